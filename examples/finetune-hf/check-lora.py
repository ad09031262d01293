"""Loads the LoRA run's adapter/ onto the base with PEFT, as any PEFT user
would, scores the held-out documents with it, and merges it into a plain
model (`hearth checkpoint merge-adapter`'s output, when given) to score
the same.

  .venv/bin/python examples/finetune-hf/check-lora.py runs/finetune-lora [MERGED]
"""
import json
import pathlib
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

run = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/finetune-lora")
here = pathlib.Path(__file__).resolve().parent
base = AutoModelForCausalLM.from_pretrained(here / "pretrained").eval()
model = PeftModel.from_pretrained(base, run / "adapter").eval()
tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(here / "pretrained" / "tokenizer.json"), eos_token="<|endoftext|>")
ids = []
for line in open(here / "data" / "val.jsonl"):
    ids += tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
window = 65
batch = torch.tensor([ids[k * window:(k + 1) * window] for k in range(len(ids) // window)])


def held_out_loss(m) -> float:
    with torch.no_grad():
        logits = m(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


hearths = json.loads((run / "summary.json").read_text())["eval"]["loss"]
print(f"held-out loss: {held_out_loss(model):.6f} under PEFT, {hearths:.6f} under hearth")
if len(sys.argv) > 2:
    merged = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    print(f"merged model's held-out loss: {held_out_loss(merged):.6f}")
prompt = tokenizer("the old sailor", return_tensors="pt")["input_ids"]
out = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
print("greedy continuation:", tokenizer.decode(out[0]))
