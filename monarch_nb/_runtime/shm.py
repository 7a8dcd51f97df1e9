"""Large buffers to a peer on this host travel through shared memory, not the socket.

The sender writes a buffer into a file in ``/dev/shm``, named ``mnb-<sender pid>-<128 random
bits>``, created ``O_EXCL`` with mode 0600, and sends the name. The receiver checks that the
file is a regular file of its own user, 0600 and large enough, and maps it.

Filling fresh tmpfs pages costs seven times what copying into pages that exist does, and
mapping them and giving them back again costs as much as the copy: so a buffer for one peer goes
into a pooled segment (names ``mnb-<pid>-p<hex>``) that both sides keep mapped.

* The receiver lends the segment out as the memory of what it unpickles: an array or a tensor
  is built on it, writable, through a lease object whose last user gone renames the name to
  ``<name>.free``; a ``bytes`` is laid over it (``_rawbuf.bytes_at``: its header goes in the
  ``DATA_OFF`` bytes before the buffer), and the name goes back once the receiver sees that
  nobody holds that object any more (it looks on its next shared-memory message and on every
  sweep). Only then may the sender claim it back (an atomic rename) and write into it again,
  so a segment belongs to one side at a time: what the receiver holds is never overwritten
  while it is in use.
* A reply that is the very ``bytes`` laid over a segment its caller sent (an actor returning
  what it was given) goes back by name (``<name>.back`` in the reply, :func:`returnable`), not
  copied: the caller lays its own object over its own mapping of the segment. The receiver
  first makes the segment's first page its own copy (its header stays there; the caller's
  goes in the same place in the file), and gives the segment back as ``<name>.back``, which
  only its sender claims, once it has read that reply and nobody holds its own object.
* A buffer for several peers (one message to many procs of this host) is written once into a
  file of its own, each peer gets a hard link to it, maps it copy-on-write and unlinks its name
  at once: the mapping is the only thing left and goes with the last object using it. So are
  buffers beyond the pool's budget.

Only used between peers on ipc addresses, i.e. the same host and user (the socket itself is
0600 in the user's runtime dir). A name nobody took (the receiver died first) is unlinked by
the sender after a grace period or when it closes, and by the allocator when the sender dies;
a pooled segment nobody used for a while, or that a receiver kept longer than the grace period,
is given back the same way (a receiver's array on it stays valid: its mapping keeps the pages),
and the receivers unmap their view of it when they see the name gone. A sender that ended with
``os._exit`` after its allocator had gone leaves its pool behind: the next allocator to start on
the host removes it (:func:`sweep_stale`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from typing import Any

from .._wire import _rawbuf
from ..errors import ProtocolError
from . import _libc
from ._pids import pid_alive

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"mnb-[0-9]{1,10}-(p?)[0-9a-f]{32}")
_LEFT = re.compile(r"mnb-[0-9]{1,10}-p?[0-9a-f]{32}(\.free|\.back)?")
FREE = ".free"
#: a pooled segment its receiver sent back to its sender as a ``bytes`` (by name: no copy)
#: carries this name once the receiver no longer holds it; only that sender claims it, and
#: only once it has taken the reply that named it (so no reply naming it is still on its way)
BACK = ".back"
_BACK_NAME = re.compile(r"mnb-[0-9]{1,10}-p[0-9a-f]{32}\.back")
#: a receiver takes a name within milliseconds; this long without it means it never will
GRACE_S = 60.0
#: what one process keeps in pooled segments, and for how long one may sit unused
POOL_BYTES = 512 << 20
POOL_IDLE_S = 30.0
_GRAIN = 1 << 20
#: where a pooled segment holds its buffer: cache-line aligned for arrays, with room before it
#: for the header of a ``bytes`` laid over it, and a byte after it for that object's NUL
DATA_OFF = 64
#: a ``bytes`` can be laid over a pooled segment in this interpreter (its header fits before
#: the buffer)
_LAYABLE = _rawbuf.IN_PLACE and _rawbuf.HEAD <= DATA_OFF


class _Segment:
    __slots__ = ("name", "size", "mm", "fd", "addr", "used", "pid", "laid", "back", "pinned", "private", "until")

    def __init__(self, name: str, size: int, mm: mmap.mmap, fd: int) -> None:
        self.name, self.size, self.mm, self.fd, self.used = name, size, mm, fd, time.monotonic()
        self.addr, self.pid = _address(mm), os.getpid()
        #: the length of a ``bytes`` its receiver sent back, laid over it here (0: none; its
        #: header lies at ``addr + DATA_OFF - HEAD``): the segment is not written while held
        self.laid = 0
        #: its receiver sent it back: it comes free under ``BACK``, not ``FREE``
        self.back = False
        #: the mapping carries a reference nobody owns (as :attr:`_Mapped.pinned`)
        self.pinned = False
        #: the laid-over object was moved to private memory before a fork: never sent again
        self.private = False
        #: dropped while lent out: kept mapped until then for a reply that sends it back late
        self.until = 0.0


def _address(mm: mmap.mmap) -> int:
    pin = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(pin)  # valid until the mapping is closed
    del pin
    return addr


#: this process's pooled segments (of every ShmSender), by name: a reply may send one back
_own: dict[str, _Segment] = {}


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


class ShmSender:
    """Writes buffers into shared memory files for one process (thread-safe)."""

    def __init__(self) -> None:
        self.prefix = f"mnb-{os.getpid()}-"
        self._pending: dict[str, float] = {}
        self._pool: list[_Segment] = []  # smallest first
        self._lock = threading.Lock()

    def put(self, buf: Any, pooled: bool = False) -> tuple[str, int]:
        """Copy ``buf`` into shared memory; return ``(name, nbytes)`` for the receiver.

        ``pooled``: for one receiver, which gives the segment back once done with it (not for
        :meth:`link`).
        """
        mv = memoryview(buf).cast("B")
        if pooled and _rawbuf.available() and mv.nbytes >= _GRAIN:
            room = DATA_OFF + mv.nbytes + 1
            seg = self._claim(room) or self._new_segment(room)
            if seg is not None:
                return self._fill(seg, mv)
        name = self.prefix + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with self._lock:
                self._pending[name] = time.monotonic()
            n, off = mv.nbytes, 0
            while off < n:
                off += os.write(fd, mv[off:])
        except BaseException:
            self._unlink(name)
            raise
        finally:
            os.close(fd)
        return name, n

    def link(self, name: str) -> str:
        """Another name for the file ``name`` that :meth:`put` wrote: one copy in memory for
        several peers of this host, each of which unlinks its own name once it has mapped it."""
        new = self.prefix + secrets.token_hex(16)
        os.link(os.path.join(SHM_DIR, name), os.path.join(SHM_DIR, new))
        with self._lock:
            self._pending[new] = time.monotonic()
        return new

    def unlink(self, name: str) -> None:
        """Give up a name :meth:`put` returned that no peer was sent (its links live on)."""
        self._unlink(name)

    def _claim(self, n: int) -> _Segment | None:
        """A pooled segment of at least ``n`` bytes that its receiver gave back, now ours."""
        with self._lock, _mapped_lock:  # _mapped_lock: a reply may be laying a bytes over one
            for seg in self._pool:
                if seg.size < n or seg.private:
                    continue
                if _own_held(seg):
                    continue  # a bytes its receiver sent back is still held here
                seg.laid = 0
                path = os.path.join(SHM_DIR, seg.name)
                try:
                    # only the receiver's rename, once done with it, makes that name exist
                    os.rename(path + (BACK if seg.back else FREE), path)
                except FileNotFoundError:
                    continue  # still with a receiver
                seg.back = False
                return seg
        return None

    def _new_segment(self, n: int) -> _Segment | None:
        size = -(-n // _GRAIN) * _GRAIN  # a slightly larger buffer next time still fits
        with self._lock:
            if sum(s.size for s in self._pool) + size > POOL_BYTES:
                return None
        name = self.prefix + "p" + secrets.token_hex(16)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            # reserve the pages now: a sparse file in a full tmpfs would SIGBUS on the write
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.unlink(path)
            os.close(fd)
            return None
        # the descriptor stays: a fork's private copy of a bytes sent back over it needs it
        seg = _Segment(name, size, mm, fd)
        with self._lock:
            self._pool.append(seg)
            self._pool.sort(key=lambda s: s.size)
        with _mapped_lock:
            _own[name] = seg
        return seg

    def _fill(self, seg: _Segment, mv: memoryview) -> tuple[str, int]:
        n = mv.nbytes
        try:
            with _rawbuf.pinned(seg.mm, writable=True) as (dst, _), _rawbuf.pinned(mv) as (src, _):
                _rawbuf.copy(dst + DATA_OFF, src, n)  # GIL released: other threads go on meanwhile
        except BaseException:
            self._drop(seg)
            raise
        seg.used = time.monotonic()
        return seg.name, n

    def _drop(self, seg: _Segment, lent: bool = False) -> None:
        """Give up a segment. ``lent``: its receiver still has it, and may yet send it back
        (:func:`returnable`): it stays mapped, out of the pool, for ``GRACE_S`` more."""
        with self._lock:
            if seg in self._pool:
                self._pool.remove(seg)
        for suffix in ("", FREE, BACK):
            self._unlink(seg.name + suffix)
        with _mapped_lock:
            if lent:
                seg.until = time.monotonic() + GRACE_S
                _orphans.append(seg)
                return
            if _own.get(seg.name) is seg:
                del _own[seg.name]
            if _own_held(seg):
                _orphans.append(seg)  # a bytes sent back is held: unmapped once it is not
                return
        _close(seg)

    def sweep(self, max_age: float = GRACE_S, idle: float = POOL_IDLE_S) -> None:
        """Unlink names handed out more than ``max_age`` ago that nobody took (taken ones are
        gone already), and pooled segments unused for ``idle`` seconds or never given back."""
        now = time.monotonic()
        with self._lock:
            old = [n for n, t in self._pending.items() if now - t > max_age]
            pool = list(self._pool)
        for n in old:
            self._unlink(n)
        for seg in pool:
            free = os.path.join(SHM_DIR, seg.name + (BACK if seg.back else FREE))
            if os.path.exists(free):
                if now - seg.used > idle:
                    try:
                        os.unlink(free)  # unlinking the free name claims it: nobody else can
                    except FileNotFoundError:
                        continue
                    self._drop(seg)
            elif now - seg.used > max_age:
                self._drop(seg, lent=True)  # the receiver never gave it back
        _close_orphans()

    def close(self) -> None:
        self.sweep(-1.0, -1.0)
        for seg in list(self._pool):
            self._drop(seg)

    def _unlink(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


class _Mapped:
    """A peer's pooled segment as this process maps it, kept for its next use."""

    __slots__ = (
        "name", "key", "mm", "fd", "addr", "size", "busy", "used", "pid", "held", "pinned", "private",
        "origin", "returned", "page0",
    )  # fmt: skip

    def __init__(self, name: str, key: tuple[int, int], mm: mmap.mmap, fd: int, addr: int, size: int) -> None:
        self.name, self.key, self.mm, self.fd, self.addr, self.size = name, key, mm, fd, addr, size
        self.busy, self.used, self.pid = False, time.monotonic(), os.getpid()
        #: the length of the ``bytes`` laid over the segment now (0: none; it lies at
        #: :func:`_laid_at`), given back once nobody holds it
        self.held = 0
        #: the mapping carries a reference nobody owns: see :func:`_lay_bytes`
        self.pinned = False
        #: the laid-over object was moved to private memory before a fork (``_unlay_before_fork``)
        self.private = False
        #: where replies to the message that brought it go (its sender, for an actor's call)
        self.origin = ""
        #: the laid-over object went back to ``origin`` by name (:func:`returnable`): the
        #: segment goes back under ``BACK``
        self.returned = False
        #: its first page is this process's own copy (the object's header, out of the file,
        #: where the sender lays its own): mapped shared again on the next take
        self.page0 = False


