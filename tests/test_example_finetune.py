"""The fine-tuning example, end to end as its README section walks it:
prepare.py, `hearth launch -n 2 --cpu finetune.toml`, check.py — the
fine-tuned run folder loads with transformers' from_pretrained, which
scores the held-out documents as hearth did and generates."""
import re
import shutil
import sys

from conftest import ROOT, run_command, run_hearth


def test_the_finetune_example_runs_as_its_readme_says(hearth_bin, tmp_path):
    example = tmp_path / "finetune-hf"
    shutil.copytree(ROOT / "examples" / "finetune-hf", example, ignore=shutil.ignore_patterns("data", "pretrained", "llama.pt"))
    prepared = run_command([sys.executable, example / "prepare.py"], cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    tuned = run_hearth(hearth_bin, "launch", "-n", 2, "--cpu", example / "finetune.toml", cwd=tmp_path, timeout=600)
    assert tuned.returncode == 0, tuned.stderr
    run = tmp_path / "runs" / "finetune-hf"
    assert "eval validation loss" in tuned.stdout, tuned.stdout
    checked = run_command([sys.executable, example / "check.py", run], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    losses = re.search(r"held-out loss: ([\d.]+) under transformers, ([\d.]+) under hearth", checked.stdout)
    assert losses, checked.stdout
    theirs, ours = map(float, losses.groups())
    assert abs(theirs - ours) <= 1e-5 * ours + 1e-6, checked.stdout
    assert ours < 2.0, "it learned: the pretrained (random) model scores ~5.9"
    assert "greedy continuation: the old sailor" in checked.stdout, checked.stdout
