"""Accelerate's set_seed(seed, device_specific=False, deterministic=True):
the first values torch.rand draws after it, whether deterministic
algorithms are then on, and whether a fresh torch.empty is all NaN."""
import json
import sys

import torch
from accelerate.utils import set_seed

set_seed(int(sys.argv[1]), device_specific=False, deterministic=True)
rand = torch.rand(4, dtype=torch.float64).tolist()
print(json.dumps({
    "rand": rand,
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "empty_is_nan": bool(torch.empty(8).isnan().all()),
}))
