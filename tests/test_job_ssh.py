"""SSHJob against real sshd servers on network-namespace hosts (tests/_sshd.py).

The controller runs on host "ctl", as a notebook on a login machine would; the allocators are
started over ssh on s1..s3. One cluster for the module. Nothing sleeps to synchronise: scripts
run to completion and print JSON; host processes are polled with deadlines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

sys.path.insert(0, str(Path(__file__).parent))
from _jobhelp import PY, KeyWatch, run_controller
from _sshd import SshCluster

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ssh() -> Iterator[SshCluster]:
    c = SshCluster(3)
    try:
        yield c
        c.assert_alive()
    finally:
        c.close()


def _env(c: SshCluster) -> dict[str, str]:
    return c.env(
        MONARCH_NB_RUNTIME_DIR="/tmp/mnb",
        MONARCH_NB_ZYGOTE_PRELOAD="",
        MONARCH_NB_HEARTBEAT_INTERVAL="0.2",
        MONARCH_NB_HEARTBEAT_TIMEOUT="1.5",
    )


_HEAD = """
import json, os, socket, sys
from monarch_nb.actor import Actor, ProcMesh, endpoint
from monarch_nb.job import JobError, SSHJob, named_job_path

class Where(Actor):
    @endpoint
    def where(self):
        return socket.gethostname(), os.getpid()

def out(**kw):
    print(json.dumps(kw), flush=True)

def make_job(ssh_args, hosts=("root@s1", "root@s2"), extra=("root@s3",)):
    job = SSHJob(python_exe={py!r}, ssh_args=ssh_args, monarch_port=0)
    job.add_mesh("workers", list(hosts))
    if extra:
        job.add_mesh("extra", list(extra))
    return job
