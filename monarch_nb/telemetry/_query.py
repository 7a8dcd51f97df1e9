"""Gathering spans from the allocators, and what is made of them: a trace, stragglers."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._runtime import spans as _ring
from .._runtime.records import read_connection_files
from .._runtime.runtime import pid_alive
from ..actor import _context, _debugwait
from ..config import runtime_dir

COLUMNS = [
    "mesh",
    "rank",
    "host",
    "pid",
    "kind",
    "name",
    "actor",
    "method",
    "start",
    "duration",
    "outcome",
    "attributes",
    "clock_offset",
    "mesh_id",
]

#: how a span name reads in every view: a ``%%mesh exec`` cell is a call of the exec
#: namespace's internal actor, whose name would mean nothing to the person who ran the cell
#: (``actor`` and ``method`` keep the internal names)
_SHOWN_AS = {"__mnb_exec__.run": "%%mesh exec"}

#: the incarnations a query keeps: ``latest`` (the newest of each name), ``all``, or a mesh id
LATEST, ALL = "latest", "all"

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(since: Any, now: float | None = None) -> float | None:
    """``since`` as a wall-clock time: None, epoch seconds, a datetime, a timedelta or a
    duration such as ``"30s"``/``"5m"`` (that long before now)."""
    now = time.time() if now is None else now
    if since is None:
        return None
    if isinstance(since, datetime.datetime):
        return since.timestamp()
    if isinstance(since, datetime.timedelta):
        return now - since.total_seconds()
    if isinstance(since, (int, float)) and not isinstance(since, bool):
        return float(since)
    if isinstance(since, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", since)
        if m:
            return now - float(m.group(1)) * _UNITS[m.group(2) or "s"]
    raise ValueError(f"since={since!r}: give epoch seconds, a datetime, a timedelta or a duration such as '30s', '5m', '2h'")


def _target(mesh: Any) -> tuple[str | None, set[tuple[str, int]] | None]:
    """``mesh`` as the allocators file spans: by proc mesh name, and for a ProcMesh or an
    ActorMesh (standing for the whole proc mesh it runs on, as in ``%mesh trace procs``; before,
    such an object matched no span) the (host, pid) of its procs, which name its incarnation."""
    from ..actor import ActorMesh, ProcMesh

    if mesh is None or isinstance(mesh, str):
        return mesh, None
    if isinstance(mesh, (ProcMesh, ActorMesh)) and mesh._procs:
        return str(mesh._procs[0].mesh), {(p.host, p.pid) for p in mesh._procs}
    raise TypeError(f"mesh={mesh!r}: give a proc mesh's name, a ProcMesh or an ActorMesh")


def _incarnation_filter(
    incarnation: str, incs: list[tuple[str, str, float]], rows: list[dict[str, Any]], procs: set[tuple[str, int]] | None
) -> Callable[[dict[str, Any]], bool] | None:
    """Which rows (spans, proc summaries, metrics: each with mesh, mesh_id, host, pid) to keep;
    None: all. A name's spans outlive its mesh: after ``stop()`` and a new spawn under the same
    name (by this kernel or another), the old incarnation's spans are still kept, and a query
    of the name meant both, so a trace spanned two meshes and the old one's ranks could be
    named stragglers of the new. ``incs`` are the allocators' ``(name, mesh id, started)``."""
    if not isinstance(incarnation, str) or not incarnation:
        raise ValueError(f"incarnation={incarnation!r}: give 'latest', 'all' or a mesh id")
    if incarnation == ALL:
        return None
    if incarnation != LATEST:
        if not any(i[1] == incarnation for i in incs):
            known = ", ".join(f"{n} {i}" for n, i, _ in sorted(incs, key=lambda i: -i[2]) if i) or "none"
            raise ValueError(f"incarnation={incarnation!r}: no mesh with that id (incarnations kept: {known})")
        return lambda r: r.get("mesh_id") == incarnation
    if procs is not None:
        # a mesh object: its own incarnation, also once it is stopped and its name reused
        ids = {r.get("mesh_id") for r in rows if (r.get("host"), r.get("pid")) in procs}
        return lambda r: r.get("mesh_id") in ids
    newest: dict[str, tuple[float, str]] = {}
    for name, mid, started in incs:
        if mid and (name not in newest or started > newest[name][0]):
            newest[name] = (started, mid)
    # a name none of whose incarnations has an id (an allocator that predates them): all of it
    return lambda r: r.get("mesh") not in newest or r.get("mesh_id") == newest[r["mesh"]][1]


