"""What Accelerate's environment checks say in this venv: one JSON object
with torch's version as Accelerate reads it, is_cuda_available,
is_bf16_available, and is_torch_version(op, version) for each "op version"
pair given as an argument (null where Accelerate raises)."""
import json
import sys

from accelerate.utils import is_bf16_available, is_cuda_available, is_torch_version
from accelerate.utils.versions import torch_version

answers = []
for pair in sys.argv[1:]:
    op, version = pair.split(" ", 1)
    try:
        answers.append(is_torch_version(op, version))
    except Exception:  # noqa: BLE001 - a refusal is an answer here
        answers.append(None)
print(json.dumps({
    "torch_version": str(torch_version),
    "cuda": is_cuda_available(),
    "bf16": is_bf16_available(),
    "is_torch_version": answers,
}))
