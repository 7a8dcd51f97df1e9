"""libc's ``mmap`` and ``munmap`` through ctypes, typed once.

Python's :mod:`mmap` keeps a duplicate of the descriptor for each mapping's life (before 3.13's
``trackfd=False``) and cannot map at a chosen address: shared memory that lays a buffer over
pages in place (``shm``) and a reader of many owners' files (``_dataplane``) map through libc.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

#: what ``mmap`` returns when it fails (then ``ctypes.get_errno()`` says why)
MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _lib() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def mmap() -> Any:
    """``mmap(addr, length, prot, flags, fd, offset)``: the address, or :data:`MAP_FAILED`."""
    f = _lib().mmap
    f.restype = ctypes.c_void_p
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    return f


@functools.cache
def munmap() -> Any:
    """``munmap(addr, length)``: 0, or -1."""
    f = _lib().munmap
    f.restype = ctypes.c_int
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return f
