"""hearth's sharded data parallel against PyTorch FSDP, in one run.

1. Throughput: the bench GPT (shared/bench/peer_gpt_accelerate.py's model,
   B=16 per process) on PROCS processes: `hearth launch` with `[fsdp]`
   SHARD_GRAD_OP, NO_SHARD and FULL_SHARD (also prefetching: forward and
   BACKWARD_PRE), then torchrun + PyTorch FSDP1
   (ShardingStrategy.SHARD_GRAD_OP, Block units, gloo) and torchrun +
   PyTorch FSDP2 (`fully_shard` on every Block and the root, gloo), ROUNDS
   rounds alternately; tokens/s and ratios.
2. Memory: a ~100M-parameter GPT (d=768, 12 layers, vocab 8192, T=128,
   B=2) for a few steps on 4 processes, DDP vs SHARD_GRAD_OP vs FULL_SHARD
   (and FULL_SHARD with sync-module-states, with and without
   cpu-ram-efficient-loading, where only rank 0 builds the weights):
   peak RSS per process (from /proc, sampled) and summary.json's memory.
A benchmark, not a test: nothing is asserted.
Usage: make bench-fsdp  (or: python fsdp_vs_torch.py [ROUNDS] [PROCS])
"""
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
from peer_gpt import peer_script  # noqa: E402
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
STEPS = 40

FSDP_PEER = r'''
import os, re, sys, time, torch, functools
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.device_mesh import init_device_mesh
source = open(sys.argv[1]).read()
source = source[: source.rindex("\nmain()")]
ns = {"__name__": "peer"}
exec(compile(source, sys.argv[1], "exec"), ns)
steps = int(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
V, T, B = ns["V"], ns["T"], ns["B"]
if sys.argv[3] == "fsdp2":
    model = ns["GPT"]()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, ns["Block"]):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
else:
    model = FSDP(ns["GPT"](), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ns["Block"]}),
                 use_orig_params=True, device_id=torch.device("cpu"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
data = torch.randint(0, V, (steps * B + 1, T + 1))
warm, t0 = 10, None
for i in range(steps):
    if i == warm: t0 = time.perf_counter()
    x = data[i * B:(i + 1) * B]
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad()
dt = time.perf_counter() - t0
if dist.get_rank() == 0:
    print(f"tokens/s={(steps - warm) * B * T * dist.get_world_size() / dt:.0f}")
dist.destroy_process_group()
'''


def job(fsdp: str, d=128, layers=4, heads=4, vocab=256, seq=128, batch=16) -> str:
    return f"""
[run]
name = "bench"
steps = {STEPS}
log-every = {STEPS}
[model]
kind = "gpt"
d-model = {d}
layers = {layers}
heads = {heads}
[data]
kind = "random-tokens"
vocab-size = {vocab}
seq-len = {seq}
batch-size = {batch}
[optimizer]
kind = "adamw"
lr = 3e-4
{fsdp}"""


SHARDED = '[fsdp]\nsharding-strategy = "SHARD_GRAD_OP"\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\n'
NO_SHARD = '[fsdp]\nsharding-strategy = "NO_SHARD"\n'
FULL_SHARD = SHARDED.replace("SHARD_GRAD_OP", "FULL_SHARD")
SYNCED = FULL_SHARD + "sync-module-states = true\n"
EFFICIENT = SYNCED + "cpu-ram-efficient-loading = true\n"
PREFETCH = FULL_SHARD + 'forward-prefetch = true\nbackward-prefetch = "BACKWARD_PRE"\n'


def peak_rss_of_children(proc: subprocess.Popen, name: str) -> dict:
    """Samples the resident memory of every process named `name` under `proc`."""
    peaks = {}
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                status = pathlib.Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if f"Name:\t{name}" in status and pid != str(proc.pid):  # not the launcher
                rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024 if "VmRSS" in status else 0
                peaks[pid] = max(peaks.get(pid, 0), rss)
        time.sleep(0.05)
    return peaks


