"""Large copies without the page-fault bill: CPython's buffer and bytes C API through ctypes.

A fresh 64 MiB ``bytes`` costs 16,384 page faults (4 KiB each) before the copy into it even
starts: on a small VM that is more time than the copy. Transparent huge pages cut that to 32
faults, but Linux hands them out only to ranges advised with ``MADV_HUGEPAGE`` (the common
``enabled=madvise`` setting), and ``bytes(buffer)`` gives no chance to advise. So the bytes
object is made uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, the documented way for
C code to fill one), advised, and filled by ``memmove`` with the GIL released.

Anything unusual (another interpreter, no libc, a non-contiguous buffer) falls back to plain
``bytes(buffer)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from typing import Any

#: below this a plain copy is as fast (a huge page is 2 MiB; the ends stay small pages)
MIN_BYTES = 4 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
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
    return new, get, rel, madvise, sval


_API = _load()


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
        out: bytes = _API[0](None, n)
        dst = id(out) + _API[4]
        advise_huge(dst, n)
        copy(dst, src, n)
    return out


def join(parts: list[Any]) -> bytes:
    """``b"".join(parts)``, into huge pages when large (as :func:`to_bytes`)."""
    n = sum(memoryview(p).nbytes for p in parts)
    if _API is None or n < MIN_BYTES or not all(memoryview(p).c_contiguous for p in parts):
        return b"".join(parts)
    out: bytes = _API[0](None, n)
    dst = id(out) + _API[4]
    advise_huge(dst, n)
    for p in parts:
        with pinned(p) as (src, m):
            copy(dst, src, m)
            dst += m
    return out
