"""The Monarch actor API on the embedded local allocator: real daemon, real procs."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import threading
import time
from typing import Any

import _gate
import pytest
from conftest import run_script, wait_for

from monarch_nb.actor import (
    Accumulator,
    Actor,
    ActorError,
    Channel,
    Future,
    Port,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    context,
    current_rank,
    current_size,
    endpoint,
    get_or_spawn_controller,
    send,
    this_host,
    this_proc,
)
from monarch_nb.errors import SupervisionError

pytestmark = pytest.mark.timeout(90)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words for it")


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.seen: list[int] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def record(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    def get_seen(self) -> list[int]:
        return self.seen

    @endpoint
    def where(self) -> tuple[int, dict[str, int], int, bool]:
        try:
            asyncio.get_running_loop()
            has_loop = True
        except RuntimeError:
            has_loop = False
        return current_rank().rank, current_size(), context().actor_instance.rank.rank, has_loop

    @endpoint
    def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    def slow(self, s: float) -> str:
        time.sleep(s)
        return "done"

    @endpoint(explicit_response_port=True)
    def ported(self, port: Port[int], x: int) -> None:
        port.send(x + 1)

    @endpoint
    def call_other(self, other, x: int) -> list[int]:
        return other.incr.call(x).get(timeout=10).values()

    @endpoint
    def unpicklable(self) -> object:
        return threading.Lock()

    @endpoint
    def fail_to(self, port: Port[int], v: object) -> str:
        try:
            port.exception(v)  # type: ignore[arg-type]
        except TypeError as e:
            port.exception(ValueError("the right way"))
            return str(e)
        return "sent"

    @endpoint
    def raise_odd(self, how: str, folder: str = "") -> None:
        rank = current_rank().rank
        if how == "unprintable":
            raise Unprintable(rank)
        if how == "long":
            raise ValueError(f"rank {rank} " + "x" * 100_000)
        # a class the procs import and the controller cannot (a package only the workers have)
        import sys

        sys.path.insert(0, folder)
        import procs_only_errors

        raise procs_only_errors.ProcsOnlyError(f"only the procs know this class (rank {rank})")

    def plain(self) -> str:
        return "plain"


class AsyncActor(Actor):
    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    @endpoint
    async def where(self) -> bool:
        await asyncio.sleep(0)
        return asyncio.get_running_loop() is not None

    @concurrent_endpoint
    async def overlap(self, s: float) -> int:
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(s)
        self.active -= 1
        return self.peak

    @endpoint
    async def cancelled(self, how: str) -> None:
        if how == "raise":
            raise asyncio.CancelledError()
        t = asyncio.ensure_future(asyncio.sleep(10))
        t.cancel()
        await t  # a task the endpoint awaits was cancelled


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    yield pm
    pm.stop().get(timeout=30)


@pytest.fixture(scope="module")
def counters(procs):
    return procs.spawn("counters", Counter, 10)


def test_spawn_and_call_gather_a_value_mesh(procs, counters):
    assert procs.extent == counters.extent
    assert repr(procs.extent) == "{hosts: 2, gpus: 2}"
    vm = counters.value.call().get(timeout=10)
    assert isinstance(vm, ValueMesh)
    assert vm.values() == [10, 10, 10, 10]
    assert vm.item(hosts=1, gpus=0) == 10
    pts = [repr(p) for p, _ in vm.items()]
    assert pts[3] == "{'hosts': 1/2, 'gpus': 1/2}"
    with pytest.raises(KeyError):
        vm.item(hosts=1)


def test_current_rank_is_the_message_rank_within_a_slice(counters):
    vm = counters.slice(gpus=1).where.call().get(timeout=10)
    ranks = [v[0] for v in vm.values()]
    assert ranks == [0, 1]
    assert vm.values()[1][1] == {"hosts": 2}
    # the actor's own spawn position is unchanged
    assert [v[2] for v in vm.values()] == [1, 3]
    assert all(v[3] is False for v in vm.values()), "sync actors run without an event loop"


def test_slicing_operations_on_every_mesh_kind(procs, counters):
    assert procs.slice(hosts=0).sizes == {"gpus": 2}
    assert counters.flatten("r").sizes == {"r": 4}
    assert counters.rename(gpus="g").sizes == {"hosts": 2, "g": 2}
    assert procs.split(hosts=("a", "b"), b=1).sizes == {"a": 2, "b": 1, "gpus": 2}
    assert counters.size() == 4 and counters.size("gpus") == 2
    vm = counters.value.call().get(timeout=10)
    assert vm.slice(gpus=slice(1, 2)).sizes == {"hosts": 2, "gpus": 1}
    with pytest.raises(TypeError, match="dimension labeled 'nope'"):
        procs.slice(nope=0)
    with pytest.raises(IndexError):
        procs.slice(gpus=5)
    with pytest.raises(ValueError):
        procs.split(hosts="ab")


def test_call_one_choose_stream_broadcast(procs):
    c = procs.spawn("adverbs", Counter)
    with pytest.raises(ValueError, match="exactly 1 actor, but mesh has 4"):
        c.value.call_one()
    one = c.slice(hosts=0, gpus=1)
    assert one.incr.call_one(5).get(timeout=10) == 5
    assert c.incr.choose(0).get(timeout=10) in (0, 5)
    got = sorted(f.get(timeout=10) for f in c.value.stream())
    assert got == [0, 0, 0, 5]
    c.incr.broadcast(100)
    # a later call from the same sender is ordered after the broadcast
    assert c.value.call().get(timeout=10).values() == [100, 105, 100, 100]
    assert Accumulator(c.value, 0, lambda a, b: a + b).accumulate().get(timeout=10) == 405


def test_call_ranks_then_and_progress_for_frontends(procs):
    """The public calls ``%%mesh exec`` and the progress line are built on."""
    from monarch_nb.actor import blocked_on, controller_client

    h = procs.spawn("frontend_calls", Holder)
    fut = h.rank.call_ranks([3, 0])
    assert fut.get(timeout=10) == [3, 0] and fut.progress() == (2, 2)
    held = h.hold.call_ranks(None)
    derived = held.then(lambda ranks: sum(ranks), "sum of ranks")
    assert derived.description == "sum of ranks" and derived.progress() == (0, 4)
    assert repr(held) == "<monarch_nb Future frontend_calls.hold.call_ranks() pending, 0/4 ranks replied>"
    seen: list[object] = []
    main = threading.get_ident()
    waiter = threading.Thread(target=lambda: seen.append(derived.get(timeout=20)))
    waiter.start()
    assert blocked_on(main) is None
    wait_for(lambda: blocked_on(waiter.ident or 0) is derived, 10, "the thread to block on the derived future")
    h.release.call().get(timeout=10)
    waiter.join(20)
    assert seen == [6] and derived.progress() == (4, 4)
    assert repr(held) == "<monarch_nb Future frontend_calls.hold.call_ranks() done>"
    failing = h.rank.call_ranks([1]).then(lambda r: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.get(timeout=10)
    with pytest.raises(ValueError, match=r"ranks \[4\] are out of range for actor mesh 'frontend_calls' of 4 actors"):
        h.rank.call_ranks([0, 4])
    # no ranks: nothing to wait for (a %%mesh exec on no ranks hung)
    assert h.rank.call_ranks([]).get(timeout=10) == []
    assert controller_client().cid == controller_client().rt.uid


class Holder(Actor):
    """``hold`` calls overlap and return only once ``release`` is called."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    @concurrent_endpoint
    async def hold(self) -> int:
        await self.go.wait()
        return current_rank().rank

    @endpoint
    async def release(self) -> None:
        self.go.set()

    @endpoint
    async def rank(self) -> int:
        return context().actor_instance.rank.rank  # its rank in the whole mesh, not the called slice


