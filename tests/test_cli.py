"""The command line: help, and bad input that must be refused with a message
naming the file and the key, exit status 2, and nothing written."""
from conftest import write_config

GOOD = """
[run]
name = "t"
steps = 2
[model]
kind = "gpt"
d-model = 16
layers = 1
heads = 2
[data]
kind = "sort-digits"
digits = 3
batch-size = 4
[optimizer]
lr = 0.01
"""


def test_help_lists_commands_and_run_flags(hearth):
    top = hearth("--help")
    assert top.returncode == 0
    assert "run" in top.stdout and "Exit status" in top.stdout
    run = hearth("run", "--help")
    assert run.returncode == 0
    for flag in ("--output-dir", "--steps", "--cpu", "--quiet"):
        assert flag in run.stdout


def test_misspelled_key_names_the_key_and_the_file(hearth, tmp_path):
    config = write_config(tmp_path, GOOD.replace("lr = 0.01", "lerning-rate = 0.01"))
    out = hearth("run", config)
    assert out.returncode == 2, out.stderr
    assert "lerning-rate" in out.stderr and str(config) in out.stderr
    assert not (tmp_path / "runs").exists(), "a refused config must not start a run"


def test_wrong_type_names_the_key(hearth, tmp_path):
    config = write_config(tmp_path, GOOD.replace("steps = 2", 'steps = "two"'))
    out = hearth("run", config)
    assert out.returncode == 2 and "steps" in out.stderr and str(config) in out.stderr


def test_key_of_another_kind_is_refused(hearth, tmp_path):
    config = write_config(tmp_path, GOOD.replace("digits = 3", "digits = 3\nvocab-size = 9"))
    out = hearth("run", config)
    assert out.returncode == 2 and "data.vocab-size" in out.stderr and "random-tokens" in out.stderr


def test_missing_config_file_is_named(hearth, tmp_path):
    out = hearth("run", tmp_path / "nope.toml")
    assert out.returncode == 2 and "nope.toml" in out.stderr


def test_missing_text_file_is_named(hearth, tmp_path):
    text = GOOD.replace('kind = "sort-digits"\ndigits = 3', 'kind = "text-file"\npath = "corpus.txt"\nseq-len = 8')
    out = hearth("run", write_config(tmp_path, text))
    assert out.returncode == 2, out.stderr
    assert str(tmp_path / "corpus.txt") in out.stderr
