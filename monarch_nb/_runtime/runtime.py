"""The per-process runtime: one I/O thread, an inbox, ports, actors and peer supervision.

Every process (controller, allocator, proc) runs one :class:`Runtime`. It binds an inbox
(ipc, plus TCP when other hosts must reach it) and sends to other inboxes through
thread-local DEALER sockets, so any thread can send without waking the I/O thread and
messages from one thread to one peer keep their order. The I/O thread only receives and
dispatches: PORT frames go to port handlers, ACTOR frames to an actor's mailbox or, for
system actors, run inline. It never runs user code, so a process whose actor is stuck in
pdb still answers pings.

A message for many procs (:meth:`Runtime.send_many`) goes to each host's allocator once, as
a FANOUT frame that the allocator turns into one message per proc. Since such messages and
direct ones take different paths, every message this process sends to a proc that way is
numbered on a stream of its own (one per destination), and the receiving runtime delivers
each stream in order, holding any message that overtook an earlier one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, NamedTuple, Protocol

import zmq
import zmq.asyncio

from .._wire import frames as wire
from .._wire.serialize import dumps, loads, nbytes
from ..config import Config
from ..errors import ActorError, ProtocolError, SupervisionError, VersionMismatchError, _safe_exc, format_exception
from . import fastpath
from . import shm as _shm
from .transport import Security, SocketFactory, ipc_path, route_ip, split_tcp

logger = logging.getLogger(__name__)

PortHandler = Callable[[int, int, Any, list[Any]], None]

#: returned by a system method that answers through its reply port itself (or never)
NO_REPLY = object()


class Mailbox(Protocol):
    def deliver(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None: ...


class _Watch:
    """What this process knows about one allocator whose procs it talks to."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.procs: dict[str, tuple[str, int, str]] = {}  # proc addr -> (mesh, rank, host)
        self.last_pong = time.monotonic()
        self.lost: SupervisionError | None = None
        self.host = ""


class Target(NamedTuple):
    """One destination of :meth:`Runtime.send_many`."""

    addr: str
    #: the allocator that owns the proc ("" for a process no allocator owns: sent direct)
    alloc: str
    #: the receiver's index in the call (its reply carries it back)
    index: int
    #: where the proc sends its reply ("" for none)
    reply: str


class _Held:
    """A receiving stream: the next number to deliver and the messages that came early."""

    __slots__ = ("next", "held", "since")

    def __init__(self) -> None:
        self.next = 1
        self.held: dict[int, tuple[tuple[Any, ...], Any, list[Any]]] = {}
        self.since = 0.0


