"""PyTorch's DDP on 2 gloo processes with a layer the loss does not use:
with find_unused_parameters=False it refuses (at the next forward pass,
naming the flag); with it True, or with static_graph=True, training goes on,
the idle layer keeps no gradient and the used one gets the mean. Prints
JSON: per mode, the error (or null), whether the idle weight has a gradient,
and the used weight's gradient on rank 0."""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(3, 2)
        self.idle = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x)


def worker(rank, mode, init, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        Net(), find_unused_parameters=(mode == "find"), static_graph=(mode == "static")
    )
    x = torch.full((4, 3), float(rank + 1))
    error = None
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
    except RuntimeError as e:
        error = str(e)
    result = {
        "error": error,
        "idle_grad": model.module.idle.weight.grad is not None,
        "used_grad": model.module.used.weight.grad.tolist() if model.module.used.weight.grad is not None else None,
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "find", "static"):
            out = os.path.join(tmp, f"{mode}.json")
            init = "file://" + os.path.join(tmp, f"{mode}.store")
            mp.spawn(worker, args=(mode, init, out), nprocs=2, join=True)
            with open(out) as f:
                results[mode] = json.load(f)
    json.dump(results, sys.stdout)
