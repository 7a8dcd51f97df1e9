"""The first call after a pause, as a notebook user makes it, beside Monarch's.

    python -m bench.cold_call [--monarch-python PATH] [--runs 2]

Each system in its own process, in turn (``--runs`` times each): one actor in one proc of
this host; warm ``call_one().get()``s, then calls each made after a pause of 1 ms, 20 ms and
200 ms (``time.sleep``: the processes sit idle, as between a notebook's cells). Also times a
300-iteration Python loop, first and second time after each pause: how much colder the
machine makes any code, and the floor's raw round trip (two Python processes, a blocking
AF_UNIX pair, 64 bytes each way: ``bench.floor``) after the same pauses: the least any call
made from Python can cost there; and a bare Python RPC (``python_rpc``: the call and its value
pickled, one thread a side, with the system calls our proc makes per call): the least a call
through Python objects costs. ``--walk-mib N`` copies N MiB before each pause, as the other
system's round does before our first call in ``python -m bench``. Prints JSON: medians in µs
per pause, per run, and ratios ours ÷ Monarch, ours ÷ raw and ours ÷ python_rpc of the medians
over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import select
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench import floor

PAUSES_MS = (0, 1, 20, 200)


def _tiny() -> int:
    x = 0
    for i in range(300):
        x += i
    return x


def _machine() -> dict[str, Any]:
    """The loop's first and second run after each pause (µs)."""
    out: dict[str, Any] = {}
    for ms in PAUSES_MS:
        first, second = [], []
        for _ in range(30):
            if ms:
                time.sleep(ms / 1e3)
            t0 = time.perf_counter_ns()
            _tiny()
            t1 = time.perf_counter_ns()
            _tiny()
            t2 = time.perf_counter_ns()
            first.append(t1 - t0)
            second.append(t2 - t1)
        out[f"pause_{ms}ms"] = {"first": statistics.median(first) / 1e3, "second": statistics.median(second) / 1e3}
    return out


def _walker() -> Callable[[], None]:
    """A copy of ``--walk-mib`` MiB (0: none; the children read it from their environment), as
    another system's round in ``python -m bench`` does to the caches before our first call."""
    mib = int(os.environ.get("BENCH_COLD_WALK_MIB", "0"))
    if not mib:
        return lambda: None
    src, dst = bytearray(os.urandom(1 << 20)) * mib, bytearray(mib << 20)

    def walk() -> None:
        dst[:] = src

    return walk


def _after_pauses(call: Callable[[], object]) -> dict[str, float]:
    """``call``'s median time (µs), made after each pause in turn."""
    out: dict[str, float] = {}
    walk = _walker()
    for ms in PAUSES_MS:
        xs = []
        for _ in range(15 if ms >= 200 else 40):
            walk()
            if ms:
                time.sleep(ms / 1e3)
            t0 = time.perf_counter()
            call()
            xs.append(time.perf_counter() - t0)
        out[f"pause_{ms}ms"] = statistics.median(xs) * 1e6
    return out


def _raw() -> dict[str, float]:
    """The floor's round trip, the first after each pause (µs, medians)."""
    with floor.echo_peer() as a:
        msg = floor.message()
        buf = bytearray(floor.MSG)
        view = memoryview(buf)

        def once() -> None:
            a.sendall(msg)
            floor.recv_exact(a, buf, view)

        for _ in range(300):
            once()
        return _after_pauses(once)


#: a pickled call's or value's length prefix, in the bare Python RPC
_LEN = struct.Struct("<I")


class _Echo:
    def ping(self) -> int:
        return 1


def _serve_calls(b: socket.socket) -> None:
    """(A forked peer.) Serve pickled calls one at a time, on one thread, with the system calls
    our proc makes for one: a poll wake-up, a read, two epoll_ctl, a write."""
    obj, buf = _Echo(), bytearray(65536)
    ep, p = select.epoll(), select.poll()
    ep.register(b.fileno(), select.EPOLLONESHOT)
    p.register(b.fileno(), select.POLLIN)
    b.setblocking(False)
    while True:
        p.poll()
        if not b.recv_into(buf):
            return
        (n,) = _LEN.unpack_from(buf, 0)
        method, args = pickle.loads(buf[4 : 4 + n])
        ep.modify(b.fileno(), select.EPOLLIN | select.EPOLLONESHOT)  # watched while it runs
        out = pickle.dumps(getattr(obj, method)(*args))
        ep.modify(b.fileno(), select.EPOLLONESHOT)
        b.send(_LEN.pack(len(out)) + out)


