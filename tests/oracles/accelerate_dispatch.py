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
offload indexes, the `.dat` files whose bytes differ between them, and
`Accelerator.verify_device_map` of the dispatched model and of one
dispatched whole onto the CPU.

With "save": PATH in the spec, the model is accelerate_big_model.py's
TiedNet (tied weights, buffers, a root parameter): the oracle writes its
checkpoint and a scripted copy with other weights to PATH, and the logits
of the checkpoint's model (`checkpoint_model`) and of Accelerate's
dispatched model (`accelerate`)."""
import json
import os
import pathlib
import sys

import torch
from accelerate import Accelerator, dispatch_model, load_checkpoint_and_dispatch
from accelerate.utils import load_offloaded_weights
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402


def fresh(sizes):
    # Weights that are not the checkpoint's: anything not loaded shows.
    torch.manual_seed(1234)
    return peer_gpt.build(**sizes)


def torchscript(spec):
    """The TiedNet of accelerate_big_model.py: its checkpoint (from one
    model), a scripted copy with other weights for hearth to load it into,
    the logits of the checkpoint's model and of Accelerate's dispatched one."""
    import accelerate_big_model
    from safetensors.torch import save_model

    sizes, tokens = spec["sizes"], torch.tensor(spec["tokens"])
    model = accelerate_big_model.build({"kind": "torchscript", **sizes})
    os.makedirs(spec["checkpoint"], exist_ok=True)
    save_model(model, os.path.join(spec["checkpoint"], "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        want = model(tokens)
    torch.manual_seed(99)
    other = accelerate_big_model.TiedNet(sizes["vocab_size"], sizes["d_model"], sizes["layers"]).eval()
    torch.jit.script(other).save(spec["save"])
    torch.manual_seed(98)
    fresh_model = accelerate_big_model.TiedNet(sizes["vocab_size"], sizes["d_model"], sizes["layers"]).eval()
    dispatched = load_checkpoint_and_dispatch(
        fresh_model, spec["checkpoint"], device_map=spec["device_map"],
        offload_folder=spec["accelerate_offload"], offload_buffers=spec.get("offload_buffers", False),
    )
    with torch.no_grad():
        accelerate_logits = dispatched(tokens)
    save_file({"checkpoint_model": want.contiguous(), "accelerate": accelerate_logits.contiguous()}, spec["out"])
    # Whether Accelerate loaded the running statistics of a block on the disk
    # (kept in the model unless buffers are offloaded too).
    kept = dispatched.blocks[0].bn.running_mean
    loaded = None if kept.is_meta else torch.equal(kept, model.blocks[0].bn.running_mean)
    return {"accelerate_loaded_disk_buffers": loaded}


def main(spec):
    if "save" in spec:
        return torchscript(spec)
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
    # Accelerator.verify_device_map of this model, and of one dispatched
    # whole onto the CPU (a map of one entry).
    acc = Accelerator(cpu=True)
    whole = dispatch_model(fresh(sizes), device_map={"": "cpu"})
    verified = {"mapped": acc.verify_device_map(dispatched), "whole": acc.verify_device_map(whole)}
    theirs = json.loads((pathlib.Path(spec["accelerate_offload"]) / "index.json").read_text())
    differ = [
        name
        for name in theirs
        if (pathlib.Path(spec["accelerate_offload"]) / f"{name}.dat").read_bytes()
        != (pathlib.Path(folder) / f"{name}.dat").read_bytes()
    ]
    return {"hearth_index": index, "accelerate_index": theirs, "dat_differ": differ, "verify_device_map": verified}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
