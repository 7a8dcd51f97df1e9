"""Rank output into the notebook cell that caused it.

Every endpoint call is tagged with the cell that was executing when it was sent (the runtime
tells us through ``Client.on_call``); every captured line carries the id of the call that was
running when the rank printed it. While that cell runs, lines go out as ``stream`` messages
with the cell's request as parent (unaggregated ones at once, then at most every
:data:`STREAM_EMIT_S`, as ipykernel sends a cell's own prints). Output that arrives after the cell
ended (after the allocators flushed what ranks already wrote), when other cells may have run,
goes into a display of its own, sent with the cell's request as parent (JupyterLab keeps a
finished cell's request open until it runs again) and updated by id as more arrives.
Lines written outside any call go to the cell of the last call to that rank.

Aggregation collects lines for a window (default 1 s in a kernel) and collapses them across
ranks (:class:`monarch_nb.logs.Aggregator`). A cell's first line is not held for the window: it
is shown at once in a display of its own, provisionally; when the window closes that display is
emptied and the line appears in its merged group (a call is seen to start printing at once). ``\\r`` progress bars become one updating line
per rank. A flood is thinned to a line budget, with a marker that says how many lines were
suppressed and where to read them all; the allocators' logs keep every line.
"""

from __future__ import annotations

import collections
import html as html_lib
import itertools
import sys
import threading
import time
import uuid
from typing import Any

from .._numtext import plural, template
from .._ranks import format_ranks
from ..actor import blocked_on
from ..debug import quiet
from ..errors import ActorError, ExecError, SupervisionError
from ..logs import Aggregator, LogLine, format_line
from . import _interrupt

#: a kernel's default aggregation window, in seconds (as in Monarch's notebook default)
DEFAULT_WINDOW = 1.0
#: flood control: output lines per second per cell, after a burst allowance
RATE = 1000.0
BURST = 10_000.0
#: in a flood, what a source of lines (a rank or rank set, on one stream) that has not flooded
#: yet may still show of each batch, and all of them together per cell, beyond the line budget
QUIET_LINES = 100
QUIET_BUDGET = 2_000
#: a running cell's unaggregated lines go out at once, then at most this often (ipykernel's own
#: flush interval): JupyterLab renders a cell's whole stream output again for each message, and
#: a message per arrival (two dozen in the first 0.4 s of 16 ranks printing, 12,000 lines) held
#: the page for 2-3 s on two CPUs
STREAM_EMIT_S = 0.2
#: lines kept in a cell's late-output display
LATE_LINES = 500
#: a call blocking the cell longer than this shows "ranks replied / total"
PROGRESS_AFTER = 2.0
#: a spawn of at least this many procs shows "procs up / total" (a smaller one starts in about a
#: second: its bar would only flicker, and make the example notebooks' outputs vary with load)
SPAWN_PROGRESS_MIN = 16
#: a failure notice waits this long in a running cell for the user's code to see the failure
#: as an error (and catch it, so there is nothing "unhandled" to tell); the cell's end decides.
#: While the cell is blocked on a call it waits longer (up to NOTICE_HOLD_MAX): a call that the
#: failure concerns fails at once and the cell's code sees it as soon as it wakes
NOTICE_HOLD = 5.0
NOTICE_HOLD_MAX = 60.0
#: the failures of one mesh told in full in a cell, one of each kind: past these, a count
NOTICE_KINDS = 5
_TICK = 0.05


