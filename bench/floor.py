"""What the machine itself costs: the floor every row of ``python -m bench`` is compared with.

* ``roundtrip_where``: two processes, a blocking AF_UNIX SOCK_STREAM pair, 64-byte messages
  with ``send``/``recv_into``, ``n`` round trips; seconds per round trip.
* ``memcpy``: one in-process copy of ``nbytes`` into memory that is already mapped; seconds.
* ``fanout``: one process, ``k`` forked echo peers (an AF_UNIX pair each), a 64-byte message
  written to every peer, then every echo read as epoll reports it; seconds until the last
  echo. The shape of a ``call`` to ``k`` actors with nothing of a call in it: ``k`` wake-ups
  shared by the machine's CPUs, and the caller's ``k`` writes and reads.

The round trip has two modes on a small VM: with the peer on the other CPU each message is a
cross-CPU wake-up (45-55 us a round trip on the 2-vCPU machine of docs/performance.md), with
both on one CPU a context switch (10-13 us, when the other CPU is busy). :func:`roundtrip_where`
also says which one it got.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import socket
import time
from collections.abc import Callable, Iterator

MSG = 64
#: a message that starts with this byte asks the peer for its CPU, which it writes into the echo
_WHERE = 0xFF
#: glibc's sched_getcpu(): the CPU the calling thread runs on
_getcpu = ctypes.CDLL(None).sched_getcpu


def message() -> bytes:
    """A timed round trip's message (never the peer's CPU question)."""
    return b"\0" + os.urandom(MSG - 1)


def recv_exact(sock: socket.socket, buf: bytearray, view: memoryview) -> bool:
    got = 0
    while got < MSG:
        k = sock.recv_into(view[got:], MSG - got)
        if not k:
            return False
        got += k
    return True


@contextlib.contextmanager
def forked_peer(serve: Callable[[socket.socket], None]) -> Iterator[socket.socket]:
    """A forked process that runs ``serve`` on its end of an AF_UNIX pair until it returns;
    yields this side's blocking socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            a.close()
            serve(b)
        finally:
            os._exit(0)
    b.close()
    try:
        yield a
    finally:
        a.close()
        os.waitpid(pid, 0)


def _echo(b: socket.socket) -> None:
    buf = bytearray(MSG)
    view = memoryview(buf)
    while recv_exact(b, buf, view):
        if buf[0] == _WHERE:
            buf[1:3] = _getcpu().to_bytes(2, "little")
        b.sendall(view)


def echo_peer() -> contextlib.AbstractContextManager[socket.socket]:
    """A forked process that echoes ``MSG``-byte messages; yields this side's blocking socket."""
    return forked_peer(_echo)


def roundtrip_where(n: int = 10_000, probes: int = 200) -> tuple[float, float]:
    """Seconds per round trip, and in which share of ``probes`` more round trips (after the
    timed ones, untimed) the peer ran on the caller's CPU."""
    with echo_peer() as a:
        msg = message()
        buf = bytearray(MSG)
        view = memoryview(buf)
        for _ in range(100):  # both sides running before the clock starts
            a.sendall(msg)
            recv_exact(a, buf, view)
        t0 = time.perf_counter()
        for _ in range(n):
            a.sendall(msg)
            recv_exact(a, buf, view)
        took = (time.perf_counter() - t0) / n
        probe = bytes([_WHERE]) + bytes(MSG - 1)
        same = 0
        for _ in range(probes):
            here = _getcpu()
            a.sendall(probe)
            recv_exact(a, buf, view)
            same += int.from_bytes(buf[1:3], "little") == here
        return took, same / probes


def fanout(k: int, n: int = 2_000) -> float:
    """Median seconds of ``n`` fan-outs of a 64-byte message to ``k`` echo peers until every
    echo is back (see the module's docstring)."""
    with contextlib.ExitStack() as peers:
        socks = [peers.enter_context(echo_peer()) for _ in range(k)]
        by_fd = {s.fileno(): s for s in socks}
        poller = select.epoll()
        peers.callback(poller.close)
        for s in socks:
            poller.register(s.fileno(), select.EPOLLIN)
        msg = message()
        buf = bytearray(MSG)
        view = memoryview(buf)
        times: list[float] = []
        for i in range(n + 20):  # the first 20: every peer running before the clock starts
            t0 = time.perf_counter()
            for s in socks:
                s.sendall(msg)
            left = k
            while left:
                for fd, _ in poller.poll():
                    recv_exact(by_fd[fd], buf, view)
                    left -= 1
            if i >= 20:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]


def memcpy(nbytes: int, repeat: int = 3) -> float:
    """The fastest of ``repeat`` copies of ``nbytes`` (pages of both sides already touched)."""
    src = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20) if nbytes >= 1 << 20 else bytearray(os.urandom(nbytes))
    dst = bytearray(len(src))
    dst[:] = src  # fault the destination's pages in: the floor is the copy, not the kernel
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t0)
    return best
