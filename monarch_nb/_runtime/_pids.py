"""Whether a process id names a live process on this host (one definition for every caller)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

__all__ = ["SilentPeer", "activity", "pid_alive", "pid_is", "terminate"]


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
    return _state(stat) not in _GONE


_GONE = (b"Z", b"X")


def _state(stat: bytes) -> bytes:
    """The state letter of a ``/proc/.../stat`` line."""
    # it follows the command name, which is in parentheses and may hold any byte
    at = stat.rfind(b")") + 2
    return stat[at : at + 1]


def pid_is(pid: int, marker: str) -> bool:
    """Is ``pid`` alive and started with ``marker`` in its command line (still the process we
    started, not a recycled pid; not a number from another pid namespace)?"""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


def activity(pid: int) -> tuple[str, int]:
    """What a process of this host is doing, to tell a silent peer that is busy from one that
    is hung: ``(state, cpu_ns)``, ``state`` one of ``"gone"`` (or a zombie), ``"stopped"``
    (every thread stopped: SIGSTOP, a debugger), ``"runnable"`` (a thread running or waiting
    for a CPU) or ``"waiting"`` (every thread asleep); ``cpu_ns`` the CPU time its threads
    have had, in ns (``schedstat``; 0 where the kernel does not keep it)."""
    states, cpu, leader = [], 0, b"X"
    try:
        tids = os.listdir(f"/proc/{pid}/task") if pid > 0 else []
    except OSError:
        return "gone", 0
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}/"
        try:
            with open(base + "stat", "rb") as f:
                states.append(_state(f.read()))
            if tid == str(pid):
                leader = states[-1]
            with open(base + "schedstat", "rb") as f:
                cpu += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    # the main thread's state is the process's, as pid_alive reads it (a zombie: Z)
    if leader in _GONE:
        return "gone", 0
    if all(s in (b"T", b"t") for s in states):
        return "stopped", cpu
    return ("runnable" if b"R" in states else "waiting"), cpu


#: the share of a CPU a sleeping process must have used since the last look to count as at
#: work: threads waiting for a GIL that a sleeping thread holds wake every 5 ms, about 0.2%
BUSY_SHARE = 0.01
#: a silent peer still at work counts as gone after this many of its timeouts all the same
SLOW_FACTOR = 10


class SilentPeer:
    """A peer process of this host that has gone silent (no heartbeat), judged by its process:
    still at work (a thread running or waiting for a CPU, or at least ``BUSY_SHARE`` of a CPU
    since the last look) rather than hung, stopped or gone. What it remembers (the last look,
    whether the slowness was told) belongs to one silence: a new ``heard`` time starts another."""

    __slots__ = ("pid", "_heard", "_cpu", "_at", "_told")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._heard: float | None = None
        self._cpu, self._at, self._told = -1, 0.0, False

    def at_work(self, heard: float) -> bool:
        """Whether the peer, last heard from at ``heard``, is still at work."""
        if heard != self._heard:
            self._heard, self._cpu, self._told = heard, -1, False
        state, cpu = activity(self.pid)
        now = time.monotonic()
        spent = self._cpu >= 0 and now > self._at and (cpu - self._cpu) / ((now - self._at) * 1e9) >= BUSY_SHARE
        self._cpu, self._at = cpu, now
        return state == "runnable" or (state == "waiting" and spent)

    def excused(self, heard: float, silent: float, timeout: float) -> bool:
        """Whether the peer, last heard from at ``heard`` and silent for ``silent`` s, is let off
        its ``timeout``: it is still at work, for up to ``SLOW_FACTOR`` timeouts."""
        return silent <= SLOW_FACTOR * timeout and self.at_work(heard)

    def first_late(self, silent: float, timeout: float) -> bool:
        """True once in this silence, when it is past ``timeout``: for the one line saying the
        peer is slow, not gone."""
        if silent <= timeout or self._told:
            return False
        self._told = True
        return True


def terminate(pids: list[int], timeout: float, reap: Callable[[], object] | None = None) -> list[int]:
    """SIGTERM ``pids``, wait up to ``timeout`` for them to exit, SIGKILL those still running;
    returns those. An exited child of ours is reaped here (else it would stay a zombie, which
    :func:`pid_alive` counts as gone); ``reap`` is called on every look, for callers that
    hold ``Popen`` objects of some of them."""
    live = []
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
            live.append(p)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while live:
        if reap is not None:
            reap()
        still = []
        for p in live:
            if pid_alive(p):
                still.append(p)
                continue
            # gone, or a zombie child of ours (one that exited after a reap before this look
            # would stay one): reap it
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass  # not ours (or reaped already)
        live = still
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.02)  # waiting for other processes to exit; no event to wait on
    for p in live:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return live
