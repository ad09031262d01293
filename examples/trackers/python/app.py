"""A hearth tracker in Python: one JSON line per logged step in
/logs/steps.jsonl. Built into a WebAssembly component by componentize-py
against hearth's WIT (see docs/src/plugins.md)."""
import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import log as host


class Tracker(exports.Tracker):
    """The exported `tracker` interface. Return normally for `ok`; raise
    `Err(message)` for `err`. Any other exception traps the instance (hearth
    then starts a fresh one), so each method turns them into `Err`.
    componentize-py makes a new instance of this class for every call: state
    lives on the class (module level), not on `self`."""

    out = None

    def start(self, run, config, options, restart):
        try:
            Tracker.out = open("/logs/steps.jsonl", "a")
        except OSError as e:
            raise Err(f"cannot open /logs/steps.jsonl: {e}")
        host.log(host.Level.INFO, f"python tracker: {run.project}/{run.run}, {len(config)} config values")

    def log(self, step, values):
        if Tracker.out is None:
            raise Err("log before start")
        try:
            # values: (name, Value_Float | Value_Int | Value_Boolean | Value_Text); each has .value
            Tracker.out.write(json.dumps({"step": step, **{k: v.value for k, v in values}}) + "\n")
            Tracker.out.flush()
        except (OSError, ValueError) as e:
            raise Err(f"writing /logs/steps.jsonl: {e}")

    def finish(self):
        if Tracker.out is not None:
            Tracker.out.close()
            Tracker.out = None
