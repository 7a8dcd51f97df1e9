"""A message for many procs goes to each host's allocator once and is relayed from there;
messages from one sender to one actor still arrive in the order they were sent, whichever
path each took. (Across real hosts: test_multihost.py.)

By default only other hosts' allocators relay; here, on one host, the local allocator is made
to relay too (``fanout_local``), and a test checks that by default it does not."""

from __future__ import annotations

import hashlib
import logging
import os
import threading

import pytest
from conftest import run_script, wait_for

from monarch_nb._runtime.runtime import Runtime
from monarch_nb._runtime.transport import Security
from monarch_nb._wire import frames as wire
from monarch_nb._wire.serialize import dumps, loads
from monarch_nb.actor import Actor, current_rank, endpoint
from monarch_nb.config import Config
from monarch_nb.errors import ActorError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def relay_on_this_host():
    """These tests run on one host: relay through its allocator too (by default only other
    hosts' allocators relay; test_multihost.py covers that)."""
    from monarch_nb.actor import _context

    rt = _context.runtime()
    saved = rt.cfg
    rt.cfg = saved.replace(fanout_local=True)
    yield
    rt.cfg = saved


class Log(Actor):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    @endpoint
    def add(self, who: str, i: int) -> None:
        self.seen.append((who, i))

    @endpoint
    def digest(self, x: bytes) -> tuple[str, int]:
        return hashlib.sha256(x).hexdigest(), os.getpid()

    @endpoint
    def seen_by(self) -> tuple[int, list[tuple[str, int]]]:
        return current_rank().rank, self.seen


def relayed(allocator) -> dict[str, int]:
    from monarch_nb import introspect

    (a,) = [a for a in introspect.status([allocator.addr])["allocators"] if a.get("addr") == allocator.addr]
    return a["relayed"]


def test_broadcast_is_one_send_to_the_allocator_and_mixed_paths_keep_order(allocator):
    pm = allocator.hosts.spawn_procs(per_host={"gpus": 4}, name="fan")
    log = pm.spawn("log", Log)
    before = relayed(allocator)
    n = 300
    for i in range(n):
        if i % 3 == 0:
            log.add.broadcast("main", i)  # through the allocator
        elif i % 7 == 0:
            log.slice(gpus=i % 4).add.call_one("main", i).get(timeout=30)  # straight to the proc, waited for
        else:
            log.slice(gpus=i % 4).add.broadcast("main", i)  # straight to the proc
    after = relayed(allocator)
    # each 4-proc broadcast was one message to the allocator and four deliveries from it
    fanned = len(range(0, n, 3))
    assert after["messages"] - before["messages"] == fanned
    assert after["deliveries"] - before["deliveries"] == 4 * fanned
    for rank, seen in log.seen_by.call().get(timeout=30).values():
        assert seen == [("main", i) for i in range(n) if i % 3 == 0 or i % 4 == rank], f"rank {rank}"
    pm.stop().get(timeout=20)


def test_a_large_buffer_relayed_to_several_procs_arrives_intact_and_leaves_nothing_in_shm(allocator, monkeypatch):  # type: ignore[no-untyped-def]
    from monarch_nb.actor import _context

    # without shared memory of its own this controller relays even a large buffer through
    # this host's allocator, which writes it to shared memory once and links it to each proc
    monkeypatch.setattr(_context.runtime().sender, "shm", None)
    pm = allocator.hosts.spawn_procs(per_host={"gpus": 4}, name="bigfan")
    log = pm.spawn("log", Log)
    log.seen_by.call().get(timeout=30)
    before = relayed(allocator)
    x = os.urandom(9 << 20)
    got = log.digest.call(x).get(timeout=30).values()
    assert relayed(allocator)["messages"] - before["messages"] == 1
    assert [d for d, _ in got] == [hashlib.sha256(x).hexdigest()] * 4
    alloc_pid = allocator.info["pid"]
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"mnb-{alloc_pid}-")]
    assert left == [], f"the allocator left {left} in /dev/shm"
    pm.stop().get(timeout=20)


def test_threads_keep_their_order_and_a_later_call_sees_everything_sent_before(allocator):  # type: ignore[no-untyped-def]
    pm = allocator.hosts.spawn_procs(per_host={"gpus": 3}, name="threads")
    log = pm.spawn("log", Log)
    errors: list[BaseException] = []

    def sender(who: str) -> None:
        try:
            for i in range(150):
                if i % 2:
                    log.add.broadcast(who, i)
                else:
                    log.slice(gpus=i % 3).add.broadcast(who, i)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for rank, seen in log.seen_by.call().get(timeout=30).values():
        for k in range(4):
            mine = [i for who, i in seen if who == f"t{k}"]
            assert mine == [i for i in range(150) if i % 2 or i % 3 == rank], f"rank {rank}, thread t{k}"
    pm.stop().get(timeout=20)


def test_spawn_goes_through_the_allocator_once(allocator):
    pm = allocator.hosts.spawn_procs(per_host={"gpus": 4}, name="spawnfan")
    before = relayed(allocator)
    log = pm.spawn("log", Log)
    after = relayed(allocator)
    assert (after["messages"] - before["messages"], after["deliveries"] - before["deliveries"]) == (1, 4)
    assert sorted(r for r, _ in log.seen_by.call().get(timeout=30).values()) == [0, 1, 2, 3]
    pm.stop().get(timeout=20)


