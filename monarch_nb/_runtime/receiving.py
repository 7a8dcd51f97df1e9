"""Receiving: what this process does with each message its transport hands over.

:class:`Receiver` decodes a message (dropping, with a logged reason, anything malformed, of
another wire version, or replayed), then: a PORT value goes to the handler of that port; a
FANOUT frame is relayed as one message per proc of this allocator; an ACTOR message on an
ordered stream waits its turn (:class:`~.ordering.StreamOrder`), then goes to an actor's
mailbox or, for a system actor, runs inline. It runs on the I/O thread and never runs user
code, so a process whose actor is stuck in pdb still answers pings. Answers go out through
a :class:`~.sending.Sender`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from .._newest import Newest
from .._wire import frames as wire
from .._wire.frames import ACTOR_NAME, CALL_INDEX, REPLY_ADDR, REPLY_PORT, SEQ, STREAM, port_value
from .._wire.serialize import loads
from ..config import Config
from ..errors import ActorError, ProtocolError, SupervisionError, VersionMismatchError, _safe_exc, format_exception
from . import shm as _shm
from .ordering import Skipped, StreamOrder
from .sending import Sender
from .transport import refuse

logger = logging.getLogger(__name__)

PortHandler = Callable[[int, int, Any, list[Any]], None]

#: returned by a system method that answers through its reply port itself (or never)
NO_REPLY = object()
#: stopped actors whose stop reason a message for them is still refused with
STOPPED_KEPT = 256

_Msg = tuple[tuple[Any, ...], Any, list[Any]]
#: :meth:`Receiver.take_own`'s answer for a call it delivered and answered with an error itself
REFUSED: _Msg = ((), b"", [])


def _taken(bufs: list[Any], table: list[tuple[int, str, int]], origin: str) -> list[Any]:
    """``bufs`` with the shared-memory buffers ``table`` names mapped in (:class:`ProtocolError`
    if one cannot be); ``origin``: where the message's reply goes."""
    out = list(bufs)
    for i, name, n in table:
        out[i] = _shm.take(name, n, origin)
    return out


