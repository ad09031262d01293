"""Oracle for host/hearth/tests/checkpoint/model_files.rs: Linear(3,4)+BatchNorm1d(4)+Linear(4,5)
saved and split the way huggingface_hub does it, and hearth's sharded save
loaded back with plain safetensors + the index.

  make DIR   writes DIR/python_sharded/ (huggingface_hub, max 100 bytes) and
             DIR/reference.safetensors, and prints huggingface_hub's split
             plan and the state-dict order as JSON
  check DIR  loads DIR/hearth_sharded/ through its index into the model
             (strict) and compares every tensor with the reference"""
import json
import pathlib
import sys

import torch
from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5))
    m.train()
    m(torch.randn(8, 3))  # running statistics and num_batches_tracked move
    return m


def make(folder: pathlib.Path) -> None:
    sd = model().state_dict()
    (folder / "python_sharded").mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(sd, folder / "python_sharded", max_shard_size=100)
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "reference.safetensors", metadata={"format": "pt"})
    split = split_torch_state_dict_into_shards(sd, max_shard_size=100)
    print(json.dumps({
        "order": list(sd.keys()),
        "total_size": split.metadata["total_size"],
        "filename_to_tensors": split.filename_to_tensors,
    }))


def check(folder: pathlib.Path) -> int:
    shard_dir = folder / "hearth_sharded"
    index = json.loads((shard_dir / "model.safetensors.index.json").read_text())
    sd = {}
    for file in sorted(set(index["weight_map"].values())):
        sd.update(load_file(shard_dir / file))
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5))
    m.load_state_dict(sd, strict=True)
    expected = model().state_dict()
    bad = [k for k, v in m.state_dict().items() if not torch.equal(v, expected[k])]
    if bad or index["metadata"]["total_size"] != 236:
        print("differ:", bad, index["metadata"])
        return 1
    print("agree")
    return 0


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[2])
    if sys.argv[1] == "make":
        make(folder)
    else:
        sys.exit(check(folder))
