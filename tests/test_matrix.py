"""The bring-your-own matrix: hearth's GPT and a transformers GPT-2 traced
to TorchScript, under every strategy on 2 processes (and one), on every
kind of data — each cell trained under a time limit, ending with its
evaluation and its model written. Ten cells, each model, strategy and data
kind in at least two."""
import json
import math

import numpy as np
import pytest

import hf_gpt2
import text_data
from conftest import mpirun, write_config

from text_data import TEXT
DOCS = text_data.documents(300)

MODELS = {
    "gpt": 'kind = "gpt"\nd-model = 32\nlayers = 2\nheads = 4',
    "gpt2": 'kind = "torchscript"\npath = "gpt2.pt"',
}
STRATEGIES = {
    "one-process": (1, ""),
    "ddp": (2, ""),
    "shard-grad-op": (2, 'sharding-strategy = "SHARD_GRAD_OP"'),
    "full-shard": (2, 'sharding-strategy = "FULL_SHARD"'),
    "full-shard-checkpointed": (2, 'sharding-strategy = "FULL_SHARD"\nactivation-checkpointing = true'),
}
DATA = {
    "sort-digits": 'kind = "sort-digits"\ndigits = 4',
    "text-file": 'kind = "text-file"\npath = "corpus.txt"\nseq-len = 64',
    "tokens": 'kind = "tokens"\npath = "ids.bin"\nvocab-size = 256\nseq-len = 64\nsampling = "sequential"',
    "jsonl": 'kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tok/tokenizer.json"\nseq-len = 64',
}
CELLS = [
    ("gpt", "one-process", "sort-digits"),
    ("gpt", "ddp", "text-file"),
    ("gpt", "shard-grad-op", "tokens"),
    ("gpt", "full-shard", "jsonl"),
    ("gpt", "full-shard-checkpointed", "text-file"),
    ("gpt2", "one-process", "jsonl"),
    ("gpt2", "ddp", "tokens"),
    ("gpt2", "shard-grad-op", "sort-digits"),
    ("gpt2", "full-shard", "text-file"),
    ("gpt2", "full-shard-checkpointed", "sort-digits"),
]


def wrap(model: str) -> str:
    cls = "Block" if model == "gpt" else "GPT2Block"
    return f'auto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["{cls}"]'


@pytest.mark.parametrize("model, strategy, data", CELLS)
def test_cell_trains_evaluates_and_writes_its_model(hearth_bin, tmp_path, model, strategy, data):
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    np.frombuffer(TEXT, dtype=np.uint8).astype(np.uint16).tofile(tmp_path / "ids.bin")
    text_data.write_jsonl(tmp_path / "docs.jsonl", DOCS)
    text_data.train_tokenizer(tmp_path / "tok", DOCS, vocab_size=400)
    if model == "gpt2":
        hf_gpt2.export(hf_gpt2.model(0, vocab_size=512), tmp_path / "gpt2.pt")
    processes, fsdp = STRATEGIES[strategy]
    table = f"\n[fsdp]\n{fsdp}\n{wrap(model)}\n" if fsdp else ""
    config = write_config(tmp_path, f"""
[run]
name = "cell"
steps = 3
log-every = 1

[model]
{MODELS[model]}

[data]
{DATA[data]}
batch-size = 4

[optimizer]
kind = "adamw"
lr = 1e-3

[eval]
samples = 40
{table}
[distributed]
timeout = 60
""")
    run = mpirun(hearth_bin, processes, "run", config, "--output-dir", tmp_path / "out", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "out" / "cell" / "summary.json").read_text())
    assert summary["num_processes"] == processes and summary["steps"] == 3
    want = "exact-match" if data == "sort-digits" else "validation-loss"
    assert summary["eval"]["kind"] == want, summary["eval"]
    score = summary["eval"].get("loss", summary["eval"].get("accuracy"))
    assert math.isfinite(summary["final_loss"]) and math.isfinite(score), summary
    assert (tmp_path / "out" / "cell" / "model.safetensors").stat().st_size > 0
    if fsdp:
        assert summary["fsdp"]["sharding_strategy"] in fsdp, summary["fsdp"]


def test_every_model_strategy_and_data_kind_is_in_two_cells_or_more():
    for axis, names in enumerate((MODELS, STRATEGIES, DATA)):
        for name in names:
            assert sum(cell[axis] == name for cell in CELLS) >= 2, name
