"""The fine-tuning example, end to end as its README section walks it:
prepare.py, `hearth launch -n 2 --cpu finetune.toml`, check.py — the
fine-tuned run folder loads with transformers' from_pretrained, which
scores the held-out documents as hearth did and generates. Its LoRA
variant (finetune-lora.toml, check-lora.py): PEFT loads the run's
adapter/ onto the base and scores as hearth did, and so does the model
`hearth checkpoint merge-adapter` writes."""
import re
import shutil
import sys

from conftest import ROOT, run_command, run_hearth


IGNORED = shutil.ignore_patterns("data", "pretrained", "adapter", "*.pt")


def prepared_example(tmp_path):
    example = tmp_path / "finetune-hf"
    shutil.copytree(ROOT / "examples" / "finetune-hf", example, ignore=IGNORED)
    prepared = run_command([sys.executable, example / "prepare.py"], cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    return example


def same_loss(theirs: float, ours: float) -> bool:
    return abs(theirs - ours) <= 1e-5 * ours + 1e-6


def test_the_finetune_example_runs_as_its_readme_says(hearth_bin, tmp_path):
    example = prepared_example(tmp_path)
    tuned = run_hearth(hearth_bin, "launch", "-n", 2, "--cpu", example / "finetune.toml", cwd=tmp_path, timeout=600)
    assert tuned.returncode == 0, tuned.stderr
    run = tmp_path / "runs" / "finetune-hf"
    assert "eval validation loss" in tuned.stdout, tuned.stdout
    checked = run_command([sys.executable, example / "check.py", run], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    losses = re.search(r"held-out loss: ([\d.]+) under transformers, ([\d.]+) under hearth", checked.stdout)
    assert losses, checked.stdout
    theirs, ours = map(float, losses.groups())
    assert same_loss(theirs, ours), checked.stdout
    assert ours < 2.0, "it learned: the pretrained (random) model scores ~5.9"
    assert "greedy continuation: the old sailor" in checked.stdout, checked.stdout


def test_the_lora_variant_trains_an_adapter_peft_loads_and_merges(hearth_bin, tmp_path):
    example = prepared_example(tmp_path)
    tuned = run_hearth(hearth_bin, "launch", "-n", 2, "--cpu", example / "finetune-lora.toml", cwd=tmp_path, timeout=600)
    assert tuned.returncode == 0, tuned.stderr
    # 10 LoRA tensors, and the head's weight PEFT saves beside a LoRA on it.
    assert "6976 trainable" in tuned.stdout and "loaded 10 LoRA tensors and 1 of the model's own" in tuned.stdout, tuned.stdout
    run, merged = tmp_path / "runs" / "finetune-lora", tmp_path / "merged"
    done = run_hearth(hearth_bin, "checkpoint", "merge-adapter", run, example / "pretrained", merged, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    checked = run_command([sys.executable, example / "check-lora.py", run, merged], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    losses = re.search(r"held-out loss: ([\d.]+) under PEFT, ([\d.]+) under hearth", checked.stdout)
    merged_loss = re.search(r"merged model's held-out loss: ([\d.]+)", checked.stdout)
    assert losses and merged_loss, checked.stdout
    theirs, ours = map(float, losses.groups())
    assert same_loss(theirs, ours) and same_loss(float(merged_loss.group(1)), ours), checked.stdout
    assert ours < 2.0, "it learned: the pretrained (random) model scores ~5.9"
    assert "greedy continuation: the old sailor" in checked.stdout, checked.stdout
