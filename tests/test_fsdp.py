"""Sharded data parallel from the outside: `hearth model plan` against
Accelerate's own wrap policies and PyTorch's module tree, `hearth run` with
`[fsdp]` on two processes (its summary's memory, its model loaded into the
PyTorch class), and wrap policies and `[fsdp]` values that must stop a run."""
import json
import os
import pathlib
import random
import re
import signal
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, make_plugin, tiny_job, mpi_env, mpirun, mpirun_command, processes_of_rank, run_command, start, write_config

sys.path.insert(0, str(ROOT / "tests" / "oracles"))
import peer_gpt  # noqa: E402

# The peer benchmark's GPT: V=256, T=128, d=128, 4 layers, 4 heads.
SIZES = dict(vocab_size=256, block_size=128, d_model=128, layers=4, heads=4)


def job(fsdp: str = "", steps: int = 4) -> str:
    return f"""
[run]
name = "fsdp"
steps = {steps}
log-every = 2

[model]
kind = "gpt"
d-model = 128
layers = 4
heads = 4

[data]
kind = "random-tokens"
vocab-size = 256
seq-len = 128
batch-size = 2

[optimizer]
kind = "adamw"
lr = 3e-4
{fsdp}"""


def fsdp_table(policy: str, extra: str = "") -> str:
    return f'\n[fsdp]\nsharding-strategy = "SHARD_GRAD_OP"\nauto-wrap-policy = "{policy}"\n{extra}\n'


def plan(hearth, tmp_path, fsdp: str, n: int = 1, name="job.toml"):
    config = write_config(tmp_path, job(fsdp), name)
    out = hearth("model", "plan", config, "-n", n, "--json")
    return out


def accelerate_units(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")}
    out = run_command([sys.executable, ROOT / "tests" / "oracles" / "fsdp_wrap_units.py", json.dumps({**SIZES, **spec})], env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "policy, extra, spec",
    [
        ("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]',
         {"policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Block"]}),
        ("transformer-based", 'transformer-cls-names-to-wrap = ["Linear"]',
         {"policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Linear"]}),
        ("size-based", "min-num-params = 100000", {"policy": "size_based_wrap", "min_num_params": 100000}),
        ("size-based", "min-num-params = 300000", {"policy": "size_based_wrap", "min_num_params": 300000}),
        ("size-based", "min-num-params = 30000", {"policy": "size_based_wrap", "min_num_params": 30000}),
        ("no-wrap", "", {"policy": "no_wrap"}),
    ],
)
def test_units_are_what_accelerates_policies_pick_on_the_pytorch_class(hearth, tmp_path, policy, extra, spec):
    out = plan(hearth, tmp_path, fsdp_table(policy, extra))
    assert out.returncode == 0, out.stderr
    ours = sorted(json.loads(out.stdout)["units"])
    theirs = accelerate_units(spec)
    assert "units" in theirs, theirs
    assert ours == theirs["units"]


def test_a_class_the_model_lacks_is_refused_with_accelerates_message(hearth, tmp_path):
    theirs = accelerate_units({"policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Nope"]})
    out = plan(hearth, tmp_path, fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Nope"]'))
    assert out.returncode != 0
    assert theirs["error"] in out.stderr
    assert "transformer-based" in out.stderr, "the message names the plugin"


def test_the_module_tree_is_pytorchs(hearth, tmp_path):
    out = plan(hearth, tmp_path, "")
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout)["modules"]
    model = peer_gpt.build(**SIZES)
    want = [
        {"path": name, "class": type(m).__name__,
         "params": sum(p.numel() for p in m.parameters()),
         "bytes": sum(p.numel() * p.element_size() for p in m.parameters())}
        for name, m in model.named_modules()
    ]
    key = lambda m: m["path"]
    assert sorted(modules, key=key) == sorted(want, key=key)


def test_plan_holds_a_quarter_of_the_gradients_and_state_on_four_processes(hearth, tmp_path):
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]')
    one = json.loads(plan(hearth, tmp_path, table, 1).stdout)["per_process"]
    four = json.loads(plan(hearth, tmp_path, table, 4).stdout)["per_process"]
    assert four["param_bytes"] == one["param_bytes"], "SHARD_GRAD_OP keeps whole parameters"
    for key in ("grad_bytes", "optimizer_bytes"):
        # A quarter, within the padding of rows that do not divide by 4
        # (every dimension 0 here divides, so exactly; the step counters stay whole).
        assert abs(four[key] - one[key] / 4) <= 0.01 * one[key], (key, one, four)


