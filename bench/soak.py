"""Soak: an hour of mixed traffic on a persistent mesh, watching the allocator for growth and loss.

    python -m bench.soak [--minutes 60] [--out /tmp/soak-result.json]

Not run in CI. One allocator daemon under a private runtime directory, and at once:

* calls: a steady stream of broadcast ``echo`` calls to a persistent 2-proc mesh, each checked;
* floods: every 30 s one rank prints 10,000 numbered lines (~1 MB) while the calls go on; each
  flood's lines are then counted in the rank's log on disk;
* spawns and stops: every 20 s a short-lived mesh is spawned, called and stopped;
* a proc killed every minute: a persistent 1-proc mesh's proc gets SIGKILL while a call to it is
  in flight; the call must fail with a supervision error (not hang); the mesh is then respawned;
* kernel restarts: a real IPython kernel (jupyter_client) owns a persistent mesh; every 5 minutes
  it is restarted, re-attaches (``%mesh connect``) and runs a cell on the same procs whose printed
  line must reach the cell.

Every minute it prints the allocator's RSS, open fds and threads. At the end: lost replies (a
call with no answer, or a wrong one: must be 0), lost log lines (printed but not in the log on
disk: must be 0), and the rest, as JSON in ``--out`` and a table in ``--out`` with ``.md``.
Everything it started is stopped and its runtime directory removed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN_ENV = "MNB_SOAK_RUN"

from bench.run import _reap  # noqa: E402
from monarch_nb.actor import Actor, endpoint  # noqa: E402


class Soak(Actor):
    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def flood(self, tag: str, n: int) -> int:
        pad = "x" * 80
        for i in range(n):
            print(f"soak-flood {tag} {i:07d} {pad}")
        sys.stdout.flush()
        return n

    @endpoint
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: dict[str, int] = {}
        self.errors: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] = self.c.get(key, 0) + n

    def error(self, what: str) -> None:
        with self.lock:
            self.c["errors"] = self.c.get("errors", 0) + 1
            if len(self.errors) < 50:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {what}")
        print(f"soak: ERROR {what}", flush=True)


class LogCounter:
    """Counts each tag's lines in a rank's log on disk, reading only what was appended since.

    It keeps the file open: when the log rotates (``rank-N.jsonl`` becomes ``rank-N.jsonl.1``
    at half the per-rank cap), it reads the rest of the old file through its descriptor, then
    the new file from its start; every line is counted once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f: Any = None
        self.rest = b""
        self.counts: dict[str, int] = {}
        self.rotations = 0

    def read(self) -> None:
        if self.f is None:
            try:
                self.f = open(self.path, "rb")
            except FileNotFoundError:
                return
        while True:
            self._count(self.f.read())
            try:
                rotated = os.stat(self.path).st_ino != os.fstat(self.f.fileno()).st_ino
            except FileNotFoundError:
                rotated = False
            if not rotated:
                return
            self._count(self.f.read())  # what reached the old file after the first read
            self.f.close()
            self.f = open(self.path, "rb")
            self.rest = b""
            self.rotations += 1

    def _count(self, data: bytes) -> None:
        data = self.rest + data
        cut = data.rfind(b"\n") + 1
        self.rest = data[cut:]
        for line in data[:cut].split(b"\n"):
            i = line.find(b"soak-flood ")
            if i >= 0:
                tag = line[i + 11 :].split(b" ", 1)[0].decode()
                self.counts[tag] = self.counts.get(tag, 0) + 1


def _sample(pid: int) -> dict[str, Any]:
    import psutil

    p = psutil.Process(pid)
    return {
        "rss_mib": round(p.memory_info().rss / 2**20, 1),
        "fds": p.num_fds(),
        "threads": p.num_threads(),
        "children": len(p.children(recursive=True)),
    }


class KernelDriver:
    """A real IPython kernel through jupyter_client, restarted as a notebook user would."""

    def __init__(self, rdir: str, env: dict[str, str]) -> None:
        import jupyter_client

        self.km = jupyter_client.KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(rdir, "kernel"))
        self.km.connection_file = os.path.join(rdir, "kernel.json")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 120.0) -> tuple[str, str, str | None]:
        """(stdout, result, error) of one cell."""
        msg_id = self.kc.execute(code)
        out, result, error = [], "", None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "".join(out), result, f"no idle status within {timeout} s"
            try:
                m = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            t, c = m["msg_type"], m["content"]
            if t == "stream" and c["name"] == "stdout":
                out.append(c["text"])
            elif t == "execute_result":
                result = c["data"].get("text/plain", "")
            elif t == "error":
                error = f"{c['ename']}: {c['evalue']}"
            elif t == "status" and c["execution_state"] == "idle":
                return "".join(out), result, error

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=120)

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass


