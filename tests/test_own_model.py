"""A Rust user's own model (examples/own_model.rs: `impl Model` with its
units) under FULL_SHARD on 2 processes trains to the weights DDP trains,
bit for bit, and really shards (reduce-scatters and gathers, no
all-reduce)."""
import re

from conftest import ROOT, mpirun

EXAMPLE = ROOT / "target" / "debug" / "examples" / "own_model"
FSDP = {
    "HEARTH_USE_FSDP": "1",
    "HEARTH_FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "HEARTH_FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "HEARTH_FSDP_TRANSFORMER_CLS_TO_WRAP": "Layer",
}


def test_your_own_model_under_full_shard_trains_ddps_weights(tmp_path, monkeypatch):
    assert EXAMPLE.exists(), "cargo test (make test) builds the examples"
    ddp = mpirun(EXAMPLE, 2, tmp_path / "ddp", cwd=tmp_path, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    for key, value in FSDP.items():
        monkeypatch.setenv(key, value)
    sharded = mpirun(EXAMPLE, 2, tmp_path / "fs", cwd=tmp_path, timeout=300)
    assert sharded.returncode == 0, sharded.stderr
    said = re.search(r"FullShard: (\d+) reduce-scatters, (\d+) all-reduces, (\d+) gathers", sharded.stdout)
    assert said and int(said[1]) > 0 and int(said[2]) == 0 and int(said[3]) > 0, sharded.stdout
    assert "DDP: 0 reduce-scatters" in ddp.stdout, ddp.stdout
    assert (tmp_path / "fs" / "model.safetensors").read_bytes() == (tmp_path / "ddp" / "model.safetensors").read_bytes()
