"""The data plane: bulk bytes straight between two procs, never through a controller or allocator.

A process that owns buffers runs one :class:`DataServer`, started on its first buffer: an accept
thread per listener and a thread per connection, so a read or write completes while the owner's
actor thread is busy in a long endpoint.

* Same host, buffer in shared memory: no server at all. The owner's storage lives in an
  unlinked shared-memory file whose descriptor the owner keeps open; a reader opens it through
  ``/proc/<owner pid>/fd/<n>`` (checked against the file's device and inode, so a reused
  descriptor number is never mistaken for it), maps it once, and copies with ``memmove``: one
  copy at memory speed, no socket. The owner closing that descriptor (``drop()``) is what tells
  readers the buffer is gone; their mappings of it are let go on their next look.
* Same host otherwise (a ``memoryview``, a CUDA tensor, or /dev/shm full): an abstract unix
  socket (nothing on disk to leave behind), the peer's uid checked on accept.
* Across hosts: TCP on the proc's cluster address. Both ends prove they hold the cluster key
  (HMAC challenge-response over fresh nonces, the key never on the wire), derive one AES-256-GCM
  key per direction for this connection, and seal every record of every message: requests,
  replies and payload (the nonce is a record counter, so a replayed, dropped or reordered record
  fails authentication). A large transfer may be split into byte ranges over several such
  connections (:func:`streams_for`; one by default: more never won on the machines measured).
* CUDA buffers, same host: a reader that sees the owner's GPU asks the owner (``OP_IPC``) for a
  CUDA IPC handle of its own and copies device to device from then on (``rdma/_buffer.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._newest import Newest
from . import _fdlimit, _libc
from ._greeting import Greeting
from ._hangup import hung_up
from ._refusals import Refusals

logger = logging.getLogger(__name__)

# request: op, buffer id, offset, length; reply: status, length of what follows
_REQ = struct.Struct("!B16sQQ")
_RSP = struct.Struct("!BQ")
OP_READ, OP_WRITE, OP_DROP, OP_IPC = 1, 2, 3, 4
ST_OK, ST_GONE, ST_BAD = 0, 1, 2
_MAGIC = b"MNBDP1"
_NONCE = 32
# plaintext per sealed record: small enough that the reader decrypts one record while the
# next is sealed and on the wire (a whole 1 MiB record would make the three happen in turn)
_REC = 256 << 10
_TAG = 16
#: a payload this large is moved in pieces so that a CUDA owner stages through a bounded buffer
PIECE = 8 << 20


class PeerGone(ConnectionError):
    """The owner's process cannot be reached any more (it died, or its host is unreachable)."""


class BufferGone(RuntimeError):
    """The owner answered, but the buffer was dropped (or never existed there)."""


class Stalled(TimeoutError):
    pass


class OutOfDescriptors(OSError):
    """This process has no file descriptor left for a transfer: its own state, not the owner's
    (which must then not be called gone or dropped)."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EMFILE, what)


def _no_descriptor(e: OSError) -> bool:
    return e.errno in (errno.EMFILE, errno.ENFILE)


# ------------------------------------------------------------------------------------- identity
def host_id() -> str:
    """What two processes share iff they share memory and /proc: the same kernel boot and the
    same network namespace (test "hosts" are network namespaces on one kernel)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            net = os.stat("/proc/self/ns/net").st_ino
        except OSError as e:
            if _no_descriptor(e):
                # not for good: remembered, it would make every owner of this host look remote
                raise OutOfDescriptors("telling which host this process is on (/proc)") from e
            boot, net = secrets.token_hex(8), 0  # no /proc: never "the same host" as anyone
        _HOST_ID = f"{boot}:{net}"
    return _HOST_ID


_HOST_ID: str | None = None


#: the kernel's "this task is exiting" flag in /proc/<pid>/stat, set before its descriptors close
_PF_EXITING = 0x4


