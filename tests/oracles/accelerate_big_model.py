"""Oracle for hearth's big-model utilities: Accelerate's own
`compute_module_sizes`, `get_max_layer_size`, `calculate_maximum_sizes`,
`get_balanced_memory` and `infer_auto_device_map` (with what they log, warn
and, with verbose, print) on the PyTorch twin of a hearth model.

Usage: python accelerate_big_model.py '<json spec>'
  {"model": {"kind": "gpt", "vocab_size", "block_size", "d_model", "layers", "heads"}
          | {"kind": "mlp", "vocab_size", "context", "d_model", "hidden"}
          | {"kind": "torchscript", "vocab_size", "d_model", "layers", "save": PATH},
   "cases": [{"max_memory": {"0": bytes, "cpu": bytes, ...}, "no_split": [...],
              "dtype": "bfloat16" | null, "low_zero": bool, "verbose": bool,
              "clean_result": bool, "offload_buffers": bool,
              "fallback_allocation": bool, "balanced": bool}]}
A torchscript model is the TiedNet below (a top-level parameter, tied
embedding and head weights, BatchNorm buffers, a parameter-less GELU child),
scripted and saved to PATH for hearth to load; Accelerate runs on the eager
module it was scripted from. Prints one JSON object: the sizes in
Accelerate's key order, the top-level largest layer, and per case the
balanced max_memory (when asked), the device map, and the messages — or
{"error"} where Accelerate itself fails."""
import contextlib
import io
import json
import logging
import pathlib
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import (
    calculate_maximum_sizes,
    compute_module_sizes,
    get_balanced_memory,
    get_max_layer_size,
    infer_auto_device_map,
)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peer_gpt  # noqa: E402


class MLP(nn.Module):
    """hearth's `mlp` model: each position sees the embeddings of the
    `context` tokens ending at it (zero-padded)."""

    def __init__(self, vocab_size, context, d_model, hidden):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.fc = nn.Linear(context * d_model, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx):
        emb = self.tok(idx)
        t = emb.shape[1]
        shifted = [F.pad(emb, (0, 0, k, 0))[:, :t] for k in range(self.context)]
        return self.head(F.gelu(self.fc(torch.cat(shifted, -1))))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        h = self.out(self.act(self.fc(self.ln(x))))
        return x + self.bn(h.transpose(1, 2)).transpose(1, 2)


class TiedNet(nn.Module):
    """A model with what hearth's own models lack: a parameter on the root,
    tied weights, buffers and a module without parameters."""

    def __init__(self, vocab_size, d_model, layers):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d_model))
        self.tok = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList([Block(d_model) for _ in range(layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(spec):
    torch.manual_seed(0)
    kind = spec["kind"]
    if kind == "gpt":
        return peer_gpt.build(spec["vocab_size"], spec["block_size"], spec["d_model"], spec["layers"], spec["heads"])
    if kind == "mlp":
        return MLP(spec["vocab_size"], spec["context"], spec["d_model"], spec["hidden"])
    model = TiedNet(spec["vocab_size"], spec["d_model"], spec["layers"])
    # Running statistics that are not the defaults, so that they matter.
    for block in model.blocks:
        block.bn.running_mean.uniform_(-1, 1)
        block.bn.running_var.uniform_(0.5, 2)
    model.eval()
    if spec.get("save"):
        torch.jit.script(model).save(spec["save"])
    return model


def device_key(k):
    return int(k) if k.isdigit() else k


def top_level(model):
    return (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )


class Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def run_case(model, case, messages):
    dtype = getattr(torch, case["dtype"]) if case.get("dtype") else None
    max_memory = {device_key(k): v for k, v in case["max_memory"].items()}
    no_split = case.get("no_split", [])
    out = {}
    if case.get("balanced"):
        messages.records.clear()
        out["balanced"] = {
            str(k): v
            for k, v in get_balanced_memory(
                model, dict(max_memory), no_split, dtype=dtype, low_zero=case.get("low_zero", False)
            ).items()
        }
        out["balanced_warnings"] = [m for level, m in messages.records if level == "WARNING"]
    messages.records.clear()
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        try:
            device_map = infer_auto_device_map(
                model,
                max_memory=dict(max_memory),
                no_split_module_classes=no_split,
                dtype=dtype,
                verbose=case.get("verbose", False),
                clean_result=case.get("clean_result", True),
                offload_buffers=case.get("offload_buffers", False),
                fallback_allocation=case.get("fallback_allocation", False),
            )
        except Exception as e:  # Accelerate's own failure, reported as such
            out["error"] = f"{type(e).__name__}: {e}"
            return out
    out["device_map"] = device_map
    out["warnings"] = [m for level, m in messages.records if level == "WARNING"] + [str(w.message) for w in caught]
    out["info"] = [m for level, m in messages.records if level == "INFO"]
    out["printed"] = printed.getvalue()
    return out


def main(spec):
    model = build(spec["model"])
    messages = Messages()
    logger = logging.getLogger("accelerate.utils.modeling")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sizes = compute_module_sizes(model)
    no_split = spec.get("no_split", [])
    total, largest = calculate_maximum_sizes(model)
    return {
        "sizes": list(sizes.items()),
        "sizes_bf16": list(compute_module_sizes(model, dtype=torch.bfloat16).items()),
        "max_layer": list(get_max_layer_size(top_level(model), sizes, no_split)),
        "maximum_sizes": [total, list(largest)],
        "cases": [run_case(model, case, messages) for case in spec.get("cases", [])],
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
