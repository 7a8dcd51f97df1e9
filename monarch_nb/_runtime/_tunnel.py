"""The gateway tunnel's wire: frames over one byte stream (:class:`Mux`), and the streams that
ride it (:class:`Streams`), which outlive any one tunnel.

A port-forward drops now and then (the API server closes it, a laptop sleeps). Every zmq
connection between the controller and the job rides it, and a message half-written into a
tunnel that then drops is gone: zmq has handed it to TCP and never sends it again, so a call
whose message was lost waits for ever (its procs are alive, and their heartbeats come through
the next tunnel). So a stream's bytes are numbered in each direction, kept by the sender until
the far end acknowledges them (:data:`ACK`, every :data:`ACK_EVERY` bytes), and sent again from
where the far end stopped when the next tunnel of the same session opens (:data:`RESUME`). The
local sockets stay open meanwhile: zmq never sees the drop.

Frame: type (1 byte), stream id (4), offset (8), payload length (4), payload. The offset is the
stream position of a DATA frame's first byte, the position received so far in ACK and RESUME,
and 0 otherwise. BYE: the controller is done with the session (its streams close at the
gateway now, not when the session's grace runs out).
"""

from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

OPEN, OPENED, FAILED, DATA, CLOSE, ACCEPT, ACK, RESUME, BYE = range(1, 10)
HDR = struct.Struct("!BIQI")
CHUNK = 256 * 1024
#: a receiver acknowledges after this many bytes (what a sender keeps in steady state)
ACK_EVERY = 256 * 1024
#: unacknowledged bytes a stream keeps before it stops reading its local socket (a tunnel that
#: is down: the local sender then sees TCP back-pressure, and zmq its high-water mark)
HOLD_MAX = 8 * 1024 * 1024


class TunnelError(RuntimeError):
    """The tunnel ended or spoke out of turn."""


class TunnelClosed(TunnelError):
    """The tunnel ended (not a fault of what it carried)."""


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise TunnelClosed("the tunnel closed")
        got += k
    return buf


class Mux:
    """One tunnel; ``gen`` numbers the session's tunnels. :meth:`send` writes a frame under a
    lock, from a stream's pump or any thread but the reader; the reader's own frames (ACK, a
    CLOSE) go through :meth:`post`, which never waits: if both ends' readers were stuck writing
    into a tunnel full of resent bytes, neither would read and the tunnel would stop."""

    def __init__(self, tunnel: socket.socket, gen: int) -> None:
        self.tunnel = tunnel
        self.gen = gen
        self.wlock = threading.Lock()
        self.closed = threading.Event()
        self._posted: list[bytes] = []
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None

    def send(self, t: int, sid: int, off: int = 0, payload: bytes = b"") -> bool:
        try:
            with self.wlock:
                self.tunnel.sendall(HDR.pack(t, sid, off, len(payload)) + payload)
            return True
        except OSError:
            self.close()
            return False

    def post(self, t: int, sid: int, off: int = 0) -> None:
        """(The reader.) A frame without payload, written by a thread of its own."""
        with self._cond:
            if self.closed.is_set():
                return
            self._posted.append(HDR.pack(t, sid, off, 0))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_posted, name="gateway-post", daemon=True)
                self._writer.start()
            self._cond.notify()

    def _write_posted(self) -> None:
        while True:
            with self._cond:
                while not self._posted and not self.closed.is_set():
                    self._cond.wait()
                if self.closed.is_set():
                    return
                frames, self._posted = self._posted, []
            try:
                with self.wlock:
                    self.tunnel.sendall(b"".join(frames))
            except OSError:
                self.close()
                return

    def run(self, on_frame: Callable[[Mux, int, int, int, bytes | bytearray], None]) -> None:
        """Tunnel -> ``on_frame``, until the tunnel ends (or speaks out of turn: then it is
        closed, and the streams wait for the next one as after a drop)."""
        try:
            while True:
                t, sid, off, n = HDR.unpack(recv_exact(self.tunnel, HDR.size))
                if n > CHUNK:
                    # no frame carries more; a length from a broken peer must not size a buffer
                    raise TunnelError(f"a frame of {n} bytes (at most {CHUNK})")
                on_frame(self, t, sid, off, recv_exact(self.tunnel, n) if n else b"")
        except (TunnelClosed, OSError, struct.error):
            pass
        except TunnelError as e:
            logger.warning("gateway: closing a tunnel that spoke out of turn: %s", e)
        except UnicodeDecodeError:
            logger.warning("gateway: closing a tunnel that sent an address or error that is not UTF-8")
        finally:
            self.close()

    def close(self) -> None:
        """The tunnel drops (its streams stay, for the next one)."""
        with self._cond:
            if self.closed.is_set():
                return
            self.closed.set()
            self._cond.notify_all()
        try:
            self.tunnel.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.tunnel.close()


