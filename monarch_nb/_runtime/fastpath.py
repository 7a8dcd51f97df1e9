"""The direct path between processes of one host: a plain AF_UNIX stream socket per sending
thread, beside the zmq ipc inbox.

Over zmq a message crosses two extra threads (libzmq's I/O thread on each side) before the
receiver's runtime loop sees it; on a loaded two-core machine each hop is a wait for a core.
Here the sending thread writes the frames itself (``sendmsg``, no copy into a queue) and the
receiver's runtime loop reads them off the socket. It carries the same multipart messages as
the zmq inbox, as ``[nframes: u8][len: u32 × nframes][frames…]``.

Security is the ipc inbox's: the socket lives in the 0700 runtime directory with mode 0600,
and the receiver also checks the connecting process's uid (``SO_PEERCRED``).

Sends block when the receiver's socket buffer is full (its runtime loop always drains, it runs
no user code), but never for long: once a receiver has taken nothing for ``STALL_S`` (stopped,
or stuck), the connection hands what is left of that message, and every later one, to a writer
thread of its own, in order, as zmq would queue them; the sending thread is free. A runtime's
own I/O thread never sends this way, so two loops can never wait on each other.

On accept the receiver writes its magic and wire version; the sender reads them before its
first message and raises :class:`~monarch_nb.errors.VersionMismatchError` for another version.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from .._wire import frames as wire
from ..errors import ProtocolError, VersionMismatchError

logger = logging.getLogger(__name__)

SUFFIX = ".fast"
#: frames at least this large are received straight into their own buffer
_BIG = 1 << 16
_READ = 1 << 18
_PEERCRED = struct.Struct("3i")
_ONE = struct.Struct("<I")
#: a receiver that takes no byte for this long is treated as stuck (SO_SNDTIMEO: no cost per send)
STALL_S = 1.0
#: how long a new connection's sending thread waits for the receiver's greeting before a writer
#: thread takes the wait over: the call that opened the connection returns, so its own timeout
#: (``get(timeout=)``) is what bounds the caller's wait (a receiver greets within milliseconds)
HANDOVER_S = 0.5
#: a receiver that has not greeted for this long is said at the sender (a warning)
GREETING_S = 5.0
_TIMEVAL = struct.Struct("ll")


#: a message of one frame starts so, then the frame's length (u32)
ONE_FRAME = b"\x01"


def greeting() -> bytes:
    return wire.MAGIC + bytes([wire.VERSION])


def _timeval(seconds: float) -> bytes:
    return _TIMEVAL.pack(int(seconds), int((seconds % 1) * 1e6))


def path_for(ipc_addr: str) -> str:
    """The direct socket beside an ipc inbox (``ipc://…/x.sock`` -> ``…/x.fast``)."""
    base = ipc_addr[len("ipc://") :]
    return (base[: -len(".sock")] if base.endswith(".sock") else base) + SUFFIX


class Sender:
    """One thread's connection to one peer; closed when the thread's last reference goes
    (a thread that exits takes its connections with it)."""

    __slots__ = ("sock", "_q", "__weakref__")

    def __init__(self, path: str) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._q: _Queue | None = None
        try:
            s.connect(path)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(HANDOVER_S))
            try:
                _await_greeting(s, path)
            except (BlockingIOError, TimeoutError):
                # connected, yet no greeting: the peer is there but does not accept (out of
                # descriptors, or its loop held up). Another way in (zmq) would make its libzmq
                # accept, which aborts that process for want of a descriptor; so this thread's
                # messages queue, in order, for a writer that waits for the greeting
                self._q = _Queue()
                threading.Thread(target=_writer, args=(s, self._q, path), name="monarch_nb-direct-writer", daemon=True).start()
            else:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(STALL_S))
        except BaseException:
            s.close()
            raise
        self.sock = s

    def send(self, frames: list[Any]) -> None:
        n = len(frames)
        if n == 1 and type(frames[0]) is bytes:  # a small message: one frame, one write
            self.send_one(frames[0])
            return
        if n > 255:
            raise ValueError(f"a message of {n} frames is more than the direct path carries (255)")
        # sendmsg wants plain byte buffers; an array's buffer (out-of-band pickle) is cast to one
        parts = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
        head = struct.pack(f"<B{n}I", n, *(len(p) for p in parts))
        parts.insert(0, head)
        q = self._q
        if q is not None:
            self._queue(q, b"".join(bytes(p) for p in parts))
            return
        total = sum(len(p) for p in parts)
        try:
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        if sent < total:
            self._finish(b"".join(bytes(p) for p in parts), sent)

    def send_one(self, frame: bytes) -> None:
        """Send a message of one frame (most of them: a call, a reply): one write."""
        data = ONE_FRAME + len(frame).to_bytes(4, "little") + frame
        q = self._q
        if q is not None:
            self._queue(q, data)
            return
        try:
            # send() costs ~0.2 us less than sendmsg() (no iovec to build): one per rank of a call
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._finish(data, sent)

    def _queue(self, q: _Queue, data: bytes) -> None:
        # the receiver stalled earlier: keep the order, behind what is queued
        if q.failed:
            raise BrokenPipeError("the direct connection's writer failed: the peer is gone")
        q.put(data)

    def _finish(self, data: bytes, sent: int) -> None:
        """Write the rest of a message that a full buffer or a signal cut short, in order; once
        SO_SNDTIMEO passes without the receiver taking a byte, a writer thread takes over."""
        rest = memoryview(data)[sent:]
        try:
            while rest:
                rest = rest[self.sock.send(rest) :]
        except BlockingIOError:
            self._q = q = _Queue()
            q.put(bytes(rest))
            threading.Thread(target=_writer, args=(self.sock, q), name="monarch_nb-direct-writer", daemon=True).start()

    def close(self) -> None:
        q = getattr(self, "_q", None)
        if q is not None and not q.failed:
            q.put(None)  # the writer closes the socket once what is queued is written
        else:
            self.sock.close()

    def __del__(self) -> None:
        if getattr(self, "sock", None) is not None:  # absent when the connect in __init__ failed
            self.close()


