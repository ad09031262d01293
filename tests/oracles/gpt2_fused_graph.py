"""Oracle for hearth's TorchScript graph fusion (host/ops/csrc/jit_fuse.cpp,
tests `api::fused_graph`): a transformers GPT-2 as a user exports it
(tests/hf_gpt2.py: traced behind a wrapper returning logits, with its tanh
GELU), one batch of tokens, and PyTorch's values for them. FORM is how it
was traced:
  cache     as called plainly: an empty key and value cache in each block,
            attention with is_causal and no mask
  no-cache  use_cache=False: no cache, but a causal mask transformers
            computes from the positions (hearth checks it on each call)
  padded    use_cache=False and a padding mask from the ids (token 0 is
            padding): a mask that is not causal, so libtorch's attention

Writes to DIR:
  gpt2.pt               the traced module (hearth loads it fused and not)
  batch.safetensors     `ids` [4, 64] and `targets` [4, 64]
  pytorch.safetensors   `f64.logits` and `f64.grad.<name>`: the eager
                        module in float64 (the exact values, up to float64
                        rounding); `f32.logits` and `f32.grad.<name>`: the
                        traced module in float32 run by libtorch op by op
                        (what hearth runs unfused), the loss being the mean
                        next-token cross-entropy in each

The tolerance the test derives from them: a fused value is within 4 times
float32 libtorch's distance from float64, plus 64 units of float32 rounding
of the largest float64 value (as api::pytorch_parity). Fusing changes which
float32 roundings happen (one gelu kernel instead of eight ops, a gradient
in one formula instead of autograd through the chain) but not the formula,
so its error is of float32 libtorch's own size, not a multiple of the
values. Usage: python gpt2_fused_graph.py DIR [cache|no-cache|padded]
"""
import pathlib
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import hf_gpt2  # noqa: E402

# Weights drawn wide (transformers' default is std 0.02) so that the GELUs'
# inputs span their curved range, where a wrong formula shows: at std 0.02
# the exact GELU passes for the tanh one within float32 rounding.
SIZES = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.5)


class NoCache(torch.nn.Module):
    """`m(ids, use_cache=False)` → logits."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids, use_cache=False)[0]


class Padded(NoCache):
    """Logits with token 0 as padding: keys holding it are masked out."""

    def forward(self, input_ids):
        return self.m(input_ids, attention_mask=(input_ids != 0).long(), use_cache=False)[0]


WRAPPERS = {"cache": hf_gpt2.Logits, "no-cache": NoCache, "padded": Padded}


def loss_and_grads(module, ids, targets):
    module.zero_grad(set_to_none=True)
    logits = module(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    return logits.detach(), grads


def write_values(traced_path, exact, ids, targets, out) -> None:
    """out/pytorch.safetensors: `f32.*` from the traced module at
    `traced_path` run op by op, `f64.*` from `exact` (the eager module in
    float64) under the names the traced module gives its parameters."""
    tensors = {}
    traced = torch.jit.load(str(traced_path))
    traced.train()
    logits, grads = loss_and_grads(traced, ids, targets)
    tensors["f32.logits"] = logits
    tensors.update({f"f32.grad.{n}": g for n, g in grads.items()})
    logits, grads = loss_and_grads(exact.train(), ids, targets)
    tensors["f64.logits"] = logits
    # The traced module names a tied weight once; take the same names.
    tensors.update({f"f64.grad.{n}": grads[n] for n in [k[len("f32.grad."):] for k in list(tensors)
                                                         if k.startswith("f32.grad.")]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "pytorch.safetensors")


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    wrapper = WRAPPERS[sys.argv[2] if len(sys.argv) > 2 else "cache"]
    model = hf_gpt2.model(0, **SIZES)
    seq = model.config.n_positions
    torch.manual_seed(1)
    tokens = torch.randint(1, model.config.vocab_size, (4, seq + 1))
    # Padding at a few places in every row but never first, so that no
    # position is left with nothing to attend to.
    tokens[:, 5::9] = 0
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # Traced on the batch: padding in the example keeps the padding mask
    # in the graph (transformers drops an all-true one while tracing).
    torch.jit.trace(wrapper(model), ids[:2]).save(str(out / "gpt2.pt"))
    save_file({"ids": ids, "targets": targets}, out / "batch.safetensors")

    write_values(out / "gpt2.pt", wrapper(model).double(), ids, targets, out)

if __name__ == "__main__":
    main()
