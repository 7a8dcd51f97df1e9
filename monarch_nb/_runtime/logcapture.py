"""Per-proc log capture at the file-descriptor level.

The allocator owns the read ends of each proc's stdout/stderr pipes. Lines are tagged with
rank, stream, wall-clock time and the id of the call that printed them, which the proc
announces in-band with an OSC escape (``ESC ] mnb;call=ID BEL``) in front of that call's text,
so the tag is exact for Python output and never races the data. Every line goes to a JSONL
file; subscribers get batches.

The markers are written lazily (:class:`TaggedStream`): a proc's ``sys.stdout``/``sys.stderr``
put one in front of a write whose call (the writing thread's or asyncio task's, see
:func:`begin_call`) is not the one its last marker named, through the stream's own buffer, so
a call that prints nothing costs no syscall and wakes nobody, and two calls running at once in
one proc (two actors, an async actor's concurrent endpoints) each get their own lines. A call
that printed ends with the marker of no call behind its last text (the allocator then forwards
its burst at once). The last stream a call wrote to also names the call that ended there
(``ESC ] mnb;call=-ID BEL`` just before that marker, :func:`ended_marker`): the allocator passes
it on to its controllers behind the call's lines (:data:`ENDED`), so a script's controller shows
them before the value without asking the allocator. C-level writes to fd 1/2 carry the tag of
the last marker on that stream.

The allocator keeps each call's line apart (:meth:`ProcLog._demux`): text a call leaves open
(``print(x, end="")``) when another call's text follows goes on when that call writes again, and
ends with its own newline or with the call, so two calls printing at once never cut or glue
each other's lines; a line is passed on when it is whole.

A line that starts with ``\r`` is the current state of a line still being redrawn (a progress
bar), not a finished line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import io
import json
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._newest import Newest
from .._wire._rawbuf import join, to_bytes
from ._private import private

logger = logging.getLogger(__name__)

MARK_PREFIX = b"\x1b]mnb;call="
MARK_END = b"\x07"
_MARK = re.compile(rb"\x1b\]mnb;call=([^\x07]*)\x07")

#: characters in one batch of lines from which it reaches subscribers before the log file
BIG_WRITE = 1 << 20

#: (rank, stream, ts, call_id, line); a huge line (:data:`HUGE_LINE` or more, read in a megabyte
#: or more at once) stays ``bytes``, UTF-8 as the proc wrote it, decoded only where it is shown
LogLine = tuple[int, str, float, str, str | bytes]

#: a line this long, read in one megabyte or more, is passed on as the proc's bytes
HUGE_LINE = 1 << 16

#: a run of lines of one rank, stream and call read at once (a flood's chunk):
#: (rank, stream, ts, call_id, text, n), ``text`` the ``n`` lines joined by ``"\n"``; it goes to
#: subscribers as one string, not ``n`` tuples (:func:`expand` makes it lines)
LogRun = tuple[int, str, float, str, str, int]

#: what :class:`ProcLog` emits and the allocator sends: lines and runs of lines, in order
LogItem = LogLine | LogRun


def expand(items: list[LogItem]) -> list[LogLine]:
    """``items`` as lines (each run as its lines)."""
    if 6 not in map(len, items):
        return items  # type: ignore[return-value]
    out: list[LogLine] = []
    for it in items:
        if len(it) == 5:
            out.append(it)
        else:
            rank, stream, ts, call, text, _ = it
            out += [(rank, stream, ts, call, t) for t in text.split("\n")]
    return out


def count_lines(items: list[LogItem]) -> int:
    """How many lines ``items`` hold."""
    return sum(it[5] if len(it) == 6 else 1 for it in items)


def split_run(run: LogRun, limit: int) -> list[LogRun]:
    """``run`` cut at line ends into runs of about ``limit`` characters (a line longer than
    that is a run of its own)."""
    rank, stream, ts, call, text, _ = run
    out: list[LogRun] = []
    start, n = 0, len(text)
    while n - start > limit:
        cut = text.rfind("\n", start, start + limit + 1)
        if cut < 0:
            cut = text.find("\n", start + limit)
            if cut < 0:
                break
        piece = text[start:cut]
        out.append((rank, stream, ts, call, piece, piece.count("\n") + 1))
        start = cut + 1
    piece = text[start:] if start else text
    out.append((rank, stream, ts, call, piece, piece.count("\n") + 1))
    return out


#: what a proc's tail keeps of a longer line (the tail is for error messages)
TAIL_LINE = 4096


def _tail_lines(items: list[LogItem], n: int) -> list[LogLine]:
    """The last ``n`` lines of ``items`` (of a run, only those are split off), each cut to
    :data:`TAIL_LINE`: a tail holding the last 50 lines of 10 MiB kept 500 MiB alive, and
    each new huge line had to be faulted into fresh memory (19 ms for 10 MiB, huge pages
    compacted, on the line's way to the controller)."""
    out: list[LogLine] = []
    for it in reversed(items):
        if len(it) == 5:
            out.append(it if len(it[4]) <= TAIL_LINE else (*it[:4], it[4][:TAIL_LINE]))
        else:
            rank, stream, ts, call, text, _ = it
            out += [(rank, stream, ts, call, t) for t in reversed(text.rsplit("\n", n - len(out))[-(n - len(out)) :])]
        if len(out) >= n:
            break
    out.reverse()
    return out


def line_text(line: str | bytes) -> str:
    """A log line's text (a huge one is still the proc's bytes)."""
    return line if isinstance(line, str) else _decode(line)


def marker(call_id: str) -> bytes:
    return MARK_PREFIX + call_id.encode() + MARK_END


def ended_marker(call_id: str) -> bytes:
    """The marker that says call ``call_id`` ended (it printed): no text is tagged with it, the
    marker of no call always follows it."""
    return MARK_PREFIX + b"-" + call_id.encode() + MARK_END


#: the kind of a message on a controller's log port (``(kind, payload, mesh, alloc_id)``; its
#: lines are ``(LOGS, items, ...)``) that lists calls whose output ended: ``(ENDED, [(rank,
#: call_id), ...], mesh, alloc_id)``, sent behind the lines those calls printed. A controller
#: of an older version ignores it (it reads only ``LOGS``)
LOGS = "logs"
ENDED = "ended"

#: what an allocator's hello says when it sends :data:`ENDED` messages
ENDS_CALLS = "ends_calls"


class _Call:
    """A call running in this proc, as its output sees it: its id and the streams it wrote
    to (a marker with its id is in each), which its end flushes."""

    __slots__ = ("id", "streams")

    def __init__(self, call_id: str) -> None:
        self.id = call_id
        #: made at its first marker (most calls print nothing)
        self.streams: list[TaggedStream] | None = None


_NO_CALL = _Call("")
_new = object.__new__

#: the call of the thread or asyncio task that writes (each actor thread has its own context,
#: each task a copy of its creator's): two calls running at once in one proc (two actors, an
#: async actor's concurrent endpoints) each get their own text. None: the context runs no call
_call_var: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("monarch_nb_call", default=None)

#: the calls running in this proc, oldest first
_running: list[_Call] = []

#: what a thread with no call of its own (one the user started) prints is tagged with: the
#: latest call begun that still runs, as before calls had contexts
_latest = [_NO_CALL]

#: this proc's coalescing streams (their fast path ends when the running calls change)
_fast_streams: list[TaggedStream] = []


def begin_call(call_id: str) -> None:
    """Tag what this context (thread, task) prints from now on with ``call_id``, until
    :func:`end_call` (markers follow lazily, in-band)."""
    # on every call: no __init__ frame, no list until it prints, the fast-path loop inline
    c = _new(_Call)
    c.id, c.streams = call_id, None
    _running.append(c)
    _latest[0] = c
    _call_var.set(c)
    for s in _fast_streams:  # _end_fast_paths()
        s.__dict__.pop("write", None)


def current_call() -> str | None:
    """The id of the call this context (thread, task) runs; None: it runs none of its own."""
    c = _call_var.get()
    return None if c is None else c.id


def _end_fast_paths() -> None:
    # after the change of the running calls (a writer that decided before it undoes its own
    # fast path, see TaggedStream.write): the next write must see the change and write a marker
    for s in _fast_streams:
        s.__dict__.pop("write", None)


def set_call(call_id: str) -> None:
    """This context's call is ``call_id`` from now on ("": none), the previous one dropped
    without its end (tests)."""
    c = _call_var.get()
    if c is not None and c in _running:
        _running.remove(c)
    if call_id:
        begin_call(call_id)
        return
    _call_var.set(None)
    _latest[0] = (_running[-1:] or [_NO_CALL])[0]  # one read: another thread may empty the list between two
    _end_fast_paths()


#: a proc's stdout writes the lines printed this soon after its last write to the pipe
#: together, up to this much later (one write for a burst of lines, not one per line)
COALESCE_S = 0.001

_END = marker("")
_END_TEXT = _END.decode("ascii")
_text_write = io.TextIOWrapper.write
_text_flush = io.TextIOWrapper.flush

#: every tagged stream of this process (a forked child makes their locks anew)
_all_streams: weakref.WeakSet[TaggedStream] = weakref.WeakSet()


class TaggedStream(io.TextIOWrapper):
    """A line-buffered text stream that announces the writer's call before its text.

    Each write is tagged with the call of the context that writes (:func:`begin_call`): a
    marker goes in front of it when that call is not the one the stream's last marker named,
    marker and text together under the stream's lock, so two calls printing at once from two
    threads or tasks each get their own lines.

    ``coalesce`` (stdout): a line goes to the pipe at once when the stream has not written for
    :data:`COALESCE_S`; lines printed sooner after (a loop of prints) wait in the buffer for at
    most that long, so 10,000 lines cost a few dozen writes (and allocator wake-ups), not
    10,000. The first write of a call is flushed at once, so output written to the fd by C code
    after it still carries the call's tag; the end of a call flushes what is left.

    Within a burst, while one call runs in the proc, the writes skip this class's Python
    ``write``: the instance's ``write`` becomes the C one of :class:`io.TextIOWrapper` (what
    ``print`` looks up on every call) until the flusher's next tick or a change of the running
    calls puts the Python one back. Nothing is decided per write inside that window: the
    markers (no other call can write) and the flush (the flusher is armed) are taken care of.
    """

    _mnb_last = ""
    _mnb_coalesce = False
    _mnb_flushed = 0.0
    _mnb_flusher: _Flusher | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # reentrant: a signal handler that prints may run inside a write
        self._mnb_lock = threading.RLock()
        _all_streams.add(self)

    def write(self, s: str) -> int:
        c = _call_var.get() or _latest[0]
        with self._mnb_lock:
            if c.id != self._mnb_last:
                self._mnb_last = c.id
                # through the same buffer: the marker lands between earlier text and this text
                _text_flush(self)
                self.buffer.write(marker(c.id))
                self._mnb_flushed = 0.0
                if c.id:
                    if c.streams is None:
                        c.streams = [self]
                    elif self not in c.streams:
                        c.streams.append(self)
            n = _text_write(self, s)
            if self._mnb_coalesce and ("\n" in s or "\r" in s):
                now = time.monotonic()
                if now - self._mnb_flushed >= COALESCE_S:
                    self._mnb_flushed = now
                    _text_flush(self)
                elif (fl := self._mnb_flusher) is not None:
                    if len(_running) <= 1 and c is _latest[0]:
                        # a burst of the only call: the next lines go straight into the buffer
                        # until the flusher's tick
                        self.__dict__["write"] = _text_write.__get__(self)
                        if len(_running) > 1 or c is not _latest[0]:
                            # a call began meanwhile, after its begin_call ended fast paths
                            self.__dict__.pop("write", None)
                    fl.arm()
        return n

    def end_call(self, ended: str = "", call_id: str | None = None) -> None:
        """At the end of a call that printed here: flush, with the marker of "no call" after
        its text if it was the last to write here, which tells the allocator that this burst is
        over (it forwards it at once); ``ended``: the id of the call, named before that marker
        (on the last stream the call wrote to). ``call_id`` None: whichever call wrote last."""
        with self._mnb_lock:
            self.__dict__.pop("write", None)
            last = self._mnb_last
            if last and (ended or call_id is None or last == call_id):
                # another call's text after this one's (it wrote last) is marked anew after this
                self._mnb_last = ""
                end = ended_marker(ended) + _END if ended else _END
                if _END_TEXT.encode(self.encoding, "replace") == _END:
                    _text_write(self, end.decode("ascii", "replace"))  # behind the text in the buffer: one write for both
                else:
                    _text_flush(self)
                    self.buffer.write(end)
                self._mnb_flushed = time.monotonic()
            _text_flush(self)


def _relock_after_fork() -> None:
    # a thread of the parent may have held a lock when it forked: the child's only thread
    # would wait for it for ever at its first print
    for s in list(_all_streams):
        s._mnb_lock = threading.RLock()


os.register_at_fork(after_in_child=_relock_after_fork)


class _Flusher:
    """Flushes a coalescing stream :data:`COALESCE_S` after a line was left in its buffer (a
    print followed by a long computation must not sit there), and ends its fast path."""

    def __init__(self, stream: TaggedStream) -> None:
        self.stream = stream
        _fast_streams.append(stream)  # only a stream with a flusher takes the fast path
        self._start()
        # a child forked by user code (a data loader's worker) has the stream but not the thread
        os.register_at_fork(after_in_child=self._child)

    def _start(self) -> None:
        self.wanted = threading.Event()
        threading.Thread(target=self._run, name="mnb-stdout-flush", daemon=True).start()

    def _child(self) -> None:
        self._start()
        self.arm()  # the parent may have forked in a burst, with lines in the buffer

    def arm(self) -> None:
        if not self.wanted.is_set():
            self.wanted.set()

    def _run(self) -> None:
        st = self.stream
        while True:
            self.wanted.wait()
            time.sleep(COALESCE_S)
            self.wanted.clear()
            # first back to the Python write, then flush: a line written in between either
            # decides for itself or is in the buffer this flush empties
            st.__dict__.pop("write", None)
            st._mnb_flushed = time.monotonic()
            try:
                _text_flush(st)
            except (OSError, ValueError):
                return


def install_tagged_streams() -> None:
    """Make this proc's ``sys.stdout``/``sys.stderr`` :class:`TaggedStream` (line-buffered,
    stdout coalescing bursts of lines)."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        try:
            old.flush()
            # a fresh buffer over the fd: the zygote's one cached facts about its old target (seekable)
            raw = open(old.fileno(), "wb", closefd=False)
            new = TaggedStream(raw, encoding=old.encoding, errors=old.errors, line_buffering=name == "stderr")
        except (AttributeError, ValueError, OSError):
            continue
        if name == "stdout":
            new._mnb_coalesce = True
            new._mnb_flusher = _Flusher(new)
        _tagged.append(new)
        setattr(sys, name, new)


#: how long a reader of a rank's log waits for a huge line still on its way to the file
CLOSE_WAIT_S = 2.0
#: calls whose end a proc's capture remembers (see ``_ended_ids``)
ENDED_IDS_KEPT = 256
#: this process's rank logs still being written to, by path (:func:`read_log` waits for them)
_open_logs: weakref.WeakValueDictionary[str, ProcLog] = weakref.WeakValueDictionary()

#: this proc's tagged streams
_tagged: list[TaggedStream] = []


def end_call(call_id: str = "") -> bool:
    """This context's call (``call_id``) ended: what it printed leaves the proc now (before its
    reply does). True if it printed (its reply says so: a script's controller shows the text
    first, once the allocator passed on that ``call_id`` ended)."""
    c = _call_var.get()
    if c is None:
        return False
    _call_var.set(None)
    try:
        _running.remove(c)
    except ValueError:  # dropped by set_call
        pass
    _latest[0] = (_running[-1:] or [_NO_CALL])[0]  # one read: another thread may empty the list between two
    for s in _fast_streams:  # _end_fast_paths(), inline: this runs on every call
        s.__dict__.pop("write", None)
    # the streams the call wrote to (its first write to each put a marker there): one it did
    # not write to has none of its text to flush (most calls print nothing, and the flushes
    # were a tenth of a small call's work in the proc)
    streams = c.streams
    if not streams:
        return False
    mine = [s for s in _tagged if s in streams] + [s for s in streams if s not in _tagged]
    for s in mine:
        try:
            # the last one names the call: the others' text is in their pipes by then (these
            # writes block), and the allocator reads those before it passes the end on
            s.end_call(call_id if s is mine[-1] else "", c.id)
        except (OSError, ValueError):
            pass
    return True


class ProcLog:
    """Splits one proc's two streams into tagged lines and appends them to ``path``."""

    def __init__(
        self,
        path: str,
        rank: int,
        emit: Callable[[list[LogItem]], None],
        max_bytes: int = 0,
        on_call_end: Callable[[list[str]], None] | None = None,
        max_line: int = 64 << 20,
    ) -> None:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        self.path = path
        self.rank = rank
        self._emit = emit
        #: called when the proc said that a call which printed is over (its burst is complete),
        #: with the ids of the calls that ended (after the lines they printed went to ``emit``)
        self._on_call_end = on_call_end
        #: ids of calls that ended in what ``feed`` is reading, and whether a burst ended there
        self._calls_ended: list[str] = []
        self._burst_over = False
        #: the newest file holds at most half: with the previous one, the rank stays under max_bytes
        self._half = max_bytes // 2
        self._open()
        self._partial = {"stdout": b"", "stderr": b""}
        self._more: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        #: the bytes in ``_more``; a line that reaches ``_max_line`` is cut there
        self._more_n = {"stdout": 0, "stderr": 0}
        self._max_line = max_line
        #: batches on their way to the file after a huge one, written by :func:`_file_writer`
        #: while ``_writing`` (the file is then that thread's alone); both under ``_lock``
        self._unwritten: list[list[LogItem]] = []
        self._writing = False
        #: the waiting batches are some thread's to write (the writer's, or a caller of settle)
        self._submitted = False
        self._close_after = False
        self._lock = threading.Condition(threading.Lock())
        _open_logs[path] = self
        self._call = {"stdout": "", "stderr": ""}
        #: per stream, the text of lines calls left open when another call's text came in (two
        #: calls printing at once in one proc): each call's line goes on when its text does, and
        #: ends with a newline of its own or with the call, never glued to or cut by the other's
        self._held: dict[str, dict[str, bytes]] = {"stdout": {}, "stderr": {}}
        #: the latest calls whose end was read (as keys): text of theirs read after it (on the
        #: other stream, read late) ends its line with the read that holds it, not held for an
        #: end already passed; ``_late``: such text is held now
        self._ended_ids: Newest[str, None] = Newest(ENDED_IDS_KEPT, refresh=False)
        self._late = False
        #: per stream, the open line whose progress state went out last (not sent twice)
        self._drawn = {"stdout": b"", "stderr": b""}
        self.tail: list[LogLine] = []
        self.nlines = 0
        #: lines that could not be written to the file (a full disk) since the last that were,
        #: and why: the next write that succeeds puts a note of the gap first
        self.unwritten_lines = 0
        self._lost_why = ""
        self._warned_at = -1e9
        #: close() was called: the file is not opened again
        self._ended = False

    def feed(self, stream: str, data: bytes) -> None:
        self._feed(stream, data)
        if self._late:
            self._late = False
            held, now = self._held[stream], time.time()
            late: list[LogItem] = [self._left_open(stream, c, held.pop(c), now) for c in list(held) if c in self._ended_ids]
            if late:
                self._write(late)
        if self._burst_over:
            self._burst_over = False
            ids, self._calls_ended = self._calls_ended, []
            if self._on_call_end is not None:
                self._on_call_end(ids)

    def _feed(self, stream: str, data: bytes) -> None:
        # the end of the call that wrote here last: the line it left open ends there
        ends = data.endswith(_END)
        if not ends and b"\n" not in data and b"\r" not in data:
            if data.startswith(MARK_PREFIX) and not self._partial[stream] and not self._more[stream]:
                out: list[LogItem] = []
                data = self._reopen(stream, data, time.time(), out, False)
                if out:
                    self._write(out)
                if not data:
                    return
            # the middle of a long line: keep the piece, join once the line ends (joining every
            # 64 KiB read made a 10 MiB line cost 160 copies of up to 10 MiB)
            self._more[stream].append(data)
            self._more_n[stream] += len(data)
            if self._max_line and len(self._partial[stream]) + self._more_n[stream] >= self._max_line:
                self._cut(stream)
            return
        self._more_n[stream] = 0
        more = self._more[stream]
        if more and self._whole_line(stream, data):
            return
        if more:
            buf = b"".join([self._partial[stream], *more, data])
            more.clear()
        else:
            buf = self._partial[stream] + data
        now = time.time()
        out = []
        if len(buf) >= BIG_WRITE:
            out, rest = self._big(stream, buf, now)
        else:
            end = buf.rfind(b"\n")
            rest = buf[end + 1 :]
            if end < 0:
                pass  # only a carriage return or a call's end: below
            elif buf.find(MARK_PREFIX, 0, end) >= 0:
                for raw in buf[:end].split(b"\n"):
                    out.extend(self._split(stream, raw, now))
            else:
                # the common case, and the one that matters in a flood: no call markers in these
                # lines; decoded at once (a newline byte never ends inside a character) and
                # passed on as one run, not split into lines
                text = str(memoryview(buf)[:end], "utf-8", "replace")
                if b"\r" in buf:
                    text = "\n".join([_final_text(t) for t in text.split("\n")])
                out = [(self.rank, stream, now, self._call[stream], text, text.count("\n") + 1)]
        if MARK_PREFIX in rest:
            # the open line holds only its call's text from here (the markers taken now: a
            # call's end after its last line is passed on now, not with the next line)
            rest = self._reopen(stream, rest, now, out, ends)
        self._partial[stream] = rest
        cr = rest.rfind(b"\r")
        if cr >= 0 and cr + 1 < len(rest):
            # a progress bar redraws its line with \r and no newline: pass on its current state
            # (marked by a leading \r) instead of holding it until the bar ends
            cur = rest[cr + 1 :]
            self._partial[stream] = b"\r" + cur
            esc = cur.rfind(b"\x1b")
            if (
                esc >= 0
                and MARK_END not in cur[esc:]
                and (cur[esc:].startswith(MARK_PREFIX) or MARK_PREFIX.startswith(cur[esc:]))
            ):
                cur = cur[:esc]  # a marker the read cut in two: in the line until the rest of it comes
            if cur:
                out.append((self.rank, stream, now, self._call[stream], "\r" + _decode(cur)))
                self._drawn[stream] = b"\r" + cur
        if out:
            self._write(out, len(buf))

    def _reopen(self, stream: str, rest: bytes, now: float, out: list[LogItem], ends: bool) -> bytes:
        """The open line after the last newline read (``rest``), with its markers taken
        (:meth:`_demux`): the text of the stream's call. Markers at its start ending in the
        marker of no call, or the end of a call at its end: a call's burst is over."""
        i = 0
        while rest.startswith(MARK_PREFIX, i) and (q := rest.find(MARK_END, i)) >= 0:
            i = q + 1
        if ends or (i and rest[:i].endswith(_END)):
            self._burst_over = True
        return self._demux(stream, rest, now, out, ends)

    def _demux(self, stream: str, raw: bytes, now: float, out: list[LogItem], ends: bool = False) -> bytes:
        """Take the markers in ``raw`` (read after the open line ``stream`` holds): the text of
        the stream's call at its end (what it had held in front). Each call's text goes on
        its own line: the text of a call that another call's text follows is held until the
        call writes again (its line goes on) or ends (``out`` gets its line). ``ends``:
        ``raw`` ends with the end of the call that wrote here last, which ends its line."""
        held = self._held[stream]
        call = self._call[stream]
        parts: list[bytes] = []
        pos = 0
        last = len(raw) - len(_END)
        for m in _MARK.finditer(raw):
            if m.start() > pos:
                parts.append(raw[pos : m.start()])
            pos = m.end()
            mark = m.group(1)
            self._tag(stream, mark)
            new = self._call[stream]
            if mark.startswith(b"-"):
                ended = mark[1:].decode("ascii", "replace")
                if call == ended:
                    text = b"".join(parts)
                    if text:
                        out.append(self._left_open(stream, call, text, now))
                else:
                    self._hold(stream, call, parts, now, out)
                self._ended_ids[ended] = None
                for s, h in self._held.items():  # its last stream names it: its lines end on both
                    text = h.pop(ended, b"")
                    if text:
                        out.append(self._left_open(s, ended, text, now))
            elif new == call:
                continue  # named again (another call ended meanwhile): its line goes on
            elif ends and m.start() == last:
                text = b"".join(parts)
                if text:
                    out.append(self._left_open(stream, call, text, now))
            else:
                self._hold(stream, call, parts, now, out)
            call = new
            parts = [held.pop(call)] if call in held else []
        parts.append(raw[pos:])
        return b"".join(parts)

    def _hold(self, stream: str, call: str, parts: list[bytes], now: float, out: list[LogItem]) -> None:
        """Keep ``call``'s text (``parts``) of a line it has not ended, until it goes on; a
        progress bar's state drawn there goes out now (``out``)."""
        text = b"".join(parts)
        if not text:
            return
        cr = text.rfind(b"\r")
        if cr >= 0 and cr + 1 < len(text) and text != self._drawn[stream]:
            out.append((self.rank, stream, now, call, "\r" + _decode(text[cr + 1 :])))
        if call in self._ended_ids:  # its end was read on its other stream already: see feed
            self._late = True
        held = self._held[stream]
        held[call] = held.get(call, b"") + text

    def _left_open(self, stream: str, call: str, text: bytes, now: float) -> LogLine:
        """The line ``call`` left open when it ended: a line, or a progress bar's last state."""
        if b"\r" in text:
            return (self.rank, stream, now, call, "\r" + _decode(_final(text)))
        return (self.rank, stream, now, call, _decode(text))

    def _cut(self, stream: str) -> None:
        """A line that reached ``_max_line`` with no end: out as it is, with a note; what
        the rank prints next starts a new line."""
        line = join([self._partial[stream], *self._more[stream]])
        self._more[stream].clear()
        self._more_n[stream] = 0
        self._partial[stream] = b""
        now = time.time()
        out: list[LogItem] = []
        if line.find(MARK_PREFIX) >= 0:
            line = self._demux(stream, line, now, out)
        call = self._call[stream]
        note = (
            f"[monarch_nb: the line above was cut at {len(line)} bytes (log_max_line_bytes): "
            "what this rank printed next starts a new line]"
        )
        self._write([*out, (self.rank, stream, now, call, line), (self.rank, stream, now, call, note)], len(line))

    def _whole_line(self, stream: str, data: bytes) -> bool:
        """A huge line ending in ``data``, with no marker and no carriage return: its pieces
        are joined into the line itself (one copy, not a buffer and then the line); False if
        this is not that line."""
        nl = data.find(b"\n")
        head = [self._partial[stream], *self._more[stream]]
        if nl < 0 or sum(map(len, head)) + nl < HUGE_LINE:
            return False
        if any(b"\x1b" in p or b"\r" in p for p in head) or data.find(b"\x1b", 0, nl) >= 0 or data.find(b"\r", 0, nl) >= 0:
            return False
        line = join([*head, memoryview(data)[:nl]])
        self._more[stream].clear()
        self._partial[stream] = b""
        self._write([(self.rank, stream, time.time(), self._call[stream], line)], len(line))
        if nl + 1 < len(data):
            self._feed(stream, data[nl + 1 :])
        return True

    def _tag(self, stream: str, raw: bytes) -> None:
        """A marker read (``raw``, what follows ``call=``): the call its stream's text is
        tagged with from here, or a call that ended (noted for :meth:`feed` to pass on)."""
        if raw.startswith(b"-"):
            self._calls_ended.append(raw[1:].decode("ascii", "replace"))
            self._burst_over = True
            raw = b""
        self._call[stream] = raw.decode("ascii", "replace")

    def _big(self, stream: str, buf: bytes, now: float) -> tuple[list[LogItem], bytes]:
        """``feed`` for megabytes at once, as :meth:`_split` does it line by line, but each
        piece decoded straight out of ``buf`` (splitting first would copy it once more)."""
        out: list[LogItem] = []
        mv = memoryview(buf)
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            pos = start
            if buf.find(MARK_PREFIX, pos, end) >= 0:
                out.extend(self._split(stream, buf[pos:end], now))
            else:
                text: str | bytes
                if buf.find(b"\r", pos, end) >= 0:
                    text = _decode(_final(buf[pos:end]))
                elif end - pos >= HUGE_LINE:
                    text = to_bytes(mv[pos:end])  # one copy (huge pages), no decoding here
                else:
                    text = str(mv[pos:end], "utf-8", "replace")
                out.append((self.rank, stream, now, self._call[stream], text))
            start = end + 1
        return out, buf[start:]

    def _split(self, stream: str, raw: bytes, now: float, whole: bool = True) -> list[LogItem]:
        """The line ``raw`` ends (``whole``: with a newline), for the call that ends it; the
        calls whose text it holds besides go on with their own lines."""
        out: list[LogItem] = []
        text = self._demux(stream, raw, now, out)
        if text or whole:
            out.append((self.rank, stream, now, self._call[stream], _decode(_final(text))))
        return out

    def close(self) -> None:
        now = time.time()
        out: list[LogItem] = []
        for stream, rest in self._partial.items():
            rest = b"".join([rest, *self._more[stream]])
            self._more[stream].clear()
            if rest:
                out.extend(self._split(stream, rest, now, whole=False))
            self._partial[stream] = b""
            held, self._held[stream] = self._held[stream], {}
            out += [(self.rank, stream, now, call, _decode(_final(text))) for call, text in held.items()]
        if out:
            self._write(out)
        self._ended = True  # a file closed by a failure from here on stays closed: the rank is done
        # the proc is gone: its last lines go to disk now. Lines the writer thread already has
        # are waited for, but not on an event loop (the allocator's: its heartbeats and spawns
        # would wait for the disk too); there, and if the disk stalls, the writer closes the file
        # once it has everything (read_log waits for it)
        try:
            asyncio.get_running_loop()
            wait = 0.0
        except RuntimeError:
            wait = CLOSE_WAIT_S
        if not self.settle(wait):
            with self._lock:
                if self._writing:
                    self._close_after = True
                    return
        self._close_file()

    def settle(self, timeout: float) -> bool:
        """Wait until every line taken so far is in the file (at most ``timeout`` seconds);
        lines not yet handed to the writer thread are written by the caller."""
        with self._lock:
            if not self._writing or self._submitted:
                return self._lock.wait_for(lambda: not self._writing, timeout)
            self._submitted = True
        self._write_unwritten()
        return True

    def _write(self, lines: list[LogItem], nbytes: int = 0) -> None:
        self.nlines += count_lines(lines)
        self.tail += _tail_lines(lines, 50)
        del self.tail[:-50]
        start = False
        with self._lock:
            if self._writing:
                self._unwritten.append(lines)  # after the lines still waiting: the file keeps their order
            elif nbytes >= BIG_WRITE:
                # a huge line (10 MiB) takes ms to check and write, and a write into a page
                # cache full of dirty pages can stall for 20 ms: it goes to subscribers first and
                # to the file from another thread, so the allocator reads on meanwhile (a proc
                # printing its next line waits for no disk)
                self._writing = start = True
                self._unwritten = [lines]
            else:
                self._store(lines)
        self._emit(lines)
        if start:
            try:
                # after what ``emit`` queued on the loop (the line's send): the writer's copy of
                # 10 MiB into the page cache must not compete with it for the machine's cores
                asyncio.get_running_loop().call_soon(self._to_writer)
            except RuntimeError:
                self._to_writer()

    def _to_writer(self) -> None:
        with self._lock:
            if not self._writing or self._submitted:
                return  # written meanwhile by a caller of settle
            self._submitted = True
        try:
            _file_writer().submit(self._write_unwritten)
        except RuntimeError:  # the interpreter is shutting down: written here
            self._write_unwritten()

    def _write_unwritten(self) -> None:
        """The writer thread's turn: the waiting batches, in order, until there are none."""
        while True:
            with self._lock:
                batches, self._unwritten = self._unwritten, []
                if not batches:
                    self._writing = self._submitted = False
                    close, self._close_after = self._close_after, False
                    self._lock.notify_all()
                    break
            for lines in batches:
                try:
                    self._store(lines)
                except Exception:  # whatever it was, the lines after these still get their turn
                    logger.warning("could not write %d lines to %s", count_lines(lines), self.path, exc_info=True)
        if close:
            self._close_file()

    def _store(self, lines: list[LogItem]) -> None:
        """Write ``lines`` to the file; if the disk refuses (full, gone), count them and say so
        (at most once a minute) instead of raising: they still go to the notebook, and the file
        gets a note of how many it misses once it takes lines again."""
        try:
            if self.unwritten_lines:
                # "up to": a batch that failed half-way may have left some of its lines here
                note = f"[monarch_nb: up to {self.unwritten_lines} lines of this rank are missing here: {self._lost_why}]"
                self._write_file([(self.rank, "stderr", time.time(), "", note)])
                logger.warning(
                    "rank %d's log %s takes lines again (%d were not written)", self.rank, self.path, self.unwritten_lines
                )
                self.unwritten_lines = 0
            self._write_file(lines)
        except OSError as e:
            self.unwritten_lines += count_lines(lines)
            self._lost_why = f"{e.strerror or e} writing {self.path}"
            # what the file object still buffers would go out with the next write, notes and
            # all: dropped with it (counted above); the next write opens the file again
            self._close_file()
            now = time.monotonic()
            if now - self._warned_at > 60:
                self._warned_at = now
                logger.warning(
                    "rank %d's log %s: %s; its lines still stream to the controller, but %d are missing from the file so far",
                    self.rank,
                    self.path,
                    e.strerror or e,
                    self.unwritten_lines,
                )

    def _close_file(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # what it still buffered could not be written: counted and said already

    def _write_file(self, lines: list[LogItem]) -> None:
        parts = _records(lines)
        n = sum(map(len, parts))
        if self._file.closed and not self._ended:  # after a write or a rotation failed (a full disk)
            self._open()
            # a record the failure cut short ends here: read_log skips it, not the next one
            parts.insert(0, b"\n")
            n += 1
        if self._half and self._size + n > self._half:
            self._rotate()
        for p in parts:
            self._file.write(p)
        self._file.flush()
        self._size += n

    def _rotate(self) -> None:
        self._close_file()
        os.replace(self.path, self.path + ROTATED)
        self._open()

    def _open(self) -> None:
        """(Re)open the rank's log for appending: 0600 whatever the umask (what a rank prints is its user's)."""
        self._file = open(self.path, "ab", buffering=1 << 16, opener=private)
        self._size = self._file.tell()


_writer: list[concurrent.futures.ThreadPoolExecutor] = []


def _file_writer() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that writes huge lines to rank logs (a disk takes one write at a time)."""
    if not _writer:
        _writer.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mnb-logfile"))
    return _writer[0]


def _records(lines: list[LogItem]) -> list[bytes]:
    """The log file's records of ``lines``: one JSON object a line, ASCII, always the same
    keys in the same order (:func:`read_log` parses them)."""
    enc = _encode
    parts: list[bytes] = []
    small: list[str] = []
    for item in lines:
        if len(item) == 6:
            rank, stream, ts, call, joined, _ = item
            head = f'{{"ts": {ts!r}, "rank": {rank}, "stream": "{stream}", "call": {enc(call)}, "line": '
            if "\\" not in joined:
                # escaped at once: every \n left in the escaped text stands for a line break (with
                # no backslash in the text, no other escape is a backslash and an n)
                small.append(head + enc(joined).replace("\\n", '"}\n' + head + '"') + "}\n")
            else:
                small += [head + enc(t) + "}\n" for t in joined.split("\n")]
            continue
        rank, stream, ts, call, line = item
        head = f'{{"ts": {ts!r}, "rank": {rank}, "stream": "{stream}", "call": {enc(call)}, "line": '
        raw = line if isinstance(line, bytes) else None
        if isinstance(line, str) and len(line) >= HUGE_LINE and line.isascii():
            raw = line.encode("ascii")
        if raw is not None and _json_plain(raw):
            # megabytes that JSON leaves as they are (the usual huge line): not escaped, not copied
            if small:
                parts.append("".join(small).encode("ascii"))
                small = []
            parts += [(head + '"').encode("ascii"), raw, b'"}\n']
        else:
            small.append(head + enc(line_text(line)) + "}\n")
    if small:
        parts.append("".join(small).encode("ascii"))
    return parts


#: the bytes JSON (``ensure_ascii``) writes as they are
_JSON_PLAIN = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')


def _json_plain(raw: bytes) -> bool:
    """Whether JSON writes ``raw`` as it is: printable ASCII, no quote, no backslash. For a
    10 MiB line numpy's min and max (vectorised, no temporary) and two memchr scans take
    0.3-0.5 ms; ``bytes.translate`` with deletions took 2.4 ms (6 ms on a busy allocator,
    where it competed with the controller writing the same line out). Below a megabyte (a
    line written to the file before it goes out) numpy is not worth its first import."""
    if len(raw) < BIG_WRITE:
        return not raw.translate(None, _JSON_PLAIN)
    try:
        import numpy as np
    except ImportError:
        return not raw.translate(None, _JSON_PLAIN)
    if b'"' in raw or b"\\" in raw:
        return False
    a = np.frombuffer(raw, np.uint8)
    return bool(a.min() >= 0x20 and a.max() < 0x7F)


#: the suffix of a rank log's previous half
ROTATED = ".1"


def _final(raw: bytes) -> bytes:
    """What a terminal shows of a finished line: the text after its last carriage return."""
    if b"\r" not in raw:
        return raw
    return raw.rstrip(b"\r").rsplit(b"\r", 1)[-1]


#: JSON string encoding (C-accelerated); one JSON object per line is written by hand for speed
_encode = json.encoder.encode_basestring_ascii


def _final_text(line: str) -> str:
    """:func:`_final` of a decoded line."""
    if "\r" not in line:
        return line
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def rank_log_path(log_dir: str, mesh: str, rank: int) -> str:
    """Where rank ``rank`` of ``mesh`` logs under ``log_dir``; a name that would leave it
    (``..``, a slash) is an error, not a path."""
    if not isinstance(mesh, str) or not mesh or mesh.startswith(".") or "/" in mesh or "\0" in mesh or os.sep in mesh:
        raise ValueError(f"bad mesh name {str(mesh)[:80]!r}: a mesh name is one path component, not starting with '.'")
    if type(rank) is not int or rank < 0:
        raise ValueError(f"bad rank {rank!r}: a rank is an integer >= 0")
    return os.path.join(log_dir, mesh, f"rank-{rank}.jsonl")


def check_tail(tail: Any) -> None:
    """A tail of a rank's log is a number of lines, 0 or more (a negative one read as "all but
    the first lines")."""
    if not isinstance(tail, int) or tail < 0:
        raise ValueError(f"tail is a number of lines per rank, 0 or more, not {tail!r}")


def read_log(path: str, tail: int | None = None, start: int = 0) -> list[dict[str, Any]]:
    """Rows ``start:`` of a rank's log, or only its last ``tail`` rows (read from the end of
    the file: a tail of a huge log costs what the tail is, not what the log is)."""
    if tail is not None:
        check_tail(tail)
    rows: list[bytes] = []
    # a record cut short (a full disk refused the rest, or the allocator is writing it now) is
    # skipped below: a tail reads that many more rows, or `--tail 1` on a full disk shows nothing
    want = tail + _CUT_ROWS if tail is not None and not start else tail
    log = _open_logs.get(path)
    if log is not None:
        log.settle(CLOSE_WAIT_S)  # a huge line read from its proc is on disk before this reads
    try:
        with open(path, "rb") as f:
            if want is not None and start == 0:
                rows = _last_lines(f, want)
            else:
                rows = f.readlines()
    except FileNotFoundError:
        pass
    if want is None or start or len(rows) < want:
        # the previous half of a rotated log comes first
        try:
            with open(path + ROTATED, "rb") as f:
                old = _last_lines(f, want - len(rows)) if want is not None and not start else f.readlines()
            rows = old + rows
        except FileNotFoundError:
            pass
    if start:
        rows = rows[start:]
        if tail is not None:
            rows = rows[-tail:] if tail else []
    out = []
    for r in rows:
        if r.strip():
            try:
                out.append(json.loads(r))
            except ValueError:
                pass  # a line the allocator is still writing
    if tail is not None and not start:
        out = out[-tail:] if tail else []
    return out


#: rows cut short a tail may meet: the one being written at the end, one a full disk cut
_CUT_ROWS = 2


def _last_lines(f: Any, n: int, block: int = 1 << 16) -> list[bytes]:
    if n <= 0:
        return []
    end = f.seek(0, os.SEEK_END)
    pos, buf = end, b""
    # n + 1 newlines: the first line in the buffer may be cut
    while pos > 0 and buf.count(b"\n") <= n:
        step = min(block, pos)
        pos -= step
        f.seek(pos)
        buf = f.read(step) + buf
    lines = buf.splitlines(keepends=True)
    if pos > 0:
        lines = lines[1:]
    return lines[-n:]
