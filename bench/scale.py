"""monarch_nb at scale: many hosts (network namespaces) and many ranks, from one controller.

    sudo .venv/bin/python -m bench.scale [--part hero|grid|onehost|all] [--quick]
        [--monarch-python PATH] [--out FILE]

Not in CI (minutes, root, a quiet machine). Parts:

* ``hero``: 16 hosts x 8 procs = 128 ranks (``--quick``: 4 x 2) driven from a real IPython
  kernel on a host of its own, through jupyter_client as a notebook frontend drives it: spawn
  until every actor is constructed, ``call`` to all (median, p99), a broadcast, a
  ``%%mesh exec`` cell, every rank printing 100 lines aggregated into the cell (time to the last
  line, the lines the cell's groups stand for, the lines on the hosts' disks), ``%mesh status``
  and the dashboard rendering every rank, a SIGKILLed proc and a host's cut link surfaced at the
  notebook, and the kernel's event-loop lag (the longest a scheduled callback was late while no
  cell was running) throughout. Zygotes preload torch (``--hero-preload`` to change).
* ``grid``: the controller's cost per call-to-all, per broadcast and per log line (wall time
  and the controller's CPU time) over hosts 1, 2, 4, 8, 16 x ranks per host 1, 8, 32 (32 only
  up to 4 hosts; ``--quick``: 1, 2 x 1, 8), with an empty zygote preload, and a least-squares
  fit ``a + b*hosts + c*ranks`` of each.
* ``onehost``: 16, 48 and 128 ranks on one host (no namespaces; ``--quick``: 16), spawn and
  call-to-all, side by side with Monarch (``this_host().spawn_procs({"gpus": N})``) when
  ``--monarch-python`` is given; 128 falls back to 64 for Monarch if it fails.

Prints one JSON object (and writes it to ``--out``). The machine's CPU count and load are in
it: on a 2-core machine 128 ranks and 16 allocators share two cores, so the figures say what
the controller costs, not what a cluster would take.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PY = sys.executable
PORT = 26700


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


# ------------------------------------------------------------------ hosts
class Hosts:
    """``n`` worker hosts (network namespaces 1..n) each running an allocator, and host 0 for
    the controller; the cluster key is in every host's /tmp/key."""

    def __init__(self, n: int, preload: str) -> None:
        from _netns import NetnsCluster

        self.c = NetnsCluster(n)
        self.allocs: list[subprocess.Popen[bytes]] = []
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": "/tmp",
            "MONARCH_NB_RUNTIME_DIR": "/tmp/mnb",
            "PYTHONUNBUFFERED": "1",
        }
        try:
            keydir = tempfile.mkdtemp(prefix="mnbs-")
            key = Path(keydir) / "key"
            subprocess.run([PY, "-m", "monarch_nb", "keygen", str(key)], check=True, capture_output=True)
            for i in self.c.hosts:
                dst = self.c.path(i, "/tmp/key")
                dst.write_bytes(key.read_bytes())
                os.chmod(dst, 0o600)
            shutil.rmtree(keydir)
            self.addrs = [f"tcp://{self.c.ip(i)}:{PORT}" for i in range(1, n + 1)]
            aenv = dict(self.env, MONARCH_NB_ZYGOTE_PRELOAD=preload)
            for i, addr in enumerate(self.addrs, 1):
                argv = [PY, "-m", "monarch_nb", "allocator", "--bind", addr, "--key-file", "/tmp/key"]
                self.allocs.append(self.c.popen(i, argv, env=aenv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for p in self.allocs:
                for line in iter(p.stderr.readline, b""):  # type: ignore[union-attr]
                    if b"serving at" in line:
                        break
                else:
                    raise RuntimeError("an allocator exited while starting")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.allocs:
            p.terminate()
        for p in self.allocs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.c.close()


# ------------------------------------------------------------------ grid
GRID_CONTROLLER = r"""
import json, os, statistics, sys, threading, time
from monarch_nb.actor import Actor, endpoint, attach_to_workers, controller_client

class Echo(Actor):
    @endpoint
    def ping(self):
        return 1

    @endpoint
    def spew(self, n, tag):
        for i in range(n):
            print(f"{tag} {i}")
        return n

addrs, shapes, reps, lines = json.loads(sys.argv[1])

def cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]

def busy(a, b):
    return 1 - (b[1] - a[1]) / max(1, b[0] - a[0])
seen = {"n": 0, "tag": ""}
done = threading.Condition()

def tap(mesh, batch):
    k = sum(1 for ln in batch if ln[4].startswith(seen["tag"]))
    if k:
        with done:
            seen["n"] += k
            done.notify_all()

client = controller_client()
client.log_taps.append(tap)
out = []
for h, r in shapes:
    hm = attach_to_workers(workers=addrs[:h], key_file="/tmp/key")
    pm = hm.spawn_procs(per_host={"gpus": r}, name=f"g{h}x{r}")
    am = pm.spawn("e", Echo)
    am.initialized.get(timeout=300)
    for _ in range(3):
        am.ping.call().get(timeout=120)
    row = {"hosts": h, "ranks_per_host": r, "ranks": h * r}
    walls = []
    c0, u0 = time.process_time(), cpu()
    for _ in range(reps):
        t = time.perf_counter()
        am.ping.call().get(timeout=120)
        walls.append(time.perf_counter() - t)
    row["call_s"] = statistics.median(walls)
    row["call_cpu_s"] = (time.process_time() - c0) / reps
    row["machine_cpu_busy_during_calls"] = round(busy(u0, cpu()), 2)
    nb = reps * 4
    c0, t = time.process_time(), time.perf_counter()
    for _ in range(nb):
        am.ping.broadcast()
    am.ping.call().get(timeout=120)  # ordered after the broadcasts on every rank
    row["broadcast_s"] = (time.perf_counter() - t) / nb
    row["broadcast_cpu_s"] = (time.process_time() - c0) / nb
    tag = seen["tag"] = f"L{h}x{r}"
    seen["n"] = 0
    total = h * r * lines
    c0, t = time.process_time(), time.perf_counter()
    am.spew.call(lines, tag).get(timeout=300)
    with done:
        done.wait_for(lambda: seen["n"] >= total, timeout=120)
    row["log_lines"] = seen["n"]
    row["log_line_s"] = (time.perf_counter() - t) / total
    row["log_line_cpu_s"] = (time.process_time() - c0) / total
    pm.stop().get(timeout=120)
    out.append(row)
    print("ROW", json.dumps(row), flush=True)
print("RESULT", json.dumps(out), flush=True)
"""


def _fit(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Least squares of ``key`` on ``a + b*hosts + c*ranks`` (numpy)."""
    import numpy as np

    if len(rows) < 3:
        return {}
    x = np.array([[1.0, r["hosts"], r["ranks"]] for r in rows])
    y = np.array([r[key] for r in rows])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ np.array([a, b, c])
    rel = float(np.median(np.abs(pred - y) / np.maximum(y, 1e-12)))
    return {
        "a_s": float(a),
        "per_host_s": float(b),
        "per_rank_s": float(c),
        "median_rel_error": rel,
        "projected_256x16_s": float(a + 256 * b + 4096 * c),
    }


def part_grid(quick: bool, hosts_list: list[int] | None = None, ranks_list: list[int] | None = None) -> dict[str, Any]:
    hl = hosts_list or ([1, 2] if quick else [1, 2, 4, 8, 16])
    rl = ranks_list or ([1, 8] if quick else [1, 8, 32])
    shapes = [(h, r) for h in hl for r in rl if r < 32 or h <= 4]
    reps, lines = (10, 20) if quick else (30, 100)
    n = max(h for h, _ in shapes)
    t0 = time.monotonic()
    hosts = Hosts(n, preload="")
    try:
        script = hosts.c.path(0, "/tmp/scale_grid.py")
        script.write_text(GRID_CONTROLLER)
        cp = hosts.c.run(
            0,
            [PY, "/tmp/scale_grid.py", json.dumps([hosts.addrs, shapes, reps, lines])],
            env=hosts.env,
            capture_output=True,
            timeout=3600,
        )
        text = cp.stdout.decode(errors="replace")
        if cp.returncode != 0 or "RESULT " not in text:
            raise RuntimeError(f"grid controller failed ({cp.returncode}):\n{cp.stderr.decode(errors='replace')[-3000:]}")
        rows = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    finally:
        hosts.close()
    return {
        "rows": rows,
        "fit": {k: _fit(rows, k) for k in ("call_cpu_s", "call_s", "broadcast_cpu_s", "log_line_cpu_s")},
        "reps": reps,
        "lines_per_rank": lines,
        "wall_s": round(time.monotonic() - t0, 1),
    }


# ------------------------------------------------------------------ hero (from a kernel)
HERO_SETUP = r"""
%load_ext monarch_nb
import asyncio, json, os, statistics, time
import monarch_nb.mesh as M
from monarch_nb.actor import Actor, endpoint

class Echo(Actor):
    @endpoint
    def ping(self):
        return 1

    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def spew(self, n, tag):
        from monarch_nb.actor import current_rank
        r = current_rank().rank
        for i in range(n):
            print(f"{tag} rank {r} line {i}")
        return n

# the kernel's event-loop lag: how late a 10 ms callback runs while no cell is running
_lag = {"max": 0.0, "busy": False, "n": 0}
_ip = get_ipython()
_ip.events.register("pre_run_cell", lambda *a: _lag.update(busy=True))
_ip.events.register("post_run_cell", lambda *a: _lag.update(busy=False, last=None))
def _tick(loop, due):
    now = loop.time()
    if not _lag["busy"] and _lag.get("last") is not None:
        _lag["max"] = max(_lag["max"], now - due)
        _lag["n"] += 1
    _lag["last"] = now
    loop.call_at(now + 0.01, _tick, loop, now + 0.01)
_loop = asyncio.get_event_loop()
_loop.call_soon(_tick, _loop, _loop.time())
def report(**kw):
    print("SCALE " + json.dumps(kw))
"""


class HeroKernel:
    def __init__(self, hosts: Hosts, rundir: str) -> None:
        import jupyter_client
        from jupyter_client.kernelspec import KernelSpecManager

        kdir = os.path.join(rundir, "kernels", "scale")
        os.makedirs(kdir)
        argv = hosts.c.wrap(0, [PY, "-m", "ipykernel_launcher", "-f", "{connection_file}"], cwd=rundir)
        with open(os.path.join(kdir, "kernel.json"), "w") as f:
            json.dump({"argv": argv, "display_name": "scale", "language": "python"}, f)
        # ipc sockets under rundir (not /tmp): host 0 sees them at the same path
        os.chdir(rundir)
        self.km = jupyter_client.KernelManager(
            kernel_name="scale",
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[os.path.join(rundir, "kernels")]),
            transport="ipc",
            connection_file=os.path.join(rundir, "kernel.json"),
        )
        self.km.start_kernel(env=dict(hosts.env))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 600) -> tuple[float, list[dict[str, Any]]]:
        """Execute a cell; its wall time (sent → idle) and its iopub messages."""
        t0 = time.perf_counter()
        mid = self.kc.execute(code)
        msgs: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            m = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            m["_t"] = time.perf_counter()
            if m["parent_header"].get("msg_id") != mid:
                continue
            msgs.append(m)
            if m["msg_type"] == "error":
                raise RuntimeError("\n".join(m["content"]["traceback"]))
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return time.perf_counter() - t0, msgs

    def report(self, code: str, timeout: float = 600) -> dict[str, Any]:
        _, msgs = self.run(code, timeout)
        for m in msgs:
            text = m["content"].get("text", "")
            if "SCALE " in text:
                return json.loads(text.split("SCALE ", 1)[1].splitlines()[0])  # type: ignore[no-any-return]
        raise RuntimeError(f"no report from cell:\n{code}")

    def first_output_after(self, t0: float, timeout: float) -> dict[str, Any] | None:
        """Seconds from ``t0`` (perf_counter) to the first output the kernel shows, of any cell,
        and its text."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                m = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            c = m["content"]
            text = c.get("text") or c.get("data", {}).get("text/plain", "")
            if m["msg_type"] in ("stream", "display_data", "update_display_data", "error") and text.strip():
                return {"s": time.perf_counter() - t0, "shown": text.strip()[:300]}
        return None

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _count_log_lines(hosts: Hosts, tag: str) -> int:
    n = 0
    for i in range(1, len(hosts.addrs) + 1):
        for f in hosts.c.path(i, "/tmp/mnb").glob("mnb-logs-*/**/*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    n += fh.read().count(tag.encode())
    return n


def _cpu() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def _busy(a: tuple[int, int]) -> float:
    b = _cpu()
    return round(1 - (b[1] - a[1]) / max(1, b[0] - a[0]), 2)


def part_hero(quick: bool, preload: str, shape: str = "") -> dict[str, Any]:
    n_hosts, per = (int(x) for x in shape.split("x")) if shape else ((4, 2) if quick else (16, 8))
    ranks = n_hosts * per
    reps = 20 if quick else 100
    out: dict[str, Any] = {"hosts": n_hosts, "procs_per_host": per, "ranks": ranks, "zygote_preload": preload}
    t0 = time.monotonic()
    hosts = Hosts(n_hosts, preload)
    rundir = tempfile.mkdtemp(prefix="mnbs-", dir=str(ROOT))  # not /tmp: host 0 must see it
    cwd = os.getcwd()
    k = None
    try:
        k = HeroKernel(hosts, rundir)
        k.run(HERO_SETUP)
        k.run(f"M.connect(*{hosts.addrs!r}, key_file='/tmp/key')")
        # the zygotes finish their preload (torch: seconds) before the timed spawn, as in a session
        k.run("M.spawn('warm', {'gpus': 1}).stop().get()")
        u = _cpu()
        out.update(
            k.report(
                "t = time.perf_counter()\n"
                f"pm = M.spawn('hero', {{'gpus': {per}}})\n"
                "am = pm.spawn('e', Echo)\nam.initialized.get(timeout=600)\n"
                "report(spawn_s=time.perf_counter() - t)\n"
            )
        )
        out["machine_cpu_busy_during_spawn"] = _busy(u)
        u = _cpu()
        out.update(
            k.report(
                f"for _ in range(3): am.ping.call().get()\nw = []\nc0 = time.process_time()\n"
                f"for _ in range({reps}):\n    t = time.perf_counter(); am.ping.call().get(); w.append(time.perf_counter() - t)\n"
                "w.sort()\n"
                f"report(call_all_median_s=statistics.median(w), call_all_p99_s=w[min(len(w) - 1, int(0.99 * len(w)))], "
                f"call_all_controller_cpu_s=(time.process_time() - c0) / {reps})\n"
            )
        )
        out["machine_cpu_busy_during_calls"] = _busy(u)
        out.update(
            k.report(
                f"t = time.perf_counter()\nfor _ in range({reps}): am.ping.broadcast()\nam.ping.call().get()\n"
                f"report(broadcast_s=(time.perf_counter() - t) / {reps})\n"
            )
        )
        # the first %%mesh exec of a mesh puts an exec actor on every proc; later ones reuse it
        out["mesh_exec_first_cell_s"], _ = k.run("%%mesh exec hero\n1 + 1")
        out["mesh_exec_cell_s"], _ = k.run("%%mesh exec hero\n1 + 1")
        tag = "hero" + secrets.token_hex(3)
        t_sent = time.perf_counter()
        _, msgs = k.run(f"am.spew.call(100, {tag!r}).get()")
        shown = [m for m in msgs if m["msg_type"] == "stream" and tag in m["content"]["text"]]
        represented = 0
        group_lines = 0
        for m in shown:
            for line in m["content"]["text"].splitlines():
                if tag in line:
                    group_lines += 1
                    x = re.search(r"×(\d+)\]", line)
                    represented += int(x.group(1)) if x else 1
        out["print_100_each"] = {
            "lines_printed": ranks * 100,
            "to_last_line_s": (shown[-1]["_t"] - t_sent) if shown else None,
            "lines_shown_in_cell": group_lines,
            "lines_the_groups_stand_for": represented,
            "lines_on_hosts_disks": _count_log_lines(hosts, tag),
        }
        out["mesh_status_cell_s"], _ = k.run("%mesh status")
        out.update(
            k.report(
                "t = time.perf_counter()\nfrom monarch_nb.widgets import Dashboard\nd = Dashboard(pm)\n"
                "report(dashboard_build_s=time.perf_counter() - t)\n"
            )
        )
        out["dashboard_cell_s"], _ = k.run("d")
        # a SIGKILLed proc: from the kill to the first thing the notebook shows about it
        pids = k.report("report(pids=sorted(am.pid.call().get().values()))")["pids"]
        t = time.perf_counter()
        os.kill(pids[-1], signal.SIGKILL)
        out["sigkill_surfaced"] = k.first_output_after(t, 30)
        # one host's link cut: the heartbeats stop; until the notebook says so
        t = time.perf_counter()
        hosts.c.link_down(1)
        out["link_cut_surfaced"] = k.first_output_after(t, 60)
        out.update(k.report("report(kernel_loop_lag_max_s=_lag['max'], kernel_loop_lag_samples=_lag['n'])"))
    finally:
        if k is not None:
            k.close()
        os.chdir(cwd)
        hosts.close()
        shutil.rmtree(rundir, ignore_errors=True)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


# ------------------------------------------------------------------ one host, side by side
ONEHOST = r"""
import json, os, statistics, sys, time
IMPL, N, REPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if IMPL == "nb":
    from monarch_nb.actor import Actor, endpoint, this_host
else:
    from monarch.actor import Actor, endpoint, this_host

class Echo(Actor):
    @endpoint
    def ping(self):
        return 1

# the first spawn of a process starts what stays (monarch_nb: the allocator and its zygote)
t = time.perf_counter()
w = this_host().spawn_procs(per_host={"gpus": 1})
w.spawn("w", Echo).ping.call().get()
first = time.perf_counter() - t
w.stop().get()
t = time.perf_counter()
pm = this_host().spawn_procs(per_host={"gpus": N})
am = pm.spawn("e", Echo)
am.initialized.get()
am.ping.call().get()
spawn = time.perf_counter() - t
for _ in range(3):
    am.ping.call().get()
w = []
for _ in range(REPS):
    t = time.perf_counter()
    am.ping.call().get()
    w.append(time.perf_counter() - t)
w.sort()
print("RESULT " + json.dumps({"first_spawn_1_s": first, "spawn_s": spawn, "call_all_median_s": statistics.median(w),
                             "call_all_p99_s": w[min(len(w) - 1, int(0.99 * len(w)))]}), flush=True)
pm.stop().get()
"""


def _onehost_run(py: str, impl: str, n: int, reps: int) -> dict[str, Any]:
    rdir = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONARCH_NB_", "PYTHONPATH"))}
    env.update(MONARCH_NB_RUNTIME_DIR=rdir, TMPDIR=rdir)
    script = os.path.join(rdir, "onehost.py")
    with open(script, "w") as f:
        f.write(ONEHOST)
    try:
        cp = subprocess.run([py, script, impl, str(n), str(reps)], env=env, capture_output=True, timeout=900, cwd=rdir)
        text = cp.stdout.decode(errors="replace")
        if "RESULT " not in text:
            return {"error": (cp.stderr.decode(errors="replace") or text)[-1500:]}
        return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])  # type: ignore[no-any-return]
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    finally:
        if impl == "nb":
            subprocess.run([PY, "-m", "monarch_nb", "allocator", "stop"], env=env, capture_output=True)
        shutil.rmtree(rdir, ignore_errors=True)


def part_onehost(quick: bool, monarch_python: str, sizes: list[int] | None = None, monarch_max: int = 128) -> dict[str, Any]:
    sizes = sizes or ([16] if quick else [16, 48, 128])
    reps = 10 if quick else 30
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"ranks": n, "monarch_nb": _onehost_run(PY, "nb", n, reps)}
        if monarch_python:
            m = min(n, monarch_max)
            mon = _onehost_run(monarch_python, "monarch", m, reps)
            if "error" in mon and m > 64:
                row[f"monarch_{m}_error"] = mon["error"][-300:]
                m = 64
                mon = _onehost_run(monarch_python, "monarch", m, reps)
            row["monarch"] = dict(mon, ranks=m)
            nb = row["monarch_nb"]
            if "error" not in mon and "error" not in nb and m == n:
                for key in ("spawn_s", "call_all_median_s"):
                    row[f"ratio_{key}"] = nb[key] / mon[key]
            if "call_all_median_s" in mon:
                mon["call_per_rank_s"] = mon["call_all_median_s"] / m
        nb = row["monarch_nb"]
        if "call_all_median_s" in nb:
            nb["call_per_rank_s"] = nb["call_all_median_s"] / n
        rows.append(row)
        print(f"scale: onehost {n}: {json.dumps(row)[:400]}", file=sys.stderr, flush=True)
    return {"rows": rows, "reps": reps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=("hero", "grid", "onehost", "all"))
    ap.add_argument("--quick", action="store_true", help="small shapes (minutes on a 2-core machine)")
    ap.add_argument("--monarch-python", default="", help="a torchmonarch interpreter for the onehost comparison")
    ap.add_argument("--hero-preload", default="torch", help="what the hero run's zygotes import (default torch)")
    ap.add_argument("--hero-shape", default="", help="HOSTSxPROCS, e.g. 8x4 (default 16x8, --quick 4x2)")
    ap.add_argument("--grid-hosts", default="", help="comma-separated host counts (default 1,2,4,8,16)")
    ap.add_argument("--grid-ranks", default="", help="comma-separated ranks per host (default 1,8,32)")
    ap.add_argument("--onehost-ranks", default="", help="comma-separated (default 16,48,128)")
    ap.add_argument("--monarch-max", type=int, default=128, help="Monarch's largest mesh (memory: its procs do not share pages)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    parts = ("onehost", "grid", "hero") if a.part == "all" else (a.part,)
    if any(p in ("grid", "hero") for p in parts) and os.geteuid() != 0:
        raise SystemExit("the grid and hero parts make network namespaces: run as root")
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "mem_gib": _mem_gib()},
        "quick": a.quick,
    }
    for p in parts:
        print(f"scale: {p} ...", file=sys.stderr, flush=True)
        if p == "grid":
            result["grid"] = part_grid(a.quick, _ints(a.grid_hosts), _ints(a.grid_ranks))
        elif p == "hero":
            result["hero"] = part_hero(a.quick, a.hero_preload, a.hero_shape)
        else:
            result["onehost"] = part_onehost(a.quick, a.monarch_python, _ints(a.onehost_ranks), a.monarch_max)
    result["machine"]["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


def _ints(text: str) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] or None


def _mem_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = int(f.readline().split()[1])
    return round(kb / 2**20, 1)


if __name__ == "__main__":
    sys.exit(main())