class FailOrHold(Holder):
    @concurrent_endpoint
    async def work(self) -> int:
        if current_rank().rank == 1:
            raise ValueError("rank 1 failed")
        await self.go.wait()  # the others block, as ranks in a collective wait for a failed peer
        return current_rank().rank


def test_a_failed_rank_surfaces_while_the_others_still_block(procs):
    from monarch_nb.config import get_config

    f = procs.spawn("fail_or_hold", FailOrHold)
    t0 = time.monotonic()
    with pytest.raises(ActorError, match="rank 1 failed"):
        f.work.call().get(timeout=30)
    assert time.monotonic() - t0 < get_config().call_error_window + 5
    f.release.broadcast()


def test_a_rank_whose_actor_exits_fails_the_call_ahead_of_a_lower_rank_that_raised():
    # rank 1's script calls sys.exit(3); rank 0 raises (gloo's "Connection closed by peer" once
    # rank 1's process group is gone). As on 0.7.0 the call fails with rank 1's actor failure.
    # Before: "RuntimeError on 1 of 2 ranks: 0" alone, rank 1's failure dropped from the group.
    # A long call_error_window: both answers are in whatever order they come (the call
    # completes once the last has)
    code = """
import sys
import monarch_nb
import monarch_nb.actor as api
from monarch_nb.actor import Actor, current_rank, endpoint, this_host
monarch_nb.configure(call_error_window=60)
api.unhandled_fault_hook = lambda failure: None
class Step(Actor):
    @endpoint
    def step(self):
        if current_rank().rank == 1:
            sys.exit(3)
        raise RuntimeError("Connection closed by peer")
procs = this_host().spawn_procs(per_host={"gpus": 2})
try:
    procs.spawn("s", Step).step.call().get(timeout=30)
except Exception as e:
    print("RAISED", type(e).__name__)
    print(e)
    print("NOTES", getattr(e, "__notes__", None))
procs.stop().get(timeout=30)
"""
    r = run_script(code, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "RAISED SupervisionError" in r.stdout, r.stdout
    assert "Endpoint call s.step() failed, The actor <root>.<__main__.Step s{'gpus': 1/2}> and all its descendants" in r.stdout
    assert "SystemExit: 3" in r.stdout, r.stdout
    # what rank 0 raised is not lost
    notes = r.stdout.split("NOTES ")[1]
    assert "in the same call rank 0 (1 of 2) raised RuntimeError: Connection closed by peer" in notes, r.stdout


def test_a_rank_that_raised_before_another_s_process_died_is_noted_on_the_death(tmp_path):
    # rank 0 raises, then rank 1's process exits (os._exit(3)) within call_error_window: the
    # call fails with rank 1's death, as on 0.7.0. What rank 0 raised was dropped; it is a note
    code = f"""
import os, time
import monarch_nb
import monarch_nb.actor as api
import _gate
from monarch_nb.actor import Actor, current_rank, endpoint, this_host
monarch_nb.configure(call_error_window=60)
api.unhandled_fault_hook = lambda failure: None
go = _gate.Gate({str(tmp_path / "exit")!r})
class Step(Actor):
    @endpoint
    def step(self):
        if current_rank().rank == 1:
            _gate.wait(go.path, 60)
            os._exit(3)
        raise RuntimeError("Connection closed by peer")
procs = this_host().spawn_procs(per_host={{"gpus": 2}})
fut = procs.spawn("s", Step).step.call()
deadline = time.monotonic() + 30
while fut._progress[0][0] != 1 and time.monotonic() < deadline:
    time.sleep(0.01)
go.open()  # rank 0's error is in: now rank 1 exits
try:
    fut.get(timeout=30)
except Exception as e:
    print("RAISED", type(e).__name__)
    print(e)
    print("NOTES", getattr(e, "__notes__", None))
procs.stop().get(timeout=30)
go.close()
"""
    tests = os.path.dirname(os.path.abspath(__file__))  # for _gate, here and in the procs
    r = run_script(code, timeout=90, env={"PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, r.stderr
    assert "RAISED SupervisionError" in r.stdout, r.stdout
    assert "The actor <root>.<__main__.Step s{'gpus': 1/2}> and all its descendants have failed:" in r.stdout, r.stdout
    assert "exited with non-zero code 3" in r.stdout, r.stdout
    notes = r.stdout.split("NOTES ")[1]
    assert "in the same call rank 0 (1 of 2) raised RuntimeError: Connection closed by peer" in notes, r.stdout


def test_a_cancelled_await_says_the_call_runs_on_and_the_future_still_works(procs):
    h = procs.spawn("held_await", Holder)
    fut = h.hold.call()

    async def give_up() -> None:
        await asyncio.wait_for(_awaited(fut), 0.2)

    with pytest.raises(asyncio.TimeoutError) as ei:
        asyncio.run(give_up())
    cancelled = ei.value.__cause__
    assert isinstance(cancelled, asyncio.CancelledError), repr(cancelled)
    assert cancelled.__notes__ == [
        "monarch_nb: only the wait stopped: held_await.hold.call() still runs on 4 of 4 ranks, as in Monarch, and "
        "their actors take their next calls once it returns. .get() or await waits for it again; stopping the mesh "
        "ends it now."
    ]
    h.release.broadcast()
    assert sorted(fut.get(timeout=20).values()) == [0, 1, 2, 3]


async def _awaited(fut: Future[Any]) -> Any:
    return await fut


def test_choose_spreads_calls_over_the_least_busy_actors(procs):
    h = procs.spawn("holders", Holder)
    # one at a time: every actor is idle each time, so they take turns
    assert sorted(h.rank.choose().get(timeout=10) for _ in range(8)) == [0, 0, 1, 1, 2, 2, 3, 3]
    # eight calls still running at once: each actor gets two, none gets a third while another has one
    futs = [h.hold.choose() for _ in range(8)]
    h.release.broadcast()
    assert sorted(f.get(timeout=10) for f in futs) == [0, 0, 1, 1, 2, 2, 3, 3]
    # a slice chooses among its own actors only
    assert {h.slice(hosts=1).rank.choose().get(timeout=10) for _ in range(4)} == {2, 3}


def test_arguments_are_checked_against_the_signature_before_sending(counters):
    with pytest.raises(TypeError, match="incr"):
        counters.incr.call(1, 2, 3)
    with pytest.raises(TypeError):
        counters.value.call(bogus=1)


def test_ports_channels_send_and_explicit_response_port(counters):
    assert counters.ported.call(5).get(timeout=10).values() == [6, 6, 6, 6]
    port, recv = Channel.open()
    send(counters.value, (), {}, port=port)
    vals = sorted(recv.recv().get(timeout=10) for _ in range(4))
    assert len(vals) == 4
    port.send("local")
    assert recv.recv().get(timeout=10) == "local"


def test_port_exception_of_a_non_exception_raises_in_the_sender_and_leaves_a_once_port_unspent(counters):
    # Monarch sends it and the receiver's recv() raises Python's bare "exceptions must derive
    # from BaseException", which says nothing of who sent what
    port, recv = Channel.open(once=True)
    with pytest.raises(TypeError) as info:
        port.exception("just words")  # type: ignore[arg-type]
    assert str(info.value) == (
        "port.exception() takes an exception, such as ValueError('what went wrong'), "
        "not str 'just words': to send a value, use port.send()"
    )
    port.exception(KeyError("k"))  # the once port was not spent by the refused one
    with pytest.raises(KeyError, match="k"):
        recv.recv().get(timeout=10)
    # an exception class is what `raise` takes too, as on Monarch
    port, recv = Channel.open()
    port.exception(ValueError)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        recv.recv().get(timeout=10)
    # in an actor the endpoint can catch it and send what it meant
    port, recv = Channel.open(once=True)
    words = counters.slice(hosts=0, gpus=0).fail_to.call_one(port, 3).get(timeout=10)
    assert words.startswith("port.exception() takes an exception") and "not int 3" in words
    with pytest.raises(ValueError, match="the right way"):
        recv.recv().get(timeout=10)


def test_a_port_reaches_this_hosts_procs_after_the_controller_joined_a_keyed_cluster(allocator, tmp_path):
    # once a controller has a TCP inbox (it attached to a keyed cluster), a Port pickled for the
    # procs of a trust-all allocator on this host must still carry the address they reach it at:
    # they hold no cluster key and fail the TCP inbox's handshake, so the values were lost
    from conftest import AllocatorProc

    from monarch_nb._wire.keys import write_key_file

    key = str(tmp_path / "cluster.key")
    write_key_file(key)
    keyed = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", "--key-file", key)
    code = f"""
from monarch_nb.actor import Actor, Channel, attach_to_workers, endpoint, _context
class Sender(Actor):
    @endpoint
    def to(self, port, v) -> None:
        port.send(v)
cluster = attach_to_workers(workers=[{keyed.info["tcp"]!r}], ca={key!r})
cluster.spawn_procs(per_host={{"gpus": 1}}).spawn("s", Sender).to.call_one(Channel.open()[0], 0).get(timeout=30)
print("TCP", _context.runtime().tcp_addr)
hosts = attach_to_workers(workers=[{allocator.addr!r}], ca="trust_all_connections")
s = hosts.spawn_procs(per_host={{"gpus": 2}}).spawn("s", Sender)
port, recv = Channel.open()
s.slice(gpus=0).to.call_one(port, "one").get(timeout=30)  # pickled for one proc
s.to.broadcast(port, "all")  # pickled once for the mesh
print("GOT", sorted(recv.recv().get(timeout=30) for _ in range(3)))
"""
    try:
        r = run_script(code, env={"MONARCH_NB_RUNTIME_DIR": allocator.rdir})
    finally:
        keyed.stop()
    assert r.returncode == 0, r.stderr
    assert "TCP tcp://127.0.0.1:" in r.stdout and "GOT ['all', 'all', 'one']" in r.stdout, r.stdout + r.stderr
    assert "security handshake" not in r.stderr, r.stderr


def test_non_endpoints_refuse_until_wrapped_with_as_endpoint(counters):
    with pytest.raises(RuntimeError, match="not annotated as an endpoint"):
        counters.plain.call()
    assert as_endpoint(counters.plain).call().get(timeout=10).values() == ["plain"] * 4


def test_endpoint_error_carries_remote_traceback_and_actor_lives_on(counters):
    with pytest.raises(ActorError) as ei:
        counters.slice(hosts=1, gpus=1).boom.call_one("bad thing").get(timeout=10)
    e = ei.value
    assert isinstance(e.exception, ValueError) and str(e.exception) == "bad thing"
    assert "raise ValueError(msg)" in e.remote_traceback
    assert e.rank == 3
    rendered = "\n".join(e._render_traceback_())
    assert "test_actor_api.py" in rendered and "bad thing" in rendered
    assert counters.slice(hosts=1, gpus=1).value.call_one().get(timeout=10) >= 10


def test_future_timeout_leaves_it_usable_and_await_works(counters):
    f = counters.slice(hosts=0, gpus=0).slow.call_one(0.6)
    with pytest.raises(TimeoutError):
        f.get(timeout=0.05)
    assert f.get(timeout=10) == "done"

    async def main() -> list[int]:
        return (await counters.value.call()).values()

    assert len(asyncio.run(main())) == 4
    with pytest.raises(TypeError):
        Future()


def test_an_empty_mesh_name_is_an_unnamed_mesh_that_stops():
    """The allocator named it anon-…; the controller kept '' and its stop() found no such mesh."""
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="")
    assert pm.name.startswith("anon-"), pm
    # per_host as something that is no mapping (it read "cannot convert dictionary update sequence element")
    with pytest.raises(TypeError, match=r"per_host is a dict of dimension sizes, like \{'gpus': 8\}, got \[2\]"):
        this_host().spawn_procs(per_host=[2])  # type: ignore[arg-type]
    # an actor mesh's name is asked for by name (it read "argument of type 'NoneType' is not iterable")
    with pytest.raises(TypeError, match="needs the actor mesh's name first, a str, got None"):
        pm.spawn(None, Counter)  # type: ignore[arg-type]
    pm.stop().get(timeout=30)


def test_a_proc_mesh_stopped_by_another_process_stops_again_quietly_and_calls_say_by_whom():
    """Another process stopped the mesh (`monarch-nb stop --force` from a shell, a script's
    stop_mesh): its owner's ``stop().get()`` raised "MeshError: no mesh named 'NAME' on host ...",
    as if the stop had failed, at every try, and its calls said "stopped: stopped by client",
    naming the wrong stopper. Now the stop resolves as a second stop does (Monarch's), and calls
    say who stopped it."""
    import socket

    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="outstopped")
    c = pm.spawn("outc", Counter)
    assert c.incr.call().get(timeout=30).values() == [1, 1]
    r = run_script("import os\nfrom monarch_nb.allocator import stop_mesh\nprint(stop_mesh('outstopped'), os.getpid())")
    assert r.returncode == 0, r.stderr
    n, pid = r.stdout.split()
    assert n == "2", r.stdout
    assert pm.stop().get(timeout=30) is None
    assert pm.stop().get(timeout=30) is None
    with pytest.raises(SupervisionError) as e:
        c.incr.call().get(timeout=30)
    assert str(e.value).splitlines()[1:] == [
        f"  stopped: stopped by monarch_nb.allocator.stop_mesh() in process {pid} on host {socket.gethostname()}",
        "  actor mesh 'outc' was stopped; spawn it again",
    ], str(e.value)


def test_a_spawn_on_a_proc_mesh_stopped_by_another_process_says_by_whom():
    """`monarch-nb stop --force NAME` from a shell: a spawn on the owner's handle then failed as
    "SpawnError: spawning 'again' (Counter) failed on 2 of 2 procs: Supervision failure: ... mesh
    stopped (process N exited with code 0)", as if the spawn had gone wrong, and after the owner's
    stop() as "`ProcMesh` has already been stopped" with no word of who, though calls said it."""
    import subprocess
    import sys

    from monarch_nb.errors import MeshClosedError

    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="outspawn")
    assert pm.spawn("c", Counter).incr.call().get(timeout=30).values() == [1, 1]
    r = subprocess.run(
        [sys.executable, "-m", "monarch_nb", "stop", "outspawn", "--force"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    said = (
        "`ProcMesh` has already been stopped: proc mesh 'outspawn' (stopped by `monarch-nb stop` on the command line); "
        "spawn new procs"
    )
    with pytest.raises(MeshClosedError) as before:
        pm.spawn("again", Counter)
    assert pm.stop().get(timeout=30) is None  # stopped already: done, as a second stop
    with pytest.raises(MeshClosedError) as after:
        pm.spawn("again", Counter)
    assert (str(before.value), str(after.value)) == (said, said)


class _Dies(Actor):
    @endpoint
    def die(self) -> None:
        os._exit(3)


def test_a_mesh_spawned_again_under_the_name_of_one_stopped_reports_its_dead_proc(fault_hook):  # type: ignore[no-untyped-def]
    """The client kept the name of a proc mesh it had stopped as a mesh whose procs' deaths are
    no failure: a mesh spawned again under that name lost a proc and nobody was told (no
    unhandled_fault_hook, no __supervise__), though its calls failed."""
    this_host().spawn_procs(per_host={"gpus": 1}, name="again").stop().get(timeout=30)
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="again")
    try:
        pm.spawn("dies", _Dies).die.broadcast()
        wait_for(lambda: [f for f in fault_hook if f.mesh_name == "dies"], 30, "the hook to hear of the dead proc")
    finally:
        pm.stop().get(timeout=30)


class _Leaves(Actor):
    @endpoint
    def leave(self) -> None:
        os._exit(0)

    @endpoint
    def ping(self) -> str:
        return "pong"


def test_an_actor_mesh_whose_proc_exited_cleanly_stops_quietly(fault_hook):  # type: ignore[no-untyped-def]
    """A proc that exited with status 0 stopped its actor (program clean_exit): its mesh's stop()
    raised Monarch's dead-rank ValueError, saying the actor failed. (0.7.0's stop() never
    returns there.)"""
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        m = pm.spawn("leaves", _Leaves)
        with pytest.raises(SupervisionError, match="stopped: process exited cleanly"):
            m.slice(gpus=1).leave.call_one().get(timeout=30)
        m.stop().get(timeout=30)
        with pytest.raises(SupervisionError):
            m.slice(gpus=0).ping.call_one().get(timeout=30)
        assert not fault_hook
    finally:
        pm.stop().get(timeout=30)


def test_a_mesh_no_allocator_knows_is_a_lookup_error_and_still_a_mesh_error():
    """A name no allocator knows was told apart from other MeshErrors by its words ("no mesh
    named"); it is a type now, also from an allocator across the wire, and ``except MeshError``
    catches it as before."""
    from monarch_nb.allocator import list_allocators, stop_mesh
    from monarch_nb.errors import MeshError, MeshNotFoundError

    this_host().spawn_procs(per_host={"gpus": 1}, name="known").stop().get(timeout=30)  # the allocator runs
    addr = next(a["addr"] for a in list_allocators() if a["alive"])
    with pytest.raises(MeshError, match=r"^no mesh named 'nope' on host ") as there:
        stop_mesh("nope", addr)  # asked of the allocator itself: its error, unpickled here
    with pytest.raises(MeshError, match=r"^no mesh named 'nope' on any known allocator ") as anywhere:
        stop_mesh("nope")
    for e in (there.value, anywhere.value):
        assert isinstance(e, MeshNotFoundError) and isinstance(e, LookupError) and e.name == "nope", repr(e)


def test_chained_endpoint_decorators_and_a_non_method_are_refused_where_written():
    """``@endpoint`` twice ("chaining endpoints"): Monarch 0.7.0 takes the class and fails every
    call with ``TypeError: <EndpointProperty> is not a callable object``; here the class
    definition fails, naming the method."""
    with pytest.raises(ValueError, match="f is already an endpoint: decorate it with @endpoint once"):

        class Twice(Actor):
            @endpoint
            @endpoint
            def f(self) -> int:
                return 1

    with pytest.raises(ValueError, match="already an endpoint"):
        endpoint(explicit_response_port=True)(endpoint(lambda self: 1))
    with pytest.raises(TypeError, match="@endpoint decorates a method, got 5"):
        endpoint(5)


def test_sync_and_async_actors_and_mixing_is_rejected(procs):
    a = procs.spawn("asyncs", AsyncActor)
    assert a.where.call().get(timeout=10).values() == [True] * 4
    one = a.slice(hosts=0, gpus=0)
    futs = [one.overlap.call_one(0.3) for _ in range(3)]
    assert max(f.get(timeout=10) for f in futs) >= 2, "concurrent endpoints overlap at awaits"

    class Mixed(Actor):
        @endpoint
        def a(self) -> None: ...

        @endpoint
        async def b(self) -> None: ...

    with pytest.raises(ValueError, match="mixes both async and sync endpoints"):
        procs.spawn("mixed", Mixed)


def test_an_async_endpoint_that_raises_cancelled_error_fails_its_call_and_the_actor_serves_on(procs):
    # (Monarch 0.7.0's actor loop ends there, and every later call to the actor hangs)
    a = procs.spawn("cancels", AsyncActor).slice(hosts=0, gpus=0)
    for how in ("raise", "await"):
        with pytest.raises(ActorError) as ei:
            a.cancelled.call_one(how).get(timeout=10)
        assert isinstance(ei.value.exception, asyncio.CancelledError), ei.value
        assert a.where.call_one().get(timeout=10) is True


class _Held(Actor):
    @endpoint
    async def hold(self, started: str) -> str:
        open(started, "w").close()
        await asyncio.Event().wait()  # until stop() cancels it
        return "not reached"


def test_a_call_in_hand_when_its_mesh_stops_fails_in_monarchs_words(procs, tmp_path):
    held = procs.slice(hosts=0, gpus=slice(1, 2)).spawn("held", _Held)
    started = tmp_path / "started"
    call = held.hold.call_one(str(started))
    wait_for(started.exists, 30, "the call to start")
    held.stop().get(timeout=30)
    with pytest.raises(SupervisionError) as e:
        call.get(timeout=30)
    # as a call sent after the stop reads (before: "..., the actor <...> was stopped")
    assert str(e.value).splitlines()[:2] == [
        "Endpoint call held.hold() failed, Supervision event: actor <root>.<test_actor_api._Held held{'gpus': 0/1}> has status:",
        "  stopped: stopped by client",
    ]


class _Stopper(Actor):
    @endpoint
    def stop_it(self, mesh: Any) -> str:
        try:
            mesh.stop().get(timeout=30)
            return "stopped"
        except Exception as e:
            return f"{type(e).__name__}: {e}"


def test_an_actor_mesh_handed_to_an_actor_is_not_stopped_there(procs, counters):
    # Monarch's words (what it hands over is an ActorMeshRef); before, the actor stopped the
    # client's mesh, whose next call failed with "no actor named 'counters'"
    stopper = procs.slice(hosts=0, gpus=0).spawn("stopper", _Stopper)
    said = stopper.stop_it.call_one(counters).get(timeout=30)
    assert said.startswith("NotImplementedError: Cannot call stop on an ActorMeshRef, requires an owned ActorMesh"), said
    assert len(counters.value.call().get(timeout=30)) == 4


class _Fds(Actor):
    @endpoint
    def count(self) -> int:
        import os

        return len(os.listdir("/proc/self/fd"))


def test_a_proc_that_spawns_and_stops_actors_keeps_its_descriptors(procs):
    # an async actor's event loop (its epoll, wake-up and signal descriptors) was never
    # closed: ~5 descriptors per actor spawned and stopped, a proc out of them after ~200
    one = procs.slice(hosts=0, gpus=0)
    fds = one.spawn("fds", _Fds)
    before = fds.count.call_one().get(timeout=10)
    for i in range(20):
        a = one.spawn(f"churn{i}", AsyncActor)
        assert a.where.call_one().get(timeout=10)
        a.stop().get(timeout=10)
    assert fds.count.call_one().get(timeout=10) - before < 10
    fds.stop().get(timeout=10)


def test_failing_init_is_reported_through_supervision_and_fails_calls(fault_hook):  # type: ignore[no-untyped-def]
    class Bad(Actor):
        def __init__(self) -> None:
            if current_rank().rank == 2:
                raise RuntimeError("no GPU for rank 2")

        @endpoint
        def ping(self) -> int:
            return current_rank().rank

    # procs of its own: a proc where an actor failed takes no new actors (as Monarch's)
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    try:
        bad = procs.spawn("bad", Bad)  # returns at once, as Monarch's
        mine = lambda: [f for f in fault_hook if f.mesh_name == "bad"]  # noqa: E731
        wait_for(mine, 30, "the hook to hear of the failed __init__")
        assert [f.crashed_ranks for f in mine()] == [[2]]
        assert "no GPU for rank 2" in repr(mine()[0]) and "raise RuntimeError" in repr(mine()[0])
        with pytest.raises(SupervisionError, match="no GPU for rank 2"):
            bad.ping.call().get(timeout=20)
        assert bad.slice(hosts=0, gpus=0).ping.call_one().get(timeout=20) == 0
    finally:
        procs.stop().get(timeout=30)


#: a handled failure's absence at the client's hook is checked by waiting this long for it: the
#: client hears of an actor's failure on a thread of its own (actor/_mesh.py, _Supervised), so
#: nothing it is told of later is ordered after that hook call (as tests/monarch_programs do)
HOOK_WINDOW_S = 1.0


class _GivesUp(Actor):
    @endpoint
    def give_up(self, backlog: str) -> None:
        _gate.wait(backlog, 60)  # the test opens it once its owner has a backlog
        raise SystemExit(3)  # fails this actor alone


class BusyOwner(Actor):
    """Owns a mesh whose actor fails while a backlog of its own slow messages is queued."""

    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.child = this_proc().spawn("giver_upper", _GivesUp)

    @endpoint
    def fail_child(self, backlog: str) -> None:
        self.child.give_up.broadcast(backlog)

    @endpoint
    def slow(self, i: int) -> None:
        time.sleep(0.05)
        self.events.send(f"slow {i}")

    def __supervise__(self, failure: Any) -> bool:
        self.events.send(f"supervised {failure.crashed_ranks}")
        return True


class AsyncBusyOwner(Actor):
    """BusyOwner as an async actor: its supervision, too, goes ahead of its queued messages."""

    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.child = this_proc().spawn("giver_upper", _GivesUp)

    @endpoint
    async def fail_child(self, backlog: str) -> None:
        self.child.give_up.broadcast(backlog)

    @endpoint
    async def slow(self, i: int) -> None:
        await asyncio.sleep(0.05)
        self.events.send(f"slow {i}")

    async def __supervise__(self, failure: Any) -> bool:
        self.events.send(f"supervised {failure.crashed_ranks}")
        return True


@pytest.mark.parametrize("owner_cls", [BusyOwner, AsyncBusyOwner], ids=["sync", "async"])
def test_supervision_of_an_actor_goes_ahead_of_its_message_backlog(fault_hook, owner_cls, gate):  # type: ignore[no-untyped-def]
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    backlog = gate("backlog")
    try:
        port, events = Channel.open()
        owner = procs.spawn("busy_owner", owner_cls, port)
        owner.fail_child.call_one(backlog.path).get(timeout=20)
        for i in range(60):
            owner.slow.broadcast(i)
        backlog.open()  # the child fails now, 3 s of slow messages queued at its owner
        seen = [events.recv().get(timeout=20) for _ in range(61)]
        assert "supervised [0]" in seen
        assert seen.index("supervised [0]") < 50, seen  # not after the 3 s backlog
        time.sleep(HOOK_WINDOW_S)
        assert fault_hook == [], "a handled failure does not reach the client's hook"
    finally:
        procs.stop().get(timeout=30)


def test_meshes_are_picklable_and_an_actor_can_call_a_mesh_it_was_handed(procs, counters):
    other = procs.spawn("others", Counter, 1000)
    back = pickle.loads(pickle.dumps(other))
    assert back.value.call().get(timeout=10).values() == [1000] * 4
    res = counters.slice(hosts=0, gpus=0).call_other.call_one(other, 1).get(timeout=20)
    assert res == [1001] * 4


def test_messages_from_one_sender_arrive_in_order(procs):
    c = procs.spawn("ordered", Counter)
    for i in range(500):
        c.record.broadcast(i)
    seen = c.get_seen.call().get(timeout=20).values()
    assert all(s == list(range(500)) for s in seen)


def test_unpicklable_argument_and_result_give_clear_errors(counters):
    with pytest.raises(Exception, match="pickle"):
        counters.incr.call(threading.Lock())
    with pytest.raises(ActorError, match="could not be pickled") as ei:
        counters.slice(hosts=0, gpus=0).unpicklable.call_one().get(timeout=10)
    # headed as any failed call is (Monarch's words), and ending as Monarch's: the pickling error
    lines = str(ei.value).strip().splitlines()
    assert re.fullmatch(r"Actor call \S+\.unpicklable failed\.", lines[0]), lines
    assert lines[-1].startswith("TypeError: cannot pickle"), lines


def test_a_remote_exception_whose_class_the_controller_lacks_keeps_its_words(counters, tmp_path):
    # before: the call raised `ModuleNotFoundError: No module named 'procs_only_errors'`, and
    # what failed, where and why was lost
    (tmp_path / "procs_only_errors.py").write_text("class ProcsOnlyError(Exception):\n    pass\n")
    with pytest.raises(ActorError) as ei:
        counters.raise_odd.call("procs-only", str(tmp_path)).get(timeout=30)
    e = ei.value
    assert isinstance(e.exception, RuntimeError), repr(e.exception)
    assert str(e.exception) == "procs_only_errors.ProcsOnlyError: only the procs know this class (rank 0)"
    assert "No module named 'procs_only_errors'" in "".join(getattr(e.exception, "__notes__", []))
    text = e.grouped_text()
    assert "procs_only_errors.ProcsOnlyError on 4 of 4 ranks: 0-3" in text, text
    assert 'raise procs_only_errors.ProcsOnlyError(f"only the procs know this class (rank {rank})")' in text, text
    assert "rank 3: procs_only_errors.ProcsOnlyError: only the procs know this class (rank 3)" in text, text


def test_a_notebook_shows_errors_whose_str_raises_and_clips_each_rank_s_long_message(counters):
    # IPython calls _render_traceback_: before, an exception whose __str__ raises made it raise,
    # and the notebook printed "Unexpected exception formatting exception" and our frames
    with pytest.raises(ActorError) as ei:
        counters.raise_odd.call("unprintable").get(timeout=30)
    rendered = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ei.value._render_traceback_()))
    assert rendered.startswith("ActorError: Actor call counters.raise_odd failed.\nUnprintable on 4 of 4 ranks: 0-3"), rendered
    assert "raise Unprintable(rank)" in rendered, rendered
    # the lowest rank's message shortened in its traceback, saying where the whole is; each rank's
    # listed, clipped: 4 ranks' 100 kB messages were 500 kB of output, 128 ranks' megabyte ones
    # more than a browser shows
    with pytest.raises(ActorError) as ei:
        counters.raise_odd.call("long").get(timeout=30)
    rendered = "\n".join(ei.value._render_traceback_())
    assert "ValueError: rank 0 " + "x" * 1_900 in rendered
    assert "… (the message is 100,007 characters; print(sys.last_value.grouped_text()) shows all of it)" in rendered
    assert len(rendered) < 5_000, len(rendered)
    assert "rank 0 " + "x" * 100_000 in ei.value.grouped_text()
    assert "rank 3: ValueError: rank 3 xxx" in rendered and "… (100,007 characters)" in rendered, rendered[-2000:]


