#!/usr/bin/env bash
# `make test`'s parts, timed: tests/tools/timed.sh PART COMMAND... runs
# COMMAND with its output shown and kept in $TIMES/PART.log, and adds
# "PART<TAB>seconds<TAB>exit status" to $TIMES/parts.tsv; it exits as
# COMMAND did. tests/tools/suite_times.py turns the folder into a table.
set -uo pipefail
TIMES=${TIMES:-target/test-times}
part=$1
shift
mkdir -p "$TIMES"
started=$EPOCHREALTIME
"$@" 2>&1 | tee "$TIMES/$part.log"
status=${PIPESTATUS[0]}
awk -v p="$part" -v a="$started" -v b="$EPOCHREALTIME" -v s="$status" 'BEGIN { printf "%s\t%.1f\t%s\n", p, b - a, s }' >> "$TIMES/parts.tsv"
exit "$status"
