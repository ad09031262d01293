"""The CPU throughput rows of `make bench`: hearth against the peers a
PyTorch expert would pick, each side run ROUNDS times, every round in
another order (the sides rotated), and each ratio given as n, the median
and the min–max of the per-round ratios (a round's hearth run against the
same round's peer run).

Rows (`ROWS`): the bench GPT (examples/bench-gpt.toml) in float32 on 1 and
2 processes and in bf16 on 1, and the user-model rows (user_model.py: a
transformers GPT-2 exported with `torch.jit.trace`) on 1 and 2 processes in
float32 and bf16; `LLAMA_ROWS` (make bench-llama): a traced transformers
Llama and Qwen2 (llama_model.py) likewise. Sides:

  hearth    `hearth run` (1 process) or `hearth launch -n 2 --cpu` (MPI)
  eager     the model under Accelerate, `AdamW(fused=True)` (cpu_peer.py)
  compiled  the same with `dynamo_backend="inductor"`, compile time apart;
            its first round runs torch.compile's default mode and
            "max-autotune-no-cudagraphs", and the faster is kept for the
            rest; a compile over COMPILE_CAP_S seconds stops it
  malloc    the eager peer under hearth's malloc settings (glibc's
            M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 256 MiB), to tell the
            allocator's share of hearth's lead from the rest

Two processes: both sides bind each rank to its own share of this
process's CPUs (k = CPUs / 2; mpirun mapped `slot:PE=k` and bound through
OMPI_MCA_* variables, the peer's ranks pinning themselves to CPUs
[LOCAL_RANK·k, (LOCAL_RANK+1)·k) under torchrun), both with
OMP_NUM_THREADS = k; mpirun's `--report-bindings` and the peer's CPUs are
printed. The compiled peer's first 10 steps (its compile) are given
apart; inductor's cache on disk makes later rounds' compiles shorter.
ROUNDS rounds are run, more (up to verdict.MAX_ROUNDS) while a ratio's
verdict against its goal is split (verdict.py). A benchmark, not a test:
nothing is asserted.
Usage: python cpu_rows.py [ROUNDS] [ROW...]   (table.py runs every row)
"""
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import llama_model  # noqa: E402
import user_model  # noqa: E402
import verdict  # noqa: E402

HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
BENCH_GPT = ROOT / "examples" / "bench-gpt.toml"
# hearth's own (host/ops: keep_freed_memory_for_reuse), as glibc's variables.
HEARTH_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}

# name: (model, processes, precision, sides)
ROWS = {
    "gpt-1": ("gpt", 1, "no", ["hearth", "eager", "compiled", "malloc"]),
    "gpt-2": ("gpt", 2, "no", ["hearth", "eager", "compiled"]),
    "gpt-1-bf16": ("gpt", 1, "bf16", ["hearth", "eager", "compiled"]),
    "gpt2-1": ("gpt2", 1, "no", ["hearth", "eager", "compiled"]),
    "gpt2-2": ("gpt2", 2, "no", ["hearth", "eager", "compiled"]),
    "gpt2-1-bf16": ("gpt2", 1, "bf16", ["hearth", "eager", "compiled"]),
    "gpt2-2-bf16": ("gpt2", 2, "bf16", ["hearth", "eager", "compiled"]),
}
LLAMA_ROWS = {
    f"{family}-{procs}{'-bf16' if precision == 'bf16' else ''}": (family, procs, precision,
                                                                  ["hearth", "eager", "compiled"])
    for family in llama_model.FAMILIES for procs in (1, 2) for precision in ("no", "bf16")
}
ALL_ROWS = {**ROWS, **LLAMA_ROWS}
# torch.compile's modes the compiled peer tries in its first round.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# The longest a compiled peer's run may take, its compile included.
COMPILE_CAP_S = 900
PEER_NAMES = {"eager": "Accelerate", "compiled": "Accelerate + inductor",
              "malloc": "Accelerate, hearth's malloc settings"}


