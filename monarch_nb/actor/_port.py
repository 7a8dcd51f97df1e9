"""Ports and channels: a picklable address to which anyone may send values."""

from __future__ import annotations

import queue
import reprlib
from typing import Any, Generic, TypeVar

from .._wire import frames as wire
from .._wire.serialize import loads
from ..errors import _safe_exc
from . import _context
from ._future import Future

R = TypeVar("R")


class Port(Generic[R]):
    """Where a value should go; picklable, so it can be handed to other actors."""

    def __init__(self, addr: str, port: int, index: int = 0, once: bool = False) -> None:
        self._addr = addr
        self._port = port
        self._index = index
        self._once = once
        #: a once port (``Channel.open(once=True)``) that has sent its value
        self._spent = False
        self.return_undeliverable = True

    def send(self, obj: R) -> None:
        if self._once and self._spent:
            self._spend()  # raises
        # a value that cannot be pickled raises here, in the sender's code, as in Monarch (and as
        # an endpoint's arguments do): the receiver would otherwise get an error it cannot act
        # on. Nothing was sent then, so a once port is spent only after
        _context.runtime().send_port(self._addr, self._port, self._index, wire.ITEM, obj, strict=True)
        self._spent = self._once

    def exception(self, exc: Exception) -> None:
        """Make the receiving end raise ``exc``: ``recv()`` (or the call an explicit response
        port answers) raises this exception itself, as in Monarch, not an ActorError around it."""
        if not (isinstance(exc, BaseException) or (isinstance(exc, type) and issubclass(exc, BaseException))):
            # Monarch sends it, and the receiver gets Python's bare "exceptions must derive from
            # BaseException" with no word of who sent what; say it here, where the mistake is.
            # Nothing is sent, so a once port stays unspent. A class is what `raise` takes too
            raise TypeError(
                f"port.exception() takes an exception, such as ValueError('what went wrong'), "
                f"not {type(exc).__name__} {reprlib.repr(exc)}: to send a value, use port.send()"
            )
        if self._once:
            self._spend()
        _context.runtime().send_port(self._addr, self._port, self._index, wire.ERROR, _safe_exc(exc))

    def _spend(self) -> None:
        if self._spent:
            raise RuntimeError("OncePortRef already used")  # Monarch's words: a once port sends one value
        self._spent = True

    def __reduce__(self) -> tuple[Any, ...]:
        addr = self._addr
        rt = _context._runtime
        if rt is not None and (addr == rt.ipc_addr or addr == rt.tcp_addr):
            # once we have a TCP inbox, hand out the address the recipient's host reaches
            addr = _context.reachable_addr(rt) or addr
        return (Port, (addr, self._port, self._index, self._once))

    def __repr__(self) -> str:
        return f"Port({self._addr}#{self._port})"


class PortReceiver(Generic[R]):
    """The receiving end of a :class:`Channel`."""

    def __init__(self, ranked: bool = False, once: bool = False) -> None:
        self._q: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()
        #: futures of recv() calls waiting for a value, each with whether it wants the rank
        self._waiters: list[tuple[Future[Any], bool]] = []
        self._ranked = ranked
        self._port = 0
        #: a once channel's: whether a recv() has been read (shared with its ranked() view)
        self._spent: list[bool] | None = [False] if once else None

    def ranked(self) -> PortReceiver[Any]:
        """The same channel received as ``(rank, value)`` pairs (Monarch's ``RankedPortReceiver``)."""
        other: PortReceiver[Any] = PortReceiver(True)
        other._q, other._waiters, other._port, other._spent = self._q, self._waiters, self._port, self._spent
        return other

    def _on_value(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        raw = (bytes(body), [bytes(b) for b in bufs])
        if self._waiters:
            f, ranked = self._waiters.pop(0)
            self._complete(f, ranked, index, status, raw)
        else:
            self._q.put((index, status, raw))

    @staticmethod
    def _complete(f: Future[Any], ranked: bool, index: int, status: int, raw: Any) -> None:
        if status == wire.ERROR:

            def fail(r: Any) -> Any:
                raise loads(*r)

            f._set_raw(raw, fail)
        elif ranked:
            f._set_raw(raw, lambda r: (index, loads(*r)))
        else:
            f._set_raw(raw, lambda r: loads(*r))

    def recv(self) -> Future[R]:
        """A future for the next value sent to the port."""
        f: Future[R] = Future._create("PortReceiver.recv()")
        rt = _context.runtime()

        def take() -> None:
            try:
                index, status, raw = self._q.get_nowait()
            except queue.Empty:
                self._waiters.append((f, self._ranked))
                return
            self._complete(f, self._ranked, index, status, raw)

        spent = self._spent

        def start() -> None:
            if spent is not None:
                if spent[0]:
                    # Monarch's words: a once channel's receiver takes one value
                    f._set_exception(ValueError("OncePort is already used"))
                    return
                spent[0] = True
            rt.call_soon(take)

        # values arrive on the I/O thread; taking there too keeps their order. Only once the
        # future is first read or awaited, as Monarch's: an unobserved recv() consumes nothing
        f._start = start
        return f

    def close(self) -> None:
        _context.runtime().close_port(self._port)


class Channel(Generic[R]):
    """``Channel.open()`` returns a connected ``(Port, PortReceiver)`` pair."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        return Channel._open(once, False)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[Any], PortReceiver[Any]]:
        return Channel._open(once, True)

    @staticmethod
    def _open(once: bool, ranked: bool) -> tuple[Port[Any], PortReceiver[Any]]:
        rt = _context.runtime()
        recv: PortReceiver[Any] = PortReceiver(ranked, once)
        recv._port = rt.open_port(recv._on_value)
        return Port(rt.ipc_addr, recv._port, 0, once), recv
