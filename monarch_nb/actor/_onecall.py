"""``call_one``'s own path, for its commonest case: a small call to an actor of this host over
a connection the calling thread already writes to.

A call made after a pause (the first of a cell, the first after other work) costs several
times a warm one, in proportion to what it touches (docs/performance.md, "The cold call").
The general path (:func:`._endpoint.gather` and :func:`._endpoint.multicast`) serves calls to
any number of ranks on any host: a port with its supervision record, four closures, a lock,
lists of targets. Here one slotted object is the reply's port handler and supervision's
waiter, and the message is framed and written in place. The rules are the general path's:
ordered on the same stream, failed by the proc's death, the call's output waited for, its
errors grouped as any call's. Anything else (no connection yet, a large or out-of-band
argument, a TCP inbox, a peer not watched yet or dead) takes the general path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._wire.frames import ACTOR, ERROR, INLINE_MAX, PRINTED, encode_one
from .._wire.serialize import dumps_call
from . import _context
from . import _endpoint as _ep  # its attributes read at call time: it imports this module
from ._future import _RAW, Future

if TYPE_CHECKING:
    from .._runtime.runtime import Runtime
    from ._endpoint import Endpoint


class _Reply:
    """The reply of one call: the port's handler and supervision's waiter."""

    __slots__ = ("fut", "rt", "ep", "addr", "port")
    port: int

    def __init__(self, fut: Future[Any], rt: Runtime, ep: Endpoint[Any], addr: str) -> None:
        self.fut, self.rt, self.ep, self.addr = fut, rt, ep, addr

    def _close(self) -> None:
        # what ReplyPort.close does
        self.rt.close_port(self.port)
        self.rt.supervision.unwait(self.port)

    def on_reply(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        self._close()
        fut = self.fut
        fut._progress[0][0] = 0  # type: ignore[index]
        if status != ERROR and status != PRINTED:  # OK, or ITEM: a Port's value (an explicit response port)
            fut._finish(_RAW, (body, bufs), _ep._decode_one)
        elif status == PRINTED:
            _ep._set_raw_after_output(fut, [(body, bufs)], _ep._decode_first, self.ep, fut._call or "", [0])
        else:
            # an error, grouped as a call to many ranks' is (its rank named, and what it printed
            # shown before it)
            failure: tuple[Any, ...] = ({0: (body, bufs)}, [], 1, self.ep)
            _ep._set_raw_after_output(fut, failure, _ep._raise_grouped, self.ep, fut._call or "", [], [0])

    def peer_failed(self, peer: str, err: BaseException) -> None:
        if peer != self.addr:
            return
        self._close()
        ep = self.ep
        # a dead proc, in the words of the endpoint's actor (as Monarch's)
        self.fut._set_exception(ep._mesh._dead_proc_error(ep._name, 0, err))


def call_one(
    ep: Endpoint[Any], rt: Runtime, proc: Any, args: tuple[Any, ...], kwargs: dict[str, Any], what: str
) -> Future[Any] | None:
    """``ep.call_one(*args, **kwargs)`` to ``proc`` (the mesh's one proc) on this path, or None:
    the general path's case (nothing sent)."""
    mesh = ep._mesh
    if mesh._refused is not None or mesh._closed():
        return None  # Monarch fails these when the future is read: the general path's way
    sender = rt.sender
    addr = proc.addr
    direct = sender._direct_conns
    conns = direct() if direct is not None else None
    conn = conns.get(addr) if conns is not None else None
    tr = rt.transport
    sup = rt.supervision
    if (
        conn is None
        or tr.tcp_addr  # our address in the arguments depends on the peer (_context.addresses_vary)
        or tr.sockets.routes
        or addr in sup.dead
        or (proc.alloc and addr not in sup.watched)
    ):
        return None
    ep._check(args, kwargs)
    body, bufs = dumps_call(args, kwargs)
    if bufs or len(body) > INLINE_MAX or len(body) > rt.cfg.max_message_bytes:
        return ep._gather(args, kwargs, None, what, _ep._decode_first, pickled=(body, bufs))
    call_id = sender.next_call_id()
    client = _context._client
    if client is not None and client.on_call is not None:
        client.on_call(call_id, [(proc.mesh, proc.rank)])
    fut: Future[Any] = Future._create(what)
    fut._progress = ([1], 1)
    fut._call = call_id
    reply = _Reply(fut, rt, ep, addr)
    port = reply.port = fut._port = rt.receiver.open_port(reply.on_reply)
    sup.wait(port, reply.peer_failed)
    st = sender._seqs.get(addr) or sender._stream(addr)
    view = mesh._view
    # an ActorMeta (see frames.py)
    meta = (mesh._name, ep._name, tr.ipc_addr, port, 0, (view.labels, view.sizes), call_id, st[0], next(st[1]))
    try:
        conn.send_one(encode_one(ACTOR, meta, body))
    except OSError:
        # as Sender.send_many: the peer went away and the message with it; supervision reports
        # the peer (which fails this call), and this thread's later messages to it take zmq
        conns[addr] = None  # type: ignore[index]
    dead = sup.dead.get(addr)
    if dead is not None:  # it died while we sent: supervision may have told the waiters before ours
        reply.peer_failed(addr, dead)
    return fut