def test_this_proc_spawns_in_the_controller_and_controllers_are_singletons():
    import os

    class Local(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    m = this_proc().spawn("local_here", Local)
    assert m.pid.call_one().get(timeout=10) == os.getpid()
    c1 = get_or_spawn_controller("ctl", Counter).get(timeout=10)
    c2 = get_or_spawn_controller("ctl", Counter).get(timeout=10)
    c1.incr.call_one(3).get(timeout=10)
    assert c2.value.call_one().get(timeout=10) == 3


class _FailsToStart(Actor):
    def __init__(self, kind: type[Exception]) -> None:
        raise kind("controller cannot start")


@pytest.mark.parametrize("kind", [ValueError, RuntimeError])
def test_a_controller_whose_init_raises_fails_each_request_with_an_actor_error(kind: type[Exception]) -> None:
    # as on Monarch, whose controller's spawn runs in an actor: code catching ActorError for it
    # must catch it whatever the __init__ raised (a ValueError or TypeError came out bare, as
    # our own daemons' errors do)
    for _ in range(2):
        with pytest.raises(ActorError, match="controller cannot start") as ei:
            get_or_spawn_controller(f"fails_{kind.__name__}", _FailsToStart, kind).get(timeout=30)
        assert type(ei.value.exception) is kind


def test_classes_defined_in_main_travel_by_value():
    code = """
from monarch_nb.actor import Actor, endpoint, this_host, current_rank
class ToyActor(Actor):
    def __init__(self):
        self.rank = current_rank().rank
    @endpoint
    async def hello_world(self, msg):
        print(f"Identity: {self.rank}, {msg=}")
        return self.rank
procs = this_host().spawn_procs(per_host={"gpus": 3})
toys = procs.spawn("toy", ToyActor)
print("RESULT", toys.hello_world.call("hey").get(timeout=20).values(), flush=True)
"""
    r = run_script(code)
    assert r.returncode == 0, r.stderr
    assert "RESULT [0, 1, 2]" in r.stdout
    # rank output streams back to the controller, tagged with the rank
    assert "[1] Identity: 1, msg='hey'" in r.stdout


def test_a_script_prints_what_a_call_printed_before_the_value_it_returned():
    # Monarch's procs write to the script's own stdout, so a rank's line comes before the value
    # the script prints next; here the line travels through the allocator, the reply straight
    # from the proc, and the value used to win about half the time (and an error's traceback)
    code = """
import asyncio
from monarch_nb.actor import Actor, ActorError, endpoint, this_host
class Talker(Actor):
    @endpoint
    def say(self, i):
        print(f"said {i}", flush=i % 2 == 0)
        return i
    @endpoint
    def fail(self, i):
        print(f"failing {i}")
        raise ValueError(i)
procs = this_host().spawn_procs(per_host={"gpus": 2})
t = procs.spawn("t", Talker)
one = t.slice(gpus=1)
for i in range(20):
    print("value", one.say.call_one(i).get(timeout=20), flush=True)
print("values", t.say.call(20).get(timeout=20).values(), flush=True)
for f in one.say.stream(23):
    print("streamed", f.get(timeout=20), flush=True)
async def main():
    return await one.say.call_one(21)
print("awaited", asyncio.run(main()), flush=True)
try:
    one.fail.call_one(22).get(timeout=20)
except ActorError:
    print("raised 22", flush=True)
"""
    r = run_script(code)
    assert r.returncode == 0, r.stderr
    got = r.stdout.splitlines()
    assert got[:40] == [ln for i in range(20) for ln in (f"[1] said {i}", f"value {i}")], r.stdout
    # two ranks' lines come in either order, both before the values
    assert sorted(got[40:42]) == ["[0] said 20", "[1] said 20"], r.stdout
    assert got[42:] == [
        "values [20, 20]",
        "[1] said 23",
        "streamed 23",
        "[1] said 21",
        "awaited 21",
        "[1] failing 22",
        "raised 22",
    ], r.stdout


class Talker(Actor):
    @endpoint
    def say(self, i: int) -> int:
        print(f"said {i}")
        return i


def test_a_script_waits_for_the_end_of_a_calls_output_without_asking_its_allocator(allocator, monkeypatch, capfd):
    # the allocator passes on where a call's output ends, behind its lines; the controller
    # used to ask it for a flush (a round trip) after every call that printed
    from monarch_nb.actor import _client, _context

    asked: list[str] = []
    request = _client.Client.request
    monkeypatch.setattr(_client.Client, "request", lambda self, a, m, *r, **k: asked.append(m) or request(self, a, m, *r, **k))
    t = allocator.hosts.spawn_procs(per_host={"gpus": 1}, name="ends").spawn("t", Talker)
    for i in range(5):
        print("value", t.say.call_one(i).get(timeout=20), flush=True)
    assert "flush_logs" not in asked
    got = [ln for ln in capfd.readouterr().out.splitlines() if "said" in ln or "value" in ln]
    assert got == [ln for i in range(5) for ln in (f"[0] said {i}", f"value {i}")]
    # an end that came before its reply (the allocator was quicker): nothing left to wait for
    client, p = _context.client(), t._procs[0]
    client._output_ended([(p.rank, "early.1")])
    done: list[str] = []
    assert client.after_output(lambda: done.append("early"), "early.1", [p], set()) is False
    assert client.after_output(lambda: done.append("late"), "late.1", [p], set()) is True
    assert done == []
    client._output_ended([(p.rank, "late.1")])
    assert done == ["late"]


def test_a_printing_call_completes_when_the_end_of_its_output_never_comes(allocator, monkeypatch):
    import os
    import signal

    from monarch_nb.actor import _client, _context

    t = allocator.hosts.spawn_procs(per_host={"gpus": 1}, name="noend").spawn("t", Talker)
    t.say.call_one(0).get(timeout=20)
    monkeypatch.setattr(_client, "AFTER_OUTPUT_WAIT_S", 0.5)
    os.kill(allocator.proc.pid, signal.SIGSTOP)  # its procs' output stays in their pipes
    try:
        t0 = time.monotonic()
        assert t.say.call_one(1).get(timeout=20) == 1
        took = time.monotonic() - t0
        # the wait's bound, not a hang (nor the timeout above)
        assert 0.4 < took < 5, took
        # an allocator killed while a call waits for it: the call completes once it is known lost
        monkeypatch.setattr(_client, "AFTER_OUTPUT_WAIT_S", 60.0)
        fut = t.say.call_one(2)
        client = _context.client()
        wait_for(lambda: client._waits, 20, "the reply, waiting for the end of its output")
        os.kill(allocator.proc.pid, signal.SIGKILL)
        assert fut.get(timeout=30) == 2
    finally:
        os.kill(allocator.proc.pid, signal.SIGCONT)


def test_code_from_main_keeps_its_file_name_in_the_proc(tmp_path):
    # cloudpickle 3.1.3 ships all by-value code as "<dynamic-code>": a remote traceback would
    # then name no file and the debugger could not fetch the cell's source
    script = tmp_path / "my_training.py"
    script.write_text(
        """
import sys
from monarch_nb.actor import Actor, ActorError, endpoint, this_host
class Fails(Actor):
    @endpoint
    def where(self):
        return sys._getframe().f_code.co_filename
    @endpoint
    def boom(self):
        raise ValueError("boom")
procs = this_host().spawn_procs(per_host={"gpus": 1})
f = procs.spawn("f", Fails)
print("FILE", f.where.call_one().get(timeout=20), flush=True)
try:
    f.boom.call_one().get(timeout=20)
except ActorError as e:
    print("TRACE", str(e).replace("\\n", " | "), flush=True)
"""
    )
    r = run_script(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))")
    assert r.returncode == 0, r.stderr
    assert f"FILE {script}" in r.stdout, r.stdout
    trace = next(ln for ln in r.stdout.splitlines() if ln.startswith("TRACE"))
    assert f'File "{script}"' in trace and "<dynamic-code>" not in trace, trace