def _shown(s: dict[str, Any]) -> dict[str, Any]:
    s["name"] = _SHOWN_AS.get(s["name"], s["name"])
    return s


def _targets(addresses: list[str] | None) -> list[str]:
    """This host's allocators (the runtime directory's connection files), those this process
    attached to (``attach_to_workers``, a job's hosts, ``%mesh connect``) and ``addresses``; an
    allocator reached by two addresses is asked once, so its spans are not counted twice."""
    host = socket.gethostname()
    out: dict[str, str] = {}
    for info in read_connection_files(runtime_dir()):
        if info.get("host") == host and not pid_alive(int(info.get("pid", 0))):
            continue
        out[info["addr"]] = str(info.get("alloc_id", ""))
    client = _context.client()
    for a, info in list(client.hellos.items()):
        gone = a.startswith("ipc://") and not os.path.exists(a[len("ipc://") :])
        # one declared lost would only cost the whole timeout and land in ``unreachable``
        if gone or client.rt.supervision.is_lost(a) or a in out:
            continue
        alloc_id = str(info.get("alloc_id", ""))
        if not alloc_id or alloc_id not in out.values():
            out[a] = alloc_id
    return list(out) + [a for a in addresses or [] if a not in out]


def _ask(
    method: str, addresses: list[str] | None, timeout: float, args: Callable[[float], tuple[Any, ...]]
) -> tuple[list[tuple[dict[str, Any], float]], list[str]]:
    """Ask every allocator ``method`` at once (``args(send_time)``): each answer with its clock
    offset, and the allocators that did not answer (``addr: error``)."""
    client = _context.client()
    asked = []
    targets = _targets(addresses)
    client.revive_lost(targets, timeout)  # the hellos to those declared lost: at once, in the timeout
    for a in targets:
        t_send = time.time()
        asked.append((a, t_send, client.request(a, method, *args(t_send))))
    answers: list[tuple[dict[str, Any], float]] = []
    errors: list[str] = []
    for addr, t_send, fut in asked:
        try:
            with _debugwait.quiet():
                got = fut.get(timeout=timeout)
        except Exception as e:
            errors.append(f"{addr}: {type(e).__name__}: {e}")
            continue
        t_recv = time.time()
        # NTP's estimate: the allocator's clock minus ours, from its readings on arrival and reply
        answers.append((got, ((got.get("received", got["now"]) - t_send) + (got["now"] - t_recv)) / 2))
    return answers, errors


def _gather(
    mesh: Any, since: float | None, addresses: list[str] | None, timeout: float, incarnation: str = LATEST
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    name, procs = _target(mesh)
    # allocators filter in their own clock: a second's slack covers any offset, trimmed below
    answers, errors = _ask("spans", addresses, timeout, lambda _t: (name, None if since is None else since - 1.0))
    spans: list[dict[str, Any]] = []
    mets: list[dict[str, Any]] = []
    incs: list[tuple[str, str, float]] = []
    for got, offset in answers:
        for s in got["spans"]:
            s["start"] -= offset
            s["clock_offset"] = offset
            spans.append(_shown(s))
        mets.extend(got["metrics"])
        incs.extend(tuple(i) for i in got.get("incarnations", ()))
    if name is not None and procs is None and not incs and not errors:
        _warn_unknown(name, addresses, timeout)
    keep = _incarnation_filter(incarnation, incs, spans, procs)
    if keep is not None:
        spans = [s for s in spans if keep(s)]
        mets = [m for m in mets if keep(m)]
    if name is None:
        # this process's own spans (span() in the notebook itself), on our clock
        for s in _ring.drain(0)["spans"]:
            if s["kind"] == "span":
                s.update(mesh="(controller)", rank=0, host=socket.gethostname(), pid=os.getpid(), clock_offset=0.0)
                spans.append(s)
    if since is not None:
        spans = [s for s in spans if s["start"] + s["duration"] >= since]
    spans.sort(key=lambda s: s["start"])
    return spans, mets, errors


def _warn_unknown(name: str, addresses: list[str] | None, timeout: float) -> None:
    """A name no allocator has a proc mesh of found nothing, silently: an actor mesh's name
    (``query("trainers")`` for ``procs.spawn("trainers", ...)``) or a typo read as an idle mesh."""
    answers, _ = _ask("spans", addresses, timeout, lambda t: (None, t + 3600.0))
    known = sorted({str(i[0]) for got, _ in answers for i in got.get("incarnations", ())})
    # the warning points at the caller's line, whichever public function it called
    here, level, frame = os.path.dirname(__file__), 1, sys._getframe(0)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"telemetry: no proc mesh named {name!r} on the allocators asked (proc meshes: {', '.join(known) or 'none'}); "
        "mesh is a proc mesh's name: for an actor mesh, pass the ActorMesh itself",
        stacklevel=level,
    )