def start_time(pid: int) -> int:
    """The kernel's start time of ``pid`` (0 if gone): with the pid, names one process for good.
    A process killed or exiting counts as gone at once: its sockets close before its parent
    reaps it, and a reader that saw them close must not take it for alive (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read()
        fields = s[s.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X") or int(fields[6]) & _PF_EXITING:
            return 0
        return int(fields[19])
    except OSError as e:
        if _no_descriptor(e):
            raise OutOfDescriptors(f"telling whether process {pid} is alive (/proc)") from e
        return 0
    except (ValueError, IndexError):
        return 0


# -------------------------------------------------------------------------------------- channels
def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, mv.nbytes
    while got < n:
        k = sock.recv_into(mv[got:], n - got)
        if k == 0:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k


class _Plain:
    """A unix-socket connection: payloads go as they are (same user, 0600 socket)."""

    sealed = False
    reused = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: Any) -> None:
        self.sock.sendall(data)

    def recv_into(self, mv: memoryview) -> None:
        _recv_exact(self.sock, mv)

    def close(self) -> None:
        self.sock.close()


class _Sealed:
    """A TCP connection whose every record is AES-256-GCM with keys made for this connection."""

    sealed = True
    reused = False

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.sock = sock
        self._enc, self._dec = AESGCM(send_key), AESGCM(recv_key)
        self._sent = self._recvd = 0
        self._out = bytearray(4 + _REC + _TAG)
        self._in = bytearray(_REC + _TAG)
        self._hdr = bytearray(4)

    def send(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        out = memoryview(self._out)
        for off in range(0, mv.nbytes, _REC):
            chunk = mv[off : off + _REC]
            m = chunk.nbytes + _TAG
            hdr = struct.pack("!I", m)
            out[:4] = hdr
            self._enc.encrypt_into(self._sent.to_bytes(12, "big"), chunk, hdr, out[4 : 4 + m])
            self._sent += 1
            self.sock.sendall(out[: 4 + m])  # header and record in one write: one packet, not two

    def recv_into(self, mv: memoryview) -> None:
        n, got = mv.nbytes, 0
        ct = memoryview(self._in)
        while got < n:
            _recv_exact(self.sock, memoryview(self._hdr))
            (m,) = struct.unpack("!I", self._hdr)
            if m <= _TAG or m > _REC + _TAG or m - _TAG > n - got:
                raise ConnectionResetError(f"malformed sealed record of {m} bytes")
            _recv_exact(self.sock, ct[:m])
            try:
                self._dec.decrypt_into(self._recvd.to_bytes(12, "big"), ct[:m], bytes(self._hdr), mv[got : got + m - _TAG])
            except Exception as e:  # cryptography's InvalidTag: forged, replayed, reordered or cut
                logger.warning("dropped a data-plane connection: a record failed authentication")
                raise ConnectionResetError("a sealed record failed authentication") from e
            self._recvd += 1
            got += m - _TAG

    def close(self) -> None:
        self.sock.close()


def _tune_tcp(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # a peer host that vanished (no RST) fails a blocked send within a minute, and an idle pooled
    # connection to it is found dead by keepalive, instead of a server thread waiting forever
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    with contextlib.suppress(AttributeError, OSError):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 60_000)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _client_handshake(sock: socket.socket, key: bytes) -> _Sealed:
    cn = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + cn)
    got = bytearray(_NONCE + 32)
    _recv_exact(sock, memoryview(got))
    sn, proof = bytes(got[:_NONCE]), bytes(got[_NONCE:])
    if not hmac.compare_digest(proof, _mac(key, b"server", cn, sn)):
        raise PermissionError("the owner's data server does not hold this cluster's key")
    sock.sendall(_mac(key, b"client", cn, sn))
    return _Sealed(sock, _mac(key, b"c2s", cn, sn), _mac(key, b"s2c", cn, sn))


def _server_handshake(sock: socket.socket, key: bytes) -> _Sealed | None:
    hello = bytearray(len(_MAGIC) + _NONCE)
    _recv_exact(sock, memoryview(hello))
    if bytes(hello[: len(_MAGIC)]) != _MAGIC:
        return None
    cn, sn = bytes(hello[len(_MAGIC) :]), secrets.token_bytes(_NONCE)
    sock.sendall(sn + _mac(key, b"server", cn, sn))
    proof = bytearray(32)
    _recv_exact(sock, memoryview(proof))
    if not hmac.compare_digest(bytes(proof), _mac(key, b"client", cn, sn)):
        return None
    return _Sealed(sock, _mac(key, b"s2c", cn, sn), _mac(key, b"c2s", cn, sn))


# ----------------------------------------------------------------------------------- owner side


class Entry:
    """One registered buffer as its owner's server sees it. Subclasses stage non-host memory."""

    def __init__(self, view: memoryview, keep: Any) -> None:
        self.view = view  # 1-D bytes
        self.nbytes = view.nbytes
        self.keep = keep  # what keeps the memory alive while registered
        self.extra: list[Callable[[], None]] = []  # run at release (closing the shm descriptor)

    def sources(self, off: int, n: int) -> Iterator[memoryview]:
        """Bytes ``off:off+n`` to send, in pieces of at most :data:`PIECE`: the next is asked
        for once the last has been sent."""
        for p in range(off, off + n, PIECE):
            yield self.view[p : min(p + PIECE, off + n)]

    def targets(self, off: int, n: int) -> Iterator[memoryview]:
        """Where bytes ``off:off+n`` of a write land, in pieces of at most :data:`PIECE`: each
        is filled before the next is asked for, and the write is in place once this ends."""
        if self.view.readonly:
            raise BufferError("this RDMABuffer was made from read-only memory")
        for p in range(off, off + n, PIECE):
            yield self.view[p : min(p + PIECE, off + n)]

    def ipc(self) -> bytes:
        """A CUDA IPC handle of this buffer for one reader of this host (CUDA buffers only)."""
        raise BufferError("this RDMABuffer is not in CUDA memory: no CUDA IPC handle")

    def release(self) -> None:
        for fn in self.extra:
            try:
                fn()
            except OSError:
                pass
        self.extra = []
        # ``keep`` stays: a transfer under way holds this entry, and ``view`` may be a bare
        # address into that memory (a CPU tensor's); it is let go with the entry's last user


