"""Logging refused connections without letting a stranger write the user's logs.

Whoever can reach a port (anyone on the network for TCP, any local user for loopback TCP and
the data plane's abstract socket) can open connections as fast as the kernel accepts them. A
warning per refusal put one line per connection in the allocator's log and, in a proc, in its
rank's output, which streams into the notebook: a stranger could fill the user's cell and disk
without ever getting in. Each kind of refusal is now said once, then at most once per
:data:`INTERVAL` with how many more there were; every one is still counted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

#: seconds between two lines about the same kind of refusal
INTERVAL = 60.0


class Refusals:
    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()
        # message template -> (when it was last logged, refusals since then not logged)
        self._said: dict[str, tuple[float, int]] = {}
        #: every refusal, logged or not
        self.count = 0

    def refused(self, msg: str, *args: Any) -> None:
        """Count one refusal; log ``msg % args`` unless a refusal of this kind was logged
        within :data:`INTERVAL` (its ``args`` are then not shown: they come from the peer)."""
        now = time.monotonic()
        with self._lock:
            self.count += 1
            said = self._said.get(msg)
            if said is not None and now - said[0] < INTERVAL:
                self._said[msg] = (said[0], said[1] + 1)
                return
            self._said[msg] = (now, 0)
        if said is None:
            note = f" (more of these are counted and logged at most once every {INTERVAL:.0f} s)"
        elif said[1]:
            note = f" ({said[1]} more since the last such line)"
        else:
            note = ""
        self._logger.warning(msg + "%s", *args, note)