def query_records(
    mesh: Any = None,
    since: Any = None,
    addresses: list[str] | None = None,
    timeout: float = 10.0,
    incarnation: str = LATEST,
) -> list[dict[str, Any]]:
    """``query()`` as a list of dicts (no pandas needed)."""
    spans, _, _ = _gather(mesh, parse_since(since), addresses, timeout, incarnation)
    return [{c: s.get("attrs") if c == "attributes" else s.get(c) for c in COLUMNS} for s in spans]


def _frame(rows: list[dict[str, Any]], columns: list[str]) -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "telemetry.query() returns a pandas DataFrame and pandas is not installed: "
            "pip install 'monarch-nb[telemetry]' (or use telemetry.query_records() for a list of dicts)"
        ) from None
    return pd.DataFrame(rows, columns=columns)


def query(
    mesh: Any = None,
    since: Any = None,
    addresses: list[str] | None = None,
    timeout: float = 10.0,
    incarnation: str = LATEST,
) -> Any:
    """Spans of every rank (of ``mesh``: a proc mesh's name, or a ProcMesh or ActorMesh for the
    proc mesh it runs on) since ``since`` from every attached allocator (and ``addresses``), as a pandas DataFrame sorted by start: columns ``mesh, rank, host, pid,
    kind`` (``call`` or ``span``), ``name, actor, method, start`` (epoch seconds on this
    machine's clock: each host's offset is applied), ``duration`` (seconds), ``outcome``
    (``ok``/``error``), ``attributes``, ``clock_offset`` and ``mesh_id``.

    A name reused after a stop names several meshes (incarnations), each with its own
    ``mesh_id``: ``incarnation="latest"`` (the default) keeps the newest of each name (of a
    ProcMesh or ActorMesh given as ``mesh``: its own), ``"all"`` every one, a mesh id that one."""
    return _frame(query_records(mesh, since, addresses, timeout, incarnation), COLUMNS)


def metrics(mesh: Any = None, addresses: list[str] | None = None, timeout: float = 10.0, incarnation: str = LATEST) -> Any:
    """Every rank's instruments (``get_meter``): meter, name, kind, attrs, count, sum, min,
    max, last, with mesh, rank, host and mesh_id (``incarnation`` as in :func:`query`); a pandas DataFrame."""
    _, mets, _ = _gather(mesh, None, addresses, timeout, incarnation)
    cols = ["mesh", "rank", "host", "meter", "name", "kind", "attrs", "count", "sum", "min", "max", "last", "mesh_id"]
    return _frame([{c: m.get(c) for c in cols} for m in mets], cols)


def _rows(spans: Any) -> list[dict[str, Any]]:
    if hasattr(spans, "to_dict"):
        return list(spans.to_dict("records"))
    return list(spans)


#: the fewest completed calls of a name a rank needs before it is compared with the others:
#: one call's duration (a first call's import, a rank that raised) says nothing of the rank
MIN_CALLS = 3


