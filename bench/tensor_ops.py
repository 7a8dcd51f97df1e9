"""Mesh tensors (monarch_nb.tensor) on a 4-proc mesh: per-op overhead, pipelined ops/s, and
distribute/full_tensor of a large tensor. Prints JSON (medians).

    python -m bench.tensor_ops [--mib 256] [--ops 500] [--reps 3] [--monarch-python PATH]

Runs under a private runtime dir and stops what it started. Per-op overhead is what the
notebook waits for when it issues a small elementwise op (the ranks run it later); round trip
is an op plus fetch_shard of its result; pipelined is ops/s from the first issue to the last
result. distribute and full_tensor run both ways: "messages" (every shard inside a message;
full_tensor an all-gather on the ranks, rank 0 sending the value) and "data_plane" (every
piece from 1 MiB: each rank reads its shard from the controller's RDMABuffer, the controller
reads each rank's piece from that rank's). By default full_tensor takes the data plane from
1 MiB and distribute from pieces of 32 MiB (where it starts to pay here). With ``--monarch-python`` (a torchmonarch 0.7 interpreter) the same
per-op workloads run on Monarch's tensor engine too (local per-rank ops: its cross-rank ones
need CUDA), under "monarch".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="size of the distribute/full_tensor tensor")
    ap.add_argument("--ops", type=int, default=500, help="ops per pipelined sample")
    ap.add_argument("--reps", type=int, default=3, help="distribute/full_tensor samples per path")
    ap.add_argument("--monarch-python", default="", help="a torchmonarch interpreter, to compare")
    args = ap.parse_args()
    rdir = tempfile.mkdtemp(prefix="mnb-bt-", dir="/tmp")
    os.chmod(rdir, 0o700)
    os.environ["MONARCH_NB_RUNTIME_DIR"] = rdir
    try:
        out = {"monarch_nb": run(args.mib, args.ops, args.reps)}
        if args.monarch_python:
            cp = subprocess.run(
                [args.monarch_python, "-c", MONARCH, str(args.ops)], capture_output=True, text=True, timeout=300, cwd=rdir
            )
            lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
            out["monarch"] = json.loads(lines[-1]) if lines else {"error": cp.stderr[-2000:]}
        print(json.dumps(out, indent=2))
    finally:
        subprocess.run([sys.executable, "-m", "monarch_nb", "allocator", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(rdir, ignore_errors=True)


def run(mib: int, nops: int, reps: int = 3) -> dict[str, object]:
    import torch

    import monarch_nb.tensor as mt
    from monarch_nb.actor import this_host
    from monarch_nb.tensor import Replicate, Shard

    out: dict[str, object] = {"procs": 4}
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="bench_tensor")
    try:
        t0 = time.perf_counter()
        mt.setup(procs)
        out["setup_s"] = round(time.perf_counter() - t0, 3)
        x = mt.distribute(torch.ones(16, 16), procs, [Shard(0)])
        mt.inspect(x)
        issue, rtt = [], []
        for _ in range(200):
            t0 = time.perf_counter()
            y = x + 1
            t1 = time.perf_counter()
            mt.fetch_shard(y).get(timeout=60)
            issue.append(t1 - t0)
            rtt.append(time.perf_counter() - t0)
        out["op_issue_us_median"] = round(statistics.median(issue) * 1e6, 1)
        out["op_plus_fetch_ms_median"] = round(statistics.median(rtt) * 1e3, 3)
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            y = x
            for _ in range(nops):
                y = y + 1
            mt.fetch_shard(y).get(timeout=120)
            rates.append(nops / (time.perf_counter() - t0))
        out["pipelined_ops_per_s_median"] = round(statistics.median(rates), 1)
        # ops with a collective on the ranks (an all-reduce of x.sum()'s Partial; a sharded
        # matmul's all-gather): since session 34 each is preceded by the ranks' agreement on
        # their inputs, one more small all-reduce (docs/tensors.md)
        w = mt.distribute(torch.ones(16, 16), procs, [Shard(0)])
        for name, op in (("clamp_max_sum", lambda y: y.clamp(max=x.sum())), ("sharded_matmul", lambda y: y @ w)):
            rtt = []
            for _ in range(100):
                t0 = time.perf_counter()
                mt.fetch_shard(op(x)).get(timeout=60)
                rtt.append(time.perf_counter() - t0)
            out[f"{name}_plus_fetch_ms_median"] = round(statistics.median(rtt) * 1e3, 3)
            rates = []
            for _ in range(3):
                t0 = time.perf_counter()
                y = x
                for _ in range(nops // 5):
                    y = op(y) / 16
                mt.fetch_shard(y).get(timeout=120)
                rates.append(nops // 5 / (time.perf_counter() - t0))
            out[f"{name}_pipelined_per_s_median"] = round(statistics.median(rates), 1)

        big = torch.randn(mib * 2**20 // 4 // 1024, 1024)
        # both paths, warm (the first data-plane use starts each proc's data server), medians
        defaults = (mt._engine.DATA_PLANE_BYTES, mt._engine.DISTRIBUTE_DATA_PLANE_BYTES)
        for path, threshold in (("messages", 1 << 62), ("data_plane", 1 << 20)):
            mt._engine.DATA_PLANE_BYTES = mt._engine.DISTRIBUTE_DATA_PLANE_BYTES = threshold
            w = mt.distribute(torch.ones(1024, 1024), procs, [Shard(0)])
            w.full_tensor()
            dist_s, full_s, received = [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                h = mt.distribute(big, procs, [Shard(0)])
                mt.fetch_shard(h.sum(), gpus=3).get(timeout=600)  # the last rank has its shard
                dist_s.append(time.perf_counter() - t0)
                before = mt.stats(procs)["bytes_received"]
                t0 = time.perf_counter()
                back = h.full_tensor()
                full_s.append(time.perf_counter() - t0)
                received.append(mt.stats(procs)["bytes_received"] - before)
                assert torch.equal(back, big)
                del h, back
            out[f"distribute_{mib}MiB_s_median_{path}"] = round(statistics.median(dist_s), 3)
            out[f"full_tensor_{mib}MiB_s_median_{path}"] = round(statistics.median(full_s), 3)
            out[f"full_tensor_MiB_received_{path}"] = round(max(received) / 2**20, 3)
        # the controller is the source: the whole tensor leaves it once, in messages on the
        # first path, as shared-memory RDMABuffers the ranks read on the second
        out["distribute_MiB_out_of_controller"] = mib
        mt._engine.DATA_PLANE_BYTES, mt._engine.DISTRIBUTE_DATA_PLANE_BYTES = defaults
        r = mt.distribute(torch.ones(4), procs, [Replicate()])
        mt.inspect(r)
    finally:
        procs.stop().get(timeout=60)
    return out


MONARCH = """
import json, statistics, sys, time
import torch
from monarch import fetch_shard
from monarch.actor import this_host

