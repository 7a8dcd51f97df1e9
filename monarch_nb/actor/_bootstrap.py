"""A proc's main: build the runtime from the allocator's spec, host actors until told to stop."""

from __future__ import annotations

import asyncio
import atexit
import gc
import os
import pickle
import sys
from typing import Any

from . import _logprefix, _pdb  # imported here so the zygote preloads pdb once, not every proc


def main(spec: dict[str, Any]) -> int:
    from .._runtime.logcapture import install_tagged_streams
    from .._runtime.runtime import Runtime
    from .._runtime.transport import Security
    from .._wire.serialize import dumps, loads
    from ..config import Config
    from ..errors import SupervisionError
    from . import _context
    from ._host import ensure_actor_host

    # synced workspaces come first: their modules win over anything with the same name
    for ws in reversed(spec.get("workspaces", [])):
        sys.path.insert(0, ws)
    install_tagged_streams()
    cfg = Config(**spec["cfg"])
    rt = Runtime(
        cfg,
        Security(spec["key"], spec["trust_all"]),
        spec["runtime_dir"],
        tcp_ip=spec["tcp_ip"],
        label=f"{spec['mesh']}[{spec['rank']}]",
    ).start()
    rt.supervision.home.update(a for a in (spec["alloc_addr"], spec.get("alloc_tcp")) if a)
    _context.install_runtime(rt, spec)
    _logprefix.install(False)
    _pdb.install(rt)
    host = ensure_actor_host(rt)
    if spec.get("bootstrap"):
        r = loads(spec["bootstrap"])()
        if asyncio.iscoroutine(r):
            asyncio.run(r)
    addr = rt.tcp_addr or rt.ipc_addr
    body, bufs = dumps(((spec["token"], addr, os.getpid(), rt.ipc_addr), {}))
    rt.send_actor(spec["alloc_addr"], "__allocator__", "proc_ready", body, bufs)
    host.main_loop()
    host.cleanup_all()
    # the allocator gives a proc a grace period from here, then kills it (and stop() says so)
    try:
        rt.send_actor(spec["alloc_addr"], "__allocator__", "proc_cleaned", *dumps(((spec["token"],), {})))
    except SupervisionError:
        # this proc heard its allocator shut down (it watches it once its actors call its
        # peers): nobody is left to tell, and its controllers heard why from the allocator.
        # An allocator lost otherwise (silent, crashed) stays an error worth its traceback
        if not any(rt.supervision.was_shut_down(a) for a in rt.supervision.home):
            raise
    # a normal exit, as Monarch's procs make: non-daemon threads are waited for, then
    # finalizers and atexit handlers run
    _join_threads()
    gc.collect()
    atexit._run_exitfuncs()
    # segments its senders lent it go back now (nothing here holds what lies on them any
    # more), not a minute on when they would give them up
    rt.release_shm()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join_threads() -> None:
    import threading

    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()


if __name__ == "__main__":
    # exec'd through a bootstrap command: the spec comes through an inherited pipe
    fd = int(os.environ.pop("MONARCH_NB_PROC_SPEC_FD"))
    with os.fdopen(fd, "rb") as f:
        spec = pickle.load(f)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    main(spec)
