"""The blocked wait is the debugger: wake a controller's main thread when a rank it waits on stops.

Allocators publish debug sessions to their subscribers (every controller that calls their
procs). This module keeps the paused sessions of calls *this* controller made (their call id
starts with our runtime's uid) and, when one opens while the main thread is blocked in
``Future.get()``, wakes that thread and runs the console: ``monarch_nb.debug`` installs it
with :func:`set_console` (imported on the first breakpoint, so ``mesh.ep.call().get()`` is
debuggable as written).

Only the main thread runs a console: it owns ``input()`` (in a kernel, the cell's input box);
other threads keep waiting, and their ranks stay listed for ``monarch_nb.debug`` clients.
The plain (no breakpoint) path costs one thread check per blocking wait.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import importlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._future import Future

#: Future._state of a pending future (``_future`` imports this module, so it cannot be imported here)
_PENDING = 0

_lock = threading.Lock()
#: sid -> session record, for paused (or gone) sessions of calls this controller made
_ours: dict[str, dict[str, Any]] = {}
#: sids opened since a console last showed them
_unseen: set[str] = set()
#: sid -> record, for sessions paused in calls of *other* controllers (a kernel since restarted,
#: another notebook; an allocator replays them to a new subscriber): no console of ours shows
#: them, but a call of ours to their actors queues behind them, so a wait on it that times out
#: or is interrupted names them rather than leaving the user to guess why it never returns
_theirs: dict[str, dict[str, Any]] = {}
#: the wake-up of the main thread blocked in Future.get(), if it is (a _Wake, or the
#: _replyread reader of a thread reading its reply itself): only the main thread waits
#: through this module, one wait at a time (waits inside the console are plain), so a slot
#: set and cleared without the lock does (wait() sets it before it reads _unseen, on_event
#: adds to _unseen before it reads the slot)
_main_wake: Any = None
#: wake-ups of main-thread coroutines awaiting a Future
_async_waiters: set[Callable[[], object]] = set()
#: notified on every change to _ours (consoles wait on it without polling)
changed = threading.Condition(_lock)
#: the main thread's ident, compared with the caller's on every blocking wait (cheaper than
#: current_thread(); a forked child's thread keeps the ident of the thread that forked)
_main_ident = threading.main_thread().ident
_uid_prefix = ""
_enabled = False
_busy = threading.local()

#: ``console(future)`` runs when the main thread waits and a rank of ours stopped
_console: Callable[[Future[Any]], None] | None = None


def set_console(fn: Callable[[Future[Any]], None] | None) -> None:
    """Install the console a blocked main thread runs when a rank of its calls stops
    (``monarch_nb.debug`` installs its own on import; None falls back to importing it)."""
    global _console
    _console = fn


def enable(uid: str) -> None:
    """Called once by a controller's client: sessions of calls whose id starts with ``uid`` are ours."""
    global _uid_prefix, _enabled
    _uid_prefix = uid + "."
    _enabled = True


def on_event(ev: tuple[Any, ...]) -> None:
    """An allocator event (I/O thread): track our sessions and wake the main thread's wait."""
    if ev[0] != "debug" or not _enabled:
        return
    _, kind, rec = ev
    if not str(rec.get("call_id", "")).startswith(_uid_prefix):
        with _lock:
            if kind in ("open", "update"):
                _theirs[rec["sid"]] = rec
            else:
                _theirs.pop(rec["sid"], None)
        return
    sid = rec["sid"]
    with _lock:
        if kind == "open":
            if sid not in _ours:
                _unseen.add(sid)
            _ours[sid] = rec
        elif kind in ("update", "gone"):
            if sid in _ours or kind == "gone":
                _ours[sid] = rec
            if kind == "gone":
                _unseen.discard(sid)
        elif kind == "closed":
            _ours.pop(sid, None)
            _unseen.discard(sid)
        changed.notify_all()
        waiter = _main_wake if _unseen else None
        wakes = list(_async_waiters) if _unseen else []
    if waiter is not None:
        waiter.set()
    for wake in wakes:
        wake()


def is_ours(call_id: str) -> bool:
    """Whether a session's call is one this controller made."""
    return _enabled and call_id.startswith(_uid_prefix)


def paused() -> dict[str, dict[str, Any]]:
    """Our sessions still paused (or running a step), by sid."""
    with _lock:
        return {s: r for s, r in _ours.items() if r.get("state") != "gone"}


def mark_seen(sids: set[str] | None = None) -> None:
    """A console showed these sessions (all when None): they no longer wake a wait."""
    with _lock:
        if sids is None:
            _unseen.clear()
        else:
            _unseen.difference_update(sids)


def forget(sid: str) -> None:
    """A client saw ``sid`` continue (its close event may still be on the way)."""
    with _lock:
        _ours.pop(sid, None)
        _unseen.discard(sid)
        changed.notify_all()


