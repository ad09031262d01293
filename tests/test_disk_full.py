"""A save that storage refuses (issue 43): on a real small file system — a
tmpfs mounted for the test, where this machine lets the test mount one (as
root) — and under a file size limit (`ulimit -f`, RLIMIT_FSIZE: the kernel
fails the write with EFBIG), which any machine can set. Both reach hearth
as a failed write, the same path.

Each case trains a run to its first checkpoint, makes the storage too
small for the next one, and resumes it:
- `on-save-error = "stop"` (the default): exit 1 with a message naming the
  file system (or the limit) and the bytes; the previous checkpoint
  byte-identical and verifying; no partial folder left.
- `"continue"`: every later checkpoint fails and is reported (summary,
  metrics.jsonl, a warning), training goes on, and the final weights equal
  an unbroken run's.
Async and blocking saves, 1 and 2 processes, full and sharded state dicts."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import mpi_env, mpirun_command, ranked, run_command, tiny_job, write_config

PAGE = 4096


def can_mount_tmpfs(tmp_path_factory) -> bool:
    if os.geteuid() != 0:
        return False
    probe = tmp_path_factory.mktemp("probe")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


@pytest.fixture(scope="module")
def tmpfs_allowed(tmp_path_factory):
    return can_mount_tmpfs(tmp_path_factory)


def job(ranks, async_save, sharded, on_error):
    tables = dict(
        run={"name": "full", "seed": 5, "save-every": 10, "steps": 30, "async-save": async_save, "on-save-error": on_error},
        data={"batch-size": 8},
    )
    if sharded:
        tables["fsdp"] = {
            "sharding-strategy": "FULL_SHARD",
            "auto-wrap-policy": "transformer-based",
            "transformer-cls-names-to-wrap": ["Block"],
            "state-dict-type": "SHARDED_STATE_DICT",
        }
    return tiny_job(**tables)


def train(hearth_bin, ranks, config, out, *extra, fsize=None):
    """`hearth run CONFIG` on `ranks` processes into `out`, under a file
    size limit of `fsize` bytes when given."""
    command = [hearth_bin, "run", config, "--output-dir", out, "-q", "--cpu", *extra]
    if fsize:
        # On the ranks only (mpirun's own shared-memory files are larger),
        # and MPI's shared-memory transport off (its segments too).
        command = ["bash", "-c", f'ulimit -f {fsize // 1024} && exec "$@"', "bash", *command]
        if ranks > 1:
            command = ["--mca", "btl", "self,tcp", *command]
    if ranks > 1:
        command = mpirun_command(ranks, *command)
    done = run_command([str(c) for c in command], cwd=Path(out).parent, env=mpi_env(HEARTH_LOG="info"))
    return subprocess.CompletedProcess(done.args, done.returncode, ranked(done.stdout), ranked(done.stderr))


def files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def pages(folder):
    """Bytes a folder's files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in folder.rglob("*") if p.is_file())


def used(mount):
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


CASES = [
    # (storage, ranks, async, sharded, on-save-error)
    ("tmpfs", 1, True, False, "stop"),
    ("tmpfs", 1, False, False, "stop"),
    ("tmpfs", 1, True, False, "continue"),
    ("tmpfs", 2, False, False, "stop"),
    ("tmpfs", 2, True, False, "continue"),
    ("tmpfs", 2, True, True, "stop"),
    ("tmpfs", 2, False, True, "continue"),
    ("fsize", 1, False, False, "stop"),
    ("fsize", 2, True, False, "continue"),
    ("fsize", 2, False, True, "stop"),
]


def case_id(case):
    storage, ranks, async_save, sharded, mode = case
    return f"{storage}-{ranks}proc-{'async' if async_save else 'blocking'}-{'sharded' if sharded else 'full'}-{mode}"


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_a_save_the_storage_refuses_keeps_the_previous_checkpoint_and_stops_or_goes_on(hearth, hearth_bin, tmp_path, tmpfs_allowed, case):
    storage, ranks, async_save, sharded, mode = case
    if storage == "tmpfs" and not tmpfs_allowed:
        pytest.skip("mounting a tmpfs needs root here; the fsize cases test the same path under `ulimit -f`")
    config = write_config(tmp_path, job(ranks, async_save, sharded, mode))

    # The unbroken run: its checkpoint size and final weights.
    reference = train(hearth_bin, ranks, config, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr
    ref = tmp_path / "reference" / "full"
    first = ref / "checkpoints" / "checkpoint_0"

    small = tmp_path / "small"
    small.mkdir()
    if storage == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        # Up to the first checkpoint, with room to spare.
        out = train(hearth_bin, ranks, config, small, "--steps", 10)
        assert out.returncode == 0, out.stderr
        kept = small / "full" / "checkpoints" / "checkpoint_0"
        before = files(kept)
        # The same tensors as the unbroken run's (a sharded file's metadata names its writer's run).
        for name in (n for n in before if n.endswith(".safetensors")):
            a, b = load_file(kept / name), load_file(first / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{name} differs from the unbroken run's"
        limit = None
        if storage == "tmpfs":
            # Room for the final model's replacement, not for a checkpoint.
            size = used(small) + int(0.6 * pages(first))
            subprocess.run(["mount", "-o", f"remount,size={-(-size // PAGE) * PAGE}", str(small)], check=True)
        else:
            sizes = {name: len(data) for name, data in before.items() if name.endswith(".safetensors")}
            if sharded:
                limit = max(sizes.values()) // 2
            else:
                # Above the model file (the final model fits), below the optimizer's.
                limit = (sizes["model.safetensors"] + sizes["optimizer.safetensors"]) // 2
        out = train(hearth_bin, ranks, config, small, "--resume", fsize=limit)
        said = out.stdout + out.stderr

        if mode == "stop":
            assert out.returncode == 1, said
            main = [line for line in said.splitlines() if "was not saved" in line and not line.startswith("[rank 1]")]
            assert main, said
            message = main[0]
            if storage == "tmpfs":
                for part in [f"{small} (tmpfs) is full", "No space left on device", "The save needed about", "were free when it began"]:
                    assert part in message, (part, message)
            else:
                assert "ulimit -f" in message and f"{limit // 1024 * 1024} bytes" in message, message
            assert "checkpoint_1" in message and "previous checkpoint is untouched" in message, message
        else:
            assert out.returncode == 0, said
            summary = json.loads((small / "full" / "summary.json").read_text())
            assert summary["checkpoints_not_saved"] == [20, 30], summary
            events = [json.loads(l) for l in (small / "full" / "metrics.jsonl").read_text().splitlines()]
            failed = [e["step"] for e in events if e.get("event", "").startswith("checkpoint not saved")]
            assert failed == [20, 30], events
            assert said.count("a checkpoint was not saved; training goes on") == 2, said
            a, b = load_file(ref / "model.safetensors"), load_file(small / "full" / "model.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the weights differ from the unbroken run's"

        # Either way: the previous checkpoint as it was, nothing partial left.
        assert sorted(os.listdir(small / "full" / "checkpoints")) == ["checkpoint_0"], os.listdir(small / "full" / "checkpoints")
        assert files(kept) == before
        verify = hearth("checkpoint", "verify", kept)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        print(f"{case_id(case)}: {storage} " + (f"at {small}" if storage == "tmpfs" else f"limit {limit} bytes"))
    finally:
        if storage == "tmpfs":
            subprocess.run(["umount", "-l", str(small)], check=False)
