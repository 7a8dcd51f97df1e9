"""Large copies without the page-fault bill: CPython's buffer and bytes C API through ctypes.

A fresh 64 MiB ``bytes`` costs 16,384 page faults (4 KiB each) before the copy into it even
starts: on a small VM that is more time than the copy. Transparent huge pages cut that to 32
faults, but Linux hands them out only to ranges advised with ``MADV_HUGEPAGE`` (the common
``enabled=madvise`` setting), and ``bytes(buffer)`` gives no chance to advise. So the bytes
object is made uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, the documented way for
C code to fill one), advised, and filled by ``memmove`` with the GIL released.

Even in huge pages, the kernel's zeroing of fresh memory costs more than the copy (3.6 vs
2.8 ms for 64 MiB here). So the last large ``bytes`` made here is remembered: when the next one
of the same size comes and nothing else holds the old one any more (its reference count says
so: only this module could still see it, so nobody can see it change), its memory is filled
again instead of fresh memory. One per process, given up after a few seconds unused
(:func:`release_idle`).

Anything unusual (another interpreter, no libc, a non-contiguous buffer) falls back to plain
``bytes(buffer)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

#: below this a plain copy is as fast (a huge page is 2 MiB; the ends stay small pages)
MIN_BYTES = 4 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
#: the largest ``bytes`` kept for reuse, and how long one is kept unused: a process that got
#: one keeps that much memory this long after (its peak is no higher than without reuse)
REUSE_MAX = 512 << 20
REUSE_IDLE_S = 5.0
_PyBUF_SIMPLE = 0
_PyBUF_WRITABLE = 1


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _load() -> Any:
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    try:
        api = ctypes.pythonapi
        new = api.PyBytes_FromStringAndSize
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
        get = api.PyObject_GetBuffer
        get.restype, get.argtypes = ctypes.c_int, (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
        rel = api.PyBuffer_Release
        rel.restype, rel.argtypes = None, (ctypes.POINTER(_PyBuffer),)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (AttributeError, OSError):
        return None
    # ob_sval follows the header; a 1-byte bytes object shows where
    probe = b"\xa5"
    sval = bytes.__basicsize__ - 1
    if ctypes.string_at(id(probe) + sval, 1) != probe:
        return None
    # the cached hash (ob_shash) just before it, if this build has one: reuse resets it
    probe = b"mnb-probe-%d" % id(sval)  # made here: its hash not yet computed
    shash = sval - ctypes.sizeof(ctypes.c_ssize_t)
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        shash = 0  # free-threaded: a reference count read here is not the whole story
    elif ctypes.c_ssize_t.from_address(id(probe) + shash).value != -1:
        shash = 0
    else:
        h = hash(probe)
        if ctypes.c_ssize_t.from_address(id(probe) + shash).value != h:
            shash = 0
    return new, get, rel, madvise, sval, shash


_API = _load()


def _header_layout() -> bool:
    """Whether a ``bytes`` header is reference count, type, size, cached hash, in that order,
    one word each, as :func:`bytes_at` writes it (CPython 3.11-3.13 with the GIL)."""
    if _API is None or not _API[5] or _API[4] != 4 * ctypes.sizeof(ctypes.c_ssize_t):
        return False
    probe = b"mnb-layout-probe-%d" % id(_API)
    word = ctypes.sizeof(ctypes.c_ssize_t)
    before = ctypes.c_ssize_t.from_address(id(probe)).value
    held = [probe]  # one more reference: the count must move by one
    ok = (
        ctypes.c_ssize_t.from_address(id(probe)).value == before + 1
        and ctypes.c_void_p.from_address(id(probe) + word).value == id(bytes)
        and ctypes.c_ssize_t.from_address(id(probe) + 2 * word).value == len(probe)
        and _API[5] == 3 * word
    )
    del held
    return ok


#: bytes objects can be laid over memory of ours (:func:`bytes_at`)
IN_PLACE = _header_layout()
#: the room :func:`bytes_at` needs before the data for the object's header
HEAD = _API[4] if IN_PLACE else 0


def bytes_at(addr: int, n: int) -> bytes:
    """A ``bytes`` object whose ``n`` bytes are the memory at ``addr + HEAD``, not a copy: its
    header is written into the ``HEAD`` bytes before them, and a NUL after them (CPython's
    terminator), so ``[addr, addr + HEAD + n + 1)`` must be the caller's, writable.

    The object holds one reference nobody owns, so CPython never frees it (its memory is
    not CPython's): :func:`in_use` says when nobody else holds it, and only then may the memory
    be written again or unmapped. Only where :data:`IN_PLACE`."""
    if not IN_PLACE:
        raise BufferError("bytes objects cannot be laid over memory in this interpreter")
    word = ctypes.sizeof(ctypes.c_ssize_t)
    ctypes.memset(addr + HEAD + n, 0, 1)
    ctypes.c_ssize_t.from_address(addr + 3 * word).value = -1  # no cached hash
    ctypes.c_ssize_t.from_address(addr + 2 * word).value = n
    ctypes.c_void_p.from_address(addr + word).value = id(bytes)
    ctypes.c_ssize_t.from_address(addr).value = 1  # the reference nobody owns
    out: bytes = ctypes.cast(ctypes.c_void_p(addr), ctypes.py_object).value
    return out


def in_use(addr: int) -> bool:
    """Whether anyone holds the object :func:`bytes_at` made at ``addr``."""
    return ctypes.c_ssize_t.from_address(addr).value > 1


def available() -> bool:
    return _API is not None


@contextlib.contextmanager
def pinned(obj: Any, writable: bool = False) -> Iterator[tuple[int, int]]:
    """``(address, nbytes)`` of a C-contiguous buffer, held (not movable, not freed) inside."""
    if _API is None:
        raise BufferError("raw buffer addresses need CPython on Linux")
    view = _PyBuffer()
    _API[1](obj, ctypes.byref(view), _PyBUF_WRITABLE if writable else _PyBUF_SIMPLE)
    try:
        yield view.buf or 0, view.len
    finally:
        _API[2](ctypes.byref(view))


def advise_huge(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the 2 MiB-aligned part of a not yet touched range."""
    lo = (addr + _HUGE - 1) & ~(_HUGE - 1)
    hi = (addr + nbytes) & ~(_HUGE - 1)
    if _API is not None and hi > lo:
        _API[3](lo, hi - lo, _MADV_HUGEPAGE)  # a kernel without THP says EINVAL: small pages then


def copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` with the GIL released (ctypes drops it around foreign calls)."""
    ctypes.memmove(dst, src, nbytes)


def to_bytes(buf: Any) -> bytes:
    """A new ``bytes`` with the content of ``buf`` (one copy, into huge pages when large)."""
    mv = memoryview(buf)
    n = mv.nbytes
    if _API is None or n < MIN_BYTES or not mv.c_contiguous:
        return bytes(mv)
    with pinned(mv) as (src, _):
        out = _reuse(n) or _fresh(n)
        copy(id(out) + _API[4], src, n)
    _remember(out)
    return out


def _remember(out: bytes) -> None:
    if len(out) <= REUSE_MAX and _API[5]:
        with _last_lock:
            _last[:] = [out, time.monotonic()]


_last: list[Any] = []  # [the last large bytes made here, when]
_last_lock = threading.Lock()


def _reuse(n: int) -> bytes | None:
    with _last_lock:
        old = _last[0] if _last else None
        _last.clear()
    # 2: ``old`` here and getrefcount's argument; any other holder (the user, a memoryview,
    # a queue) keeps it as it is
    if old is None or len(old) != n or sys.getrefcount(old) != 2:
        return None
    ctypes.c_ssize_t.from_address(id(old) + _API[5]).value = -1  # its content changes: no cached hash
    return old  # type: ignore[no-any-return]


def release_idle(idle: float) -> None:
    """Forget the ``bytes`` kept for reuse if unused for ``idle`` seconds (its memory goes back)."""
    with _last_lock:
        if _last and time.monotonic() - _last[1] > idle:
            _last.clear()


def _fresh(n: int) -> bytes:
    """An uninitialised ``bytes`` of ``n``, advised for huge pages: only its maker holds it
    until it is filled."""
    out: bytes = _API[0](None, n)
    advise_huge(id(out) + _API[4], n)
    return out


def join(parts: list[Any]) -> bytes:
    """``b"".join(parts)``, into huge pages when large, or into the memory of the last large
    ``bytes`` made here when nothing holds it any more (as :func:`to_bytes`)."""
    n = sum(memoryview(p).nbytes for p in parts)
    if _API is None or n < MIN_BYTES or not all(memoryview(p).c_contiguous for p in parts):
        return b"".join(parts)
    out = _reuse(n) or _fresh(n)
    dst = id(out) + _API[4]
    for p in parts:
        with pinned(p) as (src, m):
            copy(dst, src, m)
            dst += m
    _remember(out)
    return out