nops = int(sys.argv[1])
mesh = this_host().spawn_procs({"gpus": 4})
out = {"procs": 4}
with mesh.activate():
    x = torch.ones(16, 16)
t0 = time.perf_counter()
fetch_shard(x.sum()).result(timeout=120)
out["first_fetch_shard_sum_s"] = round(time.perf_counter() - t0, 3)
issue, rtt = [], []
for _ in range(200):
    t0 = time.perf_counter()
    with mesh.activate():
        y = x + 1
    t1 = time.perf_counter()
    fetch_shard(y).result(timeout=60)
    issue.append(t1 - t0)
    rtt.append(time.perf_counter() - t0)
out["op_issue_us_median"] = round(statistics.median(issue) * 1e6, 1)
out["op_plus_fetch_ms_median"] = round(statistics.median(rtt) * 1e3, 3)
rates = []
for _ in range(3):
    t0 = time.perf_counter()
    with mesh.activate():
        y = x
        for _ in range(nops):
            y = y + 1
    fetch_shard(y).result(timeout=120)
    rates.append(nops / (time.perf_counter() - t0))
out["pipelined_ops_per_s_median"] = round(statistics.median(rates), 1)
print(json.dumps(out), flush=True)
mesh.stop().get()
"""


if __name__ == "__main__":
    main()