class Mailbox(Protocol):
    def deliver(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None: ...

    def claims(self) -> bool:
        """Whether it would read its messages' connection itself now (see Transport.claim)."""
        ...

    def take_connection(self, claim: Any) -> None: ...


def system_method(wants_reply: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a ``sys_*`` method that wants the caller's ``_reply=(addr, port, index)``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.wants_reply = wants_reply  # type: ignore[attr-defined]
        return fn

    return deco


class Receiver:
    """Routes decoded messages to ports, actors and system actors, and relays fan-outs."""

    def __init__(
        self,
        cfg: Config,
        sender: Sender,
        *,
        label: str,
        hostname: str,
        pid: int,
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.sender = sender
        self.label = label
        self.hostname = hostname
        self.pid = pid
        self._spawn = spawn
        self._ports: dict[int, PortHandler] = {}
        self._port_ids = itertools.count(1)
        self.actors: dict[str, Mailbox] = {}
        #: actor -> why it was stopped, where its stop said (its owner actor failed): what a
        #: message for it is then refused with; the latest few
        self.stopped_because: Newest[str, str] = Newest(STOPPED_KEPT, refresh=False)
        self.system: dict[str, Any] = {}
        #: receiving side of ordered streams; the lock: actor threads that read their own
        #: connections (take_own) check the order too
        self.order: StreamOrder[_Msg] = StreamOrder(self._route_held, cfg.order_gap_timeout, clock, self._skipped)
        self._order_lock = threading.Lock()
        #: set by the runtime: the direct connection of the message being dispatched, for an
        #: idle sync actor to read itself (Transport.claim)
        self.claim: Callable[[], Any] | None = None
        #: (a controller) port -> told the claim (or None) of the connection its reply came on
        #: alone, before the reply is handled: a caller blocked on it reads the next ones itself
        self.reply_claims: dict[int, Callable[[Any], None]] = {}
        #: (a controller) Transport.claim, for reply_claims
        self.claim_reply: Callable[[], Any] | None = None
        #: set by an allocator: its proc at a given address as it can reach it, or None
        self.resolve_proc: Callable[[str], str | None] | None = None
        #: messages dropped (malformed, foreign, replayed, for a proc not here)
        self.dropped = 0
        #: FANOUT frames taken and the proc messages made of them
        self.relayed = [0, 0]

    # ---------------------------------------------------------------- ports
    def open_port(self, handler: PortHandler) -> int:
        port = next(self._port_ids)
        self._ports[port] = handler
        return port

    def close_port(self, port: int) -> None:
        self._ports.pop(port, None)

    def port_reply(self, pv: tuple[int, int, int, Any]) -> None:
        """Deliver a reply read by :func:`~.._wire.frames.port_value`: :meth:`dispatch`'s, or a
        caller's that reads its own reply connection (``dispatch`` would parse it again)."""
        h = self._ports.get(pv[0])
        if h is not None:
            if self.reply_claims and (told := self.reply_claims.pop(pv[0], None)) is not None:
                told(self.claim_reply() if self.claim_reply is not None else None)
            h(pv[1], pv[2], pv[3], [])

    #: dispatch's own name for it: what replaces ``port_reply`` on an instance (a profiler, a
    #: test counting the replies callers read themselves) sees only the replies read outside it
    _deliver = port_reply

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, frames: list[Any], sock: Any = None, rid: bytes = b"") -> None:
        """Take one message's frames (``sock`` and ``rid``: where to refuse it, if anywhere)."""
        if len(frames) == 1:
            # the commonest message: a reply (one per rank of a call to many actors)
            pv = port_value(frames[0])
            if pv is not None:
                self._deliver(pv)
                return
        elif not frames:
            self.dropped += 1
            logger.warning("dropped an empty message")
            return
        try:
            kind, meta, body, bufs, table = wire.decode(frames)
        except VersionMismatchError as e:
            self.dropped += 1
            from .._version import __version__

            logger.warning("dropped a frame: %s", e)
            refuse(
                sock,
                rid,
                f"{self.label} on {self.hostname} speaks wire version {wire.VERSION} (monarch_nb {__version__}) "
                f"and got a message of version {frames[0][3]}: run the same monarch_nb version on every host",
            )
            return
        except ProtocolError as e:
            self.dropped += 1
            logger.warning("dropped a frame: %s", e)
            return
        if table:
            try:
                bufs = _taken(bufs, table, meta[REPLY_ADDR] if kind == wire.ACTOR else "")
            except ProtocolError as e:
                self._refuse_shm(meta if kind == wire.ACTOR else None, e)
                return
        if kind == wire.PORT:
            port, index, status = meta
            h = self._ports.get(port)
            if h is not None:
                h(index, status, body, bufs)
            return
        if kind == wire.FANOUT:
            self._fan_out(meta, body, bufs)
            return
        if meta[SEQ]:
            with self._order_lock:
                ok = self.order.accept(meta[STREAM], meta[SEQ], (meta, body, bufs))
            if not ok:
                self.dropped += 1
                logger.warning("dropped message %d of stream %s: already delivered (a replay?)", meta[SEQ], meta[STREAM])
        else:
            self._route(meta, body, bufs)

    def _refuse_shm(self, meta: tuple[Any, ...] | None, e: ProtocolError) -> None:
        """A message whose shared memory could not be taken is dropped; a call is answered
        with the error."""
        self.dropped += 1
        logger.warning("dropped a message: %s", e)
        if meta is not None and meta[REPLY_ADDR]:
            err = ActorError(e, host=self.hostname)
            self.sender.send_port(meta[REPLY_ADDR], meta[REPLY_PORT], meta[CALL_INDEX], wire.ERROR, err)

    def skip_gaps(self, now: float) -> None:
        """Deliver messages held behind one that never came (lost with a failed relay) after a while."""
        self.order.gap_timeout = self.cfg.order_gap_timeout
        with self._order_lock:
            self.order.skip_gaps(now)

    def take_own(self, frames: list[Any], actor: str) -> _Msg | None:
        """For an actor's thread that read ``frames`` off its own connection: the message, if
        it is a call to ``actor`` due now in its stream's order (then it counts as delivered);
        else None, and the frames go to :meth:`dispatch` as usual. :data:`REFUSED`: it was
        delivered, but its shared memory could not be taken, and it was answered so."""
        try:
            kind, meta, body, bufs, table = wire.decode(frames)
        except ProtocolError:
            return None
        if kind != wire.ACTOR or meta[ACTOR_NAME] != actor or (table and any(not _shm.pooled(e[1]) for e in table)):
            # a shared-memory file of its own (one buffer for several peers) is unlinked once
            # taken: taken twice (here, then by dispatch after a refusal) it would read "gone"
            return None
        if meta[SEQ]:
            # never wait here: the loop's thread may hold it while it delivers
            if not self._order_lock.acquire(blocking=False):
                return None
            try:
                if not self.order.take_next(meta[STREAM], meta[SEQ]):
                    return None
            finally:
                self._order_lock.release()
        if table:
            try:
                bufs = _taken(bufs, table, meta[REPLY_ADDR])
            except ProtocolError as e:
                self._refuse_shm(meta, e)
                return REFUSED  # delivered (its place in the stream is taken), and answered
        return meta, body, bufs

    def _skipped(self, gap: Skipped) -> None:
        logger.warning(
            "messages %d..%d of stream %s never arrived within %.0f s; delivering the later ones",
            gap.first,
            gap.last,
            gap.stream,
            self.order.gap_timeout,
        )

    def _fan_out(self, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor, method, rport, extent, call_id, dests = meta  # a FanoutMeta
        resolve = self.resolve_proc
        self.relayed[0] += 1
        shared: dict[int, Any] | None = {} if len(dests) > 1 and bufs else None
        for addr, index, raddr, sid, seq in dests:
            local = resolve(addr) if resolve is not None else None
            if local is None:
                self.dropped += 1
                where = f"{self.label} on {self.hostname}"
                err = ActorError(LookupError(f"{where} has no proc at {addr} to relay {actor}.{method} to"), host=self.hostname)
                if raddr:
                    self.sender.send_port(raddr, rport, index, wire.ERROR, err)
                else:
                    logger.warning("%s", err)
                continue
            try:
                meta1 = (actor, method, raddr, rport, index, extent, call_id, sid, seq)  # an ActorMeta
                self.sender.send(local, self.sender.encode(local, wire.ACTOR, meta1, body, bufs, shared))
                self.relayed[1] += 1
            except SupervisionError:
                pass  # the proc is gone; its subscribers hear that from the allocator
        self.sender.unshare(shared)

    def _route_held(self, msg: _Msg) -> None:
        self._route(*msg)

    def _route(self, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor = meta[ACTOR_NAME]
        sysobj = self.system.get(actor)
        if sysobj is not None:
            self._run_system(sysobj, meta, body, bufs)
            return
        box = self.actors.get(actor)
        if box is not None:
            box.deliver(meta, body, bufs)
            if self.claim is not None and box.claims():
                c = self.claim()
                if c is not None:
                    box.take_connection(c)
            return
        raddr, rport, index = meta[REPLY_ADDR], meta[REPLY_PORT], meta[CALL_INDEX]
        # the actor was stopped (by the client, or by itself): as in Monarch, a supervision error
        # an actor mesh's id is ``name#spawn``: the name is what the program knows it by
        name, _, spawn = actor.partition("#")
        because = self.stopped_because.get(actor)
        where = f"{name!r}{f' (spawn {spawn})' if spawn else ''} in {self.label} pid {self.pid}"
        err = SupervisionError(
            f"actor {where} was stopped because {because}"
            if because
            else f"no actor named {where} (stopped, or never spawned there)",
            actor=name,
            host=self.hostname,
        )
        if raddr:
            self.sender.send_port(raddr, rport, index, wire.ERROR, err)
        else:
            logger.warning("dropped a message for unknown actor %r", actor)

    def _run_system(self, obj: Any, meta: tuple[Any, ...], body: Any, bufs: list[Any]) -> None:
        actor, method, raddr, rport, index = meta[:5]  # the first ActorMeta fields
        # system methods get the sender's reply address so they can stream or defer answers
        try:
            args, kwargs = loads(body, bufs)
            fn = getattr(obj, "sys_" + method, None)
            if fn is None:
                raise AttributeError(f"system actor {actor!r} has no method {method!r}")
            res = fn(*args, **kwargs, _reply=(raddr, rport, index)) if getattr(fn, "wants_reply", False) else fn(*args, **kwargs)
        except Exception as e:
            self._system_error(raddr, rport, index, e)
            return
        if asyncio.iscoroutine(res):
            self._spawn(self._finish_system(res, raddr, rport, index))
        elif raddr and res is not NO_REPLY:
            self.sender.send_port(raddr, rport, index, wire.OK, res)

    async def _finish_system(self, coro: Coroutine[Any, Any, Any], raddr: str, rport: int, index: int) -> None:
        try:
            res = await coro
        except Exception as e:
            self._system_error(raddr, rport, index, e)
            return
        if raddr and res is not NO_REPLY:
            self.sender.send_port(raddr, rport, index, wire.OK, res)

    def _system_error(self, raddr: str, rport: int, index: int, e: Exception) -> None:
        if isinstance(e, (ActorError, SupervisionError)):
            err: Exception = e
        else:
            err = ActorError(_safe_exc(e), format_exception(e), host=self.hostname)
        if raddr:
            self.sender.send_port(raddr, rport, index, wire.ERROR, err)
        else:
            logger.warning("system call failed: %s", e)
