"""`hearth run` through the Accelerator: gradient accumulation, mixed
precision, Adam with parameter groups, and a TorchScript model exported
from PyTorch, trained by hearth and loaded back into PyTorch."""
import json
import math
import tomllib

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import tiny_job, write_config

def gpt_job(steps=20, batch=16, extra="", opt="adamw", lr=3e-3, model=None):
    """The tiny job (tests/fixtures/tiny-job.toml) with these settings;
    `extra` is TOML for its [run] table, `model` replaces its [model]."""
    run = {"name": "r", "steps": steps, "seed": 4, **tomllib.loads(extra)}
    tables = {"run": run, "data": {"batch-size": batch}, "optimizer": {"kind": opt, "lr": lr}}
    if model is not None:
        tables["model"] = {"d-model": None, "layers": None, "heads": None, **model}
    return tiny_job(**tables)


def torchscript(path=None):
    """A [model] table for a TorchScript file (none: the path left out)."""
    return {"kind": "torchscript"} | ({"path": path} if path else {})


def train(hearth, tmp_path, name, text, env=None):
    out_dir = tmp_path / name
    out = hearth("run", write_config(tmp_path, text, f"{name}.toml"), "--output-dir", out_dir, "-q", env=env)
    assert out.returncode == 0, out.stderr
    return out_dir / "r", out


def test_two_accumulated_batches_of_8_give_the_weights_of_one_batch_of_16(hearth, tmp_path):
    # Two draws of 8 examples consume the data stream as one draw of 16, and
    # every example scores the same number of tokens, so the mean of the
    # two halves' losses is the loss of the whole: the steps must agree.
    # (SGD: Adam would amplify the fp32 noise of gradients that are zero in
    # exact arithmetic, like the key third of the qkv bias.)
    job = dict(opt="sgd", lr=0.3)
    big, _ = train(hearth, tmp_path, "big", gpt_job(batch=16, **job))
    acc, _ = train(hearth, tmp_path, "acc", gpt_job(batch=8, extra="gradient-accumulation-steps = 2", **job))
    small, _ = train(hearth, tmp_path, "small", gpt_job(batch=8, **job))
    a, b, c = (load_file(p / "model.safetensors") for p in (big, acc, small))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), f"{k}: max diff {(a[k] - b[k]).abs().max()}"
    assert not torch.allclose(a["tok.weight"], c["tok.weight"], atol=1e-4)


def test_the_environment_sets_accumulation_and_the_config_wins(hearth, tmp_path):
    env = {"HEARTH_GRADIENT_ACCUMULATION_STEPS": "2"}
    from_env, out = train(hearth, tmp_path, "env", gpt_job(batch=8), env=env)
    assert "2 × 8 × 8 tokens" in out.stdout + out.stderr
    from_config, _ = train(hearth, tmp_path, "cfg", gpt_job(batch=8, extra="gradient-accumulation-steps = 2"))
    a, b = (load_file(p / "model.safetensors") for p in (from_env, from_config))
    assert all(torch.equal(a[k], b[k]) for k in a)
    overridden, out = train(hearth, tmp_path, "win", gpt_job(batch=8, extra="gradient-accumulation-steps = 1"), env=env)
    assert "2 × 8" not in out.stdout + out.stderr


def test_bf16_autocast_trains_and_changes_the_arithmetic(hearth, tmp_path):
    fp32, _ = train(hearth, tmp_path, "fp32", gpt_job(steps=60))
    bf16, out = train(hearth, tmp_path, "bf16", gpt_job(steps=60, extra='mixed-precision = "bf16"'))
    assert "mixed precision bf16" in out.stdout + out.stderr
    s32 = json.loads((fp32 / "summary.json").read_text())
    s16 = json.loads((bf16 / "summary.json").read_text())
    assert s16["final_loss"] < math.log(11) * 0.8, s16
    assert abs(s16["final_loss"] - s32["final_loss"]) < 0.2
    a, b = (load_file(p / "model.safetensors") for p in (fp32, bf16))
    assert a["tok.weight"].dtype == b["tok.weight"].dtype == torch.float32
    assert not torch.equal(a["tok.weight"], b["tok.weight"]), "bf16 must change the arithmetic"


