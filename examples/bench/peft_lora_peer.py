"""The peer of traced_llama_lora.py's speed row: the same LoRA fine-tune
under Accelerate + peft, as a user writes it (the base `from_pretrained`,
`PeftModel.from_pretrained(..., is_trainable=True)`, fused AdamW over the
trainable parameters), on the same sequential windows. Prints
{"tokens_per_sec": …} measured after WARMUP steps, as hearth measures.

usage: peft_lora_peer.py FOLDER STEPS BATCH SEQ_LEN
"""
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import hf_lora  # noqa: E402
from accelerate import Accelerator  # noqa: E402


def main():
    folder = pathlib.Path(sys.argv[1])
    steps, batch, seq_len = (int(a) for a in sys.argv[2:5])
    warmup = min(steps // 5, 10)
    accelerator = Accelerator(cpu=True)
    model = hf_lora.peft_from(folder, folder / "adapter", trainable=True)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    model, opt = accelerator.prepare(model, opt)
    data = hf_lora.windows(folder, seq_len, steps * batch)
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        w = data[step * batch:(step + 1) * batch]
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - start
    print(json.dumps({"tokens_per_sec": (steps - warmup) * batch * seq_len / elapsed}))


if __name__ == "__main__":
    main()