#: this process's mappings of its peers' pooled segments, by name (RLock: a lease's finalizer
#: may run inside a collection that started while the lock was held)
_mapped: dict[str, _Mapped] = {}
_mapped_lock = threading.RLock()
_mapped_pid = [0]


def pooled(name: str) -> bool:
    """Whether ``name`` is a pooled segment's (given back after use, not unlinked on taking)."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    return m is not None and bool(m.group(1))


def take(name: str, nbytes: int, origin: str = "") -> memoryview:
    """Map the file a peer wrote (unlinking it unless pooled); raise :class:`ProtocolError` if it
    is not ours. ``origin``: where replies to the message go (see :func:`returnable`)."""
    if _laid:
        _release_laid()
    if isinstance(name, str) and name.endswith(BACK):
        return _take_back(name, nbytes)
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or not isinstance(nbytes, int) or nbytes <= 0:
        raise ProtocolError(f"malformed shared-memory reference {name!r}")
    pooled = bool(m.group(1))
    path = os.path.join(SHM_DIR, name)
    try:
        # a pooled segment is mapped shared (it is ours alone until given back): read-write
        fd = os.open(path, (os.O_RDWR if pooled else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ProtocolError(f"shared-memory buffer {name} is gone: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        size_ok = st.st_size >= nbytes if pooled else st.st_size == nbytes
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or not size_ok:
            raise ProtocolError(f"refused shared-memory buffer {name}: not a 0600 file of ours of {nbytes} bytes")
        if pooled:
            return _lend(_map_pooled(name, fd, st, origin), path, nbytes)
        # private: writes by the receiver (arrays are writable) never reach the file
        try:
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ProtocolError(f"could not map shared-memory buffer {name}: {e.strerror}") from e
    finally:
        os.close(fd)
        if not pooled:
            try:
                os.unlink(path)
            except OSError:
                pass  # gone already, or not ours to remove (sticky /dev/shm)
    return memoryview(mm)


def _map_pooled(name: str, fd: int, st: os.stat_result, origin: str) -> _Mapped:
    key = (st.st_dev, st.st_ino)
    with _mapped_lock:
        if _mapped_pid[0] != os.getpid():  # a forked child starts with no leases of its own
            for old in _mapped.values():
                if old.fd >= 0:
                    os.close(old.fd)
                    old.fd = -1
            _mapped.clear()
            _mapped_pid[0] = os.getpid()
        seg = _mapped.get(name)
        if seg is not None and seg.busy:
            # only this process's rename hands it back: its sender broke the protocol
            raise ProtocolError(f"refused shared-memory buffer {name}: it is still in use here")
        if seg is not None and (seg.key != key or seg.size < st.st_size):
            _unmap(seg)
            seg = None
        if seg is None:
            if st.st_size < DATA_OFF + 1:
                raise ProtocolError(f"refused shared-memory buffer {name}: {st.st_size} bytes is too small for a pooled segment")
            try:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # out of address space or memory: this message is lost, not the loop
                raise ProtocolError(f"could not map shared-memory buffer {name}: {e.strerror}") from e
            # its own descriptor, for a fork's private copy of a bytes laid over it (the
            # address is valid until _unmap, which only an unlent mapping gets)
            seg = _mapped[name] = _Mapped(name, key, mm, os.dup(fd), _address(mm), st.st_size)
        elif seg.page0:
            # the sender has written it again since: its first page is the file's once more
            if _remap(seg.addr, mmap.PAGESIZE, seg.fd, 0, mmap.MAP_SHARED) != seg.addr:
                _unmap(seg)
                raise ProtocolError(f"could not map shared-memory buffer {name} again: errno {ctypes.get_errno()}")
            seg.page0 = False
        seg.busy, seg.used, seg.origin, seg.returned = True, time.monotonic(), origin, False
        return seg


def _lend(seg: _Mapped, path: str, nbytes: int) -> memoryview:
    if DATA_OFF + nbytes + 1 > seg.size:
        seg.busy = False
        raise ProtocolError(f"refused shared-memory buffer {seg.name}: {nbytes} bytes do not fit its {seg.size}")
    # the lease is the buffer's exporter: every view, array or tensor made from it holds it
    # (directly or through a memoryview's managed buffer), so it dies with the last of them
    lease = (ctypes.c_ubyte * nbytes).from_address(seg.addr + DATA_OFF)
    done = weakref.finalize(lease, _give_back, seg, path)
    done.atexit = False
    lease.copied = done  # type: ignore[attr-defined]  # a bytes object, copied out, gives it back at once
    if _LAYABLE and seg.size <= 2 * nbytes + _GRAIN:
        # (a much larger segment, the sender's only free one, is not held for a small bytes)
        lease.as_bytes = lambda: _lay_bytes(seg, nbytes, done)  # type: ignore[attr-defined]
    return memoryview(lease)


#: segments with a ``bytes`` laid over them, until nobody holds it
_laid: list[_Mapped] = []
#: at most this much of /dev/shm held by ``bytes`` laid over segments in one process, its
#: peers' and its own sent back (a notebook collecting results would fill the tmpfs others
#: use too): past it they are copied
LAID_MAX = 512 << 20
_PIN = ctypes.pythonapi.Py_IncRef
_PIN.argtypes = (ctypes.py_object,)
_UNPIN = ctypes.pythonapi.Py_DecRef
_UNPIN.argtypes = (ctypes.py_object,)


def _laid_total() -> int:
    """The bytes of objects laid over segments that this process holds (with _mapped_lock)."""
    return sum(s.held for s in _laid) + sum(s.laid for s in _own.values() if _own_held(s))


def _laid_at(seg: _Mapped | _Segment) -> int:
    """Where the header of a ``bytes`` laid over ``seg`` lies: just before its buffer."""
    return seg.addr + DATA_OFF - _rawbuf.HEAD


def _own_held(seg: _Segment) -> bool:
    """Whether a ``bytes`` sent back is laid over this process's own ``seg`` and still held."""
    return bool(seg.laid) and _rawbuf.in_use(_laid_at(seg))


