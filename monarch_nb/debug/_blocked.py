"""The blocked cell is the debugger: what a controller's main thread does when a rank of a call
it waits on stops at ``breakpoint()`` (installed with ``_debugwait.set_console`` on import).

With a person at the other end of ``input()`` (a kernel request that allows stdin, a TTY) it
runs the :class:`Console`; without one it applies ``Config.debug_no_input``: continue the
ranks after ``debug_no_input_timeout`` and say so, raise, or wait for an attach from elsewhere.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

from .._ranks import format_ranks
from ..actor import _context, _debugwait
from ..actor._future import Future
from ..actor._pdb import NO_INPUT_CONTINUE
from ..config import get_config
from ..errors import ConfigError, DebugError
from ._console import Console
from ._sessions import Session, _send, _where


def _stdin_available() -> bool:
    """Can ``input()`` reach a person? (A kernel request with allow_stdin, or a TTY.)"""
    if _context.in_ipython_kernel():
        from IPython import get_ipython  # only reached inside a kernel, where IPython is loaded

        kernel = getattr(get_ipython(), "kernel", None)
        return bool(getattr(kernel, "_allow_stdin", False))
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def _settle(quiet: float = 0.15, limit: float = 1.0) -> None:
    """Let ranks of one call that stop together arrive before the first table (UI debounce)."""
    end = time.monotonic() + limit
    with _debugwait.changed:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not _debugwait.changed.wait(min(quiet, left)):
                return


def _blocked(fut: Future[Any]) -> None:
    """The console of a main thread blocked on ``fut`` while ranks of its calls are paused."""
    if not _stdin_available():
        _no_input(fut)
        return
    _settle()
    ours = _debugwait.paused()
    seen = set(ours)
    con = Console(own=lambda: _debugwait.paused().keys())
    con.write(
        f"\nmonarch_nb: {len(ours)} rank(s) {_whose(fut, ours)}stopped {_how(ours)} while waiting for {fut._what}.\n"
        "Type 'attach ACTOR RANK' to debug one, 'continue' to resume them, 'help' for more.\n"
    )
    con.show_table()

    def until() -> bool:
        now = _debugwait.paused()
        seen.update(now)
        return not now

    # stop reading once the call completes or no rank of ours is paused, whoever resumed them
    done = lambda: fut.done() or not _debugwait.paused()  # noqa: E731

    def why() -> str:
        # a call fails while ranks of it are still paused when another rank raised (pdb's `q`
        # raises BdbQuit): nobody resumed those, and they stay paused
        left = _debugwait.paused()
        if fut.done() and left:
            return f"({fut._what} {_ended(fut)} while {len(left)} rank(s) {_whose(fut, left, 'of it ')}stay paused)"
        return "(the ranks were resumed elsewhere)"

    read: Any = _kernel_reader(done, why) if _context.in_ipython_kernel() else _terminal_reader(done, why)
    try:
        con.interact(read, until=until)
    except NotImplementedError:  # a frontend that says allow_stdin but cannot answer (StdinNotImplementedError)
        _no_input(fut)
        return
    finally:
        _debugwait.mark_seen(seen)
    left = _debugwait.paused()
    if left and fut.done():
        con.write(
            f"{fut._what} {_ended(fut)}; {len(left)} rank(s) stay paused {_where_paused(left)} "
            "(waiting on their call opens this console again; or attach or continue them with "
            "monarch_nb.debug or `monarch-nb debug`)\n"
        )
    elif left:
        con.write(
            f"left the debugger; {len(left)} rank(s) stay paused and this call keeps waiting "
            "(attach with monarch_nb.debug or `monarch-nb debug`, or interrupt to stop waiting)\n"
        )
    else:
        con.write("all ranks continued; waiting for the result\n")


def _how(recs: dict[str, Any]) -> str:
    """Where the ranks stopped: at a breakpoint, or post-mortem in a call that raised after one."""
    pm = sorted({r["post_mortem"] for r in recs.values() if r.get("post_mortem")})
    if not pm:
        return "at a breakpoint"
    what = f"post-mortem after {pm[0]}" if len(pm) == 1 else f"post-mortem after {len(pm)} different errors"
    if all(r.get("post_mortem") for r in recs.values()):
        return f"{what} ('continue' lets the error reach the caller)"
    return f"at a breakpoint or {what}"


def _where_paused(recs: dict[str, Any]) -> str:
    pm = sum(1 for r in recs.values() if r.get("post_mortem"))
    return "at their breakpoints" if not pm else "post-mortem" if pm == len(recs) else "at breakpoints or post-mortem"


def _whose(fut: Future[Any], recs: dict[str, Any], own: str = "") -> str:
    """Words for whose ranks ``recs`` are: "of other calls " when none is of ``fut``'s call
    (they stopped while another call was waited on), else ``own``."""
    call = getattr(fut, "_call", None)
    if call and recs and not any(r.get("call_id") == call for r in recs.values()):
        return "of other calls "
    return own


def _ended(fut: Future[Any]) -> str:
    return "failed" if fut.exception(timeout=0) is not None else "returned"


def _terminal_reader(done: Any, why: Any, poll: float = 0.1) -> Any:
    """``input()`` for a TTY that gives up (EOFError: the console leaves) once ``done()``: the
    ranks were continued from elsewhere (``monarch-nb debug`` in another terminal) and the
    call completed, so the program goes on without waiting for a keystroke."""
    import os
    import select

    def read(prompt: str) -> str:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        fd = sys.stdin.fileno()
        while True:
            if select.select([fd], [], [], poll)[0]:
                # canonical mode: a read returns one line the user typed
                data = os.read(fd, 4096).decode(errors="replace")
                if not data:
                    raise EOFError
                return data.rstrip("\r\n")
            if done():
                sys.stdout.write(why() + "\n")
                sys.stdout.flush()
                raise EOFError

    return read


class _Resumed(BaseException):
    """Raised into the main thread waiting in the kernel's input(): the ranks went on without it.

    A BaseException: ipykernel's input loop swallows Exceptions (as invalid messages)."""