def test_two_processes_hold_what_the_plan_says_and_save_what_pytorch_loads(hearth, hearth_bin, tmp_path):
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]')
    config = write_config(tmp_path, job(table))
    run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "sharded", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "sharded" / "fsdp" / "summary.json").read_text())
    planned = json.loads(plan(hearth, tmp_path, table, 2).stdout)["per_process"]
    assert summary["memory"] == planned, "measured from the tensors = planned from the layout"
    assert summary["fsdp"]["sharding_strategy"] == "SHARD_GRAD_OP"
    assert summary["gradient_sync"]["reduce_scatters"] == 5 * 4
    # The same job without [fsdp]: DDP holds twice the gradients and state.
    ddp_config = write_config(tmp_path, job(), "ddp.toml")
    ddp = mpirun(hearth_bin, 2, "run", ddp_config, "--quiet", "--output-dir", tmp_path / "ddp", cwd=tmp_path)
    assert ddp.returncode == 0, ddp.stderr
    full = json.loads((tmp_path / "ddp" / "fsdp" / "summary.json").read_text())["memory"]
    assert full["param_bytes"] == summary["memory"]["param_bytes"]
    for key in ("grad_bytes", "optimizer_bytes"):
        assert abs(summary["memory"][key] / full[key] - 0.5) < 0.01, (key, full, summary["memory"])
    # The saved weights load strict into the PyTorch class.
    model = peer_gpt.build(**SIZES)
    model.load_state_dict(load_file(tmp_path / "sharded" / "fsdp" / "model.safetensors"), strict=True)


@pytest.mark.parametrize(
    "misbehave, says",
    [
        ("trap", "trapped"),
        ("hang", "deadline"),
        ("err", "fixture wrap policy refuses this model"),
        ("missing", "`blocks.99`, which is not a module of the model"),
    ],
)
def test_a_bad_wrap_policy_stops_the_run_before_the_first_step_naming_it(hearth, tmp_path, fixture_wasm, misbehave, says):
    make_plugin(tmp_path / "policies", "bad-policy", fixture_wasm("bad-policy"), kind="wrap-policy",
                limits="[limits]\ncall-timeout-ms = 300\n")
    table = fsdp_table("bad-policy", f'policy-options = {{ misbehave = "{misbehave}" }}')
    config = write_config(tmp_path, job(table))
    out = hearth("run", config, "--plugin-dir", tmp_path / "policies", "--output-dir", tmp_path / "runs")
    assert out.returncode == 1, out.stderr
    assert "bad-policy" in out.stderr and says in out.stderr, out.stderr
    assert "step 2" not in out.stdout + out.stderr, "no step was taken"
    assert not (tmp_path / "runs" / "fsdp" / "model.safetensors").exists()


@pytest.mark.parametrize("raised", [False, True])
def test_a_wrap_policys_output_budget_is_what_plugin_limits_raises(hearth, tmp_path, fixture_wasm, raised):
    """The policy prints 1500 lines in one call; its manifest allows 1000
    a call unless the run config's [plugin-limits.bad-policy] raises it."""
    make_plugin(tmp_path / "policies", "bad-policy", fixture_wasm("bad-policy"), kind="wrap-policy")
    table = fsdp_table("bad-policy", 'policy-options = { misbehave = "chatter" }')
    if raised:
        table += "\n[plugin-limits.bad-policy]\nlog-lines-per-call = 2000\n"
    config = write_config(tmp_path, job(table))
    out = hearth("run", config, "--plugin-dir", tmp_path / "policies", "--output-dir", tmp_path / "runs")
    assert out.returncode == 0, out.stderr
    logged = out.stdout + out.stderr
    assert "fixture wrap policy line 1000" in logged, logged[-2000:]
    if raised:
        assert "fixture wrap policy line 1500" in logged and "dropped" not in logged, logged[-2000:]
    else:
        assert "fixture wrap policy line 1001" not in logged, logged[-2000:]
        assert "[plugin bad-policy] dropped 500 line(s)" in logged, logged[-2000:]
        assert "[plugin-limits.bad-policy]" in logged, logged[-2000:]


