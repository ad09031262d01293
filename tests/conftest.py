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


@pytest.fixture
def hearth(hearth_bin, tmp_path):
    """Runs hearth with the given arguments in `tmp_path`, without
    LD_LIBRARY_PATH (the binary must find libtorch through its rpath)."""

    def run(*args, cwd=None, timeout=600):
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        env.setdefault("HEARTH_LOG", "info")
        return subprocess.run(
            [str(hearth_bin), *map(str, args)],
            cwd=cwd or tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def write_config(folder: pathlib.Path, text: str, name: str = "job.toml") -> pathlib.Path:
    path = folder / name
    path.write_text(text)
    return path
