"""Sending: what this process's messages look like on the wire, and which way they go.

:class:`Sender` encodes messages (large buffers to a peer of this host through shared
memory), refuses to send to a peer supervision has declared dead, and numbers every message
for a proc on an ordered stream of its own (one per destination), so the receiver delivers
them in the order they were sent although direct messages and relayed ones take different
paths. A message for many procs (:meth:`Sender.send_many`) goes to each host's allocator
once, as a FANOUT frame that the allocator turns into one message per proc. The bytes leave
through the transport's ``send``, handed in as a callable.
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from .._wire import frames as wire
from .._wire.serialize import dumps, dumps_leaf, nbytes
from ..config import Config
from ..errors import ActorError, SupervisionError, format_exception, raised_again, safe_str
from . import shm as _shm

logger = logging.getLogger(__name__)

#: when a lost reply to each address was last said (:func:`say_unsent`)
_unsent_said: dict[str, float] = {}


def say_unsent(addr: str) -> bool:
    """Whether a reply lost on its way to ``addr`` is to be logged now: once in 30 s per
    address, as a caller that cannot be reached would otherwise get a line a call in the
    rank's output (which streams to the notebook)."""
    now = time.monotonic()
    if now - _unsent_said.get(addr, -60.0) <= 30:
        return False
    if len(_unsent_said) > 1024:
        _unsent_said.clear()
    _unsent_said[addr] = now
    return True


class Target(NamedTuple):
    """One destination of :meth:`Sender.send_many`."""

    addr: str
    #: the allocator that owns the proc ("" for a process no allocator owns: sent direct)
    alloc: str
    #: the receiver's index in the call (its reply carries it back)
    call_index: int
    #: where the proc sends its reply ("" for none)
    reply: str


