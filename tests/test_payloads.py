"""Large payloads: bytes, numpy arrays and torch tensors reach an actor and come back intact,
through shared memory on one host, and leave nothing behind in /dev/shm."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
import torch

from monarch_nb._runtime import shm
from monarch_nb._wire import _rawbuf
from monarch_nb.actor import Actor, endpoint, this_host
from monarch_nb.errors import ProtocolError

pytestmark = pytest.mark.timeout(90)

in_place = pytest.mark.skipif(not _rawbuf.IN_PLACE, reason="this interpreter's bytes objects cannot be laid over shared memory")

BIG = 9 << 20  # above the default shared-memory threshold (8 MiB)


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def bump(self, x):
        x += 1  # arrays and tensors that arrived are writable
        return x

    @endpoint
    def describe(self, x) -> str:
        return f"{type(x).__name__} {getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}"

    @endpoint
    def digest(self, x) -> str:  # type: ignore[no-untyped-def]
        return _digest(x)

    @endpoint
    def keep(self, x) -> str:  # type: ignore[no-untyped-def]
        self.kept = x
        return _digest(x)

    @endpoint
    def keep_and_return(self, x):  # type: ignore[no-untyped-def]
        self.kept = x
        return x

    @endpoint
    def kept(self):  # type: ignore[no-untyped-def]
        return self.kept

    @endpoint
    def kept_digest(self) -> str:
        return _digest(self.kept)

    @endpoint
    def drop(self) -> None:
        del self.kept

    @endpoint
    def leftovers(self, controller_pid: int) -> list[str]:
        return _ours(os.getpid(), controller_pid)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def reads_own_connection(self) -> bool:
        from monarch_nb.actor import _context

        # white-box: the actor's thread holds its caller's connection (Transport.claim)
        return any(s.obj is self and s._claim is not None for s in _context.runtime().actors.values())  # type: ignore[attr-defined]


def _digest(x) -> str:  # type: ignore[no-untyped-def]
    """The length, a byte of every 4 KiB page and the last 64 KiB (hashing all of a 64 MiB
    payload on 16 procs costs seconds of CI time)."""
    mv = memoryview(x).cast("B")
    return f"{mv.nbytes} " + hashlib.sha256(bytes(mv[::4096]) + bytes(mv[-65536:])).hexdigest()


def _ours(*pids: int) -> list[str]:
    """Shared-memory files sent by these processes and not yet taken or given back."""
    prefixes = tuple(f"mnb-{p}-" for p in pids)
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes) and not n.endswith((shm.FREE, shm.BACK)))


def _pooled(*pids: int) -> list[str]:
    """Segments these processes keep for their next large ``bytes``."""
    prefixes = tuple(f"mnb-{p}-p" for p in pids)
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes) and n.endswith((shm.FREE, shm.BACK)))


def _segments(*pids: int) -> set[str]:
    """Every pooled segment of these processes, given back or not."""
    prefixes = tuple(f"mnb-{p}-p" for p in pids)
    return {n.removesuffix(shm.FREE).removesuffix(shm.BACK) for n in os.listdir(shm.SHM_DIR) if n.startswith(prefixes)}


def _all_given_back(echo, timeout: float = 10.0) -> list[str]:  # type: ignore[no-untyped-def]
    """What is still out once both sides have had a look: a ``bytes`` laid over a segment gives
    it back when its receiver next takes a message or sweeps (every heartbeat)."""
    deadline = time.monotonic() + timeout
    while (left := echo.leftovers.call_one(os.getpid()).get(timeout=30)) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the receivers' sweeps
    return left  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def echo():
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="payloads")
    try:
        yield pm.spawn("e", Echo)
    finally:
        pm.stop().get(timeout=30)


def test_large_bytes_arrays_and_tensors_round_trip_intact(echo):
    b = os.urandom(BIG)
    assert echo.echo.call_one(b).get(timeout=30) == b
    arr = np.frombuffer(os.urandom(BIG), dtype=np.float32).copy()
    back = echo.echo.call_one(arr).get(timeout=30)
    assert back.dtype == arr.dtype and np.array_equal(back, arr, equal_nan=True)
    for t in (torch.arange(BIG // 4, dtype=torch.int32), torch.ones(BIG // 2, dtype=torch.bfloat16).reshape(-1, 1024)):
        got = echo.echo.call_one(t).get(timeout=30)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    # several large buffers in one message, mixed with small values
    msg = {"a": b, "t": torch.zeros(3), "n": arr, "s": "small"}
    got = echo.echo.call_one(msg).get(timeout=30)
    assert got["a"] == b and torch.equal(got["t"], torch.zeros(3)) and np.array_equal(got["n"], arr, equal_nan=True)


def test_received_buffers_are_writable_and_private(echo):
    arr = np.zeros(BIG // 8, dtype=np.int64)
    assert (echo.bump.call_one(arr).get(timeout=30) == 1).all()
    assert (arr == 0).all(), "the sender's array is not changed by the receiver"
    t = torch.zeros(BIG // 4)
    back = echo.bump.call_one(t).get(timeout=30)
    assert bool((back == 1).all()) and bool((t == 0).all())
    back += 1  # writable on the controller too
    assert echo.describe.call_one(t[: BIG // 8]).get(timeout=30) == f"Tensor torch.float32 ({BIG // 8},)"


def test_a_large_call_to_an_actor_reading_its_own_connection_is_run_there_and_a_lost_segment_answered(echo, monkeypatch):
    from monarch_nb.actor import _context

    # called alone, an idle actor takes its caller's connection within a few calls
    assert any(echo.reads_own_connection.call_one().get(timeout=10) for _ in range(40))
    b = os.urandom(BIG)
    assert echo.digest.call_one(b).get(timeout=30) == _digest(b)
    assert echo.reads_own_connection.call_one().get(timeout=10), "a large call leaves the connection with the actor"

    # a segment gone before the actor took it (its sender gave it up): that call fails with
    # why, the actor keeps its connection, and the calls after it run in order
    sender = _context.runtime().sender.shm
    put = sender.put

    def lost(buf, pooled=False):  # type: ignore[no-untyped-def]
        name, n = put(buf, pooled=pooled)
        os.unlink(os.path.join(shm.SHM_DIR, name))
        return name, n

    monkeypatch.setattr(sender, "put", lost)
    with pytest.raises(Exception, match="is gone"):
        echo.digest.call_one(b).get(timeout=30)
    monkeypatch.setattr(sender, "put", put)
    assert echo.digest.call_one(b).get(timeout=30) == _digest(b)
    assert echo.reads_own_connection.call_one().get(timeout=10)


def test_nothing_is_left_in_dev_shm(echo):
    for _ in range(3):
        echo.echo.call_one(np.ones(BIG, dtype=np.uint8)).get(timeout=30)
    assert echo.leftovers.call_one(os.getpid()).get(timeout=30) == []


def test_large_bytes_reuse_their_shared_memory_and_what_arrived_stays_intact(echo):
    proc = echo.pid.call_one().get(timeout=30)
    assert _all_given_back(echo) == []
    before = _segments(os.getpid(), proc)
    first = os.urandom(BIG)
    got_first = echo.echo.call_one(first).get(timeout=30)
    assert _segments(os.getpid(), proc), "each side keeps the segment it sent"
    # the same segments carry the next buffers, of the same size, a smaller and a larger one
    sizes = [BIG, BIG, BIG - 4097, BIG + 12345, BIG, BIG, BIG]
    sent = [os.urandom(n) for n in sizes]
    for x in sent:
        assert echo.echo.call_one(x).get(timeout=30) == x
    assert got_first == first, "a bytes object that arrived does not change while it is held"
    # 16 buffers went by: each side used two segments in turn (a receiver gives one back on
    # its next message), and the controller holds a third (got_first)
    new = _segments(os.getpid(), proc) - before
    assert len(new) <= 5, new
    del got_first
    assert _all_given_back(echo) == []


def test_arrays_that_arrived_keep_their_memory_while_held_and_give_their_segment_back_after(echo):
    proc = echo.pid.call_one().get(timeout=30)
    assert _all_given_back(echo) == [], "nothing of the tests before is still on its way back"
    first = np.frombuffer(os.urandom(BIG), dtype=np.uint8).copy()
    held = echo.echo.call_one(first).get(timeout=30)
    t_held = echo.echo.call_one(torch.from_numpy(first.copy())).get(timeout=30)
    assert echo.keep.call_one(first).get(timeout=30) == _digest(first)
    # the segments go round again and again, with other content, while both sides hold theirs
    for i in range(4):
        x = np.full(BIG, i, dtype=np.uint8)
        back = echo.echo.call_one(x).get(timeout=30)
        assert (back[::4096] == i).all() and back[-1] == i
        back[:] = 255  # written after arrival: the next message is not affected
    assert np.array_equal(held, first) and np.array_equal(t_held.numpy(), first)
    assert echo.kept_digest.call_one().get(timeout=30) == _digest(first)
    held[:] = 1  # writable; writes stay with the holder
    assert (held == 1).all() and echo.kept_digest.call_one().get(timeout=30) == _digest(first)
    free = len(_pooled(os.getpid(), proc))
    del held, t_held, back  # the last users of their segments: they go back to the actor at once
    assert len(_pooled(os.getpid(), proc)) == free + 3
    echo.drop.call_one().get(timeout=30)
    assert len(_pooled(os.getpid(), proc)) == free + 4
    assert echo.leftovers.call_one(os.getpid()).get(timeout=30) == []


def _mapped_here(name: str) -> int:
    """How many mappings of the segment ``name`` this process has."""
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def test_an_array_kept_past_the_senders_grace_stays_valid_and_its_memory_goes_with_it():
    sender = shm.ShmSender()
    try:
        data = np.frombuffer(os.urandom(2 << 20), dtype=np.int32).copy()
        name, n = sender.put(data, pooled=True)
        got = np.frombuffer(shm.take(name, n), dtype=np.int32)
        sender.sweep(max_age=0.0)  # not given back within the grace period: the sender gives it up
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
        assert np.array_equal(got, data)
        got += 1
        assert np.array_equal(got - 1, data)
        # the sender keeps its own mapping a while (a late reply may send the segment back)
        assert _mapped_here(name) == 2
        del got
        assert _mapped_here(name) == 1, "the receiver unmaps a segment its sender gave up once unused"

        # given back and then unlinked by its idle sender: the receiver unmaps it on its sweep
        name, n = sender.put(data, pooled=True)
        assert np.array_equal(np.frombuffer(shm.take(name, n), dtype=np.int32), data)
        assert os.path.exists(os.path.join(shm.SHM_DIR, name + shm.FREE))
        sender.sweep(idle=0.0)
        assert _mapped_here(name), "kept mapped for the segment's next use"
        shm.sweep_mapped()
        assert not _mapped_here(name)
    finally:
        sender.close()
        shm.sweep_mapped(-1.0)


def test_large_bytes_that_arrived_never_change_and_hash_right_when_their_memory_is_reused():
    from monarch_nb._wire.serialize import _bytes_from

    def arrive(data: bytes) -> bytes:
        return _bytes_from(memoryview(bytearray(data)))

    n = _rawbuf.MIN_BYTES + 4096
    a, b, c = (os.urandom(n) for _ in range(3))
    got_a = arrive(a)
    as_key = {got_a: "a"}  # hashed: its hash is cached in the object
    view = memoryview(arrive(b))  # a view holds the bytes it was made of
    got_c = arrive(c)
    assert got_a == a and view == b and got_c == c and as_key[a] == "a"
    del as_key, got_a, view
    for data in (os.urandom(n), os.urandom(n)):
        got = arrive(data)
        assert got == data and hash(got) == hash(bytes(bytearray(data))) and {got: 1}[data] == 1
        del got  # dropped: its memory may carry the next one
    assert got_c == c
    _rawbuf.release_idle(-1.0)


def test_a_huge_line_joined_from_pipe_reads_never_changes_when_the_next_one_reuses_memory() -> None:

    n = _rawbuf.MIN_BYTES + 4096
    pieces = [os.urandom(n // 4) for _ in range(4)]
    kept = _rawbuf.join(pieces)  # still held (a subscriber's batch): never written again
    assert kept == b"".join(pieces)
    for _ in range(3):
        new = [os.urandom(n // 4) for _ in range(4)]
        line = _rawbuf.join(new)
        assert line == b"".join(new) and hash(line) == hash(b"".join(new))
        del line  # gone: the next line may take its memory
    assert kept == b"".join(pieces)
    _rawbuf.release_idle(-1.0)


def _mapping_of(addr: int) -> str:
    """The file mapped at ``addr`` in this process, "" for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[5] if len(line.split()) > 5 else ""
    return ""