class Runtime:
    """I/O for one process. Create with :meth:`start`; all methods are thread-safe."""

    _instance: Runtime | None = None
    _instance_lock = threading.Lock()

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
        self.cfg = cfg
        self.security = security
        self.runtime_dir = runtime_dir
        self.label = label
        self.uid = secrets.token_hex(6)
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.ctx = zmq.Context()
        self.sockets = SocketFactory(self.ctx, security)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"monarch_nb-io-{label}", daemon=True)
        self._tcp_ip = tcp_ip
        self._tcp_port = tcp_port
        self.ipc_addr = ""
        self.tcp_addr = ""
        self._inboxes: list[zmq.Socket] = []
        self._ports: dict[int, PortHandler] = {}
        self._port_ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self.actors: dict[str, Mailbox] = {}
        self.system: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._expect: dict[str, dict[tuple[int, int], Callable[[BaseException], None]]] = {}
        self._dead: dict[str, SupervisionError] = {}
        self._watches: dict[str, _Watch] = {}
        self._tls = threading.local()
        self._stream_ids = itertools.count(1)
        #: sending side of ordered streams: destination -> (stream id, message numbers)
        self._seqs: dict[str, tuple[str, Iterator[int]]] = {}
        #: receiving side of ordered streams, by stream id (touched by the I/O thread only)
        self._streams: dict[str, _Held] = {}
        #: set by an allocator: its proc at a given address as it can reach it, or None
        self.resolve_proc: Callable[[str], str | None] | None = None
        self._all_out: list[zmq.Socket] = []
        self._io_ident = 0
        self._fast_listener: socket.socket | None = None
        self._fast_in: set[fastpath.Receiver] = set()
        #: every thread's direct connections (held by the threads; weakly here, to close them)
        self._fast_out: weakref.WeakSet[fastpath.Sender] = weakref.WeakSet()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.peer_failure_callbacks: list[Callable[[str, SupervisionError], None]] = []
        #: called on the I/O thread with every other event an allocator publishes (e.g. debug sessions)
        self.event_callbacks: list[Callable[[tuple[Any, ...]], None]] = []
        self.dropped_frames = 0
        #: FANOUT frames taken and the proc messages made of them
        self.relayed = [0, 0]
        self._closed = False
        self._shm = _shm.ShmSender() if cfg.shm_min_bytes > 0 and _shm.available() else None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> Runtime:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread.start()
        self.loop.call_soon_threadsafe(self._start_inboxes, ready)
        ready.result(timeout=30)
        return self

    def _run_loop(self) -> None:
        self._io_ident = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _start_inboxes(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            self.ipc_addr = self._bind("ipc://" + ipc_path(self.runtime_dir, f"mnb-{self.uid}.sock"))
            if self.cfg.direct_ipc:
                self._fast_listener = fastpath.listen(fastpath.path_for(self.ipc_addr))
                self.loop.add_reader(self._fast_listener.fileno(), self._accept_direct)
            if self._tcp_ip:
                self.tcp_addr = self._bind(f"tcp://{self._tcp_ip}:{self._tcp_port}")
            self._spawn(self._watch_loop())
            ready.set_result(None)
        except BaseException as e:
            ready.set_exception(e)

    def _bind(self, addr: str) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 0)
        self.sockets.secure_server(sock, addr)
        if addr.startswith("tcp://"):
            host, port = split_tcp(addr)
            if port == 0:
                port = sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(addr)
            # a wildcard bind is advertised under the address other hosts route to
            bound = f"tcp://{route_ip('10.255.255.255') if host in ('0.0.0.0', '*') else host}:{port}"
        else:
            sock.bind(addr)
            bound = addr
            if addr.startswith("ipc://"):
                os.chmod(addr[len("ipc://") :], 0o600)
        self._inboxes.append(sock)
        # a plain socket drained from a reader callback: one wake-up takes every queued
        # message, without a zmq.asyncio future per message
        self.loop.add_reader(sock.FD, self._drain_inbox, sock)
        self.loop.call_soon(self._drain_inbox, sock)
        if addr.startswith("tcp://") and self.security.key is not None:
            mon = zmq.asyncio.Socket.shadow(sock.get_monitor_socket().underlying)
            self._spawn(self._log_handshake_failures(mon, bound))
        return bound

    def _accept_direct(self) -> None:
        assert self._fast_listener is not None
        while True:
            try:
                conn, _ = self._fast_listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("accepting a direct connection failed: %s", e)
                return
            uid = fastpath.peer_uid(conn)
            if uid not in (os.getuid(), 0):
                # the socket is 0600 in a 0700 directory; this is a second line of defence
                self.dropped_frames += 1
                logger.warning("refused a direct connection from uid %d", uid)
                conn.close()
                continue
            conn.setblocking(False)
            rx = fastpath.Receiver(conn, self._dispatch_direct, self.cfg.max_message_bytes, self.label)
            self._fast_in.add(rx)
            self.loop.add_reader(conn.fileno(), self._read_direct, rx)

    def _read_direct(self, rx: fastpath.Receiver) -> None:
        if not rx.on_readable():
            self.loop.remove_reader(rx.sock.fileno())
            rx.sock.close()
            self._fast_in.discard(rx)

    def _dispatch_direct(self, frames: list[Any]) -> None:
        try:
            self._dispatch(frames)
        except Exception:
            logger.exception("dropped a message whose handler failed")

    def _direct(self, addr: str) -> fastpath.Sender | None:
        """This thread's direct connection to the process at ipc ``addr`` (None: use zmq)."""
        conns: dict[str, fastpath.Sender | None] | None = getattr(self._tls, "direct", None)
        if conns is None:
            conns = self._tls.direct = {}
        try:
            return conns[addr]
        except KeyError:
            pass
        try:
            conn: fastpath.Sender | None = fastpath.Sender(fastpath.path_for(addr))
        except OSError:
            conn = None  # a peer without a direct socket (or gone): zmq from this thread on
        conns[addr] = conn
        if conn is not None:
            with self._lock:
                self._fast_out.add(conn)
        return conn

    async def _log_handshake_failures(self, mon: zmq.asyncio.Socket, where: str) -> None:
        from zmq.utils.monitor import parse_monitor_message

        failures = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        while True:
            ev = parse_monitor_message(await mon.recv_multipart())
            if ev["event"] in failures:
                self.dropped_frames += 1
                # libzmq reports our own endpoint here, not the peer's, so it is not named
                logger.warning(
                    "refused a connection on %s: the peer failed the security handshake (wrong cluster key or not monarch_nb)",
                    where,
                )

    def ensure_tcp(self, ip: str) -> str:
        """Bind a TCP inbox on ``ip`` (once) so peers on other hosts can reach us."""
        if self.tcp_addr:
            return self.tcp_addr
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()

        def bind() -> None:
            try:
                if not self.tcp_addr:
                    self.tcp_addr = self._bind(f"tcp://{ip}:0")
                fut.set_result(self.tcp_addr)
            except BaseException as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(bind)
        return fut.result(timeout=10)

    def addr_for(self, peer: str) -> str:
        """Our inbox address as ``peer`` must see it."""
        if peer.startswith("ipc://"):
            return self.ipc_addr
        if self.tcp_addr:
            return self.tcp_addr
        return self.ensure_tcp(route_ip(split_tcp(peer)[0]))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        done = threading.Event()

        def stop() -> None:
            for t in list(self._tasks):
                t.cancel()
            for s in self._inboxes:
                self.loop.remove_reader(s.FD)
                s.close(linger=0)

            def end() -> None:
                self.loop.stop()
                done.set()

            # one more turn of the loop lets the cancelled tasks finish (no "destroyed but pending")
            self.loop.call_soon(end)

        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(stop)
            done.wait(5)
            self._thread.join(5)
        for conn in list(self._fast_out):
            conn.close()
        for rx in self._fast_in:
            rx.sock.close()
        if self._fast_listener is not None:
            self._fast_listener.close()
            try:
                os.unlink(fastpath.path_for(self.ipc_addr))
            except OSError:
                pass
        for s in self._all_out:
            try:
                s.close(linger=200)
            except zmq.ZMQError:
                pass
        self.sockets.close()
        if self._shm is not None:
            self._shm.close()
        self.ctx.term()
        if self.ipc_addr:
            try:
                os.unlink(self.ipc_addr[len("ipc://") :])
            except OSError:
                pass

    def release_shm(self) -> None:
        """Give back the shared memory this process keeps for sending (it is made again on use)."""
        if self._shm is not None:
            self._shm.close()

    # ---------------------------------------------------------------- helpers
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

    def next_call_id(self) -> str:
        return f"{self.uid}.{next(self._call_ids)}"

    # ---------------------------------------------------------------- ports
    def open_port(self, handler: PortHandler) -> int:
        pid = next(self._port_ids)
        self._ports[pid] = handler
        return pid

    def close_port(self, pid: int) -> None:
        self._ports.pop(pid, None)

    # ---------------------------------------------------------------- sending
    def _out(self, addr: str) -> zmq.Socket:
        socks: dict[str, zmq.Socket] | None = getattr(self._tls, "socks", None)
        if socks is None:
            socks = self._tls.socks = {}
        s = socks.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.linger = 2000
            s.setsockopt(zmq.SNDHWM, 0)
            self.sockets.secure_client(s, addr)
            s.connect(addr)
            socks[addr] = s
            with self._lock:
                self._all_out.append(s)
        return s

    def send(self, addr: str, frames: list[Any]) -> None:
        """Send ``frames`` to ``addr``: directly to a process of this host from any thread but
        the I/O thread, else queued on zmq (which never blocks on the network)."""
        dead = self._dead.get(addr)
        if dead is not None:
            raise dead
        if addr[0] == "i" and self.cfg.direct_ipc and threading.get_ident() != self._io_ident:
            conn = self._direct(addr)
            if conn is not None:
                try:
                    conn.send(frames)
                except OSError as e:
                    # the peer went away: like zmq, the message is lost with it (supervision
                    # reports the peer); this thread's later messages to it take zmq
                    logger.debug("direct send to %s failed (%s); dropped", addr, e)
                    self._tls.direct[addr] = None
                return
        if len(frames) == 1:
            self._out(addr).send(frames[0])
        else:
            self._out(addr).send_multipart(frames, copy=False)

    def send_port(self, addr: str, port: int, index: int, status: int, value: Any) -> None:
        """Send ``value`` to a port; an unpicklable value becomes an error the receiver sees."""
        try:
            body, bufs = dumps(value)
        except Exception as e:
            status = wire.ERROR
            body, bufs = dumps(
                ActorError(
                    TypeError(f"the value could not be pickled to send back: {type(e).__name__}: {e}"),
                    format_exception(e),
                    host=self.hostname,
                )
            )
        try:
            self.send(addr, self._encode(addr, wire.PORT, (port, index, status), body, bufs))
        except SupervisionError:
            logger.debug("reply to dead peer %s dropped", addr)

    def send_actor(
        self,
        addr: str,
        actor: str,
        method: str,
        body: bytes,
        buffers: list[Any],
        *,
        reply: tuple[str, int] | None = None,
        index: int = 0,
        extent: tuple[tuple[str, ...], tuple[int, ...]] = ((), ()),
        call_id: str = "",
    ) -> None:
        """Send one unordered message (system requests); see :meth:`send_many` for actors."""
        raddr, rport = reply if reply else ("", 0)
        meta = (actor, method, raddr, rport, index, extent, call_id, "", 0)
        self.send(addr, self._encode(addr, wire.ACTOR, meta, body, buffers))

    def _stream(self, addr: str) -> tuple[str, Iterator[int]]:
        """This process's ordered stream to ``addr``: its id and its message numbers.

        One stream per destination for all threads: a message numbered after another (in one
        thread, or after a join or a lock) is delivered after it. ``next()`` on the counter is
        atomic, so threads need no lock; one whose number goes unsent (the peer is gone, the
        only way a send fails) leaves a gap that only that dead peer would have waited on.
        """
        st = self._seqs.get(addr)
        if st is None:
            st = self._seqs.setdefault(addr, (f"{self.uid}.{next(self._stream_ids)}", itertools.count(1)))
        return st

    def send_many(
        self,
        targets: list[Target],
        actor: str,
        method: str,
        body: bytes,
        buffers: list[Any],
        *,
        port: int = 0,
        extent: tuple[tuple[str, ...], tuple[int, ...]] = ((), ()),
        call_id: str = "",
    ) -> list[tuple[int, BaseException]]:
        """Send one message to every target, in order with this thread's other messages to each.

        Targets that share another host's allocator get one FANOUT frame to it (``fanout_min``
        or more of them), so a broadcast costs one send per host; the rest go direct. Returns the
        ``(index, error)`` of targets it could not send to; the others are on their way.
        """
        groups: dict[str, list[Target]] = {}
        direct: list[Target] = []
        fmin = self.cfg.fanout_min
        if fmin > 0 and len(targets) >= fmin:
            # this host's procs are cheaper to reach straight (the direct path from this thread,
            # shared memory for bulk data) than through a relay; other hosts' through theirs
            local = self.cfg.fanout_local and not (
                self._shm is not None and any(memoryview(b).nbytes >= self.cfg.shm_min_bytes for b in buffers)
            )
            for t in targets:
                if t.alloc and (local or not t.alloc.startswith("ipc://")):
                    groups.setdefault(t.alloc, []).append(t)
                else:
                    direct.append(t)
            for alloc in [a for a, g in groups.items() if len(g) < fmin]:
                direct.extend(groups.pop(alloc))
        else:
            direct = targets
        failed: list[tuple[int, BaseException]] = []
        for t in direct:
            sid, seqs = self._stream(t.addr)
            meta = (actor, method, t.reply, port if t.reply else 0, t.index, extent, call_id, sid, next(seqs))
            try:
                self.send(t.addr, self._encode(t.addr, wire.ACTOR, meta, body, buffers))
            except BaseException as e:
                failed.append((t.index, e))
        for alloc, group in groups.items():
            dests = []
            for t in group:
                sid, seqs = self._stream(t.addr)
                dests.append((t.addr, t.index, t.reply, sid, next(seqs)))
            meta = (actor, method, port, extent, call_id, tuple(dests))
            try:
                self.send(alloc, self._encode(alloc, wire.FANOUT, meta, body, buffers))
            except BaseException as e:
                failed.extend((t.index, e) for t in group)
        return failed

    def _encode(self, addr: str, kind: int, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> list[Any]:
        table = None
        if bufs and self._shm is not None and addr.startswith("ipc://"):
            # a peer on this host maps large buffers instead of reading them off a socket
            lim = self.cfg.shm_min_bytes
            for i, b in enumerate(bufs):
                if memoryview(b).nbytes >= lim:
                    try:
                        # a bytes object is copied out at the receiver, so its segment comes back
                        entry = (i, *self._shm.put(b, copied=type(memoryview(b).obj) is bytes))
                    except OSError as e:
                        # /dev/shm full or unusable: this buffer takes the socket instead
                        logger.debug("shared memory unavailable (%s); sending %d bytes over the socket", e, memoryview(b).nbytes)
                        continue
                    if table is None:
                        table, bufs = [], list(bufs)
                    table.append(entry)
                    bufs[i] = b""
        return wire.encode(kind, meta, body, bufs, table)

    def check_size(self, body: bytes, buffers: list[Any]) -> None:
        n = nbytes(body, buffers)
        if n > self.cfg.max_message_bytes:
            raise ValueError(
                f"message of {n} bytes exceeds max_message_bytes={self.cfg.max_message_bytes}; "
                "send a handle to the data instead, or raise MONARCH_NB_MAX_MESSAGE_BYTES"
            )

    # ---------------------------------------------------------------- receiving
    def _drain_inbox(self, sock: zmq.Socket) -> None:
        # the zmq FD is edge-triggered: read while ZMQ_EVENTS says so (checking it re-arms the
        # FD), or come back at once after a batch. Asking EVENTS instead of calling recv until
        # EAGAIN saves a GIL release (recv always drops it) and an exception per wake-up; each
        # GIL release is a chance for a waiting thread to take it and make this one wait
        recv, opt = sock.recv, sock.getsockopt
        for _ in range(256):
            try:
                if not opt(zmq.EVENTS) & zmq.POLLIN:
                    return
                rid = recv(zmq.NOBLOCK)  # the sender's routing id; answers go to reply addresses instead
                # the rest of a multipart message has arrived with its first part; the head is
                # small (copied), payloads and buffers are not
                frames = [recv()] if opt(zmq.RCVMORE) else []
                while opt(zmq.RCVMORE):
                    frames.append(recv(copy=False).buffer)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                logger.warning("inbox receive failed: %s", e)
                continue
            try:
                self._dispatch(frames, sock, rid)
            except Exception:
                logger.exception("dropped a message whose handler failed")
        self.loop.call_soon(self._drain_inbox, sock)

    def _refuse(self, sock: zmq.Socket | None, rid: bytes, reason: str) -> None:
        """Tell the sender (on its own connection) why its message was dropped."""
        if sock is None:
            return
        try:
            sock.send_multipart([rid, wire.refusal(reason)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _dispatch(self, frames: list[Any], sock: zmq.Socket | None = None, rid: bytes = b"") -> None:
        if not frames:
            self.dropped_frames += 1
            logger.warning("dropped an empty message")
            return
        try:
            kind, meta, body, bufs, table = wire.decode(frames)
        except VersionMismatchError as e:
            self.dropped_frames += 1
            from .. import __version__

            logger.warning("dropped a frame: %s", e)
            self._refuse(
                sock,
                rid,
                f"{self.label} on {self.hostname} speaks wire version {wire.VERSION} (monarch_nb {__version__}) "
                f"and got a message of version {frames[0][3]}: run the same monarch_nb version on every host",
            )
            return
        except ProtocolError as e:
            self.dropped_frames += 1
            logger.warning("dropped a frame: %s", e)
            return
        if table:
            try:
                bufs = list(bufs)
                for i, name, n in table:
                    bufs[i] = _shm.take(name, n)
            except ProtocolError as e:
                self.dropped_frames += 1
                logger.warning("dropped a message: %s", e)
                if kind == wire.ACTOR and meta[2]:
                    self.send_port(meta[2], meta[3], meta[4], wire.ERROR, ActorError(e, host=self.hostname))
                return
        if kind == wire.PORT:
            port, index, status = meta
            h = self._ports.get(port)
            if h is not None:
                h(index, status, body, bufs)
            return
        if kind == wire.FANOUT:
            self._fan_out(meta, body, bufs)
            return
        if meta[8]:
            self._ordered(meta, body, bufs)
        else:
            self._route(meta, body, bufs)

    def _ordered(self, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        sid, seq = meta[7], meta[8]
        st = self._streams.get(sid)
        if st is None:
            st = self._streams[sid] = _Held()
        if seq < st.next or seq in st.held:
            self.dropped_frames += 1
            logger.warning("dropped message %d of stream %s: already delivered (a replay?)", seq, sid)
            return
        if seq != st.next and not st.held:
            st.since = time.monotonic()  # a gap opens
        st.held[seq] = (meta, body, bufs)
        self._release(st)

    def _release(self, st: _Held) -> None:
        """Deliver the stream's next messages while they are here."""
        delivered = False
        while (msg := st.held.pop(st.next, None)) is not None:
            st.next += 1
            delivered = True
            self._route(*msg)
        if delivered and st.held:
            st.since = time.monotonic()  # waiting again, for the next gap

    def _skip_gaps(self, now: float) -> None:
        """Deliver messages held behind one that never came (lost with a failed relay) after a while."""
        for sid, st in self._streams.items():
            if st.held and now - st.since > self.cfg.order_gap_timeout:
                first = min(st.held)
                logger.warning(
                    "messages %d..%d of stream %s never arrived within %.0f s; delivering the later ones",
                    st.next,
                    first - 1,
                    sid,
                    self.cfg.order_gap_timeout,
                )
                st.next = first
                self._release(st)

    def _fan_out(self, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor, method, rport, extent, call_id, dests = meta
        resolve = self.resolve_proc
        self.relayed[0] += 1
        for addr, index, raddr, sid, seq in dests:
            local = resolve(addr) if resolve is not None else None
            if local is None:
                self.dropped_frames += 1
                where = f"{self.label} on {self.hostname}"
                err = ActorError(LookupError(f"{where} has no proc at {addr} to relay {actor}.{method} to"), host=self.hostname)
                if raddr:
                    self.send_port(raddr, rport, index, wire.ERROR, err)
                else:
                    logger.warning("%s", err)
                continue
            try:
                meta1 = (actor, method, raddr, rport, index, extent, call_id, sid, seq)
                self.send(local, self._encode(local, wire.ACTOR, meta1, body, bufs))
                self.relayed[1] += 1
            except SupervisionError:
                pass  # the proc is gone; its subscribers hear that from the allocator

    def _route(self, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor = meta[0]
        sysobj = self.system.get(actor)
        if sysobj is not None:
            self._run_system(sysobj, meta, body, bufs)
            return
        box = self.actors.get(actor)
        if box is not None:
            box.deliver(meta, body, bufs)
            return
        raddr, rport, index = meta[2], meta[3], meta[4]
        # the actor was stopped (by the client, or by itself): as in Monarch, a supervision error
        err = SupervisionError(
            f"no actor named {actor!r} in {self.label} pid {self.pid} (stopped, or never spawned there)",
            actor=actor,
            host=self.hostname,
        )
        if raddr:
            self.send_port(raddr, rport, index, wire.ERROR, err)
        else:
            logger.warning("dropped a message for unknown actor %r", actor)

    def _run_system(self, obj: Any, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor, method, raddr, rport, index = meta[:5]
        # system methods get the sender's reply address so they can stream or defer answers
        try:
            args, kwargs = loads(body, bufs)
            fn = getattr(obj, "sys_" + method, None)
            if fn is None:
                raise AttributeError(f"system actor {actor!r} has no method {method!r}")
            res = fn(*args, **kwargs, _reply=(raddr, rport, index)) if getattr(fn, "wants_reply", False) else fn(*args, **kwargs)
        except Exception as e:
            self._system_error(raddr, rport, index, e)
            return
        if asyncio.iscoroutine(res):
            self._spawn(self._finish_system(res, raddr, rport, index))
        elif raddr and res is not NO_REPLY:
            self.send_port(raddr, rport, index, wire.OK, res)

    async def _finish_system(self, coro: Coroutine[Any, Any, Any], raddr: str, rport: int, index: int) -> None:
        try:
            res = await coro
        except Exception as e:
            self._system_error(raddr, rport, index, e)
            return
        if raddr and res is not NO_REPLY:
            self.send_port(raddr, rport, index, wire.OK, res)

    def _system_error(self, raddr: str, rport: int, index: int, e: Exception) -> None:
        if isinstance(e, (ActorError, SupervisionError)):
            err: Exception = e
        else:
            err = ActorError(_safe_exc(e), format_exception(e), host=self.hostname)
        if raddr:
            self.send_port(raddr, rport, index, wire.ERROR, err)
        else:
            logger.warning("system call failed: %s", e)

    # ---------------------------------------------------------------- supervision
    def expect(self, peer: str, key: tuple[int, int], on_fail: Callable[[BaseException], None]) -> None:
        """Remember that a reply ``key`` is owed by ``peer``; fail it if the peer dies."""
        with self._lock:
            dead = self._dead.get(peer)
            if dead is None:
                self._expect.setdefault(peer, {})[key] = on_fail
        if dead is not None:
            on_fail(dead)

    def fulfil(self, peer: str, key: tuple[int, int]) -> None:
        with self._lock:
            d = self._expect.get(peer)
            if d is not None:
                d.pop(key, None)

    def peer_error(self, peer: str) -> SupervisionError | None:
        return self._dead.get(peer)

    def peer_failed(self, peer: str, err: SupervisionError) -> None:
        with self._lock:
            if peer in self._dead:
                return
            self._dead[peer] = err
            owed = self._expect.pop(peer, {})
        for on_fail in owed.values():
            try:
                on_fail(err)
            except Exception:
                logger.exception("failure callback raised")
        for cb in list(self.peer_failure_callbacks):
            try:
                cb(peer, err)
            except Exception:
                logger.exception("peer failure callback raised")

    def watch(self, alloc_addr: str, proc_addr: str, mesh: str, rank: int, host: str) -> None:
        """Supervise ``proc_addr`` through the allocator that owns it."""
        w = self._watches.get(alloc_addr)
        if w is not None and proc_addr in w.procs:
            return
        if w is None:
            with self._lock:
                w = self._watches.get(alloc_addr)
                if w is None:
                    w = self._watches[alloc_addr] = _Watch(alloc_addr)
                    w.host = host
                    self.call_soon(self._subscribe, w)
        w.procs[proc_addr] = (mesh, rank, host)
        if w.lost is not None:
            self.peer_failed(proc_addr, self._proc_error(w, proc_addr, w.lost.cause))

    def _proc_error(self, w: _Watch, proc_addr: str, cause: str) -> SupervisionError:
        mesh, rank, host = w.procs.get(proc_addr, ("", None, w.host))
        return SupervisionError(cause, mesh=mesh, rank=rank, host=host)

    def _subscribe(self, w: _Watch) -> None:
        def on_event(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            if status == wire.ERROR:
                return
            ev = loads(body, bufs)
            if ev[0] == "proc_exited":
                _, addr, mesh, rank, host, cause = ev
                w.procs.setdefault(addr, (mesh, rank, host))
                self.peer_failed(addr, SupervisionError(cause, mesh=mesh, rank=rank, host=host))
            elif ev[0] == "pong":
                w.last_pong = time.monotonic()
            else:
                for cb in self.event_callbacks:
                    try:
                        cb(ev)
                    except Exception:
                        logger.exception("allocator event callback raised")

        port = self.open_port(on_event)
        w.event_port = port  # type: ignore[attr-defined]
        body, bufs = dumps(((), {}))
        try:
            self.send_actor(w.addr, "__allocator__", "subscribe", body, bufs, reply=(self.addr_for(w.addr), port))
        except Exception as e:
            logger.warning("could not subscribe to allocator %s: %s", w.addr, e)

    def heard_from(self, alloc_addr: str) -> None:
        """Any message from an allocator counts as a heartbeat (its pongs may queue behind output)."""
        w = self._watches.get(alloc_addr)
        if w is not None:
            w.last_pong = time.monotonic()

    async def _watch_loop(self) -> None:
        ping = dumps(((), {}))
        interval = self.cfg.heartbeat_interval
        woke = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if self._shm is not None:
                self._shm.sweep()
            now = time.monotonic()
            if self._streams:
                self._skip_gaps(now)
            # when this loop itself was starved (a busy I/O thread, a loaded machine), pongs that
            # did arrive may not have been read yet: that is no evidence against the peer
            starved = now - woke > interval + max(0.25, interval)
            woke = now
            for w in list(self._watches.values()):
                if w.lost is not None:
                    continue
                if now - w.last_pong > self.cfg.heartbeat_timeout and not starved:
                    cause = (
                        f"allocator {w.addr} lost: no heartbeat for {now - w.last_pong:.1f} s "
                        "(host down, network partition, or allocator killed)"
                    )
                    w.lost = SupervisionError(cause, host=w.host)
                    logger.warning("%s", cause)
                    for addr in list(w.procs):
                        self.peer_failed(addr, self._proc_error(w, addr, cause))
                    # requests to the allocator itself (stop, lookup, ...) fail the same way
                    self.peer_failed(w.addr, w.lost)
                    continue
                port = getattr(w, "event_port", None)
                if port is not None:
                    try:
                        self.send_actor(w.addr, "__allocator__", "ping", ping[0], ping[1], reply=(self.addr_for(w.addr), port))
                    except Exception:
                        pass


def system_method(wants_reply: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a ``sys_*`` method that wants the caller's ``_reply=(addr, port, index)``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.wants_reply = wants_reply  # type: ignore[attr-defined]
        return fn

    return deco


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
