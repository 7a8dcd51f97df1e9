"""RDMABuffer reads and writes between two procs of one host: monarch_nb vs Monarch vs memcpy.

    python -m bench.rdma [--monarch-python PATH] [--sizes 1M,64M] [--big] [--hosts [--streams 1,2,4]] [--no-same-host]
                         [--device cuda]

Each system runs ``bench/_rdma_worker.py`` as its own controller (the same file, a different
import), with its default configuration. ``memcpy`` is the floor: one ``memmove`` of the same
size inside a proc. Medians per size and operation; prints one JSON object.
``--big`` adds 1 GiB (minutes with Monarch's TCP fallback). ``--hosts`` (root) also runs both
with the owner and the reader on two network-namespace hosts, next to a raw TCP stream over the
same link, and ours once per ``--streams`` count (a transfer split over that many connections).
Every row has the controller's CPU time, and that of the processes between it and the two procs
(allocators, zygotes; Monarch's host agents), over the transfers' wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(s: str) -> int:
    return int(s[:-1]) * _UNITS[s[-1]] if s[-1] in _UNITS else int(s)


def run(impl: str, python: str, sizes: list[int], timeout: float, device: str = "cpu") -> dict:
    env = dict(os.environ, BENCH_IMPL=impl, BENCH_FLOOR="1" if impl == "nb" else "0", BENCH_DEVICE=device)
    with tempfile.TemporaryDirectory(prefix="mnb-bench-") as rdir:
        env["MONARCH_NB_RUNTIME_DIR"] = rdir
        if impl == "nb":
            env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        try:
            r = subprocess.run(
                [python, os.path.join(HERE, "_rdma_worker.py"), ",".join(map(str, sizes))],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=rdir,
            )
        finally:
            if impl == "nb":
                subprocess.run(
                    [sys.executable, "-m", "monarch_nb", "allocator", "stop"], env=env, capture_output=True, timeout=60
                )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}: {r.stderr[-2000:]}"}
    return json.loads(lines[-1])


def _result(p: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return {"error": f"timed out after {timeout:.0f} s: {err[-2000:]}"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {err[-3000:]}"}
    return json.loads(lines[-1])


def _wait_for_log(path: Any, text: bytes, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_bytes():
            return True
        time.sleep(0.1)
    return False


def run_hosts(sizes: list[int], timeout: float, monarch_python: str | None, streams: str) -> tuple[dict, dict]:
    """The same worker with the owner and the reader on two network-namespace hosts (root only;
    tests/_netns.py), over one veth link: first monarch_nb (allocators holding a cluster key:
    every byte authenticated and encrypted; with ``streams``, each forced stream count too), then
    Monarch (its workers started with ``run_worker_loop_forever``, as its docs do). Each run also
    times a raw TCP stream between the same two procs."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _netns import NetnsCluster

    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "MONARCH_NB_RUNTIME_DIR": "/tmp/mnb",
        "PYTHONPATH": ROOT,
    }
    argv = [os.path.join(HERE, "_rdma_worker.py"), ",".join(map(str, sizes))]
    # named hosts (a UTS namespace each, /etc/hosts naming all): Monarch's client finds the
    # address its workers reach it at from its hostname
    with NetnsCluster(2, hostnames=["bench-h0", "bench-h1", "bench-h2"]) as c:
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(
                [sys.executable, "-m", "monarch_nb", "keygen", f"{d}/key"], capture_output=True, check=True, timeout=60
            )
            with open(f"{d}/key", "rb") as f:
                key = f.read()
        for i in c.hosts:
            fd = os.open(c.path(i, "/tmp/key"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
        addrs = [f"tcp://{c.ip(i)}:26650" for i in (1, 2)]
        allocs = []
        for i, addr in zip((1, 2), addrs):
            with open(c.path(i, "/tmp/alloc.log"), "wb") as log:
                cmd = [sys.executable, "-m", "monarch_nb", "allocator", "--bind", addr, "--key-file", "/tmp/key"]
                allocs.append(c.popen(i, cmd, env=env, stdout=log, stderr=log))
        if not all(_wait_for_log(c.path(i, "/tmp/alloc.log"), b"serving at", 60) for i in (1, 2)):
            ours = {"error": "allocators did not start"}
        else:
            wenv = dict(env, BENCH_IMPL="nb", BENCH_WORKERS=",".join(addrs), BENCH_KEY="/tmp/key", BENCH_STREAMS=streams)
            p = c.popen(0, [sys.executable, *argv], env=wenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ours = _result(p, timeout)
        for a in allocs:
            a.terminate()
            a.wait(30)
        if monarch_python is None:
            return ours, {"error": "no Monarch interpreter"}
        maddrs = [f"tcp://{c.ip(i)}:26651" for i in (1, 2)]
        workers = []
        for i, addr in zip((1, 2), maddrs):
            with open(c.path(i, "/tmp/monarch-worker.log"), "wb") as log:
                code = f"from monarch.actor import run_worker_loop_forever\nrun_worker_loop_forever(ca='trust_all_connections', address={addr!r})"
                workers.append(c.popen(i, [monarch_python, "-c", code], env=dict(env, PYTHONPATH=""), stdout=log, stderr=log))
        wenv = dict(env, PYTHONPATH="", BENCH_IMPL="monarch", BENCH_WORKERS=",".join(maddrs))
        p = c.popen(0, [monarch_python, *argv], env=wenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        theirs = _result(p, timeout)
        if "error" in theirs:
            for i in (1, 2):
                wlog = c.path(i, "/tmp/monarch-worker.log").read_bytes().decode(errors="replace")
                theirs["error"] += f"\n--- worker on host {i}:\n{wlog[-1500:]}"
        for w in workers:
            w.kill()
            w.wait(30)
    return ours, theirs


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--monarch-python", default=os.path.join(ROOT, ".bench-venv", "bin", "python"))
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--big", action="store_true", help="add 1 GiB")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--hosts", action="store_true", help="also across two network-namespace hosts (root)")
    ap.add_argument("--streams", default="1,2,4", help="across hosts, also force these stream counts (ours)")
    ap.add_argument("--no-same-host", action="store_true", help="only the runs across hosts")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the buffers on the GPU, same host only (CUDA IPC; ours also staged through pinned memory; "
        "the floor is a device-to-device copy)",
    )
    a = ap.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    if a.big:
        sizes.append(1 << 30)
    has_monarch = os.path.exists(a.monarch_python)
    out: dict = {"sizes": sizes}
    if not a.no_same_host:
        nb = run("nb", sys.executable, sizes, a.timeout, a.device)
        mon = run("monarch", a.monarch_python, sizes, a.timeout, a.device) if has_monarch else {"error": "no Monarch"}
        out["same_host"] = {}
        for n in sizes:
            row: dict = {"memcpy_GBps": nb.get(f"memcpy_{n}", {}).get("GBps")}
            # --device cuda: the floors of a staged transfer (a plain AF_UNIX stream between the
            # two procs; a pinned copy each way)
            for floor in ("unixstream", "d2h", "h2d"):
                if f"{floor}_{n}" in nb:
                    row[f"{floor}_GBps"] = nb[f"{floor}_{n}"]["GBps"]
            for op in ("read", "write", "read_staged", "write_staged"):
                if f"{op}_{n}" not in nb and op.endswith("_staged"):
                    continue
                ours, theirs = nb.get(f"{op}_{n}", {}), mon.get(f"{op}_{n}", {})
                row[op] = {
                    "monarch_nb_median_s": ours.get("median_s"),
                    "monarch_nb_GBps": ours.get("GBps"),
                    "monarch_median_s": theirs.get("median_s"),
                    "monarch_GBps": theirs.get("GBps"),
                    "vs_memcpy": _ratio(ours.get("GBps"), row["memcpy_GBps"]),
                    "vs_monarch": _ratio(ours.get("GBps"), theirs.get("GBps")),
                    "controller_cpu_fraction": ours.get("controller_cpu_fraction"),
                    "allocators_cpu_fraction": ours.get("allocators_cpu_fraction"),
                }
                if op.endswith("_staged") and "unixstream_GBps" in row:
                    row[op]["vs_unix_stream"] = _ratio(ours.get("GBps"), row["unixstream_GBps"])
            out["same_host"][str(n)] = row
        out["same_host"]["cpu_counted_for"] = {"monarch_nb": nb.get("helpers"), "monarch": mon.get("helpers")}
        for name, r in (("monarch_nb", nb), ("monarch", mon)):
            if "error" in r:
                out[f"{name}_error"] = r["error"]
    if a.hosts:
        hosts, mhosts = run_hosts(sizes, a.timeout, a.monarch_python if has_monarch else None, a.streams)
        out["across_hosts"] = {}
        for n in sizes:
            raw = hosts.get(f"rawtcp_{n}", {}).get("GBps")
            row = {"raw_tcp_GBps": raw, "raw_tcp_GBps_in_monarch_run": mhosts.get(f"rawtcp_{n}", {}).get("GBps")}
            for op in ("read", "write"):
                ours, theirs = hosts.get(f"{op}_{n}", {}), mhosts.get(f"{op}_{n}", {})
                row[op] = {
                    "monarch_nb_median_s": ours.get("median_s"),
                    "monarch_nb_GBps": ours.get("GBps"),
                    "monarch_median_s": theirs.get("median_s"),
                    "monarch_GBps": theirs.get("GBps"),
                    "vs_raw_tcp": _ratio(ours.get("GBps"), raw),
                    "vs_monarch": _ratio(ours.get("GBps"), theirs.get("GBps")),
                    "controller_cpu_fraction": ours.get("controller_cpu_fraction"),
                    "allocators_cpu_fraction": ours.get("allocators_cpu_fraction"),
                    "monarch_controller_cpu_fraction": theirs.get("controller_cpu_fraction"),
                    "monarch_host_agents_cpu_fraction": theirs.get("allocators_cpu_fraction"),
                    "by_streams_GBps": {
                        k: hosts[f"{op}_{n}_s{k}"]["GBps"] for k in a.streams.split(",") if f"{op}_{n}_s{k}" in hosts
                    },
                }
            out["across_hosts"][str(n)] = row
        out["across_hosts"]["cpu_counted_for"] = {"monarch_nb": hosts.get("helpers"), "monarch": mhosts.get("helpers")}
        if "error" in hosts:
            out["across_hosts_error"] = hosts["error"]
        if "error" in mhosts:
            out["monarch_across_hosts_error"] = mhosts["error"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
