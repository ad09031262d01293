"""A program of your own on the hearth library (examples/library), built as
a user builds it: a crate outside hearth's workspace that depends on
`hearth` by path and calls `hearth_build::link_libtorch()` in its build
script. Its binary, copied to a folder of its own, runs with no
LD_LIBRARY_PATH, no HEARTH_* variable and no plugin folder: libtorch comes
from its rpath, the `cosine` schedule and the `jsonl` tracker it names from
the built-ins embedded in hearth. It learns on 1 and 2 processes (the 2 by
`hearth launch -n 2`), and a run stopped after 2 epochs and resumed ends
with the uninterrupted run's weights, bit for bit."""
import json
import os
import shutil
import tomllib

import pytest
from safetensors.numpy import load_file

from conftest import ROOT, mpi_env, run_command

EXAMPLE = ROOT / "examples" / "library"


def clean_env(tmp) -> dict:
    """This environment without LD_LIBRARY_PATH or any HEARTH_* variable,
    and with an empty user plugin folder."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH" and not k.startswith("HEARTH_")}
    env["XDG_DATA_HOME"] = str(tmp / "empty-data-home")
    return env


def profile_tables(table: dict, prefix: str = "profile") -> list:
    """The workspace's `[profile]` tables as TOML lines."""
    lines, scalars = [], {k: v for k, v in table.items() if not isinstance(v, dict)}
    if scalars:
        lines.append(f"[{prefix}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += profile_tables(value, f'{prefix}."{key}"')
    return lines


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The example built from a copy outside the repository, its binary
    moved to a folder of its own."""
    crate = tmp_path_factory.mktemp("outside") / "my-trainer"
    shutil.copytree(EXAMPLE, crate, ignore=shutil.ignore_patterns("target", "Cargo.lock"))
    manifest = crate / "Cargo.toml"
    text = manifest.read_text().replace('path = "../../host/', f'path = "{ROOT}/host/')
    assert text.count(str(ROOT)) == 2, text
    # The workspace's profile and lock file, so that the build reuses the
    # dependencies `make test` compiled into target/ (what is tested is how
    # the crate links, not how long a first build takes).
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())
    profile = workspace["profile"]
    # hearth's crates are members there and dependencies here, where the
    # `"*"` table would otherwise give them its settings: the members'.
    for member in ["hearth-build", "hearth-ops", "hearth-comm", "hearth-plugins", "hearth"]:
        profile["dev"]["package"][member] = {"debug": profile["dev"]["debug"]}
    manifest.write_text(text + "\n" + "\n".join(profile_tables(profile)) + "\n")
    shutil.copy(ROOT / "Cargo.lock", crate / "Cargo.lock")
    env = clean_env(crate)
    # How a user outside the repository names libtorch (docs/src/rust-api.md).
    env.update(LIBTORCH=str(ROOT / ".venv" / "libtorch"), LIBTORCH_CXX11_ABI="1",
               CARGO_TARGET_DIR=str(ROOT / "target"))
    built = run_command(["cargo", "build", "--quiet"], cwd=crate, env=env, timeout=1800)
    assert built.returncode == 0, built.stderr
    home = tmp_path_factory.mktemp("elsewhere")
    binary = home / "bin" / "my-trainer"
    binary.parent.mkdir()
    shutil.copy(ROOT / "target" / "debug" / "hearth-library-example", binary)
    return binary


def metrics(project) -> list:
    lines = (project / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_the_program_runs_anywhere_learns_and_logs_to_the_built_in_jsonl_tracker(program, tmp_path):
    run = run_command([program, tmp_path / "one"], cwd=tmp_path, env=clean_env(tmp_path), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    logged = metrics(tmp_path / "one")
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    assert logged[-1]["train_loss"] < logged[0]["train_loss"] / 5, logged
    assert logged[-1]["eval.accuracy"] > 0.95 and logged[-1]["eval.samples"] == 500, logged
    config = json.loads((tmp_path / "one" / "trackers" / "jsonl" / "config.json").read_text())
    assert config["config"]["gradient_accumulation_steps"] == 2, config
    assert set(load_file(tmp_path / "one" / "model" / "model.safetensors")) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_stopped_run_resumes_to_the_uninterrupted_runs_weights(program, tmp_path):
    env = clean_env(tmp_path)
    whole = run_command([program, tmp_path / "whole"], cwd=tmp_path, env=env, timeout=600)
    assert whole.returncode == 0, whole.stderr
    first = run_command([program, tmp_path / "parts", "--stop-after", "2"], cwd=tmp_path, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    rest = run_command([program, tmp_path / "parts", "--resume"], cwd=tmp_path, env=env, timeout=600)
    assert rest.returncode == 0, rest.stderr
    assert "resumed from" in rest.stdout and "epoch 3:" in rest.stdout and "epoch 1:" not in rest.stdout, rest.stdout
    assert (tmp_path / "parts" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()
    assert [m["step"] for m in metrics(tmp_path / "parts")] == [1, 2, 3, 4]


def test_on_two_processes_by_hearth_launch_it_learns_and_only_rank_0_tracks(program, hearth_bin, tmp_path):
    env = {**mpi_env(), **clean_env(tmp_path)}
    env = {k: v for k, v in env.items() if not k.startswith("HEARTH_")}
    run = run_command([hearth_bin, "launch", "-n", "2", "--", program, tmp_path / "two"],
                      cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("eval accuracy") == 4, run.stdout  # the main process prints
    # Both ranks wrote to one project folder: four lines mean one tracker.
    logged = metrics(tmp_path / "two")
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    assert logged[-1]["eval.accuracy"] > 0.95 and logged[-1]["eval.samples"] == 500, logged
