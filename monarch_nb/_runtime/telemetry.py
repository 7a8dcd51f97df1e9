"""What an allocator knows about its host and procs, sampled about once a second.

CPU and RSS per proc and for the host come from the OS (psutil), without asking the procs;
what a proc is doing (idle, or busy in which endpoint; calls served, time spent) comes from
its ``__sys__`` actor, answered by its I/O thread, so a busy or paused actor still answers.
GPU utilisation and memory come from NVML when a GPU and ``pynvml`` are present.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import psutil

from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from .runtime import sleep_to_tick
from .spanstore import SpanStore

if TYPE_CHECKING:
    from .allocator import Allocator
    from .procs import ProcRec

logger = logging.getLogger(__name__)

INTERVAL = 1.0


class Telemetry:
    def __init__(self, alloc: Allocator) -> None:
        self.alloc = alloc
        self.host: dict[str, Any] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._prev: dict[str, tuple[float, int, int]] = {}  # token -> (time, lines, calls)
        self._port = 0
        self._index: dict[str, int] = {}  # proc token -> the reply index its state comes back with
        self._token: dict[int, str] = {}
        self._next = 0
        self._nvml: Any = None
        self._nvml_tried = False
        #: spans drained from the procs (spanstore.py)
        self.spans = SpanStore(alloc)

    async def run(self) -> None:
        psutil.cpu_percent(None)  # the first reading only starts the measurement
        self._port = self.alloc.rt.open_port(self._on_state)
        while True:
            try:
                self.sample()
            except Exception:
                logger.exception("telemetry sample failed")
            await sleep_to_tick(self.alloc.rt.loop, INTERVAL)

    def sample(self) -> None:
        vm = psutil.virtual_memory()
        self.host = {
            "cpu_percent": psutil.cpu_percent(None),
            "cpus": psutil.cpu_count() or 1,
            "mem_used": vm.total - vm.available,
            "mem_total": vm.total,
            "load": list(psutil.getloadavg()),
            "gpus": self._gpus(),
            "time": time.time(),
        }
        now = time.monotonic()
        args = dumps(((), {}))
        for rec in list(self.alloc.by_token.values()):
            if rec.state != "running" or not rec.pid:
                self._procs.pop(rec.pid, None)
                continue
            t = rec.tele
            p = self._procs.get(rec.pid)
            try:
                if p is None:
                    p = self._procs[rec.pid] = psutil.Process(rec.pid)
                    p.cpu_percent(None)
                t["cpu_percent"] = p.cpu_percent(None)
                t["rss"] = p.memory_info().rss
            except psutil.Error:
                self._procs.pop(rec.pid, None)
                continue
            lines = rec.log.nlines if rec.log else 0
            calls = int(t.get("calls", 0))
            prev = self._prev.get(rec.token)
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                t["lines_per_s"] = round((lines - prev[1]) / dt, 1)
                t["calls_per_s"] = round((calls - prev[2]) / dt, 1)
            self._prev[rec.token] = (now, lines, calls)
            if rec.addr:
                # its spans are drained when its state says there are new ones (_on_state)
                i = self._index.get(rec.token, -1)
                if i < 0:
                    i = self._index[rec.token] = self._next
                    self._token[i] = rec.token
                    self._next += 1
                try:
                    self.alloc.rt.send_actor(
                        rec.addr, "__sys__", "state", args[0], args[1], reply=(self.alloc.rt.ipc_addr, self._port), index=i
                    )
                except Exception:
                    pass
        for tok in set(self._prev) - set(self.alloc.by_token):
            del self._prev[tok]
            self._token.pop(self._index.pop(tok, -1), None)

    def _on_state(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        if status != wire.OK:
            return
        actors = loads(body, bufs)
        rec = self.alloc.by_token.get(self._token.get(index, ""))
        if rec is not None and rec.state == "running":
            # An idle proc is not asked for spans it does not have: a drain that finds none costs
            # it a wake-up and the GIL every second, and the allocator a message each way per proc
            version = actors.pop("__spans__", None)
            if version is None or self.spans.stale(rec, version):
                self.spans.poll(rec)
            _absorb(rec, actors)

    def _gpus(self) -> list[dict[str, Any]]:
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                self._nvml = None
        nv = self._nvml
        if nv is None:
            return []
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out.append({"index": i, "util_percent": util.gpu, "mem_used": mem.used, "mem_total": mem.total})
        except Exception:
            return []
        return out


def _absorb(rec: ProcRec, actors: dict[str, dict[str, Any]]) -> None:
    """Fold a proc's actor states into its telemetry: what it is doing, calls served, time per call."""
    actors = dict(actors)
    moved = actors.pop("__dataplane__", None)
    failures = actors.pop("__failures__", None)
    user = {n: a for n, a in actors.items() if not n.startswith("__")}
    # shown by the names actor meshes were spawned under, not their spawn ids (``name#spawn``)
    busy: list[str] = []
    doing: list[str] = []
    queued = 0
    for n, a in actors.items():
        ms = a.get("busy") or []
        # every call running, an async actor's concurrent endpoints too: `fetch ×3` for three of one
        for m in dict.fromkeys(ms):
            k = ms.count(m)
            busy.append(f"{n.partition('#')[0]}.{m}" + (f" ×{k}" if k > 1 else ""))
            doing.append(busy[-1])
        q = int(a.get("queued", 0) or 0)
        if q and ms:
            # the calls waiting behind this actor's: a caller whose call hangs sees it is in line
            doing[-1] += f" ({q} queued)"
            queued += q
    calls = sum(int(a.get("calls", 0)) for a in actors.values())
    busy_s = sum(float(a.get("busy_s", 0.0)) for a in actors.values())
    t = rec.tele
    if failures:
        # an actor failed while its proc lives on: the rank is failed (_meshhtml.rank_state)
        first = failures["actors"][0]
        why = (first.get("reason") or "").strip().splitlines()
        t["actor_failed"] = f"actor {first.get('actor')} failed: {why[-1] if why else 'no reason given'}"
    t["actors"] = sorted({n.partition("#")[0] for n in user})
    t["busy"] = busy
    t["queued"] = queued
    t["activity"] = ("busy in " + ", ".join(doing)) if doing else "idle"
    t["calls"] = calls
    t["mean_call_ms"] = round(1000 * busy_s / calls, 3) if calls else 0.0
    if moved:
        t["bytes_moved"] = int(moved.get("total", 0))
