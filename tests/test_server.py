"""The sidebar's server side: the manager (public API only) and its REST handlers in a real
jupyter_server, with Jupyter's authentication on every route."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import _gate
import psutil
import pytest
from conftest import PY, run_script, wait_for

from monarch_nb._meshhtml import STATE_COLOURS
from monarch_nb.errors import ConnectError, MeshClosedError, MeshError, MeshNotFoundError, SpawnError


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _mesh(state: dict, name: str) -> dict | None:
    return next((m for m in state["meshes"] if m["name"] == name), None)


@pytest.fixture
def manager():
    from monarch_nb.server.manager import MeshManager

    return MeshManager()


def _spawn(name: str, n: int = 2):
    from monarch_nb.actor import this_host

    return this_host().spawn_procs(per_host={"gpus": n}, name=name)


def test_importing_the_package_and_manager_loads_no_web_framework() -> None:
    code = (
        "import sys, monarch_nb, monarch_nb.server, monarch_nb.server.manager\n"
        "assert monarch_nb._jupyter_server_extension_points() == [{'module': 'monarch_nb'}]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tornado', 'jupyter_server', 'IPython'))\n"
        "print('loaded:', bad)\n"
    )
    r = run_script(code)
    assert r.returncode == 0, r.stderr
    assert "loaded: []" in r.stdout


def test_manager_shows_meshes_ranks_logs_and_failures_then_stops(manager, fault_hook) -> None:
    from monarch_nb.actor import Actor, current_rank, endpoint

    class Printer(Actor):
        @endpoint
        def hello(self) -> int:
            print(f"hello from rank {current_rank().rank}", flush=True)
            return os.getpid()

    name = f"mgr-{uuid.uuid4().hex[:6]}"
    procs = _spawn(name, 3)
    try:
        pids = procs.spawn("printer", Printer).hello.call().get(timeout=30)
        state = manager.state()
        m = _mesh(state, name)
        assert m is not None, state
        assert [p["rank"] for p in m["procs"]] == [0, 1, 2]
        # the dashboard's states and legend, not the allocator's "running"
        assert {p["state"] for p in m["procs"]} <= {"idle", "busy"} and m["state"] in ("idle", "busy")
        assert list(state["legend"]) == ["idle", "busy", "paused", "failed", "stopped"]
        assert state["legend"] == {s: STATE_COLOURS[s] for s in state["legend"]}
        assert state["local_allocator"] is True
        assert sorted(p["pid"] for p in m["procs"]) == sorted(v for _, v in pids.items())
        assert "printer" in m["actors"]
        assert state["debug_sessions"] == []
        host = state["hosts"][0]
        assert host["procs"] >= 3 and host["host"] == state["server_host"]
        assert any(a["alive"] and name in a["meshes"] for a in state["allocators"])

        # recent logs come from the allocator's per-rank logs
        def logged() -> bool:
            lines = {(ln["mesh"], ln["rank"], ln["line"]) for ln in manager.state()["logs"]}
            return all((name, r, f"hello from rank {r}") in lines for r in range(3))

        wait_for(logged, 10, "the ranks' output in the recent logs")
        log = manager.rank_log(name, 1)
        assert [ln["line"] for ln in log["lines"]] == ["hello from rank 1"]

        victim = m["procs"][1]["pid"]
        os.kill(victim, signal.SIGKILL)

        def failed() -> dict | None:
            mm = _mesh(manager.state(), name)
            return mm if mm and mm["procs"][1]["state"] == "failed" else None

        mm = wait_for(failed, 10, "rank 1 to show as failed")
        assert "SIGKILL" in mm["procs"][1]["cause"]
        # failed as a whole, in the same words as the dashboard and %mesh status, with what to do
        assert (mm["state"], mm["label"]) == ("failed", "failed (healthy ranks still callable; new spawns refused)")
        assert "%mesh stop" in mm["hint"]
        assert [p["state"] for p in mm["procs"]][::2] == ["idle", "idle"]
        # a rank's log view says where it ran and how it died
        dead = manager.rank_log(name, 1)["proc"]
        assert dead["pid"] == victim and dead["state"] == "failed" and "SIGKILL" in dead["cause"] and dead["host"]

        out = manager.stop_mesh(name)
        assert out["stopped_procs"] >= 2
        after = manager.state()
        assert _mesh(after, name) is None
        # the stopped mesh's recent lines stay in the sidebar
        assert {(name, r) for r in range(3)} <= {(ln["mesh"], ln["rank"]) for ln in after["logs"]}
        gone = manager.rank_log(name, 0)["proc"]
        assert gone["state"] == "stopped" and gone["pid"] == m["procs"][0]["pid"]
        # the same name spawned again, smaller: the old ranks are history, not lost ranks of the new mesh
        again = _spawn(name, 1)
        try:
            ranks = wait_for(lambda: (mm := _mesh(manager.state(), name)) and mm["procs"], 10, "the new mesh listed")
            assert [(p["rank"], p["state"]) for p in ranks] in ([(0, "idle")], [(0, "busy")]), ranks
        finally:
            again.stop().get(timeout=15)
        wait_for(lambda: all(_gone(p["pid"]) for p in mm["procs"]), 15, "the mesh's procs to exit")
    finally:
        try:
            procs.stop().get(timeout=15)
        except Exception:
            pass


def test_a_rank_whose_actor_failed_shows_failed_while_its_proc_lives_on(manager, fault_hook) -> None:
    from monarch_nb.actor import Actor, current_rank, endpoint

    class Quitter(Actor):
        @endpoint
        def quit(self) -> None:
            if current_rank().rank == 1:
                raise SystemExit(3)

    name = f"actfail-{uuid.uuid4().hex[:6]}"
    procs = _spawn(name, 2)
    try:
        w = procs.spawn("quitter", Quitter)
        w.quit.broadcast()
        wait_for(lambda: fault_hook, 30, "the client's hook to hear of rank 1's failure")

        def failed() -> dict | None:
            mm = _mesh(manager.state(), name)
            return mm if mm and mm["procs"][1]["state"] == "failed" else None

        mm = wait_for(failed, 15, "rank 1 to show as failed in the sidebar's state")
        # the proc lives on; the rank is failed for its actor, and the mesh fails as a whole
        assert mm["procs"][1]["proc_state"] == "running" and not _gone(mm["procs"][1]["pid"])
        assert "actor quitter failed" in mm["procs"][1]["cause"] and "SystemExit" in mm["procs"][1]["cause"], mm
        assert mm["procs"][0]["state"] in ("idle", "busy")
        assert (mm["state"], mm["label"]) == ("failed", "failed (healthy ranks still callable; new spawns refused)")
        # as the label says: a spawn on these procs is refused, as in Monarch when the new mesh is
        # first called, with Monarch's words and what to do
        again = procs.spawn("again", Quitter)
        with pytest.raises(RuntimeError) as e:
            again.quit.call().get(timeout=30)
        said = str(e.value)
        assert said.startswith(
            "error spawning actor mesh: statuses: Running=0..1;"
            "Failed(Cannot spawn new actors on mesh with supervision events)=1..2"
        ), said
        assert "procs.stop()" in said and "spawn_procs" in said
    finally:
        procs.stop().get(timeout=15)


def test_a_rank_in_a_call_is_busy_in_the_sidebar_as_in_the_dashboard(manager, gate) -> None:
    from monarch_nb.actor import Actor, endpoint
    from monarch_nb.widgets import _render

    flag = gate()

    class Waiter(Actor):
        @endpoint
        def wait(self, path: str) -> None:
            _gate.wait(path, 30)

    name = f"busy-{uuid.uuid4().hex[:6]}"
    procs = _spawn(name, 2)
    try:
        pending = procs.spawn("waiter", Waiter).slice(gpus=1).wait.call(flag.path)

        def busy() -> dict | None:
            m = _mesh(manager.state(), name)
            return m if m and m["procs"][1]["state"] == "busy" else None

        m = wait_for(busy, 15, "rank 1 to show as busy")
        assert m["procs"][0]["state"] == "idle" and m["state"] == "busy" and "wait" in m["procs"][1]["activity"]
        # the dashboard draws the same record the same way
        assert _render.rank_state({"state": m["procs"][1]["proc_state"], "busy": ["waiter.wait"]})[0] == "busy"
        # and its tooltip says what the rank does once ("busy in waiter.wait", not twice: the
        # dashboard's reason for a busy rank is that same activity)
        doing = m["procs"][1]["activity"]
        assert doing.startswith("busy in ") and "wait" in doing, doing
        rec = {"state": "running", "busy": ["waiter.wait"], "activity": doing}
        state, reason = _render.rank_state(rec)
        grid = _render.grid_html([{**rec, "rank": 1, "host": "h", "pid": 7, "state": state, "reason": reason}], ["gpus"], [2])
        assert html.unescape(grid).count(doing) == 1, grid
        flag.open()
        pending.get(timeout=30)
        wait_for(lambda: _mesh(manager.state(), name)["procs"][1]["state"] == "idle", 15, "rank 1 idle again")
    finally:
        flag.open()  # a rank still waiting is let go
        procs.stop().get(timeout=15)


@pytest.mark.timeout(90)
def test_debug_rows_say_where_each_rank_stopped_and_attach_to_that_very_session(manager, fault_hook) -> None:
    # two actor meshes named alike, each with rank 0 at a breakpoint: "%mesh attach trainer 0"
    # is refused as ambiguous, so each row's button must name its own session
    import shlex
    import time
    import warnings

    from monarch_nb import debug
    from monarch_nb.actor import Actor, ProcsKilledWarning, endpoint
    from monarch_nb.config import configured
    from monarch_nb.introspect import status

    class Stopper(Actor):
        @endpoint
        def go(self) -> int:
            breakpoint()  # the line the rows point at
            return 1

    names = [f"dbg{c}-{uuid.uuid4().hex[:6]}" for c in "ab"]
    meshes = [_spawn(n, 1) for n in names]

    def rows() -> list[dict]:
        got = [d for d in manager.state()["debug_sessions"] if d.get("mesh") in names]
        return got if len(got) == 2 else []

    try:
        with configured(debug_no_input="wait"):  # pytest has no stdin: leave the ranks paused
            for m in meshes:
                m.spawn("trainer", Stopper).go.broadcast()
            found = wait_for(rows, 30, "both ranks to stop at their breakpoint")
            assert len({d["attach"] for d in found}) == 2, found
            for d in found:
                assert re.fullmatch(r".*test_server\.py:\d+ in go", d["where"]), d
                argv = shlex.split(d["attach"])
                assert argv[:2] == ["%mesh", "attach"] and argv[3] == "0", d
                assert debug.attach(argv[2], 0).session.mesh == d["mesh"]

            # stopping meshes whose ranks are still paused (no input to skip them here) quits
            # their breakpoints: each actor ends its call and cleans up, nothing waits out the
            # 2 s stop_cleanup_timeout for a `c` nobody can type, nothing is killed
            start = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("error", ProcsKilledWarning)
                for m in meshes:
                    m.stop().get(timeout=15)
            took = time.monotonic() - start
            assert took < 1.5, f"stopping two meshes paused at a breakpoint took {took:.1f} s"
            assert not [d for d in status()["debug_sessions"] if d.get("mesh") in names]
    finally:
        for m in meshes:
            m.stop().get(timeout=15)


@pytest.mark.timeout(120)
def test_a_jobs_mesh_can_be_stopped_and_its_full_rank_log_read_from_the_sidebar(manager, fault_hook) -> None:
    # a ProcessJob's allocators keep their connection files in the job's directory: the sidebar
    # lists their meshes, and its Stop and rank log (no allocator named) must reach them too
    from monarch_nb.actor import Actor, endpoint
    from monarch_nb.job import ProcessJob

    class Chatty(Actor):
        @endpoint
        def talk(self) -> None:
            for i in range(8):
                print(f"line {i}", flush=True)

    name = f"jobm-{uuid.uuid4().hex[:6]}"
    job = ProcessJob({"workers": 2}, env={"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"})
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, name=name)
        procs.spawn("chatty", Chatty).talk.call().get(timeout=30)
        m = wait_for(lambda: _mesh(manager.state(), name), 15, "the job's mesh in the sidebar")
        assert len(set(m["allocators"])) == 2 and len(m["procs"]) == 2
        # its whole log, as its allocator keeps it (not only the last lines the poll saw)
        log = manager.rank_log(name, 1)
        assert [r["line"] for r in log["lines"]] == [f"line {i}" for i in range(8)], log
        assert manager.stop_mesh(name) == {"mesh": name, "stopped_procs": 2}
        wait_for(lambda: _mesh(manager.state(), name) is None, 15, "the stopped mesh to leave the sidebar")
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_a_mesh_spawned_again_under_its_name_does_not_inherit_a_lost_hosts_ranks(manager, fault_hook) -> None:
    # "train" on hosts A and B; B dies (its ranks show failed: lost); the user stops "train" and
    # spawns it again on A alone before the sidebar polls again (it polls only while shown)
    from monarch_nb.allocator import stop_mesh
    from monarch_nb.job import ProcessJob

    name = f"again-{uuid.uuid4().hex[:6]}"
    job = ProcessJob({"workers": 2}, env={"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"})
    try:
        hosts = job.state().workers
        hosts.spawn_procs(per_host={"gpus": 1}, name=name)
        assert [p["state"] for p in wait_for(lambda: _mesh(manager.state(), name), 15, "the mesh")["procs"]] == ["idle"] * 2
        a, b = job._hosts.values()
        os.kill(int(b["pid"]), signal.SIGKILL)

        def lost() -> bool:
            manager._invalidate()
            m = _mesh(manager.state(), name)
            return bool(m and [p["state"] for p in m["procs"]] == ["idle", "failed"])

        wait_for(lost, 15, "host B's rank to show failed")
        # its log view still opens: what the server kept, and why the rank is failed
        log = manager.rank_log(name, 1)
        assert log["proc"]["state"] == "failed" and "does not answer" in log["proc"]["cause"], log
        assert stop_mesh(name, a["addr"]) == 1
        hosts.slice(hosts=0).spawn_procs(per_host={"gpus": 1}, name=name)
        manager._invalidate()
        m = _mesh(manager.state(), name)
        assert m is not None and [(p["rank"], p["state"]) for p in m["procs"]] == [(0, "idle")], m
        assert m["state"] == "idle"
    finally:
        job.kill()


def test_stop_mesh_refuses_an_attached_owners_mesh_unless_forced() -> None:
    from monarch_nb.allocator import stop_mesh

    name = f"owned-{uuid.uuid4().hex[:6]}"
    # a separate controller owns the mesh and stays attached until its stdin closes
    code = (
        "import sys\n"
        "import monarch_nb.actor as api\n"
        "api.unhandled_fault_hook = lambda f: print('fault', flush=True)\n"
        "from monarch_nb.actor import this_host\n"
        f"p = this_host().spawn_procs(per_host={{'gpus': 2}}, name={name!r})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen([PY, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        with pytest.raises(PermissionError, match="owned by another controller"):
            stop_mesh(name, force=False)
        assert stop_mesh(name) == 2
        with pytest.raises(MeshError, match="no mesh named"):
            stop_mesh(name)
    finally:
        owner.communicate("", timeout=30)


@pytest.mark.timeout(120)
def test_stop_mesh_asks_an_allocator_too_busy_to_list_its_meshes() -> None:
    """status() gives an allocator 2 s to list its meshes: one busier than that (a flood of rank
    output, a loaded machine) read as "no mesh named 'kept' on any known allocator", and the
    mesh kept running (the browser tests' cleanup, which stops by name and passes over a missing
    mesh, would leave it to later tests)."""
    rdir = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")  # short: ipc socket paths are limited
    code = """
