"""The import graph of hearth's Rust crates, at two levels, and what runs
back up in it.

- **Modules**: for each crate under `host/` (and `fuzz/entry`), an arrow
  from each top-level module to every other top-level module its code names
  through `crate::` (comments left out: a doc link is not an import). A
  cycle among them is an arrow running back up.
- **Files**: an arrow from each source file to each file it names through a
  `crate::`, `super::` or `self::` path (the longest path that is a
  module's file). A cycle of files that are not all in one folder is a
  "file circle outside one folder".

`python3 tests/tools/import_graph.py [--edges]` prints every crate's module
arrows (with `--edges`) and the cycles found; it exits 1 when there is one.
`tests/test_layers.py` runs it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRATES = sorted(p.parent.parent for p in ROOT.glob("host/*/src/lib.rs")) + sorted(
    p.parent.parent for p in ROOT.glob("host/*/src/main.rs")
)
COMMENT = re.compile(r"//[^\n]*")
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
GROUP = re.compile(r"\b(crate|super|self)::((?:[a-z_][a-z0-9_]*::)*)\{([^}]*)\}")


def module_files(src: Path) -> dict[tuple[str, ...], Path]:
    """Every module path of a crate (`("parallel", "ddp")`) and its file."""
    files = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("").parts
        if rel[-1] in ("lib", "main") and len(rel) == 1:
            rel = ()
        elif rel[-1] == "mod":
            rel = rel[:-1]
        files[rel] = f
    return files


def resolve(start: tuple[str, ...], segments: list[str], files) -> tuple[str, ...] | None:
    """The longest prefix of `start + segments` that is a module with a file."""
    path = list(start)
    best = None
    for s in segments:
        path.append(s)
        if tuple(path) in files:
            best = tuple(path)
        else:
            break
    return best


def references(text: str, here: tuple[str, ...]):
    """(base module, segments) for every crate/super/self path in `text`."""
    text = COMMENT.sub("", text)
    # Modules written inline (`mod tracker { ... }`) are this file's own.
    inline = set(re.findall(r"\bmod\s+([a-z_][a-z0-9_]*)\s*\{", text))
    # `super` is the parent of this module; a mod.rs module is its folder.
    parent = here[:-1]
    bases = {"crate": (), "self": here, "super": parent}
    for kind, prefix, names in GROUP.findall(text):
        head = [s for s in prefix.split("::") if s]
        for name in re.findall(r"\b([a-z_][a-z0-9_]*)\b", names):
            segs = head + [name]
            if segs[0] not in inline:
                yield bases[kind], segs
    for kind, rest in PATH.findall(text):
        segs = [s for s in rest.split("::") if s]
        if segs and segs[0] not in inline:
            yield bases[kind], segs


def graphs(crate: Path):
    src = crate / "src"
    files = module_files(src)
    modules = {m[0] for m in files if m}
    top = {}
    by_file = {}
    for mod, f in files.items():
        text = f.read_text()
        targets = set()
        for base, segs in references(text, mod):
            hit = resolve(base, segs, files)
            if hit is not None and hit != mod and hit != ():
                targets.add(hit)
        by_file[mod] = targets
        if mod:
            top.setdefault(mod[0], set()).update(t[0] for t in targets if t[0] != mod[0])
    for m in modules:
        top.setdefault(m, set())
    return top, by_file


def cycles(edges: dict) -> list[list]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, count = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def report(show_edges: bool) -> list[str]:
    problems = []
    for crate in CRATES + [ROOT / "fuzz" / "entry"]:
        name = crate.relative_to(ROOT)
        top, by_file = graphs(crate)
        if show_edges:
            print(f"== {name}")
            for m in sorted(top):
                print(f"  {m} -> {' '.join(sorted(top[m])) or '(nothing)'}")
        for c in cycles(top):
            # Top-level modules that are all single files form a circle in
            # one folder (src/), which the file check below allows.
            if not any((crate / "src" / m).is_dir() for m in c):
                continue
            problems.append(f"{name}: modules in a cycle: {' <-> '.join(c)}")
        for c in cycles(by_file):
            # The folder each file is in (a mod.rs module is its folder's).
            owners = {m if (crate / "src" / Path(*m) / "mod.rs").exists() else m[:-1] for m in c}
            if len(owners) > 1:
                files = ", ".join("::".join(m) for m in c)
                problems.append(f"{name}: files in a circle across folders: {files}")
    return problems


if __name__ == "__main__":
    problems = report("--edges" in sys.argv)
    for p in problems:
        print(p)
    print(f"{len(problems)} cycle(s)")
    sys.exit(1 if problems else 0)
