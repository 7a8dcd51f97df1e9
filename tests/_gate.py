"""A gate between processes, on a FIFO: a test lets waiting ranks or scripts go on.

The test makes the gate and holds it open (read and write) until it is done with it, so
waiting and opening may come in either order: a waiter that comes after the gate opened finds
it open. One opening lets up to 4096 waiters through at once.
"""

from __future__ import annotations

import os
import select

_TOKENS = 4096  # one byte per waiter, within a pipe's buffer


class Gate:
    """The test's side. ``path`` is what the waiters are given."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkfifo(path, 0o600)
        # read and write: opens at once, and keeps what open() writes there for later waiters
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def open(self) -> None:
        if self._fd is not None:
            os.write(self._fd, b"g" * _TOKENS)

    def close(self) -> None:
        """Done with it: a waiter still waiting is let go with False."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def wait(path: str, timeout: float | None = None) -> bool:
    """Until the gate at ``path`` opens (True), or ``timeout`` passes or the gate is closed
    unopened (False)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            return False
        try:
            return os.read(fd, 1) == b"g"  # b"": the test closed the gate without opening it
        except BlockingIOError:
            return False  # another waiter took the last byte (more than _TOKENS waiters)
    finally:
        os.close(fd)