def test_the_allocator_relays_only_to_its_own_procs(allocator):
    from monarch_nb.actor import _context

    rt = _context.runtime()
    got: list[BaseException] = []
    done = threading.Event()

    def on_reply(index: int, status: int, body, bufs) -> None:
        got.append(loads(body, bufs))
        done.set()

    port = rt.open_port(on_reply)
    body, bufs = dumps(((), {}))
    stranger = "tcp://127.0.0.1:9"
    dests = ((stranger, 0, rt.addr_for(allocator.addr), "probe.1", 1),)
    rt.send(allocator.addr, wire.encode(wire.FANOUT, ("x", "y", port, ((), ()), "", dests), body, bufs))
    assert done.wait(10), "no answer to a relay request for a stranger's address"
    rt.close_port(port)
    (err,) = got
    assert isinstance(err, ActorError) and "has no proc at tcp://127.0.0.1:9" in str(err)


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.cond = threading.Condition()

    def sys_note(self, i: int) -> None:
        with self.cond:
            self.seen.append(i)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10) -> list[int]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.seen) >= n, timeout), self.seen
            return list(self.seen)


@pytest.fixture
def pair(tmp_path):
    """Two bare runtimes: a receiver with a recording system actor, and a sender."""
    rdir = str(tmp_path)
    cfg = Config(heartbeat_interval=0.1, order_gap_timeout=0.5)
    rx = Runtime(cfg, Security(), rdir, label="receiver").start()
    tx = Runtime(cfg, Security(), rdir, label="sender").start()
    rec = rx.system["rec"] = _Recorder()
    yield rx, tx, rec
    tx.close()
    rx.close()


def _note(tx: Runtime, to: str, i: int, seq: int, stream: str = "s.1") -> None:
    body, bufs = dumps(((i,), {}))
    tx.send(to, wire.encode(wire.ACTOR, ("rec", "note", "", 0, 0, ((), ()), "", stream, seq), body, bufs))


def test_receiver_holds_a_message_that_overtook_an_earlier_one(pair):
    rx, tx, rec = pair
    _note(tx, rx.ipc_addr, 3, seq=3)
    _note(tx, rx.ipc_addr, 2, seq=2)
    _note(tx, rx.ipc_addr, 100, seq=1, stream="other.1")  # another sender's stream is not held up
    assert rec.wait(1) == [100]
    _note(tx, rx.ipc_addr, 1, seq=1)
    assert rec.wait(4) == [100, 1, 2, 3]


def test_receiver_drops_a_replayed_message(pair, caplog):
    rx, tx, rec = pair
    _note(tx, rx.ipc_addr, 1, seq=1)
    _note(tx, rx.ipc_addr, 1, seq=1)
    _note(tx, rx.ipc_addr, 2, seq=2)
    assert rec.wait(2) == [1, 2]
    wait_for(lambda: rx.dropped_frames == 1, 5, "the replay to be counted")
    assert rec.seen == [1, 2]


def test_a_lost_message_delays_later_ones_only_for_the_gap_timeout(pair, caplog):
    rx, tx, rec = pair
    caplog.set_level(logging.WARNING, logger="monarch_nb._runtime.receiving")
    _note(tx, rx.ipc_addr, 1, seq=1)
    _note(tx, rx.ipc_addr, 3, seq=3)  # 2 never comes
    assert rec.wait(1) == [1]
    assert rec.wait(2) == [1, 3]
    assert any("never arrived" in r.getMessage() for r in caplog.records)


def test_foreign_wire_version_is_refused_with_a_reason_at_the_caller(allocator):
    code = f"""
import monarch_nb._wire.frames as f
f.VERSION = 2
f._HEADS = {{k: f.MAGIC + bytes([2, k[0], k[1]]) for k in f._HEADS}}
from monarch_nb.actor import _context
from monarch_nb.errors import VersionMismatchError
try:
    _context.client().connect({allocator.addr!r}, timeout=10)
    print("CONNECTED")
except VersionMismatchError as e:
    print("REFUSED", e)
"""
    r = run_script(code)
    assert "REFUSED" in r.stdout, r.stdout + r.stderr
    assert f"speaks wire version {wire.VERSION}" in r.stdout and "got a message of version 2" in r.stdout, r.stdout
    assert "same monarch_nb version" in r.stdout
    wait_for(lambda: "wire version 2" in allocator.logtext(), 10, "the allocator to log the drop")


def test_refusal_frames_are_recognised() -> None:
    f = wire.refusal("why not")
    assert wire.refusal_reason(f) == "why not"
    assert wire.refusal_reason(b"MNB\x03\x01") is None
    with pytest.raises(Exception, match="refused by the peer: why not"):
        wire.decode([f])


@pytest.mark.parametrize("setting", ["fanout_min=0", "fanout_local=False"])
def test_no_relay_when_disabled_or_on_this_host_by_default(allocator, setting):
    code = f"""
from monarch_nb.config import configure
configure({setting})
from monarch_nb.actor import Actor, endpoint, attach_to_workers
from monarch_nb import introspect
class W(Actor):
    @endpoint
    def ping(self):
        return 1
hosts = attach_to_workers(workers=[{allocator.addr!r}], ca="trust_all_connections")
pm = hosts.spawn_procs(per_host={{"gpus": 3}}, name="nofan")
w = pm.spawn("w", W)
before = introspect.status([{allocator.addr!r}])["allocators"][0]["relayed"]
assert w.ping.call().get(timeout=20).values() == [1, 1, 1]
after = introspect.status([{allocator.addr!r}])["allocators"][0]["relayed"]
print("RELAYED", after["messages"] - before["messages"])
pm.stop().get(timeout=20)
"""
    r = run_script(code, env={"MONARCH_NB_RUNTIME_DIR": allocator.rdir})
    assert "RELAYED 0" in r.stdout, r.stdout + r.stderr
