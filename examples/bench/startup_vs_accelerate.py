"""Whole-process cost of a tiny job, hearth vs Accelerate, in one run.

Each side starts a process that builds the peer benchmark's GPT, takes one
AdamW step on one batch, writes model.safetensors and exits:
`hearth run examples/bench-gpt.toml --steps 1` against this file's `peer`
mode (Accelerator(cpu=True), prepare, backward, step, save_model), and
against the same job in plain tch (`bare_tch_gpt`, host/bench: the floor
a Rust program linking libtorch starts from), and against `hearth --version`,
which does nothing but is loaded: libtorch's load alone (the dynamic linker
and libtorch's static initialisers, which register its operators), the part
of each figure no program linking libtorch can shed. Reports the median wall time
and the median peak RSS (the child's ru_maxrss, from wait4) of ROUNDS
alternating runs, and their ratios. A benchmark, not a test: nothing is
asserted.

Linux carries a process's peak RSS across exec (exec_mmap keeps the old
image's high-water mark), so a child forked from a parent that has torch
loaded reports at least the parent's RSS: run this file in a process of its
own (`table.py` does, with --json), never import it into one that has torch.
Usage: python startup_vs_accelerate.py [ROUNDS] [--json]   (make bench runs it)
"""
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
BARE = ROOT / "target" / "debug" / "bare_tch_gpt"


def timed(cmd) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes of one process run to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def hearth_cmd(out: pathlib.Path) -> list:
    return [HEARTH, "run", ROOT / "examples" / "bench-gpt.toml", "--cpu", "--quiet",
            "--steps", "1", "--output-dir", out]


def peer_cmd(out: pathlib.Path) -> list:
    return [sys.executable, __file__, "peer", out]


def bare_cmd(out: pathlib.Path) -> list:
    return [BARE, out]


def load_cmd(out: pathlib.Path) -> list:
    return [HEARTH, "--version"]


def peer(out: str) -> None:
    """The peer's process: the bench GPT, one fused AdamW step, save_model."""
    sys.path.insert(0, str(ROOT / "tests" / "oracles"))
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from peer_gpt import build

    acc = Accelerator(cpu=True)
    set_seed(0)
    vocab, block, batch = 256, 128, 16
    model = build(vocab, block, 128, 4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, vocab, (batch, block + 1))
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    acc.save_model(model, out)


def measure(rounds: int) -> dict:
    """{"hearth"|"peer"|"bare"|"load": {"wall": [s...], "rss": [bytes...]}}."""
    if not BARE.exists():
        raise SystemExit(f"{BARE} is missing: cargo build -p hearth-bench --bin bare_tch_gpt (make bench does)")
    sides = (("hearth", hearth_cmd), ("peer", peer_cmd), ("bare", bare_cmd), ("load", load_cmd))
    runs = {side: {"wall": [], "rss": []} for side, _ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            # Each round in another order: the sides rotated.
            for side, cmd in sides[i % len(sides):] + sides[: i % len(sides)]:
                out = pathlib.Path(tmp) / f"{side}-{i}"
                wall, rss = timed(cmd(out))
                saved = list(out.rglob("model.safetensors"))
                if not saved and side != "load":
                    raise SystemExit(f"{side} wrote no model.safetensors under {out}")
                runs[side]["wall"].append(wall)
                runs[side]["rss"].append(rss)
    return runs


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--json"]
    rounds = int(args[0]) if args else 5
    runs = measure(rounds)
    if "--json" in sys.argv:
        print(json.dumps(runs))
        return
    med = statistics.median
    print(f"start -> 1 AdamW step -> model.safetensors -> exit, median of {rounds}:")
    for key, unit, scale in (("wall", "s", 1), ("rss", "MiB", 2**20)):
        h, p, b, l = (med(runs[side][key]) / scale for side in ("hearth", "peer", "bare", "load"))
        print(f"  {key}: hearth {h:.2f} {unit}, accelerate {p:.2f} {unit} ({h / p:.2f}x), "
              f"bare tch {b:.2f} {unit} ({h / b:.2f}x); libtorch's load alone {l:.2f} {unit} ({l / p:.2f}x)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "peer":
        peer(sys.argv[2])
    else:
        main()
