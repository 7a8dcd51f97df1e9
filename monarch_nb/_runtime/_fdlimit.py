"""File descriptors: how many a process may open, and room for more before it opens them.

A controller holds about three descriptors per proc it talks to (its connection to the proc,
the proc's connection back, a direct connection) and one more per actor (the actor's thread
connects to it directly); an allocator about four per proc it runs. The usual soft limit is
1,024, which a controller reaches at about 250 procs, and libzmq aborts the whole process (the
notebook's kernel) when its listener cannot accept a connection for want of a descriptor. So
every process of the runtime raises its soft limit towards the hard one as it starts (procs
inherit their allocator's), and a spawn of procs or actors first checks that there is room,
failing with an error that says what to do rather than letting the kernel die later.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import time
from collections.abc import Callable

#: the soft limit is raised to at most this: enough for thousands of procs, and low enough
#: that code which closes every possible descriptor in a loop stays quick
TARGET = 65536
#: descriptors a controller (and an allocator) needs per proc it spawns (see above; measured
#: 3 and 4), rounded up
PER_PROC = 5
#: descriptors a controller needs per actor it spawns (each actor's thread connects to it
#: directly; measured 1)
PER_ACTOR = 1
#: left free for everything else the process does (files, pipes, libraries' own sockets)
RESERVE = 64


def raise_soft_limit() -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``min(hard, TARGET)`` if it is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = TARGET if hard == resource.RLIM_INFINITY else min(hard, TARGET)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # a container that forbids it: ensure_room still says so before a spawn


def open_count() -> int:
    """Descriptors this process has open (Linux: its ``/proc/self/fd``; else 0)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one the listing itself used
    except OSError as e:
        if e.errno == errno.EMFILE:  # not even one more: all of them
            return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 0


def usage() -> str:
    """ "N of its M open (hard limit H)": where this process stands, for a message."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _usage(open_count(), soft, hard)


def _usage(used: int, soft: int, hard: int) -> str:
    return f"{used} of its {soft} open (hard limit {hard})"


def ensure_room(need: int, what: str, starts: str = "Jupyter") -> None:
    """Raise ``OSError(EMFILE)`` naming the limit if this process has no room for ``need``
    more descriptors, keeping :data:`RESERVE` free; ``what`` takes them (``PER_PROC`` per proc
    spawned, ``PER_ACTOR`` per actor); ``starts``: what the user restarts with a higher limit
    (this process)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return
    used = open_count()
    if used + need + RESERVE <= soft:
        return
    raise _exhausted(f"{what} needs about {need} more file descriptors and leaves {RESERVE} free", used, need, starts)


def out_of_descriptors(what: str, starts: str = "Jupyter") -> OSError:
    """The ``OSError(EMFILE)`` for ``what`` (opening a connection, say) when the process has
    no descriptor left, naming the limit and what to do."""
    return _exhausted(f"{what} needs a file descriptor", open_count(), 1, starts)


def _exhausted(need_text: str, used: int, need: int, starts: str) -> OSError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    suggest = max(TARGET, used + need + RESERVE)
    return OSError(
        errno.EMFILE,
        f"{need_text}, but this process has {_usage(used, soft, hard)}. "
        f"Start {starts} from a shell with `ulimit -n {suggest}` "
        "(above the hard limit that takes /etc/security/limits.conf, or LimitNOFILE= in a systemd unit), "
        "or stop meshes you no longer use",
    )


#: accept() errors after which a listener still works: a pending connection that was aborted,
#: or no descriptor or memory for it yet
_ACCEPT_AGAIN = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO})
ACCEPT_PAUSE_S = 0.1


def accept(lsock: socket.socket, what: str, warn: Callable[..., None]) -> socket.socket | None:
    """The next connection for a thread that serves ``lsock`` until it is closed (then None).
    Out of descriptors for now (this process's own code, or connections a stranger holds open),
    it waits and tries again, the connection queued meanwhile, saying so through ``warn``
    (a :meth:`Refusals.refused <._refusals.Refusals.refused>`); such a thread used to end at
    the first ``EMFILE``, and ``what`` (the data plane, the gateway) never answered again."""
    while True:
        try:
            return lsock.accept()[0]
        except OSError as e:
            if lsock.fileno() < 0 or e.errno not in _ACCEPT_AGAIN:
                return None  # closed
            if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                continue  # that peer gave up before we took it
            warn("%s cannot accept a connection for now: %s (descriptors: %s); retrying", what, e.strerror, usage())
            time.sleep(ACCEPT_PAUSE_S)
