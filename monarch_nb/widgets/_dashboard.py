"""``Dashboard(mesh)``: a live ipywidgets view of a proc mesh, updated from a background thread."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import ipywidgets as W

from .. import introspect
from .._ranks import parse_ranks
from ..actor import ProcMesh, _context
from ..logs import format_line
from . import _render

BUSY_NOTE = (
    "Buttons act only while the kernel is idle: a running cell holds the kernel. "
    "Use the JupyterLab sidebar (monarch_nb panel) to act while a cell runs."
)


class Dashboard(W.VBox):
    """The mesh as a grid of ranks coloured by state, host resources, a live log tail, errors.

    ``Dashboard(mesh)`` takes a :class:`~monarch_nb.actor.ProcMesh` or the name of one known to
    ``monarch_nb.mesh``. It refreshes every ``interval`` seconds on a background thread, so it
    stays live while cells run; :meth:`close` stops it.
    """

    def __init__(self, mesh: ProcMesh | str, interval: float = 1.0, tail: int = 200) -> None:
        if isinstance(mesh, str):
            from .. import mesh as _mesh

            mesh = _mesh.get(mesh)
        self.mesh = mesh
        self.interval = interval
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=tail)
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.header = W.HTML()
        self.grid_view = W.HTML()
        self.hosts_view = W.HTML()
        self.rank_filter = W.Text(placeholder="ranks, e.g. 0-3", description="log ranks", layout=W.Layout(width="260px"))
        self.log_view = W.HTML(layout=W.Layout(max_height="220px", overflow="auto"))
        self.errors_view = W.HTML()
        self.stop_button = W.Button(description="stop mesh", button_style="danger", tooltip=BUSY_NOTE)
        self.refresh_button = W.Button(description="refresh", tooltip=BUSY_NOTE)
        note = W.HTML(f'<span style="color:#57606a">{BUSY_NOTE}</span>')
        self.stop_button.on_click(lambda _b: self._stop_mesh())
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.rank_filter.observe(lambda _c: self._render_log(), names="value")
        super().__init__(
            [
                W.HTML(_render.CSS),
                self.header,
                W.HTML(_render.legend_html()),
                self.grid_view,
                self.hosts_view,
                W.HBox([self.refresh_button, self.stop_button]),
                note,
                self.rank_filter,
                self.log_view,
                self.errors_view,
            ]
        )
        self.add_class("mnb-dash")
        self._client = _context.client()
        self._client.log_taps.append(self._on_lines)
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="monarch_nb-dashboard", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ data
    def snapshot(self) -> dict[str, Any]:
        """The ranks of the mesh with their state, from one introspection snapshot."""
        pm = self.mesh
        st = introspect.status(sorted({p.alloc for p in pm._procs if p.alloc}))
        by_alloc: dict[str, dict[str, Any]] = {}
        for a in st["allocators"]:
            for key in ("addr", "tcp"):
                if a.get(key):
                    by_alloc[a[key]] = a
        ranks = []
        hosts: dict[str, dict[str, Any]] = {}
        for p in pm._procs:
            a = by_alloc.get(p.alloc)
            unreachable = ""
            rec = None
            if a is None or a.get("error"):
                unreachable = f"host {p.host} unreachable" + (f": {a['error']}" if a and a.get("error") else "")
            else:
                m = next((m for m in a.get("meshes", []) if m["name"] == p.mesh), None)
                rec = next((r for r in m["procs"] if r["rank"] == p.rank), None) if m else None
            state, reason = _render.rank_state(rec, unreachable)
            ranks.append({**(rec or {}), "rank": p.rank, "host": p.host, "pid": p.pid, "state": state, "reason": reason})
            hosts.setdefault(p.host, a or {"host": p.host, "error": "no answer"})
        return {"ranks": ranks, "hosts": list(hosts.values()), "time": st["time"]}

    def refresh(self) -> None:
        try:
            snap = self.snapshot()
        except Exception as e:  # the dashboard must never take the kernel down
            self.header.value = f'<b>{self.mesh.name}</b> <span class="mnb-errors">status unavailable: {e}</span>'
            return
        pm = self.mesh
        labels, sizes = list(pm._view.labels), list(pm._view.sizes)
        counts = collections.Counter(r["state"] for r in snap["ranks"])
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        self.header.value = f"<b>mesh {pm.name}</b> {pm.extent} · {summary} · {time.strftime('%H:%M:%S')}"
        self.grid_view.value = _render.grid_html(snap["ranks"], labels, sizes)
        self.hosts_view.value = _render.hosts_html(snap["hosts"])
        with self._lock:
            for r in snap["ranks"]:
                if r["state"] == "failed":
                    msg = f"rank {r['rank']} on {r['host']}: {r['reason']}"
                    if msg not in self._errors:
                        self._errors.append(msg)
            self.errors_view.value = _render.errors_html(self._errors)
        self._render_log()

    def _on_lines(self, mesh: str, lines: list[tuple[int, str, float, str, str]]) -> None:
        if mesh != self.mesh.name:
            return
        with self._lock:
            self._lines.extend((r, text) for r, _s, _t, _c, text in lines if not text.startswith("\r"))

    def _render_log(self) -> None:
        import html

        ranks: set[int] | None = None
        f = self.rank_filter.value.strip()
        if f:
            try:
                ranks = set(parse_ranks(f, len(self.mesh._procs)))
            except ValueError as e:
                self.log_view.value = f'<span class="mnb-errors">{html.escape(str(e))}</span>'
                return
        with self._lock:
            rows = [format_line(r, t) for r, t in self._lines if ranks is None or r in ranks]
        self.log_view.value = "<pre style='margin:0'>" + html.escape("\n".join(rows[-100:])) + "</pre>"

    # ------------------------------------------------------------ actions and lifetime
    def _stop_mesh(self) -> None:
        try:
            self.mesh.stop().get(timeout=60)
        except Exception as e:
            with self._lock:
                self._errors.append(f"stop failed: {e}")
        self.refresh()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._on_lines in self._client.log_taps:
            self._client.log_taps.remove(self._on_lines)
        super().close()
