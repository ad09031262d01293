"""`make soak`: SIGKILL `hearth run` at random moments, many times, and
check that every visible checkpoint is always complete (issue 18).

Three scenarios, each killed KILLS times (default 20, so 60 in all):
  rotation  one process saving every 2 steps, keeping 2: most kills land
            while a checkpoint is written in the background or an old one
            is being removed;
  large     one process with a larger model (~40 MB a checkpoint), so the
            background (async) write takes long enough to be hit often;
  two-rank  two MPI ranks saving together (rank 0 the shared files, each
            rank its generators); a random rank is killed, or both.
After each kill the run folder is inspected: every visible `checkpoint_N`
must pass `hearth checkpoint verify`; hidden leftovers (`.tmp-*` of a save,
`.removing-*` of a rotation) show where the kill landed, and must be swept
by the next save. The next attempt resumes from the newest complete
checkpoint (as `hearth launch --max-restarts` does). Prints one table; exits
1 if any visible checkpoint was ever incomplete.

Usage: python tests/soak/kill_soak.py [KILLS] [SEED]"""
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTH = ROOT / "target" / "debug" / "hearth"

JOB = """
[run]
name = "soak"
steps = 1000000
seed = 5
log-every = 1000000
save-every = 2
keep-checkpoints = KEEP
[model]
kind = "gpt"
d-model = DMODEL
layers = LAYERS
heads = 2
[data]
kind = "sort-digits"
digits = 4
batch-size = 8
[optimizer]
kind = "adamw"
lr = 3e-3
[eval]
samples = 10
"""

SCENARIOS = {
    "rotation": dict(keep=2, d_model=32, layers=1, ranks=1, window=(0.3, 2.0)),
    "large": dict(keep=3, d_model=256, layers=3, ranks=1, window=(2.0, 8.0)),
    "two-rank": dict(keep=3, d_model=64, layers=1, ranks=2, window=(1.0, 4.0)),
}


def env():
    e = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HEARTH_RESTART_COUNT="1")
    return e


def command(config, ranks):
    run = [str(HEARTH), "run", str(config), "--cpu", "-q"]
    if ranks == 1:
        return run
    return ["mpirun", "--oversubscribe", "-n", str(ranks)] + run


def rank_pids(config):
    # A rank (not mpirun): its command line starts with the binary.
    out = subprocess.run(["pgrep", "-f", rf"^\S*hearth run {config}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def inspect(folder):
    """(visible checkpoints, incomplete ones with the reason, hidden leftovers)."""
    if not folder.exists():
        return [], [], []
    names = sorted(os.listdir(folder))
    visible = [n for n in names if n.startswith("checkpoint_")]
    hidden = [n for n in names if n.startswith(".")]
    bad = []
    for name in visible:
        out = subprocess.run([str(HEARTH), "checkpoint", "verify", str(folder / name)], capture_output=True, text=True, env=env())
        if out.returncode != 0:
            bad.append(f"{name}: {out.stdout.strip()} {out.stderr.strip()}")
    return visible, bad, hidden


def soak(name, spec, kills, rng):
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"hearth-soak-{name}-"))
    try:
        job = JOB.replace("KEEP", str(spec["keep"])).replace("DMODEL", str(spec["d_model"]))
        config = work / "soak.toml"
        config.write_text(job.replace("LAYERS", str(spec["layers"])))
        folder = work / "runs" / "soak" / "checkpoints"
        stats = dict(kills=0, newest=-1, mid_save=0, mid_rotation=0, incomplete=0, failures=[])
        started = time.time()
        for _ in range(kills):
            proc = subprocess.Popen(command(config, spec["ranks"]), cwd=work, env=env(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
            time.sleep(rng.uniform(*spec["window"]))
            if spec["ranks"] == 1 or rng.random() < 0.3:
                os.killpg(proc.pid, signal.SIGKILL)  # the machine dies: every rank at once
            else:
                pids = rank_pids(config)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)  # one rank dies; mpirun stops the rest
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pid in rank_pids(config):
                os.kill(pid, signal.SIGKILL)
            stats["kills"] += 1
            visible, bad, hidden = inspect(folder)
            stats["mid_save"] += any(".tmp-" in h for h in hidden)
            stats["mid_rotation"] += any(".removing-" in h for h in hidden)
            stats["incomplete"] += len(bad)
            stats["failures"] += bad
            if visible:
                stats["newest"] = max(stats["newest"], max(int(v.split("_")[1]) for v in visible))
        stats["seconds"] = time.time() - started
        return stats
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    if not HEARTH.exists():
        sys.exit(f"{HEARTH} is missing: run `make build` first")
    rows = [(name, soak(name, spec, kills, rng)) for name, spec in SCENARIOS.items()]
    print(f"{'scenario':<10} {'kills':>5} {'newest ckpt':>11} {'mid-save':>8} {'mid-rotation':>12} {'incomplete visible':>18} {'seconds':>7}")
    for name, s in rows:
        print(f"{name:<10} {s['kills']:>5} {s['newest']:>11} {s['mid_save']:>8} {s['mid_rotation']:>12} {s['incomplete']:>18} {s['seconds']:>7.0f}")
    total = sum(s["kills"] for _, s in rows)
    incomplete = sum(s["incomplete"] for _, s in rows)
    print(f"{total} SIGKILLs; visible checkpoints ever incomplete: {incomplete}")
    for _, s in rows:
        for f in s["failures"]:
            print("INCOMPLETE:", f)
    sys.exit(1 if incomplete else 0)


if __name__ == "__main__":
    main()
