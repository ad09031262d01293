"""Checkpoints through the binary: `run.save-every` and `hearth run --resume`
continue a run bit for bit; `hearth checkpoint inspect|verify`; and a run
killed with SIGKILL at random moments never leaves its newest checkpoint
damaged."""
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file

from conftest import mpi_env, mpirun, mpirun_command, processes_of_rank, run_hearth, start, tiny_job, write_config

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


def flip_one_bit(path: Path, rng: random.Random, header_only=False) -> bytes:
    """Inverts one random bit of `path` in place (its size unchanged; in
    a safetensors file's header when `header_only`) and returns the bytes
    it had."""
    data = bytearray(path.read_bytes())
    end = 8 + int.from_bytes(data[:8], "little") if header_only else len(data)
    data[rng.randrange(end)] ^= 1 << rng.randrange(8)
    original = path.read_bytes()
    path.write_bytes(bytes(data))
    return original


def test_a_flipped_bit_in_any_checkpoint_file_is_caught_and_resume_falls_back(hearth, tmp_path):
    """Each kind of file of a checkpoint (model, optimizer, random state,
    scheduler, trainer state): one random bit inverted at 20 positions
    each (the first in a safetensors header), the size unchanged. `verify`
    exits 1 naming the file every time; `--resume` (3 positions a kind)
    skips the checkpoint, saying which file changed, and resumes from the
    one before."""
    job = JOB.replace("steps = 40", "steps = 20") + '\n[scheduler]\nname = "linear"\nwarmup-steps = 4\n'
    out = hearth("run", write_config(tmp_path, job), "-q")
    assert out.returncode == 0, out.stderr
    run = tmp_path / "runs" / "r"
    newest = run / "checkpoints" / "checkpoint_1"
    names = {p.name for p in newest.iterdir()}
    kinds = ["model.safetensors", "optimizer.safetensors", "random_states_0.safetensors", "trainer_state.json"]
    # The scheduler's files: its plugin's state (empty for `linear`) and its JSON.
    kinds += [n for n in names if n.startswith("scheduler") and (newest / n).stat().st_size > 0][:1]
    assert len(kinds) == 5, names
    # The manifest's hashes are xxh3-64, as the xxhash package computes it.
    manifest = json.loads((newest / "hearth_checkpoint.json").read_text())
    for f in manifest["files"]:
        assert f["xxh3"] == xxhash.xxh3_64_hexdigest((newest / f["name"]).read_bytes()), f
    rng = random.Random(43)
    for kind in kinds:
        path = newest / kind
        for i in range(20):
            original = flip_one_bit(path, rng, header_only=i == 0 and kind.endswith(".safetensors"))
            out = hearth("checkpoint", "verify", newest)
            assert out.returncode == 1 and kind in out.stderr and "has changed since it was written" in out.stderr, \
                (kind, i, out.stdout, out.stderr)
            if i < 3:
                copy = tmp_path / f"resume-{kind}-{i}"
                shutil.copytree(run, copy / "r")
                out = hearth("run", write_config(tmp_path, job.replace("steps = 20", "steps = 24")),
                             "--output-dir", copy, "--resume", "-q")
                said = out.stdout + out.stderr
                assert out.returncode == 0, said
                assert "skipping checkpoint" in said and "checkpoint_1 is damaged" in said and kind in said, said
                assert "resumed from" in said and "checkpoint_0" in said and "step 11" in said, said
                # The damaged one is kept aside; the resumed run saved its step anew.
                checkpoints = copy / "r" / "checkpoints"
                assert (checkpoints / "checkpoint_1.damaged" / kind).exists(), sorted(os.listdir(checkpoints))
                assert hearth("checkpoint", "verify", checkpoints / "checkpoint_1").returncode == 0
            path.write_bytes(original)
        out = hearth("checkpoint", "verify", newest)
        assert out.returncode == 0, out.stderr


def wait_for_training(metrics: Path, past: int, deadline: float):
    """Waits until the run's own metrics.jsonl logs a step past `past`
    (training has begun: the signal handlers are in)."""
    while time.monotonic() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            steps = [json.loads(l).get("step", 0) for l in lines if l.strip()]
            if steps and max(steps) > past:
                return
        time.sleep(0.02)
    raise AssertionError(f"{metrics} never logged a step past {past}")


def stopped_at(stderr: str) -> int:
    """The step a polite stop saved, from its message."""
    line = next(l for l in stderr.splitlines() if "stopped by SIGTERM after step" in l)
    return int(line.split("after step ")[1].split(";")[0])


