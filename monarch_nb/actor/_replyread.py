"""A caller blocked on one actor's reply reads it off that actor's connection itself.

A reply normally reaches a caller blocked in ``Future.get()`` in two steps: the runtime's I/O
thread reads it and wakes the caller. That thread hop is about 50 µs of a warm ``call_one`` and
over 100 µs of one made after a pause (docs/performance.md). So once a reply to a blocked
caller has come alone on a direct connection, the I/O thread hands that connection to the
caller's thread (``Transport.claim``, the mechanism a proc's idle sync actor reads its calls
with). Its next ``get()`` on that actor's reply reads the connection itself: one wake-up. While
the caller is elsewhere the I/O thread watches the connection and takes it back for good once
a byte arrives, and anything but the awaited reply goes back to it with the connection, in
order. A failure that completes the future elsewhere, or a rank of ours stopping at a
breakpoint, wakes the read through an eventfd.

A coroutine awaiting such a reply (:func:`awaitable`) has its event loop watch the claimed
connection instead (``loop.add_reader``): the loop wakes on the reply itself, where it used to
wake on its self-pipe, written by the I/O thread after its own wake-up.
"""

from __future__ import annotations

import _thread
import asyncio
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._runtime.transport import drain_wake
from .._wire.frames import port_value
from . import _debugwait
from ._debugwait import _PENDING

if TYPE_CHECKING:
    from .._runtime.runtime import Runtime
    from ._future import Future

_tls = threading.local()


class _Reader:
    """A thread's claimed reply connections (by actor) and the eventfd that wakes its reads."""

    __slots__ = ("claims", "early", "efd", "owner", "poller")

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Any] = {}
        #: by peer: the weight of looking for its reply right after the send (>= 0), or calls
        #: left before looking again (< 0) (:func:`send`)
        self.early: dict[tuple[str, str], int] = {}
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.owner = _thread.get_ident()
        #: the eventfd, and a claimed connection while a read waits on it
        self.poller = select.poll()
        self.poller.register(self.efd, select.POLLIN)

    def set(self, *_: Any) -> None:
        """Wake this thread's read (from another thread: its own completions need no wake-up)."""
        if _thread.get_ident() != self.owner:
            try:
                os.eventfd_write(self.efd, 1)
            except OSError:
                pass  # closed: the thread is gone

    def __del__(self) -> None:
        try:
            for c in self.claims.values():
                c.give_back()  # the thread ended: its connections go back to the I/O thread
            os.close(self.efd)
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass


def _reader() -> _Reader | None:
    """This thread's reader; None if the process has no descriptor left for its eventfd (its
    waits then go the usual way, which needs none)."""
    r: _Reader | None = getattr(_tls, "r", None)
    if r is None:
        try:
            r = _tls.r = _Reader()
        except OSError:
            return None
    return r


def _forget_in_child() -> None:
    # a forked child shares its parent's sockets and epoll: it must never read or watch them
    r: _Reader | None = getattr(_tls, "r", None)
    if r is not None:
        r.claims = {}
        _tls.r = None


os.register_at_fork(after_in_child=_forget_in_child)


def wait(fut: Future[Any], peer: tuple[str, str], timeout: float | None, rt: Runtime, tid: int) -> bool:
    """``get()``'s wait for a one-actor call's future (``peer``: the actor's proc and name): on
    its reply connection, if this thread holds it, else as usual, asking the I/O thread for that
    connection. True: done; False: ``timeout`` passed."""
    r = _reader()
    if r is None:
        return _debugwait.wait(fut, timeout, tid)
    c = r.claims.get(peer)
    if c is not None:
        done = _read(fut, c, r, timeout, rt, tid)
        if done is not None:
            return done
        if c.state == c.GONE:
            del r.claims[peer]
    adopt = _ask(r, peer, fut._port, rt)
    try:
        return _debugwait.wait(fut, timeout, tid)
    finally:
        adopt()


