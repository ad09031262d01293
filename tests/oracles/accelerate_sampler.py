"""Oracle for host/tests/accelerator.rs: the batches Accelerate's seedable
sampler and BatchSamplerShard give, as JSON.

argv: n batch_size seed epochs, then world configurations as
"processes:split:even:drop_last" (0/1 flags)."""
import json
import sys

import torch
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
from torch.utils.data import BatchSampler


def main(n, batch_size, seed, epochs, *worlds):
    out = {"orders": [], "shards": {}}
    sampler = SeedableRandomSampler(range(n), data_seed=seed)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out["orders"].append(list(sampler))
    for w in worlds:
        procs, split, even, drop = map(int, w.split(":"))
        batches = BatchSampler(range(n), batch_size, drop_last=bool(drop))
        out["shards"][w] = [
            list(BatchSamplerShard(batches, procs, i, split_batches=bool(split), even_batches=bool(even)))
            for i in range(procs)
        ]
    print(json.dumps(out))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), *sys.argv[5:])
