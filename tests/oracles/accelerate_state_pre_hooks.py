"""Oracle for host/hearth/tests/checkpoint/checkpointing.rs: Accelerate's save_state and
load_state pre-hooks on two prepared models (Linear(3, 4), Linear(4, 2)).
The save hook writes hook.txt into the checkpoint and drops the first
model's weights; the load hook drops the first model. Prints, as JSON, the
model files and hook.txt in the checkpoint, the names and shapes in
model.safetensors, which model a load restored, and the files of a second
save after both hooks' handles were removed.
Usage: accelerate_state_pre_hooks.py DIR"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from safetensors import safe_open


def listed(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("model") or f == "hook.txt")


def main(out):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    a, b = acc.prepare(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def save_hook(models, weights, output_dir):
        with open(os.path.join(output_dir, "hook.txt"), "w") as f:
            f.write("written by the save hook")
        weights.pop(0)

    def load_hook(models, input_dir):
        models.pop(0)

    save_handle = acc.register_save_state_pre_hook(save_hook)
    load_handle = acc.register_load_state_pre_hook(load_hook)
    first = os.path.join(out, "first")
    acc.save_state(first)
    with safe_open(os.path.join(first, "model.safetensors"), "pt") as f:
        keys = {k: list(f.get_tensor(k).shape) for k in f.keys()}
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    with torch.no_grad():
        for p in list(a.parameters()) + list(b.parameters()):
            p.add_(1.0)
    acc.load_state(first)
    restored = [all(torch.equal(m.state_dict()[k], s[k]) for k in s) for m, s in zip((a, b), saved)]
    save_handle.remove()
    load_handle.remove()
    second = os.path.join(out, "second")
    acc.save_state(second)
    print(json.dumps({"files": listed(first), "model_keys": keys, "restored": restored, "files_after_remove": listed(second)}, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