@dataclass(frozen=True)
class Address:
    """Where a process's data server listens (picklable, in every buffer handle)."""

    pid: int
    start: int
    host: str
    unix: str
    tcp: str  # "ip:port" or ""


#: keyed TCP connections in their handshake at once; past this the oldest is dropped. A reader
#: with the key greets within milliseconds, while anyone who can reach the port could otherwise
#: hold a thread of the rank per silent connection for the handshake's 10 s, thousands of them
#: (and the user's own code would then find no thread to start): a flood is bounded, and a reader
#: arriving during one is still served
GREETING_MAX = 32


class DataServer:
    def __init__(self, key: Callable[[], bytes | None], tcp_ip: Callable[[], str]) -> None:
        self._key = key  # asked on use: a controller adopts its cluster key when it attaches
        self._tcp_ip = tcp_ip
        self._entries: dict[bytes, Entry] = {}
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self.refusals = Refusals(logger)
        #: keyed connections still in their handshake
        self._greeting = Greeting(
            GREETING_MAX, self.refusals, "the data plane cut a connection still in its handshake: more than %d at once"
        )
        # abstract (no file to leave behind when the proc is killed); callers' uid is checked
        self.unix = f"\0monarch_nb-dp-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"
        self.tcp = ""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.unix)
        s.listen(64)
        self._serve_listener(s, sealed=False)
        self.bytes_out = 0
        self.bytes_in = 0
        self.closed = False

    def _serve_listener(self, s: socket.socket, sealed: bool) -> None:
        self._listeners.append(s)
        threading.Thread(target=self._accept, args=(s, sealed), name="monarch_nb-dataplane-accept", daemon=True).start()

    def address(self) -> Address:
        if not self.tcp and self._key() is not None:
            ip = self._tcp_ip()
            if ip:
                with self._lock:
                    if not self.tcp:
                        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        s.bind((ip, 0))
                        s.listen(64)
                        self.tcp = f"{ip}:{s.getsockname()[1]}"
                        self._serve_listener(s, sealed=True)
        return Address(os.getpid(), start_time(os.getpid()), host_id(), self.unix, self.tcp)

    # -- registry
    def register(self, entry: Entry) -> bytes:
        bid = secrets.token_bytes(16)
        with self._lock:
            self._entries[bid] = entry
        return bid

    def release(self, bid: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(bid, None)
        if entry is None:
            return False
        entry.release()
        return True

    def registered(self) -> int:
        with self._lock:
            return len(self._entries)

    # -- serving
    def _accept(self, lsock: socket.socket, sealed: bool) -> None:
        while (conn := _fdlimit.accept(lsock, "the data plane", self.refusals.refused)) is not None:
            if sealed:
                self._greeting.begin(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, sealed), name="monarch_nb-dataplane", daemon=True).start()
            except RuntimeError as e:  # no thread to serve it: that reader is refused, later ones are not
                self._greeting.done(conn)
                conn.close()
                self.refusals.refused("the data plane dropped a connection: %s", e)

    def _serve(self, conn: socket.socket, sealed: bool) -> None:
        ch: _Plain | _Sealed | None
        try:
            if sealed:
                _tune_tcp(conn)
                conn.settimeout(10)
                key = self._key()
                assert key is not None
                try:
                    ch = _server_handshake(conn, key)
                finally:
                    self._greeting.done(conn)
                if ch is None:
                    self.refusals.refused("refused a data-plane connection: the peer does not hold the cluster key")
                    conn.close()
                    return
                conn.settimeout(None)
            else:
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                uid = struct.unpack("3i", cred)[1]
                if uid not in (os.getuid(), 0):
                    self.refusals.refused("refused a data-plane connection from uid %d", uid)
                    conn.close()
                    return
                ch = _Plain(conn)
            req = bytearray(_REQ.size)
            while True:
                try:
                    ch.recv_into(memoryview(req))
                except (ConnectionError, OSError):
                    return
                op, bid, off, n = _REQ.unpack(req)
                self._handle(ch, op, bytes(bid), off, n)
        except Exception as e:  # a peer that breaks protocol loses its connection, nothing more
            logger.debug("data-plane connection ended: %s", e)
        finally:
            conn.close()

    def _reply(self, ch: _Plain | _Sealed, status: int, msg: str = "") -> None:
        body = msg.encode()
        # two records, as the reader takes them: the fixed-size reply, then what it announced
        ch.send(_RSP.pack(status, len(body)))
        if body:
            ch.send(body)

    def _handle(self, ch: _Plain | _Sealed, op: int, bid: bytes, off: int, n: int) -> None:
        with self._lock:
            entry = self._entries.get(bid)
        if op == OP_DROP:
            self.release(bid)
            self._reply(ch, ST_OK)
            return
        if op == OP_IPC:
            if entry is None:
                self._reply(ch, ST_GONE)
                return
            try:
                if ch.sealed:
                    raise BufferError("CUDA IPC handles are for processes of the owner's host")
                body = entry.ipc()
            except Exception as e:  # no IPC for this buffer or between these two: the reader streams
                self._reply(ch, ST_BAD, f"{type(e).__name__}: {e}")
                return
            ch.send(_RSP.pack(ST_OK, len(body)))
            ch.send(body)
            return
        bad = ""
        if entry is None:
            status = ST_GONE
        elif off + n > entry.nbytes:
            status, bad = ST_BAD, f"bytes {off}..{off + n} are outside the buffer's {entry.nbytes}"
        else:
            status = ST_OK
        if op == OP_READ:
            if entry is None or status != ST_OK:
                self._reply(ch, status, bad)
                return
            with self._lock:  # counted first: the reader may look before this thread goes on
                self.bytes_out += n
            ch.send(_RSP.pack(ST_OK, n))
            for piece in entry.sources(off, n):
                ch.send(piece)
        elif op == OP_WRITE:
            # the payload follows the request: take it all (into the buffer, or away) to stay in step
            pieces = entry.targets(off, n) if entry is not None and status == ST_OK else None
            for p in range(off, off + n, PIECE):
                dst = None
                if pieces is not None:
                    try:
                        dst = next(pieces)
                    except BufferError as e:
                        status, bad, pieces = ST_BAD, str(e), None
                ch.recv_into(dst if dst is not None else memoryview(bytearray(min(PIECE, off + n - p))))
            if pieces is not None:
                next(pieces, None)  # its end: the last piece is in place (a staged one copied in)
            if status == ST_OK:
                with self._lock:
                    self.bytes_in += n
            self._reply(ch, status, bad)
        else:
            raise ConnectionError(f"unknown data-plane op {op}")

    def close(self) -> None:
        self.closed = True
        for s in self._listeners:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            e.release()


