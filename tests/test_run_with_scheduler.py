"""`[scheduler]`: the built-in `linear` scheduler plugin drives the
optimizer's rate step for step as transformers' get_linear_schedule_with_warmup
does, computed here with PyTorch's LambdaLR; bad options are refused by the
plugin with a message naming it and the option."""
import json

import pytest
import torch

from conftest import SHORT_JOB, tracker_tables, write_config

STEPS, WARMUP, LR = 40, 10, 2e-3


def linear_with_warmup(step: int) -> float:
    # transformers.optimization._get_linear_schedule_with_warmup_lr_lambda
    if step < WARMUP:
        return float(step) / float(max(1, WARMUP))
    return max(0.0, float(STEPS - step) / float(max(1, STEPS - WARMUP)))


def pytorch_rates() -> list:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_with_warmup)
    rates = []
    for _ in range(STEPS):
        rates.append(opt.param_groups[0]["lr"])  # the rate this optimizer step uses
        opt.step()
        sched.step()
    return rates


def job(extra: str) -> str:
    return SHORT_JOB.replace("log-every = 10", "log-every = 1") + extra + tracker_tables("jsonl")


def test_linear_schedule_matches_pytorch_step_for_step(hearth, tmp_path):
    config = write_config(tmp_path, job(f'[scheduler]\nname = "linear"\nwarmup-steps = {WARMUP}\n'))
    out = hearth("run", config)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in (tmp_path / "runs/short/trackers/jsonl/metrics.jsonl").read_text().splitlines()]
    logged = [l["lr"] for l in lines if "lr" in l]
    assert len(logged) == STEPS
    assert logged == pytest.approx(pytorch_rates(), rel=1e-12, abs=1e-18)
    # summary.json accounts for every call: the schedule's rate each step,
    # the tracker's log each step (with its start and finish).
    calls = {u["name"]: u for u in json.loads((tmp_path / "runs/short/summary.json").read_text())["plugin_calls"]}
    assert (calls["linear"]["kind"], calls["jsonl"]["kind"]) == ("scheduler", "tracker")
    for used in calls.values():
        assert used["calls"] >= STEPS and used["instantiations"] >= 1, used
        assert 0 < used["cpu_seconds"] <= used["wall_seconds"] + 1e-3, used


@pytest.mark.parametrize(
    "table, message",
    [
        ('name = "linear"\nwarmup = 5\n', "unknown option `warmup`"),
        ('name = "linear"\nwarmup-steps = 500\n', "`warmup-steps` (500) is more than the 40 steps"),
        ('name = "jsonl"\n', "it is a tracker plugin, not a scheduler"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_plugin(hearth, tmp_path, table, message):
    config = write_config(tmp_path, job("[scheduler]\n" + table))
    out = hearth("run", config)
    assert out.returncode == 2
    assert message in out.stderr and config.name in out.stderr, out.stderr
    assert not (tmp_path / "runs" / "short" / "model.safetensors").exists()


def test_reduce_on_plateau_observes_each_evaluation(hearth, tmp_path):
    """With `eval.every = 10`, the run feeds each evaluation's accuracy to
    the schedule; PyTorch's ReduceLROnPlateau fed the same accuracies gives
    the same rate at every step."""
    text = job('[scheduler]\nname = "reduce-on-plateau"\nmode = "max"\npatience = 0\nfactor = 0.5\n')
    config = write_config(tmp_path, text.replace("[eval]\nsamples = 20", "[eval]\nsamples = 20\nevery = 10"))
    out = hearth("run", config)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in (tmp_path / "runs/short/trackers/jsonl/metrics.jsonl").read_text().splitlines()]
    logged = [l["lr"] for l in lines if "lr" in l]
    accuracy = {l["step"]: l["eval/accuracy"] for l in lines if "eval/accuracy" in l}
    assert sorted(accuracy) == [10, 20, 30, 40]

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5)
    expected = []
    for step in range(1, STEPS + 1):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        if step % 10 == 0 and step != STEPS:
            sched.step(accuracy[step])
    assert logged == pytest.approx(expected, rel=1e-12)
    assert len(set(logged)) > 1  # it did reduce