def test_logging_option_sets_the_python_logging_level_of_the_procs():
    code = """
import asyncio, logging
from monarch_nb.actor import Actor, endpoint, this_host
class Talker(Actor):
    @endpoint
    def talk(self, tag):
        log = logging.getLogger("talker")
        log.debug("debug %s", tag)
        log.info("info %s", tag)
        log.warning("warning %s", tag)
procs = this_host().spawn_procs(per_host={"gpus": 2})
t = procs.spawn("t", Talker)
asyncio.run(procs.logging_option(level=logging.DEBUG))
t.talk.call("A").get(timeout=20)
asyncio.run(procs.logging_option(level=logging.WARNING))
t.talk.call("B").get(timeout=20)
"""
    r = run_script(code)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        # with Monarch's [actor=...] prefix on records logged by an actor
        prefix = f"[actor=<root>.<__main__.Talker t{{'gpus': {rank}/2}}>]"
        for level, text in (("DEBUG", "debug A"), ("INFO", "info A"), ("WARNING", "warning A"), ("WARNING", "warning B")):
            assert f"[{rank}] {level}:talker:{prefix} {text}" in r.stderr, r.stderr
    assert "debug B" not in r.stderr and "info B" not in r.stderr, r.stderr


def test_stop_kills_a_proc_that_outlives_its_cleanup_and_says_so():
    # a normal exit waits for non-daemon threads, as Monarch's procs do; one that never ends
    # keeps its proc alive past the grace period: stop() kills it and names it. So is a proc
    # whose actor is still in an endpoint after stop_cleanup_timeout
    code = """
import os, threading, time, warnings
from monarch_nb.actor import Actor, endpoint, this_host
class Lingers(Actor):
    @endpoint
    def start(self):
        threading.Thread(target=threading.Event().wait, name="never-ends", daemon=False).start()
        return os.getpid()
    @endpoint
    def pid(self):
        return os.getpid()
    @endpoint
    def busy(self):
        time.sleep(60)
procs = this_host().spawn_procs(per_host={"gpus": 2})
m = procs.spawn("l", Lingers)
stuck = m.slice(gpus=1).start.call_one().get(timeout=20)
busy = m.slice(gpus=0).pid.call_one().get(timeout=20)
m.slice(gpus=0).busy.broadcast()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    procs.stop().get(timeout=60)
print("WARN", [(x.category.__name__, str(x.message)) for x in w])
print("WHERE", [(x.filename, x.lineno) for x in w])
for pid in (stuck, busy):
    try:
        os.kill(pid, 0)
        print("ALIVE", pid)
    except ProcessLookupError:
        pass
print("STUCK", stuck, "BUSY", busy)
"""
    t0 = time.monotonic()
    r = run_script(code, timeout=90)
    assert r.returncode == 0, r.stderr
    stuck, busy = r.stdout.split("STUCK ")[1].split()[0], r.stdout.split("BUSY ")[1].split()[0]
    warned = r.stdout.split("WARN ")[1].splitlines()[0]
    assert "ProcsKilledWarning" in warned, r.stdout
    assert "killed 2 proc(s): " in warned, warned
    # different reasons: one entry each
    # before: "its actors' __cleanup__ had not finished", of an actor that has no __cleanup__
    assert f"rank 0 (pid {busy} on " in warned, warned
    assert "its actors had not finished the message in hand and __cleanup__ after 2 s (stop_cleanup_timeout)" in warned
    assert f"rank 1 (pid {stuck} on " in warned and "still running 3 s after its actors' __cleanup__" in warned, warned
    # the warning names the program's line that stopped the mesh (before: monarch_nb's _future.py)
    stop_line = code.splitlines().index("    procs.stop().get(timeout=60)") + 1
    assert r.stdout.split("WHERE ")[1].splitlines()[0] == f"[('<string>', {stop_line})]", r.stdout
    assert "ALIVE" not in r.stdout, r.stdout
    assert time.monotonic() - t0 < 60
    # 16 ranks killed for one reason are one entry, not 16 copies of it
    from monarch_nb.actor._mesh import _killed_text

    killed = [{"rank": r, "pid": 100 + r, "host": "h", "why": "hung"} for r in range(16)]
    assert _killed_text(killed) == f"ranks 0-15 (pids {', '.join(str(100 + r) for r in range(16))} on h): hung"


