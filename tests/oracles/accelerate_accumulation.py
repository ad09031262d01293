"""Oracle for host/tests/accelerator.rs: Accelerate's own gradient
accumulation over a 5-batch loader for 2 epochs, with a linear LambdaLR
schedule. Prints, for every micro-batch, whether gradients synced and the
learning rate after the scheduler step, as JSON."""
import json
import sys

import torch
from accelerate import Accelerator


def main(ga: int, n: int, epochs: int, total: int) -> None:
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
            out.append([acc.sync_gradients, opt.param_groups[0]["lr"]])
    print(json.dumps(out))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
