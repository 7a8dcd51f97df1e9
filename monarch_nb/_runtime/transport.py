"""Sockets: where inboxes bind, how every connection is secured, and the bytes in and out.

:class:`Transport` owns a process's sockets. It binds an inbox (ipc, plus TCP when other
hosts must reach it), reads it on the I/O thread and hands every message's frames to one
``dispatch`` callable, and sends frames to other inboxes through thread-local DEALER sockets
(or, to a process of this host from any thread but the I/O thread, a direct connection), so
any thread can send without waking the I/O thread and messages from one thread to one peer
keep their order. What the frames mean is not its business.

Threat model (see docs/security.md): on one host, ipc sockets live in a 0700 runtime
directory and are themselves 0600, so only the user can connect. Across hosts every socket
speaks CurveZMQ with keys derived from the cluster secret; a ZAP handler admits only peers
that prove they hold it. No TCP socket is ever plain: without a cluster key, loopback TCP
uses a key kept in the runtime directory (made 0600 on first use, so the user's own processes
share it and nobody else can read it), and TCP off loopback is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import ipaddress
import logging
import operator
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth.thread

from .._wire import frames as wire
from .._wire.keys import curve_keypair, load_or_create_key
from ..config import Config
from ..errors import ConfigError, ConnectError
from . import _fdlimit, _preauth, fastpath
from ._hangup import hung_up
from ._refusals import Refusals

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "monarch_nb"
#: the key of a runtime directory's loopback TCP sockets when no cluster key is given
LOCAL_KEY_FILE = "loopback-tcp.key"


def local_key(runtime_dir: str) -> bytes:
    """This runtime directory's loopback key (created 0600 on first use)."""
    return load_or_create_key(os.path.join(runtime_dir, LOCAL_KEY_FILE))


@dataclass(frozen=True)
class Security:
    """The secret of a cluster (None: ipc, and loopback TCP with the runtime directory's key).

    ``trust_all`` (``ca="trust_all_connections"``, ``--trust-all``) is kept for Monarch's API;
    it means no more than no key: loopback TCP is still authenticated, with the local key.
    """

    key: bytes | None = None
    trust_all: bool = False

    def check_address(self, addr: str) -> None:
        """Refuse TCP to ``addr`` that no key we hold could authenticate."""
        if not addr.startswith("tcp://") or self.key is not None:
            return
        host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if not _is_loopback(host):
            raise ConfigError(
                f"refusing unauthenticated TCP to {addr}: off loopback every connection is authenticated "
                "with a cluster key. Make one with `monarch-nb keygen KEYFILE`, copy it to every host, and pass it "
                "(--key-file KEYFILE, key_file=/ca=KEYFILE, or MONARCH_NB_KEY_FILE=KEYFILE); "
                "ca='trust_all_connections' / --trust-all only serve loopback"
            )


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "*"):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


class _KeyProvider:
    def __init__(self, public: bytes, refusals: Refusals) -> None:
        self.public = public
        self.refusals = refusals

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.public
        if not ok:
            self.refusals.refused("refused a connection: the peer does not hold the cluster key")
        return ok