import os, signal
import monarch_nb.introspect as introspect
from monarch_nb.actor import this_host
from monarch_nb.allocator import list_allocators, stop_allocator, stop_mesh

try:
    this_host().spawn_procs(per_host={"gpus": 1}, name="kept")
    this_host().spawn_procs(per_host={"gpus": 1}, name="other")
    pid = int(list_allocators()[0]["pid"])
    search = introspect.status

    def busy_while_searched(*args, **kwargs):
        os.kill(pid, signal.SIGSTOP)  # it hears nothing while stopped: the search times out
        try:
            return search(*args, **kwargs)
        finally:
            os.kill(pid, signal.SIGCONT)

    introspect.status = busy_while_searched
    print("STOPPED", stop_mesh("kept"))
    try:
        stop_mesh("nosuch")
    except Exception as e:
        print("NOSUCH", type(e).__name__, e)
    # one that does not answer at all: said so, not "no mesh"
    introspect.status = search
    os.kill(pid, signal.SIGSTOP)
    introspect.status = lambda addresses=None, timeout=2.0, **k: search(addresses, 0.5, **k)
    try:
        stop_mesh("other", timeout=1)
    except Exception as e:
        print("SILENT", type(e).__name__, e)
    finally:
        os.kill(pid, signal.SIGCONT)
    introspect.status = search
    print("LEFT", sorted(m["name"] for a in search()["allocators"] for m in a.get("meshes", [])))
