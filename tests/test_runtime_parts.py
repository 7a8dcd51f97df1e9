"""The runtime's parts, each on its own: the sender's frames go to a list, the receiver is
handed frames, supervision's clock is a variable, and a transport carries bytes without a
runtime around it. (The parts together: test_fastpath.py, test_fanout.py.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import math
import os
import threading
import time
import weakref
from typing import Any

import pytest
from conftest import wait_for

from monarch_nb._runtime._pids import activity
from monarch_nb._runtime.receiving import Receiver
from monarch_nb._runtime.runtime import ReplyPort, Runtime
from monarch_nb._runtime.sending import Sender, Target
from monarch_nb._runtime.supervision import Supervision
from monarch_nb._runtime.transport import Security, Transport
from monarch_nb._wire import frames as wire
from monarch_nb._wire.serialize import dumps, dumps_call, loads
from monarch_nb.config import Config
from monarch_nb.errors import SupervisionError

pytestmark = pytest.mark.timeout(10)

A, B = "ipc:///tmp/a.sock", "ipc:///tmp/b.sock"
REMOTE = "tcp://10.0.0.2:5000"


class Wire:
    """Where a sender's frames go: (address, decoded message) in sending order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...]]] = []
        self.frames: list[list[Any]] = []

    def __call__(self, addr: str, frames: list[Any]) -> None:
        self.frames.append(frames)
        self.sent.append((addr, wire.decode(frames)))


def _sender(cfg: Config | None = None) -> tuple[Sender, Wire, dict[str, SupervisionError]]:
    out, dead = Wire(), {}
    return Sender(cfg or Config(shm_min_bytes=0), out, dead, uid="me", hostname="h"), out, dead


def test_sender_numbers_each_destination_its_own_stream() -> None:
    s, out, _ = _sender()
    body, bufs = dumps(((), {}))
    for _ in range(2):
        assert s.send_many([Target(A, "", 0, ""), Target(B, "", 1, "")], "act", "m", body, bufs) == []
    streams = [(addr, meta[7], meta[8]) for addr, (_, meta, *_) in out.sent]
    assert streams == [(A, "me.1", 1), (B, "me.2", 1), (A, "me.1", 2), (B, "me.2", 2)]


def test_sender_sends_one_fanout_per_remote_allocator() -> None:
    s, out, _ = _sender(Config(shm_min_bytes=0, fanout_min=2))
    body, bufs = dumps(((), {}))
    targets = [Target(f"tcp://10.0.0.2:{6000 + i}", REMOTE, i, "tcp://10.0.0.1:1") for i in range(3)]
    assert s.send_many(targets, "act", "m", body, bufs, port=7) == []
    [(addr, (kind, meta, *_))] = out.sent
    assert (addr, kind) == (REMOTE, wire.FANOUT)
    assert [(d[0], d[1], d[4]) for d in meta[5]] == [(t.addr, t.call_index, 1) for t in targets]


def test_sender_refuses_a_dead_peer_and_reports_it_per_target() -> None:
    s, out, dead = _sender()
    dead[B] = SupervisionError("gone")
    body, bufs = dumps(((), {}))
    failed = s.send_many([Target(A, "", 0, ""), Target(B, "", 1, "")], "act", "m", body, bufs)
    assert [(i, str(e)) for i, e in failed] == [(1, str(dead[B]))]
    assert [addr for addr, _ in out.sent] == [A]
    with pytest.raises(SupervisionError):
        s.send(B, [b""])


class Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def sys_note(self, i: int) -> int:
        self.seen.append(i)
        return i * 10


def _receiver(cfg: Config | None = None) -> tuple[Receiver, Wire, Recorder]:
    s, out, _ = _sender()
    rx = Receiver(cfg or Config(), s, label="rx", hostname="h", pid=1, spawn=lambda c: c.close())
    rec = rx.system["rec"] = Recorder()
    return rx, out, rec


def _actor_msg(i: int, seq: int, reply: str = "", stream: str = "s.1", actor: str = "rec") -> list[Any]:
    body, bufs = dumps(((i,), {}))
    return wire.encode(wire.ACTOR, (actor, "note", reply, 5 if reply else 0, 0, ((), ()), "", stream, seq), body, bufs)


