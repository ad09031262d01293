"""Documents users have — JSON Lines and Parquet — tokenized by hearth
with a Hugging Face tokenizer.json: the ids equal Python `tokenizers`'
`encode_batch`, packed as the reference packs them, cached once for every
run and process, and bad files refused naming the file and the place."""
import json
import math

import numpy as np
import pytest

import text_data
from conftest import mpirun, write_config

DOCS = text_data.documents(1200)


def job(data: str, extra: str = "") -> str:
    return f"""
[run]
name = "docs"
steps = 2
log-every = 1

[model]
kind = "gpt"
d-model = 32
layers = 2
heads = 4

[data]
seq-len = 32
batch-size = 4
tokenizer = "tok/tokenizer.json"
{data}

[optimizer]
kind = "adamw"
lr = 1e-3
{extra}"""


@pytest.fixture
def folder(tmp_path):
    text_data.train_tokenizer(tmp_path / "tok", DOCS)
    return tmp_path


def held_out(tokens: int) -> int:
    """The validation part of `tokens` ids: a tenth, rounded half away
    from zero as Rust's `f64::round`."""
    return math.floor(tokens * 0.1 + 0.5)


def cache_of(folder) -> np.ndarray:
    caches = list((folder / ".hearth-cache").glob("*.npy"))
    assert len(caches) == 1, caches
    return np.load(caches[0])


def test_jsonl_ids_are_encode_batchs_packed_with_eos_and_cached_for_the_next_run(hearth, folder):
    text_data.write_jsonl(folder / "docs.jsonl", DOCS)
    config = write_config(folder, job('kind = "jsonl"\npath = "docs.jsonl"'))
    first = hearth("run", config, "--output-dir", folder / "out", env={"HEARTH_LOG": "info"})
    assert first.returncode == 0, first.stderr
    assert "tokenized 1 file(s)" in first.stderr, first.stderr
    want = text_data.packed(folder / "tok" / "tokenizer.json", DOCS)
    got = cache_of(folder)
    assert got.dtype == np.uint32 and got.tolist() == want
    assert any(ord(c) > 0x3000 for c in "".join(DOCS)), "CJK and emoji are in the text"
    summary = json.loads((folder / "out" / "docs" / "summary.json").read_text())
    held = held_out(len(want))
    assert summary["eval"]["tokens"] == min(held // 33, 1000) * 32, summary["eval"]
    again = hearth("run", config, "--output-dir", folder / "again", env={"HEARTH_LOG": "info"})
    assert again.returncode == 0, again.stderr
    assert "tokenized" not in again.stderr, "the cache is reused"
    # Another tokenizer setting is another cache.
    other = write_config(folder, job('kind = "jsonl"\npath = "docs.jsonl"\neos-token = "a"'), "other.toml")
    assert hearth("run", other, "--output-dir", folder / "other").returncode == 0
    assert len(list((folder / ".hearth-cache").glob("*.npy"))) == 2


def test_parquet_files_of_several_row_groups_read_in_file_order_through_a_glob(hearth, folder):
    (folder / "shards").mkdir()
    text_data.write_parquet(folder / "shards" / "part-0.parquet", DOCS[:700], row_group_size=128)
    text_data.write_parquet(folder / "shards" / "part-1.parquet", DOCS[700:], row_group_size=200)
    config = write_config(folder, job('kind = "parquet"\npath = "shards/*.parquet"'))
    run = hearth("run", config, "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    caches = list((folder / "shards" / ".hearth-cache").glob("*.npy"))
    assert len(caches) == 1
    assert np.load(caches[0]).tolist() == text_data.packed(folder / "tok" / "tokenizer.json", DOCS)


def test_two_processes_tokenize_once_and_train_on_the_cache(hearth_bin, folder):
    text_data.write_jsonl(folder / "docs.jsonl", DOCS)
    config = write_config(folder, job('kind = "jsonl"\npath = "docs.jsonl"\nsampling = "sequential"'))
    run = mpirun(hearth_bin, 2, "run", config, "--output-dir", folder / "out", cwd=folder, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("tokenized 1 file(s)") == 1, run.stderr
    assert len(list((folder / ".hearth-cache").glob("*.npy"))) == 1


@pytest.mark.parametrize("data, says", [
    ('kind = "jsonl"\npath = "broken.jsonl"', ["broken.jsonl", "line 3: is not JSON"]),
    ('kind = "jsonl"\npath = "other.jsonl"', ["other.jsonl", "line 1: has no field \"text\" (it has body, id)", "data.text-field"]),
    ('kind = "jsonl"\npath = "numbers.jsonl"', ["numbers.jsonl", "line 2: field \"text\" is not a string but a number"]),
    ('kind = "parquet"\npath = "docs.parquet"\ntext-field = "body"', ["docs.parquet", "has no column \"body\" (it has id, text)"]),
    ('kind = "jsonl"\npath = "docs.jsonl"\nvocab-size = 100', [".hearth-cache", "outside the vocabulary (vocab-size = 100)"]),
    ('kind = "jsonl"\npath = "none/*.jsonl"', ["none/*.jsonl", "matches no file"]),
    ('kind = "jsonl"\npath = "docs.jsonl"\neos-token = "<nope>"', ["tokenizer.json", "\"<nope>\""]),
])
def test_bad_documents_are_refused_naming_file_and_place_before_the_run_writes(hearth, folder, data, says):
    text_data.write_jsonl(folder / "docs.jsonl", DOCS[:50])
    (folder / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n')
    (folder / "other.jsonl").write_text('{"id": 1, "body": "x"}\n')
    (folder / "numbers.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    text_data.write_parquet(folder / "docs.parquet", DOCS[:50], row_group_size=10)
    run = hearth("run", write_config(folder, job(data)), "--output-dir", folder / "out")
    assert run.returncode == 2, run.stderr
    for part in says:
        assert part in run.stderr, (part, run.stderr)
    assert not (folder / "out").exists()


def test_data_prepare_tokenizes_ahead_of_the_run_and_times_the_loader(hearth, folder):
    text_data.write_jsonl(folder / "docs.jsonl", DOCS)
    config = write_config(folder, job('kind = "jsonl"\npath = "docs.jsonl"\nsampling = "sequential"'))
    prepared = hearth("data", "prepare", config, "--json", "--batches", 50)
    assert prepared.returncode == 0, prepared.stderr
    report = json.loads(prepared.stdout.strip().splitlines()[-1])
    tokens = len(text_data.packed(folder / "tok" / "tokenizer.json", DOCS))
    assert report["windows"] == (tokens - held_out(tokens) - 1) // 32, report
    assert report["batches"] == 50 and report["loader_tokens_per_sec"] > 0, report
    run = hearth("run", config, "--output-dir", folder / "out")
    assert run.returncode == 0 and "tokenized" not in run.stderr, run.stderr
    bad = hearth("data", "prepare", write_config(folder, job('kind = "jsonl"\npath = "missing.jsonl"'), "bad.toml"))
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr, bad.stderr