def test_sigterm_at_random_moments_saves_the_step_reached_and_resumes_to_the_unbroken_weights(hearth, hearth_bin, tmp_path):
    """SIGTERM at 10 random moments of a 1-process run: each time the run
    finishes its step, saves a checkpoint of that step and exits with
    status 75; resumed each time from that step, it ends with the weights
    of a run that was never stopped."""
    job = tiny_job(run={"name": "p", "steps": 3000, "log-every": 5, "gradient-accumulation-steps": 2},
                   eval={"samples": None})
    config = write_config(tmp_path, job)
    out = hearth("run", config, "--output-dir", tmp_path / "unbroken", "-q")
    assert out.returncode == 0, out.stderr
    run = tmp_path / "stopped" / "p"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    rng = random.Random(11)
    last = 0
    for stop in range(10):
        args = [str(hearth_bin), "run", str(config), "--output-dir", str(tmp_path / "stopped"), "-q"]
        args += ["--resume"] if stop else []
        with start(args, cwd=tmp_path, env=env) as job_:
            wait_for_training(run / "metrics.jsonl", last, time.monotonic() + 120)
            time.sleep(rng.uniform(0.0, 0.4))
            job_.proc.send_signal(signal.SIGTERM)
            ended = job_.finish()
        assert ended.returncode == 75, (stop, ended.stderr)
        step = stopped_at(ended.stderr)
        assert step > last, (stop, step, last)
        history = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        saved = [h for h in history if h.get("event") == "stopped by SIGTERM"]
        assert saved and saved[-1]["step"] == step, saved
        assert run_hearth(hearth_bin, "checkpoint", "verify", saved[-1]["path"], cwd=tmp_path).returncode == 0
        last = step
    out = hearth("run", config, "--output-dir", tmp_path / "stopped", "--resume", "-q")
    assert out.returncode == 0, out.stderr
    assert f"at step {last + 1}" in out.stdout + out.stderr
    a, b = load_file(tmp_path / "unbroken" / "p" / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ after 10 polite stops"


def test_sigterm_at_random_moments_of_two_processes_stops_both_at_the_same_step_and_resumes_to_the_unbroken_weights(hearth_bin, tmp_path):
    """SIGTERM at 10 random moments of a 2-process run, to rank 1 alone
    (a signal may reach only some processes) or to both, by turns. Both
    ranks agree on the step, save one checkpoint of it and exit with
    status 75; resumed each time, the run ends with the weights of a
    2-process run never stopped."""
    job = tiny_job(run={"name": "p", "steps": 10000, "log-every": 5}, eval={"samples": None})
    config = write_config(tmp_path, job)
    out = mpirun(hearth_bin, 2, "run", config, "--output-dir", tmp_path / "unbroken", "-q", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "stopped" / "p"
    rng = random.Random(5)
    last = 0
    for stop in range(10):
        args = ["run", config, "--output-dir", tmp_path / "stopped", "-q"] + (["--resume"] if stop else [])
        with start(mpirun_command(2, hearth_bin, *args), cwd=tmp_path, env=mpi_env()) as job_:
            wait_for_training(run / "metrics.jsonl", last, time.monotonic() + 120)
            time.sleep(rng.uniform(0.0, 0.4))
            targets = processes_of_rank(1, config) + (processes_of_rank(0, config) if stop % 2 else [])
            assert len(targets) == 1 + stop % 2, "the ranks are running"
            for pid in targets:
                os.kill(pid, signal.SIGTERM)
            ended = job_.finish()
        assert ended.returncode != 0
        steps = {int(l.split("after step ")[1].split(";")[0]) for l in ended.stderr.splitlines()
                 if "stopped by SIGTERM after step" in l}
        assert len(steps) == 1, ("one step agreed by both ranks", ended.stderr[-3000:])
        step = steps.pop()
        assert step > last
        assert ended.stderr.count("stopped by SIGTERM after step") == 2, ended.stderr[-3000:]
        last = step
    out = mpirun(hearth_bin, 2, "run", config, "--output-dir", tmp_path / "stopped", "--resume", "-q", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"at step {last + 1}" in out.stdout + out.stderr
    a, b = load_file(tmp_path / "unbroken" / "p" / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ after 10 polite stops"


def test_hearth_launch_passes_a_polite_stop_on_and_restarts_only_what_it_was_not_told_to_stop(hearth, hearth_bin, tmp_path):
    """SIGTERM to `hearth launch` (the scheduler taking the machine) goes
    to every process: they save and stop, and the launcher exits with 75
    for a requeue — no restart, even with --max-restarts. SIGTERM to one
    process alone is a restart: the launch resumes from that checkpoint and
    finishes."""
    job = tiny_job(run={"name": "p", "steps": 10000, "log-every": 5}, eval={"samples": None})
    config = write_config(tmp_path, job)
    run = tmp_path / "runs" / "p"
    args = [str(hearth_bin), "launch", "-n", "2", "--max-restarts", "1", "--",
            str(hearth_bin), "run", str(config), "-q"]
    with start(args, cwd=tmp_path, env=mpi_env()) as launched:
        wait_for_training(run / "metrics.jsonl", 0, time.monotonic() + 120)
        launched.proc.send_signal(signal.SIGTERM)
        ended = launched.finish()
    assert ended.returncode == 75, ended.stderr[-3000:]
    assert ended.stderr.count("stopped by SIGTERM after step") == 2 and "starting them again" not in ended.stderr
    first = stopped_at(ended.stderr)

    with start(args + ["--resume"], cwd=tmp_path, env=mpi_env()) as launched:
        wait_for_training(run / "metrics.jsonl", first, time.monotonic() + 120)
        rank1 = processes_of_rank(1, config)
        assert rank1, "rank 1 is running"
        for pid in rank1:
            os.kill(pid, signal.SIGTERM)
        ended = launched.finish()
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert "starting them again from it (restart 1 of 1)" in ended.stderr, ended.stderr[-3000:]
    assert (run / "model.safetensors").exists()