def test_receiver_delivers_a_stream_in_order_and_drops_replays(caplog) -> None:
    rx, _, rec = _receiver()
    for i, seq in [(3, 3), (1, 1), (1, 1), (2, 2)]:
        rx.dispatch(_actor_msg(i, seq))
    assert rec.seen == [1, 2, 3]
    assert rx.dropped == 1


def test_receiver_answers_on_the_reply_port_and_routes_ports_to_handlers() -> None:
    rx, out, _ = _receiver()
    rx.dispatch(_actor_msg(4, 0, reply=B))
    [(addr, (kind, meta, body, bufs, _))] = out.sent
    assert (addr, kind, meta) == (B, wire.PORT, (5, 0, wire.OK))
    assert loads(body, bufs) == 40
    got: list[Any] = []
    port = rx.open_port(lambda index, status, body, bufs: got.append((index, status, loads(body, bufs))))
    body, bufs = dumps("v")
    rx.dispatch(wire.encode(wire.PORT, (port, 2, wire.OK), body, bufs))
    rx.close_port(port)
    rx.dispatch(wire.encode(wire.PORT, (port, 3, wire.OK), body, bufs))  # closed: ignored
    assert got == [(2, wire.OK, "v")]


def test_receiver_takes_a_one_frame_port_value_as_a_multipart_one(caplog) -> None:
    # a reply of one frame (the direct path's common case) is read without the general decode:
    # same result as the same value in frames of its own, and anything malformed still goes
    # to the general decode, which drops it with a reason
    rx, _, _ = _receiver()
    got: list[Any] = []
    port = rx.open_port(lambda index, status, body, bufs: got.append((index, status, loads(body, bufs), list(bufs))))
    body, bufs = dumps({"x": 1})
    [frame] = wire.encode(wire.PORT, (port, 7, wire.ERROR), body, bufs)
    rx.dispatch([frame])
    assert got == [(7, wire.ERROR, {"x": 1}, [])]
    big = b"y" * (wire.INLINE_MAX + 1)  # a payload frame of its own: the general decode
    rx.dispatch(wire.encode(wire.PORT, (port, 8, wire.OK), *dumps(big)))
    assert got[1][:3] == (8, wire.OK, big)
    rx.dispatch([frame[:12]])  # truncated meta
    bad = wire.encode(wire.PORT, ("p", 1, 0), body)[0]  # no such port: ignored
    rx.dispatch([bad])
    assert len(got) == 2 and rx.dropped == 1
    rx.dispatch(_actor_msg(4, 0, reply=B))  # any other message of one frame: the general way
    assert rx.system["rec"].seen == [4]


def test_a_small_message_is_one_frame_the_general_decode_reads() -> None:
    # the hot paths' shortcuts (a call's arguments, a one-frame message) make the same bytes
    # as the general functions, and the pickler's shortcut takes only what it can write alike
    import pickle

    for args, kwargs in (((), {}), (("x", 1, 2.5, None, b"b"), {"k": [1, (2, 3)]}), ((list(range(17)),), {})):
        body, bufs = dumps_call(args, kwargs)
        assert (body, bufs) == dumps((args, kwargs)) and loads(body, bufs) == (args, kwargs)
    assert dumps((("x", 1), {"k": {"n": 2}}))[0] == pickle.dumps((("x", 1), {"k": {"n": 2}}), protocol=5)
    meta = ("a#1", "m", B, 3, 0, ((), ()), "c.1", "s.1", 7)
    body = dumps(((1,), {}))[0]
    one = wire.encode_one(wire.ACTOR, meta, body)
    assert [one] == wire.encode(wire.ACTOR, meta, body)
    kind, got, b, rest, table = wire.decode([one])
    assert (kind, got, bytes(b), rest, table) == (wire.ACTOR, meta, body, [], [])
    reply = wire.encode_one(wire.PORT, (5, 2, wire.OK), body)
    assert wire.port_value(reply)[:3] == (5, 2, wire.OK) and bytes(wire.port_value(reply)[3]) == body
    assert wire.port_value(one) is None and wire.port_value(reply[:9]) is None