def test_fp16_on_the_cpu_trains_in_float32_like_accelerate(hearth, tmp_path):
    fp32, _ = train(hearth, tmp_path, "fp32", gpt_job())
    fp16, _ = train(hearth, tmp_path, "fp16", gpt_job(extra='mixed-precision = "fp16"'))
    a, b = (load_file(p / "model.safetensors") for p in (fp32, fp16))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_adam_with_a_no_decay_group_runs(hearth, tmp_path):
    text = tiny_job(run={"name": "r", "steps": 20, "seed": 4},
                    optimizer={"kind": "adam", "lr": 3e-3, "weight-decay": 0.1, "no-decay": ["bias", "ln"]})
    run, _ = train(hearth, tmp_path, "adam", text)
    assert json.loads((run / "summary.json").read_text())["final_loss"] < math.log(11)


def test_bad_accelerator_settings_name_the_key_or_variable(hearth, tmp_path):
    out = hearth("run", write_config(tmp_path, gpt_job(extra="gradient-accumulation-steps = 0")), "-q")
    assert out.returncode == 2 and "run.gradient-accumulation-steps" in out.stderr
    out = hearth("run", write_config(tmp_path, gpt_job(extra='mixed-precision = "fp8"')), "-q")
    assert out.returncode == 2 and "mixed-precision" in out.stderr and "FP8 tensor cores" in out.stderr
    out = hearth("run", write_config(tmp_path, gpt_job()), "-q", env={"HEARTH_MIXED_PRECISION": "fp8"})
    assert out.returncode != 0 and "HEARTH_MIXED_PRECISION" in out.stderr and "FP8 tensor cores" in out.stderr


def test_the_accumulation_plugin_keys_train_as_accelerate_on_one_process(hearth, tmp_path):
    """On one process there is nothing to communicate and no loader end
    within these steps: sync-each-batch and adjust-scheduler leave the
    weights exactly as plain accumulation trains them."""
    plain, _ = train(hearth, tmp_path, "plain", gpt_job(batch=8, extra="gradient-accumulation-steps = 2"))
    keys = "gradient-accumulation-steps = 2\nsync-each-batch = true\nadjust-scheduler = false"
    plugin, out = train(hearth, tmp_path, "plugin", gpt_job(batch=8, extra=keys))
    assert "2 × 8 × 8 tokens" in out.stdout + out.stderr
    a, b = (load_file(p / "model.safetensors") for p in (plain, plugin))
    assert all(torch.equal(a[k], b[k]) for k in a)


DIGITS = 4


class TinyLM(torch.nn.Module):
    """Token and position embeddings, then a per-position MLP."""

    def __init__(self, vocab: int = 11, seq: int = 2 * DIGITS, d: int = 32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.mlp(self.tok(tokens) + self.pos(positions))


def sort_digits_batch(n: int, generator: torch.Generator):
    """The sort-digits task as hearth defines it, made here independently."""
    digits = torch.randint(0, 10, (n, DIGITS), generator=generator)
    seq = torch.cat([digits, torch.full((n, 1), 10), digits.sort(dim=1).values], dim=1)
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[:, :DIGITS] = -100
    return inputs, targets


def loss_of(model, batch):
    inputs, targets = batch
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100).item()


