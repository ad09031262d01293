"""hearth vs Hugging Face Accelerate on the same tiny GPT, in one run.

Runs `hearth run examples/bench-gpt.toml` and the peer script
(shared/bench/peer_gpt_accelerate.py) alternately, ROUNDS times each, and
prints tokens/s of both and their ratio. With PROCS > 1 both train data
parallel in PROCS processes: `hearth launch -n PROCS --cpu` (MPI) against
`torchrun --nproc_per_node PROCS` (gloo). A benchmark, not a test: nothing
is asserted. Usage: make bench  (or: python gpt_vs_accelerate.py [ROUNDS] [PROCS])
"""
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
from peer_gpt import peer_script  # noqa: E402  (shared/bench, found as the tests find it)
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
STEPS = 60


def hearth_tokens_per_sec(out_dir: pathlib.Path, procs: int) -> float:
    flags = ["--quiet", "--steps", str(STEPS), "--output-dir", out_dir]
    config = ROOT / "examples" / "bench-gpt.toml"
    if procs == 1:
        cmd = [HEARTH, "run", config, "--cpu", *flags]
    else:
        cmd = [HEARTH, "launch", "-n", str(procs), "--cpu", config, "--", *flags]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads((out_dir / "bench-gpt" / "summary.json").read_text())["tokens_per_sec"]


def peer_tokens_per_sec(procs: int) -> float:
    if procs == 1:
        cmd = [sys.executable, peer_script(), str(STEPS)]
    else:
        torchrun = pathlib.Path(sys.executable).parent / "torchrun"
        cmd = [torchrun, "--nproc_per_node", str(procs), peer_script(), str(STEPS)]
    out = subprocess.run(
        cmd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(re.search(r"tokens/s=(\d+)", out).group(1))


def measure(rounds: int, procs: int) -> tuple[list, list]:
    """tokens/s of hearth and of the peer, ROUNDS alternating runs each."""
    ours, peer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            ours.append(hearth_tokens_per_sec(pathlib.Path(tmp) / f"r{i}", procs))
            peer.append(peer_tokens_per_sec(procs))
            print(f"round {i + 1}: hearth {ours[-1]:.0f} tokens/s, accelerate {peer[-1]:.0f} tokens/s")
    return ours, peer


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    procs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    ours, peer = measure(rounds, procs)
    h, a = statistics.median(ours), statistics.median(peer)
    print(f"tiny GPT (V=256 T=128 d=128 L=4 H=4 B=16 per process, AdamW), {procs} process(es), median of {rounds}:")
    print(f"  hearth     {h:9.0f} tokens/s")
    print(f"  accelerate {a:9.0f} tokens/s")
    print(f"  ratio hearth/accelerate = {h / a:.2f}")


if __name__ == "__main__":
    main()
