"""`make bench`: every performance measure of hearth against its peer, each
measured in this run on this machine, in one table; the table and the
machine's description go to BENCHMARKS.md (the last figures).

Rows (issues 22, 44): tokens/s of the tiny GPT and of a user's transformers
GPT-2 against Accelerate eager and compiled (cpu_rows.py: n, median and
min–max of the per-round ratios), a whole tiny process's wall time and peak RSS
(Accelerate, and the same job in plain tch), what a scheduler and three trackers logging every step cost
(the same run without plugins), save_state of 3 GB fsync'd (Accelerate, and
the disk's own fsync'd write speed by dd) and the async save's time to
commit (the blocking save), a process's first and one after another; the
tokens loader's rate (the bench GPT's consumption) and tokenizing 100 MB
of JSON Lines (Python tokenizers' encode_batch). A benchmark, not a test: nothing is asserted.
Usage: python table.py [ROUNDS]   (ROUNDS of each, 7 by default; the
plugin row takes PLUGIN_ROUNDS and the checkpoint rows CHECKPOINT_ROUNDS)
"""
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import data_loading  # noqa: E402
import cpu_rows  # noqa: E402
import plugin_overhead  # noqa: E402
import save_state_vs_accelerate  # noqa: E402

med = statistics.median
# The plugin row's rounds (its runs are short and noisy) and the checkpoint
# rows' (one per place in the rotating order of dd, Accelerate, blocking
# and async saves).
PLUGIN_ROUNDS = 8
CHECKPOINT_ROUNDS = 4
# Each CPU throughput row's goal against each peer (issue 44); the malloc
# peer has none: it tells the allocator's share of the lead apart.
GOALS = {
    ("gpt-1", "eager"): "≥ 1.10×", ("gpt-1", "compiled"): "≥ 1.0×",
    ("gpt-2", "eager"): "≥ 1.35×", ("gpt-2", "compiled"): "≥ 1.0×",
    ("gpt-1-bf16", "eager"): "≥ 1.10×", ("gpt-1-bf16", "compiled"): "≥ 1.0×",
    **{(row, "eager"): "≥ 1.15×" for row in ("gpt2-1", "gpt2-2", "gpt2-1-bf16", "gpt2-2-bf16")},
    **{(row, "compiled"): "≥ 1.0×" for row in ("gpt2-1", "gpt2-2", "gpt2-1-bf16", "gpt2-2-bf16")},
}
# The data rows' rounds (tokenizing 100 MB takes ~30 s a side here).
DATA_ROUNDS = 3


# The CPU flags that change which kernels run (libtorch's, oneDNN's, hearth's).
VECTOR_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16",
                "amx_bf16": "AMX"}


def machine() -> str:
    """CPU model, its vector flags, cores, memory and OS, in one line."""
    model, flags = "unknown CPU", set()
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown CPU":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    vector = ", ".join(name for flag, name in VECTOR_FLAGS.items() if flag in flags) or "no AVX2"
    mem_kib = int(pathlib.Path("/proc/meminfo").read_text().split()[1])
    import torch

    return (f"{model} ({vector}), {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB, "
            f"{platform.system()} {platform.release()}, torch {torch.__version__}, no GPU")


def spread(ratios: list[float], digits: int = 2) -> str:
    """The median of per-round ratios in bold, then n and their min–max."""
    f = f"{{:.{digits}f}}"
    return f"**{f.format(med(ratios))}×** (n {len(ratios)}, {f.format(min(ratios))}–{f.format(max(ratios))})"


def per_round(ours: list[float], theirs: list[float]) -> list[float]:
    return [a / b for a, b in zip(ours, theirs)]