class _Queue(queue.SimpleQueue):  # type: ignore[type-arg]
    """A stalled connection's messages; ``failed`` once its writer could not write (later
    sends raise, as a send to a gone peer does)."""

    failed = False


def _await_greeting(s: socket.socket, path: str) -> None:
    """Read the receiver's greeting off new connection ``s`` (within its SO_RCVTIMEO)."""
    hello = b""
    while len(hello) < 4:
        b = s.recv(4 - len(hello))
        if not b:
            raise ConnectionResetError(f"{path} closed the direct connection before greeting")
        hello += b
    if hello[:3] != wire.MAGIC:
        raise ProtocolError(f"{path} is not a monarch_nb direct socket (it greeted with {hello!r})")
    if hello[3] != wire.VERSION:
        raise VersionMismatchError(
            f"the process at {path} speaks wire version {hello[3]}, this process speaks {wire.VERSION}: "
            "run the same monarch_nb version in every process of a host"
        )


def _writer(sock: socket.socket, q: _Queue, greeted_by: str = "") -> None:
    """Write a stalled connection's messages in order, waiting as long as the receiver does
    (first for its greeting, if ``greeted_by`` names the receiver that has not greeted yet)."""
    try:
        if greeted_by:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(max(0.001, GREETING_S - HANDOVER_S)))
            try:
                _await_greeting(sock, greeted_by)
            except (BlockingIOError, TimeoutError):
                # said, or a call to it waits with no word at the caller (the peer's log says why)
                logger.warning(
                    "the process at %s has not accepted a connection from this one within %.0f s: it is out of "
                    "file descriptors, or stuck (its rank log says which); messages to it wait until it accepts",
                    greeted_by,
                    GREETING_S,
                )
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))
                _await_greeting(sock, greeted_by)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))  # no limit here
        while (data := q.get()) is not None:
            sock.sendall(data)
    except OSError as e:
        q.failed = True
        logger.debug("a direct connection's writer failed: %s", e)
    except ProtocolError as e:  # a late greeting that was not ours (or another version's)
        q.failed = True
        logger.warning("%s", e)
    finally:
        sock.close()