def _lay_bytes(seg: _Mapped, nbytes: int, done: weakref.finalize[Any, Any]) -> bytes | None:
    """The lent buffer as a ``bytes`` object laid over the segment (no copy), the lease's
    give-back left to :func:`_release_laid`; None (copy it) past ``LAID_MAX`` or if the lease
    was given back already."""
    with _mapped_lock:
        if _laid_total() + nbytes > LAID_MAX:
            return None  # copied out, and the segment goes back at once
        if done.detach() is None:
            return None
        if not seg.pinned:
            # the object's header lives in this mapping: the mapping must outlive every holder
            # of it, at interpreter exit too, where module globals (``_mapped``) go first. Only
            # _unmap, once nobody holds the object, closes it
            _PIN(seg.mm)
            seg.pinned = True
        seg.held = nbytes
        _laid.append(seg)
        return _rawbuf.bytes_at(_laid_at(seg), nbytes)


def _release_laid() -> None:
    """Give back the segments whose laid-over ``bytes`` nobody holds any more."""
    with _mapped_lock:
        free = [s for s in _laid if not _rawbuf.in_use(_laid_at(s))]
        for seg in free:
            _laid.remove(seg)
            seg.held = 0
    for seg in free:
        if seg.private:
            _unmap(seg)  # moved off its segment before a fork, which went back then
        else:
            _give_back(seg, os.path.join(SHM_DIR, seg.name))


