"""Host, proc, actor and value meshes."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import pprint
import re
import secrets
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .._callers import callers_level
from .._numtext import plural
from .._runtime import _fdlimit
from .._wire import frames as wire
from .._wire.serialize import dumps, dumps_by_value, loads
from ..errors import (
    ActorError,
    ConnectError,
    MeshClosedError,
    MeshError,
    MeshNotFoundError,
    SpawnError,
    SupervisionError,
    note_missing_module,
)
from . import _context
from ._actor import Actor, endpoints_of, is_async_actor
from ._client import QUICK_HELLO_S
from ._endpoint import Endpoint, EndpointProperty, RemoteFailure, _NotAnEndpointMethod, gather, multicast
from ._future import Future
from ._refs import HostRef, ProcRef
from ._shape import Extent, MeshTrait, Point, View

R = TypeVar("R")
T = TypeVar("T")


class ValueMesh(MeshTrait, Generic[R]):
    """The results of ``call()``: one value per actor, shaped like the mesh that was called."""

    def __init__(self, extent: Extent, values: list[R]) -> None:
        self._view = View(extent.labels, extent.sizes)
        self._values = list(values)

    @classmethod
    def _from_view(cls, view: View, values: list[R]) -> ValueMesh[R]:
        vm: ValueMesh[R] = object.__new__(cls)
        vm._view = View(view.labels, view.sizes)
        vm._values = values
        return vm

    def _with_view(self, view: View) -> ValueMesh[R]:
        vm: ValueMesh[R] = object.__new__(type(self))
        vm._view = view
        vm._values = self._values
        return vm

    def item(self, **kwargs: int) -> R:
        """The value at the given coordinates (every dimension must be given)."""
        labels = self._view.labels
        extra = [k for k in kwargs if k not in labels]
        if extra:
            raise KeyError(f"item has extra dimensions: {extra}")
        idx = 0
        for label, size in zip(labels, self._view.sizes):
            if label not in kwargs:
                raise KeyError(label)
            c = kwargs[label]
            if not 0 <= c < size:
                raise IndexError(f"{label}={c} out of range for size {size}")
            idx = idx * size + c
        return self._values[self._view.ranks[idx]]

    def get(self, rank: int) -> R:
        return self._values[self._view.ranks[rank]]

    def items(self) -> Iterator[tuple[Point, R]]:
        ext = self._view.extent
        for i, r in enumerate(self._view.ranks):
            yield Point(i, ext), self._values[r]

    def values(self) -> list[R]:
        return [self._values[r] for r in self._view.ranks]

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __repr__(self) -> str:
        items = tuple(self.items())
        more = ""
        if len(items) > _REPR_MAX:  # stays short; .values() and the notebook table have them all
            more = f"\n  … {len(items) - _REPR_MAX} more (.values() has them all)"
            items = items[:_REPR_MAX]
        body = pprint.pformat(items)
        return f"ValueMesh({self.extent}):\n" + "\n".join("  " + line for line in body.splitlines()) + more

    def _repr_html_(self) -> str:
        from .._meshhtml import value_table_html

        return value_table_html(self._view.labels, self._view.sizes, self.values())

    @property
    def _ipython_display_(self) -> Callable[[], None] | None:
        # a print-only cell (every endpoint returned None) shows nothing; the value stays a
        # ValueMesh (Out[N] and _ still hold it). IPython asks for this hook before any repr.
        if self._view.ranks and all(self._values[r] is None for r in self._view.ranks):
            return _show_nothing
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (ValueMesh, (self.extent, self.values()))


#: a ValueMesh's text repr lists at most this many values
_REPR_MAX = 32


def _show_nothing() -> None:
    return None


class ActorMesh(MeshTrait, Generic[T]):
    """Actors of one class spawned on a proc mesh; endpoints are attributes."""

    def __init__(
        self,
        cls: type,
        name: str,
        procs: list[ProcRef],
        view: View,
        proc_mesh: ProcMesh | None,
        label: str | None = None,
        refused: str | None = None,
    ) -> None:
        self._class = cls
        self._name = name
        self._procs = procs
        self._view = view
        self._proc_mesh = proc_mesh
        self._endpoints = endpoints_of(cls) if cls is not None else {}
        #: the actor (an _actor.Instance) that spawned this mesh, None for the client
        self._owner: Any = None
        #: the name the program gave; ``_name`` is this spawn's own id (see ProcMesh._unique_actor_name)
        self._label = label or _label_of(name)
        #: where its actors report failures (None when re-attached from elsewhere)
        self._sup: _Supervised | None = None
        #: (creator, (labels, sizes), ranks into ``_procs``) of the spawn that made it: how its
        #: actors name themselves (their Point), for errors that speak for a dead actor; None
        #: when re-attached or unpickled
        self._origin: tuple[Any, tuple[list[str], list[int]], list[int]] | None = None
        #: why its spawn was refused on some of its procs (calls fail with it; see ProcMesh.spawn)
        self._refused = refused

    def _refusal(self) -> RuntimeError | None:
        """What a call fails with when procs refused this mesh's spawn (a new error each time)."""
        return RuntimeError(self._refused) if self._refused is not None else None

    def _with_view(self, view: View) -> ActorMesh[T]:
        m: ActorMesh[T] = ActorMesh(self._class, self._name, self._procs, view, self._proc_mesh, self._label)
        m._owner, m._sup, m._origin, m._refused = self._owner, self._sup, self._origin, self._refused
        return m

    def _report_actor_failure(self, event: dict[str, Any]) -> None:
        from . import _supervision

        err = SupervisionError(event["reason"], mesh=self._label, actor=self._label, rank=event["rank"])
        failure = _supervision.MeshFailure(
            self._label,
            self,
            err,
            crashed_ranks=[event["rank"]],
            event=event["event"],
        )
        # what an owner that does not handle it fails with (see ActorSlot.fail_unsupervised)
        failure.actor, failure.reason = event["actor"], event["reason"]
        if self._sup is not None and self._origin is not None and 0 <= event["rank"] < len(self._origin[2]):
            self._sup.failed.add(self._origin[2][event["rank"]])
            self._sup.events.setdefault(self._origin[2][event["rank"]], event)
        pm = self._proc_mesh
        if pm is not None:
            # its procs take no new actors now: `%mesh spawn NAME` replaces them (_registry.spawn)
            root = getattr(pm, "_root", pm)
            root._actor_failed = root._actor_failed or event["reason"]
        _supervision.report(failure)

    def _dead_actor(self, err: BaseException, proc: int) -> tuple[int, str, str] | None:
        """For a proc-death ``err`` (the runtime's) of ``self._procs[proc]``: the rank of this
        mesh's actor there, its Monarch name, and Monarch's words for its failure followed by
        ours (host, proc mesh and rank, pid and signal by name). None for any other error, or
        when no actor of this mesh lived on that proc."""
        if not isinstance(err, SupervisionError) or err.actor or not err.mesh or err.cause.startswith("mesh stopped"):
            return None
        named = self._monarch_name(proc)
        if named is None:
            return None
        rank, actor = named
        words = (
            f"the process this actor was running on {_proc_status(err.cause)}\n"
            f"  host {err.host}, proc mesh {err.mesh!r} rank {err.rank}: {err.cause}"
        )
        return rank, actor, words

    def _killed_at_stop(self, err: BaseException, proc: int) -> tuple[int, str, str] | None:
        """``_dead_actor`` for a process that ended while its proc mesh stopped (killed there
        once its message in hand or ``__cleanup__`` ran past ``stop_cleanup_timeout``): for the
        call it had in hand only. Not a failure for the hook (the user asked for the stop), but
        the call failed all the same, and says which actor's, as every dead-proc call error does."""
        if not isinstance(err, SupervisionError) or err.actor or not err.mesh:
            return None
        # "mesh stopped (process N ...)", and why where the stop said ("... because the actor ...")
        m = _STOPPED_PROC.match(err.cause)
        if m is None:
            return None
        inner = m.group(1)
        named = self._monarch_name(proc)
        if named is None:
            return None
        rank, actor = named
        if _KILLED.match(inner):
            how = "was killed as its proc mesh stopped: the message in hand or __cleanup__ had not finished after stop_cleanup_timeout"
        else:
            how = f"ended as its proc mesh stopped ({_proc_status(inner)})"
        pm = self._proc_mesh
        root = getattr(pm, "_root", pm) if pm is not None else None
        why = _context.client().stop_reasons.get(err.mesh, "") if root is not None and not root._stopped else ""
        if why:
            # not this process's stop: who stopped it (`monarch-nb stop --force` from a shell, say)
            how += f"; {_stopped_by(why)}"
        words = (
            f"the process this actor was running on {how}\n  host {err.host}, proc mesh {err.mesh!r} rank {err.rank}: {err.cause}"
        )
        return rank, actor, words

    def _monarch_name(self, proc: int) -> tuple[int, str] | None:
        """The rank of this mesh's actor on ``self._procs[proc]`` and its name as Monarch's errors
        write it (``<root>.<__main__.P p{'gpus': 1/2}>``); None for a mesh that does not know
        its creator (one received in a message) or has no actor there."""
        if self._origin is None:
            return None
        creator, (labels, sizes), ranks = self._origin
        try:
            rank = ranks.index(proc)
        except ValueError:
            return None
        point = Point(rank, Extent(labels, sizes))
        return rank, _context.qualified_name(_context.CreatorInstance(point, self._label, _class_name(self._class), creator))

    def _stopped_error(self, method: str) -> SupervisionError:
        """What a call to ``method`` of this stopped mesh fails with: Monarch's words (its
        SupervisionError names the first actor called), then ours. A mesh one of whose actors
        failed before the stop (its process dead, or itself) fails with that failure, as
        Monarch's does: the stop that followed is not what went wrong."""
        from ._supervision import stopped_words

        if (failed := self._failure_before_stop(method)) is not None:
            return failed
        named = self._monarch_name(self._view.ranks[0]) if self._view.ranks else None
        ours, words = stopped_words(self._label, method, named[1] if named is not None else "", self._stop_reason())
        if named is None:
            return SupervisionError(ours, actor=self._label)
        e = SupervisionError(ours, actor=self._label, message=words)
        e.endpoint = f"{self._label}.{method}"
        return e

    def _stop_reason(self) -> str:
        """Why this mesh takes no more calls, as a stopped actor's status says it: its proc mesh's
        stop's reason (Monarch's: ``stop("why")``'s), also one from outside this process."""
        pm = self._proc_mesh
        root = getattr(pm, "_root", pm) if pm is not None else None
        client = _context._client
        if client is not None and self._key() in client.stopped_actor_meshes:
            return "stopped by client"  # the actor mesh's own stop
        if root is None or not root._stopped:
            return "stopped by client"
        if root._stopped_outside:
            return root._stop_reason or "stopped from outside this process (by whom is not known)"
        return root._stop_reason or "stopped by client"  # marked stopped with another object's stop

    def _failure_before_stop(self, method: str) -> SupervisionError | None:
        """The error a call to ``method`` got before this mesh stopped from the first actor in
        this view that had failed, its process dead or itself; None when none had."""
        sup = self._sup
        dead = _context.runtime().supervision.dead
        for i, r in enumerate(self._view.ranks):
            err = dead.get(self._procs[r].addr)
            if err is not None and self._dead_actor(err, r) is not None:
                e = self._dead_proc_error(method, i, err)
                return e if isinstance(e, SupervisionError) else None
            event = sup.events.get(r) if sup is not None else None
            if event is not None:
                reason = event["reason"]
                e = SupervisionError(
                    reason,
                    actor=self._label,
                    rank=event["rank"],
                    message=(
                        f"Endpoint call {self._label}.{method}() failed, The actor {event['actor']} and all its "
                        "descendants have failed:\n" + textwrap.indent(reason, "  ")
                    ),
                )
                e.endpoint = f"{self._label}.{method}"
                return e
        return None

    def _dead_proc_error(self, method: str, index: int, err: BaseException) -> BaseException:
        """What a call to ``method`` gets from the actor at ``index`` (of this mesh's view) when
        its process died (``err``, the runtime's): Monarch's words, naming the actor, then ours.
        Any other error is returned as it is."""
        try:
            proc = self._view.ranks[index]
        except IndexError:
            return err
        dead = self._dead_actor(err, proc) or self._killed_at_stop(err, proc)
        if dead is None:
            return err
        assert isinstance(err, SupervisionError)
        _, actor, words = dead
        if _exited_cleanly(err.cause):
            # Monarch's: a process that exited with status 0 stopped its actors, it failed nothing
            message = (
                f"Endpoint call {self._label}.{method}() failed, Supervision event: actor {actor} has status:\n"
                f"  stopped: process exited cleanly\n  host {err.host}, proc mesh {err.mesh!r} rank {err.rank}: {err.cause}"
            )
        else:
            message = f"Endpoint call {self._label}.{method}() failed, The actor {actor} and all its descendants have failed:\n  {words}"
        e = SupervisionError(err.cause, mesh=err.mesh, actor=self._label, rank=err.rank, host=err.host, message=message)
        e.endpoint = f"{self._label}.{method}"
        return e

    def _proc_failure(self, err: BaseException) -> Any:
        """The ``MeshFailure`` of this mesh for a dead proc (``err``), as Monarch reports it to
        the owner or the hook: the actor mesh, the actor's rank and words. None when no actor
        of this mesh lived there, or this mesh was stopped."""
        from . import _supervision

        if self._closed() or not isinstance(err, SupervisionError):
            return None
        proc = next((i for i, p in enumerate(self._procs) if p.mesh == err.mesh and p.rank == err.rank), None)
        dead = self._dead_actor(err, proc) if proc is not None else None
        if dead is None:
            return None
        rank, actor, words = dead
        event = f"Supervision event: actor {actor} failed:\n  {words}"
        e = SupervisionError(err.cause, mesh=err.mesh, actor=self._label, rank=err.rank, host=err.host, message=event)
        failure = _supervision.MeshFailure(self._label, self, e, crashed_ranks=[rank], event=event)
        # an owner that does not handle it fails naming the dead actor, as for an actor's own
        # failure (ActorSlot.fail_unsupervised), not the mesh's bare name
        failure.actor, failure.reason = actor, words
        return failure

    def _known_failed(self) -> int | None:
        """The index (in this view) of the first actor this process knows has failed, its
        process dead or itself failed; None if none. ``choose`` calls it, as Monarch's fails
        every ``choose`` on a mesh with a failed actor: picking the least loaded would send most
        calls to it (it fails each at once, so it is never loaded) and let the rest work."""
        sup = self._sup
        failed = sup.failed if sup is not None else ()
        dead = _context.runtime().supervision.dead
        if not failed and not dead:
            return None
        for i, r in enumerate(self._view.ranks):
            if r in failed or self._procs[r].addr in dead:
                return i
        return None

    def _known_failed_all(self) -> list[int]:
        """Every index (in this view) that :meth:`_known_failed` could name."""
        sup = self._sup
        failed = sup.failed if sup is not None else ()
        dead = _context.runtime().supervision.dead
        return [i for i, r in enumerate(self._view.ranks) if r in failed or self._procs[r].addr in dead]

    def _key(self) -> tuple[str, str]:
        # an actor mesh is its name on its procs (slices and copies share it)
        return (self._name, self._procs[0].addr if self._procs else "")

    def _closed(self) -> bool:
        if self._proc_mesh is not None and self._proc_mesh._stopped:
            return True
        return _context._client is not None and self._key() in _context._client.stopped_actor_meshes

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        prop = self._endpoints.get(name)
        if prop is not None:
            # kept on the instance: ``mesh.ep.call_one()`` in a loop builds it once
            ep = self.__dict__[name] = Endpoint(self, name, prop)
            return ep
        if self._class is None:
            # re-attached without the class: trust the caller about the name
            return Endpoint(self, name, EndpointProperty(_permissive(name)))
        attr = getattr(self._class, name, None)
        if callable(attr):
            return _NotAnEndpointMethod(self, name, attr)
        raise AttributeError(name)  # as Monarch words it

    def __reduce__(self) -> tuple[Any, ...]:
        procs = self._procs
        if _context._pickling_for.get():
            # actors in this process, at the address the recipient reaches it (_context.reachable_addr)
            rt = _context.runtime()
            if any(p.addr == rt.ipc_addr for p in procs):
                reach = _context.reachable_addr(rt)
                procs = [p._replace(addr=reach) if p.addr == rt.ipc_addr else p for p in procs]
        return (ActorMesh, (self._class, self._name, procs, self._view, None, self._label, self._refused))

    def __repr__(self) -> str:
        cls = self._class.__qualname__ if self._class is not None else "?"
        return f"ActorMesh(class={cls}, name={self._label!r}, extent={self.extent})"

    def _repr_html_(self) -> str:
        from ._display import mesh_grid_html

        cls = self._class.__qualname__ if self._class is not None else "?"
        pm = self._proc_mesh
        return mesh_grid_html(
            f"ActorMesh {cls}", self._label, list(self._view.labels), list(self._view.sizes),
            [self._procs[r] for r in self._view.ranks], self._closed(), pm._failed if pm is not None else "",
        )  # fmt: skip

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        return self._stop(reason)

    def _stop(self, reason: str = "stopped by client", *, because: str = "") -> Future[None]:
        """:meth:`stop`; ``because``: what a later call to its actors says (an actor that failed
        stops the meshes it spawned), where this process's own ``reason`` would not."""
        sup = self._sup
        if sup is not None and not set(self._view.ranks) >= sup.ranks:
            # a slice of the mesh this process spawned: its actors stop together. Monarch's
            # error (a slice there is an unowned ActorMeshRef), when the future is read
            return Future._failed(
                NotImplementedError(
                    "Cannot call stop on an ActorMeshRef, requires an owned ActorMesh: this is a slice of actor "
                    f"mesh {self._label!r}, whose actors stop together (stop the mesh spawn() returned)"
                ),
                f"stop actor mesh {self._label}",
            )
        if sup is None and self._proc_mesh is None:
            # a reference handed over in a message (Monarch's ActorMeshRef): stopping it would
            # take the actors from under their owner, whose calls then fail as "no actor named"
            return Future._failed(
                NotImplementedError(
                    "Cannot call stop on an ActorMeshRef, requires an owned ActorMesh: actor mesh "
                    f"{self._label!r} was handed to this process; stop it where it was spawned"
                ),
                f"stop actor mesh {self._label}",
            )
        client = _context.client()
        # later calls fail when read, with a SupervisionError, as in Monarch (not with the
        # proc's "no such actor" error)
        client.stopped_actor_meshes.add(self._key())
        # only the procs this mesh's actors live on: a mesh spawned on a slice of a proc mesh
        # must not reach (and fail on a dead) proc outside it
        procs = {self._procs[r].addr: self._procs[r] for r in self._view.ranks}
        futs = [client.request(p.addr, "stop_actor", self._name, because, _actor="__sys__") for p in procs.values()]
        ranks = {a: [i for i, r in enumerate(self._view.ranks) if self._procs[r].addr == a] for a in procs}
        done = _stop_actors(futs, [ranks[a] for a in procs], self, client.rt)
        if sup is not None and sup.port is not None:
            # the whole mesh is gone: no more failures to hear of
            done.add_done_callback(lambda _: sup.close(client.rt))
        return done

    @property
    def initialized(self) -> Future[None]:
        return Future._completed(None)

    def __await__(self) -> Any:
        # Monarch's early API awaited spawn(); ours has already finished constructing
        return _immediate(self).__await__()


