"""PyTorch's profiler on a scripted module with with_stack, with_modules
and profile_memory on: saves the module as argv[1]/m.pt and prints, as
JSON, what the trace says of its operators (the call stack and module
path of aten::linear and aten::relu) and whether allocations were traced
as `[memory]` events. The Rust test profiles the saved module under
hearth's `Accelerator::profile` and extracts the same."""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def traced(trace):
    """The operators' stacks and module paths, and whether memory was traced."""
    events = trace["traceEvents"]
    out = {"memory": any(e.get("name") == "[memory]" for e in events)}
    for name in ("aten::linear", "aten::relu"):
        first = next(e for e in events if e.get("name") == name)
        out[name] = {k: v for k, v in first.get("args", {}).items() if k in ("Call stack", "Module Hierarchy")}
    return out


if __name__ == "__main__":
    path = os.path.join(sys.argv[1], "m.pt")
    torch.jit.script(Net()).save(path)
    model = torch.jit.load(path)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, with_modules=True, profile_memory=True) as prof:
        model(torch.ones(2, 4))
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            print(json.dumps(traced(json.load(f))))