class SoakRun:
    def __init__(self, minutes: float, out: str, kernel_every: float = 300.0) -> None:
        self.minutes = minutes
        self.kernel_every = kernel_every
        self.out = out
        self.run_id = secrets.token_hex(4)
        self.rdir = tempfile.mkdtemp(prefix="mnb-soak-", dir="/tmp")
        os.chmod(self.rdir, 0o700)
        self.stats = Stats()
        self.stop = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.flood_expected: dict[str, int] = {}
        self.alloc_pid = 0
        self.log_dir = ""
        env = {
            "MONARCH_NB_RUNTIME_DIR": self.rdir,
            RUN_ENV: self.run_id,
            "JUPYTER_RUNTIME_DIR": os.path.join(self.rdir, "jupyter"),
            # the procs import this module (its actors) from the tree the run started from
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            # procs need no torch here: the zygote starts fast and takes less of a shared machine
            "MONARCH_NB_ZYGOTE_PRELOAD": "",
        }
        os.environ.update(env)
        self.env = dict(os.environ)

    # ------------------------------------------------------------ the parts
    def _start(self) -> None:
        import subprocess

        from monarch_nb._runtime.records import read_connection_files
        from monarch_nb.actor import _context, this_host

        self.alloc_log = open(os.path.join(self.rdir, "allocator.log"), "wb")
        self.alloc = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb", "allocator"], env=self.env, stdout=self.alloc_log, stderr=self.alloc_log
        )
        deadline = time.monotonic() + 60
        while not (infos := read_connection_files(self.rdir)):
            if time.monotonic() > deadline or self.alloc.poll() is not None:
                raise RuntimeError("the allocator did not start")
            time.sleep(0.1)
        self.alloc_pid = infos[0]["pid"]
        self.log_dir = infos[0]["log_dir"]
        # what the ranks print is counted, not written to this process's output
        client = _context.controller_client()
        client.log_writer = lambda mesh, lines: self.stats.add("log_lines_streamed", len(lines))
        # the killed procs are expected failures: counted, not the script's end
        import monarch_nb.actor

        monarch_nb.actor.unhandled_fault_hook = lambda failure: self.stats.add("mesh_failures_reported")
        self.hosts = this_host()
        self.main = self.hosts.spawn_procs(per_host={"gpus": 2}, name="soak-main", persist=True)
        self.actor = self.main.spawn("soak", Soak)
        self.actor.echo.call(0).get(timeout=120)
        self.counter = LogCounter(os.path.join(self.log_dir, "soak-main", "rank-0.jsonl"))
        self._spawn_victim()

    def _spawn_victim(self) -> None:
        self.victim = self.hosts.spawn_procs(per_host={"gpus": 1}, name="soak-victim", persist=True)
        self.vactor = self.victim.spawn("v", Soak)
        self.vpid = self.vactor.pid.call_one().get(timeout=120)

    def _loop(self, name: str, every: float, fn: Any) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            try:
                fn()
            except Exception as e:
                self.stats.error(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
            next_at += every
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def calls(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                vals = self.actor.echo.call(i).get(timeout=60)
                got = [v for _, v in vals.items()]
                if got != [i, i]:
                    self.stats.add("lost_replies")
                    self.stats.error(f"call {i}: wrong answer {got!r}")
                else:
                    self.stats.add("calls")
            except TimeoutError:
                self.stats.add("lost_replies")
                self.stats.error(f"call {i}: no answer within 60 s")
            except Exception as e:
                self.stats.add("call_errors")
                self.stats.error(f"call {i}: {type(e).__name__}: {e}")
            self.stop.wait(0.02)  # a steady rate, not a busy loop on a shared machine

    def flood(self) -> None:
        tag = f"f{len(self.flood_expected):04d}"
        n = 10_000
        self.flood_expected[tag] = n
        self.actor.slice(gpus=0).flood.call_one(tag, n).get(timeout=120)
        self.stats.add("floods")
        self.stats.add("log_lines_printed", n)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.counter.read()
            if self.counter.counts.get(tag, 0) >= n:
                return
            time.sleep(0.2)
        self.stats.error(f"flood {tag}: {self.counter.counts.get(tag, 0)} of {n} lines on disk after 60 s")

    def churn(self) -> None:
        k = self.stats.c.get("spawns", 0)
        pm = self.hosts.spawn_procs(per_host={"gpus": 1}, name=f"soak-churn-{k}")
        a = pm.spawn("c", Soak)
        if a.echo.call_one(k).get(timeout=60) != k:
            self.stats.add("lost_replies")
            self.stats.error(f"churn {k}: wrong answer")
        pm.stop().get(timeout=60)
        self.stats.add("spawns")

    def kill(self) -> None:
        from monarch_nb.errors import SupervisionError

        fut = self.vactor.nap.call_one(60)
        time.sleep(0.5)  # let the call reach the actor: the kill must catch it in flight
        os.kill(self.vpid, signal.SIGKILL)
        self.stats.add("kills")
        try:
            fut.get(timeout=30)
            self.stats.error("killed proc: its call returned")
        except TimeoutError:
            self.stats.add("lost_replies")
            self.stats.error("killed proc: its call got no answer within 30 s")
        except (SupervisionError, Exception) as e:  # what a user sees: a supervision failure
            self.stats.add("kill_failures_reported")
            if not isinstance(e, SupervisionError) and "SupervisionError" not in type(e).__name__:
                self.stats.error(f"killed proc: unexpected {type(e).__name__}: {e}")
        self.victim.stop().get(timeout=60)
        self._spawn_victim()

    def kernel(self) -> None:
        if not hasattr(self, "kdriver"):
            self.kdriver = KernelDriver(self.rdir, self.env)
            for cell in ("%load_ext monarch_nb", "%mesh connect", "%mesh spawn soak_kernel --per-host gpus=1"):
                _, _, err = self.kdriver.run(cell)
                if err:
                    raise RuntimeError(f"kernel cell {cell!r}: {err}")
            out, self.kpid, err = self.kdriver.run("%%mesh exec soak_kernel\nimport os\nos.getpid()")
            if err:
                raise RuntimeError(f"kernel exec: {err}")
            return
        self.kdriver.restart()
        self.stats.add("kernel_restarts")
        for cell in ("%load_ext monarch_nb", "%mesh connect"):
            _, _, err = self.kdriver.run(cell)
            if err:
                raise RuntimeError(f"kernel cell {cell!r} after a restart: {err}")
        marker = f"soak-after-restart-{self.stats.c['kernel_restarts']}"
        out, pid, err = self.kdriver.run(f"%%mesh exec soak_kernel\nprint({marker!r}, flush=True)\nos.getpid()")
        if err or pid != self.kpid or marker not in out:
            self.stats.add("kernel_failures")
            self.stats.error(f"kernel restart: err={err} pid={pid!r} (was {self.kpid!r}) printed={out[-200:]!r}")

    # ------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._start()
        print(f"soak: allocator pid {self.alloc_pid}, runtime dir {self.rdir}, {self.minutes} min", flush=True)
        self.samples.append({"t_min": 0.0, **_sample(self.alloc_pid)})
        threads = [
            threading.Thread(target=self.calls, name="calls", daemon=True),
            threading.Thread(target=self._loop, args=("flood", 30.0, self.flood), name="flood", daemon=True),
            threading.Thread(target=self._loop, args=("churn", 20.0, self.churn), name="churn", daemon=True),
            threading.Thread(target=self._loop, args=("kill", 60.0, self.kill), name="kill", daemon=True),
            threading.Thread(target=self._loop, args=("kernel", self.kernel_every, self.kernel), name="kernel", daemon=True),
        ]
        for t in threads:
            t.start()
        end = t0 + self.minutes * 60
        next_sample = t0 + 60
        while time.monotonic() < end:
            time.sleep(max(0.0, min(next_sample, end) - time.monotonic()))
            if time.monotonic() >= next_sample:
                s = {"t_min": round((time.monotonic() - t0) / 60, 1), **_sample(self.alloc_pid)}
                self.samples.append(s)
                with self.stats.lock:
                    c = dict(self.stats.c)
                print(f"soak: {json.dumps(s)} {json.dumps(c)}", flush=True)
                next_sample += 60
        self.stop.set()
        for t in threads:
            t.join(180)
        self.samples.append({"t_min": round((time.monotonic() - t0) / 60, 1), **_sample(self.alloc_pid)})
        # the lines of every flood, counted in the log on disk (across its rotation; the run
        # stays under the per-rank cap, so nothing is deleted by it)
        self.counter.read()
        on_disk = {t: self.counter.counts.get(t, 0) for t in self.flood_expected}
        lost_lines = sum(max(0, n - on_disk[t]) for t, n in self.flood_expected.items())
        with self.stats.lock:
            c = dict(self.stats.c)
        first, last = self.samples[1] if len(self.samples) > 1 else self.samples[0], self.samples[-1]
        return {
            "started_utc": started,
            "minutes": round((time.monotonic() - t0) / 60, 1),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "calls": c.get("calls", 0),
            "lost_replies": c.get("lost_replies", 0),
            "call_errors": c.get("call_errors", 0),
            "floods": c.get("floods", 0),
            "log_lines_printed": sum(self.flood_expected.values()),
            "log_lines_on_disk": sum(on_disk.values()),
            "log_rotations_seen": self.counter.rotations,
            "lost_log_lines": lost_lines,
            "log_lines_streamed_to_controller": c.get("log_lines_streamed", 0),
            "spawns_and_stops": c.get("spawns", 0),
            "procs_killed": c.get("kills", 0),
            "kills_reported_as_failures": c.get("kill_failures_reported", 0),
            "mesh_failures_reported": c.get("mesh_failures_reported", 0),
            "kernel_restarts": c.get("kernel_restarts", 0),
            "kernel_failures": c.get("kernel_failures", 0),
            "errors": c.get("errors", 0),
            "first_errors": self.stats.errors,
            "allocator": {
                "rss_mib_after_1_min": first["rss_mib"],
                "rss_mib_end": last["rss_mib"],
                "rss_mib_max": max(s["rss_mib"] for s in self.samples),
                "fds_after_1_min": first["fds"],
                "fds_end": last["fds"],
                "fds_max": max(s["fds"] for s in self.samples),
                "threads_end": last["threads"],
                "threads_max": max(s["threads"] for s in self.samples),
            },
            "samples": self.samples,
        }

    def cleanup(self) -> None:
        self.stop.set()
        for t in threading.enumerate():
            if t.name in ("calls", "flood", "churn", "kill", "kernel"):
                t.join(60)
        if hasattr(self, "kdriver"):
            self.kdriver.close()
        try:
            for pm in (getattr(self, "main", None), getattr(self, "victim", None)):
                if pm is not None:
                    pm.stop().get(timeout=30)
        except Exception:
            pass
        alloc = getattr(self, "alloc", None)
        if alloc is not None and alloc.poll() is None:
            alloc.terminate()
            try:
                alloc.wait(30)
            except Exception:
                alloc.kill()
        killed = _reap(self.run_id, RUN_ENV)
        if killed:
            print(f"soak: killed {len(killed)} leftover processes", flush=True)
        shutil.rmtree(self.rdir, ignore_errors=True)


def _table(r: dict[str, Any]) -> str:
    a = r["allocator"]
    rows = [
        ("duration (min)", r["minutes"]),
        ("calls answered", r["calls"]),
        ("lost replies (must be 0)", r["lost_replies"]),
        ("lost log lines on disk (must be 0)", f"{r['lost_log_lines']} of {r['log_lines_printed']}"),
        (
            "floods / spawns+stops / procs killed / kernel restarts",
            f"{r['floods']} / {r['spawns_and_stops']} / {r['procs_killed']} / {r['kernel_restarts']}",
        ),
        ("allocator RSS MiB (1 min / end / max)", f"{a['rss_mib_after_1_min']} / {a['rss_mib_end']} / {a['rss_mib_max']}"),
        ("allocator open fds (1 min / end / max)", f"{a['fds_after_1_min']} / {a['fds_end']} / {a['fds_max']}"),
        ("allocator threads (end / max)", f"{a['threads_end']} / {a['threads_max']}"),
        ("errors", r["errors"]),
    ]
    return "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--out", default="/tmp/soak-result.json", help="the result (JSON; a table beside it in .md)")
    ap.add_argument("--kernel-every", type=float, default=300.0, help="seconds between kernel restarts")
    args = ap.parse_args()
    soak = SoakRun(args.minutes, args.out, args.kernel_every)
    result: dict[str, Any] = {}
    try:
        result = soak.run()
    except BaseException as e:
        result = {"crashed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "errors_so_far": soak.stats.errors}
        raise
    finally:
        soak.cleanup()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if "allocator" in result:
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(_table(result))
            print(_table(result), flush=True)
        print(f"soak: result in {args.out}", flush=True)
    ok = result.get("lost_replies") == 0 and result.get("lost_log_lines") == 0
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
