"""The tracker's logic, apart from the WIT glue in app.py so that plain
Python can test it."""
import json
import math


def line(step, values):
    """One JSON object: the step and every number logged with it."""
    row = {"step": step}
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        row[name] = value
    return json.dumps(row, separators=(",", ":"))
