"""Endpoints and their adverbs: ``call``, ``call_one``, ``choose``, ``stream``, ``broadcast``."""

from __future__ import annotations

import functools
import inspect
import itertools
import random
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from ..errors import MeshClosedError, SupervisionError
from . import _context
from ._future import Future

if TYPE_CHECKING:
    from ._mesh import ActorMesh, ValueMesh
    from ._port import Port

R = TypeVar("R")
A = TypeVar("A")


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
            raise ValueError(f"{fn.name} is already an endpoint")
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


class NotAnEndpointError(AttributeError, RuntimeError):
    """An adverb of a method without ``@endpoint``: an AttributeError as in Monarch, and the
    RuntimeError monarch_nb raised before."""


_rr = itertools.count()

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

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._name} over {self._mesh.extent}>"

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
        port: tuple[str, int] | None,
        on_fail: Callable[[int, BaseException], None] | None,
        ranks: list[int] | None = None,
    ) -> int:
        """Send to every actor of the mesh (or ``ranks``, indices into its view); return how many."""
        self._check(args, kwargs)
        mesh = self._mesh
        if mesh._closed():
            raise MeshClosedError(f"actor mesh {mesh._name!r} was stopped; spawn it again")
        rt = _context.runtime()
        body, bufs = dumps((args, kwargs))
        rt.check_size(body, bufs)
        view = mesh._view
        ext = (view.labels, view.sizes)
        call_id = rt.next_call_id()
        procs = mesh._procs
        idx = range(len(view.ranks)) if ranks is None else ranks
        on_call = _context.client().on_call if _context._client is not None else None
        if on_call is not None:
            on_call(call_id, [(procs[view.ranks[i]].mesh, procs[view.ranks[i]].rank) for i in idx])
        raddr_cache: dict[bool, str] = {}
        for i in idx:
            p = procs[view.ranks[i]]
            reply = None
            if port is not None:
                tcp = p.addr.startswith("tcp://")
                raddr = raddr_cache.get(tcp) or raddr_cache.setdefault(tcp, rt.addr_for(p.addr))
                reply = (raddr, port[1]) if port[0] == "" else port
                if p.alloc:
                    rt.watch(p.alloc, p.addr, p.mesh, p.rank, p.host)
                if on_fail is not None:
                    rt.expect(p.addr, (port[1], i), functools.partial(on_fail, i))
            try:
                rt.send_actor(p.addr, mesh._name, self._name, body, bufs, reply=reply, index=i, extent=ext, call_id=call_id)
            except BaseException as e:
                if on_fail is None:
                    raise
                on_fail(i, e)
        return len(idx)

    def _gather(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ranks: list[int] | None,
        what: str,
        decode: Callable[[list[Any]], Any] | None = None,
        order: list[int] | None = None,
    ) -> Future[Any]:
        """Send and collect raw replies, decoded by ``decode`` on first read.

        Like Monarch, the future completes once every actor has answered, and when some
        failed it raises the failure of the lowest rank (not whichever arrived first), so a
        program sees the same error on every run. ``order``, if given, receives the indices
        in arrival order (Accumulator folds in that order, as Monarch's does).
        """
        rt = _context.runtime()
        n = len(self._mesh._view.ranks) if ranks is None else len(ranks)
        fut: Future[list[Any]] = Future._create(what)
        if self._mesh._closed():
            self._check(args, kwargs)
            # Monarch's calls to a stopped mesh fail when their future is read, not when sent
            fut._set_exception(_stopped_error(self._mesh))
            return fut
        raw: list[Any] = [None] * len(self._mesh._view.ranks)
        errors: dict[int, Any] = {}
        left = [n]
        fut._progress = (left, n)
        pid = 0
        procs, view = self._mesh._procs, self._mesh._view

        lock = threading.Lock()  # replies come on the I/O thread, a failed send on the caller's

        def arrive(index: int, value: Any, failed: bool) -> bool:
            """Record one actor's answer (the first one only); True when it was the last."""
            with lock:
                if raw[index] is not None or index in errors:
                    return False
                if failed:
                    errors[index] = value
                else:
                    raw[index] = value
                if order is not None:
                    order.append(index)
                left[0] -= 1
                return left[0] == 0

        def done() -> None:
            rt.close_port(pid)
            if errors:
                first = errors[min(errors)]
                if isinstance(first, BaseException):
                    fut._set_exception(first)
                else:
                    fut._set_raw(first, _raise_remote)
            else:
                fut._set_raw(raw, decode or _decode_all)

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            rt.fulfil(procs[view.ranks[index]].addr, (pid, index))
            if arrive(index, (body, bufs), status == wire.ERROR):
                done()

        def on_fail(index: int, err: BaseException) -> None:
            if arrive(index, err, True):
                done()

        pid = rt.open_port(on_reply)
        try:
            self._send(args, kwargs, ("", pid), on_fail, ranks)
        except BaseException:
            rt.close_port(pid)
            raise
        return fut

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Call every actor; the future holds a ValueMesh of their results."""
        from ._mesh import ValueMesh

        view = self._mesh._view
        return self._gather(
            args,
            kwargs,
            None,
            f"{self._mesh._name}.{self._name}.call()",
            lambda raws: ValueMesh._from_view(view, _decode_all(raws)),
        )

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call the single actor of a one-actor mesh; ValueError for any other size."""
        n = len(self._mesh._view.ranks)
        if n != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {n}")
        return self._gather(args, kwargs, None, f"{self._mesh._name}.{self._name}.call_one()", _decode_first)

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call one actor, chosen to spread load."""
        n = len(self._mesh._view.ranks)
        i = random.randrange(n)
        return self._gather(args, kwargs, [i], f"{self._mesh._name}.{self._name}.choose()", lambda raws: loads(*raws[i]))

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[R]]:
        """Call every actor; yield a future per reply, in arrival order."""
        import queue

        rt = _context.runtime()
        n = len(self._mesh._view.ranks)
        q: queue.SimpleQueue[Future[R]] = queue.SimpleQueue()
        left = [n]
        pid = 0
        procs, view = self._mesh._procs, self._mesh._view

        def deliver(f: Future[R]) -> None:
            left[0] -= 1
            if left[0] == 0:
                rt.close_port(pid)
            q.put(f)

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            rt.fulfil(procs[view.ranks[index]].addr, (pid, index))
            f: Future[R] = Future._create(f"{self._name}.stream() item")
            f._set_raw((body, bufs), _raise_remote if status == wire.ERROR else _decode_one)
            deliver(f)

        def on_fail(index: int, err: BaseException) -> None:
            f: Future[R] = Future._create(f"{self._name}.stream() item")
            f._set_exception(err)
            deliver(f)

        if self._mesh._closed():
            # as for call(): the items fail when read
            for i in range(n):
                on_fail(i, _stopped_error(self._mesh))
            return (q.get() for _ in range(n))
        pid = rt.open_port(on_reply)
        self._send(args, kwargs, ("", pid), on_fail)

        def gen() -> Iterator[Future[R]]:
            for _ in range(n):
                yield q.get()

        return gen()

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting for (or receiving) results."""
        self._send(args, kwargs, None, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a TypeError, as in Monarch (whose endpoints are simply not callable)
        raise TypeError(
            f"call an endpoint through an adverb: {self._name}.call(...), .call_one(...), .choose(...), .stream(...) or .broadcast(...)"
        )


def _stopped_error(mesh: ActorMesh[Any]) -> SupervisionError:
    """What a call to a stopped mesh fails with (Monarch's is a SupervisionError too)."""
    return SupervisionError(f"actor mesh {mesh._name!r} was stopped; spawn it again", actor=mesh._name)


def _decode_one(raw: Any) -> Any:
    return loads(*raw)


def _decode_first(raws: list[Any]) -> Any:
    return loads(*raws[0])


def _decode_all(raws: list[Any]) -> list[Any]:
    return [loads(*r) if r is not None else None for r in raws]


def _raise_remote(raw: Any) -> Any:
    raise loads(*raw)


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
    ranks = None if selection == "all" else [random.randrange(len(endpoint._mesh._view.ranks))]
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
