"""Per-sender stream ordering: deliver each stream's messages in the order they were numbered.

A sender numbers its messages to one receiver 1, 2, 3 … on a stream of its own; they may
take different paths (straight, or relayed by an allocator) and so overtake each other.
:class:`StreamOrder` delivers each stream in number order, holds a message that came early,
drops a number it has already seen (a replay), and, when a message never comes (lost with a
relay that failed), delivers the ones held behind it after ``gap_timeout`` seconds.

Pure: no sockets, no threads, no logging; time comes from an injected clock, so every case
is a unit test (tests/test_ordering.py). The runtime calls it on its I/O thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

M = TypeVar("M")


class Skipped(NamedTuple):
    """Messages ``first``..``last`` of ``stream`` never arrived and were given up on."""

    stream: str
    first: int
    last: int


class _Held(Generic[M]):
    """A receiving stream: the next number to deliver and the messages that came early."""

    __slots__ = ("next", "held", "since")

    def __init__(self) -> None:
        self.next = 1
        self.held: dict[int, M] = {}
        #: when the stream last started waiting for a missing message
        self.since = 0.0


class StreamOrder(Generic[M]):
    """Delivers messages to ``deliver`` in each stream's number order (numbers start at 1)."""

    def __init__(
        self,
        deliver: Callable[[M], None],
        gap_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        on_skip: Callable[[Skipped], None] | None = None,
    ) -> None:
        self._deliver = deliver
        self.gap_timeout = gap_timeout
        self._clock = clock
        #: told of each gap given up on, before the messages behind it are delivered
        self._on_skip = on_skip
        self._streams: dict[str, _Held[M]] = {}
        #: told when a stream starts holding messages behind a gap (on the caller's thread):
        #: whoever calls :meth:`skip_gaps` may look less often while nothing is held
        self.on_gap: Callable[[], None] | None = None

    def holding(self) -> bool:
        """Whether any stream holds messages behind a gap."""
        return any(st.held for st in self._streams.values())

    def accept(self, stream: str, seq: int, msg: M) -> bool:
        """Take message ``seq`` of ``stream``: deliver it and every held one it unblocks, or hold
        it until those before it arrive. False: ``seq`` was delivered or is held already (a
        replay); it is dropped."""
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Held()
        if seq == st.next and not st.held:
            # in order, nothing held: the commonest case, delivered without holding it
            st.next = seq + 1
            self._deliver(msg)
            return True
        if seq < st.next or seq in st.held:
            return False
        gap = seq != st.next and not st.held
        if gap:
            st.since = self._clock()  # a gap opens
        st.held[seq] = msg
        self._release(st)
        if gap and self.on_gap is not None:
            self.on_gap()
        return True

    def take_next(self, stream: str, seq: int) -> bool:
        """Whether ``seq`` is the next message of ``stream`` with none held behind a gap: if so
        it counts as delivered (the caller delivers it itself), else nothing changes."""
        st = self._streams.get(stream)
        if st is None:
            st = self._streams[stream] = _Held()
        if seq != st.next or st.held:
            return False
        st.next += 1
        return True

    def _release(self, st: _Held[M]) -> None:
        """Deliver the stream's next messages while they are here."""
        delivered = False
        while (msg := st.held.pop(st.next, None)) is not None:
            st.next += 1
            delivered = True
            self._deliver(msg)
        if delivered and st.held:
            st.since = self._clock()  # waiting again, for the next gap

    def skip_gaps(self, now: float | None = None) -> list[Skipped]:
        """Give up on messages a stream has waited for longer than ``gap_timeout``: deliver the
        ones held behind them. Returns what was given up on."""
        if now is None:
            now = self._clock()
        skipped = []
        for sid, st in self._streams.items():
            if st.held and now - st.since > self.gap_timeout:
                first = min(st.held)
                gap = Skipped(sid, st.next, first - 1)
                if self._on_skip is not None:
                    self._on_skip(gap)
                skipped.append(gap)
                st.next = first
                self._release(st)
        return skipped

    def waiting(self) -> int:
        """How many messages are held behind a gap, over all streams."""
        return sum(len(st.held) for st in self._streams.values())

    def __len__(self) -> int:
        """How many streams this receiver has seen."""
        return len(self._streams)
