"""``call_one``'s own path (actor/_onecall.py) keeps the general path's rules: the order of one
thread's messages to an actor whichever path each took, arguments pickled once, a dead proc's
failure in Monarch's words, an endpoint's error and what it printed."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from monarch_nb.actor import Actor, Port, endpoint, this_host
from monarch_nb.errors import ActorError, SupervisionError

#: larger than a frame's inline payload (frames.INLINE_MAX): such a call takes the general path
BIG = 100_000


class _Log(Actor):
    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def note(self, i: int, pad: bytes = b"") -> int:
        self.seen.append(i)
        return i

    @endpoint
    def order(self) -> list[int]:
        return self.seen

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint(explicit_response_port=True)
    def square(self, port: Port[int], x: int) -> None:
        port.send(x * x)  # the value of the call, sent on the caller's port

    @endpoint
    def fail(self, why: str) -> None:
        print(f"about to fail: {why}", flush=True)
        raise ValueError(why)


@pytest.fixture
def log() -> Any:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="onecall")
    try:
        yield procs.spawn("log", _Log)
    finally:
        procs.stop().get(timeout=30)


def test_one_threads_small_and_large_calls_and_broadcasts_arrive_in_the_order_sent(log: Any) -> None:
    assert log.note.call_one(-1).get(timeout=30) == -1  # the connection and supervision set up
    futs = []
    for i in range(60):
        kind = i % 4
        if kind == 0:
            futs.append(log.note.call_one(i))  # the small path
        elif kind == 1:
            futs.append(log.note.call_one(i, b"x" * BIG))  # too large for it: the general path
        elif kind == 2:
            log.note.broadcast(i)  # no reply: the general path
        else:
            futs.append(log.note.call(i))
    for f in futs:
        f.get(timeout=30)
    assert log.order.call_one().get(timeout=30) == list(range(-1, 60))


class _Counted:
    """Pickles to a large bytes, counting how often it is pickled."""

    times = 0

    def __reduce__(self) -> Any:
        _Counted.times += 1
        return (bytes, (b"y" * BIG,))


def test_an_argument_too_large_for_the_small_path_is_pickled_once(log: Any) -> None:
    assert log.note.call_one(0).get(timeout=30) == 0
    _Counted.times = 0
    assert log.note.call_one(1, _Counted()).get(timeout=30) == 1
    assert _Counted.times == 1


def test_a_proc_that_dies_fails_the_call_naming_its_actor(log: Any, fault_hook: list[Any]) -> None:
    pid = log.pid.call_one().get(timeout=30)
    f = log.slow.call_one(60)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(SupervisionError) as info:
        f.get(timeout=30)
    assert time.monotonic() - t0 < 15
    # Monarch's words, naming the endpoint and the actor
    assert "Endpoint call log.slow() failed" in str(info.value) and "have failed" in str(info.value)


def test_an_endpoints_error_names_its_rank_after_what_it_printed(log: Any, capfd: Any) -> None:
    assert log.note.call_one(0).get(timeout=30) == 0
    with pytest.raises(ActorError) as info:
        log.fail.call_one("bad input").get(timeout=30)
    assert isinstance(info.value.exception, ValueError) and "bad input" in str(info.value)
    # a script shows what the call printed before its error
    assert "about to fail: bad input" in capfd.readouterr().out


def test_an_explicit_response_ports_value_answers_the_call(log: Any) -> None:
    assert log.note.call_one(0).get(timeout=30) == 0
    assert [log.square.call_one(x).get(timeout=30) for x in range(5)] == [0, 1, 4, 9, 16]