def hearth_run(tmp: pathlib.Path, text: str, procs: int, steps: int = STEPS, watch=False):
    config = tmp / "job.toml"
    config.write_text(text)
    out = tmp / "out"
    cmd = [HEARTH, "launch", "-n", str(procs), "--cpu", config, "--", "--quiet", "--steps", str(steps), "--output-dir", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peaks = peak_rss_of_children(proc, "hearth") if watch else {}
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err.decode())
    summary = json.loads((out / "bench" / "summary.json").read_text())
    return summary, peaks


def torch_fsdp_tokens_per_sec(tmp: pathlib.Path, procs: int, version: str = "fsdp1") -> float:
    script = tmp / "fsdp_peer.py"
    script.write_text(FSDP_PEER)
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    out = subprocess.run([torchrun, "--nproc_per_node", str(procs), script, peer_script(), str(STEPS), version],
                         check=True, capture_output=True, text=True).stdout
    return float(re.search(r"tokens/s=(\d+)", out).group(1))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    procs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    zero2, ddp, zero3, ahead, torch_fsdp, torch_fsdp2 = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for i in range(rounds):
            zero2.append(hearth_run(tmp, job(SHARDED), procs)[0]["tokens_per_sec"])
            ddp.append(hearth_run(tmp, job(NO_SHARD), procs)[0]["tokens_per_sec"])
            zero3.append(hearth_run(tmp, job(FULL_SHARD), procs)[0]["tokens_per_sec"])
            ahead.append(hearth_run(tmp, job(PREFETCH), procs)[0]["tokens_per_sec"])
            torch_fsdp.append(torch_fsdp_tokens_per_sec(tmp, procs))
            torch_fsdp2.append(torch_fsdp_tokens_per_sec(tmp, procs, "fsdp2"))
            print(f"round {i + 1}: hearth SHARD_GRAD_OP {zero2[-1]:.0f}, hearth NO_SHARD {ddp[-1]:.0f}, "
                  f"hearth FULL_SHARD {zero3[-1]:.0f} (prefetching {ahead[-1]:.0f}), PyTorch FSDP1 SHARD_GRAD_OP {torch_fsdp[-1]:.0f}, "
                  f"PyTorch FSDP2 fully_shard {torch_fsdp2[-1]:.0f} tokens/s")
        z, d, f, a, t, t2 = (statistics.median(v) for v in (zero2, ddp, zero3, ahead, torch_fsdp, torch_fsdp2))
        print(f"bench GPT, {procs} processes, median of {rounds}:")
        print(f"  SHARD_GRAD_OP / NO_SHARD (hearth)                 = {z / d:.2f}")
        print(f"  hearth SHARD_GRAD_OP / PyTorch FSDP1 (gloo)        = {z / t:.2f}")
        print(f"  hearth FULL_SHARD / PyTorch FSDP2 fully_shard      = {f / t2:.2f}")
        print(f"  FULL_SHARD prefetching / not (hearth)              = {a / f:.2f}")
        big = dict(d=768, layers=12, heads=12, vocab=8192, seq=128, batch=2)
        for name, table in (("DDP", ""), ("SHARD_GRAD_OP", SHARDED), ("FULL_SHARD", FULL_SHARD),
                            ("FULL_SHARD synced", SYNCED), ("FULL_SHARD RAM-efficient", EFFICIENT)):
            summary, peaks = hearth_run(tmp, job(table, **big), 4, steps=3, watch=True)
            gib = [p / 2**30 for p in peaks.values()]
            print(f"~100M GPT ({summary['num_parameters'] / 1e6:.0f}M parameters), 4 processes, {name}: "
                  f"peak RSS per process {max(gib):.2f} GiB (mean {statistics.mean(gib):.2f}, least {min(gib):.2f}); "
                  f"memory {summary['memory']}")


if __name__ == "__main__":
    main()
