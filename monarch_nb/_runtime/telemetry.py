"""What an allocator knows about its host and procs, sampled about once a second.

CPU and RSS per proc and for the host come from the OS (psutil), without asking the procs;
what a proc is doing (idle, or busy in which endpoint; calls served, time spent) comes from
its ``__sys__`` actor, answered by its I/O thread, so a busy or paused actor still answers.
GPU utilisation and memory come from NVML when a GPU and ``pynvml`` are present.

Asking a proc wakes it (its I/O thread takes the GIL, and a call it serves meanwhile waits),
so a proc is asked each second only while somebody looks (a status request in the last
``LOOK_S``: a dashboard, the sidebar, ``%mesh status``) or while it works (its last answer
said busy or new calls or spans, or the OS says it spent CPU since); an idle proc nobody looks
at is asked every ``IDLE_ASK_S``. A look that finds states older than a tick asks for them at
once and waits up to ``FIRST_LOOK_S`` for the answers (:meth:`Telemetry.fresh`). A proc's
death is not seen here: the zygote's exit message or a pidfd says so (procs.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
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
#: how long after a status request the procs are asked each second (a consumer polls more often)
LOOK_S = 5.0
#: how often an idle proc nobody looks at is asked anyway (its few spans drained, a change seen)
IDLE_ASK_S = 10.0
#: how long a first look waits for the states it asked for (a proc's I/O thread answers in ms;
#: one whose actor holds the GIL in a long C call shows its last state)
FIRST_LOOK_S = 0.5


class Telemetry:
    def __init__(self, alloc: Allocator) -> None:
        self.alloc = alloc
        self.host: dict[str, Any] = {}
        #: per proc pid: its process, and when its CPU time was read and what it was (-1: not yet)
        self._procs: dict[int, tuple[psutil.Process, list[float]]] = {}
        #: when memory, load and GPUs were read (each look's, not each tick's)
        self._host_read = -math.inf
        self._prev: dict[str, tuple[float, int]] = {}  # token -> (time, log lines)
        self._port = 0
        self._index: dict[str, int] = {}  # proc token -> the reply index its state comes back with
        self._token: dict[int, str] = {}
        self._next = 0
        #: when a status request last came (``LOOK_S``)
        self._looked = -math.inf
        #: per proc token: when its state was last asked for and came back, its CPU time then
        self._asked: dict[str, float] = {}
        self._answered: dict[str, float] = {}
        self._cpu: dict[str, float] = {}
        #: procs whose last answer said they work (busy, or calls or spans since the one before)
        self._working: set[str] = set()
        #: (answer indexes a look waits for, woken when none is left)
        self._first_look: tuple[set[int], asyncio.Future[None]] | None = None
        #: the procs a look's asks went to, by their answers' indexes
        self._looks: dict[int, str] = {}
        self._nvml: Any = None
        self._nvml_tried = False
        #: spans drained from the procs (spanstore.py)
        self.spans = SpanStore(alloc)

    async def run(self) -> None:
        psutil.cpu_percent(None)  # the first reading only starts the measurement
        self._port = self.alloc.rt.open_port(self._on_state)
        failing = ""  # the failure last logged: said once, not every tick (out of descriptors, say)
        while True:
            try:
                self.sample()
            except Exception as e:
                if repr(e) != failing:
                    failing = repr(e)
                    logger.exception("telemetry sample failed (logged again only when the failure changes)")
            else:
                if failing:
                    failing = ""
                    logger.info("telemetry samples again")
            await sleep_to_tick(self.alloc.rt.loop, INTERVAL)

    def sample(self) -> None:
        now = time.monotonic()
        looking = now - self._looked < LOOK_S
        # CPU time is read every tick, looked at or not: it is what a look's CPU% is measured
        # from, and how a proc that starts working is noticed without asking it. What is read at
        # the moment it is shown (memory, load, GPUs, RSS) is read only for a look
        self.host["cpu_percent"] = psutil.cpu_percent(None)
        if looking:
            self._read_host(now)
        for rec in list(self.alloc.by_token.values()):
            if rec.state != "running" or not rec.pid:
                self._procs.pop(rec.pid, None)
                continue
            t = rec.tele
            p = self._procs.get(rec.pid)
            try:
                if p is None:
                    p = self._procs[rec.pid] = (psutil.Process(rec.pid), [now, -1.0])
                times = p[0].cpu_times()
                if looking:
                    t["rss"] = p[0].memory_info().rss
            except psutil.Error:
                self._procs.pop(rec.pid, None)
                continue
            # CPU time moves in clock ticks (10 ms): an idle proc's own wake-ups add one about
            # once a minute, a proc serving calls at once
            cpu = times.user + times.system
            then, cpu0 = p[1]
            t["cpu_percent"] = round(100 * (cpu - cpu0) / (now - then), 1) if cpu0 >= 0 and now > then else 0.0
            p[1][:] = [now, cpu]
            lines = rec.log.nlines if rec.log else 0
            prev = self._prev.get(rec.token)
            if prev is not None and now > prev[0]:
                t["lines_per_s"] = round((lines - prev[1]) / (now - prev[0]), 1)
            self._prev[rec.token] = (now, lines)
            tok = rec.token
            if (
                looking
                or tok in self._working
                or cpu != self._cpu.get(tok)
                or now - self._asked.get(tok, -math.inf) >= IDLE_ASK_S
            ):
                self._cpu[tok] = cpu
                self._ask(rec, now)
        for tok in set(self._prev) - set(self.alloc.by_token):
            del self._prev[tok]
            self._token.pop(self._index.pop(tok, -1), None)
            for d in (self._asked, self._answered, self._cpu):
                d.pop(tok, None)
            self._working.discard(tok)
        if self._looks:
            # asks of looks that a proc gone since never answered
            for i, tok in list(self._looks.items()):
                if tok not in self.alloc.by_token:
                    del self._looks[i]

    def _read_host(self, now: float) -> None:
        vm = psutil.virtual_memory()
        self.host.update(
            {
                "cpus": psutil.cpu_count() or 1,
                "mem_used": vm.total - vm.available,
                "mem_total": vm.total,
                "load": list(psutil.getloadavg()),
                "gpus": self._gpus(),
                "time": time.time(),
            }
        )
        self._host_read = now

    def _ask(self, rec: ProcRec, now: float, look: bool = False) -> int:
        """Ask a proc for its state (answered to ``_on_state``); returns the answer's index. A
        look's ask has an index of its own: an answer to an earlier ask is not the one it waits for."""
        if not rec.addr:
            return -1
        # its spans are drained when its state says there are new ones (_on_state)
        i = self._index.get(rec.token, -1)
        if look:
            i = self._next
            self._looks[i] = rec.token
            self._next += 1
        elif i < 0:
            i = self._index[rec.token] = self._next
            self._token[i] = rec.token
            self._next += 1
        self._asked[rec.token] = now
        try:
            self.alloc.rt.send_actor(
                rec.addr, "__sys__", "state", *_EMPTY_ARGS, reply=(self.alloc.rt.ipc_addr, self._port), index=i
            )
        except Exception:
            pass
        return i

    async def fresh(self) -> None:
        """A status request: the procs are asked each second from now on for ``LOOK_S``, and
        those whose last state is older than a tick (every one, at the first look in a while)
        are asked now, waited for up to ``FIRST_LOOK_S`` (what a look shows is no staler than
        while somebody keeps looking)."""
        now = time.monotonic()
        # the first look in a while asks every proc: one asked a moment ago because its CPU time
        # moved may have started a call since (later looks show what the ticks bring, as before)
        first = now - self._looked >= LOOK_S
        self._looked = now
        # read at the moment shown, as every tick reads them while somebody looks
        stale_host = now - self._host_read > 1.5 * INTERVAL
        if stale_host:
            self._read_host(now)
        for rec in list(self.alloc.by_token.values()):
            if rec.state == "running" and rec.pid and (stale_host or "rss" not in rec.tele):
                try:
                    p = self._procs.get(rec.pid)
                    if p is None:
                        p = self._procs[rec.pid] = (psutil.Process(rec.pid), [now, -1.0])
                    rec.tele["rss"] = p[0].memory_info().rss
                    rec.tele.setdefault("cpu_percent", 0.0)  # measured from the next tick on
                except psutil.Error:
                    pass
                # a rate's start: the next tick's rate covers what it printed from now on
                self._prev.setdefault(rec.token, (now, rec.log.nlines if rec.log else 0))
        if not self._port:
            return
        stale = []
        for r in list(self.alloc.by_token.values()):
            if r.state != "running" or not r.addr:
                continue
            asked, answered = self._asked.get(r.token, -math.inf), self._answered.get(r.token, -math.inf)
            if now - answered <= (0.0 if first else 1.5 * INTERVAL):
                continue
            if asked > answered and now - asked > FIRST_LOOK_S:
                # it left an earlier ask unanswered (an actor holding the GIL in a C call): every
                # look would wait for it in vain; its last state is shown
                continue
            stale.append(r)
        if not stale:
            return
        if self._first_look is None:
            self._first_look = (set(), self.alloc.rt.loop.create_future())
        waiting, fut = self._first_look
        for r in stale:
            waiting.add(self._ask(r, now, look=True))
        try:
            await asyncio.wait_for(asyncio.shield(fut), FIRST_LOOK_S)
        except TimeoutError:
            pass
        finally:
            # answers that did not come in time are shown by the next look, not waited for again
            if self._first_look is not None and self._first_look[1] is fut:
                self._first_look = None

    def _on_state(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        tok = self._token.get(index) or self._looks.pop(index, "")
        look = self._first_look
        if look is not None:
            look[0].discard(index)
            if not look[0] and not look[1].done():
                look[1].set_result(None)
        if status != wire.OK:
            return
        actors = loads(body, bufs)
        rec = self.alloc.by_token.get(tok)
        if rec is not None and rec.state == "running":
            now = time.monotonic()
            # An idle proc is not asked for spans it does not have: a drain that finds none costs
            # it a wake-up and the GIL every second, and the allocator a message each way per proc
            version = actors.pop("__spans__", None)
            new_spans = version is None or self.spans.stale(rec, version)
            if new_spans:
                self.spans.poll(rec)
            t = rec.tele
            calls0, then = int(t.get("calls", 0)), self._answered.get(tok)
            _absorb(rec, actors)
            calls = int(t["calls"])
            if then is not None and now > then:
                # over the time since its last answer: an idle proc is asked seldom, and served none
                t["calls_per_s"] = round((calls - calls0) / (now - then), 1)
            self._answered[tok] = now
            if t["busy"] or calls != calls0 or new_spans:
                self._working.add(tok)
            else:
                self._working.discard(tok)

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


_EMPTY_ARGS = dumps(((), {}))