def stragglers(spans: Any, factor: float = 2.0, kind: str | None = "call", min_calls: int = MIN_CALLS) -> list[dict[str, Any]]:
    """Ranks slower than the others: for each span name (of ``kind``; None: every kind) of a
    mesh, among the ranks with at least ``min_calls`` spans of it that completed (outcome
    ``ok``: a span that raised is an error, not a latency), and at least two such ranks, a rank
    whose median duration exceeds ``factor`` times the median of the other ranks' medians (so
    the fastest rank never is one). Returns dicts (mesh, mesh_id, name, rank, host, calls,
    median_s, typical_s, ratio), the slowest first."""
    _check(factor, min_calls)
    per: dict[tuple[str, Any, str], dict[int, list[float]]] = {}
    hosts: dict[tuple[str, Any, int], str] = {}
    for s in _rows(spans):
        if kind is not None and s.get("kind") != kind:
            continue
        if s.get("outcome", "ok") != "ok":
            continue
        mid = s.get("mesh_id")
        per.setdefault((s["mesh"], mid, s["name"]), {}).setdefault(int(s["rank"]), []).append(float(s["duration"]))
        hosts[(s["mesh"], mid, int(s["rank"]))] = s.get("host") or ""
    return _flag(
        {key: {r: (len(d), statistics.median(d)) for r, d in ranks.items()} for key, ranks in per.items()},
        hosts,
        factor,
        min_calls,
    )


def _check(factor: float, min_calls: int) -> None:
    if factor <= 1:
        raise ValueError(f"factor={factor}: a straggler is slower than the median by a factor above 1 (e.g. 2.0)")
    if min_calls < 1:
        raise ValueError(f"min_calls={min_calls}: a rank needs at least one call to be compared (default {MIN_CALLS})")


