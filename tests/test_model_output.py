"""Models that compute their own loss (`[model] output = "loss"`): a
transformers GPT-2 traced as `model(input_ids, labels=labels)`, whose
tuple's first element is the loss, trains under hearth and reports the
loss transformers computes on the same windows."""
import json

import numpy as np
import pytest
import torch

import hf_gpt2
from conftest import mpirun, write_config

from text_data import TEXT


def job(extra_model: str, fsdp: str = "") -> str:
    return f"""
[run]
name = "own-loss"
steps = 1
log-every = 1

[model]
kind = "torchscript"
path = "gpt2.pt"
{extra_model}

[data]
kind = "tokens"
path = "ids.npy"
vocab-size = 256
seq-len = 64
batch-size = 4
sampling = "sequential"

[optimizer]
kind = "adamw"
lr = 1e-3
{fsdp}
[distributed]
timeout = 60
"""


@pytest.fixture
def folder(tmp_path):
    np.save(tmp_path / "ids.npy", np.frombuffer(TEXT, dtype=np.uint8).astype(np.int64))
    return tmp_path


def first_windows(n: int) -> torch.Tensor:
    """Sequential windows 0..n-1 (window k starts at id 64k), inputs only."""
    ids = np.frombuffer(TEXT, dtype=np.uint8).astype(np.int64)
    return torch.as_tensor(np.stack([ids[64 * k:64 * k + 64] for k in range(n)]))


@pytest.mark.parametrize("processes", [1, 2])
def test_a_model_returning_its_loss_trains_on_the_loss_transformers_computes(hearth_bin, folder, processes):
    """Step 1's logged loss is transformers' `model(x, labels=x)[0]` on the
    windows the processes took (rank r windows 4r..4r+3; the mean over 2
    ranks of equal counts is the mean of their losses): the labels hearth
    passes are the inputs, as transformers wants them. The held-out score
    weights each batch by the labels it scores."""
    m = hf_gpt2.model(0)
    hf_gpt2.export_with_labels(m, folder / "gpt2.pt")
    fsdp = '[fsdp]\nsharding-strategy = "FULL_SHARD"\n' if processes == 2 else ""
    config = write_config(folder, job('output = "loss"', fsdp))
    run = mpirun(hearth_bin, processes, "run", config, "--output-dir", folder / "out", cwd=folder, timeout=300)
    assert run.returncode == 0, run.stderr
    logged = [json.loads(line) for line in (folder / "out" / "own-loss" / "metrics.jsonl").read_text().splitlines()]
    hearths = next(e["loss"] for e in logged if e.get("step") == 1 and "loss" in e)
    x = first_windows(4 * processes)
    # The export was traced in evaluation mode: its graph holds no dropout.
    with torch.no_grad():
        theirs = sum(m(x[4 * r:4 * r + 4], labels=x[4 * r:4 * r + 4])[0].item() for r in range(processes)) / processes
    assert abs(hearths - theirs) <= 1e-5 * theirs, (hearths, theirs)
    summary = json.loads((folder / "out" / "own-loss" / "summary.json").read_text())
    # 900 held-out ids: 13 windows of 65, each scoring 63 labels.
    assert summary["eval"]["tokens"] == 13 * 63, summary["eval"]


def test_a_tuple_of_logits_trains_without_a_wrapper_and_a_wrong_output_is_named(hearth, folder):
    """GPT2LMHeadModel traced returning its tuple (return_dict=False: the
    logits first) trains with output = "logits"; told it returns its loss,
    the probe says what it needs instead."""
    m = hf_gpt2.model(0)
    torch.jit.trace(hf_gpt2.Tuple(m), torch.zeros(2, 64, dtype=torch.long)).save(str(folder / "gpt2.pt"))
    run = hearth("run", write_config(folder, job("")), "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    refused = hearth("run", write_config(folder, job('output = "loss"'), "loss.toml"), "--output-dir", folder / "bad")
    assert refused.returncode == 2, refused.stderr
    assert "gpt2.pt" in refused.stderr and "forward must take (input_ids, labels)" in refused.stderr, refused.stderr
    digits = job('output = "loss"').replace('kind = "tokens"\npath = "ids.npy"\nvocab-size = 256\nseq-len = 64', 'kind = "sort-digits"').replace('sampling = "sequential"\n', "")
    refused = hearth("run", write_config(folder, digits, "digits.toml"))
    assert refused.returncode == 2 and "model.output" in refused.stderr and "needs logits" in refused.stderr, refused.stderr
