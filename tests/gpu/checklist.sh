#!/usr/bin/env bash
# docs/src/gpu-checklist.md, run on a GPU machine with torch but no Rust,
# from the repository root, with the bundle tests/gpu/bundle.sh made in
# .gpu/. Each step's output goes to OUT/<step>.log and a PASS/FAIL line to
# stdout. Each step is stopped after STEP_TIMEOUT seconds (default 240), so
# one hang cannot eat a whole device lease; with ARCHIVE=FILE.tgz set, the
# logs so far are packed there after every step (a lease returns few files).
# Usage: tests/gpu/checklist.sh OUT [STEP...]   (steps: env cuda parity run
# graph launch fsdp traced bench offload profile offload-profile; default all
# but the two profiles;
# BENCH_ROUNDS, default 3; BENCH_SIZES, default the script's; PEERS, the
# bench's peers; RUN_MPS, the run step's mixed precisions, default all three;
# PROFILE_SIZES, default gpt2; PARITY_FILTER, a test name filter)
set -u
OUT=${1:?usage: checklist.sh OUT [STEP...]}; shift
STEPS=${*:-env cuda parity run graph launch fsdp traced bench offload}
ROOT=$PWD
# The bundle as one archive (tests/gpu/bundle.sh), unpacked on first use.
if [ ! -x .gpu/bin/hearth ] && [ -f .gpu/carry.tar.xz ]; then tar xJf .gpu/carry.tar.xz -C .gpu; fi
mkdir -p "$OUT" /tmp/gpu-lib
TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
NCCL=$(ls "$TORCH"/../nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1)
[ -n "$NCCL" ] && ln -sf "$NCCL" /tmp/gpu-lib/libnccl.so
export LD_LIBRARY_PATH=$TORCH/lib:/tmp/gpu-lib:$ROOT/.gpu/lib:${LD_LIBRARY_PATH:-}
export HEARTH_PYTHON=python3 HEARTH_BIN=$ROOT/.gpu/bin/hearth PYTHONUNBUFFERED=1
# The test binaries find the repository where it was built.
mkdir -p /work && [ -e /work/main ] || ln -s "$ROOT" /work/main
export H=$ROOT/.gpu/bin/hearth

step() {  # step NAME COMMAND...: runs it, logs it, says PASS or FAIL with its time
    local name=$1; shift
    local t0=$SECONDS
    if timeout -k 10 "${STEP_TIMEOUT:-240}" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1; then echo "PASS $name ($((SECONDS - t0)) s)"
    else echo "FAIL $name ($((SECONDS - t0)) s, exit $?): tail of $name.log"; tail -15 "$OUT/$name.log"; fi
    if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$OUT" .; fi
}

# A copy of CONFIG with KEY = VALUE lines added to its [run] table.
with_run_keys() {
    local config=$1 out=$2; shift 2
    python3 - "$config" "$out" "$@" <<'PY'
import sys
src, dst, *keys = sys.argv[1:]
text = open(src).read().replace("[run]\n", "[run]\n" + "".join(k + "\n" for k in keys), 1)
open(dst, "w").write(text)
PY
}

sort_digits() {  # sort_digits MP [GRAPH]: the default job on the GPU, accuracy printed
    with_run_keys examples/sort-digits.toml /tmp/sd-$1.toml 'device = "cuda"' "mixed-precision = \"$1\"" "output-dir = \"/tmp/sd-$1\"" "cuda-graph = ${2:-false}"
    "$H" run /tmp/sd-$1.toml --quiet
}
export -f with_run_keys sort_digits  # step runs each command in a bash under timeout

for s in $STEPS; do case $s in
env) step env "$H" env ;;
cuda) step cuda .gpu/bin/cuda --include-ignored --test-threads=1 --nocapture ;;
parity) step parity .gpu/bin/api --include-ignored --test-threads=1 ${PARITY_FILTER:-pytorch_parity::} ;;
run) for mp in ${RUN_MPS:-no bf16 fp16}; do step run-$mp sort_digits $mp; grep -iE "accuracy|tokens/s" "$OUT/run-$mp.log" | tail -2; done ;;
graph) step graph sort_digits bf16 true; grep -iE "accuracy|tokens/s" "$OUT/graph.log" | tail -2; grep -o '"cuda_graph": {[^}]*}' /tmp/sd-bf16/sort-digits/summary.json | tr -d '\n ' ;;
launch)
    # NCCL by name: a world of one otherwise needs no collectives.
    with_run_keys examples/sort-digits.toml /tmp/launch.toml 'output-dir = "/tmp/launch"'
    printf '\n[distributed]\nbackend = "nccl"\n' >> /tmp/launch.toml
    step launch "$H" launch -n 1 /tmp/launch.toml -- --quiet --steps 300
    grep -iE "nccl|accuracy" "$OUT/launch.log" | head -5 ;;
