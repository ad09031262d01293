"""The command line: help, and bad input that must be refused with a message
naming the file and the key, exit status 2, and nothing written."""
from conftest import tiny_job, write_config

# The tiny job, cut to 2 steps of a smaller model.
SMALL = {"run": {"name": "t", "steps": 2}, "model": {"d-model": 16}, "data": {"digits": 3, "batch-size": 4},
         "optimizer": {"lr": 0.01}}


def job(**changes) -> str:
    """SMALL with `changes` applied table by table (a key set to None is removed)."""
    return tiny_job(**{t: SMALL.get(t, {}) | changes.get(t, {}) for t in SMALL.keys() | changes.keys()})


def test_help_lists_commands_and_run_flags(hearth):
    top = hearth("--help")
    assert top.returncode == 0
    assert "run" in top.stdout and "Exit status" in top.stdout
    run = hearth("run", "--help")
    assert run.returncode == 0
    for flag in ("--output-dir", "--steps", "--cpu", "--quiet"):
        assert flag in run.stdout


def test_misspelled_key_names_the_key_and_the_file(hearth, tmp_path):
    config = write_config(tmp_path, job(optimizer={"lr": None, "lerning-rate": 0.01}))
    out = hearth("run", config)
    assert out.returncode == 2, out.stderr
    assert "lerning-rate" in out.stderr and str(config) in out.stderr
    assert not (tmp_path / "runs").exists(), "a refused config must not start a run"


def test_wrong_type_names_the_key(hearth, tmp_path):
    config = write_config(tmp_path, job(run={"steps": "two"}))
    out = hearth("run", config)
    assert out.returncode == 2 and "steps" in out.stderr and str(config) in out.stderr


def test_key_of_another_kind_is_refused(hearth, tmp_path):
    config = write_config(tmp_path, job(data={"vocab-size": 9}))
    out = hearth("run", config)
    assert out.returncode == 2 and "data.vocab-size" in out.stderr and "random-tokens" in out.stderr


def test_missing_config_file_is_named(hearth, tmp_path):
    out = hearth("run", tmp_path / "nope.toml")
    assert out.returncode == 2 and "nope.toml" in out.stderr


def test_missing_text_file_is_named(hearth, tmp_path):
    text = job(data={"kind": "text-file", "digits": None, "path": "corpus.txt", "seq-len": 8})
    out = hearth("run", write_config(tmp_path, text))
    assert out.returncode == 2, out.stderr
    assert str(tmp_path / "corpus.txt") in out.stderr