class SocketFactory:
    """Makes inbox (server) and outbox (client) sockets with the right security."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], security: Security, runtime_dir: str = "") -> None:
        self.ctx = ctx
        self.security = security
        self.runtime_dir = runtime_dir
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._keys: tuple[bytes, bytes] | None = None
        if security.key is not None:
            self._keys = curve_keypair(security.key)
        #: host -> the gateway that reaches it (hosts the controller cannot route to: see gateway.py)
        self.routes: dict[str, Any] = {}
        #: refused connections of this process's TCP inboxes (_refusals.py)
        self.refusals = Refusals(logger)

    def set_security(self, security: Security) -> None:
        """Adopt a cluster key after start (before any TCP socket uses the old one)."""
        if security.key is not None and security.key != self.security.key and self.security.key is not None:
            raise ConfigError("this process already uses another cluster key; one process joins one cluster")
        if security.key is None:
            # dropping a key would leave our TCP sockets on it: keep it
            security = Security(self.security.key, security.trust_all)
        self.security = security
        if security.key is not None:
            self._keys = curve_keypair(security.key)
            if self._auth is not None:
                self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(self._keys[0], self.refusals))

    def _tcp_keys(self, addr: str) -> tuple[bytes, bytes]:
        self.security.check_address(addr)
        if self._keys is None:
            from ..config import runtime_dir

            self._keys = curve_keypair(local_key(self.runtime_dir or runtime_dir()))
        return self._keys

    def _ensure_auth(self, public: bytes) -> None:
        if self._auth is None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self.ctx, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyProvider(public, self.refusals))

    def secure_server(self, sock: zmq.Socket[bytes], addr: str) -> None:
        if addr.startswith("tcp://"):
            public, secret = self._tcp_keys(addr)
            self._ensure_auth(public)
            sock.curve_server = True
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.zap_domain = ZAP_DOMAIN.encode()

    def secure_client(self, sock: zmq.Socket[bytes], addr: str) -> None:
        if addr.startswith("tcp://"):
            public, secret = self._tcp_keys(addr)
            sock.curve_serverkey = public
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            if self.routes:
                route = self.routes.get(split_tcp(addr)[0])
                if route is not None:
                    # through the gateway's SOCKS5 proxy; CurveZMQ still runs end to end
                    sock.setsockopt(zmq.SOCKS_PROXY, route.proxy.encode())
                    sock.setsockopt(zmq.SOCKS_USERNAME, route.username.encode())
                    sock.setsockopt(zmq.SOCKS_PASSWORD, route.password.encode())

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def ipc_path(runtime_dir: str, name: str) -> str:
    path = os.path.join(runtime_dir, name)
    if len(path) > 100:
        raise ConfigError(
            f"ipc socket path {path!r} is too long for the OS (limit ~107 bytes); "
            "set MONARCH_NB_RUNTIME_DIR to a shorter directory"
        )
    return path


def route_ip(peer_host: str) -> str:
    """The local IP address the kernel would use to reach ``peer_host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def worker_address(addr: str) -> tuple[str, str]:
    """(advertised, bound) of a worker address in any form Monarch's worker loops accept:
    ``tcp://host:port``, ``ipc://path`` (made absolute against this process's working directory), ``<proc-id>@<url>`` (``service@…``,
    ``service<2MuAHeDjLCEd>@…``: the proc id is Monarch's, ignored here), and the serving alias
    ``tcp://advertised:port@tcp://0.0.0.0:port`` (bind to the right, peers dial the left)."""
    if not isinstance(addr, str) or not addr:
        raise ValueError(f"a worker address is a string such as tcp://host:port, got {addr!r}")
    if addr.startswith("ipc://"):
        return (_ipc_worker(addr),) * 2
    rest = addr
    head, sep, tail = rest.partition("@")
    if sep and "://" not in head:
        rest = tail  # a proc id
    advertised, sep, bound = rest.partition("@")
    bound = bound if sep else advertised
    for a in (advertised, bound):
        if not (a.startswith("tcp://") or a.startswith("ipc://")) or "@" in a:
            raise ValueError(
                f"bad worker address {addr!r}: use tcp://host:port, ipc://path, "
                "[proc-id@]tcp://advertised:port[@tcp://bind-ip:port]"
            )
    if advertised.startswith("tcp://") != bound.startswith("tcp://"):
        raise ValueError(f"bad worker address {addr!r}: the advertised and bound addresses are of different kinds")
    return advertised, bound


def _ipc_worker(addr: str) -> str:
    """``ipc://PATH`` as Monarch reads it: a unix socket file, a relative PATH resolved against
    this process's working directory; ``ipc://@NAME`` (Linux's abstract namespace) is refused."""
    path = addr[len("ipc://") :]
    if path.startswith("@"):
        raise ConfigError(
            f"worker address {addr!r}: an abstract unix socket (ipc://@NAME) has no file permissions, so any "
            "local user could connect to it; monarch_nb serves ipc only at socket files of mode 0600: "
            "use ipc://PATH (a file path, relative to the working directory or absolute)"
        )
    if not path or "@" in path:
        raise ValueError(f"bad worker address {addr!r}: use ipc://PATH, a socket file's path")
    full = os.path.abspath(path)
    if len(full.encode()) > 107:
        raise ValueError(f"worker address {addr!r}: the socket path {full!r} is over the 107 bytes unix sockets allow")
    return "ipc://" + full


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "*", "::", "")


def check_form(addr: str) -> None:
    """Refuse what cannot be an address to connect to before zmq or the key exchange meets it
    (a typed ``host:port``, ``garbage``, port 0) with the forms that are."""
    if addr.startswith("ipc://") and len(addr) > len("ipc://"):
        return
    if not 0 < split_tcp(addr)[1] < 65536:
        raise ValueError(_not_an_address(addr))