@in_place
def test_a_large_bytes_is_laid_over_its_segment_which_is_not_reused_while_held():
    from monarch_nb._wire.serialize import _bytes_from

    sender = shm.ShmSender()
    try:
        data = os.urandom(3 << 20)
        name, n = sender.put(data, pooled=True)
        got = _bytes_from(shm.take(name, n))
        assert type(got) is bytes and got == data and hash(got) == hash(data) and {data: 1}[got] == 1
        assert _mapping_of(id(got)) == os.path.join(shm.SHM_DIR, name), "not a copy: the object is in the segment"
        view = memoryview(got)[5:10]
        del got
        shm.sweep_mapped()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name + shm.FREE)), "a view still holds it"
        other, _ = sender.put(data[::-1], pooled=True)
        assert other != name, "a held segment is not written again"
        assert view == data[5:10]
        del view
        assert _bytes_from(shm.take(other, n)) == data[::-1]
        shm.sweep_mapped()
        assert sender.put(data, pooled=True)[0] in (name, other), "a segment nobody holds is reused"
    finally:
        sender.close()
        shm.sweep_mapped(-1.0)


@in_place
def test_received_bytes_past_the_budget_for_shared_memory_are_copied_and_their_segments_go_back(monkeypatch):
    from monarch_nb._wire.serialize import _bytes_from

    monkeypatch.setattr(shm, "LAID_MAX", 5 << 20)
    sender = shm.ShmSender()
    try:
        held = []
        for _ in range(3):  # 2 MiB each: the third goes past 5 MiB
            data = os.urandom(2 << 20)
            name, n = sender.put(data, pooled=True)
            held.append((_bytes_from(shm.take(name, n)), data, name))
        in_segment = [_mapping_of(id(b)) == os.path.join(shm.SHM_DIR, name) for b, _, name in held]
        assert in_segment == [True, True, False]
        assert all(b == data for b, data, _ in held)
        free = [os.path.exists(os.path.join(shm.SHM_DIR, name + shm.FREE)) for _, _, name in held]
        assert free == [False, False, True], "a copied bytes gives its segment back at once"
    finally:
        held.clear()
        sender.close()
        shm.sweep_mapped(-1.0)


