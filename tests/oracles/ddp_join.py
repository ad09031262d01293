"""What Accelerate's `join_uneven_inputs([model], even_batches=False)` does
on GPUs, run on 2 gloo CPU processes: PyTorch's `Join` with the DDP model as
joinable (Accelerate itself only warns and does nothing on CPUs), and the
loaders' `even_batches` set to False inside. Rank 0 trains on 3 batches,
rank 1 on 5, plain SGD by hand. Prints JSON per rank: the gradients after
each of its backward passes, its weights after the join, and the batches
Accelerate's `prepare_data_loader` gives this rank from 7 examples (batch
size 1) with `even_batches` True (outside the join) and False (inside)."""
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.data_loader import prepare_data_loader
from torch.distributed.algorithms.join import Join

from ddp_sgd import sgd_steps

BATCHES = [3, 5]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(5, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(x)))


def batch(rank, step):
    x = torch.arange(15, dtype=torch.float32).view(3, 5) * 0.41 + (step * 0.9 + rank * 1.7)
    y = torch.arange(6, dtype=torch.float32).view(3, 2) * 0.23 + (step * 0.5 + rank * 0.2)
    return x.sin(), y.cos()


def batches(rank, even):
    examples = [torch.tensor([i]) for i in range(7)]
    loader = prepare_data_loader(
        torch.utils.data.DataLoader(examples, batch_size=1),
        num_processes=2, process_index=rank, even_batches=even, put_on_device=False,
    )
    return [b.tolist() for b in loader]


def worker(rank, port, tmp):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = Net()
    with torch.no_grad():
        for k, (_, p) in enumerate(net.named_parameters()):
            p.copy_((torch.arange(p.numel(), dtype=torch.float32) * 0.9 + k).sin().view_as(p) * 0.3)
    model = torch.nn.parallel.DistributedDataParallel(net)
    seen = {"even": batches(rank, True), "uneven": batches(rank, False)}
    with Join([model], enable=True, throw_on_early_termination=False):
        grads = sgd_steps(model, net, (batch(rank, step) for step in range(BATCHES[rank])))
    weights = {n: p.flatten().tolist() for n, p in net.named_parameters()}
    with open(os.path.join(tmp, f"{rank}.json"), "w") as f:
        json.dump({"grads": grads, "weights": weights, "batches": seen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(port, tmp), nprocs=2, join=True)
        out = []
        for r in range(2):
            with open(os.path.join(tmp, f"{r}.json")) as f:
                out.append(json.load(f))
    json.dump(out, sys.stdout)
