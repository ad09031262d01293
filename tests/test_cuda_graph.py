"""`run.cuda-graph`: where the training step cannot be captured, `hearth
run` refuses before training, exit status 2, with a message that names the
config and the key and says what to change. (That a captured step trains as
the eager one does is in host/hearth/tests/cuda/graphs.rs, on a GPU.)"""
import pytest

from conftest import SHORT_JOB, write_config


@pytest.mark.parametrize(
    "run_keys, optimizer, expected",
    [
        ("gradient-accumulation-steps = 2\n", "adamw", "needs gradient-accumulation-steps = 1"),
        ('mixed-precision = "fp16"\n', "adamw", 'use mixed-precision = "bf16"'),
        ("", "sgd", "cannot be used with this optimizer"),
        ('device = "cpu"\n', "adamw", 'needs a CUDA GPU, and this run trains on cpu; set run.device = "cuda"'),
    ],
    ids=["accumulation", "fp16", "sgd", "cpu"],
)
def test_a_step_that_cannot_be_captured_is_refused_before_training(hearth, tmp_path, run_keys, optimizer, expected):
    text = SHORT_JOB.replace("[run]\n", "[run]\ncuda-graph = true\n" + run_keys, 1)
    text = text.replace('kind = "adamw"', f'kind = "{optimizer}"')
    config = write_config(tmp_path, text)
    out = hearth("run", config, "--quiet", "--output-dir", tmp_path / "runs")
    assert out.returncode == 2, out.stderr
    assert f"config {config}: run.cuda-graph = true" in out.stderr, out.stderr
    assert expected in out.stderr, out.stderr
    assert not (tmp_path / "runs" / "short" / "model.safetensors").exists()
