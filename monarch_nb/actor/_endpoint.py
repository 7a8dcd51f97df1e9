"""Endpoints and their adverbs: ``call``, ``call_one``, ``choose``, ``stream``, ``broadcast``."""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from .._runtime.runtime import ReplyPort
from .._wire import frames as wire
from .._wire.serialize import dumps_call, loads
from ..errors import ActorError, MeshClosedError, NotAnEndpointError, SupervisionError
from . import _context, _onecall, _replyread
from ._future import Future

if TYPE_CHECKING:
    from .._runtime.runtime import Runtime
    from ._mesh import ActorMesh, ValueMesh
    from ._port import Port
    from ._refs import ProcRef

R = TypeVar("R")
A = TypeVar("A")

ERROR, PRINTED = wire.ERROR, wire.PRINTED


class EndpointProperty(Generic[R]):
    """What ``@endpoint`` leaves on the class: the function plus how it is called."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        propagate: Any = None,
        explicit_response_port: bool = False,
        instrument: bool = True,
        concurrent: bool = False,
    ) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.propagate = propagate
        self.explicit_response_port = explicit_response_port
        self.instrument = instrument
        self.concurrent = concurrent
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = inspect.signature(fn)
        self.positional = _positional_range(self.signature, 2 if explicit_response_port else 1)
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        # inside the actor, self.method(...) is a plain local call
        return self.fn.__get__(obj, objtype)


def endpoint(
    method: Callable[..., Any] | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Mark an actor method as callable on a mesh (``@endpoint`` or ``@endpoint(...)``)."""

    def deco(fn: Callable[..., Any]) -> EndpointProperty[Any]:
        if isinstance(fn, EndpointProperty):
            # Monarch takes it and fails each call with a TypeError; here it fails where it is written
            raise ValueError(f"{fn.name} is already an endpoint: decorate it with @endpoint once")
        if not callable(fn):
            raise TypeError(f"@endpoint decorates a method, got {fn!r}")
        return EndpointProperty(fn, propagate=propagate, explicit_response_port=explicit_response_port, instrument=instrument)

    return deco(method) if method is not None else deco


def concurrent_endpoint(
    method: Callable[..., Any] | None = None,
    *,
    propagate: Any = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """An ``async def`` endpoint whose calls may overlap at their awaits (start order kept)."""

    def deco(fn: Callable[..., Any]) -> EndpointProperty[Any]:
        if isinstance(fn, EndpointProperty):
            raise ValueError("concurrent_endpoint cannot be stacked on @endpoint; use one of them")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"concurrent_endpoint needs an async def, {fn.__qualname__} is a def")
        return EndpointProperty(
            fn, propagate=propagate, explicit_response_port=explicit_response_port, instrument=instrument, concurrent=True
        )

    return deco(method) if method is not None else deco


class _NotAnEndpointMethod:
    """``mesh.plain`` for a method without @endpoint: only ``as_endpoint`` accepts it."""

    def __init__(self, mesh: ActorMesh[Any], name: str, fn: Callable[..., Any]) -> None:
        self.mesh = mesh
        self.name = name
        self.fn = fn

    def _message(self) -> str:
        return (
            f"Actor {self.mesh._class}.{self.name} is not annotated as an endpoint. To call it as one, add a "
            f"@endpoint decorator to it, or directly wrap it in one as_endpoint(obj.method).call(...)"
        )

    def __call__(self, *_: Any, **__: Any) -> Any:
        raise RuntimeError(self._message())

    def __getattr__(self, name: str) -> Any:
        # Monarch's NotAnEndpoint has no adverbs: `mesh.plain.call()` is an AttributeError there
        # (a program may catch that); ours carries the explanation
        if name in _ADVERBS:
            raise NotAnEndpointError(f"{name!r}: {self._message()}")
        raise AttributeError(name)


_ADVERBS = frozenset({"call", "call_one", "choose", "stream", "broadcast", "rref"})


