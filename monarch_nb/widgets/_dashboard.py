"""``Dashboard(mesh)``: a live ipywidgets view of a proc mesh, updated from a background thread."""

from __future__ import annotations

import collections
import html
import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from .. import _meshhtml, introspect, telemetry
from .._errgroup import cell_location
from .._exec import EXEC_ACTOR
from .._meshstop import kills_noted, stop_proc_mesh
from .._ranks import format_ranks, parse_ranks
from ..actor import ProcMesh, controller_client
from ..logs import Aggregator
from . import _render

#: jobs are asked of their schedulers (squeue, ssh probes) at most this often
JOBS_EVERY = 5.0

BUSY_NOTE = (
    "Buttons act only while the kernel is idle: a running cell holds the kernel. "
    "Use the JupyterLab sidebar (monarch_nb panel) to act while a cell runs."
)


def _killed_html(killed: list[str]) -> str:
    """What a stop had to kill (``ProcsKilledWarning``'s words), a line each."""
    return "".join(f'<br><span class="mnb-errors">{html.escape(k)}</span>' for k in killed)


class Dashboard(W.VBox):
    """The mesh as a grid of ranks coloured by state, host resources, a live log tail, errors.

    ``Dashboard(mesh)`` takes a :class:`~monarch_nb.actor.ProcMesh` or the name of one known to
    ``monarch_nb.mesh``. It refreshes every ``interval`` seconds on a background thread, so it
    stays live while cells run; :meth:`close` stops it. Every refresh runs on that thread, the
    first one and a button's too, never in the kernel: an allocator that died answers nothing
    until the heartbeat declares it lost (seconds), and the kernel (cells, the widgets' events)
    would wait that long. The buttons' actions (stop, stacks, attach, a pdb command) run on
    threads of their own for the same reason (see :meth:`_start`): the view says at once that
    one runs, and what came of it when it ends.
    """

    def __init__(
        self, mesh: ProcMesh | str, interval: float = 1.0, tail: int = 200, straggler_factor: float = 2.0, window: str = "30s"
    ) -> None:
        if isinstance(mesh, str):
            from ..mesh import get

            mesh = get(mesh)
        self.mesh = mesh
        self.interval = interval
        #: endpoint latency per rank over ``window``; a rank over ``straggler_factor`` x the others' median is flagged
        self.straggler_factor, self.window = straggler_factor, window
        self._lines: collections.deque[tuple[int, str, float, str, str]] = collections.deque(maxlen=tail)
        self._errors: list[str] = []
        self._error_spans: set[tuple[Any, ...]] = set()
        self._failed_inits: set[tuple[str, int]] = set()
        #: failures told by supervision: (what, why) -> (index in _errors, time, ranks)
        self._failures: dict[tuple[str, str], tuple[int, str, set[int]]] = {}
        self._jobs_at = -JOBS_EVERY
        self._jobs: list[dict[str, Any]] = []
        #: the saved notebook's view of the dashboard (see _repr_mimebundle_), as of the last refresh
        self._saved_text = f"Dashboard of mesh {mesh.name!r}"
        self._saved_html = ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: a refresh asked of the thread, and the refreshes it started and finished (see refresh)
        self._kick = threading.Event()
        self._done = threading.Condition()
        self._started = self._finished = 0
        #: the buttons' actions running now, by name (see _start), and when each started
        self._actions: dict[str, tuple[threading.Thread, float]] = {}
        #: what the dashboard's last stop raised ("" while none failed): the mesh may be stopped again
        self._stop_error = ""
        self.header = W.HTML()
        self.grid_view = W.HTML()
        self.hosts_view = W.HTML()
        self.latency_view = W.HTML()
        self.jobs_view = W.HTML()
        self.stacks_view = W.HTML(layout=W.Layout(max_height="400px", overflow="auto"))
        self.rank_filter = W.Text(placeholder="ranks, e.g. 0-3", description="log ranks", layout=W.Layout(width="260px"))
        self.log_view = W.HTML(layout=W.Layout(max_height="220px", overflow="auto"))
        self.errors_view = W.HTML()
        self.debug_view = W.VBox()
        self.console_out = W.HTML(layout=W.Layout(max_height="240px", overflow="auto"))
        self._console_text = ""
        #: the pdb command the rank has not answered yet, as the console shows it
        self._console_pending = ""
        self.console_in = W.Text(placeholder="pdb command (p x, n, s, l, w, c)", layout=W.Layout(width="360px"))
        self.console_send = W.Button(description="send", tooltip=BUSY_NOTE)
        self.console_send.on_click(lambda _b: self._console_send())
        self.console = W.VBox([self.console_out, W.HBox([self.console_in, self.console_send])])
        self.console.layout.display = "none"
        self._dbg: Any = None
        self._sids: tuple[str, ...] = ()
        self.stop_button = W.Button(description="stop mesh", button_style="danger", tooltip=BUSY_NOTE)
        self.refresh_button = W.Button(description="refresh", tooltip=BUSY_NOTE)
        self.stacks_button = W.Button(description="stacks", tooltip="the Python stack of every rank, merged. " + BUSY_NOTE)
        self.stacks_button.on_click(lambda _b: self._show_stacks())
        #: what the stop button is doing, or what came of it
        self.stop_view = W.HTML()
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
                self.jobs_view,
                self.latency_view,
                W.HBox([self.refresh_button, self.stacks_button, self.stop_button]),
                self.stop_view,
                note,
                self.stacks_view,
                self.rank_filter,
                self.log_view,
                self.debug_view,
                self.console,
                self.errors_view,
            ]
        )
        self.add_class("mnb-dash")
        self._client = controller_client()
        self._client.log_taps.append(self._on_lines)
        self._client.failure_taps.append(self._on_failure)
        self._watch_cells()
        self.header.value = f"<b>mesh {html.escape(mesh.name)}</b> · <i>asking its allocators…</i>"
        self._thread = threading.Thread(target=self._loop, name="monarch_nb-dashboard", daemon=True)
        self._thread.start()
        self.refresh()

    # ------------------------------------------------------------ data
    def snapshot(self) -> dict[str, Any]:
        """The ranks of the mesh with their state, from one introspection snapshot."""
        pm = self.mesh
        allocs = sorted({p.alloc for p in pm._procs if p.alloc})
        st = self._known_status(allocs)
        lost = [a for a in st["allocators"] if a.get("error") and {a.get("addr"), a.get("tcp")} & set(allocs)]
        if any(not a.get("lost") for a in lost):
            # an allocator of ours did not answer: the jobs may know it lost, by its host's and
            # the job's name (the address alone is a socket path), so they are asked again now
            self._jobs_at = -JOBS_EVERY
            st = self._known_status(allocs)
        by_alloc: dict[str, dict[str, Any]] = {}
        for a in st["allocators"]:
            for key in ("addr", "tcp"):
                if a.get(key):
                    by_alloc[a[key]] = a
        # each allocator's procs by (mesh, rank), indexed once: a lookup per rank, not a scan
        recs: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}
        ranks = []
        hosts: dict[str, dict[str, Any]] = {}
        unreached: dict[str, dict[str, Any]] = {}
        for p in pm._procs:
            a = by_alloc.get(p.alloc)
            unreachable = ""
            rec = None
            host = p.host
            if a is not None and a.get("job"):
                # a job's host by its name in the job (a lost one answers no hostname)
                host = f"{a.get('host') or p.host} of job {a['job'].get('name')}"
            if a is None or a.get("error"):
                # the rank's host is listed beside it (grid, errors): its job's word for what became of it
                unreachable = (
                    f"its host was {a['error']}"
                    if a and a.get("lost")
                    else f"host {host} unreachable" + (f": {a['error']}" if a and a.get("error") else "")
                )
                unreached[p.alloc] = a or {"addr": p.alloc, "host": p.host, "error": "no answer"}
            else:
                index = recs.get(id(a))
                if index is None:
                    index = recs[id(a)] = {(m["name"], r["rank"]): r for m in a.get("meshes", []) for r in m["procs"]}
                rec = index.get((p.mesh, p.rank))
            state, reason = _render.rank_state(rec, unreachable)
            ranks.append({**(rec or {}), "rank": p.rank, "host": host, "pid": p.pid, "state": state, "reason": reason})
            # by allocator: a job's hosts on one machine share its hostname
            hosts.setdefault(p.alloc, {**a, "host": host} if a else {"host": host, "error": "no answer"})
        missing = [p.rank for p in pm._procs if p.alloc in unreached]
        # the mesh's ranks there and what became of them, in the words of %mesh status and stop
        note = introspect._unreached_note(pm.name, list(unreached.values()), missing=missing) if unreached else ""
        names = {p.mesh for p in pm._procs}
        sessions = [d for d in st.get("debug_sessions", []) if d.get("mesh") in names and d.get("state") != "gone"]
        paused = {int(d.get("rank", -1)): d.get("post_mortem") or "" for d in sessions}
        for r in ranks:
            if r["rank"] in paused and r["state"] in ("idle", "busy"):
                after = paused[r["rank"]]
                r["state"], r["reason"] = "paused", f"paused post-mortem after {after}" if after else "paused at a breakpoint"
        return {
            "ranks": ranks,
            "hosts": list(hosts.values()),
            "time": st["time"],
            "debug": sessions,
            "unreached": note,
            "unreached_allocs": sorted(unreached),
        }

    def _known_status(self, allocs: list[str]) -> dict[str, Any]:
        """``introspect.known_status`` of the jobs on record and ``allocs``: a job's host it lists
        as lost is named (host, job) and not asked; the jobs are read at most every JOBS_EVERY s."""
        if time.monotonic() - self._jobs_at >= JOBS_EVERY:
            self._jobs_at = time.monotonic()
            try:
                from ..job import list_jobs

                self._jobs = list_jobs()
                self.jobs_view.value = _render.jobs_html(self._jobs)
            except Exception as e:  # jobs are extra: the rest of the dashboard stays live
                self._jobs = []
                self.jobs_view.value = f'<span class="mnb-errors">jobs unavailable: {html.escape(str(e))}</span>'

        # the jobs that run this mesh alone: another job's key would be adopted by this process
        # (one process holds one cluster key) and its allocators asked at every refresh
        mine = set(allocs)
        jobs, theirs = [], set()
        for j in self._jobs:
            addrs = {str(a) for a in [*(j.get("addrs") or []), *(j.get("lost_addrs") or {}).values()]}
            if addrs & mine:
                jobs.append(j)
                # asked by the jobs' rows with their keys; a lost one is not asked (its whole timeout)
                theirs |= addrs
        return introspect.known_status(jobs, addresses=[a for a in allocs if a not in theirs])

    def refresh(self, timeout: float = 0.1) -> bool:
        """Refresh now, on the dashboard's thread; wait at most ``timeout`` seconds for it (the
        kernel is not held longer: the views update when it ends). True: the views are current."""
        if threading.current_thread() is getattr(self, "_thread", None):
            self._refresh_now()
            return True
        with self._done:
            # a refresh that starts after this call: one under way may have read the state before it
            want = self._started + 1
            self._kick.set()
            return self._done.wait_for(lambda: self._finished >= want or self._stop.is_set(), timeout)

    def _refresh_now(self) -> None:
        try:
            snap = self.snapshot()
        except Exception as e:  # the dashboard must never take the kernel down
            self.header.value = (
                f'<b>{html.escape(self.mesh.name)}</b> <span class="mnb-errors">status unavailable: {html.escape(str(e))}</span>'
            )
            self._saved_text = f"Dashboard of mesh {self.mesh.name!r}: status unavailable: {e}"
            return
        pm = self.mesh
        labels, sizes = list(pm._view.labels), list(pm._view.sizes)
        counts = collections.Counter(r["state"] for r in snap["ranks"])
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        # the mesh as a whole, in the sidebar's and %mesh status's words
        state, label, hint = _meshhtml.mesh_state([r["state"] for r in snap["ranks"]])
        stopping = self._running("stop") is not None
        if pm._stopped and not stopping and self._stop_error:
            self._see_a_later_stop()
        # a stop that failed leaves the mesh to stop again: its ranks are drawn as they are
        if pm._stopped and not stopping and not self._stop_error:
            state, label, hint = "stopped", "stopped", ""
        colour = _meshhtml.STATE_COLOURS.get(state, _meshhtml.STATE_COLOURS["unknown"])
        hint_html = f' <span class="mnb-hint">{html.escape(hint.replace("NAME", pm.name))}</span>' if hint else ""
        self.header.value = (
            # the extent's labels are the user's (per_host={...}), as free as the mesh's name
            f"<b>mesh {html.escape(pm.name)}</b> {html.escape(str(pm.extent))} · "
            f'<span class="mnb-mesh-state mnb-state-{state}" data-state="{state}" style="color:{colour};font-weight:600">'
            f"{html.escape(label)}</span> · {summary} · {time.strftime('%H:%M:%S')}{hint_html}"
        )
        # nothing left to stop, or a stop under way
        self.stop_button.disabled = self.stacks_button.disabled = stopping or state == "stopped"
        self.grid_view.value = _render.grid_html(snap["ranks"], labels, sizes)
        self.hosts_view.value = _render.hosts_html(snap["hosts"])
        self._render_latency(snap.get("unreached_allocs", []))
        self._render_debug(snap["debug"])
        with self._lock:
            for r in snap["ranks"]:
                if r["state"] == "failed" and not self._told_failure(r):
                    msg = f"rank {r['rank']} on {r['host']}: {r['reason']}"
                    if msg not in self._errors:
                        self._errors.append(msg)
            if snap.get("unreached") and snap["unreached"] not in self._errors:
                self._errors.append(snap["unreached"])
            self.errors_view.value = _render.errors_html(self._errors)
        self._render_log()
        self._saved_text, self._saved_html = self._saved_views(label, summary, snap["ranks"])

    def _saved_views(self, label: str, summary: str, ranks: list[dict[str, Any]]) -> tuple[str, str]:
        """Text and HTML of the mesh as it is now, for where the live widget cannot show."""
        pm, when = self.mesh, time.strftime("%H:%M:%S")
        lines = [f"Dashboard of mesh {pm.name!r} {pm.extent}: {label} · {summary} (as of {when})"]
        by_state: dict[str, list[int]] = {}
        for r in ranks:
            by_state.setdefault(r["state"], []).append(r["rank"])
        for st, rs in sorted(by_state.items()):
            lines.append(f"  {st}: {'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)}")
        failed = [r for r in ranks if r["state"] == "failed"]
        lines += [f"  rank {r['rank']} on {r['host']}: {r['reason']}" for r in failed[:8]]
        if len(failed) > 8:
            lines.append(f"  … and {len(failed) - 8} more failed ranks")
        lines.append("  (a snapshot: the live dashboard needs the notebook's kernel running)")
        with self._lock:
            errors = self.errors_view.value
        body = "".join((self.header.value, _render.legend_html(), self.grid_view.value, self.hosts_view.value, errors))
        note = (
            f'<div style="color:#57606a">a snapshot as of {when}: the live dashboard needs the notebook\'s kernel running</div>'
        )
        return "\n".join(lines), f'{_render.CSS}<div class="mnb-dash">{body}{note}</div>'

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # beside the widget view, what shows where the widget cannot: a notebook saved and opened
        # again without its kernel, nbconvert, GitHub (ipywidgets' own text/plain would be the
        # repr of every child, CSS included). A live JupyterLab prefers the widget view.
        data: dict[str, Any] = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self._saved_text
        if self._saved_html:
            data["text/html"] = self._saved_html
        return data

    def _render_latency(self, unreached: list[str]) -> None:
        pm = self.mesh
        try:
            # reduced by the allocators: a 128-rank mesh's calls are tens of thousands of spans a window
            got = telemetry.latency_summary(
                pm,  # this mesh's own spans, not those of an earlier mesh of its name
                since=self.window,
                # one that did not answer the status query would cost the whole timeout again
                addresses=sorted({p.alloc for p in pm._procs if p.alloc} - set(unreached)),
                timeout=2.0,
                factor=self.straggler_factor,
            )
            self._span_errors(got["errors"])
            self.latency_view.value = _render.latency_html(got["ranks"], got["stragglers"], self.straggler_factor, self.window)
        except Exception as e:  # latency is extra: the rest of the dashboard stays live
            self.latency_view.value = f'<span class="mnb-errors">latency unavailable: {html.escape(str(e))}</span>'

    def _span_errors(self, rows: list[dict[str, Any]]) -> None:
        """Endpoint calls that raised on a rank, and failed spans (a ``%%mesh exec`` cell), whoever ran
        them, join the errors: one line per failure and its ranks, not one per rank."""
        groups: dict[str, tuple[float, list[int], set[str]]] = {}
        with self._lock:
            for s in rows:
                if s.get("outcome") != "error":
                    continue
                # the start moves with each query's clock-offset estimate; the duration, measured in the proc, does not
                key = (s.get("pid"), s.get("rank"), s.get("name"), s.get("duration"))
                if key in self._error_spans:
                    continue
                self._error_spans.add(key)
                if str(s.get("name")).endswith(".__init__") and (s.get("actor"), s.get("rank")) in self._failed_inits:
                    continue
                if s.get("kind") == "call" and str(s.get("actor")).partition("#")[0] == EXEC_ACTOR:
                    continue  # a failed cell: its "mesh exec" span says what it raised
                if s.get("kind") == "call":
                    what = f"endpoint {s.get('name')} raised"
                else:
                    attrs = s.get("attributes")
                    err = attrs.get("error") if isinstance(attrs, dict) else None
                    what = f"{s.get('name')} raised" + (f" {err}" if err else "")
                first, ranks, hosts = groups.setdefault(what, (float(s.get("start") or 0), [], set()))
                ranks.append(int(s.get("rank") or 0))
                hosts.add(str(s.get("host")))
            for what, (first, ranks, hosts) in groups.items():
                at = time.strftime("%H:%M:%S", time.localtime(first))
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
                where = ", ".join(sorted(hosts)[:3]) + (f" (+{len(hosts) - 3})" if len(hosts) > 3 else "")
                self._errors.append(f"{at} {who} on {where}: {what}")

    def _watch_cells(self) -> None:
        """Errors raised by this notebook's cells (a call, ``%%mesh exec``, a spawn) join the errors."""
        try:
            from IPython import get_ipython
        except ImportError:
            return
        shell = get_ipython()
        if shell is None:
            return
        self._shell = shell
        shell.events.register("post_run_cell", self._on_cell)

    def _on_cell(self, result: Any) -> None:
        from ..errors import MonarchNBError

        err = getattr(result, "error_in_exec", None)
        if err is None or not isinstance(err, MonarchNBError):
            return
        n = getattr(result, "execution_count", None)
        # Monarch's headline, the rank count ("KeyError on 4 of 16 ranks: 0,4,8,12") if any, and
        # the exception's own last line (what it said); the traceback is in the cell. The ranks
        # come from the error itself: str()'s wording is Monarch's and may change
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [""]
        ranks = err._rank_summary()
        said = lines[-1:] if len(lines) > 1 and lines[-1] not in ranks else []
        head = " ".join([lines[0], *ranks, *said])
        where = f"In[{n}]" if n else "a cell"
        with self._lock:
            self._errors.append(f"{time.strftime('%H:%M:%S')} {where}: {type(err).__name__}: {head[:300]}")
            self.errors_view.value = _render.errors_html(self._errors)

    def _told_failure(self, r: dict[str, Any]) -> bool:
        """A rank the allocator reports failed by an actor failure supervision told us of (its
        grouped line, from _on_failure, says it already)."""
        return any(
            r["rank"] in ranks and r.get("reason") == f"{what}: {why}" for (what, why), (_, _, ranks) in self._failures.items()
        )

    def _on_failure(self, failure: Any) -> None:
        """An actor failure on this mesh's procs (a failed ``__init__``, an actor that died) joins the
        errors when the controller learns of it, before any call raises it. A dead proc is not
        listed here: refresh lists it with how it died, from its allocator."""
        procs = getattr(failure.mesh, "_procs", None) or []
        if not failure.actor or not any(p.mesh == self.mesh.name for p in procs):
            return
        # the headline: the remote error's last line ("ValueError: bad shard"), its traceback is in the cell's notice
        why = [ln.strip() for ln in str(failure.reason or failure.error).strip().splitlines() if ln.strip()] or [""]
        what = f"actor {failure.mesh_name} failed"
        with self._lock:
            # its __init__ span (see _span_errors) says the same later: listed once
            self._failed_inits.update((failure.mesh_name, r) for r in failure.crashed_ranks)
            # each rank's failure is an event of its own: alike ones (same actor, same error) are one line
            key = (what, why[-1][:300])
            entry = self._failures.get(key)
            if entry is None:  # _errors only grows: the index stays its line
                entry = self._failures[key] = (len(self._errors), time.strftime("%H:%M:%S"), set())
                self._errors.append("")
            entry[2].update(failure.crashed_ranks)
            ranks = sorted(entry[2])
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            self._errors[entry[0]] = f"{entry[1]} {what} on {who}: {key[1]}"
            self.errors_view.value = _render.errors_html(self._errors)

    def _show_stacks(self) -> None:
        from .. import debug

        started = time.strftime("%H:%M:%S")

        def work() -> None:
            # a rank that does not answer (stopped, a C call holding its GIL) costs the whole timeout
            try:
                got = debug.stacks(self.mesh, timeout=5.0)._repr_html_()
            except Exception as e:
                got = f'<span class="mnb-errors">stacks failed: {html.escape(str(e))}</span>'
            self._show(self.stacks_view, got)

        if self._running("stop") is not None:
            self.stacks_view.value = "<i>the mesh is being stopped: no stacks to collect</i>"
            return

        def begin() -> None:
            self.stacks_view.value = f"<i>collecting the stacks of every rank… (since {started})</i>"

        if not self._start("stacks", work, begin=begin):
            self.stacks_view.value = (
                f"<i>collecting the stacks of every rank… (since {self._since('stacks')})</i>"
                " · already running: the stacks show here when it ends"
            )

    def _on_lines(self, mesh: str, lines: list[tuple[int, str, float, str, str]]) -> None:
        if mesh != self.mesh.name:
            return
        with self._lock:
            self._lines.extend(ln for ln in lines if not ln[4].startswith("\r"))

    def _render_log(self) -> None:
        ranks: set[int] | None = None
        f = self.rank_filter.value.strip()
        if f:
            try:
                ranks = set(parse_ranks(f, len(self.mesh._procs)))
            except ValueError as e:
                self.log_view.value = f'<span class="mnb-errors">{html.escape(str(e))}</span>'
                return
        with self._lock:
            lines = [ln for ln in self._lines if ranks is None or ln[0] in ranks]
        # aggregated as in a cell: the k-th line of each rank with one template is one line, in order
        agg = Aggregator()
        agg.add(self.mesh.name, lines)
        rows = [text for _stream, text in agg.flush()]
        self.log_view.value = "<pre style='margin:0'>" + html.escape("\n".join(rows[-100:])) + "</pre>"

    # ------------------------------------------------------------ debug sessions
    def _render_debug(self, sessions: list[dict[str, Any]]) -> None:
        sids = tuple(sorted(str(d.get("sid")) for d in sessions))
        if sids == self._sids:
            return
        self._sids = sids
        rows: list[W.Widget] = []
        if sessions:
            rows.append(W.HTML(f"<b>paused at breakpoints</b> ({len(sessions)})"))
        for d in sorted(sessions, key=lambda d: (str(d.get("actor")), int(d.get("rank", 0)))):
            # every field is the user's text (their file, function, actor and host names)
            # a notebook cell's code by its cell (Cell In[N], line L), as the sessions table names it
            where = f"{cell_location(str(d.get('file', '?')), d.get('line', '?'))} in {d.get('function', '?')}"
            if d.get("post_mortem"):
                where += f" · post-mortem after {d['post_mortem']}"
            label = W.HTML(
                f"<code>{html.escape(str(d.get('actor')))}</code> rank {html.escape(str(d.get('rank')))}"
                f" on {html.escape(str(d.get('host')))} · {html.escape(where)}"
            )
            b = W.Button(description="attach", tooltip=BUSY_NOTE, layout=W.Layout(width="80px"))
            b.on_click(lambda _b, a=d.get("actor"), r=int(d.get("rank", 0)): self._attach(a, r))
            rows.append(W.HBox([b, label]))
        self.debug_view.children = rows

    def _attach(self, actor: str, rank: int) -> None:
        from .. import debug

        def work() -> None:
            try:
                dbg = debug.attach(actor, rank)
            except Exception as e:
                self._show(self.console_out, f'<span class="mnb-errors">{html.escape(str(e))}</span>')
                return
            self._dbg = dbg
            self._console_text = f"attached to {actor} rank {rank}\n{dbg.header}\n"
            self._show(self.console_out, self._console_html())

        def begin() -> None:
            self.console_out.value = f"<i>attaching to {html.escape(str(actor))} rank {rank}…</i>"

        self.console.layout.display = ""
        if not self._start("pdb", work, begin=begin):
            self._pdb_busy()

    def _console_send(self) -> None:
        cmd = self.console_in.value.strip()
        dbg = self._dbg
        if not cmd or dbg is None:
            return

        def work() -> None:
            try:
                # a step over a long line ("n", "c" to the next breakpoint) answers when the rank stops again
                out = dbg.send(cmd, timeout=60)
            except Exception as e:
                out = f"error: {e}\n"
            self._console_text += f"(Pdb) {cmd}\n{out}"
            self._console_pending = ""
            if dbg.ended:
                pm = dbg.session.post_mortem
                self._console_text += (
                    f"(the rank left post-mortem: its call fails with {pm})\n"
                    if pm
                    else "(the rank quit pdb: its call fails with BdbQuit)\n"
                    if dbg.quit
                    else "(the rank continued)\n"
                )
                self._dbg = None
            self._show(self.console_out, self._console_html())

        def begin() -> None:
            self.console_in.value = ""
            self._console_pending = f"(Pdb) {cmd}\n… (the rank runs it; since {time.strftime('%H:%M:%S')})\n"
            self.console_out.value = self._console_html()

        if not self._start("pdb", work, begin=begin):
            self._pdb_busy()  # the command stays typed, to send once the rank answers

    def _console_html(self, note: str = "") -> str:
        return "<pre style='margin:0'>" + html.escape((self._console_text + self._console_pending + note)[-20000:]) + "</pre>"

    def _pdb_busy(self) -> None:
        self.console_out.value = self._console_html(
            f"(the rank has not answered yet, asked at {self._since('pdb')}: one command at a time)\n"
        )

    def _see_a_later_stop(self) -> None:
        """After this dashboard's stop failed: if a stop since has stopped the mesh (a cell's
        ``procs.stop()`` or ``%mesh stop``, or the failed one, which ran on past its timeout), say
        so, as the stop button would have: until then its result still read "stop failed", and
        the mesh was drawn only as its ranks' records had it."""
        root = getattr(self.mesh, "_root", self.mesh)
        fut = root._stop_fut
        if fut is None or not fut.done():
            return
        # if no cell has read it yet, what it killed is said here, not in whichever cell runs
        with kills_noted() as killed:
            failed = fut.exception(timeout=0) is not None
        if failed:
            return
        self._stop_error = ""
        when = time.strftime("%H:%M:%S")
        self._show(self.stop_view, f"mesh {html.escape(self.mesh.name)} stopped (seen at {when}){_killed_html(killed)}")

    # ------------------------------------------------------------ actions and lifetime
    def _stop_mesh(self) -> None:
        name = self.mesh.name
        t0 = time.monotonic()

        def work() -> None:
            try:
                # the words of %mesh stop: a host that did not answer is named, with its job. What
                # it killed is said here, in this stop's result: a warning from this thread would
                # print in whatever cell happens to run
                with kills_noted() as killed:
                    stop_proc_mesh(self.mesh)
            except Exception as e:
                self._stop_error = str(e) or type(e).__name__
                with self._lock:
                    self._errors.append(f"{time.strftime('%H:%M:%S')} stop failed: {self._stop_error}")
                    # shown with the stop's result, not at the refresh after it (which waits on
                    # the hosts: a page showed "stop failed" with the errors list still without it)
                    self.errors_view.value = _render.errors_html(self._errors)
                said = f'<span class="mnb-errors">stop failed: {html.escape(self._stop_error)}</span>'
            else:
                said = f"mesh {html.escape(name)} stopped at {time.strftime('%H:%M:%S')} (took {time.monotonic() - t0:.1f} s)"
                said += _killed_html(killed)
            self._show(self.stop_view, said)

        def begin() -> None:
            self._stop_error = ""
            # at once, not at the next refresh: a second click would stop it again
            self.stop_button.disabled = self.stacks_button.disabled = True
            self.stop_view.value = f"<i>stopping mesh {html.escape(name)}… (since {time.strftime('%H:%M:%S')})</i>"

        if not self._start("stop", work, begin=begin, then=self.refresh):
            self.stop_view.value = f"<i>stopping mesh {html.escape(name)}… (since {self._since('stop')})</i> · already running"

    def _start(
        self, what: str, work: Callable[[], None], *, begin: Callable[[], None], then: Callable[[], Any] | None = None
    ) -> bool:
        """Say it started (``begin``, here), then run ``work`` and ``then`` on a thread of their
        own, unless an action named ``what`` still runs (False: the caller says so). ipywidgets
        runs a click's callback in the kernel's shell handler: an action that waited there (a
        stop on a host that does not answer, the stacks of a stopped rank, a pdb ``n`` over a
        long line) held every cell, and an interrupt, until it ended. One of each at a time:
        ten clicks are one stop."""
        with self._lock:
            if what in self._actions:
                return False
            t = threading.Thread(target=self._act, args=(what, work, then), name=f"monarch_nb-dashboard-{what}", daemon=True)
            self._actions[what] = (t, time.time())
        try:
            begin()  # before the thread: its result, however soon, is drawn after this
        except BaseException:
            with self._lock:
                del self._actions[what]
            raise
        t.start()
        return True

    def _act(self, what: str, work: Callable[[], None], then: Callable[[], Any] | None) -> None:
        try:
            work()
        except Exception as e:  # an action must never take the dashboard down: said in its errors
            with self._lock:
                self._errors.append(f"{time.strftime('%H:%M:%S')} {what} failed: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._actions.pop(what, None)
        if then is not None and not self._stop.is_set():
            then()

    def _running(self, what: str) -> float | None:
        """When the action ``what`` started (time.time()), or None if it does not run."""
        with self._lock:
            got = self._actions.get(what)
        return got[1] if got else None

    def _since(self, what: str) -> str:
        at = self._running(what)
        return time.strftime("%H:%M:%S", time.localtime(at)) if at is not None else "just now"

    def _show(self, view: W.HTML, value: str) -> None:
        """An action's result, unless the dashboard was closed meanwhile (its views are gone)."""
        if not self._stop.is_set():
            view.value = value

    def _loop(self) -> None:
        while True:
            self._kick.wait(self.interval)
            self._kick.clear()
            if self._stop.is_set():
                return
            with self._done:
                self._started += 1
            try:
                self._refresh_now()
            finally:
                with self._done:
                    self._finished += 1
                    self._done.notify_all()

    def close(self) -> None:
        """Stop refreshing. An action under way (a stop) is not waited for: it ends on its own
        thread, and its result is dropped."""
        self._stop.set()
        self._kick.set()
        shell = getattr(self, "_shell", None)
        if shell is not None:
            try:
                shell.events.unregister("post_run_cell", self._on_cell)
            except ValueError:
                pass
        if self._on_lines in self._client.log_taps:
            self._client.log_taps.remove(self._on_lines)
        if self._on_failure in self._client.failure_taps:
            self._client.failure_taps.remove(self._on_failure)
        super().close()