def split_tcp(addr: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT`` (port 0 allowed: a bind to any port); anything else
    is a ValueError saying which forms an address takes."""
    host, sep, port = addr[len("tcp://") :].rpartition(":") if addr.startswith("tcp://") else ("", "", "")
    if not (sep and host and port.isdigit()):
        raise ValueError(_not_an_address(addr))
    if int(port) > 65535:
        # zmq takes the port modulo 65536: tcp://127.0.0.1:99999 served at 34463, advertised as 99999
        raise ValueError(f"{addr!r} is not an address: port {port} is over 65535")
    return host.strip("[]"), int(port)


def _not_an_address(addr: str) -> str:
    return f"{addr!r} is not an address: use tcp://HOST:PORT or ipc://PATH"


#: what a transport hands each message to: its frames, and the inbox socket and sender's
#: routing id when it came over zmq (to refuse it on the sender's own connection)
Dispatch = Callable[..., None]


def refuse(sock: zmq.Socket[bytes] | None, rid: bytes, reason: str) -> None:
    """Tell the sender (on its own connection) why its message was dropped."""
    if sock is None:
        return
    try:
        sock.send_multipart([rid, wire.refusal(reason)], zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


#: a thread keeps at most this many peer connections; the least recently used go first
MAX_PEER_SOCKETS = 256
#: seconds a direct listener goes unwatched after an accept failed for want of descriptors
ACCEPT_PAUSE_S = 0.5
#: monitor events read in one turn of the loop before it serves its other readers
_MONITOR_BATCH = 256
#: a thread looks for direct connections whose peer went away once it holds this many, and
#: again each time it holds twice as many as it kept (a sweep per new connection would cost a
#: thread that connects to a thousand procs a million polls)
DIRECT_PRUNE_MIN = 64


class _Outboxes:
    """One thread's zmq sockets by peer address, and when each was last used (for closing idle ones)."""

    __slots__ = ("socks", "used", "last_used", "full_since")

    def __init__(self) -> None:
        self.socks: dict[str, zmq.Socket[bytes]] = {}
        #: addresses sent to since the last sweep (a set add per send: no clock read on the hot path)
        self.used: set[str] = set()
        self.last_used: dict[str, float] = {}
        #: peers whose full queue made a send fail, and when: later sends fail at once for a while
        self.full_since: dict[str, float] = {}


def _not_open(frames: list[Any], sock: zmq.Socket[bytes] | None = None, rid: bytes = b"") -> None:
    raise RuntimeError("the transport is not open")


class Transport:
    """A process's sockets. Thread-safe; inboxes are read on ``loop``'s thread."""

    def __init__(
        self,
        cfg: Config,
        security: Security,
        runtime_dir: str,
        loop: asyncio.AbstractEventLoop,
        *,
        name: str,
        label: str = "proc",
        spawn: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
        tcp_ip: str | None = None,
        tcp_port: int = 0,
    ) -> None:
        # a process of the runtime holds descriptors per peer: the usual 1,024 is too few
        _fdlimit.raise_soft_limit()
        self.cfg = cfg
        self.security = security
        self.runtime_dir = runtime_dir
        self.loop = loop
        self.name = name
        self.label = label
        self._spawn = spawn if spawn is not None else loop.create_task
        self.ctx = zmq.Context()
        self.sockets = SocketFactory(self.ctx, security, runtime_dir)
        self._tcp_ip = tcp_ip
        self._tcp_port = tcp_port
        self.ipc_addr = ""
        self.tcp_addr = ""
        #: where the TCP inbox is bound, when peers are told another address (``advertise``)
        self.bound_tcp = ""
        #: the address peers dial, when not the bound one (Monarch's ``advertised@bind`` form)
        self.advertise = ""
        #: a worker loop's ``ipc://PATH`` of the program's choosing (absolute): an inbox served
        #: there besides the one in the runtime directory
        self.extra_ipc = ""
        #: the thread that reads the inboxes (set by its owner); it never sends directly
        self.io_ident = 0
        self.dispatch: Dispatch = _not_open
        #: connections refused here (wrong uid, failed handshakes)
        self.dropped = 0
        self._inboxes: list[zmq.Socket[bytes]] = []
        #: the TCP inboxes' connections in their handshake (tests read how many were cut)
        self._handshakes: list[_preauth.Handshakes] = []
        self._all_out: set[zmq.Socket[bytes]] = set()
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._fast_listener: socket.socket | None = None
        #: accepted direct connections
        self.fast_in: set[fastpath.Receiver] = set()
        #: every thread's direct connections (held by the threads; weakly here, to close them)
        self.fast_out: weakref.WeakSet[fastpath.Sender] = weakref.WeakSet()
        #: the direct connection being read (on the loop's thread), for claim()
        self._reading: fastpath.Receiver | None = None
        #: connections claimed by actor threads that this loop watches while their actor is busy
        self._watch: select.epoll | None = None
        self._claims: dict[int, Claim] = {}
        #: when running out of descriptors was last logged
        self._emfile_logged = -1e9

    # ---------------------------------------------------------------- inboxes
    def open(self, dispatch: Dispatch) -> None:
        """Bind the inboxes and hand what they receive to ``dispatch`` (on the loop's thread)."""
        self.dispatch = dispatch
        self.ipc_addr = self._bind("ipc://" + ipc_path(self.runtime_dir, f"{self.name}.sock"))
        if self.cfg.direct_ipc:
            self._fast_listener = fastpath.listen(fastpath.path_for(self.ipc_addr))
            self.loop.add_reader(self._fast_listener.fileno(), self._accept_direct)
        if self._tcp_ip:
            self.tcp_addr = self.bound_tcp = self._bind(f"tcp://{self._tcp_ip}:{self._tcp_port}")
            if self.advertise:
                self.tcp_addr = self.advertise
        if self.extra_ipc:
            self._bind_extra_ipc(self.extra_ipc)

    def _bind_extra_ipc(self, addr: str) -> None:
        """Serve ``ipc://PATH`` too: bound in the runtime directory (0700) and made 0600 there,
        then renamed into place, so no other user can connect in between. A live server there
        already is refused; a stale socket file is replaced."""
        path = addr[len("ipc://") :]
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            pass
        else:
            raise ConfigError(f"worker address {addr}: another process already serves at {path}")
        finally:
            probe.close()
        tmp = ipc_path(self.runtime_dir, f"{self.name}.extra.sock")
        self._bind("ipc://" + tmp)  # chmods 0600
        os.rename(tmp, path)

    def _bind(self, addr: str) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 0)
        self.sockets.secure_server(sock, addr)
        if addr.startswith("tcp://"):
            # a stranger's connection is cut after this long (libzmq's default: 30 s)
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(_preauth.HANDSHAKE_S * 1000))
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
        if addr.startswith("tcp://"):
            self._guard_handshakes(sock, bound, split_tcp(bound)[1])
        return bound

    def _drain_inbox(self, sock: zmq.Socket[bytes]) -> None:
        # the zmq FD is edge-triggered: read while ZMQ_EVENTS says so (checking it re-arms the
        # FD), or come back at once after a batch. Asking EVENTS instead of calling recv until
        # EAGAIN saves a GIL release (recv always drops it) and an exception per wake-up; each
        # GIL release is a chance for a waiting thread to take it and make this one wait
        recv, opt, dispatch = sock.recv, sock.getsockopt, self.dispatch
        for _ in range(256):
            try:
                # getsockopt is typed int | bytes; EVENTS is an int, and a cast would be a call per message
                if not opt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator, arg-type]
                    return
                rid = recv(zmq.NOBLOCK)  # the sender's routing id; answers go to reply addresses instead
                # the rest of a multipart message has arrived with its first part; the head is
                # small (copied), payloads and buffers are not
                frames: list[Any] = [recv()] if opt(zmq.RCVMORE) else []
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
                dispatch(frames, sock, rid)
            except Exception:
                logger.exception("dropped a message whose handler failed")
        self.loop.call_soon(self._drain_inbox, sock)

    def _accept_direct(self) -> None:
        assert self._fast_listener is not None
        while True:
            try:
                conn, _ = self._fast_listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._pause_accepting(e)
                else:
                    logger.warning("accepting a direct connection failed: %s", e)
                return
            uid = fastpath.peer_uid(conn)
            if uid not in (os.getuid(), 0):
                # the socket is 0600 in a 0700 directory; this is a second line of defence
                self.dropped += 1
                self.sockets.refusals.refused("refused a direct connection from uid %d", uid)
                conn.close()
                continue
            conn.setblocking(False)
            rx = fastpath.Receiver(conn, self._dispatch_direct, self.cfg.max_message_bytes, self.label)
            self.fast_in.add(rx)
            self.loop.add_reader(conn.fileno(), self._read_direct, rx)

    def _pause_accepting(self, e: OSError) -> None:
        """Out of descriptors: the pending connection stays queued, and the listener, readable
        until it is taken, would wake this loop at once for ever. Stop watching it a while."""
        assert self._fast_listener is not None
        fd = self._fast_listener.fileno()
        self.loop.remove_reader(fd)
        self.loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting)
        now = time.monotonic()
        if now - self._emfile_logged > 30:
            self._emfile_logged = now
            logger.warning(
                "%s cannot accept a direct connection: %s (descriptors: %s); retrying every %.1f s. "
                "Raise `ulimit -n` where this process starts, or stop meshes",
                self.label,
                e.strerror,
                _fdlimit.usage(),
                ACCEPT_PAUSE_S,
            )

    def _resume_accepting(self) -> None:
        lis = self._fast_listener
        if lis is not None and lis.fileno() >= 0:  # not closed meanwhile
            self.loop.add_reader(lis.fileno(), self._accept_direct)

    def _read_direct(self, rx: fastpath.Receiver) -> None:
        self._reading = rx
        try:
            alive = rx.on_readable()
        finally:
            self._reading = None
        if not alive:
            self.loop.remove_reader(rx.sock.fileno())
            rx.sock.close()
            self.fast_in.discard(rx)

    def claim(self, keep: bool = False) -> Claim | None:
        """On the loop's thread, while it dispatches a message that came alone on a direct
        connection: hand that connection to the caller (an idle actor's thread, which reads it
        itself from then on, see :class:`Claim`), or None. ``keep``: see :attr:`Claim.keep`."""
        rx = self._reading
        if rx is None or rx.claimed or not rx.drained():
            return None
        if rx.cooldown:
            rx.cooldown -= 1
            return None
        if self._watch is None:
            self._watch = select.epoll()
            self.loop.add_reader(self._watch.fileno(), self._on_watch)
        fd = rx.sock.fileno()
        try:
            # watched until the actor's thread takes it (it may be busy with what is queued before)
            self._watch.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
        except OSError:
            return None
        self.loop.remove_reader(fd)
        rx.claimed = True
        c = self._claims[fd] = Claim(self, rx, keep)
        return c

    def _on_watch(self) -> None:
        assert self._watch is not None
        for fd, _ in self._watch.poll(0):
            c = self._claims.get(fd)
            if c is not None:
                if c.keep:
                    c.serve()
                else:
                    c.take_back()

    def resume(self, rx: fastpath.Receiver, frames: list[list[Any]]) -> None:
        """On the loop's thread: read a claimed connection here again, after dispatching the
        messages its actor's thread read off it and left (in their order)."""
        fd = rx.sock.fileno()
        self._claims.pop(fd, None)
        rx.claimed = False
        rx.dispatch = self._dispatch_direct
        if fd < 0 or rx not in self.fast_in:
            return  # closed meanwhile
        try:
            if self._watch is not None:
                self._watch.unregister(fd)
        except OSError:
            pass
        for f in frames:
            self._dispatch_direct(f)
        self.loop.add_reader(fd, self._read_direct, rx)

    def _dispatch_direct(self, frames: list[Any]) -> None:
        try:
            self.dispatch(frames)
        except Exception:
            logger.exception("dropped a message whose handler failed")

    def _guard_handshakes(self, sock: zmq.Socket[bytes], where: str, port: int) -> None:
        """Log refused handshakes of TCP inbox ``sock`` and keep the connections still in their
        handshake few and small (``_preauth.py``), from its monitor's events, on the loop's thread."""
        from zmq.utils.monitor import parse_monitor_message

        failures = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        # not ACCEPT_FAILED: out of descriptors, libzmq's listener retries its accept in a busy
        # loop, a failure event each time (400,000 in 5 s here), and reading those held the
        # loop's thread until the flood's handshakes timed out, its cut never made
        mon = sock.get_monitor_socket(events=functools.reduce(operator.or_, (*failures, *_preauth.FOLLOWED)))
        checking: list[asyncio.TimerHandle] = []

        def on_events() -> None:
            # edge-triggered FD, as for an inbox: read while EVENTS says so, and cut as the flood
            # comes: a flood accepted faster than this thread reads its events would otherwise
            # take every descriptor before the first look. Then let the loop serve the rest
            # (the zygote, controllers) before reading on.
            for _ in range(_MONITOR_BATCH):
                if mon.closed or not mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator, arg-type]
                    break
                ev = parse_monitor_message(mon.recv_multipart())
                if ev["event"] in failures:
                    self.dropped += 1
                    # libzmq reports our own endpoint here, not the peer's, so it is not named
                    self.sockets.refusals.refused(
                        "refused a connection on %s: the peer failed the security handshake (wrong cluster key or not monarch_nb)",
                        where,
                    )
                guard.event(int(ev["event"]), int(ev["value"]))
                if guard.due():
                    guard.check()
            else:
                self.loop.call_soon(on_events)
            if guard.pending and not checking:
                checking.append(self.loop.call_later(_preauth.CHECK_S, check))

        def check() -> None:
            checking.clear()
            if not mon.closed:
                guard.check()
                on_events()

        guard = _preauth.Handshakes(port, where, self.sockets.refusals)
        self._handshakes.append(guard)
        self.loop.add_reader(mon.FD, on_events)
        self.loop.call_soon(on_events)

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

    def add_route(self, route: Any) -> None:
        """Reach ``route.hosts`` through a gateway (a :class:`~.gateway.Route`); connections
        already open keep their path."""
        for h in route.hosts:
            self.sockets.routes[h] = route

    def remove_route(self, route: Any) -> None:
        for h in route.hosts:
            if self.sockets.routes.get(h) is route:
                del self.sockets.routes[h]

    def addr_for(self, peer: str) -> str:
        """Our inbox address as ``peer`` must see it."""
        if peer.startswith("ipc://"):
            return self.ipc_addr
        routes = self.sockets.routes
        if routes and peer.startswith("tcp://"):
            route = routes.get(split_tcp(peer)[0])
            if route is not None:
                # behind a gateway: the peer reaches us through its reverse listener, which
                # connects back to our TCP inbox
                if not self.tcp_addr:
                    self.ensure_tcp(route_ip(split_tcp(peer)[0]))
                return str(route.reply_addr)
        if self.tcp_addr:
            return self.tcp_addr
        return self.ensure_tcp(route_ip(split_tcp(peer)[0]))

    # ---------------------------------------------------------------- sending
    def send(self, addr: str, frames: list[Any], droppable: bool = False) -> bool:
        """Send ``frames`` to the inbox at ``addr``: directly to a process of this host from any
        thread but the I/O thread, else queued on zmq (which never blocks on the network).

        A peer's zmq queue holds at most ``send_hwm`` messages. When it is full, a ``droppable``
        message (a log line) is not sent and False returned; any other waits up to
        ``send_timeout`` for room (the I/O thread, which must keep answering, at most a second)
        and then raises :class:`ConnectError`: nothing but log lines is ever dropped silently."""
        if addr[0] == "i" and self.cfg.direct_ipc and threading.get_ident() != self.io_ident:
            conn = self._direct(addr)
            if conn is not None:
                try:
                    conn.send(frames)
                except OSError as e:
                    # the peer went away: like zmq, the message is lost with it (supervision
                    # reports the peer); this thread's later messages to it take zmq
                    logger.debug("direct send to %s failed (%s); dropped", addr, e)
                    self._tls.direct[addr] = None
                return True
        ob: _Outboxes | None = getattr(self._tls, "out", None)
        if ob is None:
            ob = self._tls.out = _Outboxes()
        s = ob.socks.get(addr)
        if s is None:
            s = self._connect(ob, addr)
        ob.used.add(addr)
        try:
            if len(frames) == 1:
                s.send(frames[0], zmq.NOBLOCK)
            else:
                s.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return self._send_when_room(ob, s, addr, frames, droppable)
        return True

    def _send_when_room(self, ob: _Outboxes, s: zmq.Socket[bytes], addr: str, frames: list[Any], droppable: bool) -> bool:
        if droppable:
            return False
        now = time.monotonic()
        timeout = self.cfg.send_timeout
        if threading.get_ident() == self.io_ident:
            timeout = min(timeout, 1.0)
        failed = ob.full_since.get(addr)
        # a peer that already let a whole wait pass fails at once until it reads again
        wait = 0.0 if failed is not None and now - failed < self.cfg.send_timeout else timeout
        if wait > 0 and s.poll(int(wait * 1000), zmq.POLLOUT):
            try:
                if len(frames) == 1:
                    s.send(frames[0], zmq.NOBLOCK)
                else:
                    s.send_multipart(frames, zmq.NOBLOCK, copy=False)
                ob.full_since.pop(addr, None)
                return True
            except zmq.Again:
                pass
        ob.full_since[addr] = time.monotonic()  # when the wait ended: it fails at once from here
        raise ConnectError(
            f"{addr} is not reading its messages: {self.cfg.send_hwm} are queued for it and none left "
            f"within {wait:.1f} s (a stopped, hung or overloaded peer); this message was not sent "
            "(MONARCH_NB_SEND_HWM / MONARCH_NB_SEND_TIMEOUT set the bounds)"
        )

    def _connect(self, ob: _Outboxes, addr: str) -> zmq.Socket[bytes]:
        check_form(addr)
        try:
            s = self.ctx.socket(zmq.DEALER)
        except zmq.ZMQError as e:
            if e.errno != errno.EMFILE:
                raise
            # the program holds every descriptor (a thread's first message to a peer opens one)
            starts = "Jupyter" if self.label == "controller" else f"this {self.label}"
            raise _fdlimit.out_of_descriptors(f"connecting to {addr}", starts) from None
        s.linger = 2000
        s.setsockopt(zmq.SNDHWM, self.cfg.send_hwm)
        self.sockets.secure_client(s, addr)
        s.connect(addr)
        ob.socks[addr] = s
        with self._lock:
            self._all_out.add(s)
        if len(ob.socks) > MAX_PEER_SOCKETS:
            self._evict(ob, time.monotonic(), keep=addr)
        return s

    def sweep_idle(self, now: float) -> int:
        """Close this thread's connections unused for ``peer_idle_close`` (called by their
        thread, as zmq sockets are not thread-safe); returns how many were closed."""
        ob: _Outboxes | None = getattr(self._tls, "out", None)
        if ob is None:
            return 0
        for addr in ob.used:
            ob.last_used[addr] = now
        ob.used.clear()
        idle = [a for a, t in ob.last_used.items() if now - t > self.cfg.peer_idle_close]
        for addr in idle:
            self._close_out(ob, addr, linger=0)
        return len(idle)

    def forget_peer(self, addr: str, linger: float = 0.0) -> None:
        """Close this thread's connection to ``addr`` (a peer known to be gone); what is still
        queued gets ``linger`` seconds to leave. A later message reconnects."""
        ob: _Outboxes | None = getattr(self._tls, "out", None)
        if ob is not None and addr in ob.socks:
            self._close_out(ob, addr, linger)

    def _evict(self, ob: _Outboxes, now: float, keep: str) -> None:
        for addr in ob.used:
            ob.last_used[addr] = now
        ob.used.clear()
        ob.last_used.setdefault(keep, now)
        for addr in sorted(ob.socks, key=lambda a: ob.last_used.get(a, 0.0))[: len(ob.socks) - MAX_PEER_SOCKETS]:
            if addr != keep:
                self._close_out(ob, addr, linger=1.0)  # the least recently used: what it queued may leave

    def _close_out(self, ob: _Outboxes, addr: str, linger: float) -> None:
        s = ob.socks.pop(addr)
        ob.last_used.pop(addr, None)
        ob.used.discard(addr)
        ob.full_since.pop(addr, None)
        with self._lock:
            self._all_out.discard(s)
        try:
            s.close(linger=int(linger * 1000))
        except zmq.ZMQError:
            pass

    def out_sockets(self) -> int:
        """How many zmq connections this thread holds."""
        ob: _Outboxes | None = getattr(self._tls, "out", None)
        return 0 if ob is None else len(ob.socks)

    def direct_conns(self) -> dict[str, fastpath.Sender | None] | None:
        """This thread's direct connections by address (None where the thread sends none:
        the I/O thread, or the direct path is off), for a sender writing to many peers in a row.
        An address not in it yet, or None there, goes through :meth:`send`."""
        if not self.cfg.direct_ipc or threading.get_ident() == self.io_ident:
            return None
        conns: dict[str, fastpath.Sender | None] | None = getattr(self._tls, "direct", None)
        if conns is None:
            conns = self._tls.direct = {}
        return conns

    def _direct(self, addr: str) -> fastpath.Sender | None:
        """This thread's direct connection to the process at ipc ``addr`` (None: use zmq)."""
        conns: dict[str, fastpath.Sender | None] | None = getattr(self._tls, "direct", None)
        if conns is None:
            conns = self._tls.direct = {}
        try:
            return conns[addr]
        except KeyError:
            pass
        if len(conns) >= getattr(self._tls, "prune_at", DIRECT_PRUNE_MIN):
            self._prune_direct(conns)
        try:
            conn: fastpath.Sender | None = fastpath.Sender(fastpath.path_for(addr))
        except OSError:
            conn = None  # a peer without a direct socket (or gone): zmq from this thread on
        conns[addr] = conn
        if conn is not None:
            with self._lock:
                self.fast_out.add(conn)
        return conn

    def _prune_direct(self, conns: dict[str, fastpath.Sender | None]) -> None:
        """Close this thread's direct connections whose peer closed its end (its process
        exited): nothing else does while the thread lives, and a notebook that spawns and stops
        meshes kept a descriptor per actor it had called, for the kernel's life. A receiver
        writes only its greeting, read before the connection is used, so one that can be read
        from has gone (a connection still waiting for its greeting, ``_q`` set, is left be)."""
        live = {addr: c for addr, c in conns.items() if c is not None and c._q is None}
        if live:
            ready = hung_up(c.sock for c in live.values())
            for addr, c in live.items():
                if c.sock.fileno() in ready:
                    del conns[addr]  # a later message to it connects again, or takes zmq
                    with self._lock:
                        self.fast_out.discard(c)
                    c.close()
        self._tls.prune_at = max(DIRECT_PRUNE_MIN, 2 * len(conns))

    # ---------------------------------------------------------------- closing
    def close_inboxes(self) -> None:
        """Stop reading (on the loop's thread)."""
        for s in self._inboxes:
            self.loop.remove_reader(s.FD)
            # a TCP inbox's monitor socket left open would hold ctx.term() forever
            mon = s._monitor_socket
            s.close(linger=0)
            if mon is not None:
                self.loop.remove_reader(mon.FD)
                mon.close(linger=0)

    def close_connections(self) -> None:
        """Close every connection; queued outgoing messages get a moment to leave."""
        for conn in list(self.fast_out):
            conn.close()
        for rx in self.fast_in:
            rx.sock.close()
        if self._fast_listener is not None:
            self._fast_listener.close()
            try:
                os.unlink(fastpath.path_for(self.ipc_addr))
            except OSError:
                pass
        with self._lock:
            out = list(self._all_out)
        for s in out:
            try:
                s.close(linger=200)
            except zmq.ZMQError:
                pass
        self.sockets.close()

    def terminate(self) -> None:
        """End the zmq context (after :meth:`close_connections`) and remove the inbox's socket file."""
        if self.label == "allocator":
            # a daemon that exits: a socket left to a TCP peer that went away (a controller on
            # another host) made term() wait forever, so SIGTERM (scancel, a job's kill()) hung
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()
        for addr in (self.ipc_addr, self.extra_ipc):
            if addr:
                try:
                    os.unlink(addr[len("ipc://") :])
                except OSError:
                    pass


