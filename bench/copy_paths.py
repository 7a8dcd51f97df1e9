"""How fast one process can hand a large ``bytes`` to another on this host, by every path
Linux offers an unprivileged process, beside the in-process copy that ``python -m bench``
takes as its floor.

    python -m bench.copy_paths [--mib 16,64] [--rounds 30]

One direction, sender's ``bytes`` to receiver's buffer (pages of both already touched), the
sender a forked child told to go by a pipe:

* ``shm_two_copies``: the sender copies into a shared segment both keep mapped, the receiver
  copies out of it (what ``_runtime/shm`` does for a ``bytes``; the receiver must own its
  memory);
* ``process_vm_readv``: the receiver copies straight out of the sender's object (one copy;
  in production it would need ptrace rights over the sender);
* ``vmsplice_read``: the sender lends its pages to a pipe (1 MiB) with ``vmsplice``, the
  receiver ``readv``s them (one copy, no privilege);
* ``memcpy_in_process``: the floor, one copy in one process, the fastest of the rounds
  after the first (as ``bench/floor.py``).

Prints JSON: medians in ms per size, and each path over the floor. Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import statistics
import time
from typing import Any

from monarch_nb._wire import _rawbuf

_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.vmsplice.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_uint)
    libc.vmsplice.restype = ctypes.c_ssize_t
    iov = ctypes.POINTER(_Iovec)
    libc.process_vm_readv.argtypes = (ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    return libc


def _sender(libc: Any, src: bytes, base: int, shm_addr: int, go: int, done: int, pipe_w: int, pipe_size: int) -> None:
    n = len(src)
    while True:
        cmd = os.read(go, 1)
        if cmd == b"s":
            ctypes.memmove(shm_addr, base, n)
            os.write(done, b"k")
        elif cmd == b"v":
            # the last pipe-full by a plain write: once it is in, the reader has taken every
            # lent page, so the sender could free or change the object
            off, end = 0, n - pipe_size
            while off < end:
                iov = _Iovec(base + off, end - off)
                got = libc.vmsplice(pipe_w, ctypes.byref(iov), 1, 0)
                if got < 0:
                    raise OSError(ctypes.get_errno(), "vmsplice")
                off += got
            tail = memoryview(src)[end:]
            while tail:
                tail = tail[os.write(pipe_w, tail) :]
            os.write(done, b"k")
        elif cmd == b"a":
            os.write(done, str(base).encode().ljust(24))
        else:
            os._exit(0)


def measure(nbytes: int, rounds: int) -> dict[str, float]:
    libc = _libc()
    src = os.urandom(nbytes)
    with _rawbuf.pinned(src) as (src_addr, _):  # a bytes object does not move: the address stays good
        pass
    dst = bytearray(nbytes)
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    shm = mmap.mmap(-1, nbytes, mmap.MAP_SHARED)
    shm_addr = ctypes.addressof(ctypes.c_char.from_buffer(shm))
    ctypes.memset(shm_addr, 0, nbytes)
    ctypes.memset(dst_addr, 0, nbytes)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pipe_r, pipe_w = os.pipe()
    fcntl.fcntl(pipe_w, _F_SETPIPE_SZ, 1 << 20)
    pipe_size = fcntl.fcntl(pipe_w, _F_GETPIPE_SZ)
    pid = os.fork()
    if pid == 0:
        os.close(pipe_r)
        _sender(libc, src, src_addr, shm_addr, go_r, done_w, pipe_w, pipe_size)
    os.close(pipe_w)
    sender_addr = 0

    def shm_two_copies() -> None:
        os.write(go_w, b"s")
        os.read(done_r, 1)
        ctypes.memmove(dst_addr, shm_addr, nbytes)

    def process_vm_readv() -> None:
        local, remote = _Iovec(dst_addr, nbytes), _Iovec(sender_addr, nbytes)
        if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != nbytes:
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    def vmsplice_read() -> None:
        os.write(go_w, b"v")
        view, got = memoryview(dst), 0
        while got < nbytes:
            got += os.readv(pipe_r, [view[got:]])
        os.read(done_r, 1)

    def memcpy_in_process() -> None:
        ctypes.memmove(dst_addr, src_addr, nbytes)

    paths = [shm_two_copies, process_vm_readv, vmsplice_read, memcpy_in_process]
    times: dict[str, list[float]] = {f.__name__: [] for f in paths}
    try:
        os.write(go_w, b"a")
        sender_addr = int(os.read(done_r, 24))
        for r in range(rounds + 1):
            for f in paths:  # interleaved: each round sees the machine as the others do
                ctypes.memset(dst_addr, 0, 64)
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
                if bytes(dst[:64]) != src[:64] or dst[-64:] != src[-64:]:
                    raise AssertionError(f"{f.__name__} delivered other bytes")
                if r:
                    times[f.__name__].append(dt)
    finally:
        os.write(go_w, b"q")
        os.waitpid(pid, 0)
        for fd in (go_r, go_w, done_r, done_w, pipe_r):
            os.close(fd)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["memcpy_in_process"] = min(times["memcpy_in_process"]) * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="16,64", help="sizes in MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {}
    for mib in (int(x) for x in args.mib.split(",")):
        ms = measure(mib << 20, args.rounds)
        floor = ms["memcpy_in_process"]
        result[f"{mib}MiB"] = {
            "ms": {k: round(v, 3) for k, v in ms.items()},
            "over_floor": {k: round(v / floor, 2) for k, v in ms.items() if k != "memcpy_in_process"},
        }
    result["load"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