_server: DataServer | None = None
_server_lock = threading.Lock()


def server(key: Callable[[], bytes | None], tcp_ip: Callable[[], str]) -> DataServer:
    """This process's data server, started on first use."""
    global _server
    if _server is None:
        with _server_lock:
            if _server is None:
                _server = DataServer(key, tcp_ip)
    return _server


def local_server() -> DataServer | None:
    return _server


# --------------------------------------------------------------------------------- bytes moved
_moved = {"read": 0, "written": 0, "shm": 0, "stream": 0, "cuda_ipc": 0}
_moved_lock = threading.Lock()


def count(write: bool, path: str, n: int) -> None:
    """Count ``n`` bytes this process read or wrote through a buffer, by ``path`` (shm/stream)."""
    with _moved_lock:
        _moved["written" if write else "read"] += n
        _moved[path] += n


def counters() -> dict[str, int] | None:
    """What this process moved as a reader/writer and served as an owner; None if it never
    touched the data plane (telemetry then reports nothing)."""
    with _moved_lock:
        out = dict(_moved)
    srv = _server
    out["served_out"] = srv.bytes_out if srv else 0
    out["served_in"] = srv.bytes_in if srv else 0
    if srv is None and not any(out.values()):
        return None
    out["total"] = out["read"] + out["written"] + out["served_out"] + out["served_in"]
    return out