"""


def _code(body: str, **fmt: object) -> str:
    return textwrap.dedent(_HEAD).format(py=PY) + textwrap.dedent(body).format(**fmt)


def _allocators_on(c: SshCluster, i: int) -> list[tuple[int, str]]:
    return [p for p in c.host_pids(i) if "monarch_nb" in p[1]]


def test_launch_survive_reattach_kill(ssh: SshCluster) -> None:
    args = ssh.ssh_args()
    with KeyWatch() as watch:
        first = run_controller(
            ssh.net,
            ssh.shared,
            _code(
                """
                job = make_job({args!r})
                state = job.state(cached_path=named_job_path("ssh1"))
                procs = state.workers.spawn_procs(per_host={{"gpus": 2}}, name="kept", persist=True)
                got = procs.spawn("w", Where).where.call().get()
                out(where=sorted(got.values()), key_file=job._key_file,
                    extra=[h.host for h in state.extra._refs()])
                os._exit(0)  # a crashed kernel: no goodbye, no kill()
                """,
                args=args,
            ),
            _env(ssh),
        )[0]
        # the ssh clients are gone (they return once the allocator announced), the allocators live on
        assert not [p for p in ssh.host_pids(0) if p[1].startswith("ssh ")]
        for i in (1, 2, 3):
            assert len(_allocators_on(ssh, i)) >= 1, ssh.host_pids(i)
        hosts = sorted({h for h, _ in first["where"]})
        assert hosts == ["s1", "s2"] and len(first["where"]) == 4 and first["extra"] == ["s3"]
        key = bytes.fromhex(ssh.net.path(0, first["key_file"]).read_text().strip())

        # the JupyterLab sidebar's state (GET /monarch-nb/api/state is MeshManager.state()), from
        # a process that never attached: it asks the job's allocators with the job's own key
        side = run_controller(
            ssh.net,
            ssh.shared,
            _code(
                """
                from monarch_nb.server.manager import MeshManager
                m = MeshManager()
                s = m.state()
                # a rank's log, as the sidebar's rank view asks it of the rank's allocator
                log = m.rank_log("kept", 3)
                out(jobs=s["jobs"], allocators=[[a["addr"], a["alive"], a["error"]] for a in s["allocators"]],
                    meshes={{m["name"]: [[p["host"], p["pid"], p["state"]] for p in m["procs"]] for m in s["meshes"]}},
                    log=[log["proc"]["host"], log["lines"]])
                """
            ),
            _env(ssh),
        )[0]
        (row,) = side["jobs"]
        assert row["name"] == "ssh1" and row["scheduler"] == "ssh" and row["state"] == "running" and not row["lost"], row
        # each allocator is listed at the address the job reaches it by (its own ipc one is on its host)
        assert len(row["addrs"]) == 3 and {addr for addr, alive, _ in side["allocators"] if alive} >= set(row["addrs"]), side
        assert side["log"] == ["s2", []], side
        assert sorted((h, pid) for h, pid, _ in side["meshes"]["kept"]) == sorted(tuple(w) for w in first["where"]), side
        assert {st for _, _, st in side["meshes"]["kept"]} == {"idle"}, side

        second = run_controller(
            ssh.net,
            ssh.shared,
            _code(
                """
                job = make_job({args!r})
                state = job.state(cached_path=named_job_path("ssh1"))
                procs = ProcMesh.lookup("kept", state.workers)
                got = procs.actor_mesh("w").where.call().get()
                out(where=sorted(got.values()), pids=sorted((p.host, p.pid) for p in procs._procs))
                job.kill()
                out(killed=True, cache=os.path.exists(named_job_path("ssh1")))
                """,
                args=args,
            ),
            _env(ssh),
        )
    assert [list(x) for x in second[0]["pids"]] == [list(x) for x in first["where"]]
    assert second[0]["where"] == first["where"]
    assert second[1] == {"killed": True, "cache": False}
    # kill() stopped the recorded allocators over ssh: nothing of ours is left on any host
    for i in (1, 2, 3):
        wait_for(lambda i=i: not [p for p in ssh.host_pids(i) if "sshd:" not in p[1]], 15, f"host s{i} to be empty")
    ssh.assert_alive()
    assert watch.scans > 10
    assert watch.leaks(key) == []


def test_unreachable_host_fails_clearly_and_cleans_up(ssh: SshCluster) -> None:
    assert ssh.net is not None
    nowhere = ssh.net.ip(3).rsplit(".", 1)[0] + ".250"  # on the subnet, no host there
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            job = make_job({args!r}, hosts=("root@s1", "root@{nowhere}"), extra=())
            try:
                job.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e))
            """,
            args=ssh.ssh_args(),
            nowhere=nowhere,
        ),
        _env(ssh),
    )[0]
    assert res["error"] and f"ssh could not reach root@{nowhere}" in res["error"], res
    # the host that did start was stopped again
    wait_for(lambda: not _allocators_on(ssh, 1), 15, "the allocator started on s1 to be stopped")


def test_refused_ssh_key_fails_clearly(ssh: SshCluster) -> None:
    other = os.path.join(ssh.shared, "not_authorized")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other], check=True)
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            job = make_job({args!r}, extra=())
            try:
                job.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e))
            """,
            args=ssh.ssh_args(other),
        ),
        _env(ssh),
    )[0]
    assert res["error"] and "was refused" in res["error"] and "Permission denied" in res["error"], res
    assert not _allocators_on(ssh, 1) and not _allocators_on(ssh, 2)


def test_wrong_cluster_key_fails_clearly(ssh: SshCluster) -> None:
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            from monarch_nb._wire.keys import write_key_file
            from monarch_nb.errors import AuthenticationError
            job = make_job({args!r}, hosts=("root@s1",), extra=())
            job.apply()
            write_key_file(job._key_file)  # the controller now holds another key than the hosts
            try:
                job.state(cached_path=None)
                out(error=None)
            except AuthenticationError as e:
                out(error=str(e))
            finally:
                job.kill()
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )[0]
    assert res["error"] and "different cluster key" in res["error"], res
    wait_for(lambda: not _allocators_on(ssh, 1), 15, "s1's allocator to be stopped")


def test_a_python_without_monarch_nb_fails_clearly_and_leaves_no_key(ssh: SshCluster) -> None:
    assert ssh.net is not None
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            job = SSHJob(python_exe="/usr/bin/python3", ssh_args={args!r}, monarch_port=0)
            job.add_mesh("workers", ["root@s1", "root@s2"])
            try:
                job.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e))
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )[0]
    assert res["error"] and "starting on root@s1 failed" in res["error"] and "No module named monarch_nb" in res["error"], res
    # the job's directory (with the cluster key in it) went with the allocator that never ran
    for i in (1, 2):
        assert not list(ssh.net.path(i, "/tmp").glob("mnb-job-*")), i


def test_one_machine_under_two_names_is_refused_naming_both(ssh: SshCluster) -> None:
    """A host name and its address (or two aliases) started two allocators on one machine in
    the job's one directory there: the second took over the first's key file and announcement,
    and the job ran with a stray allocator. Refused, naming both, and nothing is left running."""
    assert ssh.net is not None
    ip = ssh.net.ip(1)
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            job = make_job({args!r}, hosts=("root@s1", "root@s2"), extra=("root@{ip}",))
            try:
                job.state(cached_path=None)
                out(error=None)
            except JobError as e:
                out(error=str(e))
            """,
            args=ssh.ssh_args(),
            ip=ip,
        ),
        _env(ssh),
    )[0]
    names = f"('root@s1' and 'root@{ip}'|'root@{ip}' and 'root@s1')"  # whichever reached it first
    assert res["error"] and re.search(
        names + r" are the same machine \(s1\) under two names: a job runs one allocator per host", res["error"]
    ), res
    for i in (1, 2):
        wait_for(lambda i=i: not _allocators_on(ssh, i), 15, f"the allocators started on s{i} to be stopped")
        assert not list(ssh.net.path(i, "/tmp").glob("mnb-job-*")), i