def cpus_per_rank(procs: int) -> int:
    """The CPUs this process may use, shared out between the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // procs)


def bound_env(procs: int) -> dict:
    """Both sides' environment: equal threads, and for several processes
    each rank bound to its own CPUS_PER_RANK logical CPUs (mpirun: mapped
    by slot with that many processing elements, hardware threads counted as
    CPUs, bound to them, the binding reported; the peer: cpu_peer.py --bind)."""
    k = cpus_per_rank(procs)
    env = dict(os.environ, OMP_NUM_THREADS=str(k), CPUS_PER_RANK=str(k))
    if procs > 1:
        env.update(OMPI_MCA_hwloc_base_use_hwthreads_as_cpus="1",
                   OMPI_MCA_rmaps_base_mapping_policy=f"slot:PE={k}",
                   OMPI_MCA_hwloc_base_binding_policy="hwthread" if k == 1 else "core",
                   OMPI_MCA_hwloc_base_report_bindings="1")
    return env


def hearth_config(model: str, precision: str, folder: pathlib.Path) -> pathlib.Path:
    if model == "gpt2":
        return user_model.export(folder, precision)
    if model in llama_model.FAMILIES:
        return llama_model.export(folder, model, precision)
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "bench.toml"
    text = BENCH_GPT.read_text().replace('name = "bench-gpt"', 'name = "bench"')
    config.write_text(text.replace("[run]\n", f'[run]\nmixed-precision = "{precision}"\n', 1))
    return config


def run_hearth(config: pathlib.Path, procs: int, log: list) -> float:
    out = config.parent / "out"
    flags = ["--quiet", "--output-dir", out]
    if procs == 1:
        cmd = [HEARTH, "run", config, "--cpu", *flags]
    else:
        cmd = [HEARTH, "launch", "-n", str(procs), "--cpu", config, "--", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=bound_env(procs))
    if done.returncode != 0:
        raise SystemExit(f"hearth failed ({done.returncode}):\n{done.stderr[-3000:]}")
    # mpirun's --report-bindings lines, without the host and pid that
    # make each run's differ.
    log += [re.sub(r"\[[^\]\s]+:\d+\] ", "", line) for line in done.stderr.splitlines()
            if "bound to" in line or "not bound" in line]
    return json.loads((out / "bench" / "summary.json").read_text())["tokens_per_sec"]


def steps_of(model: str) -> int:
    """The steps hearth's job takes, which the peer takes too."""
    if model == "gpt2":
        return user_model.STEPS
    if model in llama_model.FAMILIES:
        return llama_model.STEPS
    return tomllib.loads(BENCH_GPT.read_text())["run"]["steps"]