def test_plugin_limits_for_a_misspelt_wrap_policy_names_the_section_and_the_policy(hearth, tmp_path):
    table = fsdp_table("bad-policy") + "\n[plugin-limits.bad-polcy]\nlog-lines-per-call = 2000\n"
    out = hearth("run", write_config(tmp_path, job(table)))
    assert out.returncode == 2, out.stderr
    assert "`plugin-limits.bad-polcy`" in out.stderr and "wrap policy" in out.stderr, out.stderr
    assert "(they are: bad-policy)" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "line, key, says",
    [
        ('sharding-strategy = "FULLEST"', "fsdp.sharding-strategy", "is not a sharding strategy"),
        ('mixed-precision-policy = "bf16"', "fsdp.mixed-precision-policy", "use FULL_SHARD or HYBRID_SHARD"),
        ('mixed-precision-policy = "param_dtype=bf17"', "fsdp.mixed-precision-policy", "is not a dtype"),
        ('state-dict-type = "LOCAL_STATE_DICT"', "fsdp.state-dict-type", "not implemented in hearth yet"),
        ("min-num-params = -3", "fsdp.min-num-params", "whole number"),
        ("reshard-after-forwards = true", "fsdp.reshard-after-forwards", "unknown key"),
    ],
)
def test_a_bad_fsdp_value_names_the_key(hearth, tmp_path, line, key, says):
    config = write_config(tmp_path, job(f'\n[fsdp]\nsharding-strategy = "SHARD_GRAD_OP"\n{line}\n'.replace(
        'sharding-strategy = "SHARD_GRAD_OP"\nsharding-strategy', "sharding-strategy")))
    out = hearth("run", config)
    assert out.returncode == 2, out.stderr
    assert f"`{key}`" in out.stderr and says in out.stderr and str(config) in out.stderr, out.stderr


def test_one_run_resolves_fsdp_once_and_reads_each_variable_once(hearth, tmp_path):
    """The `[fsdp]` section and the HEARTH_FSDP_* variables are merged in
    one place, once per run (issue 62): the debug log has one resolution,
    and one read of each variable the plugin has (listed from its source)."""
    source = (ROOT / "host" / "hearth" / "src" / "parallel" / "fsdp" / "plugin.rs").read_text()
    fields = source[source.index("pub const FIELDS"):source.index("];", source.index("pub const FIELDS"))]
    variables = re.findall(r'"(HEARTH_FSDP_[A-Z_]+)"', fields)
    assert len(variables) == 18, variables
    table = {"sharding-strategy": "SHARD_GRAD_OP", "auto-wrap-policy": "transformer-based", "transformer-cls-names-to-wrap": ["Block"]}
    config = write_config(tmp_path, tiny_job(run={"steps": 4, "log-every": 2}, fsdp=table, eval={"samples": 4}))
    out = hearth("run", config, "--quiet", "--output-dir", tmp_path / "out", env={"HEARTH_LOG": "hearth=debug", "HEARTH_FSDP_FORWARD_PREFETCH": "true"})
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert said.count("resolved [fsdp]: SHARD_GRAD_OP with the wrap policy transformer-based") == 1, said
    reads = re.findall(r"read the environment variable (HEARTH_[A-Z_]+)", said)
    assert sorted(reads) == sorted(variables), reads
    # The variable acted: it is in the settings the run used.
    summary = json.loads((tmp_path / "out" / "tiny" / "summary.json").read_text())
    assert summary["fsdp"]["forward_prefetch"] is True, summary["fsdp"]


def test_full_shard_is_the_default_and_holds_only_its_shards_of_everything(hearth, hearth_bin, tmp_path):
    table = '\n[fsdp]\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\n'
    config = write_config(tmp_path, job(table))
    run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "full", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "full" / "fsdp" / "summary.json").read_text())
    assert summary["fsdp"]["sharding_strategy"] == "FULL_SHARD"
    assert summary["num_parameters"] == sum(p.numel() for p in peer_gpt.build(**SIZES).parameters())
    planned = json.loads(plan(hearth, tmp_path, table, 2).stdout)["per_process"]
    assert summary["memory"] == planned, "measured from the tensors = planned from the layout"
    whole = json.loads(plan(hearth, tmp_path, table, 1).stdout)["per_process"]
    assert abs(planned["param_bytes"] / whole["param_bytes"] - 0.5) < 0.01, (planned, whole)
    # Without activation checkpointing backward recomputes nothing: each
    # unit's graph is kept from forward, its whole parameters' memory freed
    # in between and given back (gathered again) for its backward.
    assert summary["gradient_sync"]["recomputed"] == 0
    assert summary["gradient_sync"]["gathers"] > 0
    # The saved weights are whole and load strict into the PyTorch class.
    model = peer_gpt.build(**SIZES)
    model.load_state_dict(load_file(tmp_path / "full" / "fsdp" / "model.safetensors"), strict=True)


SCRIPTED = '''
import torch, torch.nn as nn
class Block(nn.Module):
    def __init__(s, d):
        super().__init__(); s.ln = nn.LayerNorm(d); s.fc = nn.Linear(d, d)
        s.register_buffer("scale", torch.ones(d))
    def forward(s, x):
        return x + s.fc(s.ln(x)) * s.scale
class Net(nn.Module):
    def __init__(s):
        super().__init__(); s.tok = nn.Embedding(64, 32)
        s.blocks = nn.ModuleList([Block(32) for _ in range(2)]); s.head = nn.Linear(32, 64)
    def forward(s, idx):
        x = s.tok(idx)
        for b in s.blocks:
            x = b(x)
        return s.head(x)
'''


