"""RDMABuffer and RDMAAction: Monarch's ``monarch.rdma`` API over monarch_nb's data plane.

There is no InfiniBand here; the backend (``get_rdma_backend() == "shm+tcp"``) is shared memory
between procs of one host and a direct, authenticated and encrypted TCP stream between hosts
(see ``monarch_nb/_runtime/_dataplane.py``). Neither path touches the controller or an allocator.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import json
import logging
import os
import stat
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from .._runtime import _dataplane as dp
from .._runtime import _fdlimit
from ..actor import _context
from ..actor._future import Future
from ..errors import SupervisionError

__all__ = [
    "BufferDroppedError",
    "RDMAAction",
    "RDMABuffer",
    "RDMAReadTransferWarning",
    "RDMAShmFallbackWarning",
    "RDMATcpFallbackWarning",
    "RDMAWriteTransferWarning",
    "bytes_moved",
    "get_rdma_backend",
    "is_ibverbs_available",
    "is_rdma_available",
]

BACKEND = "shm+tcp"
#: how long ``drop()`` from a holder other than the owner waits for the owner by default
DROP_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


class RDMAReadTransferWarning(Warning):
    pass


class RDMAWriteTransferWarning(Warning):
    pass


class RDMATcpFallbackWarning(Warning):
    """Monarch's warning when it falls back to TCP; kept for code that filters it (never raised here)."""


class RDMAShmFallbackWarning(Warning):
    """A buffer could not be placed in shared memory (e.g. /dev/shm is full): it is served over
    its owner's stream instead, also on its own host."""


class BufferDroppedError(RuntimeError):
    """The buffer was dropped (by its owner or any holder, or collected by its owner)."""


def is_ibverbs_available() -> bool:
    """Whether ibverbs RDMA hardware is used: never, monarch_nb moves bytes with shm and TCP."""
    return False


def is_rdma_available() -> bool:
    """Deprecated in Monarch (ambiguous); like Monarch's, it answers :func:`is_ibverbs_available`."""
    warnings.warn(
        "is_rdma_available is deprecated (as in Monarch): use is_ibverbs_available() or get_rdma_backend()",
        DeprecationWarning,
        stacklevel=2,
    )
    return is_ibverbs_available()


def get_rdma_backend() -> str:
    """``"shm+tcp"``: shared memory within a host, a direct encrypted TCP stream across hosts."""
    return BACKEND


def _check_timeout(timeout: float) -> None:
    """Refuse a negative transfer timeout with Monarch's exception, on every path (a copy out of
    shared memory too, which would finish before any timeout)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        # ``timeout=None`` hoping for no limit failed deep inside with "'<' not supported"
        raise TypeError(f"timeout must be a number of seconds (as Monarch's: an int), not {timeout!r}")
    if timeout < 0:
        raise OverflowError(f"timeout must be >= 0 seconds (Monarch's: fit in an unsigned 64-bit integer), not {timeout!r}")


def _out_of_descriptors(what: str) -> OSError:
    """``OSError(EMFILE)`` naming this process's limit and what to do (as a spawn says it)."""
    label = _context.runtime().label
    return _fdlimit.out_of_descriptors(what, "Jupyter" if label == "controller" else f"this {label}")


# ------------------------------------------------------------------------------- local memory
def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(obj: object) -> bool:
    t = _torch()
    return t is not None and isinstance(obj, t.Tensor)


def _check(data: Any) -> int:
    """Validate local memory as Monarch does; return its size in bytes."""
    if isinstance(data, memoryview):
        if data.ndim != 1 or not data.c_contiguous:
            raise ValueError(f"RDMABuffer only supports 1d contiguous torch.Tensor or 1d c-contiguous memoryview. Got: {data!r}")
        return data.nbytes
    if _is_tensor(data):
        if data.dim() != 1 or not data.is_contiguous():
            raise ValueError(f"RDMABuffer only supports 1d contiguous torch.Tensor or 1d c-contiguous memoryview. Got: {data!r}")
        if data.device.type not in ("cpu", "cuda"):
            # a meta tensor has no bytes: a read into it would "succeed" and keep nothing
            raise ValueError(f"RDMABuffer moves the bytes of CPU and CUDA tensors, not of a tensor on {data.device}")
        return int(data.numel() * data.element_size())
    try:
        memoryview(data)
        hint = f": wrap it, RDMABuffer(memoryview(x)), to lend a {type(data).__name__}'s bytes"
    except TypeError:
        hint = ""
    # Monarch's type and words, for any object
    raise ValueError(
        f"RDMABuffer only supports 1d contiguous torch.Tensor or 1d c-contiguous memoryview. Got: {type(data).__name__}{hint}"
    )


