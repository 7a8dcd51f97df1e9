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
stream opens.
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

logger = logging.getLogger(__name__)

MAGIC = b"MNBGW1\n"
OPEN, OPENED, FAILED, DATA, CLOSE, ACCEPT = range(1, 7)
_HDR = struct.Struct("!BII")
_CHUNK = 256 * 1024
#: largest handshake document
_MAX_HELLO = 1 << 20
#: seconds for a handshake, a stream to open, a SOCKS negotiation
TIMEOUT = 15.0
#: seconds a session's reverse listener waits for the controller's next tunnel
SESSION_GRACE = 120.0
#: seconds between attempts to open a tunnel that dropped
RETRY_S = 1.0


class GatewayError(RuntimeError):
    """The tunnel could not be set up (refused key, wrong port, closed)."""


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
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise GatewayError("the tunnel closed during the handshake")
        buf += chunk
    return bytes(buf)


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
    return json.loads(raw), raw


class _Mux:
    """Streams over one tunnel: frames (type, stream id, length) + payload, written under a lock."""

    def __init__(self, tunnel: socket.socket, first_sid: int) -> None:
        self.tunnel = tunnel
        self.wlock = threading.Lock()
        self.streams: dict[int, socket.socket] = {}
        #: what arrived for a stream before its socket was attached (a zmq peer greets at once)
        self.pending: dict[int, list[bytes] | None] = {}
        self.waiting: dict[int, tuple[threading.Event, list[str]]] = {}
        self.lock = threading.Lock()
        self.next_sid = first_sid  # the client's ids are odd, the server's even: no clash
        self.closed = threading.Event()

    def new_sid(self) -> int:
        with self.lock:
            sid, self.next_sid = self.next_sid, self.next_sid + 2
            return sid

    def send(self, t: int, sid: int, payload: bytes = b"") -> bool:
        try:
            with self.wlock:
                self.tunnel.sendall(_HDR.pack(t, sid, len(payload)) + payload)
            return True
        except OSError:
            self.close()
            return False

    def expect(self, sid: int) -> None:
        """Hold what arrives for ``sid`` until :meth:`attach`."""
        with self.lock:
            self.pending[sid] = []

    def attach(self, sid: int, sock: socket.socket) -> None:
        with self.lock:
            held = self.pending.pop(sid, [])
            try:
                for b in held or ():
                    sock.sendall(b)  # under the lock: what arrives next goes after it
            except OSError:
                held = None
            if held is None:  # closed by the other end meanwhile
                sock.close()
                return
            self.streams[sid] = sock
        threading.Thread(target=self._pump, args=(sid, sock), name=f"gateway-stream-{sid}", daemon=True).start()

    def _pump(self, sid: int, sock: socket.socket) -> None:
        """Local socket -> tunnel, until either ends."""
        try:
            while True:
                data = sock.recv(_CHUNK)
                if not data or not self.send(DATA, sid, data):
                    break
        except OSError:
            pass
        if self._drop(sid):
            self.send(CLOSE, sid)

    def _drop(self, sid: int) -> bool:
        with self.lock:
            sock = self.streams.pop(sid, None)
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        return True

    def run(self, on_open: Callable[[int, str], None] | None, on_accept: Callable[[int], None] | None) -> None:
        """Tunnel -> local sockets, until the tunnel ends."""
        try:
            while True:
                t, sid, n = _HDR.unpack(_recv_exact(self.tunnel, _HDR.size))
                payload = _recv_exact(self.tunnel, n) if n else b""
                if t == DATA:
                    with self.lock:
                        sock = self.streams.get(sid)
                        held = self.pending.get(sid)
                        if sock is None and held is not None:
                            held.append(payload)
                    if sock is not None:
                        try:
                            sock.sendall(payload)
                        except OSError:
                            if self._drop(sid):
                                self.send(CLOSE, sid)
                elif t == CLOSE:
                    with self.lock:
                        if sid in self.pending:
                            self.pending[sid] = None
                    self._drop(sid)
                elif t in (OPENED, FAILED):
                    w = self.waiting.pop(sid, None)
                    if w is not None:
                        w[1].append(payload.decode() if t == FAILED else "")
                        w[0].set()
                elif t == OPEN and on_open is not None:
                    threading.Thread(target=on_open, args=(sid, payload.decode()), daemon=True).start()
                elif t == ACCEPT and on_accept is not None:
                    on_accept(sid)
        except (GatewayError, OSError, struct.error):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            self.tunnel.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.tunnel.close()
        with self.lock:
            sids = list(self.streams)
        for sid in sids:
            self._drop(sid)
        for ev, why in list(self.waiting.values()):
            why.append("the tunnel closed")
            ev.set()


