"""A gateway into a cluster network the controller cannot route to (a notebook outside
Kubernetes): every connection between the controller and the job's hosts rides one tunnel, a
single byte stream the controller opened (a Kubernetes port-forward, or any TCP connection).

Why bytes and not messages: the allocators' FANOUT relay delivers one message to the relaying
allocator's own procs, and every answer goes straight to the reply address the message names.
Relaying calls and replies message by message would put an allocator on the hot path of every
message and give replies a second route. A byte tunnel keeps the runtime as it is: zmq connects
through a SOCKS5 proxy (``ZMQ_SOCKS_PROXY``) and CurveZMQ still runs end to end, so the gateway
never sees a message and cannot forge one.

Two ends, multiplexing streams over the tunnel:

- :class:`GatewayServer`, in one allocator of the job (``monarch-nb allocator --gateway
  127.0.0.1:PORT``): listens on the pod's loopback only (a port-forward connects there; no other
  pod can), and per tunnel a reverse listener on the host's routable address. A stream the
  controller opens goes to ``ip:port`` only for the hosts it named in the authenticated
  handshake (the job's allocators); a connection to the reverse listener (a proc answering the
  controller) becomes a stream back to the controller.
- :class:`GatewayClient`, in the controller: a SOCKS5 proxy on 127.0.0.1 with a random user
  name and password (zmq's SOCKS client authenticates; other local users cannot use it), whose
  connections become streams; streams from the server are connected to the controller's own
  TCP inbox.

The handshake proves both ends hold the cluster key (HMAC-SHA256 over both nonces), before any
stream opens. A session's streams outlive its tunnels: when one drops, the next resumes them
without losing a byte (``_tunnel.py``, which owns the frames).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import _fdlimit
from ._greeting import Greeting
from ._refusals import Refusals
from ._tunnel import ACCEPT, BYE, FAILED, OPENED, Mux, Streams, TunnelError, recv_exact

logger = logging.getLogger(__name__)

MAGIC = b"MNBGW2\n"
#: largest handshake document
_MAX_HELLO = 1 << 20
#: seconds for a handshake, a stream to open, a SOCKS negotiation
TIMEOUT = 15.0
#: SOCKS5 negotiations at once (the controller's own: one per connection zmq opens to a pod);
#: past it the oldest is cut. Its port is on 127.0.0.1, where every local user can connect
SOCKS_GREETING_MAX = 32
#: seconds a session's reverse listener and streams wait for the controller's next tunnel
SESSION_GRACE = 120.0
#: seconds between attempts to open a tunnel that dropped
RETRY_S = 1.0


class GatewayError(RuntimeError):
    """The tunnel could not be set up (refused key, wrong port, closed)."""


class _Gone(GatewayError):
    """No tunnel of this session will open again (the gateway restarted, or this end closed)."""


class _Closed(GatewayError):
    """The other end closed the tunnel during the handshake."""


@dataclass(frozen=True)
class Route:
    """Hosts behind a gateway, as the transport uses them: connect through ``proxy`` (SOCKS5 with
    ``username``/``password``), and give ``reply_addr`` as the address they reach us at."""

    hosts: frozenset[str]
    proxy: str
    username: str
    password: str
    reply_addr: str


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    try:
        return bytes(recv_exact(sock, n))
    except TunnelError:
        raise _Closed("the tunnel closed during the handshake") from None


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"monarch-nb gateway\0" + b"\0".join(parts), hashlib.sha256).digest()


def _send_doc(sock: socket.socket, doc: dict[str, object]) -> bytes:
    raw = json.dumps(doc).encode()
    sock.sendall(struct.pack("!I", len(raw)) + raw)
    return raw


def _recv_doc(sock: socket.socket) -> tuple[dict[str, object], bytes]:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > _MAX_HELLO:
        raise GatewayError("handshake document too large")
    raw = _recv_exact(sock, n)
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise GatewayError(
            "the other end's handshake document is not a JSON object (is it a monarch_nb gateway of this version?)"
        )
    return doc, raw


# ------------------------------------------------------------------ the cluster's end


class _Session:
    """One controller's tunnels, one after another: its reverse listener and its streams outlive
    a tunnel that drops, so the reply address the procs were given stays valid and the
    connections riding the tunnel never notice."""

    def __init__(self, reverse: socket.socket, on_bye: Callable[[], None]) -> None:
        self.reverse = reverse
        self.mux: Mux | None = None
        self.gen = 0
        #: the job's allocators, as the last handshake named them: where a stream may lead
        self.allow: set[str] = set()
        self.streams = Streams(first_sid=2, on_open=self._on_open, on_bye=on_bye)

    def _on_open(self, mux: Mux, sid: int, dest: str) -> None:
        host, _, port = dest.rpartition(":")
        host = host.strip("[]")
        if host not in self.allow:
            mux.send(FAILED, sid, 0, f"{host} is not an allocator of this job".encode())
            return
        try:
            s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
            s.settimeout(None)
        except (OSError, ValueError) as e:
            mux.send(FAILED, sid, 0, str(e).encode())
            return
        self.streams.expect(sid, mux)
        mux.send(OPENED, sid)
        self.streams.attach(sid, s)

    def close(self) -> None:
        self.reverse.close()
        self.streams.close_all()
        if self.mux is not None:
            self.mux.close()


class GatewayServer:
    """Serves tunnels on ``listen`` (loopback of the pod) for holders of ``key``; reverse
    listeners bind ``reverse_ip`` (the address the job's other hosts reach this one at)."""

    def __init__(self, listen: tuple[str, int], reverse_ip: str, key: bytes) -> None:
        if not ipaddress.ip_address(listen[0]).is_loopback:
            # only a port-forward (or someone on this host) may reach it
            raise ValueError(f"the gateway listens on loopback only, not {listen[0]}")
        self.key = key
        self.reverse_ip = reverse_ip
        self.sock = socket.create_server(listen)
        self.addr = self.sock.getsockname()
        self.tunnels = 0
        self.refusals = Refusals(logger)
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="gateway", daemon=True).start()

    def _accept(self) -> None:
        while (conn := _fdlimit.accept(self.sock, "the gateway", self.refusals.refused)) is not None:
            threading.Thread(target=self._serve, args=(conn,), name="gateway-tunnel", daemon=True).start()

    def _session(self, name: str) -> _Session:
        with self.lock:
            sess = self.sessions.get(name)
            if sess is None:
                sess = self.sessions[name] = _Session(
                    socket.create_server((self.reverse_ip, 0)), on_bye=lambda: self._end(name, "the controller closed it")
                )
                threading.Thread(target=self._accept_reverse, args=(sess,), name="gateway-reverse", daemon=True).start()
            return sess

    def _accept_reverse(self, sess: _Session) -> None:
        while (c := _fdlimit.accept(sess.reverse, "the gateway's reverse listener", self.refusals.refused)) is not None:
            mux = sess.mux
            if mux is None or mux.closed.is_set():
                c.close()  # between tunnels: the peer's zmq connects again
                continue
            sid = sess.streams.new_sid()
            sess.streams.expect(sid, mux)
            mux.send(ACCEPT, sid)
            sess.streams.attach(sid, c)

    def _expire(self, name: str, sess: _Session) -> None:
        self._end(name, f"no tunnel for {SESSION_GRACE:.0f} s", idle=sess)

    def _end(self, name: str, why: str, idle: _Session | None = None) -> None:
        """End session ``name``; ``idle``: only if it is still that session, with no tunnel."""
        with self.lock:
            sess = self.sessions.get(name)
            if sess is None or (idle is not None and (sess is not idle or sess.mux is not None)):
                return
            del self.sessions[name]
        sess.close()
        logger.info("gateway: session %s ended (%s)", name[:8], why)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        try:
            nonce_s = secrets.token_bytes(32)
            conn.sendall(MAGIC + nonce_s)
            nonce_c = _recv_exact(conn, 32)
            hello, raw = _recv_doc(conn)
            if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self.key, b"client", nonce_s, nonce_c, raw)):
                logger.warning("gateway: refused a tunnel: the peer does not hold the cluster key")
                conn.close()
                return
            hosts = hello.get("hosts")
            allow = {str(ipaddress.ip_address(str(h))) for h in hosts} if isinstance(hosts, list) else set()
            name = str(hello.get("session") or secrets.token_hex(16))
            sess = self._session(name)
            raw = _send_doc(conn, {"reverse": f"tcp://{self.reverse_ip}:{sess.reverse.getsockname()[1]}"})
            conn.sendall(_mac(self.key, b"server", nonce_c, nonce_s, raw))
        except (OSError, GatewayError, ValueError, TypeError) as e:
            logger.warning("gateway: a tunnel failed its handshake: %s", e)
            conn.close()
            return
        conn.settimeout(None)
        self.tunnels += 1
        with self.lock:
            sess.gen += 1
            mux = Mux(conn, sess.gen)
            old, sess.mux, sess.allow = sess.mux, mux, allow
        if old is not None:
            old.close()
        sess.streams.bind(mux)
        logger.info("gateway: tunnel open, %d hosts, answers at %s", len(allow), sess.reverse.getsockname())
        try:
            mux.run(sess.streams.on_frame)
        finally:
            sess.streams.down(mux)
            with self.lock:
                if sess.mux is mux:
                    sess.mux = None
                    # the reply address and the streams stay a while, for the controller's next tunnel
                    t = threading.Timer(SESSION_GRACE, self._expire, args=(name, sess))
                    t.daemon = True
                    t.start()
            logger.info("gateway: tunnel closed")

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for sess in sessions:
            sess.close()