def test_a_torchscript_model_trains_and_its_weights_load_back_into_pytorch(hearth, tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.jit.script(model).save(str(tmp_path / "tiny.pt"))
    text = gpt_job(steps=150, batch=32, model=torchscript("tiny.pt"))
    run, _ = train(hearth, tmp_path, "ts", text)

    trained = load_file(run / "model.safetensors")
    assert set(trained) == set(init), "PyTorch's parameter names are kept"
    loaded = TinyLM()
    loaded.load_state_dict(trained, strict=True)
    batch = sort_digits_batch(512, torch.Generator().manual_seed(99))
    before = TinyLM()
    before.load_state_dict(init)
    assert loss_of(loaded, batch) < 0.8 * loss_of(before, batch), "hearth's training must help on fresh data"


class FailingLM(torch.nn.Module):
    """A module whose forward pass fails on any batch."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(11, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > 0:
            raise RuntimeError("this model cannot run")
        return self.tok(tokens)


class PooledLM(torch.nn.Module):
    """A module that returns one row of logits per sequence, not per token."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(11, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens).mean(1)


def test_a_torchscript_model_that_cannot_train_is_refused_at_load_naming_it(hearth, tmp_path):
    """Issue 18, item 4: a forward pass that fails or returns the wrong
    shape is found by a probe batch at load, with exit 2 and a message
    naming the file, not a panic in the middle of training."""
    for name, model, says in [
        ("failing.pt", FailingLM(), "this model cannot run"),
        ("pooled.pt", PooledLM(), "[2, 11]"),
    ]:
        torch.jit.script(model).save(str(tmp_path / name))
        text = gpt_job(model=torchscript(name))
        out = hearth("run", write_config(tmp_path, text), "-q")
        assert out.returncode == 2, (name, out.returncode, out.stderr)
        assert name in out.stderr and "forward pass" in out.stderr and says in out.stderr, out.stderr
        assert "panicked" not in out.stderr


def test_a_torchscript_path_that_is_not_a_module_is_a_clear_error(hearth, tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a module")
    text = gpt_job(model=torchscript("junk.pt"))
    out = hearth("run", write_config(tmp_path, text), "-q")
    assert out.returncode != 0
    assert "junk.pt" in out.stderr and "torch.jit.script" in out.stderr
    text = gpt_job(model={"kind": "torchscript"})
    out = hearth("run", write_config(tmp_path, text), "-q")
    assert out.returncode == 2 and "model.path" in out.stderr


def test_the_rust_example_learns(tmp_path):
    """examples/custom_loop.rs, as `cargo test` built it, fits its curve."""
    import re

    from conftest import ROOT, run_command

    binary = ROOT / "target" / "debug" / "examples" / "custom_loop"
    assert binary.exists(), f"{binary} is missing: run `make test` (cargo test builds the examples)"
    out = run_command([binary], cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HEARTH_USE_CPU": "1"})
    assert out.returncode == 0, out.stderr
    mse = [float(m) for m in re.findall(r"mse ([0-9.]+)", out.stdout)]
    lrs = [float(m) for m in re.findall(r"lr ([0-9.e+-]+)", out.stdout)]
    assert len(mse) == 6 and mse[-1] < mse[0] / 3 and mse[-1] < 0.01, out.stdout
    assert lrs[0] > lrs[-1] and lrs[-1] < 1e-6, "the cosine schedule decays to zero"


def test_a_small_shard_size_saves_an_hf_index_that_loads_the_same_weights(hearth, tmp_path):
    whole, _ = train(hearth, tmp_path, "whole", gpt_job())
    sharded, _ = train(hearth, tmp_path, "sharded", gpt_job(extra='max-shard-size = "20KB"'))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(f.startswith("model-0000") for f in files)
    assert not (sharded / "model.safetensors").exists()
    loaded = {}
    for f in files:
        loaded.update(load_file(sharded / f))
    reference = load_file(whole / "model.safetensors")
    assert set(loaded) == set(reference) == set(index["weight_map"])
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    summary = json.loads((sharded / "summary.json").read_text())
    assert summary["model_path"].endswith("model.safetensors.index.json")
    out = hearth("run", write_config(tmp_path, gpt_job(extra='max-shard-size = "lots"')), "-q")
    assert out.returncode == 2 and "run.max-shard-size" in out.stderr
