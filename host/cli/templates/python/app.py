"""{{name}}: a hearth tracker in Python. It appends the numbers of every
`every`-th logged step to /logs/values.jsonl, one JSON object per line.

Build and install it with `hearth plugins build` and `hearth plugins
install .` (componentize-py must be on PATH); test the logic with
`python -m pytest`."""
from componentize_py_types import Err
from wit_world import exports

from lines import line


class Tracker(exports.Tracker):
    """Return normally for `ok`; raise `Err(message)` for `err`. Any other
    exception traps the instance (hearth then starts a fresh one and sends
    the call again). componentize-py makes a new instance of this class for
    every call: state lives on the class, not on `self`."""

    out = None
    every = 1
    calls = 0

    def start(self, run, config, options, restart):
        for name, value in options:
            if name == "every" and value.value > 0:
                Tracker.every = value.value
        try:
            # Append: after a fault a fresh instance goes on where the
            # failed one stopped; a new run starts with /logs empty.
            Tracker.out = open("/logs/values.jsonl", "a")
        except OSError as e:
            raise Err(f"values.jsonl: {e}")

    def log(self, step, values):
        Tracker.calls += 1
        if (Tracker.calls - 1) % Tracker.every != 0:
            return
        if Tracker.out is None:
            raise Err("log before start")
        try:
            Tracker.out.write(line(step, [(k, v.value) for k, v in values]) + "\n")
            Tracker.out.flush()
        except OSError as e:
            raise Err(f"values.jsonl: {e}")

    def finish(self):
        if Tracker.out is not None:
            Tracker.out.close()
            Tracker.out = None
