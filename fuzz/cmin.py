#!/usr/bin/env python3
"""Picks the corpus to check in from a libFuzzer merge control file.

libFuzzer's own minimisation keeps every input that adds a feature (edge
hit counts, comparisons), thousands for some targets; this keeps at most
MAX_FILES inputs and MAX_BYTES in all that cover as many edges (`COV`) as
possible: greedy set cover, smaller inputs first on ties.

    cmin.py CONTROL_FILE OUT_DIR [MAX_FILES [MAX_BYTES]]
"""
import hashlib
import heapq
import os
import shutil
import sys


def main():
    control, out = sys.argv[1], sys.argv[2]
    max_files = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    max_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 2 << 20
    with open(control) as f:
        lines = f.read().splitlines()
    n = int(lines[0])
    paths = lines[2 : 2 + n]
    cov, size = {}, {}
    for line in lines[2 + n :]:
        kind, _, rest = line.partition(" ")
        if kind == "STARTED":
            i, s = rest.split()
            size[int(i)] = int(s)
        elif kind == "COV":
            i, *edges = rest.split()
            cov[int(i)] = set(map(int, edges))
    total = set().union(*cov.values()) if cov else set()
    covered, chosen, used = set(), [], 0
    # Lazy greedy: (-gain, size, i), gains only shrink as coverage grows.
    heap = [(-len(e), size.get(i, 0), i) for i, e in cov.items()]
    heapq.heapify(heap)
    while heap and len(chosen) < max_files:
        neg, s, i = heapq.heappop(heap)
        gain = len(cov[i] - covered)
        if gain == 0:
            continue
        if gain != -neg:
            heapq.heappush(heap, (-gain, s, i))
            continue
        if used + s > max_bytes:
            continue
        chosen.append(i)
        covered |= cov[i]
        used += s
    # Read first: OUT_DIR may be one of the merged folders.
    kept = []
    for i in chosen:
        with open(paths[i], "rb") as f:
            kept.append(f.read())
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for data in kept:
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
    print(
        f"{len(chosen)} files, {used} bytes, {len(covered)} of {len(total)} edges"
        f" of {len(cov)} inputs"
    )


if __name__ == "__main__":
    main()
