"""Large buffers to a peer on this host travel through shared memory, not the socket.

The sender writes a buffer into a fresh file in ``/dev/shm`` (one copy, by the kernel),
named ``mnb-<sender pid>-<128 random bits>``, created ``O_EXCL`` with mode 0600, and sends
the name. The receiver checks that the file is a regular file of its own user, 0600 and of
the announced size, maps it copy-on-write (the data stays where the sender put it: arrays
and tensors are built on the mapping, zero-copy) and unlinks it at once, so the mapping is
the only thing left and goes with the last object using it.

Only used between peers on ipc addresses, i.e. the same host and user (the socket itself is
0600 in the user's runtime dir). A name nobody took (the receiver died first) is unlinked by
the sender after a grace period or when it closes, and by the allocator when the sender dies.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
import time
from typing import Any

from ..errors import ProtocolError

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"mnb-[0-9]{1,10}-[0-9a-f]{32}")
#: a receiver takes a name within milliseconds; this long without it means it never will
GRACE_S = 60.0


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


class ShmSender:
    """Writes buffers into shared memory files for one process (thread-safe)."""

    def __init__(self) -> None:
        self.prefix = f"mnb-{os.getpid()}-"
        self._pending: dict[str, float] = {}
        self._lock = threading.Lock()

    def put(self, buf: Any) -> tuple[str, int]:
        """Copy ``buf`` into a new file; return ``(name, nbytes)`` for the receiver."""
        mv = memoryview(buf).cast("B")
        name = self.prefix + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with self._lock:
                self._pending[name] = time.monotonic()
            n, off = mv.nbytes, 0
            while off < n:
                off += os.write(fd, mv[off:])
        except BaseException:
            self._unlink(name)
            raise
        finally:
            os.close(fd)
        return name, n

    def sweep(self, max_age: float = GRACE_S) -> None:
        """Unlink names handed out more than ``max_age`` ago (taken ones are already gone)."""
        now = time.monotonic()
        with self._lock:
            old = [n for n, t in self._pending.items() if now - t > max_age]
        for n in old:
            self._unlink(n)

    def close(self) -> None:
        self.sweep(-1.0)

    def _unlink(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def take(name: str, nbytes: int) -> memoryview:
    """Map and unlink the file a peer wrote; raise :class:`ProtocolError` if it is not ours."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ProtocolError(f"malformed shared-memory reference {name!r}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ProtocolError(f"shared-memory buffer {name} is gone: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size != nbytes:
            raise ProtocolError(f"refused shared-memory buffer {name}: not a 0600 file of ours of {nbytes} bytes")
        # private: writes by the receiver (arrays are writable) never reach the file
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove (sticky /dev/shm)
    return memoryview(m)


def sweep_dead(pid: int) -> int:
    """Unlink what the dead process ``pid`` left in flight (its allocator calls this)."""
    prefix = f"mnb-{pid}-"
    n = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix) and _NAME.fullmatch(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                n += 1
            except OSError:
                pass
    return n
