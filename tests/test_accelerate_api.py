"""The book's "Accelerate's API, item by item" table (docs/src/accelerate.md)
is complete and true: every field of Accelerate's kwargs handlers and
GradientAccumulationPlugin and every public method of `Accelerator` — listed
from the installed Accelerate itself — has a row; a `yes` row (or a
`refused:` one, whose hearth items exist but refuse to be used) names hearth
items that exist in the library's source under host/ (`Type::member`: a
public type of that name and a public field or function `member`), and
names in its "tested by" column the test that shows the behaviour: a test
of `make test` (a Rust `#[test]` outside the GPU suite, or a pytest test)
whose file uses one of the row's hearth items. That test's oracle — most
often Accelerate or PyTorch run live — is what keeps the row true; this
file keeps the row tied to it."""
import dataclasses
import inspect
import re

import accelerate.utils
from accelerate import Accelerator

from conftest import ROOT

PAGE = ROOT / "docs" / "src" / "accelerate.md"
HANDLERS = ["AutocastKwargs", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
            "FP8RecipeKwargs", "ProfileKwargs", "GradientAccumulationPlugin"]


def table() -> dict[str, tuple[str, str]]:
    text = PAGE.read_text()
    section = text.split("# Accelerate's API, item by item", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([A-Za-z0-9_.]+)` \| (.*) \| (.*) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def accelerate_items() -> list[str]:
    items = [f"{h}.{f.name}" for h in HANDLERS for f in dataclasses.fields(getattr(accelerate.utils, h))]
    items += [f"Accelerator.{n}" for n in dir(Accelerator)
              if not n.startswith("_") and inspect.isfunction(getattr(Accelerator, n))]
    return items


def source() -> str:
    """The library's Rust source: host/src, and the src/ of any crate under
    host/ (so the check holds when host/ is split into crates)."""
    return "\n".join(p.read_text() for p in sorted((ROOT / "host").glob("**/src/**/*.rs")))


def test_every_accelerate_item_has_a_row():
    rows = table()
    missing = [item for item in accelerate_items() if item not in rows]
    assert not missing, f"add these to the table in {PAGE.relative_to(ROOT)}: {missing}"
    for item, (_, status, _) in rows.items():
        assert status == "yes" or status.startswith("not yet") or re.match(r"(not applicable|refused): \S", status), \
            f"{item}: status must be yes, not yet, 'refused: how' or 'not applicable: why', not {status!r}"


def test_every_yes_names_items_that_exist():
    src = source()
    for item, (hearth, status, _) in table().items():
        if status == "yes":
            names = re.findall(r"`([A-Z][A-Za-z0-9]*)::([a-z_0-9]+)`", hearth)
        elif status.startswith("refused:"):
            # What is refused, and what refuses it, both exist.
            names = re.findall(r"`([A-Z][A-Za-z0-9]*)::([a-z_0-9]+)`", hearth + " " + status)
        else:
            continue
        assert names, f"{item}: a {status.split(':')[0]} row names hearth's Type::member"
        for ty, member in names:
            assert re.search(rf"pub (struct|enum|trait) {ty}\b", src), f"{item}: no public type {ty} in the library's source"
            assert re.search(rf"pub (fn {member}\b|{member}:)", src), f"{item}: no public fn or field {member} in the library's source"


def make_test_functions() -> dict[str, str]:
    """Each test `make test` runs, by name, with the text of its file: Rust
    `#[test]` functions under host/ (not the GPU suite, host/hearth/tests/cuda/)
    and pytest's `test_` functions under tests/."""
    found = {}
    gpu_suite = ROOT / "host" / "hearth" / "tests" / "cuda"
    for path in sorted((ROOT / "host").glob("**/*.rs")):
        if "target" in path.parts or path.is_relative_to(gpu_suite):
            continue
        text = path.read_text()
        for name in re.findall(r"#\[test\]\s*(?:#\[[^\]]*\]\s*)*fn ([a-z0-9_]+)", text):
            found[name] = text
    for path in sorted(ROOT.glob("tests/**/test_*.py")):
        text = path.read_text()
        for name in re.findall(r"^def (test_[a-z0-9_]+)", text, re.M):
            found[name] = text
    return found


def uses(text: str, hearth: str) -> bool:
    """Whether source `text` uses one of the hearth items a row names: a
    call or field of `Type::member`, or a config key of `[table] key`."""
    members = [m for _, m in re.findall(r"`([A-Z][A-Za-z0-9]*)::([a-z_0-9]+)`", hearth)]
    keys = re.findall(r"`\[[a-z.-]+\] ([a-z0-9-]+)`", hearth)
    return any(re.search(rf"(\.{m}\b|\b{m}\s*[:(=])", text) for m in members) or \
        any(re.search(rf"(?<![a-z-]){re.escape(k)}(?![a-z-])", text) for k in keys)


def test_every_yes_names_a_test_that_exercises_it():
    tests = make_test_functions()
    for item, (hearth, status, tested_by) in table().items():
        names = re.findall(r"`([a-z0-9_]+)`", tested_by)
        if status.startswith("not applicable") or status.startswith("not yet"):
            assert not names, f"{item}: a {status.split(':')[0]} row names no test"
            continue
        assert names, f"{item}: name the test that shows it in the 'tested by' column of {PAGE.name}"
        for name in names:
            assert name in tests, f"{item}: no test named {name} in make test (Rust #[test] under host/ or pytest under tests/)"
        refused = status if status.startswith("refused:") else ""
        assert any(uses(tests[name], hearth + " " + refused) for name in names), \
            f"{item}: none of {names} uses {hearth!r}"