def _python_rpc() -> dict[str, float]:
    """A bare Python call's round trip, the first after each pause (µs, medians): the call and
    its value pickled, one thread a side, no futures, no ordering, no supervision; the least a
    call made through Python objects costs here."""
    with floor.forked_peer(_serve_calls) as a:
        poller, buf = select.poll(), bytearray(65536)
        a.setblocking(False)

        def once() -> object:
            out = pickle.dumps(("ping", ()))
            a.send(_LEN.pack(len(out)) + out)
            poller.register(a.fileno(), select.POLLIN)
            poller.poll()
            poller.unregister(a.fileno())
            a.recv_into(buf)
            (n,) = _LEN.unpack_from(buf, 0)
            return pickle.loads(buf[4 : 4 + n])

        for _ in range(300):
            once()
        return _after_pauses(once)


def _child(impl: str) -> None:
    rdir = ""
    if impl == "nb":
        rdir = tempfile.mkdtemp(prefix="mnbk-", dir="/tmp")
        os.chmod(rdir, 0o700)
        os.environ["MONARCH_NB_RUNTIME_DIR"] = rdir
        from monarch_nb.actor import Actor, endpoint, this_host
    else:
        from monarch.actor import Actor, endpoint, this_host  # type: ignore[no-redef]

    class Echo(Actor):  # type: ignore[misc, valid-type]
        @endpoint  # type: ignore[misc]
        def ping(self) -> int:
            return 1

    pm = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        am = pm.spawn("cold", Echo)
        for _ in range(300):
            am.ping.call_one().get()
        print(json.dumps(_after_pauses(lambda: am.ping.call_one().get())), flush=True)
        pm.stop().get()
    finally:
        if impl == "nb":
            from monarch_nb.allocator import stop_allocator

            stop_allocator()
            shutil.rmtree(rdir, ignore_errors=True)


def _run(python: str, impl: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONARCH_NB_", "MONARCH_", "HYPERACTOR_"))}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([python, "-m", "bench.cold_call", "--child", impl], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} run failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_call")
    ap.add_argument("--monarch-python", default="", help="an interpreter with torchmonarch (the peer)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--walk-mib", type=int, default=0, help="MiB to copy before each pause (evicts the caches)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.walk_mib:
        os.environ["BENCH_COLD_WALK_MIB"] = str(a.walk_mib)
    if a.child:
        _child(a.child)
        return 0
    runs: dict[str, list[dict[str, float]]] = {"monarch_nb": [], "raw": [], "python_rpc": []}
    if a.monarch_python:
        runs["monarch"] = []
    for _ in range(a.runs):
        runs["monarch_nb"].append(_run(sys.executable, "nb"))
        runs["raw"].append(_raw())
        runs["python_rpc"].append(_python_rpc())
        if a.monarch_python:
            runs["monarch"].append(_run(a.monarch_python, "monarch"))
    med = {impl: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for impl, rs in runs.items()}
    out: dict[str, Any] = {
        "command": " ".join(["python", "-m", "bench.cold_call", *sys.argv[1:]]),
        "loadavg": os.getloadavg(),
        "call_us": runs,
        "median_us": med,
        "machine_loop_us": _machine(),
    }
    out["over_raw"] = {k: med["monarch_nb"][k] / med["raw"][k] for k in med["monarch_nb"]}
    out["over_python_rpc"] = {k: med["monarch_nb"][k] / med["python_rpc"][k] for k in med["monarch_nb"]}
    if "monarch" in med:
        out["ratio"] = {k: med["monarch_nb"][k] / med["monarch"][k] for k in med["monarch_nb"]}
        out["raw_over_monarch"] = {k: med["raw"][k] / med["monarch"][k] for k in med["raw"]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