def _give_back(seg: _Mapped, path: str) -> None:
    if seg.pid != os.getpid():
        return  # a forked child's copy of a lease: the segment is its parent's to give back
    seg.used = time.monotonic()
    seg.busy = False  # before the rename: the name may come back to this process at once
    try:
        os.rename(path, path + (BACK if seg.returned else FREE))
    except OSError:
        # its sender gave up on it (kept too long) or is gone: nothing will reuse this mapping
        with _mapped_lock:
            if _mapped.get(seg.name) is seg and not seg.busy:
                _unmap(seg)


def _unmap(seg: _Mapped) -> None:
    if _mapped.get(seg.name) is seg:
        del _mapped[seg.name]
    _close(seg)


def _close(seg: _Mapped | _Segment) -> None:
    """Unmap a segment and close its descriptor, pinned or not (nothing laid over it is held)."""
    if seg.pinned:
        seg.pinned = False
        _UNPIN(seg.mm)
    try:
        seg.mm.close()
    except BufferError:
        pass  # a copy into it is still running; the mapping goes with its last user
    if seg.fd >= 0:
        os.close(seg.fd)
        seg.fd = -1


def _unlay_before_fork() -> None:
    """A ``bytes`` laid over a segment would share its header, reference count included, with a
    forked child, which counts on its own: before a fork, the pages of each one still held are
    mapped again, privately, from the segment's file (one ``mmap``: a count another thread
    changes meanwhile lands before or after, never lost), each page is written once so that
    it is this process's own copy, and the segment goes back. The fork then copies them as any
    other memory."""
    if not _laid and not _own:
        return
    if _laid:
        _release_laid()
    with _mapped_lock:
        for seg in _laid:
            if seg.private or seg.fd < 0:
                continue
            # a first page of its own already holds the header (the file's has the sender's)
            _privatize(seg.addr, seg.fd, seg.held, mmap.PAGESIZE if seg.page0 else 0)
            seg.private = True  # the rest of the mapping is unused: it goes when the object does
            if _mapped.get(seg.name) is seg:
                del _mapped[seg.name]
            path = os.path.join(SHM_DIR, seg.name)
            try:
                os.rename(path, path + (BACK if seg.returned else FREE))
            except OSError:
                pass  # its sender gave up on it already
        for own in _own.values():
            if not own.private and own.pid == os.getpid() and _own_held(own):
                # its pages are this process's own now: it is never written to send again
                _privatize(own.addr, own.fd, own.laid, 0)
                own.private = True


