"""The data rows of `make bench` (issue 38), each side by side in one run:

- the `tokens` loader (a nanoGPT .bin of 20 M uint16 ids, the bench GPT's
  batch 16 × 128, random windows) timed by `hearth data prepare`, against
  the rate the bench GPT consumes tokens on one process (table.py's first
  row, measured in the same run);
- tokenizing a 100 MB JSON Lines file into the token cache (`hearth data
  prepare`: hashing, reading, encoding, writing the .npy) against Python
  `tokenizers`' `encode_batch` on the same file in the same chunks, its ids
  written with NumPy — the same tokenizer, the same threads (RAYON_NUM_THREADS
  for hearth, RAYON_RS_NUM_CPUS for the Python package, both the machine's
  cores). The two outputs are checked equal.

A benchmark, not a test: nothing here is asserted but that equality.
Usage: python data_loading.py [ROUNDS]
"""
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
sys.path.insert(0, str(ROOT / "tests"))
import text_data  # noqa: E402

THREADS = str(os.cpu_count())
JSONL_BYTES = 100 * 2**20

PYTHON_SIDE = """
import json, sys, numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1]); eos = tok.token_to_id("<|endoftext|>")
ids, chunk = [], []
def flush():
    for e in tok.encode_batch(chunk):
        ids.extend(e.ids); ids.append(eos)
    chunk.clear()
for line in open(sys.argv[2], encoding="utf-8"):
    chunk.append(json.loads(line)["text"])
    if len(chunk) == 4096: flush()
flush()
np.save(sys.argv[3], np.asarray(ids, dtype=np.uint32))
"""


def config(folder: pathlib.Path, data: str) -> pathlib.Path:
    path = folder / "job.toml"
    path.write_text(f"""
[run]
name = "data"
steps = 1
[model]
kind = "gpt"
[data]
{data}
seq-len = 128
batch-size = 16
[optimizer]
kind = "adamw"
""")
    return path


def prepare(cfg: pathlib.Path, batches: int) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": THREADS}
    out = subprocess.run([HEARTH, "data", "prepare", cfg, "--json", "--batches", str(batches)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def write_documents(path: pathlib.Path) -> None:
    rng = random.Random(0)
    words = text_data.WORDS
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < JSONL_BYTES:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())


def measure(rounds: int) -> dict:
    out = {"loader": [], "hearth": [], "python": []}
    with tempfile.TemporaryDirectory(prefix="hearth-data-bench-") as tmp:
        tmp = pathlib.Path(tmp)
        ids = np.random.default_rng(0).integers(0, 256, size=20_000_000, dtype=np.uint16)
        ids.tofile(tmp / "train.bin")
        loader = config(tmp, 'kind = "tokens"\npath = "train.bin"\nvocab-size = 256')
        for _ in range(rounds):
            out["loader"].append(prepare(loader, 2000)["loader_tokens_per_sec"])

        docs = tmp / "docs"
        docs.mkdir()
        write_documents(docs / "docs.jsonl")
        text_data.train_tokenizer(docs / "tok", text_data.documents(3000), vocab_size=4096)
        jsonl = config(docs, 'kind = "jsonl"\npath = "docs.jsonl"\ntokenizer = "tok/tokenizer.json"')
        for r in range(rounds):
            sides = ["hearth", "python"] if r % 2 == 0 else ["python", "hearth"]
            for side in sides:
                shutil.rmtree(docs / ".hearth-cache", ignore_errors=True)
                if side == "hearth":
                    out["hearth"].append(prepare(jsonl, 1)["prepare_seconds"])
                    # Read now: the next side's run clears the cache.
                    ours = np.load(next((docs / ".hearth-cache").glob("*.npy")))
                else:
                    env = {**os.environ, "RAYON_RS_NUM_CPUS": THREADS}
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-c", PYTHON_SIDE, docs / "tok" / "tokenizer.json",
                                    docs / "docs.jsonl", tmp / "python.npy"], check=True, env=env)
                    out["python"].append(time.perf_counter() - start)
        theirs = np.load(tmp / "python.npy")
        assert ours.shape == theirs.shape and (ours == theirs).all(), "hearth's ids are Python's"
    return out


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
