"""GPU memory of `cpu-offload` on one GPU: the same ~1.4B-parameter GPT
(d=2048, 24 layers, T=1024, batch 4, bf16 autocast, AdamW) trained a few
steps by `hearth run` plainly and with FULL_SHARD + cpu-offload in a world
of one (shards, gradients and AdamW state in host memory), and by the peer,
PyTorch FSDP2 (`fully_shard` on every block and the root with
`CPUOffloadPolicy`, under torchrun) on the peer benchmark's GPT class;
prints each run's peak GPU memory in use (nvidia-smi, sampled every 50 ms)
and tokens/s. A benchmark, not a test. Usage (on a GPU machine):
    HEARTH_BIN=path/to/hearth python gpu_offload_memory.py [STEPS]
    HEARTH_BIN=... python gpu_offload_memory.py --profile DIR
`--profile DIR` records two steps of each offloading side (hearth's
`--profile`, torch.profiler for the peer) and prints, per step, the wall
time, the named spans (hearth's `hearth::*`, FSDP2's and the optimizer's
`record_function`s), the host operators that took longest and the GPU's
copies and kernels: where the step goes on each side.
"""
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "release" / "hearth"))
CONFIG = """[run]
name = "offload"
steps = {steps}
log-every = 1
device = "cuda"
mixed-precision = "bf16"

[model]
kind = "gpt"
d-model = 2048
layers = 24
heads = 16

[data]
kind = "random-tokens"
vocab-size = 50304
seq-len = 1024
batch-size = 4

[optimizer]
kind = "adamw"
lr = 1e-4
"""
FSDP = """
[fsdp]
sharding-strategy = "FULL_SHARD"
auto-wrap-policy = "transformer-based"
transformer-cls-names-to-wrap = ["Block"]
cpu-offload = true
"""


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def peer(steps: int, trace_dir: str = "") -> float:
    """PyTorch FSDP2 with CPU offload, in this process (under torchrun):
    tokens/s after the first step; with `trace_dir`, steps 3 and 4 are
    recorded by torch.profiler into trace_dir/peer.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    sys.path.insert(0, str(ROOT / "tests" / "oracles"))
    import peer_gpt

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    v, t, batch = 50304, 1024, 4
    model = peer_gpt.build(v, t, 2048, 24, 16)
    for block in model.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    # Fused AdamW, as hearth's: on the offloaded (CPU) parameters it is
    # one multithreaded pass where the default (foreach) makes ~10.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=os.environ.get("PEER_FUSED", "1") == "1")
    print(f"peer optimizer: AdamW(fused={opt.defaults['fused']})", flush=True)
    torch.set_default_device("cuda")  # the peer GPT makes its positions with torch.arange
    data = torch.randint(0, v, (steps, batch, t + 1), device="cuda")
    prof = None
    if trace_dir:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=2, warmup=1, active=2),
            on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(trace_dir, "peer.json")),
        )
        prof.start()
    for i in range(steps):
        if i == 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x = data[i]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, v), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()
    torch.cuda.synchronize()
    if prof is not None:
        prof.stop()
    rate = (steps - 1) * batch * t / (time.perf_counter() - start)
    dist.destroy_process_group()
    return rate


def sampled(cmd):
    """Runs `cmd`; returns its output and the peak GPU memory in use above
    what was in use before (MiB)."""
    peak, done = [used_mib()], threading.Event()

    def sample():
        while not done.is_set():
            peak.append(used_mib())
            time.sleep(0.05)

    t = threading.Thread(target=sample)
    t.start()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    done.set()
    t.join()
    if proc.returncode != 0:
        sys.exit(proc.stdout + proc.stderr)
    return proc.stdout, max(peak) - peak[0]


def run(config: str, folder: pathlib.Path):
    folder.mkdir(parents=True)
    (folder / "c.toml").write_text(config)
    start = time.time()
    _, mib = sampled([HEARTH, "run", folder / "c.toml", "--quiet", "--output-dir", folder])
    summary = json.loads((folder / "offload" / "summary.json").read_text())
    return mib, summary["tokens_per_sec"], time.time() - start, summary.get("final_loss")


def summarise(label: str, trace: pathlib.Path) -> None:
    """Where a recorded step goes: wall time, named spans, the longest host
    operators (inclusive) and the GPU's copies and kernels, per step."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    host = [e for e in events if not e.get("cat", "").startswith("gpu") and e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in host if e.get("name", "").startswith("ProfilerStep#")]
    n = max(len(steps), 1)
    wall = sum(e["dur"] for e in steps) / n / 1e3
    print(f"{label}: {len(steps)} recorded steps, {wall:.0f} ms per step")

    def table(title, durations, calls, top):
        print(f"  {title}")
        for name, dur in durations.most_common(top):
            print(f"    {dur / n / 1e3:10.1f} ms {calls[name] / n:7.0f}x  {name[:100]}")

    spans, span_calls = collections.Counter(), collections.Counter()
    ops, op_calls = collections.Counter(), collections.Counter()
    for e in host:
        name, cat = e.get("name", ""), e.get("cat", "")
        if name.startswith("ProfilerStep#"):
            continue
        if cat == "user_annotation":
            spans[name] += e["dur"]
            span_calls[name] += 1
        elif cat == "cpu_op":
            ops[name] += e["dur"]
            op_calls[name] += 1
    table("named spans (inclusive)", spans, span_calls, 25)
    table("host operators (inclusive)", ops, op_calls, 20)
    gpu, gpu_calls = collections.Counter(), collections.Counter()
    copied = collections.Counter()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu[e["name"][:100]] += e["dur"]
            gpu_calls[e["name"][:100]] += 1
            copied[e["name"][:100]] += e.get("args", {}).get("bytes", 0)
    table("GPU copies and kernels", gpu, gpu_calls, 12)
    for name, b in copied.most_common(4):
        if b:
            print(f"    {name[:60]}: {b / n / 2**30:.2f} GiB per step, {b / max(gpu[name], 1) / 1e3:.1f} GB/s")


