"""The import graph of hearth's Rust crates, at two levels, and what runs
back up in it.

- **Modules**: for each crate under `host/` (and `fuzz/entry`), an arrow
  from each top-level module to every other top-level module its code names
  through `crate::` (comments left out: a doc link is not an import). A
  cycle among them is an arrow running back up.
- **Files**: an arrow from each source file to each file it names through a
  `crate::`, `super::` or `self::` path: the longest path that is a
  module's file, then through that module's `pub use` re-exports (globs
  too) to the file that defines the item. Any cycle of files is a
  "circle", within one folder or across folders.

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


USE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);")
DEFINES = r"\b(?:struct|enum|fn|trait|type|const|static|mod|union|macro_rules!)\s+{name}\b"


def use_items(tree: str) -> list[tuple[list[str], str]]:
    """The (path, name it is known by) of each item of a `use` tree:
    `a::{b, c as d, e::*}` gives (a::b, b), (a::c, d), (a::e::*, *)."""
    tree = " ".join(tree.split())
    if "{" not in tree:
        path, _, alias = tree.partition(" as ")
        segs = [s for s in path.strip().split("::") if s]
        return [(segs, alias.strip() or segs[-1])] if segs else []
    head, _, rest = tree.partition("{")
    inner = rest[: rest.rindex("}")]
    prefix = [s for s in head.strip().split("::") if s]
    items, depth, part = [], 0, ""
    for ch in inner + ",":
        if ch == "," and depth == 0:
            if part.strip():
                items += [(prefix + p, n) for p, n in use_items(part)]
            part = ""
            continue
        depth += (ch == "{") - (ch == "}")
        part += ch
    return items


class Crate:
    """A crate's module files and what each re-exports (`pub use`), so that
    a path through a re-export leads to the file that defines the item."""

    def __init__(self, src: Path):
        self.files = module_files(src)
        self.text = {m: COMMENT.sub("", f.read_text()) for m, f in self.files.items()}
        # module -> name -> (module path, item name) it re-exports; "*" -> globs.
        self.exports: dict[tuple, dict[str, list]] = {}
        for mod, text in self.text.items():
            table = self.exports.setdefault(mod, {})
            for tree in USE.findall(text):
                for segs, name in use_items(tree):
                    base = {"crate": (), "self": mod, "super": mod[:-1]}.get(segs[0])
                    rel = segs[1:] if base is not None else segs
                    while rel and rel[0] == "super" and base:
                        base, rel = base[:-1], rel[1:]
                    if base is None:
                        base = mod  # a child module named bare
                        if not rel or (mod + (rel[0],)) not in self.files:
                            continue  # another crate's item
                    table.setdefault(name, []).append((base, rel))

    def resolve(self, start: tuple, segments: list[str], seen=None) -> tuple | None:
        """The file a path leads to: the longest module prefix of `start +
        segments`, then through its re-exports of the next name."""
        while segments and segments[0] == "super" and start:
            start, segments = start[:-1], segments[1:]
        path, best, rest = list(start), None, []
        for i, s in enumerate(segments):
            path.append(s)
            if tuple(path) in self.files:
                best, rest = tuple(path), segments[i + 1:]
            else:
                break
        if best is None or not rest:
            return best
        seen = seen or set()
        if (best, rest[0]) in seen:
            return best
        seen.add((best, rest[0]))
        if re.search(DEFINES.format(name=re.escape(rest[0])), self.text[best]):
            return best
        table = self.exports.get(best, {})
        # A named re-export leads to the item under its own name (`pub use
        # x::Foo as Bar`: Bar is x::Foo).
        for base, rel in table.get(rest[0], []):
            hit = self.resolve(base, rel + rest[1:], seen)
            if hit is not None:
                return hit
        for base, rel in table.get("*", []):
            hit = self.resolve(base, rel[:-1] + rest, seen)
            if hit is not None and hit != best and (
                re.search(DEFINES.format(name=re.escape(rest[0])), self.text[hit]) or rest[0] in self.exports.get(hit, {})
            ):
                return hit
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
    tree = Crate(src)
    files = tree.files
    modules = {m[0] for m in files if m}
    top = {}
    by_file = {}
    for mod, f in files.items():
        text = f.read_text()
        targets = set()
        for base, segs in references(text, mod):
            hit = tree.resolve(base, segs)
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


def report(show_edges: bool, crates: list[Path] | None = None) -> list[str]:
    """What runs back up in each crate (default: every crate of the
    workspace): module cycles, and circles of files, within one folder or
    across folders."""
    problems = []
    for crate in crates or CRATES + [ROOT / "fuzz" / "entry"]:
        name = crate.relative_to(crate.parent.parent) if crates else crate.relative_to(ROOT)
        top, by_file = graphs(crate)
        if show_edges:
            print(f"== {name}")
            for m in sorted(top):
                print(f"  {m} -> {' '.join(sorted(top[m])) or '(nothing)'}")
        for c in cycles(top):
            problems.append(f"{name}: modules in a cycle: {' <-> '.join(c)}")
        for c in cycles(by_file):
            # The folder each file is in (a mod.rs module is its folder's).
            owners = {m if (crate / "src" / Path(*m) / "mod.rs").exists() else m[:-1] for m in c}
            files = ", ".join("::".join(m) or "lib" for m in c)
            where = "across folders" if len(owners) > 1 else "within one folder"
            problems.append(f"{name}: files in a circle {where}: {files}")
    return problems


if __name__ == "__main__":
    problems = report("--edges" in sys.argv)
    for p in problems:
        print(p)
    print(f"{len(problems)} cycle(s)")
    sys.exit(1 if problems else 0)
