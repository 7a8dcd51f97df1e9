"""Exceptions raised by monarch_nb.

* MonarchNBError
  + ActorError            an endpoint raised remotely (.exception, .remote_traceback, .rank)
  + SupervisionError      the actor or its process is gone (.mesh, .rank, .host, .cause); also a RuntimeError
  + MeshError
    - SpawnError          an allocator could not start a proc or construct an actor
    - MeshClosedError     a mesh used after stop() (also a RuntimeError)
    - MeshNotFoundError   no mesh of that name where it was looked for (.name; also a LookupError)
  + ProtocolError         malformed, oversized, replayed or foreign frame
    - VersionMismatchError
  + AuthenticationError   the peer refused our key (or we refused theirs)
  + ConnectError          an address that cannot be reached in time
  + ConfigError
  + DebugError            a debug session that continued, is gone, or a breakpoint nobody could answer
  + ExecError             a ``%%mesh exec`` cell raised on some ranks (one entry per failing rank)
  + NotAnEndpointError    an adverb of a method without ``@endpoint`` (also AttributeError, RuntimeError)
  + DimensionNotFound     a label that is not a dimension of an extent or point (also KeyError, ValueError)

Deadlines raise the builtin ``TimeoutError`` saying what was awaited and for how long.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import traceback
from typing import Any

__all__ = [
    "ActorError",
    "AuthenticationError",
    "ConfigError",
    "ConnectError",
    "DebugError",
    "DimensionNotFound",
    "ExecError",
    "MeshClosedError",
    "MeshError",
    "MeshNotFoundError",
    "MonarchNBError",
    "NotAnEndpointError",
    "ProtocolError",
    "SpawnError",
    "SupervisionError",
    "VersionMismatchError",
    "format_exception",
]


class MonarchNBError(Exception):
    """Base class of every error monarch_nb raises itself."""

    def _note_lines(self) -> list[str]:
        # IPython shows only what a _render_traceback_ returns: without these, the notes added on
        # purpose (what to do, what still runs) never reach a notebook; Python prints them last
        return [line for n in getattr(self, "__notes__", ()) for line in str(n).splitlines()]

    def _rank_summary(self) -> list[str]:
        """Which ranks failed, one line per exception type (``KeyError on 4 of 16 ranks: 0,4,8,12``),
        for a one-line view of the error (the dashboard's errors); none for an error of no ranks."""
        return []


#: an attribute set (True) on an exception raised in a collective only because a peer's script
#: failed first (monarch_nb.spmd): a grouped call raises and shows another rank's error first
PEER_GONE_MARK = "_mnb_peer_gone"
#: gloo's words when a peer closes its connections mid-collective (its script ended: its process
#: group is destroyed; or its process died)
PEER_GONE_WORDS = ("Connection closed by peer", "Connection reset by peer")


def peer_gone(etype: type[BaseException] | str, message: str) -> bool:
    """Whether an error is a rank's collective failing only because a peer went away first (the
    peer's script failed, and its process group was destroyed, or its process died): torch's
    ``RuntimeError`` (``DistBackendError``, a ``RuntimeError``, in later versions) in gloo's words
    for it; not a socket's own ``ConnectionResetError`` ("[Errno 104] Connection reset by peer").
    ``etype`` is the error's type, or its name where only that came back (a ``%%mesh exec``
    cell's failure). The one test of it: SPMDActor marks such errors (``PEER_GONE_MARK``), and
    ExecError groups such ranks apart."""
    if isinstance(etype, str):
        torch_error = etype.rpartition(".")[2] in ("RuntimeError", "DistBackendError")
    else:
        torch_error = issubclass(etype, RuntimeError)
    return torch_error and any(w in message for w in PEER_GONE_WORDS)


class ActorError(MonarchNBError):
    """An endpoint raised on a remote actor.

    ``exception`` is the remote exception when it could be unpickled here (else a
    ``RuntimeError`` carrying its text); ``remote_traceback`` is the remote traceback
    already formatted, since exceptions do not always survive pickling.
    """

    def __init__(
        self,
        exception: BaseException,
        remote_traceback: str = "",
        *,
        actor: str = "",
        rank: int | None = None,
        host: str = "",
        message: str = "",
    ) -> None:
        self.exception = exception
        self.remote_traceback = remote_traceback
        self.actor = actor
        self.rank = rank
        self.host = host
        self.message = message or f"{type(exception).__name__}: {safe_str(exception)}"
        super().__init__(self._headline())

    #: set by a call to several actors (``_set_group``): "actor.method", how many were called,
    #: every failure by rank (index in the call), and the ranks that had not answered
    endpoint: str = ""
    #: the first line of the grouped view, where "Actor call {endpoint} failed." would say less
    #: than the caller knows (a mesh tensor op's error read through its hidden actor)
    headline: str = ""
    #: a line under the headline saying where the caller's code issued what failed (a mesh
    #: tensor op's: its error is read later, by another line, and the ranks' traceback of it
    #: has torch's frames only)
    origin: str = ""
    total: int = 0
    failures: dict[int, ActorError] | None = None
    running: list[int] | int = 0

    def _set_group(
        self, endpoint: str, total: int, failures: dict[int, ActorError] | None = None, running: list[int] | int = 0
    ) -> ActorError:
        self.endpoint, self.total, self.failures, self.running = endpoint, total, failures, running
        return self

    @property
    def exception_formatted(self) -> str:
        """The remote traceback as Monarch's ``ActorError.exception_formatted`` words it."""
        return _remote_words(self.remote_traceback)

    def _failure_tuple(self, rank: int) -> tuple[int, str, str, str]:
        """(rank, exception type, message, traceback) for grouping."""
        from ._errgroup import exception_text

        # the final exception as it printed, all of it: a message of many lines ends the
        # traceback with its own last line, which alone matched nothing and showed it twice
        last = exception_text(self.remote_traceback)
        first, _, rest = last.partition("\n")
        etype, sep, msg = first.partition(": ")
        msg = f"{msg}\n{rest}" if rest else msg
        tb = _remote_words(self.remote_traceback)
        # safe_str: the exception's own __str__ may raise here (it did not in the proc, or it
        # printed its placeholder there), and this runs inside IPython's error display
        text = safe_str(self.exception)
        # a SyntaxError's str() adds "(file, line N)", which its traceback shows above its last line
        said = getattr(self.exception, "msg", None) if isinstance(self.exception, SyntaxError) else None
        if not self.remote_traceback or not etype or " " in etype:
            etype, msg = type(self.exception).__name__, text
        elif text not in last and not (isinstance(said, str) and said and said in last):
            # the error raised is not the one its traceback ends with (a reply that could not
            # be pickled, say): show both
            etype, msg = type(self.exception).__name__, text
            tb = f"{tb.rstrip()}\n{etype}: {msg}\n"
        elif not sep:
            msg = ""
        return (rank, etype, msg, tb)

    def _cause(self) -> int:
        """The rank whose traceback is shown: the lowest (Monarch's), except a rank whose
        collective only failed because another rank's script failed first (SPMDActor marks
        those: ``PEER_GONE_MARK``), which would show gloo's "Connection closed by peer" for
        the cause."""
        failures = self.failures or {}
        return min(
            (r for r, e in failures.items() if not getattr(e.exception, PEER_GONE_MARK, False)),
            default=min(failures, default=0),
        )

    #: where a notebook's view of this error, which shortens long messages, says the whole is
    _WHOLE = "print(sys.last_value.grouped_text()) shows all of it"

    def _grouped_lines(self, color: bool) -> list[str]:
        from . import _errgroup

        # the notebook's view (color) shortens long messages: the text (grouped_text) does not
        shorten = self._WHOLE if color else ""
        lines = [self.headline or f"Actor call {self.endpoint} failed."]
        if self.origin:
            lines.append(self.origin)
        failures = self.failures or {}
        if self.total <= 1 and len(failures) <= 1:
            tb = _errgroup.clean_traceback(self._failure_tuple(0)[3])
            tb = (_errgroup.shorten_message(tb, shorten) if shorten else tb).rstrip()
            return lines + (tb.splitlines() if tb else [self.message])
        groups, waited = self._groups()
        cause = self._cause()
        groups.sort(key=lambda g: cause not in g.ranks)
        lines.extend(self._rank_lines(groups, waited, color))
        if not color:
            groups = groups + waited
        lines.extend(_errgroup.group_lines(groups, color, shorten=shorten))
        return lines

    def _groups(self) -> tuple[list[Any], list[Any]]:
        """The failures grouped: those of the ranks that failed on their own, and those of the
        ranks whose collective failed only because one of those failed first (SPMDActor marks
        them: ``PEER_GONE_MARK``). No second list when every rank is marked: a rank's own failure
        is then not among the call's, and the survivors' are all there is to show."""
        from . import _errgroup

        failures = self.failures or {}
        gone = {r for r, e in failures.items() if getattr(e.exception, PEER_GONE_MARK, False)}
        if len(gone) == len(failures):
            gone = set()
        own = _errgroup.group(e._failure_tuple(r) for r, e in failures.items() if r not in gone)
        return own, _errgroup.group(e._failure_tuple(r) for r, e in failures.items() if r in gone)

    def _rank_lines(self, groups: list[Any], waited: list[Any] | None = None, color: bool = False) -> list[str]:
        """Which ranks of the call failed, by type, which failed only waiting for them in a
        collective, and which were still running. The notebook's view (color) leaves out the
        tracebacks of those waiting: torch's own (~25 lines of DDP and gloo frames), which say
        nothing of the bug; one line each here, the whole one call away."""
        from . import _errgroup

        lines = _errgroup.summary_lines(groups, self.total)
        if waited:
            lines.extend(_waited_lines(groups, waited, self.total, "print(sys.last_value.grouped_text())" if color else ""))
        running = _errgroup.running_line(self.running, self.total)
        if running:
            # their actors take no other call until it returns: a collective waiting for the rank
            # that raised (an SPMD script) waits until its timeout, 30 minutes for gloo
            one = (self.running if isinstance(self.running, int) else len(self.running)) == 1
            whose = "its actor takes its" if one else "their actors take their"
            lines.append(f"{running}; {whose} next calls once it returns (stopping the proc mesh ends it)")
        return lines

    def _rank_summary(self) -> list[str]:
        failures = self.failures or {}
        if not self.endpoint or (self.total <= 1 and len(failures) <= 1):
            return []
        from . import _errgroup

        # as str() counts them: "RuntimeError on 16 of 16 ranks" beside rank 1's message read as
        # 16 ranks raising it
        own, waited = self._groups()
        return _errgroup.summary_lines(own, self.total) + _waited_lines(own, waited, self.total)

    def _plain_rank_lines(self) -> str:
        """The rank lines of the grouped view, for plain text: a script's traceback named no rank
        at all, so a failure on ranks 0-3 and 7 of 8 read as rank 0's alone."""
        failures = self.failures or {}
        if not self.endpoint or (self.total <= 1 and len(failures) <= 1):
            return ""
        lines = self._rank_lines(*self._groups())
        if len(failures) > 1:
            first = self._cause()
            lines.append(f"the traceback below is rank {first}'s; .grouped_text() shows every rank's")
        return "\n".join(lines) + "\n"

    def _headline(self, message: str = "") -> str:
        message = message or self.message
        where = []
        if self.actor:
            where.append(f"actor {self.actor!r}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.host:
            where.append(f"host {self.host}")
        return f"{message} ({', '.join(where)})" if where else message

    def __str__(self) -> str:
        # Monarch's: the message, then the remote traceback (of the lowest failing rank); the
        # grouped view of every failing rank is the notebook's (_render_traceback_) and grouped_text()
        if self.remote_traceback:
            from ._errgroup import clean_traceback

            # runtime frames hidden (unless traceback_internal_frames), cell frames named Cell In[N];
            # the first line stays Monarch's headline, which code matches on
            return f"{self._message_lines()}\n{self._plain_rank_lines()} {clean_traceback(self.exception_formatted)}"
        return self._message_lines() + (f"\n{self._plain_rank_lines()}".rstrip("\n") if self.endpoint else "")

    def _message_lines(self) -> str:
        return f"{self.message}\n{self.origin}" if self.origin else self.message

    def grouped_text(self) -> str:
        """Every failing rank of the call, grouped (what a notebook shows for this error)."""
        if self.endpoint:
            return "\n".join(self._grouped_lines(color=False))
        return str(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_actor_error,
            (type(self), _exc_blob(self.exception), self.remote_traceback, self.actor, self.rank, self.host, self.message),
        )

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our local frames, which say nothing about the bug.
        if self.endpoint:
            lines = self._grouped_lines(color=True)
            lines[0] = f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}"
            return lines + self._note_lines()
        from ._errgroup import clean_traceback, clip, shorten_message

        # the traceback below ends with the message: the headline's copy is only its start
        head = self._headline(clip(self.message) if self.remote_traceback else "")
        lines = [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {head}", *([self.origin] if self.origin else [])]
        if self.remote_traceback:
            lines.append("Remote traceback:")
            tb = shorten_message(clean_traceback(self.remote_traceback), "print(sys.last_value) shows all of it")
            lines.extend(tb.rstrip().splitlines())
        return lines + self._note_lines()


class SupervisionError(MonarchNBError, RuntimeError):
    """The actor, its process, or its host failed; pending and later calls to it fail with this.

    A ``RuntimeError`` and not an ``ActorError``, as Monarch's: the endpoint did not raise,
    the actor is gone. ``cause`` says why; ``mesh``, ``rank`` and ``host`` where.
    """

    def __init__(
        self,
        cause: str,
        *,
        mesh: str = "",
        actor: str = "",
        rank: int | None = None,
        host: str = "",
        message: str = "",
    ) -> None:
        self.cause = cause
        self.mesh = mesh
        self.actor = actor
        self.rank = rank
        self.host = host
        #: Monarch's settable attribute: the endpoint whose call saw the failure
        self.endpoint: str | None = None
        if not message:
            parts = []
            if mesh:
                parts.append(f"mesh {mesh!r}")
            if rank is not None:
                parts.append(f"rank {rank}")
            if host:
                parts.append(f"host {host}")
            message = f"Supervision failure: {' '.join(parts)}: {cause}" if parts else f"Supervision failure: {cause}"
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        # a failed __init__ or proc carries its remote traceback: runtime frames hidden (unless
        # traceback_internal_frames), cell frames named Cell In[N], as ActorError's
        from ._errgroup import clean_traceback

        return clean_traceback(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_supervision_error, (self.cause, self.mesh, self.actor, self.rank, self.host, self.message))

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our local frames, which say nothing about the failure.
        # A long message is shortened as an ActorError's is (str() keeps all of it)
        from ._errgroup import shorten_message

        lines = shorten_message(str(self), "print(sys.last_value) shows all of it").splitlines() or [""]
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}", *lines[1:], *self._note_lines()]


def _waited_lines(own: list[Any], waited: list[Any], total: int, whole: str = "") -> list[str]:
    """One line per kind of failure of the ranks (``waited``, groups) that failed waiting in a
    collective for the ranks of ``own`` (``ranks 0,2-15 (15 of 16): RuntimeError: [gloo]
    Connection closed by peer … (waiting for rank 1 in a collective)``): 15 copies of gloo's error
    and torch's frames, each telling only that rank 1 went away, hid the one that says why.
    ``whole``: where their tracebacks are, for a view that leaves them out (a notebook's)."""
    from . import _errgroup

    for_whom = _errgroup.ranks_text(sorted(r for g in own for r in g.ranks))
    by_text: dict[tuple[str, str], list[int]] = {}
    for g in waited:
        by_text.setdefault((g.etype, _peer_gone_words(g.messages[g.ranks[0]])), []).extend(g.ranks)
    lines = [
        f"{_errgroup.ranks_text(sorted(ranks))} ({len(ranks)} of {total}): {etype}: {said} (waiting for {for_whom} in a collective)"
        for (etype, said), ranks in by_text.items()
    ]
    return [*lines, f"{whole} shows their tracebacks too"] if lines and whole else lines


def _peer_gone_words(message: str) -> str:
    """gloo's "[/__w/pytorch/…/gloo/transport/tcp/pair.cc:553] Connection closed by peer
    [127.0.0.1]:38528. This is typically caused by a remote worker crashing. …" as one short line:
    its words, which say what happened; the rest is the same on every rank but the port."""
    from ._errgroup import clip

    at = min((i for i in (message.find(w) for w in PEER_GONE_WORDS) if i >= 0), default=-1)
    if at < 0:
        return clip(message)
    word = next(w for w in PEER_GONE_WORDS if message.startswith(w, at))
    return ("[gloo] " if "gloo" in message[:at] else "") + word + " …"


def _remote_words(tb: str) -> str:
    return tb.replace("Traceback (most recent call last):", "Traceback of where the remote call failed (most recent call last):")


def _rebuild_actor_error(cls, exc, tb, actor, rank, host, message):
    if isinstance(exc, bytes):
        exc = _load_exc(exc, tb, message)
    return cls(exc, tb, actor=actor, rank=rank, host=host, message=message)


def _rebuild_supervision_error(cause, mesh, actor, rank, host, message=""):
    return SupervisionError(cause, mesh=mesh, actor=actor, rank=rank, host=host, message=message)


def raised_again(err: BaseException) -> BaseException:
    """``err``, to raise once more: a copy if it was raised before, so that the traceback its
    reader sees is of this raise alone. An error kept and raised to many readers (a dead peer's,
    a failed future read twice) would otherwise carry every earlier raise's frames, one more
    set each time, and keep their frames' locals alive."""
    if err.__traceback__ is None:
        return err
    try:
        e = copy.copy(err)
        e.__dict__.update(err.__dict__)  # what __reduce__ leaves out (an error's endpoint, its notes)
    except Exception:
        return err.with_traceback(None)
    e.__cause__, e.__context__, e.__suppress_context__ = err.__cause__, err.__context__, err.__suppress_context__
    return e


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def note_missing_module(err: BaseException) -> None:
    """Add a note to ``err`` (once) when it says a proc could not import a module this controller
    imported from a folder of its own: the commonest failure of code that ran in the notebook's
    folder and not on another host (no shared filesystem, or a path added after the spawn)."""
    if getattr(err, "_module_noted", False):
        return
    names = set(_NO_MODULE.findall(safe_str(err)))
    inner = getattr(err, "exception", None) or getattr(err, "error", None)
    if isinstance(inner, ModuleNotFoundError) and inner.name:
        names.add(inner.name)
    for name in sorted(names):
        top = name.partition(".")[0]
        path = getattr(sys.modules.get(top), "__file__", None)
        if not path:
            continue  # nor here: the procs' error says all there is
        # the sys.path folder it came from: what to put on the procs' path
        root = os.path.dirname(os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path)
        err.add_note(
            f"monarch_nb: {top!r} is a module of this controller ({path}) that the procs cannot import: "
            f"`%mesh sync {root}` (monarch_nb.sync.sync({root!r})) puts that folder first on every proc's "
            "sys.path; or install it on every host"
        )
    try:
        err._module_noted = True  # type: ignore[attr-defined]
    except AttributeError:
        pass  # an exception type that takes no attributes: its note (if any) may come twice


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as e:
        return f"<str() of {type(exc).__name__} raised {type(e).__name__}>"


def _safe_exc(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (cloudpickle: classes defined in ``__main__``
    or a notebook travel by value and arrive as themselves), else a ``RuntimeError`` with its text."""
    blob = _exc_blob(exc)
    return exc if isinstance(blob, bytes) else blob


def _exc_blob(exc: BaseException) -> bytes | BaseException:
    """``exc`` pickled on its own (cloudpickle: classes defined in ``__main__`` or a notebook
    travel by value and arrive as themselves) if it survives a round trip here, else a
    ``RuntimeError`` with its text. Pickled apart so that the reader can fall back too: a class
    the proc imports may not exist where the error is read (:func:`_load_exc`)."""
    import pickle

    import cloudpickle

    try:
        blob = cloudpickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {safe_str(exc)}")


def _load_exc(blob: bytes, tb: str, message: str) -> BaseException:
    """The remote exception, or, when it cannot be unpickled here (its module is on the procs'
    path and not the controller's: a package installed only on the GPU hosts, a folder synced to
    them), a ``RuntimeError`` with its text, so that the error still says what failed and where,
    not ``No module named …``."""
    import pickle

    try:
        return pickle.loads(blob)
    except Exception as e:
        last = next((ln for ln in reversed(tb.splitlines()) if ln.strip()), "") or message
        err = RuntimeError(last)
        err.add_note(f"(the remote exception could not be unpickled here: {type(e).__name__}: {safe_str(e)})")
        return err


def format_exception(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception as e:
        return f"{type(exc).__name__}: {safe_str(exc)} (its traceback could not be formatted: {type(e).__name__})\n"


class ExecError(MonarchNBError):
    """A ``%%mesh exec`` cell raised on some ranks: one entry per failing rank.

    ``failures`` maps rank → ``(exception type name, message, formatted remote traceback)``;
    ranks that failed alike (same type, same frames) are shown once, with their rank set and
    the messages that differ.
    """

    def __init__(
        self,
        failures: dict[int, tuple[str, str, str]],
        total: int,
        mesh: str = "",
        running: list[int] | int = 0,
        group_ranks: list[int] | None = None,
        cell_ranks: str = "",
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        #: the ``--ranks`` the cell ran on ("": every rank of the mesh)
        self.cell_ranks = cell_ranks
        #: the failed ranks (of the mesh) with a torch.distributed process group: destroying it
        #: there frees the ranks that wait for them in its collectives
        self.group_ranks = sorted(group_ranks or [])
        self.total = total
        self.mesh = mesh
        #: the ranks (or how many, of a ``--ranks`` subset) whose cell was still running when this
        #: was raised: the cell fails as soon as a rank raises, since the others may be blocked for
        #: good in a collective waiting for it
        self.running = running
        super().__init__(self._headline())

    def _headline(self) -> str:
        n = len(self.failures)
        where = f" of mesh {self.mesh!r}" if self.mesh else ""
        return f"the cell failed on {n} of {self.total} ranks{where}"

    def __str__(self) -> str:
        return "\n".join(self._lines(color=False))

    def _rank_summary(self) -> list[str]:
        from . import _errgroup

        own, waited = self._groups()
        return _errgroup.summary_lines(own, self.total) + _waited_lines(own, waited, self.total)

    def _groups(self) -> tuple[list[Any], list[Any]]:
        """The failures grouped: those of the ranks that failed on their own, and those of the
        ranks whose collective failed only because one of those went away first (gloo's
        "Connection closed by peer": a cell whose ``finally`` destroys the process group, as
        many training scripts' do). No second list when every failure is gloo's."""
        from . import _errgroup

        gone = {r for r, (etype, msg, _) in self.failures.items() if peer_gone(etype, msg)}
        if len(gone) == len(self.failures):
            gone = set()
        own = _errgroup.group((r, *f) for r, f in self.failures.items() if r not in gone)
        return own, _errgroup.group((r, *f) for r, f in self.failures.items() if r in gone)

    def _lines(self, color: bool) -> list[str]:
        from . import _errgroup

        groups, waited = self._groups()
        # the notebook's view (color) leaves out the tracebacks of those waiting (torch's frames
        # and gloo's words, which say nothing of the bug): one line each, the whole one call away
        whole = "print(sys.last_value)" if color else ""
        lines = [
            self._headline(),
            *_errgroup.summary_lines(groups, self.total),
            *_waited_lines(groups, waited, self.total, whole),
        ]
        running = _errgroup.running_line(self.running, self.total)
        if running:
            where = f"%mesh stop {self.mesh}" if self.mesh else "stopping the mesh"
            lines.append(f"{running}; the next cell on this mesh waits for them ({where} ends them)")
            if self.group_ranks and self.mesh:
                # stopping the mesh loses every proc's state; destroying the failed ranks' group
                # closes its connections, so the collective the others wait in fails instead
                failed = ",".join(map(str, self.group_ranks))
                who = f"rank{'s' if len(self.group_ranks) > 1 else ''} {failed}"
                # on every rank of the cell: rank R runs it at once and frees the ranks waiting for
                # it, they free the ranks waiting for them (gloo's ring: with 4 ranks, one waits
                # for the failed rank's neighbours, whose groups stay open), and each one's group,
                # broken now, is gone, ready for a new one
                on = f"{self.mesh} --ranks {self.cell_ranks}" if self.cell_ranks else self.mesh
                runs, frees, it = ("runs", "frees", "it") if len(self.group_ranks) == 1 else ("run", "free", "them")
                lines.append(
                    f"if they wait for {who} in a collective, destroying the process group frees them and keeps "
                    f"every proc's other state: in %%mesh exec {on} (every rank: {who} {runs} it at once and {frees} "
                    f"the ranks waiting for {it}, they those waiting for them), drop what holds the group (a DDP "
                    "model: model = model.module keeps the module and its weights; a DeviceMesh, a new_group(): "
                    "del it), then dist.destroy_process_group()"
                )
                lines.append(
                    f"to use a process group again after: monarch_nb.spmd.setup_torch_elastic_env({self.mesh}) (a new "
                    "rendezvous), then on every rank dist.init_process_group() and model = DDP(model)"
                )
        # the notebook's view (color) shortens long messages: str() does not
        shorten = "print(sys.last_value) shows all of it" if color else ""
        if not color:
            groups = groups + waited
        return lines + _errgroup.group_lines(groups, color, shorten=shorten)

    def _render_traceback_(self) -> list[str]:
        lines = self._lines(color=True)
        lines[0] = f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}"
        return lines + self._note_lines()


class MeshError(MonarchNBError):
    """A mesh could not be created or used."""


class SpawnError(MeshError):
    """An allocator could not start a proc, or an actor's ``__init__`` raised."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        from ._errgroup import clean_traceback

        self.remote_traceback = remote_traceback
        tb = clean_traceback(remote_traceback).rstrip() if remote_traceback else ""
        #: the remote error, when an actor's constructor raised
        self.error: BaseException | None = None
        super().__init__(message + (f"\nRemote traceback:\n{tb}" if tb else ""))

    def _render_traceback_(self) -> list[str]:
        # the local frames (spawn's) say nothing about the user's bug: the remote traceback does
        lines = str(self).splitlines() or [""]
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}", *lines[1:], *self._note_lines()]


class MeshClosedError(MeshError, RuntimeError):
    """The mesh was stopped; spawn a new one.

    Also a ``RuntimeError``: that is what Monarch raises for a spawn on a stopped proc mesh.
    """


class MeshNotFoundError(MeshError, LookupError):
    """No mesh of that name where it was looked for: an allocator (stopped there, or never
    spawned), the allocators this host and its jobs know, or this kernel's registry.

    Also a ``LookupError``, what Python raises for a name that is not there; ``name`` is the
    name looked for. An allocator raises it too: it reaches its caller as itself.
    """

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class ProtocolError(MonarchNBError):
    """A frame that is malformed, oversized, replayed, or from another protocol."""


class VersionMismatchError(ProtocolError):
    """The peer speaks another wire version of monarch_nb; install the same version on both sides."""


class AuthenticationError(MonarchNBError):
    """The peer refused our key; both sides must use the same cluster key file."""


class ConnectError(MonarchNBError):
    """An address could not be reached in time (wrong address, dead host, firewall)."""


class ConfigError(MonarchNBError):
    """A configuration value is invalid."""


class DebugError(MonarchNBError):
    """A debug session is gone or unknown, or a breakpoint was hit where nobody could debug it."""


class NotAnEndpointError(AttributeError, RuntimeError, MonarchNBError):
    """An adverb of a method without ``@endpoint``: an AttributeError as in Monarch, and the
    RuntimeError monarch_nb raised before."""


class DimensionNotFound(KeyError, ValueError, MonarchNBError):
    """A label that is not a dimension of this extent or point.

    Monarch raises ``ValueError("Dimension 'x' not found")`` here; a ``KeyError`` is what a
    ``Mapping`` owes ``.get()`` and ``in``. Being both, either ``except`` clause catches it.
    """

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.label = label

    def __str__(self) -> str:
        return f"Dimension {self.label!r} not found"
