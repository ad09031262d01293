"""Oracle for host/hearth/tests/api/data_loading.rs: the batches Accelerate's seedable
sampler, BatchSamplerShard and IterableDatasetShard give, as JSON.

argv: n batch_size seed epochs, then world configurations as
"processes:split:even:drop_last" (0/1 flags)."""
import json
import sys

import torch
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
from torch.utils.data import BatchSampler, IterableDataset


def main(n, batch_size, seed, epochs, *worlds):
    out = {"orders": [], "shards": {}, "streams": {}}
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
        # The same world over a stream of n examples: each process's
        # elements, cut into its batches.
        if not even:
            continue
        stream = Stream(n)
        per = batch_size // procs if split else batch_size
        out["streams"][w] = []
        for i in range(procs):
            shard = IterableDatasetShard(stream, batch_size, bool(drop), procs, i, split_batches=bool(split))
            items = list(shard)
            out["streams"][w].append([items[k : k + per] for k in range(0, len(items), per)])
    print(json.dumps(out))


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), *sys.argv[5:])
