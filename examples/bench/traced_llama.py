"""Builds the 103M-parameter traced Llama the sharding benchmarks measure
(and the adapter, export and tensor-parallel rows reuse): a transformers
LlamaForCausalLM with random weights, d 1024, 8 decoder layers of 16 heads,
SwiGLU width 2816, over bytes (vocab 256), saved with `save_pretrained`
and traced behind the logits wrapper of tests/hf_causal.py.

Usage: python traced_llama.py OUT_DIR   → OUT_DIR/pretrained/, OUT_DIR/model.pt
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import hf_causal  # noqa: E402

SIZES = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=2816, vocab_size=256, max_position_embeddings=128)
SEQ_LEN = 64


def build(folder: pathlib.Path) -> dict:
    """The model in `folder` (built once: an existing one is reused)."""
    done = {"pretrained": folder / "pretrained", "traced": folder / "model.pt"}
    if not done["traced"].exists():
        done = hf_causal.build("llama", folder, seed=0, seq_len=SEQ_LEN, **SIZES)
    return done


if __name__ == "__main__":
    built = build(pathlib.Path(sys.argv[1]))
    print(built["pretrained"], built["traced"])
