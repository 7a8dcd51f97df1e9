"""Debug any rank: list paused sessions, attach a pdb, cast a command to many ranks, continue.

``breakpoint()`` (or ``pdb.set_trace()``) in an endpoint pauses that actor and registers a
session with its host's allocator. Everything here reaches sessions through allocators, so it
works from any controller: the notebook that made the call, another kernel, a restarted one,
or ``monarch-nb debug`` in a terminal.

>>> from monarch_nb import debug
>>> debug.sessions()                       # the session table, as records
>>> s = debug.attach("debugee", 13)        # a pdb on rank 13
>>> print(s.send("p rank")); s.send("c")
>>> debug.cast("debugee", "0-3", "p rank") # {rank: output}
>>> debug.continue_all()
>>> debug.stacks(mesh)                     # every thread's stack on every rank, merged

:class:`Console` is the interactive loop (``list``, ``attach``, ``cast``, ``continue``, also in
Monarch's spelling ``attach debugee 13``, ``cast debugee ranks(0:4) p x``) shared by the
blocked cell, the ``%mesh`` magics and the CLI. A controller whose main thread is blocked on
a call whose rank stops runs it through ``input()``: in a kernel, the cell's input box.
``with quiet():`` keeps housekeeping waits (a frontend's own requests) from opening it.
"""

from ..actor._debugwait import quiet
from . import _blocked  # noqa: F401  (importing it installs the blocked-cell console)
from ._console import Console, run_cli
from ._sessions import DebugClient, RankSet, Session, attach, cast, continue_all, format_table, parse_ranks, sessions
from ._stacks import Stacks, stacks

__all__ = [
    "Console",
    "DebugClient",
    "RankSet",
    "Session",
    "Stacks",
    "attach",
    "cast",
    "continue_all",
    "format_table",
    "parse_ranks",
    "quiet",
    "run_cli",
    "sessions",
    "stacks",
]
