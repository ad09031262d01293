"""The user-model rows of `make bench`: a model hearth did not write.

A transformers GPT-2 (2 blocks, width 128, 4 heads, a vocabulary of 256,
64 positions; random init, no download; dropout off, since a traced module
keeps none) trained on batches of 16 × 64 random tokens:

  hearth    the module exported with `torch.jit.trace` behind a wrapper that
            returns the logits (`use_cache=False` on both sides), trained
            by `hearth run` (`kind = "torchscript"`), as examples/finetune-hf
            does;
  peers     the eager transformers module under Accelerate, as it is and
            compiled (cpu_peer.py --model gpt2).

`python user_model.py DIR [bf16]` writes DIR/gpt2.pt and DIR/bench.toml,
hearth's job for the row. cpu_rows.py runs both sides.
"""
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import hf_gpt2  # noqa: E402  (the tests' GPT-2, as a user brings one)

VOCAB, SEQ, BATCH = 256, 64, 16
SIZES = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
STEPS = 60


def gpt2(seed: int):
    """The row's GPT-2, in training mode."""
    return hf_gpt2.model(seed, **SIZES).train()


class LogitsOf(torch.nn.Module):
    """`m(input_ids)` → logits without a cache (`use_cache=False`, as
    training wants): what both sides run, so that neither carries the
    cache's work."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids, use_cache=False)[0]


def export(out: pathlib.Path, precision: str = "no") -> pathlib.Path:
    """Writes out/gpt2.pt (traced) and out/bench.toml; returns the config."""
    out.mkdir(parents=True, exist_ok=True)
    m = hf_gpt2.model(0, **SIZES)
    torch.jit.trace(LogitsOf(m), torch.zeros(2, SEQ, dtype=torch.long)).save(str(out / "gpt2.pt"))
    config = out / "bench.toml"
    config.write_text(f"""[run]
name = "bench"
steps = {STEPS}
log-every = {STEPS}
mixed-precision = "{precision}"

[model]
kind = "torchscript"
path = "gpt2.pt"

[data]
kind = "random-tokens"
vocab-size = {VOCAB}
seq-len = {SEQ}
batch-size = {BATCH}

[optimizer]
kind = "adamw"
lr = 3e-4
""")
    return config


if __name__ == "__main__":
    print(export(pathlib.Path(sys.argv[1]), *(sys.argv[2:3] or ["no"])))
