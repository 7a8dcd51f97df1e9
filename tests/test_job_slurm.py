"""SlurmJob against a real Slurm 22.05 cluster (Debian's munged, slurmctld and slurmd on network
namespace hosts: tests/_slurm.py), one cluster for the module.

The controller runs on "ctl" (the login node, where slurmctld runs too); n1..n3 are the nodes.
Allocators announce themselves in the job's directory (on the shared directory, as ``log_dir``
must be on a real cluster); squeue is read only for the job's state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

sys.path.insert(0, str(Path(__file__).parent))
from _jobhelp import PY, KeyWatch, run_controller
from _slurm import SlurmCluster

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    c = SlurmCluster(3)
    try:
        c.assert_alive()
        yield c
        c.assert_alive()
    finally:
        c.close()


@pytest.fixture(autouse=True)
def _queue_emptied(slurm: SlurmCluster) -> Iterator[None]:
    """A test that failed midway leaves its jobs in the module's one cluster (a "hog" holding
    every node, or a job its controller never cancelled): every later test would queue behind
    them and fail too (seen in session 31's CI: six failures after one)."""
    yield
    if slurm.squeue().strip():
        assert slurm.net is not None
        slurm.net.run(0, ["scancel", "--user", "root"], env=slurm.env(), check=False)
        wait_for(lambda: not slurm.squeue().strip(), 60, "the jobs a test left to be cancelled")


def _env(c: SlurmCluster) -> dict[str, str]:
    return c.env(
        MONARCH_NB_RUNTIME_DIR="/tmp/mnb",
        MONARCH_NB_ZYGOTE_PRELOAD="",
        MONARCH_NB_HEARTBEAT_INTERVAL="0.2",
        MONARCH_NB_HEARTBEAT_TIMEOUT="1.5",
    )


_HEAD = """
import contextlib, io, json, os, socket, sys
from monarch_nb.actor import Actor, ProcMesh, endpoint
from monarch_nb.job import JobError, SlurmJob

class Where(Actor):
    @endpoint
    def where(self):
        return socket.gethostname(), os.getpid()

def out(**kw):
    print(json.dumps(kw), flush=True)

LOG_DIR = {log_dir!r}
PY = {py!r}
"""


def _code(c: SlurmCluster, body: str, **fmt: object) -> str:
    return textwrap.dedent(_HEAD).format(log_dir=os.path.join(c.shared, "jobs"), py=PY) + textwrap.dedent(body).format(**fmt)


def _ours_on(c: SlurmCluster, i: int) -> list[str]:
    """Command lines of monarch_nb processes on host i."""
    assert c.net is not None
    key = os.stat(f"/run/netns/{c.net.netns(i)}")
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{e}/ns/net")
            if (st.st_dev, st.st_ino) != (key.st_dev, key.st_ino):
                continue
            cmd = Path(f"/proc/{e}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "monarch_nb" in cmd and state != "Z":
            out.append(cmd)
    return out


def test_trainers_on_three_nodes_reattach_and_kill(slurm: SlurmCluster) -> None:
    with KeyWatch() as watch:
        first = run_controller(
            slurm.net,
            slurm.shared,
            _code(
                slurm,
                """
                job = SlurmJob(meshes={{"trainers": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
                state = job.state(cached_path="/tmp/job.json")
                procs = state.trainers.spawn_procs(per_host={{"gpus": 2}}, name="train", persist=True)
                got = procs.spawn("w", Where).where.call().get()
                out(job_id=job.job_id, extent=str(procs.extent), where=sorted(got.values()),
                    dir=job._dir, hosts=[h.host for h in state.trainers._refs()])
                os._exit(0)  # the kernel dies: no kill(), no goodbye
                """,
            ),
            _env(slurm),
        )[0]
        assert first["extent"] == "{hosts: 3, gpus: 2}"
        assert first["hosts"] == ["n1", "n2", "n3"]
        assert sorted({h for h, _ in first["where"]}) == ["n1", "n2", "n3"] and len(first["where"]) == 6
        slurm.assert_alive()
        assert f"{first['job_id']} " in slurm.squeue() or f" {first['job_id']} " in slurm.squeue()
        key = bytes.fromhex(Path(first["dir"], "key").read_text().strip())
        assert Path(first["dir"], "key").stat().st_mode & 0o777 == 0o600

        second = run_controller(
            slurm.net,
            slurm.shared,
            _code(
                slurm,
                """
                job = SlurmJob(meshes={{"trainers": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
                state = job.state(cached_path="/tmp/job.json")
                procs = ProcMesh.lookup("train", state.trainers)
                got = procs.actor_mesh("w").where.call().get()
                out(job_id=job._running.job_id, where=sorted(got.values()))
                job.kill()
                out(killed=True, cache=os.path.exists("/tmp/job.json"))
                """,
            ),
            _env(slurm),
        )
    assert second[0] == {"job_id": first["job_id"], "where": first["where"]}
    assert second[1] == {"killed": True, "cache": False}
    for i in (1, 2, 3):
        wait_for(lambda i=i: not _ours_on(slurm, i), 20, f"node n{i} to have no monarch_nb process")
    assert not os.path.exists(first["dir"])
    slurm.assert_alive()
    assert watch.scans > 10
    assert watch.leaks(key) == []


def test_pending_job_shows_its_reason_and_honours_job_start_timeout(slurm: SlurmCluster) -> None:
    res = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            hog = SlurmJob(meshes={{"all": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_name="hog")
            hog.apply()
            err = io.StringIO()
            late = SlurmJob(meshes={{"one": 1}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_name="late",
                            job_start_timeout=2)
            import threading
            try:
                with contextlib.redirect_stderr(err):
                    late.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e), stderr=err.getvalue(), late=late.job_id)
            # Ctrl-C in the cell while it waits: the job leaves the queue, and the cell says so
            import _thread, subprocess
            class Interrupting(io.StringIO):
                def write(self, s):
                    n = super().write(s)
                    if "pending:" in s:
                        _thread.interrupt_main()
                    return n
            cell = Interrupting()
            stopped = SlurmJob(meshes={{"one": 1}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_name="stopped")
            try:
                with contextlib.redirect_stderr(cell):
                    stopped.state(cached_path=None)
                out(interrupted=False)
            except KeyboardInterrupt:
                queue = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
                out(interrupted=True, cell=cell.getvalue(), queued=queue)
            # the default: no deadline. The reason shows in the cell while the job is still queued;
            # the nodes are freed only once it showed, and the job then starts
            shown = threading.Event()
            class Cell(io.StringIO):
                def write(self, s):
                    if "pending: Resources" in s or "pending: Priority" in s:
                        shown.set()
                    return super().write(s)
            def free_nodes():
                shown.wait(60)
                hog.kill()
            threading.Thread(target=free_nodes).start()
            cell = Cell()
            waited = SlurmJob(meshes={{"one": 1}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_name="waited")
            try:
                with contextlib.redirect_stderr(cell):
                    state = waited.state(cached_path=None)
                out(started=len(state.one.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where).where.call().get()),
                    cell=cell.getvalue(), shown_before_start=shown.is_set())
            finally:
                waited.kill()
                hog.kill()
            """,
        ),
        _env(slurm),
    )
    res, stopped, waited = res
    assert res["error"] and "did not start within job_start_timeout=2 s" in res["error"], res
    assert stopped["interrupted"] and "stopped" not in stopped["queued"], stopped
    assert "(waiting for it to start; interrupt to cancel it)" in stopped["cell"], stopped
    assert re.search(r"Slurm job \d+ cancelled: interrupted before it started", stopped["cell"]), stopped
    assert "pending: Resources" in res["stderr"] or "pending: Priority" in res["stderr"], res
    assert "PENDING" in res["error"]
    assert waited["started"] == 1 and waited["shown_before_start"], waited
    assert "pending: Resources" in waited["cell"] or "pending: Priority" in waited["cell"], waited
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def test_a_slurmctld_restart_keeps_the_job_its_cache_and_its_procs(slurm: SlurmCluster) -> None:
    # while slurmctld is down, 22.05's `squeue --json` exits 0 with an error and no jobs: that read
    # as "job gone", so %mesh launch dropped the running job's cache and submitted another, and
    # the job ran on unknown to monarch_nb (no %mesh jobs row, nothing to kill)
    launch = """
            from monarch_nb.job import launch
            state = launch("slurm", "ctldjob", 2, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
            """
    first = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            launch
            + """
            procs = state.ctldjob.spawn_procs(per_host={{"gpus": 1}}, name="ctld", persist=True)
            out(where=sorted(procs.spawn("w", Where).where.call().get().values()))
            """,
        ),
        _env(slurm),
    )[0]
    slurm.stop_slurmctld()
    try:
        down = run_controller(
            slurm.net,
            slurm.shared,
            _code(
                slurm,
                """
                from monarch_nb.job import launch, list_jobs as jobs, named_job_path
                try:
                    launch("slurm", "ctldjob", 2, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
                    out(error=None)
                except JobError as e:
                    out(error=str(e))
                out(cached=os.path.exists(named_job_path("ctldjob")), rows=[r["state"] for r in jobs() if r["name"] == "ctldjob"])
                """,
            ),
            _env(slurm),
        )
    finally:
        slurm.start_slurmctld()
    assert down[0]["error"] and "squeue could not tell the state of Slurm job" in down[0]["error"], down
    assert "is slurmctld up?" in down[0]["error"], down
    assert down[1]["cached"] and len(down[1]["rows"]) == 1 and "is slurmctld up?" in down[1]["rows"][0], down
    assert slurm.squeue().count(" R ") == 1, slurm.squeue()  # no second job was submitted
    back = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            launch
            + """
            from monarch_nb.job import kill_job as kill, list_jobs as jobs
            procs = ProcMesh.lookup("ctld", state.ctldjob)
            row = [r for r in jobs() if r["name"] == "ctldjob"][0]
            out(where=sorted(procs.actor_mesh("w").where.call().get().values()), state=row["state"], lost=row["lost"])
            kill("ctldjob")
            """,
        ),
        _env(slurm),
    )[0]
    # the same procs on the same job; right after the restart Slurm shows the nodes "unknown"
    # until their slurmd register, which is not lost
    assert back["where"] == first["where"], (first, back)
    assert back["state"] == "RUNNING" and back["lost"] == [], back
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def test_nodes_that_never_announce_fail_the_job_with_their_names(slurm: SlurmCluster) -> None:
    fake = Path(slurm.shared, "not-python")
    fake.write_text("#!/bin/sh\nexec sleep 600\n")  # starts, never announces
    fake.chmod(0o755)
    res = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            job = SlurmJob(meshes={{"a": 2}}, python_exe={fake!r}, log_dir=LOG_DIR, exclusive=False, announce_timeout=2)
            try:
                job.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e), job_id=job.job_id)
            """,
            fake=str(fake),
        ),
        _env(slurm),
    )[0]
    assert res["error"] and "node(s) n1, n2 did not announce themselves within 2 s" in res["error"], res
    # the failed job was cancelled, not left holding the nodes
    wait_for(lambda: not slurm.squeue().strip(), 30, "the failed job to leave the queue")


def test_walltime_ends_the_allocators_and_the_notebook_is_told(slurm: SlurmCluster) -> None:
    # time_limit is one minute (Slurm's granularity); slurmctld enforces it up to ~30 s late
    res = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            import time
            import monarch_nb.actor as public
            failures = []
            public.unhandled_fault_hook = lambda f: failures.append(f.report())
            job = SlurmJob(meshes={{"t": 2}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False,
                           time_limit="1", job_name="short")
            state = job.state(cached_path=None)
            w = state.t.spawn_procs(per_host={{"gpus": 1}}, name="short").spawn("w", Where)
            out(before=sorted(h for h, _ in w.where.call().get().values()), job_id=job.job_id)
            deadline = time.time() + 150
            info = job.query()
            while info is not None and info.state == "RUNNING" and time.time() < deadline:
                time.sleep(0.5)  # polling the scheduler until the walltime passes
                info = job.query()
            out(state=info.state if info else None, reason=info.reason if info else None)
            # COMPLETING comes before slurmd has signalled the step (a call made at once, on a
            # loaded machine, was still answered): wait until Slurm has ended it
            while info is not None and info.state == "COMPLETING" and time.time() < deadline:
                time.sleep(0.5)
                info = job.query()
            try:
                w.where.call().get(timeout=30)
                out(call=None)
            except Exception as e:
                out(call=f"{{type(e).__name__}}: {{e}}")
            try:
                job.state(cached_path=None)
                out(state_error=None)
            except JobError as e:
                out(state_error=str(e))
            out(failures=failures)
            job.kill()
            """,
        ),
        _env(slurm),
        timeout=240,
    )
    assert res[0]["before"] == ["n1", "n2"]
    # 22.05 shows COMPLETING while the step is torn down, then TIMEOUT; the reason is TimeLimit
    assert res[1]["state"] in ("COMPLETING", "TIMEOUT") and res[1]["reason"] == "TimeLimit", res
    # Slurm SIGTERMs every process of the step: the allocators (their controllers hear so) and
    # the procs, whose own deaths the zygote (which outlives the signal) may report first; an
    # allocator that missed it goes silent
    call = res[2]["call"]
    assert call and call.startswith("SupervisionError"), res
    assert any(w in call for w in ("was shut down (SIGTERM", "was killed by SIGTERM", "lost")), res
    err = res[3]["state_error"]
    assert "TimeLimit: its time_limit ran out): its allocators are gone" in err and f"Slurm job {res[0]['job_id']} is" in err, res
    assert res[4]["failures"] and "failed" in res[4]["failures"][0], res
    for i in (1, 2, 3):
        wait_for(lambda i=i: not _ours_on(slurm, i), 20, f"node n{i} to have no monarch_nb process")


def test_batch_mode_runs_the_client_inside_the_allocation(slurm: SlurmCluster) -> None:
    result = Path(slurm.shared, "jobs", "batch-result.json")
    client = Path(slurm.shared, "client.py")
    client.write_text(
        textwrap.dedent(_HEAD).format(log_dir=os.path.join(slurm.shared, "jobs"), py=PY)
        + textwrap.dedent(
            f"""
            job = SlurmJob(meshes={{"trainers": 2}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
            state = job.state()
            got = state.trainers.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where).where.call().get()
            # written whole, then renamed: the test reads it as soon as the name exists
            with open({str(result)!r} + ".tmp", "w") as f:
                json.dump({{"where": sorted(h for h, _ in got.values()), "job": os.environ["SLURM_JOB_ID"],
                           "me": socket.gethostname()}}, f)
            os.replace({str(result)!r} + ".tmp", {str(result)!r})
            job.kill()  # inside its own allocation: a no-op, the job ends with this script
            """
        )
    )
    res = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            job = SlurmJob(meshes={{"trainers": 2}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
            job.apply(client_script={client!r})
            out(job_id=job.job_id)
            """,
            client=str(client),
        ),
        _env(slurm),
    )[0]
    wait_for(result.exists, 90, f"the batch client's result ({slurm.logs()})")
    got = json.loads(result.read_text())
    assert got["where"] == ["n1", "n2"] and got["job"] == res["job_id"] and got["me"] == "n1", got
    # the job ended with its client: allocators gone, queue empty
    wait_for(lambda: not slurm.squeue().strip(), 60, "the batch job to end")
    for i in (1, 2, 3):
        wait_for(lambda i=i: not _ours_on(slurm, i), 20, f"node n{i} to have no monarch_nb process")


def test_a_node_whose_link_goes_down_fails_its_calls_by_name(slurm: SlurmCluster) -> None:
    assert slurm.net is not None
    ready = Path(slurm.shared, "jobs", "link-ready")
    go = Path(slurm.shared, "jobs", "link-go")
    script = _code(
        slurm,
        """
        import time
        import monarch_nb.actor as public
        failures = []
        public.unhandled_fault_hook = lambda f: failures.append(f.report())
        job = SlurmJob(meshes={{"t": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False, job_name="link")
        state = job.state(cached_path=None)
        w = state.t.spawn_procs(per_host={{"gpus": 1}}, name="link").spawn("w", Where)
        w.where.call().get()
        open({ready!r}, "w").close()
        while not os.path.exists({go!r}):
            time.sleep(0.05)  # the test pulls n2's cable, then says go
        t0 = time.monotonic()
        try:
            w.where.call().get(timeout=30)
            out(call=None)
        except Exception as e:
            out(call=f"{{type(e).__name__}}: {{e}}", after=time.monotonic() - t0)
        row = job.describe()  # the job tables' row (%mesh jobs, the sidebar, the dashboard)
        out(failures=failures, lost=row["lost"], state=row["state"], addrs=len(row["addrs"]))
        while os.path.exists({go!r}):
            time.sleep(0.05)  # the cable is back
        job.kill()
        out(killed=True)
        """,
        ready=str(ready),
        go=str(go),
    )
    path = Path(slurm.shared, "link.py")
    path.write_text(script)
    proc = slurm.net.popen(0, [PY, str(path)], env=_env(slurm), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 90, "the job to run")
        assert proc.poll() is None, proc.communicate()
        slurm.net.link_down(2)  # n2
        go.touch()
        lines: list[dict] = []
        while len(lines) < 2:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.communicate()
            if line.startswith(b"{"):
                lines.append(json.loads(line))
        slurm.net.link_up(2)
        go.unlink()
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (ready, go):
            if f.exists():
                f.unlink()
    call = lines[0]
    n2 = slurm.net.ip(2)
    assert call["call"].startswith("SupervisionError") and f"allocator tcp://{n2}:" in call["call"] and "lost" in call["call"]
    assert call["after"] < 10, call  # heartbeats, not Slurm's SlurmdTimeout, notice it
    # the job's row names the lost node, and the sidebar asks only the two that answer
    row = lines[1]
    assert row["lost"] == ["n2"] and "lost: n2" in row["state"] and row["addrs"] == 2, row
    # its liveness probe is a CurveZMQ handshake: the allocators log no refused connection for it
    errs = list(Path(slurm.shared, "jobs").glob("slurm_*_link.err"))
    assert errs and not [f for f in errs if "security handshake" in f.read_text()], errs
    assert b'"killed": true' in out


def test_spawning_on_the_hosts_of_a_job_scancelled_from_outside_names_the_job(slurm: SlurmCluster) -> None:
    # scancel from a shell: the allocators, shutting down, still forked the procs of a spawn that
    # arrived meanwhile, and spawn_procs returned a mesh whose procs were gone a moment later
    # ("allocator ... lost: no heartbeat"), the job unnamed
    res = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            import subprocess
            import monarch_nb.actor as public
            from monarch_nb.errors import ConnectError, SpawnError
            public.unhandled_fault_hook = lambda f: None  # the scancel fails the first mesh: expected
            import signal, threading

            class Slow(Where):
                def __cleanup__(self, exc):
                    threading.Event().wait(30)  # holds the allocator's shutdown for stop_cleanup_timeout

            def keep_on_sigterm():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the allocator stops this proc

            job = SlurmJob(meshes={{"t": 2}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False, job_name="sc")
            state = job.state(cached_path=None)
            w = state.t.spawn_procs(per_host={{"gpus": 1}}, bootstrap=keep_on_sigterm).spawn("w", Slow)
            w.where.call().get()
            subprocess.run(["scancel", job.job_id], check=True)
            import time
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    w.where.call().get(timeout=30)  # fails once the allocators say they shut down
                except Exception as e:
                    out(call=str(e))
                    break
                time.sleep(0.05)  # polling: the step's SIGTERM reaches the allocators soon after scancel
            try:
                state.t.spawn_procs(per_host={{"gpus": 1}})
                out(spawn=None)
            except (ConnectError, SpawnError) as e:
                out(spawn=str(e))
            try:
                job.state(cached_path=None)
            except JobError as e:
                out(state=str(e))
            job.kill()
            out(job_id=job._slurm_job_id)
            """,
        ),
        _env(slurm),
    )
    assert "was shut down (SIGTERM" in res[0]["call"], res
    spawn = res[1]["spawn"]
    assert spawn and spawn.startswith("cannot spawn procs on these hosts: SlurmJob "), res
    assert "its allocators are gone; kill() it and apply it again (job.state()" in spawn, res
    assert "its allocators are gone; kill() it and apply again" in res[2]["state"], res
    assert res[3] == {"job_id": None}, res
    for i in (1, 2, 3):
        wait_for(lambda i=i: not _ours_on(slurm, i), 20, f"node n{i} to have no monarch_nb process")
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def test_a_job_slurm_requeued_is_replaced_saying_so_with_both_ids(slurm: SlurmCluster) -> None:
    # a node failure requeues the job (scontrol requeue does the same, at once): its allocators
    # are killed and it waits to run its batch script again. state() replaced it saying only
    # "it cannot run this spec (it is no longer running)": not that Slurm requeued it, nor the
    # new job's id, nor that the procs must be spawned again
    (res,) = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            import subprocess, time, warnings
            import monarch_nb.actor as public
            from monarch_nb.job import JobReplacedWarning
            public.unhandled_fault_hook = lambda f: None  # the requeue fails the mesh: expected

            def make():
                return SlurmJob(meshes={{"t": 2}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False, job_name="rq")

            job = make()
            job.state(cached_path="/tmp/rq.json").t.spawn_procs(per_host={{"gpus": 1}}, name="rq")
            old = job.job_id
            subprocess.run(["scontrol", "requeue", old], check=True)
            deadline = time.monotonic() + 60
            while job.query().state != "PENDING":
                assert time.monotonic() < deadline, job.query()
                time.sleep(0.2)  # polling the scheduler: it has no way to wait
            again = make()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                again.state(cached_path="/tmp/rq.json")
            out(old=old, new=again.job_id, said=[str(w.message) for w in said if w.category is JobReplacedWarning])
            again.kill()
            """,
        ),
        _env(slurm),
    )
    old, new = res["old"], res["new"]
    assert new and new != old, res
    (said,) = res["said"]
    assert said.startswith(f"Slurm requeued job {old} (restart 1, now PENDING"), said
    assert "a node of it failed (or someone ran `scontrol requeue`); its allocators and every proc on n" in said, said
    assert (
        f"the job cached at /tmp/rq.json was cancelled and job {new} submitted in its place. Spawn your proc meshes again" in said
    )
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def test_a_kernel_killed_while_its_job_is_queued_leaves_a_job_the_next_one_finds(slurm: SlurmCluster) -> None:
    (res,) = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            import subprocess
            from monarch_nb.job import kill_job, launch, list_jobs
            hog = SlurmJob(meshes={{"all": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_name="hog")
            hog.apply()
            try:
                LATE = "from monarch_nb.job import launch; launch('slurm', 'late', 1, python_exe=%r, log_dir=%r, monarch_port=0)"
                kernel = subprocess.Popen([sys.executable, "-c", LATE % (PY, LOG_DIR)], stderr=subprocess.PIPE, text=True)
                said = kernel.stderr.readline()
                kernel.kill()  # a kernel restart or the OOM killer while its job waits in the queue
                kernel.wait()
                queued = [(r["name"], r["id"], r["state"]) for r in list_jobs()]
            finally:
                hog.kill()
            state = launch("slurm", "late", 1, python_exe=PY, log_dir=LOG_DIR, monarch_port=0)
            answered = len(state.late.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where).where.call().get())
            after = [(r["name"], r["id"], r["state"]) for r in list_jobs()]
            kill_job("late")
            out(said=said, queued=queued, after=after, answered=answered)
            """,
        ),
        _env(slurm),
    )
    assert "pending: " in res["said"], res
    job_id = re.search(r"Slurm job (\d+) pending", res["said"]).group(1)  # type: ignore[union-attr]
    # the killed kernel's job is known (not queued unseen), and the next launch waits for it
    assert len(res["queued"]) == 1 and res["queued"][0][:2] == ["late", job_id] and "PENDING" in res["queued"][0][2], res
    assert res["after"] == [["late", job_id, "RUNNING"]] and res["answered"] == 1, res
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def test_kill_stops_the_allocator_of_a_node_whose_slurmd_died(slurm: SlurmCluster) -> None:
    # Slurm marks the node down after SlurmdTimeout (30 s) and cannot signal its step there:
    # scancel leaves that allocator and its procs running
    code = _code(
        slurm,
        """
        import subprocess, time
        import monarch_nb.actor
        monarch_nb.actor.unhandled_fault_hook = lambda failure: None  # Slurm requeues the job: its meshes fail
        job = SlurmJob(meshes={{"all": 3}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0)
        state = job.state(cached_path=None)
        pids = state.all.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where).where.call().get()
        out(ready=True)
        sys.stdin.readline()  # the test kills n3's slurmd
        deadline = time.monotonic() + 90
        while "down" not in subprocess.run(["sinfo", "-h", "-n", "n3", "-o", "%T"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "n3 never went down"
            time.sleep(0.5)  # polling the scheduler: it has no way to wait
        job.kill()
        out(killed=True)
        """,
    )
    path = os.path.join(slurm.shared, "kill-down.py")
    Path(path).write_text(code)
    assert slurm.net is not None
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    ctl = slurm.net.popen(0, [PY, path], env=_env(slurm), text=True, **pipes)
    try:
        assert ctl.stdout is not None and json.loads(ctl.stdout.readline()) == {"ready": True}
        assert _ours_on(slurm, 3)
        slurm.kill_slurmd("n3")
        out, err = ctl.communicate("go\n", timeout=150)
        assert ctl.returncode == 0 and '"killed": true' in out, err[-3000:]
        wait_for(lambda: _ours_on(slurm, 3) == [], 30, "n3's allocator and procs to exit")
    finally:
        if ctl.poll() is None:
            ctl.kill()
        if "slurmd-n3" not in slurm.daemons:
            slurm.start_slurmd("n3")


def test_a_job_larger_than_its_partition_says_it_may_never_start(slurm: SlurmCluster) -> None:
    (res,) = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            job = SlurmJob(meshes={{"all": 4}}, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, job_start_timeout=10)
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    job.state(cached_path=None)
            except JobError as e:
                out(error=str(e), cell=err.getvalue())
            """,
        ),
        _env(slurm),
    )
    # Slurm (EnforcePartLimits=NO, its default) queues it for good: the cell says why, and what to do
    assert "pending: PartitionNodeLimit: more nodes than the partition allows or has up; it may never start" in res["cell"], res
    assert "ask for fewer nodes or another partition" in res["cell"]
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")


def _cli(c: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    assert c.net is not None
    return c.net.run(0, [PY, "-m", "monarch_nb", *args], capture_output=True, text=True, env=_env(c), timeout=60)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_the_cli_lists_logs_and_stops_a_mesh_of_the_job_from_another_process(slurm: SlurmCluster) -> None:
    """`monarch-nb status/logs/stop` on the login node find a mesh on the job's allocators: they
    answer with their own addresses (an ipc socket in their node's /tmp), not the ones asked."""
    first = run_controller(
        slurm.net,
        slurm.shared,
        _code(
            slurm,
            """
            from monarch_nb.actor import current_rank
            from monarch_nb.job import launch
            class Talk(Actor):
                @endpoint
                def talk(self):
                    print(f"jobmatch hello from rank {{current_rank().rank}}", flush=True)
                    return socket.gethostname(), os.getpid()
            state = launch("slurm", "slurmcli", 2, python_exe=PY, log_dir=LOG_DIR, monarch_port=0, exclusive=False)
            procs = state.slurmcli.spawn_procs(per_host={{"gpus": 1}}, name="slurmmesh", persist=True)
            out(where=sorted(procs.spawn("t", Talk).talk.call().get().values()))
            """,
        ),
        _env(slurm),
    )[0]
    try:
        where = [tuple(w) for w in first["where"]]
        hosts = sorted(h for h, _ in where)
        assert len(set(hosts)) == 2, first
        st = _cli(slurm, "status")
        assert st.returncode == 0, st.stderr
        job_line = re.search(r"^job slurmcli \(SlurmJob, slurm \d+\): RUNNING$", st.stdout, re.M)
        assert job_line, st.stdout
        under = st.stdout[job_line.end() :]
        for host in hosts:
            assert re.search(
                rf"^  allocator \w+ on {host} pid \d+: ok\n    mesh slurmmesh \{{hosts: 2, gpus: 1\}}", under, re.M
            ), st.stdout
        lg = _cli(slurm, "logs", "slurmmesh")
        assert lg.returncode == 0, lg.stderr
        assert "jobmatch hello from rank 0" in lg.stdout and "jobmatch hello from rank 1" in lg.stdout, (lg.stdout, lg.stderr)
        sk = _cli(slurm, "stacks", "slurmmesh")
        assert sk.returncode == 0 and "stacks of mesh 'slurmmesh': 2 ranks\n  [ranks 0-1 (2)]" in sk.stdout, (
            sk.stdout,
            sk.stderr,
        )
        sp = _cli(slurm, "stop", "slurmmesh")
        assert (sp.returncode, sp.stdout.strip()) == (0, "stopped mesh 'slurmmesh' (2 procs)"), (sp.stdout, sp.stderr)
        for host, pid in where:
            wait_for(lambda pid=pid: not _running(pid), 15, f"proc {pid} on {host} to exit")
        assert slurm.squeue().count(" R ") == 1, slurm.squeue()  # the job and its allocators stay
    finally:
        run_controller(
            slurm.net, slurm.shared, _code(slurm, "from monarch_nb.job import kill_job\nkill_job('slurmcli')\n"), _env(slurm)
        )
    wait_for(lambda: not slurm.squeue().strip(), 30, "the queue to be empty")
