"""The data plane (``monarch_nb.rdma``): buffers that move between procs directly.

Real procs on the embedded default for one host, network-namespace hosts (tests/_netns.py)
for two: reads and writes see the owner's memory in place, complete while the owner's actor
is busy, fail with SupervisionError when the owner died, and leave nothing in /dev/shm.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
from conftest import run_script, wait_for

from monarch_nb.actor import Actor, ProcMesh, endpoint, this_host
from monarch_nb.errors import ConfigError, SupervisionError
from monarch_nb.rdma import (
    BufferDroppedError,
    RDMAAction,
    RDMABuffer,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
)

pytestmark = pytest.mark.timeout(120)

N = 1 << 20


class Owner(Actor):
    def __init__(self) -> None:
        self.t = torch.arange(N // 4, dtype=torch.int32)
        self.raw = bytearray(b"m" * 4096)
        self.buf = RDMABuffer(self.t.view(torch.uint8))
        self.mvbuf = RDMABuffer(memoryview(self.raw))

    @endpoint
    def buffers(self) -> tuple[RDMABuffer, RDMABuffer]:
        return self.buf, self.mvbuf

    @endpoint
    def info(self) -> dict:
        from monarch_nb._runtime import _dataplane as dp

        srv = dp.local_server()
        return dict(
            pid=os.getpid(),
            ptr=self.t.data_ptr(),
            head=self.t[:4].tolist(),
            raw=bytes(self.raw[:4]),
            registered=srv.registered() if srv else 0,
            bytes_out=srv.bytes_out if srv else 0,
        )

    @endpoint
    def bump(self) -> None:
        self.t += 1  # in place: the buffer must show it

    @endpoint
    def temporary(self) -> RDMABuffer:
        return RDMABuffer(torch.ones(1024, dtype=torch.uint8))  # nobody keeps it here

    @endpoint
    def collect(self) -> None:
        gc.collect()

    @endpoint
    def drop_own(self) -> None:
        self.buf.drop().get(timeout=10)

    @endpoint
    def block(self, seconds: float) -> float:
        # not a sleep to wait for something: this actor must be busy while others read it
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            sum(range(1000))
        return seconds


class Reader(Actor):
    def __init__(self) -> None:
        self.dst = torch.zeros(N // 4, dtype=torch.int32)

    @endpoint
    def read(self, buf: RDMABuffer, timeout: int = 30) -> list[int]:
        buf.read_into(self.dst.view(torch.uint8), timeout=timeout).get(timeout=60)
        return [int(self.dst[0]), int(self.dst[-1])]

    @endpoint
    def read_mv(self, buf: RDMABuffer) -> bytes:
        out = bytearray(buf.size())
        buf.read_into(memoryview(out)).get(timeout=60)
        return bytes(out[:8])

    @endpoint
    def write(self, buf: RDMABuffer, value: int) -> None:
        src = torch.full((N // 4,), value, dtype=torch.int32)
        buf.write_from(src.view(torch.uint8)).get(timeout=60)

    @endpoint
    def error_of_read(self, buf: RDMABuffer) -> tuple[str, str]:
        try:
            buf.read_into(memoryview(bytearray(buf.size()))).get(timeout=60)
        except Exception as e:
            return type(e).__name__, str(e)
        return "", ""

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get(timeout=30)

    @endpoint
    def forget(self, buf: RDMABuffer) -> None:
        del buf
        gc.collect()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def pair() -> Iterator[tuple[ProcMesh, ProcMesh]]:
    a = this_host().spawn_procs(per_host={"gpus": 1})
    b = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        yield a, b
    finally:
        for m in (a, b):
            try:
                m.stop().get(timeout=30)
            except Exception:
                pass


def _leftovers(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith((f"mnb-{pid}-", f"torch_{pid}_"))]


def test_backend_names() -> None:
    assert get_rdma_backend() == "shm+tcp"
    assert is_ibverbs_available() is False
    with pytest.warns(DeprecationWarning):
        assert is_rdma_available() is False


def test_bad_memory_raises_value_error() -> None:
    with pytest.raises(ValueError, match="size 0"):
        RDMABuffer(torch.zeros(0))
    with pytest.raises(ValueError, match="1d contiguous"):
        RDMABuffer(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="1d contiguous"):
        RDMABuffer(torch.zeros(16)[::2])
    with pytest.raises(ValueError, match="1d"):
        RDMABuffer(memoryview(bytearray(8)).cast("B", (2, 4)))
    # any other object: Monarch's ValueError (it was a TypeError here); a bytes-like one is told how to lend it
    with pytest.raises(ValueError, match="1d c-contiguous memoryview. Got: list$"):
        RDMABuffer([1, 2, 3])
    with pytest.raises(ValueError, match=r"Got: bytearray: wrap it, RDMABuffer\(memoryview\(x\)\)"):
        RDMABuffer(bytearray(8))
    assert RDMABuffer(memoryview(bytearray(8))).size() == 8
    buf = RDMABuffer(torch.zeros(16, dtype=torch.uint8))
    try:
        with pytest.raises(ValueError, match="smaller"):
            buf.read_into(torch.zeros(8, dtype=torch.uint8))
        with pytest.raises(ValueError, match="exceeds"):
            buf.write_from(torch.zeros(32, dtype=torch.uint8))
        # a meta tensor has no bytes to fill: refused, not a read that "succeeds" and keeps nothing
        with pytest.raises(ValueError, match="CPU and CUDA tensors, not of a tensor on meta"):
            buf.read_into(torch.empty(16, dtype=torch.uint8, device="meta"))
        with pytest.raises(ValueError, match="not of a tensor on meta"):
            RDMABuffer(torch.empty(16, dtype=torch.uint8, device="meta"))
        # a negative timeout, as Monarch's: refused also where the copy would not need one
        for call in (buf.read_into, buf.write_from):
            with pytest.raises(OverflowError, match="timeout must be >= 0"):
                call(torch.zeros(16, dtype=torch.uint8), timeout=-1)
        with pytest.raises(OverflowError, match="timeout must be >= 0"):
            RDMAAction().read_remote(torch.zeros(16, dtype=torch.uint8), buf).submit(timeout=-1)
        # no timeout is not "no limit": refused up front in words, on every path, as Monarch's TypeError
        local = torch.zeros(16, dtype=torch.uint8)
        for attempt in (
            lambda: buf.read_into(local, timeout=None),  # type: ignore[arg-type]
            lambda: buf.write_from(local, timeout=None),  # type: ignore[arg-type]
            lambda: RDMAAction().read_remote(local, buf).submit(timeout=None),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match="timeout must be a number of seconds .* not None"):
                attempt()
    finally:
        buf.drop().get(timeout=10)


def test_same_host_reads_and_writes_alias_the_owner_without_a_socket(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("owner", Owner)
    reader = b.spawn("reader", Reader)
    buf, mvbuf = owner.buffers.call_one().get(timeout=60)
    assert buf.size() == N and buf.backend == "shm+tcp" and "owner" in buf.owner
    before = owner.info.call_one().get(timeout=30)
    assert reader.read.call_one(buf).get(timeout=60) == [0, N // 4 - 1]
    owner.bump.call_one().get(timeout=30)  # changed in place after the buffer was made
    assert reader.read.call_one(buf).get(timeout=60) == [1, N // 4]
    reader.write.call_one(buf, 7).get(timeout=60)
    after = owner.info.call_one().get(timeout=30)
    assert after["head"] == [7, 7, 7, 7] and after["ptr"] == before["ptr"]
    # the tensor's bytes never went through the owner's data server (its sockets)
    assert after["bytes_out"] == 0
    # a memoryview cannot be moved into shared memory: it is served by the owner's stream
    assert reader.read_mv.call_one(mvbuf).get(timeout=60) == b"m" * 8
    assert owner.info.call_one().get(timeout=30)["bytes_out"] == 4096
    # batches, from the controller too
    dst1, dst2 = torch.zeros(N, dtype=torch.uint8), bytearray(4096)
    RDMAAction().read_remote(dst1, buf).read_remote(memoryview(dst2), mvbuf).submit(timeout=30).get(timeout=60)
    assert dst1.view(torch.int32)[:2].tolist() == [7, 7] and dst2[:1] == b"m"


def test_reads_complete_while_the_owner_is_busy(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("owner", Owner)
    reader = b.spawn("reader", Reader)
    buf, mvbuf = owner.buffers.call_one().get(timeout=60)
    busy = owner.block.call_one(5.0)
    assert reader.read.call_one(buf).get(timeout=30) == [0, N // 4 - 1]
    assert reader.read_mv.call_one(mvbuf).get(timeout=30) == b"m" * 8
    reader.write.call_one(buf, 3).get(timeout=30)
    assert not busy.done(), "reads waited for the owner's endpoint"
    assert busy.get(timeout=30) == 5.0
    assert owner.info.call_one().get(timeout=30)["head"] == [3, 3, 3, 3]


def test_read_from_a_dead_owner_is_a_supervision_error_and_leaves_no_segment(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("owner", Owner)
    reader = b.spawn("reader", Reader)
    buf, mvbuf = owner.buffers.call_one().get(timeout=60)
    pid = owner.info.call_one().get(timeout=30)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "owner proc to die")
    for b_ in (buf, mvbuf):
        kind, msg = reader.error_of_read.call_one(b_).get(timeout=60)
        assert kind == "SupervisionError", (kind, msg)
        assert "owner" in msg and buf.owner in msg, msg
    with pytest.raises(SupervisionError, match="owner"):
        buf.read_into(torch.zeros(N, dtype=torch.uint8)).get(timeout=30)
    assert _leftovers(pid) == []


ZOMBIE_OWNER = """
import pickle, sys, torch
from monarch_nb.rdma import RDMABuffer
keep = torch.ones(4096, dtype=torch.uint8), bytearray(4096)
bufs = RDMABuffer(keep[0]), RDMABuffer(memoryview(keep[1]))
sys.stdout.write(pickle.dumps(bufs).hex() + "\\n")
sys.stdout.flush()
sys.stdin.read()
"""


def test_an_owner_killed_but_not_yet_reaped_is_gone_not_dropped() -> None:
    # a reader sees the owner's sockets and files close as it dies, before its parent reaps it:
    # in that moment (a zombie here, kept so by not waiting for it) the reader must say the
    # owner is gone, not that somebody dropped the buffer
    import pickle
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", ZOMBIE_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        shm_buf, stream_buf = pickle.loads(bytes.fromhex(child.stdout.readline().decode()))
        assert "(shm)" in repr(shm_buf) and "(stream)" in repr(stream_buf)
        stream_buf.read_into(memoryview(bytearray(4096))).get(timeout=30)  # a pooled connection too
        os.kill(child.pid, signal.SIGKILL)

        def zombie() -> bool:
            with open(f"/proc/{child.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_for(zombie, 10, "the owner to be a zombie")
        for buf in (shm_buf, stream_buf):
            with pytest.raises(SupervisionError, match="owner of this RDMABuffer, .* is gone"):
                buf.read_into(torch.zeros(4096, dtype=torch.uint8)).get(timeout=30)
    finally:
        child.kill()
        child.wait(timeout=30)


def test_drop_gc_and_reader_handles(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("owner", Owner)
    reader = b.spawn("reader", Reader)
    buf, mvbuf = owner.buffers.call_one().get(timeout=60)
    start = owner.info.call_one().get(timeout=30)
    assert start["registered"] == 2
    # a reader's handle going away frees nothing
    reader.forget.call_one(buf).get(timeout=30)
    assert reader.read.call_one(buf).get(timeout=60) == [0, N // 4 - 1]
    # an owner's handle nobody keeps is collected, and with it its registration
    tmp = owner.temporary.call_one().get(timeout=30)
    owner.collect.call_one().get(timeout=30)
    assert owner.info.call_one().get(timeout=30)["registered"] == 2
    kind, msg = reader.error_of_read.call_one(tmp).get(timeout=30)
    assert kind == "BufferDroppedError", (kind, msg)
    # nobody called drop() (Monarch's would still serve it): the words say what to keep
    assert "kept no reference to it" in msg and "self.buf = RDMABuffer(" in msg, msg
    # drop() from any holder: the owner lets go at once (its descriptor of the shared file too)
    reader.drop.call_one(mvbuf).get(timeout=30)
    owner.drop_own.call_one().get(timeout=30)
    end = owner.info.call_one().get(timeout=30)
    assert end["registered"] == 0
    shm = buf._shm
    assert shm is not None
    try:
        st = os.stat(f"/proc/{end['pid']}/fd/{shm.fd}")
        assert (st.st_dev, st.st_ino) != (shm.dev, shm.ino)
    except FileNotFoundError:
        pass
    for b_ in (buf, mvbuf):
        kind, msg = reader.error_of_read.call_one(b_).get(timeout=30)
        assert kind == "BufferDroppedError" and "dropped" in msg, (kind, msg)
    with pytest.raises(BufferDroppedError):
        buf.read_into(torch.zeros(N, dtype=torch.uint8)).get(timeout=30)
    pid = end["pid"]
    a.stop().get(timeout=30)
    assert _leftovers(pid) == []


def test_a_stalled_owner_times_out_saying_so(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("owner", Owner)
    reader = b.spawn("reader", Reader)
    _, mvbuf = owner.buffers.call_one().get(timeout=60)
    pid = owner.info.call_one().get(timeout=30)["pid"]
    assert reader.read_mv.call_one(mvbuf).get(timeout=60) == b"m" * 8
    os.kill(pid, signal.SIGSTOP)  # its data server cannot answer, its process is alive
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="owner's side stalled") as e:
            mvbuf.read_into(memoryview(bytearray(4096)), timeout=1).get(timeout=30)
        assert time.monotonic() - t0 < 10
        assert mvbuf.owner in str(e.value)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert reader.read_mv.call_one(mvbuf).get(timeout=60) == b"m" * 8


def test_a_drop_waits_for_a_stalled_owner_only_as_long_as_its_timeout(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # drop() from another holder waited a fixed 30 s for a stalled owner, then raised the data
    # plane's own Stalled, naming neither the buffer's owner nor what was left undone
    a, _ = pair
    owner = a.spawn("owner", Owner)
    _, mvbuf = owner.buffers.call_one().get(timeout=60)
    info = owner.info.call_one().get(timeout=30)
    pid = info["pid"]
    with pytest.raises(TypeError, match="timeout must be a number"):
        mvbuf.drop(timeout=None)  # type: ignore[arg-type]
    os.kill(pid, signal.SIGSTOP)  # its data server cannot answer, its process is alive
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            mvbuf.drop(timeout=1).get(timeout=30)
        assert time.monotonic() - t0 < 10
        assert type(e.value) is TimeoutError, type(e.value)
        msg = str(e.value)
        assert msg.startswith(f"RDMABuffer drop at {mvbuf.owner} timed out after 1 s: the owner's side stalled"), msg
        assert "drop it again once the owner answers" in msg, msg
    finally:
        os.kill(pid, signal.SIGCONT)
    mvbuf.drop(timeout=10).get(timeout=30)  # the owner answers again: done
    assert owner.info.call_one().get(timeout=30)["registered"] == info["registered"] - 1


def test_a_batch_with_a_failed_op_resolves_only_once_every_op_has_ended(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # a batch failed at its first failure while its other ops still wrote into the caller's
    # memory (Monarch's resolves once every op completes or times out)
    a, _ = pair
    owner = a.spawn("owner", Owner)
    _, mvbuf = owner.buffers.call_one().get(timeout=60)
    pid = owner.info.call_one().get(timeout=30)["pid"]
    gone = RDMABuffer(torch.ones(16, dtype=torch.uint8))
    gone.drop().get(timeout=10)
    dst = bytearray(4096)
    os.kill(pid, signal.SIGSTOP)  # its stream read can only end at the deadline
    try:
        t0 = time.monotonic()
        fut = RDMAAction().read_remote(memoryview(dst), mvbuf).read_remote(torch.zeros(16, dtype=torch.uint8), gone)
        with pytest.raises(BufferDroppedError):
            fut.submit(timeout=2).get(timeout=30)
        assert time.monotonic() - t0 >= 1.9, "the batch failed while its stalled read was still under way"
    finally:
        os.kill(pid, signal.SIGCONT)


def test_transfers_stalled_on_one_owner_do_not_hold_up_another(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # transfers ran on a pool of 8 threads: 8 reads from a stalled owner made a read from a
    # healthy one wait for their deadlines, well past its own timeout
    from monarch_nb.rdma import _buffer

    a, b = pair
    stalled, healthy = a.spawn("stalled", Owner), b.spawn("healthy", Owner)
    _, stuck_buf = stalled.buffers.call_one().get(timeout=60)
    _, good_buf = healthy.buffers.call_one().get(timeout=60)
    pid = stalled.info.call_one().get(timeout=30)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        stuck = [stuck_buf.read_into(memoryview(bytearray(4096)), timeout=20) for _ in range(_buffer.POOL_SIZE + 2)]
        out = bytearray(4096)
        t0 = time.monotonic()
        good_buf.read_into(memoryview(out), timeout=5).get(timeout=30)
        assert time.monotonic() - t0 < 5, "the read waited for transfers to another owner"
        assert out[:1] == b"m"
    finally:
        os.kill(pid, signal.SIGCONT)
    for f in stuck:
        f.get(timeout=30)  # the owner answers again: they complete


def test_the_dashboard_shows_bytes_moved_per_proc() -> None:
    from monarch_nb import introspect
    from monarch_nb.widgets._render import grid_html

    a = this_host().spawn_procs(per_host={"gpus": 1}, name="rdma_dash_a")
    b = this_host().spawn_procs(per_host={"gpus": 1}, name="rdma_dash_b")
    try:
        owner = a.spawn("owner", Owner)
        reader = b.spawn("reader", Reader)
        buf, mvbuf = owner.buffers.call_one().get(timeout=60)
        reader.read.call_one(buf).get(timeout=60)
        reader.read_mv.call_one(mvbuf).get(timeout=60)

        def procs(mesh: str) -> list[dict]:
            for al in introspect.status()["allocators"]:
                for m in al.get("meshes", []):
                    if m["name"] == mesh:
                        return m["procs"]
            return []

        # the reader read N + 4096 bytes; the owner served the 4096 of the stream (shm costs it nothing)
        got = wait_for(lambda: (p := procs("rdma_dash_b")) and p[0].get("bytes_moved") == N + 4096 and p, 10, "reader's bytes")
        assert wait_for(lambda: (p := procs("rdma_dash_a")) and p[0].get("bytes_moved") == 4096, 10, "owner's bytes")
        ranks = [{**got[0], "rank": 0, "state": "idle"}]
        assert "moved 1.1 MB" in grid_html(ranks, ["gpus"], [1])
    finally:
        for m in (a, b):
            m.stop().get(timeout=30)


class TinyShmOwner(Actor):
    """Owns a buffer made while its thread sees a full /dev/shm (a tiny tmpfs in a mount
    namespace of this thread's own: the rest of the machine keeps the real one)."""

    @endpoint
    def make(self) -> tuple[RDMABuffer, list[str]]:
        libc = ctypes.CDLL(None, use_errno=True)
        clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 1 << 18
        assert libc.unshare(clone_newns) == 0, os.strerror(ctypes.get_errno())
        assert libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0, os.strerror(ctypes.get_errno())
        assert libc.mount(b"tiny", b"/dev/shm", b"tmpfs", 0, b"size=64k") == 0, os.strerror(ctypes.get_errno())
        self.t = torch.full((N,), 5, dtype=torch.uint8)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.buf = RDMABuffer(self.t)
        return self.buf, [f"{x.category.__name__}: {x.message}" for x in w] + os.listdir("/dev/shm")


def test_full_dev_shm_falls_back_to_the_stream_with_a_warning(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("tiny", TinyShmOwner)
    reader = b.spawn("reader", Reader)
    buf, seen = owner.make.call_one().get(timeout=60)
    assert len(seen) == 1 and seen[0].startswith("RDMAShmFallbackWarning") and "shared memory" in seen[0], seen
    assert "stream" in repr(buf)
    assert reader.read_mv.call_one(buf).get(timeout=60) == b"\x05" * 8


_PLANTED = """
import os, resource, signal, subprocess, sys, warnings
import torch
from monarch_nb.rdma._buffer import _share

pid = os.getpid()
theirs, link, ours = f"/dev/shm/torch_{pid}_theirs", f"/dev/shm/torch_{pid}_link", os.environ["OURS"]
PLANT = "import os, sys; open(sys.argv[1], 'x').close(); os.symlink(sys.argv[3], sys.argv[2])"


def plant(signum, frame):
    # torch could not size its file (the file size limit below): another user makes files under
    # this process's torch names now, before the failed share cleans up what torch left
    if not os.path.lexists(theirs):
        argv = [os.environ["NOBODY_PY"], "-c", PLANT, theirs, link, ours]
        subprocess.run(argv, user=65534, group=65534, extra_groups=[], cwd="/", env={}, check=True)


open(ours, "w").close()
signal.signal(signal.SIGXFSZ, plant)
t = torch.ones(1 << 20, dtype=torch.uint8)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        shm, fds = _share(t, t.numel())
    print("shared:", shm, [type(x.message).__name__ for x in w])
finally:
    for n in sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_")):
        print("left:", n.split("_", 2)[2], os.lstat("/dev/shm/" + n).st_uid)
        os.unlink("/dev/shm/" + n)
print("ours:", os.path.exists(ours))
"""


def test_a_failed_move_to_shared_memory_removes_only_what_torch_left_not_another_user_s_files(tmp_path) -> None:
    # torch leaves the file it could not size in /dev/shm, and the move removed every new
    # torch_<pid>_* name: as root, also a file or link another user had made under one (the pid
    # is no secret and /dev/shm is everyone's). torch fails here on RLIMIT_FSIZE, a real failure
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    r = run_script(_PLANTED, env={"OURS": str(tmp_path / "ours"), "NOBODY_PY": py})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "shared: None ['RDMAShmFallbackWarning']",  # served over the stream, as when /dev/shm is full
        "left: link 65534",  # another user's link to a file of ours: judged as itself, kept
        "left: theirs 65534",
        "ours: True",
    ], r.stdout


class ForeignMemoryOwner(Actor):
    """Tensors over memory torch does not own: a numpy array's, a bytearray's."""

    def __init__(self) -> None:
        import numpy as np

        self.arr = np.zeros(4096, dtype=np.uint8)
        self.raw = bytearray(4096)
        self.bufs = (RDMABuffer(torch.from_numpy(self.arr)), RDMABuffer(torch.frombuffer(self.raw, dtype=torch.uint8)))

    @endpoint
    def buffers(self) -> tuple[RDMABuffer, RDMABuffer]:
        return self.bufs

    @endpoint
    def fill(self, value: int) -> None:
        self.arr[:] = value  # through the array, not the tensor
        self.raw[:] = bytes([value]) * 4096

    @endpoint
    def heads(self) -> tuple[int, int]:
        return int(self.arr[0]), self.raw[0]


def test_a_tensor_over_a_numpy_array_stays_aliased_to_it(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # a tensor of torch.from_numpy / torch.frombuffer was moved into shared memory like any CPU
    # tensor: the array stayed where it was, reads missed the owner's changes to it and writes
    # never reached it (Monarch registers the memory where it is: both are seen)
    a, _ = pair
    owner = a.spawn("owner", ForeignMemoryOwner)
    bufs = owner.buffers.call_one().get(timeout=60)
    owner.fill.call_one(5).get(timeout=30)
    for buf in bufs:
        dst = torch.zeros(4096, dtype=torch.uint8)
        buf.read_into(dst).get(timeout=30)
        assert int(dst[0]) == 5 and int(dst[-1]) == 5, repr(buf)
    bufs[0].write_from(torch.full((4096,), 9, dtype=torch.uint8)).get(timeout=30)
    bufs[1].write_from(torch.full((4096,), 8, dtype=torch.uint8)).get(timeout=30)
    assert owner.heads.call_one().get(timeout=30) == (9, 8)


def test_a_buffer_dropped_and_freed_mid_read_still_sends_its_bytes() -> None:
    # the owner drops a CPU buffer and lets go of its tensor while a stream read of it is under
    # way (a reader on another host; the same here, over the unix socket): the bytes in flight
    # came from freed memory (unmapped: the read broke; across hosts the sealing segfaulted the
    # owner; reused: another tensor's bytes)
    from monarch_nb._runtime import _dataplane as dp

    n = 64 << 20
    t = torch.ones(n, dtype=torch.uint8)
    buf = RDMABuffer(t)
    ch = dp._pool.take(("unix", buf._addr.unix), None, time.monotonic() + 30)
    try:
        ch.sock.settimeout(30)
        ch.send(dp._REQ.pack(dp.OP_READ, buf._id, 0, n))
        rsp = bytearray(dp._RSP.size)
        ch.recv_into(memoryview(rsp))
        assert dp._RSP.unpack(rsp) == (dp.ST_OK, n)
        out = bytearray(n)
        ch.recv_into(memoryview(out)[: 1 << 20])  # under way: the owner's thread is sending
        buf.drop().get(timeout=10)
        del t, buf
        gc.collect()
        reuse = torch.full((n,), 7, dtype=torch.uint8)  # what freed memory would be taken by
        ch.recv_into(memoryview(out)[1 << 20 :])
        assert out.count(1) == n, "the read sent bytes that were not the buffer's"
        del reuse
    finally:
        ch.close()


FD_STARVED = """
import errno, os, pickle, resource, sys, torch, warnings
from monarch_nb.actor import _context
from monarch_nb.rdma import RDMABuffer
bufs = pickle.loads(bytes.fromhex(sys.stdin.readline()))
mode = sys.argv[1]
_context.runtime()  # it raises the soft limit as it starts: lowered after
if mode == "warm":  # this process has told its host already: the transfers' own descriptors run out
    from monarch_nb._runtime import _dataplane as dp
    dp.host_id()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
hog = []
with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fall back "because /dev/shm is full"
    try:
        while True:
            keep = torch.ones(4096, dtype=torch.uint8)
            hog.append((keep, RDMABuffer(keep)))
    except OSError as e:
        print("make", e.errno, e)
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for b in bufs:
    try:
        b.read_into(torch.zeros(4096, dtype=torch.uint8), timeout=10).get(timeout=30)
        print("read ok")
    except Exception as e:
        print("read", type(e).__name__, getattr(e, "errno", None), e)
del hog
import gc; gc.collect()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
for b in bufs:  # descriptors free again: nothing remembered from the starved moment
    dst = torch.zeros(4096, dtype=torch.uint8)
    b.read_into(dst, timeout=10).get(timeout=30)
    print("then", int(dst[0]))
sys.stdout.flush()
"""


def test_out_of_descriptors_says_so_and_blames_neither_owner_nor_host() -> None:
    # a process out of file descriptors was told the owner of a buffer "is gone" (a stream) or got
    # a bare "Too many open files" (shared memory, making a buffer); and a first transfer in that
    # state took this host for another one for good, so that later reads failed for ever
    import pickle
    import subprocess
    import sys

    raw = bytearray(b"\x03" * 4096)
    keep = torch.full((4096,), 4, dtype=torch.uint8)
    bufs = [RDMABuffer(memoryview(raw)), RDMABuffer(keep)]
    try:
        for mode in ("cold", "warm"):
            out = subprocess.run(
                [sys.executable, "-c", FD_STARVED, mode],
                input=pickle.dumps(bufs).hex() + "\n",
                capture_output=True,
                text=True,
                timeout=90,
            )
            lines = out.stdout.splitlines()
            assert out.returncode == 0 and len(lines) == 5, (mode, out.stdout, out.stderr[-3000:])
            make, reads, then = lines[0], lines[1:3], lines[3:]
            assert make.startswith("make 24 ") and "holds two descriptors" in make and "ulimit -n" in make, make
            for line in reads:
                assert line.startswith("read OSError 24 "), (mode, line)
                assert "needs a file descriptor" in line and "ulimit -n" in line and "RDMABuffer of" in line, line
            assert then == ["then 3", "then 4"], (mode, out.stdout)
    finally:
        for b in bufs:
            b.drop().get(timeout=10)


class ManyReader(Actor):
    @endpoint
    def read_all(self, bufs: list[RDMABuffer], headroom: int, maps_max: int) -> dict:
        import resource

        from monarch_nb._runtime import _dataplane as dp

        dp.maps._maps.most = maps_max  # MAPS_MAX, lowered for this process: the next mapping lets go down to it
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
        try:
            dst = torch.zeros(64, dtype=torch.uint8)
            heads = []
            for b in bufs:
                b.read_into(dst).get(timeout=30)
                heads.append(int(dst[0]))
            # the first ones were let go to stay under maps_max: mapped again when needed
            again = []
            for b in bufs[:3]:
                b.read_into(dst).get(timeout=30)
                again.append(int(dst[0]))
            bufs[1].write_from(torch.full((64,), 250, dtype=torch.uint8)).get(timeout=30)
            return dict(heads=heads, again=again, fds=len(os.listdir("/proc/self/fd")), maps=dp.maps.count())
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    @endpoint
    def error_of_read(self, buf: RDMABuffer) -> str:
        try:
            buf.read_into(torch.zeros(64, dtype=torch.uint8)).get(timeout=30)
        except Exception as e:
            return type(e).__name__
        return ""


def test_a_reader_of_more_buffers_than_its_descriptor_limit() -> None:
    # a reader kept a descriptor per owner's buffer it had mapped (mmap.mmap keeps a duplicate),
    # so a training loop reading one buffer per parameter shard, or a new buffer per step, failed
    # with EMFILE once it had read as many buffers as its soft limit (often 1,024)
    n = 400
    keep = [torch.full((64,), i % 200, dtype=torch.uint8) for i in range(n)]
    bufs = [RDMABuffer(t) for t in keep]
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        reader = procs.spawn("many", ManyReader)
        got = reader.read_all.call_one(bufs, 64, 100).get(timeout=90)
        assert got["heads"] == [i % 200 for i in range(n)]
        assert got["again"] == [0, 1, 2]
        assert int(keep[1][0]) == 250 and int(keep[1][-1]) == 250  # written in place, after being let go
        assert got["maps"] <= 100, got
        # a buffer dropped after its mapping was let go is still seen as dropped, not read
        bufs[0].drop().get(timeout=10)
        assert reader.error_of_read.call_one(bufs[0]).get(timeout=30) == "BufferDroppedError"
    finally:
        for b in bufs:
            b.drop().get(timeout=10)
        procs.stop().get(timeout=30)


def test_idle_connections_to_owners_that_went_away_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # a reader kept its idle stream connection to every owner it had read from, also once that
    # owner's process had exited: a descriptor per short-lived owner, for the reader's life
    from monarch_nb._runtime import _dataplane as dp

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    owner = procs.spawn("owner", Owner)
    _, mvbuf = owner.buffers.call_one().get(timeout=60)
    out = bytearray(4096)
    mvbuf.read_into(memoryview(out)).get(timeout=30)
    assert bytes(out[:2]) == b"mm"
    gone = ("unix", mvbuf._addr.unix)
    assert gone in dp._pool._idle
    procs.stop().get(timeout=30)
    raw = bytearray(4096)
    mine = RDMABuffer(memoryview(raw))  # read over this process's own stream: gives a connection back
    try:
        wait_for(
            lambda: mine.read_into(memoryview(out)).get(timeout=30) is None and gone not in dp._pool._idle,
            timeout=30,
            what="the idle connection to the exited owner to be closed",
        )
    finally:
        mine.drop().get(timeout=10)
    # and a reader of many live owners keeps at most POOL_MAX idle connections, oldest closed first
    monkeypatch.setattr(dp, "POOL_MAX", 2)
    pool = dp._Pool()
    pairs = [socket.socketpair() for _ in range(5)]
    try:
        chans = [dp._Plain(a) for a, _ in pairs]
        for i, ch in enumerate(chans):
            pool.give(("unix", f"owner{i}"), ch)
        assert [c.sock.fileno() == -1 for c in chans] == [True, True, True, False, False]
        assert sorted(pool._idle) == [("unix", "owner3"), ("unix", "owner4")]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


class CudaOwner(Actor):
    def __init__(self) -> None:
        self.t = torch.arange(N, device="cuda", dtype=torch.uint8)
        self.buf = RDMABuffer(self.t)

    @endpoint
    def get(self) -> RDMABuffer:
        return self.buf

    @endpoint
    def head(self) -> list[int]:
        return self.t[:4].tolist()

    @endpoint
    def ptr(self) -> int:
        return self.t.data_ptr()

    @endpoint
    def bump(self) -> None:
        self.t += 1

    @endpoint
    def drop_own(self) -> None:
        self.buf.drop().get(timeout=10)


class CudaReader(Actor):
    @endpoint
    def roundtrip(self, buf: RDMABuffer, stream: bool = False) -> dict:
        from monarch_nb.rdma import bytes_moved

        if stream:
            buf._ipc = False  # as when the owner's GPU is not visible here: staged over the stream
        before = bytes_moved()
        dst = torch.zeros(N, device="cuda", dtype=torch.uint8)
        buf.read_into(dst).get(timeout=60)
        cpu = torch.zeros(N, dtype=torch.uint8)
        buf.read_into(cpu).get(timeout=60)
        buf.write_from(torch.full((N,), 4, device="cuda", dtype=torch.uint8)).get(timeout=60)
        after = bytes_moved()
        return dict(
            head=dst[:4].tolist(),
            cpu_head=cpu[:4].tolist(),
            moved={k: after[k] - before[k] for k in ("cuda_ipc", "stream", "shm")},
        )

    @endpoint
    def head(self, buf: RDMABuffer) -> list[int]:
        dst = torch.zeros(N, device="cuda", dtype=torch.uint8)
        buf.read_into(dst).get(timeout=60)
        return dst[:4].tolist()

    @endpoint
    def error_of_read(self, buf: RDMABuffer) -> str:
        try:
            buf.read_into(torch.zeros(N, device="cuda", dtype=torch.uint8)).get(timeout=60)
        except Exception as e:
            return type(e).__name__
        return ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_buffers_stage_through_pinned_memory(pair: tuple[ProcMesh, ProcMesh]) -> None:
    a, b = pair
    owner = a.spawn("cuda_owner", CudaOwner)
    reader = b.spawn("cuda_reader", CudaReader)
    buf = owner.get.call_one().get(timeout=60)
    got = reader.roundtrip.call_one(buf, True).get(timeout=60)
    assert got["head"] == [0, 1, 2, 3] and got["cpu_head"] == [0, 1, 2, 3], got
    assert got["moved"] == {"cuda_ipc": 0, "stream": 3 * N, "shm": 0}, got
    assert owner.head.call_one().get(timeout=60) == [4, 4, 4, 4]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_between_procs_of_one_host(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # both procs are rank 0 of a {gpus: 1} mesh: they see the same GPU
    a, b = pair
    owner = a.spawn("cuda_owner", CudaOwner)
    reader = b.spawn("cuda_reader", CudaReader)
    buf = owner.get.call_one().get(timeout=60)
    ptr = owner.ptr.call_one().get(timeout=60)
    got = reader.roundtrip.call_one(buf).get(timeout=60)
    assert got["head"] == [0, 1, 2, 3] and got["cpu_head"] == [0, 1, 2, 3], got
    assert got["moved"] == {"cuda_ipc": 3 * N, "stream": 0, "shm": 0}, got
    # the buffer is the owner's tensor, both ways: written in place, in-place changes seen
    assert owner.head.call_one().get(timeout=60) == [4, 4, 4, 4]
    assert owner.ptr.call_one().get(timeout=60) == ptr
    owner.bump.call_one().get(timeout=60)
    assert reader.head.call_one(buf).get(timeout=60) == [5, 5, 5, 5]
    owner.drop_own.call_one().get(timeout=60)
    assert reader.error_of_read.call_one(buf).get(timeout=60) == "BufferDroppedError"


def _seeded(n: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).to(device)


class CudaStagedOwner(Actor):
    def __init__(self, n: int) -> None:
        self.t = _seeded(n, 0, "cuda")
        self.buf = RDMABuffer(self.t)

    @endpoint
    def get(self) -> RDMABuffer:
        return self.buf

    @endpoint
    def holds(self, seed: int) -> bool:
        return bool(torch.equal(self.t.cpu(), _seeded(self.t.numel(), seed, "cpu")))


class CudaStagedReader(Actor):
    @endpoint
    def roundtrip(self, buf: RDMABuffer, n: int) -> dict:
        buf._ipc = False  # staged both ways, as for a reader that does not see the owner's GPU
        got = {}
        for where in ("cuda", "cpu"):
            dst = torch.zeros(n, dtype=torch.uint8, device=where)
            buf.read_into(dst).get(timeout=60)
            got[where] = bool(torch.equal(dst.cpu(), _seeded(n, 0, "cpu")))
        buf.write_from(_seeded(n, 1, "cuda")).get(timeout=60)
        return got


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_staging_of_many_pieces_keeps_every_byte(pair: tuple[ProcMesh, ProcMesh]) -> None:
    # several 8 MiB pieces, the last one short: each side copies one piece to or from the GPU
    # while the socket carries another, so each of the owner's two pinned pieces is used again
    # three times (a piece reused before its copy ended would show as wrong bytes)
    from monarch_nb._runtime import _dataplane as dp

    a, b = pair
    n = 6 * dp.PIECE + 4097
    owner = a.spawn("cuda_staged", CudaStagedOwner, n)
    reader = b.spawn("cuda_staged_reader", CudaStagedReader)
    buf = owner.get.call_one().get(timeout=60)
    assert reader.roundtrip.call_one(buf, n).get(timeout=120) == {"cuda": True, "cpu": True}
    assert owner.holds.call_one(1).get(timeout=60)


def test_cuda_ipc_handles_are_only_for_cuda_buffers_on_their_host() -> None:
    # the request a reader of a CUDA buffer makes first (runs without a GPU): a CPU buffer has
    # no IPC handle, and none is given over TCP; the reader then streams
    from monarch_nb._runtime import _dataplane as dp

    srv = dp.DataServer(lambda: b"k" * 32, lambda: "127.0.0.1")
    try:
        data = bytearray(4096)
        bid = srv.register(dp.Entry(memoryview(data), data))
        addr = srv.address()
        with pytest.raises(ValueError, match="not in CUDA memory"):
            dp.stream(addr, None, dp.OP_IPC, bid, None, 0, 0, time.monotonic() + 30)
        remote = dp.Address(addr.pid, addr.start, "elsewhere", addr.unix, addr.tcp)
        with pytest.raises(ValueError, match="owner's host"):
            dp.stream(remote, b"k" * 32, dp.OP_IPC, bid, None, 0, 0, time.monotonic() + 30)
        srv.release(bid)
        with pytest.raises(dp.BufferGone):
            dp.stream(addr, None, dp.OP_IPC, bid, None, 0, 0, time.monotonic() + 30)
    finally:
        srv.close()


def test_a_write_into_read_only_memory_is_refused_and_its_connection_stays_in_step() -> None:
    # the owner takes a refused write's whole payload off the connection (over several pieces),
    # so the reader's next request on the same pooled connection is answered, not misread
    from monarch_nb._runtime import _dataplane as dp

    srv = dp.DataServer(lambda: b"k" * 32, lambda: "127.0.0.1")
    try:
        data = bytes(range(256)) * (dp.PIECE // 128 + 1)  # two pieces and a bit
        bid = srv.register(dp.Entry(memoryview(data), data))
        addr = srv.address()
        payload = memoryview(bytearray(len(data)))
        with pytest.raises(ValueError, match="read-only memory"):
            dp.stream(addr, None, dp.OP_WRITE, bid, payload, 0, len(data), time.monotonic() + 30)
        back = bytearray(len(data))
        dp.stream(addr, None, dp.OP_READ, bid, memoryview(back), 0, len(data), time.monotonic() + 30)
        assert back == data
        assert srv.bytes_in == 0 and srv.bytes_out == len(data)
    finally:
        srv.close()


# -- two hosts -----------------------------------------------------------------------------

CROSS_HOST_BODY = """
import psutil
from monarch_nb.rdma import RDMABuffer


def tcp_conns():
    p = psutil.Process()
    conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") else p.connections(kind="tcp")
    return [(c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port) for c in conns if c.raddr and c.status == "ESTABLISHED"]


class Owner(Actor):
    def __init__(self):
        self.raw = bytearray(bytes(range(256)) * (4 << 12))  # 4 MiB
        self.buf = RDMABuffer(memoryview(self.raw))

    @endpoint
    def get(self):
        return self.buf

    @endpoint
    def state(self):
        return dict(pid=os.getpid(), ip=my_ip(), head=list(self.raw[:4]), sevens=self.raw.count(7), conns=tcp_conns())

    @endpoint
    def block(self, s):
        t0 = time.monotonic()
        while time.monotonic() - t0 < s:
            sum(range(1000))


class Reader(Actor):
    @endpoint
    def read(self, buf):
        out = bytearray(buf.size())
        buf.read_into(memoryview(out)).get(timeout=60)
        return dict(ok=out == bytearray(bytes(range(256)) * (4 << 12)), n=len(out))

    @endpoint
    def read_split(self, buf, streams):
        from monarch_nb.config import configured

        out = bytearray(buf.size())
        with configured(rdma_streams=streams):
            buf.read_into(memoryview(out)).get(timeout=60)
        port = int(buf._addr.tcp.rsplit(":", 1)[1])
        return dict(ok=out == bytearray(bytes(range(256)) * (4 << 12)), conns=sum(1 for c in tcp_conns() if c[3] == port))

    @endpoint
    def write_split(self, buf, streams):
        from monarch_nb.config import configured

        with configured(rdma_streams=streams):
            buf.write_from(memoryview(bytes([7]) * buf.size())).get(timeout=60)

    @endpoint
    def write(self, buf):
        buf.write_from(memoryview(bytes([9]) * 1024)).get(timeout=60)

    @endpoint
    def state(self):
        return dict(pid=os.getpid(), ip=my_ip(), conns=tcp_conns())


hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
procs = hosts.spawn_procs(per_host={"gpus": 1})
owner = procs.slice(hosts=0).spawn("owner", Owner)
reader = procs.slice(hosts=1).spawn("reader", Reader)
buf = owner.get.call_one().get(timeout=30)
emit("read", **reader.read.call_one(buf).get(timeout=60))
emit("read_split", **reader.read_split.call_one(buf, 4).get(timeout=60))
reader.write_split.call_one(buf, 3).get(timeout=60)
busy = owner.block.call_one(5.0)
t0 = time.monotonic()
reader.write.call_one(buf).get(timeout=60)
emit("write_while_busy", seconds=time.monotonic() - t0, busy_done=busy.done())
busy.get(timeout=30)
emit("ends", owner=owner.state.call_one().get(timeout=30), reader=reader.state.call_one().get(timeout=30), port=int(buf._addr.tcp.rsplit(":", 1)[1]))
procs.stop().get(timeout=30)
"""


@pytest.mark.multihost
@pytest.mark.timeout(150)
def test_cross_host_read_and_write_go_straight_between_the_two_procs(tmp_path_factory: pytest.TempPathFactory) -> None:
    import test_multihost as mh

    assert os.geteuid() == 0, "multi-host tests need root (network and mount namespaces)"
    keydir = tmp_path_factory.mktemp("rdmakey")
    import subprocess

    subprocess.run([mh.PY, "-m", "monarch_nb", "keygen", str(keydir / "k")], check=True, capture_output=True, timeout=60)
    key = (keydir / "k").read_bytes()
    cluster = mh.NetnsCluster(2)
    try:
        for i in cluster.hosts:
            mh.plant_key(cluster, i, key)
        allocs = [mh.Allocator(cluster, i, "--key-file", mh.KEY).wait_ready() for i in (1, 2)]
        ctl = mh.Controller(cluster, CROSS_HOST_BODY)
        assert ctl.expect("read", 90) == {"step": "read", "ok": True, "n": 4 << 20}
        # the same buffer in four byte ranges over four connections, each sealed, arrives whole
        assert ctl.expect("read_split", 60) == {"step": "read_split", "ok": True, "conns": 4}
        w = ctl.expect("write_while_busy", 60)
        assert w["seconds"] < 4.0 and not w["busy_done"], w
        ends = ctl.expect("ends", 60)
        ctl.finish()
        own, rd, port = ends["owner"], ends["reader"], ends["port"]
        # the split write (3 ranges) landed whole, then the small write over its first KiB
        assert own["head"] == [9, 9, 9, 9] and own["sevens"] == (4 << 20) - 1024, own["sevens"]
        assert own["ip"] == cluster.ip(1) and rd["ip"] == cluster.ip(2)
        # the data connection: reader's end in the reader's proc, owner's end in the owner's
        # proc at its data port, and nobody else (controller, allocators) in between
        data = [c for c in rd["conns"] if c[2] == own["ip"] and c[3] == port]
        assert len(data) >= 4, rd
        mine = {(c[0], c[1], c[2], c[3]) for c in own["conns"] if c[1] == port}
        for lip, lport, rip, rport in data:
            assert (rip, rport, lip, lport) in mine, (data, own["conns"])
        assert own["pid"] not in (a.pid for a in allocs) and rd["pid"] not in (a.pid for a in allocs)
    finally:
        cluster.close()


def _notebook_body() -> str:
    """notebooks/08_data_plane.ipynb's code cells, on two netns hosts instead of the embedded
    default: the server's proc on the first host, a trainer proc... on each."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parent.parent / "notebooks" / "08_data_plane.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    *run, cleanup = cells
    subs = {
        'this_host().spawn_procs(per_host={"gpus": 1}, name="ps")': 'hosts.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, name="ps")',
        'this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="trainers")': 'hosts.spawn_procs(per_host={"gpus": 2}, name="trainers")',
    }
    src = "\n".join(run)
    for a, b in subs.items():
        assert a in src, a
        src = src.replace(a, b)
    return (
        'hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")\n'
        + src
        + '\nemit("moved", items=[[dict(p), m] for p, m in trainers.moved.call().get(timeout=60).items()])\n'
        + cleanup
    )


@pytest.mark.multihost
@pytest.mark.timeout(150)
def test_the_notebook_cells_across_two_hosts(tmp_path_factory: pytest.TempPathFactory) -> None:
    import subprocess

    import test_multihost as mh

    keydir = tmp_path_factory.mktemp("rdmakey")
    subprocess.run([mh.PY, "-m", "monarch_nb", "keygen", str(keydir / "k")], check=True, capture_output=True, timeout=60)
    key = (keydir / "k").read_bytes()
    cluster = mh.NetnsCluster(2)
    try:
        for i in cluster.hosts:
            mh.plant_key(cluster, i, key)
        for i in (1, 2):
            mh.Allocator(cluster, i, "--key-file", mh.KEY).wait_ready()
        ctl = mh.Controller(cluster, _notebook_body())
        moved = ctl.expect("moved", 120)["items"]
        ctl.finish()
        out = ctl.out.text()
        for v in (1, 2, 3):
            assert f"version {v}: trainers see mean [{v}.0]" in out, out
        assert "[7.0, 7.0, 7.0, 7.0]" in out, out
        assert len(moved) == 4
        for point, m in moved:
            # 4 pulls of 4 MB each: on the server's host out of shared memory, on the other by stream
            assert m["read"] == 16_000_000, (point, m)
            path = "shm" if point["hosts"] == 0 else "stream"
            assert m[path] == 16_000_000, (point, m)
    finally:
        cluster.close()


def test_the_stream_is_sealed_and_refuses_a_wrong_key() -> None:
    from monarch_nb._runtime import _dataplane as dp

    srv = dp.DataServer(lambda: b"k" * 32, lambda: "127.0.0.1")
    try:
        data = bytearray(os.urandom(3 << 20))
        bid = srv.register(dp.Entry(memoryview(data), data))
        addr = srv.address()
        remote = dp.Address(addr.pid, addr.start, "elsewhere", addr.unix, addr.tcp)  # force TCP
        out = bytearray(len(data))
        dp.stream(remote, b"k" * 32, dp.OP_READ, bid, memoryview(out), 0, len(out), time.monotonic() + 30)
        assert out == data
        # an idle pooled connection that broke meanwhile is replaced, not reported as a dead owner
        for sock in dp.pool_sockets():
            sock.shutdown(socket.SHUT_RDWR)
        out[:] = bytes(len(out))
        dp.stream(remote, b"k" * 32, dp.OP_READ, bid, memoryview(out), 0, len(out), time.monotonic() + 30)
        assert out == data
        with pytest.raises(PermissionError, match="key"):
            dp.stream(remote, b"x" * 32, dp.OP_READ, bid, memoryview(out), 0, len(out), time.monotonic() + 30)
        # a record changed on the way is refused (and the client sees a broken connection)
        ip, port = addr.tcp.rsplit(":", 1)
        with socket.create_connection((ip, int(port)), timeout=10) as s:
            ch = dp._client_handshake(s, b"k" * 32)
            ch.send(dp._REQ.pack(dp.OP_READ, bid, 0, 16))
            hdr = s.recv(4, socket.MSG_WAITALL)
            rec = bytearray(s.recv(int.from_bytes(hdr, "big"), socket.MSG_WAITALL))
            rec[0] ^= 1  # the reply's first record, one bit flipped, fed to the client's decoder
            r, w = socket.socketpair()
            w.sendall(hdr + bytes(rec))
            ch.sock = r
            with pytest.raises(ConnectionResetError, match="authentication"):
                ch.recv_into(memoryview(bytearray(dp._RSP.size)))
            r.close()
            w.close()
        # what travels on the wire is not the plaintext
        with socket.create_connection((ip, int(port)), timeout=10) as s:
            ch = dp._client_handshake(s, b"k" * 32)
            ch.send(dp._REQ.pack(dp.OP_READ, bid, 0, 4096))
            raw = b""
            while len(raw) < 4096 + 2 * (4 + 16):
                chunk = s.recv(65536)
                if not chunk:
                    break
                raw += chunk
            assert bytes(data[:64]) not in raw
    finally:
        srv.close()


def test_a_transfer_split_over_several_streams_arrives_whole() -> None:
    from monarch_nb._runtime import _dataplane as dp
    from monarch_nb.config import configured

    srv = dp.DataServer(lambda: b"k" * 32, lambda: "127.0.0.1")
    try:
        data = bytearray(os.urandom((5 << 20) + 123))  # not a whole number of records
        bid = srv.register(dp.Entry(memoryview(data), data))
        addr = srv.address()
        remote = dp.Address(addr.pid, addr.start, "elsewhere", addr.unix, addr.tcp)  # force TCP
        port = int(addr.tcp.rsplit(":", 1)[1])

        def conns() -> int:
            n = 0
            for s in dp.pool_sockets():
                with contextlib.suppress(OSError):  # pooled by an earlier test, to a server now gone
                    n += s.getpeername()[1] == port
            return n

        with configured(rdma_streams=4):
            assert dp.streams_for(len(data)) == 4
            out = bytearray(len(data))
            dp.stream(remote, b"k" * 32, dp.OP_READ, bid, memoryview(out), 0, len(out), time.monotonic() + 30)
            assert out == data
            assert conns() == 4  # one connection per range, each sealed (the server is TCP only here)
            new = bytearray(os.urandom(len(data)))
            dp.stream(remote, b"k" * 32, dp.OP_WRITE, bid, memoryview(new), 0, len(new), time.monotonic() + 30)
            assert data == new and srv.bytes_in == len(new) and srv.bytes_out == len(out)
            # a range that fails (the buffer is gone) fails the whole transfer
            srv.release(bid)
            with pytest.raises(dp.BufferGone):
                dp.stream(remote, b"k" * 32, dp.OP_READ, bid, memoryview(out), 0, len(out), time.monotonic() + 30)
        with configured(rdma_streams=0):
            assert dp.streams_for(1 << 20) == 1  # small transfers: one stream
        with configured(rdma_streams=8):
            assert dp.streams_for(3 << 20) == 3  # never a range under 1 MiB
            assert dp.streams_for(1 << 20) == 1
            # nor a byte short of whole MiBs (rounded up, it was 3 ranges of 1 MiB less a third of a byte each, and 2 of half a MiB)
            assert dp.streams_for((3 << 20) - 1) == 2
            assert dp.streams_for((1 << 20) + 1) == 1
        with pytest.raises(ConfigError, match="rdma_streams is seconds, bytes or a count, 0 or more"):
            with configured(rdma_streams=-1):
                pass
    finally:
        srv.close()


def test_out_of_descriptors_at_any_step_of_making_a_buffer_says_buffers_hold_them(monkeypatch) -> None:
    # which step of making a CPU buffer meets the limit depends on what else holds a descriptor at
    # that moment: out at its /proc read, the error named only that read, not the buffers made
    # so far that hold the descriptors
    from monarch_nb._runtime import _dataplane as dp

    def starved(pid: int) -> int:
        raise dp.OutOfDescriptors(f"telling whether process {pid} is alive (/proc)")

    monkeypatch.setattr(dp, "start_time", starved)
    with pytest.raises(OSError) as e:
        RDMABuffer(torch.ones(16, dtype=torch.uint8))
    msg = str(e.value)
    assert e.value.errno == 24 and "alive (/proc)" in msg, msg
    assert "holds two descriptors" in msg and "ulimit -n" in msg, msg