def test_kill_with_a_host_cut_off_says_so_and_can_be_retried(ssh: SshCluster) -> None:
    assert ssh.net is not None
    ready = Path(ssh.shared, "cut-ready")
    path = Path(ssh.shared, "cut.py")
    path.write_text(
        _code(
            """
            import sys
            job = make_job({args!r}, extra=())
            job.state(cached_path=None)
            open({ready!r}, "w").close()
            sys.stdin.readline()  # the test pulls s2's cable, then says go
            try:
                job.kill()
                out(error=None)
            except JobError as e:
                out(error=str(e), active=job.active)
            sys.stdin.readline()  # the cable is back
            job.kill()
            out(killed=True, active=job.active)
            """,
            args=ssh.ssh_args(),
            ready=str(ready),
        )
    )
    proc = ssh.net.popen(0, [PY, str(path)], env=_env(ssh), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def say_go() -> None:
        proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]

    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "the job to run")
        assert proc.poll() is None, proc.communicate()
        ssh.net.link_down(2)
        say_go()
        line = b""
        while not line.startswith(b"{"):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.communicate()
        first = json.loads(line)
        ssh.net.link_up(2)
        say_go()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ready.exists():
            ready.unlink()
    assert first["error"] and "could not stop the allocators on: root@s2" in first["error"], first
    assert "Call kill() again once they are reachable" in first["error"] and first["active"], first
    assert b'"killed": true' in out and b'"active": false' in out, out
    # the retry reached s2: nothing of the job is left on either host
    for i in (1, 2):
        wait_for(lambda i=i: not _allocators_on(ssh, i), 15, f"s{i}'s allocator to be stopped")
        assert not list(ssh.net.path(i, "/tmp").glob("mnb-job-*")), i


def test_a_second_job_in_the_same_kernel_after_the_first_was_killed(ssh: SshCluster) -> None:
    # each job made its own key and a process holds one: the second job's hosts failed with
    # "this process already uses another cluster key", its allocators left running
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            first = make_job({args!r}, hosts=("root@s1",), extra=())
            got = first.state(cached_path=None).workers.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where)
            out(first=[h for h, _ in got.where.call().get().values()])
            first.kill()
            second = make_job({args!r}, hosts=("root@s2", "root@s3"), extra=())
            try:
                got = second.state(cached_path=None).workers.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where)
                out(second=sorted(h for h, _ in got.where.call().get().values()))
            except Exception as e:
                out(second=f"{{type(e).__name__}}: {{e}}")
            finally:
                second.kill()
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )
    assert res == [{"first": ["s1"]}, {"second": ["s2", "s3"]}], res
    for i in (1, 2, 3):
        wait_for(lambda i=i: not _allocators_on(ssh, i), 15, f"s{i}'s allocator to be stopped")


