"""Oracle for host/hearth/tests/checkpoint/model_files.rs: a tch VarStore
that `save_model` wrote, loaded strictly into the PyTorch module of the same
layers, and run on the input the test ran it on.

  FILE  the model.safetensors; prints the output of
        Sequential(Linear(3, 4), Tanh(), Linear(4, 2)) on arange(6).view(2, 3)
        as JSON, and the file's metadata"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

path = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
model.load_state_dict(load_file(path), strict=True)
with torch.no_grad():
    out = model(torch.arange(6, dtype=torch.float32).view(2, 3))
with safe_open(path, "pt") as f:
    metadata = f.metadata()
print(json.dumps({"output": out.flatten().tolist(), "metadata": metadata}))
