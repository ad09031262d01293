"""torch.amp.GradScaler("cpu", ...) over a sequence of steps: argv is
init_scale growth_factor backoff_factor growth_interval enabled, then one
word per step, "ok" (gradients of 1) or "nan" (a NaN gradient). Prints one
JSON object: the scale after each step, and the parameter after all of them
(SGD, lr 0.1, from ones)."""
import json
import sys

import torch

init, growth, backoff, interval, enabled, *steps = sys.argv[1:]
scaler = torch.amp.GradScaler("cpu", init_scale=float(init), growth_factor=float(growth),
                              backoff_factor=float(backoff), growth_interval=int(interval),
                              enabled=enabled == "true")
p = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([p], lr=0.1)
scales = []
for step in steps:
    factor = float("nan") if step == "nan" else 1.0
    loss = (p * torch.tensor([factor, 1.0])).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scales.append(scaler.get_scale())
print(json.dumps({"scales": scales, "param": p.detach().tolist()}))
