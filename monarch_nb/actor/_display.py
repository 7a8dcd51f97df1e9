"""Notebook displays of meshes: the data behind their ``_repr_html_`` (rendered by _meshhtml)."""

from __future__ import annotations

from typing import Any

from .. import _meshhtml
from .._deadline import budget
from . import _context, _debugwait

#: how long a mesh's display waits for its allocators' status before showing "unknown"
STATUS_TIMEOUT = 2.0


def _statuses(allocs: set[str]) -> dict[str, dict[str, Any]]:
    if _context._client is None:
        return {}
    client = _context.client()
    # a display waits STATUS_TIMEOUT in all: the hellos to allocators declared lost too
    client.revive_lost(allocs, STATUS_TIMEOUT)
    futs = {a: client.request(a, "status") for a in sorted(allocs) if a}
    out = {}
    left = budget(STATUS_TIMEOUT)
    for a, f in futs.items():
        try:
            with _debugwait.quiet():  # a display is not a wait that should open the debugger
                out[a] = f.get(timeout=left())
        except Exception:
            continue
    return out


def rank_records(procs: list[Any], stopped: bool = False, failed: str = "") -> list[dict[str, Any]]:
    """``{"rank", "host", "pid", "state", "reason"}`` for each proc, ``rank`` its index in the view."""
    status = {} if stopped else _statuses({p.alloc for p in procs})
    recs: dict[tuple[str, str, int], dict[str, Any]] = {}
    paused: set[tuple[str, int]] = set()
    for a, st in status.items():
        for m in st.get("meshes", []):
            for p in m.get("procs", []):
                recs[(a, m["name"], int(p["rank"]))] = p
        for d in st.get("debug_sessions", []):
            if d.get("state", "paused") == "paused":
                paused.add((str(d.get("mesh", "")), int(d.get("rank", -1))))
    out = []
    for i, p in enumerate(procs):
        if stopped:
            state, reason = "stopped", "mesh stopped"
        elif not p.alloc:
            state, reason = ("failed", failed) if failed else ("idle", "")
        else:
            state, reason = _meshhtml.rank_state(recs.get((p.alloc, p.mesh, p.rank)))
            if state in ("idle", "busy") and (p.mesh, p.rank) in paused:
                state, reason = "paused", "paused at a breakpoint"
        out.append({"rank": i, "host": p.host, "pid": p.pid, "state": state, "reason": reason})
    return out


def mesh_grid_html(
    kind: str, name: str, labels: list[str], sizes: list[int], procs: list[Any], stopped: bool, failed: str
) -> str:
    recs = rank_records(procs, stopped, failed)
    note = ""
    if any(r["state"] == "failed" for r in recs) or failed:
        note = _meshhtml.FAILED_MESH
    ext = ", ".join(f"{k}: {s}" for k, s in zip(labels, sizes))
    return _meshhtml.rank_grid_html(f"{kind} {name} {{{ext}}}".replace("  ", " "), labels, sizes, recs, note)
