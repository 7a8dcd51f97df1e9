"""What the machine itself costs: the floor every row of ``python -m bench`` is compared with.

* ``roundtrip``: two processes, a blocking AF_UNIX SOCK_STREAM pair, 64-byte messages with
  ``send``/``recv_into``, ``n`` round trips; seconds per round trip.
* ``memcpy``: one in-process copy of ``nbytes`` into memory that is already mapped; seconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

MSG = 64


def recv_exact(sock: socket.socket, buf: bytearray, view: memoryview) -> bool:
    got = 0
    while got < MSG:
        k = sock.recv_into(view[got:], MSG - got)
        if not k:
            return False
        got += k
    return True


@contextlib.contextmanager
def echo_peer() -> Iterator[socket.socket]:
    """A forked process that echoes ``MSG``-byte messages; yields this side's blocking socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echoing peer
        try:
            a.close()
            buf = bytearray(MSG)
            view = memoryview(buf)
            while recv_exact(b, buf, view):
                b.sendall(view)
        finally:
            os._exit(0)
    b.close()
    try:
        yield a
    finally:
        a.close()
        os.waitpid(pid, 0)


def roundtrip(n: int = 10_000) -> float:
    with echo_peer() as a:
        msg = os.urandom(MSG)
        buf = bytearray(MSG)
        view = memoryview(buf)
        for _ in range(100):  # both sides running before the clock starts
            a.sendall(msg)
            recv_exact(a, buf, view)
        t0 = time.perf_counter()
        for _ in range(n):
            a.sendall(msg)
            recv_exact(a, buf, view)
        return (time.perf_counter() - t0) / n


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
