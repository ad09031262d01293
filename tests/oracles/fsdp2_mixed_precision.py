"""Oracle for host/hearth/tests/distributed/fsdp_mixed_precision.rs: PyTorch FSDP2 with
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on the peer
benchmark's GPT class, in a world of one (gloo), from hearth's initial
weights, replaying hearth's AdamW steps. Exits non-zero unless hearth's
policy run agrees with it, and far better than hearth's float32 run."""
import json
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402


def main(folder: pathlib.Path) -> int:
    spec = json.loads((folder / "spec.json").read_text())
    io = load_file(folder / "io.safetensors")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = peer_gpt.build(spec["vocab_size"], spec["block_size"], spec["d_model"], spec["layers"], spec["heads"])
    model.load_state_dict(load_file(folder / "init.safetensors"), strict=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    x, y = io["inputs"], io["targets"]
    losses = []
    for _ in range(spec["steps"]):
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, spec["vocab_size"]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    theirs = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    dist.destroy_process_group()

    def worst(ours):
        return max((ours[n] - v).abs().max().item() for n, v in theirs.items())

    mp, fp32 = worst(load_file(folder / "after_mp.safetensors")), worst(load_file(folder / "after_fp32.safetensors"))
    loss_mp = (io["losses_mp"] - torch.tensor(losses, dtype=torch.float64)).abs().max().item()
    loss_fp32 = (io["losses_fp32"] - torch.tensor(losses, dtype=torch.float64)).abs().max().item()
    print(f"weights: policy run {mp:.3e} from PyTorch's, float32 run {fp32:.3e}; losses: {loss_mp:.3e}, {loss_fp32:.3e}")
    if not (mp <= 1e-5 and mp <= fp32 / 100 and loss_mp <= 1e-5):
        print("hearth's mixed-precision policy does not train what FSDP2's does")
        return 1
    print("hearth and PyTorch FSDP2 agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
