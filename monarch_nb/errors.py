"""Exceptions raised by monarch_nb.

* MonarchNBError
  + ActorError            an endpoint raised remotely (.exception, .remote_traceback, .rank)
    - SupervisionError    the actor or its process is gone (.mesh, .rank, .host, .cause)
  + MeshError
    - SpawnError          an allocator could not start a proc or construct an actor
    - MeshClosedError     a mesh used after stop() (also a RuntimeError)
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

    @property
    def exception_formatted(self) -> str:
        """The remote traceback as Monarch's ``ActorError.exception_formatted`` words it."""
        return self.remote_traceback.replace(
            "Traceback (most recent call last):", "Traceback of where the remote call failed (most recent call last):"
        )

    def _headline(self) -> str:
        where = []
        if self.actor:
            where.append(f"actor {self.actor!r}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.host:
            where.append(f"host {self.host}")
        prefix = f"A remote actor call failed ({', '.join(where)})" if where else "A remote actor call failed"
        return f"{prefix}: {self.message}"

    def __str__(self) -> str:
        if self.remote_traceback:
            return f"{self._headline()}\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return self._headline()

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_actor_error,
            (type(self), _safe_exc(self.exception), self.remote_traceback, self.actor, self.rank, self.host, self.message),
        )

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our local frames, which say nothing about the bug.
        lines = [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self._headline()}"]
        if self.remote_traceback:
            lines.append("Remote traceback:")
            lines.extend(self.remote_traceback.rstrip().splitlines())
        return lines


class SupervisionError(ActorError):
    """The actor, its process, or its host is gone; pending and later calls fail with this."""

    def __init__(
        self,
        cause: str,
        *,
        mesh: str = "",
        actor: str = "",
        rank: int | None = None,
        host: str = "",
    ) -> None:
        self.cause = cause
        self.mesh = mesh
        parts = []
        if mesh:
            parts.append(f"mesh {mesh!r}")
        if rank is not None:
            parts.append(f"rank {rank}")
        if host:
            parts.append(f"host {host}")
        msg = f"{' '.join(parts)}: {cause}" if parts else cause
        super().__init__(RuntimeError(msg), "", actor=actor, rank=rank, host=host, message=msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_supervision_error, (self.cause, self.mesh, self.actor, self.rank, self.host))

    def _headline(self) -> str:
        return f"Supervision failure: {self.message}"


def _rebuild_actor_error(cls, exc, tb, actor, rank, host, message):
    return cls(exc, tb, actor=actor, rank=rank, host=host, message=message)


def _rebuild_supervision_error(cause, mesh, actor, rank, host):
    return SupervisionError(cause, mesh=mesh, actor=actor, rank=rank, host=host)


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as e:
        return f"<str() of {type(exc).__name__} raised {type(e).__name__}>"


def _safe_exc(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (cloudpickle: classes defined in ``__main__``
    or a notebook travel by value and arrive as themselves), else a ``RuntimeError`` with its text."""
    import pickle

    import cloudpickle

    try:
        pickle.loads(cloudpickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {safe_str(exc)}")


def format_exception(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception as e:
        return f"{type(exc).__name__}: {safe_str(exc)} (its traceback could not be formatted: {type(e).__name__})\n"


class ExecError(MonarchNBError):
    """A ``%%mesh exec`` cell raised on some ranks: one entry per failing rank.

    ``failures`` maps rank → ``(exception type name, message, formatted remote traceback)``;
    ranks that failed the same way are shown once, with their rank set.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]], total: int, mesh: str = "") -> None:
        self.failures = dict(sorted(failures.items()))
        self.total = total
        self.mesh = mesh
        super().__init__(self._headline())

    def _groups(self) -> list[tuple[list[int], tuple[str, str, str]]]:
        groups: dict[tuple[str, str, str], list[int]] = {}
        for rank, f in self.failures.items():
            groups.setdefault(f, []).append(rank)
        return [(ranks, f) for f, ranks in groups.items()]

    def _headline(self) -> str:
        n = len(self.failures)
        where = f" of mesh {self.mesh!r}" if self.mesh else ""
        kinds = "; ".join(f"{_ranks(r)}: {_kind(*f[:2])}" for r, f in self._groups())
        return f"the cell failed on {n} of {self.total} ranks{where} ({kinds})"

    def __str__(self) -> str:
        return "\n".join(self._lines(color=False))

    def _lines(self, color: bool) -> list[str]:
        red, off = ("\x1b[0;31m", "\x1b[0m") if color else ("", "")
        lines = [self._headline()]
        for ranks, (etype, msg, tb) in self._groups():
            lines.append("")
            lines.append(f"{red}--- {_ranks(ranks)}: {_kind(etype, msg)}{off}")
            lines.extend(tb.rstrip().splitlines())
        return lines

    def _render_traceback_(self) -> list[str]:
        lines = self._lines(color=True)
        lines[0] = f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}"
        return lines


def _ranks(ranks: list[int]) -> str:
    from ._ranks import format_ranks

    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} (×{len(ranks)})"


def _kind(etype: str, msg: str) -> str:
    return f"{etype}: {msg}" if msg else etype


class MeshError(MonarchNBError):
    """A mesh could not be created or used."""


class SpawnError(MeshError):
    """An allocator could not start a proc, or an actor's ``__init__`` raised."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        self.remote_traceback = remote_traceback
        super().__init__(message + (f"\nRemote traceback:\n{remote_traceback.rstrip()}" if remote_traceback else ""))


class MeshClosedError(MeshError, RuntimeError):
    """The mesh was stopped; spawn a new one.

    Also a ``RuntimeError``: that is what Monarch raises for a spawn on a stopped proc mesh.
    """


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
