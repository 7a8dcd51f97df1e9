"""One side of ``bench/rdma.py``: a controller that times RDMABuffer reads and writes between two
procs of this host, with ``BENCH_IMPL`` = ``nb`` (monarch_nb.rdma) or ``monarch`` (monarch.rdma).
Prints one JSON object."""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
import warnings

import torch

if os.environ.get("BENCH_IMPL") == "monarch":
    from monarch.actor import Actor, endpoint, this_host
    from monarch.rdma import RDMABuffer
else:
    from monarch_nb.actor import Actor, endpoint, this_host
    from monarch_nb.rdma import RDMABuffer

warnings.simplefilter("ignore")


class Owner(Actor):
    def __init__(self, n: int) -> None:
        self.t = torch.ones(n, dtype=torch.uint8)
        self.buf = RDMABuffer(self.t)

    @endpoint
    def get(self) -> RDMABuffer:
        return self.buf


class Reader(Actor):
    @endpoint
    def time_op(self, buf: RDMABuffer, n: int, reps: int, op: str) -> list[float]:
        local = torch.zeros(n, dtype=torch.uint8)
        local.fill_(2)  # touched: page faults are not part of a transfer
        out = []
        for _ in range(reps + 1):  # the first one sets up connections and mappings
            t0 = time.perf_counter()
            (buf.read_into(local) if op == "read" else buf.write_from(local)).get()
            out.append(time.perf_counter() - t0)
        return out[1:]

    @endpoint
    def memcpy(self, n: int, reps: int) -> list[float]:
        a = torch.ones(n, dtype=torch.uint8)
        b = torch.zeros(n, dtype=torch.uint8)
        out = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            ctypes.memmove(b.data_ptr(), a.data_ptr(), n)
            out.append(time.perf_counter() - t0)
        return out[1:]


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    floor = os.environ.get("BENCH_FLOOR") == "1"
    owners_procs = this_host().spawn_procs(per_host={"gpus": 1})
    reader_procs = this_host().spawn_procs(per_host={"gpus": 1})
    reader = reader_procs.spawn("reader", Reader)
    res: dict[str, dict[str, float]] = {}
    for n in sizes:
        reps = 20 if n <= (1 << 20) else 5 if n <= (64 << 20) else 2
        if os.environ.get("BENCH_IMPL") == "monarch" and n > (1 << 20):
            reps = 2  # its TCP fallback moves ~0.1 GB/s
        owner = owners_procs.spawn(f"owner{n}", Owner, n)
        buf = owner.get.call_one().get()
        for op in ("read", "write"):
            t = statistics.median(reader.time_op.call_one(buf, n, reps, op).get())
            res[f"{op}_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
        if floor:
            t = statistics.median(reader.memcpy.call_one(n, reps).get())
            res[f"memcpy_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
    print(json.dumps(res))
    owners_procs.stop().get()
    reader_procs.stop().get()


if __name__ == "__main__":
    main()