fsdp)
    with_run_keys examples/sort-digits.toml /tmp/fsdp.toml 'output-dir = "/tmp/fsdp"' 'save-every = 150' 'mixed-precision = "bf16"'
    # A policy shards a world of one: NCCL gathers (prefetched) and reduce-scatters.
    printf '\n[distributed]\nbackend = "nccl"\n' >> /tmp/fsdp.toml
    printf '\n[fsdp]\nsharding-strategy = "FULL_SHARD"\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["Block"]\nactivation-checkpointing = true\nstate-dict-type = "SHARDED_STATE_DICT"\nmixed-precision-policy = "param_dtype=bf16,reduce_dtype=fp32"\nforward-prefetch = true\nbackward-prefetch = "BACKWARD_PRE"\n' >> /tmp/fsdp.toml
    step fsdp "$H" launch -n 1 /tmp/fsdp.toml -- --quiet --steps 300
    ls /tmp/fsdp/sort-digits/checkpoints/*/ >> "$OUT/fsdp.log"
    grep -oE "\"(prefetched|gathers|gather_bytes|reduce_scatters)\": ?[0-9]+" /tmp/fsdp/sort-digits/summary.json | tr "\n" " " >> "$OUT/fsdp.log"
    grep -iE "nccl|accuracy|shard|prefetched" "$OUT/fsdp.log" | head -6 ;;
traced)
    # A user's traced Llama (tests/hf_causal.py) cut at its decoder layers on
    # the GPU: FULL_SHARD with cpu-offload and the bf16 policy over NCCL.
    if ! python3 -c "import transformers" 2>/dev/null; then echo "SKIP traced (no transformers here)"; continue; fi
    python3 -c "import sys, pathlib; sys.path.insert(0, 'tests'); import hf_causal, text_data; hf_causal.build('llama', pathlib.Path('/tmp/traced')); pathlib.Path('/tmp/traced/corpus.txt').write_bytes(text_data.TEXT)"
    printf '[run]\nname = "traced"\nsteps = 20\nlog-every = 5\ndevice = "cuda"\noutput-dir = "/tmp/traced/out"\n[model]\nkind = "torchscript"\npath = "/tmp/traced/model.pt"\ninit-from = "/tmp/traced/pretrained"\ninit-key-prefix = "m."\n[data]\nkind = "text-file"\npath = "/tmp/traced/corpus.txt"\nseq-len = 64\nbatch-size = 8\n[optimizer]\nkind = "adamw"\nlr = 1e-3\n[distributed]\nbackend = "nccl"\n[fsdp]\nsharding-strategy = "FULL_SHARD"\nauto-wrap-policy = "transformer-based"\ntransformer-cls-names-to-wrap = ["LlamaDecoderLayer"]\ncpu-offload = true\nmixed-precision-policy = "param_dtype=bf16,reduce_dtype=fp32"\nforward-prefetch = true\nbackward-prefetch = "BACKWARD_PRE"\n' > /tmp/traced.toml
    step traced "$H" launch -n 1 /tmp/traced.toml -- --quiet
    grep -oE "\"(gathers|prefetched|recomputed|most_gathered|most_gathered_bytes)\": ?[0-9]+" /tmp/traced/out/traced/summary.json | tr "\n" " " >> "$OUT/traced.log"
    grep -iE "loss|gathers" "$OUT/traced.log" | tail -3 ;;
bench) STEP_TIMEOUT=${BENCH_TIMEOUT:-${STEP_TIMEOUT:-240}} step bench python3 examples/bench/gpu_gpt_vs_accelerate.py "${BENCH_ROUNDS:-3}" ${BENCH_SIZES:-}; grep -E "^[a-z0-9-]+:|hearth |accelerate |ratio" "$OUT/bench.log" ;;
profile) step profile python3 examples/bench/gpu_gpt_vs_accelerate.py --profile /tmp/profile ${PROFILE_SIZES:-gpt2}; grep -vE "^\s*$" "$OUT/profile.log" | tail -45 ;;
offload) step offload python3 examples/bench/gpu_offload_memory.py 6; cat "$OUT/offload.log" ;;
offload-profile) step offload-profile python3 examples/bench/gpu_offload_memory.py --profile /tmp/offload-profile; cat "$OUT/offload-profile.log" ;;
*) echo "unknown step $s" ;;
esac; done