def run_peer(model: str, side: str, procs: int, precision: str, log: list,
             mode: str = "default") -> tuple[float, float]:
    """(tokens/s, seconds of the warm-up steps: the compile, if any); a
    compiled run past COMPILE_CAP_S gives (0, the cap)."""
    args = [HERE / "cpu_peer.py", "--model", model, "--precision", precision,
            "--peer", "compiled" if side == "compiled" else "eager"]
    if side == "compiled" and mode != "default":
        args += ["--mode", mode]
    steps = ["--steps", str(steps_of(model))]
    if procs == 1:
        cmd = [sys.executable, *args, *steps]
    else:
        torchrun = pathlib.Path(sys.executable).parent / "torchrun"
        cmd = [torchrun, "--nproc_per_node", str(procs), *args, *steps, "--bind"]
    env = bound_env(procs)
    if side == "malloc":
        env.update(HEARTH_MALLOC)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=COMPILE_CAP_S if side == "compiled" else None)
    except subprocess.TimeoutExpired:
        log.append(f"{side} ({mode}): stopped at the {COMPILE_CAP_S} s cap")
        return 0.0, float(COMPILE_CAP_S)
    if done.returncode != 0:
        raise SystemExit(f"the {side} peer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    line = done.stdout.strip().splitlines()[-1]
    found = dict(re.findall(r"(\S+)=(\S+)", line))
    log.append(f"{side}: threads {found['threads']}, cores {found['cores']}")
    return float(found["tokens/s"]), float(found["warmup"])


def measure(row: str, rounds: int, goals: dict | None = None, fp32: dict | None = None) -> dict:
    """{side: [tokens/s per round]}, {side: [warm-up s]}, the compiled
    peer's mode, and the log. After `rounds` rounds, more while a peer's
    ratio is split against its goal in `goals` ({peer: "≥ 1.15×"}), up to
    verdict.MAX_ROUNDS; `fp32` is the float32 row's result for a bf16 row
    (its peers' best setting, see `judged_ratios`)."""
    model, procs, precision, sides = ALL_ROWS[row]
    rates = {side: [] for side in sides}
    warmups = {side: [] for side in sides if side != "hearth"}
    log, mode = [], "default"
    result = dict(rates=rates, warmups=warmups, log=log, mode=mode)

    def split() -> bool:
        return any(verdict.judge(judged_ratios(result, peer, fp32), goal) == "split"
                   for peer, goal in (goals or {}).items() if peer in rates)

    with tempfile.TemporaryDirectory() as tmp:
        config = hearth_config(model, precision, pathlib.Path(tmp) / "job")
        i = 0
        while i < rounds or (split() and i < verdict.MAX_ROUNDS):
            order = sides[i % len(sides):] + sides[: i % len(sides)]
            for side in order:
                if side == "hearth":
                    shutil.rmtree(config.parent / "out", ignore_errors=True)
                    rates[side].append(run_hearth(config, procs, log))
                elif side == "compiled" and i == 0:
                    # Both modes once; the faster stays.
                    tried = {m: run_peer(model, side, procs, precision, log, m) for m in COMPILE_MODES}
                    mode = max(tried, key=lambda m: tried[m][0])
                    result["mode"] = mode
                    log.append("compiled: " + ", ".join(f"{m} {r:,.0f} tokens/s" for m, (r, _) in tried.items())
                               + f"; {mode} kept")
                    rates[side].append(tried[mode][0])
                    warmups[side].append(tried[mode][1])
                else:
                    rate, warm = run_peer(model, side, procs, precision, log, mode)
                    rates[side].append(rate)
                    warmups[side].append(warm)
            line = ", ".join(f"{side} {rates[side][-1]:,.0f}" for side in sides)
            print(f"{row} round {i + 1} ({' then '.join(order)}): {line} tokens/s", flush=True)
            i += 1
    result["log"] = sorted(set(log))
    return result


def judged_ratios(result: dict, peer: str, fp32: dict | None = None) -> list[float]:
    """The per-round ratios a goal is judged on: hearth over `peer`, and for
    a bf16 row over the peer's best setting, per round its bf16 run or the
    median of its float32 row's, whichever is faster (`fp32`)."""
    theirs = result["rates"][peer]
    if fp32 is not None and peer in fp32["rates"]:
        best_fp32 = statistics.median(fp32["rates"][peer])
        theirs = [max(r, best_fp32) for r in theirs]
    return [h / p if p > 0 else float("inf") for h, p in zip(result["rates"]["hearth"], theirs)]


def ratios(result: dict, peer: str) -> list[float]:
    return [h / p for h, p in zip(result["rates"]["hearth"], result["rates"][peer])]


MODEL_NAMES = {"gpt": "tiny GPT", "gpt2": "user's GPT-2 (transformers, torch.jit.trace)",
               "llama": "traced Llama (transformers, torch.jit.trace)",
               "qwen2": "traced Qwen2 (transformers, torch.jit.trace)"}


def describe(row: str) -> str:
    model, procs, precision, _ = ALL_ROWS[row]
    what = MODEL_NAMES[model]
    kind = "bf16" if precision == "bf16" else "float32"
    return f"{what} tokens/s, {kind}, {procs} process{'es' if procs > 1 else ''}"


def summary(row: str, result: dict) -> list[str]:
    """Lines: each side's median tokens/s, each peer's ratio n/median/min–max."""
    n = len(result["rates"]["hearth"])
    lines = [f"{describe(row)}, n={n}:"]
    for side, rates in result["rates"].items():
        warm = result["warmups"].get(side)
        extra = f"  (first 10 steps, compile included: {statistics.median(warm):.1f} s)" if warm else ""
        if side == "compiled":
            extra += f", mode {result.get('mode', 'default')}"
        lines.append(f"  {side:9s} {statistics.median(rates):10,.0f} tokens/s{extra}")
    for peer in list(result["rates"])[1:]:
        r = ratios(result, peer)
        lines.append(f"  hearth/{peer} = {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})")
    lines += [f"  log: {line}" for line in result["log"]]
    return lines


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    for row in sys.argv[2:] or list(ROWS):
        print("\n".join(summary(row, measure(row, rounds))), flush=True)


if __name__ == "__main__":
    main()
