#!/usr/bin/env bash
# One line: the CPU this machine has and its vector instruction sets, so a
# test report says which machine it came from (`make test` prints it first).
model=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2- | tr ' ' '\n' |
    grep -E '^(sse4_2|avx|avx2|fma|f16c|avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni)$' | tr '\n' ' ')
echo "CPU: ${model:-unknown} ($(nproc) cores); vector flags: ${flags% }"