def test_receiver_fails_a_call_to_an_unknown_actor_and_drops_garbage() -> None:
    rx, out, _ = _receiver()
    rx.dispatch(_actor_msg(1, 0, reply=B, actor="nobody"))
    [(addr, (kind, meta, body, bufs, _))] = out.sent
    assert (addr, kind, meta[2]) == (B, wire.PORT, wire.ERROR)
    assert "no actor named 'nobody'" in str(loads(body, bufs))
    rx.dispatch([b"not a frame"])
    rx.dispatch([])
    assert rx.dropped == 2


def test_receiver_relays_a_fanout_to_its_procs() -> None:
    rx, out, _ = _receiver()
    rx.resolve_proc = {"tcp://p0": A}.get
    body, bufs = dumps(((), {}))
    dests = (("tcp://p0", 0, "tcp://ctl", "c.1", 1), ("tcp://p1", 1, "tcp://ctl", "c.2", 1))
    rx.dispatch(wire.encode(wire.FANOUT, ("act", "m", 9, ((), ()), "call", dests), body, bufs))
    assert [(addr, kind, meta[:5], meta[7:]) for addr, (kind, meta, *_) in out.sent] == [
        (A, wire.ACTOR, ("act", "m", "tcp://ctl", 9, 0), ("c.1", 1)),  # relayed, numbering kept
        ("tcp://ctl", wire.PORT, (9, 1, wire.ERROR), ()),  # no such proc here: the caller hears why
    ]
    assert rx.relayed == [1, 1]


class IO:
    """Supervision's way out: ports it opens and messages it sends, recorded."""

    def __init__(self) -> None:
        self.handlers: list[Any] = []
        self.sent: list[tuple[str, str]] = []

    def open_port(self, handler: Any) -> int:
        self.handlers.append(handler)
        return len(self.handlers)

    def send_actor(self, addr: str, actor: str, method: str, body: bytes, buffers: list[Any], *, reply: tuple[str, int]) -> None:
        self.sent.append((addr, method))

    def addr_for(self, peer: str) -> str:
        return "ipc:///me"

    def call_soon(self, fn: Any, *args: Any) -> None:
        fn(*args)


def test_supervision_tells_waiting_ports_of_a_dead_peer_once_and_refuses_it_after() -> None:
    sup = Supervision(Config(), IO())
    told: list[tuple[int, str, BaseException]] = []
    sup.wait(1, lambda peer, e: told.append((1, peer, e)))
    sup.wait(2, lambda peer, e: told.append((2, peer, e)))
    sup.unwait(2)  # closed: told nothing
    err = SupervisionError("proc died")
    sup.peer_failed(A, err)
    sup.peer_failed(A, SupervisionError("again"))  # once only
    assert told == [(1, A, err)]
    assert sup.peer_error(A) is err and sup.dead[A] is err  # refused from now on


