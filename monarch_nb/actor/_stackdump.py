"""Every thread's Python stack in this process, taken on the I/O thread.

The I/O thread answers while an actor thread is blocked in a collective or a C call that
released the GIL; one that holds the GIL stops this answer too, which the caller reports.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any


def collect(rt: Any) -> dict[str, Any]:
    """``{"pid", "host", "threads": [{"name", "ident", "collector", "frames": [(file, line, func, source)]}], "actors"}``."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        stack: list[traceback.FrameSummary] = list(traceback.extract_stack(frame))
        if ident == me:
            # the collector's own frames say nothing about the process
            stack = stack[: next((i for i, fs in enumerate(stack) if fs.filename == __file__), len(stack))]
        threads.append(
            {
                "name": names.get(ident, f"thread-{ident}"),
                "ident": ident,
                "collector": ident == me,
                "frames": [(fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip()) for fs in stack],
            }
        )
    actors = {n: getattr(s, "busy", []) for n, s in list(getattr(rt, "actors", {}).items())}
    return {"pid": os.getpid(), "host": getattr(rt, "hostname", ""), "threads": threads, "actors": actors}
