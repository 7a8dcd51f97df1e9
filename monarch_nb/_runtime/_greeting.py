"""Connections still in their handshake on a listener anyone can reach: few at once.

Each is served by a thread of its own while it negotiates (up to a timeout a byte), so a
stranger's silent connections, unbounded, would leave the process's own code no thread to start.
Past a bound the oldest one still negotiating is cut: a peer with the key greets within
milliseconds, so one arriving during a flood is still served."""

from __future__ import annotations

import contextlib
import socket
import threading

from .._newest import Newest
from ._refusals import Refusals


class Greeting:
    """The connections of one listener in their handshake, oldest first; past ``most`` the oldest
    is shut down (its thread ends) and ``cut`` (a message template taking ``most``) is said."""

    def __init__(self, most: int, refusals: Refusals, cut: str) -> None:
        self._refusals = refusals
        self._cut = cut
        self._lock = threading.Lock()
        self._conns: Newest[socket.socket, None] = Newest(most, refresh=False)

    def begin(self, conn: socket.socket) -> None:
        with self._lock:
            cut = self._conns.push(conn, None)
        for oldest, _ in cut:
            self._refusals.refused(self._cut, self._conns.most)
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)

    def done(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(conn, None)
