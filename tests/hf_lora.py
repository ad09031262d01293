"""A PEFT LoRA fine-tune as a user sets it up: a transformers Llama with
random weights saved with `save_pretrained` (the base), PEFT's LoRA
(`r = 8`, `lora_alpha = 16`, on `q_proj` and `v_proj`) saved with
`PeftModel.save_pretrained` (the adapter to start from), and the
`PeftModel` traced behind the logits wrapper. The traced module's own
weights are another draw than the base's and the adapter's, so a run
that trains what these files hold has read both (`init-from`,
`adapter-from`). Shared by tests/test_lora.py, its Accelerate + peft
oracle and examples/bench/traced_llama_lora.py."""
import pathlib

import numpy as np
import torch

import hf_causal
from text_data import TEXT

LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def peft_model(base, **overrides):
    import peft

    return peft.get_peft_model(base, peft.LoraConfig(**{**LORA, **overrides}))


def build(folder: pathlib.Path, seq_len: int = 64, **sizes) -> dict:
    """`base/`, `adapter/` (its lora_B drawn, not zero: loading it shows),
    `lora.pt` and `text.npy` (the corpus as int64 byte ids) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    base = hf_causal.model("llama", 0, **sizes)
    base.save_pretrained(folder / "base")
    start = peft_model(hf_causal.model("llama", 0, **sizes))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in start.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    start.save_pretrained(folder / "adapter")
    traced = peft_model(hf_causal.model("llama", 5, **sizes))
    hf_causal.export(traced, folder / "lora.pt", seq_len)
    np.save(folder / "text.npy", np.frombuffer(TEXT, dtype=np.uint8).astype(np.int64))
    return {"base": folder / "base", "adapter": folder / "adapter", "traced": folder / "lora.pt"}


def windows(folder: pathlib.Path, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` sequential windows of `text.npy` as hearth cuts
    them: window k holds ids [k·seq_len, (k+1)·seq_len]."""
    ids = torch.from_numpy(np.load(folder / "text.npy"))
    return torch.stack([ids[k * seq_len:(k + 1) * seq_len + 1] for k in range(count)])


def peft_from(folder: pathlib.Path, adapter: pathlib.Path, trainable: bool = False):
    """PeftModel.from_pretrained on the base in `folder`."""
    import peft
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(folder / "base").eval()
    return peft.PeftModel.from_pretrained(base, adapter, is_trainable=trainable)
