"""Starting from pretrained weights (`[model] init-from`) and saving what
the ecosystem loads back: a transformers GPT-2 saved with
`save_pretrained`, its TorchScript export trained by hearth under
FULL_SHARD on 2 processes, the run folder loaded by transformers'
`from_pretrained`; and every way the weights can fail to fit, refused
before the run writes anything."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_gpt2
from conftest import mpirun, write_config

from text_data import TEXT
FULL_SHARD = """
[fsdp]
sharding-strategy = "FULL_SHARD"
auto-wrap-policy = "transformer-based"
transformer-cls-names-to-wrap = ["GPT2Block"]
"""


def job(init: str, extra: str = "") -> str:
    return f"""
[run]
name = "tuned"
steps = 4
log-every = 2

[model]
kind = "torchscript"
path = "gpt2.pt"
{init}

[data]
kind = "text-file"
path = "corpus.txt"
seq-len = 64
batch-size = 4

[optimizer]
kind = "adamw"
lr = 1e-3
{extra}
[distributed]
timeout = 60
"""


INIT = 'init-from = "pretrained"\ninit-key-prefix = "m."'


@pytest.fixture
def folder(tmp_path):
    """`pretrained/` (save_pretrained of seed 0), `gpt2.pt` (the export of
    seed 1: other weights, so loading them shows) and the text."""
    hf_gpt2.model(0).save_pretrained(tmp_path / "pretrained")
    hf_gpt2.export(hf_gpt2.model(1), tmp_path / "gpt2.pt")
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    return tmp_path


def test_a_gpt2_fine_tuned_under_full_shard_loads_with_from_pretrained_and_scores_what_hearth_scored(hearth_bin, folder):
    """Loaded on rank 0 alone (cpu-ram-efficient-loading: the other rank
    receives each unit), a run of no steps writes the pretrained weights
    bit for bit under their own names. Trained 4 steps, the run folder
    loads with from_pretrained (config and generation config copied, the
    head tied to the embedding again); its logits are those of the program
    hearth ran with the weights it wrote within 1e-5, and transformers' loss
    on the held-out windows is hearth's evaluation within 1e-5 relative:
    the same float32 operations in an order libtorch's TorchScript graph
    and transformers' eager code may each pick."""
    from transformers import AutoModelForCausalLM

    efficient = FULL_SHARD + "cpu-ram-efficient-loading = true\nsync-module-states = true\n"
    start = write_config(folder, job(INIT, extra=efficient), "start.toml")
    run = mpirun(hearth_bin, 2, "run", start, "--steps", 0, "--output-dir", folder / "start", cwd=folder, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "initialised 28 tensors from" in run.stdout, run.stdout
    pretrained = load_file(folder / "pretrained" / "model.safetensors")
    written = load_file(folder / "start" / "tuned" / "model.safetensors")
    assert written.keys() == pretrained.keys()
    for name in pretrained:
        assert torch.equal(written[name], pretrained[name]), name

    tune = write_config(folder, job(INIT, extra=FULL_SHARD), "tune.toml")
    run = mpirun(hearth_bin, 2, "run", tune, "--output-dir", folder / "out", cwd=folder, timeout=300)
    assert run.returncode == 0, run.stderr
    out = folder / "out" / "tuned"
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / "pretrained" / name).read_bytes(), name
    tuned, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert tuned.lm_head.weight.data_ptr() == tuned.transformer.wte.weight.data_ptr()
    trained = load_file(out / "model.safetensors")
    assert not torch.equal(trained["transformer.wte.weight"], pretrained["transformer.wte.weight"])
    assert torch.equal(tuned.transformer.wte.weight.detach(), trained["transformer.wte.weight"])
    # hearth's logits: the program it ran (the TorchScript export) with the
    # weights it wrote, executed by libtorch; transformers' from the folder.
    program = torch.jit.load(str(folder / "gpt2.pt"))
    program.load_state_dict({f"m.{k}": v for k, v in trained.items()}, strict=False)
    x = torch.as_tensor(list(TEXT[-64:])).view(1, 64)
    with torch.no_grad():
        ours, theirs_logits = program(x), tuned.eval()(x)[0]
    assert (ours - theirs_logits).abs().max().item() <= 1e-5, (ours - theirs_logits).abs().max().item()
    summary = json.loads((out / "summary.json").read_text())
    theirs = hf_gpt2.validation_loss(tuned.eval(), TEXT, 64)
    assert abs(theirs - summary["eval"]["loss"]) <= 1e-5 * theirs, (theirs, summary["eval"])
    # The pretrained model scores differently: the check can fail.
    before = hf_gpt2.validation_loss(hf_gpt2.model(0), TEXT, 64)
    assert abs(before - summary["eval"]["loss"]) > 1e-3


