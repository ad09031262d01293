"""Third-party trackers in other languages, against the same WIT: the
Python one (componentize-py) and the JavaScript one (componentize-js) in
examples/trackers, built by `make test` into target/example-plugins. Each
must receive every logged step, with the values the built-in jsonl tracker
received."""
import json

import pytest

from conftest import LOGGED_STEPS, ROOT, SHORT_JOB, tracker_tables, write_config

EXAMPLES = ROOT / "target" / "example-plugins"
NAMES = ["python-tracker", "js-tracker"]


@pytest.fixture(scope="module")
def run_dir(hearth_bin, tmp_path_factory):
    for name in NAMES:
        if not (EXAMPLES / name / f"{name}.wasm").exists():
            pytest.fail(f"{EXAMPLES / name} is missing: run `make test` (it builds the example trackers)")
    from conftest import run_hearth

    folder = tmp_path_factory.mktemp("examples")
    config = write_config(folder, SHORT_JOB + tracker_tables(*NAMES, "jsonl"))
    out = run_hearth(hearth_bin, "run", "--plugin-dir", EXAMPLES, config, cwd=folder)
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stderr, out.stderr
    for name in NAMES:
        assert f"[plugin {name}]" in out.stderr  # its `log` import reached the host log
    return folder / "runs" / "short"


def lines(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


@pytest.mark.parametrize("name", NAMES)
def test_tracker_in_another_language_receives_every_step(run_dir, name):
    expected = lines(run_dir / "trackers" / "jsonl" / "metrics.jsonl")
    got = lines(run_dir / "trackers" / name / "steps.jsonl")
    assert [g["step"] for g in got] == LOGGED_STEPS + [40]  # + the eval values
    assert got == expected