class _Supervised:
    """Where the actors of a mesh this process spawned report their failures. One may fail
    (its ``__init__``, say) before ``spawn`` has made the mesh: its event waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mesh: ActorMesh[Any] | None = None
        self._early: list[dict[str, Any]] = []
        self.port: int | None = None
        #: the ranks (of the proc mesh) the actors were spawned on
        self.ranks: set[int] = set()
        #: indices into the mesh's procs whose actor failed (its process lives on); see
        #: ActorMesh._known_failed
        self.failed: set[int] = set()
        #: index -> the first failure event of the actor there: what calls fail with once the
        #: mesh is stopped (its process, which said so, is gone)
        self.events: dict[int, dict[str, Any]] = {}

    def close(self, rt: Any) -> None:
        if self.port is not None:
            rt.close_port(self.port)
            self.port = None

    def attach(self, mesh: ActorMesh[Any]) -> None:
        self.ranks = set(mesh._view.ranks)
        with self._lock:
            self._mesh = mesh
            early, self._early = self._early, []
        for event in early:
            self._report(mesh, event)

    def on_event(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        """An actor failed (on the I/O thread)."""
        if status != wire.OK:
            return
        event = loads(body, bufs)
        with self._lock:
            mesh = self._mesh
            if mesh is None:
                self._early.append(event)
                return
        self._report(mesh, event)

    @staticmethod
    def _report(mesh: ActorMesh[Any], event: dict[str, Any]) -> None:
        # on a thread of its own: an owner's __supervise__ may take its time
        threading.Thread(target=mesh._report_actor_failure, args=(event,), name="monarch_nb-supervise", daemon=True).start()


def _permissive(name: str) -> Callable[..., Any]:
    def fn(self: Any, *args: Any, **kwargs: Any) -> Any: ...

    fn.__name__ = name
    return fn


async def _immediate(v: T) -> T:
    return v


def _all(futs: list[Future[Any]], what: str) -> Future[None]:
    """Completes (with None) when every future has, raising the first failure."""
    out: Future[Any] = Future._create(what)
    left = [len(futs)]
    lock = threading.Lock()
    if not futs:
        out._set_result(None)

    def done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out._set_raw(futs, lambda fs: [f.get() for f in fs] and None)

    for f in futs:
        f.add_done_callback(done)
    return out


def _stop_actors(futs: list[Future[Any]], ranks: list[list[int]], mesh: ActorMesh[Any], rt: Any) -> Future[None]:
    """An actor mesh's stop: done when every proc has stopped its actor (raising the first
    failure, a dead proc's), or ``stop_cleanup_timeout`` after it was asked, when some actor is
    still in the message in hand. A thread blocked in a collective with a dead or hung rank
    cannot be stopped inside its live proc, and a stop that waited for it would hang the cell
    for good; those actors take no more calls, and the proc mesh's stop kills their procs."""
    label = mesh._label
    out: Future[None] = Future._create(f"stop actor mesh {label}")
    timeout = float(rt.cfg.stop_cleanup_timeout)
    lock = threading.Lock()
    settled = [False]

    def finish(fs: list[Future[Any]]) -> None:
        busy = sorted(r for f, rs in zip(fs, ranks) if not f.done() for r in rs)
        if busy:
            import warnings

            from .._errgroup import ranks_text

            warnings.warn(
                f"stopping actor mesh {label!r}: its actors on {ranks_text(busy)} had not finished the message "
                f"in hand and __cleanup__ after {timeout:g} s (stop_cleanup_timeout), blocked in a collective "
                "with a failed or hung rank, perhaps; they take no more calls, but run on until their procs "
                "stop (stopping the proc mesh kills them)",
                RuntimeWarning,
                callers_level(),
            )
        failed: dict[str, list[int]] = {}
        for f, rs in zip(fs, ranks):
            if not f.done():
                continue
            err = f.exception(timeout=0)
            if isinstance(err, SupervisionError) and _exited_cleanly(err.cause):
                continue  # stopped already: its process exited with status 0
            dead = mesh._dead_actor(err, mesh._view.ranks[rs[0]]) if err is not None and rs else None
            if dead is None:
                f.get()  # any other failure, as it is
                continue
            _, actor, words = dead
            failed.setdefault(f"Failed(Supervision event: actor {actor} failed:\n  {words})", []).extend(rs)
        if failed:
            # Monarch's error for an actor mesh with a dead proc (its ranks as half-open ranges)
            gone = {r for rs in failed.values() for r in rs}
            statuses = (
                [f"Running={_ranges(sorted(set(range(len(mesh._view.ranks))) - gone))}"]
                if len(gone) < len(mesh._view.ranks)
                else []
            )
            statuses += [f"{k}={_ranges(sorted(v))}" for k, v in failed.items()]
            raise ValueError(f"error stopping actor mesh: statuses: {';'.join(statuses)}")

    def settle(at_deadline: bool) -> None:
        with lock:
            if settled[0] or not (at_deadline or all(f.done() for f in futs)):
                return
            settled[0] = True
        out._set_raw(futs, finish)

    for f in futs:
        f.add_done_callback(lambda _f: settle(False))
    if not futs:
        settle(True)
    else:
        try:
            # slack for the replies' trip
            rt.loop.call_soon_threadsafe(rt.loop.call_later, timeout + 0.5, settle, True)
        except RuntimeError:  # the runtime is closing
            pass
    return out