#: how a thread weighs looking for a peer's reply right after the send (:func:`send`):
#: each reply found there adds _HIT (up to _MAX), each look that found nothing takes 1 away;
#: at 0 a look that finds nothing stops it looking for _SKIP calls. A look that finds nothing
#: costs 3 system calls, one that finds the reply saves 15-40 µs: worth it from 1 in 9 or so
_START, _HIT, _MAX, _SKIP = 8, 8, 64, 256


def send(peer: tuple[str, str], rt: Runtime | None, gather: Callable[..., Future[Any]], *args: Any) -> Future[Any]:
    """(``call_one``.) ``gather(*args)``, which sends a call to ``peer``, with this thread's
    claim on that actor's reply connection (if it holds one) read here meanwhile: its reply may
    be complete when this returns.

    Where a call's proc wakes on its caller's CPU (a machine with few CPUs), the scheduler runs
    it at once, inside the caller's send, so its reply is written before the caller is back;
    were the I/O thread watching, the reply would wake it on another CPU (a remote wake-up, in
    the proc's write) only for the caller to read the reply itself, and an ``await`` would
    take a turn of its event loop for it. :func:`after_send` reads what came and hands the
    connection back to the I/O thread's watch."""
    r: _Reader | None = getattr(_tls, "r", None)
    if r is None or rt is None:
        return gather(*args)
    c = _claim_to_look(r, peer, rt)
    if c is None:
        return gather(*args)
    try:
        fut = gather(*args)
    except BaseException:
        c.busy()  # the I/O thread watches the connection again
        raise
    after_send(fut, c, rt, peer)
    return fut


def _claim_to_look(r: _Reader, peer: tuple[str, str], rt: Runtime) -> Any:
    """The claim on ``peer``'s reply connection, now read here (the I/O thread no longer watches
    it), if this thread holds it and looking for the reply after the send is worth it; or None."""
    c = r.claims.get(peer)
    # idle already: an await of this thread's loop reads it now (a reply to come is its)
    if c is None or c.state != c.BUSY:
        return None
    score = r.early.get(peer, _START)
    if score < 0:
        r.early[peer] = score + 1  # at 0 it looks again
        return None
    if not _held(c, rt):
        return None
    return c


def after_send(fut: Future[Any], c: Any, rt: Runtime, peer: tuple[str, str]) -> None:
    """(:func:`send`, after the send.) Take the reply if it came already; the I/O thread
    watches the connection again (what is not the reply goes back to it)."""
    try:
        if fut._state == _PENDING:
            got = c.read()
            if got is None or (got and not _take(c, got, fut._port, rt.receiver.port_reply)):
                return  # the connection ended, or given back: the I/O thread has it
            early = _tls.r.early
            score = early.get(peer, _START)
            if fut._state == _PENDING:
                early[peer] = score - 1 if score > 0 else -_SKIP
            else:
                early[peer] = min(score + _HIT, _MAX)
    finally:
        c.busy()


def _ask(r: _Reader, peer: tuple[str, str], port: int, rt: Runtime) -> Callable[[], None]:
    """Ask the I/O thread for the connection the reply on ``port`` comes on; the function
    returned, called on this thread once the wait is over, takes it (if it came) as ``peer``'s."""
    asks = rt.receiver.reply_claims
    claimed: list[Any] = []
    asks[port] = claimed.append

    def adopt() -> None:
        asks.pop(port, None)
        if claimed and claimed[0] is not None:
            old = r.claims.get(peer)
            if old is not None and old is not claimed[0]:
                old.give_back()
            r.claims[peer] = claimed[0]

    return adopt


def _held(c: Any, rt: Runtime) -> bool:
    """Whether claimed connection ``c`` is still this runtime's and now read here (``idle``)."""
    return c.t is rt.transport and c.rx.sock.fileno() == c.fd and bool(c.idle())


