"""The built-in scheduler plugins against the schedulers users know, step
for step over 200 steps: transformers' get_*_schedule* functions and
PyTorch's StepLR, OneCycleLR and ReduceLROnPlateau, run here on a real
torch optimizer. The plugin side is `hearth plugins schedule`, which drives
the plugin through the host adapter; `--reload-at` also round-trips the
schedule's state through save/load mid-way."""
import json

import pytest
import torch
from torch.optim import lr_scheduler as torch_sched
from transformers import optimization as hf

STEPS = 200
LR = 0.1
# reduce-on-plateau sees a loss that falls, stalls, falls again, then stalls.
METRICS = [1.0 / (1 + k) if k < 40 or 90 <= k < 120 else 1.0 / (1 + min(k, 40 if k < 90 else 120)) + 1e-6 * (k % 3)
           for k in range(STEPS)]

CASES = {
    "constant": ("constant", {}, lambda o: hf.get_constant_schedule(o)),
    "constant-with-warmup": ("constant-with-warmup", {"warmup-steps": 20},
                             lambda o: hf.get_constant_schedule_with_warmup(o, 20)),
    "linear": ("linear", {"warmup-steps": 20}, lambda o: hf.get_linear_schedule_with_warmup(o, 20, STEPS)),
    "cosine": ("cosine", {"warmup-steps": 20}, lambda o: hf.get_cosine_schedule_with_warmup(o, 20, STEPS)),
    "cosine-cycles": ("cosine", {"warmup-steps": 10, "cycles": 1.5},
                      lambda o: hf.get_cosine_schedule_with_warmup(o, 10, STEPS, num_cycles=1.5)),
    "cosine-min-lr": ("cosine", {"warmup-steps": 10, "min-lr": 0.01},
                      lambda o: hf.get_cosine_with_min_lr_schedule_with_warmup(o, 10, STEPS, min_lr=0.01)),
    "cosine-restarts": ("cosine", {"warmup-steps": 10, "restarts": True, "cycles": 3},
                        lambda o: hf.get_cosine_with_hard_restarts_schedule_with_warmup(o, 10, STEPS, num_cycles=3)),
    "polynomial": ("polynomial", {"warmup-steps": 20, "lr-end": 1e-4, "power": 2.0},
                   lambda o: hf.get_polynomial_decay_schedule_with_warmup(o, 20, STEPS, lr_end=1e-4, power=2.0)),
    "inverse-sqrt": ("inverse-sqrt", {"warmup-steps": 20}, lambda o: hf.get_inverse_sqrt_schedule(o, 20)),
    "inverse-sqrt-timescale": ("inverse-sqrt", {"timescale": 50},
                               lambda o: hf.get_inverse_sqrt_schedule(o, 0, timescale=50)),
    "step": ("step", {"step-size": 30, "gamma": 0.5}, lambda o: torch_sched.StepLR(o, 30, gamma=0.5)),
    "one-cycle": ("one-cycle", {},
                  lambda o: torch_sched.OneCycleLR(o, max_lr=LR, total_steps=STEPS, cycle_momentum=False)),
    "one-cycle-three-phase": ("one-cycle", {"max-lr": 0.5, "three-phase": True, "anneal-strategy": "linear"},
                              lambda o: torch_sched.OneCycleLR(o, max_lr=0.5, total_steps=STEPS, three_phase=True,
                                                               anneal_strategy="linear", cycle_momentum=False)),
    "reduce-on-plateau": ("reduce-on-plateau", {"patience": 3, "factor": 0.5, "cooldown": 2},
                          lambda o: torch_sched.ReduceLROnPlateau(o, patience=3, factor=0.5, cooldown=2)),
    "reduce-on-plateau-max-abs": ("reduce-on-plateau",
                                  {"mode": "max", "threshold-mode": "abs", "threshold": 1e-3, "patience": 5,
                                   "min-lr": 0.02},
                                  lambda o: torch_sched.ReduceLROnPlateau(o, mode="max", threshold_mode="abs",
                                                                          threshold=1e-3, patience=5, min_lr=0.02)),
}


def reference(factory, lrs) -> list:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)], lr=lrs[0])
    sched = factory(opt)
    out = []
    for k in range(STEPS):
        out.append([g["lr"] for g in opt.param_groups])  # the rates optimizer step k uses
        opt.step()
        if isinstance(sched, torch_sched.ReduceLROnPlateau):
            sched.step(METRICS[k])
        else:
            sched.step()
    return out


def hearth_rates(hearth, name, options, lrs, reload_at=None) -> list:
    args = ["plugins", "schedule", name, "--steps", STEPS, "--options", json.dumps(options)]
    for lr in lrs:
        args += ["--lr", lr]
    if name == "reduce-on-plateau":
        args += ["--observe", ",".join(map(repr, METRICS))]
    if reload_at is not None:
        args += ["--reload-at", reload_at]
    out = hearth(*args)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == list(range(STEPS))
    return [[float(x) for x in r[1:]] for r in rows]


@pytest.mark.parametrize("case", CASES)
def test_schedule_equals_the_reference_for_200_steps(hearth, case):
    name, options, factory = CASES[case]
    ours = hearth_rates(hearth, name, options, [LR])
    ref = reference(factory, [LR])
    for k, (a, b) in enumerate(zip(ours, ref)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), f"step {k}: {a} vs {b}"
    assert len({tuple(r) for r in ours}) > 1 or name == "constant"  # the schedule moves


@pytest.mark.parametrize("case", ["linear", "one-cycle", "reduce-on-plateau"])
def test_each_parameter_group_follows_its_own_base_rate(hearth, case):
    name, options, factory = CASES[case]
    if name == "one-cycle":
        options = {**options, "max-lr": [0.1, 0.01]}
        factory = lambda o: torch_sched.OneCycleLR(o, max_lr=[0.1, 0.01], total_steps=STEPS, cycle_momentum=False)
    ours = hearth_rates(hearth, name, options, [0.1, 0.01])
    ref = reference(factory, [0.1, 0.01])
    assert len(ours) == len(ref) and all(len(r) == 2 for r in ours)
    assert sum(ours, []) == pytest.approx(sum(ref, []), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("case", ["cosine", "reduce-on-plateau", "one-cycle"])
def test_state_round_trips_mid_schedule(hearth, case):
    name, options, _ = CASES[case]
    assert hearth_rates(hearth, name, options, [LR], reload_at=100) == hearth_rates(hearth, name, options, [LR])


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("cosine", {"warmup": 5}, "unknown option `warmup` for `cosine` (known: warmup-steps, cycles"),
        ("cosine", {"min-lr": 0.01, "min-lr-rate": 0.1}, "set one of `min-lr` and `min-lr-rate`"),
        ("step", {}, "`step` needs `step-size`"),
        ("reduce-on-plateau", {"mode": "up"}, '`mode` must be "min" or "max"'),
        ("polynomial", {"lr-end": 1.0}, "`lr-end` (1) must be smaller than the initial rate (0.1)"),
        ("constant", {"warmup-steps": 3}, "unknown option `warmup-steps` (`constant` takes none)"),
        ("cosine", {"schedule": "linear"}, "option `schedule` is preset by the plugin's manifest"),
    ],
)
def test_bad_options_are_refused_naming_plugin_and_option(hearth, name, options, message):
    out = hearth("plugins", "schedule", name, "--lr", LR, "--options", json.dumps(options))
    assert out.returncode == 2
    assert f"plugin `{name}`" in out.stderr and message in out.stderr, out.stderr
