"""What a user's actor is: the ``Actor`` base class, its ``Instance``, and its endpoints.

How a process hosts actors (their mailboxes and threads) is ``_host``.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

from . import _context
from ._endpoint import EndpointProperty
from ._shape import Point


class Actor:
    """Base class of actors. Decorate methods with ``@endpoint`` to make them callable on a mesh."""

    @cached_property
    def logger(self) -> logging.Logger:
        # as Monarch's: named after the class and passing DEBUG records, so that a program's
        # logging configuration (formats with %(name)s, levels) treats it the same
        lgr = logging.getLogger(type(self).__name__)
        lgr.setLevel(logging.DEBUG)
        return lgr

    def __supervise__(self, failure: Any) -> Any:
        """Called when a mesh this actor owns fails; return True when handled."""
        return None

    def _handle_undeliverable_message(self, message: Any) -> bool:
        return False

    def __cleanup__(self, exc: Exception | None) -> None:
        """Called when the actor stops (``exc`` is None) or fails (the error); override it to
        release what the actor holds. As Monarch's, this one does nothing, so an override may
        call ``super().__cleanup__(exc)``. One that raises as the actor stops fails the actor,
        as in Monarch: the owner of its mesh hears of it (``cleanup error: …``; the client's
        ``unhandled_fault_hook``), except at its actor mesh's own ``stop()``."""
        return None


def endpoints_of(cls: type) -> dict[str, EndpointProperty]:
    out: dict[str, EndpointProperty] = {}
    for klass in reversed(cls.__mro__):
        for name, v in vars(klass).items():
            if isinstance(v, EndpointProperty):
                out[name] = v
    return out


def is_async_actor(cls: type) -> bool:
    """True for actors whose endpoints are ``async def``; ValueError when a class mixes both."""
    eps = endpoints_of(cls)
    kinds = {name: ep.is_async for name, ep in eps.items()}
    if kinds and len(set(kinds.values())) > 1:
        sync = sorted(n for n, a in kinds.items() if not a)
        asyn = sorted(n for n, a in kinds.items() if a)
        # Monarch's words
        raise ValueError(
            f"{cls} mixes both async and sync endpoints.Synchronous endpoints cannot be mixed with async endpoints "
            f"because they can cause the asyncio loop to deadlock if they wait.sync: {sync} async: {asyn}"
        )
    return any(kinds.values())


class Instance:
    """What an actor knows about itself (``context().actor_instance``)."""

    def __init__(
        self,
        name: str,
        cls: type,
        rank: Point,
        proc_mesh: Any,
        creator: str,
        parent: _context.CreatorInstance | None = None,
        controllers: Any = None,
    ) -> None:
        self.name = name
        self.class_name = f"{cls.__module__}.{cls.__qualname__}"
        self.rank = rank
        self.proc_mesh = proc_mesh
        #: who spawned this actor, as Monarch's ``Instance.creator`` (``<root>`` for the controller)
        self.creator = parent if parent is not None else _context.ROOT
        #: the spawning client's uid: a breakpoint in ``__init__`` belongs to its spawn call
        self._creator_uid = creator
        #: the root controller's proc, where get_or_spawn_controller keeps the job's controllers
        self._controllers = controllers
        rt = _context.runtime()
        self.proc_id = f"{rt.label}@{rt.hostname}:{rt.pid}"
        self.actor_id = f"{name}{rank!r}@{self.proc_id}"
        self._slot: Any = None  # its _host.ActorSlot, once hosted
        #: the meshes (actor and proc) this actor spawned: they stop when it does
        self._owned: list[Any] = []

    @property
    def proc(self) -> Any:
        from ._mesh import this_proc

        return this_proc()

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor once the messages already delivered to it are handled (Monarch's
        ``Instance.stop``); later calls to it fail instead of waiting on a dead mailbox."""
        slot = self._slot
        if slot is not None:
            if not slot.is_async:
                slot.leave_connection()
            # on the I/O thread, which delivers messages: once the proc no longer lists the
            # actor nothing more reaches its mailbox, and the stop queues after all that did
            slot.rt.call_soon(slot.retire)

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor (Monarch's ``Instance.abort``) once the message in hand is done: later
        messages get ``SupervisionError``, ``__cleanup__`` runs, and the owner of its mesh is told."""
        slot = self._slot
        if slot is None:
            return
        slot.abort_reason = reason or "aborted"
        if not slot.running:
            # between messages (a thread of the actor's own): the actor's loop acts on it next
            slot._put(("abort",))

    def __repr__(self) -> str:
        # Monarch's qualified name: <root>.<__main__.Trainer trainers{'gpus': 0/2}>
        return _context.qualified_name(self)