def test_a_job_killed_from_another_process_says_so_here(ssh: SshCluster) -> None:
    # the notebook's job object, after `job_load(path).kill()` in another kernel: state() raised
    # "ConfigError: cannot read cluster key file ...", and a spawn on its hosts named no job
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            import subprocess
            import monarch_nb.actor as public
            from monarch_nb.errors import ConnectError, SpawnError
            public.unhandled_fault_hook = lambda f: None  # the other kill fails the first mesh: expected
            job = make_job({args!r}, hosts=("root@s1",), extra=())
            state = job.state(cached_path=named_job_path("elsewhere"))
            state.workers.spawn_procs(per_host={{"gpus": 1}}).spawn("w", Where).where.call().get()
            other = "from monarch_nb.job import job_load, named_job_path; job_load(named_job_path('elsewhere')).kill()"
            subprocess.run([sys.executable, "-c", other], check=True)
            try:
                state.workers.spawn_procs(per_host={{"gpus": 1}})
                out(spawn=None)
            except (ConnectError, SpawnError) as e:
                out(spawn=str(e))
            try:
                job.state(cached_path=named_job_path("elsewhere"))
                out(state=None)
            except JobError as e:
                out(state=str(e), active=job.active)
            job.kill()
            out(active=job.active)
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )
    spawn = res[0]["spawn"]
    assert spawn and spawn.startswith("cannot spawn procs on these hosts: SSHJob "), res
    assert "its allocators are gone; kill() it and apply it again" in spawn, res
    state = res[1]["state"]
    assert state and "was stopped elsewhere" in state and "kill() it and apply it again" in state, res
    assert res[2] == {"active": False}, res
    wait_for(lambda: not _allocators_on(ssh, 1), 15, "s1's allocator to be stopped")


@pytest.mark.timeout(120)
def test_a_jobs_mesh_on_other_hosts_is_read_and_stopped_by_name(ssh: SshCluster) -> None:
    """An allocator of another host answers status with its own ipc address (a socket file on
    that host): ``known_status()`` listed it under that, and ``stop_mesh(name)``, ``monarch-nb
    stop``, the sidebar's Stop and ``introspect.logs`` sent their request there and waited out
    their whole timeout (15 s: ``TimeoutError: stop_mesh on ipc:///tmp/mnb-job-.../rt/mnb-....sock``)."""
    res = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            import subprocess, time
            from monarch_nb.allocator import stop_mesh
            from monarch_nb.introspect import logs
            job = make_job({args!r}, extra=())
            try:
                state = job.state(cached_path=named_job_path("byname"))
                pm = state.workers.spawn_procs(per_host={{"gpus": 1}}, name="far", persist=True)
                pm.spawn("w", Where).where.call().get()
                state.workers.spawn_procs(per_host={{"gpus": 1}}, name="far2", persist=True)
                code = "import json, time, sys; t0 = time.monotonic(); r = " + "{{}}" + "; print(json.dumps([r, time.monotonic() - t0]))"
                def script(expr):
                    cp = subprocess.run([sys.executable, "-c", code.format(expr)], capture_output=True, text=True, timeout=60)
                    return cp.stdout.strip() or cp.stderr[-800:]
                # from processes that never saw the job, as a terminal or the sidebar would
                out(logs=script("__import__('monarch_nb.introspect').introspect.logs('far', 1)"))
                out(stop=script("__import__('monarch_nb.allocator').allocator.stop_mesh('far')"))
                t0 = time.monotonic()
                cp = subprocess.run([sys.executable, "-m", "monarch_nb", "stop", "far2", "--force"], capture_output=True, text=True, timeout=60)
                out(cli=[cp.returncode, cp.stdout, cp.stderr[-800:], time.monotonic() - t0])
            finally:
                job.kill()
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )
    logs, elapsed = json.loads(res[0]["logs"])
    assert elapsed < 5 and isinstance(logs, list), res[0]
    assert json.loads(res[1]["stop"])[0] == 2, res[1]
    rc, stdout, _stderr, elapsed = res[2]["cli"]
    assert (rc, stdout) == (0, "stopped mesh 'far2' (2 procs)\n") and elapsed < 10, res[2]


