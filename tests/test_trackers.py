"""The built-in tracker plugins, read back by the readers of the tools they
imitate: TensorBoard's EventAccumulator, MlflowClient, DVCLive itself
(writing the same values), wandb's own reader of `.wandb` files beside a
wandb run of the same values — plus jsonl/csv with the standard library."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import LOGGED_STEPS, SHORT_JOB, run_hearth, tracker_tables, write_config

TRACKERS = ["jsonl", "csv", "tensorboard", "mlflow", "dvclive", "wandb"]


@pytest.fixture(scope="module")
def run_dir(hearth_bin, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trackers")
    config = write_config(folder, SHORT_JOB + tracker_tables(*TRACKERS))
    out = run_hearth(hearth_bin, "run", config, cwd=folder)
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stderr, out.stderr
    return folder / "runs" / "short"


@pytest.fixture(scope="module")
def logged(run_dir):
    """What the run logged, from the jsonl tracker: {step: {name: value}}."""
    lines = (run_dir / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines()
    steps = {}
    for line in map(json.loads, lines):
        steps.setdefault(line.pop("step"), {}).update(line)
    return steps


def test_jsonl_and_csv_see_every_step(run_dir, logged):
    assert sorted(logged) == LOGGED_STEPS
    for step in LOGGED_STEPS:
        assert {"loss", "lr", "tokens_per_sec"} <= set(logged[step])
    assert "eval/accuracy" in logged[40] and "eval/summary" in logged[40]
    config = json.loads((run_dir / "trackers" / "jsonl" / "config.json").read_text())
    assert config["project"] == "trackers-test" and config["run"] == "short"
    assert config["config"]["optimizer.lr"] == 0.002 and config["config"]["model.kind"] == "gpt"

    with open(run_dir / "trackers" / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "loss"}
    assert losses == {s: logged[s]["loss"] for s in LOGGED_STEPS}
    summary = next(r["value"] for r in rows if r["name"] == "eval/summary")
    assert summary.startswith("eval exact-match accuracy:")


def test_tensorboard_reads_scalars_text_and_hparams(run_dir, logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run_dir / "trackers" / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("loss")
    assert [e.step for e in scalars] == LOGGED_STEPS
    for e in scalars:
        assert e.value == pytest.approx(logged[e.step]["loss"], rel=1e-6)
    assert acc.Scalars("eval/accuracy")[0].value == pytest.approx(logged[40]["eval/accuracy"])

    (text,) = acc.Tensors("eval/summary")
    assert text.step == 40
    assert tensor_util.make_ndarray(text.tensor_proto)[0].decode() == logged[40]["eval/summary"]

    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["optimizer.lr"].number_value == pytest.approx(0.002)
    assert start.hparams["model.kind"].string_value == "gpt"
    assert start.hparams["run.steps"].number_value == 40
    assert start.group_name == "short"
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert {"optimizer.lr", "model.kind"} <= {h.name for h in experiment.hparam_infos}
    assert {"loss", "eval/accuracy"} <= {m.name.tag for m in experiment.metric_infos}
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    assert end.status == api_pb2.STATUS_SUCCESS


def test_mlflow_client_reads_metrics_and_the_run_is_finished(run_dir, logged, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{run_dir / 'trackers' / 'mlflow'}")
    experiment = client.get_experiment_by_name("trackers-test")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "short"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == LOGGED_STEPS
    assert [m.value for m in history] == [logged[s]["loss"] for s in LOGGED_STEPS]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [40]
    assert run.data.params["optimizer.lr"] == "0.002"
    assert run.data.params["model.kind"] == "gpt"
    assert run.data.tags["eval/summary"] == logged[40]["eval/summary"]


def test_dvclive_files_equal_what_dvclive_writes(run_dir, logged, tmp_path, monkeypatch):
    """DVCLive itself, fed the same values the way Accelerate's DVCLiveTracker
    feeds it, is the oracle for the three files."""
    from dvclive import Live

    config = json.loads((run_dir / "trackers" / "jsonl" / "config.json").read_text())["config"]
    params = {}
    for key, value in config.items():
        node = params
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    monkeypatch.chdir(tmp_path)
    with Live(dir=str(tmp_path / "ref"), save_dvc_exp=False, dvcyaml=None) as live:
        live.log_params(params)
        for step in sorted(logged):
            live.step = step
            for name, value in logged[step].items():
                if isinstance(value, (int, float)):
                    live.log_metric(name, value)
            live.next_step()

    ours, ref = run_dir / "trackers" / "dvclive", tmp_path / "ref"
    assert yaml.safe_load((ours / "params.yaml").read_text()) == yaml.safe_load((ref / "params.yaml").read_text())
    assert json.loads((ours / "metrics.json").read_text()) == json.loads((ref / "metrics.json").read_text())
    ref_plots = sorted(p.relative_to(ref) for p in (ref / "plots").rglob("*.tsv"))
    assert sorted(p.relative_to(ours) for p in (ours / "plots").rglob("*.tsv")) == ref_plots
    for rel in ref_plots:
        with open(ours / rel) as a, open(ref / rel) as b:
            ra, rb = list(csv.reader(a, delimiter="\t")), list(csv.reader(b, delimiter="\t"))
        assert ra[0] == rb[0]
        assert [(int(s), float(v)) for s, v in ra[1:]] == [(int(s), float(v)) for s, v in rb[1:]]


def wandb_inspect(run_folder: Path, *flags: str):
    """wandb's reader of a run's `.wandb` file (`wandb leet inspect`, which
    checks every record's checksum): its records, or with `--summary` the
    run's state."""
    wandb = Path(sys.executable).parent / "wandb"
    out = subprocess.run([wandb, "leet", "inspect", str(run_folder), "--json", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if flags:
        return json.loads(out.stdout)
    return [json.loads(line) for line in out.stdout.splitlines()]


def without_clock(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("_runtime", "_timestamp") and not k.startswith("_wandb")}


def test_wandb_reads_every_record_and_they_equal_what_wandb_writes(run_dir, logged, tmp_path, monkeypatch):
    """wandb itself, fed the same values through Accelerate's WandBTracker in
    offline mode, is the oracle: the same config, the same history rows
    (the values logged at one step merged into one row) and the same
    summary, each read back by wandb's reader."""
    from accelerate import PartialState
    from accelerate.tracking import WandBTracker

    (ours,) = (run_dir / "trackers" / "wandb").glob("offline-run-*")
    records = wandb_inspect(ours)
    assert [r["type"] for r in records[:2]] == ["header", "run"]
    assert [r["num"] for r in records] == list(range(1, len(records) + 1))
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == LOGGED_STEPS
    assert {h["step"]["num"]: without_clock(h["item"]) for h in history} == {s: {**v, "_step": s} for s, v in logged.items()}
    assert records[-1]["type"] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0

    config = json.loads((run_dir / "trackers" / "jsonl" / "config.json").read_text())["config"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    PartialState()
    tracker = WandBTracker("trackers-test", name="short", dir=str(tmp_path))
    tracker.start()
    tracker.store_init_configuration(config)
    for step in sorted(logged):
        tracker.log(logged[step], step=step)
    tracker.finish()
    (ref,) = (tmp_path / "wandb").glob("offline-run-*")
    ref_history = [r["history"] for r in wandb_inspect(ref) if r["type"] == "history"]
    assert [without_clock(h["item"]) for h in history] == [without_clock(h["item"]) for h in ref_history]

    mine, theirs = wandb_inspect(ours, "--summary"), wandb_inspect(ref, "--summary")
    for key in ("project", "name", "state", "step", "exit_code"):
        assert mine[key] == theirs[key], key
    assert mine["state"] == "finished"
    assert without_clock(mine["config"]) == without_clock(theirs["config"])
    assert without_clock(mine["summary"]) == without_clock(theirs["summary"])
