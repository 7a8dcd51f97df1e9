"""A dict that keeps only its newest entries: the one owner of "remember the last N" bookkeeping
(ended calls, stop reasons, reaped meshes, connections in their handshake, ...).

It is an :class:`~collections.OrderedDict` because forgetting the oldest of a plain dict
(``del d[next(iter(d))]``) is not O(1): the dict's deleted slots stay at the front of its entry
table until it is resized, and ``next(iter(d))`` steps over all of them; at a bound of 4096 that
costs microseconds per insert, at 100 000 a hundred times more. ``popitem(last=False)`` is O(1).

No lock: each owner holds the container under its own lock, or on one thread, as before."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Newest(OrderedDict[K, V], Generic[K, V]):
    """At most ``most`` entries; setting a new key past that forgets the oldest one.

    ``refresh``: whether setting a key already held makes it the newest (a mesh stopped again is
    the latest stop) or leaves it where its first write put it (a dict's own order). Every insert
    — ``d[k] = v``, ``setdefault``, ``update`` — goes through :meth:`__setitem__`, so the bound
    holds whichever is used. Reads, ``pop`` and ``move_to_end`` are the OrderedDict's own.
    ``most`` may be lowered later: the next insert forgets down to it."""

    __slots__ = ("most", "refresh")

    def __init__(self, most: int, *, refresh: bool) -> None:
        if most < 1:
            raise ValueError(f"Newest keeps at least one entry: most={most!r}; pass a bound of 1 or more")
        super().__init__()
        self.most = most
        self.refresh = refresh

    def __setitem__(self, key: K, value: V) -> None:
        if self.refresh:
            # taken out first, not moved to the end after: another thread's pop of the key in
            # between would make move_to_end raise (the hand-written copies popped, then set)
            self.pop(key, None)
        OrderedDict.__setitem__(self, key, value)
        while len(self) > self.most:
            self.popitem(last=False)

    def push(self, key: K, value: V) -> list[tuple[K, V]]:
        """Set ``key`` as ``d[key] = value`` does, and return the entries it forgot, oldest
        first, for an owner that must act on them (shut a connection)."""
        if self.refresh:
            self.pop(key, None)
        OrderedDict.__setitem__(self, key, value)
        dropped = []
        while len(self) > self.most:
            dropped.append(self.popitem(last=False))
        return dropped

    # OrderedDict's own copy and pickle call the class with no arguments: ours needs its bound
    def copy(self) -> Newest[K, V]:
        new: Newest[K, V] = Newest(self.most, refresh=self.refresh)
        OrderedDict.update(new, self)
        return new

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.most, self.refresh, list(self.items())))

    def __repr__(self) -> str:
        return f"Newest(most={self.most}, refresh={self.refresh}, {dict(self)!r})"


def _rebuild(most: int, refresh: bool, items: list[tuple[Any, Any]]) -> Newest[Any, Any]:
    new: Newest[Any, Any] = Newest(most, refresh=refresh)
    OrderedDict.update(new, items)
    return new