def _ranges(ranks: list[int]) -> str:
    """``0..2,3..4`` for ranks 0, 1 and 3: Monarch's half-open ranges in a mesh's statuses."""
    out: list[str] = []
    for r in ranks:
        if out and int(out[-1].split("..")[1]) == r:
            out[-1] = f"{out[-1].split('..')[0]}..{r + 1}"
        else:
            out.append(f"{r}..{r + 1}")
    return ",".join(out)


#: this process's part of the spawn ids it makes (see ProcMesh._unique_actor_name)
_SPAWN_ID = secrets.token_hex(3)
_spawn_counter = itertools.count(1)


def _label_of(actor_id: str) -> str:
    """The name a spawn was given, from its id (``trainers#3fa2b1.2`` -> ``trainers``)."""
    return actor_id.partition("#")[0]


def _ambiguous(name: str, proc_mesh: str, ids: list[str], meta: dict[str, dict[str, Any]], me: str) -> str:
    now = time.time()
    rows = []
    for a in sorted(ids, key=lambda a: meta.get(a, {}).get("created", 0.0)):
        m = meta.get(a, {})
        owner = m.get("owner") or "?"
        who = "this controller" if owner == me else f"controller {owner}"
        age = f"{now - m['created']:.0f} s ago" if "created" in m else "earlier"
        rows.append(f"  {a!r}: spawned by {who}, {age}")
    return (
        f"{len(ids)} actor meshes named {name!r} live on proc mesh {proc_mesh!r} (each spawn is its own mesh):\n"
        + "\n".join(rows)
        + f"\npick one by its id: actor_mesh({ids[0]!r})"
    )


