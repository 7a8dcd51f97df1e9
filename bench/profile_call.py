"""Where the time of one ``call_one`` goes, on monarch_nb (a breakdown for docs/performance.md).

    python -m bench.profile_call [--calls 2000] [--async] [--gap-ms G [--thrash]] [--payload KIND:MIB]

With ``--payload`` (``bytes:16``, ``numpy:16``, ``torch:64``) every call is an echo of that payload, as
``python -m bench``'s payload rows (the copies into shared memory fall in the write phases).
With ``--gap-ms`` every call follows a pause of G ms (``--thrash``: another process walks
48 MiB meanwhile, as the peer's round does in ``python -m bench``): the breakdown of a cold call.

Timestamps come from ``time.perf_counter_ns`` (CLOCK_MONOTONIC, shared by every process of
the host), taken by instrumenting the runtime objects in place: the controller's send and
receive, and — through an actor that patches its own process — the proc's receive, the
endpoint's start and the reply's send. Also reports CPU time per call of controller, proc
and allocator, which is steadier than wall time on a loaded machine. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

_RDIR = tempfile.mkdtemp(prefix="mnbp-", dir="/tmp")
os.chmod(_RDIR, 0o700)
os.environ["MONARCH_NB_RUNTIME_DIR"] = _RDIR

from monarch_nb.actor import Actor, endpoint, this_host  # noqa: E402

T = time.perf_counter_ns


def _instrument(rt: Any, log: list[tuple[str, int]], peer: str, what: Any) -> None:
    """Record when this runtime dispatches a message ``what(meta)`` accepts, and sends to ``peer``."""
    from monarch_nb._wire import frames as wire

    dispatch, send = rt.transport.dispatch, rt.sender._send_frames

    def timed_dispatch(msg: Any, *rest: Any) -> None:
        t = T()
        try:
            if what(wire.decode(msg)[:2]):
                log.append(("recv", t))
        except Exception:
            pass
        dispatch(msg, *rest)

    def timed_send(addr: str, frames: list[Any], *rest: Any) -> Any:
        t = T()
        r = send(addr, frames, *rest)
        if addr == peer:
            log.append(("send0", t))
            log.append(("send1", T()))
        return r

    take_own = getattr(rt.receiver, "take_own", None)

    def timed_take_own(frames: Any, actor: str) -> Any:
        # a proc's idle sync actor reads its calls itself: "recv" is when its thread has one
        t = T()
        r = take_own(frames, actor)  # type: ignore[misc]
        if r is not None and what((wire.ACTOR, r[0])):
            log.append(("recv", t))
        return r

    port_reply = getattr(rt.receiver, "port_reply", None)

    def timed_port_reply(pv: Any) -> None:
        # a reply its caller read itself, parsed already (_replyread)
        t = T()
        if what((wire.PORT, tuple(pv[:3]))):
            log.append(("recv", t))
        port_reply(pv)  # type: ignore[misc]

    # every send through the runtime (a reply, a call to many, a call whose thread has no
    # connection to its proc yet) ends in the sender's send_frames; a call to one actor goes
    # straight to the thread's direct connection (_instrument_direct)
    rt.transport.dispatch, rt.sender._send_frames = timed_dispatch, timed_send
    # a caller blocked on its reply reads it itself (actor/_replyread.py), delivering it through
    # the receiver, which the I/O thread reaches through its own reference
    rt.receiver.dispatch = timed_dispatch
    if port_reply is not None:
        rt.receiver.port_reply = timed_port_reply
    if take_own is not None:
        rt.receiver.take_own = timed_take_own


def _instrument_direct(log: list[tuple[str, int]]) -> None:
    """Record this thread's writes on its direct connections (a call to one actor goes there)."""
    import threading

    from monarch_nb._runtime import fastpath

    send_one, me = fastpath.Sender.send_one, threading.get_ident()

    def timed_send_one(self: Any, frame: bytes) -> None:
        t = T()
        send_one(self, frame)
        if threading.get_ident() == me:
            log.append(("send0", t))
            log.append(("send1", T()))

    fastpath.Sender.send_one = timed_send_one  # type: ignore[method-assign]


class Probe(Actor):
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    @endpoint
    def install(self, controller: str) -> int:
        return _install(self.log, controller)

    @endpoint
    def ping(self) -> int:
        self.log.append(("fn", T()))
        return 0

    @endpoint
    def echo(self, x: Any) -> Any:
        self.log.append(("fn", T()))
        return x

    @endpoint
    def dump(self) -> list[tuple[str, int]]:
        out, self.log[:] = list(self.log), []
        return out


class AsyncProbe(Probe):
    @endpoint
    async def install(self, controller: str) -> int:  # type: ignore[override]
        return _install(self.log, controller)

    @endpoint
    async def ping(self) -> int:  # type: ignore[override]
        self.log.append(("fn", T()))
        return 0

    @endpoint
    async def echo(self, x: Any) -> Any:  # type: ignore[override]
        self.log.append(("fn", T()))
        return x

    @endpoint
    async def dump(self) -> list[tuple[str, int]]:  # type: ignore[override]
        out, self.log[:] = list(self.log), []
        return out