class Receiver:
    """Reassembles the messages of one accepted connection; driven by its loop's reader."""

    __slots__ = (
        "sock",
        "dispatch",
        "max_bytes",
        "buf",
        "r",
        "w",
        "lens",
        "frames",
        "big",
        "filled",
        "label",
        "got",
        "claimed",
        "cooldown",
    )

    def __init__(
        self,
        sock: socket.socket,
        dispatch: Callable[[list[Any]], None],
        max_bytes: int,
        label: str,
    ) -> None:
        try:
            sock.send(greeting())  # a fresh connection's buffer is empty: this never blocks
        except OSError as e:
            logger.debug("greeting a direct connection failed: %s", e)
        self.sock = sock
        self.dispatch = dispatch
        self.max_bytes = max_bytes
        self.label = label
        self.buf = bytearray(_READ)
        self.r = self.w = 0
        self.lens: tuple[int, ...] | None = None
        self.frames: list[Any] = []
        self.big: bytearray | None = None
        self.filled = 0
        #: messages dispatched so far
        self.got = 0
        #: read by an actor's own thread for now (its runtime loop leaves it alone)
        self.claimed = False
        #: messages to go before an actor may claim this connection again (one gave it back)
        self.cooldown = 0

    def drained(self) -> bool:
        """Nothing read and not yet dispatched (no partial message buffered)."""
        return self.r == self.w and self.lens is None and self.big is None

    def on_readable(self) -> bool:
        """Read what is there and dispatch whole messages; False once the connection is over."""
        sock = self.sock
        for _ in range(64):  # bounded work per wake-up, like the zmq inbox
            want = 0
            try:
                if self.big is not None:
                    n = sock.recv_into(memoryview(self.big)[self.filled :])
                else:
                    if self.w == len(self.buf):
                        self._compact()
                    want = len(self.buf) - self.w
                    n = sock.recv_into(memoryview(self.buf)[self.w :])
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                logger.debug("direct connection to %s failed: %s", self.label, e)
                return False
            if n == 0:
                return False
            if self.big is not None:
                self.filled += n
                if self.filled < len(self.big):
                    continue
                self.frames.append(self.big)
                self.big = None
            else:
                self.w += n
            got = self.got
            if not self._parse():
                return False
            if self.claimed:
                return True  # an actor's thread reads it from here on
            if n < want and self.got == got + 1 and self.r == self.w:
                # a short read of exactly one whole message (a reply, one of a call's many): the
                # next read would almost surely fail with EAGAIN (a syscall and an exception per
                # message); the loop's reader is level-triggered, so more bytes call us again.
                # A burst (several messages a read) keeps reading, which is cheaper there
                self.r = self.w = 0
                return True
        return True

    def _compact(self) -> None:
        left = self.w - self.r
        self.buf[:left] = self.buf[self.r : self.w]
        self.r, self.w = 0, left

    def _parse(self) -> bool:
        buf, mv = self.buf, memoryview(self.buf)
        while True:
            if self.lens is None:
                avail = self.w - self.r
                if avail < 1:
                    return True
                n = buf[self.r]
                if n == 1 and avail >= 5:
                    # the common message (a call, a reply): one frame, often wholly read already
                    r = self.r + 5
                    (need,) = _ONE.unpack_from(buf, r - 4)
                    if need <= self.w - r and need <= self.max_bytes:
                        end = r + need
                        frame = bytes(mv[r:end])
                        self.got += 1
                        if end == self.w:
                            # all read is parsed (a call, a reply): the next read starts at the
                            # buffer's head, and no second pass finds nothing left
                            self.r = self.w = 0
                            self.dispatch([frame])
                            return True
                        self.r = end
                        self.dispatch([frame])
                        continue
                if avail < 1 + 4 * n:
                    return True
                lens = struct.unpack_from(f"<{n}I", buf, self.r + 1)
                if n == 0 or sum(lens) > self.max_bytes:
                    logger.warning(
                        "dropped a direct connection to %s: a message of %d frames and %d bytes (limit %d)",
                        self.label,
                        n,
                        sum(lens),
                        self.max_bytes,
                    )
                    return False
                self.r += 1 + 4 * n
                self.lens, self.frames = lens, []
            lens, frames = self.lens, self.frames
            while len(frames) < len(lens):
                need = lens[len(frames)]
                avail = self.w - self.r
                if need <= avail:
                    frames.append(bytes(mv[self.r : self.r + need]))
                    self.r += need
                elif need >= _BIG or need > len(buf):
                    # straight into a buffer of its own: no copy through the read buffer
                    big = bytearray(need)
                    big[:avail] = mv[self.r : self.w]
                    self.r = self.w = 0
                    self.big, self.filled = big, avail
                    return True
                else:
                    if self.r + need > len(buf):
                        self._compact()
                    return True
            self.lens, self.frames = None, []
            self.got += 1
            self.dispatch(frames)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of an AF_UNIX connection."""
    uid: int = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
    return uid


def listen(path: str) -> socket.socket:
    """A listening socket at ``path`` (mode 0600; its directory is the 0700 runtime dir)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(128)
    except BaseException:
        s.close()
        raise
    s.setblocking(False)
    return s
