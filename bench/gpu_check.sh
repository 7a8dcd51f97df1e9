#!/bin/bash
# The checks that need a GPU, as one command for a lent device machine (never CI).
#
#   bash bench/gpu_check.sh prepare [BASELINE]   # here: wheels the device image lacks (Python
#                                                # 3.12) into .whl/, and BASELINE's tree to compare
#   bash bench/gpu_check.sh                      # there, with `.whl` carried: the `cuda` tests
#                                                # (test_spmd.py's NCCL one too),
#                                                # then bench.rdma --device cuda (twice, and the
#                                                # baseline's too when prepared); results in $OUT
#
# The device image has torch, cloudpickle, psutil, rich, fsspec, uvloop, pytest, pytest-timeout;
# not pyzmq or cryptography. .whl/ must be ignored (.git/info/exclude) and stay under 64 MiB.
set -u
cd "$(dirname "$0")/.." || exit 2
if [ "${1:-}" = prepare ]; then
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >>.git/info/exclude; }
    mkdir -p .whl && rm -f .whl/*.whl  # one version of each, or the install there stops
    for p in pyzmq cryptography cffi pycparser; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$p" || exit 1
    done
    rm -f .whl/old_tree.tar
    [ -n "${2:-}" ] && git archive "$2" monarch_nb bench -o .whl/old_tree.tar
    ls -la .whl
    exit 0
fi
: "${OUT:?run this on the device machine, where OUT is set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -p no:cacheprovider -o addopts="" -ra -v -m cuda --timeout 150 \
    tests/test_rdma.py tests/test_tensor.py tests/test_spmd.py 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed"
rc=${PIPESTATUS[0]}
if [ -f .whl/old_tree.tar ]; then mkdir -p /tmp/old && tar -xf .whl/old_tree.tar -C /tmp/old; fi
for i in 1 2; do
    if [ -d /tmp/old/monarch_nb ]; then
        (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout 120 python3 -m bench.rdma --device cuda --sizes 1M,64M,1G \
            --monarch-python /nonexistent >"$OUT/baseline$i.json" 2>"$OUT/baseline$i.err")
    fi
    PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m bench.rdma --device cuda --sizes 1M,64M,1G \
        --monarch-python /nonexistent >"$OUT/tree$i.json" 2>"$OUT/tree$i.err"
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in sorted(os.listdir(out)):
    if f.endswith(".json"):
        try:
            d = json.load(open(os.path.join(out, f)))
        except ValueError:
            print(f, "no result:", open(os.path.join(out, f[:-5] + ".err")).read()[-1500:])
            continue
        for n, row in d.get("same_host", {}).items():
            if n.isdigit():
                ops = ("read", "write", "read_staged", "write_staged")
                print(f, n, {op: round(row[op]["monarch_nb_GBps"] or 0, 2) for op in ops if op in row},
                      "floor", round(row["memcpy_GBps"] or 0, 1),
                      "staged floors", {k: round(row.get(f"{k}_GBps") or 0, 1) for k in ("unixstream", "d2h", "h2d")})
        if "monarch_nb_error" in d:
            print(f, d["monarch_nb_error"][-1500:])
PY
echo "monarch_nb processes left: $(ps -eo args | grep -c '[m]onarch_nb')"
exit "$rc"
