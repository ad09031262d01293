"""The LoRA fine-tune of tests/test_lora.py under Accelerate and peft, as
a user writes it: the base `from_pretrained`, the adapter
`PeftModel.from_pretrained(..., is_trainable=True)`, AdamW (fused, as
hearth's), gradients clipped to `max_grad_norm`, on the run's sequential
windows. Writes the trained adapter with `save_pretrained` into OUT.

usage: accelerate_peft_lora.py FOLDER OUT STEPS BATCH SEQ_LEN LR MAX_NORM"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import hf_lora  # noqa: E402
from accelerate import Accelerator  # noqa: E402


def main():
    folder, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    steps, batch, seq_len = (int(a) for a in sys.argv[3:6])
    lr, max_norm = float(sys.argv[6]), float(sys.argv[7])
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = hf_lora.peft_from(folder, folder / "adapter", trainable=True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, fused=True)
    model, opt = accelerator.prepare(model, opt)
    data = hf_lora.windows(folder, seq_len, steps * batch)
    for step in range(steps):
        w = data[step * batch:(step + 1) * batch]
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    accelerator.unwrap_model(model).save_pretrained(out)


if __name__ == "__main__":
    main()
