"""Oracle for the Llama-family rewrites of hearth's graph pass
(host/ops/csrc/jit_patterns.cpp, jit_fuse.cpp; tests `api::fused_graph`):
a transformers Llama, Qwen2 or Mistral as a user traces it
(tests/hf_causal.py: random init, 2 decoder layers of 4 heads sharing 2
key/value heads, behind the logits wrapper), one batch, and PyTorch's
values for it. FORM is how it was traced:
  plain     `m(ids, use_cache=False)`: the causal mask transformers
            computes in the graph (hearth checks it on each call)
  padded    with a padding mask from the ids (token 0 is padding): a mask
            that is not causal, so the masked attention over repeated heads

Writes to DIR the same files as gpt2_fused_graph.py (model.pt,
batch.safetensors, pytorch.safetensors: `f64.*` from the eager module in
float64, `f32.*` from the traced module run by libtorch op by op); the test
derives the same bound from them.
Usage: python llama_fused_graph.py DIR FAMILY [plain|padded]
"""
import pathlib
import sys

import torch
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import hf_causal  # noqa: E402
from gpt2_fused_graph import write_values  # noqa: E402

SEQ = 48
# Weights drawn wider than transformers' default (0.02), so that the gates
# reach silu's curved range and the norms see rows of differing scale.
INIT = dict(initializer_range=0.3)


class Padded(hf_causal.Logits):
    """Logits with token 0 as padding: keys holding it are masked out."""

    def forward(self, input_ids):
        return self.m(input_ids, attention_mask=(input_ids != 0).long(), use_cache=False)[0]


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    family = sys.argv[2]
    form = sys.argv[3] if len(sys.argv) > 3 else "plain"
    wrapper = {"plain": hf_causal.Logits, "padded": Padded}[form]
    out.mkdir(parents=True, exist_ok=True)
    model = hf_causal.model(family, 0, **INIT)
    torch.manual_seed(1)
    tokens = torch.randint(1, model.config.vocab_size, (3, SEQ + 1))
    # Padding in every row but never first, so that no query is left with
    # nothing to attend to; in the example too, so the trace keeps the mask.
    if form == "padded":
        tokens[:, 5::9] = 0
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    torch.jit.trace(wrapper(model), ids[:2]).save(str(out / "model.pt"))
    save_file({"ids": ids, "targets": targets}, out / "batch.safetensors")

    write_values(out / "model.pt", wrapper(model).double(), ids, targets, out)

if __name__ == "__main__":
    main()