def test_a_torchscript_models_tree_is_its_named_modules_with_classes_and_buffers(hearth, tmp_path):
    import importlib.util
    source = tmp_path / "scripted_net.py"
    source.write_text(SCRIPTED)  # TorchScript reads the classes' source from a file
    spec = importlib.util.spec_from_file_location("scripted_net", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Net()
    torch.jit.script(model).save(str(tmp_path / "net.pt"))
    text = job(fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]'))
    text = text.replace('kind = "gpt"\nd-model = 128\nlayers = 4\nheads = 4', 'kind = "torchscript"\npath = "net.pt"')
    text = text.replace("vocab-size = 256\nseq-len = 128", "vocab-size = 64\nseq-len = 16")
    config = write_config(tmp_path, text)
    out = hearth("model", "plan", config, "-n", 2, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = [
        {"path": name, "class": type(m).__name__,
         "params": sum(p.numel() for p in m.parameters()),
         "bytes": sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])}
        for name, m in model.named_modules()
    ]
    key = lambda m: m["path"]
    assert sorted(got["modules"], key=key) == sorted(want, key=key)
    assert sorted(got["units"]) == ["", "blocks.0", "blocks.1"]


def test_sharded_checkpoints_are_ddps_and_resume_to_the_unbroken_run(hearth_bin, tmp_path):
    """save_state under SHARD_GRAD_OP writes what a DDP run writes (the
    optimizer state gathered whole, PyTorch's names), and a sharded run
    stopped and resumed from it ends with the unbroken run's weights. A
    step schedule runs beside: its rates reach the sharded optimizer."""
    schedule = '\n[scheduler]\nname = "step"\nstep-size = 2\ngamma = 0.5\n'
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]') + schedule
    save = "save-every = 4\n"
    sharded = write_config(tmp_path, job(table, steps=8).replace("log-every = 2\n", "log-every = 2\n" + save), "sharded.toml")
    ddp = write_config(tmp_path, job(schedule, steps=8).replace("log-every = 2\n", "log-every = 2\n" + save), "ddp.toml")
    for config, out in ((sharded, "whole"), (ddp, "ddp")):
        run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / out, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    ours = tmp_path / "whole" / "fsdp" / "checkpoints" / "checkpoint_0"
    theirs = tmp_path / "ddp" / "fsdp" / "checkpoints" / "checkpoint_0"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    a, b = load_file(ours / "optimizer.safetensors"), load_file(theirs / "optimizer.safetensors")
    assert a.keys() == b.keys() and len(a) == 3 * 4 * 12 + 3 * 6
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key
    groups = json.loads((ours / "optimizer.json").read_text())
    assert groups == json.loads((theirs / "optimizer.json").read_text())
    assert 0 < groups[0]["lr"] < 3e-4, "the schedule halved the rate"
    # Stopped after 4 steps, resumed to 8: the unbroken run's weights, bit for bit.
    first = mpirun(hearth_bin, 2, "run", sharded, "--quiet", "--steps", 4, "--output-dir", tmp_path / "broken", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = mpirun(hearth_bin, 2, "run", sharded, "--quiet", "--resume", "--output-dir", tmp_path / "broken", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    whole = (tmp_path / "whole" / "fsdp" / "model.safetensors").read_bytes()
    assert (tmp_path / "broken" / "fsdp" / "model.safetensors").read_bytes() == whole


def test_the_environment_wins_over_the_config_and_a_refusal_names_the_variable(hearth, tmp_path):
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]')
    config = write_config(tmp_path, job(table))
    # HEARTH_FSDP_* over [fsdp], as Accelerate's FSDP_* over its defaults.
    out = hearth("model", "plan", config, "-n", 2, "--json", env={"HEARTH_FSDP_SHARDING_STRATEGY": "3"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["strategy"] == "NO_SHARD"
    out = hearth("run", config, env={"HEARTH_FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"})
    assert out.returncode == 2
    assert "`fsdp.state-dict-type`" in out.stderr and "HEARTH_FSDP_STATE_DICT_TYPE" in out.stderr, out.stderr
    out = hearth("run", config, env={"HEARTH_FSDP_SYNC_MODULE_STATES": "perhaps"})
    assert out.returncode == 2 and "HEARTH_FSDP_SYNC_MODULE_STATES" in out.stderr, out.stderr


def test_ignored_modules_are_neither_sharded_nor_averaged(hearth, hearth_bin, tmp_path):
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]\nignored-modules = ["blocks.0"]')
    config = write_config(tmp_path, job(table), "ignoring.toml")
    planned = json.loads(plan(hearth, tmp_path, table, 2).stdout)["per_process"]
    full = json.loads(plan(hearth, tmp_path, fsdp_table("no-wrap"), 1, "whole.toml").stdout)["per_process"]
    block = 198272 * 4  # blocks.0's parameters, whole on every process
    assert planned["grad_bytes"] == (full["grad_bytes"] - block) // 2 + block
    run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "out" / "fsdp" / "summary.json").read_text())
    assert summary["memory"] == planned
    assert summary["gradient_sync"]["reduce_scatters"] == 4 * 4, "blocks.0 is no unit"
    bad = write_config(tmp_path, job(fsdp_table("no-wrap", 'ignored-modules = ["blocks.9"]')), "bad.toml")
    out = hearth("model", "plan", bad)
    assert out.returncode == 2 and "ignored module `blocks.9` is not a module of the model" in out.stderr, out.stderr


