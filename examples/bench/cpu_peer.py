"""The CPU peer of `make bench`: a model trained under Hugging Face
Accelerate the way a PyTorch expert would train it, in one process or, under
torchrun, in several (gloo). One program for every CPU row, so the rows
differ only in what they name:

  --model gpt     the bench GPT (the peer benchmark's class, built through
                  tests/oracles/peer_gpt.py, at examples/bench-gpt.toml's sizes)
  --model gpt2    a transformers GPT-2 at the user-model row's sizes
                  (user_model.py), the eager module a user would train
  --model llama   a transformers Llama or Qwen2 at the Llama rows' sizes
  --model qwen2   (llama_model.py), SDPA attention
  --peer eager    `Accelerator(cpu=True, mixed_precision=...)`
  --peer compiled the same with `dynamo_backend="inductor"` (torch.compile);
                  its first WARMUP steps (the compile) are timed apart
  --mode          torch.compile's mode for the compiled peer (default, or
                  max-autotune-no-cudagraphs)
  --precision     no | bf16 (Accelerate's CPU autocast)
  --bind          pins each rank to its CPUS_PER_RANK CPUs (LOCAL_RANK's
                  share, as mpirun binds hearth's ranks)

Both use `AdamW(fused=True)`, and make positions on the tokens' device (no
`torch.set_default_device`). Prints one line: `tokens/s=N warmup=S
threads=T cores=C` (rank 0). Usage: see cpu_rows.py, which runs it.
"""
import argparse
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
sys.path.insert(0, str(HERE))
WARMUP = 10


def bench_gpt():
    """The peer benchmark's GPT at examples/bench-gpt.toml's sizes: (module,
    vocab, seq-len, batch)."""
    import peer_gpt

    return peer_gpt.build(256, 128, 128, 4, 4, positions_on_input_device=True), 256, 128, 16


def user_gpt2():
    """The user-model row's transformers GPT-2, returning its logits."""
    import user_model

    return user_model.LogitsOf(user_model.gpt2(seed=0)), user_model.VOCAB, user_model.SEQ, user_model.BATCH


def user_llama(family: str):
    """A Llama-family row's transformers model, returning its logits."""
    import llama_model

    return llama_model.logits_of(family, seed=0), llama_model.VOCAB, llama_model.SEQ, llama_model.BATCH


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--model", choices=["gpt", "gpt2", "llama", "qwen2"], default="gpt")
    args.add_argument("--peer", choices=["eager", "compiled"], default="eager")
    args.add_argument("--precision", choices=["no", "bf16"], default="no")
    args.add_argument("--steps", type=int, default=60)
    args.add_argument("--bind", action="store_true")
    args.add_argument("--mode", default=None)
    a = args.parse_args()
    if a.bind:
        # This rank's share of the CPUs it may use, as mpirun binds hearth's.
        cpus = sorted(os.sched_getaffinity(0))
        k = int(os.environ.get("CPUS_PER_RANK", "1"))
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        os.sched_setaffinity(0, cpus[rank * k:(rank + 1) * k] or cpus[-k:])

    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    dynamo = TorchDynamoPlugin(backend="inductor" if a.peer == "compiled" else "no",
                               mode=a.mode if a.peer == "compiled" else None)
    acc = Accelerator(cpu=True, mixed_precision=a.precision, dynamo_plugin=dynamo)
    torch.manual_seed(0)
    build = {"gpt": bench_gpt, "gpt2": user_gpt2}.get(a.model) or (lambda: user_llama(a.model))
    model, vocab, seq, batch = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    data = torch.randint(0, vocab, (a.steps, batch, seq + 1))
    start = time.perf_counter()
    for i in range(a.steps):
        if i == WARMUP:
            t0 = time.perf_counter()
        x = data[i]
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), x[:, 1:].reshape(-1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    if acc.is_main_process:
        tokens = (a.steps - WARMUP) * batch * seq * acc.num_processes
        print(f"tokens/s={tokens / elapsed:.0f} warmup={t0 - start:.2f} threads={torch.get_num_threads()} "
              f"cores={','.join(map(str, sorted(os.sched_getaffinity(0))))} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
