"""Oracle for hearth's device-mapped loading and dispatch: Accelerate's own
`load_checkpoint_and_dispatch` of the peer GPT with the same checkpoint and
device map, and Accelerate's `load_offloaded_weights` reading the offload
folder hearth wrote.

Usage: python accelerate_dispatch.py '<json spec>'
  {"sizes": {"vocab_size", "block_size", "d_model", "layers", "heads"},
   "checkpoint": DIR, "device_map": {module: "cpu" | "disk"},
   "hearth_offload": DIR, "accelerate_offload": DIR, "tokens": [[...]],
   "out": FILE}
Writes to FILE (safetensors) the logits of Accelerate's dispatched model
(`accelerate`) and of a model whose disk-mapped weights come only from
hearth's offload folder (`from_hearth_folder`); prints JSON with both
offload indexes and the `.dat` files whose bytes differ between them."""
import json
import os
import pathlib
import sys

import torch
from accelerate import load_checkpoint_and_dispatch
from accelerate.utils import load_offloaded_weights
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402


def fresh(sizes):
    # Weights that are not the checkpoint's: anything not loaded shows.
    torch.manual_seed(1234)
    return peer_gpt.build(**sizes)


def main(spec):
    sizes, device_map = spec["sizes"], spec["device_map"]
    tokens = torch.tensor(spec["tokens"])

    dispatched = load_checkpoint_and_dispatch(
        fresh(sizes), spec["checkpoint"], device_map=device_map, offload_folder=spec["accelerate_offload"]
    )
    with torch.no_grad():
        accelerate_logits = dispatched(tokens)

    model = fresh(sizes)
    folder = spec["hearth_offload"]
    index = json.loads((pathlib.Path(folder) / "index.json").read_text())
    state = {}
    for f in sorted(pathlib.Path(spec["checkpoint"]).glob("*.safetensors")):
        state.update({k: v for k, v in load_file(f).items() if k not in index})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert sorted(missing) == sorted(index), (missing, sorted(index))
    assert not unexpected, unexpected
    load_offloaded_weights(model, index, folder)
    with torch.no_grad():
        from_hearth_folder = model(tokens)

    save_file({"accelerate": accelerate_logits.contiguous(), "from_hearth_folder": from_hearth_folder.contiguous()}, spec["out"])
    theirs = json.loads((pathlib.Path(spec["accelerate_offload"]) / "index.json").read_text())
    differ = [
        name
        for name in theirs
        if (pathlib.Path(spec["accelerate_offload"]) / f"{name}.dat").read_bytes()
        != (pathlib.Path(folder) / f"{name}.dat").read_bytes()
    ]
    return {"hearth_index": index, "accelerate_index": theirs, "dat_differ": differ}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
