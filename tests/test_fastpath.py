"""The direct AF_UNIX path between processes of one host (monarch_nb/_runtime/fastpath.py)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest
from conftest import wait_for

from monarch_nb._runtime import fastpath
from monarch_nb._runtime.runtime import Runtime
from monarch_nb._runtime.transport import Security
from monarch_nb._wire import frames as wire
from monarch_nb._wire.serialize import dumps
from monarch_nb.actor import Actor, endpoint
from monarch_nb.config import Config

pytestmark = pytest.mark.timeout(60)


def _wire_bytes(frames: list[bytes]) -> bytes:
    """What a Sender writes for ``frames``, captured off a real socket pair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out = bytearray()

    def read() -> None:
        while chunk := b.recv(1 << 20):
            out.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    with a, b:
        s = fastpath.Sender.__new__(fastpath.Sender)
        s.sock, s._q = a, None
        s.send(frames)  # blocks while the socket buffer is full: the reader drains it
        a.shutdown(socket.SHUT_WR)
        reader.join(10)
    return bytes(out)


def _receive(data: bytes, chunk: int, max_bytes: int = 1 << 30) -> tuple[list[list[bytes]], bool]:
    """Feed ``data`` to a Receiver through a real socket, ``chunk`` bytes per write."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setblocking(False)
    got: list[list[bytes]] = []
    rx = fastpath.Receiver(b, lambda fr: got.append([bytes(f) for f in fr]), max_bytes, "test")
    alive = True
    with a, b:
        for i in range(0, len(data), chunk):
            part = memoryview(data)[i : i + chunk]
            while part and alive:  # a write never waits on a reader that is this same thread
                n = a.send(part[: 1 << 16])
                part = part[n:]
                alive = rx.on_readable()
            if not alive:
                break
        if alive:
            a.shutdown(socket.SHUT_WR)
            alive = rx.on_readable()
    return got, alive


def test_messages_survive_any_split_into_reads() -> None:
    small = [[b"head-1"], [b"h2", b"two", b""], [b"h3"] * 3]
    # frames larger than the read buffer (256 KiB) are read straight into their own buffer
    large = [[b"h4", b"x" * 70_000, b""], [b"h5", os.urandom(300_000), b"tail"], [b"last"]]
    for msgs, chunks in ((small, (1, 2, 5)), (small + large, (13, 4096, 65_537, 1 << 30))):
        data = b"".join(_wire_bytes(m) for m in msgs)
        for chunk in chunks:
            got, alive = _receive(data, chunk)
            assert got == msgs, chunk
            assert not alive  # the writer closed: the connection is over


def test_a_lone_message_takes_one_read_and_a_burst_reads_until_drained() -> None:
    class Counting(socket.socket):
        reads = 0

        def recv_into(self, *args: Any) -> int:
            Counting.reads += 1
            return super().recv_into(*args)

    a, raw = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = Counting(fileno=raw.detach())
    b.setblocking(False)
    got: list[list[bytes]] = []
    rx = fastpath.Receiver(b, lambda fr: got.append([bytes(f) for f in fr]), 1 << 30, "test")
    with a, b:
        a.sendall(_wire_bytes([b"reply"]))
        assert rx.on_readable() and got == [[b"reply"]]
        # a reply, one of a call's many: no second read that could only fail with EAGAIN
        assert Counting.reads == 1
        a.sendall(b"".join(_wire_bytes([b"m%d" % i]) for i in range(3)))
        assert rx.on_readable() and len(got) == 4
        assert Counting.reads == 3  # several messages in one read: read on until the socket is empty
        a.sendall(_wire_bytes([b"last"]))
        a.shutdown(socket.SHUT_WR)
        assert rx.on_readable() and got[-1] == [b"last"]
        assert not rx.on_readable()  # the level-triggered loop calls again: the end of the connection


def test_an_oversized_message_drops_the_connection(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.fastpath")
    data = _wire_bytes([b"small"]) + _wire_bytes([b"h", b"y" * 5000])
    got, alive = _receive(data, len(data), max_bytes=1000)
    assert got == [[b"small"]] and not alive
    assert "a message of 2 frames and 5001 bytes (limit 1000)" in caplog.text


@pytest.fixture
def pair(tmp_path):
    cfg = Config(heartbeat_interval=0.1)
    rx = Runtime(cfg, Security(), str(tmp_path), label="rx").start()
    tx = Runtime(cfg, Security(), str(tmp_path), label="tx").start()
    got: list[tuple[int, bytes]] = []
    cond = threading.Condition()

    def on_port(index: int, status: int, body, bufs) -> None:
        with cond:
            got.append((index, bytes(body)))
            cond.notify_all()

    port = rx.open_port(on_port)

    def wait(n: int) -> list[tuple[int, bytes]]:
        with cond:
            assert cond.wait_for(lambda: len(got) >= n, 10), got
            return list(got)

    yield rx, tx, port, wait
    tx.close()
    rx.close()


def test_runtimes_of_one_host_talk_directly_and_in_order(pair) -> None:
    rx, tx, port, wait = pair
    path = fastpath.path_for(rx.ipc_addr)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    big = os.urandom(3 << 20)
    for i in range(50):
        tx.send(rx.ipc_addr, wire.encode(wire.PORT, (port, i, wire.ITEM), big if i == 25 else b"%d" % i))
    got = wait(50)
    assert [i for i, _ in got] == list(range(50))
    assert got[25][1] == big and got[7][1] == b"7"
    assert len(rx.transport.fast_in) == 1, "the messages did not take the direct path"


def test_a_thread_that_exits_closes_its_connections(pair) -> None:
    rx, tx, port, wait = pair
    for i in range(5):  # short-lived threads (returns_future makes one per call) must not leak sockets
        t = threading.Thread(target=tx.send, args=(rx.ipc_addr, wire.encode(wire.PORT, (port, i, wire.ITEM), b"x")))
        t.start()
        t.join(10)
    wait(5)
    gc.collect()
    wait_for(lambda: not rx.transport.fast_in, 10, "the receiver to see every thread's connection close")
    assert not tx.transport.fast_out


def test_the_io_thread_sends_through_zmq(pair) -> None:
    rx, tx, port, wait = pair
    tx.call_soon(tx.send, rx.ipc_addr, wire.encode(wire.PORT, (port, 0, wire.ITEM), b"from the loop"))
    assert wait(1) == [(0, b"from the loop")]
    assert not rx.transport.fast_in


def test_a_dead_peer_costs_the_sender_nothing(pair) -> None:
    rx, tx, port, wait = pair
    addr = rx.ipc_addr
    tx.send(addr, wire.encode(wire.PORT, (port, 0, wire.ITEM), b"before"))
    wait(1)
    rx.close()
    assert not os.path.exists(fastpath.path_for(addr))
    for i in range(20):  # a broken pipe is not the caller's error; later sends fall back to zmq
        tx.send(addr, wire.encode(wire.PORT, (port, i, wire.ITEM), b"into the void"))


def test_direct_path_off(tmp_path) -> None:
    cfg = Config(direct_ipc=False)
    rx = Runtime(cfg, Security(), str(tmp_path), label="rx").start()
    tx = Runtime(cfg, Security(), str(tmp_path), label="tx").start()
    try:
        assert not os.path.exists(fastpath.path_for(rx.ipc_addr))
        seen = threading.Event()
        port = rx.open_port(lambda *a: seen.set())
        body, bufs = dumps(1)
        tx.send(rx.ipc_addr, wire.encode(wire.PORT, (port, 0, wire.ITEM), body, bufs))
        assert seen.wait(10)
    finally:
        tx.close()
        rx.close()


def test_another_user_cannot_connect(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.transport")
    rdir = tempfile.mkdtemp(prefix="mnbu-", dir="/tmp")  # every parent directory is searchable
    rx = Runtime(Config(), Security(), rdir, label="rx").start()
    path = fastpath.path_for(rx.ipc_addr)
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        f"    s.connect({path!r})\n"
        "except PermissionError:\n"
        "    print('DENIED'); sys.exit()\n"
        "print('CONNECTED', flush=True)\n"
        "try:\n"
        "    s.sendall(b'x' * 64)\n"
        "except OSError:\n"
        "    pass  # the runtime may already have hung up\n"
    )
    # the socket is 0600 in a private directory: the file system refuses another uid
    os.chmod(os.path.dirname(path), 0o755)
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "DENIED", r.stdout + r.stderr
        # and if the file's mode were loosened, the runtime checks the peer's uid itself
        os.chmod(path, 0o666)
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "CONNECTED", r.stdout + r.stderr
        wait_for(lambda: "refused a direct connection from uid 65534" in caplog.text, 10, "the refusal")
        assert not rx.transport.fast_in
    finally:
        rx.close()
        shutil.rmtree(rdir, ignore_errors=True)


class _Recorder(Actor):
    """A sync actor: its thread reads the caller's connection itself once idle."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def record(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    def get_seen(self) -> list[int]:
        return self.seen

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint
    def gated(self, path: str) -> str:
        import _gate

        return "done" if _gate.wait(path, 30) else "the test never opened the gate"

    @endpoint
    def reads_own_connection(self) -> bool:
        from monarch_nb.actor import _context

        # white-box: the path this test is about was taken (the slot holds a claimed connection)
        return any(s.obj is self and s._claim is not None for s in _context.runtime().actors.values())  # type: ignore[attr-defined]


