"""Accelerate's `accelerator.profile()` with a ProfileKwargs handler, run
live: a linear layer's forward and backward for 8 steps under the schedule
skip_first=1, wait=1, warmup=1, active=2, repeat=1, recording shapes and
FLOPs, its trace written to argv[1]. Prints the steps at which
on_trace_ready was called and where the trace went (the Rust test runs the
same steps under hearth's `Accelerator::profile` and compares the traces)."""
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProfileKwargs

out = sys.argv[1]
ready = []
kwargs = ProfileKwargs(
    activities=["cpu"],
    schedule_option=dict(wait=1, warmup=1, active=2, repeat=1, skip_first=1),
    on_trace_ready=lambda prof: ready.append(prof.step_num),
    record_shapes=True,
    with_flops=True,
    output_trace_dir=out,
)
acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
x = torch.ones(4, 8)
w = torch.full((16, 8), 0.5, requires_grad=True)
b = torch.zeros(16, requires_grad=True)
with acc.profile() as prof:
    for _ in range(8):
        torch.nn.functional.linear(x, w, b).relu().sum().backward()
        prof.step()
print(json.dumps({"ready": ready, "trace": f"{out}/profile_{acc.process_index}.json"}))
