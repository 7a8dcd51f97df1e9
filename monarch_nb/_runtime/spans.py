"""This process's spans and metrics: a fixed-size ring written on every endpoint call.

Recording is on the hot path of every call, so it is one ``next()`` on a shared counter and
one slot store into a preallocated list: no lock (``next`` on ``itertools.count`` is atomic
under the GIL), no allocation beyond the record tuple, and times kept as raw
``perf_counter`` seconds, turned into wall-clock time only when the allocator drains them.

The allocator drains the ring through the ``__spans__`` system actor (answered on the I/O
thread, so a busy actor still answers); a record the ring overwrote before it was drained
is lost and counted as ``dropped``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from array import array
from typing import Any

#: records each process keeps between drains (a power of two)
RING = 1 << int(os.environ.get("MONARCH_NB_SPAN_RING_BITS", "13"))
_MASK = RING - 1

_ring: list[Any] = [None] * RING
_seq = itertools.count(1)
#: about the last sequence number stored (writers race to set it; drain reads on past it)
_last = [0]
#: perf_counter and wall clock read together once: converts recorded times at drain
_BASE_PERF = time.perf_counter()
_BASE_WALL = time.time()

_metrics: dict[tuple[Any, ...], list[float]] = {}
_mlock = threading.Lock()


def record_call(actor: str, method: str, rank: int, t0: float, t1: float, ok: bool) -> None:
    """One endpoint call: ``t0``/``t1`` are the ``perf_counter()`` readings around it."""
    i = next(_seq)
    _ring[i & _MASK] = (i, "call", method, actor, rank, t0, t1, ok, None, threading.get_ident())
    _last[0] = i  # a hint for drain, which reads on past it


def record_span(name: str, actor: str, rank: int, t0: float, t1: float, ok: bool, attrs: dict[str, Any] | None) -> None:
    """A user span (``telemetry.span``) in this process."""
    i = next(_seq)
    _ring[i & _MASK] = (i, "span", name, actor, rank, t0, t1, ok, attrs or None, threading.get_ident())
    _last[0] = i


def record_metric(meter: str, name: str, kind: str, value: float, attrs: tuple[tuple[str, Any], ...]) -> None:
    """Fold ``value`` into the aggregate (count, sum, min, max, last) of one instrument and attribute set."""
    key = (meter, name, kind, attrs)
    with _mlock:
        m = _metrics.get(key)
        if m is None:
            _metrics[key] = [1, value, value, value, value]
        else:
            m[0] += 1
            m[1] += value
            if value < m[2]:
                m[2] = value
            if value > m[3]:
                m[3] = value
            m[4] = value


def drain(after: int) -> dict[str, Any]:
    """Records with a sequence number above ``after`` still in the ring, as dicts with
    wall-clock ``start`` (seconds) and ``duration``; also the metrics' aggregates."""
    last = _last[0]
    lo = max(after, last - RING)
    out = []
    dropped = max(0, last - RING - after)
    off = _BASE_WALL - _BASE_PERF
    last = lo
    # up to the first slot not yet stored: _last may lag (or, set by a slower writer, trail)
    # the newest record, and a numbered record may not be stored yet (its writer lost the GIL
    # in between); the next drain starts there rather than skip it for good
    for s in range(lo + 1, lo + RING + 1):
        r = _ring[s & _MASK]
        if r is None or r[0] < s:
            break
        last = s
        if r[0] > s:
            continue  # overwritten by a writer that lapped us: counted in dropped
        _, kind, name, actor, rank, t0, t1, ok, attrs, tid = r
        d = {
            "seq": s,
            "kind": kind,
            "name": f"{actor}.{name}" if kind == "call" else name,
            "actor": actor,
            "method": name if kind == "call" else "",
            "actor_rank": rank,
            "start": t0 + off,
            "duration": t1 - t0,
            "outcome": "ok" if ok else "error",
            "thread": tid,
        }
        if attrs:
            d["attrs"] = attrs
        out.append(d)
    return {"last": last, "dropped": dropped, "spans": out, "metrics": _metrics_now(), "now": time.time(), "pid": os.getpid()}


def _metrics_now() -> list[dict[str, Any]]:
    with _mlock:
        return [
            {
                "meter": k[0],
                "name": k[1],
                "kind": k[2],
                "attrs": dict(k[3]),
                "count": v[0],
                "sum": v[1],
                "min": v[2],
                "max": v[3],
                "last": v[4],
            }
            for k, v in _metrics.items()
        ]


def drain_packed(after: int, limit: int = RING) -> dict[str, Any]:
    """The newest ``limit`` records above ``after``, as columns: what the allocator drains.

    It runs on the proc's I/O thread, which holds the GIL meanwhile, so every call in flight
    waits for it: a full ring as :func:`drain`'s dicts took about 6 ms there (and as long again
    to pickle), once a second at a high call rate. Here the ring is sliced, transposed and the
    times packed by C code (about 0.3 ms for 4096 records). ``spans`` is ``None`` and
    ``cols`` holds ``(first seq, kinds, names, actors, ranks, t0 bytes, t1 bytes, oks,
    attrs, tid bytes)`` for consecutive sequence numbers from ``first``; records that were
    not consecutive (a writer that lost the GIL between numbering and storing, or one that
    lapped us) go through :func:`drain` instead. Older records than the newest ``limit`` are
    skipped (the allocator keeps no more than that per proc), not counted as dropped."""
    last = max(_last[0], after)  # _last may trail what an earlier drain returned (racing writers)
    lo = max(after, last - min(limit, RING))
    recs: list[Any] = []
    if last > lo:
        a, b = (lo + 1) & _MASK, (last & _MASK) + 1
        recs = _ring[a:b] if a < b else _ring[a:] + _ring[:b]
    cols: list[tuple[Any, ...]] = list(zip(*recs)) if recs and None not in recs else [()] * 10
    if recs and cols[0] != tuple(range(lo + 1, last + 1)):
        d = drain(lo)
        d["dropped"] = max(d["dropped"], last - RING - after, 0)
        return d
    _, kinds, names, actors, ranks, t0s, t1s, oks, attrs, tids = cols
    dropped = max(0, last - RING - after)
    # a record stored since _last was read (or whose writer has not set _last yet) goes with
    # the next drain, which starts at ``last``
    return {
        "last": last,
        "dropped": dropped,
        "spans": None,
        "cols": (
            lo + 1,
            kinds,
            names,
            actors,
            ranks,
            array("d", t0s).tobytes(),
            array("d", t1s).tobytes(),
            oks,
            attrs,
            array("Q", tids).tobytes(),
        ),
        "off": _BASE_WALL - _BASE_PERF,
        "metrics": _metrics_now(),
        "now": time.time(),
        "pid": os.getpid(),
    }


class SpanSource:
    """The ``__spans__`` system actor: how an allocator drains this process's ring."""

    def sys_drain(self, after: int = 0, limit: int = 0) -> dict[str, Any]:
        # ``limit`` (records wanted at most) asks for the packed form: allocators that predate
        # it get dicts
        return drain_packed(after, limit) if limit else drain(after)
