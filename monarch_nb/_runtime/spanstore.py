"""The allocator's copy of its procs' spans: drained from each proc's ring, kept with a bound.

Every proc's ring (spans.py) is drained about once a second while it records (its state,
sampled each second while it works, says so) and on every query, so spans
outlive the proc that recorded them and the controller (a restarted kernel reads them back
from here). Bounds: the last ``PER_PROC`` spans of each proc, for the ``PROCS`` procs seen
most recently, and ``TOTAL`` in all (the procs polled longest ago go first); spans a proc
recorded in its last second before it died are lost with it, in its last ``IDLE_ASK_S`` (10 s)
if it recorded so few that its CPU time did not move a clock tick (telemetry.py); those of a
stopped mesh are not: its procs are drained as they are told to stop. Spans are kept as tuples with interned
names, about 250 bytes each, so the bounds cost at most about 64 MiB (attributes extra).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import operator
import sys
import time
from array import array
from typing import TYPE_CHECKING, Any

from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from ..config import env_int

if TYPE_CHECKING:
    from .allocator import Allocator
    from .procs import ProcRec

PER_PROC = env_int("MONARCH_NB_SPANS_PER_PROC", 4096, 1)
PROCS = env_int("MONARCH_NB_SPAN_PROCS", 256, 1)
TOTAL = env_int("MONARCH_NB_SPANS_TOTAL", 262144, 1)

#: what each kept span holds (the proc's mesh, rank, host and pid are kept once per proc)
_FIELDS = ("seq", "kind", "name", "actor", "method", "actor_rank", "start", "duration", "outcome", "thread", "attrs")


class _Kept:
    """One proc's kept spans. A drain's packed columns are kept as they came and made into
    tuples only when something reads ``spans`` (a query, a dashboard): the allocator drains
    every proc every second, on cores it shares with the procs it serves, and a busy proc's
    4096 records take it about 1 ms to unpack; most of them are never read."""

    __slots__ = ("_npacked", "_packed", "_spans", "cursor", "dropped", "mcount", "meta", "metrics")

    def __init__(self, meta: dict[str, Any]) -> None:
        self.cursor = 0
        #: the proc's count of metric values as of the last drain (-1: none yet)
        self.mcount = -1
        self.dropped = 0
        self.meta = meta
        self._spans: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=PER_PROC)
        self.metrics: list[dict[str, Any]] = []
        #: packed drains not unpacked yet, oldest first: (columns, clock offset, records above
        #: the cursor then, that cursor)
        self._packed: list[tuple[tuple[Any, ...], float, int, int]] = []
        self._npacked = 0

    def add_packed(self, cols: tuple[Any, ...], off: float, cursor: int) -> None:
        n = max(0, len(cols[1]) - max(0, cursor + 1 - cols[0]))
        if not n:
            return
        self._packed.append((cols, off, n, cursor))
        self._npacked += n
        # a drain whose records the newer ones push out of the bound is never unpacked
        while self._npacked - self._packed[0][2] >= PER_PROC:
            self._npacked -= self._packed.pop(0)[2]

    @property
    def spans(self) -> collections.deque[tuple[Any, ...]]:
        if self._packed:
            if self._npacked >= PER_PROC:
                self._spans.clear()
            for cols, off, _, cursor in self._packed:
                self._spans.extend(_unpack(cols, off, cursor))
            self._packed.clear()
            self._npacked = 0
        return self._spans

    def __len__(self) -> int:
        return min(PER_PROC, len(self._spans) + self._npacked)


class SpanStore:
    def __init__(self, alloc: Allocator) -> None:
        self.alloc = alloc
        self.kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self._port = 0
        self._index: dict[int, str] = {}
        self._next = 0
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        self.total = 0

    def _open(self) -> int:
        if not self._port:
            self._port = self.alloc.rt.open_port(self._on_drain)
        return self._port

    def stale(self, rec: ProcRec, version: tuple[int, int]) -> bool:
        """Whether a drain of ``rec``, whose ring and metrics stand at ``version``
        (``spans.version()`` in the proc), would find anything not kept here yet."""
        k = self.kept.get(rec.token)
        if k is None:
            return True
        self.kept.move_to_end(rec.token)  # seen now, though not drained: kept as long as the others
        last, mcount = version
        return last > k.cursor or mcount != k.mcount

    def poll(self, rec: ProcRec) -> asyncio.Future[None] | None:
        """Ask one running proc for the spans it recorded since the last drain."""
        if rec.state != "running" or not rec.addr:
            return None
        k = self.kept.get(rec.token)
        if k is None:
            m = self.alloc.meshes.get(rec.mesh)
            k = self.kept[rec.token] = _Kept(
                {
                    "mesh": rec.mesh,
                    "rank": rec.rank,
                    "host": self.alloc.rt.hostname,
                    # which incarnation of the name: a mesh stopped and spawned again under it is
                    # another, and a query of the name means the newest (telemetry._query)
                    "mesh_id": m.info.get("mesh_id", "") if m is not None else "",
                    "mesh_started": m.created if m is not None else 0.0,
                }
            )
            while len(self.kept) > PROCS:
                self.total -= len(self.kept.popitem(last=False)[1])
        self.kept.move_to_end(rec.token)
        k.meta["pid"] = rec.pid
        i = self._next
        self._next += 1
        self._index[i] = rec.token
        body, bufs = dumps(((k.cursor, PER_PROC), {}))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(rec.token, []).append(fut)
        try:
            self.alloc.rt.send_actor(
                rec.addr, "__spans__", "drain", body, bufs, reply=(self.alloc.rt.ipc_addr, self._open()), index=i
            )
        except Exception:
            self._index.pop(i, None)
            self._release(rec.token)
            return None
        return fut

    def _release(self, token: str) -> None:
        for f in self._waiting.pop(token, []):
            if not f.done():
                f.set_result(None)

    def _on_drain(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        token = self._index.pop(index, "")
        k = self.kept.get(token)
        if status == wire.OK and k is not None:
            got = loads(body, bufs)
            meta = k.meta
            before = len(k)
            if got["spans"] is None:
                k.add_packed(got["cols"], got["off"], k.cursor)
            else:  # a proc that predates the packed form, or whose ring had a gap
                intern = sys.intern
                for s in got["spans"]:
                    if s["seq"] > k.cursor:
                        k.spans.append(
                            (
                                s["seq"],
                                intern(s["kind"]),
                                intern(s["name"]),
                                intern(s["actor"]),
                                intern(s["method"]),
                                s["actor_rank"],
                                s["start"],
                                s["duration"],
                                intern(s["outcome"]),
                                s["thread"],
                                s.get("attrs"),
                            )
                        )
            self.total += len(k) - before
            k.dropped += got["dropped"]
            k.cursor = max(k.cursor, got["last"])
            k.mcount = got.get("mcount", -1)
            k.metrics = [dict(m, **meta) for m in got["metrics"]]
            while self.total > TOTAL and len(self.kept) > 1:
                _, old = self.kept.popitem(last=False)
                self.total -= len(old)
        self._release(token)

    async def collect(self, mesh: str | None, since: float | None, timeout: float = 2.0) -> dict[str, Any]:
        """Drain every running proc (of ``mesh``) now, then everything kept that matches."""
        await self._drain(mesh, timeout)
        spans: list[dict[str, Any]] = []
        metrics: list[dict[str, Any]] = []
        dropped = 0
        for k in self.kept.values():
            if mesh is not None and k.meta["mesh"] != mesh:
                continue
            dropped += k.dropped
            metrics.extend(k.metrics)
            meta = k.meta
            spans.extend(dict(zip(_FIELDS, s), **meta) for s in k.spans if since is None or s[6] + s[7] >= since)
        return {
            "now": time.time(),
            "host": self.alloc.rt.hostname,
            "spans": spans,
            "metrics": metrics,
            "dropped": dropped,
            "incarnations": self.incarnations(mesh),
        }

    def incarnations(self, mesh: str | None) -> list[tuple[str, str, float]]:
        """``(name, mesh id, started)`` of every incarnation of ``mesh`` (None: of every name)
        this allocator runs or keeps spans of: the caller picks the newest of each name from
        these, also where the newest has no span in the window asked about yet."""
        out = {(k.meta["mesh"], k.meta.get("mesh_id", ""), k.meta.get("mesh_started", 0.0)) for k in self.kept.values()}
        out.update((m.name, m.info.get("mesh_id", ""), m.created) for m in self.alloc.meshes.values())
        return sorted(i for i in out if mesh is None or i[0] == mesh)

    async def _drain(self, mesh: str | None, timeout: float) -> None:
        futs = [
            f for r in list(self.alloc.by_token.values()) if mesh is None or r.mesh == mesh if (f := self.poll(r)) is not None
        ]
        if futs:
            await asyncio.wait(futs, timeout=timeout)

    async def summarize(
        self, mesh: str | None, since: float | None, timeout: float = 2.0, max_errors: int = 1000
    ) -> dict[str, Any]:
        """``collect``'s spans reduced here, per proc, to what a dashboard shows: the endpoint calls'
        count, median and p95 duration (all calls, and per name for stragglers) and the spans that
        failed in full. A 128-rank mesh's 30 s of calls are tens of thousands of spans; sending
        their summary, not them, keeps a dashboard's refresh cheap whatever the call rate."""
        await self._drain(mesh, timeout)
        procs: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for k in self.kept.values():
            if mesh is not None and k.meta["mesh"] != mesh:
                continue
            calls: list[float] = []
            names: dict[tuple[str, str], list[float]] = {}
            for sp in k.spans:
                if since is not None and sp[6] + sp[7] < since:
                    continue
                if sp[1] == "call":
                    calls.append(sp[7])
                if sp[8] == "error":
                    errors.append(dict(zip(_FIELDS, sp), **k.meta))
                else:
                    # stragglers compare latencies of calls that completed: a call that raised
                    # at once, or spent its time formatting a traceback, says nothing of the rank
                    names.setdefault((sp[1], sp[2]), []).append(sp[7])
            if not names and not calls:
                continue
            calls.sort()
            procs.append(
                {
                    **k.meta,
                    "calls": _stats(calls),
                    "names": [(kind, name, *_stats(sorted(d))) for (kind, name), d in names.items()],
                }
            )
        return {
            "now": time.time(),
            "host": self.alloc.rt.hostname,
            "procs": procs,
            "errors": errors[-max_errors:],
            "incarnations": self.incarnations(mesh),
        }