@pytest.mark.timeout(120)
def test_stop_and_status_with_a_dead_host_name_it_at_once(ssh: SshCluster) -> None:
    """A job's host whose allocator died: ``stop_mesh(name)`` stopped the ranks on the live
    hosts and returned as if that was all of the mesh (or, found nowhere else, "no mesh named");
    the dead host was not named. Now the live ranks stop at once, and a ConnectError names the
    host, the ranks there and what became of them, within the dead-host promise (3 s)."""
    _code_spawn = """
        job = make_job({args!r}, extra=())
        state = job.state(cached_path=named_job_path("deadhost"))
        state.workers.spawn_procs(per_host={{"gpus": 1}}, name="dm", persist=True)
        state.workers.spawn_procs(per_host={{"gpus": 1}}, name="dm2", persist=True)
        state.workers.slice(hosts=1).spawn_procs(per_host={{"gpus": 1}}, name="only2", persist=True)
        os._exit(0)  # the notebook is gone; its persistent meshes stay
        """
    run_controller(ssh.net, ssh.shared, _code(_code_spawn, args=ssh.ssh_args()), _env(ssh))
    try:
        (victim,) = [pid for pid, cmd in _allocators_on(ssh, 2) if " allocator " in cmd]
        os.kill(victim, signal.SIGKILL)
        # what the error says of them: its zygote and procs die with it
        wait_for(lambda: not _allocators_on(ssh, 2), 15, "s2's procs to die with their allocator")
        res = run_controller(
            ssh.net,
            ssh.shared,
            _code(
                """
                import subprocess, time
                from monarch_nb.allocator import stop_mesh
                from monarch_nb.errors import ConnectError
                from monarch_nb.introspect import known_status
                t0 = time.monotonic()
                try:
                    out(stopped=stop_mesh("dm"))
                except ConnectError as e:
                    out(error=str(e), stopped=e.stopped, elapsed=time.monotonic() - t0)
                out(left=sorted(m["name"] for a in known_status()["allocators"] for m in a.get("meshes", [])))
                for argv in (["stop", "dm2", "--force"], ["stop", "only2", "--force"], ["status"], ["stop", "--all", "--force"]):
                    t0 = time.monotonic()
                    cp = subprocess.run([sys.executable, "-m", "monarch_nb", *argv], capture_output=True, text=True, timeout=60)
                    out(rc=cp.returncode, stdout=cp.stdout, stderr=cp.stderr, elapsed=time.monotonic() - t0)
                """
            ),
            _env(ssh),
        )
    finally:
        run_controller(ssh.net, ssh.shared, _code("from monarch_nb.job import kill_job\nkill_job('deadhost')\n"), _env(ssh))
    stop, left, cli_part, cli_stop, status, cli_all = res
    assert stop["stopped"] == 1 and stop["elapsed"] < 3, stop
    assert stop["error"].startswith("1 proc of mesh 'dm' stopped on the allocators that answered; rank 1 of mesh 'dm' is "), stop
    assert re.search(r"root@s2 \(tcp://[\d.]+:\d+, job deadhost\): lost: its allocator does not answer", stop["error"]), stop
    assert "if the allocator died (killed, or its host went down), its procs died with it" in stop["error"], stop
    assert "`monarch-nb job kill deadhost`" in stop["error"], stop
    assert left == {"left": ["dm2"]}, left
    # the command line: the live part stopped and said so, then the dead host named, exit status 1
    assert (cli_part["rc"], cli_part["stdout"]) == (1, "stopped mesh 'dm2' (1 proc)\n") and cli_part["elapsed"] < 3, cli_part
    assert cli_part["stderr"].startswith("monarch-nb stop: rank 1 of mesh 'dm2' is on no allocator that answered"), cli_part
    # found nowhere that answered: the lost host is named, not "no mesh" alone
    assert cli_stop["rc"] == 1 and cli_stop["elapsed"] < 3, cli_stop
    assert cli_stop["stderr"].startswith("monarch-nb stop: no mesh named 'only2'"), cli_stop
    assert "did not answer: lost: its allocator does not answer" in cli_stop["stderr"], cli_stop
    assert status["rc"] == 0 and status["elapsed"] < 3, status
    assert re.search(r"\n  allocator on root@s2 \(tcp://[\d.]+:\d+\): lost: its allocator does not answer\n", status["stdout"]), (
        status
    )
    # --all: nothing left where it could look, and the host it could not is named
    assert (cli_all["rc"], cli_all["stdout"]) == (1, "no meshes on this host's allocators\n"), cli_all
    assert cli_all["stderr"].startswith(
        "monarch-nb stop: these could not be reached, and no mesh of theirs was stopped: root@s2"
    ), cli_all


