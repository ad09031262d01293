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


@pytest.mark.parametrize("name", NAMES)
def test_tracker_in_another_language_posts_every_step_to_a_granted_host_and_no_other(hearth_bin, tmp_path, name):
    """With `url` set and its host granted, each language's tracker POSTs
    every step over wasi:http (what the jsonl tracker received, by the
    server's account); a host not granted is refused before any
    connection, and the tracker goes on."""
    from conftest import run_hearth
    from test_network import Server

    granted, other = Server(), Server()
    try:
        def run(folder, url, grant):
            folder.mkdir()
            text = (SHORT_JOB + tracker_tables("jsonl") + f'\n[[trackers]]\nname = "{name}"\nurl = "{url}"\n'
                    f'\n[plugin-permissions.{name}]\nnetwork = ["{grant}"]\n')
            out = run_hearth(hearth_bin, "run", "--plugin-dir", EXAMPLES, write_config(folder, text), cwd=folder)
            assert out.returncode == 0, out.stderr
            assert "failed" not in out.stderr, out.stderr
            return out, folder / "runs" / "short"

        grant = f"http://127.0.0.1:{granted.port}"
        _, run_dir = run(tmp_path / "granted", f"{grant}/steps", grant)
        expected = lines(run_dir / "trackers" / "jsonl" / "metrics.jsonl")
        assert [r["path"] for r in granted.requests] == ["/steps"] * len(expected)
        assert [json.loads(r["body"]) for r in granted.requests] == expected

        out, _ = run(tmp_path / "other", f"http://127.0.0.1:{other.port}/steps", grant)
        assert other.requests == [], "a host not granted got nothing"
        refused = [l for l in out.stderr.splitlines() if f"refused http://127.0.0.1:{other.port}: not granted" in l]
        assert len(refused) == 1 and name in refused[0], out.stderr
    finally:
        granted.close()
        other.close()
