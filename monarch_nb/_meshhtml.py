"""HTML shaped like a mesh, for ``_repr_html_`` of value, proc, actor and host meshes.

Pure functions of plain data (labels, sizes, values, per-rank records), so the actor layer can
render itself in a notebook without importing a frontend. Self-contained markup (inline styles,
one ``<style>`` per output) because JupyterLab sanitises nothing it needs here and a static
notebook export keeps it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from ._ranks import format_ranks

#: a value whose repr is longer than this is clipped, the full text one click away
CLIP = 60
#: a mesh with more values than this, and few distinct ones, lists values with their rank sets
GROUP_OVER = 32
#: the state a rank tile carries (``mnb-state-<state>``) and its colour (one legend everywhere)
STATE_COLOURS = {
    "starting": "#d4a72c",
    "idle": "#2da44e",
    "busy": "#0969da",
    "paused": "#8250df",
    "failed": "#cf222e",
    "stopped": "#8c959f",
    "unknown": "#afb8c1",
}
#: the states every legend shows (dashboard, sidebar, grids), in this order
LEGEND = ("idle", "busy", "paused", "failed", "stopped")
#: what a mesh with a failed rank is, as a whole (Monarch's semantics), and what to do about it
FAILED_MESH = "failed (healthy ranks still callable; new spawns refused)"
FAILED_MESH_HINT = (
    "read the failed ranks' logs for why, then stop the mesh and spawn it again (%mesh stop NAME; %mesh spawn NAME ...)"
)

_CSS = """<style>
.mnb-vm { font-family: var(--jp-code-font-family, monospace); font-size: 12px; }
.mnb-vm table { border-collapse: collapse; margin: 2px 0 6px 0; }
.mnb-vm th, .mnb-vm td { border: 1px solid #d0d7de; padding: 1px 6px; text-align: left; vertical-align: top; }
.mnb-vm th { background: #f6f8fa; font-weight: 600; }
.mnb-vm caption { text-align: left; font-weight: 600; padding: 2px 0; }
.mnb-vm details summary { cursor: pointer; }
.mnb-vm pre { margin: 0; white-space: pre-wrap; }
.mnb-rg { font-family: var(--jp-ui-font-family, sans-serif); font-size: 11px; max-width: 1000px; }
.mnb-rg .mnb-grid { display: grid; gap: 2px; margin: 4px 0; }
.mnb-rg .mnb-tile { border-radius: 2px; color: white; display: flex; align-items: center;
                    justify-content: center; overflow: hidden; cursor: default; }
.mnb-rg .mnb-legend span { margin-right: 10px; }
</style>"""


def _cell(text: str) -> str:
    if len(text) <= CLIP and "\n" not in text:
        return f"<code>{html.escape(text)}</code>"
    short = text.splitlines()[0] if text else ""
    short = short[: CLIP - 1] + "…" if len(short) >= CLIP or "\n" in text else short
    return (
        f'<details class="mnb-clip"><summary><code>{html.escape(short)}</code></summary><pre>{html.escape(text)}</pre></details>'
    )


def _safe_repr(v: Any) -> str:
    try:
        return repr(v)
    except Exception as e:  # a value whose repr fails must not hide the others
        return f"<repr failed: {type(e).__name__}: {e}>"


def value_table_html(labels: Sequence[str], sizes: Sequence[int], values: Sequence[Any]) -> str:
    """A table per value of the outer dimensions, the last two as rows × columns; values
    grouped with their rank sets when the mesh is large and they repeat."""
    reprs = [_safe_repr(v) for v in values]
    ext = ", ".join(f"{k}: {s}" for k, s in zip(labels, sizes))
    head = f"<div><b>ValueMesh</b>({{{html.escape(ext)}}})</div>"
    distinct: dict[str, list[int]] = {}
    for i, r in enumerate(reprs):
        distinct.setdefault(r, []).append(i)
    if len(reprs) > GROUP_OVER and len(distinct) <= len(reprs) // 4:
        rows = "".join(
            f'<tr><td>{_cell(r)}</td><td class="mnb-ranks">{format_ranks(rs)}</td><td>{len(rs)}</td></tr>'
            for r, rs in sorted(distinct.items(), key=lambda kv: kv[1][0])
        )
        body = f'<table class="mnb-grouped"><thead><tr><th>value</th><th>ranks</th><th>count</th></tr></thead><tbody>{rows}</tbody></table>'
        return f'{_CSS}<div class="mnb-vm">{head}{body}</div>'
    if not labels:
        return f'{_CSS}<div class="mnb-vm">{head}<table><tbody><tr><td>{_cell(reprs[0] if reprs else "")}</td></tr></tbody></table></div>'
    tables = []
    if len(labels) == 1:
        rows_l, cols_l, outer = None, labels[0], []
        nr, nc = 1, sizes[0]
    else:
        rows_l, cols_l, outer = labels[-2], labels[-1], list(zip(labels[:-2], sizes[:-2]))
        nr, nc = sizes[-2], sizes[-1]
    per = nr * nc
    n_outer = math.prod(s for _l, s in outer) if outer else 1
    for o in range(n_outer):
        caption = ""
        if outer:
            coords, rem = [], o
            for label, size in reversed(outer):
                coords.append(f"{label}={rem % size}")
                rem //= size
            caption = f"<caption>{html.escape(', '.join(reversed(coords)))}</caption>"
        corner = f"{html.escape(rows_l)} \\ {html.escape(cols_l)}" if rows_l else html.escape(cols_l)
        thead = f"<tr><th>{corner}</th>" + "".join(f"<th>{c}</th>" for c in range(nc)) + "</tr>"
        trs = []
        for row in range(nr):
            row_th = f"<th>{row}</th>" if rows_l else "<th></th>"
            tds = "".join(
                f'<td data-rank="{o * per + row * nc + c}">{_cell(reprs[o * per + row * nc + c])}</td>' for c in range(nc)
            )
            trs.append(f"<tr>{row_th}{tds}</tr>")
        tables.append(f'<table class="mnb-table">{caption}<thead>{thead}</thead><tbody>{"".join(trs)}</tbody></table>')
    return f'{_CSS}<div class="mnb-vm">{head}{"".join(tables)}</div>'


def rank_state(proc: dict[str, Any] | None) -> tuple[str, str]:
    """``(state, reason)`` of one rank from its allocator status record."""
    if proc is None:
        return "unknown", "no status"
    st = proc.get("state", "")
    if st in ("failed", "exited"):
        return "failed", proc.get("cause") or st
    if st in ("stopping", "stopped"):
        return "stopped", proc.get("cause") or st
    if st == "starting":
        return "starting", ""
    if proc.get("actor_failed"):
        return "failed", str(proc["actor_failed"])
    if proc.get("paused"):
        return "paused", "paused at a breakpoint"
    if proc.get("busy"):
        return "busy", str(proc.get("activity") or "busy")
    return "idle", ""


def mesh_state(states: Sequence[str]) -> tuple[str, str, str]:
    """``(state, label, hint)`` of a whole mesh from its ranks' states: one failed rank fails
    the mesh (its label says what still works); otherwise the most telling of its ranks' states."""
    present = set(states)
    if not present:
        return "unknown", "unknown", ""
    if "failed" in present:
        return "failed", FAILED_MESH, FAILED_MESH_HINT
    for s in ("stopped", "starting", "paused", "busy", "idle"):
        if s in present and (s != "stopped" or present == {"stopped"}):
            return s, s, ""
    # some stopped, the rest in states not listed above
    return "unknown", ", ".join(sorted(present)), ""


def _grid_columns(sizes: Sequence[int], n: int) -> int:
    """The last dimension across (wrapped at 32 so a long one still fits 1000 px)."""
    cols = sizes[-1] if sizes else max(1, n)
    return max(1, min(cols, 32))


def rank_grid_html(
    title: str, labels: Sequence[str], sizes: Sequence[int], ranks: Sequence[dict[str, Any]], note: str = ""
) -> str:
    """Rank tiles coloured by state; hovering one shows its coordinates, host, PID and state.

    ``ranks``: per rank ``{"rank", "host", "pid", "state", "reason"}``. Tiles shrink with the
    mesh (never under 8 px) so that 128 ranks fit in 1000×700 px.
    """
    n = len(ranks)
    cols = _grid_columns(sizes, n)
    rows = math.ceil(n / cols) if n else 1
    tile = max(8, min(26, (960 // cols) - 2, (560 // rows) - 2))
    show_num = tile >= 20
    tiles = []
    for r in ranks:
        coords = _coords(r["rank"], labels, sizes)
        tip = " · ".join(
            x
            for x in (
                f"rank {r['rank']}" + (f" ({coords})" if coords else ""),
                f"host {r.get('host', '?')}",
                f"pid {r['pid']}" if r.get("pid") else "",
                r.get("state", "unknown"),
                r.get("reason") or "",
            )
            if x
        )
        state = r.get("state", "unknown")
        colour = STATE_COLOURS.get(state, STATE_COLOURS["unknown"])
        tiles.append(
            # host and pid only in the title (hover): a stored notebook output differs on
            # another machine only where nbval's sanitizers look (host X, pid N)
            f'<div class="mnb-tile mnb-state-{state}" data-rank="{r["rank"]}" title="{html.escape(tip)}" '
            f'style="background:{colour};width:{tile}px;height:{tile}px;font-size:{max(8, tile // 2 - 2)}px">'
            f"{r['rank'] if show_num else ''}</div>"
        )
    counts: dict[str, int] = {}
    for r in ranks:
        counts[r.get("state", "unknown")] = counts.get(r.get("state", "unknown"), 0) + 1
    legend = "".join(
        f'<span><b style="color:{c}">■</b> {s}{f" ({counts[s]})" if s in counts else ""}</span>'
        for s, c in STATE_COLOURS.items()
        if s != "unknown" or s in counts
    )
    note_html = f'<div class="mnb-note">{html.escape(note)}</div>' if note else ""
    return (
        f'{_CSS}<div class="mnb-rg"><div><b>{html.escape(title)}</b></div>{note_html}'
        f'<div class="mnb-grid" style="grid-template-columns: repeat({cols}, {tile}px)">{"".join(tiles)}</div>'
        f'<div class="mnb-legend">{legend}</div></div>'
    )


def _coords(rank: int, labels: Sequence[str], sizes: Sequence[int]) -> str:
    out, rem = [], rank
    for label, size in reversed(list(zip(labels, sizes))):
        out.append(f"{label}={rem % size}")
        rem //= size
    return ", ".join(reversed(out))
