#!/usr/bin/env bash
# Every figure of docs/performance.md in one run, side by side with Monarch where it has one.
#
#   sudo bash bench/figures.sh [OUT_DIR] [--quick]
#
# Writes OUT_DIR/{bench,notebook_output,scale}.json (default bench-figures-<UTC time>/).
# MONARCH_PY picks the peer interpreter (default .bench-venv/bin/python, made by
# bench/setup_monarch.sh). Root is needed for the scale part's network namespaces.
# Full run: about 10 min for bench, 1 for notebook_output, 10-30 for scale on a quiet machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=""
QUICK=""
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -*) echo "figures: unknown option $arg (usage: bench/figures.sh [OUT_DIR] [--quick])" >&2; exit 2 ;;
        *) OUT=$arg ;;
    esac
done
OUT=${OUT:-bench-figures-$(date -u +%Y%m%dT%H%M%S)}
PY=.venv/bin/python
MONARCH_PY=${MONARCH_PY:-.bench-venv/bin/python}
mkdir -p "$OUT"
peer=()
[ -x "$MONARCH_PY" ] && peer=(--monarch-python "$MONARCH_PY")
echo "figures: bench -> $OUT/bench.json" >&2
$PY -m bench ${QUICK:+--quick} "${peer[@]}" --out "$OUT/bench.json" > /dev/null
echo "figures: notebook_output -> $OUT/notebook_output.json" >&2
$PY -m bench.notebook_output "${peer[@]}" --repeat "$([ -n "$QUICK" ] && echo 3 || echo 5)" > "$OUT/notebook_output.json"
echo "figures: scale -> $OUT/scale.json" >&2
$PY -m bench.scale --part all ${QUICK:+--quick} "${peer[@]}" --out "$OUT/scale.json" > /dev/null
echo "figures: done in $OUT" >&2
