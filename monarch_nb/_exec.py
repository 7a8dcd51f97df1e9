"""The actor behind ``%%mesh exec``: runs cell source in a proc, like an ipyparallel engine.

Each proc keeps one namespace across cells. Code runs on the proc's main thread, so a kernel
interrupt becomes a real SIGINT there and breaks blocking calls as it would locally.
"""

from __future__ import annotations

import ast
import builtins
import contextvars
import gc
import linecache
import time
import traceback
from typing import Any, cast

import cloudpickle

from ._newest import Newest
from ._runtime import spans
from .actor import Actor, endpoint
from .actor._context import runtime
from .actor._host import ensure_actor_host
from .actor._spans import _who
from .spmd import _default_group_initialized, _forget_destroyed_groups

#: the actor name every proc mesh uses for its exec namespace
EXEC_ACTOR = "__mnb_exec__"
#: the ``__name__`` of a mesh's exec namespace (the module of the classes its cells define)
EXEC_NS = "__mnb_exec__"
#: how many cells' outcomes a proc remembers for :meth:`ExecActor.outcome`
OUTCOMES_KEPT = 64


class Unpicklable:
    """Stands in for a cell value that cannot travel back to the notebook."""

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unpicklable {self.text} ({self.reason})>"


class CellFailed(Exception):
    """A cell raised in a proc: ``args`` are its ``(type name, message, formatted traceback)``.

    Raised out of :meth:`ExecActor.run` (not returned) so that the call fails fast as any
    endpoint's does: the other ranks may be blocked for good in a collective waiting for this
    one, and the notebook must hear of it now, not when their collective times out."""

    #: whether torch.distributed's default process group was initialized in the proc
    holds_group = False


class ExecActor(Actor):
    def __init__(self) -> None:
        self.ns: dict[str, Any] = {"__name__": EXEC_NS, "__builtins__": builtins}
        self.count = 0
        #: label -> how the cell ended here: ``(type name, message)`` it raised, both empty when
        #: it succeeded
        self.outcomes: Newest[str, tuple[str, str]] = Newest(OUTCOMES_KEPT, refresh=False)

    @endpoint
    def outcome(self, label: str) -> tuple[str, str] | None:
        """How cell ``label`` ended in this proc (None: not run here). A cell fails fast, so its
        call does not wait for the ranks still running when one raised (in a collective with
        it, perhaps): asked after it, this answers once they have ended it (calls to one actor
        run in order), and the notebook says how (``mesh.exec_cell``)."""
        return self.outcomes.get(label)

    def _ended(self, label: str, error: tuple[str, str]) -> None:
        self.outcomes[label] = error

    @endpoint
    def run(self, source: str, label: str = "") -> tuple[bool, Any]:
        """Run ``source``; ``(True, value of the last expression)``, or raise :class:`CellFailed`."""
        self.count += 1
        filename = f"<mesh exec {label or self.count}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ctx = contextvars.copy_context()
        host = ensure_actor_host(runtime())
        t0 = time.perf_counter()
        had_group = _default_group_initialized()
        try:
            value = host.run_on_main(lambda: ctx.run(self._exec, source, filename))
            self._ended(label or str(self.count), ("", ""))
        except BaseException as e:  # KeyboardInterrupt too: it is the cell's result, not the actor's end
            tb = e.__traceback__
            # drop our own frames: the user wants their cell's lines
            while tb is not None and tb.tb_frame.f_code.co_filename != filename:
                tb = tb.tb_next
            text = "".join(traceback.format_exception(type(e), e, tb))
            # a class the cell defined reads as a notebook cell's does (``ShardError: …``), not
            # qualified by this namespace's internal module name (``__mnb_exec__.ShardError``)
            text = text.replace(f"{EXEC_NS}.", "")
            # this span carries the cell's own error (the call span only says the endpoint raised)
            # to telemetry, and to every dashboard on the mesh, whichever kernel ran the cell
            actor, rank = _who()
            spans.record_span(
                "mesh exec",
                actor,
                rank,
                t0,
                time.perf_counter(),
                False,
                {"cell": label, "error": f"{type(e).__name__}: {e}"[:300]},
            )
            failed = CellFailed(type(e).__name__, str(e), text)
            # the ranks waiting for this one in a collective of its process group are freed by
            # destroying that group here (its connections close): the error says so
            failed.holds_group = _default_group_initialized()
            self._ended(label or str(self.count), (type(e).__name__, str(e)))
            raise failed from None
        finally:
            if had_group and not _default_group_initialized():
                # the cell destroyed the group (the error's advice): what torch itself still
                # holds of it kept its connections open, and the ranks it was to free blocked
                _forget_destroyed_groups()
                gc.collect()  # a deleted DDP model's hooks are reference cycles
        if value is None:
            return True, None
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            return True, Unpicklable(repr(value)[:200], f"{type(e).__name__}: {e}")
        return True, value

    def _exec(self, source: str, filename: str) -> Any:
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(cast(ast.Expr, tree.body.pop()).value)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.ns)
        return None
