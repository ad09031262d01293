"""Oracle for host/hearth/tests/distributed/mpi/process_helpers.rs: what Accelerate's process helpers give on
each rank of a CPU world (gloo), started as
`python -m torch.distributed.run --nproc_per_node N this.py OUT_DIR`.
Each rank writes OUT_DIR/rank_<r>.json; hearth's child under mpirun
writes the same keys from the same inputs."""
import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, synchronize_rng_states
from torch.utils.data import DataLoader, IterableDataset


def main(out):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    r, n = acc.process_index, acc.num_processes
    res = {"rank": r, "world": n, "split": {}, "split_tensor": {}, "pad": {}}

    # split_between_processes over lists and tensors (rows of 2) of 0..7
    # items, with and without padding (Accelerate cannot pad nothing).
    for length in range(8):
        for pad in (False, True) if length else (False,):
            key = f"{length}:{int(pad)}"
            with acc.split_between_processes(list(range(length)), apply_padding=pad) as mine:
                res["split"][key] = list(mine)
            rows = torch.arange(length * 2, dtype=torch.float32).view(length, 2)
            with acc.split_between_processes(rows, apply_padding=pad) as mine:
                res["split_tensor"][key] = mine.tolist()

    # pad_across_processes: rank r holds an (r+1) x (r+2) tensor.
    x = torch.arange((r + 1) * (r + 2), dtype=torch.float32).view(r + 1, r + 2) + 1
    for dim, value, first in [(0, 0, False), (1, -1, True), (-1, 7, False), (-2, 0, True), (2, 5, False)]:
        padded = acc.pad_across_processes(x, dim=dim, pad_index=value, pad_first=first)
        res["pad"][f"{dim}:{value}:{int(first)}"] = padded.tolist()

    # A trigger raised on the last process stops everyone once.
    if r == n - 1:
        acc.set_trigger()
    res["triggers"] = [acc.check_trigger(), acc.check_trigger()]

    # Every rank draws rank 0's numbers after synchronising the CPU generator.
    torch.manual_seed(100 + r)
    res["own_draw"] = torch.rand(3).tolist()
    synchronize_rng_states(["torch"])
    res["synced_draw"] = torch.rand(3).tolist()

    # dispatch_batches: rank 0 reads 11 examples in batches of 2 and sends
    # each process its slice; gather_for_metrics drops the repeats, of
    # tensors and of objects (use_gather_object).
    for drop in (False, True):
        loader = acc.prepare(DataLoader(Stream(11), batch_size=2, drop_last=drop))
        batches, metrics, objects = [], [], []
        for batch in loader:
            batches.append(batch.tolist())
            metrics.append(acc.gather_for_metrics(batch).tolist())
            names = [f"ex{v}" for v in batch.tolist()]
            objects.append(acc.gather_for_metrics(names, use_gather_object=True))
        res[f"dispatch:{int(drop)}"] = {"batches": batches, "metrics": metrics, "objects": objects}

    # Which processes run a function, and who goes first: rank 0 writes a
    # file after a pause; every process then looks for it.
    res["runs"] = {
        "main": acc.on_main_process(lambda: r)(),
        "local_main": acc.on_local_main_process(lambda: r)(),
        "last": acc.on_last_process(lambda: r)(),
        "process_1": acc.on_process(lambda: r, process_index=1)(),
        "local_process_1": acc.on_local_process(lambda: r, local_process_index=1)(),
    }
    for kind, first in (("main", acc.main_process_first), ("local_main", acc.local_main_process_first)):
        marker = os.path.join(out, f"first-{kind}")
        with first():
            if r == 0:
                time.sleep(0.3)
                open(marker, "w").write("rank 0")
            res[f"seen_first:{kind}"] = os.path.exists(marker)

    # no_sync keeps each process's own gradient (rank r's is r + 1);
    # trigger_sync_in_backward inside it averages this backward pass's.
    layer = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    model = acc.prepare(layer)

    def gradient():
        acc.backward(model(torch.ones(1, 2)).sum() * (r + 1))
        grad = layer.weight.grad.view(-1).tolist()
        layer.weight.grad = None
        return grad

    with acc.no_sync(model):
        res["no_sync"] = gradient()
    with acc.no_sync(model), acc.trigger_sync_in_backward(model):
        res["trigger_sync_in_backward"] = gradient()
    res["synced"] = gradient()

    with open(os.path.join(out, f"rank_{r}.json"), "w") as f:
        json.dump(res, f)
    acc.wait_for_everyone()
    acc.end_training()


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


if __name__ == "__main__":
    main(sys.argv[1])
