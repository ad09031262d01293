"""The GPT class of the peer benchmark (shared/bench/peer_gpt_accelerate.py),
loaded from that very file so hearth is checked against the peer's model and
not a copy of it. Sizes are module globals there; `build` sets them."""
import os
import pathlib

import torch


def peer_script() -> pathlib.Path:
    env = os.environ.get("HEARTH_SHARED_DIR")
    root = pathlib.Path(__file__).resolve().parents[2]
    shared = pathlib.Path(env) if env else root.parent / "shared"
    path = shared / "bench" / "peer_gpt_accelerate.py"
    if not path.exists():
        raise SystemExit(f"peer benchmark not found at {path}; set HEARTH_SHARED_DIR to the folder holding bench/")
    return path


def build(vocab_size, block_size, d_model, layers, heads) -> torch.nn.Module:
    source = peer_script().read_text()
    # The script ends by calling main(); take only its definitions.
    source = source[: source.rindex("\nmain()")]
    namespace = {"__name__": "peer_gpt"}
    exec(compile(source, str(peer_script()), "exec"), namespace)
    namespace.update(V=vocab_size, T=block_size, D=d_model, L=layers, H=heads)
    return namespace["GPT"]()
