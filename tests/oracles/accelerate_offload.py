"""Oracle for hearth's offload folders, both ways: Accelerate's
`offload_state_dict` writes tensors of every dtype NumPy and hearth share
(bfloat16 as int16, as Accelerate stores it) for hearth to read, and
Accelerate's `OffloadedWeightsLoader` reads the folder hearth wrote.

Usage: python accelerate_offload.py '<json spec>'
  {"tensors": FILE.safetensors, "write": DIR, "read": DIR}
Writes the tensors of FILE into DIR `write` with Accelerate, reads DIR
`read` (hearth's) with Accelerate and prints {"read_equal": {name: bool},
"read_dtypes": {name: dtype}}."""
import json
import sys

import torch
from accelerate.utils import OffloadedWeightsLoader, offload_state_dict
from safetensors.torch import load_file


def main(spec):
    tensors = load_file(spec["tensors"])
    offload_state_dict(spec["write"], tensors)
    loader = OffloadedWeightsLoader(save_folder=spec["read"])
    equal, dtypes = {}, {}
    for name, want in tensors.items():
        got = loader[name]
        dtypes[name] = str(got.dtype)
        equal[name] = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert sorted(loader) == sorted(tensors), (sorted(loader), sorted(tensors))
    return {"read_equal": equal, "read_dtypes": dtypes}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
