"""Which idle connections the other end has closed.

An idle connection's peer sends nothing (a data-plane owner between transfers; a proc whose
greeting was read), so one that can be read from has hung up: its process exited, or the
connection broke. Nothing else closes such a connection while the process that holds it lives.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterable


def hung_up(socks: Iterable[socket.socket]) -> set[int]:
    """The descriptors of ``socks`` (idle connections) that can be read from now: closed by
    their peer. One ``poll`` for them all, which does not wait."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    return {fd for fd, _ in poller.poll(0)}