@pytest.mark.timeout(120)
def test_logs_and_stacks_with_a_dead_host_name_it(ssh: SshCluster) -> None:
    """A job's host whose allocator died: ``stacks(name)`` showed the live ranks alone, numbered
    from 0 (rank 1 shown as rank 0), ``monarch-nb logs M --rank R``
    said "mesh 'M' has no rank R (ranks 1)" and ``introspect.logs`` "no rank R ... on any known
    allocator". Each now names the host that could not be reached, at once."""
    spawn = """
        class Hello(Actor):
            @endpoint
            def hello(self):
                print("hello", flush=True)

        job = make_job({args!r}, extra=())
        state = job.state(cached_path=named_job_path("deadlogs"))
        state.workers.spawn_procs(per_host={{"gpus": 1}}, name="lm", persist=True).spawn("h", Hello).hello.call().get()
        os._exit(0)
        """
    run_controller(ssh.net, ssh.shared, _code(spawn, args=ssh.ssh_args()), _env(ssh))
    try:
        (victim,) = [pid for pid, cmd in _allocators_on(ssh, 1) if " allocator " in cmd]
        os.kill(victim, signal.SIGKILL)
        res = run_controller(
            ssh.net,
            ssh.shared,
            _code(
                """
                import subprocess, time
                from monarch_nb.debug import stacks
                from monarch_nb.errors import ConnectError
                from monarch_nb.introspect import logs
                t0 = time.monotonic()
                out(stacks=str(stacks("lm")), elapsed=time.monotonic() - t0)
                t0 = time.monotonic()
                try:
                    logs("lm", 0)
                except ConnectError as e:  # not "not found": its host is lost
                    out(error=str(e), elapsed=time.monotonic() - t0)
                from monarch_nb.logs import follow
                try:
                    next(follow("lm", 0))
                except ConnectError as e:
                    out(follow=str(e))
                for argv in (["logs", "lm", "--rank", "0"], ["logs", "lm"], ["logs", "lm", "-f", "--rank", "0"]):
                    t0 = time.monotonic()
                    cp = subprocess.run([sys.executable, "-m", "monarch_nb", *argv], capture_output=True, text=True, timeout=60)
                    out(rc=cp.returncode, stdout=cp.stdout, stderr=cp.stderr, elapsed=time.monotonic() - t0)
                """
            ),
            _env(ssh),
        )
    finally:
        run_controller(ssh.net, ssh.shared, _code("from monarch_nb.job import kill_job\nkill_job('deadlogs')\n"), _env(ssh))
    st, lg, fol, one, every, following = res
    unreached = r"these could not be reached: root@s1 \(tcp://[\d.]+:\d+, job deadlogs\): lost: its allocator does not answer"
    assert st["elapsed"] < 3 and st["stacks"].startswith("stacks of mesh 'lm': 2 ranks\n"), st
    assert re.search(r"\n  rank 0 \(root@s1\): on no allocator that answered, and " + unreached, st["stacks"]), st
    # the live rank keeps its number
    assert "\n  [rank 1] thread MainThread\n" in st["stacks"] and "[rank 0] thread" not in st["stacks"], st
    assert lg["elapsed"] < 3 and lg["error"].startswith("no rank 0 of a mesh named 'lm' on any known allocator that answered"), lg
    assert re.search(unreached, lg["error"]), lg
    assert one["rc"] == 1 and one["elapsed"] < 3, one
    assert one["stderr"].startswith("monarch-nb logs: rank 0 of mesh 'lm' is on no allocator that answered, and "), one
    assert re.search(unreached, one["stderr"]), one
    # all ranks: what can be read is printed, and the rest is named
    assert (every["rc"], every["stdout"]) == (0, "[1] hello\n") and every["elapsed"] < 3, every
    assert every["stderr"].startswith("monarch-nb logs: rank 0 of mesh 'lm' is on no allocator that answered"), every
    assert fol["follow"].startswith("rank 0 of mesh 'lm' is on no allocator that answered, and "), fol
    assert following["rc"] == 1 and following["elapsed"] < 3, following
    assert following["stderr"].startswith("monarch-nb logs: rank 0 of mesh 'lm' is on no allocator that answered"), following


