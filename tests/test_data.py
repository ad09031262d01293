"""The data users have: pre-tokenized ids (`kind = "tokens"`, nanoGPT's
`.bin` and NumPy's `.npy`), scored against transformers on the same
held-out windows cut by NumPy, sequential windows resumed on another
number of processes, and bad files refused before anything is written."""
import json
import shutil

import numpy as np
import pytest

import hf_gpt2
from conftest import mpirun, write_config

from text_data import TEXT


def job(data: str, extra: str = "") -> str:
    return f"""
[run]
name = "tokens"
steps = 4
log-every = 2
save-every = 2

[model]
kind = "torchscript"
path = "gpt2.pt"
init-from = "pretrained"
init-key-prefix = "m."

[data]
kind = "tokens"
vocab-size = 256
seq-len = 64
batch-size = 4
{data}

[optimizer]
kind = "adamw"
lr = 1e-3
{extra}
[distributed]
timeout = 60
"""


@pytest.fixture
def folder(tmp_path):
    hf_gpt2.model(0).save_pretrained(tmp_path / "pretrained")
    hf_gpt2.export(hf_gpt2.model(1), tmp_path / "gpt2.pt")
    ids = np.frombuffer(TEXT, dtype=np.uint8)
    ids[:8000].astype(np.uint16).tofile(tmp_path / "train.bin")
    ids[8000:].astype(np.uint16).tofile(tmp_path / "val.bin")
    np.save(tmp_path / "all.npy", ids.astype(np.int64))
    return tmp_path


def test_nanogpt_bins_train_and_score_what_transformers_scores_on_the_same_windows(hearth, folder):
    """train.bin and val.bin as nanoGPT's prepare.py writes them: the
    fine-tuned model, loaded by transformers, scores the held-out windows
    NumPy cuts from val.bin as hearth scored them (1e-5 relative)."""
    from transformers import AutoModelForCausalLM

    config = write_config(folder, job('path = "train.bin"\nval-path = "val.bin"'))
    run = hearth("run", config, "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    out = folder / "out" / "tokens"
    summary = json.loads((out / "summary.json").read_text())
    held = np.fromfile(folder / "val.bin", dtype=np.uint16)
    assert summary["eval"]["tokens"] == (len(held) // 65) * 64, summary["eval"]
    theirs = hf_gpt2.held_out_loss(AutoModelForCausalLM.from_pretrained(out).eval(), held, 64)
    assert abs(theirs - summary["eval"]["loss"]) <= 1e-5 * theirs, (theirs, summary["eval"])


def test_sequential_windows_of_an_npy_resume_on_more_processes_and_evaluate(hearth_bin, folder):
    """int64 .npy, the last 10 % held out, sequential shuffled windows on
    2 processes, resumed on 4 (the position in the epoch is every
    process's; the unit tests check each window is seen once)."""
    config = write_config(folder, job('path = "all.npy"\nsampling = "sequential"\nshuffle = true'))
    first = mpirun(hearth_bin, 2, "run", config, "--steps", 2, "--output-dir", folder / "out", cwd=folder, timeout=300)
    assert first.returncode == 0, first.stderr
    resumed = mpirun(hearth_bin, 4, "run", config, "--resume", "--output-dir", folder / "out", cwd=folder, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((folder / "out" / "tokens" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["num_processes"] == 4
    assert summary["eval"]["tokens"] == (900 // 65) * 64, summary["eval"]
    # A random-sampled checkpoint does not resume a sequential config.
    shutil.copytree(folder / "out", folder / "mixed")
    random = write_config(folder, job('path = "all.npy"'), "random.toml")
    refused = mpirun(hearth_bin, 2, "run", random, "--resume", "--output-dir", folder / "mixed", cwd=folder, timeout=300)
    assert refused.returncode != 0 and "sampled sequential windows" in refused.stderr, refused.stderr


@pytest.mark.parametrize("data, says", [
    ('path = "big.bin"', ["big.bin", "token 300 at position 5 (byte 10)", "vocab-size = 256"]),
    ('path = "odd.bin"', ["odd.bin", "16001 bytes of ids is not a multiple of uint16's 2 bytes", "partial token"]),
    ('path = "grid.npy"', ["grid.npy", "1-D"]),
    ('path = "train.bin"\ndtype = "uint32"', ["train.bin", "token", "outside the vocabulary"]),
    ('path = "tiny.bin"', ["tiny.bin", "holds", "seq-len 64 needs at least 65"]),
    ('path = "all.npy"\nsampling = "sequential"\nbatch-size = 200', ["windows of seq-len + 1 tokens", "takes 200"]),
    ('path = "all.npy"\nshuffle = true', ["data.shuffle", 'sampling = "sequential"']),
])
def test_bad_token_files_are_refused_naming_the_file_and_place_before_anything_is_written(hearth, folder, data, says):
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    ids[5] = 300
    ids.tofile(folder / "big.bin")
    (folder / "odd.bin").write_bytes((folder / "train.bin").read_bytes() + b"\x00")
    np.save(folder / "grid.npy", np.zeros((10, 10), dtype=np.int64))
    ids[:5].tofile(folder / "tiny.bin")
    text = job(data).replace("batch-size = 4\n", "" if "batch-size" in data else "batch-size = 4\n")
    run = hearth("run", write_config(folder, text), "--output-dir", folder / "out")
    assert run.returncode == 2, run.stderr
    for part in says:
        assert part in run.stderr, (part, run.stderr)
    assert not (folder / "out").exists()