def profile(out: pathlib.Path) -> None:
    """Two recorded steps of hearth's FULL_SHARD + cpu-offload and of the
    FSDP2 peer, each summarised."""
    out.mkdir(parents=True, exist_ok=True)
    config = CONFIG.format(steps=6) + FSDP + "\n[profile]\nwait = 2\nwarmup = 1\nactive = 2\n"
    (out / "offload.toml").write_text(config)
    run = subprocess.run([HEARTH, "run", out / "offload.toml", "--quiet", "--output-dir", out, "--profile", out / "trace"], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(run.stdout[-3000:] + run.stderr[-3000:])
    summarise("hearth FULL_SHARD + cpu-offload", out / "trace" / "profile_0.json")
    peer_run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", __file__, "--peer", "6", str(out)], capture_output=True, text=True)
    if peer_run.returncode != 0:
        sys.exit(peer_run.stdout[-3000:] + peer_run.stderr[-3000:])
    print(*peer_run.stdout.strip().splitlines()[:-1], sep="\n")
    summarise("FSDP2 + CPUOffloadPolicy", out / "peer.json")


def main() -> None:
    if sys.argv[1:2] == ["--peer"]:
        print(peer(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""))
        return
    if sys.argv[1:2] == ["--profile"]:
        profile(pathlib.Path(sys.argv[2]))
        return
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in [("plain", CONFIG), ("FULL_SHARD + cpu-offload", CONFIG + FSDP)]:
            mib, tps, wall, loss = run(config.format(steps=steps), pathlib.Path(tmp) / name.split()[0])
            print(f"{name:26s} peak GPU memory {mib / 1024:6.2f} GiB  {tps:8.0f} tokens/s  {wall:5.1f} s  final loss {loss}", flush=True)
    start = time.time()
    peer_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", __file__, "--peer", str(steps)]
    try:
        out, mib = sampled(peer_cmd)
    except SystemExit as failed:
        # A torch whose fused AdamW refuses FSDP2's CPU DTensors: the default.
        print(f"peer with fused AdamW failed ({str(failed.code)[-300:]}); again with foreach", flush=True)
        os.environ["PEER_FUSED"] = "0"
        start = time.time()
        out, mib = sampled(peer_cmd)
    *notes, rate = out.strip().splitlines()
    tps = float(rate)
    print(*notes, sep="\n")
    print(f"{'FSDP2 + CPUOffloadPolicy':26s} peak GPU memory {mib / 1024:6.2f} GiB  {tps:8.0f} tokens/s  {time.time() - start:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
