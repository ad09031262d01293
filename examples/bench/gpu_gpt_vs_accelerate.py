"""hearth vs Hugging Face Accelerate training a GPT on one CUDA GPU, in one run.

For each size below, runs `hearth run` on a generated config and the same
GPT class as the CPU peer benchmark (shared/bench/peer_gpt_accelerate.py,
built through tests/oracles/peer_gpt.py) under Accelerate on the GPU, in two
forms a PyTorch user would pick:
  eager     `Accelerator(mixed_precision=...)`, `AdamW(fused=True)`;
  compiled  the same with `dynamo_backend="inductor"` (torch.compile); its
            compile time is measured apart and left out of its tokens/s.
Neither peer uses `torch.set_default_device` (the model makes its positions
on the tokens' device). Each round runs the three sides in another order
(rotated), ROUNDS rounds; each row prints n, the median tokens/s, the median
and min-max of the per-round ratios, and model FLOPs utilisation (6 N for the
blocks' and the head's weights + 12 L T d FLOPs per token over the GPU's dense bf16 peak). A benchmark, not a
test: nothing is asserted. Usage (on a GPU machine):
    HEARTH_BIN=path/to/hearth python gpu_gpt_vs_accelerate.py [ROUNDS] [SIZE...]
    HEARTH_BIN=... python gpu_gpt_vs_accelerate.py --profile DIR SIZE
SIZE is one of: tiny (the CPU bench GPT, fp32), tiny-bf16, gpt2 (d=768,
12 layers, T=1024, bf16), and each with -graph (hearth's step captured in a
CUDA graph, `run.cuda-graph`). PEERS=eager,compiled picks the peers;
HEARTH_OFF=1 adds hearth with its own GPU kernels off (HEARTH_GPU_KERNELS=off).
`--profile DIR` runs hearth once with `--profile DIR` and prints where the
GPU's time went, by kernel, per recorded step.
"""
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
import peer_gpt  # noqa: E402

HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "release" / "hearth"))
SIZES = {
    # name: vocab, seq-len, d-model, layers, heads, batch, steps, mixed precision
    "tiny": (256, 128, 128, 4, 4, 16, 300, "no"),
    "tiny-bf16": (256, 128, 128, 4, 4, 16, 300, "bf16"),
    "gpt2": (50304, 1024, 768, 12, 12, 8, 120, "bf16"),
}
SIZES.update({f"{name}-graph": size for name, size in SIZES.items()})
WARMUP = 10
# Dense bf16 peak of the GPU, FLOP/s (H100 SXM and H200: 989 TFLOP/s).
PEAK = float(os.environ.get("GPU_PEAK_TFLOPS", "989")) * 1e12
PEERS = os.environ.get("PEERS", "eager,compiled").split(",")
# HEARTH_OFF=1 adds hearth with its GPU kernels off as a side ("hearth-off").
HEARTH_SIDES = ["hearth", "hearth-off"] if os.environ.get("HEARTH_OFF") == "1" else ["hearth"]


def flops_per_token(v, t, d, layers):
    """Model FLOPs of one token's forward and backward: 6 per weight of the
    blocks and the head (the embeddings are looked up, not multiplied), and
    the attention scores (12 L T d, PaLM's appendix B)."""
    weights = layers * 12 * d * d + d * v  # blocks, head
    return 6 * weights + 12 * layers * t * d


def hearth_config(size, steps=None) -> str:
    v, t, d, layers, heads, batch, default_steps, mp = SIZES[size]
    steps = steps or default_steps
    graph = "true" if size.endswith("-graph") else "false"
    return f"""[run]
name = "bench"
steps = {steps}
log-every = {steps}
device = "cuda"
mixed-precision = "{mp}"
cuda-graph = {graph}

[model]
kind = "gpt"
d-model = {d}
layers = {layers}
heads = {heads}

[data]
kind = "random-tokens"
vocab-size = {v}
seq-len = {t}
batch-size = {batch}

[optimizer]
kind = "adamw"
lr = 3e-4
"""


def hearth_tokens_per_sec(size, out_dir: pathlib.Path, kernels="on") -> float:
    """hearth's tokens/s; kernels="off" runs it with HEARTH_GPU_KERNELS=off
    (libtorch's operators where hearth has GPU kernels of its own)."""
    out_dir.mkdir(parents=True)
    config = out_dir / "bench.toml"
    config.write_text(hearth_config(size))
    env = dict(os.environ, HEARTH_GPU_KERNELS=kernels)
    subprocess.run([HEARTH, "run", config, "--quiet", "--output-dir", out_dir], check=True, capture_output=True, env=env)
    return json.loads((out_dir / "bench" / "summary.json").read_text())["tokens_per_sec"]


def peer_tokens_per_sec(size, peer):
    """The peer in a process of its own (Accelerate's state is per process):
    tokens/s, and the seconds its warm-up steps took (the compile, if any);
    (None, None), with its error printed, if it failed."""
    out = subprocess.run([sys.executable, __file__, "--peer", peer, size], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"the {peer} peer failed on {size}:\n{out.stderr[-3000:]}", flush=True)
        return None, None
    rate, warmup = out.stdout.strip().splitlines()[-1].split()
    return float(rate), float(warmup)


