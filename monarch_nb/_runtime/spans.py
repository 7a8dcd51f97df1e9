"""This process's spans and metrics: a fixed-size ring written on every endpoint call.

Recording is on the hot path of every call, so it is one ``next()`` on a shared counter and
a few slot stores into preallocated columns: no lock (``next`` on ``itertools.count`` is
atomic under the GIL), no allocation but a small key tuple (an endpoint's recurring
``(kind, name, actor, rank, ok, attrs, thread)`` is shared by its records), and times kept
as raw ``perf_counter`` seconds, turned into wall-clock time only when they are read.

The allocator drains the ring through the ``__spans__`` system actor (answered on the I/O
thread, so a busy actor still answers; the columns go as they are, see
:func:`drain_packed`); a record the ring overwrote before it was drained is lost and
counted as ``dropped``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from array import array
from typing import Any

from ..config import env_int

#: records each process keeps between drains (a power of two)
RING = 1 << env_int("MONARCH_NB_SPAN_RING_BITS", 13, 1, 24)
_MASK = RING - 1

# the ring, as columns: a slot's number is stored last, so a slot that holds number ``s``
# holds record ``s`` (unless a writer a whole ring ahead lapped it meanwhile)
_nums = array("q", bytes(8 * RING))
_t0s = array("d", bytes(8 * RING))
_t1s = array("d", bytes(8 * RING))
#: each slot's (kind, name, actor, rank, ok, attrs, thread)
_keys: list[Any] = [None] * RING
_seq = itertools.count(1)
#: about the last sequence number stored (writers race to set it; drain reads on past it)
_last = [0]


_offset = [time.time() - time.perf_counter()]
#: how far a newly read offset must move to replace the last one (a wall-clock step)
_OFFSET_STEP_S = 1e-3


def _wall_offset() -> float:
    """What turns a ``perf_counter`` time into wall-clock time, read at each drain: a base read
    once (when the zygote imported this) went stale for good when the wall clock was stepped or
    the machine suspended (the monotonic clock stops, the wall clock does not), and every span
    after that fell outside ``query(since=...)``. Two reads differ by microseconds (the clocks
    are read one after the other), so the last one stands until the wall clock moved: a span's
    times are the same in every drain that carries it."""
    off = time.time() - time.perf_counter()
    if abs(off - _offset[0]) > _OFFSET_STEP_S:
        _offset[0] = off
    return _offset[0]


_metrics: dict[tuple[Any, ...], list[float]] = {}
_mlock = threading.Lock()
#: values folded into ``_metrics`` so far: with ``_last``, whether a drain would find anything new
_mcount = [0]


def call_key(actor: str, method: str, rank: int, ok: bool) -> tuple[Any, ...]:
    """The key of this thread's calls of ``actor.method`` (for :func:`record`): an actor's
    thread keeps its own, so that a call's record is no lookup and no ``get_ident``."""
    return ("call", method, actor, rank, ok, None, threading.get_ident())


def record(key: tuple[Any, ...], t0: float, t1: float) -> None:
    """One endpoint call under a key from :func:`call_key`, made on this thread."""
    i = next(_seq)
    j = i & _MASK
    _t0s[j] = t0
    _t1s[j] = t1
    _keys[j] = key
    _nums[j] = i
    _last[0] = i  # a hint for drain, which reads on past it


def record_span(name: str, actor: str, rank: int, t0: float, t1: float, ok: bool, attrs: dict[str, Any] | None) -> None:
    """A user span (``telemetry.span``) in this process."""
    i = next(_seq)
    j = i & _MASK
    _t0s[j] = t0
    _t1s[j] = t1
    _keys[j] = ("span", name, actor, rank, ok, attrs or None, threading.get_ident())
    _nums[j] = i
    _last[0] = i  # a hint for drain, which reads on past it


def record_metric(meter: str, name: str, kind: str, value: float, attrs: tuple[tuple[str, Any], ...]) -> None:
    """Fold ``value`` into the aggregate (count, sum, min, max, last) of one instrument and attribute set."""
    key = (meter, name, kind, attrs)
    with _mlock:
        _mcount[0] += 1
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


def version() -> tuple[int, int]:
    """``(last, metric values)``: a drain after ``last`` (the ``last`` a drain returned) finds
    nothing new while this stays the same. A proc's ``__sys__`` state carries it, and its
    allocator drains only a proc that changed (see telemetry.py)."""
    return _last[0], _mcount[0]


def drain(after: int) -> dict[str, Any]:
    """Records with a sequence number above ``after`` still in the ring, as dicts with
    wall-clock ``start`` (seconds) and ``duration``; also the metrics' aggregates."""
    last = _last[0]
    lo = max(after, last - RING)
    out = []
    dropped = max(0, last - RING - after)
    off = _wall_offset()
    last = lo
    # up to the first slot not yet stored: _last may lag (or, set by a slower writer, trail)
    # the newest record, and a numbered record may not be stored yet (its writer lost the GIL
    # in between); the next drain starts there rather than skip it for good
    for s in range(lo + 1, lo + RING + 1):
        j = s & _MASK
        n = _nums[j]
        if n < s:
            break
        last = s
        if n > s:
            continue  # overwritten by a writer that lapped us: counted in dropped
        kind, name, actor, rank, ok, attrs, tid = _keys[j]
        t0, t1 = _t0s[j], _t1s[j]
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
    mcount = _mcount[0]  # read before the metrics: a value folded in between is drained again
    return {
        "last": last,
        "dropped": dropped,
        "spans": out,
        "mcount": mcount,
        "metrics": _metrics_now(),
        "now": time.time(),
        "pid": os.getpid(),
    }


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
    """The newest ``limit`` records above ``after``, as the ring's columns: what the allocator drains.

    It runs on the proc's I/O thread, which holds the GIL meanwhile, so every call in flight
    waits for it: a full ring as :func:`drain`'s dicts took 3-8 ms there with the pickling,
    once a second at a high call rate; slices of the columns take C code tens of µs. ``spans``
    is ``None`` and ``cols`` holds ``(first seq, keys, t0 bytes, t1 bytes)`` (a key per record,
    see ``_keys``) for consecutive sequence numbers from ``first``; when they are not
    consecutive (a writer between numbering and storing, or one that lapped us) :func:`drain`
    answers instead. Records older than the newest ``limit`` are skipped (the allocator keeps
    no more than that per proc), not counted as dropped."""
    last = max(_last[0], after)  # _last may trail what an earlier drain returned (racing writers)
    lo = max(after, last - min(limit, RING))
    a, b = (lo + 1) & _MASK, (last & _MASK) + 1
    if last <= lo:
        nums, keys, t0s, t1s = array("q"), [], array("d"), array("d")
    elif a < b:
        nums, keys, t0s, t1s = _nums[a:b], _keys[a:b], _t0s[a:b], _t1s[a:b]
    else:
        nums, keys, t0s, t1s = _nums[a:] + _nums[:b], _keys[a:] + _keys[:b], _t0s[a:] + _t0s[:b], _t1s[a:] + _t1s[:b]
    if nums != array("q", range(lo + 1, last + 1)):
        d = drain(lo)
        d["dropped"] = max(d["dropped"], last - RING - after, 0)
        return d
    mcount = _mcount[0]
    return {
        "last": last,
        "dropped": max(0, last - RING - after),
        "spans": None,
        "cols": (lo + 1, keys, t0s.tobytes(), t1s.tobytes()),
        "off": _wall_offset(),
        "mcount": mcount,
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
