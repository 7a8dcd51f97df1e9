"""Where a cold ``call_one`` spends its CPU: the interpreter, the kernel or C libraries.

    python -m bench.cold_perf [--calls 300] [--walk-mib 16] [--pause-ms 20]

One actor in one proc of this host. ``perf record`` (system-wide, cpu-clock) runs while the
controller makes ``--calls`` calls, each after copying ``--walk-mib`` MiB and sleeping
``--pause-ms`` (cold), then ten times as many back to back (warm). Prints JSON: per call, the
controller's and the proc's sampled CPU (µs) by where it ran (``libpython``, of which
``_PyEval_EvalFrameDefault``; the kernel; other libraries; the controller's copy is in
``libc`` and left out). Needs ``perf`` and permission to sample the whole system (root here).
The figures are ``perf``'s samples, so they carry its overhead (a cold call takes longer under
it): compare cold with warm, and one tree with another, not with ``bench.cold_call``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

_PERF_HZ = "20000"


def _threads(pid: int) -> set[str]:
    # perf's "pid" sort key is a thread's id
    return set(os.listdir(f"/proc/{pid}/task"))


def _split(data: str, tids: set[str], calls: int) -> dict[str, float]:
    """The sampled CPU per call (µs) of the threads ``tids`` in ``data``, by where it ran."""
    rep = subprocess.run(
        ["perf", "report", "-i", data, "--show-total-period", "--sort", "pid,dso,sym", "--stdio"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    out = {"libpython": 0.0, "eval_loop": 0.0, "kernel": 0.0, "other": 0.0}
    for line in rep.splitlines():
        parts = line.split()
        # "  1.30%  26600000  29764:python  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault"
        if len(parts) < 6 or not parts[0].endswith("%") or parts[2].split(":", 1)[0] not in tids:
            continue
        us = int(parts[1]) / 1e3 / calls
        dso, sym = parts[3], parts[5]
        if dso.startswith("libpython"):
            out["libpython"] += us
            if sym == "_PyEval_EvalFrameDefault":
                out["eval_loop"] += us
        elif dso == "[kernel.kallsyms]":
            out["kernel"] += us
        elif not dso.startswith("libc."):  # the controller's copy between cold calls is libc's
            out["other"] += us
    return {k: round(v, 1) for k, v in out.items()}


def _record(data: str, loop: Any) -> None:
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-F", _PERF_HZ, "-q", "-o", data],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # perf has no "ready" signal; an idle second before the loop only adds idle samples
        time.sleep(1.0)
        loop()
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_perf")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--walk-mib", type=int, default=16)
    ap.add_argument("--pause-ms", type=float, default=20.0)
    a = ap.parse_args()
    if shutil.which("perf") is None:
        print("bench.cold_perf needs `perf` (Debian: linux-perf)", file=sys.stderr)
        return 2
    rdir = tempfile.mkdtemp(prefix="mnbk-", dir="/tmp")
    os.chmod(rdir, 0o700)
    os.environ["MONARCH_NB_RUNTIME_DIR"] = rdir
    work = tempfile.mkdtemp(prefix="coldperf-")
    from monarch_nb.actor import Actor, endpoint, this_host
    from monarch_nb.allocator import stop_allocator

    class Echo(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    src, dst = bytearray(os.urandom(1 << 20)) * a.walk_mib, bytearray(a.walk_mib << 20)
    try:
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        am = pm.spawn("coldperf", Echo)
        proc_pid = am.pid.call_one().get()
        for _ in range(300):
            am.pid.call_one().get()
        took: dict[str, list[float]] = {"cold": [], "warm": []}

        def cold() -> None:
            for _ in range(a.calls):
                dst[:] = src
                time.sleep(a.pause_ms / 1e3)
                t0 = time.perf_counter()
                am.pid.call_one().get()
                took["cold"].append(time.perf_counter() - t0)

        def warm() -> None:
            for _ in range(a.calls * 10):
                t0 = time.perf_counter()
                am.pid.call_one().get()
                took["warm"].append(time.perf_counter() - t0)

        out: dict[str, Any] = {"command": " ".join(["python", "-m", "bench.cold_perf", *sys.argv[1:]])}
        out["loadavg"] = os.getloadavg()
        tids = {"controller_us": _threads(os.getpid()), "proc_us": _threads(proc_pid)}
        for kind, loop, n in (("cold", cold, a.calls), ("warm", warm, a.calls * 10)):
            data = os.path.join(work, f"{kind}.data")
            _record(data, loop)
            xs = sorted(took[kind])
            out[kind] = {"round_trip_median_us": round(xs[len(xs) // 2] * 1e6, 1)}
            out[kind].update({side: _split(data, t, n) for side, t in tids.items()})
        pm.stop().get()
        print(json.dumps(out, indent=1))
    finally:
        stop_allocator()
        shutil.rmtree(rdir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
