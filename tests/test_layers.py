"""The layers hold: each workspace crate depends only on crates of a lower
layer (so an import running back up does not compile, and cargo refuses a
cycle outright), the architecture page names every crate, and no module
cycle or cross-folder file circle is in any crate's import graph
(tests/tools/import_graph.py)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lower numbers are lower layers; a crate may depend on lower ones only.
LAYER = {
    # Build scripts' helper: below everything, depending on nothing.
    "hearth-build": -1,
    "hearth-ops": 0,
    "hearth-comm": 1,
    "hearth-plugins": 1,
    "hearth": 2,
    "hearth-cli": 3,
    # Tools above the library, never below it.
    "hearth-testkit": 3,
    "hearth-bench": 3,
    "hearth-fuzz-entry": 3,
}
# Only this crate may depend on wasmtime (DESIGN: plugins alone knows it).
WASMTIME_ONLY = "hearth-plugins"


def metadata():
    out = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_every_crate_depends_only_on_lower_layers():
    packages = metadata()["packages"]
    names = {p["name"] for p in packages}
    assert names == set(LAYER), f"crates changed: {sorted(names ^ set(LAYER))}; place them in LAYER"
    upward = []
    for p in packages:
        for d in p["dependencies"]:
            if d["name"] in names and d["kind"] is None and LAYER[d["name"]] >= LAYER[p["name"]]:
                upward.append(f"{p['name']} -> {d['name']}")
    assert not upward, f"dependencies that do not point down: {upward}"


def test_only_the_plugin_crate_links_wasmtime():
    for p in metadata()["packages"]:
        wasm = [d["name"] for d in p["dependencies"] if d["name"].startswith("wasmtime") and d["kind"] is None]
        assert not wasm or p["name"] == WASMTIME_ONLY, f"{p['name']} depends on {wasm}"


def test_the_architecture_page_names_every_crate():
    page = (ROOT / "docs" / "src" / "architecture.md").read_text()
    missing = [name for name in LAYER if f"`{name}`" not in page]
    assert not missing, f"docs/src/architecture.md does not describe {missing}"


def test_no_module_cycle_or_cross_folder_file_circle():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "tools" / "import_graph.py")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def write_crate(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / rel).write_text(text)
    return root


def test_the_checker_finds_circles_through_re_exports_and_within_a_folder(tmp_path):
    """The checker's own test: y names `crate::m::Thing`, which m/mod.rs
    re-exports from m/x.rs, and x calls y, one folder down. Only following
    the re-export finds the circle; without x's call there is none. Two
    files of one folder that name each other are one as well."""
    sys.path.insert(0, str(ROOT / "tests" / "tools"))
    import import_graph

    files = {
        "lib.rs": "pub mod m;\n",
        "m/mod.rs": "mod sub;\nmod x;\npub use x::Thing;\n",
        "m/x.rs": "pub struct Thing;\npub fn f() {\n    super::sub::y::g();\n}\n",
        "m/sub/mod.rs": "pub mod y;\n",
        "m/sub/y.rs": "/// Not an import: crate::m::sub::y.\npub fn g() {\n    let _ = crate::m::Thing;\n}\n",
    }
    circle = write_crate(tmp_path / "circle" / "made-up", files)
    found = import_graph.report(False, [circle])
    assert found == ["circle/made-up: files in a circle across folders: m::sub::y, m::x"], found
    files["m/x.rs"] = "pub struct Thing;\n"
    none = write_crate(tmp_path / "none" / "made-up", files)
    assert import_graph.report(False, [none]) == []
    # Two files of one folder naming each other are a circle too.
    files["m/x.rs"] = "pub struct Thing;\npub fn f() {\n    super::w::h();\n}\n"
    files["m/w.rs"] = "pub fn h() {\n    let _ = super::x::Thing;\n}\n"
    files["m/mod.rs"] = "mod sub;\nmod w;\nmod x;\npub use x::Thing;\n"
    within = write_crate(tmp_path / "within" / "made-up", files)
    found = import_graph.report(False, [within])
    assert found == ["within/made-up: files in a circle within one folder: m::w, m::x"], found


LIBRARY_CRATES = ["hearth-build", "hearth-ops", "hearth-comm", "hearth-plugins", "hearth"]


def test_the_library_crates_package_with_everything_their_builds_read(tmp_path):
    """`cargo package` accepts the library crates (every path dependency
    has a version; no build script or bindgen reads outside its crate), and
    hearth-plugins carries the WIT its `wit` link points at. Not verified by
    a build from the packages: that compiles every dependency again."""
    crates = [arg for name in LIBRARY_CRATES for arg in ("-p", name)]
    out = subprocess.run(
        ["cargo", "package", "--no-verify", "--allow-dirty", "--quiet", "--target-dir", str(tmp_path), *crates],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    listed = subprocess.run(
        ["tar", "tzf", str(tmp_path / "package" / "hearth-plugins-0.1.0.crate")],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert "hearth-plugins-0.1.0/wit/plugin.wit" in listed, listed


def features(cwd: Path) -> dict:
    """Each registry package a `cargo build` in `cwd` compiles, with the
    feature sets it is built with (`cargo tree`, normal and build edges)."""
    out = subprocess.run(
        ["cargo", "tree", "--offline", "-e", "normal,build", "--prefix", "none", "--no-dedupe", "-f", "{p} [{f}]"],
        cwd=cwd, capture_output=True, text=True, check=True)
    found = {}
    for line in out.stdout.splitlines():
        head, _, feats = line.strip().partition(" [")
        if head and "(" not in head:  # path crates (hearth's own) carry "(/path)"
            found.setdefault(head, set()).add(feats.rstrip("]"))
    return found


def test_a_program_on_hearth_resolves_the_dependency_builds_of_the_workspace():
    """examples/library, a crate outside the workspace that depends on
    hearth, gets every shared dependency with the workspace's features, so
    its build (and test_library_crate's) reuses what `cargo build` compiled.
    host/hearth/Cargo.toml turns on what the CLI adds; when this fails, add
    the features it names there."""
    example = ROOT / "examples" / "library"
    # The workspace's versions (its lock, git-ignored there, as a user's
    # first build would pick them today).
    shutil.copy(ROOT / "Cargo.lock", example / "Cargo.lock")
    workspace, program = features(ROOT), features(example)
    differ = {name: (sorted(program[name]), sorted(workspace[name]))
              for name in program if name in workspace and program[name] != workspace[name]}
    assert not differ, f"(the program's features, the workspace's): {differ}"