def peer_run(size, peer) -> tuple[float, float]:
    from accelerate import Accelerator

    v, t, d, layers, heads, batch, steps, mp = SIZES[size]
    acc = Accelerator(mixed_precision=mp, dynamo_backend="inductor" if peer == "compiled" else "no")
    torch.manual_seed(0)
    model = peer_gpt.build(v, t, d, layers, heads, positions_on_input_device=True).to(acc.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    data = torch.randint(0, v, (steps, batch, t + 1), device=acc.device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        if i == WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = data[i]
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, v).float(), x[:, 1:].reshape(-1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return (steps - WARMUP) * batch * t / (time.perf_counter() - t0), t0 - start


def profile(size, out_dir: pathlib.Path) -> None:
    """hearth once under its profiler; the GPU's time per step by kernel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = out_dir / "bench.toml"
    config.write_text(hearth_config(size, steps=30) + "\n[profile]\nwait = 20\nwarmup = 2\nactive = 3\n")
    run = subprocess.run([HEARTH, "run", config, "--output-dir", out_dir, "--profile", out_dir / "trace"], capture_output=True, text=True)
    print(run.stdout[-3000:], run.stderr[-3000:])
    trace = json.loads((out_dir / "trace" / "profile_0.json").read_text())
    events = trace["traceEvents"]
    # Each step is a span on the host and again on the GPU's timeline.
    steps = [
        e for e in events
        if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X" and not e.get("cat", "").startswith("gpu")
    ]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    n = max(len(steps), 1)
    by_name = collections.Counter()
    calls = collections.Counter()
    for k in kernels:
        by_name[k["name"][:90]] += k["dur"]
        calls[k["name"][:90]] += 1
    busy = sum(by_name.values()) / n / 1e3
    wall = sum(s["dur"] for s in steps) / n / 1e3
    if kernels:
        first, last = min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels)
        span = (last - first) / n / 1e3
    else:
        span = 0.0
    print(f"{size}: {n} recorded steps; per step: host span {wall:.2f} ms, GPU span {span:.2f} ms, kernels busy {busy:.2f} ms")
    groups = collections.Counter()
    for name, dur in by_name.items():
        low = name.lower()
        group = next((g for g, keys in GROUPS if any(key in low for key in keys)), "other")
        groups[group] += dur
    for group, dur in groups.most_common():
        print(f"  {group:14s} {dur / n / 1e3:8.2f} ms  {dur / max(sum(groups.values()), 1):6.1%}")
    for name, dur in by_name.most_common(30):
        print(f"  {dur / n / 1e3:8.3f} ms {calls[name] // n:4d}x  {name}")


GROUPS = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "hearth_attn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "xmma", "cublas")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("loss", ("softmax", "nll", "cross_entropy")),
    ("layernorm", ("layer_norm", "layernorm")),
    ("gelu", ("gelu",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reduce", ("reduce",)),
]


def main() -> None:
    if sys.argv[1:2] == ["--peer"]:
        print(*peer_run(sys.argv[3], sys.argv[2]))
        return
    if sys.argv[1:2] == ["--profile"]:
        for size in sys.argv[3:] or ["gpt2"]:
            profile(size, pathlib.Path(sys.argv[2]) / size)
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sizes = sys.argv[2:] or ["tiny", "tiny-graph", "tiny-bf16", "gpt2", "gpt2-graph"]
    print(f"GPU: {torch.cuda.get_device_name()}; peak {PEAK / 1e12:.0f} TFLOP/s for MFU; peers: {', '.join(PEERS)}")
    sides = HEARTH_SIDES + PEERS
    for size in sizes:
        v, t, d, layers, heads, batch, steps, mp = SIZES[size]
        rates = {side: [] for side in sides}
        failed = set()
        warmups = {peer: [] for peer in PEERS}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(rounds):
                order = sides[i % len(sides):] + sides[: i % len(sides)]
                for side in order:
                    if side.startswith("hearth"):
                        kernels = "off" if side == "hearth-off" else "on"
                        rates[side].append(hearth_tokens_per_sec(size, pathlib.Path(tmp) / f"r{i}-{side}", kernels))
                    elif side not in failed:
                        rate, warmup = peer_tokens_per_sec(size, side)
                        if rate is None:
                            failed.add(side)
                            continue
                        rates[side].append(rate)
                        warmups[side].append(warmup)
                line = ", ".join(f"{side} {rates[side][-1]:.0f}" for side in sides if side not in failed)
                print(f"{size} round {i + 1} ({' then '.join(order)}): {line} tokens/s", flush=True)
        f = flops_per_token(v, t, d, layers)
        print(f"{size}: V={v} T={t} d={d} L={layers} H={heads} B={batch} {mp}, n={rounds}:")
        for side in [s for s in sides if s not in failed]:
            median = statistics.median(rates[side])
            extra = f"  warm-up ({WARMUP} steps, compile included) {statistics.median(warmups[side]):.1f} s" if side in warmups else ""
            print(f"  {side:10s} {median:10.0f} tokens/s  MFU {median * f / PEAK:6.1%}{extra}")
        for peer in [p for p in HEARTH_SIDES[1:] + PEERS if p not in failed]:
            ratios = [h / p for h, p in zip(rates["hearth"], rates[peer])]
            print(f"  ratio hearth/{peer} = {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    main()
