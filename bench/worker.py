"""One benchmark controller process: runs workloads on request from the runner.

Started by ``bench/run.py`` as ``PYTHON bench/worker.py RESULT_FD`` with ``BENCH_IMPL`` set
to ``nb`` or ``monarch``. Commands arrive as JSON lines on stdin; answers go to RESULT_FD.
This process's fd 1 becomes a pipe read by :class:`workloads.LogSink`, so output that
either system forwards to its controller is counted where a user would see it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    res_fd = int(sys.argv[1])
    r, w = os.pipe()
    os.dup2(w, 1)
    os.close(w)
    import workloads

    workloads.SINK = workloads.LogSink(r)
    out = os.fdopen(res_fd, "w", buffering=1)
    live: dict[str, object] = {}

    def answer(**kw: object) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    answer(ok=True, impl=workloads.IMPL, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                break
            name = cmd.get("w", "")
            if op == "setup":
                t0 = time.perf_counter()
                wl = workloads.build(name)
                wl.setup()
                live[name] = wl
                answer(ok=True, setup_s=time.perf_counter() - t0)
            elif op == "run":
                wl = live[name]
                samples = wl.sample(int(cmd["n"]))  # type: ignore[attr-defined]
                # figures a workload reports beside its times (e.g. peak memory), then forgets
                extra, wl.extra = getattr(wl, "extra", {}), {}  # type: ignore[attr-defined]
                answer(ok=True, samples=samples, extra=extra)
            elif op == "teardown":
                wl = live.pop(name, None)
                if wl is not None:
                    wl.teardown()  # type: ignore[attr-defined]
                answer(ok=True)
            else:
                answer(ok=False, error=f"unknown op {op!r}")
        except BaseException as e:
            answer(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
    for wl in list(live.values()):
        try:
            wl.teardown()  # type: ignore[attr-defined]
        except Exception:
            pass
    if workloads.IMPL == "nb":
        import atexit

        # a user's script ends normally: the controller says bye and gives back its shared-memory
        # pool at exit; os._exit below would skip that, and the allocator stopped next would no
        # longer be there to sweep the pool after us
        atexit._run_exitfuncs()
        # the worker started this private runtime dir's allocator (this_host()); stop it
        from monarch_nb.allocator import stop_allocator

        stop_allocator()
    else:
        try:
            from monarch.actor import shutdown_context

            shutdown_context().get()
        except Exception:
            pass
    answer(ok=True, bye=True)
    out.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