class _Cell:
    __slots__ = (
        "parent",
        "number",
        "running",
        "made_calls",
        "agg",
        "window",
        "progress",
        "progress_id",
        "progress_dirty",
        "late_id",
        "late",
        "late_dirty",
        "tokens",
        "last_refill",
        "suppressed",
        "flooders",
        "quiet_left",
        "started",
        "wait_id",
        "wait_shown",
        "deadline",
        "stream_held",
        "stream_sent",
        "first_id",
        "first_shown",
        "held",
        "raised",
        "caught",
        "noticed",
    )

    def __init__(self, parent: dict[str, Any], number: int, window: float | None) -> None:
        self.parent = parent
        self.number = number
        self.running = True
        self.made_calls = False
        self.agg = Aggregator()
        self.window = window  # None: each mesh's own setting
        #: the progress bars drawn in this cell: (mesh, rank, stream) -> (the call drawing it, its state)
        self.progress: dict[tuple[str, int, str], tuple[str, str]] = {}
        self.progress_id = ""
        self.progress_dirty = False
        self.late_id = ""
        self.late: collections.deque[str] = collections.deque(maxlen=LATE_LINES)
        self.late_dirty = False
        self.tokens = BURST
        self.last_refill = time.monotonic()
        self.suppressed: dict[str, int] = {}
        #: the sources of lines (stream, rank tag) thinned in this cell, and what quiet ones
        #: may still show beyond the budget
        self.flooders: set[tuple[str, str]] = set()
        self.quiet_left = QUIET_BUDGET
        self.started = time.monotonic()
        self.wait_id = ""
        self.wait_shown = ""
        self.deadline = 0.0  # when the aggregation window of the lines held now ends
        #: unaggregated lines not sent yet (STREAM_EMIT_S), and when the last of them went out
        self.stream_held: list[tuple[str, str]] = []
        self.stream_sent = 0.0
        self.first_id = ""  # the display showing the cell's first line until its window closes
        self.first_shown = False
        #: failure notices not shown yet: (arrival, text, mesh, rank)
        self.held: list[tuple[float, str, str, int | None]] = []
        #: the meshes named by errors raised into the cell's code ("*": an error naming none)
        self.raised: set[str] = set()
        #: once the cell ended: those of them it caught (it did not end with their error)
        self.caught: set[str] = set()
        #: meshes whose failure this cell has told of, with the kinds told (later failures of a
        #: kind told get one short line)
        self.noticed: dict[str, set[str]] = {}


