"""Supervision: which peers are gone, and failing whatever they owed.

A process that waits for replies registers the port they come to (:meth:`Supervision.wait`;
a :class:`~.runtime.ReplyPort` knows which peer owes which reply); a peer that dies is
reported to every such port at once (:meth:`Supervision.peer_failed`), which fails what that
peer owed it, and is refused from then on. Procs are watched through the allocator that owns them: :class:`Supervision`
subscribes to each such allocator's events (a proc exited), pings it every heartbeat, and
declares it and all its procs lost when it goes silent for ``heartbeat_timeout``.

Its I/O (a port for events, a ping) goes through ``io``, any object with the four methods
of :class:`SupervisionIO` (the runtime in practice); time comes from ``clock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from ..config import Config
from ..errors import SupervisionError
from ._pids import SLOW_FACTOR, SilentPeer, pid_alive

logger = logging.getLogger(__name__)


class SupervisionIO(Protocol):
    def open_port(self, handler: Callable[[int, int, Any, list[Any]], None]) -> int: ...

    def send_actor(
        self, addr: str, actor: str, method: str, body: bytes, buffers: list[Any], *, reply: tuple[str, int]
    ) -> None: ...

    def addr_for(self, peer: str) -> str: ...

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None: ...


class Watch:
    """What this process knows about one allocator whose procs it talks to."""

    def __init__(self, addr: str, now: float) -> None:
        self.addr = addr
        self.procs: dict[str, tuple[str, int, str]] = {}  # proc addr -> (mesh, rank, host)
        self.last_pong = now
        self.lost: SupervisionError | None = None
        self.host = ""
        #: the port its events come to (0 until subscribed)
        self.event_port = 0
        #: its process, when it runs on this host (reached over ipc)
        self.local: SilentPeer | None = None
        #: it said it was shutting down (``lost`` is why), rather than going silent
        self.shut_down = False
        #: ``lost`` because it went silent: a new hello may get no answer for heartbeat_timeout
        self.silent = False


class Supervision:
    """Ports waiting for replies, known-dead peers, and the allocators watched; thread-safe."""

    def __init__(self, cfg: Config, io: SupervisionIO, clock: Callable[[], float] = time.monotonic, own_id: str = "") -> None:
        self.cfg = cfg
        self.io = io
        self._clock = clock
        self._lock = threading.Lock()
        #: key -> told ``(peer, error)`` of every peer that fails while registered: one record for a
        #: whole call to many peers (a :class:`~.runtime.ReplyPort`) instead of one per peer
        self._waiters: dict[int, Callable[[str, SupervisionError], None]] = {}
        #: peer address -> why it is gone (read lock-free by the sender)
        self.dead: dict[str, SupervisionError] = {}
        #: allocator address -> what we know of it
        self.watches: dict[str, Watch] = {}
        #: every proc address :meth:`watch` was told of (read lock-free: a call to many actors
        #: skips the call for procs it already watches)
        self.watched: set[str] = set()
        self.peer_failure_callbacks: list[Callable[[str, SupervisionError], None]] = []
        #: called on the I/O thread with every other event an allocator publishes (e.g. debug sessions)
        self.event_callbacks: list[Callable[[tuple[Any, ...]], None]] = []
        self._ping = dumps(((), {}))
        #: this process's id as its allocators know it (its runtime's uid, a controller's cid)
        self.own_id = own_id
        #: (a proc's) the addresses of the allocator that owns this process: its shutdown is
        #: this process's own end, which that allocator tells its controllers, not news to log
        self.home: set[str] = set()
        #: told (on the I/O thread) when an allocator is watched from now on: heartbeats are
        #: due every ``heartbeat_interval`` from then, however long :meth:`check` was idle
        self.on_watch: Callable[[], None] | None = None

    def pinging(self) -> bool:
        """Whether :meth:`check` has an allocator to ping and time out."""
        return any(w.lost is None for w in self.watches.values())

    def wait(self, key: int, on_peer_failed: Callable[[str, SupervisionError], None]) -> None:
        """Tell ``on_peer_failed`` of every peer that fails until :meth:`unwait` (it checks whether
        it waits on that peer). A peer already dead is not reported: check :attr:`dead` after
        noting what a peer owes (both lock-free; a peer failing in between is reported)."""
        self._waiters[key] = on_peer_failed

    def unwait(self, key: int) -> None:
        self._waiters.pop(key, None)

    def peer_error(self, peer: str) -> SupervisionError | None:
        return self.dead.get(peer)

    def peer_failed(self, peer: str, err: SupervisionError) -> None:
        with self._lock:
            if peer in self.dead:
                return
            self.dead[peer] = err
            waiters = list(self._waiters.values())
        # the callbacks first: they decide what the failure is reported as (the client's, by the
        # meshes' state), which must be the state before any caller, failed below, acts on it
        # (stops the mesh at once, say)
        for cb in list(self.peer_failure_callbacks):
            try:
                cb(peer, err)
            except Exception:
                logger.exception("peer failure callback raised")
        for on_peer_failed in waiters:
            try:
                on_peer_failed(peer, err)
            except Exception:
                logger.exception("failure callback raised")

    def watch(self, alloc_addr: str, proc_addr: str, mesh: str, rank: int, host: str) -> None:
        """Supervise ``proc_addr`` through the allocator that owns it."""
        w = self.watches.get(alloc_addr)
        if w is not None and proc_addr in w.procs:
            return
        if w is None:
            w = self.watch_allocator(alloc_addr, host)
        w.procs[proc_addr] = (mesh, rank, host)
        self.watched.add(proc_addr)
        if w.lost is not None:
            self.peer_failed(proc_addr, self._proc_error(w, proc_addr, w.lost.cause))

    def watch_allocator(self, alloc_addr: str, host: str, pid: int = 0) -> Watch:
        """Ping and listen to the allocator at ``alloc_addr`` from now on, procs or not: an
        allocator detaches a controller that stays silent, even one waiting for its first spawn.
        ``pid``: its process, if it runs on this host (see :meth:`_busy`)."""
        w = self.watches.get(alloc_addr)
        if w is None:
            with self._lock:
                w = self.watches.get(alloc_addr)
                if w is None:
                    w = self.watches[alloc_addr] = Watch(alloc_addr, self._clock())
                    w.host = host
                    self.io.call_soon(self._subscribe, w)
        if pid:
            w.local = SilentPeer(pid)
        return w

    def lose(self, alloc_addr: str, cause: str) -> None:
        """Count the allocator at ``alloc_addr`` and its procs as gone for ``cause`` (it was
        stopped on purpose): what is pending on them fails at once, with no heartbeat alarm."""
        w = self.watches.get(alloc_addr)
        if w is None or w.lost is not None:
            return
        w.lost = SupervisionError(cause, host=w.host)
        for p in list(w.procs):
            self.peer_failed(p, self._proc_error(w, p, cause))
        self.peer_failed(alloc_addr, w.lost)

    def is_lost(self, alloc_addr: str) -> bool:
        w = self.watches.get(alloc_addr)
        return w is not None and w.lost is not None

    def lost_silent(self, alloc_addr: str) -> SupervisionError | None:
        """Its loss, when the allocator at ``alloc_addr`` was declared lost for its silence (not
        one that said it shut down or detached us, nor one stopped on purpose): a hello to it
        may wait the whole heartbeat_timeout for a host that is gone."""
        w = self.watches.get(alloc_addr)
        return w.lost if w is not None and w.silent else None

    def was_shut_down(self, alloc_addr: str) -> bool:
        """Whether the allocator at ``alloc_addr`` was lost because it said it was shutting down."""
        w = self.watches.get(alloc_addr)
        return w is not None and w.lost is not None and w.shut_down

    def local_gone(self, alloc_addr: str) -> bool:
        """Whether the allocator at ``alloc_addr`` runs on this host and its process is gone
        (known at once, before any heartbeat is missed)."""
        w = self.watches.get(alloc_addr)
        return w is not None and w.local is not None and not pid_alive(w.local.pid)

    def revive(self, alloc_addr: str) -> None:
        """The allocator at ``alloc_addr``, declared lost, answered a new hello: heartbeats and
        sends to it resume. What its loss failed stays failed (the calls, the meshes' states),
        and its procs stay refused until they are watched again (a new spawn, or an attach by
        name that finds them alive): the silence may have been a stall of a host that lived
        on, and a host that was lost once is not lost for this process's lifetime."""
        w = self.watches.get(alloc_addr)
        if w is None or w.lost is None:
            return
        with self._lock:
            cause = w.lost.cause
            for addr in [alloc_addr, *w.procs]:
                err = self.dead.get(addr)
                if err is not None and err.cause == cause:
                    del self.dead[addr]
            self.watched.difference_update(w.procs)
            w.procs.clear()
            w.lost, w.silent = None, False
            w.last_pong = self._clock()
        self.io.call_soon(self._subscribe, w)

    def _detached(self, w: Watch, why: str) -> None:
        """The allocator no longer counts us as attached (we were silent too long): what we
        wait for from it and its procs would never come, so it fails now, saying why."""
        if w.lost is not None:
            return
        cause = (
            f"allocator {w.addr} detached this controller: {why}. Its procs no longer answer to it; "
            "a new spawn or attach on that host from this controller (or a restarted kernel or script) attaches again "
            "and finds persistent meshes by name"
        )
        logger.warning("%s", cause)
        self.lose(w.addr, cause)

    def _proc_error(self, w: Watch, proc_addr: str, cause: str) -> SupervisionError:
        mesh, rank, host = w.procs.get(proc_addr, ("", None, w.host))
        return SupervisionError(cause, mesh=mesh, rank=rank, host=host)

    def _subscribe(self, w: Watch) -> None:
        def on_event(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            if status == wire.ERROR:
                return
            ev = loads(body, bufs)
            if ev[0] == "proc_exited":
                _, addr, mesh, rank, host, cause = ev
                w.procs.setdefault(addr, (mesh, rank, host))
                self.peer_failed(addr, SupervisionError(cause, mesh=mesh, rank=rank, host=host))
            elif ev[0] == "pong":
                if len(ev) > 2 and ev[1] == "detached":
                    self._detached(w, str(ev[2]))
                else:
                    w.last_pong = self._clock()
            elif ev[0] == "shutdown":
                # stopped on purpose: fail what waits on it with the reason instead of a heartbeat
                # alarm later. Asked by this process (HostMesh.shutdown), its meshes there were
                # stopped, not failed; asked by anyone else, say so once where it touches ours
                cause = str(ev[1])
                if self.own_id and len(ev) > 2 and ev[2] == self.own_id:
                    cause += " (mesh stopped)"
                elif w.procs and w.lost is None and w.addr not in self.home:
                    logger.warning("%s", cause)
                w.shut_down = w.shut_down or w.lost is None
                self.lose(w.addr, cause)
            else:
                for cb in self.event_callbacks:
                    try:
                        cb(ev)
                    except Exception:
                        logger.exception("allocator event callback raised")

        if not w.event_port:  # a revived allocator's events come to the port they came to before
            w.event_port = self.io.open_port(on_event)
        if self.on_watch is not None:
            self.on_watch()
        body, bufs = dumps(((), {}))
        try:
            self.io.send_actor(w.addr, "__allocator__", "subscribe", body, bufs, reply=(self.io.addr_for(w.addr), w.event_port))
        except Exception as e:
            logger.warning("could not subscribe to allocator %s: %s", w.addr, e)

    def _busy(self, local: SilentPeer, w: Watch, silent: float) -> bool:
        """Whether an allocator of this host whose pong is late is still at work
        (:class:`~._pids.SilentPeer`). Stopping 128 procs on two cores, or a build beside a
        notebook, starves an allocator past the heartbeat timeout, and calling it lost then
        fails every mesh it has. Up to ``SLOW_FACTOR`` timeouts; one stopped (SIGSTOP), gone,
        or asleep with no CPU spent (hung) is lost after one, as any other."""
        timeout = self.cfg.heartbeat_timeout
        if not local.excused(w.last_pong, silent, timeout):
            return False
        if local.first_late(silent, timeout):
            logger.info(
                "allocator %s (pid %d) has not answered heartbeats for %.1f s but is running: this host is "
                "overloaded; it counts as lost after %.0f s",
                w.addr,
                local.pid,
                silent,
                SLOW_FACTOR * timeout,
            )
        return True

    def heard_from(self, alloc_addr: str) -> None:
        """Any message from an allocator counts as a heartbeat (its pongs may queue behind output)."""
        w = self.watches.get(alloc_addr)
        if w is not None:
            w.last_pong = self._clock()

    def check(self, now: float, starved: bool) -> None:
        """One heartbeat: declare silent allocators lost, ping the others. ``starved``: this
        check itself ran late, so pongs that did arrive may not have been read yet (no
        evidence against a peer)."""
        ping = self._ping
        for w in list(self.watches.values()):
            if w.lost is not None:
                continue
            if starved:
                # this process was not running (suspended, or starved of CPU): its own silence is no
                # evidence against the peer, which gets a whole timeout from now to answer this ping
                # (a controller resumed after being detached hears so from the pong, not as a loss)
                w.last_pong = max(w.last_pong, now)
            silent = now - w.last_pong
            local = w.local
            busy = local is not None and silent > 2 * self.cfg.heartbeat_interval and self._busy(local, w, silent)
            if silent > self.cfg.heartbeat_timeout and not busy:
                cause = (
                    f"allocator {w.addr} lost: no heartbeat for {silent:.1f} s "
                    "(host down, network partition, or allocator killed)"
                )
                w.lost, w.silent = SupervisionError(cause, host=w.host), True
                logger.warning("%s", cause)
                for addr in list(w.procs):
                    self.peer_failed(addr, self._proc_error(w, addr, cause))
                # requests to the allocator itself (stop, lookup, ...) fail the same way
                self.peer_failed(w.addr, w.lost)
                continue
            if w.event_port:
                try:
                    self.io.send_actor(
                        w.addr, "__allocator__", "ping", ping[0], ping[1], reply=(self.io.addr_for(w.addr), w.event_port)
                    )
                except Exception:
                    pass
