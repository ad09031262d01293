"""A transformers GPT-2 as a user brings one: random init (no download),
saved with `save_pretrained` and exported with `torch.jit.trace` behind a
wrapper that returns the logits (its parameters are named `m.<name>`).
Shared by the tests that train it with hearth."""
import pathlib

import torch

# Small enough for a 2-core CPU: 2 blocks of width 32 over bytes.
SIZES = dict(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def config(**overrides):
    from transformers import GPT2Config

    sizes = {**SIZES, **overrides}
    # Byte tokens: the special tokens must lie inside the vocabulary.
    return GPT2Config(**sizes, bos_token_id=0, eos_token_id=0, torchscript=True)


def model(seed: int, **overrides):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(config(**overrides)).eval()


class Logits(torch.nn.Module):
    """`m(input_ids)` → logits, the contract of `kind = "torchscript"`."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids)[0]


class WithLabels(torch.nn.Module):
    """`m(input_ids, labels=labels, return_dict=False)` → transformers'
    tuple `(loss, logits)`, the contract of `output = "loss"`."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, labels):
        return self.m(input_ids, labels=labels, use_cache=False, return_dict=False)


class Tuple(torch.nn.Module):
    """`m(input_ids, return_dict=False)` → the tuple `(logits,)`."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids, use_cache=False, return_dict=False)


def export_with_labels(m, path: pathlib.Path) -> pathlib.Path:
    ids = torch.zeros(2, m.config.n_positions, dtype=torch.long)
    torch.jit.trace(WithLabels(m), (ids, ids)).save(str(path))
    return path


def export(m, path: pathlib.Path) -> pathlib.Path:
    seq = m.config.n_positions
    torch.jit.trace(Logits(m), torch.zeros(2, seq, dtype=torch.long)).save(str(path))
    return path


def held_out_loss(m, ids, seq_len: int) -> float:
    """The mean next-token cross-entropy over held-out `ids` cut into
    windows of seq_len + 1, as `hearth run` scores its validation part."""
    window = seq_len + 1
    count = len(ids) // window
    data = torch.as_tensor([list(ids[k * window:(k + 1) * window]) for k in range(count)], dtype=torch.long)
    with torch.no_grad():
        logits = m(data[:, :-1])[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)).item()


def validation_loss(m, text: bytes, seq_len: int) -> float:
    """`held_out_loss` of a text file's last tenth (`kind = "text-file"`)."""
    return held_out_loss(m, text[len(text) * 9 // 10:], seq_len)