def wait_closed(sids: set[str], timeout: float) -> bool:
    """Wait up to ``timeout`` for all of ``sids`` to continue or go (e.g. a terminal attached)."""
    with changed:
        return changed.wait_for(lambda: not any(s in _ours and _ours[s].get("state") != "gone" for s in sids), timeout)


def watches(tid: int) -> bool:
    """Whether a wait on thread ``tid`` must wake for a debug session of ours: the main thread,
    outside the console (its own waits are plain)."""
    return _enabled and tid == _main_ident and not getattr(_busy, "on", False)


def swap_main_wake(wake: Any) -> Any:
    """Make ``wake.set()`` what a debug session of ours opening calls, for the main thread's
    wait; returns the one before, to put back (a signal handler's wait may nest in another)."""
    global _main_wake
    outer, _main_wake = _main_wake, wake
    return outer


def unseen() -> bool:
    """Whether a debug session of ours opened that no console has shown yet."""
    return bool(_unseen)


def stopped_in(fut: Future[Any]) -> list[dict[str, Any]]:
    """Our sessions paused in the call ``fut`` is the result of (none for other futures)."""
    call = getattr(fut, "_call", None)
    if not call or not _ours:
        return []
    with _lock:
        return [r for r in _ours.values() if r.get("call_id") == call and r.get("state") != "gone"]


def paused_elsewhere(fut: Future[Any]) -> str:
    """A line naming the ranks of ``fut``'s actor paused at a breakpoint in another controller's
    call ("" if none): ``fut``'s call waits behind them, and only an attach resumes them."""
    what = getattr(fut, "_what", "")
    with _lock:
        recs = [
            r
            for r in _theirs.values()
            if r.get("actor") and r.get("state") != "gone" and what.startswith((r["actor"] + ".", r["actor"] + "["))
        ]
    if not recs:
        return ""
    actor = recs[0]["actor"]
    ranks = ", ".join(str(r) for r in sorted({int(r.get("rank", 0)) for r in recs}))
    return (
        f"rank(s) {ranks} of {actor} are stopped at a breakpoint in a call another controller made "
        "(a kernel since restarted, another notebook), and calls to them wait behind it: "
        "%mesh debug, monarch_nb.debug or `monarch-nb debug` attaches or continues them."
    )


def due(fut: Future[Any]) -> bool:
    """Must a wait on ``fut`` open the console before it blocks? Ranks of its call are paused
    and a console already showed them, opened for another wait (another cell's ``get()``, or
    this cell's on another future): no session opening is left to wake this wait, which would
    otherwise block, silent, until someone resumes them from elsewhere."""
    return bool(_ours) and bool(stopped_in(fut))