# ---------------------------------------------------------------------------------- reader side
#: idle data connections a process keeps at most (a descriptor each); past this the least
#: recently used is closed, and a later transfer to its owner connects again
POOL_MAX = 64
#: how often giving a connection back also closes the idle ones whose owner went away (its
#: process exited): nothing else would, and a reader of many short-lived owners kept a
#: descriptor per owner for good
PRUNE_S = 1.0


class _Pool:
    """Idle connections to data servers, reused across transfers (one transfer per connection)."""

    def __init__(self) -> None:
        self._idle: OrderedDict[tuple[str, ...], list[_Plain | _Sealed]] = OrderedDict()
        self._n = 0
        self._pruned = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def take(self, where: tuple[str, ...], key: bytes | None, deadline: float, fresh: bool = False) -> _Plain | _Sealed:
        """An idle connection (its ``reused`` set) or, with ``fresh`` or none idle, a new one."""
        with self._lock:
            idle = self._idle.get(where)
            if idle and not fresh:
                ch = idle.pop()
                if not idle:
                    del self._idle[where]
                self._n -= 1
                ch.reused = True
                return ch
        kind, addr = where[0], where[1]
        left = max(0.001, deadline - time.monotonic())
        if kind == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(left)
            s.connect(addr)
            return _Plain(s)
        if key is None:
            raise PermissionError("reading a buffer on another host needs the cluster key (this process has none)")
        ip, port = addr.rsplit(":", 1)
        s = socket.create_connection((ip, int(port)), timeout=left)
        _tune_tcp(s)
        try:
            return _client_handshake(s, key)
        except BaseException:
            s.close()
            raise

    def give(self, where: tuple[str, ...], ch: _Plain | _Sealed) -> None:
        shut: list[_Plain | _Sealed] = []
        now = time.monotonic()
        with self._lock:
            if self._closed:  # a transfer ending while the process exits: nobody will reuse it
                shut.append(ch)
            else:
                self._idle.setdefault(where, []).append(ch)
                self._idle.move_to_end(where)
                self._n += 1
            if now - self._pruned >= PRUNE_S:
                self._pruned = now
                shut += self._broken()
            while self._n > POOL_MAX:
                oldest, lst = next(iter(self._idle.items()))
                shut.append(lst.pop(0))
                if not lst:
                    del self._idle[oldest]
                self._n -= 1
        for c in shut:
            c.close()

    def _broken(self) -> list[_Plain | _Sealed]:
        """Take out the idle connections the other end closed (or broke): an owner never sends
        on an idle one, so any that can be read from is one (under the lock)."""
        every = [c for lst in self._idle.values() for c in lst]
        ready = hung_up(c.sock for c in every)
        if not ready:
            return []
        out = [c for c in every if c.sock.fileno() in ready]
        for where in list(self._idle):
            keep = [c for c in self._idle[where] if c.sock.fileno() not in ready]
            if keep:
                self._idle[where] = keep
            else:
                del self._idle[where]
        self._n -= len(out)
        return out

    def connections(self) -> list[socket.socket]:
        with self._lock:
            return [c.sock for lst in self._idle.values() for c in lst]

    def close(self) -> None:
        """Close every idle connection, and each one given back from now on: at exit, where
        Python's finalizer would otherwise find them open (a ResourceWarning per connection)."""
        with self._lock:
            self._closed = True
            idle = [c for lst in self._idle.values() for c in lst]
            self._idle.clear()
            self._n = 0
        for c in idle:
            c.close()