finally:
    stop_allocator()
"""
    # heartbeats that outlast the stops: the allocator and its controller keep each other
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_HEARTBEAT_TIMEOUT": "30"}
    try:
        r = run_script(code, timeout=90, env=env)
    finally:
        shutil.rmtree(rdir, ignore_errors=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STOPPED 1" in r.stdout, r.stdout + r.stderr
    assert "NOSUCH MeshNotFoundError no mesh named 'nosuch' on any known allocator" in r.stdout, r.stdout
    assert re.search(
        r"SILENT ConnectError no allocator that answered has a mesh named 'other', and these could not be reached: "
        r".+no answer to the stop either, within 1 s\. What ran there was not stopped",
        r.stdout,
    ), r.stdout
    assert "LEFT ['other']" in r.stdout, r.stdout


def test_a_stale_connection_file_is_listed_as_a_dead_allocator(manager) -> None:
    import json
    import socket

    from monarch_nb._runtime import records
    from monarch_nb.config import runtime_dir

    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    path = records.path_for(runtime_dir(), "stale0test")
    info = {"alloc_id": "stale0test", "host": socket.gethostname(), "pid": dead.pid, "addr": "ipc:///nonexistent.sock"}
    with open(path, "w") as f:
        json.dump(info, f)
    try:
        a = next(a for a in manager.state()["allocators"] if a["id"] == "stale0test")
        assert a["alive"] is False and "stale connection file" in a["error"]
        assert a["pid"] == dead.pid
    finally:
        os.unlink(path)


def test_a_rank_log_click_does_not_list_the_jobs_again(manager, monkeypatch) -> None:
    """The sidebar's rank log searched every allocator for the rank, and so listed the jobs on
    record on each click (an squeue per Slurm job); the manager's state already knows the rank's
    allocator, with the job rows it keeps for a few seconds."""
    import monarch_nb.job as job
    from monarch_nb.actor import Actor, endpoint

    class Printer(Actor):
        @endpoint
        def hello(self) -> None:
            print("hello", flush=True)

    name = f"mgr-{uuid.uuid4().hex[:6]}"
    procs = _spawn(name, 1)
    listed = []
    real = job.list_jobs
    monkeypatch.setattr(job, "list_jobs", lambda *a, **k: listed.append(1) or real(*a, **k))
    try:
        procs.spawn("printer", Printer).hello.call().get(timeout=30)
        wait_for(lambda: manager.rank_log(name, 0)["lines"], 10, "the rank's line in its log")
        before = len(listed)
        for _ in range(3):
            assert [ln["line"] for ln in manager.rank_log(name, 0)["lines"]] == ["hello"]
        # (one, should the manager's few seconds of job rows run out meanwhile)
        assert len(listed) - before <= 1, f"{len(listed) - before} job listings for three clicks"
    finally:
        procs.stop().get(timeout=30)


def test_rank_log_of_an_unknown_mesh_is_a_clear_error(manager) -> None:
    with pytest.raises(MeshError, match="no rank 0 of a mesh named 'no-such-mesh'"):
        manager.rank_log("no-such-mesh", 0)
    with pytest.raises(ValueError, match="tail must be >= 0"):
        manager.rank_log("no-such-mesh", 0, tail=-1)


# ---------------------------------------------------------------------------------- REST
@pytest.fixture(scope="module")
def server():
    from _jupyter import JupyterServer

    s = JupyterServer("server")
    yield s
    s.stop()


ROUTES = [
    ("GET", "/monarch-nb/api/state", None),
    ("POST", "/monarch-nb/api/allocators", {}),
    ("POST", "/monarch-nb/api/meshes/demo/stop", {}),
    ("GET", "/monarch-nb/api/meshes/demo/ranks/0/log", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_route_needs_jupyters_authentication(server, method, path, body) -> None:
    status, _ = server.request(method, path, body, token=None)
    assert status == 403
    status, _ = server.request(method, path, body, token="wrong-token")
    assert status == 403


def test_rest_api_lists_starts_stops_and_reads_logs(server, fault_hook) -> None:
    status, started = server.request("POST", "/monarch-nb/api/allocators", {})
    assert status == 200, started
    assert started["addr"].startswith("ipc://")
    status, again = server.request("POST", "/monarch-nb/api/allocators", {})
    assert status == 200 and again["started"] is False and again["pid"] == started["pid"]

    name = f"rest-{uuid.uuid4().hex[:6]}"
    procs = _spawn(name, 2)
    try:
        status, state = server.request("GET", "/monarch-nb/api/state")
        assert status == 200
        assert set(state) >= {"allocators", "hosts", "meshes", "debug_sessions", "logs"}
        m = _mesh(state, name)
        assert m is not None and {p["state"] for p in m["procs"]} <= {"idle", "busy"}
        assert state["legend"]["failed"] == STATE_COLOURS["failed"] and isinstance(state["jobs"], list)

        status, log = server.request("GET", f"/monarch-nb/api/meshes/{name}/ranks/0/log?tail=10")
        assert status == 200 and log["rank"] == 0 and isinstance(log["lines"], list)
        status, err = server.request("GET", f"/monarch-nb/api/meshes/{name}/ranks/0/log?tail=lots")
        assert status == 400 and "tail must be an integer" in err["message"]
        status, err = server.request("GET", "/monarch-nb/api/meshes/nope/ranks/0/log")
        assert status == 404 and "no rank 0 of a mesh named 'nope'" in err["message"]
        status, err = server.request("POST", "/monarch-nb/api/meshes/nope/stop", {})
        assert status == 404 and "no mesh named 'nope'" in err["message"]
        status, err = server.request("POST", f"/monarch-nb/api/meshes/{name}/stop", [1, 2])
        assert status == 400 and "JSON object" in err["message"]

        status, out = server.request("POST", f"/monarch-nb/api/meshes/{name}/stop", {})
        assert status == 200 and out == {"mesh": name, "stopped_procs": 2}
        wait_for(lambda: all(_gone(p["pid"]) for p in m["procs"]), 15, "the stopped mesh's procs to exit")
        status, state = server.request("GET", "/monarch-nb/api/state")
        assert _mesh(state, name) is None
    finally:
        try:
            procs.stop().get(timeout=15)
        except Exception:
            pass
    assert "Traceback" not in server.logtext()


@pytest.mark.timeout(120)
def test_rest_api_says_an_allocator_did_not_answer_not_that_the_mesh_is_not_found(tmp_path) -> None:
    """A running mesh whose allocator did not answer (stopped, busy, its host lost): a rank's log
    was a 404 "no rank 0 of a mesh named ...", or a 500 with a traceback in the server's log (asked
    of that allocator), or "stopped: its mesh was stopped" (a rank seen before): the user read the
    mesh as gone. Now a 504 naming the allocator, and a rank seen before is failed as the
    dashboard draws it, with what this server kept of its lines."""
    from _jupyter import JupyterServer
    from conftest import AllocatorProc

    from monarch_nb.actor import attach_to_workers

    a = AllocatorProc(str(tmp_path))
    s = None
    try:
        attach_to_workers(workers=[a.addr]).spawn_procs(per_host={"gpus": 1}, name="quiet")
        # this allocator is the only one this server knows
        s = JupyterServer("server", extra_env={"MONARCH_NB_RUNTIME_DIR": a.rdir})
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            status, err = s.request("GET", "/monarch-nb/api/meshes/quiet/ranks/0/log")
            assert status == 504, (status, err)
            assert err["message"].startswith("ConnectError: no rank 0 of a mesh named 'quiet' on any known allocator that")
            assert f"these could not be reached: {a.info['host']} ({a.addr}): no answer within 2 s" in err["message"], err
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        status, state = s.request("GET", "/monarch-nb/api/state")
        assert status == 200 and _mesh(state, "quiet") is not None, state
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            status, err = s.request("GET", f"/monarch-nb/api/meshes/quiet/ranks/0/log?alloc={a.addr}")
            assert status == 504 and err["message"].startswith("TimeoutError: logs on "), (status, err)
            # (the server's snapshot in which it answered has expired by now)
            status, log = s.request("GET", "/monarch-nb/api/meshes/quiet/ranks/0/log")
            assert status == 200, (status, log)
            assert log["proc"]["state"] == "failed", log
            assert log["proc"]["cause"] == (
                f"its host {a.info['host']} does not answer (allocator {a.addr}: no answer within 2 s: not running, "
                "or not reachable from here)"
            ), log
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        status, err = s.request("GET", "/monarch-nb/api/meshes/quiet/ranks/5/log")
        assert status == 404 and "no rank 5 of a mesh named 'quiet'" in err["message"], (status, err)
        assert "Traceback" not in s.logtext()
    finally:
        if s is not None:
            s.stop()
        a.stop()  # and its procs with it


def test_a_mesh_whose_only_allocator_does_not_answer_stays_in_the_list_saying_why(tmp_path) -> None:
    """The sidebar's list of meshes dropped a mesh whose only allocator did not answer (busy,
    stopped, its host cut off): the user read it as gone. Now it stays, its ranks failed with
    their state unknown, and the mesh says which allocator did not answer and in how long."""
    from _jupyter import JupyterServer
    from conftest import AllocatorProc

    from monarch_nb.actor import attach_to_workers

    a = AllocatorProc(str(tmp_path))
    s = None
    try:
        attach_to_workers(workers=[a.addr]).spawn_procs(per_host={"gpus": 2}, name="quiet")
        s = JupyterServer("server", extra_env={"MONARCH_NB_RUNTIME_DIR": a.rdir})
        status, state = s.request("GET", "/monarch-nb/api/state")
        assert status == 200 and [p["state"] for p in _mesh(state, "quiet")["procs"]] == ["idle", "idle"], state
        host = a.info["host"]

        def quiet() -> dict:
            status, state = s.request("GET", "/monarch-nb/api/state")
            assert status == 200, state
            m = _mesh(state, "quiet")
            assert m is not None, f"the mesh dropped out of the list: {state['meshes']}"
            return m if m["label"] == "unreachable" else {}

        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            # (a snapshot from before the stop is served for a moment)
            m = wait_for(quiet, 20, "the mesh to show its allocator did not answer")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert m["state"] == "failed" and m["allocators"] == [a.addr], m
        assert m["hint"].startswith(f"allocator at {a.addr} ({host}) did not answer: no answer within 2 s"), m["hint"]
        cause = (
            f"its host {host} does not answer (allocator {a.addr}: no answer within 2 s: not running, or not reachable from here)"
        )
        assert [(p["rank"], p["state"], p["proc_state"], p["cause"]) for p in m["procs"]] == [
            (0, "failed", "unknown", cause),
            (1, "failed", "unknown", cause),
        ], m["procs"]
        # answering again, it is the mesh it was
        wait_for(
            lambda: (
                [p["state"] for p in (_mesh(s.request("GET", "/monarch-nb/api/state")[1], "quiet") or {"procs": []})["procs"]]
                == ["idle", "idle"]
            ),
            20,
            "the ranks idle again",
        )
        assert "Traceback" not in s.logtext()
    finally:
        if s is not None:
            s.stop()
        a.stop()  # and its procs with it


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (MeshNotFoundError("no mesh named 'x'", "x"), 404),
        (MeshClosedError("mesh 'x' has already been stopped"), 409),
        (MeshError("a mesh named 'x' already exists on host h; stop it first or choose another name"), 409),
        (SpawnError("the allocator of host h is shutting down"), 502),
        (ConnectError("h (tcp://10.0.0.2:1): no answer within 2 s"), 504),
        (TimeoutError("stop_mesh on tcp://10.0.0.2:1: no reply within 15 s"), 504),
        (PermissionError("'tcp://x' is not an allocator this server knows"), 400),
        (KeyError("a bug"), None),
    ],
)
def test_rest_errors_say_not_found_only_for_a_name_that_is_not_there(error, status) -> None:
    """Every MeshError was a 404: a mesh that is there (stopped, a name taken) read as gone."""
    from monarch_nb.server.handlers import _error_status

    assert _error_status(error) == status


def test_install_enables_the_server_extension_labextension_and_kernel_spec() -> None:
    def jupyter(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr

    out = jupyter("jupyter_server", "extension", "list")
    assert re.search(r"monarch_nb\S*\s+\S*enabled", out), out
    out = jupyter("jupyterlab.labextensions", "list")
    assert re.search(r"monarch-nb v\S+ \S*enabled\S* \S*OK", out), out
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("monarch-nb")
    assert spec.display_name == "Python 3 (monarch_nb)"
    # the shipped spec says "python"; `monarch-nb kernelspec install` (run by .ci/setup) pins the interpreter
    assert os.path.basename(spec.argv[0]).startswith("python")
    assert spec.argv[1:] == ["-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext", "monarch_nb"]
