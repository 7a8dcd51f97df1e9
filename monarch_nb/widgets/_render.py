"""HTML for the dashboard, from introspection snapshots (pure functions, no widgets)."""

from __future__ import annotations

import html
import math
from typing import Any

from .. import _meshhtml
from ..actor import Extent, Point

#: the state classes a rank element carries (``mnb-state-<state>``) and their colours
# one legend for the dashboard and the mesh grids; the dashboard has no "unknown" rank
STATE_COLOURS = {s: c for s, c in _meshhtml.STATE_COLOURS.items() if s != "unknown"}

CSS = """
<style>
.mnb-dash { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; }
.mnb-grid { display: grid; gap: 3px; margin: 4px 0; }
.mnb-rank { width: 26px; height: 22px; border-radius: 3px; color: white; font-size: 10px;
            display: flex; align-items: center; justify-content: center; cursor: default; }
.mnb-bar { background: #eaeef2; border-radius: 3px; height: 10px; width: 160px; display: inline-block;
           vertical-align: middle; overflow: hidden; }
.mnb-bar > div { height: 100%; background: #0969da; }
.mnb-legend span { margin-right: 10px; }
.mnb-errors { color: #cf222e; }
</style>
"""


def rank_state(proc: dict[str, Any] | None, unreachable: str = "") -> tuple[str, str]:
    """``(state class, reason)`` of one rank from its status record (the states are the mesh grid's)."""
    if unreachable:
        return "failed", unreachable
    if proc is None:
        return "stopped", "not running"
    return _meshhtml.rank_state(proc)


def _grid_shape(sizes: list[int]) -> tuple[int, int]:
    """Rows and columns: the last dimension across, the others stacked."""
    if not sizes:
        return 1, 1
    cols = sizes[-1]
    return max(1, math.prod(sizes[:-1])), max(1, cols)