def _install(log: list[tuple[str, int]], controller: str) -> int:
    from monarch_nb.actor import _context

    _instrument(_context.runtime(), log, controller, lambda km: km[0] == 1 and km[1][1] in ("ping", "echo"))
    return os.getpid()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Gap:
    """A pause before a call: a sleep, or another process walking memory (evicting caches)."""

    _WALK = (
        "import sys, time, numpy as np\n"
        "a = np.ones(6 << 20); idx = np.random.permutation(len(a))[: 1 << 20]\n"
        "for line in sys.stdin:\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < float(line): a[idx] += 1.0\n"
        "    print(flush=True)\n"
    )

    def __init__(self, seconds: float, thrash: bool) -> None:
        import subprocess

        self.seconds = seconds
        self.walker = (
            subprocess.Popen([sys.executable, "-c", self._WALK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if thrash
            else None
        )

    def wait(self) -> None:
        w = self.walker
        if w is None or w.stdin is None or w.stdout is None:
            time.sleep(self.seconds)
            return
        w.stdin.write(f"{self.seconds}\n")
        w.stdin.flush()
        w.stdout.readline()

    def close(self) -> None:
        if self.walker is not None:
            self.walker.kill()
            self.walker.wait()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_call")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--async", dest="use_async", action="store_true", help="an async actor")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="pause before each call (a cold call)")
    ap.add_argument("--thrash", action="store_true", help="during the pause another process walks 48 MiB")
    ap.add_argument("--payload", default="", help="KIND:MIB (bytes, numpy or torch): echo it instead of a ping")
    a = ap.parse_args()
    if a.payload:
        from .workloads import make_payload

        kind, mib = a.payload.split(":")
        x = make_payload(kind, int(mib) << 20)
    else:
        x = None
    gap = _Gap(a.gap_ms / 1e3, a.thrash) if a.gap_ms > 0 else None
    from monarch_nb.actor import _context
    from monarch_nb.allocator import list_allocators, stop_allocator

    try:
        pm = this_host().spawn_procs(per_host={"gpus": 1}, name="profile")
        am = pm.spawn("p", AsyncProbe if a.use_async else Probe)
        rt = _context.runtime()
        proc_pid = am.install.call_one(rt.ipc_addr).get()
        alloc_pid = int(list_allocators()[0]["pid"])
        call = (lambda: am.echo.call_one(x)) if x is not None else am.ping.call_one
        for _ in range(200 if x is None else 5):
            call().get()
        am.dump.call_one().get()
        ctl: list[tuple[str, int]] = []
        proc_addr = am._procs[0].addr
        # replies come on fresh ports; heartbeats and logs on the watch/log ports
        quiet = {getattr(w, "event_port", -1) for w in rt.supervision.watches.values()} | {_context.client().log_port}
        _instrument(rt, ctl, proc_addr, lambda km: km[0] == 2 and km[1][0] not in quiet)
        _instrument_direct(ctl)
        cpu0 = (time.process_time(), _cpu(proc_pid), _cpu(alloc_pid))
        w0 = time.perf_counter()
        starts, ends = [], []
        for _ in range(a.calls):
            if gap is not None:
                gap.wait()
            starts.append(T())
            y = call().get()
            ends.append(T())
            del y
        wall = time.perf_counter() - w0
        cpu1 = (time.process_time(), _cpu(proc_pid), _cpu(alloc_pid))
        ctl_log = list(ctl)
        ctl.clear()
        proc_log = am.dump.call_one().get()
        pm.stop().get()
    finally:
        if gap is not None:
            gap.close()
        stop_allocator()
        shutil.rmtree(_RDIR, ignore_errors=True)

    # pair the events of call i: controller send0/send1/recv, proc recv/fn/send0/send1
    def split(log: list[tuple[str, int]], kinds: tuple[str, ...]) -> dict[str, list[int]]:
        d: dict[str, list[int]] = {k: [] for k in kinds}
        for k, t in log:
            if k in d:
                d[k].append(t)
        return d

    c = split(ctl_log, ("send0", "send1", "recv"))
    p = split(proc_log, ("recv", "fn", "send0", "send1"))
    # the first reply the proc logged is the one to the `dump` that emptied its log
    p["send0"], p["send1"] = p["send0"][1:], p["send1"][1:]
    n = min(a.calls, *(len(v) for v in c.values()), *(len(v) for v in p.values()))
    phases = {
        "controller: call_one() until its write": [c["send0"][i] - starts[i] for i in range(n)],
        "controller: the write (it wakes the proc)": [c["send1"][i] - c["send0"][i] for i in range(n)],
        "wire out: written until the proc has read it": [p["recv"][i] - c["send0"][i] for i in range(n)],
        "proc: read until endpoint body runs": [p["fn"][i] - p["recv"][i] for i in range(n)],
        # from the reply's write call: a cold write returns after the controller has read it
        "proc: endpoint body until the reply is written": [p["send0"][i] - p["fn"][i] for i in range(n)],
        "wire back: written until the controller has read it": [c["recv"][i] - p["send0"][i] for i in range(n)],
        "controller: read until .get() returns": [ends[i] - c["recv"][i] for i in range(n)],
    }
    total = [ends[i] - starts[i] for i in range(n)]
    out = {
        "calls": n,
        "actor": "async" if a.use_async else "sync",
        "payload": a.payload or None,
        "gap_ms": a.gap_ms,
        "thrash": a.thrash,
        "loadavg": os.getloadavg(),
        "round_trip_median_us": statistics.median(total) / 1e3,
        "round_trip_p99_us": sorted(total)[int(0.99 * (n - 1))] / 1e3,
        "phases_median_us": {k: round(statistics.median(v) / 1e3, 1) for k, v in phases.items()},
        "cpu_us_per_call": {
            "controller": round((cpu1[0] - cpu0[0]) / a.calls * 1e6, 1),
            "proc": round((cpu1[1] - cpu0[1]) / a.calls * 1e6, 1),
            "allocator": round((cpu1[2] - cpu0[2]) / a.calls * 1e6, 1),
        },
        "wall_us_per_call": round(wall / a.calls * 1e6, 1),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