def test_sharded_and_half_precision_weights_load_cast_to_the_models_dtype(hearth, folder):
    """save_pretrained in float16 with 20 KB shards: an index and several
    files, read one at a time, each tensor cast to float32."""
    half = hf_gpt2.model(0).half()
    half.save_pretrained(folder / "pretrained", max_shard_size="20KB")
    index = json.loads((folder / "pretrained" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = write_config(folder, job(INIT))
    run = hearth("run", config, "--steps", 0, "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    written = load_file(folder / "out" / "tuned" / "model.safetensors")
    for name, value in half.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight, saved once
        assert written[name].dtype == torch.float32 and torch.equal(written[name], value.float()), name


def test_renamed_weights_are_saved_back_under_the_files_names(hearth, folder):
    """init-rename strips `transformer.` and the prefix puts `m.transformer.`
    back: the run folder holds the pretrained file's names, not a guess."""
    init = 'init-from = "pretrained"\ninit-key-prefix = "m.transformer."\ninit-rename = { "transformer." = "" }'
    run = hearth("run", write_config(folder, job(init)), "--steps", 0, "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    written = load_file(folder / "out" / "tuned" / "model.safetensors")
    assert written.keys() == load_file(folder / "pretrained" / "model.safetensors").keys()


def test_a_hearth_run_folder_starts_the_next_run(hearth, tmp_path):
    """The built-in GPT from a previous run's model.safetensors."""
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    gpt = job("").replace('kind = "torchscript"\npath = "gpt2.pt"', 'kind = "gpt"\nd-model = 32\nlayers = 2\nheads = 4')
    first = hearth("run", write_config(tmp_path, gpt, "first.toml"), "--output-dir", tmp_path / "first")
    assert first.returncode == 0, first.stderr
    again = gpt.replace("[model]\n", '[model]\ninit-from = "first/tuned"\n')
    run = hearth("run", write_config(tmp_path, again, "again.toml"), "--steps", 0, "--output-dir", tmp_path / "again")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "again" / "tuned" / "model.safetensors").read_bytes() == (tmp_path / "first" / "tuned" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("init, says", [
    # No prefix: every name misses; both lists in one message.
    ('init-from = "pretrained"', ["missing from the weights (28): m.transformer.h.0.attn.c_attn.bias", "not in the model (28): transformer.h.0.attn.c_attn.bias", "init-key-prefix"]),
    ('init-from = "wide"\ninit-key-prefix = "m."', ["wrong shape (", "m.transformer.wte.weight is [256, 48] in", "[256, 32] in the model"]),
    ('init-from = "extra.safetensors"\ninit-key-prefix = "m."', ["not in the model (1): transformer.extra", "init-strict = false"]),
    ('init-from = "nowhere"\ninit-key-prefix = "m."', ["nowhere", "does not exist"]),
    ('init-from = "sharded"', ["sharded checkpoint", "hearth checkpoint merge"]),
    ('init-key-prefix = "m."', ["model.init-key-prefix", "only applies with model.init-from"]),
])
def test_weights_that_do_not_fit_are_refused_naming_what_and_where_before_anything_is_written(hearth, folder, init, says):
    hf_gpt2.model(0, n_embd=48).save_pretrained(folder / "wide")
    extra = load_file(folder / "pretrained" / "model.safetensors")
    extra["transformer.extra"] = torch.zeros(3)
    save_file(extra, folder / "extra.safetensors", metadata={"format": "pt"})
    (folder / "sharded" / "pytorch_model_fsdp_0").mkdir(parents=True)
    run = hearth("run", write_config(folder, job(init)), "--output-dir", folder / "out")
    assert run.returncode == 2, run.stderr
    for part in says:
        assert part in run.stderr, (part, run.stderr)
    assert not (folder / "out").exists(), sorted(p.name for p in (folder / "out").rglob("*"))


def test_without_strict_what_fits_is_loaded_and_the_rest_named(hearth, folder):
    extra = load_file(folder / "pretrained" / "model.safetensors")
    del extra["transformer.wpe.weight"]
    extra["transformer.extra"] = torch.zeros(3)
    save_file(extra, folder / "partial.safetensors", metadata={"format": "pt"})
    init = 'init-from = "partial.safetensors"\ninit-key-prefix = "m."\ninit-strict = false'
    run = hearth("run", write_config(folder, job(init)), "--steps", 0, "--output-dir", folder / "out")
    assert run.returncode == 0, run.stderr
    assert "1 parameters keep their initial values (m.transformer.wpe.weight)" in run.stderr, run.stderr
    assert "1 tensors of the weights are not loaded (transformer.extra)" in run.stderr, run.stderr
    written = load_file(folder / "out" / "tuned" / "model.safetensors")
    assert torch.equal(written["transformer.wte.weight"], extra["transformer.wte.weight"])
    assert torch.equal(written["transformer.wpe.weight"], hf_gpt2.model(1).transformer.wpe.weight.detach())


def test_full_shard_trains_the_torchscript_gpt2_to_ddps_weights(hearth_bin, folder):
    """The same 4 steps from the same pretrained weights on 2 processes,
    DDP against FULL_SHARD: the same weights, bit for bit. Tolerance zero,
    and why it holds: the TorchScript model is one unit, so both run the
    same graph on the same whole weights; a reduce-scatter over 2 ranks
    adds the same two numbers an all-reduce adds; AdamW's update is
    elementwise, so stepping shards or the whole gives the same values."""
    weights = {}
    for name, extra in (("ddp", ""), ("full-shard", FULL_SHARD)):
        config = write_config(folder, job(INIT, extra=extra), f"{name}.toml")
        run = mpirun(hearth_bin, 2, "run", config, "--output-dir", folder / name, cwd=folder, timeout=300)
        assert run.returncode == 0, run.stderr
        weights[name] = load_file(folder / name / "tuned" / "model.safetensors")
    assert weights["ddp"].keys() == weights["full-shard"].keys()
    for key, value in weights["ddp"].items():
        assert torch.equal(value, weights["full-shard"][key]), key