def read_with_torch(folder, like: dict) -> dict:
    """torch 2.11's own reader of distributed checkpoints in safetensors,
    without a process group: fills tensors shaped like `like`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return state


@pytest.mark.parametrize("strategy, machines", [("FULL_SHARD", 1), ("SHARD_GRAD_OP", 1), ("HYBRID_SHARD", 2)])
def test_a_sharded_checkpoint_merges_to_the_full_one_and_resumes_on_another_number_of_processes(hearth, hearth_bin, tmp_path, strategy, machines):
    """SHARDED_STATE_DICT on 4 processes: merged by hearth it is the
    FULL_STATE_DICT save byte for byte, torch's reader reads the same
    tensors (model and optimizer state), and resumed on 2 processes it ends
    where a 2-process run resumed from the full checkpoint ends, bit for bit.
    HYBRID_SHARD on 2 pretend machines writes one machine's shards (2 files)."""
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]').replace("SHARD_GRAD_OP", strategy)
    saving = "log-every = 2\nsave-every = 4\n"
    configs = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        text = job(table + f'state-dict-type = "{kind}"\n', steps=8).replace("log-every = 2\n", saving)
        configs[kind] = write_config(tmp_path, text, f"{kind}.toml")
        out = tmp_path / kind
        first = mpirun(hearth_bin, 4, "run", configs[kind], "--quiet", "--steps", 4, "--output-dir", out, cwd=tmp_path, machines=machines)
        assert first.returncode == 0, first.stderr
    if strategy != "SHARD_GRAD_OP":
        # save_state and save_model gathered one unit at a time: never more
        # whole at once than training's root and one block.
        summary = json.loads((tmp_path / "FULL_STATE_DICT" / "fsdp" / "summary.json").read_text())
        assert summary["gradient_sync"]["most_gathered"] == 2, summary["gradient_sync"]
    full = tmp_path / "FULL_STATE_DICT" / "fsdp" / "checkpoints" / "checkpoint_0"
    sharded = tmp_path / "SHARDED_STATE_DICT" / "fsdp" / "checkpoints" / "checkpoint_0"
    shards = sorted(p.name for p in (sharded / "pytorch_model_fsdp_0").iterdir())
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, 4 // machines + 1)]
    assert not (sharded / "model.safetensors").exists() and not (sharded / "optimizer.safetensors").exists()
    assert hearth("checkpoint", "verify", sharded).returncode == 0
    assert "1 sharded model, 1 sharded optimizer" in hearth("checkpoint", "inspect", sharded).stdout
    # Merged by hearth: the full save's model file, byte for byte.
    merged = hearth("checkpoint", "merge", sharded, tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    # A whole checkpoint has nothing to merge: the error names it and says what to pass.
    refused = hearth("checkpoint", "merge", full, tmp_path / "nothing")
    assert refused.returncode == 1 and str(full) in refused.stderr and "SHARDED_STATE_DICT" in refused.stderr, refused.stderr
    # --max-shard-size: HF shards with their index, holding the same tensors.
    split = hearth("checkpoint", "merge", sharded / "pytorch_model_fsdp_0", tmp_path / "split", "--max-shard-size", "300KB")
    assert split.returncode == 0, split.stderr
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    merged_whole = load_file(tmp_path / "merged" / "model.safetensors")
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / "split" / file)[name], merged_whole[name]), name
    # torch's reader: the same model tensors, and the optimizer state the full save gathered.
    for folder, whole in (("pytorch_model_fsdp_0", "model.safetensors"), ("optimizer_0", "optimizer.safetensors")):
        want = load_file(full / whole)
        got = read_with_torch(sharded / folder, want)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (folder, key)
    assert json.loads((sharded / "optimizer.json").read_text()) == json.loads((full / "optimizer.json").read_text())
    # Resumed on 2 processes from each: the same weights at step 8, bit for bit.
    for kind in configs:
        resumed = mpirun(hearth_bin, 2, "run", configs[kind], "--quiet", "--resume", "--output-dir", tmp_path / kind, cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
    final = [(tmp_path / kind / "fsdp" / "model.safetensors").read_bytes() for kind in configs]
    assert final[0] == final[1]
    assert final[0] != (full / "model.safetensors").read_bytes(), "training went on"




def test_a_process_killed_during_a_sharded_save_leaves_the_previous_checkpoint_loadable(hearth, hearth_bin, tmp_path):
    """Rank 3 is stopped in the middle of a sharded save, before its shards
    are in (the others have started it and wait), then killed: no
    checkpoint appears for that save, and the previous one verifies and
    resumes."""
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]').replace("SHARD_GRAD_OP", "FULL_SHARD")
    table += 'state-dict-type = "SHARDED_STATE_DICT"\n'
    text = job(table, steps=200).replace("log-every = 2\n", "log-every = 2\nsave-every = 2\n").replace("d-model = 128", "d-model = 256")
    config = write_config(tmp_path, text)
    checkpoints = tmp_path / "out" / "fsdp" / "checkpoints"
    caught = None
    with start(mpirun_command(4, hearth_bin, "run", config, "--quiet", "--output-dir", tmp_path / "out"),
               cwd=tmp_path, env=mpi_env()) as job_:
        deadline = time.monotonic() + 300
        while caught is None and job_.proc.poll() is None and time.monotonic() < deadline:
            staging = [p for p in checkpoints.glob(".checkpoint_*.tmp-*") if p.is_dir()] if checkpoints.exists() else []
            if not staging or not (checkpoints / "checkpoint_0").exists():
                time.sleep(0.001)
                continue
            rank3 = processes_of_rank(3, config)
            shard = staging[0] / "pytorch_model_fsdp_0" / "shard-00004-model-00001-of-00001.safetensors"
            for pid in rank3:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
            if staging[0].exists() and not shard.exists():
                caught = staging[0]
            else:
                for pid in rank3:
                    os.kill(pid, signal.SIGCONT)
        assert caught is not None, "never caught a save before rank 3's shards were in"
        name = caught.name.split(".tmp-")[0].lstrip(".")
        time.sleep(1.0)
        assert not (checkpoints / name).exists(), "the others must wait for rank 3's shards"
        for pid in processes_of_rank(3, config):
            os.kill(pid, signal.SIGKILL)
        ended = job_.finish()
    assert ended.returncode != 0
    assert not (checkpoints / name).exists()
    visible = sorted(checkpoints.glob("checkpoint_*"))
    assert visible, "an earlier checkpoint was committed"
    for folder in visible:
        assert hearth("checkpoint", "verify", folder).returncode == 0, folder
    resumed = mpirun(hearth_bin, 2, "run", config, "--quiet", "--resume", "--steps", int(name.split("_")[1]) * 2 + 2, "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert (checkpoints / name).exists(), "the resumed run saves that step again"


def test_a_sharded_checkpoint_of_another_model_is_refused_naming_the_tensor(hearth_bin, tmp_path):
    """Resuming a 2-layer GPT from a 4-layer one's sharded checkpoint stops
    before anything is restored, naming the folder and the tensor."""
    table = '\n[fsdp]\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\nstate-dict-type = "SHARDED_STATE_DICT"\n'
    text = job(table, steps=2).replace("log-every = 2\n", "log-every = 2\nsave-every = 2\n")
    four = write_config(tmp_path, text, "four.toml")
    saved = mpirun(hearth_bin, 2, "run", four, "--quiet", "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    two = write_config(tmp_path, text.replace("layers = 4", "layers = 2").replace("steps = 2", "steps = 4"), "two.toml")
    resumed = mpirun(hearth_bin, 2, "run", two, "--quiet", "--resume", "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert resumed.returncode != 0
    assert "pytorch_model_fsdp_0" in resumed.stderr and "`blocks.2." in resumed.stderr, resumed.stderr
    assert "which model 0 does not have" in resumed.stderr, resumed.stderr


@pytest.mark.parametrize("prefetch", ['forward-prefetch = true\nbackward-prefetch = "BACKWARD_PRE"', 'backward-prefetch = "BACKWARD_POST"'])
def test_prefetching_gathers_ahead_and_trains_the_same_weights(hearth_bin, tmp_path, prefetch):
    base = '\n[fsdp]\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\n'
    summaries = {}
    for name, table in [("plain", base), ("ahead", base + prefetch + "\n")]:
        config = write_config(tmp_path, job(table), f"{name}.toml")
        run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / name, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        summaries[name] = json.loads((tmp_path / name / "fsdp" / "summary.json").read_text())["gradient_sync"]
    plain, ahead = summaries["plain"], summaries["ahead"]
    # The same values are gathered, only earlier: the same weights, bit for bit.
    assert (tmp_path / "plain" / "fsdp" / "model.safetensors").read_bytes() == (tmp_path / "ahead" / "fsdp" / "model.safetensors").read_bytes()
    assert plain["prefetched"] == 0
    # The four blocks' gathers start ahead, in forward and in backward (the
    # root, used first and last, stays gathered in between); 4 steps.
    forward = 4 * 4 if "forward-prefetch" in prefetch else 0
    assert ahead["prefetched"] == forward + 4 * 4, ahead
    assert ahead["gathers"] == plain["gathers"] and ahead["gather_bytes"] == plain["gather_bytes"]
    # limit-all-gathers: at most the unit at work and the next one beyond
    # what is held anyway.
    assert ahead["most_gathered"] <= plain["most_gathered"] + 1, (plain, ahead)


@pytest.mark.parametrize("strategy, extra", [("FULL_SHARD", ""), ("SHARD_GRAD_OP", ""), ("FULL_SHARD", 'ignored-modules = ["head"]')])
def test_ram_efficient_loading_trains_from_rank_0s_weights_alone(hearth, hearth_bin, tmp_path, strategy, extra):
    # Rank 1 never builds its weights (allocated, never written): were any
    # of them used instead of rank 0's (an ignored module's too), the
    # weights would differ.
    base = f'\n[fsdp]\nsharding-strategy = "{strategy}"\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\nsync-module-states = true\n{extra}\n'
    for name, table in [("synced", base), ("efficient", base + "cpu-ram-efficient-loading = true\n")]:
        config = write_config(tmp_path, job(table), f"{name}.toml")
        run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / name, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
    assert (tmp_path / "synced" / "fsdp" / "model.safetensors").read_bytes() == (tmp_path / "efficient" / "fsdp" / "model.safetensors").read_bytes()
    # Without the broadcast that brings rank 0's weights it is refused.
    config = write_config(tmp_path, job(base.replace("sync-module-states = true", "cpu-ram-efficient-loading = true")), "bad.toml")
    out = hearth("run", config)
    assert out.returncode == 2 and "`fsdp.cpu-ram-efficient-loading`" in out.stderr and "sync-module-states = true" in out.stderr, out.stderr


def test_a_mixed_precision_policy_on_two_processes_reduces_in_its_dtype_and_saves_float32(hearth_bin, tmp_path):
    # The oracle run against PyTorch FSDP2 is host/hearth/tests/distributed/fsdp_mixed_precision.rs
    # (one process); here the collectives of two processes carry the dtypes.
    base = '\n[fsdp]\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\n'
    sync = {}
    for name, policy in [("fp32", "fp32"), ("bf16", "bf16")]:
        config = write_config(tmp_path, job(base + f'mixed-precision-policy = "{policy}"\n'), f"{name}.toml")
        run = mpirun(hearth_bin, 2, "run", config, "--output-dir", tmp_path / name, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        sync[name] = json.loads((tmp_path / name / "fsdp" / "summary.json").read_text())["gradient_sync"]
    assert "parameters in bf16, gradients reduced in bf16" in run.stdout + run.stderr
    assert 2 * sync["bf16"]["bytes"] == sync["fp32"]["bytes"], sync
    assert sync["bf16"]["gathers"] == sync["fp32"]["gathers"] and sync["bf16"]["gather_bytes"] < sync["fp32"]["gather_bytes"], sync
    saved = load_file(tmp_path / "bf16" / "fsdp" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())
    peer_gpt.build(**SIZES).load_state_dict(saved, strict=True)


def test_a_sharded_torchscript_models_buffers_are_saved_and_resumed(hearth_bin, tmp_path):
    """Issue 18, item 3, under sharding: a BatchNorm model's buffers are not
    sharded but held whole, saved in a SHARDED_STATE_DICT checkpoint (rank
    0's pieces) and in model.safetensors, and a run stopped and resumed
    ends with the unbroken run's parameters and buffers, bit for bit."""
    sys.path.insert(0, str(ROOT / "tests" / "oracles"))
    from batchnorm_lm import BatchNormLM

    torch.manual_seed(0)
    fresh = BatchNormLM(vocab=256, seq=16)
    torch.jit.script(fresh).save(str(tmp_path / "bn.pt"))
    table = fsdp_table("no-wrap", 'state-dict-type = "SHARDED_STATE_DICT"')
    text = job(table, steps=8).replace("log-every = 2\n", "log-every = 2\nsave-every = 4\n")
    text = text.replace('kind = "gpt"\nd-model = 128\nlayers = 4\nheads = 4', 'kind = "torchscript"\npath = "bn.pt"')
    config = write_config(tmp_path, text.replace("seq-len = 128", "seq-len = 16"), "bn.toml")
    whole = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = mpirun(hearth_bin, 2, "run", config, "--quiet", "--steps", 4, "--output-dir", tmp_path / "broken", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "broken" / "fsdp" / "checkpoints" / "checkpoint_0" / "pytorch_model_fsdp_0").is_dir()
    resumed = mpirun(hearth_bin, 2, "run", config, "--quiet", "--resume", "--output-dir", tmp_path / "broken", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    saved = load_file(tmp_path / "whole" / "fsdp" / "model.safetensors")
    assert set(saved) == set(fresh.state_dict())
    assert int(saved["bn.num_batches_tracked"]) == 8
    again = load_file(tmp_path / "broken" / "fsdp" / "model.safetensors")
    assert all(torch.equal(saved[k], again[k]) for k in saved), "state differs after a sharded resume"


# Issue 38: text a FULL_SHARD job evaluates on.
from text_data import TEXT  # noqa: E402


def text_job(tmp_path, fsdp: str, steps: int, extra: str = "") -> str:
    """The sharding job on `TEXT` (a small GPT, windows of 64 bytes)."""
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    data = 'kind = "text-file"\npath = "corpus.txt"\nseq-len = 64\nbatch-size = 4'
    text = job(fsdp, steps=steps).replace('kind = "random-tokens"\nvocab-size = 256\nseq-len = 128\nbatch-size = 2', data)
    return text.replace("d-model = 128\nlayers = 4", "d-model = 32\nlayers = 2") + extra


@pytest.mark.parametrize("eval_batch", [500, 5])
def test_full_shard_on_text_evaluates_and_writes_its_model_on_two_processes(hearth_bin, tmp_path, eval_batch):
    """FULL_SHARD with text data on 2 processes ends with its evaluation and
    its model. The 13 validation windows make 1 batch of 500 (rank 1 had
    none) or 3 of 5 (rank 0 had two): every evaluation forward pass gathers
    the units, a collective, so the rank with fewer passes went on to the
    loss's all-reduce and both waited until the collective timeout. Every
    rank now runs as many passes, the extra ones counting nothing."""
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]').replace("SHARD_GRAD_OP", "FULL_SHARD")
    extra = f"\n[eval]\nbatch-size = {eval_batch}\n\n[distributed]\ntimeout = 30\n"
    config = write_config(tmp_path, text_job(tmp_path, table, 2, extra))
    out = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "out", cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "out" / "fsdp"
    summary = json.loads((run / "summary.json").read_text())
    # 9 000 bytes, the last tenth held out: 13 windows of 65 bytes.
    assert summary["eval"]["kind"] == "validation-loss" and summary["eval"]["tokens"] == 13 * 64, summary["eval"]
    assert (run / "model.safetensors").exists()


def test_a_flipped_bit_in_a_shard_another_rank_wrote_is_caught_and_resume_falls_back(hearth, hearth_bin, tmp_path):
    """A sharded checkpoint's shard written by rank 1 (its hash came to the
    writer with the gather that waits for every rank): one random bit
    inverted at 20 positions; `verify` exits 1 naming the shard each time,
    and a 2-process `--resume` skips the checkpoint and resumes from the
    one before."""
    table = fsdp_table("transformer-based", 'transformer-cls-names-to-wrap = ["Block"]').replace("SHARD_GRAD_OP", "FULL_SHARD")
    table += 'state-dict-type = "SHARDED_STATE_DICT"\n'
    text = job(table, steps=4).replace("log-every = 2\n", "log-every = 2\nsave-every = 2\n")
    config = write_config(tmp_path, text)
    saved = mpirun(hearth_bin, 2, "run", config, "--quiet", "--output-dir", tmp_path / "out", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    newest = tmp_path / "out" / "fsdp" / "checkpoints" / "checkpoint_1"
    shard = newest / "pytorch_model_fsdp_0" / "shard-00002-model-00001-of-00001.safetensors"
    assert shard.exists(), sorted(p.name for p in newest.rglob("*"))
    rng = random.Random(7)
    for i in range(20):
        data = bytearray(shard.read_bytes())
        end = 8 + int.from_bytes(data[:8], "little") if i == 0 else len(data)
        pos = rng.randrange(end)
        data[pos] ^= 1 << rng.randrange(8)
        original = shard.read_bytes()
        shard.write_bytes(bytes(data))
        out = hearth("checkpoint", "verify", newest)
        assert out.returncode == 1 and "pytorch_model_fsdp_0/shard-00002" in out.stderr, (i, pos, out.stderr)
        if i == 19:
            resumed = mpirun(hearth_bin, 2, "run", config, "--quiet", "--resume", "--steps", 6,
                             "--output-dir", tmp_path / "out", cwd=tmp_path)
            said = resumed.stdout + resumed.stderr
            assert resumed.returncode == 0, said
            assert "checkpoint_1 is damaged" in said and "checkpoint_0" in said, said
        else:
            shard.write_bytes(original)