def _child_ok(pid: int, go: int) -> bool:
    """Tell the forked child ``pid`` to check what it holds (a byte on ``go``); its verdict."""
    os.write(go, b"x")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@in_place
def test_a_forked_child_keeps_its_laid_bytes_when_the_parent_gives_the_segment_back():
    from monarch_nb._wire.serialize import _bytes_from

    sender = shm.ShmSender()
    go_r, go_w = os.pipe()
    try:
        data = os.urandom(2 << 20)
        name, n = sender.put(data, pooled=True)
        got = _bytes_from(shm.take(name, n))
        pid = os.fork()
        if pid == 0:  # the child: holds, passes around and drops references to its copy
            try:
                os.close(go_w)
                os.read(go_r, 1)  # the parent has given the segment back and it was written again
                ok = got == data and [got, got][1] is got and hash(got) == hash(data)
                del got
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        os.close(go_r)
        del got  # the parent lets go: the segment goes back, and its sender reuses it
        shm.sweep_mapped()
        assert sender.put(os.urandom(n), pooled=True)[0] == name
        assert _child_ok(pid, go_w), "the child's bytes changed, or it crashed"
    finally:
        os.close(go_w)
        sender.close()
        shm.sweep_mapped(-1.0)


@pytest.mark.parametrize(
    "hold",
    [
        "kept = [_bytes_from(shm.take(name, n))]\n",
        # a bytes sent back to its sender: the sender's own segment under the object
        "xp = _bytes_from(shm.take(name, n, 'me'))\n"
        "kept = [_bytes_from(shm.take(*shm.returnable(pickle.PickleBuffer(xp), 'me'))), xp]\n",
    ],
    ids=["received", "sent-back"],
)
def test_a_process_exits_cleanly_holding_laid_bytes(hold: str) -> None:
    import subprocess
    import sys

    script = (
        "import os, pickle\n"
        "from monarch_nb._runtime import shm\n"
        "from monarch_nb._wire.serialize import _bytes_from\n"
        "sender = shm.ShmSender()\n"
        "data = os.urandom(2 << 20)\n"
        "name, n = sender.put(data, pooled=True)\n"
        f"{hold}"
        "alias = kept[0]\n"
        "assert alias == data\n"
        "sender.close()\n"
        "assert alias == data\n"
        "print('held', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "held\n", (r.returncode, r.stderr[-2000:])


def _sent_back(data: bytes, origin: str = "caller") -> tuple[shm.ShmSender, str, bytes, bytes]:
    """One process in both roles: ``data`` sent through a pooled segment, laid over it by its
    receiver (``xp``), and sent back by name to its sender (``y``)."""
    import pickle

    from monarch_nb._wire.serialize import _bytes_from

    sender = shm.ShmSender()
    name, n = sender.put(data, pooled=True)
    xp = _bytes_from(shm.take(name, n, origin))
    ref = shm.returnable(pickle.PickleBuffer(xp), origin)
    assert ref == (name + shm.BACK, n)
    return sender, name, xp, _bytes_from(shm.take(*ref))


@in_place
def test_a_bytes_sent_back_to_its_sender_is_its_own_segment_not_reused_until_both_sides_let_go():
    import pickle

    data = os.urandom(3 << 20)
    sender, name, xp, y = _sent_back(data)
    try:
        path = os.path.join(shm.SHM_DIR, name)
        assert type(y) is bytes and y == data and xp == data and hash(y) == hash(data) == hash(xp)
        assert _mapping_of(id(y)) == _mapping_of(id(xp)) == path, "no copy on either side"
        assert shm.returnable(pickle.PickleBuffer(xp), "caller") is None, "sent back once per message"
        assert shm.returnable(pickle.PickleBuffer(bytes(xp)), "caller") is None, "only a laid-over bytes"
        # the receiver lets go first: the segment waits for the sender's own object
        del xp
        shm.sweep_mapped()
        assert os.path.exists(path + shm.BACK)
        other, _ = sender.put(os.urandom(len(data)), pooled=True)
        assert other != name and y == data
        del y
        assert sender.put(os.urandom(len(data)), pooled=True)[0] == name, "reused once neither side holds it"

        # the sender lets go first: the segment waits for its receiver
        data2 = os.urandom(len(data))
        sender2, name2, xp2, y2 = _sent_back(data2)
        try:
            del y2
            assert sender2.put(data2[::-1], pooled=True)[0] != name2
            assert xp2 == data2
            del xp2
            shm.sweep_mapped()
            assert sender2.put(data2[::-1], pooled=True)[0] == name2
        finally:
            sender2.close()
    finally:
        sender.close()
        shm.sweep_mapped(-1.0)


@in_place
def test_a_bytes_sent_back_after_its_sender_gave_the_segment_up_still_arrives(monkeypatch):
    import pickle

    from monarch_nb._wire.serialize import _bytes_from

    sender = shm.ShmSender()
    try:
        data = os.urandom(2 << 20)
        name, n = sender.put(data, pooled=True)
        xp = _bytes_from(shm.take(name, n, "caller"))
        sender.sweep(max_age=0.0)  # a slow call: the sender gives up the segment it lent
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
        y = _bytes_from(shm.take(*shm.returnable(pickle.PickleBuffer(xp), "caller")))
        assert y == data == xp
        del xp
        shm.sweep_mapped()
        assert _mapped_here(name) == 1 and y == data, "the receiver's mapping is gone, the sender's kept"

        class Later:  # the sender's lingering is over
            @staticmethod
            def monotonic() -> float:
                return time.monotonic() + 2 * shm.GRACE_S

        monkeypatch.setattr(shm, "time", Later)
        shm.sweep_mapped()
        assert _mapped_here(name) == 1 and y == data, "kept while the bytes sent back is held"
        del y
        shm.sweep_mapped()
        assert _mapped_here(name) == 0
    finally:
        sender.close()
        shm.sweep_mapped(-1.0)


@in_place
def test_bytes_sent_back_count_against_the_budget_for_shared_memory(monkeypatch):
    monkeypatch.setattr(shm, "LAID_MAX", 10 << 20)
    data = os.urandom(3 << 20)
    first = _sent_back(data)  # 6 MiB laid: the receiver's object and the sender's
    second = _sent_back(data[::-1])  # the receiver's 3 MiB more fit; the sender's do not
    try:
        (_, name1, xp1, y1), (_, name2, xp2, y2) = first, second
        assert y1 == xp1 == data and y2 == xp2 == data[::-1]
        assert os.path.basename(_mapping_of(id(y1))) == name1
        assert os.path.basename(_mapping_of(id(y2))) != name2, "over the budget: a copy"
    finally:
        for sender, *_ in (first, second):
            sender.close()
        del first, second
        shm.sweep_mapped(-1.0)


def test_a_reference_to_a_segment_not_sent_from_here_is_refused():
    sender = shm.ShmSender()
    try:
        name, n = sender.put(os.urandom(2 << 20), pooled=True)
        for bad, size in (
            (f"mnb-1-p{'0' * 32}{shm.BACK}", n),  # not one of ours
            (name + shm.BACK, 1 << 40),  # larger than the segment
            (name + shm.BACK, -1),
            ("../etc/passwd" + shm.BACK, n),
        ):
            with pytest.raises(ProtocolError):
                shm.take(bad, size)
    finally:
        sender.close()


@in_place
def test_a_forked_child_keeps_what_was_sent_back_on_both_sides():
    import sys

    data = os.urandom(2 << 20)
    sender, name, xp, y = _sent_back(data)
    more_of_y = [y] * 5  # the two headers' counts differ: each must stay its own
    counts = sys.getrefcount(xp), sys.getrefcount(y)
    go_r, go_w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child holds both objects while the parent reuses the segment
            try:
                os.close(go_w)
                os.read(go_r, 1)
                ok = y == data and xp == data and hash(y) == hash(data) and (sys.getrefcount(xp), sys.getrefcount(y)) == counts
                del y, xp
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        os.close(go_r)
        assert (sys.getrefcount(xp), sys.getrefcount(y)) == counts
        del xp, y, more_of_y
        shm.sweep_mapped()
        for _ in range(2):  # a segment of the fork's is never sent again: a new one
            name2, n2 = sender.put(os.urandom(len(data)), pooled=True)
            assert name2 != name
            shm.take(name2, n2).release()
            shm.sweep_mapped()
        assert _child_ok(pid, go_w), "the child's bytes changed, or it crashed"
    finally:
        os.close(go_w)
        sender.close()
        shm.sweep_mapped(-1.0)


@in_place
def test_an_actor_returning_the_bytes_it_was_sent_and_keeping_it_shares_one_segment_safely(echo):
    assert _all_given_back(echo) == []
    first = os.urandom(BIG)
    got = echo.keep_and_return.call_one(first).get(timeout=30)
    assert got == first
    where = os.path.basename(_mapping_of(id(got)))
    assert where.startswith(f"mnb-{os.getpid()}-p"), f"sent back by name, into the segment it came in, not {where!r}"
    # the controller's segments go round with other content while both sides hold theirs
    for i in range(4):
        x = bytes([i]) * BIG
        assert echo.echo.call_one(x).get(timeout=30) == x
    assert got == first and echo.kept_digest.call_one().get(timeout=30) == _digest(first)
    # the kept object again, in a later reply: the controller already holds one over that
    # segment, so this one comes as a copy
    again = echo.kept.call_one().get(timeout=30)
    assert again == first and again is not got
    del got, again
    for i in range(3):
        x = bytes([i + 10]) * BIG
        assert echo.echo.call_one(x).get(timeout=30) == x
    assert echo.kept_digest.call_one().get(timeout=30) == _digest(first)
    echo.drop.call_one().get(timeout=30)
    assert _all_given_back(echo) == []


def test_threads_echoing_large_bytes_at_once_each_get_their_own_back_intact(echo):
    import threading

    from monarch_nb.actor import this_host

    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="payloads-2")
    try:
        other = pm.spawn("e", Echo)
        held: list[tuple[bytes, bytes]] = []
        errors: list[BaseException] = []

        def run(actor, seed: int) -> None:  # type: ignore[no-untyped-def]
            try:
                for i in range(8):
                    x = bytes([seed, i]) * (BIG // 2) + os.urandom(64)
                    y = actor.echo.call_one(x).get(timeout=60)
                    assert y == x
                    if i % 3 == 0:
                        held.append((x, y))  # some results stay held while the segments go round
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(a, k)) for k, a in enumerate((echo, echo, other, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert len(held) == 12 and all(x == y for x, y in held)
    finally:
        pm.stop().get(timeout=30)
    held.clear()
    assert _all_given_back(echo) == []


def test_a_pooled_segment_goes_back_when_idle_or_never_returned():
    from monarch_nb._wire.serialize import _bytes_from

    sender = shm.ShmSender()
    try:
        data = os.urandom(2 << 20)
        name, n = sender.put(data, pooled=True)
        assert _bytes_from(shm.take(name, n)) == data
        shm.sweep_mapped()  # the receiver's next look: nobody holds the bytes laid over it
        assert os.path.exists(os.path.join(shm.SHM_DIR, name + shm.FREE))
        again, _ = sender.put(data[::-1], pooled=True)
        assert again == name, "a given-back segment is reused"
        assert _bytes_from(shm.take(name, n)) == data[::-1]
        shm.sweep_mapped()
        sender.sweep(idle=0.0)
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name + shm.FREE)), "an idle segment is unlinked"
        lost, _ = sender.put(data, pooled=True)  # nobody takes this one
        sender.sweep(max_age=0.0)
        assert not os.path.exists(os.path.join(shm.SHM_DIR, lost))
        kept, _ = sender.put(data, pooled=True)
    finally:
        sender.close()
    left = [n for n in (name, lost, kept) for n in (n, n + shm.FREE) if os.path.exists(os.path.join(shm.SHM_DIR, n))]
    assert left == [], "closing the sender removes what it kept"


