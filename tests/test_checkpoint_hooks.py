"""The built-in checkpoint hooks through `hearth run`, checked by readers
no one here wrote: Python's hashlib recomputes every hash of
`manifest-sha256`; PyTorch's own float16 rounding and Python safetensors
check `reduced-precision`; a run resumed from hooked checkpoints goes on."""
import hashlib
import json

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import tiny_job, write_config

JOB = tiny_job(
    run={"name": "h", "steps": 20, "seed": 11, "save-every": 10},
    data={"batch-size": 8},
    optimizer={"lr": 3e-3},
    eval={"samples": 10},
    **{"checkpoint-hooks": [
        {"name": "reduced-precision", "dtype": "f16", "tensors": ["blocks.*.weight", "head.weight"]},
        {"name": "manifest-sha256"},
    ]},
)


def test_hooked_checkpoints_hold_what_the_hooks_promise(hearth, tmp_path):
    config = write_config(tmp_path, JOB)
    out = hearth("run", config, "--output-dir", tmp_path / "out", "-q")
    assert out.returncode == 0, out.stderr
    run = tmp_path / "out" / "h"
    last = run / "checkpoints" / "checkpoint_1"

    # manifest-sha256: hashlib agrees with every hash, every file is listed,
    # and the run's config is recorded.
    manifest = json.loads((last / "sha256_manifest.json").read_text())
    files = {p.name for p in last.iterdir()} - {"sha256_manifest.json", "hearth_checkpoint.json"}
    assert set(manifest["sha256"]) == files
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((last / name).read_bytes()).hexdigest() == digest, name
    assert manifest["config"]["optimizer.lr"] == 3e-3
    assert manifest["config"]["run.seed"] == 11
    assert manifest["checkpoint"] == "checkpoint_1" and manifest["iteration"] == 1

    # reduced-precision: the chosen tensors are float16 in its file, out of
    # model.safetensors, and equal to PyTorch's rounding of the float32
    # weights (the final weights, saved by the run after its last checkpoint).
    final = load_file(run / "model.safetensors")
    with safe_open(last / "reduced_precision.safetensors", "pt") as f:
        reduced = {k: f.get_tensor(k) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    expected = sorted(k for k in final if (k.startswith("blocks.") and k.endswith(".weight")) or k == "head.weight")
    assert sorted(reduced) == expected and expected
    for name, tensor in reduced.items():
        assert tensor.dtype == torch.float16
        assert torch.equal(tensor, final[name].to(torch.float16)), name
    kept = load_file(last / "model.safetensors")
    assert set(kept) == set(final) - set(expected)
    for name, tensor in kept.items():
        assert torch.equal(tensor, final[name]), name

    out = hearth("checkpoint", "inspect", last)
    assert out.returncode == 0, out.stderr
    assert f"checkpoint hook reduced-precision saved {len(expected)} tensor(s) itself" in out.stdout
    assert hearth("checkpoint", "verify", last).returncode == 0

    # A resumed run loads through both hooks and goes on.
    out = hearth("run", config, "--output-dir", tmp_path / "out", "--resume", "--steps", "30", "-q")
    assert out.returncode == 0, out.stderr
    assert (run / "checkpoints" / "checkpoint_2" / "sha256_manifest.json").exists()


def test_a_tampered_checkpoint_stops_the_resume_naming_the_hook_and_file(hearth, tmp_path):
    config = write_config(tmp_path, JOB)
    out = hearth("run", config, "--output-dir", tmp_path / "out", "-q")
    assert out.returncode == 0, out.stderr
    victim = tmp_path / "out" / "h" / "checkpoints" / "checkpoint_1" / "trainer_state.json"
    text = victim.read_text()
    tampered = text.replace('"epoch": 0', '"epoch": 9')
    assert tampered != text and len(tampered) == len(text)
    victim.write_text(tampered)
    # A tamperer, not a failing disk: hearth's own manifest is rewritten to
    # match, so only the hook's sha256 can tell.
    manifest_path = victim.parent / "hearth_checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    for f in manifest["files"]:
        if f["name"] == "trainer_state.json":
            f["xxh3"] = xxhash.xxh3_64_hexdigest(tampered.encode())
    manifest_path.write_text(json.dumps(manifest))
    out = hearth("run", config, "--output-dir", tmp_path / "out", "--resume", "--steps", "30", "-q")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "manifest-sha256" in out.stderr and "trainer_state.json has sha256" in out.stderr
