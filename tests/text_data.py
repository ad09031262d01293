"""Documents and a tokenizer made here (no download), for the tests that
feed hearth JSON Lines and Parquet: sentences mixing ASCII, accented
Latin, Greek, CJK and emoji, and a byte-level BPE tokenizer trained on
them with `<|endoftext|>` as its end-of-sequence token."""
import json
import pathlib
import random

# The text-file corpus of the sharding and bring-your-own tests: 9 000
# bytes, so 13 held-out windows of 65.
TEXT = ("the quick brown fox jumps over the lazy dog. " * 200).encode()

WORDS = (
    "the quick brown fox jumps over lazy dog naïve café über straße "
    "façade smörgåsbord ελληνικά λόγος 日本語 東京 中文 한국어 🚀 🎉 ✓ "
    "tokens windows model gradient shard 42 3.14 -7"
).split()


def documents(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 40))]
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n"])
        docs.append(sep.join(words))
    return docs


def write_jsonl(path: pathlib.Path, docs: list, field: str = "text") -> pathlib.Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}, ensure_ascii=False) + "\n")
    return path


def write_parquet(path: pathlib.Path, docs: list, row_group_size: int) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def train_tokenizer(folder: pathlib.Path, docs: list, vocab_size: int = 512) -> pathlib.Path:
    """`folder/tokenizer.json` and a `tokenizer_config.json` naming the
    end-of-sequence token, as `save_pretrained` leaves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def packed(tokenizer_json: pathlib.Path, docs: list) -> list:
    """The reference packing: each document's `encode_batch` ids, then the
    end-of-sequence id, end to end."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eos]
    return ids
