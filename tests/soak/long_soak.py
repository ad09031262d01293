"""`make soak SOAK_HOURS=1`: a week of checkpoints in an hour (issue 43).

Two MPI ranks train the bench GPT (examples/bench-gpt.toml) for SOAK_HOURS, saving every 50 steps
with rotation (keep 3), two trackers (tensorboard, jsonl) and a checkpoint
hook (manifest-sha256). Every 5 s each rank's resident memory, mapped
memory, open file descriptors and threads, and the run folder's disk use,
are read; every SOAK_SAMPLE_SECONDS (60) they make one sample: the peak of
the memory readings, and the floor of the descriptors, threads and disk
use — what was held the whole minute. A leak raises both; what a save or
a tracker's write holds for a moment (the checkpoint writer and its
hashing thread, a WASI file call's blocking-pool thread, the fourth
checkpoint that exists between a commit and its rotation) raises neither.
After the first sixth of the run — ten minutes at most — the warm-up is
over: the median of the samples in the next five minutes (or twelfth) is
the baseline, the median of the last five is the end, and the soak fails
if any of them grew by more than 5 %. The run is then stopped with
SIGTERM (a polite stop) and its last checkpoint verified.

Writes `soak-long.csv` (every sample) and `soak-long.md` (the table the
README quotes) to SOAK_OUT (default the current folder), prints the table,
and exits 1 on growth or on a failed stop.

Usage: SOAK_HOURS=1 python tests/soak/long_soak.py"""
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTH = ROOT / "target" / "debug" / "hearth"
PLUGINS = ROOT / "target" / "plugins"
GROWTH_LIMIT = 0.05

BENCH_JOB = ROOT / "examples" / "bench-gpt.toml"
SOAK_RUN = """[run]
name = "soak"
steps = 100000000
log-every = 100
save-every = 50
keep-checkpoints = 3
"""
SOAK_PLUGINS = """
[[trackers]]
name = "tensorboard"

[[trackers]]
name = "jsonl"

[[checkpoint-hooks]]
name = "manifest-sha256"
"""


def job():
    """The bench GPT's job (examples/bench-gpt.toml) with the soak's [run]
    section, two trackers and a checkpoint hook."""
    bench = BENCH_JOB.read_text()
    run = re.search(r"^\[run\]\n(?:[^\[\n].*\n)*", bench, re.M)
    if run is None:
        sys.exit(f"{BENCH_JOB} has no [run] section")
    return bench[: run.start()] + SOAK_RUN + bench[run.end():] + SOAK_PLUGINS

# (column, what it is, unit divisor, unit)
METRICS = [
    ("rss", "resident memory of the ranks", 2**20, "MiB"),
    ("mapped", "mapped memory of the ranks", 2**20, "MiB"),
    ("fds", "open file descriptors", 1, ""),
    ("threads", "threads", 1, ""),
    ("disk", "run folder on disk", 2**20, "MiB"),
]


def env():
    e = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return e