def _kernel_reader(done: Any, why: Any, poll: float = 0.1) -> Any:
    """``input()`` in a kernel that gives up (EOFError) once ``done()``.

    ipykernel's input() waits for the frontend's reply in a loop on the main thread, with no
    way to cancel it; a watcher thread raises :class:`_Resumed` into that thread (between two
    of its polls) while, and only while, it is in there.
    """
    import builtins
    import ctypes

    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"reading": False, "fired": False}

    def set_async(exc: Any) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)

    def watch(stop: threading.Event) -> None:
        while not stop.wait(poll):
            if done():
                with lock:
                    if state["reading"] and not state["fired"]:
                        state["fired"] = True
                        set_async(_Resumed)
                return

    def read(prompt: str) -> str:
        stop = threading.Event()
        threading.Thread(target=watch, args=(stop,), name="monarch_nb-console-watch", daemon=True).start()
        try:
            try:
                with lock:
                    state["reading"], state["fired"] = True, False
                # looked up now: a kernel swaps builtins.input per request
                return builtins.input(prompt)
            finally:
                with lock:
                    state["reading"] = False
                    if state["fired"]:
                        set_async(None)  # not delivered yet: it must not land anywhere else
                stop.set()
        except _Resumed:
            print(why(), flush=True)
            raise EOFError from None

    return read


#: calls a DebugError was raised for (debug_no_input='raise'): a rank of one of them that stops
#: later is continued and said, not raised again out of whatever the program waits on by then
#: (its stop(), a call to another mesh). Ids only, one per raise: it stays small.
_raised_calls: set[str] = set()


def _raise_key(s: Session) -> str:
    """What one DebugError is raised for: a call, or one actor mesh's ``__init__`` (every spawn
    of a controller shares one call id, and a second mesh's breakpoint was only skipped)."""
    return f"{s.call_id} {s.actor_id}" if s.method == "__init__" else s.call_id


