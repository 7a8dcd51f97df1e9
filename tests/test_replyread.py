"""A caller blocked on one actor's reply reads it off that actor's connection itself
(actor/_replyread.py): the replies, failures, timeouts and other messages it must not lose."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest

from monarch_nb.actor import Actor, Channel, Port, _replyread, endpoint, this_host
from monarch_nb.errors import SupervisionError


class _Echo(Actor):
    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def tell_gated(self, port: Port[int], paths: list[str]) -> None:
        import _gate

        for i, path in enumerate(paths):
            port.send(i)  # each value alone: the next waits until the test has this one
            _gate.wait(path, 30)

    @endpoint
    def gated(self, path: str) -> str:
        import _gate

        return "in" if _gate.wait(path, 30) else "closed"

    @endpoint
    def tell(self, port: Port[int], n: int) -> int:
        for i in range(n):
            port.send(i)  # on this actor's connection to the caller, before the reply
        return n


def _open_when_read(c: Any, g: Any) -> threading.Thread:
    """Open gate ``g`` once the caller reads claimed connection ``c`` itself (its reply then
    comes to a caller already waiting)."""
    from conftest import wait_for

    def run() -> None:
        try:
            wait_for(lambda: c.state == c.IDLE, 20, "the caller reading its connection")
        finally:
            g.open()

    t = threading.Thread(target=run)
    t.start()
    return t


def _open_when_waiting(c: Any, g: Any, tid: int) -> None:
    """Open gate ``g`` once thread ``tid`` waits in a future's get() reading claimed connection
    ``c`` itself (not in the look right after its send, which the reply must miss)."""
    from conftest import wait_for

    def in_get() -> bool:
        frame = sys._current_frames().get(tid)
        while frame is not None:
            if frame.f_code.co_name == "_read" and frame.f_code.co_filename.endswith("_replyread.py"):
                return True
            frame = frame.f_back
        return False

    try:
        wait_for(lambda: c.state == c.IDLE and in_get(), 20, "the caller waiting in get() on its connection")
    finally:
        g.open()


async def _await_read_on_loop(echo: Any, g: Any) -> str:
    """Await ``echo``'s replies until this thread holds its connection, then one reply that
    comes while the loop waits (gate ``g`` opened once the loop reads): the loop reads that one."""
    peer = (echo._procs[0].addr, echo._name)
    for i in range(300):
        assert await echo.echo.call_one(i) == i
        if peer in _replyread._reader().claims:
            break
    c = _replyread._reader().claims[peer]
    opener = _open_when_read(c, g)
    try:
        return str(await echo.gated.call_one(g.path))
    finally:
        opener.join()


def _reads_itself(a: Any) -> bool:
    """Within 200 calls this thread reads ``a``'s replies itself (a reply that comes before
    its caller asks for it is not handed over with its connection: on a busy machine, many)."""
    for _ in range(200):
        f = a.echo.call_one(1)
        assert f.get(timeout=10) == 1
        if f._peer in _replyread._reader().claims:
            return True
    return False


@pytest.fixture
def echo() -> Any:
    # this host's allocator: its procs hold the controller's key, so a Port handed to them
    # reaches the controller whichever inbox its address names (the tcp one, once there is one)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="replyread")
    try:
        yield procs.spawn("e", _Echo)
    finally:
        procs.stop().get(timeout=30)


def test_values_and_messages_before_a_reply_arrive_in_order(echo: Any) -> None:
    assert _reads_itself(echo)
    port, rx = Channel.open()
    for k in range(20):
        assert echo.echo.call_one(k).get(timeout=10) == k
        # values for a port of ours on the claimed connection go to the I/O thread, in order
        assert echo.tell.call_one(port, 3).get(timeout=10) == 3
        assert [rx.recv().get(timeout=10) for _ in range(3)] == [0, 1, 2]
    # and the caller reads its replies itself again afterwards
    assert _reads_itself(echo)


def test_a_timeout_while_reading_leaves_the_call_usable(echo: Any) -> None:
    assert _reads_itself(echo)
    f = echo.slow.call_one(1.0)
    with pytest.raises(TimeoutError):
        f.get(timeout=0.2)
    assert f.get(timeout=10) == "done"
    assert echo.echo.call_one("x").get(timeout=10) == "x"


def test_a_reply_left_unread_does_not_reach_the_next_call(echo: Any) -> None:
    assert _reads_itself(echo)
    unread = echo.echo.call_one("first")  # never waited on before the next call
    assert echo.echo.call_one("second").get(timeout=10) == "second"
    assert unread.get(timeout=10) == "first"
    assert _reads_itself(echo)


def test_threads_calling_one_actor_each_get_their_own_replies(echo: Any) -> None:
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for i in range(150):
                v = (t, i)
                assert echo.echo.call_one(v).get(timeout=20) == v
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a caller hung"
    assert errors == []


def test_a_dead_actor_fails_a_caller_reading_its_reply(fault_hook: list[Any]) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="replyread-dead")
    try:
        a = procs.spawn("e", _Echo)
        assert _reads_itself(a)
        pid = a.pid.call_one().get(timeout=10)
        f = a.slow.call_one(60)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(SupervisionError):
            f.get(timeout=30)
        assert time.monotonic() - t0 < 15, "the failure woke the caller's read"
    finally:
        procs.stop().get(timeout=30)


def test_a_forked_child_never_reads_its_parents_connections(echo: Any) -> None:
    assert _reads_itself(echo)
    pid = os.fork()
    if pid == 0:  # the child: the parent's claimed connections are not its own
        os._exit(0 if _replyread._reader().claims == {} else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _reads_itself(echo)  # the parent still reads its replies itself


# -- await: the user's event loop reads the reply itself (_replyread.awaitable)
def _loop_reads(echo: Any, coro_fn: Any) -> tuple[Any, list[int]]:
    """Run ``coro_fn()`` in a fresh event loop of this thread; also return the threads on which
    replies were dispatched by a reader other than the I/O thread (which the loop is)."""
    import asyncio

    from monarch_nb.actor import _context

    rt = _context.runtime()
    seen: list[int] = []
    # a reply read by its caller's thread is delivered through port_reply (the I/O thread's go
    # through dispatch)
    plain = rt.receiver.port_reply

    def counted(*a: Any) -> Any:
        seen.append(threading.get_ident())
        return plain(*a)

    rt.receiver.port_reply = counted  # type: ignore[method-assign]
    try:
        return asyncio.run(coro_fn()), seen
    finally:
        del rt.receiver.port_reply


def test_an_await_reads_its_reply_on_the_event_loop(echo: Any, gate: Any) -> None:
    async def main() -> list[str]:
        return [await _await_read_on_loop(echo, gate(f"await{k}")) for k in range(5)]

    got, seen = _loop_reads(echo, main)
    assert got == ["in"] * 5
    # after the first replies the I/O thread hands the connection over; then the loop reads:
    # every reply that comes while the await waits (a reply that comes before is the I/O
    # thread's, which keeps the connection the loop's)
    assert len(seen) >= 5 and set(seen) == {threading.get_ident()}, len(seen)


def test_an_await_keeps_values_before_its_reply_in_order_and_mixes_with_get(echo: Any, gate: Any) -> None:
    port, rx = Channel.open()

    async def main() -> None:
        for k in range(20):
            assert await echo.echo.call_one(k) == k
            # values for a port of ours on the connection the loop reads go to the I/O thread, in order
            assert await echo.tell.call_one(port, 3) == 3
            assert [await rx.recv() for _ in range(3)] == [0, 1, 2]
            assert echo.echo.call_one(-k).get(timeout=10) == -k  # the same thread, blocking

    _loop_reads(echo, main)
    got, seen = _loop_reads(echo, lambda: _await_read_on_loop(echo, gate("again")))
    assert got == "in" and seen, "the loop does not read its replies itself again"


def test_a_cancelled_await_leaves_the_call_usable(echo: Any, gate: Any) -> None:
    import asyncio

    async def main() -> tuple[str, str]:
        assert await _await_read_on_loop(echo, gate("warm")) == "in"
        f = echo.slow.call_one(1.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f, 0.2)
        return await f, await echo.echo.call_one("x")

    got, seen = _loop_reads(echo, main)
    assert got == ("done", "x") and seen


def test_a_reply_to_an_await_whose_event_loop_has_ended_is_kept_for_the_next_reader(echo: Any, gate: Any, caplog: Any) -> None:
    # asyncio.run ends (a timeout here; an interrupted cell ends the same way) before the reply
    import asyncio

    g = gate("late")
    f = echo.gated.call_one(g.path)
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(f, 0.1))
    later: list[Any] = []
    f.add_done_callback(later.append)  # a waiter after the ended loop's, told too
    g.open()
    assert f.get(timeout=10) == "in"
    assert echo.echo.call_one("x").get(timeout=10) == "x"
    assert later == [f]
    assert "handler failed" not in caplog.text


def test_a_dead_actor_fails_an_await_on_the_loop(fault_hook: list[Any], gate: Any) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="replyread-dead-await")
    try:
        a = procs.spawn("e", _Echo)

        async def main() -> float:
            assert await _await_read_on_loop(a, gate("warm")) == "in"
            pid = await a.pid.call_one()
            f = a.slow.call_one(60)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(SupervisionError):
                await asyncio.wait_for(f, 30)
            return time.monotonic() - t0

        import asyncio

        took, seen = _loop_reads(a, main)
        assert seen and took < 15, took
    finally:
        procs.stop().get(timeout=30)


def _dispatched_here(echo: Any, fn: Any) -> int:
    """How many replies this thread dispatched itself while ``fn()`` ran."""
    from monarch_nb.actor import _context

    rt = _context.runtime()
    me, seen = threading.get_ident(), [0]
    plain = rt.receiver.port_reply

    def counted(*a: Any) -> Any:
        seen[0] += threading.get_ident() == me
        return plain(*a)

    rt.receiver.port_reply = counted  # type: ignore[method-assign]
    try:
        fn()
    finally:
        del rt.receiver.port_reply
    return seen[0]


def test_a_reply_that_comes_before_its_caller_waits_keeps_the_connection_with_the_caller(echo: Any, gate: Any) -> None:
    assert _reads_itself(echo)
    for k in range(5):
        came = threading.Event()
        f = echo.echo.call_one(k)
        f.add_done_callback(lambda _, came=came: came.set())
        assert came.wait(10)  # the I/O thread read it: the caller was not waiting yet
        assert f.get(timeout=10) == k
        c = _replyread._reader().claims[f._peer]
        assert c.state != c.GONE, "the connection went back to the I/O thread"
        # the next reply is read by the caller itself, with no call through the I/O thread first
        g = gate(f"next{k}")
        opener = _open_when_read(c, g)
        assert _dispatched_here(echo, lambda g=g: echo.gated.call_one(g.path).get(timeout=30)) == 1
        opener.join()


def test_a_stream_of_port_values_while_the_caller_is_elsewhere_arrives_whole_and_in_order(echo: Any) -> None:
    assert _reads_itself(echo)
    port, rx = Channel.open()
    for _ in range(3):
        echo.tell.broadcast(port, 40)  # nobody waits on a reply: the I/O thread takes them all
        assert [rx.recv().get(timeout=10) for _ in range(40)] == list(range(40))
    assert _reads_itself(echo)


def test_a_connection_the_caller_no_longer_reads_goes_back_to_the_io_thread(echo: Any, gate: Any) -> None:
    # values arriving one by one while the caller is elsewhere: the I/O thread reads each for
    # the caller's claim, and after 16 lets the connection go for good
    assert _reads_itself(echo)
    f = echo.echo.call_one(0)
    assert f.get(timeout=10) == 0
    c = _replyread._reader().claims[f._peer]
    port, rx = Channel.open()
    gates = [gate(f"v{i}") for i in range(20)]
    echo.tell_gated.broadcast(port, [g.path for g in gates])
    for i, g in enumerate(gates):
        assert rx.recv().get(timeout=10) == i
        g.open()
    assert c.state == c.GONE
    assert _reads_itself(echo)  # and a later reply is handed over again


@pytest.fixture
def replied_in_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """``call_one`` as where the proc runs inside its caller's send (it wakes on the caller's
    CPU, as on this two-CPU machine under load): the look for the reply right after the send
    waits until the reply connection has bytes, so it finds them there every time."""
    import select

    real = _replyread.after_send

    def after_the_proc_ran(fut: Any, c: Any, rt: Any, peer: Any) -> None:
        select.select([c.fd], [], [], 10)
        real(fut, c, rt, peer)

    monkeypatch.setattr(_replyread, "after_send", after_the_proc_ran)


def test_a_reply_written_during_the_send_is_read_there_and_the_io_thread_watches_again(echo: Any, replied_in_send: None) -> None:
    assert _reads_itself(echo)
    port, rx = Channel.open()
    for k in range(5):
        f: list[Any] = []
        assert _dispatched_here(echo, lambda k=k, f=f: f.append(echo.echo.call_one(k))) == 1
        assert f[0].done() and f[0].get(timeout=0) == k  # done before call_one returned
        c = _replyread._reader().claims[f[0]._peer]
        assert c.state == c.BUSY  # handed back to the I/O thread's watch, the claim kept
        # so what comes while the caller is elsewhere still arrives
        echo.tell.broadcast(port, 3)
        assert [rx.recv().get(timeout=10) for _ in range(3)] == [0, 1, 2]


def test_messages_before_a_reply_read_during_the_send_go_to_the_io_thread_in_order(echo: Any, replied_in_send: None) -> None:
    assert _reads_itself(echo)
    port, rx = Channel.open()
    for k in range(10):
        assert echo.tell.call_one(port, 3).get(timeout=10) == 3
        assert [rx.recv().get(timeout=10) for _ in range(3)] == [0, 1, 2]
        assert echo.echo.call_one(k).get(timeout=10) == k
    assert _reads_itself(echo)


def test_a_caller_whose_replies_never_come_during_the_send_stops_looking(echo: Any, gate: Any) -> None:
    assert _reads_itself(echo)
    peer = (echo._procs[0].addr, echo._name)
    _replyread._reader().early.pop(peer, None)  # what the calls above found
    me = threading.get_ident()
    for i in range(_replyread._START + 1):
        # each reply comes once this thread waits for it in get(), never during its send
        g = gate(f"later-{i}")
        c = _replyread._reader().claims[peer]
        waiting = threading.Thread(target=_open_when_waiting, args=(c, g, me))
        waiting.start()
        try:
            assert echo.gated.call_one(g.path).get(timeout=30) == "in"
        finally:
            waiting.join()
    assert _replyread._reader().early[peer] == -_replyread._SKIP
    assert echo.echo.call_one("x").get(timeout=10) == "x"
    assert _replyread._reader().early[peer] == 1 - _replyread._SKIP


def test_a_call_made_while_an_await_of_the_same_loop_reads_the_connection_leaves_it_to_that_await(echo: Any, gate: Any) -> None:
    import asyncio

    async def main() -> tuple[str, str]:
        assert await _await_read_on_loop(echo, gate("warm")) == "in"
        c = _replyread._reader().claims[(echo._procs[0].addr, echo._name)]
        g = gate("a")
        pending = echo.gated.call_one(g.path)

        async def first() -> str:
            return str(await pending)

        task = asyncio.ensure_future(first())
        deadline = time.monotonic() + 20
        while c.state != c.IDLE and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # until the task's await reads the connection on this loop
        assert c.state == c.IDLE
        second = echo.echo.call_one("b")  # queued behind the first in the actor
        # the await still reads the connection: the I/O thread does not watch it beside the loop
        assert c.state == c.IDLE
        g.open()
        return await task, await second

    got, seen = _loop_reads(echo, main)
    assert got == ("in", "b") and seen
    assert echo.echo.call_one("c").get(timeout=10) == "c"
