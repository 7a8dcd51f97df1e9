"""The benchmark workloads, written once against the Monarch actor API.

The same file runs on monarch_nb and on real Monarch (torchmonarch): only the import below
changes, chosen by ``BENCH_IMPL``. Procs import this module by name (``PYTHONPATH`` holds
``bench/``), so actor classes travel by reference on both systems.

A workload is a class with ``setup()``, ``sample(n) -> list[float]`` (seconds per
measured operation) and ``teardown()``; the worker keeps it set up between rounds so the
runner can alternate between the two systems without paying set-up costs in the figures.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from typing import Any

IMPL = os.environ.get("BENCH_IMPL", "nb")
if IMPL == "monarch":
    from monarch.actor import Actor, endpoint, this_host
else:
    from monarch_nb.actor import Actor, endpoint, this_host

LOG_TAG = b"BENCHLOG "
#: how much of a line the log sink reads for its tag
_HEAD = 4096
#: what the log sink counts: a tag and a line number
_TAGGED = re.compile(re.escape(LOG_TAG) + rb"(\S+) (\S+)")


class Echo(Actor):
    """A sync actor: every endpoint is a ``def``."""

    @endpoint
    def ping(self) -> int:
        return 0

    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def length(self, x: Any) -> int:
        return len(x)

    @endpoint
    def say(self) -> int:
        print("said")
        return 0

    @endpoint
    def bigline(self, tag: str, nbytes: int) -> int:
        print(f"BENCHLOG {tag} 0 " + "x" * nbytes)
        return nbytes

    @endpoint
    def spew(self, tag: str, n: int) -> int:
        for i in range(n):
            print(f"BENCHLOG {tag} {i}")
        return n


class AsyncEcho(Actor):
    """An async actor: every endpoint is an ``async def``."""

    @endpoint
    async def ping(self) -> int:
        return 0

    @endpoint
    async def echo(self, x: Any) -> Any:
        return x


def _procs(n: int, name: str) -> Any:
    return this_host().spawn_procs(per_host={"gpus": n}, name=name) if n else None


_seq = [0]


def _name(prefix: str) -> str:
    _seq[0] += 1
    return f"{prefix}{os.getpid()}x{_seq[0]}"


def _stop(pm: Any) -> None:
    if pm is not None:
        pm.stop().get()


class Spawn:
    """Spawn ``n`` procs, an actor in each, and wait until every rank has replied."""

    def __init__(self, n: int) -> None:
        self.n = n

    def setup(self) -> None:
        # the first spawn of a process pays one-off costs (host agent, allocator connect)
        self.sample(1)

    def sample(self, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            pm = this_host().spawn_procs(per_host={"gpus": self.n}, name=_name("spawn"))
            am = pm.spawn("e", Echo)
            am.ping.call().get()
            out.append(time.perf_counter() - t0)
            _stop(pm)
        return out

    def teardown(self) -> None:
        pass


class _OnMesh:
    """A workload that calls a mesh of ``n`` procs with one actor each."""

    n = 1
    cls: type = Echo

    def setup(self) -> None:
        self.pm = _procs(self.n, _name("m"))
        self.am = self.pm.spawn("e", self.cls)
        self.am.ping.call().get()
        self.sample(max(3, self.warmup))

    warmup = 20

    def teardown(self) -> None:
        _stop(self.pm)


class CallOne(_OnMesh):
    """``call_one`` round trips, one at a time, with ``.get()`` or ``await``."""

    def __init__(self, actor: str, how: str) -> None:
        self.cls = AsyncEcho if actor == "async" else Echo
        self.how = how
        #: "print": a sync actor's endpoint that prints a line (a script shows it before the value)
        self.method = "say" if actor == "print" else "ping"

    def sample(self, k: int) -> list[float]:
        ep = getattr(self.am, self.method)
        if self.how == "await":

            async def run() -> list[float]:
                out = []
                for _ in range(k):
                    t0 = time.perf_counter()
                    await ep.call_one()
                    out.append(time.perf_counter() - t0)
                return out

            return asyncio.run(run())
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            ep.call_one().get()
            out.append(time.perf_counter() - t0)
        return out


class CallAll(_OnMesh):
    """``call()`` to every actor of an ``n``-proc mesh, gathered."""

    warmup = 5

    def __init__(self, n: int) -> None:
        self.n = n

    def sample(self, k: int) -> list[float]:
        ep = self.am.ping
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            ep.call().get()
            out.append(time.perf_counter() - t0)
        return out


class Outstanding(_OnMesh):
    """``m`` calls issued before the first is awaited; one sample is the time for all."""

    warmup = 1

    def __init__(self, m: int) -> None:
        self.m = m

    def sample(self, k: int) -> list[float]:
        ep = self.am.ping
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            futs = [ep.call_one() for _ in range(self.m)]
            for f in futs:
                f.get()
            out.append(time.perf_counter() - t0)
        return out


def make_payload(kind: str, nbytes: int) -> Any:
    if kind == "bytes":
        return os.urandom(1024) * (nbytes // 1024)
    import numpy as np

    arr = np.frombuffer(os.urandom(1024) * (nbytes // 1024), dtype=np.uint8).copy()
    if kind == "numpy":
        return arr
    import torch

    return torch.from_numpy(arr)


def payload_ok(kind: str, a: Any, b: Any) -> bool:
    if kind == "bytes":
        return bool(a == b)
    if kind == "numpy":
        return bool(a.shape == b.shape and (a[:: 1 << 16] == b[:: 1 << 16]).all())
    return bool(a.shape == b.shape and bool((a[:: 1 << 16] == b[:: 1 << 16]).all()))


class Payload(_OnMesh):
    """A payload sent to an actor and echoed back (same host); one sample is the round trip."""

    warmup = 2

    def __init__(self, kind: str, mib: int) -> None:
        self.kind = kind
        self.nbytes = mib << 20

    def setup(self) -> None:
        self.x = make_payload(self.kind, self.nbytes)
        super().setup()

    def sample(self, k: int) -> list[float]:
        ep = self.am.echo
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            y = ep.call_one(self.x).get()
            out.append(time.perf_counter() - t0)
            if not payload_ok(self.kind, self.x, y):
                raise AssertionError(f"{self.kind} payload came back different")
            del y
        return out


class LogSink:
    """Counts distinct ``BENCHLOG <tag> <i>`` lines arriving on this process's stdout fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Condition()
        self.seen: dict[bytes, set[bytes]] = {}
        threading.Thread(target=self._pump, name="bench-logsink", daemon=True).start()

    def _pump(self) -> None:
        # only a line's head is looked at (the tag comes after at most a rank prefix): a 10 MiB
        # line is neither joined nor split here, so the reader's copies do not count in either
        # system's time. The whole lines of a read are searched at once, in C: looping over
        # 10,000 lines in Python took this reader 6-7 ms (GIL held) per sample, the same
        # controller process the system under test runs its I/O in
        head = b""  # the start of a line not finished yet
        while True:
            data = os.read(self.fd, 1 << 20)
            if not data:
                return
            last = data.rfind(b"\n")
            if last < 0:
                if len(head) < _HEAD:
                    head += data[: _HEAD - len(head)]
                continue
            first = data.find(b"\n")
            # the line going on since earlier reads ends here
            hits = _TAGGED.findall(head + data[: min(first, _HEAD)])
            if last > first:
                hits += _TAGGED.findall(memoryview(data)[first + 1 : last])
            head = data[last + 1 : last + 1 + _HEAD]
            if hits:
                with self.lock:
                    for tag, i in hits:
                        self.seen.setdefault(tag, set()).add(i)
                    self.lock.notify_all()

    def wait(self, tag: str, n: int, timeout: float) -> bool:
        t = tag.encode()
        with self.lock:
            ok = self.lock.wait_for(lambda: len(self.seen.get(t, ())) >= n, timeout)
            self.seen.pop(t, None)
            return ok