# ------------------------------------------------------------------ the cluster's end


class _Session:
    """One controller's tunnels, one after another: its reverse listener outlives a tunnel
    that drops, so the reply address the procs were given stays valid."""

    def __init__(self, reverse: socket.socket) -> None:
        self.reverse = reverse
        self.mux: _Mux | None = None


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
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="gateway", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="gateway-tunnel", daemon=True).start()

    def _session(self, name: str) -> _Session:
        with self.lock:
            sess = self.sessions.get(name)
            if sess is None:
                sess = self.sessions[name] = _Session(socket.create_server((self.reverse_ip, 0)))
                threading.Thread(target=self._accept_reverse, args=(sess,), name="gateway-reverse", daemon=True).start()
            return sess

    def _accept_reverse(self, sess: _Session) -> None:
        while True:
            try:
                c, _ = sess.reverse.accept()
            except OSError:
                return
            mux = sess.mux
            if mux is None or mux.closed.is_set():
                c.close()  # between tunnels: the peer's zmq connects again
                continue
            sid = mux.new_sid()
            mux.expect(sid)
            mux.send(ACCEPT, sid)
            mux.attach(sid, c)

    def _expire(self, name: str, sess: _Session) -> None:
        with self.lock:
            if sess.mux is not None or self.sessions.get(name) is not sess:
                return
            del self.sessions[name]
        sess.reverse.close()
        logger.info("gateway: session %s ended (no tunnel for %.0f s)", name[:8], SESSION_GRACE)

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
        mux = _Mux(conn, first_sid=2)
        old, sess.mux = sess.mux, mux
        if old is not None:
            old.close()
        logger.info("gateway: tunnel open, %d hosts, answers at %s", len(allow), sess.reverse.getsockname())

        def on_open(sid: int, dest: str) -> None:
            host, _, port = dest.rpartition(":")
            host = host.strip("[]")
            if host not in allow:
                mux.send(FAILED, sid, f"{host} is not an allocator of this job".encode())
                return
            try:
                s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
                s.settimeout(None)
            except (OSError, ValueError) as e:
                mux.send(FAILED, sid, str(e).encode())
                return
            mux.expect(sid)
            mux.send(OPENED, sid)
            mux.attach(sid, s)

        try:
            mux.run(on_open, None)
        finally:
            with self.lock:
                if sess.mux is mux:
                    sess.mux = None
                    # the reply address stays valid a while, for the controller's next tunnel
                    t = threading.Timer(SESSION_GRACE, self._expire, args=(name, sess))
                    t.daemon = True
                    t.start()
            logger.info("gateway: tunnel closed")

    def close(self) -> None:
        self.sock.close()
        with self.lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for sess in sessions:
            sess.reverse.close()
            if sess.mux is not None:
                sess.mux.close()


# ------------------------------------------------------------------ the controller's end


