"""Oracle for host/hearth/tests/api/accumulation.rs: Accelerate's own gradient
accumulation over an N-batch loader for some epochs, with a linear LambdaLR
schedule. Prints, for every micro-batch, whether gradients synced, the
learning rate after the scheduler step and the scheduler's `_step_count`,
as JSON.

Usage: accelerate_accumulation.py GA N EPOCHS TOTAL [SYNC_WITH_DATALOADER
ADJUST_SCHEDULER]: with the last two (0 or 1), the accumulation goes
through a GradientAccumulationPlugin with those flags."""
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin


def main(ga: int, n: int, epochs: int, total: int, *flags: int) -> None:
    if flags:
        sync_with_dataloader, adjust_scheduler = map(bool, flags)
        plugin = GradientAccumulationPlugin(num_steps=ga, sync_with_dataloader=sync_with_dataloader,
                                            adjust_scheduler=adjust_scheduler)
        acc = Accelerator(gradient_accumulation_plugin=plugin, cpu=True)
    else:
        acc = Accelerator(gradient_accumulation_steps=ga, cpu=True)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / total))
    loader = torch.utils.data.DataLoader([torch.ones(1) for _ in range(n)], batch_size=1)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    out = []
    for _ in range(epochs):
        for x in loader:
            with acc.accumulate(model):
                loss = model(x).sum()
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            out.append([acc.sync_gradients, opt.param_groups[0]["lr"], sched.scheduler._step_count])
    print(json.dumps(out))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