def _ambiguous_procs(name: str, refs: list[HostRef], infos: list[dict[str, Any]], me: str) -> str:
    now = time.time()
    rows = []
    for h, i in zip(refs, infos):
        owner = i.get("owner") or "?"
        who = "this controller" if owner == me else f"controller {owner}"
        age = f", {now - i['created']:.0f} s old" if i.get("created") else ""
        labels, sizes = i.get("extent") or ([], [])
        shape = "{" + ", ".join(f"{k}: {v}" for k, v in zip(labels, sizes)) + "}"
        rows.append(f"  on host {h.host} ({h.alloc}): {shape}, spawned by {who}{age}")
    return (
        f"{len(refs)} hosts have a proc mesh named {name!r}, and they are not one mesh:\n"
        + "\n".join(rows)
        + f"\npick one by its hosts: ProcMesh.lookup({name!r}, attach_to_workers(workers=[ADDRESS]))"
        " (or `%mesh connect ADDRESS`)"
    )


def _refused_ranks(results: list[Any]) -> dict[int, str]:
    """The ranks whose proc refused the spawn because an actor failed there (``SPAWN_REFUSED``),
    with what it said."""
    from ._host import SPAWN_REFUSED

    out = {}
    for rank, r in enumerate(results):
        if isinstance(r, RemoteFailure):
            e = r.error()
            msg = getattr(e, "message", "") or str(e)
            if SPAWN_REFUSED in msg:
                out[rank] = msg[msg.index(SPAWN_REFUSED) + len(SPAWN_REFUSED) :].lstrip(": ")
    return out


def _spawn_refused(refused: dict[int, str], n: int, mesh: str) -> str:
    """Monarch's error for a spawn on procs that had an actor failure (its first line, statuses
    as rank ranges), and what to do."""
    from ._host import SPAWN_REFUSED

    runs: list[list[Any]] = []  # [status, first rank, end]
    for rank in range(n):
        st = f"Failed({SPAWN_REFUSED})" if rank in refused else "Running"
        if runs and runs[-1][0] == st:
            runs[-1][2] = rank + 1
        else:
            runs.append([st, rank, rank + 1])
    statuses = ";".join(f"{st}={a}..{b}" for st, a, b in runs)
    first = min(refused)
    return (
        f"error spawning actor mesh: statuses: {statuses}\n"
        f"rank {first} of proc mesh {mesh!r}: {refused[first]}\n"
        "a proc where an actor failed takes no new actors: stop this proc mesh (`procs.stop()`) and spawn new "
        "procs (`this_host().spawn_procs(...)`), or spawn on a slice without the failed ranks"
    )


class ProcsKilledWarning(RuntimeWarning):
    """``ProcMesh.stop()`` had to kill procs that did not exit after their actors' ``__cleanup__``."""


#: ``notes``: where a stop read on this thread puts what it killed instead of warning (see
#: :func:`kills_noted`)
_noting = threading.local()


@contextlib.contextmanager
def kills_noted() -> Iterator[list[str]]:
    """Stops whose futures are read on this thread inside the block append what they killed to the
    list it yields instead of warning ``ProcsKilledWarning``. For a thread of our own (the
    dashboard's stop button): a warning there prints in whatever cell happens to run."""
    notes: list[str] = []
    prev = getattr(_noting, "notes", None)
    _noting.notes = notes
    try:
        yield notes
    finally:
        _noting.notes = prev


def _killed_text(killed: list[dict[str, Any]]) -> str:
    """``rank 1 (pid 42 on vm): why``, ranks killed for the same reason on one host in one entry
    (``ranks 0-15 (pids 40-55 on vm): why``): a hung call on 16 ranks is one reason, not 16."""
    from .._ranks import format_ranks

    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in killed:
        by.setdefault((k["host"], k["why"]), []).append(k)
    out = []
    for (host, why), ks in by.items():
        if len(ks) == 1:
            out.append(f"rank {ks[0]['rank']} (pid {ks[0]['pid']} on {host}): {why}")
        else:
            pids = ", ".join(str(k["pid"]) for k in ks)
            out.append(f"ranks {format_ranks(k['rank'] for k in ks)} (pids {pids} on {host}): {why}")
    return "; ".join(out)


def _stopped_by(why: str) -> str:
    """Who stopped a proc mesh from outside this process, as its calls say it ("": not known)."""
    if why.startswith("stopped "):
        return why
    return f"stopped from outside this process ({why or 'by whom is not known'})"


