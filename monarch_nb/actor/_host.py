"""How a process hosts actors: each one's mailbox and thread, and the ``__sys__`` system actor.

A sync actor (every endpoint a ``def``) gets its own thread and no event loop; an actor
with ``async def`` endpoints gets its own thread running its own loop. Either way messages
reach it through a mailbox fed by the runtime's I/O thread and run one at a time, in
arrival order (``concurrent_endpoint`` methods may overlap at their awaits).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import inspect
import logging
import os
import queue
import select
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

from .._runtime import _dataplane, spans
from .._runtime.logcapture import TaggedStream, begin_call, current_call, end_call
from .._runtime.runtime import NO_REPLY, REFUSED, Runtime, new_loop, system_method
from .._runtime.sending import say_unsent
from .._runtime.transport import drain_wake
from .._wire import frames as wire
from .._wire.serialize import loads, loads_fast
from ..errors import ActorError, ConnectError, SupervisionError, _safe_exc, format_exception, safe_str
from . import _context, _pdb
from ._actor import Instance, endpoints_of, is_async_actor
from ._endpoint import _NotAnEndpointMethod
from ._shape import Extent, Point
from ._supervision import stopped_words

logger = logging.getLogger(__name__)

_OK, _ERROR, _PRINTED = wire.OK, wire.ERROR, wire.PRINTED


class _ArgWaits(threading.local):
    """(An async actor's loop thread) set while a call's arguments are unpickled there: waits an
    argument asked for (:func:`wait_for_argument`), run off the loop before the call starts."""

    def __init__(self) -> None:
        self.on = False
        self.waits: list[Any] = []


_arg_waits = _ArgWaits()


def wait_for_argument(wait: Any) -> bool:
    """For what unpickles an endpoint's argument that this process makes a moment later (a mesh
    tensor's local tensor, still being computed here): on an async actor's loop, ``wait()``
    (which blocks until it has filled the argument in, or raises the call's error) runs in a
    thread before the call starts, so the loop serves its other tasks meanwhile, and the call
    still starts in its turn. Returns False elsewhere (a sync actor): the caller waits in place."""
    if not _arg_waits.on:
        return False
    _arg_waits.waits.append(wait)
    return True


class _LoopQueue:
    """An async actor's mailbox, used on its loop only: asyncio.Queue without its size bound,
    its getters' queue (there is one reader) and their bookkeeping (a quarter of the Python an
    async actor's thread ran per small call)."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            # cancelled meanwhile (a stop), the next get makes a new one
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


class ActorSlot:
    """One actor in this process: its object, mailbox and thread (and loop, if async)."""

    def __init__(self, rt: Runtime, name: str, cls: type, info: Instance) -> None:
        """``name`` keys the actor in this proc; ``info`` is what it knows about itself."""
        self.rt = rt
        self.name = name
        self.cls = cls
        self.is_async = is_async_actor(cls)
        self.instance_info = info
        info._slot = self
        self.endpoints = endpoints_of(cls)
        #: whether a method it runs is an ``async def`` (asked once per method: inspect's
        #: answer costs more than a small endpoint's call)
        self._is_coro: dict[Any, bool] = {}
        self.obj: Any = None
        self.init_error: ActorError | None = None
        #: the constructor's arguments, kept for `%mesh sync --recreate`
        self.init_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.markers = _context.proc_spec is not None
        #: the calls running, oldest first: (method, call id, caller's address, start), by a key
        #: of each call's own (an async actor's concurrent endpoints run at once: status, stacks
        #: and a breakpoint's debug session each name their own call, not the latest one begun)
        self.running: dict[int, tuple[str, str, str, float]] = {}
        #: calls served and seconds spent in them (telemetry)
        self.calls = 0
        self.busy_s = 0.0
        self._stopped = False
        self._points: dict[Any, Point] = {}
        #: the span keys of this actor's calls, by method, that succeeded and that failed
        self._ok_keys: dict[str, tuple[Any, ...]] = {}
        self._err_keys: dict[str, tuple[Any, ...]] = {}
        #: control items (supervision) that go ahead of queued messages
        self._ctl: collections.deque[Any] = collections.deque()
        #: why this actor failed (Monarch's "actor explicitly aborted due to: ..."), once it has
        self.failed: str | None = None
        #: a reason given to ``Instance.abort``, acted on once the message in hand is done
        self.abort_reason: str | None = None
        #: where the owner of this actor's mesh hears of its failure: (address, port)
        self.supervisor: tuple[str, int] | None = None
        #: a failure to act on before the next message (an unhandled one of a mesh it owns)
        self.pending_failure: _ActorFailed | None = None
        #: the actor that calls to this failed one name (itself, or the child whose failure it did not handle)
        self.failed_actor = ""
        #: why its stop came, where the stop said (its owner actor failed): the status a call
        #: refused at the stop gives, instead of "stopped by client"
        self.stop_because = ""
        #: stop() was called: what is queued is refused, the call in hand gets no result
        self.stopping = False
        #: (async) the loop's main task, and whether it is inside a (non-concurrent) handler
        self._main: asyncio.Task[Any] | None = None
        self._handling = False
        #: the direct connection this actor's thread (or loop) reads itself while idle (Transport.claim)
        self._claim: Any = None
        self._claim_pending = False
        #: what the claim's idle() answered after the call in hand (None: not asked yet)
        self._idled: bool | None = None
        #: the actor stopped itself: its thread reads no more calls off its connection
        self._leaving = False
        if self.is_async:
            #: (async) the loop watches its claimed connection through this epoll (one-shot: a
            #: call read there leaves it unwatched until the loop is idle again)
            self._inner: Any = None
            self._inner_armed = False
            # uvloop's in a proc, which leaves by os._exit; a controller's interpreter finalizes
            # with this daemon thread still in its loop, and uvloop's callbacks then crash it
            self.loop = new_loop(fast=_context.proc_spec is not None)
            self._aq: _LoopQueue | None = None
            ready = threading.Event()
            self.thread = threading.Thread(target=self._run_async, args=(ready,), name="monarch-actor-event-loop", daemon=True)
            self.thread.start()
            ready.wait()
        else:
            self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            #: the thread waits on its connection: a put must wake it through ``_wake``
            self._polling = False
            self._wake = -1
            self._poller: Any = None
            # the thread names are Monarch's
            self.thread = threading.Thread(target=self._run_sync, name="monarch-actor-driver", daemon=True)
            self.thread.start()

    # -- mailbox (called on the I/O thread)
    def deliver(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        self._put(("call", meta, body, buffers))

    def _put(self, item: Any) -> None:
        if self.is_async:
            assert self._aq is not None
            try:
                self.loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:
                pass  # its loop ended (the actor stopped) and is closed: nobody reads it, as a stopped sync actor's queue
        else:
            self._q.put(item)
            if self._polling:
                os.eventfd_write(self._wake, 1)

    def queued(self) -> list[Any]:
        """(Any thread; ``debug.stacks`` and the status poll.) The mailbox items not taken yet,
        oldest first, read in place: the calls waiting behind the one in hand. Read through the
        collector's view of the queues, so that no call pays for it (a SimpleQueue has no peek),
        and, for an async actor, the loop's ready queue too: what the I/O thread handed to a
        loop that runs a handler's own code waits there, as put_nowait callbacks."""
        if not self.is_async:
            items: list[Any] = []
            for r in gc.get_referents(self._q):
                if isinstance(r, list):
                    items += [i for i in r.copy() if i is not None]  # its list: taken items are None
                elif isinstance(r, tuple):
                    items.append(r)  # a queue that names each item
            return items
        aq = self._aq
        if aq is None:
            return []
        # copies are single C calls under the GIL: the loop may take an item meanwhile
        items = list(aq._items.copy())
        ready = getattr(self.loop, "_ready", None)  # asyncio's; uvloop's is on no attribute
        if ready is None:
            ready = next((r for r in gc.get_referents(self.loop) if isinstance(r, collections.deque)), None)
        for h in ready.copy() if ready is not None else ():
            cb, args = getattr(h, "_callback", None), getattr(h, "_args", None)
            if cb is None:
                refs = gc.get_referents(h)
                at = next((i for i, r in enumerate(refs) if getattr(r, "__self__", None) is aq), -1)
                if at < 0 or at + 1 >= len(refs):
                    continue
                cb, args = refs[at], refs[at + 1]
            if getattr(cb, "__self__", None) is aq and getattr(cb, "__func__", None) is _LoopQueue.put_nowait:
                if isinstance(args, tuple) and len(args) == 1:
                    items.append(args[0])
        return items

    def claims(self) -> bool:
        """(The I/O thread.) Whether this actor's thread (an async one's loop) would read its
        caller's connection."""
        return self._claim is None and not self._claim_pending and not self.stopping and not self._leaving and self.failed is None

    def leave_connection(self) -> None:
        """(The actor's thread, in an endpoint that stops the actor.) Read no further call off
        the caller's connection: one sent after this endpoint's answer is not "delivered
        before" the stop, and must reach the I/O thread, which fails it once the actor is
        unlisted (the I/O thread unlists it before it reads that connection again)."""
        self._leaving = True

    def take_connection(self, claim: Any) -> None:
        """(The I/O thread, right after delivering a call that came alone on ``claim``'s
        connection.) From the next message on, this actor's thread reads it itself."""
        self._claim_pending = True
        self._put(("claim", claim))

    def stop(self, done: Any = None, owned: bool = True, graceful: bool = False, tell_owner: bool = True) -> None:
        """Stop this actor as Monarch does: the message in hand finishes (an async actor's is
        cancelled, with its concurrent tasks) but its caller gets no result, queued ones are
        refused, the meshes it spawned stop (``owned``), ``__cleanup__`` runs, then ``done()``
        is called (on its thread). ``graceful`` (an actor stopping itself): what was delivered
        before is still handled and answered. ``tell_owner``: a ``__cleanup__`` that raises is
        a failure of the actor its owner hears of (see :meth:`_cleanup_failed`)."""
        self._stop_done = done
        self._stop_owned = owned
        self._stop_tells_owner = tell_owner
        self._stop_asked = time.monotonic()
        if not graceful:
            self.stopping = True
            if self.is_async:
                try:
                    self.loop.call_soon_threadsafe(self._cancel_for_stop)
                except RuntimeError:
                    pass  # stopped already: its loop is closed
        self._put(("stop",))

    def _cancel_for_stop(self) -> None:
        # on the actor's loop
        for t in list(self._tasks):
            t.cancel()
        if self._handling and self._main is not None:
            self._main.cancel()

    def _finish_stop(self) -> None:
        """The meshes this actor spawned stop before it (their ``__cleanup__`` first)."""
        if not getattr(self, "_stop_owned", False):
            return
        self._stop_owned_meshes(logging.WARNING)

    def _stop_owned_meshes(self, level: int, because: str = "") -> None:
        for mesh in reversed(self.instance_info._owned):
            try:
                mesh._stop(because=because).get(timeout=self.rt.cfg.spawn_timeout)
            except Exception as e:
                logger.log(level, "stopping %r, spawned by %s: %s", mesh, self.name, e)

    def _signal_stopped(self) -> None:
        done = getattr(self, "_stop_done", None)
        if done is not None:
            try:
                done()
            except Exception:
                logger.exception("stop callback of %s raised", self.name)

    def retire(self) -> None:
        """Unlist this actor from its proc, then stop it (on the I/O thread)."""
        if self.rt.actors.get(self.name) is self:
            del self.rt.actors[self.name]
        self.stop(graceful=True)

    def supervise(self, failure: Any) -> Any:
        """Run ``__supervise__(failure)`` as Monarch does: on the actor's own thread between
        messages (a sync actor) or as a task on its loop (an async one, whose override may be
        ``async def``); never alongside its endpoints on another thread. Returns its result."""
        done = threading.Event()
        box: list[Any] = [None, None]
        # a control item: it runs before the messages already queued (Monarch's SA-3), so
        # supervision is never starved by a backlog of the actor's own endpoint messages
        self._ctl.append(("supervise", failure, box, done))
        self._put(("ctl",))
        while not done.wait(1.0):
            if not self.thread.is_alive():
                return None  # stopped before it got to it: not handled
        if box[1] is not None:
            raise box[1]
        return box[0]

    def _supervise_sync(self, failure: Any, box: list[Any], done: threading.Event) -> None:
        try:
            box[0] = self.obj.__supervise__(failure)
        except BaseException as e:
            box[1] = e
        finally:
            done.set()

    async def _supervise_async(self, failure: Any, box: list[Any], done: threading.Event) -> None:
        try:
            r = self.obj.__supervise__(failure)
            box[0] = await r if inspect.isawaitable(r) else r
        except BaseException as e:
            box[1] = e
        finally:
            done.set()

    # -- threads
    def _run_sync(self) -> None:
        _context._instance.set(self.instance_info)
        try:
            while True:
                c = self._claim
                if c is None:
                    if self._handle_sync(self._q.get()):
                        return
                    continue
                item = self._next_claimed(c)
                if item is None:
                    continue
                # the I/O thread watches the connection while this one is busy
                c.busy()
                self._idled = None
                stop = self._handle_sync(item)
                if self._leaving and self._claim is c:
                    self._let_go()
                elif self._claim is c and not (c.idle() if self._idled is None else self._idled):
                    self._unclaim()  # something came meanwhile: the I/O thread reads it from now on
                if stop:
                    return
        finally:
            if self._claim is not None:
                self._let_go()

    def _next_claimed(self, c: Any) -> Any:
        """Wait for the next message, on the claimed connection or in the mailbox (which goes
        first: what is there was delivered earlier); None when there is none yet."""
        q = self._q
        if not q.empty():
            return q.get_nowait()
        self._polling = True
        try:
            if not q.empty():  # put before _polling was seen: no wake-up is coming for it
                return q.get_nowait()
            ready = self._poller.poll()
        finally:
            self._polling = False
        for fd, _ in ready:
            if fd == self._wake:
                drain_wake(fd)
        if not q.empty():
            # the mailbox first; the connection is still readable next time (level-triggered)
            return q.get_nowait()
        item = self._read_claimed(c)
        if item is None:
            return None
        if not q.empty():
            # earlier messages of its stream were delivered to the mailbox meanwhile: after them
            q.put(item)
            return q.get_nowait()
        return item

    def _read_claimed(self, c: Any) -> Any:
        """Read the claimed connection ``c`` (readable): the call it brought for this actor, or
        None: nothing yet, or it went back to the I/O thread (``_claim`` is None then)."""
        got = c.read()
        if got is None:  # the connection ended: the I/O thread has it back
            self._unclaim()
            return None
        if not got:
            return None  # part of a message
        own = self.rt.receiver.take_own(got[0], self.name) if len(got) == 1 else None
        if own is None:
            # another actor's, a port's, out of order, or several at once: the I/O thread's work
            c.give_back(got, cooldown=0 if len(got) > 1 else 16)
            self._unclaim()
            return None
        if own is REFUSED:
            return None  # its shared memory was gone or not ours: answered with that error
        return ("call", *own)

    def _let_go(self) -> None:
        """Hand the claimed connection back to the I/O thread for good."""
        self._claim.give_back()
        self._unclaim()

    def _unclaim(self) -> None:
        c, self._claim = self._claim, None
        watch = self._inner if self.is_async else self._poller
        if self.is_async:
            self._inner_armed = False
        if c is not None and watch is not None:
            try:
                watch.unregister(c.fd)
            except (KeyError, ValueError, OSError):
                pass

    def _adopt(self, c: Any) -> None:
        """Read ``c``'s connection on this thread from now on (see :meth:`take_connection`)."""
        self._claim_pending = False
        if self._claim is not None or self.stopping or self._leaving or self.failed is not None:
            c.give_back()
            return
        if not c.idle():
            return  # something came while this thread was busy: the I/O thread read it
        if self._poller is None:
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            # closed with the slot, not when its thread ends: the I/O thread may be about to
            # write to it (_put), and holds the slot while it does
            weakref.finalize(self, os.close, self._wake)
            self._poller = select.poll()
            self._poller.register(self._wake, select.POLLIN)
        self._poller.register(c.fd, select.POLLIN)
        self._claim = c

    def _handle_sync(self, item: Any) -> bool:
        """Handle one mailbox item on the actor's thread; True: the actor stopped."""
        kind = item[0]
        if kind == "claim":
            self._adopt(item[1])
            return False
        # the commonest item, a call with nothing to do before it, skips the checks
        if kind != "call" or self._ctl or self.stopping or self.failed is not None or self.pending_failure is not None:
            while self._ctl:
                ctl = self._ctl.popleft()
                if self.stopping or self.failed is not None:
                    self._refuse(ctl)
                else:
                    self._supervise_sync(*ctl[1:])
            if kind == "ctl":
                return False
            if kind == "stop":
                if self._claim is not None:
                    self._let_go()
                self._finish_stop()
                if self.failed is None:
                    self._cleanup_sync(stopping=True)
                self._signal_stopped()
                return True
            if self.stopping:
                self._refuse(item)
                return False
            pf = self.pending_failure
            if pf is not None and self.failed is None:
                self._fail(pf)
                self._cleanup_sync(pf.cleanup_exc)
            if self.failed is not None:
                self._refuse(item)
                return False
        try:
            if kind == "call":
                self._call_sync(*item[1:])
            elif kind == "init":
                self._init(*item[1:])
            if self.abort_reason is not None:
                raise _Aborted(self.abort_reason)
        except _ActorFailed as f:
            self._fail(f)
            self._cleanup_sync(f.cleanup_exc)
        return False

    def _run_async(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        _context._instance.set(self.instance_info)
        self._aq = _LoopQueue(self.loop)
        self._tasks: set[asyncio.Task[Any]] = set()
        ready.set()
        try:
            self.loop.run_until_complete(self._async_main())
        finally:
            self._end_leftover_tasks()
            # its descriptors go with it (a proc may spawn and stop many actors); a late put
            # finds the loop closed (_put)
            if self._inner is not None:
                self.loop.remove_reader(self._inner.fileno())
                self._inner.close()
            self.loop.close()

    def _end_leftover_tasks(self) -> None:
        """Cancel the tasks the actor started and never awaited (``asyncio.create_task``), and
        let them run their ``except CancelledError``/``finally`` for the cleanup's grace, as
        ``asyncio.run`` and Monarch do: closing the loop over them printed "Task was destroyed
        but it is pending!" per rank, and their cleanup never ran."""
        loop = self.loop
        if loop.is_closed() or loop.is_running():
            return
        grace = self.rt.cfg.stop_cleanup_timeout
        asked = getattr(self, "_stop_asked", None)
        if asked is not None:
            # within what the allocator gives a stopping proc for its cleanup (less a moment to
            # say goodbye): a task that ignores its cancellation is named here, and its proc
            # exits, rather than being killed as if __cleanup__ had hung
            grace = max(0.0, asked + grace - 0.5 - time.monotonic())
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                _done, late = loop.run_until_complete(asyncio.wait(tasks, timeout=grace))
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        logger.error("background task of actor %s raised on cancellation", self.name, exc_info=t.exception())
                if late:
                    names = ", ".join(sorted(t.get_name() for t in late))
                    logger.warning(
                        "actor %s: %d background task(s) still running %.1f s after being cancelled (%s): left unfinished",
                        self.name,
                        len(late),
                        grace,
                        names,
                    )
                    for t in late:
                        t._log_destroy_pending = False  # type: ignore[attr-defined]  # said above, once
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), grace))
        except Exception:
            logger.exception("ending the background tasks of actor %s", self.name)

    async def _async_main(self) -> None:
        assert self._aq is not None
        self._main = asyncio.current_task()
        while True:
            item = await self._aq.get()
            if self._claim is not None and self._claim.state == self._claim.IDLE:
                self._claim_to_io()
            if item[0] == "claim":
                self._adopt_async(item[1])
                continue
            while self._ctl:
                ctl = self._ctl.popleft()
                if self.stopping or self.failed is not None:
                    self._refuse(ctl)
                else:
                    # a task, as in Monarch: it may await while the actor goes on with messages
                    t = asyncio.ensure_future(self._supervise_async(*ctl[1:]))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
            if item[0] == "ctl":
                continue
            if item[0] == "stop":
                if self._claim is not None:
                    self._let_go()
                # concurrent tasks were cancelled (_cancel_for_stop): they end before __cleanup__
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                self._finish_stop()
                if self.failed is None:
                    await self._cleanup_async(stopping=True)
                self._signal_stopped()
                return
            if self.stopping:
                self._refuse(item)
                continue
            pf = self.pending_failure
            if pf is not None and self.failed is None:
                await self._fail_async(pf)
            if self.failed is not None:
                self._refuse(item)
                continue
            if item[0] == "abort":
                await self._fail_async(_Aborted(self.abort_reason or ""))
                continue
            if item[0] == "init":
                try:
                    self._init(*item[1:])
                except _ActorFailed as f:
                    self._fail(f)  # no __cleanup__ after a failed __init__, as in Monarch
                continue
            meta = item[1]
            ep = self.endpoints.get(meta[1])
            if ep is not None and ep.concurrent:
                t = asyncio.ensure_future(self._call_async(*item[1:]))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            else:
                self._handling = True
                try:
                    await self._call_async(*item[1:])
                except asyncio.CancelledError:
                    if not self.stopping:
                        raise
                    self._main.uncancel()
                finally:
                    self._handling = False
                if self._leaving and self._claim is not None:
                    self._let_go()

    # -- (async) the claimed connection, read on the loop while the actor is idle
    def _adopt_async(self, c: Any) -> None:
        """Read ``c``'s connection on this loop while idle (see :meth:`take_connection`)."""
        self._claim_pending = False
        if self._claim is not None or self.stopping or self._leaving or self.failed is not None or self._tasks:
            c.give_back()
            return
        if not c.idle():
            return  # something came while the loop was busy: the I/O thread read it
        if self._inner is None:
            self._inner = select.epoll()
            self.loop.add_reader(self._inner.fileno(), self._on_claimed)
        try:
            self._inner.register(c.fd, select.EPOLLIN | select.EPOLLONESHOT)
        except OSError:
            c.give_back()  # closed meanwhile: the I/O thread finds it ended
            return
        self._claim, self._inner_armed = c, True

    def _claim_to_io(self) -> None:
        """About to handle a message: the I/O thread watches the claimed connection meanwhile."""
        c = self._claim
        if self._inner_armed:
            self._watch_here(False)
        if not c.busy():
            self._unclaim()  # the I/O thread has it back already

    def _claim_to_loop(self) -> None:
        """A handler's call is answered next: if nothing else is in hand, read the claimed
        connection on the loop again (before the reply goes, so a call its caller sends at once
        finds this loop watching)."""
        c = self._claim
        assert self._aq is not None
        if c.state == c.IDLE or self._tasks or self._ctl or self._aq._items:
            return
        if c.idle():
            self._watch_here(True)
        else:
            self._unclaim()  # something came meanwhile: the I/O thread took it back

    def _watch_here(self, on: bool) -> None:
        """Arm (or disarm) this loop's one-shot watch of the claimed connection."""
        self._inner_armed = on
        try:
            self._inner.modify(self._claim.fd, select.EPOLLIN | select.EPOLLONESHOT if on else 0)
        except OSError:
            pass  # closed meanwhile (the process is ending): the next read says so

    def _on_claimed(self) -> None:
        # the one-shot event: taken, so the connection is unwatched here until re-armed
        self._inner.poll(0)
        self._inner_armed = False
        c = self._claim
        if c is None or c.state != c.IDLE:
            return
        item = self._read_claimed(c)
        if item is None:
            if self._claim is c:
                self._watch_here(True)  # part of a message, or a refused one: watch for the next
            return
        self._claim_to_io()
        assert self._aq is not None
        self._aq.put_nowait(item)

    # -- failure
    def _fail(self, f: _ActorFailed) -> None:
        """This actor failed (on its own thread): its caller, then every queued message's,
        gets SupervisionError, and the owner of its mesh hears of it. Later messages are
        refused the same way (``_refuse``); the caller runs ``__cleanup__``."""
        info = self.instance_info
        self.failed = f.reason
        self._note_failure(f.reason)
        self.failed_actor = f.actor or repr(info)
        f.cleanup_exc = Exception(f"serving {info.actor_id.replace(' ', '')}: {f.reason}")
        if f.caller is not None:
            raddr, rport, index, method = f.caller
            self.rt.send_port(raddr, rport, index, wire.ERROR, self.supervision_error(method))
        for item in self._drain():
            self._refuse(item)
        while self._ctl:
            self._refuse(self._ctl.popleft())
        self._tell_owner(f.reason, f.event)
        # "… and all its descendants have failed": as in Monarch the meshes it spawned stop (their
        # __cleanup__ runs), rather than run on, holding their procs, for an owner that is gone.
        # Quietly: one of them may be the failed child this actor did not handle. A call to one of
        # them then says why its procs ended: this actor failed, not "process N exited with code 0"
        err = f.error
        first = (f"{type(err).__name__}: {err}" if err is not None else f.reason).strip().splitlines() or [""]
        # (this actor: failed_actor may name the child whose failure it did not handle)
        self._stop_owned_meshes(logging.DEBUG, f"the actor {info!r} that spawned it failed: {first[0]}")

    def _note_failure(self, reason: str) -> None:
        # the dashboard shows this proc's rank failed (sys_state)
        host = self.rt.system.get("__sys__")
        if host is not None:
            host.actor_failures.append((self.instance_info.name, reason))

    def _tell_owner(self, reason: str, event: str = "") -> None:
        """The owner of this actor's mesh hears that it failed, for ``reason`` (Monarch's
        supervision event)."""
        info = self.instance_info
        if self.supervisor is not None:
            ev = {
                "rank": info.rank.rank,
                "actor": self.failed_actor or repr(info),
                "reason": reason,
                "event": event or f"Supervision event: actor {info!r} failed:\n" + textwrap.indent(reason, "  "),
            }
            try:
                self.rt.send_port(self.supervisor[0], self.supervisor[1], info.rank.rank, wire.OK, ev)
            except Exception:
                logger.warning("could not tell the owner of %s that it failed", self.name, exc_info=True)

    def fail_unsupervised(self, failure: Any, exc: BaseException | None) -> None:
        """A failure of a mesh this actor owns that its ``__supervise__`` did not handle (returned
        falsy, or raised ``exc``): as in Monarch this actor fails, ahead of its queued messages,
        and its own owner hears of it, in Monarch's words."""
        me = repr(self.instance_info)
        child = getattr(failure, "actor", "") or failure.mesh_name
        reason = getattr(failure, "reason", "") or failure.event
        if exc is None:
            f = _ActorFailed(
                None,
                None,
                reason,
                actor=child,
                event=f"Supervision event: actor {me} failed because it did not handle a supervision event from its child. "
                "The child's event was:\n" + textwrap.indent(failure.event, "  "),
            )
        else:
            head = f"{type(exc).__name__}: {exc}"
            f = _ActorFailed(
                None,
                None,
                head
                + "\nThis error occurred while handling another failure:\n"
                + textwrap.indent(
                    f"The actor {child} and all its descendants have failed:\n" + textwrap.indent(reason, "  "), "  "
                ),
                event=f"Supervision event: actor {me} failed:\n"
                + textwrap.indent(head, "  ")
                + "\nThis error occurred while handling a supervision event from its child. The event was:\n"
                + textwrap.indent(failure.event, "  "),
            )
        self.pending_failure = f
        self._put(("abort",))  # wakes an idle actor; a busy one acts on it before its next message

    def _drain(self) -> list[Any]:
        """Take what is queued (a stop stays queued: it still ends the actor)."""
        items: list[Any] = []
        try:
            while True:
                items.append(self._aq.get_nowait() if self.is_async else self._q.get_nowait())  # type: ignore[union-attr]
        except (queue.Empty, asyncio.QueueEmpty):
            pass
        for item in items:
            if item[0] == "stop":
                self._put(item)
            elif item[0] == "claim":
                self._claim_pending = False
                item[1].give_back()  # a failed actor reads no connection
        return [i for i in items if i[0] not in ("stop", "claim")]

    def supervision_error(self, method: str) -> SupervisionError:
        """What a call to this failed (or stopped) actor gets, in Monarch's words."""
        info = self.instance_info
        if self.failed is None:
            return SupervisionError(
                "stopped",
                actor=info.name,
                rank=info.rank.rank,
                host=self.rt.hostname,
                # Monarch's words, as for a call sent after the stop
                message=stopped_words(info.name, method, repr(info), self.stop_because or "stopped by client")[1],
            )
        reason = self.failed
        return SupervisionError(
            reason,
            actor=info.name,
            rank=info.rank.rank,
            host=self.rt.hostname,
            message=(
                f"Endpoint call {info.name}.{method}() failed, The actor {self.failed_actor} and all its descendants have failed:\n"
                + textwrap.indent(reason, "  ")
            ),
        )

    def _refuse(self, item: Any) -> None:
        if item[0] == "call":
            meta = item[1]
            if meta[2]:
                self.rt.send_port(meta[2], meta[3], meta[4], wire.ERROR, self.supervision_error(meta[1]))
        elif item[0] == "supervise":
            item[3].set()  # not handled: the failure goes on up

    # -- work
    def _error(self, e: BaseException, what: str) -> ActorError:
        return ActorError(
            _safe_exc(e),
            format_exception(e),
            actor=self.instance_info.name,
            rank=self.instance_info.rank.rank,
            host=self.rt.hostname,
            message=f"{what} failed: {type(e).__name__}: {safe_str(e)}",
        )

    def _call_error(self, e: BaseException, method: str, detail: str = "") -> ActorError:
        # Monarch's words, with the name the program gave the mesh; ``detail``: what failed, where
        # it was not the endpoint's own code
        return ActorError(
            _safe_exc(e),
            format_exception(e),
            actor=self.instance_info.name,
            rank=self.instance_info.rank.rank,
            host=self.rt.hostname,
            message=f"Actor call {self.instance_info.name}.{method} failed." + (f"\n{detail}" if detail else ""),
        )

    def _init(self, args: tuple[Any, ...], kwargs: dict[str, Any], reply: tuple[str, int, int], answer: bool = True) -> None:
        """Construct the actor. ``answer``: reply with the outcome (get_or_spawn_controller waits
        for it); otherwise (``spawn``, which returned at once, as Monarch's) a failing
        ``__init__`` fails the actor, and its owner hears of it through supervision."""
        tok = _context._message_rank.set(self.instance_info.rank)
        failure: _ActorFailed | None = None
        t0 = time.perf_counter()
        # a breakpoint in __init__ belongs to the creator's spawn call (its call ids start with its uid)
        self.running[id(tok)] = ("__init__", f"{self.instance_info._creator_uid}.spawn", reply[0], t0)
        try:
            obj = self.cls.__new__(self.cls)  # type: ignore[call-overload]
            obj.__init__(*args, **kwargs)
            self.obj = obj
            self.init_args = (args, kwargs)
            status, value = wire.OK, None
        except BaseException as e:
            if isinstance(e, Exception) and _pdb._debugged.get() is not None:
                _pdb.post_mortem(self.running.get(id(tok)), e)
            self.init_error = self._error(e, f"{self.cls.__qualname__}.__init__ on rank {self.instance_info.rank.rank}")
            status, value = wire.ERROR, self.init_error
            failure = _ActorFailed(e, None)
            # a failed spawn in telemetry: a dashboard in any kernel lists it, not only the spawner's
            spans.record_span(
                f"{self.instance_info.name}.__init__",
                self.instance_info.name,
                self.instance_info.rank.rank,
                t0,
                time.perf_counter(),
                False,
                {"error": f"{type(e).__name__}: {e}"[:300]},
            )
        finally:
            _context._message_rank.reset(tok)
            self.running.pop(id(tok), None)
        if answer:
            self.rt.send_port(reply[0], reply[1], reply[2], status, value)
        elif failure is not None:
            raise failure

    def _prepare(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> tuple[Any, ...] | None:
        _, method, raddr, rport, index, ext, call_id = meta[:7]
        if self.init_error is not None:
            self._reply(raddr, rport, index, wire.ERROR, self.init_error)
            return None
        try:
            args, kwargs = loads_fast(body, buffers=buffers)
        except BaseException as e:
            self._arguments_failed(meta, e)
            return None
        ep = self.endpoints.get(method)
        if ep is not None:
            fn = ep.fn
            if ep.explicit_response_port:
                from ._port import Port

                args = (Port(raddr, rport, index), *args)
                raddr = ""
        else:
            fn = getattr(self.cls, method, None)  # type: ignore[assignment]
            if not callable(fn) or method.startswith("__"):
                self._reply(
                    raddr,
                    rport,
                    index,
                    wire.ERROR,
                    self._call_error(AttributeError(f"{self.cls.__qualname__} has no endpoint {method!r}"), method),
                )
                return None
            if isinstance(fn, _NotAnEndpointMethod):
                fn = fn.fn
        return (fn, args, kwargs, raddr, rport, index, self._point(index, ext), call_id, method)

    def _point(self, index: int, ext: Any) -> Point:
        # the message rank of a call; the same few recur, and building one costs microseconds
        key = (index, ext)
        p = self._points.get(key)
        if p is None:
            if len(self._points) > 1024:
                self._points.clear()
            p = self._points[key] = Point(index, Extent(*ext)) if ext[0] or ext[1] else Point(0, Extent([], []))
        return p

    def _reply(self, raddr: str, rport: int, index: int, status: int, value: Any, method: str = "") -> None:
        if raddr:
            try:
                self.rt.send_port(raddr, rport, index, status, value, self.instance_info.name, method)
            except ConnectError as e:
                # the caller does not read (stopped, hung, its process gone unnoticed yet): its reply
                # is lost, but this actor's thread lives on for its other callers; it used to die
                # here, and every later call to the actor waited for ever
                if say_unsent(raddr):
                    logger.warning("the reply of %s.%s was not sent: %s", self.instance_info.name, method, e)
        elif status == wire.ERROR:
            # nobody is waiting: leave the failure in this proc's log where %mesh logs finds it
            where = f"{self.instance_info.name}.{method}" if method else self.instance_info.name
            print(f"monarch_nb: unobserved error in {where}: {value}", file=sys.stderr, flush=True)

    def _flush_out(self, call_id: str = "") -> bool:
        """What the call (``call_id``) printed leaves the proc before its reply does, the
        call's end named behind it; True if it printed."""
        for f in (sys.stdout, sys.stderr):
            if not isinstance(f, TaggedStream):  # one the user put in place of the proc's own
                try:
                    f.flush()
                except (OSError, ValueError, AttributeError):
                    pass
        return end_call(call_id)

    @property
    def busy(self) -> list[str]:
        """The methods of the calls running, oldest first ([]: idle)."""
        # a copy is one C call under the GIL: the actor's thread may begin or end a call meanwhile
        return [r[0] for r in self.running.copy().values()]

    def this_call(self) -> tuple[str, str, str, float] | None:
        """The running call of the thread or asyncio task that asks (method, call id, caller's
        address, start); for one the actor started itself, the latest call begun (as its
        output is tagged)."""
        running = list(self.running.copy().values())
        if not running:
            return None
        mine = current_call()
        for r in reversed(running):
            if r[1] == mine:
                return r
        return running[-1]

    def _begin_call(self, mrank: Any, method: str, call_id: str, raddr: str, t0: float) -> Any:
        """What a sync or async endpoint call sets while it runs; the token for _end_call."""
        tok = _context._message_rank.set(mrank)
        # keyed by its token, unique while the call runs (two calls may carry one call id)
        self.running[id(tok)] = (method, call_id, raddr, t0)
        if self.markers:
            # this thread's or task's call: another running at once in this proc keeps its own
            # (a message with no call id tags its output with none)
            begin_call(call_id)
        return tok

    def _end_call(self, method: str, t0: float, status: int, tok: Any, call_id: str) -> int:
        """The call's accounting (busy time, count, span) and the state _begin_call set, undone;
        the reply's status: PRINTED for an OK call that printed."""
        t1 = time.perf_counter()
        ok = status == _OK
        self.busy_s += t1 - t0
        self.calls += 1
        keys = self._ok_keys if ok else self._err_keys
        k = keys.get(method)
        if k is None:
            if len(keys) > 1024:
                keys.clear()
            # made on this actor's thread, the one every call of it ends on
            k = keys[method] = spans.call_key(self.instance_info.name, method, self.instance_info.rank.rank, ok)
        spans.record(k, t0, t1)
        if self.markers and self._flush_out(call_id) and ok:
            status = _PRINTED
        self.running.pop(id(tok), None)
        _context._message_rank.reset(tok)
        return status

    def _call_sync(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        prep = self._prepare(meta, body, buffers)
        if prep is None:
            return
        fn, args, kwargs, raddr, rport, index, mrank, call_id, method = prep
        t0 = time.perf_counter()
        tok = self._begin_call(mrank, method, call_id, raddr, t0)
        status = _ERROR
        try:
            try:
                is_coro = self._is_coro[fn]
            except KeyError:
                is_coro = self._is_coro[fn] = inspect.iscoroutinefunction(fn)
            except TypeError:  # an unhashable callable
                is_coro = inspect.iscoroutinefunction(fn)
            if is_coro:
                # only as_endpoint reaches one: a sync actor's own endpoints are all `def`
                raise TypeError(
                    f"{self.instance_info.name}.{method} is an async def method, but its actor's endpoints are all def, "
                    "so it has no event loop to run on"
                )
            result = fn(self.obj, *args, **kwargs)
            status = _OK
        except Exception as e:
            if _pdb._debugged.get() is not None:  # this thread's calls stopped at a breakpoint
                _pdb.post_mortem(self.running.get(id(tok)), e)
            if not raddr:
                # nobody receives it (a broadcast, an explicit port): as in Monarch, the actor fails
                raise _ActorFailed(e, _caller(meta)) from None
            result, status = self._call_error(e, method), _ERROR
        except BaseException as e:
            # SystemExit, KeyboardInterrupt, ...: the actor fails, its process lives on
            raise _ActorFailed(e, _caller(meta)) from None
        finally:
            status = self._end_call(method, t0, status, tok, call_id)
        if self.stopping:
            # stopped while it ran: its caller gets no result, as in Monarch
            self._refuse(("call", meta))
            return
        if self.abort_reason is not None and not raddr:
            # aborted in an endpoint with an explicit port: a caller it never answered hears of
            # the failure, as in Monarch (an answered one ignores the late error)
            raise _Aborted(self.abort_reason, _caller(meta))
        if self._claim is not None:
            # read the connection here again before the caller can answer the reply: a call it
            # sends at once must not find the I/O thread watching, which would take it back
            # (its answer stands until this thread changes the claim: the loop takes back only a busy one)
            self._idled = self._claim.idle()
        self._reply(raddr, rport, index, status, result, method)

    async def _call_async(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        aw = _arg_waits
        aw.on = True
        try:
            prep = self._prepare(meta, body, buffers)
        finally:
            aw.on = False
        if aw.waits:
            waits, aw.waits = aw.waits, []
            if prep is not None and not await self._wait_for_arguments(meta, waits):
                return
        if prep is None:
            return
        fn, args, kwargs, raddr, rport, index, mrank, call_id, method = prep
        t0 = time.perf_counter()
        tok = self._begin_call(mrank, method, call_id, raddr, t0)
        status = _ERROR
        failure: _ActorFailed | None = None
        try:
            result = fn(self.obj, *args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            status = _OK
        except Exception as e:
            if _pdb._debugged.get() is not None:  # this task's call stopped at a breakpoint
                _pdb.post_mortem(self.running.get(id(tok)), e)
            if not raddr:
                failure = _ActorFailed(e, _caller(meta))
            result, status = self._call_error(e, method), _ERROR
        except asyncio.CancelledError as e:
            if self.stopping:
                # stop() cancelled it: its caller gets no result, as in Monarch
                self._refuse(("call", meta))
                raise
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this loop's own task was cancelled, not by the endpoint
            # the endpoint raised it (or awaited something cancelled): its error, as any other's,
            # and the actor serves on. (Monarch's actor loop ends there, and every later call hangs)
            if not raddr:
                failure = _ActorFailed(e, _caller(meta))
            result, status = self._call_error(e, method), _ERROR
        except BaseException as e:
            failure = _ActorFailed(e, _caller(meta))
            result, status = None, _ERROR
        finally:
            status = self._end_call(method, t0, status, tok, call_id)
        if failure is None and self.abort_reason is not None:
            self._reply(raddr, rport, index, status, result, method)
            # an explicit port's caller (raddr cleared) may never have been answered: tell it
            failure = _Aborted(self.abort_reason, None if raddr else _caller(meta))
        if failure is not None:
            await self._fail_async(failure)
            return
        if self.stopping:
            self._refuse(("call", meta))
            return
        if self._claim is not None and self._handling:
            self._claim_to_loop()
        self._reply(raddr, rport, index, status, result, method)

    async def _wait_for_arguments(self, meta: tuple[Any, ...], waits: list[Any]) -> bool:
        """Run the arguments' waits in a thread (see :func:`wait_for_argument`); False when one
        failed, and the caller has its error, as for any argument that cannot be unpickled."""
        loop = asyncio.get_running_loop()
        try:
            for w in waits:
                await loop.run_in_executor(None, w)
        except asyncio.CancelledError:
            if self.stopping:
                self._refuse(("call", meta))
            raise
        except Exception as e:
            self._arguments_failed(meta, e)
            return False
        return True

    def _arguments_failed(self, meta: tuple[Any, ...], e: BaseException) -> None:
        """Answer call ``meta`` with the error that its arguments could not be had."""
        _, method, raddr, rport, index = meta[:5]
        # under Monarch's headline for a failed call, as 0.7.0 raises it (a return value that
        # cannot be pickled reads the same way)
        detail = f"unpickling its arguments failed: {type(e).__name__}: {safe_str(e)}"
        self._reply(raddr, rport, index, wire.ERROR, self._call_error(e, method, detail))

    async def _fail_async(self, f: _ActorFailed) -> None:
        if self.failed is not None:
            return
        self._fail(f)
        # in Monarch a SystemExit or KeyboardInterrupt ends an async actor's loop before its
        # __cleanup__ can run
        if not isinstance(f.error, (SystemExit, KeyboardInterrupt)):
            await self._cleanup_async(f.cleanup_exc)

    def _cleanup_sync(self, exc: Exception | None = None, stopping: bool = False) -> None:
        fn = getattr(self.obj, "__cleanup__", None)
        if fn is not None:
            try:
                fn(exc)
            except BaseException as e:
                # a SystemExit too: Monarch reports it as any cleanup error, and the proc lives on
                logger.exception("__cleanup__ of %s raised", self.name)
                if stopping:
                    self._cleanup_failed(e)

    async def _cleanup_async(self, exc: Exception | None = None, stopping: bool = False) -> None:
        fn = getattr(self.obj, "__cleanup__", None)
        if fn is not None:
            try:
                r = fn(exc)
                if inspect.isawaitable(r):
                    await r
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                logger.exception("__cleanup__ of %s raised", self.name)
                if stopping:
                    self._cleanup_failed(e)

    def _cleanup_failed(self, e: BaseException) -> None:
        """``__cleanup__`` raised ``e`` as this actor stopped. As in Monarch 0.7.0 that is a
        failure of the actor (``cleanup error: ValueError: …``) its owner hears of: the client's
        fault hook at a proc mesh's stop, or when the actor stopped itself; later calls to its
        mesh fail with it. Not at its actor mesh's own stop: Monarch's owner is no longer
        listening there, and its hook hears nothing. (After a failure, already reported,
        ``__cleanup__``'s error is only logged, as there.)"""
        if not getattr(self, "_stop_tells_owner", False) or self.failed is not None:
            return
        self.failed = f"cleanup error: {type(e).__name__}: {safe_str(e)}"
        self._note_failure(self.failed)
        self._tell_owner(self.failed)


class _ActorFailed(Exception):
    """An actor's failure, raised out of the message that caused it to its loop."""

    def __init__(
        self,
        error: BaseException | None,
        caller: tuple[str, int, int, str] | None,
        reason: str = "",
        *,
        actor: str = "",
        event: str = "",
    ) -> None:
        super().__init__(reason)
        self.error = error
        #: the actor later calls name as failed (default: this one) and the supervision event's text
        self.actor = actor
        self.event = event
        #: who waits for the message that failed: (address, port, index, method)
        self.caller = caller
        self.reason = reason or "actor explicitly aborted due to: " + format_exception(error)  # type: ignore[arg-type]
        self.cleanup_exc: Exception | None = None


class _Aborted(_ActorFailed):
    def __init__(self, reason: str, caller: tuple[str, int, int, str] | None = None) -> None:
        super().__init__(None, caller, f"actor explicitly aborted due to: {reason}")


def _caller(meta: tuple[Any, ...]) -> tuple[str, int, int, str] | None:
    return (meta[2], meta[3], meta[4], meta[1]) if meta[2] else None


#: what a proc that had an actor failure answers a spawn with (Monarch's words)
SPAWN_REFUSED = "Cannot spawn new actors on mesh with supervision events"


class ActorHost:
    """The ``__sys__`` system actor every process runs: spawns and stops actors, answers pings."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.shutdown_requested = threading.Event()
        # work that must run on the proc's main thread (``%%mesh exec`` cells), so that an
        # interrupt is a real SIGINT: it breaks blocking calls such as time.sleep, as in a kernel
        self._main_jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._main_busy = False
        #: get_or_spawn_controller's singletons (in the root controller): name -> waiters, result
        self._controllers: dict[str, dict[str, Any]] = {}
        #: the actors that failed in this proc, ``(name, reason)``: Monarch's supervision events,
        #: kept for good (a proc that had one refuses new spawns; the dashboard shows it failed)
        self.actor_failures: list[tuple[str, str]] = []

    def run_on_main(self, fn: Any) -> Any:
        """Run ``fn()`` on this proc's main thread and return its result (raises what it raises)."""
        done = threading.Event()
        box: list[Any] = [None, None]
        self._main_jobs.put((fn, box, done))
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def main_loop(self) -> None:
        """The proc's main thread: run main-thread jobs until shutdown."""
        import signal

        def on_sigint(signum: int, frame: Any) -> None:
            # only interrupt user code; a stray SIGINT must not kill an idle proc
            if self._main_busy:
                raise KeyboardInterrupt

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_sigint)
        while True:
            try:
                job = self._main_jobs.get()
            except KeyboardInterrupt:  # a late interrupt after the job it was meant for
                continue
            if job is None:
                return
            fn, box, done = job
            try:
                self._main_busy = True
                try:
                    box[0] = fn()
                finally:
                    self._main_busy = False
            except BaseException as e:
                box[1] = e
            done.set()

    def sys_interrupt(self) -> bool:
        """Interrupt code running on the main thread (a kernel interrupt reaching ``%%mesh exec``)."""
        import signal

        if not self._main_busy:
            return False
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return True

    @system_method(wants_reply=True)
    def sys_spawn_actor(
        self,
        name: str,
        cls: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extent: tuple[list[str], list[int]],
        proc_mesh: Any,
        creator: str,
        *,
        parent: _context.CreatorInstance | None = None,
        controllers: Any = None,
        label: str | None = None,
        supervisor_port: int | None = None,
        _reply: tuple[str, int, int],
    ) -> Any:
        rank = _reply[2]  # one message serves every proc; each one's index in the mesh is its rank
        if self.actor_failures and not (name.startswith("__") and name.endswith("__")):
            # as Monarch's procs; monarch_nb's own per-proc actors (``%%mesh exec``) still come,
            # so a failed proc can be looked into
            failed, why = self.actor_failures[0]
            lines = [ln.strip() for ln in why.strip().splitlines() if ln.strip()]
            # a traceback's last line is the error itself
            raise RuntimeError(f"{SPAWN_REFUSED}: actor {failed!r} failed here: {lines[-1] if lines else 'no reason given'}")
        if name in self.rt.actors:
            raise ValueError(f"an actor named {name!r} already exists in this proc; pick another name")
        info = Instance(name, cls, Point(rank, Extent(*extent)), proc_mesh, creator, parent, controllers)
        if label is not None:
            # the name the program gave (``name`` may carry a suffix: ProcMesh._unique_actor_name)
            info.name = label
        slot = ActorSlot(self.rt, name, cls, info)
        if supervisor_port is not None:
            # the spawner hears of this actor's failure on a port of its own, at the address it
            # gave for the spawn's reply
            slot.supervisor = (_reply[0], supervisor_port)
        self.rt.actors[name] = slot
        # constructed in the background: spawn returns at once, as Monarch's
        slot._put(("init", args, kwargs, _reply, False))
        return None

    @system_method(wants_reply=True)
    def sys_get_or_spawn_controller(
        self, name: str, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], creator: str, *, _reply: tuple[str, int, int]
    ) -> Any:
        """The job's singleton actor ``name`` in this (the root controller's) process: spawned by
        the first request, every request answered once it is constructed (or failed to be).

        Runs on the I/O thread and never blocks it: the constructor runs on the new actor's
        thread and its reply comes back to a port here, which answers everyone waiting.
        """
        entry = self._controllers.get(name)
        if entry is None:
            if name in self.rt.actors:
                raise ValueError(f"an actor named {name!r} already exists in this proc; pick another controller name")
            entry = self._controllers[name] = {"waiters": [_reply], "result": None}
            port = 0

            def constructed(index: int, status: int, body: Any, bufs: list[Any]) -> None:
                self.rt.close_port(port)
                entry["result"] = (status, loads(body, bufs))
                for w in entry["waiters"]:
                    self.rt.send_port(w[0], w[1], w[2], *entry["result"])
                entry["waiters"] = []

            port = self.rt.open_port(constructed)
            from ._mesh import this_proc

            me = _context.controllers_proc()
            info = Instance(name, cls, Point(0, Extent([], [])), this_proc(), creator, _context.ROOT, me)
            slot = ActorSlot(self.rt, name, cls, info)
            self.rt.actors[name] = slot
            slot._put(("init", args, kwargs, (self.rt.ipc_addr, port, 0)))
        elif entry["result"] is None:
            entry["waiters"].append(_reply)
        else:
            self.rt.send_port(_reply[0], _reply[1], _reply[2], *entry["result"])
        return NO_REPLY

    @system_method(wants_reply=True)
    def sys_stop_actor(self, name: str, because: str = "", *, _reply: tuple[str, int, int]) -> Any:
        """Stop actor ``name``; answered once its ``__cleanup__`` has finished. ``because``: what
        a message for it says from now on (see ``ActorMesh._stop``)."""
        slot = self.rt.actors.pop(name, None)
        if slot is None:
            return False
        if because:
            slot.stop_because = because  # type: ignore[attr-defined]
            self.rt.receiver.stopped_because[name] = because

        def done() -> None:
            if _reply[0]:
                self.rt.send_port(_reply[0], _reply[1], _reply[2], wire.OK, True)

        # its actor mesh's own stop: Monarch's hook hears nothing of a __cleanup__ that raises
        slot.stop(done, tell_owner=False)  # type: ignore[attr-defined]
        return NO_REPLY

    def sys_ping(self) -> str:
        return "pong"

    def sys_set_log_level(self, level: int) -> None:
        """``ProcMesh.logging_option(level=)``: this process's root logger level."""
        import logging

        root = logging.getLogger()
        if not root.handlers:
            # without a handler only warnings and worse would show (logging's last resort)
            logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
        root.setLevel(level)

    @system_method(wants_reply=True)
    def sys_reload(
        self, root: str, changed: list[str], mode: str = "inplace", local: str = "", *, _reply: tuple[str, int, int]
    ) -> Any:
        """Reload synced modules that changed (on a thread of its own: imports may be slow)."""

        def run() -> None:
            from ._reload import reload_changed

            try:
                value: Any = reload_changed(self.rt, root, changed, mode, local)
                status = wire.OK
            except BaseException as e:
                value, status = ActorError(_safe_exc(e), format_exception(e), message=f"reload failed: {safe_str(e)}"), wire.ERROR
            self.rt.send_port(_reply[0], _reply[1], _reply[2], status, value)

        threading.Thread(target=run, name="monarch_nb-reload", daemon=True).start()
        return NO_REPLY

    def sys_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n, s in list(self.rt.actors.items()):
            busy = getattr(s, "busy", [])
            out[n] = {
                "busy": busy,
                "async": getattr(s, "is_async", False),
                "calls": getattr(s, "calls", 0),
                "busy_s": getattr(s, "busy_s", 0.0),
                # read only behind a running call: an idle actor's mailbox is empty but for a moment
                "queued": _queued_calls(s) if busy else 0,
            }
        if self.actor_failures:  # the dashboard shows this proc's rank failed
            out["__failures__"] = {"actors": [{"actor": a, "reason": r} for a, r in self.actor_failures]}
        moved = _dataplane.counters()
        if moved is not None:  # bytes moved through RDMABuffers, for the dashboard
            out["__dataplane__"] = moved
        out["__spans__"] = spans.version()  # the allocator drains this proc's spans when it moves
        return out

    def sys_shutdown(self) -> Any:
        self.shutdown_requested.set()
        self._main_jobs.put(None)
        _pdb.quit_sessions()  # an actor paused at a breakpoint would hold the stop until it is killed
        return NO_REPLY

    def cleanup_all(self, timeout: float = 5.0) -> None:
        slots = list(self.rt.actors.values())
        for s in slots:
            # the proc is going: what its actors spawned goes with its own procs
            s.stop(owned=False)  # type: ignore[attr-defined]
        for s in slots:
            s.thread.join(timeout)  # type: ignore[attr-defined]
        # the actors go before the interpreter does, so their __del__ runs as in Monarch
        for s in slots:
            s.obj = None  # type: ignore[attr-defined]
        self.rt.actors.clear()


def _queued_calls(slot: Any) -> int:
    try:
        return sum(1 for i in slot.queued() if i and i[0] == "call")
    except Exception:  # the status of the other actors matters more than this count
        logger.debug("reading the mailbox of %s", getattr(slot, "name", slot), exc_info=True)
        return 0


def ensure_actor_host(rt: Runtime) -> ActorHost:
    host = rt.system.get("__sys__")
    if host is None:
        host = rt.system["__sys__"] = ActorHost(rt)
    return host
