"""FULL_SHARD of a user's traced model against DDP, in one run: the 103M
traced Llama of traced_llama.py (transformers, torch.jit.trace), cut at
its decoder layers.

1. Memory: 3 AdamW steps of 2 x 64 bytes of text per process, the run
   saving a checkpoint at its last step (FULL_SHARD: SHARDED_STATE_DICT)
   and writing model.safetensors: the peak resident memory of each
   process over the whole run (load, steps, save), sampled from /proc,
   on 2 and 4 processes. The ratio is FULL_SHARD's largest process
   against DDP's.
2. Speed: tokens/s on 2 processes, FULL_SHARD with forward and backward
   prefetch against DDP, ROUNDS rounds alternately, at 2 x 64 (the memory
   rows' batch) and at 8 x 128 tokens per process.

A benchmark, not a test: nothing is asserted. The rows go to the
`bench-fsdp` section of BENCHMARKS.md.
Usage: make bench-fsdp  (or: python traced_llama_fsdp.py [ROUNDS])
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
import text_data  # noqa: E402
import traced_llama  # noqa: E402
from fsdp_vs_torch import HEARTH, peak_rss_of_children  # noqa: E402

SECTION = "bench-fsdp traced Llama"
FULL_SHARD = """
[fsdp]
sharding-strategy = "FULL_SHARD"
state-dict-type = "SHARDED_STATE_DICT"
forward-prefetch = true
backward-prefetch = "BACKWARD_PRE"
auto-wrap-policy = "transformer-based"
transformer-cls-names-to-wrap = ["LlamaDecoderLayer"]
"""


def job(model: pathlib.Path, corpus: pathlib.Path, fsdp: bool, steps: int, batch: int, seq: int) -> str:
    return f"""
[run]
name = "bench"
steps = {steps}
save-every = {steps}
log-every = {steps}

[model]
kind = "torchscript"
path = "{model}"

[data]
kind = "text-file"
path = "{corpus}"
seq-len = {seq}
batch-size = {batch}

[optimizer]
kind = "adamw"
lr = 1e-4

[eval]
batch-size = 2
{FULL_SHARD if fsdp else ""}
[distributed]
timeout = 300
"""


def run(tmp: pathlib.Path, text: str, procs: int) -> tuple[dict, list[float]]:
    """One `hearth launch` of `text`: its summary and each process's peak RSS (GiB)."""
    config = tmp / "job.toml"
    config.write_text(text)
    out = tmp / "out"
    subprocess.run(["rm", "-rf", out], check=True)
    cmd = [HEARTH, "launch", "-n", str(procs), "--cpu", config, "--", "--quiet", "--output-dir", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks = peak_rss_of_children(proc, "hearth")
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err.decode())
    summary = json.loads((out / "bench" / "summary.json").read_text())
    return summary, [p / 2**30 for p in peaks.values()]


def memory_rows(tmp, model, corpus) -> list[str]:
    rows = []
    for procs in (2, 4):
        ddp, ddp_peaks = run(tmp, job(model, corpus, False, 3, 2, 64), procs)
        fsdp, fs_peaks = run(tmp, job(model, corpus, True, 3, 2, 64), procs)
        goal = "≤ 0.5×" if procs == 2 else "≤ 0.35×"
        rows.append(
            f"| peak RSS per process, {procs} processes (3 steps of 2 × 64, load to save) "
            f"| {max(fs_peaks):.2f} GiB (least {min(fs_peaks):.2f}) | DDP {max(ddp_peaks):.2f} GiB "
            f"| **{max(fs_peaks) / max(ddp_peaks):.2f}×** | {goal} |")
        print(rows[-1], flush=True)
        print(f"  FULL_SHARD gradient_sync {fsdp['gradient_sync']}, memory {fsdp['memory']}", flush=True)
    return rows


def speed_rows(tmp, model, corpus, rounds: int) -> list[str]:
    rows = []
    for batch, seq in ((2, 64), (8, 128)):
        ddp, fsdp = [], []
        for r in range(rounds):
            # Each round in the other order.
            for fs in ((False, True) if r % 2 == 0 else (True, False)):
                summary, _ = run(tmp, job(model, corpus, fs, 8, batch, seq), 2)
                (fsdp if fs else ddp).append(summary["tokens_per_sec"])
            print(f"  {batch} x {seq}, round {r + 1}: DDP {ddp[-1]:.0f}, FULL_SHARD {fsdp[-1]:.0f} tokens/s", flush=True)
        ratios = [f / d for f, d in zip(fsdp, ddp)]
        rows.append(
            f"| tokens/s, 2 processes, {batch} × {seq} per process, prefetch on "
            f"| {statistics.median(fsdp):,.0f} | DDP {statistics.median(ddp):,.0f} "
            f"| **{statistics.median(ratios):.2f}×** (n {rounds}, {min(ratios):.2f}–{max(ratios):.2f}) | ≥ 0.85× |")
        print(rows[-1], flush=True)
    return rows


def write_section(body: str, section: str = SECTION) -> None:
    """Replaces a benchmark's section of BENCHMARKS.md (or adds it)."""
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- begin {section} -->", f"<!-- end {section} -->"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        built = traced_llama.build(tmp / "llama")
        corpus = tmp / "corpus.txt"
        corpus.write_bytes(text_data.TEXT * 2)
        rows = memory_rows(tmp, built["traced"], corpus) + speed_rows(tmp, built["traced"], corpus, rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from table import machine  # noqa: E402 (the same machine line as make bench)
    body = (
        "## `make bench-fsdp`: a user's traced Llama, FULL_SHARD against DDP\n\n"
        "examples/bench/traced_llama_fsdp.py: the 103M-parameter transformers Llama of "
        "examples/bench/traced_llama.py (d 1024, 8 layers, 16 heads, SwiGLU 2816, vocab 256), "
        "traced, cut at its `LlamaDecoderLayer`s; FULL_SHARD with forward and backward prefetch "
        "and a SHARDED_STATE_DICT checkpoint, DDP beside it in the same run. Rewritten by every "
        "`make bench-fsdp`.\n\n"
        f"- when: {when}, commit {commit}\n- machine: {machine()}\n- rounds: {rounds} (speed rows)\n\n"
        "| measure | FULL_SHARD | peer | ratio | goal |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_section(body)
    print(f"\nwritten to {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
