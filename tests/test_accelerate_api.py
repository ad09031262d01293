"""The book's "Accelerate's API, item by item" table (docs/src/accelerate.md)
is complete and true: every field of Accelerate's kwargs handlers and
GradientAccumulationPlugin and every public method of `Accelerator` — listed
from the installed Accelerate itself — has a row, and a `yes` row (or a
`refused:` one, whose hearth items exist but refuse to be used) names hearth
items that exist in the library's source under host/ (`Type::member`: a
public type of that name and a public field or function `member`)."""
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
        m = re.match(r"\| `([A-Za-z0-9_.]+)` \| (.*) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
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
    for item, (_, status) in rows.items():
        assert status == "yes" or status.startswith("not yet") or re.match(r"(not applicable|refused): \S", status), \
            f"{item}: status must be yes, not yet, 'refused: how' or 'not applicable: why', not {status!r}"


def test_every_yes_names_items_that_exist():
    src = source()
    for item, (hearth, status) in table().items():
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
