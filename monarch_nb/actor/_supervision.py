"""Mesh failures and what happens when nobody handles them."""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sys
import threading
from typing import Any

from .._errgroup import clean_traceback, shorten_message
from . import _context

logger = logging.getLogger(__name__)


class MeshFailure:
    """Ranks of a mesh failed: an actor on its own, or the proc (or host) under it. Passed to
    ``__supervise__`` and ``unhandled_fault_hook``."""

    def __init__(
        self, mesh_name: str, mesh: Any, error: Exception, crashed_ranks: list[int] | None = None, event: str | None = None
    ) -> None:
        self.mesh_name = mesh_name
        self.mesh = mesh
        self.error = error
        rank = getattr(error, "rank", None)
        self.crashed_ranks = list(crashed_ranks) if crashed_ranks is not None else ([rank] if rank is not None else [])
        self.event = event if event is not None else f"Supervision event: {getattr(error, 'message', error)}"
        #: for an actor's failure: the actor calls name as failed, and why (see ActorSlot.fail_unsupervised)
        self.actor = ""
        self.reason = ""

    def report(self) -> str:
        """Monarch's words for an actor's failure (``The actor <…> and all its descendants have
        failed:`` and why, as its errors say), what a hook written for Monarch logs; else (a
        proc mesh with no actor on it) the mesh and the event."""
        first, sep, rest = self.event.partition("\n")
        m = re.fullmatch(r"Supervision event: actor (.+) failed:", first)
        if m is not None:
            return f"The actor {m.group(1)} and all its descendants have failed:{sep}{rest}"
        return self._ours()

    def _ours(self) -> str:
        # what this process says of it (notices, logs): the mesh by name, as the notebook shows it
        return f"mesh {self.mesh_name!r} failed: {self.event}"

    def __repr__(self) -> str:
        # Monarch's words
        return f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, event={self.event})"

    __str__ = __repr__


_exit_requested = False
#: how many failures the default hook has dealt with in a kernel (tests wait on it)
_hook_calls = 0
#: the whole text of the default hook's notices in a notebook, by number, the latest
#: ``_NOTICES_KEPT``: a notice there shortens a long message (as errors do) and names its entry
unhandled_failures: dict[int, str] = {}
_NOTICES_KEPT = 64


def stopped_words(mesh: str, method: str, actor: str, reason: str = "stopped by client") -> tuple[str, str]:
    """A call to a stopped actor mesh: (ours, the whole message in Monarch's words then ours),
    the same whether the call was in hand at the stop or sent after it. ``reason``: the stop's,
    as Monarch's status line gives it (``stop("why")``'s, or who stopped it from outside)."""
    ours = f"actor mesh {mesh!r} was stopped; spawn it again"
    return ours, (
        f"Endpoint call {mesh}.{method}() failed, Supervision event: actor {actor} has status:\n  stopped: {reason}\n  {ours}"
    )