def test_a_killed_controllers_shared_memory_is_removed_by_its_allocator(echo):
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import os, sys\n"
        "from monarch_nb.actor import Actor, endpoint, this_host\n"
        "class E(Actor):\n"
        "    @endpoint\n"
        "    def echo(self, x): return x\n"
        "pm = this_host().spawn_procs(per_host={'gpus': 1}, name='payloads-killed')\n"
        f"x = os.urandom({BIG})\n"
        "assert pm.spawn('e', E).echo.call_one(x).get(timeout=30) == x\n"
        "print(os.getpid(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert _segments(pid), "the script kept a segment for its next bytes"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _segments(pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the directory the allocator cleans
        assert _pooled(pid) == [] and _ours(pid) == []
    finally:
        p.kill()
        p.wait(timeout=10)


def test_what_a_gone_process_left_in_dev_shm_is_swept_once_old_and_a_live_ones_is_kept():
    import secrets
    import subprocess
    import sys

    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    paths = {
        who: os.path.join(shm.SHM_DIR, f"mnb-{p.pid}-p{secrets.token_hex(16)}{shm.FREE}")
        for who, p in (("live", live), ("gone", gone))
    }
    try:
        for path in paths.values():
            with open(path, "wb") as f:
                f.write(b"x")
        shm.sweep_stale()
        assert all(os.path.exists(p) for p in paths.values()), "a fresh file is kept"
        shm.sweep_stale(min_age=0.0)
        assert not os.path.exists(paths["gone"]), "an exited process's pool is removed"
        assert os.path.exists(paths["live"]), "a live process's pool is kept"
    finally:
        live.kill()
        live.wait(timeout=10)
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_a_shared_memory_file_not_0600_or_not_ours_is_refused(tmp_path):
    name = f"mnb-{os.getpid()}-" + "ab" * 16
    path = os.path.join(shm.SHM_DIR, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"x" * 100)
    os.close(fd)
    os.chmod(path, 0o644)
    try:
        with pytest.raises(ProtocolError, match="refused"):
            shm.take(name, 100)
        assert not os.path.exists(path), "a refused file of ours is still removed"
        with pytest.raises(ProtocolError, match="malformed"):
            shm.take("../etc/passwd", 100)
        with pytest.raises(ProtocolError, match="gone"):
            shm.take(name, 100)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_when_shared_memory_fails_the_buffer_takes_the_socket(echo, monkeypatch):
    from monarch_nb.actor import _context

    rt = _context.runtime()
    assert rt.sender.shm is not None

    def full(buf, pooled=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rt.sender.shm, "put", full)
    arr = np.arange(BIG // 8, dtype=np.int64)
    assert np.array_equal(echo.echo.call_one(arr).get(timeout=30), arr)


def test_a_dev_shm_too_small_for_the_payloads_leaves_them_to_the_socket(tmp_path):  # type: ignore[no-untyped-def]
    # a real /dev/shm of 1 MiB (a container's default is 64 MiB), in a mount namespace of the
    # controller's own that the allocator and its procs it starts inherit: 16 MiB payloads there
    # and back, in both directions, whole; nothing is left in it
    import subprocess

    import _ownctl

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a mount namespace here (not root?)")
    small_shm = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"',
    ]
    got = _ownctl.run(
        _ownctl.runtime_dir(tmp_path),
        """
        import shutil
        import numpy as np, torch
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        a = pm.spawn("e", E)
        b = os.urandom(16 << 20)
        arr = np.frombuffer(os.urandom(16 << 20), np.uint8)
        t = torch.from_numpy(np.frombuffer(os.urandom(16 << 20), np.int32).copy())
        ok = [
            a.echo.call_one(b).get(timeout=60) == b,
            bool((a.echo.call_one(arr).get(timeout=60) == arr).all()),
            bool(torch.equal(a.echo.call_one(t).get(timeout=60), t)),
        ]
        report({"ok": ok, "shm_bytes": shutil.disk_usage("/dev/shm").total, "left": os.listdir("/dev/shm")})
        pm.stop().get(timeout=60)
        """,
        wrap=small_shm,
    )
    assert got["shm_bytes"] == 1 << 20, got  # the small one, not the machine's
    assert got["ok"] == [True, True, True], got
    assert got["left"] == [], got


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_one_payload_called_to_16_actors_is_written_once_and_the_controller_stays_small(monkeypatch):  # type: ignore[no-untyped-def]
    pm = this_host().spawn_procs(per_host={"gpus": 16}, name="fanpayload")
    try:
        e = pm.spawn("e", Echo)
        e.pid.call().get(timeout=60)
        mib = 64
        base = _rss_mib("VmRSS")
        b = os.urandom(1 << 20) * mib
        arr = np.frombuffer(b, dtype=np.uint8)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from here
        want = _digest(b)
        for x in (b, arr):
            assert set(e.digest.call(x).get(timeout=60).values()) == {want}
        # the payload itself, plus at most one more of it: not one copy per actor (512 MiB
        # of shared-memory segments mapped in the controller before)
        grew = _rss_mib("VmHWM") - base
        assert grew <= 2 * mib, f"controller peak grew by {grew:.0f} MiB for a {mib} MiB payload to 16 actors"
        assert all(v == [] for v in e.leftovers.call(os.getpid()).get(timeout=30).values())

        # /dev/shm full: tried once for the message, then every actor gets it over its socket
        from monarch_nb.actor import _context

        tries = []

        def full(buf, pooled=False):  # type: ignore[no-untyped-def]
            tries.append(1)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_context.runtime().sender.shm, "put", full)
        small = b[:BIG]
        assert set(e.digest.call(small).get(timeout=60).values()) == {_digest(small)}
        assert len(tries) == 1
    finally:
        pm.stop().get(timeout=60)
