"""The Llama-family rows of `make bench-llama`: today's models as a user
brings them (tests/hf_causal.py: random init, traced behind the logits
wrapper), at the sizes of the issue that measured them: width 256, 4
decoder layers of 8 heads sharing 4 key/value heads, SwiGLU width 688, a
vocabulary of 256, trained on batches of 16 × 64 random tokens.

  hearth    the traced module, trained by `hearth run` (`kind = "torchscript"`)
  peers     the eager transformers module (SDPA attention) under Accelerate,
            as it is and compiled (cpu_peer.py --model llama|qwen2)

`python llama_model.py DIR FAMILY [bf16]` writes DIR/FAMILY.pt and
DIR/bench.toml, hearth's job for the row. cpu_rows.py runs both sides.
"""
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import hf_causal  # noqa: E402

FAMILIES = ("llama", "qwen2")
VOCAB, SEQ, BATCH = 256, 64, 16
SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=688, vocab_size=VOCAB, max_position_embeddings=SEQ)
STEPS = 60


def model(family: str, seed: int = 0):
    """The row's model (transformers' default SDPA attention), in training mode."""
    return hf_causal.model(family, seed, **SIZES).train()


def logits_of(family: str, seed: int = 0):
    """What the peers train: the model behind the logits wrapper."""
    return hf_causal.Logits(model(family, seed))


def export(out: pathlib.Path, family: str, precision: str = "no") -> pathlib.Path:
    """Writes out/FAMILY.pt (traced) and out/bench.toml; returns the config."""
    out.mkdir(parents=True, exist_ok=True)
    traced = out / f"{family}.pt"
    if not traced.exists():
        hf_causal.export(hf_causal.model(family, 0, **SIZES), traced, SEQ)
    config = out / "bench.toml"
    config.write_text(f"""[run]
name = "bench"
steps = {STEPS}
log-every = {STEPS}
mixed-precision = "{precision}"

[model]
kind = "torchscript"
path = "{traced.name}"

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
    print(export(pathlib.Path(sys.argv[1]), sys.argv[2], *(sys.argv[3:4] or ["no"])))