def _coords(rank: int, labels: list[str], sizes: list[int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dict(Point(rank, Extent(labels, sizes))).items())


def _bytes(n: int) -> str:
    """Bytes moved through RDMABuffers, human-sized."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def grid_html(ranks: list[dict[str, Any]], labels: list[str], sizes: list[int]) -> str:
    rows, cols = _grid_shape(sizes)
    cells = []
    for r in ranks:
        tip = " · ".join(
            x
            for x in (
                f"rank {r['rank']} ({_coords(r['rank'], labels, sizes)})",
                f"host {r.get('host', '?')}",
                f"pid {r.get('pid', '?')}",
                r.get("activity") or "",
                # a busy rank's reason is its activity ("busy in steps.train"): said once
                r.get("reason") if r.get("reason") != r.get("activity") else "",
                f"cpu {r['cpu_percent']:.0f}%" if r.get("cpu_percent") is not None else "",
                f"rss {r['rss'] / 2**20:.0f} MiB" if r.get("rss") else "",
                f"moved {_bytes(r['bytes_moved'])}" if r.get("bytes_moved") else "",
            )
            if x
        )
        colour = STATE_COLOURS[r["state"]]
        cells.append(
            f'<div class="mnb-rank mnb-state-{r["state"]}" data-rank="{r["rank"]}" '
            f'title="{html.escape(tip)}" style="background:{colour}">{r["rank"]}</div>'
        )
    return f'<div class="mnb-grid" style="grid-template-columns: repeat({cols}, 26px)" data-rows="{rows}">{"".join(cells)}</div>'


def legend_html() -> str:
    """The sidebar's legend: the same states, the same colours (``_meshhtml.LEGEND``)."""
    return (
        '<div class="mnb-legend">'
        + "".join(
            f'<span class="mnb-legend-item" data-state="{s}"><b style="color:{STATE_COLOURS[s]}">■</b> {s}</span>'
            for s in _meshhtml.LEGEND
        )
        + "</div>"
    )


def _dur(v: Any) -> str:
    if v is None:
        return "-"
    v = max(0, int(v))
    return f"{v // 3600}h{v % 3600 // 60:02d}m" if v >= 3600 else f"{v // 60}m{v % 60:02d}s"


def jobs_html(rows: list[dict[str, Any]]) -> str:
    """``monarch_nb.job``'s jobs with their scheduler state; hosts the scheduler lost are named."""
    if not rows:
        return ""
    out = []
    for r in rows:
        state = str(r.get("state", ""))
        lost = list(r.get("lost") or [])
        shown = "lost" if lost else state
        cls = "mnb-errors" if lost or state.startswith(("unknown", "unreadable", "gone")) else ""
        cells = (
            html.escape(str(r.get("name", ""))),
            html.escape(str(r.get("scheduler", "?"))),
            html.escape(str(r.get("id", ""))),
            f'<span class="mnb-job-state {cls}">{html.escape(shown)}</span>'
            + (f' <span class="mnb-job-lost">({html.escape(", ".join(lost))} lost)</span>' if lost else ""),
            html.escape(str(r.get("hosts", ""))),
            _dur(r.get("age_s")),
            _dur(r.get("walltime_left_s")),
        )
        out.append(
            f'<tr class="mnb-job" data-job="{html.escape(str(r.get("name", "")))}" data-state="{html.escape(shown)}">'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    head = "".join(f"<th>{c}</th>" for c in ("job", "scheduler", "id", "state", "hosts", "age", "walltime left"))
    return f'<div class="mnb-jobs"><b>jobs</b><table><tr>{head}</tr>{"".join(out)}</table></div>'


def hosts_html(hosts: list[dict[str, Any]]) -> str:
    rows = []
    for h in hosts:
        name = html.escape(str(h.get("host", "?")))
        if h.get("error"):
            rows.append(f'<div class="mnb-host mnb-errors"><b>{name}</b>: unreachable ({html.escape(h["error"])})</div>')
            continue
        st = h.get("host_stats") or {}
        cpu = float(st.get("cpu_percent", 0.0))
        mem = st.get("mem_used", 0) / max(1, st.get("mem_total", 1)) * 100
        gpus = "".join(
            f" gpu{g['index']} {_bar(g['util_percent'])} {g['util_percent']:.0f}% {g['mem_used'] / 2**30:.1f} GiB"
            for g in st.get("gpus", [])
        )
        rows.append(f'<div class="mnb-host"><b>{name}</b> cpu {_bar(cpu)} {cpu:.0f}% · mem {_bar(mem)} {mem:.0f}%{gpus}</div>')
    return "".join(rows)


def _bar(percent: float) -> str:
    return f'<span class="mnb-bar"><div style="width:{max(0.0, min(100.0, percent)):.0f}%"></div></span>'


def errors_html(errors: list[str]) -> str:
    if not errors:
        return ""
    items = "".join(f"<li>{html.escape(e)}</li>" for e in errors[-10:])
    return f'<div class="mnb-errors"><b>recent errors</b><ul>{items}</ul></div>'


def latency_html(
    ranks: list[dict[str, Any]], slow: list[dict[str, Any]], factor: float, window: str, top: int = 16, min_calls: int = 3
) -> str:
    """Per-rank endpoint latency over the window (the slowest ``top`` ranks) and the stragglers;
    ``ranks`` are ``telemetry.latency_summary()``'s (rank, calls, median, p95), ``slow`` its
    stragglers (per endpoint)."""
    if not ranks:
        return f'<div class="mnb-latency">no endpoint calls in the last {html.escape(window)}</div>'
    by_rank: dict[int, list[str]] = {}
    for d in slow:
        by_rank.setdefault(int(d["rank"]), []).append(str(d["name"]))
    # each rank slowest at some other endpoint is no rank behind the others: the notes below
    # say which endpoint is slow where, no row is singled out
    if len(by_rank) >= len({int(r["rank"]) for r in ranks}):
        by_rank = {}
    stats = sorted(((float(r["median"]), float(r["p95"]), int(r["calls"]), int(r["rank"])) for r in ranks), reverse=True)
    worst = stats[0][0] or 1e-9
    rows = "".join(
        f'<tr class="mnb-lat-row{" mnb-straggler" if rank in by_rank else ""}"><td>rank {rank}</td><td>{n}</td>'
        f"<td>{_bar(100 * med / worst)} {med * 1e3:.2f} ms</td><td>{p95 * 1e3:.2f} ms</td>"
        f"<td>{'straggler in ' + html.escape(', '.join(by_rank[rank])) if rank in by_rank else ''}</td></tr>"
        for med, p95, n, rank in stats[:top]
    )
    notes = "".join(
        f'<div class="mnb-errors">straggler: rank {d["rank"]} ({html.escape(str(d["host"]))}) {html.escape(d["name"])} '
        f"median {d['median_s'] * 1e3:.2f} ms over {d.get('calls', '?')} calls, {d['ratio']:.1f}x the other ranks' median</div>"
        for d in slow
    )
    more = f"<div>… {len(stats) - top} faster ranks not shown</div>" if len(stats) > top else ""
    return (
        f'<div class="mnb-latency"><b>endpoint latency, last {html.escape(window)}</b> '
        f"(a straggler: median of at least {min_calls} completed calls of an endpoint over {factor:g}x the other ranks')"
        f"<table><tr><th>rank</th><th>calls</th><th>median</th><th>p95</th><th></th></tr>{rows}</table>{more}{notes}</div>"
    )
