"""Checkpoints through the binary: `run.save-every` and `hearth run --resume`
continue a run bit for bit; `hearth checkpoint inspect|verify`; and a run
killed with SIGKILL at random moments never leaves its newest checkpoint
damaged."""
import json
import os
import random
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import run_hearth, start, tiny_job, write_config

JOB = tiny_job(
    run={"name": "r", "seed": 5, "save-every": 10, "gradient-accumulation-steps": 2},
    data={"batch-size": 8},
    optimizer={"lr": 3e-3, "max-grad-norm": 1.0},
    trackers=[{"name": "jsonl"}],
)


def losses(run_dir):
    lines = (run_dir / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines()
    return {l["step"]: l["loss"] for l in map(json.loads, lines) if "loss" in l}


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(hearth, tmp_path):
    config = write_config(tmp_path, JOB)
    out = hearth("run", config, "--output-dir", tmp_path / "straight", "-q")
    assert out.returncode == 0, out.stderr
    out = hearth("run", config, "--output-dir", tmp_path / "split", "--steps", "20", "-q")
    assert out.returncode == 0, out.stderr
    out = hearth("run", config, "--output-dir", tmp_path / "split", "--resume", "-q")
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout + out.stderr and "step 21" in out.stdout + out.stderr

    a, b = tmp_path / "straight" / "r", tmp_path / "split" / "r"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"
    la, lb = losses(a), losses(b)
    assert la[30] == lb[30] and la[40] == lb[40], (la, lb)
    assert sorted(os.listdir(b / "checkpoints")) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_inspect_and_verify_report_and_catch_damage(hearth, tmp_path):
    out = hearth("run", write_config(tmp_path, JOB.replace("steps = 40", "steps = 10")), "-q")
    assert out.returncode == 0, out.stderr
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "checkpoint_0"
    out = hearth("checkpoint", "inspect", ckpt)
    assert out.returncode == 0, out.stderr
    for expected in ["1 model,", "1 optimizer,", "random state", "1 custom object", "blocks.0.qkv.weight", "state.0.exp_avg"]:
        assert expected in out.stdout, (expected, out.stdout)
    out = hearth("checkpoint", "verify", ckpt)
    assert out.returncode == 0 and "complete and readable" in out.stdout, out.stdout + out.stderr

    opt = ckpt / "optimizer.safetensors"
    data = opt.read_bytes()
    opt.write_bytes(data[:-100])
    out = hearth("checkpoint", "verify", ckpt)
    assert out.returncode == 1 and "optimizer.safetensors" in out.stderr, out.stderr
    out = hearth("run", write_config(tmp_path, JOB.replace("steps = 40", "steps = 20")), "--resume", "-q")
    assert out.returncode != 0 and "no complete checkpoint" in out.stderr, out.stderr


def test_kill_9_at_random_moments_never_damages_the_newest_checkpoint(hearth_bin, tmp_path):
    job = JOB.replace("steps = 40", "steps = 1000000").replace("save-every = 10", "save-every = 3\nkeep-checkpoints = 3")
    job = job.replace("log-every = 10", "log-every = 100000").replace('[[trackers]]\nname = "jsonl"\n', "")
    config = write_config(tmp_path, job)
    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    rng = random.Random(1)
    saves, kills, resumed = 0, 0, False
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    while saves < 50 or kills < 10:
        args = [str(hearth_bin), "run", str(config), "-q"] + (["--resume"] if resumed else [])
        before = newest(ckpts)
        with start(args, cwd=tmp_path, env=env) as job:
            time.sleep(rng.uniform(0.4, 2.0))
            job.proc.send_signal(signal.SIGKILL)
            err = job.finish().stderr
        kills += 1
        latest = newest(ckpts)
        if latest is None:
            continue  # killed before its first save
        assert before is None or latest >= before, (before, latest, err)
        saves += latest - (before if before is not None else -1)
        out = run_hearth(hearth_bin, "checkpoint", "verify", ckpts / f"checkpoint_{latest}", cwd=tmp_path)
        assert out.returncode == 0, f"after kill {kills}: {out.stdout}{out.stderr}"
        resumed = True
        assert kills < 200, "too few saves: the runs die before saving"
    print(f"{saves} saves over {kills} SIGKILLs")
    assert len([p for p in os.listdir(ckpts) if not p.startswith(".")]) <= 3 + 1


def newest(folder):
    if not folder.exists():
        return None
    numbers = [int(p.split("_")[1]) for p in os.listdir(folder) if p.startswith("checkpoint_")]
    return max(numbers) if numbers else None


def test_a_torchscript_models_buffers_are_saved_checkpointed_and_resumed(hearth, tmp_path):
    """Issue 18, item 3: BatchNorm's running statistics and batch count are
    part of the model's state: in model.safetensors (PyTorch loads it
    strictly) and in every checkpoint, so a resumed run ends bit-identical."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "oracles"))
    from batchnorm_lm import BatchNormLM

    torch.manual_seed(0)
    fresh = BatchNormLM()
    torch.jit.script(fresh).save(str(tmp_path / "bn.pt"))
    job = JOB.replace('kind = "gpt"\nd-model = 32\nlayers = 1\nheads = 2', 'kind = "torchscript"\npath = "bn.pt"')
    job = job.replace("steps = 40", "steps = 20").replace("max-grad-norm = 1.0\n", "")
    config = write_config(tmp_path, job)
    out = hearth("run", config, "--output-dir", tmp_path / "straight", "-q")
    assert out.returncode == 0, out.stderr
    out = hearth("run", config, "--output-dir", tmp_path / "split", "--steps", "10", "-q")
    assert out.returncode == 0, out.stderr
    out = hearth("run", config, "--output-dir", tmp_path / "split", "--resume", "-q")
    assert out.returncode == 0, out.stderr

    saved = load_file(tmp_path / "straight" / "r" / "model.safetensors")
    assert set(saved) == set(fresh.state_dict()), "every parameter and buffer, by PyTorch's names"
    trained = BatchNormLM()
    trained.load_state_dict(saved, strict=True)
    # 20 optimizer steps of 2 accumulated micro-batches: 40 training forward passes.
    assert int(saved["bn.num_batches_tracked"]) == 40
    assert not torch.equal(saved["bn.running_mean"], fresh.bn.running_mean), "the statistics were trained"
    checkpoint = load_file(tmp_path / "straight" / "r" / "checkpoints" / "checkpoint_1" / "model.safetensors")
    assert int(checkpoint["bn.num_batches_tracked"]) == 40
    resumed = load_file(tmp_path / "split" / "r" / "model.safetensors")
    assert all(torch.equal(saved[k], resumed[k]) for k in saved), "state differs after resume"


def test_a_restarted_run_resumes_only_from_its_own_launchs_checkpoints(hearth, tmp_path):
    """`hearth launch --max-restarts` restarts `hearth run` with
    HEARTH_RESTART_COUNT and the launch's HEARTH_LAUNCH_ID: it continues
    from the newest checkpoint its own launch wrote, never from an older
    run's left in the same folder."""
    config = write_config(tmp_path, JOB)
    ours = {"HEARTH_LAUNCH_ID": "launch-a"}
    out = hearth("run", config, "--output-dir", tmp_path / "a", "--steps", "20", "-q", env=ours)
    assert out.returncode == 0, out.stderr
    restarted = {**ours, "HEARTH_RESTART_COUNT": "1"}
    out = hearth("run", config, "--output-dir", tmp_path / "a", "-q", env=restarted)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout + out.stderr and "step 21" in out.stdout + out.stderr

    out = hearth("run", config, "--output-dir", tmp_path / "b", "--steps", "20", "-q", env=ours)
    assert out.returncode == 0, out.stderr
    other = {"HEARTH_LAUNCH_ID": "launch-b", "HEARTH_RESTART_COUNT": "1"}
    out = hearth("run", config, "--output-dir", tmp_path / "b", "-q", env=other)
    assert "resumed from" not in out.stdout + out.stderr, "another launch's checkpoint was taken"
