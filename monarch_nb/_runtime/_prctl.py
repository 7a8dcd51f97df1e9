"""Linux process plumbing the standard library lacks."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc
    _libc = None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to us when our parent thread exits."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