def test_supervision_declares_a_silent_allocator_and_its_procs_lost(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.supervision")
    now = [0.0]
    io = IO()
    sup = Supervision(Config(heartbeat_timeout=5.0), io, clock=lambda: now[0])
    sup.watch(REMOTE, A, "m", 0, "h2")
    assert io.sent == [(REMOTE, "subscribe")]
    lost: list[str] = []
    sup.peer_failure_callbacks.append(lambda peer, e: lost.append(peer))
    now[0] = 4.0
    sup.check(now[0], starved=False)
    assert io.sent[-1] == (REMOTE, "ping") and not lost
    pong = dumps(("pong",))
    io.handlers[0](0, wire.OK, *pong)  # the allocator answers: alive until 9 s
    now[0] = 8.0
    sup.check(now[0], starved=False)
    assert not lost
    now[0] = 20.0
    sup.check(now[0], starved=True)  # a late check is no evidence against the peer...
    assert not lost and io.sent[-1] == (REMOTE, "ping")
    now[0] = 24.0
    sup.check(now[0], starved=False)  # ...which has a whole timeout from then to answer
    assert not lost
    now[0] = 25.5
    sup.check(now[0], starved=False)
    assert lost == [A, REMOTE]
    assert "no heartbeat for 5.5 s" in str(sup.peer_error(A))


@pytest.mark.parametrize("doing", ["computes", "sleeps", "is stopped", "exited"])
def test_a_silent_allocator_of_this_host_is_judged_by_its_process(doing: str) -> None:
    # a loaded host (128 procs stopping on two cores) starved an allocator past the timeout,
    # and calling it lost failed every mesh on it: one still running is given SLOW_FACTOR
    # timeouts; one asleep with no CPU spent (hung), stopped or gone is lost after one
    import signal
    import subprocess
    import sys

    from monarch_nb._runtime._pids import SLOW_FACTOR

    code = {"computes": "print('computing', flush=True)\nwhile True: pass", "exited": "pass"}
    child = subprocess.Popen([sys.executable, "-c", code.get(doing, "import time; time.sleep(60)")], stdout=subprocess.PIPE)
    try:
        if doing == "computes":
            # in its loop from now on: its start-up may wait on the disk (the two looks below are
            # microseconds apart in real time, so only its state can say it is at work)
            assert child.stdout is not None and child.stdout.readline() == b"computing\n"
        elif doing == "is stopped":
            os.kill(child.pid, signal.SIGSTOP)
            wait_for(lambda: activity(child.pid)[0] == "stopped", 30, "the child to stop")
        elif doing == "exited":
            child.wait(timeout=30)
        elif doing == "sleeps":
            # asleep from now on: its start-up's CPU is behind it
            wait_for(lambda: activity(child.pid)[0] == "waiting", 30, "the child to sleep")
        now = [0.0]
        sup = Supervision(Config(heartbeat_interval=0.5, heartbeat_timeout=2.0), IO(), clock=lambda: now[0])
        sup.watch_allocator(A, "here", child.pid)
        lost: list[str] = []
        sup.peer_failure_callbacks.append(lambda peer, e: lost.append(peer))
        for t in (1.5, 2.5):
            now[0] = t
            sup.check(t, starved=False)
        if doing != "computes":
            assert lost == [A] and "no heartbeat for 2.5 s" in str(sup.peer_error(A))
            return
        assert not lost, "running: a slow host, not a lost allocator"
        now[0] = SLOW_FACTOR * 2.0 - 0.5
        sup.check(now[0], starved=False)
        assert not lost
        now[0] = SLOW_FACTOR * 2.0 + 0.5
        sup.check(now[0], starved=False)
        assert lost == [A], "a running allocator that never answers is lost in the end"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def test_a_reply_port_forgets_what_was_answered_or_closed(tmp_path) -> None:
    rt = Runtime(Config(), Security(), str(tmp_path))  # not started: no thread, no sockets
    try:
        failed: list[int] = []
        replies = ReplyPort(rt, lambda *a: None)
        for i, peer in enumerate([A, A, B]):
            replies.owe(i, peer, lambda e, i=i: failed.append(i))
        replies.answered(0)
        rt.peer_failed(A, SupervisionError("A died"))
        assert failed == [1]  # 0 had answered
        replies.close()
        rt.peer_failed(B, SupervisionError("B died"))
        assert failed == [1]  # closed: nothing is owed any more
        replies.close()
        again = ReplyPort(rt, lambda *a: None)
        assert again.port != replies.port
        again.owe(0, A, lambda e: failed.append(99))  # owed by a dead peer: fails at once
        assert failed == [1, 99]
        again.close()
    finally:
        rt.close()


def test_a_reply_port_is_one_supervision_record_and_fails_each_index_once(tmp_path) -> None:
    rt = Runtime(Config(), Security(), str(tmp_path))  # not started: no thread, no sockets
    try:
        failed: list[tuple[int, str]] = []
        replies = ReplyPort(rt, lambda *a: None, lambda i, e: failed.append((i, str(e).rsplit(": ", 1)[-1])))
        for i, peer in enumerate([A, A, B, B]):
            replies.owe(i, peer)
        # a call to many peers costs supervision one record, not one per peer
        assert list(rt.supervision._waiters) == [replies.port]
        replies.answered(1)
        rt.peer_failed(A, SupervisionError("A died"))
        assert failed == [(0, "A died")]  # 1 had answered
        replies.fail(2, OSError("send failed"))
        rt.peer_failed(B, SupervisionError("B died"))
        assert failed == [(0, "A died"), (2, "send failed"), (3, "B died")]  # 2 failed once, by its send
        replies.fail(3, OSError("again"))
        assert len(failed) == 3
        replies.close()
        assert not rt.supervision._waiters
    finally:
        rt.close()


def test_a_reply_port_owed_by_many_procs_at_once(tmp_path) -> None:
    # owe_procs (a call to many actors): one loop, allocators watched once per proc, a proc
    # already dead fails its index at once through the port's own callback
    rt = Runtime(Config(), Security(), str(tmp_path))  # not started: no thread, no sockets
    try:
        rt.supervision.watch_allocator = lambda alloc, host: _Watched(alloc)  # type: ignore[method-assign]
        failed: list[tuple[int, str]] = []
        procs = [_Proc(A, REMOTE, "m", 0), _Proc(B, REMOTE, "m", 1), _Proc("ipc:///tmp/c.sock", "", "m", 2)]
        rt.peer_failed(B, SupervisionError("B died"))
        replies = ReplyPort(rt, lambda *a: None, lambda i, e: failed.append((i, str(e).rsplit(": ", 1)[-1])))
        replies.owe_procs([4, 5, 6], procs)
        assert failed == [(5, "B died")]
        assert rt.supervision.watched == {A, B}  # the allocator-less proc is not watched
        rt.peer_failed(A, SupervisionError("A died"))
        assert failed == [(5, "B died"), (4, "A died")]
        replies.answered(6)
        replies.close()
    finally:
        rt.close()


class _Proc:
    def __init__(self, addr: str, alloc: str, mesh: str, rank: int) -> None:
        self.addr, self.alloc, self.mesh, self.rank, self.host = addr, alloc, mesh, rank, "h"


class _Watched:
    def __init__(self, addr: str) -> None:
        self.addr, self.procs, self.lost = addr, {}, None


def test_a_closed_reply_port_leaves_no_cycle_behind(tmp_path) -> None:
    # a call's callbacks are closures over its port (and its replies): once closed, the call's
    # memory must go back at once, not wait for the cyclic collector (a 1 MiB echo got 2x slower)
    rt = Runtime(Config(), Security(), str(tmp_path))
    gc.disable()
    try:

        def call() -> weakref.ref[Any]:
            # as gather() does: the callback is a closure over the port
            def on_fail(index: int, err: BaseException) -> None:
                replies.answered(index)

            replies = ReplyPort(rt, lambda *a: None, on_fail)
            replies.owe(0, A)
            replies.close()
            return weakref.ref(on_fail)

        assert call()() is None
    finally:
        gc.enable()
        rt.close()


def test_header_field_positions_match_their_named_tuples() -> None:
    fields = wire.ActorMeta._fields
    named = {"actor": wire.ACTOR_NAME, "method": wire.METHOD, "reply_addr": wire.REPLY_ADDR, "reply_port": wire.REPLY_PORT}
    named |= {
        "call_index": wire.CALL_INDEX,
        "extent": wire.EXTENT,
        "call_id": wire.CALL_ID,
        "stream": wire.STREAM,
        "seq": wire.SEQ,
    }
    assert {f: fields.index(f) for f in fields} == named
    meta = wire.ActorMeta("a", "m", "ipc:///r", 3, 1, ((), ()), "c.1", "s.1", 7)
    kind, got, *_ = wire.decode(wire.encode(wire.ACTOR, tuple(meta), b"body"))
    assert (kind, wire.ActorMeta(*got)) == (wire.ACTOR, meta)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "zmq"])
