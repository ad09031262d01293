"""The resume matrix: a checkpoint written by 1, 2 or 4 processes resumed on
each of 1, 2 and 4, under FULL_SHARD with sharded and with full state
dicts, and under DDP, on text data.

Every cell checks two things. Resumed with no step left, the run writes the
checkpoint's weights bit for bit (the model is resharded exactly onto any
number of processes) and evaluates. Resumed for one more step, it trains,
evaluates and writes its model — on as many processes as wrote the
checkpoint, the unbroken run's weights bit for bit.

What stays the same across world sizes: the model, the optimizer state
(merged and resharded: `test_fsdp.py` checks it bit for bit), the step count
and the scheduler. The data cannot: text windows are drawn by each process
from its own stream. A process the checkpoint was saved by goes on with its
own stream exactly; a process added on resume draws from its own stream of
the same seed, from where process 0 stood (`DataStream`); the streams of
processes dropped on resume end there."""
import json
import shutil

import pytest

from conftest import mpirun, write_config
from test_fsdp import fsdp_table, text_job

SIZES = (1, 2, 4)
KINDS = {
    "full-shard-sharded": 'state-dict-type = "SHARDED_STATE_DICT"\n',
    "full-shard-full": 'state-dict-type = "FULL_STATE_DICT"\n',
    "ddp": None,
}


def config(tmp_path, kind: str):
    extra = KINDS[kind]
    table = ""
    if extra is not None:
        table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]').replace("SHARD_GRAD_OP", "FULL_SHARD") + extra
    text = text_job(tmp_path, table, 2, "\n[distributed]\ntimeout = 60\n")
    return write_config(tmp_path, text.replace("log-every = 2\n", "log-every = 2\nsave-every = 2\n"))


def run(hearth_bin, tmp_path, job, n, out, *args):
    done = mpirun(hearth_bin, n, "run", job, "--quiet", "--output-dir", out, *args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, f"{n} processes:\n{done.stderr}"
    return done


@pytest.mark.parametrize("writer", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_resumes_on_one_two_and_four_processes(hearth_bin, tmp_path, kind, writer):
    job = config(tmp_path, kind)
    written = tmp_path / "written"
    run(hearth_bin, tmp_path, job, writer, written)
    weights = (written / "fsdp" / "model.safetensors").read_bytes()
    # The unbroken run the same-size resume must end at.
    unbroken = tmp_path / "unbroken"
    run(hearth_bin, tmp_path, job, writer, unbroken, "--steps", 3)
    for n in SIZES:
        # Nothing left to train: the checkpoint's weights, bit for bit.
        still = tmp_path / f"still-{n}"
        shutil.copytree(written, still)
        done = run(hearth_bin, tmp_path, job, n, still, "--resume")
        assert "at step 3" in done.stdout and "no steps left" in done.stdout, done.stdout
        assert (still / "fsdp" / "model.safetensors").read_bytes() == weights, f"{writer} -> {n}"
        # One more step: it trains, evaluates and writes its model.
        on = tmp_path / f"on-{n}"
        shutil.copytree(written, on)
        done = run(hearth_bin, tmp_path, job, n, on, "--resume", "--steps", 3)
        summary = json.loads((on / "fsdp" / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["num_processes"] == n, summary
        assert summary["eval"]["kind"] == "validation-loss" and summary["eval"]["tokens"] == 13 * 64, summary["eval"]
        logged = [json.loads(line) for line in (on / "fsdp" / "metrics.jsonl").read_text().splitlines()]
        assert any(entry.get("step") == 3 and "loss" in entry for entry in logged), logged
        trained = (on / "fsdp" / "model.safetensors").read_bytes()
        assert trained != weights, f"{writer} -> {n}: training went on"
        if n == writer:
            assert trained == (unbroken / "fsdp" / "model.safetensors").read_bytes(), f"{writer} -> {n}: the unbroken run's weights"
        assert summary["final_loss"] == summary["final_loss"] and summary["eval"]["loss"] < 10, summary