class ProcMesh(MeshTrait):
    """Processes on one or more hosts, shaped like ``{hosts: 2, gpus: 4}``."""

    def __init__(self, name: str, procs: list[ProcRef], view: View, host_mesh: HostMesh | None, persist: bool = False) -> None:
        self._name = name
        self._procs = procs
        self._view = view
        self._host_mesh = host_mesh
        self._persist = persist
        self._stopped = False
        #: this mesh's stop, for a second stop() (kept on the root, which a flattened or
        #: renamed view of the whole mesh stops too)
        self._stop_fut: Future[None] | None = None
        #: the reason of the stop that ended this mesh (kept on the root): this process's own
        #: stop's, or, when that stop found it stopped already from outside (`monarch-nb stop
        #: --force`, another process's stop_mesh), the allocators' ("" when they never said)
        self._stop_reason = ""
        #: that stop found the mesh stopped already by someone else
        self._stopped_outside = False
        self._failed: str = ""
        #: why an actor this process spawned here failed (its procs refuse new spawns)
        self._actor_failed: str = ""
        #: the actor (an _actor.Instance) that spawned these procs, None for the client
        self._owner: Any = None
        #: names of the actor meshes this process spawned on these procs (see _unique_actor_name)
        self._actor_names: set[str] = set()
        #: the actor meshes spawned here by this process, in spawn order (a dead proc is reported
        #: as theirs)
        self._spawned: list[ActorMesh[Any]] = []

    def _outside_stop(self) -> str | None:
        """Why this mesh's allocators no longer know it, when another process stopped it: their
        "mesh stopped" reason (which reaches this client before their answer to a later request),
        or "" when every proc of it ended as a mesh's stop and the reason never came; None when
        nothing says it was stopped."""
        why = _context.client().stop_reasons.get(self._name)
        if why:
            return why
        return "" if self._ended_as_a_stop() else None

    def _closed_error(self, outside: bool = False) -> MeshClosedError | None:
        """Why this mesh (or the mesh it was sliced from) takes no more work, in Monarch's words,
        then who stopped it when that was not this process (as its calls say). ``outside``: also
        when this process never stopped it but every proc of it ended as a mesh's stop
        (`monarch-nb stop --force` from a shell, another process's ``stop_mesh``)."""
        root = getattr(self, "_root", self)
        if self._stopped or root._stopped:
            who = _stopped_by(root._stop_reason) if root._stopped_outside else ""
        elif outside and self._ended_as_a_stop():
            who = _stopped_by(_context.client().stop_reasons.get(self._name, ""))
        else:
            return None
        return MeshClosedError(
            f"`ProcMesh` has already been stopped: proc mesh {self._name!r}" + (f" ({who})" if who else "") + "; spawn new procs"
        )

    def _ended_as_a_stop(self) -> bool:
        """Every proc of this view is known dead, each as its mesh stopped (not a crash)."""
        rt = _context.client().rt
        causes = [rt.peer_error(self._procs[r].addr) for r in self._view.ranks]
        return bool(causes) and all(c is not None and c.cause.startswith("mesh stopped") for c in causes)

    def _with_view(self, view: View) -> ProcMesh:
        # Monarch refuses to slice, flatten, split or rename a stopped proc mesh
        if (closed := self._closed_error()) is not None:
            raise closed
        pm = ProcMesh(self._name, self._procs, view, self._host_mesh, self._persist)
        pm._root = getattr(self, "_root", self)  # type: ignore[attr-defined]
        return pm

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"ProcMesh(name={self._name!r}, extent={self.extent})"

    def _repr_html_(self) -> str:
        from ._display import mesh_grid_html

        return mesh_grid_html(
            "ProcMesh", self._name, list(self._view.labels), list(self._view.sizes),
            [self._procs[r] for r in self._view.ranks], self._stopped, self._failed,
        )  # fmt: skip

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcMesh, (self._name, self._procs, self._view, self._host_mesh, self._persist))

    def __await__(self) -> Any:
        return _immediate(self).__await__()

    @property
    def initialized(self) -> Future[bool]:
        return Future._completed(True)

    async def __aenter__(self) -> ProcMesh:
        # Monarch's: ``async with host.spawn_procs(...) as procs:`` stops the procs at the end
        if (closed := self._closed_error()) is not None:
            raise closed
        return self

    async def __aexit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        # nested blocks on one mesh stop it once
        if not (self._stopped or getattr(self, "_root", self)._stopped):
            await self.stop()

    def rank_tensors(self) -> dict[str, Any]:
        """Monarch's: ``{dim: self.rank_tensor(dim)}`` for every dimension (``monarch_nb.tensor``)."""
        return {dim: self.rank_tensor(dim) for dim in self._view.labels}

    @property
    def host_mesh(self) -> HostMesh:
        if self._host_mesh is None:
            return this_host()
        return self._host_mesh

    def spawn(self, name: str, Class: type[T], *args: Any, **kwargs: Any) -> Any:
        """Construct ``Class(*args, **kwargs)`` in every proc, in the background: returns once
        every proc has the actor queued, as Monarch's. A failing ``__init__`` fails its actor:
        the owner hears of it through supervision and calls to it raise ``SupervisionError``.
        """
        if (closed := self._closed_error(outside=True)) is not None:
            raise closed
        if not isinstance(name, str):
            raise TypeError(f"spawn(name, Class, ...) needs the actor mesh's name first, a str, got {name!r}")
        if not isinstance(Class, type):
            raise TypeError(f"spawn needs an Actor class, got {Class!r}")
        _check_spawnable(Class, args, kwargs)
        client = _context.client()
        rt = client.rt
        view = self._view
        ext = (list(view.labels), list(view.sizes))
        procs = [self._procs[r] for r in view.ranks]
        _fdlimit.ensure_room(len(procs) * _fdlimit.PER_ACTOR, f"spawning actor {name!r} on {plural(len(procs), 'proc')}")
        label, name = name, self._unique_actor_name(name)
        # each actor tells this process of its own failure on this port (Monarch's supervision
        # events), whose handler hands it to the mesh once spawn has made it
        sup = _Supervised()
        sup_port = rt.open_port(sup.on_event)
        # the addresses of ours inside (the controller proc, Ports in the arguments) as the
        # procs' hosts reach them (through a gateway's reply address, if they are behind one)
        with _context.pickling_for(rt, procs[0].addr if procs else ""):
            # the new actors' creator (Monarch's Instance.creator) and the job's controller proc
            parent, controllers = _context.lineage()
            # pickled once (a class from a notebook cell travels by value) and sent once per host
            body, bufs = dumps(
                (
                    (name, Class, args, kwargs, ext, self, client.cid),
                    {"parent": parent, "controllers": controllers, "label": label, "supervisor_port": sup_port},
                )
            )
        rt.check_size(body, bufs)
        fut = gather(
            rt,
            len(procs),
            len(procs),
            f"spawn {label!r}",
            list,
            lambda port, on_fail: multicast(
                rt, procs, range(len(procs)), "__sys__", "spawn_actor", body, bufs, port, on_fail, ((), ())
            ),
            keep_errors=True,
        )
        results = fut.get(timeout=rt.cfg.spawn_timeout)
        errors = [r.error() for r in results if isinstance(r, RemoteFailure)]
        refused = _refused_ranks(results) if errors else {}
        if errors and len(refused) < len(errors):
            rt.close_port(sup_port)
            # its procs ended as a stop from outside while the spawn was on its way, or before
            # this process heard of it: that, not a failed spawn
            if (closed := self._closed_error(outside=True)) is not None:
                raise closed from None
            e = errors[0]
            tb = getattr(e, "remote_traceback", "")
            # the user's error is the headline; its traceback is shown once, by SpawnError (not
            # again as a chained cause: ``.error`` keeps the remote error)
            msg = getattr(e, "message", "") or str(e)
            err = SpawnError(
                f"spawning {label!r} ({Class.__qualname__}) failed on {len(errors)} of {len(procs)} procs: {msg}", tb
            )
            err.error = e
            note_missing_module(err)
            raise err from None
        mesh: ActorMesh[Any] = ActorMesh(Class, name, self._procs, view, self, label)
        if refused:
            # procs where an actor failed took no actor: as Monarch's, spawn still returns the
            # mesh, and every call to it fails with the reason
            mesh._refused = _spawn_refused(refused, len(results), self._name)
        mesh._owner = _context.current_instance()
        if mesh._owner is not None:
            mesh._owner._owned.append(mesh)  # stopped when its owner is
        sup.port = sup_port
        mesh._sup = sup
        mesh._origin = (parent, ext, list(view.ranks))
        self._spawned.append(mesh)
        sup.attach(mesh)
        # a new mesh under a stopped one's name is live
        client.stopped_actor_meshes.discard(mesh._key())
        if self._persist or any(p.alloc for p in self._procs):
            blob = dumps_by_value(Class)
            for alloc in {p.alloc for p in self._procs if p.alloc}:
                client.tell(alloc, "note_actor", self._name, name, blob, client.cid, label)
        return mesh

    def _unique_actor_name(self, name: str) -> str:
        """This spawn's own id, which its actors are addressed by in their procs.

        As in Monarch each spawn is a new mesh, also under a name spawned before: by this
        process (a notebook cell run twice), by another controller, or by an actor, on the same
        procs. Procs key actors by this id, ``name#<process>.<n>`` (unique to this process and
        spawn); the actors still call themselves ``name``, and ``name`` is what programs look
        them up by (``ProcMesh.actor_mesh``).
        """
        if "#" in name:
            raise ValueError(f"actor mesh name {name!r}: '#' is reserved (it separates a spawn's id); pick another name")
        if name.startswith("__") and name.endswith("__"):
            # monarch_nb's own per-proc actors (a kernel's %%mesh exec namespace): one per
            # proc by design, which a later controller finds again by its refused spawn
            return name
        return f"{name}#{_SPAWN_ID}.{next(_spawn_counter)}"

    def activate(self) -> Any:
        """``with procs.activate():`` torch factories make tensors on this mesh (Monarch's tensor
        engine; here ``monarch_nb.tensor``, which must have been imported)."""
        if _tensor_hooks is None:
            raise RuntimeError("ProcMesh.activate() is monarch_nb.tensor's: `import monarch_nb.tensor` first")
        return _tensor_hooks["activate"](self)

    def rank_tensor(self, dim: str) -> Any:
        """A mesh tensor holding each rank's coordinate along ``dim`` (``monarch_nb.tensor``)."""
        if _tensor_hooks is None:
            raise RuntimeError("ProcMesh.rank_tensor() is monarch_nb.tensor's: `import monarch_nb.tensor` first")
        return _tensor_hooks["rank_tensor"](self, dim)

    def stop(self, reason: str = "stopped by client", *, force: bool = False) -> Future[None]:
        """Stop every proc of this mesh. A slice of some of its procs is not stopped on its own
        (Monarch's ``ValueError``, when the future is read): stop the mesh it was sliced from.
        (A view of all of them, flattened or renamed, stops the mesh.)"""
        return self._stop(reason, force=force)

    def _stop(self, reason: str = "stopped by client", *, force: bool = False, because: str = "") -> Future[None]:
        """:meth:`stop`; ``because``: what the causes of its procs' ends say (a call to one then
        fails naming it), where this process's own ``reason`` would not (an actor that failed
        stops the meshes it spawned)."""
        root = getattr(self, "_root", self)
        if root is not self and set(self._view.ranks) != set(root._view.ranks):
            return Future._failed(
                ValueError(
                    "ProcMesh is not owned; must be stopped by an owner: this is a slice of proc mesh "
                    f"{self._name!r}, whose procs stop together (stop the mesh it was sliced from)"
                ),
                f"stop mesh {self._name}",
            )
        client = _context.client()
        self._stopped = True
        root._stopped = True
        prev = root._stop_fut
        if prev is not None and not force and not (prev.done() and prev.exception(timeout=0) is not None):
            # as Monarch's: stopping a mesh again (or while it stops) is that same stop, not
            # an error for a mesh its allocator no longer knows
            return prev
        client.stopped_meshes.add(self._name)
        root._stop_reason, root._stopped_outside = reason, False
        allocs = sorted({p.alloc for p in self._procs if p.alloc})
        # an allocator this process has declared lost gets a hello, all of them at once and for
        # QUICK_HELLO_S: one whose host recovered (a stall, a healed link, a SIGCONT) answers in
        # that, and is stopped; one still silent fails its part at once with its loss. A hello
        # each, one after another and for the whole heartbeat_timeout, held this call that long
        # per host gone; one that stalled longer reaps a non-persistent mesh itself once it finds
        # its controller silent, and `monarch-nb stop` or stop_mesh() still find it
        client.revive_lost(allocs, QUICK_HELLO_S)
        futs = [
            client.request(a, "stop_mesh", self._name, client.cid, force, reason, True, because, _revive=False) for a in allocs
        ]
        out: Future[None] = Future._create(f"stop mesh {self._name}")
        name = self._name

        def finish(fs: list[Future[Any]]) -> None:
            killed = []
            gone = 0
            failed: BaseException | None = None
            for f in fs:
                try:
                    killed.extend((f.get() or {}).get("killed", ()))
                except MeshNotFoundError as e:
                    # stopped there already, from outside this controller (`monarch-nb stop --force`,
                    # another process's stop_mesh): what was asked is done, as for a second stop
                    if root._outside_stop() is None:
                        failed = failed or e  # nothing says it was stopped: that the allocator lost it is the news
                    else:
                        gone += 1
                except Exception as e:
                    # one host's part failed (a lost host): the others' parts are still read, so
                    # what they had to kill is said before the failure is raised
                    failed = failed or e
            if fs and gone == len(fs):
                # all of it: later calls say who stopped it, not this process's reason
                root._stop_reason, root._stopped_outside = root._outside_stop() or "", True
            if killed:
                # stop finishes the job: what it had to kill is said where stop() was awaited
                import warnings

                said = f"stopping proc mesh {name!r} killed {len(killed)} proc(s): {_killed_text(killed)}"
                notes = getattr(_noting, "notes", None)
                if notes is not None:
                    notes.append(said)
                else:
                    warnings.warn(said, ProcsKilledWarning, callers_level())
            if failed is not None:
                raise failed

        _all(futs, f"stop mesh {name}").add_done_callback(lambda _f: out._set_raw(futs, finish))
        root._stop_fut = out
        return out

    async def logging_option(
        self, stream_to_client: bool = True, aggregate_window_sec: int | None = None, level: int = 20
    ) -> None:
        """Stream this mesh's output to this client (or not), aggregated over
        ``aggregate_window_sec``; ``level`` is the Python logging level of its processes
        (their root logger; records at or above it are printed to stderr, so they reach the
        logs and this client)."""
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec needs stream_to_client=True")
        client = _context.client()
        client.log_level = level
        if aggregate_window_sec is not None:
            client.log_windows[self._name] = float(aggregate_window_sec)
        body, bufs = _args((int(level),))
        # ordered before this client's later calls to the mesh, so they log at the new level
        multicast(
            client.rt, list(self._procs), range(len(self._procs)), "__sys__", "set_log_level", body, bufs, None, None, ((), ())
        )
        port = client.log_port
        if stream_to_client:
            client.log_meshes.add(self._name)
        else:
            client.log_meshes.discard(self._name)
        for alloc in sorted({p.alloc for p in self._procs if p.alloc}):
            client.rt.send_actor(
                alloc,
                "__allocator__",
                "stream_logs",
                *_args((self._name, stream_to_client)),
                reply=(client.rt.addr_for(alloc), port),
            )

    def _failures_for(self, err: Exception) -> list[Any]:
        """The ``MeshFailure``s a dead proc (``err``) is reported as, as Monarch's: one per actor
        mesh that had an actor on it, named after it; the proc mesh's own only when none had."""
        from . import _supervision

        if isinstance(err, SupervisionError) and _exited_cleanly(err.cause):
            # no failure, as on Monarch: a script whose proc ended its work with os._exit(0) goes
            # on (the default hook would end it); calls to its actors say it stopped
            return []
        failures = [f for m in list(self._spawned) if (f := m._proc_failure(err)) is not None]
        return failures or [_supervision.MeshFailure(self._name, self, err)]

    def _report_failure(self, err: Exception, failures: list[Any] | None = None) -> None:
        from . import _supervision

        try:
            for f in self._failures_for(err) if failures is None else failures:
                _supervision.report(f)
        finally:
            # marked after the report, so code that waits for the mark has seen the report
            self._failed = str(err)

    def actor_mesh(self, name: str) -> ActorMesh[Any]:
        """Re-attach to actors spawned earlier on this mesh (e.g. after a kernel restart).

        ``name`` is the name they were spawned under, or a spawn's id (``name#…``, as
        ``ActorMesh._name`` and the error below show it) when several spawns used that name.
        """
        client = _context.client()
        for alloc in sorted({p.alloc for p in self._procs if p.alloc}):
            info = client.request(alloc, "lookup", self._name).get(timeout=client.rt.cfg.connect_timeout)
            actors: dict[str, bytes] = info["actors"]
            meta: dict[str, dict[str, Any]] = info.get("actor_info") or {}
            if name in actors:
                return ActorMesh(loads(actors[name]), name, self._procs, self._view, self)
            found = [a for a in actors if _label_of(a) == name]
            if len(found) == 1:
                return ActorMesh(loads(actors[found[0]]), found[0], self._procs, self._view, self)
            if len(found) > 1:
                raise ValueError(_ambiguous(name, self._name, found, meta, client.cid))
        return ActorMesh(None, name, self._procs, self._view, self)  # type: ignore[arg-type]

    @staticmethod
    def lookup(name: str, hosts: HostMesh | None = None) -> ProcMesh:
        """Find a running mesh by name on ``hosts`` (default: this host) and attach to it."""
        hosts = hosts or this_host()
        client = _context.client()
        procs: list[ProcRef] = []
        extent = None
        persist = False
        refs = hosts._refs()
        # a host declared lost may have only stalled: the hellos that find out, at once
        client.revive_lost(h.alloc for h in refs)
        futs = [client.request(h.alloc, "lookup", name) for h in refs]
        infos = [f.get(timeout=client.rt.cfg.connect_timeout) for f in futs]
        going = [(h, i) for h, i in zip(refs, infos) if i.get("state") in ("stopping", "stopped")]
        if going:
            # its procs are exiting: attached, every call to it would fail as they go
            h, i = going[0]
            raise MeshNotFoundError(
                f"mesh {name!r} is {i['state']} on host {i.get('host', h.alloc)}: it cannot be attached to; "
                f"wait for its stop to finish, then spawn it again",
                name,
            )
        # one mesh spans hosts under one owner and extent; meshes that only share the name
        # (spawned apart, by other controllers) are not merged into one
        kinds = {(i.get("owner"), repr(i.get("extent"))) for i in infos}
        if len(kinds) > 1:
            raise MeshError(_ambiguous_procs(name, refs, infos, client.cid))
        # a mesh whose controller is gone (a restarted kernel's) is this controller's now, on every
        # host at once; one whose owner still runs stays that owner's
        # (a round trip per host only for a mesh this controller does not own already)
        adopts = [
            (client.request(h.alloc, "adopt", name, client.cid, i.get("owner", "")), i)
            for h, i in zip(refs, infos)
            if i.get("owner") != client.cid
        ]
        for f, info in adopts:
            info["owner"] = f.get(timeout=client.rt.cfg.connect_timeout)
        for h, info in zip(refs, infos):
            extent = info["extent"]
            persist = info["persist"]
            for addr, pid, rank, _state in info["procs"]:
                procs.append(ProcRef(addr, h.alloc, info["host"], pid, name, rank))
        assert extent is not None
        procs.sort(key=lambda p: p.rank)
        pm = ProcMesh(name, procs, View(*extent), hosts, persist)
        client.own(procs, pm)
        if client.log_enabled:
            # what its ranks print reaches this controller too (a restarted kernel re-attaching)
            client.log_meshes.add(name)
            for alloc in sorted({p.alloc for p in procs if p.alloc}):
                client.rt.send_actor(
                    alloc,
                    "__allocator__",
                    "stream_logs",
                    *_args((name, True)),
                    reply=(client.rt.addr_for(alloc), client.log_port),
                )
        return pm


