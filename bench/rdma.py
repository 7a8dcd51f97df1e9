"""RDMABuffer reads and writes between two procs of one host: monarch_nb vs Monarch vs memcpy.

    python -m bench.rdma [--monarch-python PATH] [--sizes 1M,64M] [--big]

Each system runs ``bench/_rdma_worker.py`` as its own controller (the same file, a different
import), with its default configuration. ``memcpy`` is the floor: one ``memmove`` of the same
size inside a proc. Medians per size and operation; prints one JSON object.
``--big`` adds 1 GiB (minutes with Monarch's TCP fallback).
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--monarch-python", default=os.path.join(ROOT, ".bench-venv", "bin", "python"))
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--big", action="store_true", help="add 1 GiB")
    ap.add_argument("--timeout", type=float, default=600)
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
    for name, r in (("monarch_nb", nb), ("monarch", mon)):
        if "error" in r:
            out[f"{name}_error"] = r["error"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
