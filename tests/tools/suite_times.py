"""The table `make test` ends with: each part's time (from
tests/tools/timed.sh's parts.tsv), each Rust test binary's (from the
`Running ...` / `finished in` lines of the cargo parts' logs) and the
slowest pytest files (from pytest's JUnit XML).

  python3 tests/tools/suite_times.py [TIMES_DIR]     # default target/test-times
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

RUNNING = re.compile(r"^\s+Running (?:unittests )?(\S+)(?: \((\S+)\))?")
DOCTESTS = re.compile(r"^\s+Doc-tests (\S+)")
FINISHED = re.compile(r"^test result: .* finished in ([0-9.]+)s")
# pytest files shown one by one; the rest are summed on one line.
SHOWN_FILES = 12


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def parts(folder: Path) -> list[tuple[str, float, str]]:
    rows = []
    tsv = folder / "parts.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, seconds, status = line.split("\t")
        rows.append((name, float(seconds), status))
    return rows


def binary_times(log: Path) -> list[tuple[str, float]]:
    """Each test binary a cargo log ran, with its own time."""
    rows, current = [], None
    for line in log.read_text(errors="replace").splitlines():
        if m := RUNNING.match(line):
            # target/debug/deps/<binary>-<hash>: the crate of a unit-test
            # binary, the test's name of an integration test.
            binary = Path(m.group(2) or "").name.rsplit("-", 1)[0]
            current = f"{binary}: {m.group(1)}" if binary else m.group(1)
        elif m := DOCTESTS.match(line):
            current = f"doc-tests {m.group(1)}"
        elif (m := FINISHED.match(line)) and current:
            rows.append((current, float(m.group(1))))
            current = None
    return rows


def pytest_files(xml: Path) -> list[tuple[str, float]]:
    """Seconds per pytest file, slowest first."""
    per_file: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml).iter("testcase"):
        module = case.get("classname", "?").split(".")
        # classname is tests.test_x or tests.test_x.TestClass.
        name = next((m for m in module if m.startswith("test_")), module[-1])
        per_file[f"{name}.py"] += float(case.get("time", 0))
    return sorted(per_file.items(), key=lambda kv: -kv[1])


def table(folder: Path) -> str:
    lines = ["", "make test, part by part (min:s):", ""]
    rows = parts(folder)
    binaries = {name: [(b, t) for b, t in binary_times(folder / f"{name}.log") if t >= 1.0]
                for name, _, _ in rows if (folder / f"{name}.log").exists()}
    width = max([len(n) for n, _, _ in rows] + [len(b) + 2 for bs in binaries.values() for b, _ in bs] + [30])
    for name, seconds, status in rows:
        mark = "" if status == "0" else f"   (exit {status})"
        lines.append(f"  {name:<{width}} {minutes(seconds):>8}{mark}")
        for binary, took in binaries.get(name, []):
            lines.append(f"    {binary:<{width - 2}} {minutes(took):>8}")
    xml = folder / "pytest.xml"
    if xml.exists():
        files = pytest_files(xml)
        lines.append("  pytest files, slowest first:")
        for name, took in files[:SHOWN_FILES]:
            lines.append(f"    {name:<{width - 2}} {minutes(took):>8}")
        rest = files[SHOWN_FILES:]
        if rest:
            label = f"the other {len(rest)} files"
            lines.append(f"    {label:<{width - 2}} {minutes(sum(t for _, t in rest)):>8}")
    total = sum(s for _, s, _ in rows)
    lines += ["", f"  {'total':<{width}} {minutes(total):>8}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "target/test-times")))
