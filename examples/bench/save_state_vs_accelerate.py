"""hearth vs Hugging Face Accelerate: save_state / load_state of the same
~1 GB fp32 model with its AdamW state (~3 GB on disk) on the CPU, in one run.

Runs the peer script (shared/bench/peer_save_state.py) and hearth's
(host/bench/src/bin/save_state.rs, sync — also with content hashes off,
HEARTH_CHECKPOINT_HASHES=off, to price them — and async, and SHARD_GRAD_OP with
SHARDED_STATE_DICT on 4 processes under mpirun, each writing its quarter)
alternately, ROUNDS times, each round in another order, and prints the
medians and the ratios. Both time the save up to a finished
`sync` of the disk. A benchmark, not a test: nothing is asserted.
Usage: make bench-checkpoint  (or: python save_state_vs_accelerate.py [ROUNDS])
"""
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
from peer_gpt import shared_bench_file  # noqa: E402

HEARTH = ROOT / "target" / "release" / "save_state"


def parse(line: str) -> dict:
    out = {k: float(v) for k, v in re.findall(r"(save|load|returned)=([0-9.]+)s", line)}
    out["gbps"] = float(re.search(r"\(([0-9.]+) GB/s\)", line).group(1))
    return out


MPIRUN = ["mpirun", "--oversubscribe", "-n", "4"]
os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(cmd, env=None) -> dict:
    text = subprocess.run(cmd, check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}).stdout.strip().splitlines()[-1]
    print("  " + text[:160])
    return parse(text)


def dd_write(folder: str, gigabytes: int = 3) -> dict:
    """The disk's own fsync'd sequential write speed: dd of GIGABYTES of
    zeros in 64 MiB blocks with conv=fsync (dd's own figure)."""
    target = pathlib.Path(folder) / "dd.bin"
    text = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={gigabytes * 16}", "conv=fsync"],
        check=True, capture_output=True, text=True).stderr
    target.unlink()
    copied, seconds = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", text).groups()
    print(f"  dd: {int(copied) / 1e9:.2f} GB in {float(seconds):.2f} s")
    return {"save": float(seconds), "gbps": int(copied) / 1e9 / float(seconds)}


def measure(rounds: int, sharded: bool = True) -> dict:
    """Each side's parsed lines ({save, load, gbps, returned}), ROUNDS each,
    and `dd`, the disk's own fsync'd write speed in the same rounds."""
    peer = shared_bench_file("peer_save_state.py")
    if peer is None:
        sys.exit("shared/bench/peer_save_state.py not found (set HEARTH_SHARED_DIR)")
    results = {"accelerate": [], "hearth": [], "hearth, no hashes": [], "hearth async": [], "hearth async again": [], "dd": []}
    if sharded:
        results["hearth sharded×4"] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {
            "dd": lambda: dd_write(tmp),
            "accelerate": lambda: run([sys.executable, str(peer), f"{tmp}/peer"]),
            "hearth": lambda: run([str(HEARTH), f"{tmp}/hearth", "sync"]),
            # The same save and load without content hashes: what they cost.
            "hearth, no hashes": lambda: run([str(HEARTH), f"{tmp}/hearth", "sync"], {"HEARTH_CHECKPOINT_HASHES": "off"}),
            "hearth async": lambda: run([str(HEARTH), f"{tmp}/hearth", "async"]),
            # The second async save of a process (the first one's buffers reused).
            "hearth async again": lambda: run([str(HEARTH), f"{tmp}/hearth", "async-again"]),
        }
        if sharded:
            jobs["hearth sharded×4"] = lambda: run([*MPIRUN, str(HEARTH), f"{tmp}/sharded", "sharded"])
        names = list(jobs)
        for r in range(rounds):
            # Each round starts one later: a write right after another's 3 GB
            # meets a busier disk (this VM's varies 0.3-1.4 GB/s), so no side
            # keeps the worst place.
            order = names[r % len(names):] + names[:r % len(names)]
            print(f"round {r + 1}: {', '.join(order)}")
            for name in order:
                results[name].append(jobs[name]())
    return results


def main(rounds: int) -> None:
    results = measure(rounds)
    dd = statistics.median(r["gbps"] for r in results.pop("dd"))
    print(f"  dd, fsync'd: {dd:.2f} GB/s")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("save", "load", "gbps")} for k, v in results.items()}
    print(f"save_state of 252 M parameters + AdamW state (3.0 GB), median of {rounds}:")
    for k, m in med.items():
        print(f"  {k:<16} save {m['save']:.2f} s ({m['gbps']:.2f} GB/s), load {m['load']:.2f} s")
    for k in ("hearth async", "hearth async again"):
        returned = statistics.median(r["returned"] for r in results[k])
        print(f"  {k} returns to training after {returned:.2f} s")
    print(f"  ratio save GB/s hearth/accelerate = {med['hearth']['gbps'] / med['accelerate']['gbps']:.2f}")
    print(f"  ratio load time accelerate/hearth = {med['accelerate']['load'] / med['hearth']['load']:.2f}")
    bare = med["hearth, no hashes"]
    print(f"  content hashes cost: save time with/without = {med['hearth']['save'] / bare['save']:.3f}, "
          f"load time with/without = {med['hearth']['load'] / bare['load']:.3f}")
    sharded = med["hearth sharded×4"]
    print(f"  ratio save time 1 process full / 4 processes sharded = {med['hearth']['save'] / sharded['save']:.2f}")
    print(f"  ratio load time 1 process full / 4 processes sharded = {med['hearth']['load'] / sharded['load']:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