#: set by monarch_nb.tensor (a feature above this layer) when imported: activate, rank_tensor
_tensor_hooks: dict[str, Callable[..., Any]] | None = None


def set_tensor_hooks(**hooks: Callable[..., Any]) -> None:
    global _tensor_hooks
    _tensor_hooks = hooks


class HostMesh(MeshTrait):
    """Hosts, each run by an allocator; ``spawn_procs`` starts procs on every one."""

    def __init__(self, hosts: list[HostRef], view: View) -> None:
        self._hosts = hosts
        self._view = view
        #: the default bootstrap command of spawn_procs (with_python_executable)
        self._bootstrap_cmd: Any = None
        #: procs start with this process's environment rather than their host's: only for a
        #: controller's this_host(), whose host Monarch runs inside the controller itself
        self._controller_env = False
        #: set by the job that started these hosts: why they are gone ("SlurmJob 12 is
        #: CANCELLED"), or None while it runs; asked only when a spawn on them fails
        self._gone: Callable[[], str | None] | None = None

    def _with_view(self, view: View) -> HostMesh:
        hm = HostMesh(self._hosts, view)
        hm._bootstrap_cmd, hm._controller_env, hm._gone = self._bootstrap_cmd, self._controller_env, self._gone
        return hm

    def with_python_executable(self, python_executable: str) -> HostMesh:
        """These hosts, spawning procs with ``python_executable`` (by exec, not from the zygote)."""
        from ._misc import default_bootstrap_cmd

        base = default_bootstrap_cmd()
        hm = HostMesh(self._hosts, self._view)
        hm._controller_env, hm._gone = self._controller_env, self._gone
        hm._bootstrap_cmd = type(base)(python_executable, None, base.args, base.env, base.inherit_env)
        return hm

    @property
    def is_fake_in_process(self) -> bool:
        """Monarch's flag for hosts simulated inside the client; ours are always real processes."""
        return False

    def _refs(self) -> list[HostRef]:
        return [self._hosts[r] for r in self._view.ranks]

    def __repr__(self) -> str:
        return f"HostMesh(extent={self.extent}, hosts={[h.host for h in self._refs()]})"

    def _repr_html_(self) -> str:
        from .._meshhtml import rank_grid_html

        recs = [{"rank": i, "host": h.host, "pid": "", "state": "idle", "reason": ""} for i, h in enumerate(self._refs())]
        return rank_grid_html(f"HostMesh {self.extent}", list(self._view.labels), list(self._view.sizes), recs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (HostMesh, (self._hosts, self._view))

    @property
    def initialized(self) -> Future[bool]:
        return Future._completed(True)

    def __await__(self) -> Any:
        return _immediate(self).__await__()

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap: Callable[[], Any] | None = None,
        name: str | None = None,
        proc_bind: list[dict[str, str]] | None = None,
        bootstrap_command: Any = None,
        *,
        persist: bool | None = None,
    ) -> ProcMesh:
        """Start procs shaped ``per_host`` on every host; returns when every proc is up.

        ``persist=True`` (the default in a Jupyter kernel) keeps them after this
        controller exits, to be re-attached with ``ProcMesh.lookup(name)``.
        """
        try:
            return self._spawn_procs(per_host, bootstrap, name, proc_bind, bootstrap_command, persist=persist)
        except (ConnectError, SpawnError) as e:
            why = self._gone() if self._gone is not None else None
            if why is None:
                raise
            # an allocator that is not there says only that: the job that ran it says why
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise type(e)(f"cannot spawn procs on these hosts: {why}. ({first})") from e

    def _spawn_procs(
        self,
        per_host: dict[str, int] | None,
        bootstrap: Callable[[], Any] | None,
        name: str | None,
        proc_bind: list[dict[str, str]] | None,
        bootstrap_command: Any,
        *,
        persist: bool | None,
    ) -> ProcMesh:
        if per_host is not None and not isinstance(per_host, Mapping):
            raise TypeError(f"per_host is a dict of dimension sizes, like {{'gpus': 8}}, got {per_host!r}")
        per_host = dict(per_host or {})
        for k, v in per_host.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"per_host[{k!r}] must be a positive int, got {v!r}")
        client = _context.client()
        if persist is None:
            persist = client.kind == "ipython"
        if not name or name == "anon":
            # (an empty name too: the allocator names it so, and stop() must find it by that name)
            client._anon += 1
            name = f"anon-{client.cid[:6]}-{client._anon}"
        hosts = self._refs()
        labels = [*self._view.labels, *per_host]
        sizes = [*self._view.sizes, *per_host.values()]
        if len(set(labels)) != len(labels):
            raise ValueError(f"per_host labels {list(per_host)} collide with host mesh dimensions {list(self._view.labels)}")
        n_local = math.prod(per_host.values()) if per_host else 1
        # as Monarch's: procs inherit their host's environment (None: the allocator's own), but
        # a controller's this_host() is the controller itself there
        env = dict(os.environ) if self._controller_env else None
        boot = dumps_by_value(bootstrap) if bootstrap is not None else None
        cmd = _bootstrap_command(bootstrap_command if bootstrap_command is not None else self._bootstrap_cmd)
        # one future for the whole spawn, reporting procs up as the allocators tell of them: a
        # frontend shows its progress while a large mesh starts
        total = n_local * len(hosts)
        # each proc takes this process descriptors; running out later would take the kernel down
        _fdlimit.ensure_room(total * _fdlimit.PER_PROC, f"spawning {plural(total, 'proc')} ({name!r})")
        whole: Future[None] = Future._create(f"spawn of {total} procs {name!r}")
        whole._progress = ([total], total)
        whole._unit = "procs up"
        up_by_host: dict[int, int] = {}

        def procs_up(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            if status != wire.ITEM:
                return
            kind, h_index, up, _n = loads(body, bufs)
            if kind == "procs_up":
                up_by_host[h_index] = max(up, up_by_host.get(h_index, 0))
                whole._progress[0][0] = total - sum(up_by_host.values())  # type: ignore[index]

        progress_port = client.rt.open_port(procs_up)
        # this incarnation of the name, the same on every host: a mesh stopped and spawned again
        # under its name is another one, and telemetry tells their spans apart by it
        mesh_id = secrets.token_hex(6)
        # and an earlier incarnation's stop is not this one's: not who stopped it (as calls tell),
        # nor that its procs' deaths are no failure (the client's supervision kept quiet for good)
        client.stop_reasons.pop(name, None)
        client.stopped_meshes.discard(name)
        futs = []
        if client.log_enabled:
            client.log_meshes.add(name)  # stream_logs_to below
        for h_index, h in enumerate(hosts):
            client.connect(h.alloc)
            spec = {
                "name": name,
                "mesh_id": mesh_id,
                "owner": client.cid,
                "persist": persist,
                "labels": list(per_host),
                "sizes": list(per_host.values()),
                "rank_base": h_index * n_local,
                "host_index": h_index,
                "extent": (labels, sizes),
                "env": env,
                "sys_path": list(sys.path),
                "cwd": os.getcwd(),
                "bootstrap": boot,
                "bootstrap_command": cmd,
                "stream_logs_to": (client.rt.addr_for(h.alloc), client.log_port) if client.log_enabled else None,
                "progress_to": (client.rt.addr_for(h.alloc), progress_port),
            }
            futs.append(client.request(h.alloc, "spawn", spec))
        waiting = [len(futs)]
        lock = threading.Lock()

        def host_done(_f: Future[Any]) -> None:
            with lock:
                waiting[0] -= 1
                last = waiting[0] == 0
            if last:
                whole._set_result(None)

        for f in futs:
            f.add_done_callback(host_done)
        if not futs:
            whole._set_result(None)
        owner = _context.current_instance()

        def finish() -> ProcMesh:
            procs: list[ProcRef] = []
            errors = []
            for h, f in zip(hosts, futs):
                try:
                    info = f.get(timeout=0)
                except Exception as e:
                    errors.append((h, e))
                    continue
                for addr, pid, rank in info["procs"]:
                    procs.append(ProcRef(addr, h.alloc, info["host"], pid, name, rank))
            if errors:
                spawned = [h for h, f in zip(hosts, futs) if f.exception(timeout=0) is None]
                # nobody reads these replies: a host lost since its spawn gets a short hello (as
                # a stop's), not one each for its heartbeat_timeout, holding the spawn's error
                # host after host (one that stalled longer reaps a non-persistent mesh itself, its
                # controller silent; `monarch-nb stop` finds a persistent one)
                client.revive_lost((h.alloc for h in spawned), QUICK_HELLO_S)
                for h in spawned:
                    client.request(h.alloc, "stop_mesh", name, client.cid, False, "spawn failed elsewhere", _revive=False)
                h, err = errors[0]
                if isinstance(err, SpawnError):
                    raise err
                raise SpawnError(f"spawning procs {name!r} on host {h.host} failed: {err}") from err
            procs.sort(key=lambda p: p.rank)
            pm = ProcMesh(name, procs, View(labels, sizes), self, persist)
            # the actor spawning these procs owns them: their failures go to its __supervise__
            pm._owner = owner
            if pm._owner is not None:
                pm._owner._owned.append(pm)  # stopped when its owner is
            client.own(procs, pm)
            for p in procs:
                client.rt.watch(p.alloc, p.addr, p.mesh, p.rank, p.host)
            return pm

        try:
            whole.get(timeout=client.rt.cfg.spawn_timeout + 10)
        except TimeoutError:
            pass  # the hosts that did not answer are named below
        except KeyboardInterrupt as e:
            # an interrupt stops the wait, not the spawn; there is no future to wait on again,
            # so the mesh is taken as this controller's once up (supervised, stopped by `%mesh
            # stop --all`), and the user is told how to reach it
            e.__notes__ = [n for n in getattr(e, "__notes__", []) if "only the wait stopped" not in n]
            e.add_note(
                f"monarch_nb: only the wait stopped: the spawn of {total} procs {name!r} goes on, and its procs are "
                f"this controller's once up: ProcMesh.lookup({name!r}) returns them, `%mesh stop {name}` stops them"
            )
            threading.Thread(target=_adopt_spawned, args=(whole, finish, client.rt.cfg.spawn_timeout + 10), daemon=True).start()
            raise
        finally:
            client.rt.close_port(progress_port)
        return finish()

    def shutdown(self) -> Future[None]:
        """Stop the allocators of these hosts (and every proc they own)."""
        client = _context.client()
        sup = client.rt.supervision
        refs = self._refs()
        # the hellos to those declared lost, at once and for QUICK_HELLO_S (see ProcMesh._stop)
        client.revive_lost((h.alloc for h in refs), QUICK_HELLO_S)
        futs: list[Future[Any]] = []
        for h in refs:
            lost = sup.lost_silent(h.alloc)
            if lost is not None:
                # still silent: not waited on, its part fails at once; one that only stalled
                # longer would still run, which the user is told
                err = SupervisionError(
                    f"HostMesh.shutdown(): {lost.cause}, so it was not asked to shut down; if its host only "
                    "stalled, the allocator still runs there: `monarch-nb allocator stop` on that host stops it",
                    host=lost.host,
                )
                futs.append(Future._failed(err, f"shutdown on {h.alloc}"))
            else:
                # with our cid: our meshes there count as stopped by us, not failed (one lost
                # otherwise, shut down or stopped on purpose, fails at once with that)
                futs.append(client.request(h.alloc, "shutdown", client.cid, _revive=False))
        return _all(futs, "shutdown hosts")

    def stop(self) -> Future[None]:
        return Future._completed(None)


def _adopt_spawned(whole: Future[None], finish: Callable[[], ProcMesh], timeout: float) -> None:
    """A spawn whose wait was interrupted: its mesh becomes this controller's once up."""
    try:
        whole.get(timeout=timeout)
        finish()
    except Exception:
        pass  # it failed or timed out: the allocators stopped what had started


def _bootstrap_command(cmd: Any) -> tuple[Any, ...] | None:
    """(argv, environment changes (None removes), whether to start from the inherited environment)."""
    if cmd is None:
        return None
    if isinstance(cmd, (list, tuple)) and cmd and isinstance(cmd[0], str):
        return [*cmd], {}
    from ._misc import BootstrapCommand

    if isinstance(cmd, BootstrapCommand):
        if cmd.inherit_env and all(v is not None for v in cmd.env.values()):
            return cmd.argv(), dict(cmd.env)  # the form allocators before inherit_env read too
        return cmd.argv(), dict(cmd.env), cmd.inherit_env
    raise TypeError(f"bootstrap_command must be a list of strings or a BootstrapCommand, got {cmd!r}")


_host_lock = threading.Lock()
_local_host: HostMesh | None = None


def this_host() -> HostMesh:
    """This host as a 0-dimensional host mesh; a controller starts the local allocator if none runs."""
    global _local_host
    if _local_host is not None and not _local_allocator_lost(_local_host):
        return _local_host
    with _host_lock:
        if _local_host is None or _local_allocator_lost(_local_host):
            spec = _context.proc_spec
            if spec is not None:
                _local_host = HostMesh([HostRef(spec["alloc_addr"], spec["host"])], View([], []))
            else:
                from .._runtime.records import local_allocator
                from ..config import runtime_dir

                client = _context.client()
                rdir = runtime_dir(client.rt.cfg)
                info = local_allocator(rdir)
                client.connect(info["addr"])
                _local_host = HostMesh([HostRef(info["addr"], info["host"])], View([], []))
                _local_host._controller_env = True
    return _local_host


def _local_allocator_lost(host: HostMesh) -> bool:
    """A controller's local allocator went silent or its process is gone: it may have died and
    another been started since (at another address), so ``this_host()`` looks again instead of
    keeping a dead one (and a spawn right after it died does not wait out a heartbeat)."""
    if not host._controller_env:
        return False
    sup, addr = _context.client().rt.supervision, host._hosts[0].alloc
    return sup.local_gone(addr) or sup.is_lost(addr)


_this_proc: ProcMesh | None = None


def this_proc() -> ProcMesh:
    """This process as a 0-dimensional proc mesh: ``this_proc().spawn(...)`` hosts actors here."""
    global _this_proc
    if _this_proc is None:
        from ._host import ensure_actor_host

        rt = _context.runtime()
        ensure_actor_host(rt)
        spec = _context.proc_spec
        me = ProcRef(rt.ipc_addr, "", rt.hostname, rt.pid, spec["mesh"] if spec else "controller", spec["rank"] if spec else 0)
        _this_proc = ProcMesh(me.mesh, [me], View([], []), None)
    return _this_proc


def get_or_spawn_controller(name: str, Class: type[T], *args: Any, **kwargs: Any) -> Future[Any]:
    """The job's singleton actor named ``name``, spawned by the first request for it.

    As in Monarch, controllers live in the root controller's process and are shared by the
    whole tree: the client and every actor it spawned (and theirs), on any proc, get the
    same actor for the same name. Later requests ignore ``Class`` and the arguments.
    A class that cannot be spawned, or a failing ``__init__``, fails the future with an
    ``ActorError``, as Monarch's (whose spawn runs in an actor of its own).
    """
    try:
        _check_spawnable(Class, args, kwargs)
    except (TypeError, ValueError) as e:
        # nothing sent: the name is not taken by a controller that could never answer
        refused: Future[Any] = Future._create(f"get_or_spawn_controller({name!r})")
        refused._set_exception(ActorError(e, message=f"get_or_spawn_controller({name!r}) failed: {e}"))
        return refused
    inst = _context.current_instance()
    root = inst._controllers if inst is not None and inst._controllers is not None else _context.controllers_proc()
    client = _context.client()
    reply = client.request(root.addr, "get_or_spawn_controller", name, Class, args, kwargs, client.cid, _actor="__sys__")
    out: Future[Any] = Future._create(f"get_or_spawn_controller({name!r})")

    def mesh(f: Future[Any]) -> ActorMesh[Any]:
        f.get()  # raises the constructor's failure
        return ActorMesh(Class, name, [root], View([], []), None)

    reply.add_done_callback(lambda f: out._set_raw(f, mesh))
    return out


def attach_to_workers(
    *,
    ca: Any = None,
    workers: list[Any],
    name: str | None = None,
    private_key: Any = None,
    key_file: str | None = None,
) -> HostMesh:
    """A host mesh ``{hosts: N}`` over allocators already running at ``workers`` addresses.

    ``ca`` (or ``key_file``) is the path of the cluster key file; ``"trust_all_connections"``
    is accepted only for loopback and ipc addresses.
    """
    from .._runtime.transport import Security, worker_address
    from .._wire.keys import read_key_file

    if isinstance(workers, str):
        # Monarch makes a host of each character
        raise ValueError(f"workers is a list of addresses, got the string {workers!r}: write [{workers!r}]")
    client = _context.client()
    path = key_file or (ca if isinstance(ca, (str, os.PathLike)) and ca != "trust_all_connections" else None)
    if path is None and private_key is None and ca is None:
        path = os.environ.get("MONARCH_NB_KEY_FILE") or None
    if isinstance(private_key, bytes):
        client.rt.sockets.set_security(Security(private_key))
    elif path:
        client.rt.sockets.set_security(Security(read_key_file(os.fspath(path))))
    elif ca == "trust_all_connections":
        client.rt.sockets.set_security(Security(None, trust_all=True))
    # Monarch's forms: [proc-id@]url, and advertised@bind (dial the advertised one)
    addrs = [worker_address(w.get() if isinstance(w, Future) else str(w))[0] for w in workers]
    refs = []
    for a in addrs:
        info = client.connect(a)
        refs.append(HostRef(a, info["host"]))
    return HostMesh(refs, View(["hosts"], [len(refs)]))


def proc_mesh(*, gpus: int | None = None, hosts: int | None = None, **dims: int) -> ProcMesh:
    """Monarch's early helper: local procs shaped ``{hosts, gpus, ...}`` on this host."""
    per_host: dict[str, int] = {}
    if hosts is not None:
        per_host["hosts"] = hosts
    if gpus is not None:
        per_host["gpus"] = gpus
    per_host.update(dims)
    return this_host().spawn_procs(per_host=per_host)


def _args(args: tuple[Any, ...]) -> tuple[bytes, list[Any]]:
    from .._wire.serialize import dumps

    return dumps((args, {}))


def _class_name(cls: type | None) -> str | None:
    return f"{cls.__module__}.{cls.__qualname__}" if cls is not None else None


_KILLED = re.compile(r"process \d+ was killed by (\w+)")
_EXITED = re.compile(r"process \d+ exited with code (\d+)")
#: a proc's cause when its mesh stopped: how it ended (then, where the stop said, why)
_STOPPED_PROC = re.compile(r"mesh stopped \((process \d+ (?:exited with code -?\d+|was killed by \w+))\)")


def _check_spawnable(Class: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What Monarch's spawn refuses before anything is sent, refused alike for ``spawn`` and
    ``get_or_spawn_controller``: a class that is no ``Actor`` or mixes sync and async endpoints
    (``ValueError``), arguments its ``__init__`` cannot take (``TypeError``)."""
    if not isinstance(Class, type) or not issubclass(Class, Actor):
        raise ValueError(f"{Class} must subclass monarch_nb.actor.Actor to spawn it.")
    is_async_actor(Class)
    _check_init_args(Class, args, kwargs)


def _check_init_args(Class: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Arguments ``Class.__init__`` cannot take raise ``TypeError`` at the spawn, nothing sent,
    as Monarch's spawn binds them: not a failed actor (and a script's fault hook) later."""
    try:
        sig = inspect.signature(Class.__init__)  # type: ignore[misc]
    except (TypeError, ValueError):
        return  # a constructor without a signature to read (a builtin's): it tells for itself
    try:
        sig.bind(None, *args, **kwargs)
    except TypeError as e:
        # an __init__'s "-> None" says nothing here
        raise TypeError(f"{Class.__qualname__}.__init__{sig.replace(return_annotation=sig.empty)}: {e}") from None


def _exited_cleanly(cause: str) -> bool:
    return (m := _EXITED.match(cause)) is not None and m.group(1) == "0"


def _proc_status(cause: str) -> str:
    """Monarch's words for how a process ended (its ProcStatus), from the runtime's ``cause``."""
    if m := _KILLED.match(cause):
        name = m.group(1)
        sig = signal.Signals[name].value if name in signal.Signals.__members__ else name
        return f"failed: Killed(sig={sig})"
    if (m := _EXITED.match(cause)) and m.group(1) != "0":
        return f"exited with non-zero code {m.group(1)}"
    return f"failed: {cause}"
