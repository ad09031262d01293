"""Oracle for hearth's FSDP auto-wrap planning: which modules of the peer
benchmark's GPT become FSDP units under Accelerate's FullyShardedDataParallelPlugin
(fsdp_version 1), decided by Accelerate's own `set_auto_wrap_policy` and torch's
own FSDP1 auto-wrap traversal (`torch.distributed.fsdp._wrap_utils._auto_wrap`,
which for Accelerate's functools.partial policies runs `_recursive_wrap` with
only_wrap_children=True). No process group is initialised: the wrapper handed to
torch is a marker that records the wrapped module and returns it unchanged.

Usage: python fsdp_wrap_units.py '<json spec>'
  {"vocab_size":256,"block_size":128,"d_model":128,"layers":4,"heads":4,
   "policy":"transformer_based_wrap"|"size_based_wrap"|"no_wrap",
   "transformer_cls_names_to_wrap":["Block"], "min_num_params":100000}
Keys left out of the spec are left to Accelerate (its FSDP_* environment
variables, then its defaults). Prints {"units": [sorted module paths]} with the
root (always a unit: FSDP wraps it) as "", or {"error": "<message>"} when
Accelerate rejects the configuration; exits 0 either way."""
import json
import pathlib
import sys

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp._wrap_utils import _auto_wrap

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402


def units(model: torch.nn.Module, auto_wrap_policy) -> list:
    paths = {id(m): name for name, m in model.named_modules()}
    wrapped = [""]  # FullyShardedDataParallel(model) always wraps the root

    def marker(module, **_kwargs):
        wrapped.append(paths[id(module)])
        return module

    # FullyShardedDataParallel.__init__ runs _auto_wrap only when a policy is set.
    if auto_wrap_policy is not None:
        _auto_wrap(model, auto_wrap_policy, set(), set(), {"mixed_precision": None}, marker)
    return sorted(wrapped)


def main(spec: dict) -> dict:
    model = peer_gpt.build(spec["vocab_size"], spec["block_size"], spec["d_model"], spec["layers"], spec["heads"])
    kwargs = {"fsdp_version": 1}
    for key, arg in (
        ("policy", "auto_wrap_policy"),
        ("transformer_cls_names_to_wrap", "transformer_cls_names_to_wrap"),
        ("min_num_params", "min_num_params"),
    ):
        if spec.get(key) is not None:
            kwargs[arg] = spec[key]
    try:
        plugin = FullyShardedDataParallelPlugin(**kwargs)
        plugin.set_auto_wrap_policy(model)
    except ValueError as e:
        return {"error": str(e)}
    return {"units": units(model, plugin.auto_wrap_policy)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
