"""ProcessJob: real allocator daemons on this machine, one per "host"; they outlive the process
that applied the job, re-attach from a new process (hosts and live proc meshes, same PIDs), end
with kill() (nothing left) or with their lease when no controller comes back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from monarch_nb.actor import Actor, ProcMesh, endpoint
from monarch_nb.job import JobError, ProcessJob, job_load

pytestmark = pytest.mark.timeout(120)
# a short lease: allocators a failed test leaves behind exit a minute after the session
FAST = {"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"}


class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _procs_mentioning(marker: str) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{e}/cmdline").read_bytes() and _alive(int(e)):
                    out.append(int(e))
            except OSError:
                pass
    return out


def test_apply_spawn_call_kill_leaves_nothing(tmp_path: Path) -> None:
    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"js-{tmp_path.name}.json")
    job = ProcessJob({"trainers": 2, "dataloaders": 1}, env=FAST)
    umask = os.umask(0o022)
    try:
        state = job.state(cached_path=cache)
        assert Path(cache).stat().st_mode & 0o777 == 0o600
        assert str(state.trainers.extent) == "{hosts: 2}" and str(state.dataloaders.extent) == "{hosts: 1}"
        with pytest.raises(AttributeError, match="Available names: dataloaders, trainers"):
            _ = state.evaluators
        procs = state.trainers.spawn_procs(per_host={"gpus": 2}, name="tr")
        pids = sorted(procs.spawn("p", Pid).pid.call().get().values())
        assert len(pids) == 4 and len(set(pids)) == 4
        alloc_pids = [int(h["pid"]) for h in job._hosts.values()]
        job_dir = job._dir
        # the job's files are the user's alone whatever the umask (the allocators' logs hold
        # what their ranks print): allocator.log was 0644 under the usual umask 022
        loose = {
            os.path.relpath(os.path.join(d, n), job_dir): oct(os.lstat(os.path.join(d, n)).st_mode & 0o777)
            for d, dirs, files in os.walk(job_dir)
            for n in dirs + files
            if os.lstat(os.path.join(d, n)).st_mode & 0o077
        }
        assert loose == {}
        # a second state() on the running job attaches again, it does not apply again
        assert str(job.state(cached_path=cache).trainers.extent) == "{hosts: 2}" and job._dir == job_dir

        job.kill()
        assert not job.active
        assert not os.path.exists(cache) and not os.path.exists(job_dir)
        wait_for(lambda: not any(_alive(p) for p in pids + alloc_pids), 15, "allocators and procs to exit")
        assert _procs_mentioning(job_dir) == []

    finally:
        os.umask(umask)
        if job.active:  # the test failed before kill(): leave nothing behind anyway
            job.kill()


def test_a_job_relaunched_with_another_shape_says_it_replaced_the_running_one(tmp_path: Path) -> None:
    # state() stops a cached job that cannot run the new spec, with every proc on its hosts; it
    # did so with only an INFO log line
    from monarch_nb.job import JobReplacedWarning

    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"js-{tmp_path.name}.json")
    first, second = ProcessJob({"trainers": 2}, env=FAST), ProcessJob({"trainers": 3}, env=FAST)
    try:
        first.state(cached_path=cache)
        old_id = first.describe()["id"]
        old_allocs = [int(h["pid"]) for h in first._hosts.values()]
        with pytest.warns(JobReplacedWarning) as said:
            assert str(second.state(cached_path=cache).trainers.extent) == "{hosts: 3}"
        assert [str(w.message) for w in said] == [
            f"replaced the ProcessJob {old_id} cached at {cache} (2 host(s), running): it cannot run this spec (its "
            "meshes or options changed), so it was stopped with every proc on its hosts"
        ]
        wait_for(lambda: not any(_alive(p) for p in old_allocs), 15, "the replaced job's allocators to exit")
    finally:
        for job in (second, first):
            if job.active:
                job.kill()


def test_a_job_replaced_because_it_ended_does_not_say_its_spec_changed(tmp_path: Path) -> None:
    # the same spec, re-run after the job ended (here: an allocator died; on Slurm: walltime or
    # scancel): the warning said "its meshes or options changed"
    from monarch_nb.job import JobReplacedWarning

    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"je-{tmp_path.name}.json")
    first, again = ProcessJob({"trainers": 2}, env=FAST), ProcessJob({"trainers": 2}, env=FAST)
    try:
        first.state(cached_path=cache)
        allocs = [int(h["pid"]) for h in first._hosts.values()]
        os.kill(allocs[0], signal.SIGKILL)
        wait_for(lambda: not _alive(allocs[0]), 15, "the allocator to die")
        with pytest.warns(JobReplacedWarning) as said:
            again.state(cached_path=cache)
        assert len(said) == 1 and "it cannot run this spec (it is no longer running)" in str(said[0].message), said
    finally:
        for job in (again, first):
            if job.active:
                job.kill()


def test_spawning_on_the_hosts_of_an_ended_job_says_which_job_ended_and_what_to_do(tmp_path: Path) -> None:
    # it read "no allocator listening at ipc://...: the socket file does not exist" (killed), or
    # "allocator ... lost: no heartbeat" (ended outside this process): nothing named the job
    from monarch_nb.errors import ConnectError, SpawnError

    killed, ended = ProcessJob({"h": 1}, env=FAST), ProcessJob({"h": 1}, env=FAST)
    try:
        hosts = killed.state(cached_path=None).h
        ident = f"ProcessJob {killed.apply_id[:8]}"
        killed.kill()
        with pytest.raises(ConnectError) as e:
            hosts.spawn_procs(per_host={"gpus": 1})
        assert str(e.value).startswith(
            f"cannot spawn procs on these hosts: {ident} was killed (kill()), and its allocators with it: apply it "
            "again (job.state(), or the same `%mesh launch`) and spawn on its new hosts. (no allocator listening at "
        ), e.value

        hosts = ended.state(cached_path=None).h.slice(hosts=0)  # a slice knows its job too
        ident = f"ProcessJob {ended.apply_id[:8]}"
        alloc = int(ended._hosts["h_0"]["pid"])
        os.kill(alloc, signal.SIGKILL)
        wait_for(lambda: not _alive(alloc), 15, "the allocator to die")
        with pytest.raises((ConnectError, SpawnError)) as e:
            hosts.spawn_procs(per_host={"gpus": 1})
        assert str(e.value).startswith(
            f"cannot spawn procs on these hosts: {ident} is lost: h_0: its allocators are gone; kill() it and apply "
            "it again (job.state(), or the same `%mesh launch`) and spawn on its new hosts. ("
        ), e.value
    finally:
        for job in (killed, ended):
            if job.active:
                job.kill()


_PHASE1 = """
import json, os, sys
sys.path.insert(0, {tests!r})
from monarch_nb.job import ProcessJob
from test_job_process import Pid, FAST
job = ProcessJob({{"trainers": 2}}, env=FAST)
state = job.state(cached_path={cache!r})
procs = state.trainers.spawn_procs(per_host={{"gpus": 2}}, name="kept", persist=True)
pids = sorted(procs.spawn("p", Pid).pid.call().get().values())
print(json.dumps({{"pids": pids, "dir": job._dir}}), flush=True)
os._exit(0)  # as a crashed kernel: no goodbye to the allocators
"""

_PHASE2 = """
import json, os, sys
sys.path.insert(0, {tests!r})
from monarch_nb.actor import ProcMesh
from monarch_nb.job import ProcessJob
from test_job_process import FAST
job = ProcessJob({{"trainers": 2}}, env=FAST)
state = job.state(cached_path={cache!r})
procs = ProcMesh.lookup("kept", state.trainers)
pids = sorted(p.pid for p in procs._procs)
answered = sorted(procs.actor_mesh("p").pid.call().get().values())
print(json.dumps({{"pids": pids, "answered": answered, "dir": job._running._dir}}), flush=True)
if {kill!r}:
    job.kill()
