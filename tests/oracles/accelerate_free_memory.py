"""Oracle for host/hearth/tests/api/accelerator.rs: what Accelerate's free_memory (and
clear) forget. Prepares a model, an optimizer and a scheduler with
gradient accumulation 2, takes 3 micro-steps, then frees: prints, as JSON,
`step` and whether the next micro-batch syncs before and after, and the
model/optimizer/scheduler files of a save_state before and after.
Usage: accelerate_free_memory.py DIR"""
import json
import os
import sys

import torch
from accelerate import Accelerator


def state_files(acc, folder):
    acc.save_state(folder)
    return sorted(f for f in os.listdir(folder) if f.split(".")[0].split("_")[0] in ("model", "optimizer", "scheduler"))


def micro_steps(acc, model, n):
    for _ in range(n):
        with acc.accumulate(model):
            pass


def main(out):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    micro_steps(acc, model, 3)
    before = {"step": acc.step, "files": state_files(acc, os.path.join(out, "before"))}
    acc.free_memory(model, opt, sched)
    after = {"step": acc.step, "files": state_files(acc, os.path.join(out, "after"))}
    micro_steps(acc, torch.nn.Linear(1, 1), 1)
    after["step_after_one_more"] = acc.step
    print(json.dumps({"before": before, "after": after}, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