def drain_wake(fd: int) -> None:
    """Consume the wake-ups an eventfd holds (a thread reading a claimed connection polls one
    beside it); none there is fine."""
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


class Claim:
    """A direct connection read by an idle actor's own thread (a sync actor's) or event loop (an
    async one's) instead of the runtime loop.

    A call that comes alone on a direct connection wakes the loop's thread, which hands it to
    the actor's thread (a second wake-up, and a wait for the GIL the first one still holds).
    An actor that claimed the connection waits on it itself: a call to it costs one wake-up.
    Anything else it reads (another actor's call, a port's value, a message out of order) it
    hands back with the connection, in order, to the runtime's loop (:meth:`give_back`). Until
    the actor takes it, and while it runs an endpoint (:meth:`busy` .. :meth:`idle`), the
    runtime's loop watches the connection, and takes it back for good once a byte arrives
    meanwhile, so pings, stacks and the debugger are served while the actor is busy, as on
    the loop.
    """

    IDLE, BUSY, GONE = 0, 1, 2
    __slots__ = ("t", "rx", "fd", "lock", "state", "got", "keep", "served")

    def __init__(self, t: Transport, rx: fastpath.Receiver, keep: bool = False) -> None:
        self.t = t
        self.rx = rx
        self.fd = rx.sock.fileno()
        self.lock = threading.Lock()
        self.state = Claim.BUSY
        #: what the loop does with a byte that comes while the claimant is elsewhere: read and
        #: dispatch what came and watch again, the claim kept (a controller's caller, whose
        #: reply often comes before it waits: a call's reply that wakes the proc on the
        #: caller's own CPU is written before the caller is back); or take the connection back
        #: for good (an actor's thread: a call read here would overtake those queued for it)
        self.keep = keep
        #: reads the loop made for it since the claimant last read (see :meth:`serve`)
        self.served = 0
        #: what the actor's thread read off the connection and has not taken yet
        self.got: list[list[Any]] = []
        rx.dispatch = self.got.append

    def read(self) -> list[list[Any]] | None:
        """(The actor's thread, when the connection is readable.) The whole messages read, or
        None: the connection ended (it went back to the loop, which closes it)."""
        if not self.rx.on_readable():
            self.give_back()
            return None
        got = self.got[:]
        self.got.clear()
        return got

    def busy(self) -> bool:
        """About to run an endpoint: the loop watches the connection meanwhile."""
        with self.lock:
            if self.state != Claim.IDLE:
                return False
            self.state = Claim.BUSY
            assert self.t._watch is not None
            try:
                self.t._watch.modify(self.fd, select.EPOLLIN | select.EPOLLONESHOT)
            except OSError:
                pass  # closed meanwhile (the process is ending)
            return True

    def idle(self) -> bool:
        """The endpoint is done: read it here again. False: the loop took it back meanwhile."""
        with self.lock:
            if self.state != Claim.BUSY:
                return self.state == Claim.IDLE
            self.state = Claim.IDLE
            self.served = 0
            assert self.t._watch is not None
            try:
                self.t._watch.modify(self.fd, select.EPOLLONESHOT)
            except OSError:
                pass  # closed meanwhile: the next read says so
            return True

    def give_back(self, frames: list[list[Any]] = (), cooldown: int = 0) -> None:  # type: ignore[assignment]
        """(The actor's thread.) The loop reads the connection again, after dispatching
        ``frames`` (read here, not taken); ``cooldown``: messages before it may be claimed again."""
        with self.lock:
            if self.state == Claim.GONE:
                return
            self.state = Claim.GONE
        self.rx.cooldown = cooldown
        try:
            self.t.loop.call_soon_threadsafe(self.t.resume, self.rx, [*frames, *self.got])
        except RuntimeError:
            pass  # the loop is closed: so is the connection

    def serve(self) -> None:
        """(The loop, a byte arrived while the claimant was elsewhere; :attr:`keep`.) Read and
        dispatch what came, in order, and watch the connection again; the claimant waits for
        the lock meanwhile, so the two never read it at once."""
        with self.lock:
            if self.state != Claim.BUSY:
                return  # idle again (it reads the bytes itself) or given back already
            self.served += 1
            # past 16 the claimant no longer reads here (the stream is a port's values, or its
            # thread calls elsewhere): the loop reads it as any other, at no extra cost
            if self.served <= 16 and self.rx.on_readable():
                frames = self.got[:]
                self.got.clear()
                for f in frames:
                    self.t._dispatch_direct(f)
                assert self.t._watch is not None
                try:
                    self.t._watch.modify(self.fd, select.EPOLLIN | select.EPOLLONESHOT)
                except OSError:
                    pass  # closed meanwhile: the next read says so
                return
            self.state = Claim.GONE  # given up, or the connection ended (the loop closes it)
            frames, self.got = self.got[:], []
        self.t.resume(self.rx, frames)

    def take_back(self) -> None:
        """(The loop, a byte arrived while the actor was busy.) Read it on the loop again."""
        with self.lock:
            if self.state != Claim.BUSY:
                return  # idle again (it reads the byte itself) or given back already
            self.state = Claim.GONE
        self.t.resume(self.rx, [])
