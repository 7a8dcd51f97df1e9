"""Connections still in their handshake on a listener anyone can reach: few at once.

Each is served by a thread of its own while it negotiates (up to a timeout a byte), so a
stranger's silent connections, unbounded, would leave the process's own code no thread to start.
Past a bound the oldest one still negotiating is cut: a peer with the key greets within
milliseconds, so one arriving during a flood is still served."""

from __future__ import annotations

import contextlib
import socket
import threading

from ._refusals import Refusals


class Greeting:
    """The connections of one listener in their handshake, oldest first; past ``most`` the oldest
    is shut down (its thread ends) and ``cut`` (a message template taking ``most``) is said."""

    def __init__(self, most: int, refusals: Refusals, cut: str) -> None:
        self._most = most
        self._refusals = refusals
        self._cut = cut
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, None] = {}

    def begin(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns[conn] = None
            oldest = next(iter(self._conns)) if len(self._conns) > self._most else None
            if oldest is not None:
                del self._conns[oldest]
        if oldest is not None:
            self._refusals.refused(self._cut, self._most)
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)

    def done(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(conn, None)
