#!/usr/bin/env bash
# `make test-isa` (part of `make test`): the numeric tests again under each
# CPU level that libtorch, oneDNN and MKL can be pinned to on this machine:
# baseline (no AVX), AVX2, and AVX-512 where the CPU has it. A level the CPU
# lacks is skipped, and said so. The tests are those that compare floats
# computed by different code (hearth's kernels against float64, hearth
# against PyTorch, sharded against DDP, hearth against Accelerate): what a
# CPU's instructions can change. hearth's own kernels follow libtorch's
# level (HEARTH_CPU_KERNELS unset), so the baseline level runs none of them,
# while the kernel tests run each path explicitly at every level.
# Usage: tests/isa/levels.sh [--others] [LEVEL...]   (default: every level;
# with --others, not the highest level this CPU has, which an unpinned run
# such as the rest of `make test` already runs)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
HEARTH=target/debug/hearth
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-) "

# level: ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS
#        libtorch's level then, and the CPU flags the level needs.
declare -A PINS=(
    [baseline]="default SSE41 SSE4_2 DEFAULT sse4_2"
    [avx2]="avx2 AVX2 AVX2 AVX2 avx2,fma"
    [avx512]="avx512 AVX512_CORE AVX512 AVX512 avx512f,avx512bw,avx512vl,avx512dq"
)
others=0
if [ "${1:-}" = --others ]; then others=1; shift; fi
LEVELS=${*:-baseline avx2 avx512}
lacks() {  # lacks LEVEL: the CPU flags LEVEL needs that this CPU lacks
    local needs
    needs=$(echo "${PINS[$1]:?unknown level $1 (baseline, avx2, avx512)}" | cut -d' ' -f5)
    for f in ${needs//,/ }; do [[ $flags == *" $f "* ]] || echo -n "$f "; done
}
native=baseline
for level in avx2 avx512; do [ -z "$(lacks $level)" ] && native=$level; done

# The numeric tests, one command a line. Each selects the packages `make
# test`'s `cargo test` does (the workspace's default members, no `-p`), so
# that cargo unifies the same features and reuses its builds: `-p hearth`
# alone resolved other features and rebuilt hearth and its tests, 10 of the
# 16 minutes this script took in a fresh clone. Every library's unit tests
# run (a few seconds).
TESTS=(
    "cargo test -q --lib"
    "cargo test -q --test api -- pytorch_parity:: fused_graph::"
    "cargo test -q --test distributed -- sharding:: fsdp_mixed_precision:: mpi::ddp::ddp_on_two_ranks mpi::ddp::bf16_compression mpi::process_helpers::process_helpers_on_three_ranks_match_accelerate mpi::ddp_kwargs::power_sgd_gives_pytorchs mpi::join::join_uneven_inputs"
    "cargo test -q --test big_model -- accelerates_logits checkpoints_logits"
    "$PY -m pytest -q --timeout 1800 tests/test_accelerator_run.py -k accumulated_batches_of_8"
)

# Every filter above must still name a test: one that matches nothing (a
# test renamed or moved to another module) would pass silently.
for test in "${TESTS[@]}"; do
    [[ $test == "cargo test"*" -- "* ]] || continue
    for filter in ${test#* -- }; do
        # grep -c reads all of the list (-q would leave cargo a broken pipe).
        named=$(${test%% -- *} -- --list "$filter" 2>/dev/null | grep -c ': test$')
        if [ "$named" = 0 ]; then
            echo "isa: the filter $filter of \"$test\" names no test; update tests/isa/levels.sh"
            exit 1
        fi
    done
done

failed=()
for level in $LEVELS; do
    read -r aten onednn mkl expect needs <<<"${PINS[$level]:?unknown level $level (baseline, avx2, avx512)}"
    missing=$(lacks "$level")
    if [ -n "$missing" ]; then
        echo "isa: $level skipped: this CPU lacks ${missing% }"
        continue
    fi
    if [ $others = 1 ] && [ "$level" = "$native" ]; then
        echo "isa: $level is this CPU's own level, which the unpinned tests ran"
        continue
    fi
    export ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=$onednn MKL_ENABLE_INSTRUCTIONS=$mkl
    # A pin libtorch ignores would make this level a copy of another.
    got=$($PY -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
    if [ "$got" != "$expect" ]; then
        echo "isa: $level FAILED: libtorch's level is $got under ATEN_CPU_CAPABILITY=$aten, not $expect"
        failed+=("$level")
        continue
    fi
    echo "isa: $level (ATEN_CPU_CAPABILITY=$aten ONEDNN_MAX_CPU_ISA=$onednn MKL_ENABLE_INSTRUCTIONS=$mkl): $($HEARTH env | grep '^CPU:')"
    start=$SECONDS
    ok=1
    for test in "${TESTS[@]}"; do
        t0=$SECONDS
        if $test; then
            echo "isa: $level: $test: passed in $((SECONDS - t0)) s"
        else
            echo "isa: $level: $test: FAILED after $((SECONDS - t0)) s"
            ok=0
        fi
    done
    if [ $ok = 1 ]; then
        echo "isa: $level passed in $((SECONDS - start)) s"
    else
        echo "isa: $level FAILED after $((SECONDS - start)) s"
        failed+=("$level")
    fi
done
unset ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS
[ ${#failed[@]} = 0 ] || { echo "isa: failed at ${failed[*]}"; exit 1; }
