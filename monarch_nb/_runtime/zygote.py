"""The warm zygote: imports heavy modules once, then forks procs on request.

It is single-threaded on purpose (forking a threaded process is unsafe) and talks to its
allocator over a SOCK_SEQPACKET pair: requests carry the pickled spec plus the write ends
of the proc's stdout/stderr pipes (SCM_RIGHTS), so the allocator reads them and a proc's
last words survive its crash. Procs die with the zygote, the zygote with its allocator.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
import weakref
from typing import Any

from ._prctl import die_with_parent

#: how long one spawn request may wait for the zygote to take the requests before it
SEND_TIMEOUT_S = 60.0


class Requests:
    """The allocator's end of the socket pair: spawn requests, sent in order.

    The zygote takes one request per fork, so a burst (a mesh of 64 procs on one host) fills
    the socket's buffer long before it is read. The end is non-blocking (it lives on the
    allocator's event loop), so a request that does not fit waits until the zygote has read
    the earlier ones, instead of failing with ``EAGAIN``; one waiter at a time, the others
    queue behind it on a lock, which also keeps the requests in the order they were made.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = asyncio.Lock()

    async def send(self, data: bytes, fds: list[int], timeout: float = SEND_TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._lock:
            while True:
                try:
                    socket.send_fds(self.sock, [data], fds)
                    return
                except BlockingIOError:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(
                        f"the allocator's zygote took no spawn request for {timeout:.0f} s "
                        "(busy forking, or stuck): spawn fewer procs at once, or restart the allocator"
                    )
                writable = loop.create_future()
                fd = self.sock.fileno()
                loop.add_writer(fd, _wake, writable)
                try:
                    await asyncio.wait_for(writable, left)
                except TimeoutError:
                    pass
                finally:
                    loop.remove_writer(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _send(sock: socket.socket, msg: Any) -> None:
    sock.send(pickle.dumps(msg))


def _child(req: dict[str, Any], fds: list[int], sock: socket.socket, wake_r: int, wake_w: int, zygote: int) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent()
        if os.getppid() != zygote:
            # the zygote died (with its allocator: kill -9 mid-spawn) between the fork and the
            # line above: the signal came too late for this proc, which would run on for good
            os._exit(1)
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cwd") and os.path.isdir(req["cwd"]):
            os.chdir(req["cwd"])
        sys.path[:] = req["sys_path"]
        mod, _, fn = req["entry"].partition(":")
        code = getattr(importlib.import_module(mod), fn)(req["spec"]) or 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _keep_preload_finalizers_from_exit() -> None:
    """A proc's normal exit runs ``weakref.finalize``'s pending finalizers; those the preload
    registered are the zygote's, not the proc's. torch's (134, undoing its operator
    registrations) took 20 ms of CPU per proc, copying the zygote's shared pages on the way
    out, so stopping 128 procs pinned two cores for 2 s, long enough for heartbeats to miss;
    and one that removes a file would remove it for every proc at its first exit."""
    for f in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        f.atexit = False


def main(sock_fd: int, preload: str) -> None:
    die_with_parent()
    # a scheduler ending the job (Slurm's walltime) or a Ctrl-C signals the whole process group:
    # the allocator stops in order and then ends this one; it must not die first, which would
    # fail its procs as if it had crashed. Its children take these back (_child)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=sock_fd)
    loaded, failed = [], []
    t0 = time.monotonic()
    for name in filter(None, (p.strip() for p in preload.split(","))):
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    # everything imported so far lives as long as every proc: keep it out of the collector's
    # sight, so a proc's collections stay short (no multi-ms pauses scanning torch's objects)
    # and do not write to, and so un-share, the pages procs inherit from the zygote
    gc.collect()
    gc.freeze()
    _keep_preload_finalizers_from_exit()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, ("ready", loaded, failed, time.monotonic() - t0))
    watched: list[socket.socket | int] = [sock, wake_r]
    while True:
        r, _, _ = select.select(watched, [], [])
        if wake_r in r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, ("exited", pid, status))
        if sock in r:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 22, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                os._exit(0)  # allocator gone; procs follow through PDEATHSIG
            req = pickle.loads(data)
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                _child(req, fds, sock, wake_r, wake_w, me)
            for fd in fds:
                os.close(fd)
            _send(sock, ("spawned", req["token"], pid))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
