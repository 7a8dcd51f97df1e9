"""A one-shot gate between processes, on a FIFO: a test lets a waiting rank or script go on.

The waiting side opens its end before it says it is ready, so the side that lets it through
always finds it there: no file to poll for, and a gate opened early is not missed.
"""

from __future__ import annotations

import os
import select


def make(path: str) -> str:
    os.mkfifo(path, 0o600)
    return path


class Waiter:
    """The waiting end (open it before telling the other side you are ready)."""

    def __init__(self, path: str) -> None:
        # non-blocking: a FIFO's read end opens at once, and select() reports it only once a
        # writer has come (Linux does not report a hang-up before any writer connected)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the gate is opened (True) or ``timeout`` passes (False); closes this end."""
        try:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            return bool(ready)
        finally:
            os.close(self.fd)


def open_gate(path: str) -> None:
    """Let the waiter through; ENXIO (OSError) if nobody waits at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)
