#!/usr/bin/env bash
# Fuzzes each target for SECONDS (default 600), one after another, on one
# core: `fuzz/run.sh [SECONDS] [TARGET...]` (all targets when none named).
#
# Each target starts from its checked-in corpus (fuzz/corpus/<t>) and its
# seeds (fuzz/seeds/<t>); what it finds new goes to fuzz/target/work/<t>
# (minimised into the corpus by `fuzz/run.sh --cmin`, below), a crash to
# fuzz/artifacts/<t>/. Prints, per target: executions, seconds, corpus files
# (checked-in + new) and crashes. Exits 1 when any target crashed.
#
# `fuzz/run.sh --cmin [TARGET...]` replaces fuzz/corpus/<t> (what is
# checked in) with at most 200 inputs, 2 MB, of fuzz/corpus/<t>,
# fuzz/target/work/<t> and fuzz/seeds/<t> that cover the most edges
# (fuzz/cmin.py).

set -euo pipefail
cd "$(dirname "$0")/.."

FUZZ=(cargo +nightly fuzz)
FLAGS=(-s none --target-dir fuzz/target --fuzz-dir fuzz)
ALL=$(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^hearth-fuzz$')

cmin=0
if [ "${1:-}" = "--cmin" ]; then
    cmin=1
    shift
    seconds=0
else
    seconds=${1:-600}
    [ $# -gt 0 ] && shift
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && read -r -d '' -a targets <<<"$ALL" || true

# One core for the build, the other left free.
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}
"${FUZZ[@]}" build "${FLAGS[@]}" >/dev/null
(cd fuzz/plugins && cargo build --release --quiet)

if [ $cmin = 1 ]; then
    for t in "${targets[@]}"; do
        mkdir -p "fuzz/corpus/$t" "fuzz/target/work/$t" "fuzz/seeds/$t"
        tmp=$(mktemp -d)
        mkdir "$tmp/out"
        # A merge records each input's coverage in the control file;
        # cmin.py then keeps the few inputs that cover the most.
        "${FUZZ[@]}" run "${FLAGS[@]}" "$t" "$tmp/out" "fuzz/corpus/$t" "fuzz/target/work/$t" \
            "fuzz/seeds/$t" -- -merge=1 -merge_control_file="$tmp/control" -rss_limit_mb=2048 \
            -timeout=10 >"fuzz/target/cmin-$t.log" 2>&1
        echo "$t: $(python3 fuzz/cmin.py "$tmp/control" "fuzz/corpus/$t" 200 $((2 << 20)))"
        rm -rf "$tmp"
    done
    exit 0
fi

printf '%-20s %12s %8s %8s %8s\n' target executions seconds corpus crashes
failed=0
for t in "${targets[@]}"; do
    work="fuzz/target/work/$t"
    artifacts="fuzz/artifacts/$t"
    log="fuzz/target/logs/$t.log"
    mkdir -p "$work" "$artifacts" "fuzz/corpus/$t" "fuzz/seeds/$t" "$(dirname "$log")"
    before=$(ls "$artifacts" | wc -l)
    dict=()
    [ -f "fuzz/dicts/$t.dict" ] && dict=(-dict="fuzz/dicts/$t.dict")
    start=$(date +%s)
    status=0
    "${FUZZ[@]}" run "${FLAGS[@]}" "$t" "$work" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "${dict[@]}" >"$log" 2>&1 || status=$?
    elapsed=$(($(date +%s) - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    corpus=$(($(ls "fuzz/corpus/$t" | wc -l) + $(ls "$work" | wc -l)))
    crashes=$(($(ls "$artifacts" | wc -l) - before))
    printf '%-20s %12s %8s %8s %8s\n' "$t" "${execs:-?}" "$elapsed" "$corpus" "$crashes"
    if [ "$status" != 0 ] || [ "$crashes" != 0 ]; then
        failed=1
        echo "  $t failed (exit $status): see $log and $artifacts/" >&2
    fi
done
exit $failed
