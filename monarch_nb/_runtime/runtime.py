"""The per-process runtime: one I/O thread and the parts that do its work.

Every process (controller, allocator, proc) runs one :class:`Runtime`. It owns the I/O
thread and its event loop, and puts together four parts, each its own object and module:

* ``transport`` (:mod:`.transport`): the sockets, bytes in and out;
* ``sender`` (:mod:`.sending`): encoding, ordered streams, fan-out through allocators;
* ``receiver`` (:mod:`.receiving`): ports, actors, system actors, fan-out relay, with the
  per-sender stream ordering of :mod:`.ordering`;
* ``supervision`` (:mod:`.supervision`): who owes which reply, who is dead, heartbeats.

The parts' entry points are the runtime's own attributes (``rt.send`` is ``rt.sender.send``),
so callers need not know which part does what, at no cost on the hot path.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

try:
    # imported here, not when a loop is made: the zygote imports this module before it forks,
    # so a proc does not pay the 2-3 ms of importing it on the way to its first call
    import uvloop
except ImportError:  # not installed (optional on platforms without wheels)
    uvloop = None  # type: ignore[assignment]

from ..config import Config
from ._pids import pid_alive
from .receiving import NO_REPLY, REFUSED, Mailbox, PortHandler, Receiver, system_method
from .sending import Sender, Target
from .spans import SpanSource
from .supervision import Supervision
from .transport import Security, Transport

__all__ = ["NO_REPLY", "REFUSED", "Mailbox", "PortHandler", "ReplyPort", "Runtime", "Target", "pid_alive", "system_method"]


#: seconds between the watch loop's sweeps while it has no heartbeat to send and no held
#: message to look at (see Runtime._watch_loop)
IDLE_WATCH_S = 2.0


def new_loop(fast: bool = True) -> asyncio.AbstractEventLoop:
    """An event loop for an I/O or actor thread: uvloop's where it is installed and ``fast``.

    libuv's loop costs less per wake-up than asyncio's selector loop (A/B against asyncio's:
    ``call_one`` 0.85-0.96x, ``call`` to 16 0.84x). The allocator keeps asyncio's: its log
    batching runs on sub-millisecond timers, which libuv rounds to whole milliseconds
    (``logs_10000`` read 1.47x with uvloop there)."""
    if fast and uvloop is not None:
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Runtime:
    """I/O for one process. Create with :meth:`start`; all methods are thread-safe."""

    def __init__(
        self,
        cfg: Config,
        security: Security,
        runtime_dir: str,
        *,
        tcp_ip: str | None = None,
        tcp_port: int = 0,
        label: str = "proc",
    ) -> None:
        self.security = security
        self.runtime_dir = runtime_dir
        self.label = label
        self.uid = secrets.token_hex(6)
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.loop = new_loop(fast=label != "allocator")
        self._thread = threading.Thread(target=self._run_loop, name=f"monarch_nb-io-{label}", daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: what the watch loop awaits between ticks (see _watch_loop)
        self._watch_fut: asyncio.Future[None] | None = None
        self.transport = Transport(
            cfg,
            security,
            runtime_dir,
            self.loop,
            name=f"mnb-{self.uid}",
            label=label,
            spawn=self._spawn,
            tcp_ip=tcp_ip,
            tcp_port=tcp_port,
        )
        self.supervision = Supervision(cfg, self, own_id=self.uid)
        self.sender = Sender(
            cfg,
            self.transport.send,
            self.supervision.dead,
            uid=self.uid,
            hostname=self.hostname,
            direct_conns=self.transport.direct_conns,
        )
        self.receiver = Receiver(cfg, self.sender, label=label, hostname=self.hostname, pid=self.pid, spawn=self._spawn)
        if label not in ("allocator", "controller"):
            # a proc's idle sync actors read their calls off the caller's connection themselves
            self.receiver.claim = self.transport.claim
        elif label == "controller":
            # and a controller's callers blocked on one actor's reply read it themselves
            self.receiver.claim_reply = functools.partial(self.transport.claim, True)
        self._cfg = cfg
        # the parts' entry points as the runtime's own: bound methods, so no extra call per use
        t, s, r, v = self.transport, self.sender, self.receiver, self.supervision
        self.ensure_tcp, self.addr_for = t.ensure_tcp, t.addr_for
        self.send, self.send_port, self.send_actor, self.send_many = s.send, s.send_port, s.send_actor, s.send_many
        self.check_size, self.next_call_id, self.release_shm = s.check_size, s.next_call_id, s.release_shm
        self.open_port, self.close_port = r.open_port, r.close_port
        self.actors, self.system, self.relayed = r.actors, r.system, r.relayed
        # every process's spans, drained by its allocator (spans.py)
        self.system["__spans__"] = SpanSource()
        self.watch, self.heard_from = v.watch, v.heard_from
        self.peer_error, self.peer_failed = v.peer_error, v.peer_failed
        self.peer_failure_callbacks, self.event_callbacks = v.peer_failure_callbacks, v.event_callbacks

    @property
    def cfg(self) -> Config:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:
        # every part reads the same configuration
        self._cfg = self.transport.cfg = self.sender.cfg = self.receiver.cfg = self.supervision.cfg = cfg

    @property
    def ipc_addr(self) -> str:
        return self.transport.ipc_addr

    @property
    def tcp_addr(self) -> str:
        return self.transport.tcp_addr

    @property
    def ctx(self) -> Any:
        return self.transport.ctx

    @property
    def sockets(self) -> Any:
        return self.transport.sockets

    @property
    def resolve_proc(self) -> Callable[[str], str | None] | None:
        return self.receiver.resolve_proc

    @resolve_proc.setter
    def resolve_proc(self, fn: Callable[[str], str | None] | None) -> None:
        self.receiver.resolve_proc = fn

    @property
    def dropped_frames(self) -> int:
        """Messages and connections refused (malformed, foreign, replayed, unauthenticated)."""
        return self.transport.dropped + self.receiver.dropped

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> Runtime:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread.start()
        self.loop.call_soon_threadsafe(self._open, ready)
        ready.result(timeout=30)
        _running.add(self)
        return self

    def _run_loop(self) -> None:
        self.transport.io_ident = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _open(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            self.transport.open(self.receiver.dispatch)
            self._spawn(self._watch_loop())
            ready.set_result(None)
        except BaseException as e:
            ready.set_exception(e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_loop(5.0, close_inboxes=True)
        self.transport.close_connections()
        self.sender.release_shm()
        self.transport.terminate()

    # ---------------------------------------------------------------- the I/O loop

    def halt(self, timeout: float = 2.0) -> None:
        """Stop the I/O thread (its tasks cancelled, its loop stopped) and leave the sockets
        open: for a process about to exit. Its interpreter must not finalize under a loop still
        running in a daemon thread: uvloop's callbacks then run into a half torn-down
        interpreter (SIGSEGV at exit). :meth:`close` would close the sockets too, which libzmq
        does not take from an exit handler (an abort in its epoll.cpp)."""
        if not self._closed:
            self._closed = True
            self._stop_loop(timeout, close_inboxes=False)

    def _stop_loop(self, timeout: float, close_inboxes: bool) -> None:
        if not self._thread.is_alive():
            return
        done = threading.Event()

        def stop() -> None:
            for t in list(self._tasks):
                t.cancel()
            if close_inboxes:
                self.transport.close_inboxes()

            def end() -> None:
                self.loop.stop()
                done.set()

            # one more turn of the loop lets the cancelled tasks finish (no "destroyed but pending")
            self.loop.call_soon(end)

        self.loop.call_soon_threadsafe(stop)
        done.wait(timeout)
        self._thread.join(timeout)

    def in_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        # the set holds strong references: the loop keeps only weak ones to tasks
        t = self.loop.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the I/O loop (from any thread), owned by the runtime."""
        if self.in_io_thread():
            self._spawn(coro)
        else:
            self.loop.call_soon_threadsafe(self._spawn, coro)

    async def _watch_loop(self) -> None:
        # Heartbeats are due every heartbeat_interval while an allocator is watched, and held
        # messages are looked at as often; the sweeps have timeouts of seconds to minutes
        # (shm.POOL_IDLE_S, peer_idle_close). An idle proc or allocator watches nobody: it
        # wakes every IDLE_WATCH_S, not twice a second, until a watch or a held message wakes
        # it (each wake-up is CPU its host's training does not get, and the GIL for a moment)
        self.supervision.on_watch = self._wake_watch_now
        self.receiver.order.on_gap = self._wake_watch
        loop = self.loop
        woke = time.monotonic()
        while True:
            cfg = self.cfg
            interval = cfg.heartbeat_interval
            if not self.supervision.pinging() and not self.receiver.order.holding():
                interval = max(interval, min(IDLE_WATCH_S, cfg.peer_idle_close / 4))
            self._watch_fut = loop.create_future()
            try:
                await sleep_to_tick(loop, interval, self._watch_fut)
            finally:
                self._watch_fut = None
            self.sender.sweep_shm()
            now = time.monotonic()
            self.transport.sweep_idle(now)
            self.receiver.skip_gaps(now)
            # when this loop itself was starved (a busy I/O thread, a loaded machine), pongs that
            # did arrive may not have been read yet: that is no evidence against the peer
            starved = now - woke > interval + max(0.25, interval)
            woke = now
            self.supervision.check(now, starved)

    def _wake_watch_now(self) -> None:
        # on the I/O thread
        fut = self._watch_fut
        if fut is not None:
            _wake(fut)

    def _wake_watch(self) -> None:
        if self.in_io_thread():
            self._wake_watch_now()
        else:
            self.loop.call_soon_threadsafe(self._wake_watch_now)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_TICK_SLACK = 0.002


