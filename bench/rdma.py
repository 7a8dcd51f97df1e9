"""RDMABuffer reads and writes between two procs of one host: monarch_nb vs Monarch vs memcpy.

    python -m bench.rdma [--monarch-python PATH] [--sizes 1M,64M] [--big] [--hosts]

Each system runs ``bench/_rdma_worker.py`` as its own controller (the same file, a different
import), with its default configuration. ``memcpy`` is the floor: one ``memmove`` of the same
size inside a proc. Medians per size and operation; prints one JSON object.
``--big`` adds 1 GiB (minutes with Monarch's TCP fallback). ``--hosts`` (root) also runs
monarch_nb with the owner and the reader on two network-namespace hosts, next to a raw TCP
stream over the same link.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(s: str) -> int:
    return int(s[:-1]) * _UNITS[s[-1]] if s[-1] in _UNITS else int(s)


def run(impl: str, python: str, sizes: list[int], timeout: float) -> dict:
    env = dict(os.environ, BENCH_IMPL=impl, BENCH_FLOOR="1" if impl == "nb" else "0")
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


def run_hosts(sizes: list[int], timeout: float) -> dict:
    """The same worker with the owner and the reader on two network-namespace hosts (root only;
    tests/_netns.py), allocators holding a cluster key: every byte authenticated and encrypted."""
    import time

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _netns import NetnsCluster

    port = 26650
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "MONARCH_NB_RUNTIME_DIR": "/tmp/mnb",
        "PYTHONPATH": ROOT,
    }
    with NetnsCluster(2) as c:
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
        addrs = [f"tcp://{c.ip(i)}:{port}" for i in (1, 2)]
        logs = []
        for i, addr in zip((1, 2), addrs):
            log = open(c.path(i, "/tmp/alloc.log"), "wb")
            logs.append(log)
            argv = [sys.executable, "-m", "monarch_nb", "allocator", "--bind", addr, "--key-file", "/tmp/key"]
            c.popen(i, argv, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        for i in (1, 2):
            while b"serving at" not in c.path(i, "/tmp/alloc.log").read_bytes():
                if time.monotonic() > deadline:
                    return {"error": "allocators did not start"}
                time.sleep(0.1)
        wenv = dict(env, BENCH_IMPL="nb", BENCH_WORKERS=",".join(addrs), BENCH_KEY="/tmp/key")
        argv = [sys.executable, os.path.join(HERE, "_rdma_worker.py"), ",".join(map(str, sizes))]
        p = c.popen(0, argv, env=wenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=timeout)
        for log in logs:
            log.close()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {err[-2000:]}"}
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--monarch-python", default=os.path.join(ROOT, ".bench-venv", "bin", "python"))
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--big", action="store_true", help="add 1 GiB")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--hosts", action="store_true", help="also across two network-namespace hosts (root)")
    a = ap.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    if a.big:
        sizes.append(1 << 30)
    nb = run("nb", sys.executable, sizes, a.timeout)
    mon = run("monarch", a.monarch_python, sizes, a.timeout) if os.path.exists(a.monarch_python) else {"error": "no Monarch"}
    out: dict = {"sizes": sizes, "same_host": {}}
    for n in sizes:
        row: dict = {"memcpy_GBps": nb.get(f"memcpy_{n}", {}).get("GBps")}
        for op in ("read", "write"):
            ours, theirs = nb.get(f"{op}_{n}", {}), mon.get(f"{op}_{n}", {})
            row[op] = {
                "monarch_nb_median_s": ours.get("median_s"),
                "monarch_nb_GBps": ours.get("GBps"),
                "monarch_median_s": theirs.get("median_s"),
                "monarch_GBps": theirs.get("GBps"),
                "vs_memcpy": (ours["GBps"] / row["memcpy_GBps"]) if ours and row["memcpy_GBps"] else None,
                "vs_monarch": (ours["GBps"] / theirs["GBps"]) if ours and theirs else None,
            }
        out["same_host"][str(n)] = row
    if a.hosts:
        hosts = run_hosts(sizes, a.timeout)
        out["across_hosts"] = {}
        for n in sizes:
            raw = hosts.get(f"rawtcp_{n}", {}).get("GBps")
            row = {"raw_tcp_GBps": raw}
            for op in ("read", "write"):
                ours = hosts.get(f"{op}_{n}", {})
                theirs = mon.get(f"{op}_{n}", {})
                row[op] = {
                    "monarch_nb_median_s": ours.get("median_s"),
                    "monarch_nb_GBps": ours.get("GBps"),
                    "vs_raw_tcp": (ours["GBps"] / raw) if ours and raw else None,
                    "vs_monarch_same_host": (ours["GBps"] / theirs["GBps"]) if ours and theirs else None,
                    "controller_cpu_fraction": ours.get("controller_cpu_fraction"),
                }
            out["across_hosts"][str(n)] = row
        if "error" in hosts:
            out["across_hosts_error"] = hosts["error"]
    for name, r in (("monarch_nb", nb), ("monarch", mon)):
        if "error" in r:
            out[f"{name}_error"] = r["error"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
