"""LoRA against a full fine-tune of the same traced model, and against
Accelerate + peft, in one run: the 103M Llama of traced_llama.py with
PEFT's LoRA (r 8 on q_proj and v_proj: 0.25 % of the parameters), built
by tests/hf_lora.py (base, adapter, the PeftModel traced).

1. LoRA against its full fine-tune (`trainable = ["*"]` on the same
   traced PeftModel), 2 processes under DDP, 8 AdamW steps of 2 x 64
   sequential windows per process: the peak resident memory of the
   largest process over the whole run, the optimizer state and the
   gradient bytes sent (summary.json), and tokens/s.
2. hearth's LoRA against Accelerate + peft's (examples/bench/
   peft_lora_peer.py), 1 process, the same model and windows, 20 steps
   of 4 x 64 (the first 4 left out on both sides), ROUNDS rounds
   alternately: tokens/s.

A benchmark, not a test: nothing is asserted. The rows go to the
`bench-fsdp LoRA` section of BENCHMARKS.md.
Usage: make bench-fsdp  (or: python traced_llama_lora.py [ROUNDS])
"""
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
import hf_lora  # noqa: E402
import traced_llama  # noqa: E402
from fsdp_vs_torch import HEARTH, peak_rss_of_children  # noqa: E402
from traced_llama_fsdp import write_section  # noqa: E402

SECTION = "bench-fsdp LoRA"
STEPS, SEQ = 8, traced_llama.SEQ_LEN
# The speed row's steps: tokens/s leaves out the first 4 (warm-up) on both sides.
SPEED_STEPS = 20


def job(folder: pathlib.Path, batch: int, full: bool, steps: int = STEPS) -> str:
    return f"""
[run]
name = "bench"
steps = {steps}
log-every = {steps}

[model]
kind = "torchscript"
path = "{folder / 'lora.pt'}"
init-from = "{folder / 'base'}"
init-key-prefix = "m."
adapter-from = "{folder / 'adapter'}"
{'trainable = ["*"]' if full else ''}

[data]
kind = "tokens"
path = "{folder / 'text.npy'}"
vocab-size = 256
seq-len = {SEQ}
batch-size = {batch}
sampling = "sequential"

[optimizer]
kind = "adamw"
lr = 1e-4

[eval]
batch-size = 2
samples = 4

[distributed]
timeout = 300
"""


def run(tmp: pathlib.Path, text: str, procs: int) -> tuple[dict, float]:
    """One `hearth launch`: its summary and the largest process's peak RSS (GiB)."""
    config = tmp / "job.toml"
    config.write_text(text)
    out = tmp / "out"
    subprocess.run(["rm", "-rf", out], check=True)
    # One process as a user runs it (no launcher, no MPI).
    cmd = ([HEARTH, "run", config, "--cpu", "--quiet", "--output-dir", out] if procs == 1 else
           [HEARTH, "launch", "-n", str(procs), "--cpu", config, "--", "--quiet", "--output-dir", out])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks = peak_rss_of_children(proc, "hearth")
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err.decode())
    # (a process run directly is the one Popen started: not sampled)
    return json.loads((out / "bench" / "summary.json").read_text()), max(peaks.values(), default=0) / 2**30


def against_full(tmp, folder) -> list[str]:
    lora, lora_rss = run(tmp, job(folder, 2, False), 2)
    full, full_rss = run(tmp, job(folder, 2, True), 2)
    gib = 2**30
    pairs = [
        ("peak RSS per process", f"{lora_rss:.2f} GiB", f"{full_rss:.2f} GiB", lora_rss / full_rss),
        ("optimizer state per process", f"{lora['memory']['optimizer_bytes'] / 2**20:.1f} MiB",
         f"{full['memory']['optimizer_bytes'] / gib:.2f} GiB",
         lora["memory"]["optimizer_bytes"] / full["memory"]["optimizer_bytes"]),
        ("gradient bytes sent per process", f"{lora['gradient_sync']['bytes'] / 2**20:.1f} MiB",
         f"{full['gradient_sync']['bytes'] / gib:.2f} GiB",
         lora["gradient_sync"]["bytes"] / full["gradient_sync"]["bytes"]),
        ("tokens/s", f"{lora['tokens_per_sec']:,.0f}", f"{full['tokens_per_sec']:,.0f}",
         lora["tokens_per_sec"] / full["tokens_per_sec"]),
    ]
    rows = [f"| {what}, LoRA vs full fine-tune, 2 processes (DDP, {STEPS} steps of 2 × {SEQ}) "
            f"| {mine} | full {theirs} | **{ratio:.{4 if ratio < 0.01 else 2}f}×** |" for what, mine, theirs, ratio in pairs]
    for row in rows:
        print(row, flush=True)
    return rows


def against_peft(tmp, folder, rounds: int) -> list[str]:
    hearth, peer = [], []
    batch = 4
    for r in range(rounds):
        for mine in ((True, False) if r % 2 == 0 else (False, True)):
            if mine:
                summary, _ = run(tmp, job(folder, batch, False, SPEED_STEPS), 1)
                hearth.append(summary["tokens_per_sec"])
            else:
                done = subprocess.run([sys.executable, HERE / "peft_lora_peer.py", folder, str(SPEED_STEPS), str(batch), str(SEQ)],
                                      capture_output=True, text=True, check=True)
                peer.append(json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_sec"])
        print(f"  round {r + 1}: hearth {hearth[-1]:.0f}, Accelerate + peft {peer[-1]:.0f} tokens/s", flush=True)
    ratios = [h / p for h, p in zip(hearth, peer)]
    row = (f"| tokens/s, LoRA, 1 process, {SPEED_STEPS} steps of {batch} × {SEQ} | {statistics.median(hearth):,.0f} "
           f"| Accelerate + peft {statistics.median(peer):,.0f} "
           f"| **{statistics.median(ratios):.2f}×** (n {rounds}, {min(ratios):.2f}–{max(ratios):.2f}) |")
    print(row, flush=True)
    return [row]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        folder = tmp / "lora"
        hf_lora.build(folder, SEQ, **traced_llama.SIZES)
        rows = against_full(tmp, folder) + against_peft(tmp, folder, rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from table import machine  # noqa: E402 (the same machine line as make bench)
    body = (
        "## `make bench-fsdp`: LoRA on a user's traced Llama\n\n"
        "examples/bench/traced_llama_lora.py: the 103M Llama of examples/bench/traced_llama.py with "
        "PEFT's LoRA (r 8, alpha 16, on q_proj and v_proj: 0.25 % of the parameters), traced from the "
        "PeftModel; `init-from` the base, `adapter-from` the adapter; sequential windows of real text. "
        "Rewritten by every `make bench-fsdp`.\n\n"
        f"- when: {when}, commit {commit}\n- machine: {machine()}\n- rounds: {rounds} (the Accelerate + peft row)\n\n"
        "| measure | LoRA | peer | ratio |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_section(body, SECTION)
    print(f"\nwritten to {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