_OUTCOME = {True: "ok", False: "error"}


def _unpack(cols: tuple[Any, ...], off: float, cursor: int) -> Any:
    """A packed drain (``spans.drain_packed``) as kept tuples (``_FIELDS``), made by C code
    but for one tuple per distinct key (an endpoint's calls share theirs)."""
    first, keys, t0b, t1b = cols
    t0, t1 = array("d"), array("d")
    t0.frombytes(t0b)
    t1.frombytes(t1b)
    table: dict[int, tuple[Any, ...]] = {}
    for k in keys:
        if id(k) not in table:
            kind, name, actor, rank, ok, attrs, tid = k
            call = kind == "call"
            table[id(k)] = (
                sys.intern(kind),
                sys.intern(f"{actor}.{name}" if call else name),
                sys.intern(actor),
                sys.intern(name if call else ""),
                rank,
                _OUTCOME[bool(ok)],
                tid,
                attrs,
            )
    per = list(map(table.__getitem__, map(id, keys)))
    g = operator.itemgetter
    rows = zip(
        range(first, first + len(keys)),
        map(g(0), per),
        map(g(1), per),
        map(g(2), per),
        map(g(3), per),
        map(g(4), per),
        map(off.__add__, t0),
        map(operator.sub, t1, t0),
        map(g(5), per),
        map(g(6), per),
        map(g(7), per),
    )
    # records at or below the cursor were kept from an earlier drain
    return itertools.islice(rows, max(0, cursor + 1 - first), None)


def _stats(d: list[float]) -> tuple[int, float, float]:
    """Count, median and p95 of sorted durations."""
    if not d:
        return 0, 0.0, 0.0
    n = len(d)
    med = d[n // 2] if n % 2 else (d[n // 2 - 1] + d[n // 2]) / 2
    return n, med, d[min(n - 1, int(n * 0.95))]