def _take(c: Any, got: list[Any], port: int, deliver: Callable[[Any], None]) -> bool:
    """Deliver (``Receiver.port_reply``) the replies on ``port`` among the messages ``got`` read
    off ``c``; at the first other one, give it and the rest back to the I/O thread, in order,
    with the connection (False)."""
    for i, msg in enumerate(got):
        pv = port_value(msg[0]) if len(msg) == 1 else None
        if pv is None or pv[0] != port:
            c.give_back(got[i:], cooldown=16)
            return False
        deliver(pv)
    return True


def _read(fut: Future[Any], c: Any, r: _Reader, timeout: float | None, rt: Runtime, tid: int) -> bool | None:
    """Read ``fut``'s reply off claimed connection ``c``; None: not here after all (the I/O
    thread has the connection back, or a debug session of ours opened), wait as usual."""
    debug = _debugwait.watches(tid)
    if debug and _debugwait._ours and _debugwait.due(fut):
        return None  # the usual wait offers the console again for this call's paused ranks
    if not _held(c, rt):
        return None
    if debug:
        outer = _debugwait.swap_main_wake(r)
    fut.add_done_callback(r.set)  # completed elsewhere (a failure, the I/O thread): wake up
    poller = r.poller
    try:
        poller.register(c.fd, select.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        port, deliver = fut._port, rt.receiver.port_reply
        while fut._state == _PENDING:
            if debug and _debugwait.unseen():
                return None  # the usual wait runs the console
            ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1e3
            ready = poller.poll(ms)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                continue
            for fd, _ in ready:
                if fd == r.efd:
                    drain_wake(fd)
                    continue
                got = c.read()
                if got is None or not _take(c, got, port, deliver):
                    return None  # the connection ended, or given back: the I/O thread has it
        return True
    finally:
        try:
            poller.unregister(c.fd)
        except (KeyError, ValueError):
            pass
        c.busy()  # the I/O thread watches it again (False: it has it back already)
        if debug:
            _debugwait.swap_main_wake(outer)


def awaitable(fut: Future[Any], peer: tuple[str, str], rt: Runtime) -> asyncio.Future[None]:
    """What ``await`` on a one-actor call's future waits on, on the running loop: done once
    ``fut`` is. If this thread holds ``peer``'s reply connection, the loop reads it; else the
    I/O thread wakes the loop, and is asked for the connection for the next ``await``."""
    loop = asyncio.get_running_loop()
    af: asyncio.Future[None] = loop.create_future()
    tid = _thread.get_ident()

    def wake(_: Any) -> None:
        if _thread.get_ident() == tid:
            _debugwait.resolve_once(af)  # read and completed right here, on the loop
        else:
            _debugwait.waker(loop, af)()

    r = _reader()
    if r is None:
        fut.add_done_callback(wake)
        return af
    c = r.claims.get(peer)
    if c is not None and _held(c, rt):
        port, deliver = fut._port, rt.receiver.port_reply
        watching = [True]

        def stop(gone: bool) -> None:
            if watching[0]:
                watching[0] = False
                loop.remove_reader(c.fd)
                if gone:
                    if r.claims.get(peer) is c:
                        del r.claims[peer]
                else:
                    c.busy()  # the I/O thread watches it again

        def readable() -> None:
            if fut._state != _PENDING:
                stop(False)  # done elsewhere: what follows is the I/O thread's
                return
            got = c.read()
            if got is None or not _take(c, got, port, deliver):
                stop(True)  # the connection ended, or given back: the I/O thread has it

        loop.add_reader(c.fd, readable)
        af.add_done_callback(lambda _: stop(False))  # also when the awaiting task is cancelled
        fut.add_done_callback(wake)
        return af
    if c is not None and c.state == c.GONE:
        del r.claims[peer]
    adopt = _ask(r, peer, fut._port, rt)
    af.add_done_callback(lambda _: adopt())
    fut.add_done_callback(wake)
    return af