def _cpu_view(data: Any, nbytes: int) -> memoryview:
    """A writable 1-D byte view of a CPU tensor's memory (the tensor must outlive it)."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")


class _Staged:
    """A CUDA tensor's bytes in pinned host memory for one transfer, copied a piece at a time as
    the stream moves them: a write's pieces leave the device ahead of the socket, a read's go to
    it as each arrives, so the copies overlap the stream rather than following it."""

    def __init__(self, flat: Any, nbytes: int, fill: bool) -> None:
        t = _torch()
        self.flat, self.fill = flat, fill
        self.stage = t.empty(nbytes, dtype=t.uint8, pin_memory=True)
        self.stream = t.cuda.current_stream(flat.device)
        self.moved = 0  # bytes a read has copied to the device (pieces of several streams add up)
        self.lock = threading.Lock()
        self.ready: list[Any] = []  # a write's: each PIECE's copy from the device
        if fill:
            for p in range(0, nbytes, dp.PIECE):
                self.stage[p : p + dp.PIECE].copy_(flat[p : p + dp.PIECE], non_blocking=True)
                event = t.cuda.Event()
                event.record(self.stream)
                self.ready.append(event)

    def piece(self, p: int, k: int) -> None:
        """Called by the stream before it sends bytes ``p:p+k`` (a write) or after they arrived (a read)."""
        if self.fill:
            for i in range(p // dp.PIECE, (p + k - 1) // dp.PIECE + 1):
                self.ready[i].synchronize()
        else:
            self.flat[p : p + k].copy_(self.stage[p : p + k], non_blocking=True)
            with self.lock:
                self.moved += k

    def finish(self) -> None:
        """A read's end: every byte on the device (copied whole where no stream moved it: shm)."""
        if self.fill:
            return
        if self.moved < self.stage.numel():
            self.flat.copy_(self.stage)
        else:
            self.stream.synchronize()


@contextlib.contextmanager
def _host_view(data: Any, nbytes: int, fill: bool) -> Iterator[tuple[memoryview, Any]]:
    """Host bytes for ``data``, and what the stream calls for each piece it moves (None: nothing
    to do): its own memory, or for CUDA a pinned staging copy (``fill``: a write's, loaded from
    the device first; a read's goes to the device afterwards: :class:`_Staged`)."""
    if isinstance(data, memoryview):
        yield data.cast("B"), None
    elif data.device.type == "cpu":
        yield _cpu_view(data, nbytes), None
    else:
        t = _torch()
        flat = (data.view(t.uint8) if data.dtype != t.uint8 else data)[:nbytes]
        staged = _Staged(flat, nbytes, fill)
        yield _cpu_view(staged.stage, nbytes), staged.piece
        staged.finish()


def _address(mv: memoryview) -> Any:
    from .._wire import _rawbuf

    return _rawbuf.pinned(mv, writable=not mv.readonly)