def _flag(
    stats: dict[tuple[str, Any, str], dict[int, tuple[int, float]]],
    hosts: dict[tuple[str, Any, int], str],
    factor: float,
    min_calls: int,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for (mesh, mid, name), per in stats.items():
        med = {r: m for r, (n, m) in per.items() if n >= min_calls}
        if len(med) < 2:
            continue
        for r, m in med.items():
            # the others' median: one slow rank of two (or of a few) does not raise its own bar
            typical = statistics.median(v for q, v in med.items() if q != r)
            if m > factor * typical and m > 0:
                ratio = m / typical if typical > 0 else float("inf")
                out.append(
                    {
                        "mesh": mesh,
                        "mesh_id": mid,
                        "name": name,
                        "rank": r,
                        "host": hosts.get((mesh, mid, r), ""),
                        "calls": per[r][0],
                        "median_s": m,
                        "typical_s": typical,
                        "ratio": ratio,
                    }
                )
    out.sort(key=lambda d: -d["ratio"])
    return out


def latency_summary(
    mesh: Any = None,
    since: Any = None,
    addresses: list[str] | None = None,
    timeout: float = 10.0,
    factor: float = 2.0,
    incarnation: str = LATEST,
    min_calls: int = MIN_CALLS,
) -> dict[str, Any]:
    """What a dashboard shows of ``mesh``'s spans (None: every mesh's), reduced by each allocator rather than sent:
    ``ranks`` (per rank: mesh, mesh_id, rank, host, pid, calls, median, p95 of its endpoint calls),
    ``stragglers`` (as :func:`stragglers` gives, from the per-rank medians of each endpoint),
    ``errors`` (the failed spans as :func:`query_records` rows, clock offsets applied) and
    ``unreachable`` (allocators that did not answer); ``incarnation`` as in :func:`query`."""
    _check(factor, min_calls)
    t_since = parse_since(since)
    name, procs = _target(mesh)
    answers, unreachable = _ask("span_summary", addresses, timeout, lambda t_send: (name, t_since, t_send))
    summaries: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    incs: list[tuple[str, str, float]] = []
    for got, offset in answers:
        summaries.extend(got["procs"])
        incs.extend(tuple(i) for i in got.get("incarnations", ()))
        for sp in got["errors"]:
            sp["start"] -= offset
            sp["clock_offset"] = offset
            if t_since is None or sp["start"] + sp["duration"] >= t_since:
                errors.append({c: sp.get("attrs") if c == "attributes" else sp.get(c) for c in COLUMNS})
    # (a proc whose only spans failed has no summary: its errors name its incarnation too)
    keep = _incarnation_filter(incarnation, incs, summaries + errors, procs)
    if keep is not None:
        summaries = [p for p in summaries if keep(p)]
        errors = [e for e in errors if keep(e)]
    ranks: list[dict[str, Any]] = []
    stats: dict[tuple[str, Any, str], dict[int, tuple[int, float]]] = {}
    hosts: dict[tuple[str, Any, int], str] = {}
    for p in summaries:
        rank, mid = int(p["rank"]), p.get("mesh_id")
        hosts[(p["mesh"], mid, rank)] = p.get("host") or ""
        n, med, p95 = p["calls"]
        if n:
            ranks.append(
                {
                    "mesh": p["mesh"],
                    "mesh_id": mid,
                    "rank": rank,
                    "host": p.get("host"),
                    "pid": p.get("pid"),
                    "calls": n,
                    "median": med,
                    "p95": p95,
                }
            )
        for kind, nm, n_ok, m, _p95 in p["names"]:
            if kind == "call":
                stats.setdefault((p["mesh"], mid, _SHOWN_AS.get(nm, nm)), {})[rank] = (n_ok, m)
    for e in errors:
        _shown(e)
    errors.sort(key=lambda s: s["start"])
    return {"ranks": ranks, "stragglers": _flag(stats, hosts, factor, min_calls), "errors": errors, "unreachable": unreachable}


def chrome_trace(spans: Any, path: str | None = None, factor: float = 2.0) -> dict[str, Any]:
    """The spans as a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing):
    one process per mesh, one track per rank (and thread), every host's clock offset already
    applied. Ranks ``stragglers(spans, factor)`` flags are named so. Written to ``path`` if given."""
    rows = _rows(spans)
    slow = {(d["mesh"], d["mesh_id"], d["rank"]) for d in stragglers(rows, factor)} if rows else set()
    # a name's incarnations (incarnation="all") are separate processes, each id named
    ids: dict[str, set[Any]] = {}
    for s in rows:
        ids.setdefault(s["mesh"], set()).add(s.get("mesh_id"))
    pids: dict[tuple[str, Any], int] = {}
    tids: dict[tuple[str, Any, int, Any], int] = {}
    events: list[dict[str, Any]] = []
    offsets: dict[str, float] = {}
    for s in rows:
        mesh, mid, rank = s["mesh"], s.get("mesh_id"), int(s["rank"])
        pid = pids.get((mesh, mid))
        if pid is None:
            pid = pids[(mesh, mid)] = len(pids) + 1
            label = f"mesh {mesh}" + (f" (mesh id {mid})" if len(ids[mesh]) > 1 else "")
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        key = (mesh, mid, rank, s.get("thread"))
        tid = tids.get(key)
        if tid is None:
            n = sum(1 for k in tids if k[:3] == (mesh, mid, rank))
            tid = tids[key] = rank * 100 + n + 1
            label = f"rank {rank}" + (f" · thread {n + 1}" if n else "") + f" ({s.get('host')}:{s.get('pid')})"
            if (mesh, mid, rank) in slow:
                label += f" straggler (>{factor:g}x median)"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        if s.get("host"):
            offsets[s["host"]] = s.get("clock_offset") or 0.0
        args = {"rank": rank, "outcome": s.get("outcome"), "actor": s.get("actor")}
        attrs = s.get("attributes", s.get("attrs"))
        if isinstance(attrs, dict):
            args.update({str(k): v if isinstance(v, (int, float, str, bool)) or v is None else repr(v) for k, v in attrs.items()})
        events.append(
            {
                "name": s["name"],
                "cat": s.get("kind") or "span",
                "ph": "X",
                "ts": round(float(s["start"]) * 1e6, 3),
                "dur": round(float(s["duration"]) * 1e6, 3),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock_offsets_s": offsets, "generator": "monarch_nb"}}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