"""


def _script(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reattach_from_a_new_process_finds_the_same_procs(tmp_path: Path) -> None:
    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"js-{tmp_path.name}.json")
    tests = str(Path(__file__).parent)
    first = _script(textwrap.dedent(_PHASE1.format(tests=tests, cache=cache)))
    try:
        # the applying process is gone; its allocators and persistent procs are not
        assert all(_alive(p) for p in first["pids"])
        second = _script(textwrap.dedent(_PHASE2.format(tests=tests, cache=cache, kill=False)))
        assert second["dir"] == first["dir"]
        assert second["pids"] == first["pids"] and second["answered"] == first["pids"]
        third = _script(textwrap.dedent(_PHASE2.format(tests=tests, cache=cache, kill=True)))
        assert third["pids"] == first["pids"]
        wait_for(lambda: not any(_alive(p) for p in first["pids"]), 15, "procs to exit after kill()")
        assert _procs_mentioning(first["dir"]) == []
    finally:
        if os.path.exists(cache):
            job_load(cache).kill()


def test_allocators_exit_after_the_lease_with_no_controller(tmp_path: Path) -> None:
    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"js-{tmp_path.name}.json")
    code = f"""
import json
from monarch_nb.job import ProcessJob
job = ProcessJob({{"h": 2}}, env={{"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "1.5"}})
job.state(cached_path={cache!r})
print(json.dumps({{"pids": [h["pid"] for h in job._hosts.values()], "dir": job._dir}}))
"""
    first = _script(code)
    try:
        wait_for(lambda: not any(_alive(p) for p in first["pids"]), 30, "allocators to exit at the end of their lease")
        # a job whose hosts are gone is not re-attached: state() says so, kill() cleans up
        job = ProcessJob({"h": 2}, env={"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "1.5"})
        stale = job_load(cache)
        assert not stale.can_run(job)
        with pytest.raises(JobError, match="are gone"):
            stale.state(cached_path=None)
    finally:
        job_load(cache).kill()
    assert not os.path.exists(first["dir"])


def test_procmesh_lookup_is_the_public_way_back(tmp_path: Path) -> None:
    # in-process: ProcMesh.lookup over the job's hosts returns the mesh spawned on them
    job = ProcessJob({"w": 1}, env=FAST)
    try:
        state = job.state(cached_path=None)
        procs = state.w.spawn_procs(per_host={"gpus": 2}, name="lk", persist=True)
        again = ProcMesh.lookup("lk", state.w)
        assert sorted(p.pid for p in again._procs) == sorted(p.pid for p in procs._procs)
    finally:
        job.kill()


def test_exec_command_runs_on_every_host_or_one(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from monarch_nb.job import exec_command

    job = ProcessJob({"w": 2}, env=FAST)
    try:
        state = job.state(cached_path=None)
        rc = exec_command(
            state.w, ["sh", "-c", 'echo "hello from $MONARCH_RANK_hosts of $MONARCH_SIZE_hosts"; exit $MONARCH_RANK_hosts']
        ).get(timeout=60)
        assert rc == 1  # the largest exit code
        out = capfd.readouterr().out
        assert "hello from 0 of 2" in out and "hello from 1 of 2" in out
        rc = exec_command(state.w, ["sh", "-c", "echo only; exit 0"], rank=1, output_dir=str(tmp_path / "out")).get(timeout=60)
        assert rc == 0
        assert (tmp_path / "out" / "stdout.txt").read_text() == "only\n"
        assert "only" not in capfd.readouterr().out  # it went to the file
    finally:
        job.kill()


def test_a_controller_leaving_does_not_wait_on_allocators_it_lost(tmp_path: Path) -> None:
    """At exit the controller flushes logs from and says goodbye to each allocator; one declared
    lost got a hello first (2 s, the heartbeat timeout, each: 6 s for three lost hosts)."""
    code = """
import json, os, signal, time
import monarch_nb.actor as A
from monarch_nb.actor import _context
from monarch_nb.job import ProcessJob
A.unhandled_fault_hook = lambda f: None  # the loss is what this script is about
job = ProcessJob({"w": 4}, env={"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"})
job.state(cached_path=None).w.spawn_procs(per_host={"gpus": 1})
client = _context.client()
gone = []
try:
    for h in sorted(job._hosts)[1:]:
        os.kill(int(job._hosts[h]["pid"]), signal.SIGKILL)
        gone.append(h)
    deadline = time.monotonic() + 30
    lost = lambda: [a for a in client.hellos if client.rt.supervision.is_lost(a)]
    while len(lost()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    asked = []
    real_connect, real_request = client.connect, client.request
    client.connect = lambda addr, *a, **k: (asked.append(addr), real_connect(addr, *a, **k))[1]
    client.request = lambda addr, *a, **k: (asked.append(addr), real_request(addr, *a, **k))[1]
    before = lost()
    client.shutdown()
    print(json.dumps({"lost": len(before), "asked_lost": sorted(set(asked) & set(before)), "asked": len(set(asked))}))
finally:
    job.kill()
"""
    out = _script(code)
    assert out["lost"] == 3 and out["asked_lost"] == [] and out["asked"] == 1, out


_GATED = """
import json, sys
from monarch_nb.job import ProcessJob

class Gated(ProcessJob):
    def _create(self, client_script):
        print("creating", flush=True)
        sys.stdin.readline()  # the test says when this apply may go on
        super()._create(client_script)

job = Gated({{"w": 1}}, env={{"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"}})
job.state(cached_path={cache!r})
print(json.dumps({{"apply_id": job.apply_id}}), flush=True)
"""


class Gated(ProcessJob):
    """The job type the scripts above cache (so that this process can load and kill it)."""


def test_two_kernels_applying_the_same_job_at_once_share_one_job(tmp_path: Path) -> None:
    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"jr-{tmp_path.name}.json")
    code = textwrap.dedent(_GATED.format(cache=cache))
    kw: dict[str, Any] = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = subprocess.Popen([sys.executable, "-c", code], **kw)
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "creating"
        second = subprocess.Popen([sys.executable, "-c", code], **kw)
        # the second waits for the first instead of submitting a job of its own
        assert second.stdout is not None
        said = second.stdout.readline()
        assert f"is applying the job cached at {cache}; waiting for it" in said, said
        assert f"process {first.pid} " in said
        out1, _ = first.communicate("go\n", timeout=90)
        out2, _ = second.communicate("go\n", timeout=90)
        ids = [json.loads(out.strip().splitlines()[-1])["apply_id"] for out in (out1, out2)]
        assert ids[0] == ids[1] == json.loads(Path(cache).read_text())["apply_id"], (out1, out2)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        if os.path.exists(cache):
            job_load(cache).kill()


def test_monarch_nb_job_apply_twice_keeps_the_running_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from monarch_nb.job import apply_spec

    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"ja-{tmp_path.name}.json")
    (tmp_path / "myjobs_twice.py").write_text(
        f"from monarch_nb.job import ProcessJob\njob = ProcessJob({{'w': 1}}, env={FAST!r})\n"
    )
    monkeypatch.chdir(tmp_path)
    first = apply_spec("myjobs_twice.job", cache)
    try:
        # `monarch-nb job apply` again (a new process imports the module again): the same job,
        # not a second one that the record keeps while the first runs on unseen
        sys.modules.pop("myjobs_twice", None)
        again = apply_spec("myjobs_twice.job", cache)
        assert again.apply_id == first.apply_id == json.loads(Path(cache).read_text())["apply_id"]
    finally:
        job_load(cache).kill()
        first.kill()


def test_monarch_nb_job_apply_of_a_changed_spec_says_it_replaced_the_job_in_one_line(tmp_path: Path) -> None:
    # it printed the warning as Python shows one: cli.py's path and line number, then the
    # source line `job = apply_spec(args.target, args.cached_path)`
    cache = os.path.join(os.environ["MONARCH_NB_RUNTIME_DIR"], f"jr-{tmp_path.name}.json")
    spec = tmp_path / "myjobs_changed.py"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def apply(hosts: int) -> subprocess.CompletedProcess[str]:
        spec.write_text(f"from monarch_nb.job import ProcessJob\njob = ProcessJob({{'w': {hosts}}}, env={FAST!r})\n")
        cmd = [sys.executable, "-m", "monarch_nb", "job", "apply", "myjobs_changed.job", "--cached-path", cache]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)

    try:
        first = apply(1)
        assert first.returncode == 0 and first.stderr == "", first
        second = apply(2)
        assert second.returncode == 0, second
        assert second.stdout.startswith("applied myjobs_changed.job: ProcessJob process "), second
        assert re.fullmatch(
            r"monarch-nb job apply: replaced the ProcessJob \w+ cached at \S+ \(1 host\(s\), running\): it cannot run this "
            r"spec \(its meshes or options changed\), so it was stopped with every proc on its hosts\n",
            second.stderr,
        ), second.stderr
    finally:
        if os.path.exists(cache):
            job_load(cache).kill()


def test_a_jobs_mesh_is_stopped_by_name_from_a_script_the_cli_and_the_sidebar() -> None:
    """``stop_mesh(name)`` looked for the mesh in this runtime directory's allocators only: a
    job's (their records are in the job's own directory) were not searched, so a mesh on a job's
    hosts was "no mesh named" from a script and from `monarch-nb stop`; the sidebar worked around
    it by passing the allocators it had found itself."""
    from monarch_nb.job import named_job_path
    from monarch_nb.server.manager import MeshManager

    job = ProcessJob({"w": 2}, env=FAST)
    try:
        state = job.state(cached_path=named_job_path("jobstop"))
        for name in ("js1", "js2", "js3"):
            state.w.spawn_procs(per_host={"gpus": 1}, name=name, persist=True)
        # from a script that never saw the job
        assert _script("import json\nfrom monarch_nb.allocator import stop_mesh\nprint(json.dumps(stop_mesh('js1')))") == 2
        # from the command line (this test's process owns the mesh and runs: --force)
        cli = subprocess.run(
            [sys.executable, "-m", "monarch_nb", "stop", "js2", "--force"], capture_output=True, text=True, timeout=60
        )
        assert cli.returncode == 0 and cli.stdout == "stopped mesh 'js2' (2 procs)\n", (cli.stdout, cli.stderr)
        # the sidebar's Stop (POST /monarch-nb/api/meshes/NAME/stop)
        assert MeshManager().stop_mesh("js3") == {"mesh": "js3", "stopped_procs": 2}
        left = {n for a in MeshManager().state()["allocators"] for n in a["meshes"]}
        assert not left & {"js1", "js2", "js3"}, left
    finally:
        job.kill()


class Say(Actor):
    @endpoint
    def say(self, text: str) -> None:
        from monarch_nb.actor import current_rank

        print(f"{text} from {current_rank().rank}", flush=True)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monarch_nb", *argv], capture_output=True, text=True, timeout=60)


def test_a_jobs_mesh_has_logs_stacks_and_a_status_from_a_script_the_cli_and_the_sidebar() -> None:
    """A job's allocators keep their records in the job's own directory: `introspect.logs()`,
    `monarch-nb logs` and `monarch-nb stacks` of a job's mesh said "no mesh named" / "no logs",
    `monarch-nb status` did not list the job's allocators at all, and the sidebar's rank log
    found the rank only through its own snapshot."""
    from monarch_nb.job import list_jobs, named_job_path
    from monarch_nb.server.manager import MeshManager

    job = ProcessJob({"w": 2}, env=FAST)
    try:
        state = job.state(cached_path=named_job_path("jobviews"))
        procs = state.w.spawn_procs(per_host={"gpus": 1}, name="jv", persist=True)
        procs.spawn("s", Say).say.call("hello").get(timeout=30)
        # from a script that never saw the job
        code = "import json\nfrom monarch_nb.introspect import logs\nprint(json.dumps([r['line'] for r in logs('jv', 1)]))"
        assert wait_for(lambda: _script(code) == ["hello from 1"], 30, "rank 1's line from a script")
        # from the command line
        r = _cli("logs", "jv", "--rank", "1")
        assert (r.returncode, r.stdout) == (0, "[1] hello from 1\n"), (r.stdout, r.stderr)
        r = _cli("logs", "jv")
        assert (r.returncode, sorted(r.stdout.splitlines())) == (0, ["[0] hello from 0", "[1] hello from 1"]), r.stderr
        r = _cli("logs", "jv", "--rank", "5")
        assert (r.returncode, r.stderr) == (1, "monarch-nb logs: mesh 'jv' has no rank 5 (ranks 0-1)\n"), r.stderr
        r = _cli("stacks", "jv")
        assert r.returncode == 0 and r.stdout.startswith("stacks of mesh 'jv': 2 ranks"), (r.stdout, r.stderr)
        # status: the job's allocators, under the job
        row = next(j for j in list_jobs() if j["name"] == "jobviews")
        r = _cli("status")
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        head = out.index(f"job jobviews (ProcessJob, {row['scheduler']} {row['id']}): {row['state']}")
        mine = out[head + 1 :]
        assert sum(bool(re.fullmatch(r"  allocator \w+ on \S+ pid \d+: ok", ln)) for ln in mine) == 2, r.stdout
        assert sum(ln.startswith("    mesh jv {hosts: 2, gpus: 1} running ") for ln in mine) == 2, r.stdout
        # the sidebar's log view
        assert [x["line"] for x in MeshManager().rank_log("jv", 0)["lines"]] == ["hello from 0"]
    finally:
        job.kill()