# ------------------------------------------------------------------------------- owner's side
class _CudaEntry(dp.Entry):
    """A CUDA buffer: served through pinned host memory, a piece at a time. Each serving thread
    has two pinned pieces, so that the copy of one between the device and the host runs while
    the other crosses the socket (the copies are the current stream's, as the user's work)."""

    def __init__(self, tensor: Any, nbytes: int) -> None:
        t = _torch()
        super().__init__(memoryview(bytearray(0)), tensor)
        self.nbytes = nbytes
        self.flat = tensor.view(t.uint8) if tensor.dtype != t.uint8 else tensor
        self._tls = threading.local()

    def _stages(self) -> tuple[list[Any], list[Any]]:
        """This thread's two pinned pieces, and the last copy of each (None, or its event, waited
        for before the piece is used again: a transfer that broke off can leave one running)."""
        tls = self._tls
        if getattr(tls, "stages", None) is None:
            t = _torch()
            tls.stages = [t.empty(min(self.nbytes, dp.PIECE), dtype=t.uint8, pin_memory=True) for _ in range(2)]
            tls.copies = [None, None]
        return tls.stages, tls.copies

    def _copied(self, copies: list[Any], i: int) -> None:
        t = _torch()
        event = t.cuda.Event()
        event.record(t.cuda.current_stream(self.flat.device))
        copies[i] = event

    def sources(self, off: int, n: int) -> Iterator[memoryview]:
        stages, copies = self._stages()
        pieces = [(p, min(dp.PIECE, off + n - p)) for p in range(off, off + n, dp.PIECE)]

        def load(i: int) -> None:
            p, k = pieces[i]
            if copies[i % 2] is not None:
                copies[i % 2].synchronize()
            stages[i % 2][:k].copy_(self.flat[p : p + k], non_blocking=True)
            self._copied(copies, i % 2)

        if pieces:
            load(0)
        for i, (_, k) in enumerate(pieces):
            if i + 1 < len(pieces):
                load(i + 1)  # into the piece sent before this one: the caller has sent it
            copies[i % 2].synchronize()
            yield _cpu_view(stages[i % 2], k)

    def targets(self, off: int, n: int) -> Iterator[memoryview]:
        stages, copies = self._stages()
        for i, p in enumerate(range(off, off + n, dp.PIECE)):
            k = min(dp.PIECE, off + n - p)
            if copies[i % 2] is not None:
                copies[i % 2].synchronize()  # its copy to the device has read it
            yield _cpu_view(stages[i % 2], k)
            self.flat[p : p + k].copy_(stages[i % 2][:k], non_blocking=True)
            self._copied(copies, i % 2)
        for c in copies:
            if c is not None:
                c.synchronize()  # the write is on the device before its writer hears so

    def ipc(self) -> bytes:
        """A fresh CUDA IPC handle of the memory for one reader of this host: torch counts one
        consumer per share (the block stays allocated until each has let go), so each reader
        asks for its own. The reader finds the device by UUID (procs see different
        ``CUDA_VISIBLE_DEVICES``)."""
        t = _torch()
        storage = self.flat.untyped_storage()
        share = storage._share_cuda_()  # (device, handle, size, offset, refcounter, its offset, event, sync)
        return json.dumps(
            {
                "uuid": str(t.cuda.get_device_properties(self.flat.device).uuid),
                "share": [{"hex": v.hex()} if isinstance(v, bytes) else v for v in share[1:]],
                "offset": self.flat.data_ptr() - storage.data_ptr(),
                "nbytes": self.nbytes,
            }
        ).encode()


def _share(data: Any, nbytes: int) -> tuple[dp.Shm | None, list[Any]]:
    """Move a CPU tensor's storage into shared memory in place (every tensor on that storage
    follows, same as ``Tensor.share_memory_()``); return where readers of this host find it."""
    storage = data.untyped_storage()
    if not storage.resizable():
        # memory torch does not own (``torch.from_numpy``, ``torch.frombuffer``): moved, the tensor
        # would leave the array that owns it, and neither the owner's changes to the array nor
        # writes into the buffer would be seen on the other side. Served where it is, over the stream
        return None, []
    try:
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize < storage.nbytes() + (1 << 20):
            raise OSError(28, "not enough free space in /dev/shm")
        before = _torch_segments()
        try:
            fd, size = storage._share_fd_cpu_()
        except RuntimeError as e:
            _remove_left_behind(before)
            if "Too many open files" in str(e):
                raise OSError(errno.EMFILE, str(e)) from e
            raise OSError(28, str(e)) from e
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise dp.OutOfDescriptors(_FDS_PER_BUFFER) from e
        warnings.warn(
            f"RDMABuffer of {nbytes} bytes could not be placed in shared memory ({e.strerror or e}): "
            "readers on this host read it over its owner's stream instead (slower); if /dev/shm is full, free space there",
            RDMAShmFallbackWarning,
            stacklevel=3,
        )
        return None, []
    # our own descriptor: closing it at drop is what readers see (torch's stays with the storage)
    try:
        mine = os.dup(fd)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise dp.OutOfDescriptors(_FDS_PER_BUFFER) from e
        raise
    st = os.fstat(mine)
    offset = data.data_ptr() - storage.data_ptr()
    return dp.Shm(mine, st.st_dev, st.st_ino, offset, size), [mine]


