"""``%mesh trace``: write the spans of the last while as a Chrome/Perfetto trace and show
them in the cell as a small timeline (inline SVG), stragglers named."""

from __future__ import annotations

import html
import os
import time
import warnings
from typing import Any

from .. import telemetry
from .._numtext import plural

#: the most spans drawn in the cell (the newest); the trace file holds them all
MAX_DRAWN = 4000
_W, _LABEL, _ROW = 900, 150, 14


def trace(name: str | None, last: str, out: str | None, factor: float, incarnation: str = "latest") -> TraceView:
    try:
        with warnings.catch_warnings():
            # an unknown name is this function's own error below, in the magic's words
            warnings.filterwarnings("ignore", message="telemetry: no proc mesh named", category=UserWarning)
            rows = telemetry.query_records(name, since=last, incarnation=incarnation)
    except ValueError as e:
        # the error names the argument it is about (since=…, incarnation=…): say which flag
        flag = f"--incarnation {incarnation!r}" if str(e).startswith("incarnation=") else f"--last {last!r}"
        raise ValueError(f"{flag}: {e}") from None
    if not rows:
        # no file for nothing: a mistyped name used to leave an empty trace behind and say "0 spans"
        if name is not None:
            from ..mesh import status

            names = sorted({m["name"] for a in status()["allocators"] for m in a.get("meshes", [])})
            if name not in names:
                raise ValueError(
                    f"no spans of a mesh named {name!r} in the last {last}, and no such mesh runs on the attached "
                    f"allocators (meshes: {', '.join(names) or 'none'}): check the name"
                )
        return TraceView(rows, "", [], factor, name, last)
    if out is None:
        out = f"trace-{name or 'all'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        telemetry.chrome_trace(rows, out, factor=factor)
    except OSError as e:
        # the spans stay with the allocators: a next %mesh trace with another --out still has them
        raise ValueError(
            f"--out {out!r}: cannot write the trace file: {e.strerror}; give a path in a folder you can write"
        ) from None
    return TraceView(rows, os.path.abspath(out), telemetry.stragglers(rows, factor), factor, name, last)


class TraceView:
    """What ``%mesh trace`` shows: where the trace went, the timeline, the stragglers."""

    def __init__(
        self, rows: list[dict[str, Any]], path: str, slow: list[dict[str, Any]], factor: float, name: str | None, last: str
    ) -> None:
        self.rows, self.path, self.stragglers, self.factor, self.name, self.last = rows, path, slow, factor, name, last
        #: the mesh ids of each name among the rows (several with --incarnation all)
        self._ids: dict[Any, set[Any]] = {}
        for r in rows:
            self._ids.setdefault(r["mesh"], set()).add(r.get("mesh_id"))

    def _headline(self) -> str:
        if not self.path:
            of = f" of mesh {self.name!r}" if self.name else ""
            return f"no spans{of} in the last {self.last}: no trace written (the ranks ran no calls or spans then)"
        ranks = {(r["mesh"], r.get("mesh_id"), r["rank"]) for r in self.rows}
        return f"{plural(len(self.rows), 'span')} of {plural(len(ranks), 'rank')} in the last {self.last} written to {self.path} (open in ui.perfetto.dev)"

    def _straggler_lines(self) -> list[str]:
        return [
            f"straggler: {self._mesh(d)} rank {d['rank']} ({d['host']}) {d['name']} median {d['median_s'] * 1e3:.2f} ms, "
            f"{d['ratio']:.1f}x the other ranks' {d['typical_s'] * 1e3:.2f} ms"
            for d in self.stragglers
        ]

    def _mesh(self, r: dict[str, Any]) -> str:
        """A mesh's name, with its id where the rows hold several meshes of that name (--incarnation all)."""
        return f"{r['mesh']}[{r.get('mesh_id')}]" if len(self._ids.get(r["mesh"], ())) > 1 else str(r["mesh"])

    def __repr__(self) -> str:
        lines = [self._headline(), *self._straggler_lines()]
        if not self.stragglers and self.rows:
            lines.append(f"no stragglers (no rank slower than {self.factor:g}x the others' median)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = f"<div class='mnb-trace'><div>{html.escape(self._headline())}</div>"
        slow = "".join(f"<div style='color:#c62828'>{html.escape(s)}</div>" for s in self._straggler_lines())
        return head + slow + self.svg() + "</div>"

    def svg(self) -> str:
        """The spans as one timeline: a row per rank, calls as bars, spans inside them thinner."""
        rows = self.rows[-MAX_DRAWN:]
        if not rows:
            return "<div><i>no spans in this window</i></div>"
        tracks = sorted({(r["mesh"], r.get("mesh_id"), r["rank"]) for r in rows}, key=lambda k: (str(k[0]), str(k[1]), k[2]))
        names = {(r["mesh"], r.get("mesh_id")): self._mesh(r) for r in rows}
        y = {k: i for i, k in enumerate(tracks)}
        t0 = min(r["start"] for r in rows)
        t1 = max(r["start"] + r["duration"] for r in rows)
        scale = (_W - _LABEL - 10) / max(t1 - t0, 1e-6)
        slow = {(d["mesh"], d.get("mesh_id"), d["rank"]) for d in self.stragglers}
        h = _ROW * len(tracks) + 20
        out = [
            f"<svg class='mnb-timeline' width='{_W}' height='{h}' xmlns='http://www.w3.org/2000/svg' font-size='10' font-family='monospace'>"
        ]
        for k, i in y.items():
            color = "#c62828" if k in slow else "#333"
            label = html.escape(f"{names[k[:2]]} r{k[2]}" + (" (slow)" if k in slow else ""))
            out.append(f"<text x='2' y='{i * _ROW + 11}' fill='{color}'>{label}</text>")
        for r in rows:
            i = y[(r["mesh"], r.get("mesh_id"), r["rank"])]
            x = _LABEL + (r["start"] - t0) * scale
            w = max(r["duration"] * scale, 1.0)
            inner = r["kind"] != "call"
            fill = "#e53935" if r["outcome"] == "error" else ("#66bb6a" if inner else "#1e88e5")
            top, ht = (i * _ROW + 4, _ROW - 8) if inner else (i * _ROW + 1, _ROW - 2)
            tip = html.escape(f"{r['name']} rank {r['rank']}: {r['duration'] * 1e3:.3f} ms ({r['outcome']})")
            out.append(
                f"<rect class='mnb-span' x='{x:.1f}' y='{top}' width='{w:.1f}' height='{ht}' fill='{fill}'><title>{tip}</title></rect>"
            )
        out.append(f"<text x='{_LABEL}' y='{h - 4}' fill='#666'>0 ms</text>")
        out.append(f"<text x='{_W - 80}' y='{h - 4}' fill='#666'>{(t1 - t0) * 1e3:.1f} ms</text>")
        out.append("</svg>")
        return "".join(out)