def test_a_call_in_hand_when_its_proc_is_killed_at_stop_names_the_endpoint_and_actor(tmp_path):
    # the proc mesh's stop kills a proc whose handler runs past stop_cleanup_timeout. Its
    # caller got "Supervision failure: mesh 'anon-…' rank 0 host …: mesh stopped (process N
    # was killed by SIGKILL)", naming the proc mesh, where every other dead-proc error (and
    # 0.7.0's, whose words here are "cleanup error: deadline has elapsed") names the endpoint
    # and the actor
    started = tmp_path / "started"
    code = f"""
import os, time
import monarch_nb
from monarch_nb.actor import Actor, endpoint, this_host
monarch_nb.configure(stop_cleanup_timeout=0.5)
class C(Actor):
    @endpoint
    def slow(self):
        open({str(started)!r}, "w").close()
        time.sleep(60)
procs = this_host().spawn_procs(per_host={{"gpus": 1}})
fut = procs.spawn("c", C).slow.call_one()
deadline = time.monotonic() + 30
while not os.path.exists({str(started)!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
procs.stop().get(timeout=30)
try:
    fut.get(timeout=30)
except Exception as e:
    print("RAISED", type(e).__name__)
    print(e)
"""
    r = run_script(code, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "RAISED SupervisionError" in r.stdout, r.stdout
    lines = r.stdout.split("RAISED SupervisionError\n")[1].splitlines()
    assert (
        lines[0]
        == "Endpoint call c.slow() failed, The actor <root>.<__main__.C c{'gpus': 0/1}> and all its descendants have failed:"
    )
    assert lines[1] == (
        "  the process this actor was running on was killed as its proc mesh stopped: "
        "the message in hand or __cleanup__ had not finished after stop_cleanup_timeout"
    ), r.stdout
    assert re.fullmatch(
        r"  host \S+, proc mesh 'anon-\S+' rank 0: mesh stopped \(process \d+ was killed by SIGKILL\)", lines[2]
    ), r.stdout


class SpawnsToo(Actor):
    @endpoint
    def spawn_counter(self, pm: Any, start: int) -> int:
        # the same name the client spawned on the same procs: a mesh of its own
        return sum(pm.spawn("w6", Counter, start).incr.call(1).get(timeout=20).values())


def test_stopping_an_async_actor_cancels_its_background_tasks_and_lets_them_clean_up():
    # tasks an actor made with asyncio.create_task and never awaited died with the closed loop:
    # "[0] Task was destroyed but it is pending!" per rank, their `except CancelledError` and
    # `finally` never ran. Now they are cancelled as asyncio.run (and Monarch) cancel them; one
    # that ignores its cancellation is named, and its proc still exits rather than being killed
    code = """
import asyncio, warnings
from monarch_nb.actor import Actor, endpoint, this_host
class Background(Actor):
    @endpoint
    async def start(self, stubborn: bool) -> str:
        async def ticking():
            try:
                while True:
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                print("cancelled, stubborn" if stubborn else "cancelled", flush=True)
                if not stubborn:
                    raise
                while True:
                    await asyncio.sleep(0.05)
        self.task = asyncio.create_task(ticking(), name="ticking")
        return "started"
procs = this_host().spawn_procs(per_host={"gpus": 2})
polite = procs.spawn("polite", Background)
polite.start.call(False).get(timeout=30)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    polite.stop().get(timeout=30)
    procs.stop().get(timeout=30)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    procs.spawn("stubborn", Background).start.call(True).get(timeout=30)
    procs.stop().get(timeout=30)
print("WARN", [str(x.message) for x in w])
"""
    r = run_script(code, timeout=90)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "destroyed but it is pending" not in out, out
    lines = sorted(ln for ln in r.stdout.splitlines() if "cancelled" in ln)
    assert lines == ["[0] cancelled", "[0] cancelled, stubborn", "[1] cancelled"], r.stdout
    assert "background task(s) still running" in out and "(ticking): left unfinished" in out, out
    assert r.stdout.split("WARN ")[1].splitlines()[0] == "[]", r.stdout  # no proc killed


def test_each_spawn_is_its_own_mesh_across_controllers_and_actors():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="shared6", persist=True)
    try:
        mine = pm.spawn("w6", Counter, 100)
        assert mine.incr.call().get(timeout=20).values() == [101, 101]
        # another controller attaches to the same procs and spawns the same name
        code = """
from monarch_nb.actor import Actor, ProcMesh, endpoint
class Other(Actor):
    def __init__(self, start):
        self.n = start
    @endpoint
    def incr(self, by=1):
        self.n += by
        return self.n
pm = ProcMesh.lookup("shared6")
theirs = pm.spawn("w6", Other, 500)
print("THEIRS", theirs.incr.call().get(timeout=20).values(), repr(theirs))
"""
        r = run_script(code)
        assert r.returncode == 0, r.stderr
        assert "THEIRS [501, 501] ActorMesh(class=Other, name='w6'" in r.stdout, r.stdout
        # an actor spawning the name too, on the same procs
        sp = pm.spawn("spawner", SpawnsToo)
        assert sp.slice(gpus=0).spawn_counter.call_one(pm, 7).get(timeout=30) == 16
        # and this controller again: every spawn is its own mesh, none disturbed the others
        again = pm.spawn("w6", Counter, 0)
        assert again.incr.call().get(timeout=20).values() == [1, 1]
        assert mine.incr.call().get(timeout=20).values() == [102, 102]
        assert mine._name != again._name and repr(again).startswith("ActorMesh(class=Counter, name='w6'")
        # looking one up by the name they share lists the candidates and says how to pick one
        with pytest.raises(ValueError) as e:
            pm.actor_mesh("w6")
        msg = str(e.value)
        assert "actor meshes named 'w6' live on proc mesh 'shared6'" in msg, msg
        assert msg.count("spawned by this controller") == 2 and msg.count("spawned by controller ") == 2, msg
        assert repr(mine._name) in msg and "pick one by its id: actor_mesh(" in msg, msg
        assert pm.actor_mesh(mine._name).value.call().get(timeout=20).values() == [102, 102]
        assert pm.actor_mesh("spawner")._name == sp._name  # a name spawned once is found by it
    finally:
        pm.stop().get(timeout=30)