SINK: LogSink | None = None


class Logs(_OnMesh):
    """An actor prints ``m`` lines; one sample is the time until all reached this controller."""

    warmup = 1

    def __init__(self, m: int) -> None:
        self.m = m

    def setup(self) -> None:
        if IMPL == "monarch":
            from monarch.config import configure

            configure(enable_log_forwarding=True)
        self.pm = _procs(1, _name("logs"))
        if IMPL == "monarch":

            async def opt() -> None:
                await self.pm.logging_option(stream_to_client=True, aggregate_window_sec=None)

            asyncio.run(opt())
        self.am = self.pm.spawn("e", Echo)
        self.am.ping.call().get()
        self.sample(1)

    def sample(self, k: int) -> list[float]:
        assert SINK is not None
        out = []
        for _ in range(k):
            tag = _name("t")
            t0 = time.perf_counter()
            self.am.spew.call_one(tag, self.m).get()
            if not SINK.wait(tag, self.m, 120):
                raise AssertionError(f"not all {self.m} lines reached the controller within 120 s")
            out.append(time.perf_counter() - t0)
        return out


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class CallArg(_OnMesh):
    """``call()`` of one large ``bytes`` argument to every actor of an ``n``-proc mesh, gathered.

    Reports ``peak_over_payload``: this controller's peak resident memory during the call, over
    its resident memory before the payload existed, in payloads (Linux: the peak is reset through
    ``/proc/self/clear_refs`` before each call)."""

    warmup = 1

    def __init__(self, mib: int, n: int) -> None:
        self.n = n
        self.nbytes = mib << 20
        self.extra: dict[str, list[float]] = {}

    def setup(self) -> None:
        self.rss0 = _mib("VmRSS")
        self.x = make_payload("bytes", self.nbytes)
        super().setup()
        self.extra = {}

    def sample(self, k: int) -> list[float]:
        ep = self.am.length
        out = []
        for _ in range(k):
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            t0 = time.perf_counter()
            v = ep.call(self.x).get()
            out.append(time.perf_counter() - t0)
            if set(v.values()) != {self.nbytes}:
                raise AssertionError("an actor got a different argument")
            peak = (_mib("VmHWM") - self.rss0) / (self.nbytes >> 20)
            self.extra.setdefault("peak_over_payload", []).append(peak)
        return out


