"""Accelerate's autocast(autocast_handler=AutocastKwargs(..)) on the CPU
under bf16: the dtype a Linear returns by default, with enabled=False, with
enabled=False inside a default block, and after; and whether autocast
caches casts inside cache_enabled=False and after it. One JSON object."""
import json

import torch
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs

acc = Accelerator(cpu=True, mixed_precision="bf16")
lin = torch.nn.Linear(4, 4)
x = torch.randn(2, 4)
name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
out = {}
with acc.autocast():
    out["default"] = name(lin(x))
with acc.autocast(AutocastKwargs(enabled=False)):
    out["disabled"] = name(lin(x))
with acc.autocast():
    with acc.autocast(AutocastKwargs(enabled=False)):
        out["nested_disabled"] = name(lin(x))
    out["outer_again"] = name(lin(x))
out["after"] = name(lin(x))
with acc.autocast(AutocastKwargs(cache_enabled=False)):
    out["cache_inside"] = torch.is_autocast_cache_enabled()
out["cache_after"] = torch.is_autocast_cache_enabled()
print(json.dumps(out))