_PLAIN_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional_range(sig: inspect.Signature, lead: int) -> tuple[int, int] | None:
    """(required, allowed) positional counts after ``lead`` (self, port) when every parameter
    is a plain positional one; None when only ``Signature.bind`` can tell."""
    params = list(sig.parameters.values())
    if len(params) < lead or any(p.kind not in _PLAIN_KINDS for p in params):
        return None
    params = params[lead:]
    return sum(p.default is inspect.Parameter.empty for p in params), len(params)


class Endpoint(Generic[R]):
    """An endpoint of an actor mesh; its adverbs say how a message is delivered."""

    def __init__(self, mesh: ActorMesh[Any], name: str, prop: EndpointProperty[R]) -> None:
        self._mesh = mesh
        self._name = name
        self._prop = prop
        self._whats: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._label}.{self._name} over {self._mesh.extent}>"

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rng = self._prop.positional
        if rng is not None and not kwargs and rng[0] <= len(args) <= rng[1]:
            return  # positional arguments that fit a plain signature: nothing for bind() to find
        lead = (None, None) if self._prop.explicit_response_port else (None,)
        try:
            self._prop.signature.bind(*lead, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._mesh._class.__qualname__}.{self._name}{self._prop.signature}: {e}") from None

    def _send(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        port: ReplyPort | tuple[str, int] | None,
        on_fail: Callable[[int, BaseException], None] | None,
        ranks: list[int] | None = None,
        checked: bool = False,
        call_id: str = "",
        pickled: tuple[bytes, list[Any]] | None = None,
    ) -> int:
        """Send to every actor of the mesh (or ``ranks``, indices into its view); return how many.
        Replies go to ``port`` (see :func:`multicast`). ``checked``: the caller found the mesh
        open and not refused just now. ``call_id``: the call's id, if the caller made it.
        ``pickled``: the arguments' ``dumps_call``, if the caller made it (never where our
        address in them depends on the peer)."""
        self._check(args, kwargs)
        mesh = self._mesh
        if not checked:
            if (refused := mesh._refusal()) is not None:
                raise refused
            if mesh._closed():
                raise MeshClosedError(f"actor mesh {mesh._label!r} was stopped; spawn it again")
        rt = _context.runtime()
        view = mesh._view
        procs = mesh._procs
        idx = range(len(view.ranks)) if ranks is None else ranks
        if pickled is not None:
            body, bufs = pickled
        elif _context.addresses_vary(rt) and len(idx) and (args or kwargs):
            # a Port of ours in the arguments, as these procs reach us: at the unix socket (this
            # host), the TCP inbox, or a gateway's reply address (hosts behind one); a mesh's
            # procs are all on this host or all reached over TCP, so its first proc decides
            with _context.pickling_for(rt, procs[view.ranks[idx[0]]].addr):
                body, bufs = dumps_call(args, kwargs)
        else:
            body, bufs = dumps_call(args, kwargs)
        rt.check_size(body, bufs)
        call_id = call_id or rt.next_call_id()
        client = _context._client
        if client is not None and client.on_call is not None:
            client.on_call(call_id, [(procs[view.ranks[i]].mesh, procs[view.ranks[i]].rank) for i in idx])
        multicast(
            rt, [procs[view.ranks[i]] for i in idx], idx, mesh._name, self._name, body, bufs, port, on_fail,
            (view.labels, view.sizes), call_id,
        )  # fmt: skip
        return len(idx)

    def _gather(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ranks: list[int] | None,
        what: str,
        decode: Callable[[list[Any]], Any] | None = None,
        order: list[int] | None = None,
        pickled: tuple[bytes, list[Any]] | None = None,
    ) -> Future[Any]:
        """Send and collect raw replies (see :func:`gather`), decoded by ``decode`` on first
        read; ``order`` receives the indices in arrival order (Accumulator folds in that order,
        as Monarch's does); ``pickled``: the arguments' ``dumps_call``, made already."""
        mesh = self._mesh
        if mesh._closed() or mesh._refused is not None:
            self._check(args, kwargs)
            # Monarch's calls to a stopped mesh (or one its procs refused) fail when their future
            # is read, not when sent
            return Future._failed(mesh._refusal() or mesh._stopped_error(self._name), what)
        slots = len(mesh._view.ranks)
        rt = _context.runtime()
        # made here, not in _send: a reply that says the call printed waits for its end by this id
        call_id = rt.next_call_id()
        return gather(
            rt,
            slots,
            slots if ranks is None else len(ranks),
            what,
            decode or _decode_all,
            lambda port, on_fail: self._send(args, kwargs, port, on_fail, ranks, True, call_id, pickled),
            order=order,
            endpoint=self,  # named only if the call fails: nothing to format on every call
            call_id=call_id,
        )

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Call every actor; the future holds a ValueMesh of their results."""
        from ._mesh import ValueMesh

        view = self._mesh._view
        return self._gather(
            args,
            kwargs,
            None,
            self._what("call"),
            lambda raws: ValueMesh._from_view(view, _decode_all(raws)),
        )

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call the single actor of a one-actor mesh; ValueError for any other size."""
        mesh = self._mesh
        n = len(mesh._view.ranks)
        if n != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {n}")
        proc = mesh._procs[mesh._view.ranks[0]]
        # its reply may be read by the thread that waits for it (_replyread)
        peer = (proc.addr, mesh._name)
        rt = _context._runtime
        fut: Future[R] = _replyread.send(peer, rt, self._call_one, rt, proc, args, kwargs)
        fut._peer = peer
        return fut

    def _call_one(self, rt: Runtime | None, proc: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        what = self._what("call_one")
        if rt is not None:
            fut = _onecall.call_one(self, rt, proc, args, kwargs, what)
            if fut is not None:
                return fut
        return self._gather(args, kwargs, None, what, _decode_first)

    def _what(self, adverb: str) -> str:
        """``"label.method.adverb()"``, what a call's future is of (made once per adverb)."""
        whats = self._whats
        w = whats.get(adverb)
        if w is None:
            w = whats[adverb] = f"{self._mesh._label}.{self._name}.{adverb}()"
        return w

    def call_ranks(self, ranks: Iterable[int] | None, *args: Any, **kwargs: Any) -> Future[list[R]]:
        """Call the actors at ``ranks`` (indices into this mesh's flattened ranks; all of them when
        None); the future holds their results in that order, and its ``progress()`` counts replies."""
        n = len(self._mesh._view.ranks)
        idx = list(range(n)) if ranks is None else list(ranks)
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise ValueError(f"ranks {bad} are out of range for actor mesh {self._mesh._label!r} of {n} actors")
        if not idx:
            # no actor to hear from: nothing to wait for (a gather of none would never finish)
            return Future._completed([])
        return self._gather(
            args,
            kwargs,
            None if ranks is None else idx,
            f"{self._mesh._label}.{self._name}.call_ranks()",
            lambda raws: [loads(*raws[i]) for i in idx],
        )

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call one actor, chosen to spread load: the one with the fewest of this process's
        ``choose`` calls still running, taking turns among equals. Once an actor of the mesh is
        known to have failed, every call goes to it and fails with its error, as in Monarch
        (a slice without it still chooses among the rest)."""
        i = self._mesh._known_failed()
        if i is None:
            i = _least_loaded(self._mesh)
        fut = self._gather(args, kwargs, [i], f"{self._mesh._label}.{self._name}.choose()", lambda raws: loads(*raws[i]))
        _track_load(self._mesh, i, fut)
        return fut

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[R]]:
        """Call every actor; yield a future per reply, in arrival order.

        As Monarch's, the iterator never blocks: the k-th future it yields is pending until the
        k-th reply arrives, so ``get(timeout=...)`` on it bounds the wait for a rank that hangs."""
        n = len(self._mesh._view.ranks)
        what = f"{self._what('stream')} item"
        slots: list[Future[R]] = [Future._create(what) for _ in range(n)]
        # the I/O thread's replies and the sending thread's failures (a dead proc) both take the
        # next slot: next() on a count is atomic, so no two take the same one
        taken = itertools.count()
        replies: ReplyPort | None = None

        def next_slot() -> Future[R]:
            k = next(taken)
            if k == n - 1 and replies is not None:
                replies.close()
            # (a rank answered twice, which nothing should do: its extra answer goes nowhere)
            return slots[k] if k < n else Future._create(what)

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            assert replies is not None
            replies.answered(index)
            f = next_slot()
            raw, decode = (body, bufs), _raise_remote if status == ERROR else _decode_one
            # in a script, what the actor printed is shown before its item is read (gather's rule)
            if status == wire.OK:
                f._set_raw(raw, decode)
            else:
                printed, failed = ([index], []) if status == PRINTED else ([], [index])
                if not _after_output(self, printed, lambda: f._set_raw(raw, decode), call_id, failed):
                    f._set_raw(raw, decode)

        def on_fail(index: int, err: BaseException) -> None:
            next_slot()._set_exception(self._mesh._dead_proc_error(self._name, index, err))

        if self._mesh._closed() or self._mesh._refused is not None:
            # as for call(): the items fail when read
            for i in range(n):
                on_fail(i, self._mesh._refusal() or self._mesh._stopped_error(self._name))
            return iter(slots)
        rt = _context.runtime()
        call_id = rt.next_call_id()
        replies = ReplyPort(rt, on_reply, on_fail)
        self._send(args, kwargs, replies, on_fail, call_id=call_id)
        return iter(slots)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting for (or receiving) results."""
        self._send(args, kwargs, None, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a TypeError, as in Monarch (whose endpoints are simply not callable)
        raise TypeError(
            f"call an endpoint through an adverb: {self._name}.call(...), .call_one(...), .choose(...), .stream(...) or .broadcast(...)"
        )


class RemoteFailure:
    """A failed slot of a :func:`gather` with ``keep_errors``: a remote error or a local one."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def error(self) -> BaseException:
        return self.value if isinstance(self.value, BaseException) else loads(*self.value)


def multicast(
    rt: Runtime,
    procs: list[ProcRef],
    idx: Iterable[int],
    actor: str,
    method: str,
    body: bytes,
    bufs: list[Any],
    port: ReplyPort | tuple[str, int] | None,
    on_fail: Callable[[int, BaseException], None] | None,
    extent: Any,
    call_id: str = "",
) -> None:
    """Send one pickled message to ``procs`` (``idx`` their indices in the call), in order with
    this thread's earlier messages to each. Replies go to ``port``: a :class:`ReplyPort` of
    ours, each proc owing it the reply of its index (the port's ``on_fail(index, error)`` if it
    dies or the send fails; ``on_fail`` here must be the port's own or None), or an
    ``(addr, port)`` anyone opened ("" = our own address; its owner supervises what it is
    owed), or nowhere (None). Without a failure callback a failed send raises."""
    replies = port if isinstance(port, ReplyPort) else None
    if on_fail is not None and (replies is None or replies.on_fail is not on_fail):
        raise ValueError("multicast: on_fail must be the ReplyPort's own failure callback")
    targets: list[tuple[str, str, int, str]] = []
    append = targets.append
    # our address as the call's ipc and tcp peers see it, asked once per call
    via_ipc = via_tcp = ""
    # read now: a failure noted below may complete the call and close the port
    fails_there = replies is not None and replies.on_fail is not None
    if replies is not None:
        # one supervision record for the call (the port's), not one per target
        replies.owe_procs(idx, procs)
        port_id = replies.port
        for i, p in zip(idx, procs):
            addr = p.addr
            if addr.startswith("tcp://"):
                append((addr, p.alloc, i, via_tcp or (via_tcp := rt.addr_for(addr))))
            else:
                append((addr, p.alloc, i, via_ipc or (via_ipc := rt.addr_for(addr))))
    elif isinstance(port, tuple):
        raddr, port_id = port
        for i, p in zip(idx, procs):
            addr = p.addr
            if p.alloc:
                rt.watch(p.alloc, addr, p.mesh, p.rank, p.host)
            if raddr:
                append((addr, p.alloc, i, raddr))
            elif addr.startswith("tcp://"):
                append((addr, p.alloc, i, via_tcp or (via_tcp := rt.addr_for(addr))))
            else:
                append((addr, p.alloc, i, via_ipc or (via_ipc := rt.addr_for(addr))))
    else:
        port_id = 0
        for i, p in zip(idx, procs):
            append((p.addr, p.alloc, i, ""))
    failed = rt.send_many(targets, actor, method, body, bufs, port=port_id, extent=extent, call_id=call_id)
    addr_of = {t[2]: t[0] for t in targets} if failed and replies is None else {}
    for i, e in failed:
        if not fails_there:
            if i in addr_of and e is rt.supervision.peer_error(addr_of[i]):
                # a broadcast (or send() to a port) reaching a proc supervision already reported
                # dead: dropped there, as in Monarch; raising would say the send failed after
                # the live ranks took it
                continue
            raise e
        assert replies is not None
        replies.fail(i, e)  # once, unless its peer's failure (or the port's closing) came first


def gather(
    rt: Runtime,
    slots: int,
    n: int,
    what: str,
    decode: Callable[[list[Any]], Any],
    send: Callable[[ReplyPort, Callable[[int, BaseException], None]], Any],
    *,
    order: list[int] | None = None,
    keep_errors: bool = False,
    endpoint: Endpoint[Any] | str | None = None,
    call_id: str = "",
) -> Future[Any]:
    """Open a :class:`ReplyPort`, ``send(port, on_fail)`` to ``n`` procs (their indices below
    ``slots``; see :func:`multicast`), and collect the raw replies into a Future that
    ``decode`` turns into its value on first read (a list of ``slots``, by index).

    It completes once all ``n`` have answered, raising the lowest index's failure if any
    failed (as Monarch does, so a program sees the same error on every run); with
    ``keep_errors`` failures go to ``decode`` as :class:`RemoteFailure` slots instead. Fail
    fast all the same: once an endpoint has failed, the others get ``call_error_window``
    seconds to answer (ranks failing alike do, within milliseconds; others may be blocked
    for good, in a collective waiting for the failed rank, say), and a proc that is gone
    (``on_fail``: supervision, a failed send) fails the call at once. ``order``, if given,
    receives the indices in arrival order. ``endpoint`` (an Endpoint, or "actor.method") names
    the call in the error, which carries every rank's failure and the ranks still running
    (``ActorError._set_group``). ``call_id``: the id ``send`` gives the call (an Endpoint's),
    by which a script waits for what it printed.
    """
    fut: Future[Any] = Future._create(what)
    raw: list[Any] = [None] * slots
    errors: dict[int, Any] = {}
    left = [n]
    fut._progress = (left, n)
    # [the future completed, send() returned]: a proc known dead fails the call inside send(),
    # before the live ranks were even sent it (_with_running words their note by which)
    closed = [False, False]
    lock = threading.Lock()  # replies come on the I/O thread, a failed send on the caller's
    #: indices whose call printed (their reply's status PRINTED)
    printed: list[int] = []

    def complete(gone: BaseException | None = None) -> None:
        with lock:
            if closed[0]:
                return
            closed[0] = True
        replies.close()  # a failed send, or ranks not heard from, left expectations behind
        if gone is not None:
            if isinstance(endpoint, Endpoint) and n > 1:
                gone = _with_running(gone, raw, errors, n, left[0], sent=closed[1])
            raised = {i: r for i, r in errors.items() if not isinstance(r, BaseException)}
            if raised:
                # ranks that raised before the process died: their errors (unpickled when read,
                # not here on the I/O thread) are a note, as beside an actor that failed
                fut._set_raw((gone, raised, n), _raise_gone)
            else:
                fut._set_exception(gone)
        elif not errors:
            if printed:
                _set_raw_after_output(fut, raw, decode, endpoint, call_id, printed)
            else:
                fut._set_raw(raw, decode)
        elif isinstance(first := errors[min(errors)], BaseException):
            fut._set_exception(first)
        else:
            still = [i for i in range(n) if raw[i] is None and i not in errors] if n == len(raw) else left[0]
            failure = (dict(errors), still, n, endpoint)
            # what the failing ranks printed before they raised is shown before the error too
            _set_raw_after_output(fut, failure, _raise_grouped, endpoint, call_id, printed, list(errors))

    def arrive(index: int, value: Any, failed: bool, gone: bool = False) -> None:
        with lock:
            if closed[0] or raw[index] is not None or index in errors:
                return  # one answer per actor, none after completion
            if failed and not keep_errors:
                errors[index] = value
            else:
                raw[index] = RemoteFailure(value) if failed else value
            if order is not None:
                order.append(index)
            left[0] -= 1
            last = left[0] == 0
            first_error = failed and not keep_errors and len(errors) == 1
        if gone and not keep_errors:
            complete(value)
        elif last:
            complete()
        elif first_error:
            try:
                rt.loop.call_soon_threadsafe(rt.loop.call_later, rt.cfg.call_error_window, complete)  # type: ignore[arg-type]
            except RuntimeError:  # the runtime is closing
                complete()

    def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
        replies.answered(index)
        if status == ERROR:
            arrive(index, (body, bufs), True)
            return
        # arrive() for a value, inline: one of these per rank, on the I/O thread
        with lock:
            if closed[0] or raw[index] is not None or index in errors:
                return
            raw[index] = (body, bufs)
            if status == PRINTED:
                printed.append(index)
            if order is not None:
                order.append(index)
            left[0] -= 1
            if left[0]:
                return
        complete()

    def on_fail(index: int, err: BaseException) -> None:
        if isinstance(endpoint, Endpoint):
            # a dead proc, in the words of the endpoint's actor (as Monarch's)
            err = endpoint._mesh._dead_proc_error(endpoint._name, index, err)
        arrive(index, err, True, gone=True)

    replies = ReplyPort(rt, on_reply, on_fail)
    fut._port = replies.port
    # an endpoint call's id: a wait on the future finds that call's paused ranks (_debugwait.due)
    fut._call = call_id
    try:
        send(replies, on_fail)
    except BaseException:
        replies.close()
        raise
    closed[1] = True
    return fut


def _with_running(
    err: BaseException, raw: list[Any], errors: dict[int, Any], n: int, left: int, sent: bool = True
) -> BaseException:
    """A dead proc fails a call at once: ``err`` with a note of the ranks that had not answered
    then, as a call that raised names them. With a dead rank they may wait for it in a
    collective until its timeout. ``sent``: the call had gone out before the death was known;
    otherwise (a proc that died before the call) the call failed as it was sent, and the others
    get it after that, so they are not "still running" it, let alone waiting in a collective.
    A copy: the runtime's error for the proc is shared by calls."""
    import copy

    from .. import _errgroup

    still = [i for i in range(n) if raw[i] is None and i not in errors] if n == len(raw) else left
    if sent:
        line = _errgroup.running_line(still, n)
        note = f"{line} (waiting for the dead rank in a collective, perhaps: stopping the proc mesh ends them)"
    else:
        line = _errgroup.sent_after_line(still, n, sorted(errors))
        note = line
    if not line:
        return err
    try:
        e = copy.copy(err)
        e.__dict__.update(err.__dict__)
    except Exception:
        return err
    e.__notes__ = [*getattr(err, "__notes__", ()), note]
    return e


def _after_output(
    endpoint: Endpoint[Any] | str | None,
    printed: list[int],
    done: Callable[[], object],
    call_id: str,
    failed: list[int] | tuple[()] = (),
) -> bool:
    """(Call ``call_id``, whose actors at ``printed``, indices into its mesh's view, printed,
    and those at ``failed`` raised.) Have the client call ``done`` once their output is shown,
    if it must wait for it (a script: the text travels through the procs' allocators, the
    reply straight from the proc); False: call ``done`` now."""
    client = _context._client
    if client is None or not isinstance(endpoint, Endpoint):
        return False
    mesh = endpoint._mesh
    procs, ranks = mesh._procs, mesh._view.ranks
    n = len(ranks)
    return client.after_output(
        done,
        call_id,
        [procs[ranks[i]] for i in printed if i < n],
        # an error's reply does not say whether its call printed: ask those allocators
        {procs[ranks[i]].alloc for i in failed if i < n},
    )


def _set_raw_after_output(
    fut: Future[Any],
    raw: Any,
    decode: Callable[[Any], Any],
    endpoint: Endpoint[Any] | str | None,
    call_id: str,
    printed: list[int],
    failed: list[int] | tuple[()] = (),
) -> None:
    """Complete ``fut`` with ``raw`` once what the call's ranks at ``printed`` printed (and those
    at ``failed`` raised after) is shown (:func:`_after_output`), or now."""
    if not _after_output(endpoint, printed, lambda: fut._set_raw(raw, decode), call_id, failed):
        fut._set_raw(raw, decode)


def _decode_one(raw: Any) -> Any:
    return loads(*raw)


def _decode_first(raws: list[Any]) -> Any:
    return loads(*raws[0])


def _decode_all(raws: list[Any]) -> list[Any]:
    return [loads(*r) if r is not None else None for r in raws]


def _raise_remote(raw: Any) -> Any:
    raise loads(*raw)


def _raise_grouped(raw: Any) -> Any:
    """Raise the lowest rank's failure (as Monarch does), carrying every rank's for display."""
    errors, still, n, endpoint = raw
    first = min(errors)
    err = loads(*errors[first])
    if isinstance(endpoint, Endpoint):
        endpoint = f"{endpoint._mesh._label}.{endpoint._name}"
    loaded: dict[int, BaseException] = {first: err}
    for i, r in errors.items():
        if i != first and not isinstance(r, BaseException):
            try:
                loaded[i] = loads(*r)
            except Exception:
                continue
    failures = {i: e for i, e in loaded.items() if isinstance(e, ActorError)}
    failed = next((i for i in sorted(loaded) if isinstance(loaded[i], SupervisionError)), None)
    if failed is not None:
        # an actor that failed (a SystemExit in its script, an abort) fails the call, as in
        # Monarch, ahead of lower ranks that raised: most often because of it (gloo's
        # "Connection closed by peer" once its process group went away). Before, such a
        # rank's failure was dropped from the group and a survivor's error read as the cause
        raise _with_raised(loaded[failed], failures, n)
    if isinstance(err, ActorError) and endpoint:
        err._set_group(endpoint, n, failures, still)
        cause = failures[err._cause()]
        if cause is not err:
            # the rank whose script failed first, not a survivor that only saw its connection close
            err = cause._set_group(endpoint, n, failures, still)
    raise err


def _raise_gone(raw: Any) -> Any:
    """Raise a dead proc's error, with a note of what the ranks that had raised raised."""
    gone, raised, n = raw
    failures: dict[int, ActorError] = {}
    for i, r in raised.items():
        try:
            e = loads(*r)
        except Exception:
            continue
        if isinstance(e, ActorError):
            failures[i] = e
    raise _with_raised(gone, failures, n)


def _with_raised(err: BaseException, failures: dict[int, ActorError], n: int) -> BaseException:
    """``err`` (a rank's actor failure) with a note of what the ranks that raised in the same
    call raised, one line per kind: their errors are not the call's, yet say how it ended there.
    A copy: ``err`` may be the runtime's error for a dead proc, shared by calls and reads."""
    if not failures:
        return err
    import copy

    from .. import _errgroup

    try:
        copied = copy.copy(err)
        copied.__dict__.update(err.__dict__)
        copied.__notes__ = list(getattr(err, "__notes__", ()))
    except Exception:
        return err
    err = copied
    from ..errors import PEER_GONE_MARK, _peer_gone_words

    groups = _errgroup.group(e._failure_tuple(r) for r, e in failures.items())
    said = []
    unsure = False
    for g in groups:
        who, msg = f"{_errgroup.ranks_text(g.ranks)} ({len(g.ranks)} of {n}) raised {g.etype}", g.messages[g.ranks[0]]
        if all(getattr(failures[r].exception, PEER_GONE_MARK, False) for r in g.ranks):
            # SPMDActor's survivors: gloo's 400 characters (a path, a port, advice) said only
            # that this rank went away, which the error above says
            said.append(f"{who}: {_peer_gone_words(msg)} (waiting for it in a collective)")
        else:
            unsure = True
            said.append(f"{who}: {_errgroup.clip(msg)}" if msg else who)
    err.add_note("in the same call " + "; ".join(said) + (" (perhaps because of this failure)" if unsure else ""))
    return err


#: proc address -> ``choose`` calls this process has running there (under _load_lock: callers'
#: threads add, the I/O thread takes away)
_load: dict[str, int] = {}
_load_lock = threading.Lock()
_turn = itertools.count()


def _least_loaded(mesh: ActorMesh[Any]) -> int:
    view, procs = mesh._view, mesh._procs
    n = len(view.ranks)
    start = next(_turn) % n  # where the scan starts rotates, so ties take turns
    best, best_load = start, None
    for k in range(n):
        i = (start + k) % n
        load = _load.get(procs[view.ranks[i]].addr, 0)
        if best_load is None or load < best_load:
            best, best_load = i, load
            if load == 0:
                break
    return best


def _track_load(mesh: ActorMesh[Any], i: int, fut: Future[Any]) -> None:
    addr = mesh._procs[mesh._view.ranks[i]].addr
    with _load_lock:
        _load[addr] = _load.get(addr, 0) + 1

    def done(_: Future[Any]) -> None:
        with _load_lock:
            left = _load.get(addr, 1) - 1
            if left > 0:
                _load[addr] = left
            else:
                _load.pop(addr, None)

    fut.add_done_callback(done)


def as_endpoint(not_an_endpoint: Any, *, propagate: Any = None, explicit_response_port: bool = False) -> Endpoint[Any]:
    """Call a method that lacks ``@endpoint`` as if it had one: ``as_endpoint(mesh.method).call()``."""
    if isinstance(not_an_endpoint, Endpoint):
        return not_an_endpoint
    if not isinstance(not_an_endpoint, _NotAnEndpointMethod):
        raise ValueError("expected an method of a spawned actor")
    prop: EndpointProperty[Any] = EndpointProperty(
        not_an_endpoint.fn, propagate=propagate, explicit_response_port=explicit_response_port
    )
    prop.name = not_an_endpoint.name
    return Endpoint(not_an_endpoint.mesh, not_an_endpoint.name, prop)


def send(
    endpoint: Endpoint[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    port: Port[Any] | None = None,
    selection: Literal["all", "choose"] = "all",
) -> None:
    """Fire-and-forget; replies, if any, go to ``port``."""
    ranks = None if selection == "all" else [_least_loaded(endpoint._mesh)]
    endpoint._send(args, kwargs, (port._addr, port._port) if port is not None else None, None, ranks)


class Accumulator(Generic[R, A]):
    """Fold the replies of ``endpoint.stream(...)`` with ``combine`` starting from ``identity``."""

    def __init__(self, endpoint: Endpoint[R], identity: A, combine: Callable[[A, R], A]) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        # Monarch folds over stream(), so values are combined in the order they arrive
        order: list[int] = []
        inner = self._endpoint._gather(args, kwargs, None, "accumulate()", order=order)
        fut: Future[A] = Future._create("accumulate()")

        def fold(f: Future[list[Any]]) -> A:
            values = f.get()
            acc = self._identity
            for i in order:
                acc = self._combine(acc, values[i])
            return acc

        inner.add_done_callback(lambda f: fut._set_raw(f, fold))
        return fut