class LogLine(Logs):
    """A rank prints one line of ``nbytes``; one sample is the time until it reached this controller."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def sample(self, k: int) -> list[float]:
        assert SINK is not None
        out = []
        for _ in range(k):
            tag = _name("t")
            t0 = time.perf_counter()
            self.am.bigline.call_one(tag, self.nbytes).get()
            if not SINK.wait(tag, 1, 120):
                raise AssertionError("the line did not reach the controller within 120 s")
            out.append(time.perf_counter() - t0)
        return out


def build(name: str) -> Any:
    """The workload object for a workload name (see ``bench.spec.WORKLOADS``)."""
    parts = name.split("_")
    if parts[0] == "spawn":
        return Spawn(int(parts[1]))
    if parts[0] == "callone":
        return CallOne(parts[1], parts[2])
    if parts[0] == "call":
        return CallAll(int(parts[1]))
    if parts[0] == "outstanding":
        return Outstanding(int(parts[1]))
    if parts[0] == "payload":
        return Payload(parts[1], int(parts[2].rstrip("MiB")))
    if parts[0] == "logs":
        return Logs(int(parts[1]))
    if parts[0] == "callarg":
        return CallArg(int(parts[1].rstrip("MiB")), int(parts[2]))
    if parts[0] == "logline":
        return LogLine(int(parts[1].rstrip("MiB")) << 20)
    raise ValueError(f"unknown workload {name!r}")