def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Default policy for a failure nobody supervised.

    In a script: report it and exit non-zero (fail fast). Under IPython: report it; the
    mesh is marked failed and the kernel lives on. Replace it by assigning
    ``monarch_nb.actor.unhandled_fault_hook = my_hook``.
    """
    global _hook_calls
    _hook_calls += 1
    # the failure's remote traceback (a failed __init__) as errors show theirs: cells named
    text = clean_traceback(f"monarch_nb: unhandled mesh failure: {failure._ours()}")
    notice = _context.client().notice if _context._client is not None else None
    if notice is not None:
        # a 10 KB message would bury the cell: shortened as the notebook's errors are, the
        # whole of it kept where the notice says
        unhandled_failures[_hook_calls] = text
        for n in list(unhandled_failures)[:-_NOTICES_KEPT]:
            del unhandled_failures[n]
        hint = f"print(monarch_nb.actor.unhandled_failures[{_hook_calls}]) shows all of it"
        notice(shorten_message(text, hint), failure.mesh_name, getattr(failure.error, "rank", None))
    else:
        print(text, file=sys.stderr, flush=True)
    if _context.in_ipython_kernel():
        # the kernel's output layer keeps the notice quiet when the cell already raised the failure
        return
    _end_main_thread()


def _end_main_thread() -> None:
    """A script's fail-fast end: the main thread gets a KeyboardInterrupt (as in Monarch), and
    the process exits with status 1 after its atexit handlers."""
    global _exit_requested
    _exit_requested = True
    _install_exit_hook()
    # a real SIGINT (unlike _thread.interrupt_main) also wakes a main thread blocked in a wait,
    # but only if that thread receives it: a process-directed signal may go to any thread (Linux
    # skips a main thread that has a signal pending), and then the wait runs to its end
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        # SIGINT does not raise KeyboardInterrupt here: ignored (a background job of a
        # non-interactive shell starts so) or taken by the program, so no wait would end
        _exit_now()
    main = threading.main_thread().ident
    if main is not None and main != threading.get_ident():
        signal.pthread_kill(main, signal.SIGINT)
    else:
        os.kill(os.getpid(), signal.SIGINT)


def _exit_now() -> None:
    sys.stderr.write("monarch_nb: exiting (exit code 1) after an unhandled mesh failure\n")
    sys.stderr.flush()
    # as Monarch's: atexit handlers run, then status 1 (a KeyboardInterrupt left to the
    # interpreter would end the process by SIGINT, status 130)
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)


def _install_exit_hook() -> None:
    prev = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if _exit_requested and issubclass(tp, KeyboardInterrupt):
            _exit_now()
        prev(tp, value, tb)

    sys.excepthook = hook


_report_lock = threading.Lock()


def _supervises(slot: Any) -> bool:
    obj = getattr(slot, "obj", None)
    return obj is not None and type(obj).__supervise__ is not _base_supervise()


def report(failure: MeshFailure) -> None:
    """Give ``failure`` to the owning actor's ``__supervise__``; when it is not handled there
    the owner fails and its own owner hears of that. With no owning actor: the client's
    ``unhandled_fault_hook`` (or, in a proc, the proc exits)."""
    _tap(failure)
    with _report_lock:
        # the owner is the actor that spawned the failed mesh
        owner = getattr(getattr(failure.mesh, "_owner", None), "_slot", None)
        if owner is not None:
            if owner.failed is not None or owner.stopping:
                # failed already (that failure went up on its own), or stopping: dropped silently
                return
            exc: BaseException | None = None
            if _supervises(owner):
                try:
                    # on the actor's own thread or loop, between its messages (awaited if async)
                    if owner.supervise(failure):
                        return
                except BaseException as e:
                    exc = e
            if owner.stopping:
                return  # stop() cancelled the pending __supervise__: silently
            owner.fail_unsupervised(failure, exc)
            return
        inst = _context.current_instance()
        slot = getattr(inst, "_slot", None) if inst is not None else None
        if not _supervises(slot):
            slot = None
            host = _context.runtime().system.get("__sys__")
            for s in list(_context.runtime().actors.values()) if host else []:
                if _supervises(s):
                    slot = s
                    break
        if slot is not None:
            try:
                if slot.supervise(failure):
                    return
            except Exception:
                logger.exception("__supervise__ raised")
        if _context.proc_spec is not None:
            _escalate(failure)
            return
        from monarch_nb import actor as public

        try:
            public.unhandled_fault_hook(failure)
        except BaseException as e:
            # Monarch's contract: a hook that raises (sys.exit() too) leaves the failure
            # unhandled, and a script ends as with the default hook. A kernel lives on
            logger.exception("unhandled_fault_hook raised")
            if not _context.in_ipython_kernel():
                print(
                    f"monarch_nb: unhandled mesh failure (unhandled_fault_hook raised {type(e).__name__}: {e}): "
                    f"{failure._ours()}",
                    file=sys.stderr,
                    flush=True,
                )
                _end_main_thread()


def _tap(failure: MeshFailure) -> None:
    client = _context._client
    for tap in list(client.failure_taps) if client is not None else ():
        try:
            tap(failure)
        except Exception:  # a reader's bug must not stop the failure's handling
            logger.exception("a failure tap raised")


def _escalate(failure: MeshFailure) -> None:
    """A failure nobody in this proc handled goes up the tree, as in Monarch: the owning
    actor fails, so its creator sees its mesh fail (and so on up to the controller's
    ``unhandled_fault_hook``). Here the proc exits, which its owner observes as exactly that.
    """
    print(f"monarch_nb: unhandled mesh failure, this proc exits: {failure._ours()}", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(1)


def _base_supervise() -> Any:
    from ._actor import Actor

    return Actor.__supervise__
