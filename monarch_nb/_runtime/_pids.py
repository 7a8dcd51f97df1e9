"""Whether a process id names a live process on this host (one definition for every caller)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host and has not exited.

    A zombie (exited, not yet reaped by its parent) is not alive: ``kill(pid, 0)`` still
    succeeds on it, and an allocator that died under a parent that never waits for it (a kernel
    that started it) would otherwise look alive for as long as that parent lives, its socket
    file still there, and every client would wait for heartbeats that never come. Someone
    else's process (``EPERM``) is alive: not ours to judge."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs here (or it just went): kill() said it exists
    # the state follows the command name, which is in parentheses and may hold any byte
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