class GatewayClient:
    """The controller's end: ``connect`` opens a tunnel (a connected stream socket to a
    :class:`GatewayServer`), now and again whenever the last one dropped; ``hosts`` are the
    addresses to reach behind it; ``inbox`` returns the controller's TCP inbox address (streams
    from the cluster connect there). The SOCKS5 end, its password and the reply address stay
    the same across tunnels, so sockets already made keep working."""

    def __init__(self, connect: Callable[[], socket.socket], key: bytes, hosts: list[str], inbox: Callable[[], str]) -> None:
        self._connect = connect
        self.key = key
        self.hosts = sorted(set(hosts))
        self.inbox = inbox
        self.session = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = 0.0
        self.reverse = ""
        self.mux = self._open()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.username = secrets.token_hex(8)
        self.password = secrets.token_hex(16)
        self.proxy = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.route = Route(frozenset(hosts), self.proxy, self.username, self.password, self.reverse)
        threading.Thread(target=self._accept, name="gateway-socks", daemon=True).start()

    def _open(self) -> _Mux:
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
            raise GatewayError(
                f"the gateway restarted (answers now at {reverse}, not {self.reverse}): re-attach with job.state() in a new kernel"
            )
        self.reverse = reverse
        mux = _Mux(tunnel, first_sid=1)
        threading.Thread(
            target=mux.run, args=(None, lambda sid: self._on_accept(mux, sid)), name="gateway-tunnel", daemon=True
        ).start()
        return mux

    def _handshake(self, tunnel: socket.socket) -> str:
        tunnel.settimeout(TIMEOUT)
        try:
            head = _recv_exact(tunnel, len(MAGIC) + 32)
        except OSError as e:
            raise GatewayError(f"no gateway answered on the tunnel ({e})") from None
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
        except GatewayError:
            raise GatewayError("the gateway refused the tunnel: it holds another cluster key") from None
        if not hmac.compare_digest(mac, _mac(self.key, b"server", nonce_c, nonce_s, raw)):
            raise GatewayError("the gateway does not hold the cluster key: refused")
        tunnel.settimeout(None)
        return str(doc["reverse"])

    def _live(self) -> _Mux:
        """The current tunnel, opened again if it dropped (at most once per RETRY_S)."""
        with self._lock:
            if self._closed:
                raise GatewayError("the gateway is closed")
            if not self.mux.closed.is_set():
                return self.mux
            now = time.monotonic()
            if now < self._retry_at:
                raise GatewayError("the tunnel dropped; opening it again failed a moment ago")
            logger.warning("gateway: the tunnel dropped; opening a new one")
            try:
                self.mux = self._open()
            except GatewayError:
                self._retry_at = now + RETRY_S
                raise
            return self.mux

    @property
    def alive(self) -> bool:
        return not self._closed

    def _on_accept(self, mux: _Mux, sid: int) -> None:
        from .transport import split_tcp

        try:
            s = socket.create_connection(split_tcp(self.inbox()), timeout=TIMEOUT)
            s.settimeout(None)
        except OSError:
            mux.send(CLOSE, sid)
            return
        mux.attach(sid, s)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
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
            sid = mux.new_sid()
            ev, why = threading.Event(), []  # type: ignore[var-annotated]
            mux.waiting[sid] = (ev, why)
            mux.expect(sid)
            if not mux.send(OPEN, sid, f"{host}:{port}".encode()) or not ev.wait(TIMEOUT) or why[0]:
                mux.waiting.pop(sid, None)
                mux.pending.pop(sid, None)
                conn.sendall(b"\x05\x05\x00\x01" + bytes(6))
                raise GatewayError(f"connect to {host}:{port} through the gateway failed: {why[0] if why else 'no answer'}")
            conn.sendall(b"\x05\x00\x00\x01" + bytes(6))
            conn.settimeout(None)
            mux.attach(sid, conn)
        except (OSError, GatewayError, ValueError) as e:
            logger.debug("gateway: %s", e)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.listener.close()
        self.mux.close()


__all__ = ["GatewayClient", "GatewayError", "GatewayServer", "Route"]
