"""A plugin author's way, as a new author takes it, from an empty folder
outside the repository: `hearth plugins new tracker`, `build`, `install`,
and a training run that uses the plugin — in Rust (with the SDK as
`cargo package` packs it, no hearth checkout beside it) and in Python
(componentize-py). Then `pack` (reproducible, its sha256 what hashlib
says) and `install` from the archive. The oracle of what the new tracker
wrote is the built-in jsonl tracker's metrics.jsonl from the same run."""
import hashlib
import json
import math
import tomllib
import os
import shutil
import subprocess
import tarfile

import pytest

from conftest import ROOT, limit, run_command, run_hearth, tiny_job, write_config

# Builds reuse what the built-in plugins compiled (wit-bindgen and the rest):
# their target folder, and (see `pin_like_the_built_ins`) their versions.
CARGO_TARGET = ROOT / "target" / "plugins-build"


def pin_like_the_built_ins(project):
    """Starts the project's Cargo.lock from the built-ins' (cargo drops
    what it does not use): the same dependency versions, so `make test`
    compiles wit-bindgen and the rest once for all, not once more per
    project. A user's project resolves its own; nothing else differs."""
    shutil.copy(ROOT / "plugins" / "Cargo.lock", project / "Cargo.lock")


def author_env(tmp_path):
    """A user's environment: plugins installed under tmp_path/data, the
    venv's componentize-py on PATH, no plugin path of hearth's tests."""
    env = {k: v for k, v in os.environ.items() if k not in ("HEARTH_PLUGIN_PATH", "LD_LIBRARY_PATH")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    env["CARGO_TARGET_DIR"] = str(CARGO_TARGET)
    return env


def hearth(hearth_bin, *args, cwd, env):
    out = run_hearth(hearth_bin, *args, cwd=cwd, env=env, timeout=max(limit(), 900))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def packaged_sdk(tmp_path):
    """guest-sdk as `cargo package` packs it, unpacked into tmp_path."""
    packed = run_command(
        ["cargo", "package", "--no-verify", "--allow-dirty", "--target-dir", tmp_path / "package-build"],
        cwd=ROOT / "guest-sdk",
    )
    assert packed.returncode == 0, packed.stderr
    (crate,) = (tmp_path / "package-build" / "package").glob("hearth-guest-*.crate")
    with tarfile.open(crate) as t:
        t.extractall(tmp_path / "sdk", filter="data")
    (sdk,) = (tmp_path / "sdk").iterdir()
    assert (sdk / "wit" / "plugin.wit").read_text() == (ROOT / "wit" / "plugin.wit").read_text()
    assert not (sdk / ".cargo").exists()  # the checkout's build settings stay home
    return sdk


def train_with(hearth_bin, folder, env, name):
    """A tiny run logging to the new tracker (every 2nd call) and jsonl."""
    config = write_config(folder, tiny_job(run={"name": "authored"}, trackers=[{"name": name, "every": 2}, {"name": "jsonl"}]))
    hearth(hearth_bin, "run", config, cwd=folder, env=env)
    run = folder / "runs" / "authored"
    lines = lambda p: [json.loads(l) for l in p.read_text().splitlines()]
    got = lines(run / "trackers" / name / "values.jsonl")
    logged = lines(run / "trackers" / "jsonl" / "metrics.jsonl")
    numbers = [{k: v for k, v in row.items() if not isinstance(v, str)} for row in logged]
    assert got == numbers[::2]
    return got


def test_a_rust_tracker_from_new_to_a_training_run(hearth_bin, tmp_path):
    env = author_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    hearth(hearth_bin, "plugins", "new", "tracker", "counter", cwd=work, env=env)
    project = work / "counter"
    pin_like_the_built_ins(project)
    # The copy `new` wrote is the SDK as `cargo package` packs it; build
    # with the packed one, so nothing of the checkout is used.
    sdk = packaged_sdk(tmp_path)
    vendored = project / "vendor" / "hearth-guest"
    for f in vendored.rglob("*"):
        if f.is_file():
            rel = f.relative_to(vendored)
            packed = sdk / ("Cargo.toml.orig" if str(rel) == "Cargo.toml" else rel)
            assert f.read_bytes() == packed.read_bytes(), rel
    shutil.rmtree(vendored)
    cargo = project / "Cargo.toml"
    cargo.write_text(cargo.read_text().replace('path = "vendor/hearth-guest"', f'path = "{sdk}"'))
    # Its own test passes on this machine, then it builds and installs.
    tested = run_command(["cargo", "test", "--quiet"], cwd=project, env=env, timeout=max(limit(), 900))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    hearth(hearth_bin, "plugins", "build", cwd=project, env=env)
    out = hearth(hearth_bin, "plugins", "install", ".", cwd=project, env=env)
    installed = tmp_path / "data" / "hearth" / "plugins" / "counter"
    assert str(installed) in out.stdout
    assert sorted(p.name for p in installed.iterdir()) == ["counter.wasm", "plugin.toml"]
    listed = hearth(hearth_bin, "plugins", "list", cwd=work, env=env)
    assert "(user)" in listed.stdout
    assert train_with(hearth_bin, work, env, "counter")

    # Packed twice, the same bytes; hashlib agrees with the printed sha256;
    # installed from the archive elsewhere, it is the same plugin.
    first = hearth(hearth_bin, "plugins", "pack", ".", "-o", tmp_path / "a.tar.gz", cwd=project, env=env)
    second = hearth(hearth_bin, "plugins", "pack", ".", "-o", tmp_path / "b.tar.gz", cwd=project, env=env)
    sha = first.stdout.split()[0]
    assert sha == second.stdout.split()[0] == hashlib.sha256((tmp_path / "a.tar.gz").read_bytes()).hexdigest()
    hearth(hearth_bin, "plugins", "install", tmp_path / "a.tar.gz", "--to", tmp_path / "team", cwd=work, env=env)
    assert (tmp_path / "team" / "counter" / "counter.wasm").read_bytes() == (installed / "counter.wasm").read_bytes()


def test_a_python_tracker_from_new_to_a_training_run(hearth_bin, tmp_path):
    env = author_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    hearth(hearth_bin, "plugins", "new", "tracker", "pycounter", "--lang", "python", cwd=work, env=env)
    project = work / "pycounter"
    tested = run_command([ROOT / ".venv" / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, env=env)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    hearth(hearth_bin, "plugins", "build", cwd=project, env=env)
    hearth(hearth_bin, "plugins", "install", ".", cwd=project, env=env)
    assert train_with(hearth_bin, work, env, "pycounter")


def test_new_and_install_refuse_bad_input_naming_it_and_wit_prints_the_contract(hearth_bin, tmp_path):
    bad = run_hearth(hearth_bin, "plugins", "new", "tracker", "no spaces", cwd=tmp_path)
    assert bad.returncode != 0 and "ASCII letters" in bad.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    used = run_hearth(hearth_bin, "plugins", "new", "tracker", "taken", cwd=tmp_path)
    assert used.returncode != 0 and "is not empty" in used.stderr
    assert not (tmp_path / "taken" / "plugin.toml").exists()
    # install: an archive that is none, a project not yet built, and a kind
    # the Python route does not write, each refused naming what to do.
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not an archive")
    out = run_hearth(hearth_bin, "plugins", "install", junk, "--to", tmp_path / "to", cwd=tmp_path)
    assert out.returncode != 0 and f"{junk} is not a plugin archive" in out.stderr, out.stderr
    new = run_hearth(hearth_bin, "plugins", "new", "tracker", "unbuilt", "--dir", tmp_path / "unbuilt", cwd=tmp_path)
    assert new.returncode == 0, new.stderr
    out = run_hearth(hearth_bin, "plugins", "install", tmp_path / "unbuilt", "--to", tmp_path / "to", cwd=tmp_path)
    assert out.returncode != 0 and "run `hearth plugins build" in out.stderr, out.stderr
    assert not (tmp_path / "to").exists()
    out = run_hearth(hearth_bin, "plugins", "new", "scheduler", "s", "--lang", "python", cwd=tmp_path)
    assert out.returncode != 0 and "writes Python trackers" in out.stderr, out.stderr
    wit = run_hearth(hearth_bin, "plugins", "wit", cwd=tmp_path)
    assert wit.stdout == (ROOT / "wit" / "plugin.wit").read_text()


def test_a_scheduler_wrap_policy_and_checkpoint_hook_from_new_to_a_run(hearth_bin, tmp_path):
    """`new` for each other kind: its own test passes, it builds, installs,
    and does its job in a run (the schedule's rates, the policy's units as
    `model plan` reports them, the hook's note in each checkpoint)."""
    env = author_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for kind, name in [("scheduler", "stepper"), ("wrap-policy", "by-class"), ("checkpoint-hook", "note")]:
        hearth(hearth_bin, "plugins", "new", kind, name, cwd=work, env=env)
        pin_like_the_built_ins(work / name)
        tested = run_command(["cargo", "test", "--quiet"], cwd=work / name, env=env, timeout=max(limit(), 900))
        assert tested.returncode == 0, tested.stdout + tested.stderr
        hearth(hearth_bin, "plugins", "build", cwd=work / name, env=env)
        hearth(hearth_bin, "plugins", "install", ".", cwd=work / name, env=env)
    config = write_config(
        work,
        tiny_job(
            run={"name": "kinds", "save-every": 20},
            scheduler={"name": "stepper", "step-size": 10, "gamma": 0.5},
            fsdp={"auto-wrap-policy": "by-class", "policy-options": {"classes": "Block, Linear", "min-params": 1000}},
            **{"checkpoint-hooks": [{"name": "note"}]},
        ),
    )
    plan = hearth(hearth_bin, "model", "plan", config, "--json", cwd=work, env=env)
    units = json.loads(plan.stdout)["units"]
    assert "blocks.0" in units and "" in units  # the Block, and the root as always
    hearth(hearth_bin, "run", config, cwd=work, env=env)
    run = work / "runs" / "kinds"
    lrs = [json.loads(l)["lr"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"lr"' in l]
    base = tomllib.loads(config.read_text())["optimizer"]["lr"]
    assert all(any(math.isclose(lr, base * 0.5**k) for k in range(5)) for lr in lrs), lrs
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]
    notes = sorted((run / "checkpoints").glob("checkpoint_*/note.json"))
    assert [json.loads(n.read_text())["step"] for n in notes] == [20, 40]