def _cli(ssh: SshCluster, *args: str) -> subprocess.CompletedProcess[str]:
    assert ssh.net is not None
    return ssh.net.run(0, [PY, "-m", "monarch_nb", *args], capture_output=True, text=True, env=_env(ssh), timeout=60)


@pytest.mark.timeout(60)
def test_the_cli_lists_logs_and_stops_a_mesh_of_the_job_from_another_process(ssh: SshCluster) -> None:
    """`monarch-nb status/logs/stacks/stop` on the login host, from a process that never saw the
    job, find a mesh on the job's allocators; logs show the running mesh's lines, not those an
    earlier mesh of the name left in this host's runtime directory."""
    first = run_controller(
        ssh.net,
        ssh.shared,
        _code(
            """
            from monarch_nb.actor import current_rank
            class Talk(Actor):
                @endpoint
                def talk(self):
                    print(f"jobmatch hello from rank {{current_rank().rank}}", flush=True)
                    return socket.gethostname(), os.getpid()
            from monarch_nb.actor import this_host
            # an earlier mesh of that name on this host: its logs stay in the runtime directory
            earlier = this_host().spawn_procs(per_host={{"gpus": 1}}, name="sshmesh")
            earlier.spawn("t", Talk).talk.call().get()
            earlier.stop().get()
            job = make_job({args!r}, extra=())
            state = job.state(cached_path=named_job_path("sshcli"))
            procs = state.workers.spawn_procs(per_host={{"gpus": 1}}, name="sshmesh", persist=True)
            out(where=sorted(procs.spawn("t", Talk).talk.call().get().values()))
            """,
            args=ssh.ssh_args(),
        ),
        _env(ssh),
    )[0]
    try:
        where = [tuple(w) for w in first["where"]]
        assert sorted(h for h, _ in where) == ["s1", "s2"], first
        st = _cli(ssh, "status")
        assert st.returncode == 0, st.stderr
        # the job's line, then each of its two allocators with the mesh under it
        job_line = re.search(r"^job sshcli \(SSHJob, ssh \w+\): running$", st.stdout, re.M)
        assert job_line, st.stdout
        under = st.stdout[job_line.end() :]
        for host in ("s1", "s2"):
            assert re.search(rf"^  allocator \w+ on {host} pid \d+: ok\n    mesh sshmesh \{{hosts: 2, gpus: 1\}}", under, re.M), (
                st.stdout
            )
        # the running mesh's logs, not the earlier one's (rank 0 alone, on this host)
        lg = _cli(ssh, "logs", "sshmesh")
        assert (lg.returncode, lg.stderr) == (0, ""), lg
        # ordered by when each rank wrote its line
        assert sorted(lg.stdout.splitlines()) == ["[0] jobmatch hello from rank 0", "[1] jobmatch hello from rank 1"], lg
        lg = _cli(ssh, "logs", "sshmesh", "--rank", "1")
        assert (lg.returncode, lg.stdout, lg.stderr) == (0, "[1] jobmatch hello from rank 1\n", ""), lg
        sk = _cli(ssh, "stacks", "sshmesh")
        assert sk.returncode == 0 and "stacks of mesh 'sshmesh': 2 ranks\n  [ranks 0-1 (2)]" in sk.stdout, (sk.stdout, sk.stderr)
        # s2 cut off: its rank is not reached, and the command says so
        assert ssh.net is not None
        ssh.net.link_down(2)
        try:
            sp = _cli(ssh, "stop", "sshmesh")
        finally:
            ssh.net.link_up(2)
        assert (sp.returncode, sp.stdout.strip()) == (1, "stopped mesh 'sshmesh' (1 proc)"), (sp.stdout, sp.stderr)
        assert sp.stderr.startswith(
            "monarch-nb stop: rank 1 of mesh 'sshmesh' is on no allocator that answered, and these could not be reached: root@s2 ("
        ), sp
        # a cut link, not a dead host: its proc runs on, and a second stop once it answers reaches it
        assert where[1][1] in [p for p, _ in ssh.host_pids(2)], ssh.host_pids(2)
        sp = _cli(ssh, "stop", "sshmesh")
        assert (sp.returncode, sp.stdout.strip(), sp.stderr) == (0, "stopped mesh 'sshmesh' (1 proc)", ""), sp
        # its procs are gone from both hosts; the job's allocators stay
        for i, (host, pid) in enumerate(where, 1):
            wait_for(lambda i=i, pid=pid: pid not in [p for p, _ in ssh.host_pids(i)], 15, f"proc {pid} on {host} to exit")
            assert _allocators_on(ssh, i), ssh.host_pids(i)
    finally:
        run_controller(
            ssh.net,
            ssh.shared,
            _code("from monarch_nb.job import kill_job\nkill_job('sshcli')\n"),
            _env(ssh),
        )
        _cli(ssh, "allocator", "stop")  # the earlier mesh's, on this host


