#!/usr/bin/env bash
# Two revisions of monarch_nb, each against Monarch, in alternating runs of `python -m bench`.
#
#   bash bench/alternate.sh REV_A REV_B [RUNS] [ONLY]
#
# `python -m bench --baseline REV` puts two monarch_nb trees in one run with no Monarch; this
# keeps each run as the targets are judged (ours beside Monarch) and alternates the trees run by
# run, so a change in the machine over the minutes (which CPU a proc wakes on, see
# docs/performance.md "Session 20") lands on both. RUNS defaults to 3, ONLY to 'callone_*'.
# MONARCH_PY picks the peer interpreter (default .bench-venv/bin/python, from
# bench/setup_monarch.sh). Prints one line per run: row:median ms/ratio to Monarch/p99 ratio.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash bench/alternate.sh REV_A REV_B [RUNS] [ONLY]" >&2
    exit 2
fi
A=$1
B=$2
RUNS=${3:-3}
ONLY=${4:-callone_*}
PY=$(pwd)/.venv/bin/python
MONARCH_PY=${MONARCH_PY:-$(pwd)/.bench-venv/bin/python}
if [ ! -x "$MONARCH_PY" ]; then
    echo "alternate: no Monarch interpreter at $MONARCH_PY (run bench/setup_monarch.sh or set MONARCH_PY)" >&2
    exit 2
fi
work=$(mktemp -d /tmp/mnb-alt-XXXXXX)
trap 'rm -rf "$work"' EXIT
for rev in "$A" "$B"; do
    mkdir -p "$work/$rev"
    git archive "$rev" monarch_nb bench | tar -x -C "$work/$rev"
done
for i in $(seq 1 "$RUNS"); do
    for rev in "$A" "$B"; do
        (cd "$work/$rev" && PYTHONPATH="$work/$rev" "$PY" -m bench --monarch-python "$MONARCH_PY" --only "$ONLY" 2>/dev/null >"$work/$rev.json")
        "$PY" - "$rev" "$work/$rev.json" <<'PY'
import json
import sys

rev, path = sys.argv[1], sys.argv[2]
rows = json.load(open(path))["workloads"]
print(rev, " ".join(
    f"{k}:{w['monarch_nb']['median_s'] * 1e3:.3f}/{w['ratio_median']:.2f}/p99 {w['ratio_p99']:.2f}"
    for k, w in rows.items() if "ratio_median" in w
))
PY
    done
done
