"""``%mesh status`` as a table: HTML in a notebook, aligned text elsewhere."""

from __future__ import annotations

import html
from collections.abc import Collection
from typing import Any

from .. import _meshhtml
from .._ranks import format_ranks

_COLUMNS = ("host", "allocator", "mesh", "owner", "ranks", "state", "pids", "detail")


def status_rows(snapshot: dict[str, Any], my_cid: str = "", held: Collection[Any] = ()) -> list[dict[str, str]]:
    """One row per (allocator, mesh, state): ranks that share a state are grouped. The states
    are the sidebar's and the dashboard's (idle, busy, paused, failed, stopped); a mesh with a
    failed rank gets a first row saying what the mesh as a whole is, and what to do. ``held``:
    the procs this controller holds (spawned or re-attached: their ``addr``, ``alloc``, ``mesh``
    and ``rank``), also listed under an allocator that does not answer."""
    rows: list[dict[str, str]] = []
    held_addrs = {p.addr for p in held}
    paused = {
        (str(d.get("mesh", "")), int(d.get("rank", -1)))
        for d in snapshot.get("debug_sessions", [])
        if d.get("state", "paused") == "paused"
    }
    for a in snapshot.get("allocators", []):
        host = str(a.get("host", "?"))
        alloc = str(a.get("tcp") or a.get("addr", ""))
        first = len(rows)
        if "error" in a:
            rows.append({"host": host, "allocator": alloc, "state": "unreachable", "detail": str(a["error"])})
            # its own list of meshes cannot be read: those this kernel holds there are still its
            # (they dropped out of the table, read as gone)
            mine: dict[str, list[int]] = {}
            for p in held:
                if p.alloc and p.alloc in (a.get("addr"), a.get("tcp")):
                    mine.setdefault(p.mesh, []).append(p.rank)
            for name, ranks in sorted(mine.items()):
                rows.append(
                    {
                        "host": host,
                        "allocator": alloc,
                        "mesh": name,
                        "owner": "this kernel",
                        "ranks": format_ranks(sorted(set(ranks))),
                        "state": "unreachable",
                        "detail": "state unknown: its allocator did not answer",
                    }
                )
            _job_of(a, rows[first:])
            continue
        meshes = a.get("meshes", [])
        if not meshes:
            n = len(a.get("controllers", []))
            rows.append({"host": host, "allocator": alloc, "state": "idle", "detail": f"{n} controller(s) attached"})
        attached = {c.get("cid") for c in a.get("controllers", [])}
        for m in meshes:
            by_state: dict[str, list[dict[str, Any]]] = {}
            for p in m["procs"]:
                state = _meshhtml.rank_state(p)[0]
                if state in ("idle", "busy") and (m["name"], int(p["rank"])) in paused:
                    state = "paused"
                by_state.setdefault(state, []).append(p)
            owner = "this kernel" if my_cid and m["owner"] == my_cid else m["owner"][:8]
            if owner == "this kernel" and m.get("reattached_from"):
                # the allocator handed it to this kernel when `%mesh connect` re-attached it
                owner = "this kernel (re-attached)"
            if owner != "this kernel" and m["owner"] not in attached:
                if any(p.get("addr") in held_addrs for p in m["procs"]):
                    # its controller left and this kernel re-attached it (`%mesh connect` after a
                    # restart): the allocator hands it to us, and `%mesh stop` stops it as ours
                    owner = "this kernel (re-attached)"
                else:
                    # its controller left (a restarted kernel's): `%mesh connect` finds it again
                    owner = f"gone ({owner})"
            mesh_label = m["name"] + ("" if not m.get("persist") else " (persistent)")
            whole, label, hint = _meshhtml.mesh_state(list(by_state))
            if whole == "failed":
                rows.append(
                    {
                        "host": host,
                        "allocator": alloc,
                        "mesh": mesh_label,
                        "owner": owner,
                        "ranks": format_ranks(p["rank"] for p in m["procs"]),
                        "state": label,
                        "detail": hint.replace("NAME", m["name"]),
                    }
                )
            for state, ps in by_state.items():
                causes = sorted({p["cause"] for p in ps if p.get("cause")})
                rows.append(
                    {
                        "host": host,
                        "allocator": alloc,
                        "mesh": mesh_label,
                        "owner": owner,
                        "ranks": format_ranks(p["rank"] for p in ps),
                        "state": state,
                        "pids": ",".join(str(p["pid"]) for p in ps[:8]) + (" …" if len(ps) > 8 else ""),
                        "detail": "; ".join(causes),
                    }
                )
        _job_of(a, rows[first:])
    return rows


def _job_of(allocator: dict[str, Any], rows: list[dict[str, str]]) -> None:
    """Name the job an allocator belongs to (``known_status``'s ``job``) in its rows, as
    ``monarch-nb status`` lists it under its job: its name, and its state where not running."""
    job = allocator.get("job")
    if not job:
        return
    state = str(job.get("state") or "")
    label = str(job.get("name") or "?") + ("" if state.lower() == "running" else f" ({state})")
    for r in rows:
        r["job"] = label


def _columns(rows: list[dict[str, str]]) -> tuple[str, ...]:
    # the job column only where a job's allocator is listed: a single-machine notebook's table stays as it was
    return ("job", *_COLUMNS) if any("job" in r for r in rows) else _COLUMNS


def status_text(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "no allocators known (start one with `%mesh connect`)"
    columns = _columns(rows)
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    for r in rows:
        lines.append("  ".join(r.get(c, "").ljust(widths[c]) for c in columns).rstrip())
    return "\n".join(lines)


#: the sidebar's and the dashboard's colours (one legend), and an allocator nobody reaches
_STATE_COLOURS = {**_meshhtml.STATE_COLOURS, "unreachable": _meshhtml.STATE_COLOURS["failed"]}


def status_html(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p>no allocators known (start one with <code>%mesh connect</code>)</p>"
    columns = _columns(rows)
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = html.escape(r.get(c, ""))
            if c == "state":
                # the whole-mesh row's label ("failed (healthy ranks ...)") takes its first word's colour
                key = r.get(c, "").split(" ")[0]
                colour = _STATE_COLOURS.get(key, "inherit")
                v = f'<span class="mnb-state mnb-state-{html.escape(key)}" style="color:{colour}">{v}</span>'
            cells.append(f"<td>{v}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="mnb-status"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


class StatusTable:
    """What ``%mesh status`` returns: renders as HTML in a notebook and as text elsewhere."""

    def __init__(
        self,
        snapshot: dict[str, Any],
        my_cid: str = "",
        held: Collection[Any] = (),
    ) -> None:
        self.snapshot = snapshot
        self.rows = status_rows(snapshot, my_cid, held)

    def _repr_html_(self) -> str:
        return status_html(self.rows)

    def __repr__(self) -> str:
        return status_text(self.rows)
