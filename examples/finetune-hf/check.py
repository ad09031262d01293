"""Loads the fine-tuned run folder with transformers, as any Hugging Face
user would, and scores the held-out documents with it.

  .venv/bin/python examples/finetune-hf/check.py runs/finetune-hf
"""
import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

run = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/finetune-hf")
here = pathlib.Path(__file__).resolve().parent
model = AutoModelForCausalLM.from_pretrained(run).eval()
tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(run / "tokenizer.json"), eos_token="<|endoftext|>")
ids = []
for line in open(here / "data" / "val.jsonl"):
    ids += tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
window = 65
batch = torch.tensor([ids[k * window:(k + 1) * window] for k in range(len(ids) // window)])
with torch.no_grad():
    logits = model(batch[:, :-1]).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
hearths = json.loads((run / "summary.json").read_text())["eval"]["loss"]
prompt = tokenizer("the old sailor", return_tensors="pt")["input_ids"]
out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
print(f"held-out loss: {loss:.6f} under transformers, {hearths:.6f} under hearth")
print("greedy continuation:", tokenizer.decode(out[0]))