def wait(fut: Future[Any], timeout: float | None, tid: int = 0) -> bool:
    """Block until ``fut`` is done (True) or ``timeout`` passes (False), running the console
    when a rank of ours stops meanwhile and this is the main thread (``tid``: the calling
    thread's ident, if the caller has it)."""
    if not watches(tid or _thread.get_ident()):
        return fut._wait_plain(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    # woken by the future's completion or by a debug session of ours opening
    woken = _Wake()
    fut.add_done_callback(woken.set)
    outer = swap_main_wake(woken)
    again = due(fut)  # offered once per wait: a console left with the ranks still paused stays left
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not (_unseen or again):
                woken.wait(left)
            if fut._state != _PENDING:
                return True
            if _unseen or again:
                again = False
                t0 = time.monotonic()
                _run_console(fut)
                if deadline is not None:  # time spent debugging does not count against the caller's timeout
                    deadline += time.monotonic() - t0
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
    finally:
        swap_main_wake(outer)


class _Wake:
    """A one-waiter wake-up on a raw lock (a ``threading.Event`` costs a Condition per wait,
    on every blocking ``get()`` of the main thread); a wait consumes the wake-up."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self, *_: Any) -> None:
        try:
            self._lock.release()
        except RuntimeError:
            pass  # already set

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(True, -1 if timeout is None else timeout)


def awaits_here() -> bool:
    """Should an ``await`` on this thread go through :func:`wait_async`?"""
    return watches(_thread.get_ident())


async def wait_async(fut: Future[Any], done: Callable[[], asyncio.Future[None]] | None = None) -> None:
    """``await fut`` on the main thread (an async cell): the console runs when a rank of ours stops.

    The console blocks this thread's loop while it reads input, as a blocked ``get()`` would.
    ``done()``, if given, makes what to wait on instead of a plain wake-up on ``fut``'s
    completion (``_replyread.awaitable``: the loop may read the reply itself).
    """
    loop = asyncio.get_running_loop()
    _interruptible(loop, +1)
    again = due(fut)  # as in wait(): ranks of this call paused, and shown by a console already
    try:
        if again:
            _console_in_loop(fut)
        while fut._state == _PENDING:
            woken: asyncio.Future[None] = loop.create_future() if done is None else done()
            wake = waker(loop, woken)
            if done is None:
                fut.add_done_callback(wake)
            # the set's add and discard are atomic (on_event copies it under _lock, also atomic):
            # added before _unseen is read, as on_event adds to _unseen before it copies the set
            _async_waiters.add(wake)
            try:
                if not _unseen:
                    await woken
            finally:
                _async_waiters.discard(wake)
            if fut._state == _PENDING and _unseen:
                _console_in_loop(fut)
    finally:
        _interruptible(loop, -1)


def _console_in_loop(fut: Future[Any]) -> None:
    """:func:`_run_console` from a coroutine of the main thread, with Ctrl-C raising in it.

    The console blocks the loop in ``input()``; ipykernel's SIGINT handler for an async cell
    (and ``asyncio.run``'s) only schedules the cell's cancellation on that loop, which would run
    once the console returns: Ctrl-C at its prompt, or during a command a rank runs, did
    nothing, and the cell stayed at the prompt. Python's own handler raises
    KeyboardInterrupt in ``input()``, as in a ``get()`` cell."""
    try:
        outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread after all: nothing to swap
        outer = None
    try:
        _run_console(fut)
    finally:
        if outer is not None:
            signal.signal(signal.SIGINT, outer)


#: how often an async cell's loop wakes while it awaits one of our futures (see _interruptible)
_TICK_S = 0.1
#: the main thread's awaits of our futures under way, and the loop a tick is armed on
_tick_waits = 0
_tick_loop: asyncio.AbstractEventLoop | None = None


def _interruptible(loop: asyncio.AbstractEventLoop, delta: int) -> None:
    """(The main thread.) In an IPython kernel, keep ``loop`` waking every :data:`_TICK_S` while
    an await of ours is under way (``delta`` +1 as one starts, -1 as it ends).

    ipykernel's SIGINT handler for an async cell queues the cell's cancellation with
    ``call_soon`` from inside the loop's ``epoll_wait``, which goes on waiting: an interrupt took
    effect only once the awaited call completed (ipykernel issue 881; 5.6 s for an
    ``await asyncio.sleep(6)``), never for a call that runs for hours. A loop that wakes runs
    the queued cancellation within a tick. One timer serves all awaits and lapses after them,
    so awaits in a row arm it once per tick, not once each."""
    global _tick_waits, _tick_loop
    _tick_waits += delta
    if delta > 0 and _tick_loop is not loop and "ipykernel" in sys.modules:
        _tick_loop = loop
        loop.call_later(_TICK_S, _tick, loop)


def _tick(loop: asyncio.AbstractEventLoop) -> None:
    global _tick_loop
    if _tick_waits > 0:
        loop.call_later(_TICK_S, _tick, loop)
    else:
        _tick_loop = None


def waker(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None]) -> Callable[..., None]:
    """A callback for any thread that resolves ``woken`` on ``loop``; it does nothing once
    ``loop`` has closed: the coroutine that awaited is gone (an ``asyncio.run`` ended by a
    timeout or an interrupted cell), and the future it awaited keeps its value for a later read."""

    def wake(*_: Any) -> None:
        try:
            loop.call_soon_threadsafe(resolve_once, woken)
        except RuntimeError:
            if not loop.is_closed():
                raise

    return wake


def resolve_once(f: asyncio.Future[None], *_: Any) -> None:
    """Wake an awaiting coroutine (on its loop; a second wake-up does nothing)."""
    if not f.done():
        f.set_result(None)


def woken_by(fut: Future[Any]) -> asyncio.Future[None]:
    """A future of the running loop that ``fut``'s completion resolves (from any thread)."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    fut.add_done_callback(waker(loop, woken))
    return woken


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Waits in this block never open the console (the debug API's own requests)."""
    was = getattr(_busy, "on", False)
    _busy.on = True
    try:
        yield
    finally:
        _busy.on = was


def _run_console(fut: Future[Any]) -> None:
    if _console is None:
        # The one upward import of the actor layer (listed in tests/test_layers.py): the console
        # is a feature (monarch_nb.debug) that a plain script never imports, yet a rank of its
        # call may stop at breakpoint() and the blocked .get() must open it. Importing it here,
        # on the first stop only, keeps the debugger out of every controller that never stops.
        importlib.import_module("monarch_nb.debug")  # calls set_console
    with _lock:
        shown = set(_unseen)
    _busy.on = True  # waits inside the console (its own requests) are plain waits
    try:
        assert _console is not None
        _console(fut)
    finally:
        _busy.on = False
        mark_seen(shown)  # never wake again for what the console was woken for
