"""Shared helpers for the end-to-end tests: they run the `hearth` binary the
way a user does (built by `make test`) and read its output with Python
readers."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hearth_bin() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make test` (it builds the binary first)")
    return path


def run_hearth(binary, *args, cwd, timeout=600, env=None):
    """Runs hearth with the given arguments in `cwd`, without
    LD_LIBRARY_PATH (the binary must find libtorch through its rpath)."""
    environ = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    environ.setdefault("HEARTH_LOG", "info")
    environ.update(env or {})
    return subprocess.run(
        [str(binary), *map(str, args)],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def hearth(hearth_bin, tmp_path):
    """Runs hearth with the given arguments in `tmp_path`."""

    def run(*args, cwd=None, timeout=600, env=None):
        return run_hearth(hearth_bin, *args, cwd=cwd or tmp_path, timeout=timeout, env=env)

    return run


def mpirun(hearth_bin, n, *args, cwd, machines=1):
    """`hearth` on `n` processes, spread over `machines` pretend machines
    (each process told its machine's name by HEARTH_NODE_NAME)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = ["mpirun", "--oversubscribe"]
    for m in range(machines):
        if m:
            command.append(":")
        command += ["-n", str(n // machines), "-x", f"HEARTH_NODE_NAME=machine-{m}", str(hearth_bin), *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def write_config(folder: pathlib.Path, text: str, name: str = "job.toml") -> pathlib.Path:
    path = folder / name
    path.write_text(text)
    return path


# A short GPT job for the plugin tests: logs at steps 10, 20, 30 and 40.
SHORT_JOB = """
[run]
name = "short"
project = "trackers-test"
steps = 40
seed = 3
log-every = 10

[model]
kind = "gpt"
d-model = 32
layers = 1
heads = 2

[data]
kind = "sort-digits"
digits = 4
batch-size = 16

[optimizer]
kind = "adamw"
lr = 2e-3

[eval]
samples = 20
"""
LOGGED_STEPS = [10, 20, 30, 40]


def tracker_tables(*names: str) -> str:
    return "".join(f'\n[[trackers]]\nname = "{n}"\n' for n in names)


FIXTURE_BUILD = ROOT / "target" / "test-plugins-build" / "wasm32-wasip2" / "release"


@pytest.fixture(scope="session")
def fixture_wasm():
    """Builds the hostile/malformed plugin fixtures in tests/plugins (cargo
    is incremental: quick when nothing changed) and returns a function that
    maps a fixture crate name to its .wasm."""
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT / "tests" / "plugins", check=True)
    return lambda name: FIXTURE_BUILD / f"fixture_{name.replace('-', '_')}.wasm"


def make_plugin(parent: pathlib.Path, name: str, wasm: pathlib.Path, kind="tracker", limits="") -> pathlib.Path:
    """A plugin folder `parent/name` holding `wasm` and its plugin.toml."""
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.wasm").write_bytes(wasm.read_bytes())
    (folder / "plugin.toml").write_text(
        f'name = "{name}"\nversion = "0.1.0"\nkind = "{kind}"\n'
        f'world = "hearth:plugin/{kind}-plugin@0.2.0"\ncomponent = "{name}.wasm"\n{limits}'
    )
    return folder