_FDS_PER_BUFFER = "a CPU tensor's buffer holds two descriptors while registered: drop() the ones you no longer use"


def _token() -> tuple[dp.Shm, list[int]]:
    """A descriptor that is open exactly while a CUDA buffer is registered: readers of this host
    check it (as they check a CPU buffer's shared file) before each copy through CUDA IPC."""
    fd = os.memfd_create("monarch_nb-cuda-buffer", os.MFD_CLOEXEC)
    st = os.fstat(fd)
    return dp.Shm(fd, st.st_dev, st.st_ino, 0, 0), [fd]


def _torch_segments() -> set[str]:
    prefix = f"torch_{os.getpid()}_"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except OSError:
        return set()


def _remove_left_behind(before: set[str]) -> None:
    """Unlink the file torch leaves behind when it cannot fill one: a ``torch_<pid>_*`` name not
    in ``before`` that is a regular file of this process's user. /dev/shm is writable by every
    user and the pid is no secret: as root, a bare unlink of each new name would remove a file
    another user made under it. ``lstat``: a link is judged as itself, never by its target. (No
    one else can swap a file of ours for theirs between the check and the unlink: /dev/shm is
    sticky.)"""
    me = os.geteuid()
    for name in _torch_segments() - before:
        path = os.path.join("/dev/shm", name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == me:
                os.unlink(path)


def _owner_identity() -> tuple[str, str, int | None, str]:
    """(owner name, mesh, rank, host) of the actor (or controller) creating a buffer."""
    rt = _context.runtime()
    inst = _context.current_instance()
    spec = _context.proc_spec or {}
    if inst is not None:
        # the spawn's name as the user gave it (``name``), not the internal id in ``actor_id``
        name = f"{inst.name}{inst.rank!r}@{inst.proc_id}"
    else:
        name = f"<root>@{rt.label}@{rt.hostname}:{rt.pid}"
    return name, spec.get("mesh", ""), spec.get("rank"), spec.get("host", rt.hostname)


def _server() -> dp.DataServer:
    rt = _context.runtime()

    def tcp_ip() -> str:
        return rt.tcp_addr[len("tcp://") :].rsplit(":", 1)[0] if rt.tcp_addr else ""

    return dp.server(_key, tcp_ip)


def _key() -> bytes | None:
    # the socket factory's: a controller adopts the cluster key there when it attaches
    return _context.runtime().sockets.security.key


def bytes_moved() -> dict[str, int]:
    """What this process moved through RDMABuffers: as a reader/writer (``read``, ``written``, and
    by path, ``shm``, ``stream`` or ``cuda_ipc``) and as an owner serving its buffers' streams (``served_out``,
    ``served_in``; shared-memory copies cost the owner nothing and are not seen there)."""
    c = dp.counters()
    keys = ("read", "written", "shm", "stream", "cuda_ipc", "served_out", "served_in", "total")
    return c if c is not None else {k: 0 for k in keys}


# ------------------------------------------------------------------------------------ buffers
class RDMABuffer:
    """A handle to 1-D contiguous memory of the actor that made it; any actor may read or write it.

    Made inside the owning actor (``RDMABuffer(tensor_or_memoryview)``) and sent to others as a
    small picklable handle. The buffer aliases the owner's memory: a change the owner makes in
    place is seen by the next ``read_into``, and ``write_from`` changes the owner's tensor in
    place. CPU tensors are moved into shared memory on creation (same data, same tensor
    objects, as ``Tensor.share_memory_()`` does) so that readers on the owner's host copy
    straight out of it; a tensor over memory torch does not own (a numpy array's) stays where
    it is and is served over the owner's stream.
    """

    def __init__(self, data: Any) -> None:
        nbytes = _check(data)
        if nbytes == 0:
            raise ValueError("Cannot create RDMABuffer with size 0.")
        try:
            self._register(data, nbytes)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # the data server's first sockets, a CUDA memfd, or our own steps (which say which)
            what = [str(e.strerror)] if isinstance(e, dp.OutOfDescriptors) else []
            if _is_tensor(data) and data.device.type == "cpu" and _FDS_PER_BUFFER not in what:
                # whichever step ran out (its /proc read, say), the buffers made so far hold them
                what.append(_FDS_PER_BUFFER)
            raise _out_of_descriptors("making an RDMABuffer" + (f" ({'; '.join(what)})" if what else "")) from e

    def _register(self, data: Any, nbytes: int) -> None:
        srv = _server()
        shm: dp.Shm | None = None
        token: dp.Shm | None = None
        extra: list[Any] = []
        if isinstance(data, memoryview):
            mv = data.cast("B")
            entry = dp.Entry(mv, data)
        elif data.device.type == "cpu":
            shm, extra = _share(data, nbytes)
            entry = dp.Entry(_cpu_view(data, nbytes), data)
        elif data.device.type == "cuda":
            entry = _CudaEntry(data, nbytes)
            token, extra = _token()
        else:  # _check refused any other device
            raise AssertionError(data.device)
        for fd in extra:
            entry.extra.append(lambda fd=fd: os.close(fd))  # type: ignore[misc]
        try:
            addr = srv.address()  # before registering: a failure here leaves nothing registered
        except BaseException:
            entry.release()
            raise
        self._id = srv.register(entry)
        self._size = nbytes
        self._addr = addr
        self._shm = shm
        self._token = token
        self._ipc: Any = None
        self._owner, self._mesh, self._rank, self._host = _owner_identity()
        self._dropped = False
        # the owner's handle going away frees the buffer; a reader's (unpickled) handle has none
        self._finalizer: weakref.finalize | None = weakref.finalize(self, srv.release, self._id)

    # -- pickling: what travels is the handle, never the bytes
    def __reduce__(self) -> tuple[Any, ...]:
        state = (self._id, self._size, self._addr, self._shm, self._owner, self._mesh, self._rank, self._host, self._token)
        return (_rebuild, state)

    @property
    def backend(self) -> str:
        return get_rdma_backend()

    @property
    def owner(self) -> str:
        """The owning actor's id."""
        return self._owner

    def size(self) -> int:
        """Size in bytes."""
        return self._size

    def __repr__(self) -> str:
        where = "shm" if self._shm is not None else "cuda" if self._token is not None else "stream"
        return f"<RDMABuffer {self._size} bytes of {self._owner} ({where}{', dropped' if self._dropped else ''})>"

    def read_into(self, dst: Any, *, timeout: int = 60) -> Future[None]:
        """Copy this buffer into ``dst`` (1-D contiguous, at least ``size()`` bytes)."""
        _check_timeout(timeout)
        if _is_tensor(dst) and self._in_shm(dst):
            # the common case, kept short: a 1 MiB copy takes tens of microseconds
            if _check(dst) < self._size:
                raise ValueError(f"destination of {_check(dst)} bytes is smaller than the RDMABuffer's {self._size}")
            return self._now(False, dst, self._size)
        return RDMAAction().read_remote(dst, self).submit(timeout=timeout)

    def write_from(self, src: Any, *, timeout: int = 60) -> Future[None]:
        """Copy ``src`` (1-D contiguous, at most ``size()`` bytes) into the owner's memory."""
        _check_timeout(timeout)
        if _is_tensor(src) and self._in_shm(src):
            n = _check(src)
            if n > self._size:
                raise ValueError(f"source of {n} bytes exceeds the RDMABuffer's {self._size}")
            return self._now(True, src, n)
        return RDMAAction().write_remote(self, src).submit(timeout=timeout)

    def _now(self, write: bool, local: Any, n: int) -> Future[None]:
        fut: Future[None] = Future._create("RDMABuffer.write_from" if write else "RDMABuffer.read_into")
        try:
            self._shm_copy(write, local.data_ptr(), n)
            dp.count(write, "shm", n)
        except dp.OutOfDescriptors as e:
            fut._set_exception(self._no_descriptor(write, e))
        except BaseException as e:
            fut._set_exception(e)
        else:
            fut._set_result(None)
        return fut

    def _shm_copy(self, write: bool, addr: int, n: int) -> None:
        assert self._shm is not None
        if dp.shm_copy(self._addr, self._shm, write, addr, 0, n):
            return
        if not dp.owner_alive(self._addr):
            raise self._gone(f"its process (pid {self._addr.pid}) exited")
        raise self._dropped_error()

    def drop(self, *, timeout: float = DROP_TIMEOUT_S) -> Future[None]:
        """Release the buffer: its owner stops serving it and lets go of its memory. Any holder
        may drop it; reads and writes after that fail with :class:`BufferDroppedError`. From
        another holder it is one round trip to the owner, which fails with ``TimeoutError``
        when the owner does not answer within ``timeout`` seconds (ours; Monarch's takes none)."""
        _check_timeout(timeout)
        self._dropped = True
        if self._finalizer is not None:
            self._finalizer()
            return Future._completed(None)
        fut: Future[None] = Future._create("RDMABuffer.drop")
        deadline = time.monotonic() + timeout

        def run() -> None:
            try:
                dp.stream(self._addr, _key(), dp.OP_DROP, self._id, None, 0, 0, deadline)
            except dp.PeerGone:
                pass  # nothing left to free
            except dp.Stalled as e:
                # not dp.Stalled itself: its words name neither the buffer nor what is left to do
                fut._set_exception(
                    TimeoutError(
                        f"RDMABuffer drop at {self._owner} timed out after {timeout} s: {e}; it is dropped for "
                        "this handle, but its owner may still hold its memory (drop it again once the owner answers)"
                    )
                )
                return
            except BaseException as e:
                fut._set_exception(e)
                return
            fut._set_result(None)

        _start(run)
        return fut

    # -- the transfers (on a pool thread)
    def _gone(self, why: str) -> SupervisionError:
        return SupervisionError(
            f"the owner of this RDMABuffer, {self._owner}, is gone: {why}",
            mesh=self._mesh,
            actor=self._owner,
            rank=self._rank,
            host=self._host,
        )

    def _no_descriptor(self, write: bool, e: dp.OutOfDescriptors) -> OSError:
        verb = "writing into" if write else "reading from"
        return _out_of_descriptors(f"{verb} the RDMABuffer of {self._owner} ({e.strerror})")

    def _dropped_error(self) -> BufferDroppedError:
        # a buffer an endpoint returned without keeping is collected with its handle: say so,
        # as Monarch's would still serve it (until drop())
        return BufferDroppedError(
            f"RDMABuffer of {self._owner} ({self._size} bytes) was dropped, or its owner kept no reference to it "
            "(a buffer lives while its owner's handle does: keep it, e.g. self.buf = RDMABuffer(...)); "
            "ask its owner for a new one"
        )

    def _in_shm(self, local: Any) -> bool:
        """Whether a transfer with ``local`` is a plain copy out of (or into) shared memory."""
        try:
            here = dp.host_id()
        except dp.OutOfDescriptors:
            return False  # the transfer itself then fails saying so, through its future
        return (
            self._shm is not None
            and not self._dropped
            and self._addr.host == here
            and (isinstance(local, memoryview) or local.device.type == "cpu")
        )

    def _transfer(self, write: bool, local: Any, nbytes: int, deadline: float) -> None:
        try:
            self._transfer_any(write, local, nbytes, deadline)
        except dp.OutOfDescriptors as e:
            raise self._no_descriptor(write, e) from e

    def _transfer_any(self, write: bool, local: Any, nbytes: int, deadline: float) -> None:
        if self._dropped:
            raise self._dropped_error()
        if self._token is not None and self._addr.host == dp.host_id() and self._ipc_copy(write, local, nbytes, deadline):
            path = "cuda_ipc"
        else:
            path = self._transfer_path(write, local, nbytes, deadline)
        dp.count(write, path, nbytes)

    # -- CUDA IPC: a CUDA buffer read or written by a proc of its host that sees the same GPU
    def _ipc_copy(self, write: bool, local: Any, n: int, deadline: float) -> bool:
        """Copy straight between ``local`` and the owner's device memory; False when CUDA IPC
        is not possible between the two (the stream, staged through pinned memory, instead)."""
        t = _torch()
        if t is None or not t.cuda.is_available() or self._ipc is False:
            return False
        assert self._token is not None
        if not dp.maps.alive(self._addr.pid, self._token):
            self._ipc = False  # let go of the mapping: the owner's block can be freed
            if not dp.owner_alive(self._addr):
                raise self._gone(f"its process (pid {self._addr.pid}) exited")
            raise self._dropped_error()
        if self._ipc is None:
            self._ipc = self._open_ipc(deadline)
            if self._ipc is False:
                return False
        remote = self._ipc[:n]
        if isinstance(local, memoryview):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only source: only read from
                flat = t.frombuffer(local, dtype=t.uint8)[:n]
        else:
            flat = (local.view(t.uint8) if local.dtype != t.uint8 else local)[:n]
        if write:
            remote.copy_(flat)
        else:
            flat.copy_(remote)
        for dev in {remote.device, flat.device}:
            if dev.type == "cuda":
                t.cuda.synchronize(dev)  # done before the future resolves, on both devices
        return True

    def _open_ipc(self, deadline: float) -> Any:
        """The owner's memory mapped here through a CUDA IPC handle it made for this handle
        (one round trip over its unix socket), or False."""
        t = _torch()
        try:
            body = dp.stream(self._addr, None, dp.OP_IPC, self._id, None, 0, 0, deadline)
            info = json.loads(body)
            want = info["uuid"]
            dev = next((i for i in range(t.cuda.device_count()) if str(t.cuda.get_device_properties(i).uuid) == want), None)
            if dev is None:
                logger.debug("RDMABuffer of %s: its GPU is not visible here; streaming instead", self._owner)
                return False
            share = [bytes.fromhex(v["hex"]) if isinstance(v, dict) else v for v in info["share"]]
            t.cuda._lazy_init()
            storage = t.UntypedStorage._new_shared_cuda(dev, *share)
            typed = t.storage.TypedStorage(wrap_storage=storage, dtype=t.uint8, _internal=True)
            return t._utils._rebuild_tensor(typed, info["offset"], (info["nbytes"],), (1,))
        except Exception as e:  # not possible between these two procs: the stream says why if it fails too
            logger.debug("RDMABuffer of %s: no CUDA IPC (%s); streaming instead", self._owner, e)
            return False

    def _transfer_path(self, write: bool, local: Any, nbytes: int, deadline: float) -> str:
        with _host_view(local, nbytes, fill=write) as (mv, piece):
            mv = mv[:nbytes]
            if self._shm is not None and self._addr.host == dp.host_id():
                if piece is not None and write:
                    piece(0, nbytes)
                with _address(mv) as (addr, _):
                    self._shm_copy(write, addr, nbytes)
                return "shm"
            try:
                op = dp.OP_WRITE if write else dp.OP_READ
                dp.stream(self._addr, _key(), op, self._id, mv, 0, nbytes, deadline, piece)
            except dp.PeerGone as e:
                if dp.owner_alive(self._addr):
                    raise self._dropped_error() from e
                raise self._gone(str(e)) from e
            except dp.BufferGone as e:
                raise self._dropped_error() from e
            except dp.Stalled as e:
                verb = "write into" if write else "read from"
                raise TimeoutError(f"RDMABuffer {verb} {self._owner} timed out: {e}") from e
            return "stream"


def _rebuild(
    bid: bytes,
    size: int,
    addr: dp.Address,
    shm: dp.Shm | None,
    owner: str,
    mesh: str,
    rank: int | None,
    host: str,
    token: dp.Shm | None = None,
) -> RDMABuffer:
    b = object.__new__(RDMABuffer)
    b._id, b._size, b._addr, b._shm = bid, size, addr, shm
    b._token, b._ipc = token, None
    b._owner, b._mesh, b._rank, b._host = owner, mesh, rank, host
    b._dropped = False
    b._finalizer = None
    return b


# ------------------------------------------------------------------------------------ batches
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
#: pool threads; past that many transfers under way, each further one gets a thread of its own
POOL_SIZE = 8
_busy = 0


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(max_workers=POOL_SIZE, thread_name_prefix="monarch_nb-rdma")
    return _executor


def _start(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on a pool thread, or on a new thread when every pool thread is busy:
    queued behind transfers to an owner that stalls, a transfer to a healthy one waited for
    their deadlines, past its own timeout (every transfer ends by its deadline, so the threads
    made here are few and short-lived)."""
    global _busy

    def task() -> None:
        global _busy
        try:
            fn(*args)
        finally:
            with _executor_lock:
                _busy -= 1

    with _executor_lock:
        overflow = _busy >= POOL_SIZE
        _busy += 1
    if overflow:
        try:
            threading.Thread(target=task, name="monarch_nb-rdma-extra", daemon=True).start()
            return
        except RuntimeError:  # no thread to be had: wait for a pool thread after all
            pass
    _pool().submit(task)


class RDMAAction:
    """A batch of reads and writes, submitted as one unit (Monarch's ``RDMAAction``)."""

    def __init__(self) -> None:
        self._ops: list[tuple[bool, RDMABuffer, Any, int]] = []

    def read_remote(self, dst: Any, src: RDMABuffer) -> RDMAAction:
        """Queue a read of buffer ``src`` into local memory ``dst``."""
        n = _check(dst)
        if isinstance(dst, memoryview) and dst.readonly:
            raise ValueError("cannot read into a read-only memoryview")
        if n < src.size():
            raise ValueError(f"destination of {n} bytes is smaller than the RDMABuffer's {src.size()}")
        self._ops.append((False, src, dst, src.size()))
        return self

    def write_remote(self, dst: RDMABuffer, src: Any) -> RDMAAction:
        """Queue a write of local memory ``src`` into buffer ``dst``."""
        n = _check(src)
        if n > dst.size():
            raise ValueError(f"source of {n} bytes exceeds the RDMABuffer's {dst.size()}")
        self._ops.append((True, dst, src, n))
        return self

    def fetch_add(self, src: RDMABuffer, dst: Any, add: int) -> RDMAAction:
        raise NotImplementedError("Not yet supported")

    def compare_and_swap(self, src: RDMABuffer, dst: Any, compare: int, swap: int) -> RDMAAction:
        raise NotImplementedError("Not yet supported")

    def submit(self, *, timeout: int = 60) -> Future[None]:
        """Run the queued operations (concurrently); the future resolves when all have ended:
        with None, or the first failure. Safe to call more than once."""
        _check_timeout(timeout)
        fut: Future[None] = Future._create("RDMAAction.submit")
        ops = list(self._ops)
        if not ops:
            fut._set_result(None)
            return fut
        deadline = time.monotonic() + timeout
        left = [len(ops)]
        failed: list[BaseException] = []
        lock = threading.Lock()

        def run(op: tuple[bool, RDMABuffer, Any, int]) -> None:
            write, buf, local, n = op
            error: BaseException | None = None
            try:
                buf._transfer(write, local, n, deadline)
            except BaseException as e:
                error = e
            # resolved only once every op has ended (each by the deadline), as Monarch's: a caller
            # that saw the first failure and reused its memory would race the others' bytes
            with lock:
                if error is not None:
                    failed.append(error)
                left[0] -= 1
                last = left[0] == 0
            if last:
                if failed:
                    fut._set_exception(failed[0])
                else:
                    fut._set_result(None)

        # a copy out of shared memory runs at memory speed: handing it to another thread would
        # cost more than the copy of a few MiB, so it runs here; streams go to the pool
        inline = [op for op in ops if op[1]._in_shm(op[2])]
        for op in ops:
            if not any(op is o for o in inline):
                _start(run, op)
        for op in inline:
            run(op)
        return fut