class KernelOutput:
    """Routes rank output into cells of one IPython kernel; installed by ``%load_ext monarch_nb``."""

    def __init__(self, shell: Any, client: Any) -> None:
        self.shell = shell
        self.kernel = shell.kernel
        self.client = client
        self._lock = threading.RLock()
        self._cells: dict[str, _Cell] = {}
        self._by_call: collections.OrderedDict[str, _Cell] = collections.OrderedDict()
        self._by_rank: dict[tuple[str, int], _Cell] = {}
        self.current: _Cell | None = None
        self.last: _Cell | None = None
        #: cells holding output not shown yet: a cell whose ranks a later cell called is no
        #: longer found through ``_by_rank``, and its late lines must still be flushed
        self._pending: dict[int, _Cell] = {}
        self._numbers = itertools.count(1)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._main_tid = threading.main_thread().ident
        #: the next cell's aggregation window, set by ``%%mesh exec --no-aggregate``
        self.next_window: float | None = None

    # ------------------------------------------------------------ install
    def install(self) -> None:
        self.client.log_writer = self.on_lines
        self.client.on_call = self.on_call
        self.client.notice = self.notice
        self.client.on_raise = self.on_raise
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self._hook_display()
        _interrupt.install(self.shell)
        threading.Thread(target=self._ticker, name="monarch_nb-output", daemon=True).start()

    def _hook_display(self) -> None:
        """What a short call printed is shown before the value the cell returns (the
        displayhook runs before post_run_cell, while the lines still sit in the window)."""
        trap = getattr(self.shell, "display_trap", None)
        if trap is None or getattr(trap.hook, "_mnb_flush", False):
            return
        original = trap.hook

        def hook(value: Any) -> Any:
            if value is not None:
                try:
                    # the flood marker waits for the cell's end: one, not one per flush
                    self.flush_now(marker=False)
                except Exception:  # showing the value matters more than ordering it
                    pass
            return original(value)

        hook._mnb_flush = True  # type: ignore[attr-defined]
        hook._mnb_original = original  # type: ignore[attr-defined]
        trap.hook = hook

    def uninstall(self) -> None:
        trap = getattr(self.shell, "display_trap", None)
        if trap is not None and getattr(trap.hook, "_mnb_flush", False):
            trap.hook = trap.hook._mnb_original
        _interrupt.uninstall(self.shell)
        self._stop.set()
        self._wake.set()
        if self.client.log_writer == self.on_lines:
            self.client.log_writer = None
        if self.client.on_call == self.on_call:
            self.client.on_call = None
        if self.client.notice == self.notice:
            self.client.notice = None
        if self.client.on_raise == self.on_raise:
            self.client.on_raise = None
        for ev, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                self.shell.events.unregister(ev, fn)
            except ValueError:
                pass

    # ------------------------------------------------------------ cell lifecycle (main thread)
    def pre_run_cell(self, info: Any = None) -> None:
        parent = self.kernel.get_parent()
        cell = _Cell(parent, next(self._numbers), self.next_window)
        self.next_window = None
        with self._lock:
            self.current = cell

    def flush_now(self, marker: bool = True) -> None:
        """Show now what ranks printed before their replies (before the cell's result is shown);
        ``marker``: also the count of lines a flood control held back so far."""
        cell = self.current
        if cell is None or not cell.made_calls:
            return
        # it is still in the allocators' pipes: fetch it into this cell (a housekeeping wait:
        # paused ranks are the user's business, not a reason to open the debugger here)
        with quiet():
            self.client.flush_logs(timeout=1.0)
        with self._lock:
            self._flush_cell(cell, force=True, marker=marker)

    def post_run_cell(self, result: Any = None) -> None:
        cell = self.current
        if cell is None:
            return
        self.flush_now()
        # the cell's own prints first, then the display that keeps late rank output below them
        sys.stdout.flush()
        sys.stderr.flush()
        uncaught = _names(getattr(result, "error_in_exec", None))
        with self._lock:
            self._show_wait(cell, None)
            # a failure the cell's code saw as an error, caught or not, needs no notice: a caught
            # one is handled, an uncaught one is the cell's own error already (issue 14: the kernel's
            # default hook prints nothing for a failure raised into user code in the same cell)
            cell.caught = cell.raised | uncaught
            held, cell.held = cell.held, []
            self._show_notices(cell, [(t, m, r) for _at, t, m, r in held if not _seen(m, cell.caught)])
            cell.running = False
            self.last = cell
            self.current = None

    # ------------------------------------------------------------ from the runtime
    def on_call(self, call_id: str, targets: list[tuple[str, int]]) -> None:
        cell = self.current or self.last
        if cell is None:
            return
        cell.made_calls = True
        with self._lock:
            self._by_call[call_id] = cell
            if len(self._by_call) > 100_000:
                self._by_call.popitem(last=False)
            for t in targets:
                self._by_rank[t] = cell

    def on_lines(self, mesh: str, lines: list[LogLine]) -> None:
        """Runs on the I/O thread: place each line in its cell."""
        with self._lock:
            per_cell: dict[int, tuple[_Cell, list[LogLine]]] = {}
            for ln in lines:
                call = ln[3]
                cell = self._by_call.get(call) if call else None
                if cell is None:
                    cell = self._by_rank.get((mesh, ln[0])) or self.current or self.last
                if cell is None:
                    continue
                per_cell.setdefault(id(cell), (cell, []))[1].append(ln)
            for cell, ls in per_cell.values():
                self._pending[id(cell)] = cell
                self._feed(cell, mesh, ls)

    def notice(self, text: str, mesh: str = "", rank: int | None = None) -> None:
        """A runtime notice: in the running cell, where the user looks, else in the cell that last
        called ``mesh``, else in the last cell. A running cell holds it until it ends (or for
        ``NOTICE_HOLD``): if its code catches the failure as an error, nothing was unhandled."""
        with self._lock:
            cell = self.current
            if cell is None and mesh:
                cell = self._by_rank.get((mesh, rank)) if rank is not None else None
                cell = cell or next((c for (m, _r), c in reversed(self._by_rank.items()) if m == mesh), None)
            cell = cell or self.last
            if cell is None:
                return
            if cell.running:
                cell.held.append((time.monotonic(), text, mesh, rank))
                self._wake.set()
            elif not _seen(mesh, cell.caught):
                self._show_notices(cell, [(text, mesh, rank)])

    def on_raise(self, err: BaseException) -> None:
        """An error raised into code reading a future: in the running cell's thread, the cell saw
        the failures it names."""
        if threading.get_ident() != self._main_tid:
            return  # a frontend's own thread (a dashboard), not the user's cell
        cell = self.current
        names = _names(err)
        if cell is not None and names:
            with self._lock:
                cell.raised |= names

    def _show_notices(self, cell: _Cell, items: list[tuple[str, str, int | None]]) -> None:
        """Each mesh's first failure of each kind in full, later ones of a kind told in one short
        line. A kind: the text with its numbers blanked (the rank's point, a pid, a shard number):
        a broadcast that failed with a ValueError on 8 ranks, a KeyError on 3 and a CUDA error on
        one showed the ValueError alone, the other two "as above"."""
        later: dict[str, list[int | None]] = {}
        other: dict[str, list[int | None]] = {}
        lines = []
        for text, mesh, rank in items:
            kind = template(text)
            kinds = cell.noticed.setdefault(mesh, set())
            if mesh and kind in kinds:
                later.setdefault(mesh, []).append(rank)
                continue
            if mesh and len(kinds) >= NOTICE_KINDS:
                other.setdefault(mesh, []).append(rank)
                continue
            kinds.add(kind)
            lines.append(text.rstrip("\n"))
        for how, groups in (("as above", later), ("each unlike those above, not shown", other)):
            for mesh, ranks in groups.items():
                known = sorted({r for r in ranks if r is not None})
                unit = "rank" if len(known) == 1 else "ranks"
                which = f" ({unit} {format_ranks(known)})" if known else ""
                n = len(ranks)
                lines.append(f"monarch_nb: {plural(n, 'more failure', 'more failures')} of mesh {mesh!r}{which}, {how}")
        if not lines:
            return
        if cell.running:
            self._send(cell, "stream", {"name": "stderr", "text": "".join(t + "\n" for t in lines)})
        else:
            cell.late.extend(lines)
            cell.late_dirty = True
            self._pending[id(cell)] = cell
            self._wake.set()

    def _window(self, cell: _Cell, mesh: str) -> float:
        if cell.window is not None:
            return cell.window
        w = self.client.log_windows.get(mesh)
        return DEFAULT_WINDOW if w is None else float(w)

    def _feed(self, cell: _Cell, mesh: str, lines: list[LogLine]) -> None:
        plain: list[LogLine] = []
        for ln in lines:
            text = ln[4]
            key = (mesh, ln[0], ln[1])
            bar = cell.progress.get(key)
            # a line of the call drawing the bar ends it: not a line the rank printed on its other
            # stream (tqdm on stderr, a print on stdout) nor another call's (two actors of one
            # proc), which blanked the bar until its next redraw
            if "\r" in text or (bar is not None and bar[0] == ln[3]):
                # a redrawn line: only its latest state matters; a newline ends it
                cur = text.rstrip("\r").rsplit("\r", 1)[-1]
                cell.progress[key] = (ln[3], cur)
                cell.progress_dirty = True
                if not text.startswith("\r"):
                    del cell.progress[key]
                    plain.append((ln[0], ln[1], ln[2], ln[3], cur))
                continue
            plain.append(ln)
        if not plain:
            self._wake.set()
            return
        window = self._window(cell, mesh)
        if window <= 0:
            cell.stream_held += [(ln[1], format_line(ln[0], ln[4])) for ln in plain]
            if not self._send_held(cell):
                self._wake.set()  # the ticker sends them (_flush_cell)
        else:
            end = time.monotonic() + window
            cell.deadline = min(cell.deadline, end) if len(cell.agg) else end
            cell.agg.add(mesh, plain)
            if not cell.first_shown and cell.running:
                # shown now, on this thread (the ticker's tick is 50 ms); merged at the flush
                cell.first_shown = True
                cell.first_id = uuid.uuid4().hex
                # " …": the rest of the window's lines follow (and nbval's sanitizer knows the
                # display by it: it runs without applying the update that empties it)
                text = format_line(plain[0][0], plain[0][4]) + PROVISIONAL_MARK
                self._send_display(cell, cell.first_id, text, update=False)
            self._wake.set()

    # ------------------------------------------------------------ emitting
    def _flush_cell(self, cell: _Cell, force: bool = False, marker: bool = True) -> None:
        if len(cell.agg) and (force or time.monotonic() >= cell.deadline):
            first, cell.first_id = cell.first_id, ""
            self._emit(cell, cell.agg.flush(), into=first)
        self._send_held(cell, force)
        if cell.progress_dirty:
            self._show_progress(cell)
        if cell.suppressed and ((force and marker) or time.monotonic() - cell.last_refill > 1.0):
            self._emit_marker(cell)

    def _send_held(self, cell: _Cell, force: bool = False) -> bool:
        """Send a cell's unaggregated lines held so far if it is time (STREAM_EMIT_S since the
        last ones, or the cell ended); whether nothing is left held."""
        if not cell.stream_held:
            return True
        now = time.monotonic()
        if not (force or not cell.running or now - cell.stream_sent >= STREAM_EMIT_S):
            return False
        held, cell.stream_held = cell.stream_held, []
        cell.stream_sent = now
        self._emit(cell, held)
        return True

    def _admit(self, cell: _Cell, n: int) -> int:
        now = time.monotonic()
        cell.tokens = min(BURST, cell.tokens + (now - cell.last_refill) * RATE)
        cell.last_refill = now
        k = min(n, int(cell.tokens))
        cell.tokens -= k
        return k

    def _emit(self, cell: _Cell, items: list[tuple[str, str]], into: str = "") -> None:
        """``into``: the display of a provisional first line, which these lines replace."""
        k = self._admit(cell, len(items))
        if k < len(items):
            items = _thin(cell, items, k)
        if into:
            # emptied, not filled: the group goes out as the stream every other window's does
            self._send_display(cell, into, "", update=True)
        if not items:
            return
        if cell.running:
            for stream in ("stdout", "stderr"):
                text = "".join(t + "\n" for s, t in items if s == stream)
                if text:
                    self._send(cell, "stream", {"name": stream, "text": text})
        else:
            cell.late.extend(t for _, t in items)
            cell.late_dirty = True
            self._wake.set()

    def _emit_marker(self, cell: _Cell) -> None:
        meshes = sorted({m for (m, _r) in self._by_rank if self._by_rank[(m, _r)] is cell}) or ["NAME"]
        n = sum(cell.suppressed.values())
        cell.suppressed.clear()
        text = f"[{plural(n, 'line')} suppressed — %mesh logs {meshes[0]} for every line]"
        if cell.running:
            self._send(cell, "stream", {"name": "stderr", "text": text + "\n"})
        else:
            cell.late.append(text)
            cell.late_dirty = True

    def _show_progress(self, cell: _Cell) -> None:
        cell.progress_dirty = False
        text = "\n".join(f"[{r}] {t}" for (_m, r, _s), (_c, t) in sorted(cell.progress.items()))
        if cell.running or not cell.late_id:
            if not cell.progress_id:
                if not cell.running:
                    return
                cell.progress_id = uuid.uuid4().hex
                self._send_display(cell, cell.progress_id, text, update=False)
            else:
                self._send_display(cell, cell.progress_id, text, update=True)
        elif cell.progress_id:
            self._send_display(cell, cell.progress_id, text, update=True)

    def _show_wait(self, cell: _Cell, shown: tuple[str, str] | None) -> None:
        """The progress bar of a cell blocked on a long call ("ranks replied") or a spawn ("procs
        up"), as text and HTML; ``None`` clears it."""
        if shown is None:
            if cell.wait_id and cell.wait_shown:
                self._send_display(cell, cell.wait_id, "", update=True)
                cell.wait_shown = ""
            return
        text, html = shown
        if text == cell.wait_shown:
            return
        if not cell.wait_id:
            cell.wait_id = uuid.uuid4().hex
            self._send_display(cell, cell.wait_id, text, update=False, html=html)
        else:
            self._send_display(cell, cell.wait_id, text, update=True, html=html)
        cell.wait_shown = text

    def _send_display(self, cell: _Cell, display_id: str, text: str, update: bool, html: str = "") -> None:
        data = {"text/plain": text, "text/html": html} if html else {"text/plain": text}
        content = {"data": data, "metadata": {}, "transient": {"display_id": display_id}}
        self._send(cell, "update_display_data" if update else "display_data", content)

    def _send(self, cell: _Cell, msg_type: str, content: dict[str, Any]) -> None:
        k = self.kernel
        ident = f"stream.{content['name']}".encode() if msg_type == "stream" else None
        k.session.send(k.iopub_socket, msg_type, content, parent=cell.parent, ident=ident)

    # ------------------------------------------------------------ the ticker thread
    def _ticker(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(_TICK)
            self._wake.clear()
            try:
                self._tick()
            except Exception:  # never let a rendering bug end output routing
                import logging

                logging.getLogger(__name__).exception("monarch_nb output routing")

    def _tick(self) -> None:
        with self._lock:
            cells = {id(c): c for c in (*self._by_rank.values(), self.current, self.last) if c is not None}
            cells.update(self._pending)
            for cell in cells.values():
                self._flush_cell(cell)
                if cell.late_dirty and not cell.running:
                    cell.late_dirty = False
                    # made at the first late line, not at the cell's end: a placeholder would be
                    # saved in the notebook as an empty output for every cell that called ranks.
                    # JupyterLab keeps a finished cell's request open, so the display lands in it
                    update = bool(cell.late_id)
                    cell.late_id = cell.late_id or uuid.uuid4().hex
                    self._send_display(cell, cell.late_id, "\n".join(cell.late), update=update)
            self._pending = {
                i: c for i, c in self._pending.items() if len(c.agg) or c.progress_dirty or c.suppressed or c.stream_held
            }
            cur = self.current
            if cur is not None:
                self._show_wait(cur, self._wait_text(cur))
                self._release_notices(cur)

    def _release_notices(self, cell: _Cell) -> None:
        """A long cell hears of a failure its code has not seen as an error within NOTICE_HOLD."""
        if not cell.held:
            return
        now = time.monotonic()
        hold = NOTICE_HOLD_MAX if blocked_on(self._main_tid or 0) is not None else NOTICE_HOLD
        due = [h for h in cell.held if now - h[0] >= hold and not _seen(h[2], cell.raised)]
        if due:
            cell.held = [h for h in cell.held if h not in due]
            self._show_notices(cell, [(t, m, r) for _at, t, m, r in due])

    def _wait_text(self, cell: _Cell) -> tuple[str, str] | None:
        fut = blocked_on(self._main_tid or 0)
        prog = fut.progress() if fut is not None else None
        if fut is None or prog is None or fut.done():
            return None
        if fut.progress_unit == "procs up" and prog[1] < SPAWN_PROGRESS_MIN:
            return None
        elapsed = time.monotonic() - cell.started
        if elapsed < PROGRESS_AFTER:
            return None
        args = (fut.description, prog[0], prog[1], fut.progress_unit, elapsed)
        return progress_text(*args), progress_html(*args)


def _thin(cell: _Cell, items: list[tuple[str, str]], k: int) -> list[tuple[str, str]]:
    """``k`` of ``items`` (or a few more), in order, shared fairly among their sources: one rank
    printing 100,000 lines must not take the whole budget, so that the few lines of the other
    ranks (a warning, a traceback on stderr) never show. A source that has not flooded yet shows
    up to QUIET_LINES lines a batch (QUIET_BUDGET a cell) beyond the budget; the budget is
    then split evenly, a source taking less leaving the rest to the others."""
    by_src: dict[tuple[str, str], list[int]] = {}
    for i, (stream, text) in enumerate(items):
        by_src.setdefault((stream, text[: text.find("] ") + 1]), []).append(i)
    keep: list[int] = []
    rest: dict[tuple[str, str], list[int]] = {}
    for src, idx in by_src.items():
        if src not in cell.flooders and cell.quiet_left > 0:
            n = min(len(idx), QUIET_LINES, cell.quiet_left)
            cell.quiet_left -= n
            keep += idx[:n]
            idx = idx[n:]
        if idx:
            rest[src] = idx
    left = k
    for src, idx in sorted(rest.items(), key=lambda kv: len(kv[1])):
        share = left // len(rest) if left > 0 else 0
        n = min(len(idx), share)
        keep += idx[:n]
        left -= n
        del rest[src]
        if n < len(idx):
            cell.flooders.add(src)
            for i in idx[n:]:
                stream = items[i][0]
                cell.suppressed[stream] = cell.suppressed.get(stream, 0) + 1
    keep.sort()
    return [items[i] for i in keep]


def _names(err: BaseException | None) -> set[str]:
    """The meshes (proc or actor) a failure's error names, also through its causes; "*" for one
    that names none."""
    names: set[str] = set()
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, (ActorError, SupervisionError, ExecError)):
            found = {n for n in (getattr(err, a, "") for a in ("mesh", "actor")) if isinstance(n, str) and n}
            names |= found or {"*"}
        err = err.__cause__ or err.__context__
        seen += 1
    return names


def _seen(mesh: str, names: set[str]) -> bool:
    return bool(names) and ("*" in names or mesh in names)


_BAR = 20
#: ends the provisional display of a cell's first line
PROVISIONAL_MARK = " \u2026"


def progress_text(what: str, done: int, total: int, unit: str, elapsed: float) -> str:
    """``waiting on spawn of 16 procs 'big': 5/16 procs up [#####...............] (3 s)``: plain
    ASCII (an emoji or a block glyph needs a font the browser may not have)."""
    filled = _BAR * done // total if total > 0 else _BAR
    return f"waiting on {what}: {done}/{total} {unit} [{'#' * filled}{'.' * (_BAR - filled)}] ({elapsed:.0f} s)"


def progress_html(what: str, done: int, total: int, unit: str, elapsed: float) -> str:
    """The same, with the browser's own progress bar (``<progress>``) for frontends showing HTML."""
    return (
        f'<div class="mnb-progress">waiting on <code>{html_lib.escape(what)}</code> '
        f'<progress value="{done}" max="{total}" style="vertical-align: middle"></progress> '
        f"{done}/{total} {html_lib.escape(unit)} ({elapsed:.0f} s)</div>"
    )