class Sender:
    """Encodes and sends this process's messages; thread-safe."""

    def __init__(
        self,
        cfg: Config,
        send_frames: Callable[..., Any],
        dead: Mapping[str, SupervisionError],
        *,
        uid: str,
        hostname: str,
        direct_conns: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._send_frames = send_frames
        #: this thread's direct connections (``Transport.direct_conns``), or None
        self._direct_conns = direct_conns
        #: peers known to be gone (supervision's, read here): sending to one raises its error
        self._dead = dead
        self.uid = uid
        self.hostname = hostname
        self._call_ids = itertools.count(1)
        self._stream_ids = itertools.count(1)
        #: sending side of ordered streams: destination -> (stream id, message numbers)
        self._seqs: dict[str, tuple[str, Iterator[int]]] = {}
        self.shm = _shm.ShmSender() if cfg.shm_min_bytes > 0 and _shm.available() else None

    def next_call_id(self) -> str:
        return f"{self.uid}.{next(self._call_ids)}"

    def send(self, addr: str, frames: list[Any]) -> None:
        """Send ``frames`` to ``addr``, or raise the peer's error if it is known to be gone."""
        dead = self._dead.get(addr)
        if dead is not None:
            raise raised_again(dead)
        self._send_frames(addr, frames)

    def send_port(
        self,
        addr: str,
        port: int,
        index: int,
        status: int,
        value: Any,
        actor: str = "",
        method: str = "",
        *,
        strict: bool = False,
    ) -> None:
        """Send ``value`` to a port; an unpicklable or oversized value becomes an error the receiver
        sees (for the reply to a call of ``actor.method``, headed with Monarch's words for it).
        ``strict``: raise the pickling error to the sender instead (a user's ``Port.send``)."""
        bufs: list[Any]
        leaf = dumps_leaf(value)
        if leaf is not None and len(leaf) <= self.cfg.max_message_bytes:
            # a reply's commonest value (an int, None, a short str), without dumps' checks
            body, bufs = leaf, []
        else:
            why = ""
            try:
                body, bufs = dumps(value)
            except Exception as e:
                if strict:
                    raise
                why, tb = f"the value could not be pickled to send back: {type(e).__name__}: {safe_str(e)}", format_exception(e)
            else:
                if nbytes(body, bufs) > self.cfg.max_message_bytes:
                    # the receiver would drop it, and its caller wait forever
                    why, tb = f"the value is too large to send back: {self._too_large(body, bufs)}", ""
            if why:
                status = wire.ERROR
                message = f"Actor call {actor}.{method} failed.\n{why}" if method else ""
                body, bufs = dumps(ActorError(TypeError(why), tb, host=self.hostname, message=message))
        meta = (port, index, status)  # a PortMeta
        try:
            if not bufs and len(body) <= wire.INLINE_MAX:  # a reply's commonest form: one small frame
                self.send(addr, [wire.encode_one(wire.PORT, meta, body)])
            else:
                self.send(addr, self.encode(addr, wire.PORT, meta, body, bufs))
        except SupervisionError:
            logger.debug("reply to dead peer %s dropped", addr)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # no descriptor left to reach the caller: its reply is lost (the caller's own
            # connection warns it that this process does not accept), but the actor that
            # answered lives on for the callers it still reaches, instead of its thread dying
            if say_unsent(addr):
                what = f"the reply of {actor}.{method}" if method else "a reply"
                logger.warning("%s to %s was not sent (nor any other until a descriptor is free): %s", what, addr, e)

    def send_actor(
        self,
        addr: str,
        actor: str,
        method: str,
        body: bytes,
        buffers: list[Any],
        *,
        reply: tuple[str, int] | None = None,
        index: int = 0,
        extent: tuple[tuple[str, ...], tuple[int, ...]] = ((), ()),
        call_id: str = "",
    ) -> None:
        """Send one unordered message (system requests); see :meth:`send_many` for actors."""
        raddr, rport = reply if reply else ("", 0)
        meta = (actor, method, raddr, rport, index, extent, call_id, "", 0)  # an ActorMeta, unordered
        self.send(addr, self.encode(addr, wire.ACTOR, meta, body, buffers))

    def _stream(self, addr: str) -> tuple[str, Iterator[int]]:
        """This process's ordered stream to ``addr``: its id and its message numbers.

        One stream per destination for all threads: a message numbered after another (in one
        thread, or after a join or a lock) is delivered after it. ``next()`` on the counter is
        atomic, so threads need no lock; one whose number goes unsent (the peer is gone, the
        only way a send fails) leaves a gap that only that dead peer would have waited on.
        """
        st = self._seqs.get(addr)
        if st is None:
            st = self._seqs.setdefault(addr, (f"{self.uid}.{next(self._stream_ids)}", itertools.count(1)))
        return st

    def send_many(
        self,
        targets: Sequence[tuple[str, str, int, str]],
        actor: str,
        method: str,
        body: bytes,
        buffers: list[Any],
        *,
        port: int = 0,
        extent: tuple[tuple[str, ...], tuple[int, ...]] = ((), ()),
        call_id: str = "",
    ) -> list[tuple[int, BaseException]]:
        """Send one message to every target, in order with this thread's other messages to each.

        Targets that share another host's allocator get one FANOUT frame to it (``fanout_min``
        or more of them), so a broadcast costs one send per host; the rest go direct. Returns the
        ``(index, error)`` of targets it could not send to; the others are on their way.
        """
        groups: dict[str, list[Target]] = {}
        direct: Sequence[tuple[str, str, int, str]] = []
        fmin = self.cfg.fanout_min
        if fmin > 0 and len(targets) >= fmin:
            # this host's procs are cheaper to reach straight (the direct path from this thread,
            # shared memory for bulk data) than through a relay; other hosts' through theirs
            local = self.cfg.fanout_local and not (
                self.shm is not None and any(memoryview(b).nbytes >= self.cfg.shm_min_bytes for b in buffers)
            )
            near: list[tuple[str, str, int, str]] = []
            for t in targets:
                t = Target(*t)
                if t.alloc and (local or not t.alloc.startswith("ipc://")):
                    groups.setdefault(t.alloc, []).append(t)
                else:
                    near.append(t)
            for alloc in [a for a, g in groups.items() if len(g) < fmin]:
                near.extend(groups.pop(alloc))
            direct = near
        else:
            direct = targets
        failed: list[tuple[int, BaseException]] = []
        shared: dict[int, Any] | None = {} if len(direct) > 1 and buffers else None
        # per target, what send(), encode() and the transport would do, without their calls and
        # checks (a call to many actors pays these per rank)
        dead, send_frames, seqs_of, encode_one = self._dead, self._send_frames, self._seqs, wire.encode_one
        small = not buffers and len(body) <= wire.INLINE_MAX
        # a small message to a peer this thread already writes to directly goes straight to that
        # connection: one frame, one write
        conns = self._direct_conns() if small and self._direct_conns is not None else None
        for addr, _, index, reply in direct:
            st = seqs_of.get(addr) or self._stream(addr)
            # an ActorMeta (see frames.py): plain tuples are cheaper to pickle
            meta = (actor, method, reply, port if reply else 0, index, extent, call_id, st[0], next(st[1]))
            gone = dead.get(addr)
            if gone is not None:
                failed.append((index, gone))  # not raised: it stays one error, however many sends it fails
                continue
            try:
                if conns is not None and (conn := conns.get(addr)) is not None:
                    try:
                        conn.send_one(encode_one(wire.ACTOR, meta, body))
                    except OSError as e:
                        # as Transport.send: the peer went away and the message with it (supervision
                        # reports the peer); this thread's later messages to it take zmq
                        logger.debug("direct send to %s failed (%s); dropped", addr, e)
                        conns[addr] = None
                elif small:
                    send_frames(addr, [encode_one(wire.ACTOR, meta, body)])
                else:
                    send_frames(addr, self.encode(addr, wire.ACTOR, meta, body, buffers, shared))
            except BaseException as e:
                failed.append((index, e))
        if shared:
            self.unshare(shared)
        for alloc, group in groups.items():
            dests = []
            for t in group:
                sid, seqs = self._stream(t.addr)
                dests.append((t.addr, t.call_index, t.reply, sid, next(seqs)))  # a FanoutTarget
            fmeta = (actor, method, port, extent, call_id, tuple(dests))  # a FanoutMeta
            try:
                self.send(alloc, self.encode(alloc, wire.FANOUT, fmeta, body, buffers))
            except BaseException as e:
                failed.extend((t.call_index, e) for t in group)
        return failed

    def encode(
        self, addr: str, kind: int, meta: tuple[Any, ...], body: Any, bufs: list[Any], shared: dict[int, Any] | None = None
    ) -> list[Any]:
        """The frames of a message for ``addr``. ``shared``: one message to several peers of this
        host (a dict this method fills, then :meth:`unshare`): each buffer is written to shared
        memory once, each peer gets a link to it."""
        table = None
        if bufs and self.shm is not None and addr.startswith("ipc://"):
            # a peer on this host maps large buffers instead of reading them off a socket
            lim = self.cfg.shm_min_bytes
            for i, b in enumerate(bufs):
                if memoryview(b).nbytes >= lim:
                    try:
                        if shared is None:
                            # one receiver: it gives the segment back when done with it; a
                            # reply that is the bytes its caller sent over shared memory goes
                            # back by name
                            ref = _shm.returnable(b, addr) if kind == wire.PORT else None
                            entry = (i, *(ref or self.shm.put(b, pooled=True)))
                        else:
                            src = shared.get(i)
                            if src is None:
                                shared[i] = ("", 0)  # stays so if it fails: the others take the socket at once
                                src = shared[i] = self.shm.put(b)
                            if not src[0]:
                                continue
                            entry = (i, self.shm.link(src[0]), src[1])
                    except OSError as e:
                        # /dev/shm full or unusable: this buffer takes the socket instead
                        logger.debug("shared memory unavailable (%s); sending %d bytes over the socket", e, memoryview(b).nbytes)
                        continue
                    if table is None:
                        table, bufs = [], list(bufs)
                    table.append(entry)
                    bufs[i] = b""
        return wire.encode(kind, meta, body, bufs, table)

    def unshare(self, shared: dict[int, Any] | None) -> None:
        """Drop this process's names of the segments :meth:`encode` shared (each peer has its link)."""
        if shared and self.shm is not None:
            for name, _ in shared.values():
                if name:
                    self.shm.unlink(name)

    def check_size(self, body: bytes, buffers: list[Any]) -> None:
        if nbytes(body, buffers) > self.cfg.max_message_bytes:
            raise ValueError(self._too_large(body, buffers))

    def _too_large(self, body: bytes, buffers: list[Any]) -> str:
        return (
            f"message of {nbytes(body, buffers)} bytes exceeds max_message_bytes={self.cfg.max_message_bytes}; "
            "send a handle to the data instead, or raise MONARCH_NB_MAX_MESSAGE_BYTES"
        )

    def sweep_shm(self) -> None:
        """Reclaim shared memory that receivers have given back, and unmap peers' segments
        that their senders gave up."""
        if self.shm is not None:
            self.shm.sweep()
        _shm.sweep_mapped()

    def release_shm(self) -> None:
        """Give back the shared memory this process keeps for sending (it is made again on use)
        and unmap the peers' segments it keeps mapped and is not using."""
        if self.shm is not None:
            self.shm.close()
        _shm.sweep_mapped(-1.0)
