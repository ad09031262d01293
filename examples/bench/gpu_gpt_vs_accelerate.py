"""hearth vs Hugging Face Accelerate training a GPT on one CUDA GPU, in one run.

For each size below, runs `hearth run` on a generated config and the same
GPT class as the CPU peer benchmark (shared/bench/peer_gpt_accelerate.py,
built through tests/oracles/peer_gpt.py) under `Accelerator(mixed_precision=
...)` on the GPU, alternately, ROUNDS times each, and prints tokens/s of
both, their ratio and each one's model FLOPs utilisation (6 N + 12 L T d
FLOPs per token over the GPU's dense bf16 peak). A benchmark, not a test:
nothing is asserted. Usage (on a GPU machine):
    HEARTH_BIN=path/to/hearth python gpu_gpt_vs_accelerate.py [ROUNDS] [SIZE...]
SIZE is one of: tiny (the CPU bench GPT, fp32), tiny-bf16, gpt2 (d=768,
12 layers, T=1024, bf16), and each with -graph (hearth's step captured in a
CUDA graph, `run.cuda-graph`; the peer stays eager, as Accelerate has no
such option).
"""
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


def flops_per_token(v, t, d, layers):
    params = v * d + layers * 12 * d * d + d * v  # embedding, blocks, head
    return 6 * params + 12 * layers * t * d


def hearth_tokens_per_sec(size, out_dir: pathlib.Path) -> float:
    v, t, d, layers, heads, batch, steps, mp = SIZES[size]
    graph = "true" if size.endswith("-graph") else "false"
    out_dir.mkdir(parents=True)
    config = out_dir / "bench.toml"
    config.write_text(
        f"""[run]
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
    )
    subprocess.run([HEARTH, "run", config, "--quiet", "--output-dir", out_dir], check=True, capture_output=True)
    return json.loads((out_dir / "bench" / "summary.json").read_text())["tokens_per_sec"]


def peer_tokens_per_sec(size) -> float:
    """The peer in a process of its own (Accelerate's state is per process)."""
    out = subprocess.run([sys.executable, __file__, "--peer", size], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def peer_run(size) -> float:
    from accelerate import Accelerator

    v, t, d, layers, heads, batch, steps, mp = SIZES[size]
    acc = Accelerator(mixed_precision=mp)
    torch.manual_seed(0)
    torch.set_default_device(acc.device)  # the peer GPT makes its positions with torch.arange
    model = peer_gpt.build(v, t, d, layers, heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, opt = acc.prepare(model, opt)
    data = torch.randint(0, v, (steps, batch, t + 1), device=acc.device)
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
    return (steps - WARMUP) * batch * t / (time.perf_counter() - t0)


def main() -> None:
    if sys.argv[1:2] == ["--peer"]:
        print(peer_run(sys.argv[2]))
        return
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sizes = sys.argv[2:] or ["tiny", "tiny-graph", "tiny-bf16", "gpt2", "gpt2-graph"]
    print(f"GPU: {torch.cuda.get_device_name()}; peak {PEAK / 1e12:.0f} TFLOP/s for MFU")
    for size in sizes:
        v, t, d, layers, heads, batch, steps, mp = SIZES[size]
        ours, peer = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(rounds):
                ours.append(hearth_tokens_per_sec(size, pathlib.Path(tmp) / f"r{i}"))
                peer.append(peer_tokens_per_sec(size))
                print(f"{size} round {i + 1}: hearth {ours[-1]:.0f} tokens/s, accelerate {peer[-1]:.0f} tokens/s", flush=True)
        h, a = statistics.median(ours), statistics.median(peer)
        f = flops_per_token(v, t, d, layers)
        print(f"{size}: V={v} T={t} d={d} L={layers} H={heads} B={batch} {mp}, median of {rounds}:")
        print(f"  hearth     {h:10.0f} tokens/s  MFU {h * f / PEAK:6.1%}")
        print(f"  accelerate {a:10.0f} tokens/s  MFU {a * f / PEAK:6.1%}")
        print(f"  ratio hearth/accelerate = {h / a:.2f}", flush=True)


if __name__ == "__main__":
    main()
