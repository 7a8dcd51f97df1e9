#!/usr/bin/env bash
# Make the second interpreter for the side-by-side benchmark: a venv (default .bench-venv,
# gitignored) holding torchmonarch==0.7.0 and torch==2.13.0 (CPU wheel; pinned on its own
# first, since an unpinned resolve pulls the CUDA build). Idempotent.
#
#   bash bench/setup_monarch.sh [VENV_DIR]
#   python -m bench --monarch-python VENV_DIR/bin/python
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1
VENV=${1:-.bench-venv}
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    # torchmonarch 0.7.0 ships cp311 wheels only
    echo "setup_monarch: $PY is $("$PY" --version 2>&1); torchmonarch 0.7.0 needs Python 3.11 (set PYTHON=...)" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup_monarch: creating $VENV"
    "$PY" -m venv "$VENV"
fi
if "$VENV/bin/python" -c 'import importlib.metadata as m, sys, ipykernel; sys.exit(0 if (m.version("torch"), m.version("torchmonarch")) == ("2.13.0", "0.7.0") else 1)' 2>/dev/null; then
    echo "setup_monarch: $VENV is up to date"
else
    pip=("$VENV/bin/python" -m pip install --quiet --progress-bar off)
    "${pip[@]}" "torch==2.13.0"
    # ipykernel: bench/notebook_output.py measures Monarch's output at a kernel's iopub
    "${pip[@]}" "torchmonarch==0.7.0" numpy ipykernel
fi
"$VENV/bin/python" -c 'import torch, monarch.actor; print("setup_monarch: torch", torch.__version__, "monarch at", monarch.__file__)'
echo "setup_monarch: run  python -m bench --monarch-python $VENV/bin/python"
