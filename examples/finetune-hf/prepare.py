"""Makes everything the fine-tuning example needs, with no download:

  pretrained/   a transformers Llama (grouped-query attention, rotary
                embeddings, RMSNorm, SwiGLU) saved with save_pretrained,
                with its tokenizer (tokenizer.json, tokenizer_config.json)
                — this stands in for a checkpoint you would download
  llama.pt      the same architecture traced to TorchScript, the program
                hearth runs (its weights are replaced by init-from)
  data/train.jsonl, data/val.jsonl
                JSON Lines documents with a "text" field
  adapter/      a fresh PEFT LoRA adapter on the Llama (r = 8, on q_proj,
                v_proj and lm_head), saved with PeftModel.save_pretrained
  llama-lora.pt the PeftModel traced: its base frozen, its adapter trainable
                (finetune-lora.toml trains it)

Run it with the Python that has torch, transformers and tokenizers
(`make setup` makes .venv/bin/python):  .venv/bin/python prepare.py
"""
import json
import pathlib
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

# The LoRA of finetune-lora.toml: PEFT's usual q_proj and v_proj, and the
# head (this stand-in base is random: its head is what most needs adapting).
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)

HERE = pathlib.Path(__file__).resolve().parent
SUBJECTS = ["the cat", "a dog", "my neighbour", "the old sailor", "a small robot", "the baker"]
VERBS = ["sees", "likes", "paints", "follows", "greets", "remembers"]
OBJECTS = ["the moon", "a red kite", "the harbour", "fresh bread", "a quiet song", "the library"]


def sentences(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [
        " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(rng.randint(1, 4)))
        for _ in range(n)
    ]


class Logits(torch.nn.Module):
    """forward(input_ids) -> logits: what `kind = "torchscript"` runs. The
    model is the attribute `m`, so its parameters are named `m.<name>`:
    the config's init-key-prefix = "m." maps the checkpoint's names."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids, use_cache=False, return_dict=False)[0]


def main():
    train, val = sentences(2000, 0), sentences(200, 1)
    (HERE / "data").mkdir(exist_ok=True)
    for name, docs in (("train", train), ("val", val)):
        with open(HERE / "data" / f"{name}.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(train, trainer)
    eos = tokenizer.token_to_id("<|endoftext|>")

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=eos, eos_token_id=eos,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(HERE / "pretrained")
    tokenizer.save(str(HERE / "pretrained" / "tokenizer.json"))
    (HERE / "pretrained" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    example = torch.zeros(2, 64, dtype=torch.long)
    torch.jit.trace(Logits(model), example).save(str(HERE / "llama.pt"))
    # LoRA: the PeftModel saved at export (its adapter is what hearth
    # starts from and writes back) and traced (torch.jit.save keeps which
    # parameters require gradients: the base stays frozen).
    import peft

    lora = peft.get_peft_model(LlamaForCausalLM.from_pretrained(HERE / "pretrained"), peft.LoraConfig(**LORA))
    lora.save_pretrained(HERE / "adapter")
    torch.jit.trace(Logits(lora), example).save(str(HERE / "llama-lora.pt"))
    print(f"wrote {HERE / 'pretrained'}, {HERE / 'llama.pt'}, {HERE / 'adapter'}, {HERE / 'llama-lora.pt'} and {HERE / 'data'}")


if __name__ == "__main__":
    main()