class _AsyncRecorder(Actor):
    """An async actor: its loop reads the caller's connection itself once idle. ``slow`` blocks
    the loop (a blocking call in an ``async def``, as real code has), so only the I/O thread
    can read the connection meanwhile."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    async def record(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    async def get_seen(self) -> list[int]:
        return self.seen

    @endpoint
    async def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint
    async def gated(self, path: str) -> str:
        import _gate

        return "done" if _gate.wait(path, 30) else "the test never opened the gate"

    @endpoint
    async def reads_own_connection(self) -> bool:
        from monarch_nb.actor import _context

        return any(s.obj is self and s._claim is not None for s in _context.runtime().actors.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", [_Recorder, _AsyncRecorder], ids=["sync", "async"])
def test_an_idle_actor_reads_its_calls_itself_and_hands_back_the_rest(allocator: Any, cls: type, gate: Any) -> None:
    procs = allocator.hosts.spawn_procs(per_host={"gpus": 1}, name="claim")
    try:
        a = procs.spawn("a", cls)
        b = procs.spawn("b", cls)
        assert a.slow.call_one(0).get(timeout=10) == "done"
        # called alone, an idle actor takes its caller's connection within a few calls (when
        # the proc's I/O thread finds it idle: on a loaded machine not always by the third)
        assert any(a.reads_own_connection.call_one().get(timeout=10) for _ in range(40))
        # one thread's calls to two actors of one proc, on one connection: each keeps its order
        for i in range(200):
            (a if i % 3 else b).record.broadcast(i)
            if i % 50 == 0:
                assert a.slow.call_one(0).get(timeout=10) == "done"
        assert a.get_seen.call_one().get(timeout=10) == [i for i in range(200) if i % 3]
        assert b.get_seen.call_one().get(timeout=10) == [i for i in range(200) if not i % 3]
        # while a runs a long endpoint, the proc's I/O thread takes the connection back: b answers
        a.slow.call_one(0).get(timeout=10)
        held = gate("held")
        slow = a.gated.call_one(held.path)
        assert b.slow.call_one(0).get(timeout=10) == "done"
        assert not slow.done()  # b answered while a was still in its call
        a.record.broadcast(-1)  # queued behind the slow call, in order
        held.open()
        assert slow.get(timeout=10) == "done"
        assert a.get_seen.call_one().get(timeout=10)[-1] == -1
        # and an idle actor takes its connection again (b may hold it for a while, and one that
        # had to hand a message back waits a few messages before it claims again)
        assert any(a.reads_own_connection.call_one().get(timeout=10) for _ in range(40))
    finally:
        procs.stop().get(timeout=30)


def test_a_peer_that_does_not_accept_is_said_at_the_sender_and_holds_up_no_call(tmp_path, caplog, monkeypatch) -> None:
    """A rank at its descriptor limit cannot accept a second controller's connection: that
    caller's call waited with no word at all (only the rank's log said why). And the call that
    opened the connection sat in ``call_one()`` for the whole 5 s greeting wait, so a
    ``get(timeout=20)`` after it returned after 25 s."""
    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.fastpath")
    monkeypatch.setattr(fastpath, "GREETING_S", 1.0)
    path = str(tmp_path / "full.fast")
    lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lis.bind(path)
    lis.listen(1)  # never accepted, as by a process with no descriptor to accept with
    try:
        t0 = time.monotonic()
        conn = fastpath.Sender(path)
        conn.send([b"queued for when it accepts"])  # the sending thread is free
        assert time.monotonic() - t0 < fastpath.HANDOVER_S + 0.4  # not GREETING_S
        wait_for(
            lambda: (
                f"the process at {path} has not accepted a connection from this one within 1 s: it is out of file" in caplog.text
            ),
            timeout=10,
            what="the sender's warning",
        )
    finally:
        lis.close()  # the connection it never accepted ends, and the writer with it


def test_a_reply_that_finds_no_descriptor_is_said_once_and_leaves_the_actor_thread_alive(caplog) -> None:
    """The actor's thread, out of descriptors to connect back to a new caller, raised in its
    reply and died: every later call to that actor, from any controller, hung."""
    from monarch_nb._runtime import _fdlimit
    from monarch_nb._runtime.sending import Sender

    def no_descriptor(addr: str, frames: list[Any]) -> None:
        raise _fdlimit.out_of_descriptors(f"connecting to {addr}", "this rank")

    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.sending")
    s = Sender(Config(), no_descriptor, {}, uid="u", hostname="h")
    addr = "ipc:///nowhere/controller.sock"
    for _ in range(3):
        s.send_port(addr, 7, 0, wire.OK, "answer", "h", "echo")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"the reply of h.echo to {addr} was not sent (nor any other until"), said
    assert "[Errno 24] connecting to ipc:///nowhere/controller.sock needs a file descriptor" in said[0]