def rank_pids(config):
    out = subprocess.run(["pgrep", "-f", rf"^\S*hearth run {config}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def status_field(pid, name):
    """A `/proc/PID/status` field in bytes (kB fields) or as a count."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            value = line.split()[1:]
            return int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    raise KeyError(name)


def disk_use(folder):
    """Bytes the folder takes on disk (allocated blocks, as `du`)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # rotated away while walking
    return total


def sample(pids, run_dir):
    row = dict(rss=0, mapped=0, fds=0, threads=0)
    for pid in pids:
        row["rss"] += status_field(pid, "VmRSS")
        row["mapped"] += status_field(pid, "VmSize")
        row["threads"] += status_field(pid, "Threads")
        row["fds"] += len(os.listdir(f"/proc/{pid}/fd"))
    row["disk"] = disk_use(run_dir)
    return row


READ_EVERY = 5.0


def minute(config, run_dir, until):
    """One sample from readings every READ_EVERY seconds until `until`:
    the peak of memory, the floor of descriptors, threads and disk
    (None when no reading found both ranks)."""
    readings = []
    while True:
        pids = rank_pids(config)
        if len(pids) == 2:
            try:
                readings.append(sample(pids, run_dir))
            except (FileNotFoundError, ProcessLookupError, KeyError):
                pass
        if time.time() + READ_EVERY > until:
            break
        time.sleep(READ_EVERY)
    time.sleep(max(0.0, until - time.time()))
    if not readings:
        return None
    peak = {k: max(r[k] for r in readings) for k in ("rss", "mapped")}
    floor = {k: min(r[k] for r in readings) for k in ("fds", "threads", "disk")}
    return {**peak, **floor}


def windows(samples, duration):
    """(baseline samples, end samples): after the warm-up (a sixth of the
    run, ten minutes at most), the next five minutes (a twelfth at most),
    and the last five."""
    warm = min(600.0, duration / 6)
    span = min(300.0, duration / 12)
    base = [s for s in samples if warm <= s["t"] < warm + span]
    end = [s for s in samples if s["t"] >= samples[-1]["t"] - span]
    return base, end


def growth_table(samples, duration):
    base, end = windows(samples, duration)
    if len(base) < 2 or len(end) < 2:
        sys.exit(f"too few samples ({len(samples)}) for a baseline and an end: soak longer")
    rows, failed = [], []
    for key, what, div, unit in METRICS:
        b = statistics.median(s[key] for s in base)
        e = statistics.median(s[key] for s in end)
        peak = max(s[key] for s in samples if s["t"] >= base[0]["t"])
        growth = (e - b) / b if b else 0.0
        rows.append((what, b / div, e / div, peak / div, unit, growth))
        if growth > GROWTH_LIMIT:
            failed.append(f"{what} grew {growth:+.1%} ({b / div:.1f} → {e / div:.1f} {unit})")
    return rows, failed


def markdown(samples, rows, duration, steps, stop):
    lines = [
        f"Soak of {duration / 3600:.2f} h, 2 MPI ranks, bench GPT saving every 50 steps "
        f"(keep 3), tensorboard + jsonl trackers, manifest-sha256 hook; "
        f"{steps} steps, {len(samples)} samples. Stop: {stop}.",
        "",
        "Each sample: the minute's peak memory, and the descriptors, threads and disk held all minute (read every 5 s).",
        "",
        "| minute | resident MiB | mapped MiB | fds | threads | disk MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    every = max(1, len(samples) // 12)
    shown = samples[::every] + ([samples[-1]] if (len(samples) - 1) % every else [])
    for s in shown:
        lines.append(
            f"| {s['t'] / 60:.0f} | {s['rss'] / 2**20:.1f} | {s['mapped'] / 2**20:.0f} | "
            f"{s['fds']} | {s['threads']} | {s['disk'] / 2**20:.1f} |"
        )
    lines += ["", "| | baseline (median) | end (median) | peak | growth |", "|---|---:|---:|---:|---:|"]
    for what, b, e, peak, unit, growth in rows:
        u = f" {unit}" if unit else ""
        lines.append(f"| {what} | {b:.1f}{u} | {e:.1f}{u} | {peak:.1f}{u} | {growth:+.1%} |")
    return "\n".join(lines) + "\n"


def last_step(run_dir):
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    lines = metrics.read_text().strip().splitlines()
    import json

    steps = [json.loads(line).get("step", 0) for line in lines if line.strip()]
    return max(steps, default=0)


def stop_politely(proc, config, run_dir):
    """SIGTERM to every rank: each saves and exits 75; the newest
    checkpoint must verify."""
    for pid in rank_pids(config):
        os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return "did not stop within 300 s of SIGTERM"
    folder = run_dir / "checkpoints"
    names = sorted((p for p in folder.glob("checkpoint_*")), key=lambda p: int(p.name.split("_")[1]))
    if not names:
        return f"exit {proc.returncode}, no checkpoint"
    verify = subprocess.run([str(HEARTH), "checkpoint", "verify", str(names[-1])], capture_output=True, text=True)
    if proc.returncode != 75 or verify.returncode != 0:
        return f"exit {proc.returncode}; verify of {names[-1].name}: {verify.stdout.strip()} {verify.stderr.strip()}"
    return f"SIGTERM → exit 75, {names[-1].name} verified"


def main():
    hours = float(os.environ.get("SOAK_HOURS", "1"))
    every = float(os.environ.get("SOAK_SAMPLE_SECONDS", "60"))
    out = pathlib.Path(os.environ.get("SOAK_OUT", "."))
    if not HEARTH.exists():
        sys.exit(f"{HEARTH} is missing: run `make build` first")
    duration = hours * 3600
    work = pathlib.Path(tempfile.mkdtemp(prefix="hearth-soak-long-"))
    config = work / "soak.toml"
    config.write_text(job())
    run_dir = work / "runs" / "soak"
    command = ["mpirun", "--oversubscribe", "-n", "2", str(HEARTH), "run", str(config), "--cpu", "-q",
               "--plugin-dir", str(PLUGINS)]
    log = open(work / "soak.log", "w")
    proc = subprocess.Popen(command, cwd=work, env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    samples, started = [], time.time()
    try:
        until = started
        while time.time() - started < duration:
            until += every
            if proc.poll() is not None:
                log.flush()
                sys.exit(f"the run ended early (exit {proc.returncode}):\n{(work / 'soak.log').read_text()[-3000:]}")
            row = minute(config, run_dir, until)
            if row is None:
                continue
            row["t"] = time.time() - started
            samples.append(row)
            print(f"{row['t'] / 60:6.1f} min  rss {row['rss'] / 2**20:7.1f} MiB  mapped {row['mapped'] / 2**20:7.0f} MiB  "
                  f"fds {row['fds']:4}  threads {row['threads']:3}  disk {row['disk'] / 2**20:6.1f} MiB", flush=True)
        steps = last_step(run_dir)
        stop = stop_politely(proc, config, run_dir)
        rows, failed = growth_table(samples, duration)
        out.mkdir(parents=True, exist_ok=True)
        keys = ["t", "rss", "mapped", "fds", "threads", "disk"]
        (out / "soak-long.csv").write_text(
            ",".join(keys) + "\n" + "".join(",".join(f"{s[k]:.0f}" for k in keys) + "\n" for s in samples))
        table = markdown(samples, rows, duration, steps, stop)
        (out / "soak-long.md").write_text(table)
        print(table)
        if failed or "exit 75" not in stop:
            for f in failed:
                print("GREW:", f)
            if "exit 75" not in stop:
                print("STOP FAILED:", stop)
            sys.exit(1)
        print(f"no growth above {GROWTH_LIMIT:.0%}; wrote {out / 'soak-long.csv'} and {out / 'soak-long.md'}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
