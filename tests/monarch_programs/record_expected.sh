#!/usr/bin/env bash
# Re-record the expected output of every program here from real Monarch:
#   bash tests/monarch_programs/record_expected.sh MONARCH_PYTHON [PROGRAM.py ...]
# (MONARCH_PYTHON: an interpreter with torchmonarch==0.7.0, see bench/setup_monarch.sh).
# Each program runs three times; its stdout must compare equal every time, as the test
# compares it (_output.py: what actors print, "actor says ...", is compared as a multiset).
set -euo pipefail
PY=${1:?usage: record_expected.sh MONARCH_PYTHON [PROGRAM.py ...]}
shift
cd "$(dirname "${BASH_SOURCE[0]}")"
progs=("$@")
[ ${#progs[@]} -gt 0 ] || progs=([!_]*.py)
for p in "${progs[@]}"; do
    out=${p%.py}.expected
    timeout 300 "$PY" "$p" >"$out.tmp"
    for _ in 1 2; do
        timeout 300 "$PY" "$p" >"$out.again"
        python3 _output.py "$out.tmp" "$out.again" >&2 || { echo "$p: output differs between runs" >&2; rm -f "$out".*; exit 1; }
    done
    rm -f "$out.again"
    mv "$out.tmp" "$out"
    echo "$p -> $out ($(wc -l <"$out") lines)"
done