def test_a_transport_carries_frames_to_another_inbox(tmp_path, direct: bool) -> None:
    loop = asyncio.new_event_loop()
    io = threading.Thread(target=loop.run_forever, daemon=True)
    io.start()
    cfg = Config(direct_ipc=direct)
    rx = Transport(cfg, Security(), str(tmp_path), loop, name="rx")
    tx = Transport(cfg, Security(), str(tmp_path), loop, name="tx")
    got: list[list[bytes]] = []
    opened: concurrent.futures.Future[None] = concurrent.futures.Future()

    def open_both() -> None:
        rx.open(lambda frames, *where: got.append([bytes(f) for f in frames]))
        tx.open(lambda *_: None)
        opened.set_result(None)

    try:
        loop.call_soon_threadsafe(open_both)
        opened.result(10)
        for i in range(3):
            tx.send(rx.ipc_addr, [b"head %d" % i, b"buffer"])
        wait_for(lambda: len(got) == 3, 10, "three messages")
        assert got == [[b"head %d" % i, b"buffer"] for i in range(3)]  # in order, frames intact
        assert bool(rx.fast_in) == direct
    finally:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def stop() -> None:
            rx.close_inboxes()
            tx.close_inboxes()
            loop.stop()
            done.set_result(None)

        loop.call_soon_threadsafe(stop)
        done.result(10)
        io.join(10)
        for t in (tx, rx):
            t.close_connections()
            t.terminate()
        loop.close()


