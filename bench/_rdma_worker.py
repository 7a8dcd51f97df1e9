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
    from monarch.actor import Actor, attach_to_workers, endpoint, this_host
    from monarch.rdma import RDMABuffer
else:
    from monarch_nb.actor import Actor, attach_to_workers, endpoint, this_host
    from monarch_nb.rdma import RDMABuffer

warnings.simplefilter("ignore")
# where the owner's buffer and the reader's tensor live: "cuda" times CUDA IPC between the two
# procs (and, ours only, the staging through pinned host memory a reader without IPC uses)
DEVICE = os.environ.get("BENCH_DEVICE", "cpu")


class Owner(Actor):
    def __init__(self, n: int) -> None:
        self.t = torch.ones(n, dtype=torch.uint8, device=DEVICE)
        self.buf = RDMABuffer(self.t)

    @endpoint
    def get(self) -> RDMABuffer:
        return self.buf

    @endpoint
    def ancestors(self) -> list[int]:
        return _ancestors(os.getpid())

    @endpoint
    def raw_server(self, ip: str) -> int | str:
        """A plain TCP sender of this buffer's bytes (no authentication, no encryption): the
        link's own speed, the baseline across hosts. ``ip`` empty: an AF_UNIX one (its path), the
        socket a staged CUDA transfer between two procs of a host goes through."""
        import socket
        import threading

        if ip:
            ls = socket.socket()
            ls.bind((ip, 0))
        else:
            ls = socket.socket(socket.AF_UNIX)
            ls.bind(f"\0mnb-bench-raw-{os.getpid()}-{id(self)}")
        ls.listen(4)
        # host bytes of the same size (a CUDA buffer's would need a copy first: that is timed apart)
        data = memoryview(self.t.numpy() if DEVICE == "cpu" else bytearray(self.t.numel()))

        def serve() -> None:
            while True:
                c, _ = ls.accept()
                while c.recv(1):
                    c.sendall(data)

        threading.Thread(target=serve, daemon=True).start()
        return ls.getsockname()[1] if ip else ls.getsockname()


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent, its parent, ... (not pid 1)."""
    out = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                s = f.read()
        except OSError:
            break
        pid = int(s[s.rindex(b")") + 2 :].split()[1])
        if pid > 1:
            out.append(pid)
    return out


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads) the processes ``pids`` have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rindex(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


class Reader(Actor):
    @endpoint
    def ancestors(self) -> list[int]:
        return _ancestors(os.getpid())

    @endpoint
    def set_streams(self, k: int) -> None:
        from monarch_nb.config import configure

        configure(rdma_streams=k)

    @endpoint
    def time_op(self, buf: RDMABuffer, n: int, reps: int, op: str) -> list[float]:
        local = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
        local.fill_(2)  # touched: page faults are not part of a transfer
        if op.endswith("_staged"):
            buf._ipc = False  # as for a reader that cannot map the owner's GPU
            op = op[: -len("_staged")]
        out = []
        for _ in range(reps + 1):  # the first one sets up connections and mappings
            t0 = time.perf_counter()
            (buf.read_into(local) if op == "read" else buf.write_from(local)).get()
            out.append(time.perf_counter() - t0)
        return out[1:]

    @endpoint
    def raw_read(self, ip: str, port: int | str, n: int, reps: int) -> list[float]:
        import socket

        buf = bytearray(n)
        mv = memoryview(buf)
        out = []
        if ip:
            conn = socket.create_connection((ip, port))
        else:
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(port)
        with conn as c:
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                c.sendall(b"x")
                got = 0
                while got < n:
                    got += c.recv_into(mv[got:])
                out.append(time.perf_counter() - t0)
        return out[1:]

    @endpoint
    def pinned_copies(self, n: int, reps: int) -> dict[str, list[float]]:
        """Device to pinned host memory and back, ``n`` bytes: what staging adds to the stream."""
        dev = torch.ones(n, dtype=torch.uint8, device=DEVICE)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out: dict[str, list[float]] = {"d2h": [], "h2d": []}
        for _ in range(reps + 1):
            for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize()
                out[name].append(time.perf_counter() - t0)
        return {k: v[1:] for k, v in out.items()}

    @endpoint
    def memcpy(self, n: int, reps: int) -> list[float]:
        a = torch.ones(n, dtype=torch.uint8, device=DEVICE)
        b = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
        out = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            if DEVICE == "cuda":
                b.copy_(a)
                torch.cuda.synchronize()
            else:
                ctypes.memmove(b.data_ptr(), a.data_ptr(), n)
            out.append(time.perf_counter() - t0)
        return out[1:]


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    floor = os.environ.get("BENCH_FLOOR") == "1"
    workers = os.environ.get("BENCH_WORKERS", "")
    monarch = os.environ.get("BENCH_IMPL") == "monarch"
    # stream counts to force (ours, across hosts): "1,2,4"; the unforced row is the default's
    forced = [int(k) for k in os.environ.get("BENCH_STREAMS", "").split(",") if k]
    if workers:
        # two hosts: the owner on the first, the reader on the second
        if monarch:
            # as Monarch's multi-host docs do: its default transport is unix sockets
            from monarch.actor import enable_transport

            enable_transport("tcp")
        hosts = attach_to_workers(workers=workers.split(","), ca="trust_all_connections" if monarch else os.environ["BENCH_KEY"])
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        owners_procs, reader_procs = procs.slice(hosts=0), procs.slice(hosts=1)
        owner_ip = workers.split(",")[0][len("tcp://") :].rsplit(":", 1)[0]
    else:
        owners_procs = this_host().spawn_procs(per_host={"gpus": 1})
        reader_procs = this_host().spawn_procs(per_host={"gpus": 1})
    reader = reader_procs.spawn("reader", Reader)
    # the processes between the controller and the two procs (allocators, zygotes, host agents):
    # their CPU time during a transfer says whether they are on its path
    mine = set(_ancestors(os.getpid())) | {os.getpid()}
    around = set(reader.ancestors.call_one().get())
    res: dict[str, dict[str, float]] = {}
    for n in sizes:
        reps = 20 if n <= (1 << 20) else 5 if n <= (64 << 20) else 2
        if monarch and n > (1 << 20):
            reps = 2  # its TCP fallback moves ~0.1-1 GB/s
        owner = owners_procs.spawn(f"owner{n}", Owner, n)
        buf = owner.get.call_one().get()
        helpers = sorted((around | set(owner.ancestors.call_one().get())) - mine)
        # forced counts only where they split anything (no range is under 1 MiB)
        rows = [(f"_s{k}", k) for k in forced if n > (1 << 20)] if workers and not monarch else []
        for suffix, k in [("", 0), *rows]:
            if workers and not monarch:
                reader.set_streams.call_one(k).get()
            staged = ("read_staged", "write_staged") if DEVICE == "cuda" and not monarch and not workers else ()
            for op in ("read", "write", *staged):
                # the controller only waits for the reply: its CPU time over the transfers' wall time
                c0, a0, w0 = time.process_time(), _cpu(helpers), time.perf_counter()
                t = statistics.median(reader.time_op.call_one(buf, n, reps, op).get())
                wall = time.perf_counter() - w0
                res[f"{op}_{n}{suffix}"] = {
                    "median_s": t,
                    "GBps": n / t / 1e9,
                    "controller_cpu_fraction": (time.process_time() - c0) / wall,
                    "allocators_cpu_fraction": (_cpu(helpers) - a0) / wall,
                    "allocator_pids": helpers,
                }
        if workers:
            port = owner.raw_server.call_one(owner_ip).get()
            t = statistics.median(reader.raw_read.call_one(owner_ip, port, n, reps).get())
            res[f"rawtcp_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
        if floor:
            t = statistics.median(reader.memcpy.call_one(n, reps).get())
            res[f"memcpy_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
            if DEVICE == "cuda" and not workers:
                # a staged transfer's floors: the bytes over a plain AF_UNIX stream between the
                # same two procs, and one pinned copy each way
                path = owner.raw_server.call_one("").get()
                t = statistics.median(reader.raw_read.call_one("", path, n, max(reps, 5)).get())
                res[f"unixstream_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
                for k, ts in reader.pinned_copies.call_one(n, max(reps, 5)).get().items():
                    t = statistics.median(ts)
                    res[f"{k}_{n}"] = {"median_s": t, "GBps": n / t / 1e9}
    names = {}
    for pid in helpers:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                names[str(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")[-100:].strip()
        except OSError:
            names[str(pid)] = "?"
    res["helpers"] = names  # type: ignore[assignment]
    print(json.dumps(res))
    if workers:
        procs.stop().get()
    else:
        owners_procs.stop().get()
        reader_procs.stop().get()


if __name__ == "__main__":
    main()
