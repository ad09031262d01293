"""Today's model families, traced, run unit by unit: transformers Llama,
Qwen2, Mistral and GPT-2 (random init, `save_pretrained`, traced behind a
logits wrapper) under every strategy on real text. FULL_SHARD cuts the
traced forward pass at its decoder layers (the wrap policy's units) and
holds one layer whole at a time; each cell that shards is checked against
a DDP run of the same model and data, and the counters show the per-unit
execution."""
import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

import hf_causal
import text_data
from conftest import mpirun, write_config

STEPS = 3
# name: (processes, machines, [fsdp] keys; None: no table)
STRATEGIES = {
    "one-process": (1, 1, None),
    "ddp": (2, 1, None),
    "shard-grad-op": (2, 1, 'sharding-strategy = "SHARD_GRAD_OP"'),
    "full-shard": (2, 1, 'sharding-strategy = "FULL_SHARD"'),
    "full-shard-checkpointed": (2, 1, 'sharding-strategy = "FULL_SHARD"\nactivation-checkpointing = true'),
    "hybrid": (4, 2, 'sharding-strategy = "HYBRID_SHARD"'),
}
CELLS = [
    ("llama", "one-process"),
    ("llama", "full-shard"),
    ("llama", "full-shard-checkpointed"),
    ("llama", "hybrid"),
    ("qwen2", "ddp"),
    ("qwen2", "shard-grad-op"),
    ("qwen2", "full-shard"),
    ("mistral", "one-process"),
    ("mistral", "full-shard-checkpointed"),
    ("mistral", "hybrid"),
    ("gpt2", "ddp"),
    ("gpt2", "shard-grad-op"),
    ("gpt2", "full-shard"),
]
# The DDP run a cell of that many processes is checked against.
DDP_ON = {2: (2, 1, None), 4: (4, 1, None)}
# A sharded run adds the same gradients in another order (unit by unit,
# reduce-scattered rather than all-reduced); after 3 AdamW steps at lr
# 1e-3 its weights measured within 2e-7 of DDP's. A unit skipped, run
# twice or stepped twice moves weights by about the learning rate.
TOLERANCE = 1e-5


def config(tmp_path, family: str, fsdp, steps: int = STEPS, extra: str = "") -> str:
    (tmp_path / "corpus.txt").write_bytes(text_data.TEXT)
    table = ""
    if fsdp is not None:
        table = (f'\n[fsdp]\n{fsdp}\nauto-wrap-policy = "transformer-based"\n'
                 f'transformer-cls-names-to-wrap = ["{hf_causal.layer_class(family)}"]\n')
    return f"""
[run]
name = "cell"
steps = {steps}
log-every = 1
{extra}
[model]
kind = "torchscript"
path = "model.pt"

[data]
kind = "text-file"
path = "corpus.txt"
seq-len = 64
batch-size = 4

[optimizer]
kind = "adamw"
lr = 1e-3
{table}
[distributed]
timeout = 60
"""


