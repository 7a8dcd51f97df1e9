"""Per-sender stream ordering without sockets: what a receiver delivers, and when, for
messages that arrive reordered, with gaps, replayed, or never (the clock is a variable).
The same rules over real sockets and relays: test_fanout.py."""

from __future__ import annotations

import pytest

from monarch_nb._runtime.ordering import Skipped, StreamOrder

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def order(clock: Clock) -> tuple[StreamOrder[str], list[str]]:
    out: list[str] = []
    return StreamOrder(out.append, gap_timeout=5.0, clock=clock), out


def test_in_order_messages_are_delivered_at_once(order):
    so, out = order
    for i in range(1, 4):
        assert so.accept("a", i, f"m{i}")
        assert out == [f"m{j}" for j in range(1, i + 1)]
    assert so.waiting() == 0


def test_an_early_message_waits_for_the_ones_before_it(order):
    so, out = order
    assert so.accept("a", 3, "m3")
    assert so.accept("a", 2, "m2")
    assert out == []
    assert so.waiting() == 2
    assert so.accept("a", 1, "m1")
    assert out == ["m1", "m2", "m3"]
    assert so.waiting() == 0
    assert so.accept("a", 4, "m4")
    assert out[-1] == "m4"


def test_streams_are_independent(order):
    so, out = order
    so.accept("a", 2, "a2")
    so.accept("b", 1, "b1")  # another sender's stream is not held up by a's gap
    assert out == ["b1"]
    so.accept("a", 1, "a1")
    assert out == ["b1", "a1", "a2"]
    assert len(so) == 2


def test_a_replay_is_dropped_whether_delivered_or_held(order):
    so, out = order
    assert so.accept("a", 1, "m1")
    assert not so.accept("a", 1, "m1 again")  # delivered already
    assert so.accept("a", 3, "m3")
    assert not so.accept("a", 3, "m3 again")  # held already
    assert so.accept("a", 2, "m2")
    assert not so.accept("a", 2, "m2 again")
    assert out == ["m1", "m2", "m3"]


def test_a_gap_is_skipped_only_after_the_timeout(order, clock):
    so, out = order
    so.accept("a", 1, "m1")
    so.accept("a", 3, "m3")  # 2 never comes
    clock.now += 5.0
    assert so.skip_gaps() == []  # not longer than the timeout yet
    assert out == ["m1"]
    clock.now += 0.1
    assert so.skip_gaps() == [Skipped("a", 2, 2)]
    assert out == ["m1", "m3"]
    assert so.skip_gaps() == []
    # the lost number stays lost: arriving late it counts as a replay
    assert not so.accept("a", 2, "m2 late")
    assert so.accept("a", 4, "m4")
    assert out == ["m1", "m3", "m4"]


def test_skipping_delivers_up_to_the_next_gap_which_gets_its_own_timeout(order, clock):
    so, out = order
    so.accept("a", 2, "m2")
    so.accept("a", 3, "m3")
    so.accept("a", 6, "m6")  # 1, 4 and 5 are missing
    clock.now += 6
    assert so.skip_gaps() == [Skipped("a", 1, 1)]
    assert out == ["m2", "m3"]
    clock.now += 3
    assert so.skip_gaps() == []  # the gap before 6 started when 3 was delivered
    clock.now += 3
    assert so.skip_gaps() == [Skipped("a", 4, 5)]
    assert out == ["m2", "m3", "m6"]


def test_the_gap_clock_restarts_when_a_missing_message_arrives(order, clock):
    so, out = order
    so.accept("a", 3, "m3")
    clock.now += 4
    so.accept("a", 1, "m1")  # 2 is still missing; the wait for it starts now
    clock.now += 4
    assert so.skip_gaps() == []
    clock.now += 2
    assert so.skip_gaps() == [Skipped("a", 2, 2)]
    assert out == ["m1", "m3"]


def test_skip_gaps_takes_an_explicit_time(order, clock):
    so, out = order
    so.accept("a", 2, "m2")
    assert so.skip_gaps(clock.now + 1) == []
    assert so.skip_gaps(clock.now + 10) == [Skipped("a", 1, 1)]
    assert out == ["m2"]


def test_a_failing_delivery_leaves_later_messages_held_not_lost(clock):
    out: list[str] = []

    def deliver(m: str) -> None:
        if m == "bad":
            raise RuntimeError("handler failed")
        out.append(m)

    so: StreamOrder[str] = StreamOrder(deliver, gap_timeout=5.0, clock=clock)
    so.accept("a", 2, "m2")
    with pytest.raises(RuntimeError):
        so.accept("a", 1, "bad")
    assert out == []  # 1 counts as delivered; 2 waits for the next arrival or the timeout
    so.accept("a", 3, "m3")
    assert out == ["m2", "m3"]


def test_a_skipped_gap_is_reported_before_the_messages_behind_it_are_delivered(clock):
    events: list[object] = []
    so: StreamOrder[str] = StreamOrder(events.append, gap_timeout=1.0, clock=clock, on_skip=events.append)
    so.accept("a", 2, "m2")
    clock.now += 2
    so.skip_gaps()
    assert events == [Skipped("a", 1, 1), "m2"]
