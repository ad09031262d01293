"""PyTorch's DDP with Accelerate's PowerSGD comm hook on 2 gloo processes:
a 4-layer MLP with deterministic weights and per-rank inputs, 6 steps of
plain SGD. Per mode (comm_state_option, comm_wrapper) it prints
JSON: each rank's gradients after every step's backward, by parameter name.

The hook is registered the way Accelerate registers it
(`DistributedDataParallelKwargs.register_comm_hook`), so the modes are
Accelerate's own settings."""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from ddp_sgd import sgd_steps

STEPS = 6
MODES = {
    # rank 1 (Gram-Schmidt), warm start and error feedback.
    "rank1": dict(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}),
    # rank 3 (QR), matrices of one shape batched, the head sent whole.
    "rank3_batched": dict(
        comm_hook="power_sgd",
        comm_state_option={"matrix_approximation_rank": 3, "start_powerSGD_iter": 3, "batch_tensors_with_same_shape": True},
    ),
    # half precision inside the hook; no warm start, no error feedback,
    # compression from the second step.
    "fp16_cold": dict(
        comm_hook="power_sgd",
        comm_wrapper="fp16",
        comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 1, "warm_start": False, "use_error_feedback": False},
    ),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(12, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.l3 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 6)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        h = torch.tanh(self.l3(h))
        return self.head(h)


def batch(rank, step):
    x = torch.arange(96, dtype=torch.float32).view(8, 12) * 0.37 + (step * 1.3 + rank * 2.1)
    y = torch.arange(48, dtype=torch.float32).view(8, 6) * 0.11 + (step * 0.7 + rank * 0.3)
    return x.sin(), y.cos()


def worker(rank, mode, init, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    # One thread, as hearth's processes in the test: MKL's sums may round
    # otherwise with another thread count.
    torch.set_num_threads(1)
    settings = dict(MODES[mode])
    for key in ("comm_hook", "comm_wrapper"):
        if key in settings:
            settings[key] = DDPCommunicationHookType(settings[key])
    net = Net()
    with torch.no_grad():
        for k, (_, p) in enumerate(net.named_parameters()):
            p.copy_((torch.arange(p.numel(), dtype=torch.float32) * 0.7 + k).sin().view_as(p) * 0.2)
    # One bucket: with more, PyTorch's hook deadlocks on gloo (both of its
    # threads wait inside callbacks for the P all-reduce).
    model = torch.nn.parallel.DistributedDataParallel(net)
    DistributedDataParallelKwargs(**settings).register_comm_hook(model)
    grads = sgd_steps(model, net, (batch(rank, step) for step in range(STEPS)))
    with open(out, "w") as f:
        json.dump(grads, f)
    dist.destroy_process_group()


def run(rank, mode, init, tmp):
    worker(rank, mode, init, os.path.join(tmp, f"{mode}_{rank}.json"))


if __name__ == "__main__":
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in sys.argv[1:] or MODES:
            init = "file://" + os.path.join(tmp, f"{mode}.store")
            mp.spawn(run, args=(mode, init, tmp), nprocs=2, join=True)
            results[mode] = []
            for r in range(2):
                with open(os.path.join(tmp, f"{mode}_{r}.json")) as f:
                    results[mode].append(json.load(f))
    json.dump(results, sys.stdout)