def train(hearth_bin, tmp_path, traced, family: str, spec, name: str, steps: int = STEPS, extra: str = ""):
    """Trains `family` as `spec` (processes, machines, [fsdp] keys) says, in
    `tmp_path/name`: its summary."""
    processes, machines, fsdp = spec
    shutil.copy(traced(family)["traced"], tmp_path / "model.pt")
    job = write_config(tmp_path, config(tmp_path, family, fsdp, steps, extra), f"{name}.toml")
    run = mpirun(hearth_bin, processes, "run", job, "--quiet", "--output-dir", tmp_path / name,
                 cwd=tmp_path, machines=machines, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads((tmp_path / name / "cell" / "summary.json").read_text())


def weights(tmp_path, name: str) -> dict:
    return load_file(tmp_path / name / "cell" / "model.safetensors")


def worst_difference(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("family, strategy", CELLS)
def test_a_traced_family_trains_under_each_strategy_as_ddp_does(hearth_bin, tmp_path, traced, family, strategy):
    spec = STRATEGIES[strategy]
    summary = train(hearth_bin, tmp_path, traced, family, spec, "cell")
    assert summary["num_processes"] == spec[0] and summary["steps"] == STEPS, summary
    assert summary["final_loss"] < 6.0 and summary["eval"]["kind"] == "validation-loss", summary
    trained = weights(tmp_path, "cell")
    # The saved weights load into transformers' class (a tied head is
    # saved once, under the embedding's name; the traced module's rotary
    # tables, buffers transformers does not save, come along).
    loaded = hf_causal.model(family).load_state_dict({k.removeprefix("m."): v for k, v in trained.items()}, strict=False)
    assert set(loaded.missing_keys) <= {"lm_head.weight"}, loaded
    assert all(k.endswith("inv_freq") for k in loaded.unexpected_keys), loaded
    sync = summary["gradient_sync"]
    if spec[2] is not None and "SHARD_GRAD_OP" not in spec[2]:
        # One unit at a time: the root (kept from forward to backward) and
        # the decoder layer at work are the most ever whole.
        assert sync["most_gathered"] == 2 and sync["gathers"] > 0, sync
        assert (sync["recomputed"] > 0) == ("activation-checkpointing" in spec[2]), sync
    if spec[2] is None:
        return
    ddp = train(hearth_bin, tmp_path, traced, family, DDP_ON[spec[0]], "ddp")
    gap = worst_difference(trained, weights(tmp_path, "ddp"))
    assert gap <= TOLERANCE, f"{family} {strategy}: {gap:e} from DDP's weights"
    assert summary["final_loss"] == pytest.approx(ddp["final_loss"], abs=1e-4)


def test_every_family_and_strategy_is_in_two_cells_or_more():
    for axis, names in enumerate((hf_causal.FAMILIES, STRATEGIES)):
        for name in names:
            assert sum(cell[axis] == name for cell in CELLS) >= 2, name


LAYERS = hf_causal.SIZES["num_hidden_layers"]


@pytest.mark.parametrize("strategy", ["full-shard", "full-shard-checkpointed"])
def test_full_shard_gathers_each_decoder_layer_twice_a_step_and_the_root_once(hearth_bin, tmp_path, traced, strategy):
    """The counters of one step (the difference of a 3-step and a 1-step run,
    so that loading, the probe, evaluation and saving cancel): forward
    gathers the root (embeddings, final norm, head) and each decoder layer,
    backward each layer again — the root stays whole from forward to
    backward, as FSDP2 keeps the root — and one reduce-scatter per unit.
    With activation checkpointing backward recomputes the four pieces (the
    code before the first layer, each layer, the code after the last)."""
    spec = STRATEGIES[strategy]
    one = train(hearth_bin, tmp_path, traced, "llama", spec, "one", steps=1)["gradient_sync"]
    three = train(hearth_bin, tmp_path, traced, "llama", spec, "three", steps=3)["gradient_sync"]
    per_step = {k: (three[k] - one[k]) / 2 for k in ("gathers", "reduce_scatters", "recomputed", "syncs")}
    assert per_step["gathers"] == 2 * LAYERS + 1, (one, three)
    assert per_step["reduce_scatters"] == LAYERS + 1 and per_step["syncs"] == 1, (one, three)
    assert per_step["recomputed"] == (LAYERS + 2 if "checkpointed" in strategy else 0), (one, three)
    assert three["most_gathered"] == 2, three


def test_prefetching_gathers_the_next_layer_early_and_trains_the_same_weights(hearth_bin, tmp_path, traced):
    spec = STRATEGIES["full-shard"]
    prefetching = (2, 1, spec[2] + '\nforward-prefetch = true\nbackward-prefetch = "BACKWARD_PRE"')
    plain = train(hearth_bin, tmp_path, traced, "qwen2", spec, "plain")["gradient_sync"]
    early = train(hearth_bin, tmp_path, traced, "qwen2", prefetching, "early")["gradient_sync"]
    assert early["gathers"] == plain["gathers"] and early["prefetched"] > 0 and plain["prefetched"] == 0
    assert early["most_gathered"] == 2, early
    assert (tmp_path / "early" / "cell" / "model.safetensors").read_bytes() == \
        (tmp_path / "plain" / "cell" / "model.safetensors").read_bytes()


def test_model_plan_says_what_a_full_shard_run_of_a_traced_llama_holds(hearth, hearth_bin, tmp_path, traced):
    spec = STRATEGIES["full-shard"]
    shutil.copy(traced("llama")["traced"], tmp_path / "model.pt")
    job = write_config(tmp_path, config(tmp_path, "llama", spec[2]), "cell.toml")
    planned = hearth("model", "plan", job, "-n", 2, "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["units"] == [""] + [f"m.model.layers.{i}" for i in range(LAYERS)], plan["units"]
    summary = train(hearth_bin, tmp_path, traced, "llama", spec, "cell")
    assert summary["memory"] == plan["per_process"], "measured from the tensors = planned from the layout"
    assert summary["gradient_sync"]["most_gathered_bytes"] == plan["whole_bytes"], (summary, plan["whole_bytes"])
    text = hearth("model", "plan", job, "-n", 2).stdout
    assert "whole at once during a step" in text and "m.model.layers.1 *" in text, text


def run(hearth_bin, tmp_path, job, n, out, *args):
    done = mpirun(hearth_bin, n, "run", job, "--quiet", "--output-dir", out, *args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, f"{n} processes:\n{done.stderr}"
    return done


@pytest.mark.parametrize("writer, reader", [(2, 4), (4, 2)])
def test_a_sharded_checkpoint_of_a_traced_llama_resumes_on_another_number_of_processes(
        hearth, hearth_bin, tmp_path, traced, writer, reader):
    fsdp = 'sharding-strategy = "FULL_SHARD"\nstate-dict-type = "SHARDED_STATE_DICT"'
    shutil.copy(traced("llama")["traced"], tmp_path / "model.pt")
    job = write_config(tmp_path, config(tmp_path, "llama", fsdp, steps=2, extra="save-every = 2\n"), "cell.toml")
    written = tmp_path / "written"
    run(hearth_bin, tmp_path, job, writer, written)
    checkpoint = written / "cell" / "checkpoints" / "checkpoint_0"
    assert len(list((checkpoint / "pytorch_model_fsdp_0").glob("*.safetensors"))) == writer
    final = (written / "cell" / "model.safetensors").read_bytes()
    # Nothing left to train: every process reads its rows, the weights
    # come back bit for bit.
    still = tmp_path / "still"
    shutil.copytree(written, still)
    done = run(hearth_bin, tmp_path, job, reader, still, "--resume")
    assert "no steps left" in done.stdout, done.stdout
    assert (still / "cell" / "model.safetensors").read_bytes() == final, f"{writer} -> {reader}"
    # One more step: it trains on.
    on = tmp_path / "on"
    shutil.copytree(written, on)
    run(hearth_bin, tmp_path, job, reader, on, "--resume", "--steps", 3)
    summary = json.loads((on / "cell" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["num_processes"] == reader and summary["final_loss"] < 6.0, summary
    assert (on / "cell" / "model.safetensors").read_bytes() != final
    # `hearth checkpoint merge` writes the file a FULL_STATE_DICT save does.
    merged = hearth("checkpoint", "merge", checkpoint, tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == final


UNCUTTABLE = {
    # A unit called only inside a branch of the graph.
    "branch": ("control flow", '''
    def forward(self, ids):
        x = self.emb(ids)
        if bool(x.sum() > 0):
            x = self.a(x)
        else:
            x = self.b(x)
        return self.head(x)
'''),
    # A unit whose weights are read directly, never called.
    "never-called": ("never called", '''
    def forward(self, ids):
        x = self.emb(ids)
        x = torch.tanh(x @ self.a.fc.weight.t())
        return self.head(self.b(x))
'''),
}


@pytest.mark.parametrize("case", UNCUTTABLE)
def test_a_model_that_cannot_be_cut_at_its_units_is_refused_naming_the_unit(hearth, tmp_path, case):
    says, forward = UNCUTTABLE[case]
    script = f'''
import sys, torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
    def forward(self, x):
        return torch.tanh(self.fc(x))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(256, 16)
        self.a = Block()
        self.b = Block()
        self.head = torch.nn.Linear(16, 256)
{forward}
torch.jit.script(Net()).save(sys.argv[1])
'''
    # torch.jit.script reads the classes' source: a file, not `-c`.
    (tmp_path / "net.py").write_text(script)
    made = subprocess.run([sys.executable, tmp_path / "net.py", tmp_path / "model.pt"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    fsdp = 'sharding-strategy = "FULL_SHARD"'
    table = config(tmp_path, "llama", fsdp).replace('"LlamaDecoderLayer"', '"Block"')
    job = write_config(tmp_path, table, "cell.toml")
    out = hearth("run", job)
    assert out.returncode == 2, out.stderr
    assert "`a`" in out.stderr and says in out.stderr and "model.pt" in out.stderr, out.stderr


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_bf16_mixed_precision_policy_and_whole_units_after_forward_work_on_a_traced_model(
        hearth_bin, tmp_path, traced, family):
    """FSDP's keys on a traced model's units: a bf16/fp32 mixed-precision
    policy (the units gathered in bf16; a traced graph fixes the kinds it
    converts to, so each piece runs under bf16 autocast) trains as DDP in
    float32 does within bf16's rounding, and saves float32 weights;
    `reshard-after-forward = false` keeps every unit whole from forward to
    backward and trains DDP's weights."""
    ddp = train(hearth_bin, tmp_path, traced, family, DDP_ON[2], "ddp")
    policy = (2, 1, 'sharding-strategy = "FULL_SHARD"\nmixed-precision-policy = "param_dtype=bf16,reduce_dtype=fp32"')
    sixteen = train(hearth_bin, tmp_path, traced, family, policy, "bf16")
    assert abs(sixteen["final_loss"] - ddp["final_loss"]) < 0.02, (sixteen["final_loss"], ddp["final_loss"])
    saved = weights(tmp_path, "bf16")
    assert {str(t.dtype) for t in saved.values()} == {"torch.float32"}
    assert worst_difference(saved, weights(tmp_path, "ddp")) < 2e-2
    whole = (2, 1, 'sharding-strategy = "FULL_SHARD"\nreshard-after-forward = false')
    held = train(hearth_bin, tmp_path, traced, family, whole, "held")
    assert held["gradient_sync"]["most_gathered"] == LAYERS + 1, held["gradient_sync"]
    assert worst_difference(weights(tmp_path, "held"), weights(tmp_path, "ddp")) <= TOLERANCE