@pytest.mark.timeout(120)
def test_a_notebooks_status_and_stop_list_a_jobs_mesh_and_name_its_dead_host(ssh: SshCluster) -> None:
    """What `%mesh status` and `%mesh stop NAME` run (monarch_nb.mesh.status/stop), in a
    controller that did not spawn the job's meshes: they listed none of them (this runtime
    directory's allocators only), and a stop said "no mesh named". Now the job's allocators are
    asked with its key, by their tcp address, and its dead host is named at once."""
    spawn = """
        job = make_job({args!r}, extra=())
        state = job.state(cached_path=named_job_path("nbssh"))
        for name in ("na", "nb"):
            state.workers.spawn_procs(per_host={{"gpus": 1}}, name=name, persist=True)
        os._exit(0)  # the notebook is gone; its persistent meshes stay
        """
    look = """
        import time
        from monarch_nb import mesh
        from monarch_nb.errors import ConnectError
        from monarch_nb.magics._tables import StatusTable
        t0 = time.monotonic()
        rows = StatusTable(mesh.status()).rows
        out(rows=sorted((r.get("job"), r["host"], r.get("mesh"), r["state"]) for r in rows if r.get("job")), elapsed=time.monotonic() - t0)
        try:
            out(stopped=mesh.stop({name!r}, force=True))  # the gone script may still read as attached for a heartbeat
        except ConnectError as e:
            out(error=str(e), elapsed=time.monotonic() - t0)
        """
    run_controller(ssh.net, ssh.shared, _code(spawn, args=ssh.ssh_args()), _env(ssh))
    try:
        healthy = run_controller(ssh.net, ssh.shared, _code(look, name="na"), _env(ssh))
        (victim,) = [pid for pid, cmd in _allocators_on(ssh, 2) if " allocator " in cmd]
        os.kill(victim, signal.SIGKILL)
        dead = run_controller(ssh.net, ssh.shared, _code(look, name="nb"), _env(ssh))
    finally:
        run_controller(ssh.net, ssh.shared, _code("from monarch_nb.job import kill_job\nkill_job('nbssh')\n"), _env(ssh))
    listed, stopped = healthy
    every = [["nbssh", h, f"{m} (persistent)", "idle"] for h in ("s1", "s2") for m in ("na", "nb")]
    assert listed["rows"] == every and listed["elapsed"] < 3, listed
    assert stopped == {"stopped": ["na"]}, stopped
    listed, stopped = dead
    lost = ["nbssh (lost: root@s2)", "root@s2", None, "unreachable"]
    assert listed["rows"] == [lost, ["nbssh (lost: root@s2)", "s1", "nb (persistent)", "idle"]], listed
    assert listed["elapsed"] < 3, listed
    assert stopped["error"].startswith("1 proc of mesh 'nb' stopped on the allocators that answered; rank 1 of mesh 'nb' is "), (
        stopped
    )
    assert re.search(r"root@s2 \(tcp://[\d.]+:\d+, job nbssh\): lost: its allocator does not answer", stopped["error"]), stopped
    assert stopped["elapsed"] < 3, stopped