def test_a_call_to_a_child_mesh_of_an_actor_that_failed_says_that_actor_failed() -> None:
    """An actor that fails stops the meshes it spawned (as 0.7.0 does). A call to one of them,
    handed out before, said "mesh stopped (process N exited with code 0)", or "no actor named
    'kids' ... (stopped, or never spawned there)" where only its actors stopped: the proc mesh's
    exit, not why. Now it names the actor that spawned it and its error's first line, for a
    mesh on the owner's own procs and on procs it was handed."""
    code = """
import time
import monarch_nb.actor as api
from monarch_nb.actor import Actor, current_rank, endpoint, this_host
api.unhandled_fault_hook = lambda failure: None

class Kid(Actor):
    @endpoint
    def ping(self) -> int:
        return current_rank().rank

class Owner(Actor):
    @endpoint
    def start(self, procs):
        self.kids = (procs or this_host().spawn_procs(per_host={"gpus": 2})).spawn("kids", Kid)
        self.kids.ping.call().get()
        return self.kids

    @endpoint
    def exit(self) -> None:
        raise SystemExit(5)

for where in ("own", "handed"):
    handed = this_host().spawn_procs(per_host={"gpus": 2}) if where == "handed" else None
    home = this_host().spawn_procs(per_host={"gpus": 1})
    owner = home.spawn("owner", Owner)
    kids = owner.start.call_one(handed).get(timeout=60)
    try:
        owner.exit.call_one().get(timeout=60)
    except Exception:
        pass
    # the owner's caller hears of its failure before the owner has stopped its meshes: calls
    # answer until the stop reaches them, then fail as its actors stopped, then (its own procs)
    # as their procs ended
    deadline = time.monotonic() + 30
    while True:
        try:
            kids.ping.call().get(timeout=30)
        except Exception as e:
            print(where, type(e).__name__, str(e).replace("\\n", " | "))
            if where == "handed" or "mesh stopped (" in str(e):
                break
        assert time.monotonic() < deadline, "the kids still answer, or their procs did not end"
    home.stop().get(timeout=60)
    if handed is not None:
        handed.stop().get(timeout=60)
"""
    r = run_script(code, timeout=120)
    assert r.returncode == 0, r.stderr
    why = "that spawned it failed: SystemExit: 5"
    owner = "the actor <root>.<__main__.Owner owner{'gpus': 0/1}>"
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith(("own ", "handed "))]
    # every call that failed said why, the last of the own procs' as their procs ended
    assert errors and all(f"{owner} {why}" in ln for ln in errors), r.stdout
    assert errors[-1].startswith("handed SupervisionError "), r.stdout
    last_own = [ln for ln in errors if ln.startswith("own ")][-1]
    assert re.search(r"mesh stopped \(process \d+ exited with code 0\) because ", last_own), r.stdout
