"""The big-model commands from the outside: `hearth model plan --max-memory`
against Accelerate's `infer_auto_device_map` (and `get_balanced_memory`)
on the PyTorch twin of the config's model, `hearth model estimate` against
`accelerate estimate-memory`'s own computation, and the bad inputs."""
import argparse
import json
import sys

import pytest
import torch
from accelerate.commands import estimate as accelerate_estimate
from accelerate.utils import compute_module_sizes, get_balanced_memory, infer_auto_device_map

from conftest import ROOT, write_config

sys.path.insert(0, str(ROOT / "tests" / "oracles"))
import peer_gpt  # noqa: E402

SIZES = dict(vocab_size=256, block_size=128, d_model=128, layers=4, heads=4)
JOB = """
[run]
name = "big"
steps = 1

[model]
kind = "gpt"
d-model = 128
layers = 4
heads = 4

[data]
kind = "random-tokens"
vocab-size = 256
seq-len = 128
"""


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path, JOB)


def accelerate_plan(max_memory, no_split=(), dtype=None, balanced=False, low_zero=False):
    model = peer_gpt.build(**SIZES)
    if balanced:
        max_memory = get_balanced_memory(model, dict(max_memory), list(no_split), dtype=dtype, low_zero=low_zero)
    device_map = infer_auto_device_map(model, dict(max_memory), list(no_split), dtype=dtype)
    return {"sizes": list(compute_module_sizes(model, dtype=dtype).items()), "device_map": dict(device_map)}


def flag(max_memory):
    return ",".join(f"{k}={v}" for k, v in max_memory.items())


@pytest.mark.parametrize(
    "max_memory, extra, kwargs",
    [
        ({0: 10**8}, [], {}),
        ({0: 1_000_000, 1: 1_000_000, "cpu": 2_000_000}, [], {}),
        ({0: 1_000_000, 1: 1_000_000, "cpu": 2_000_000}, ["--no-split", "Block"], {"no_split": ["Block"]}),
        ({0: 600_000, "cpu": 1_200_000}, ["--dtype", "bf16"], {"dtype": torch.bfloat16}),
        ({"cpu": 1_500_000}, ["--no-split", "Block"], {"no_split": ["Block"]}),
        ({0: 2_000_000, 1: 2_000_000, 2: 2_000_000, "cpu": 10**7}, ["--balanced"], {"balanced": True}),
        ({0: 2_000_000, 1: 2_000_000, 2: 2_000_000, "cpu": 10**7}, ["--balanced", "--low-zero", "--no-split", "Block"],
         {"balanced": True, "low_zero": True, "no_split": ["Block"]}),
    ],
)
def test_plan_with_max_memory_is_accelerates_device_map(hearth, config, max_memory, extra, kwargs):
    out = hearth("model", "plan", config, "--max-memory", flag(max_memory), *extra, "--json")
    assert out.returncode == 0, out.stderr
    ours = json.loads(out.stdout)
    theirs = accelerate_plan(max_memory, **kwargs)
    # The sizes come in Accelerate's key order.
    assert list(ours["sizes"].items()) == [tuple(kv) for kv in theirs["sizes"]]
    assert ours["device_map"] == {k: v for k, v in theirs["device_map"].items()}
    # Devices are integers or "cpu"/"disk", as Accelerate writes them.
    assert all(isinstance(d, int) or d in ("cpu", "disk") for d in ours["device_map"].values())


def test_plan_prints_the_map_and_what_each_device_holds(hearth, config):
    out = hearth("model", "plan", config, "--max-memory", "0=1MB,cpu=2MB", "--no-split", "Block")
    assert out.returncode == 0, out.stderr
    for word in ["module", "class", "device", "blocks.0", "Block", "disk", "may hold"]:
        assert word in out.stdout, out.stdout
    # Accelerate's warning about GPUs this machine lacks reaches the log.
    assert "Device 0 is not available" in out.stderr


def test_plan_verbose_prints_accelerates_steps(hearth, config, capsys):
    out = hearth("model", "plan", config, "--max-memory", "0=1MB,cpu=2MB", "--verbose")
    assert out.returncode == 0, out.stderr
    model = peer_gpt.build(**SIZES)
    infer_auto_device_map(model, {0: 1_000_000, "cpu": 2_000_000}, verbose=True)
    steps = capsys.readouterr().out
    assert steps and out.stdout.startswith(steps), out.stdout[:500]


def test_estimate_is_accelerates(hearth, config, monkeypatch):
    out = hearth("model", "estimate", config, "--json")
    assert out.returncode == 0, out.stderr
    ours = json.loads(out.stdout)
    # accelerate estimate-memory's own computation, on the PyTorch twin.
    monkeypatch.setattr(accelerate_estimate, "create_empty_model", lambda *a, **k: peer_gpt.build(**SIZES))
    args = argparse.Namespace(
        model_name="peer-gpt", library_name="transformers", trust_remote_code=False,
        dtypes=["float32", "float16", "int8", "int4"],
    )
    theirs = accelerate_estimate.gather_data(args)
    assert [r["dtype"] for r in ours] == [r[0] for r in theirs]
    for row, (dtype, largest, total, training) in zip(ours, theirs):
        assert row["largest_layer"] == largest and row["total_size"] == total, dtype
        peak = max(training.values())
        assert row["training"] == (None if peak == -1 else peak), dtype
    table = hearth("model", "estimate", config)
    assert "training using Adam" in table.stdout and "N/A" in table.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-memory", "0=12GX"], '"12GX" is not a size'),
        (["--max-memory", "tpu=1GB,cpu=1GB"], "unknown device `tpu`"),
        (["--max-memory", "cpu"], '"cpu" is not DEVICE=SIZE'),
        (["--max-memory", "cpu=1GB", "--dtype", "fp12"], 'unknown dtype "fp12"'),
        (["--no-split", "Block"], "--max-memory"),
        (["--max-memory", "cpu=100KB", "--no-split", "Block"], "largest layer `blocks.0` (Block, 793088 bytes)"),
    ],
)
def test_bad_plan_inputs_are_named(hearth, config, tmp_path, args, message):
    before = sorted(p.name for p in tmp_path.iterdir())
    out = hearth("model", "plan", config, *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