# ------------------------------------------------------------------ the controller's end


class GatewayClient:
    """The controller's end: ``connect`` opens a tunnel (a connected stream socket to a
    :class:`GatewayServer`), now and again whenever the last one dropped; ``hosts`` are the
    addresses to reach behind it; ``inbox`` returns the controller's TCP inbox address (streams
    from the cluster connect there). The SOCKS5 end, its password, the reply address and the
    streams stay the same across tunnels, so connections already made keep working and lose
    nothing when a tunnel drops: the next one opens at once and the streams resume on it."""

    def __init__(self, connect: Callable[[], socket.socket], key: bytes, hosts: list[str], inbox: Callable[[], str]) -> None:
        self._connect = connect
        self.key = key
        self.hosts = sorted(set(hosts))
        self.inbox = inbox
        self.session = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = 0.0
        #: close() ends a wait between attempts to open a tunnel again
        self._closing = threading.Event()
        #: why no tunnel of this session opens again (the gateway restarted): said every time
        self._gone = ""
        self._gen = 0
        self.reverse = ""
        self.streams = Streams(first_sid=1, on_accept=self._on_accept)
        self.refusals = Refusals(logger)
        #: SOCKS5 connections still negotiating: each holds a thread of the kernel for up to
        #: TIMEOUT a byte, and every local user can connect
        self._greeting = Greeting(
            SOCKS_GREETING_MAX, self.refusals, "the gateway's SOCKS5 end cut a connection still negotiating: more than %d at once"
        )
        self.mux = self._open()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.username = secrets.token_hex(8)
        self.password = secrets.token_hex(16)
        self.proxy = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.route = Route(frozenset(hosts), self.proxy, self.username, self.password, self.reverse)
        threading.Thread(target=self._accept, name="gateway-socks", daemon=True).start()

    def _open(self) -> Mux:
        try:
            tunnel = self._connect()
        except Exception as e:  # whatever the way in raises (a refused port-forward, a closed port)
            raise GatewayError(f"cannot open a tunnel: {e}") from None
        try:
            reverse = self._handshake(tunnel)
        except BaseException:
            tunnel.close()
            raise
        if self.reverse and reverse != self.reverse:
            tunnel.close()
            raise _Gone(
                f"the gateway restarted (answers now at {reverse}, not {self.reverse}): re-attach with job.state() in a new kernel"
            )
        self.reverse = reverse
        self._gen += 1
        mux = self.mux = Mux(tunnel, self._gen)
        self.streams.bind(mux)
        threading.Thread(target=self._run, args=(mux,), name="gateway-tunnel", daemon=True).start()
        return mux

    def _run(self, mux: Mux) -> None:
        try:
            mux.run(self.streams.on_frame)
        finally:
            self.streams.down(mux)
            if not self._closed and len(self.streams):
                threading.Thread(target=self._reopen, name="gateway-reopen", daemon=True).start()

    def _reopen(self) -> None:
        """The tunnel dropped with streams on it: they wait for the next one, opened now rather
        than at the next new connection (zmq's own connections never notice the drop)."""
        deadline = time.monotonic() + SESSION_GRACE
        while not self._closed:
            try:
                self._live()
                return
            except _Gone:
                break
            except GatewayError as e:
                if time.monotonic() > deadline:
                    logger.warning("gateway: no tunnel for %.0f s (%s); its connections are closed", SESSION_GRACE, e)
                    break
            self._closing.wait(RETRY_S)
        self.streams.close_all()

    def _handshake(self, tunnel: socket.socket) -> str:
        tunnel.settimeout(TIMEOUT)
        try:
            head = _recv_exact(tunnel, len(MAGIC) + 32)
        except OSError as e:
            raise GatewayError(f"no gateway answered on the tunnel ({e})") from None
        if head.startswith(MAGIC[:5]) and not head.startswith(MAGIC):
            raise GatewayError(
                f"the gateway speaks tunnel protocol {head[5:6].decode(errors='replace')}, this controller "
                f"{MAGIC[5:6].decode()}: install the same monarch_nb on the cluster's image and in the notebook"
            )
        if not head.startswith(MAGIC):
            raise GatewayError("the tunnel does not lead to a monarch_nb gateway (is the allocator started with --gateway?)")
        nonce_s = head[len(MAGIC) :]
        nonce_c = secrets.token_bytes(32)
        tunnel.sendall(nonce_c)
        raw = _send_doc(tunnel, {"hosts": self.hosts, "session": self.session})
        tunnel.sendall(_mac(self.key, b"client", nonce_s, nonce_c, raw))
        try:
            doc, raw = _recv_doc(tunnel)
            mac = _recv_exact(tunnel, 32)
        except _Closed:
            raise GatewayError("the gateway refused the tunnel: it holds another cluster key") from None
        if not hmac.compare_digest(mac, _mac(self.key, b"server", nonce_c, nonce_s, raw)):
            raise GatewayError("the gateway does not hold the cluster key: refused")
        reverse = doc.get("reverse")
        if not isinstance(reverse, str) or not reverse.startswith("tcp://"):
            raise GatewayError(
                f"the gateway gave no reply address (got {reverse!r}): install the same monarch_nb on the cluster's image and in the notebook"
            )
        tunnel.settimeout(None)
        return reverse

    def _live(self) -> Mux:
        """The current tunnel, opened again if it dropped (at most once per RETRY_S)."""
        with self._lock:
            if self._closed:
                raise _Gone("the gateway is closed")
            if self._gone:
                raise _Gone(self._gone)
            if not self.mux.closed.is_set():
                return self.mux
            now = time.monotonic()
            if now < self._retry_at:
                raise GatewayError("the tunnel dropped; opening it again failed a moment ago")
            logger.warning("gateway: the tunnel dropped; opening a new one")
            try:
                return self._open()
            except _Gone as e:
                self._gone = str(e)
                raise
            except GatewayError:
                self._retry_at = now + RETRY_S
                raise

    @property
    def alive(self) -> bool:
        return not self._closed

    def _on_accept(self, mux: Mux, sid: int) -> None:
        from .transport import split_tcp

        self.streams.expect(sid, mux)  # before the reader's next frame: its bytes are held
        try:
            s = socket.create_connection(split_tcp(self.inbox()), timeout=TIMEOUT)
            s.settimeout(None)
        except OSError:
            self.streams.refuse(mux, sid)
            return
        self.streams.attach(sid, s)

    def _accept(self) -> None:
        while (conn := _fdlimit.accept(self.listener, "the gateway's SOCKS5 end", self.refusals.refused)) is not None:
            self._greeting.begin(conn)
            threading.Thread(target=self._socks, args=(conn,), name="gateway-socks-conn", daemon=True).start()

    def _socks(self, conn: socket.socket) -> None:
        """RFC 1928 CONNECT with RFC 1929 user/password: what zmq's SOCKS client speaks."""
        conn.settimeout(TIMEOUT)
        try:
            ver, n = _recv_exact(conn, 2)
            methods = _recv_exact(conn, n)
            if ver != 5 or 2 not in methods:
                conn.sendall(b"\x05\xff")
                raise GatewayError("SOCKS client without user/password")
            conn.sendall(b"\x05\x02")
            _, ulen = _recv_exact(conn, 2)
            user = _recv_exact(conn, ulen)
            (plen,) = _recv_exact(conn, 1)
            password = _recv_exact(conn, plen)
            ok = hmac.compare_digest(user, self.username.encode()) and hmac.compare_digest(password, self.password.encode())
            conn.sendall(b"\x01\x00" if ok else b"\x01\x01")
            if not ok:
                raise GatewayError("SOCKS client with the wrong password")
            ver, cmd, _, atyp = _recv_exact(conn, 4)
            if atyp == 1:
                host = socket.inet_ntop(socket.AF_INET, _recv_exact(conn, 4))
            elif atyp == 4:
                host = socket.inet_ntop(socket.AF_INET6, _recv_exact(conn, 16))
            else:
                (hl,) = _recv_exact(conn, 1)
                host = _recv_exact(conn, hl).decode()
            (port,) = struct.unpack("!H", _recv_exact(conn, 2))
            if cmd != 1:
                conn.sendall(b"\x05\x07\x00\x01" + bytes(6))
                raise GatewayError("SOCKS command other than CONNECT")
            try:
                mux = self._live()
            except GatewayError:
                conn.sendall(b"\x05\x01\x00\x01" + bytes(6))
                raise
            try:
                sid = self.streams.open(mux, f"{host}:{port}", TIMEOUT)
            except TunnelError as e:
                conn.sendall(b"\x05\x05\x00\x01" + bytes(6))
                raise GatewayError(f"connect to {host}:{port} through the gateway failed: {e}") from None
            conn.sendall(b"\x05\x00\x00\x01" + bytes(6))
            conn.settimeout(None)
            self.streams.attach(sid, conn)
        except (OSError, GatewayError, ValueError) as e:
            logger.debug("gateway: %s", e)
            conn.close()
        finally:
            self._greeting.done(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._closing.set()
        self.listener.close()
        self.mux.send(BYE, 0)  # the gateway closes the session's streams now, not in 120 s
        self.mux.close()
        self.streams.close_all()


__all__ = ["GatewayClient", "GatewayError", "GatewayServer", "Route"]