def next_tick(loop: asyncio.AbstractEventLoop, period: float) -> float:
    """The loop time of the next multiple of ``period``. A process's periodic tasks that wait
    for their ticks on this one grid (the allocator's watch loop, reaper and telemetry, at
    multiples of half a second) run in one wake-up of its I/O thread, not one each."""
    # libuv counts whole milliseconds: a timer may run up to one early, and the grid point
    # it was set for must not be taken for the next one (it would run again at once)
    t = loop.time() + _TICK_SLACK
    return t + period - t % period


async def sleep_to_tick(loop: asyncio.AbstractEventLoop, period: float, fut: asyncio.Future[None] | None = None) -> None:
    """Sleep until :func:`next_tick` (at most ``period``), or until ``fut`` is done first (the
    watch loop's, which a new watch or a held message wakes)."""
    if fut is None:
        fut = loop.create_future()
    timer = loop.call_at(next_tick(loop, period), _wake, fut)
    try:
        await fut
    finally:
        timer.cancel()


class ReplyPort:
    """A port for the replies to one request, and supervision of the peers that owe them.

    Opening it opens a port on ``rt`` whose replies go to ``on_reply``. :meth:`owe` says which
    peer owes the reply of an index (watched through its allocator, if any; ``on_fail(index,
    error)`` runs if it dies, at once if it is dead already), :meth:`answered` that a reply
    came, and :meth:`close`, once no more are wanted, closes the port and forgets what is still
    owed (a failed send, peers never heard from). Closing twice is harmless.

    Supervision holds one record for the whole port, not one per peer: a call to many actors
    costs a dict entry per peer here, and a peer's failure is matched against what each open
    port is owed (failures are rare, replies are not). Each index fails at most once.
    """

    __slots__ = ("rt", "port", "_owed", "on_fail", "_fail_one")

    def __init__(self, rt: Runtime, on_reply: PortHandler, on_fail: Callable[[int, BaseException], None] | None = None) -> None:
        self.rt = rt
        #: index -> the peer that owes its reply
        self._owed: dict[int, str] = {}
        self.on_fail = on_fail
        #: index -> its own failure callback (owe() given one)
        self._fail_one: dict[int, Callable[[BaseException], None]] | None = None
        self.port = rt.open_port(on_reply)
        rt.supervision.wait(self.port, self._peer_failed)

    def owe(
        self,
        index: int,
        peer: str,
        on_fail: Callable[[BaseException], None] | None = None,
        alloc: str = "",
        mesh: str = "",
        rank: int = 0,
        host: str = "",
    ) -> None:
        """``peer`` owes the reply of ``index``; ``alloc``: the allocator that owns it, to watch.
        ``on_fail(error)``: this index's own failure callback instead of the port's."""
        if alloc:
            self.rt.watch(alloc, peer, mesh, rank, host)
        if on_fail is not None:
            if self._fail_one is None:
                self._fail_one = {}
            self._fail_one[index] = on_fail
        self._owed[index] = peer
        # after noting it: a peer failing from here on is matched by _peer_failed
        dead = self.rt.supervision.dead.get(peer)
        if dead is not None:
            self.fail(index, dead)

    def owe_procs(self, idx: Iterable[int], procs: Iterable[Any]) -> None:
        """:meth:`owe` for a call to many procs, failing through the port's own callback:
        ``procs`` (objects with ``addr``, ``alloc``, ``mesh``, ``rank``, ``host``) owe the
        replies of ``idx``, in order. ``idx`` is read twice."""
        owed = self._owed
        sup = self.rt.supervision
        watched, watch = sup.watched, sup.watch
        for i, p in zip(idx, procs):
            addr = owed[i] = p.addr
            if addr not in watched and p.alloc:
                watch(p.alloc, addr, p.mesh, p.rank, p.host)
        dead = sup.dead
        if dead:  # after noting them all: a peer failing from here on is matched by _peer_failed
            for i, p in zip(idx, procs):
                err = dead.get(p.addr)
                if err is not None:
                    self.fail(i, err)

    def fail(self, index: int, err: BaseException) -> None:
        """The reply of ``index`` will not come (its peer is gone, its send failed): tell the
        failure callback, once, unless the reply came first."""
        if self._owed.pop(index, None) is None:
            return
        one = self._fail_one.pop(index, None) if self._fail_one is not None else None
        if one is not None:
            one(err)
        elif self.on_fail is not None:
            self.on_fail(index, err)

    def _peer_failed(self, peer: str, err: BaseException) -> None:
        owed = self._owed
        if owed:
            for index in [i for i, p in list(owed.items()) if p == peer]:
                self.fail(index, err)

    def answered(self, index: int) -> None:
        self._owed.pop(index, None)

    def close(self) -> None:
        self.rt.close_port(self.port)
        self.rt.supervision.unwait(self.port)
        self._owed = {}
        # the callbacks are closures that hold this port (and the call's replies): without them
        # the call's memory goes back at once, not at the next cyclic collection
        self.on_fail = self._fail_one = None


#: runtimes whose I/O thread may still run when the interpreter exits
_running: weakref.WeakSet[Runtime] = weakref.WeakSet()


@atexit.register
def _halt_all() -> None:
    # a process that used a runtime without a Client (which halts its own at exit) would
    # otherwise finalize under a uvloop timer firing in the daemon I/O thread: SIGSEGV at exit
    for rt in list(_running):
        rt.halt()
