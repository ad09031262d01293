"""`hearth run` end to end, with PyTorch and Python safetensors as oracles."""
import json
import math
import pathlib
import random
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import ROOT, tiny_job, write_config

sys.path.insert(0, str(ROOT / "tests" / "oracles"))
import peer_gpt  # noqa: E402


def greedy_sort_accuracy(model, digits: int, samples: int, seed: int) -> float:
    """Exact-match accuracy of greedy decoding, computed in PyTorch."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10) for _ in range(digits)] for _ in range(samples)]
    seq = torch.tensor([p + [10] for p in prompts])
    with torch.no_grad():
        for _ in range(digits):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    answers = torch.tensor([sorted(p) for p in prompts])
    return (seq[:, digits + 1 :] == answers).all(1).float().mean().item()


def test_default_job_learns_to_sort_and_pytorch_agrees(hearth, tmp_path):
    """The README's run command, on the example config: accuracy >= 0.95,
    and the saved weights, loaded into the peer's PyTorch GPT, sort too."""
    out = hearth("run", ROOT / "examples" / "sort-digits.toml", "--output-dir", tmp_path / "runs")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("eval exact-match accuracy:"))
    accuracy = float(line.split()[3])
    assert accuracy >= 0.95, out.stdout

    run_dir = tmp_path / "runs" / "sort-digits"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"] == {"kind": "exact-match", "accuracy": summary["eval"]["accuracy"], "samples": 1000}
    assert abs(summary["eval"]["accuracy"] - accuracy) < 1e-4
    assert summary["steps"] == 1500

    weights = run_dir / "model.safetensors"
    with safe_open(weights, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    model = peer_gpt.build(vocab_size=11, block_size=16, d_model=128, layers=2, heads=4)
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    assert greedy_sort_accuracy(model, digits=8, samples=500, seed=1234) >= 0.93


def test_loss_falls_on_text_with_the_mlp(hearth, tmp_path):
    corpus = "the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "corpus.txt").write_text(corpus)
    config = write_config(
        tmp_path,
        """
[run]
name = "text"
steps = 150
log-every = 50
[model]
kind = "mlp"
d-model = 32
context = 4
[data]
kind = "text-file"
path = "corpus.txt"
seq-len = 32
batch-size = 16
[optimizer]
lr = 0.003
""",
    )
    out = hearth("run", config, "--quiet")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "runs" / "text" / "summary.json").read_text())
    assert summary["eval"]["kind"] == "validation-loss"
    # Uniform guessing over bytes costs ln(256) = 5.55 nats; the sentence is
    # nearly deterministic given 4 bytes of context.
    assert summary["eval"]["loss"] < 1.0, summary
    assert summary["final_loss"] < 1.0
    tensors = load_file(tmp_path / "runs" / "text" / "model.safetensors")
    assert set(tensors) == {"tok.weight", "fc.weight", "fc.bias", "head.weight", "head.bias"}
    assert tensors["fc.weight"].shape == (128, 4 * 32)


def test_same_seed_same_weights_and_another_seed_differs(hearth, tmp_path):
    def job(seed):
        return tiny_job(run={"name": "r", "steps": 20, "seed": seed},
                        data={"kind": "random-tokens", "digits": None, "vocab-size": 50, "seq-len": 16, "batch-size": 4},
                        optimizer={"kind": "sgd", "lr": 0.1, "momentum": 0.9})

    paths = []
    for i, seed in enumerate([1, 1, 2]):
        out_dir = tmp_path / f"out{i}"
        out = hearth("run", write_config(tmp_path, job(seed), f"c{i}.toml"), "--output-dir", out_dir, "-q")
        assert out.returncode == 0, out.stderr
        paths.append(out_dir / "r" / "model.safetensors")
    a, b, c = (load_file(p) for p in paths)
    assert all(torch.equal(a[k], b[k]) for k in a), "the same seed must give the same weights"
    assert not torch.equal(a["tok.weight"], c["tok.weight"])


def test_progress_is_logged_and_loss_is_finite(hearth, tmp_path):
    text = (ROOT / "examples" / "sort-digits.toml").read_text()
    out = hearth("run", write_config(tmp_path, text), "--steps", "40", "--quiet")
    assert out.returncode == 0, out.stderr
    log_lines = [l for l in out.stderr.splitlines() if "step 40/40 loss" in l]
    assert log_lines and "tokens/s" in log_lines[0]
    summary = json.loads((tmp_path / "runs" / "sort-digits" / "summary.json").read_text())
    assert summary["steps"] == 40 and math.isfinite(summary["final_loss"])
    assert summary["tokens_per_sec"] > 0


def test_the_peer_snapshot_is_the_shared_peer_script():
    """tests/oracles holds a snapshot of shared/bench/peer_gpt_accelerate.py
    for clones that have no shared folder beside them; it must not drift."""
    import pytest

    shared = peer_gpt.shared_peer_script()
    if shared is None:
        pytest.skip("no shared folder here: the snapshot is the oracle")
    assert peer_gpt.SNAPSHOT.read_bytes() == shared.read_bytes(), f"copy {shared} to {peer_gpt.SNAPSHOT}"
