"""Where a warning about the program's own call points: its line, not ours."""

from __future__ import annotations

import sys
from typing import Any

#: modules whose frames a warning about the program's own call skips: ours, and IPython's and
#: ipykernel's (a magic's caller is the cell)
_NOT_THE_CALLER = ("monarch_nb.", "IPython.", "ipykernel.")


def callers_level() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller name the
    program's line (the ``.get()``, ``await`` or ``%mesh stop`` that read the future), not ours:
    the warning is issued where the future is first read, and how many of our frames lie between
    depends on how it was read. 1 (the caller) when no frame of the program is on this thread."""
    f: Any = sys._getframe(1)
    level = 1
    while f is not None and f.f_globals.get("__name__", "").startswith(_NOT_THE_CALLER):
        f, level = f.f_back, level + 1
    return level if f is not None else 1
