"""Spans and metrics that record: Monarch's ``span``, ``traced`` and ``get_meter``.

They write into this process's span ring (``_runtime.spans``), which its allocator drains;
``monarch_nb.telemetry`` gathers and shows what they recorded. Inside an endpoint a span
carries the actor's name and rank, so it lands on that rank's track, within its call.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

from .._runtime import spans as _ring
from . import _context

F = TypeVar("F", bound=Callable[..., Any])


def _who() -> tuple[str, int]:
    inst = _context.current_instance()
    if inst is None:
        return "", 0
    return inst.name, inst.rank.rank


class Span:
    """An open span: add attributes while it runs (``set_attribute``, as OpenTelemetry's)."""

    __slots__ = ("attributes", "name", "ok")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        self.name = name
        self.attributes = attributes
        self.ok = True

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)


@contextmanager
def span(name: str, **attrs: Any) -> Iterator[Span]:
    """Record the block as a span named ``name`` with attributes ``attrs``; an exception
    leaving it marks the span's outcome ``error`` (and propagates)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"span() needs a non-empty name string, got {name!r}")
    s = Span(name, attrs)
    t0 = time.perf_counter()
    try:
        yield s
    except BaseException:
        s.ok = False
        raise
    finally:
        actor, rank = _who()
        _ring.record_span(name, actor, rank, t0, time.perf_counter(), s.ok, s.attributes)


@overload
def traced(fn: F) -> F: ...
@overload
def traced(fn: str | None = None, **attrs: Any) -> Callable[[F], F]: ...
def traced(fn: Any = None, **attrs: Any) -> Any:
    """Record every call of the decorated function (sync or async) as a span: ``@traced``,
    ``@traced("name")`` or ``@traced(name="name", key=value)``."""
    name = attrs.pop("name", None)
    if isinstance(fn, str):
        name, fn = fn, None

    def wrap(f: F) -> F:
        label = name or getattr(f, "__name__", repr(f))
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*a: Any, **k: Any) -> Any:
                with span(label, **attrs):
                    return await f(*a, **k)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            with span(label, **attrs):
                return f(*a, **k)

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


def _attrs(attributes: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(attributes.items())) if attributes else ()


class _Instrument:
    kind = ""

    def __init__(self, meter: str, name: str, unit: str = "", description: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an instrument needs a non-empty name string, got {name!r}")
        self.meter, self.name, self.unit, self.description = meter, name, unit, description


class Counter(_Instrument):
    """A monotonic sum (OpenTelemetry's ``Counter``)."""

    kind = "counter"

    def add(self, amount: float = 1, attributes: dict[str, Any] | None = None, context: Any = None) -> None:
        if amount < 0:
            raise ValueError(f"Counter {self.name!r} only goes up; add({amount}) is negative (use an UpDownCounter)")
        _ring.record_metric(self.meter, self.name, self.kind, amount, _attrs(attributes))


class UpDownCounter(_Instrument):
    """A sum that may go down (OpenTelemetry's ``UpDownCounter``)."""

    kind = "updown"

    def add(self, amount: float = 1, attributes: dict[str, Any] | None = None, context: Any = None) -> None:
        _ring.record_metric(self.meter, self.name, self.kind, amount, _attrs(attributes))


class Histogram(_Instrument):
    """A distribution of recorded values, kept as count, sum, min, max and last (OpenTelemetry's ``Histogram``)."""

    kind = "histogram"

    def record(self, amount: float, attributes: dict[str, Any] | None = None, context: Any = None) -> None:
        _ring.record_metric(self.meter, self.name, self.kind, amount, _attrs(attributes))


class Gauge(_Instrument):
    """The current value of something (OpenTelemetry's synchronous ``Gauge``); kept as its
    aggregate too, so ``last`` is the value and ``min``/``max`` its range."""

    kind = "gauge"

    def set(self, amount: float, attributes: dict[str, Any] | None = None, context: Any = None) -> None:
        _ring.record_metric(self.meter, self.name, self.kind, amount, _attrs(attributes))


class Meter:
    """Makes instruments whose values every rank aggregates and ``metrics()`` gathers."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        return Counter(self.name, name, unit, description)

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> UpDownCounter:
        return UpDownCounter(self.name, name, unit, description)

    def create_histogram(self, name: str, unit: str = "", description: str = "") -> Histogram:
        return Histogram(self.name, name, unit, description)

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> Gauge:
        return Gauge(self.name, name, unit, description)


def get_meter(name: str = "monarch") -> Meter:
    """A meter: Monarch's ``get_meter()`` (the process's ``monarch`` meter) or, with a name,
    OpenTelemetry's ``metrics.get_meter(name)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"get_meter() needs a non-empty name string, got {name!r}")
    return Meter(name)
