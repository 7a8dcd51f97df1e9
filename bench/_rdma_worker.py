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

    @endpoint
    def raw_server(self, ip: str) -> int:
        """A plain TCP sender of this buffer's bytes (no authentication, no encryption): the
        link's own speed, the baseline across hosts."""
        import socket
        import threading

        ls = socket.socket()
        ls.bind((ip, 0))
        ls.listen(4)
        data = memoryview(self.t.numpy())

        def serve() -> None:
            while True:
                c, _ = ls.accept()
                while c.recv(1):
                    c.sendall(data)

        threading.Thread(target=serve, daemon=True).start()
        return ls.getsockname()[1]


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
    def raw_read(self, ip: str, port: int, n: int, reps: int) -> list[float]:
        import socket

        buf = bytearray(n)
        mv = memoryview(buf)
        out = []
        with socket.create_connection((ip, port)) as c:
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                c.sendall(b"x")
                got = 0
                while got < n:
                    got += c.recv_into(mv[got:])
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
    workers = os.environ.get("BENCH_WORKERS", "")
    if workers:
        # two hosts: the owner on the first, the reader on the second
        from monarch_nb.actor import attach_to_workers

        hosts = attach_to_workers(workers=workers.split(","), ca=os.environ["BENCH_KEY"])
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        owners_procs, reader_procs = procs.slice(hosts=0), procs.slice(hosts=1)
        owner_ip = workers.split(",")[0][len("tcp://") :].rsplit(":", 1)[0]
    else:
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
            # the controller only waits for the reply: its CPU time over the transfers' wall time
            c0, w0 = time.process_time(), time.perf_counter()
            t = statistics.median(reader.time_op.call_one(buf, n, reps, op).get())
            cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
            res[f"{op}_{n}"] = {"median_s": t, "GBps": n / t / 1e9, "controller_cpu_fraction": cpu}
        if workers:
            port = owner.raw_server.call_one(owner_ip).get()
            t = statistics.median(reader.raw_read.call_one(owner_ip, port, n, reps).get())
            res[f"rawtcp_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
        if floor:
            t = statistics.median(reader.memcpy.call_one(n, reps).get())
            res[f"memcpy_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
    print(json.dumps(res))
    if workers:
        procs.stop().get()
    else:
        owners_procs.stop().get()
        reader_procs.stop().get()


if __name__ == "__main__":
    main()
