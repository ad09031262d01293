"""A rank lost under sharding (issue 43): rank 1 SIGKILLed, or hung
(SIGSTOP) mid-step, under FULL_SHARD and HYBRID_SHARD (one machine: the
shard group holds both ranks, the replica group one), through `hearth launch
-n 2 --max-restarts 1`. The other rank stops within the collective timeout
(plus the roll call that finds who is lost) with a message naming rank 1;
the launcher starts both again; the run resumes from its newest complete
checkpoint and ends with the weights of a run nobody broke."""
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import mpi_env, processes_of_rank, start, tiny_job, write_config

TIMEOUT = 10  # [distributed] timeout, seconds


def job(strategy):
    return tiny_job(
        run={"name": "lost", "seed": 5, "steps": 2000, "save-every": 50, "keep-checkpoints": 3, "log-every": 500},
        data={"batch-size": 8},
        fsdp={"sharding-strategy": strategy, "auto-wrap-policy": "transformer-based", "transformer-cls-names-to-wrap": ["Block"]},
        distributed={"timeout": TIMEOUT},
    )


def launch(hearth_bin, config, out, restarts):
    command = [hearth_bin, "launch", "-n", "2", "--cpu", "--max-restarts", restarts, config, "--", "--quiet", "--output-dir", out]
    return start([str(c) for c in command], cwd=Path(out).parent, env=mpi_env())


def wait_for(condition, seconds, what):
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"{what} within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.parametrize("failure", ["killed", "hung"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_a_lost_rank_under_sharding_is_named_and_the_restarted_run_ends_with_the_unbroken_weights(hearth_bin, tmp_path, strategy, failure):
    config = write_config(tmp_path, job(strategy))
    with launch(hearth_bin, config, tmp_path / "whole", 0) as unbroken:
        done = unbroken.finish()
    assert done.returncode == 0, done.stdout + done.stderr

    with launch(hearth_bin, config, tmp_path / "broken", 1) as broken:
        second = tmp_path / "broken" / "lost" / "checkpoints" / "checkpoint_1" / "hearth_checkpoint.json"
        wait_for(second.exists, 300, "a second checkpoint")
        victims, survivors = processes_of_rank(1, config), processes_of_rank(0, config)
        assert len(victims) == len(survivors) == 1, "both ranks run"
        victim, survivor = victims[0], survivors[0]
        if failure == "killed":
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGSTOP)
            # Rank 0 waits out the collective timeout, calls the roll (at
            # most half the timeout) and stops: 15 s here, every time. A
            # CI run saw 25.0 s once, a second timeout's worth, on
            # HYBRID_SHARD; not reproduced since (the path is an open
            # problem, noted under issue 62). The bound allows that second
            # wait and still fails a rank that waits a third time or hangs.
            took = wait_for(lambda: not Path(f"/proc/{survivor}").exists() or
                            (Path(f"/proc/{survivor}/stat").read_text().split()[2] == "Z"),
                            TIMEOUT * 6, "the surviving rank stopping")
            assert took < TIMEOUT * 3 + 5, f"rank 0 took {took:.1f} s to stop"
        out = broken.finish()
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    if failure == "killed":
        assert "rank 1 was killed by signal 9 (Killed); the other processes were stopped; starting every process again (restart 1 of 1)" in said, said
    else:
        assert "rank 1 did not answer (it hangs, or its process is gone)" in said, said
        assert "starting every process again (restart 1 of 1)" in said, said
    assert "resumed from" in said, said
    whole = (tmp_path / "whole" / "lost" / "model.safetensors").read_bytes()
    assert (tmp_path / "broken" / "lost" / "model.safetensors").read_bytes() == whole, "restarted after losing a rank = never broken"
