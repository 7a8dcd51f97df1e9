"""That files never appear for a while: their directories watched with inotify, so a file made
and removed again in between is seen too (a poll for its existence would miss it)."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time

_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded


def assert_none_appear(paths: list[str], seconds: float, message: str) -> None:
    """None of ``paths`` exists now or is made (or moved there) within ``seconds``; else
    AssertionError with ``message`` and the path."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, f"inotify_init1: {os.strerror(ctypes.get_errno())}"
    try:
        names: dict[int, set[str]] = {}
        for path in paths:
            parent, name = os.path.split(os.path.abspath(path))
            wd = libc.inotify_add_watch(fd, parent.encode(), _IN_CREATE | _IN_MOVED_TO)
            assert wd >= 0, f"inotify_add_watch {parent}: {os.strerror(ctypes.get_errno())}"
            names.setdefault(wd, set()).add(name)
        # after the watches: a file made from here on is an event, one made before exists
        made = [p for p in paths if os.path.exists(p)]
        assert not made, f"{message}: {made}"
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                continue
            data, off = os.read(fd, 65536), 0
            while off < len(data):
                wd, _, _, n = _EVENT.unpack_from(data, off)
                off += _EVENT.size
                name = data[off : off + n].rstrip(b"\0").decode(errors="replace")
                off += n
                assert name not in names.get(wd, ()), f"{message}: {name} was made"
    finally:
        os.close(fd)
