"""A ``KeyboardInterrupt`` in a cell (a ``CancelledError`` in an async one) shown without
monarch_nb's own frames.

An interrupt lands wherever the kernel's main thread was: in a cell blocked on ``.get()``
that is a lock inside the runtime, three to six frames (``Future.get``, ``_debugwait.wait``,
``%%mesh exec``'s plumbing) that say nothing about the user's code and push the note that
says what still runs below a screenful. Remote tracebacks already hide runtime frames
(``_errgroup.clean_traceback``); this does the same for the local one. Other exceptions keep
IPython's view: ours carry ``_render_traceback_``, and the user's own are not ours to trim.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import sysconfig
import threading
import types
from collections.abc import Iterator
from typing import Any

from .._errgroup import _internal, show_internal_frames

#: an interrupted wait: ``.get()`` raises KeyboardInterrupt, an async cell's ``await`` CancelledError
INTERRUPTS = (KeyboardInterrupt, asyncio.CancelledError)


def _library(path: str) -> bool:
    """A file of Python's or of an installed package (or a compiled module's relative name, as
    pyzmq's ``zmq/backend/cython/_zmq.py``): not code the user wrote."""
    if not os.path.isabs(path):
        return not path.startswith("<")  # "<ipython-input-…>", "<mesh exec In[3]>": a cell's
    return path.startswith(_LIBS) or f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


_LIBS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames of monarch_nb's own files, nor those of the libraries they
    called (an interrupt in our zmq poll showed pyzmq's frames, "Could not get source");
    ``tb`` itself when it has none."""
    frames: list[types.TracebackType] = []
    t = tb
    while t is not None:
        frames.append(t)
        t = t.tb_next
    kept = []
    ours = False
    for t in frames:
        path = t.tb_frame.f_code.co_filename
        if _internal(path):
            ours = True
        elif not (ours and _library(path)):
            kept.append(t)
    if len(kept) == len(frames) or not kept:
        return tb
    out: types.TracebackType | None = None
    for t in reversed(kept):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


def _show(shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None) -> list[str]:
    # what IPython's showtraceback records and its custom-handler path does not: %tb and %debug
    # read them (the whole traceback: a debugger may go into our frames)
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if not show_internal_frames():
        tb = user_frames(tb)
    with _held_off():
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        # IPython's run_code calls a custom handler and shows nothing itself
        shell._showtraceback(etype, value, stb)
    return stb


@contextlib.contextmanager
def _held_off() -> Iterator[None]:
    """Ignore SIGINT meanwhile: the cell is already interrupted, and formatting its traceback
    takes seconds on a busy machine, when an impatient user interrupts again. Raised in a custom
    handler, that interrupt made IPython unregister it for good ("Custom TB Handler failed") and
    print its own formatting frames instead of the cell's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, outer)


def install(shell: Any) -> bool:
    """Show a cell's :data:`INTERRUPTS` through :func:`_show`, unless the shell already has
    a custom exception handler (another extension's, or the user's: theirs wins)."""
    if getattr(shell, "custom_exceptions", None) != ():
        return False
    shell.set_custom_exc(INTERRUPTS, _show)
    return True


def uninstall(shell: Any) -> None:
    if getattr(shell, "custom_exceptions", None) == INTERRUPTS:
        handler = getattr(shell.CustomTB, "__func__", None)
        # IPython wraps the handler: ours is the one whose closure holds _show
        cells = getattr(handler, "__closure__", None) or ()
        if any(c.cell_contents is _show for c in cells):
            shell.set_custom_exc((), None)