class _Stream:
    __slots__ = ("sid", "sock", "held", "slock", "cond", "sent", "acked", "out", "recvd", "reported", "gen", "eof", "dead")

    def __init__(self, sid: int, gen: int) -> None:
        self.sid = sid
        #: the local end, once attached; what arrives before is held
        self.sock: socket.socket | None = None
        self.held: list[bytes | bytearray] = []
        #: orders this stream's DATA on a tunnel: its pump's and a resume's
        self.slock = threading.Lock()
        #: guards ``out`` and ``acked``; a pump whose hold is full waits on it
        self.cond = threading.Condition()
        #: bytes read from the local end; ``out`` holds those from ``acked`` on
        self.sent = 0
        self.acked = 0
        self.out: collections.deque[bytes] = collections.deque()
        #: bytes from the far end delivered here; ``reported``: as of the last ACK
        self.recvd = 0
        self.reported = 0
        #: the tunnel this stream's DATA goes out on; an older one's is held until the far end
        #: says where to resume
        self.gen = gen
        self.eof = False
        self.dead = False


class Streams:
    """A session's streams over its successive tunnels. ``on_open(mux, sid, dest)`` and
    ``on_accept(mux, sid)`` serve the far end's OPEN and ACCEPT (the owner's policy)."""

    def __init__(
        self,
        first_sid: int,
        on_open: Callable[[Mux, int, str], None] | None = None,
        on_accept: Callable[[Mux, int], None] | None = None,
        on_bye: Callable[[], None] | None = None,
    ) -> None:
        self.lock = threading.Lock()
        self.streams: dict[int, _Stream] = {}
        #: streams this end is opening: the far end's OPENED or FAILED sets the event
        self.waiting: dict[int, tuple[threading.Event, list[str], Mux]] = {}
        self.next_sid = first_sid  # the client's ids are odd, the server's even: no clash
        self.mux: Mux | None = None
        self.on_open = on_open
        self.on_accept = on_accept
        self.on_bye = on_bye

    def __len__(self) -> int:
        return len(self.streams)

    def new_sid(self) -> int:
        with self.lock:
            sid, self.next_sid = self.next_sid, self.next_sid + 2
            return sid

    def bind(self, mux: Mux) -> None:
        """A new tunnel: the streams from before ask the far end where to resume."""
        with self.lock:
            self.mux = mux
            older = [st for st in self.streams.values() if st.gen < mux.gen]
            for st in older:
                # a stream not attached yet asks again for what it only holds (skipped as it
                # comes back): what the far end may have unacknowledged stays its HOLD_MAX
                if st.sock is not None:
                    st.reported = st.recvd
        for st in older:
            if not mux.send(RESUME, st.sid, st.reported):
                return
        if older:
            logger.info("gateway: %d streams resume over the new tunnel", len(older))

    def down(self, mux: Mux) -> None:
        """``mux`` dropped: streams it was opening fail (their SOCKS client tries again)."""
        with self.lock:
            if self.mux is mux:
                self.mux = None
            waiting = [(ev, why) for ev, why, m in self.waiting.values() if m is mux]
        for ev, why in waiting:
            why.append("the tunnel closed")
            ev.set()

    def open(self, mux: Mux, dest: str, timeout: float) -> int:
        """Open a stream to ``dest`` at the far end over ``mux``; its id, to :meth:`attach`."""
        sid = self.new_sid()
        ev, why = threading.Event(), list[str]()
        with self.lock:
            self.waiting[sid] = (ev, why, mux)
        self.expect(sid, mux)
        sent = mux.send(OPEN, sid, 0, dest.encode())
        if not sent or not ev.wait(timeout) or why[0]:
            self.forget(sid)
            raise TunnelError(why[0] if why else "the tunnel closed" if not sent else "no answer")
        return sid

    def expect(self, sid: int, mux: Mux) -> None:
        """A stream ``sid`` on ``mux``: hold what arrives for it until :meth:`attach`."""
        with self.lock:
            self.streams[sid] = _Stream(sid, mux.gen)

    def attach(self, sid: int, sock: socket.socket) -> None:
        with self.lock:
            st = self.streams.get(sid)
            if st is not None:
                try:
                    for b in st.held:
                        sock.sendall(b)  # under the lock: what arrives next goes after it
                    st.held = []
                    st.sock = sock
                except OSError:
                    st = None
            mux = self.mux
        if st is None:  # closed by the other end meanwhile
            self.forget(sid)
            sock.close()
            return
        if mux is not None and st.recvd > st.reported:
            st.reported = st.recvd
            mux.post(ACK, st.sid, st.recvd)  # the held bytes: the far end may send more now
        threading.Thread(target=self._pump, args=(st,), name=f"gateway-stream-{sid}", daemon=True).start()

    def forget(self, sid: int) -> None:
        """Drop stream ``sid`` here, closing its local end (the far end is told by the caller)."""
        with self.lock:
            st = self.streams.pop(sid, None)
            self.waiting.pop(sid, None)
        if st is None:
            return
        with st.cond:
            st.dead = True
            st.out.clear()
            st.cond.notify_all()
        if st.sock is not None:
            try:
                st.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            st.sock.close()

    def _end(self, mux: Mux, sid: int) -> None:
        """The local end finished and everything it sent is on ``mux``: close both ends."""
        mux.send(CLOSE, sid)
        self.forget(sid)

    def refuse(self, mux: Mux, sid: int) -> None:
        """(The reader.) Drop stream ``sid`` here, if it is, and tell the far end to."""
        self.forget(sid)
        mux.post(CLOSE, sid)

    def close_all(self) -> None:
        with self.lock:
            sids = list(self.streams)
        for sid in sids:
            self.forget(sid)

    def _live(self, st: _Stream) -> Mux | None:
        mux = self.mux
        return mux if mux is not None and st.gen == mux.gen and not mux.closed.is_set() else None

    def _pump(self, st: _Stream) -> None:
        """Local socket -> tunnel, until the local end finishes."""
        assert st.sock is not None
        try:
            while True:
                data = st.sock.recv(CHUNK)
                if not data:
                    break
                with st.cond:
                    while st.sent - st.acked > HOLD_MAX and not st.dead:
                        st.cond.wait()
                    if st.dead:
                        return
                    off = st.sent
                    st.sent += len(data)
                    st.out.append(data)
                with st.slock:
                    mux = self._live(st)
                    if mux is not None:
                        mux.send(DATA, st.sid, off, data)  # lost with its tunnel: sent again on resume
        except OSError:
            pass
        with st.slock:
            st.eof = True
            mux = self._live(st)
        if mux is not None:
            self._end(mux, st.sid)
        # else: a resume sends what is held, then the CLOSE

    def _trim(self, st: _Stream, upto: int) -> bool:
        """The far end has every byte before ``upto``; False: it claims more than was sent."""
        with st.cond:
            if upto > st.sent:
                return False
            while st.out and st.acked + len(st.out[0]) <= upto:
                st.acked += len(st.out.popleft())
            if st.acked < upto:
                st.out[0] = st.out[0][upto - st.acked :]
                st.acked = upto
            st.cond.notify_all()
            return True

    def _resume(self, mux: Mux, st: _Stream) -> None:
        """Send what the far end lacks (all not acknowledged) over ``mux``; new DATA follows it."""
        with st.slock:
            if self.mux is not mux or mux.closed.is_set() or st.dead:
                return  # a newer tunnel resumes it
            with st.cond:
                chunks, off = list(st.out), st.acked
            for c in chunks:
                if not mux.send(DATA, st.sid, off, c):
                    return
                off += len(c)
            st.gen = mux.gen
            eof = st.eof
        if eof:
            self._end(mux, st.sid)

    def _deliver(self, mux: Mux, st: _Stream, off: int, payload: bytes | bytearray) -> None:
        skip = st.recvd - off
        if skip >= len(payload):
            return  # sent again after a resume: here already
        if skip < 0:
            logger.warning("gateway: stream %d skipped %d bytes; closing it", st.sid, -skip)
            self.refuse(mux, st.sid)
            return
        if skip:
            payload = payload[skip:]
        st.recvd += len(payload)
        with self.lock:
            sock = st.sock
            if sock is None:
                # not acknowledged until attached: the far end stops at its HOLD_MAX, so what
                # is held here stays as bounded
                st.held.append(payload)
                return
        try:
            sock.sendall(payload)
        except OSError:
            self.refuse(mux, st.sid)
            return
        if st.recvd - st.reported >= ACK_EVERY:
            st.reported = st.recvd
            mux.post(ACK, st.sid, st.recvd)

    def on_frame(self, mux: Mux, t: int, sid: int, off: int, payload: bytes | bytearray) -> None:
        """(The tunnel's reader.) One frame from the far end."""
        st = self.streams.get(sid)
        if t == DATA:
            if st is not None and not st.dead:
                self._deliver(mux, st, off, payload)
        elif t == ACK:
            if st is not None:
                self._trim(st, off)
        elif t == RESUME:
            if st is None or not self._trim(st, off):
                self.refuse(mux, sid)  # gone here, or it claims bytes never sent: closed both ends
            else:
                # on a thread: both ends resending at once through a full tunnel, each from
                # its reader, would wait for ever on the other's reader
                threading.Thread(target=self._resume, args=(mux, st), name=f"gateway-resume-{sid}", daemon=True).start()
        elif t == CLOSE:
            self.forget(sid)
        elif t in (OPENED, FAILED):
            with self.lock:
                w = self.waiting.pop(sid, None)
            if w is not None:
                w[1].append(payload.decode() if t == FAILED else "")
                w[0].set()
        elif t == OPEN and self.on_open is not None:
            threading.Thread(target=self.on_open, args=(mux, sid, payload.decode()), daemon=True).start()
        elif t == ACCEPT and self.on_accept is not None:
            self.on_accept(mux, sid)
        elif t == BYE and self.on_bye is not None:
            self.on_bye()