def test_an_idle_runtime_wakes_seldom_and_heartbeats_again_once_it_watches(tmp_path, monkeypatch) -> None:
    # every wake-up of an idle proc is CPU its host's training does not get (16 procs a host):
    # with no allocator to ping and no message held it sweeps every IDLE_WATCH_S, and a watch
    # brings its heartbeats back at once, with their timeout as before
    from monarch_nb._runtime import runtime

    monkeypatch.setattr(runtime, "IDLE_WATCH_S", 1.0, raising=False)
    rt = Runtime(Config(heartbeat_interval=0.05, heartbeat_timeout=0.5), Security(), str(tmp_path)).start()
    ticks: list[float] = []
    sweep = rt.sender.sweep_shm

    def counted() -> None:
        ticks.append(time.monotonic())
        sweep()

    rt.sender.sweep_shm = counted  # type: ignore[method-assign]
    try:
        wait_for(lambda: len(ticks) >= 2, 5, "two idle sweeps")
        assert ticks[1] - ticks[0] > 0.8  # not every heartbeat_interval
        t0 = time.monotonic()
        alloc = "ipc://" + str(tmp_path / "nobody")
        rt.call_soon(rt.supervision.watch_allocator, alloc, "h")
        wait_for(lambda: rt.peer_error(alloc) is not None, 5, "the silent allocator declared lost")
        assert time.monotonic() - t0 < 0.5 + 0.4  # heartbeat_timeout, plus a tick or so, not IDLE_WATCH_S
        assert "no heartbeat" in str(rt.peer_error(alloc))
    finally:
        rt.close()


@pytest.mark.parametrize("fast", [True, False], ids=["uvloop", "asyncio"])
def test_ticks_on_the_grid_come_once_a_period(fast: bool) -> None:
    # libuv's timers run up to a millisecond early: a tick must not take the grid point it was
    # set for as the next one and run again at once (a burst of sweeps each tick)
    from monarch_nb._runtime.runtime import new_loop, sleep_to_tick

    loop = new_loop(fast)
    times: list[float] = []

    async def tick() -> None:
        for _ in range(10):
            await sleep_to_tick(loop, 0.1)
            times.append(loop.time())

    try:
        loop.run_until_complete(tick())
    finally:
        loop.close()
    # each on a grid point of its own (a tick runs at most a millisecond early, or late under load)
    points = [math.floor((t + 0.002) / 0.1) for t in times]
    assert len(set(points)) == len(points), [round(t % 0.1, 4) for t in times]


def test_a_runtime_without_a_client_stops_its_io_thread_before_the_interpreter_exits(tmp_path) -> None:
    # a process that used only the runtime (an RDMABuffer read, no actor call) finalized with
    # uvloop still running in the I/O thread: a timer firing then took the GIL of an interpreter
    # that was gone (SIGSEGV at exit, now and then). An exit hook registered before monarch_nb
    # is imported runs after monarch_nb's own, so it sees what finalization will see.
    import subprocess
    import sys

    script = (
        "import atexit, threading\n"
        "atexit.register(lambda: print('io alive', any("
        "t.name.startswith('monarch_nb-io') and t.is_alive() for t in threading.enumerate())))\n"
        "from monarch_nb.actor import _context\n"
        "rt = _context.runtime()\n"
        "print('started', rt._thread.is_alive())\n"
    )
    env = {**os.environ, "MONARCH_NB_RUNTIME_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=8, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["started True", "io alive False"], out.stdout