def rows(rounds: int) -> list[dict]:
    out = []

    def row(measure, hearth, peer, ratio, goal):
        out.append(dict(measure=measure, hearth=hearth, peer=peer, ratio=ratio, goal=goal))
        print(f"== {measure}: hearth {hearth}, peer {peer}, ratio {ratio}", flush=True)

    consumed = None
    for name in cpu_rows.ROWS:
        result = cpu_rows.measure(name, rounds)
        print("\n".join(cpu_rows.summary(name, result)), flush=True)
        h = med(result["rates"]["hearth"])
        consumed = consumed or h
        for peer in list(result["rates"])[1:]:
            r = cpu_rows.ratios(result, peer)
            warm = result["warmups"][peer]
            compile_note = (f" (first 10 steps with the compile {med(warm):.0f} s, left out)"
                            if peer == "compiled" else "")
            row(cpu_rows.describe(name), f"{h:,.0f}",
                f"{cpu_rows.PEER_NAMES[peer]} {med(result['rates'][peer]):,.0f}{compile_note}",
                spread(r), GOALS.get((name, peer), "—"))

    # In a process of its own: this one has torch loaded, and a child's
    # peak RSS would start from this process's (see that file).
    runs = json.loads(subprocess.run(
        [sys.executable, HERE / "startup_vs_accelerate.py", str(max(rounds, 5)), "--json"],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    # Beside the peer, the same job in plain tch, and libtorch's load alone
    # (`hearth --version`): the part no program linking libtorch can shed.
    def against(key, side):
        return per_round(runs["hearth"][key], runs[side][key])

    def load_share(key):
        return med(per_round(runs["load"][key], runs["peer"][key]))

    h, p, b, l = (med(runs[side]["wall"]) for side in ("hearth", "peer", "bare", "load"))
    row("whole process: start → 1 fused AdamW step → model.safetensors → exit",
        f"{h:.2f} s (libtorch's load alone {l:.2f} s)", f"Accelerate {p:.2f} s; bare tch {b:.2f} s",
        f"{spread(against('wall', 'peer'))} Accelerate (the load alone {load_share('wall'):.2f}×), "
        f"{spread(against('wall', 'bare'))} bare tch", "≤ 0.10×")
    h, p, b, l = (med(runs[side]["rss"]) / 2**20 for side in ("hearth", "peer", "bare", "load"))
    row("peak memory of that process", f"{h:.0f} MiB (libtorch's load alone {l:.0f} MiB)",
        f"Accelerate {p:.0f} MiB; bare tch {b:.0f} MiB",
        f"{spread(against('rss', 'peer'))} Accelerate (the load alone {load_share('rss'):.2f}×), "
        f"{spread(against('rss', 'bare'))} bare tch", "≤ 0.25×")

    # Runs of the same binary vary by a few per cent here: more rounds, and
    # the median of each round's ratio (its two runs back to back). That
    # noise hides a fraction of a per cent, so beside it: what the plugged
    # runs' own accounts say the plugin calls took (plugin_overhead.py).
    bare, plugged, shares = plugin_overhead.measure(PLUGIN_ROUNDS)
    b, p = med(bare), med(plugged)
    costs = [with_ / without - 1 for with_, without in zip(plugged, bare)]
    row("plugin cost: scheduler + jsonl/tensorboard/mlflow every step",
        f"{p:,.0f} tokens/s; calls {med(shares) * 100:.2f} % of the steps", f"no plugins {b:,.0f}",
        f"**{med(costs) * 100:+.1f} %** end to end (n {len(costs)}, {min(costs) * 100:+.1f}–{max(costs) * 100:+.1f} %); "
        f"**{med(shares) * 100:.2f} %** by the calls' account", "≤ 0.5 %")

    results = save_state_vs_accelerate.measure(CHECKPOINT_ROUNDS, sharded=False)
    dd = med(r["gbps"] for r in results["dd"])
    h = med(r["gbps"] for r in results["hearth"])
    a = med(r["gbps"] for r in results["accelerate"])
    gbps = {side: [r["gbps"] for r in results[side]] for side in ("hearth", "accelerate", "dd")}
    row("save_state 3 GB, fsync'd", f"{h:.2f} GB/s", f"Accelerate {a:.2f} GB/s; dd {dd:.2f} GB/s",
        f"{spread(per_round(gbps['hearth'], gbps['accelerate']))} Accelerate, "
        f"{spread(per_round(gbps['hearth'], gbps['dd']))} dd", "≥ 0.9× dd")
    blocking = med(r["save"] for r in results["hearth"])
    for key, measure in (("hearth async", "async save, a process's first: time to commit (training blocked)"),
                         ("hearth async again", "async save after another (buffers reused): the same")):
        total = med(r["save"] for r in results[key])
        returned = med(r["returned"] for r in results[key])
        ratios = [a["save"] / s["save"] for a, s in zip(results[key], results["hearth"])]
        row(measure, f"{total:.2f} s ({returned:.2f} s blocked)", f"blocking save {blocking:.2f} s",
            f"{spread(ratios)}; blocked {returned / 3.0:.2f} s/GB", "≤ 1.2×; ≤ 0.4 s/GB")
    data = data_loading.measure(DATA_ROUNDS)
    rate = med(data["loader"])
    row("tokens loader (nanoGPT .bin, random windows of the bench GPT's 16 × 128), 1 process",
        f"{rate:,.0f} tokens/s", f"the bench GPT consumes {consumed:,.0f} tokens/s",
        spread([r / consumed for r in data["loader"]], 0), "≥ 50×")
    h, p = med(data["hearth"]), med(data["python"])
    row("tokenize 100 MB of JSON Lines into the token cache (same ids, same threads)",
        f"{h:.1f} s", f"Python tokenizers' encode_batch {p:.1f} s",
        f"{spread(per_round(data['python'], data['hearth']))} as fast", "≥ 1.0×")
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| measure | hearth | peer | ratio (n, min–max) | goal |", "|---|---|---|---|---|"]
    lines += [f"| {r['measure']} | {r['hearth']} | {r['peer']} | {r['ratio']} | {r['goal']} |" for r in table]
    return "\n".join(lines)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    table = markdown(rows(rounds))
    print()
    print(table)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # Sections other benchmarks write (`<!-- begin NAME -->` … `<!-- end NAME -->`,
    # make bench-fsdp's) are kept.
    path = ROOT / "BENCHMARKS.md"
    previous = path.read_text() if path.exists() else ""
    kept = previous[previous.index("<!-- begin "):] if "<!-- begin " in previous else ""
    path.write_text(
        "# Benchmarks\n\n"
        "The last figures of `make bench` (examples/bench/table.py): hearth against its peer, "
        "both measured in the same run, medians; a ratio in bold is hearth's. Rewritten by every "
        "`make bench`.\n\n"
        f"- when: {when}, commit {commit}\n"
        f"- machine: {machine()}\n"
        f"- rounds: {rounds} (plugin row {PLUGIN_ROUNDS}, checkpoint rows {CHECKPOINT_ROUNDS}, data rows {DATA_ROUNDS}, "
        "each round in another order); the debug `hearth` of `make build` "
        "(dependencies optimised), the release `save_state` example\n\n"
        f"{table}\n" + (f"\n{kept}" if kept else ""))
    print(f"\nwritten to {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()
