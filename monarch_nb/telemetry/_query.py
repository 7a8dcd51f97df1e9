"""Gathering spans from the allocators, and what is made of them: a trace, stragglers."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import statistics
import time
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
]

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


def _mesh_name(mesh: Any) -> str | None:
    """``mesh`` as the allocators file spans: by proc mesh name. A ProcMesh or an ActorMesh
    stands for the (whole) proc mesh it runs on, as in ``%mesh trace procs``; before, such an
    object matched no span and every query of it came back empty."""
    from ..actor import ActorMesh, ProcMesh

    if mesh is None or isinstance(mesh, str):
        return mesh
    if isinstance(mesh, (ProcMesh, ActorMesh)) and mesh._procs:
        return str(mesh._procs[0].mesh)
    raise TypeError(f"mesh={mesh!r}: give a proc mesh's name, a ProcMesh or an ActorMesh")


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
    for a in _targets(addresses):
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
    mesh: str | None, since: float | None, addresses: list[str] | None, timeout: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    # allocators filter in their own clock: a second's slack covers any offset, trimmed below
    answers, errors = _ask("spans", addresses, timeout, lambda _t: (mesh, None if since is None else since - 1.0))
    spans: list[dict[str, Any]] = []
    mets: list[dict[str, Any]] = []
    for got, offset in answers:
        for s in got["spans"]:
            s["start"] -= offset
            s["clock_offset"] = offset
            spans.append(s)
        mets.extend(got["metrics"])
    if mesh is None:
        # this process's own spans (span() in the notebook itself), on our clock
        for s in _ring.drain(0)["spans"]:
            if s["kind"] == "span":
                s.update(mesh="(controller)", rank=0, host=socket.gethostname(), pid=os.getpid(), clock_offset=0.0)
                spans.append(s)
    if since is not None:
        spans = [s for s in spans if s["start"] + s["duration"] >= since]
    spans.sort(key=lambda s: s["start"])
    return spans, mets, errors


def query_records(
    mesh: Any = None, since: Any = None, addresses: list[str] | None = None, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """``query()`` as a list of dicts (no pandas needed)."""
    spans, _, _ = _gather(_mesh_name(mesh), parse_since(since), addresses, timeout)
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


def query(mesh: Any = None, since: Any = None, addresses: list[str] | None = None, timeout: float = 10.0) -> Any:
    """Spans of every rank (of ``mesh``: a proc mesh's name, or a ProcMesh or ActorMesh for the
    proc mesh it runs on) since ``since`` from every attached allocator (and ``addresses``), as a pandas DataFrame sorted by start: columns ``mesh, rank, host, pid,
    kind`` (``call`` or ``span``), ``name, actor, method, start`` (epoch seconds on this
    machine's clock: each host's offset is applied), ``duration`` (seconds), ``outcome``
    (``ok``/``error``), ``attributes`` and ``clock_offset``."""
    return _frame(query_records(mesh, since, addresses, timeout), COLUMNS)


def metrics(mesh: Any = None, addresses: list[str] | None = None, timeout: float = 10.0) -> Any:
    """Every rank's instruments (``get_meter``): meter, name, kind, attrs, count, sum, min,
    max, last, with mesh, rank and host; a pandas DataFrame."""
    _, mets, _ = _gather(_mesh_name(mesh), None, addresses, timeout)
    cols = ["mesh", "rank", "host", "meter", "name", "kind", "attrs", "count", "sum", "min", "max", "last"]
    return _frame([{c: m.get(c) for c in cols} for m in mets], cols)


def _rows(spans: Any) -> list[dict[str, Any]]:
    if hasattr(spans, "to_dict"):
        return list(spans.to_dict("records"))
    return list(spans)


def stragglers(spans: Any, factor: float = 2.0, kind: str | None = "call") -> list[dict[str, Any]]:
    """Ranks slower than the others: for each span name (of ``kind``; None: every kind) with at
    least two ranks, a rank whose median duration exceeds ``factor`` times the median of the
    other ranks' medians. Returns dicts (mesh, name, rank, host, median_s, typical_s, ratio), the
    slowest first."""
    if factor <= 1:
        raise ValueError(f"factor={factor}: a straggler is slower than the median by a factor above 1 (e.g. 2.0)")
    per: dict[tuple[str, str], dict[int, list[float]]] = {}
    hosts: dict[tuple[str, int], str] = {}
    for s in _rows(spans):
        if kind is not None and s.get("kind") != kind:
            continue
        per.setdefault((s["mesh"], s["name"]), {}).setdefault(int(s["rank"]), []).append(float(s["duration"]))
        hosts[(s["mesh"], int(s["rank"]))] = s.get("host") or ""
    return _flag({key: {r: statistics.median(d) for r, d in ranks.items()} for key, ranks in per.items()}, hosts, factor)


def _flag(
    medians: dict[tuple[str, str], dict[int, float]], hosts: dict[tuple[str, int], str], factor: float
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for (mesh, name), med in medians.items():
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
                        "name": name,
                        "rank": r,
                        "host": hosts[(mesh, r)],
                        "median_s": m,
                        "typical_s": typical,
                        "ratio": ratio,
                    }
                )
    out.sort(key=lambda d: -d["ratio"])
    return out


def latency_summary(
    mesh: Any = None, since: Any = None, addresses: list[str] | None = None, timeout: float = 10.0, factor: float = 2.0
) -> dict[str, Any]:
    """What a dashboard shows of ``mesh``'s spans (None: every mesh's), reduced by each allocator rather than sent:
    ``ranks`` (per rank: mesh, rank, host, pid, calls, median, p95 of its endpoint calls),
    ``stragglers`` (as :func:`stragglers` gives, from the per-rank medians of each endpoint),
    ``errors`` (the failed spans as :func:`query_records` rows, clock offsets applied) and
    ``unreachable`` (allocators that did not answer)."""
    if factor <= 1:
        raise ValueError(f"factor={factor}: a straggler is slower than the median by a factor above 1 (e.g. 2.0)")
    t_since = parse_since(since)
    name = _mesh_name(mesh)
    answers, unreachable = _ask("span_summary", addresses, timeout, lambda t_send: (name, t_since, t_send))
    ranks: list[dict[str, Any]] = []
    medians: dict[tuple[str, str], dict[int, float]] = {}
    hosts: dict[tuple[str, int], str] = {}
    errors: list[dict[str, Any]] = []
    for got, offset in answers:
        for p in got["procs"]:
            rank = int(p["rank"])
            hosts[(p["mesh"], rank)] = p.get("host") or ""
            n, med, p95 = p["calls"]
            if n:
                ranks.append(
                    {
                        "mesh": p["mesh"],
                        "rank": rank,
                        "host": p.get("host"),
                        "pid": p.get("pid"),
                        "calls": n,
                        "median": med,
                        "p95": p95,
                    }
                )
            for kind, name, _n, m, _p95 in p["names"]:
                if kind == "call":
                    medians.setdefault((p["mesh"], name), {})[rank] = m
        for sp in got["errors"]:
            sp["start"] -= offset
            sp["clock_offset"] = offset
            if t_since is None or sp["start"] + sp["duration"] >= t_since:
                errors.append({c: sp.get("attrs") if c == "attributes" else sp.get(c) for c in COLUMNS})
    errors.sort(key=lambda s: s["start"])
    return {"ranks": ranks, "stragglers": _flag(medians, hosts, factor), "errors": errors, "unreachable": unreachable}


def chrome_trace(spans: Any, path: str | None = None, factor: float = 2.0) -> dict[str, Any]:
    """The spans as a Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing):
    one process per mesh, one track per rank (and thread), every host's clock offset already
    applied. Ranks ``stragglers(spans, factor)`` flags are named so. Written to ``path`` if given."""
    rows = _rows(spans)
    slow = {(d["mesh"], d["rank"]) for d in stragglers(rows, factor)} if rows else set()
    pids: dict[str, int] = {}
    tids: dict[tuple[str, int, Any], int] = {}
    events: list[dict[str, Any]] = []
    offsets: dict[str, float] = {}
    for s in rows:
        mesh, rank = s["mesh"], int(s["rank"])
        pid = pids.get(mesh)
        if pid is None:
            pid = pids[mesh] = len(pids) + 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"mesh {mesh}"}})
        key = (mesh, rank, s.get("thread"))
        tid = tids.get(key)
        if tid is None:
            n = sum(1 for k in tids if k[:2] == (mesh, rank))
            tid = tids[key] = rank * 100 + n + 1
            label = f"rank {rank}" + (f" · thread {n + 1}" if n else "") + f" ({s.get('host')}:{s.get('pid')})"
            if (mesh, rank) in slow:
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
