"""A transformers causal LM of a family hf_causal knows, random init,
saved with `save_pretrained` and traced (tests/hf_causal.py), for the Rust
tests that load it: argv[1] is JSON {"family", "out", "sizes"}; prints
{"pretrained", "traced"}."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import hf_causal  # noqa: E402

spec = json.loads(sys.argv[1])
built = hf_causal.build(spec["family"], pathlib.Path(spec["out"]), **spec.get("sizes", {}))
print(json.dumps({k: str(v) for k, v in built.items()}))