_pool = _Pool()
atexit.register(_pool.close)


def pool_sockets() -> list[socket.socket]:
    """The idle data connections of this process (what tests check the two ends of)."""
    return _pool.connections()


class _StaleConnection(Exception):
    pass


def stream(
    addr: Address,
    key: bytes | None,
    op: int,
    bid: bytes,
    local: memoryview | None,
    off: int,
    n: int,
    deadline: float,
    piece: Callable[[int, int], None] | None = None,
) -> bytes:
    """One read (into ``local``), write (from ``local``), drop, or request for a CUDA IPC handle
    (returned) over direct connections: one, or across hosts for a large transfer several, each
    carrying a byte range (:func:`streams_for`). ``piece(p, k)``, when given, is called with
    each piece's place in ``local`` before it is sent, or once it has arrived.

    Raises :class:`PeerGone`, :class:`BufferGone`, :class:`Stalled` (saying who stalled),
    ``ValueError`` for a bad range, ``PermissionError`` when keys differ.
    """
    k = 1 if op in (OP_DROP, OP_IPC) or addr.host == host_id() else streams_for(n)
    if k <= 1:
        return _one(addr, key, op, bid, local, off, n, deadline, piece=piece)
    assert local is not None
    # equal byte ranges (page-aligned, the last one shorter), each on a connection of its own
    step = -(-n // k)
    step = -(-step // 65536) * 65536
    ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
    errors: list[BaseException | None] = [None] * len(ranges)
    # each range's connection goes back to the pool only once every range is done, so that no
    # range takes another's connection as it frees: the ranges run on distinct connections
    held: list[tuple[tuple[str, ...], _Plain | _Sealed]] = []

    def part(i: int) -> None:
        a, b = ranges[i]
        at = None if piece is None else (lambda p, k: piece(a + p, k))
        try:
            _one(addr, key, op, bid, local[a:b], off + a, b - a, deadline, held, at)
        except BaseException as e:
            errors[i] = e

    threads = [
        threading.Thread(target=part, args=(i,), name="monarch_nb-dataplane-part", daemon=True) for i in range(1, len(ranges))
    ]
    for t in threads:
        t.start()
    part(0)
    for t in threads:
        t.join()  # each part ends by the deadline: its socket times out then
    for where, ch in held:
        _pool.give(where, ch)
    for e in errors:
        if e is not None:
            raise e
    return b""


#: a transfer across hosts at least this large is split over several connections by default
#: (0: never; measured in bench/rdma.py, see docs/rdma.md)
SPLIT_MIN = 0
#: the most connections one transfer is split over by default
SPLIT_MAX = 4


def streams_for(n: int) -> int:
    """How many connections a transfer of ``n`` bytes across hosts goes over: the configured
    ``rdma_streams``, else one per :data:`SPLIT_MIN` bytes up to :data:`SPLIT_MAX`."""
    if n <= (1 << 20):
        return 1  # never a range under 1 MiB (and no configuration lookup for small transfers)
    from ..config import get_config

    forced = get_config().rdma_streams
    if forced < 0:
        raise ValueError(f"rdma_streams must be >= 0 (0 chooses by size), not {forced}")
    if forced:
        return max(1, min(forced, n >> 20))  # no range under 1 MiB: whole MiBs per range, rounded down
    if not SPLIT_MIN or n < 2 * SPLIT_MIN:
        return 1
    return min(SPLIT_MAX, n // SPLIT_MIN)


def _one(
    addr: Address,
    key: bytes | None,
    op: int,
    bid: bytes,
    local: memoryview | None,
    off: int,
    n: int,
    deadline: float,
    held: list[tuple[tuple[str, ...], _Plain | _Sealed]] | None = None,
    piece: Callable[[int, int], None] | None = None,
) -> bytes:
    try:
        return _stream(addr, key, op, bid, local, off, n, deadline, fresh=False, held=held, piece=piece)
    except _StaleConnection:
        # an idle connection that broke meanwhile (the peer restarted its side, a network blip):
        # nothing moved on it, and every op may be repeated, so once more on a new one
        return _stream(addr, key, op, bid, local, off, n, deadline, fresh=True, held=held, piece=piece)


def _stream(
    addr: Address,
    key: bytes | None,
    op: int,
    bid: bytes,
    local: memoryview | None,
    off: int,
    n: int,
    deadline: float,
    fresh: bool,
    held: list[tuple[tuple[str, ...], _Plain | _Sealed]] | None = None,
    piece: Callable[[int, int], None] | None = None,
) -> bytes:
    same = addr.host == host_id()
    # pooled by key too: a connection proves one key, never another
    where = ("unix", addr.unix) if same else ("tcp", addr.tcp, hashlib.sha256(key or b"").hexdigest()[:16])
    if not same and not addr.tcp:
        raise RuntimeError(
            "this RDMABuffer's owner has no address that other hosts can reach (a controller that had "
            "not joined a cluster when it made the buffer): make the buffer in an actor, or after attaching"
        )
    phase = "connecting to"
    got = 0
    body = bytearray()
    try:
        ch = _pool.take(where, key, deadline, fresh)
    except PermissionError:
        raise
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
        raise PeerGone(f"its data server at {where[1]} is gone ({e.strerror or e})") from e
    except TimeoutError as e:
        raise Stalled(f"the owner's side stalled: no connection to its data server at {where[1]} in time") from e
    except OSError as e:
        if _no_descriptor(e):
            raise OutOfDescriptors("connecting to the owner's data server") from e
        raise PeerGone(f"its data server at {where[1]} cannot be reached ({e.strerror or e})") from e
    ok = False
    try:
        ch.sock.settimeout(max(0.001, deadline - time.monotonic()))
        rsp = bytearray(_RSP.size)
        if op == OP_READ:
            assert local is not None
            phase = "waiting for the owner to send"
            ch.send(_REQ.pack(op, bid, off, n))
            ch.recv_into(memoryview(rsp))
            status, m = _RSP.unpack(rsp)
            if status != ST_OK:
                _fail(ch, status, m)
            for p in range(0, n, PIECE):
                k = min(PIECE, n - p)
                ch.sock.settimeout(max(0.001, deadline - time.monotonic()))
                ch.recv_into(local[p : p + k])
                got = p + k
                if piece is not None:
                    piece(p, k)
        elif op == OP_WRITE:
            assert local is not None
            phase = "waiting for the owner to take the data"
            ch.send(_REQ.pack(op, bid, off, n))
            for p in range(0, n, PIECE):
                if piece is not None:
                    piece(p, min(PIECE, n - p))
                ch.sock.settimeout(max(0.001, deadline - time.monotonic()))
                ch.send(local[p : min(n, p + PIECE)])
                got = min(n, p + PIECE)
            phase = "waiting for the owner to confirm the write"
            ch.sock.settimeout(max(0.001, deadline - time.monotonic()))
            ch.recv_into(memoryview(rsp))
            status, m = _RSP.unpack(rsp)
            if status != ST_OK:
                _fail(ch, status, m)
        else:
            phase = "waiting for the owner to drop the buffer" if op == OP_DROP else "waiting for the owner's CUDA IPC handle"
            ch.send(_REQ.pack(op, bid, 0, 0))
            ch.recv_into(memoryview(rsp))
            status, m = _RSP.unpack(rsp)
            if status != ST_OK:
                _fail(ch, status, m)
            if m:
                body = bytearray(m)
                ch.recv_into(memoryview(body))
        ok = True
    except TimeoutError as e:
        raise Stalled(f"the owner's side stalled ({phase}; {got} of {n} bytes moved)") from e
    except (BufferGone, ValueError, PermissionError):
        ok = True  # the connection is still in step: the reply was read whole
        raise
    except (ConnectionError, OSError) as e:
        if ch.reused and got == 0:
            raise _StaleConnection() from e
        raise PeerGone(f"its connection broke while {phase} ({got} of {n} bytes moved): {e}") from e
    finally:
        if ok:
            ch.sock.settimeout(None)
            if held is not None:
                held.append((where, ch))  # given back by the caller once its other ranges are done
            else:
                _pool.give(where, ch)
        else:
            ch.close()
    return bytes(body)


def _fail(ch: _Plain | _Sealed, status: int, m: int) -> None:
    msg = bytearray(m)
    if m:
        ch.recv_into(memoryview(msg))
    if status == ST_GONE:
        raise BufferGone("")
    raise ValueError(msg.decode(errors="replace"))


# --------------------------------------------------------------------------- same-host shm reads
@dataclass(frozen=True)
class Shm:
    """An owner's buffer in an unlinked shared-memory file held open at descriptor ``fd``."""

    fd: int
    dev: int
    ino: int
    offset: int  # of the buffer in the file
    size: int  # of the file


class _Mapping:
    """An owner's shared file mapped here without a descriptor: a mapping stays valid once the
    descriptor it was made from is closed, while ``mmap.mmap`` (before Python 3.13's
    ``trackfd=False``) keeps a duplicate for the mapping's life, so a reader that read from
    thousands of buffers ran out of descriptors. Unmapped when the last reference goes."""

    __slots__ = ("addr", "size", "_munmap")

    def __init__(self, fd: int, size: int) -> None:
        self.addr = 0
        self.size = size
        self._munmap = _libc.munmap()
        got = _libc.mmap()(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if got is None or got == _libc.MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {size} bytes: {os.strerror(e)}")
        self.addr = got

    def __del__(self) -> None:
        if self.addr:
            self._munmap(self.addr, self.size)
            self.addr = 0


#: owners' shared files a reader keeps mapped at once; past this the least recently used is let
#: go (and mapped again, through the owner's descriptor, if it is read again). Each costs no
#: descriptor but one of the kernel's ``vm.max_map_count`` (65530 by default) areas, and one
#: ``stat`` per sweep
MAPS_MAX = 16384


class _Maps:
    """Mappings of owners' shared files, kept for the next copy and let go once the owner closed
    its descriptor (dropped the buffer) or died: checked on every use and by a slow sweep; or
    once :data:`MAPS_MAX` others were used since.

    A mapping is never unmapped explicitly: a copy holds its :class:`_Mapping` while it runs, so
    the memory is unmapped only once neither the table nor any copy refers to it."""

    def __init__(self) -> None:
        #: least recently used first (``get`` moves a mapping it hands out to the end)
        self._maps: Newest[tuple[int, int, int, int], _Mapping] = Newest(MAPS_MAX, refresh=False)
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

    @staticmethod
    def alive(pid: int, shm: Shm) -> bool:
        try:
            st = os.stat(f"/proc/{pid}/fd/{shm.fd}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (shm.dev, shm.ino)

    def get(self, pid: int, shm: Shm) -> _Mapping | None:
        """The mapping of the file (None: the owner let go of it, or died)."""
        key = (pid, shm.fd, shm.dev, shm.ino)
        if not self.alive(pid, shm):
            self._forget(key)
            return None
        m = self._maps.get(key)
        if m is not None:
            try:
                self._maps.move_to_end(key)
            except KeyError:
                pass  # forgotten meanwhile: this copy still holds it
            return m
        what = "mapping the owner's shared memory (one descriptor, only while it maps it)"
        try:
            fd = os.open(f"/proc/{pid}/fd/{shm.fd}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            if _no_descriptor(e):
                raise OutOfDescriptors(what) from e
            raise
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (shm.dev, shm.ino) or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return None
            m = _Mapping(fd, shm.size)
        finally:
            os.close(fd)
        with self._lock:
            m = self._maps.setdefault(key, m)
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="monarch_nb-dataplane-maps", daemon=True)
                self._sweeper.start()
        return m

    def _forget(self, key: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._maps.pop(key, None)

    def _sweep(self) -> None:
        while True:
            time.sleep(2.0)
            with self._lock:
                keys = list(self._maps)
            for key in keys:
                pid, fd, dev, ino = key
                if not self.alive(pid, Shm(fd, dev, ino, 0, 0)):
                    self._forget(key)

    def count(self) -> int:
        with self._lock:
            return len(self._maps)


maps = _Maps()


def shm_copy(addr: Address, shm: Shm, write: bool, local_addr: int, off: int, n: int) -> bool:
    """Copy between local memory at ``local_addr`` and the owner's shared file; False if the owner
    let go of it (dropped, or died: the caller tells which)."""
    m = maps.get(addr.pid, shm)
    if m is None:
        return False
    src, dst = m.addr + shm.offset + off, local_addr
    if write:
        src, dst = dst, src
    ctypes.memmove(dst, src, n)  # GIL released; ``m`` keeps the mapping alive meanwhile
    return True


def owner_alive(addr: Address) -> bool | None:
    """True/False for an owner on this host; None when it lives elsewhere (unknowable from here)."""
    if addr.host != host_id():
        return None
    return start_time(addr.pid) == addr.start