def _no_input(fut: Future[Any]) -> None:
    cfg = get_config()
    policy = cfg.debug_no_input
    if policy not in ("continue", "raise", "wait"):
        raise ConfigError(f"debug_no_input must be 'continue', 'raise' or 'wait', not {policy!r}")
    ours = _debugwait.paused()
    _debugwait.mark_seen(set(ours))
    if policy == "wait":
        for s in map(Session._from, ours.values()):
            print(
                f"{_what(s)} at {_where(s.bp_file, s.bp_line)} on rank {s.rank}: no input here; "
                "waiting for an attach (run `monarch-nb debug` in a terminal)",
                file=sys.stderr,
                flush=True,
            )
        return
    if cfg.debug_no_input_timeout > 0:
        _debugwait.wait_closed(set(ours), cfg.debug_no_input_timeout)
    still = [Session._from(r) for s, r in _debugwait.paused().items() if s in ours]
    here: list[Session] = []
    if policy == "raise":
        # Before the ranks continue (their replies would complete the call): the DebugError
        # belongs to the call that stopped, not to whatever the program waits on now.
        here = _fail_calls(fut, [s for s in still if not s.call_id or _raise_key(s) not in _raised_calls])
    # not a plain "c": a call resumed with nobody at the keyboard was not debugged, so its error
    # must not stop the rank again, post-mortem, for nobody
    futs = [(s, _send(s, NO_INPUT_CONTINUE)) for s in still]
    for s, f in futs:
        try:
            f.get(timeout=30)
        except Exception as e:
            print(f"monarch_nb: could not continue rank {s.rank}: {e}", file=sys.stderr, flush=True)
        _debugwait.forget(s.sid)
        print(f"{_what(s)} at {_where(s.bp_file, s.bp_line)} on rank {s.rank} skipped (no input)", file=sys.stderr, flush=True)
    if here:
        raise DebugError(f"{_no_input_words(here)} (while waiting for {fut._what})")


def _what(s: Session) -> str:
    return f"post-mortem of {s.post_mortem}" if s.post_mortem else "breakpoint"


def _no_input_words(sessions: list[Session]) -> str:
    # one entry per breakpoint with its rank set: 16 ranks at one line were 16 copies of its path
    by_line: dict[str, list[int]] = {}
    for s in sessions:
        by_line.setdefault(_where(s.bp_file, s.bp_line), []).append(s.rank)
    where = ", ".join(
        f"{at} on rank{'s' if len(ranks) > 1 else ''} {format_ranks(sorted(ranks))}" for at, ranks in by_line.items()
    )
    return f"breakpoint at {where} with no input to debug it (debug_no_input='raise'); the ranks were continued"


def _fail_calls(fut: Future[Any], fresh: list[Session]) -> list[Session]:
    """(debug_no_input='raise'.) Fail the futures of the calls whose ranks ``fresh`` stopped
    with a DebugError naming those ranks, so that a wait on that call raises it, and one on
    another call (``fut``, blocked when they stopped) returns its own result. Returns the
    sessions whose call has no future left to carry the error (a breakpoint in ``__init__``,
    a call whose future was dropped): the wait on ``fut`` raises for those."""
    if not fresh:
        return []
    _raised_calls.update(_raise_key(s) for s in fresh if s.call_id)
    by_call: dict[str, list[Session]] = {}
    for s in fresh:
        by_call.setdefault(s.call_id, []).append(s)
    # Futures keep no registry by call id (that would cost every call); a scan of the heap, on
    # this rare path only, finds them, the user's own and those derived from it (call_one's).
    holders: dict[str, list[Future[Any]]] = {}
    for o in gc.get_objects():
        # the state, not done(): that starts a lazy future's work
        if isinstance(o, Future) and o._state == _debugwait._PENDING:
            cid = getattr(o, "_call", None)
            if cid in by_call:
                holders.setdefault(cid, []).append(o)
    own = getattr(fut, "_call", None)
    if own in by_call and fut._state == _debugwait._PENDING and fut not in holders.get(own, []):
        holders.setdefault(own, []).append(fut)
    orphans: list[Session] = []
    for cid, sessions in by_call.items():
        held = holders.get(cid) if cid else None
        if not held:
            orphans += sessions
            continue
        for f in held:
            f._set_exception(DebugError(f"{f._what}: {_no_input_words(sessions)}"))
    return orphans


_debugwait.set_console(_blocked)
