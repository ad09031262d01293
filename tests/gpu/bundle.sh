#!/usr/bin/env bash
# Builds what docs/src/gpu-checklist.md runs on a GPU machine that has
# torch but no Rust: stripped release binaries of hearth (cuda feature) and
# of the GPU test suites, and the Open MPI libraries hearth links, in
# .gpu/ (git-ignored; carry it to the machine and run
# tests/gpu/checklist.sh there), and the same packed in .gpu/carry.tar.xz
# (a quarter of the size; checklist.sh unpacks it where .gpu/bin is
# missing). The built-in plugins are inside hearth. Usage: make gpu-bundle
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cargo build --release -p hearth-cli --bin hearth
cp target/release/hearth .gpu/bin/
# The test binaries, by the name of their test target (cuda, api).
cargo test --release --no-run --message-format=json \
    -p hearth --test cuda --test api 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".gpu/bin/" + m["target"]["name"])
'
strip .gpu/bin/*
# Open MPI and what it needs beyond glibc (the GPU image has no MPI).
ldd target/release/hearth | awk '/=> \// {print $3}' |
    grep -E 'libmpi|libopen-|libhwloc|libevent|libudev' | xargs -I{} cp -L {} .gpu/lib/
tar cf - -C .gpu bin lib | xz -T0 -6 > .gpu/carry.tar.xz
du -sh .gpu/bin/* .gpu/lib .gpu/carry.tar.xz
