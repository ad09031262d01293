"""The tracker fault contract (wit/plugin.wit, `interface tracker`), one
test per branch, with the `tally` fixture (tests/plugins/tally): a
summary-statistics tracker that keeps its numbers in its folder, reads them
back on a restart, and panics where its options say. The oracle of its
numbers is the built-in jsonl tracker's metrics.jsonl from the same run.
Also: tracker options are checked against the manifest's declarations, and
a fresh run starts with empty tracker folders while a resumed one keeps
them."""
import json
import math

import pytest

from conftest import LOGGED_STEPS, make_plugin, run_hearth, tiny_job, write_config

# The options tally declares: what the contract's branches need. A long
# deadline: the tests count faults, and on a loaded machine the tracker
# thread (nice 19) could miss the default 5 s.
DECLARED = """
[limits]
call-timeout-ms = 30000
[options.panic-steps]
type = "text"
default = ""
description = "Comma-separated steps at which to panic."
[options.panics]
type = "int"
default = 1
description = "How many deliveries of each such step panic."
[options.count-then-panic]
type = "boolean"
default = true
description = "Count the step (and save) before panicking."
"""


@pytest.fixture(scope="module")
def plugins(fixture_wasm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tally-plugins")
    make_plugin(folder, "tally", fixture_wasm("tally"), limits=DECLARED)
    return folder


def train(hearth_bin, plugins, folder, name="contract", run=None, extra=(), **options):
    """A tiny run with tally (given `options`) and jsonl; its run folder,
    stderr and summary.json."""
    trackers = [{"name": "tally", **options}, {"name": "jsonl"}]
    config = write_config(folder, tiny_job(run={"name": name, **(run or {})}, trackers=trackers))
    out = run_hearth(hearth_bin, "run", "--plugin-dir", plugins, *extra, config, cwd=folder)
    assert out.returncode == 0, out.stderr
    run = folder / "runs" / name
    return run, out.stderr, json.loads((run / "summary.json").read_text())


def logged(run):
    """What jsonl received: one dict per call, step included."""
    return [json.loads(l) for l in (run / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines()]


def expected_stats(rows, skip_step=None):
    """count, min, max, sum of every numeric value jsonl received (less one step's)."""
    stats = {}
    for row in rows:
        if row["step"] == skip_step:
            continue
        for name, v in row.items():
            if name == "step" or isinstance(v, (str, bool)):
                continue
            c, lo, hi, s = stats.get(name, (0, math.inf, -math.inf, 0.0))
            stats[name] = (c + 1, min(lo, v), max(hi, v), s + v)
    return stats


def tally(run):
    stats = {}
    for line in (run / "trackers" / "tally" / "tally.txt").read_text().splitlines():
        kind, *f = line.split(" ")
        if kind == "stat":
            stats[f[0]] = (int(f[1]), float(f[2]), float(f[3]), float(f[4]))
    return stats


def restarts(run):
    path = run / "trackers" / "tally" / "restarts.txt"
    return path.read_text().splitlines() if path.exists() else []


def health(summary):
    (entry,) = [t for t in summary["trackers"] if t["name"] == "tally"]
    return entry


def values_at(rows, step):
    """Name-value pairs jsonl received at `step` (the step key is not one)."""
    return sum(len(r) - 1 for r in rows if r["step"] == step)


def assert_same_stats(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][:3] == pytest.approx(want[name][:3], rel=1e-12), name
        assert got[name][3] == pytest.approx(want[name][3], rel=1e-9), name


def test_a_tracker_that_panics_once_ends_with_the_complete_numbers(hearth_bin, plugins, tmp_path):
    # It panics after counting step 20: the fresh instance reads its state
    # back, gets step 20 again (restart.step says so) and does not count it twice.
    run, err, summary = train(hearth_bin, plugins, tmp_path, **{"panic-steps": "20"})
    assert_same_stats(tally(run), expected_stats(logged(run)))
    assert restarts(run) == ["1 log 20 true 0"]
    h = health(summary)
    assert [(f["call"], f["step"], f["kind"]) for f in h["faults"]] == [("log", 20, "trap")]
    assert (h["restarts"], h["values_dropped"], h["disabled_at_step"]) == (1, 0, None)
    assert (run / "trackers" / "tally" / "finished").exists()
    assert "tracker plugin `tally` failed in log at step 20: trapped" in err


def test_a_call_that_faults_twice_loses_its_values_and_both_sides_count_them(hearth_bin, plugins, tmp_path):
    # It panics before counting, on both deliveries of step 20: the values
    # of step 20 are lost, and only those.
    run, _, summary = train(
        hearth_bin, plugins, tmp_path, **{"panic-steps": "20", "panics": 2, "count-then-panic": False}
    )
    rows = logged(run)
    lost = values_at(rows, 20)
    assert lost > 0
    assert_same_stats(tally(run), expected_stats(rows, skip_step=20))
    # The second restart says the call is not coming again, and counts the loss.
    assert restarts(run) == ["1 log 20 true 0", f"2 log 20 false {lost}"]
    h = health(summary)
    assert [(f["call"], f["step"]) for f in h["faults"]] == [("log", 20), ("log", 20)]
    assert (h["restarts"], h["values_dropped"], h["disabled_at_step"]) == (2, lost, None)


def test_three_faults_disable_the_tracker_and_the_summary_and_report_say_so(hearth_bin, plugins, tmp_path):
    run, err, summary = train(hearth_bin, plugins, tmp_path, **{"panic-steps": "10,20,30"})
    rows = logged(run)
    h = health(summary)
    assert [f["step"] for f in h["faults"]] == [10, 20, 30]
    assert h["disabled_at_step"] == 30
    # Nothing from step 30 on reached it: step 30's values, 40's, the eval's.
    assert h["values_dropped"] == sum(values_at(rows, s) for s in LOGGED_STEPS if s >= 30)
    assert not (run / "trackers" / "tally" / "finished").exists()  # no finish once disabled
    assert "tracker plugin `tally` disabled after 3 faults" in err
    report = run_hearth(hearth_bin, "report", run, "--out", tmp_path / "report", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "tally" in page and "disabled at step 30" in page


def test_a_misspelt_or_mistyped_tracker_option_is_refused_naming_plugin_and_key(hearth_bin, plugins, tmp_path):
    for options, says in [
        ({"panic-step": "20"}, "option `panic-step` is not one of its options (count-then-panic, panic-steps, panics)"),
        ({"panics": "two"}, "option `panics` must be an int, not string"),
    ]:
        trackers = [{"name": "tally", **options}]
        config = write_config(tmp_path, tiny_job(run={"name": "bad"}, trackers=trackers))
        out = run_hearth(hearth_bin, "run", "--plugin-dir", plugins, config, cwd=tmp_path)
        assert out.returncode != 0
        assert "plugin `tally`" in out.stderr and says in out.stderr, out.stderr
        assert str(config) in out.stderr  # and the config file it came from
    assert not (tmp_path / "runs" / "bad" / "trackers").exists()
    # `plugins inspect` lists what it takes.
    out = run_hearth(hearth_bin, "plugins", "inspect", "tally", "--plugin-dir", plugins, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "panics (int, default 1): How many deliveries of each such step panic." in out.stdout


def test_a_fresh_run_starts_with_empty_tracker_folders_and_a_resumed_one_keeps_them(hearth_bin, plugins, tmp_path):
    run, _, _ = train(hearth_bin, plugins, tmp_path)
    first = tally(run)
    # The same run again, fresh: nothing of the first is counted twice.
    run, _, _ = train(hearth_bin, plugins, tmp_path, run={"save-every": 40})
    second = tally(run)
    assert {k: v[0] for k, v in second.items()} == {k: v[0] for k, v in first.items()}
    assert second["loss"] == first["loss"]  # the same seeded run
    assert [r["step"] for r in logged(run)] == LOGGED_STEPS + [40]
    # Resumed from its step-40 checkpoint with 20 more steps: tally goes on
    # from what it kept (its state holds the steps up to 40).
    config = write_config(
        tmp_path,
        tiny_job(run={"name": "contract", "save-every": 40, "steps": 60}, trackers=[{"name": "tally"}]),
    )
    out = run_hearth(hearth_bin, "run", "--plugin-dir", plugins, "--resume", config, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    resumed = tally(run)
    assert resumed["loss"][0] == first["loss"][0] + 2  # steps 50 and 60
