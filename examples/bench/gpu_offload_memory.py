"""GPU memory of `cpu-offload` on one GPU: the same ~1.4B-parameter GPT
(d=2048, 24 layers, T=1024, batch 4, bf16 autocast, AdamW) trained a few
steps by `hearth run` plainly and with FULL_SHARD + cpu-offload in a world
of one (shards, gradients and AdamW state in host memory), and by the peer,
PyTorch FSDP2 (`fully_shard` on every block and the root with
`CPUOffloadPolicy`, under torchrun) on the peer benchmark's GPT class;
prints each run's peak GPU memory in use (nvidia-smi, sampled every 50 ms)
and tokens/s. A benchmark, not a test. Usage (on a GPU machine):
    HEARTH_BIN=path/to/hearth python gpu_offload_memory.py [STEPS]
"""
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


def peer(steps: int) -> float:
    """PyTorch FSDP2 with CPU offload, in this process (under torchrun):
    tokens/s after the first step."""
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.set_default_device("cuda")  # the peer GPT makes its positions with torch.arange
    data = torch.randint(0, v, (steps, batch, t + 1), device="cuda")
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
    torch.cuda.synchronize()
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


def main() -> None:
    if sys.argv[1:2] == ["--peer"]:
        print(peer(int(sys.argv[2])))
        return
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in [("plain", CONFIG), ("FULL_SHARD + cpu-offload", CONFIG + FSDP)]:
            mib, tps, wall, loss = run(config.format(steps=steps), pathlib.Path(tmp) / name.split()[0])
            print(f"{name:26s} peak GPU memory {mib / 1024:6.2f} GiB  {tps:8.0f} tokens/s  {wall:5.1f} s  final loss {loss}", flush=True)
    start = time.time()
    out, mib = sampled([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", __file__, "--peer", str(steps)])
    tps = float(out.strip().splitlines()[-1])
    print(f"{'FSDP2 + CPUOffloadPolicy':26s} peak GPU memory {mib / 1024:6.2f} GiB  {tps:8.0f} tokens/s  {time.time() - start:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
