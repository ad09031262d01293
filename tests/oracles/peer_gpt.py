"""The GPT class of the peer benchmark (shared/bench/peer_gpt_accelerate.py),
loaded from that very file so hearth is checked against the peer's model.
The shared folder is found through HEARTH_SHARED_DIR, else as `shared/` beside
the repository or one of its ancestors, else /work/shared; a clone somewhere
else (a CI folder) falls back to the snapshot beside this file, which
tests/test_run.py checks is identical to the shared file whenever that is
present. Sizes are module globals there; `build` sets them."""
import os
import pathlib
import sys
import types

import torch


SNAPSHOT = pathlib.Path(__file__).resolve().parent / "peer_gpt_accelerate.py"


def shared_bench_file(name: str):
    """`bench/<name>` in the shared folder, or None when there is none."""
    env = os.environ.get("HEARTH_SHARED_DIR")
    root = pathlib.Path(__file__).resolve().parents[2]
    candidates = [pathlib.Path(env)] if env else [p / "shared" for p in root.parents] + [pathlib.Path("/work/shared")]
    for shared in candidates:
        path = shared / "bench" / name
        if path.exists():
            return path
    return None


def shared_peer_script():
    """The peer GPT script in the shared folder, or None when there is none."""
    return shared_bench_file("peer_gpt_accelerate.py")


def peer_script() -> pathlib.Path:
    return shared_peer_script() or SNAPSHOT


def build(vocab_size, block_size, d_model, layers, heads, positions_on_input_device=False) -> torch.nn.Module:
    """The peer's GPT at these sizes. With `positions_on_input_device`, its
    positions are made on the tokens' device (the script makes them on the
    default device, which a GPU run would otherwise have to move with
    `torch.set_default_device`, a cost on every torch call from Python)."""
    source = peer_script().read_text()
    # The script ends by calling main(); take only its definitions.
    source = source[: source.rindex("\nmain()")]
    if positions_on_input_device:
        cpu_positions = "torch.arange(idx.shape[1])"
        assert cpu_positions in source, f"{peer_script()} no longer makes its positions with {cpu_positions}"
        source = source.replace(cpu_positions, "torch.arange(idx.shape[1], device=idx.device)")
    # A module of its own, known to sys.modules: torch.compile looks the
    # model's globals (its sizes) up there.
    module = types.ModuleType("peer_gpt_model")
    sys.modules[module.__name__] = module
    exec(compile(source, str(peer_script()), "exec"), module.__dict__)
    module.__dict__.update(V=vocab_size, T=block_size, D=d_model, L=layers, H=heads)
    return module.GPT()