def _privatize(base: int, fd: int, nbytes: int, skip: int) -> None:
    """Give the ``bytes`` laid at ``base + DATA_OFF`` over ``fd``'s mapping at ``base`` pages of
    this process's own (past ``skip`` bytes of the mapping): mapped again copy-on-write, each
    written once."""
    lo = (base & ~(mmap.PAGESIZE - 1)) + skip  # the header's page: DATA_OFF is below a page
    hi = -(-(base + DATA_OFF + nbytes + 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    if _remap(lo, hi - lo, fd, lo - base, mmap.MAP_PRIVATE) != lo:
        raise OSError(ctypes.get_errno(), "could not give a received bytes object its own pages before a fork")
    _touch(lo, hi)


def _touch(lo: int, hi: int) -> None:
    """Write each page of ``[lo, hi)`` once (with what it holds), so each is copied now."""
    for page in range(hi - 1, lo, -mmap.PAGESIZE):
        b = ctypes.c_ubyte.from_address(page)  # the last byte of each page: never a count
        b.value = b.value


_MAP_FIXED = 0x10


def _remap(addr: int, n: int, fd: int, off: int, flags: int) -> int:
    """Map ``n`` bytes of ``fd`` at ``off`` (``MAP_SHARED``, or ``MAP_PRIVATE``: copy-on-write)
    at exactly ``addr``, in place of what was mapped there; one ``mmap``, so a write to the
    old pages by another thread meanwhile lands before (then the file has it) or after."""
    got: int | None = _libc.mmap()(addr, n, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, fd, off)
    return got or 0


def returnable(buf: Any, addr: str) -> tuple[str, int] | None:
    """The name to send back instead of ``buf``'s bytes, where ``buf`` is a ``bytes`` laid over
    a segment from ``addr`` (a reply to its sender: an actor returning what it was given), else
    None. Its sender then lays its own object over its own pages (:func:`_take_back`): no copy
    either way. This process's header moves to a first page of its own, since the sender's
    goes in the same place in the file; the segment goes back under ``BACK``."""
    if not _laid:
        return None
    obj = memoryview(buf).obj
    if type(obj) is not bytes:
        return None
    at = id(obj)
    with _mapped_lock:
        for seg in _laid:
            if _laid_at(seg) != at or seg.held != len(obj):
                continue
            if seg.origin != addr or seg.returned or seg.private or seg.pid != os.getpid():
                return None  # sent back once per message (the sender then holds it)
            if time.monotonic() - seg.used > GRACE_S / 4:
                return None  # its sender may give it up before this reply is read (_drop)
            if not seg.page0:
                if _remap(seg.addr, mmap.PAGESIZE, seg.fd, 0, mmap.MAP_PRIVATE) != seg.addr:
                    raise OSError(ctypes.get_errno(), "could not map a shared-memory page")
                _touch(seg.addr, seg.addr + mmap.PAGESIZE)  # ours before the sender writes its header
                seg.page0 = True
            seg.returned = True
            return seg.name + BACK, seg.held
    return None


def _take_back(name: str, nbytes: int) -> memoryview:
    """A ``bytes`` a peer sent back by name (:func:`returnable`) over this process's own
    segment, laid over it (or, where that cannot be, copied out of it)."""
    if not _BACK_NAME.fullmatch(name) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ProtocolError(f"malformed shared-memory reference {name!r}")
    with _mapped_lock:
        seg = _own.get(name[: -len(BACK)])
        if seg is None or seg.pid != os.getpid() or seg.private or DATA_OFF + nbytes + 1 > seg.size:
            raise ProtocolError(f"refused shared-memory buffer {name}: not a segment this process sent")
        seg.back, seg.used = True, time.monotonic()
        if _LAYABLE and not _own_held(seg) and _laid_total() + nbytes <= LAID_MAX:
            if not seg.pinned:
                _PIN(seg.mm)  # as _lay_bytes: the mapping outlives every holder of the object
                seg.pinned = True
            seg.laid = nbytes
            return memoryview(_rawbuf.bytes_at(_laid_at(seg), nbytes))
        # copied while the lock keeps the segment from being claimed
        return memoryview(_rawbuf.to_bytes(memoryview(seg.mm)[DATA_OFF : DATA_OFF + nbytes]))


#: own segments dropped while a ``bytes`` sent back is laid over them: unmapped once not held
_orphans: list[_Segment] = []


def _close_orphans() -> None:
    now = time.monotonic()
    with _mapped_lock:
        done = [s for s in _orphans if s.until < now and not _own_held(s)]
        for seg in done:
            _orphans.remove(seg)
            if _own.get(seg.name) is seg:
                del _own[seg.name]
    for seg in done:
        _close(seg)


os.register_at_fork(before=_unlay_before_fork)


def sweep_mapped(idle: float = POOL_IDLE_S) -> None:
    """Unmap peers' segments not lent out that their senders gave up, or unused for ``idle`` s
    (the sender gives those up too; until this process unmaps them their pages stay); forget a
    received ``bytes`` kept for reuse after at most ``REUSE_IDLE_S``; give back the segments of
    laid-over ``bytes`` nobody holds any more."""
    _rawbuf.release_idle(min(idle, _rawbuf.REUSE_IDLE_S))
    if _laid:
        _release_laid()
    if _orphans:
        _close_orphans()
    now = time.monotonic()
    with _mapped_lock:
        idle_segs = [s for s in _mapped.values() if not s.busy]
    for seg in idle_segs:
        gone = now - seg.used > idle
        if not gone:
            path = os.path.join(SHM_DIR, seg.name)
            st = None
            for suffix in (FREE, BACK, ""):  # "": claimed again by its sender, on its way to a receiver
                try:
                    st = os.stat(path + suffix)
                    break
                except OSError:
                    pass
            gone = st is None or (st.st_dev, st.st_ino) != seg.key
        if gone:
            with _mapped_lock:
                if not seg.busy:
                    _unmap(seg)


def sweep_dead(pid: int) -> int:
    """Unlink what the dead process ``pid`` left in flight or pooled (its allocator calls this)."""
    prefix = f"mnb-{pid}-"
    n = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    uid = os.geteuid()
    for name in names:
        # torch_<pid>_*: an RDMABuffer's storage is unlinked once made; a kill right then leaves it
        if (name.startswith(prefix) and _LEFT.fullmatch(name)) or name.startswith(f"torch_{pid}_"):
            path = os.path.join(SHM_DIR, name)
            try:
                # only our own: the name says nothing of whose it is (another user's process of
                # that pid in another pid namespace, or one who made the name), and an allocator
                # run as root, or a /dev/shm without the sticky bit, would unlink theirs too
                if os.lstat(path).st_uid != uid:
                    continue
                os.unlink(path)
                n += 1
            except OSError:
                pass
    return n


def sweep_stale(min_age: float = 2 * GRACE_S) -> int:
    """Unlink what processes of this user that are gone left behind (their allocator was not
    there to see them exit), untouched for ``min_age`` seconds; returns how many.

    The age is a second guard besides the pid: a live sender in another pid namespace sharing
    this ``/dev/shm`` renames its pooled segments on every use and gives up idle ones itself
    long before ``min_age``, so nothing of its is that old.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    now, uid, n = time.time(), os.geteuid(), 0
    for name in names:
        if not _LEFT.fullmatch(name):
            continue
        pid = int(name.split("-", 2)[1])
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or now - max(st.st_ctime, st.st_mtime) < min_age:
                continue
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n
