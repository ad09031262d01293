"""Today's causal-LM families as a user brings them: a transformers Llama,
Qwen2, Mistral or GPT-2 with random weights (no download), saved with
`save_pretrained` and exported with `torch.jit.trace` behind a four-line
wrapper that returns the logits (its parameters are then named
`m.<name>`). Shared by the tests that train them with hearth, and by
examples/bench/traced_llama.py (the 103M Llama of `make bench-fsdp`).

`tests/conftest.py`'s `traced` fixture traces each family once per test
session."""
import pathlib

import torch

# Small enough for a 2-core CPU: 2 decoder layers of width 64 over bytes,
# grouped-query attention (4 heads sharing 2 key/value heads).
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
GPT2_SIZES = dict(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)

# family: (config class, model class, decoder layer class) in transformers.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralDecoderLayer"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "GPT2Block"),
}


def layer_class(family: str) -> str:
    """The decoder layer's class: what `transformer-cls-names-to-wrap` names."""
    return FAMILIES[family][2]


def config(family: str, **overrides):
    import transformers

    sizes = {**(GPT2_SIZES if family == "gpt2" else SIZES), **overrides}
    cls = getattr(transformers, FAMILIES[family][0])
    # Byte tokens: the special tokens must lie inside the vocabulary.
    return cls(**sizes, bos_token_id=0, eos_token_id=0, torchscript=True)


def model(family: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, FAMILIES[family][1])
    return cls(config(family, **overrides)).eval()


class Logits(torch.nn.Module):
    """`m(input_ids)` → logits, the contract of `kind = "torchscript"`."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids, use_cache=False)[0]


class WithLabels(torch.nn.Module):
    """`m(input_ids, labels=labels)` → transformers' `(loss, logits)`, the
    contract of `output = "loss"`."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, labels):
        return self.m(input_ids, labels=labels, use_cache=False, return_dict=False)


def export(m, path: pathlib.Path, seq_len: int = 64, labels: bool = False) -> pathlib.Path:
    """`m` traced behind `Logits` (or `WithLabels`) on a [2, seq_len] batch."""
    ids = torch.zeros(2, seq_len, dtype=torch.long)
    wrapper, example = (WithLabels(m), (ids, ids)) if labels else (Logits(m), ids)
    torch.jit.trace(wrapper, example).save(str(path))
    return path


def build(family: str, folder: pathlib.Path, seed: int = 0, seq_len: int = 64, **overrides) -> dict:
    """A model of `family` in `folder`: `pretrained/` (`save_pretrained`)
    and `model.pt` (traced, the same weights); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    m = model(family, seed, **overrides)
    m.save_pretrained(folder / "pretrained")
    return {"pretrained": folder / "pretrained", "traced": export(m, folder / "model.pt", seq_len)}
