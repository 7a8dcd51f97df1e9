"""One Future for every result: ``.get(timeout)`` in plain code and cells, ``await`` in async code.

Results are completed on the runtime's I/O thread but decoded lazily, on the first
``get``/``await``, in the consumer's thread, so unpickling never stalls the I/O thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import sys
import threading
from _thread import LockType
from _thread import allocate_lock as _allocate_lock
from _thread import get_ident as _get_ident
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

from ..errors import note_missing_module, raised_again
from . import _context, _debugwait, _replyread

_log = logging.getLogger(__name__)
#: monarch_nb's own files: a wait in them is for a future the user was never given
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _ours(filename: str) -> bool:
    return filename.startswith(_PKG)


R = TypeVar("R")
T = TypeVar("T")

_PENDING, _RAW, _DONE, _FAILED = range(4)
assert _debugwait._PENDING == _PENDING

#: thread id -> the future that thread is blocked on in ``get()``, or its loop in an ``await`` (what a
#: frontend shows progress of)
blocked: dict[int, Future[Any]] = {}
#: told of every error a future raises into the code reading it (set through ``Client.on_raise``)
raised_hook: Callable[[BaseException], None] | None = None


def _check_timeout(timeout: Any) -> None:
    """Refuse a timeout that is not a number of seconds to wait, in Monarch's words: a negative
    one read as "not ready" though the wait never began."""
    try:
        ok = 0 <= timeout < math.inf  # False for a NaN too
    except TypeError:
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}") from None
    if not ok:
        raise ValueError(f"invalid timeout {timeout}: expected a non-negative, finite number of seconds")


class Future(Generic[R]):
    """The eventual result of an endpoint call or other asynchronous operation.

    Not constructed directly; endpoints and meshes return them.
    """

    # raw locks instead of a threading.Condition: ``_mutex`` guards the state; ``_done``, made
    # by the first plain wait (most futures have none: their caller reads its reply itself, or
    # an event loop awaits it), is held until completion, so waiting is one acquire and
    # creating costs a fraction of a Condition (this is on every call's path)
    __slots__ = (
        "_mutex",
        "_done",
        "_state",
        "_value",
        "_decode",
        "_callbacks",
        "_what",
        "_progress",
        "_unit",
        "_start",
        "_peer",
        "_port",
        "_call",
        "__weakref__",
    )
    _mutex: LockType
    _done: LockType | None
    _state: int
    _value: Any
    _decode: Callable[[Any], Any] | None
    _callbacks: list[Callable[[Future[R]], object]] | None
    _what: str
    _progress: tuple[list[int], int] | None
    _unit: str  # unset (read with a default) but where progress counts something other than replies
    _start: Callable[[], None] | None
    #: a one-actor call's (proc address, actor name): get() may read its reply itself (_replyread)
    _peer: tuple[str, str] | None
    #: that call's reply port
    _port: int
    #: an endpoint call's id (unset for other futures): a wait on it offers the debugger again
    #: while ranks of that call stay paused (_debugwait.due)
    _call: str | None

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Future cannot be constructed directly; endpoints and meshes return them")

    @classmethod
    def _create(cls, what: str = "result") -> Future[R]:
        f = object.__new__(cls)
        f._mutex = _allocate_lock()
        f._done = None
        f._state = _PENDING
        f._value = None
        f._decode = None
        f._callbacks = None
        f._what = what
        #: for calls to many actors: ([replies still missing], total), read by progress displays
        f._progress = None
        #: work that begins only once the future is first read or awaited (``PortReceiver.recv``)
        f._start = None
        f._peer = None
        return f

    @classmethod
    def _completed(cls, value: R) -> Future[R]:
        f: Future[R] = cls._create()
        f._set_result(value)
        return f

    @classmethod
    def _failed(cls, exc: BaseException, what: str = "result") -> Future[R]:
        """A future of ``what`` that raises ``exc`` when read (a refusal Monarch makes there)."""
        f: Future[R] = cls._create(what)
        f._set_exception(exc)
        return f

    # -- completion (any thread)
    def _finish(self, state: int, value: Any, decode: Callable[[Any], Any] | None = None) -> bool:
        with self._mutex:
            if self._state != _PENDING:
                return False
            self._state, self._value, self._decode = state, value, decode
            cbs, self._callbacks = self._callbacks, None
            done = self._done
        if done is not None:
            done.release()
        if cbs:
            for cb in cbs:
                try:
                    cb(self)
                except Exception:
                    # as concurrent.futures does: the others are still told, and the completing
                    # thread (the I/O thread, with more messages to dispatch) goes on
                    _log.exception("a callback of %s failed", self._what)
        return True

    def _set_result(self, value: Any) -> bool:
        return self._finish(_DONE, value)

    def _set_raw(self, raw: Any, decode: Callable[[Any], Any]) -> bool:
        """Complete with ``raw``; ``decode(raw)`` runs once, in whichever thread reads first."""
        return self._finish(_RAW, raw, decode)

    def _set_exception(self, exc: BaseException) -> bool:
        return self._finish(_FAILED, exc)

    def _kick(self) -> None:
        with self._mutex:
            start, self._start = self._start, None
        if start is not None:
            start()

    def done(self) -> bool:
        if self._start is not None:
            self._kick()
        return self._state != _PENDING

    @property
    def description(self) -> str:
        """What this is the result of (``"trainers.step.call()"``), as progress and timeouts name it."""
        return self._what

    def progress(self) -> tuple[int, int] | None:
        """``(replies so far, actors called)`` of a call to several actors; None for other futures."""
        p = self._progress
        if p is None:
            return None
        left, total = p
        return total - left[0], total

    @property
    def progress_unit(self) -> str:
        """What :meth:`progress` counts: ``"ranks replied"`` for calls, ``"procs up"`` for a spawn."""
        return getattr(self, "_unit", "ranks replied")

    def then(self, fn: Callable[[R], T], description: str | None = None) -> Future[T]:
        """A future of ``fn(result)``, done when this one is and failing as it fails (or as ``fn``
        raises). ``fn`` runs once, in the thread that first reads the new future, never on the I/O
        thread. The new future reports this one's progress."""
        out: Future[T] = Future._create(self._what if description is None else description)
        out._progress = self._progress
        out._call = getattr(self, "_call", None)
        self.add_done_callback(lambda src: out._set_raw(src, lambda s: fn(s._resolve())))
        return out

    def add_done_callback(self, fn: Callable[[Future[R]], object]) -> None:
        if self._start is not None:
            self._kick()
        with self._mutex:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    # -- reading
    def _resolve(self) -> R:
        with self._mutex:
            if self._state == _RAW:
                decode, raw = self._decode, self._value
                try:
                    self._value = decode(raw)  # type: ignore[misc]
                    self._state = _DONE
                except BaseException as e:
                    self._value = e
                    self._state = _FAILED
                self._decode = None
            if self._state != _FAILED:
                return self._value
            err = self._value
        note_missing_module(err)
        hook = raised_hook  # outside the mutex: the hook takes its frontend's locks
        if hook is not None:
            hook(err)
        raise raised_again(err)

    def _wait_plain(self, timeout: float | None) -> bool:
        """Block until done (True) or ``timeout`` passes (False): one acquire of the done lock."""
        with self._mutex:
            if self._state != _PENDING:
                return True
            done = self._done
            if done is None:
                done = self._done = _allocate_lock()
                done.acquire()  # released by _finish
        if timeout is None:
            ok = done.acquire()
        elif timeout <= 0:
            ok = done.acquire(False)
        else:
            ok = done.acquire(True, timeout)
        if ok:
            done.release()  # pass the wake-up on to any other waiter
        return ok

    def get(self, timeout: float | None = None) -> R:
        """Block until the result is ready; on timeout raise ``TimeoutError`` (the future stays usable)."""
        if timeout is not None:
            _check_timeout(timeout)
        if self._state == _PENDING:
            if self._start is not None:
                self._kick()
            tid = _get_ident()
            rt = _context._runtime
            if rt is not None and tid == rt.transport.io_ident:
                raise RuntimeError("Future.get() on the monarch_nb I/O thread would deadlock; use a callback")
            blocked[tid] = self
            try:
                # the wait lives in _replyread (a one-actor call's reply, read here) or _debugwait: a
                # rank of ours stopping at a breakpoint wakes the main thread either way
                peer = self._peer
                if peer is not None and rt is not None:
                    done = _replyread.wait(self, peer, timeout, rt, tid)
                else:
                    done = _debugwait.wait(self, timeout, tid)
                if not done:
                    raise TimeoutError(self._not_ready(timeout))
                # read while still listed as blocked: whoever watches ``blocked`` sees the error raised
                return self._resolve()
            except KeyboardInterrupt as e:
                # waited for inside a function of ours (mt.inspect, %mesh stop): the user holds no
                # future to call .get() on again
                self._note_wait_stopped(e, held=not _ours(sys._getframe(1).f_code.co_filename))
                raise
            finally:
                blocked.pop(tid, None)
        return self._resolve()

    def _not_ready(self, timeout: float | None) -> str:
        """A timed-out wait's words; for a call to several ranks, how many replied: a rank hung or
        dead leaves the others waiting in a collective, and the count tells which case it is."""
        text = f"{self._what} not ready after {timeout} s"
        elsewhere = _debugwait.paused_elsewhere(self)
        if elsewhere:
            return f"{text}: {elsewhere} (the future is still usable)"
        p = self.progress()
        if p is not None and p[1] > 1 and self.progress_unit == "ranks replied":
            done, n = p
            return (
                f"{text}: {done} of {n} ranks replied, {n - done} still running (the future is still usable; "
                "monarch_nb.debug.stacks(mesh), or %mesh stacks NAME, shows where they are)"
            )
        return f"{text} (the future is still usable)"

    def _note_wait_stopped(self, e: BaseException, held: bool = True) -> None:
        """Tell the reader of an interrupted or cancelled wait that the work it waited for goes
        on: a kernel interrupt looks as if it stopped the call, and the next call to those actors
        then waits, unexplained, for this one to end."""
        if self._state != _PENDING:
            return
        elsewhere = _debugwait.paused_elsewhere(self)
        if elsewhere:
            e.add_note(f"monarch_nb: only the wait stopped: {self._what} goes on once it can; {elsewhere}")
            return
        p = self.progress()
        if p is None or self.progress_unit != "ranks replied":
            again = ", and .get() or await waits for it again" if held else ""
            e.add_note(f"monarch_nb: only the wait stopped: {self._what} goes on{again}.")
            return
        done, n = p
        again = ".get() or await waits for it again; stopping" if held else "Stopping"
        e.add_note(
            f"monarch_nb: only the wait stopped: {self._what} still runs on {n - done} of {n} ranks, "
            f"as in Monarch, and their actors take their next calls once it returns. {again} the mesh ends it now."
        )

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception, or None. A wait that times out raises ``TimeoutError`` (as
        ``concurrent.futures``; Monarch returns it), and one the user interrupts raises
        ``KeyboardInterrupt`` (as Monarch): neither is the call's."""
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except Exception as e:
            return e
        return None

    def __await__(self) -> Generator[Any, None, R]:
        if self._start is not None:
            self._kick()
        if self._state == _PENDING:
            rt, peer = _context._runtime, self._peer
            # a one-actor call's reply: the loop may read it itself
            own = None if peer is None or rt is None else functools.partial(_replyread.awaitable, self, peer, rt)
            try:
                if _debugwait.awaits_here():
                    # an async cell: a rank of ours stopping at a breakpoint opens the console here,
                    # and the frontend shows the wait's progress, as for a get()
                    tid = _get_ident()
                    blocked[tid] = self
                    try:
                        yield from _debugwait.wait_async(self, own).__await__()
                        return self._resolve()  # read while still listed, as get() does
                    finally:
                        if blocked.get(tid) is self:  # awaits gathered in one cell: the last one shows
                            del blocked[tid]
                else:
                    yield from (own() if own is not None else _debugwait.woken_by(self)).__await__()
            except asyncio.CancelledError as e:
                # a cancelled task, or a timeout around the await (asyncio.wait_for)
                self._note_wait_stopped(e)
                raise
        return self._resolve()

    def as_asyncio(self) -> asyncio.Future[R]:
        async def run() -> R:
            return await self

        return asyncio.ensure_future(run())

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _RAW: "done", _DONE: "done", _FAILED: "failed"}[self._state]
        p = self.progress() if self._state == _PENDING else None
        if p is not None:
            # a cell that shows a future it did not wait on: how far the call is
            state += f", {p[0]}/{p[1]} {self.progress_unit}"
        return f"<monarch_nb Future {self._what} {state}>"


def blocked_on(thread_id: int) -> Future[Any] | None:
    """The future thread ``thread_id`` is blocked on in ``get()`` or awaits on its loop, if any (a frontend
    shows its progress)."""
    return blocked.get(thread_id)


def returns_future(fn: Callable[..., Coroutine[Any, Any, R]]) -> Callable[..., Future[R]]:
    """Make an ``async def`` return a :class:`Future`: ``await`` it, or ``.get()`` it from sync code.

    The coroutine runs on a private event loop thread, never on the runtime's I/O loop, so a
    slow coroutine cannot stall message delivery.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Future[R]:
        fut: Future[R] = Future._create(fn.__qualname__)

        def run() -> None:
            try:
                fut._set_result(asyncio.run(_as_coro(fn(*args, **kwargs))))
            except BaseException as e:
                fut._set_exception(e)

        threading.Thread(target=run, name=f"returns_future-{fn.__qualname__}", daemon=True).start()
        return fut

    return wrapper


async def _as_coro(aw: Awaitable[R]) -> R:
    return await aw
