"""monarch_nb.job without a cluster: the API's shape, the generated sbatch script and ssh command
(every Monarch parameter shows or is refused), squeue parsing of Slurm 22.05 and 24.11, and the
cached job state's safety (0600 JSON, foreign or writable files refused)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from monarch_nb.job import (
    DEFAULT_JOB_PATH,
    JobError,
    JobState,
    LocalJob,
    ProcessJob,
    SlurmJob,
    SSHJob,
    job_load,
    job_loads,
)
from monarch_nb.job._common import expand_hostlist
from monarch_nb.job._common import forwarded_config as _forwarded
from monarch_nb.job._slurm import parse_sinfo_nodes, parse_squeue_json, parse_squeue_text

DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.timeout(60)


def test_import_does_not_need_kubernetes() -> None:
    code = "import sys, monarch_nb.job; print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_job_state_names_its_meshes() -> None:
    st = JobState({"trainers": "T", "dataloaders": "D"})  # type: ignore[dict-item]
    assert st.trainers == "T"
    with pytest.raises(AttributeError, match="'nope' is not a valid host mesh name. Available names: dataloaders, trainers"):
        _ = st.nope
    assert "trainers" in dir(st)


def test_default_job_path_is_under_the_runtime_dir() -> None:
    assert DEFAULT_JOB_PATH.startswith(os.environ["MONARCH_NB_RUNTIME_DIR"])


def test_the_default_job_path_follows_the_runtime_dir_configured_after_import(tmp_path: Path) -> None:
    # DEFAULT_JOB_PATH was computed (and the runtime dir made) when monarch_nb.job was imported:
    # configure(runtime_dir=...) afterwards left it, and job_load()'s default, in the old one
    first, second = tmp_path / "first", tmp_path / "second"
    code = f"""
import os
import monarch_nb.job as job
from monarch_nb.config import configure
from monarch_nb.job import LocalJob, job_load, kill_job, list_jobs
print("made at import:", os.path.exists({str(first)!r}))
configure(runtime_dir={str(second)!r})
print("attribute:", job.DEFAULT_JOB_PATH)
from monarch_nb.job import DEFAULT_JOB_PATH
print("imported:", DEFAULT_JOB_PATH)
LocalJob(("hosts",)).dump(DEFAULT_JOB_PATH)
print("loaded:", type(job_load()).__name__)
print("listed:", [(r["name"], r["path"]) for r in list_jobs()])
kill_job()
try:
    job_load()
except FileNotFoundError as e:
    print("after kill:", e.filename)
"""
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=str(first))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    path = str(second / "jobs" / "job_state.json")
    assert out.stdout.splitlines() == [
        "made at import: False",
        f"attribute: {path}",
        f"imported: {path}",
        "loaded: LocalJob",
        f"listed: [('(current)', {path!r})]",
        f"after kill: {path}",
    ], out.stdout


def test_constructors_keep_monarchs_parameter_names() -> None:
    want = {
        SlurmJob: [
            "meshes",
            "python_exe",
            "slurm_args",
            "monarch_port",
            "job_name",
            "ntasks_per_node",
            "time_limit",
            "partition",
            "log_dir",
            "exclusive",
            "gpus_per_node",
            "cpus_per_task",
            "mem",
            "job_start_timeout",
            "account",
            "qos",
            "out_of_cluster",
            "attach_to",
            "bind_to",
        ],
        SSHJob: ["python_exe", "ssh_args", "monarch_port", "transport"],
        ProcessJob: ["meshes", "env"],
        LocalJob: ["hosts"],
    }
    for cls, names in want.items():
        params = list(inspect.signature(cls.__init__).parameters)[1:]
        assert params[: len(names)] == names, cls
    assert list(inspect.signature(SlurmJob.add_mesh).parameters)[1:] == ["name", "num_nodes"]
    assert list(inspect.signature(SSHJob.add_mesh).parameters)[1:] == ["name", "hosts"]


def test_every_slurm_parameter_shows_in_the_sbatch_script(tmp_path: Path) -> None:
    job = SlurmJob(
        meshes={"trainers": 2},
        python_exe="/opt/py/bin/python3",
        slurm_args=["--constraint=h100", "--reservation=r1"],
        monarch_port=23456,
        job_name="exp7",
        ntasks_per_node=8,
        time_limit="1:30:00",
        partition="gpu",
        log_dir=str(tmp_path),
        exclusive=True,
        gpus_per_node=8,
        cpus_per_task=12,
        mem="200G",
        job_start_timeout=600,
        account="acct9",
        qos="high",
    )
    job.add_mesh("dataloaders", 1)
    script = job.batch_script("/shared/job", "10.0.0.1")
    for line in [
        "#SBATCH --job-name=exp7",
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=8",
        f"#SBATCH --output={tmp_path}/slurm_%j_exp7.out",
        f"#SBATCH --error={tmp_path}/slurm_%j_exp7.err",
        "#SBATCH --time=1:30:00",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --mem=200G",
        "#SBATCH --exclusive",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=acct9",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=h100",
        "#SBATCH --reservation=r1",
    ]:
        assert line in script.splitlines(), line
    srun = script.splitlines()[-1]
    assert srun.startswith("exec srun --nodes=3 --ntasks=3 --ntasks-per-node=1 ")
    assert "/opt/py/bin/python3 -m monarch_nb allocator" in srun
    assert "--bind tcp://route:10.0.0.1:23456" in srun
    assert "--key-file /shared/job/key" in srun and "--announce-dir /shared/job/announce" in srun
    # the wait, not the script: job_start_timeout is honoured by state() (test_job_slurm)
    assert job._job_start_timeout == 600
    assert "--exclusive" not in SlurmJob({"a": 1}, exclusive=False).batch_script()
    # batch mode: the allocators are a background step; the client runs on the batch host
    batch = job.batch_script("/shared/job", "10.0.0.1", "/home/u/train.py").splitlines()
    assert batch[-7].startswith("srun --nodes=3 ") and batch[-7].endswith(" &")
    assert batch[-5:-3] == ["export MONARCH_NB_BATCH_JOB=/shared/job/job.json", "/opt/py/bin/python3 /home/u/train.py"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_who_knows_the_slurm_job_id_cannot_take_its_runtime_directory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each node's allocator ran in ``$TMPDIR/mnb-slurm-$SLURM_JOB_ID``: squeue shows every
    user the job ids, so anyone on a node could make that folder first (the next ids, ahead of
    time), and the allocator refused it as another user's: the job never started there. The name
    now has 64 random bits from the script, which only the job's owner can read."""
    from _nobody import run_as_nobody

    job = SlurmJob({"a": 1}, log_dir=str(tmp_path))
    export = next(ln for ln in job.batch_script().splitlines() if "MONARCH_NB_RUNTIME_DIR=" in ln)
    job_id = str(4_000_000 + os.getpid() % 100_000)
    node_tmp = Path(tempfile.mkdtemp(prefix="mnbn-", dir="/tmp"))  # /tmp/pytest-of-root: not for nobody
    request.addfinalizer(lambda: shutil.rmtree(node_tmp, ignore_errors=True))
    os.chmod(node_tmp, 0o1777)  # a node's /tmp
    # what another user can make ahead of time: the names that follow from what squeue shows
    for name in (f"mnb-slurm-{job_id}", f"mnb-slurm-{job_id}-0"):
        run_as_nobody("import os, sys\nos.mkdir(sys.argv[1])", str(node_tmp / name))
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job_id, "TMPDIR": str(node_tmp)}
    rdir = subprocess.run(
        ["bash", "-c", f'{export}\necho "$MONARCH_NB_RUNTIME_DIR"'], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert rdir.startswith(f"{node_tmp}/mnb-slurm-{job_id}")
    r = subprocess.run(
        [sys.executable, "-c", "from monarch_nb.config import runtime_dir; print(runtime_dir())"],
        env=dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.strip() == rdir, r.stderr[-2000:]
    assert os.stat(rdir).st_uid == os.geteuid()
    other = next(ln for ln in SlurmJob({"a": 1}, log_dir=str(tmp_path)).batch_script().splitlines() if "RUNTIME_DIR" in ln)
    assert other != export  # nor can another job's name be told from this one's


def test_unsupported_parameters_are_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="out_of_cluster"):
        SlurmJob({"a": 1}, out_of_cluster=True)
    with pytest.raises(NotImplementedError, match="attach_to"):
        SlurmJob({"a": 1}, attach_to="tcp://x:1")
    with pytest.raises(NotImplementedError, match="bind_to"):
        SlurmJob({"a": 1}, bind_to="0.0.0.0")
    with pytest.raises(NotImplementedError, match="transport='metatls'"):
        SSHJob(transport="metatls")
    with pytest.raises(ValueError, match="sbatch options"):
        SlurmJob({"a": 1}, slurm_args=["constraint=x"])
    with pytest.raises(FileNotFoundError, match="client_script 'nosuch.py' does not exist"):
        SlurmJob({"a": 1})._create("nosuch.py")
    with pytest.raises(NotImplementedError, match="client_script"):
        ProcessJob({"a": 1})._create("train.py")


def test_mesh_sizes_and_host_lists_are_checked_when_given() -> None:
    """Refused at the constructor or add_mesh, not as sbatch's error or a TypeError at apply()."""
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match=rf"SlurmJob: mesh 't' needs a positive number of nodes, got {re.escape(repr(bad))}"):
            SlurmJob({"t": bad})
        with pytest.raises(ValueError, match="ProcessJob: mesh 't' needs a positive number of hosts"):
            ProcessJob({"t": bad})
    with pytest.raises(ValueError, match="needs a positive number of nodes, got 0"):
        SlurmJob({"a": 1}).add_mesh("t", 0)
    with pytest.raises(ValueError, match="needs a positive number of hosts, got 0"):
        ProcessJob({"a": 1}).add_mesh("t", 0)
    # a string for a host list would be one host per letter
    with pytest.raises(ValueError, match=r"got the string 'node1': write \['node1'\]"):
        SSHJob(meshes={"w": "node1"})
    with pytest.raises(ValueError, match="needs a non-empty list of host names, got \\[\\]"):
        SSHJob().add_mesh("w", [])
    with pytest.raises(ValueError, match="non-empty list of host names"):
        SSHJob(meshes={"w": ["h1", ""]})
    assert SSHJob(meshes={"w": ("h1", "h2")})._meshes == {"w": ["h1", "h2"]}
    # a host twice in one mesh got one allocator, a {hosts: 2} mesh over it, and its first
    # spawn_procs failed with "a mesh named ... already exists on host"
    with pytest.raises(ValueError, match=r"SSHJob: mesh 'w' lists host 'h1' more than once: a job runs one allocator per host"):
        SSHJob().add_mesh("w", ["h1", "h2", "h1"])
    with pytest.raises(ValueError, match=r"lists host 'h1' more than once.*per_host=\{'gpus': N\}"):
        SSHJob(meshes={"w": ["h1", "h1"]})
    # two meshes may share a host (and its allocator), as in Monarch
    assert SSHJob(meshes={"a": ["h1"], "b": ["h1", "h2"]})._all_hosts() == ["h1", "h2"]
    # %mesh launch's --hosts, through make_job, the first step of launch()
    from monarch_nb.job._named import make_job

    with pytest.raises(ValueError, match="hosts for a slurm job is a number of hosts, got 'two'"):
        make_job("slurm", "t", "two")
    with pytest.raises(ValueError, match="ProcessJob: mesh 't' needs a positive number of hosts, got 0"):
        make_job("process", "t", "0")
    with pytest.raises(ValueError, match="SSHJob: mesh 't' needs a non-empty list of host names"):
        make_job("ssh", "t", ",")


def test_command_arguments_ports_and_the_python_are_checked_when_given() -> None:
    # the first positional parameter of Monarch's SSHJob is python_exe: the meshes there used to
    # become "python" and the job "had no hosts" at apply()
    with pytest.raises(ValueError, match=r"SSHJob\(python_exe=...\) is the Python .* hosts go in meshes="):
        SSHJob({"w": ["h1"]})  # type: ignore[arg-type]
    # a string was a list of one-character arguments
    with pytest.raises(ValueError, match=re.escape("got the string '-p 2222': write ssh_args=['-p', '2222']")):
        SSHJob(ssh_args="-p 2222")
    with pytest.raises(ValueError, match=re.escape("write slurm_args=['--exclusive', '--qos=high']")):
        SlurmJob({"w": 2}, slurm_args="--exclusive --qos=high")
    with pytest.raises(ValueError, match="takes a list of strings, got"):
        SlurmJob({"w": 2}, slurm_args=["--qos=x", 3])  # type: ignore[list-item]
    for bad in (70000, -1, "x", 22.5, True):
        with pytest.raises(ValueError, match=r"monarch_port=...\) needs a TCP port number from 1 to 65535 \(0: any free one\)"):
            SSHJob(monarch_port=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SlurmJob\(python_exe=...\) is the Python to run on the hosts, a path, got None"):
        SlurmJob({"w": 2}, python_exe=None)  # type: ignore[arg-type]
    assert SSHJob(monarch_port="2222", ssh_args=("-p", "22"))._port == 2222  # type: ignore[arg-type]
    assert SlurmJob({"w": 2}, monarch_port=0)._port == 0


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs slurm-client's scontrol (.ci/setup installs it)")
def test_a_machine_without_a_slurm_cluster_is_told_where_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from monarch_nb.job._slurm import controller_ip

    # a slurm.conf naming no cluster fails at once (one that is missing makes scontrol retry for 60 s)
    (tmp_path / "slurm.conf").write_text("")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    with pytest.raises(
        JobError,
        match=r"not set up for a Slurm cluster \(`scontrol show config` failed: .*\): run the controller on a login node",
    ):
        controller_ip()
    # and apply() leaves no job folder (with its cluster key) behind in the log folder
    logs = tmp_path / "logs"
    with pytest.raises(JobError, match="not set up for a Slurm cluster"):
        SlurmJob({"w": 1}, log_dir=str(logs)).apply()
    assert not (logs / ".monarch_nb-jobs").exists()


def test_job_errors_are_caught_as_monarchs_runtime_errors(tmp_path: Path) -> None:
    # monarch.job raises RuntimeError ("Failed to submit SLURM job", "SLURM job is no longer
    # active"); code written for it with `except RuntimeError` let ours through
    bad = tmp_path / "job.json"
    bad.write_text("{}")
    bad.chmod(0o600)
    with pytest.raises(RuntimeError, match="not a monarch_nb job record"):
        job_load(str(bad))


def test_ssh_command_line_carries_no_secret() -> None:
    job = SSHJob(python_exe="/venv/bin/python", ssh_args=["-p", "2222", "-i", "/home/u/.ssh/id"], monarch_port=0)
    job.add_mesh("w", ["u@h1"])
    start = job.start_command("u@h1")
    assert start[5:10] == ["-p", "2222", "-i", "/home/u/.ssh/id", "u@h1"]
    # python_exe and monarch_port are arguments of the remote start script; no key anywhere
    assert start[10].endswith(" sh '<job id>' 0 /venv/bin/python" + "".join(f" {k}={v}" for k, v in sorted(_forwarded().items())))
    assert 'cat > "$d/key"' in start[10] and '--bind "tcp://$ip:$port"' in start[10]
    argv = job.ssh_command("u@h1", "echo hi", "arg1")
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert argv[5:9] == ["-p", "2222", "-i", "/home/u/.ssh/id"] and argv[9] == "u@h1"
    assert argv[10] == "sh -c 'echo hi' sh arg1"


def test_the_remote_start_script_puts_the_key_in_no_directory_another_user_made(tmp_path: Path) -> None:
    """The script's folder is ``$TMPDIR/mnb-job-<id>``, in a directory every user of that host
    writes: another user who made that name first (a link to a folder of ours, a folder of
    theirs) must get neither the key nor the allocator's runtime directory."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    job = SSHJob(python_exe="/nonexistent/python", monarch_port=0)
    job.add_mesh("w", ["u@h1"])
    job._apply_id = "feedc0de"
    remote = job.start_command("u@h1")[-1]
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(shared), "SSH_CONNECTION": "10.0.0.1 4000 10.0.0.2 22"}
    planted = shared / "mnb-job-feedc0de"

    def start() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", remote], input="00" * 32 + "\n", env=env, capture_output=True, text=True, timeout=60)

    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    planted.symlink_to(victim)
    os.lchown(planted, 65534, 65534)
    r = start()
    # before: the link was followed, the user's folder made 0700 and the key written into it
    assert r.returncode == 5 and "is not this user's own directory" in r.stderr, r.stderr
    assert os.listdir(victim) == [] and victim.stat().st_mode & 0o777 == 0o755

    planted.unlink()
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o777)
    r = start()
    assert r.returncode == 5 and "is not this user's own directory" in r.stderr, r.stderr
    assert os.listdir(planted) == []

    # the user's own folder of that name: job ids are new at each apply, so the job already
    # started here under another host name (the controller says which); that start's folder stays
    os.rmdir(planted)
    planted.mkdir()
    os.chmod(planted, 0o700)
    r = start()
    assert r.returncode == 6 and r.stderr == f"monarch_nb: same machine: {os.uname().nodename}\n", r.stderr
    assert planted.is_dir() and os.listdir(planted) == []
    os.rmdir(planted)
    r = start()
    assert r.returncode == 3 and "the allocator exited while starting" in r.stderr, r.stderr
    assert not planted.exists()  # and removed with its key


def test_squeue_json_of_slurm_22_05() -> None:
    # recorded from Debian's slurmctld 22.05.8 (tests/_slurm.py): plain strings and ints
    text = (DATA / "squeue-22.05.json").read_text()
    assert json.loads(text)["meta"]["Slurm"]["release"] == "22.05.8"
    info = parse_squeue_json(text, "1")
    assert info is not None
    assert (info.state, info.reason, info.nodes, info.time_limit_min) == ("RUNNING", "None", "n[1-3]", 5)
    assert info.node_names == ["n1", "n2", "n3"]
    assert parse_squeue_json(text, "99") is None


def test_squeue_json_of_slurm_24_11() -> None:
    # the shape of squeue --json in 24.11 (data_parser v0.0.42): states are lists, numbers are
    # {"set", "infinite", "number"}; reconstructed from that schema (bookworm only has 22.05)
    text = (DATA / "squeue-24.11.json").read_text()
    running = parse_squeue_json(text, "4242")
    assert running is not None
    assert (running.state, running.reason, running.time_limit_min, running.start_time) == ("RUNNING", "None", 60, 1732467600)
    assert running.node_names == ["gpu-a01", "gpu-a02", "gpu-b07"]
    pending = parse_squeue_json(text, "4243")
    assert pending is not None and (pending.state, pending.reason, pending.time_limit_min, pending.node_names) == (
        "PENDING",
        "Resources",
        None,
        [],
    )
    ended = parse_squeue_json(text, "4240")
    assert ended is not None and (ended.state, ended.reason) == ("TIMEOUT", "TimeLimit")


def test_squeue_that_could_not_ask_slurmctld_is_not_a_job_gone() -> None:
    # recorded from 22.05.8 with slurmctld stopped: exit code 0, an error, no jobs. Read as "not in
    # the queue", a running job looked gone: state() dropped its cache and submitted another
    text = (DATA / "squeue-22.05-no-controller.json").read_text()
    with pytest.raises(
        JobError, match=r"squeue could not tell the state of Slurm job 5 \(slurm_load_jobs: .*\): is slurmctld up\?"
    ):
        parse_squeue_json(text, "5")


def test_squeue_text_fallback() -> None:
    text = (DATA / "squeue-22.05.txt").read_text()
    info = parse_squeue_text(text, "2")
    assert info is not None and (info.state, info.nodes, info.time_limit_min) == ("RUNNING", "n[1-3]", 5)
    assert parse_squeue_text("7|PENDING|Priority||1-00:00:00\n", "7").reason == "Priority"  # type: ignore[union-attr]
    assert parse_squeue_text("7|PENDING|Priority||1-00:00:00\n", "7").time_limit_min == 1440  # type: ignore[union-attr]


def test_sinfo_names_the_nodes_slurm_lost() -> None:
    # `sinfo -h -N -o '%N|%T'`: '*' is "not responding"; drain, powered-down (~) and mixed still run work
    text = "n1|allocated\nn2|allocated*\nn3|down\nn4|mixed+drain\nn5|idle~\nn6|fail\nn7|down*\n"
    assert parse_sinfo_nodes(text) == {"n2": "allocated*", "n3": "down", "n6": "fail", "n7": "down*"}
    # right after slurmctld restarts, every node is "unknown" until its slurmd registers: not lost
    # (its allocator's answer tells); one that does not respond is "unknown*"
    assert parse_sinfo_nodes("n1|unknown\nn2|unknown*\n") == {"n2": "unknown*"}


def test_hostlists() -> None:
    assert expand_hostlist("h[1-3]") == ["h1", "h2", "h3"]
    assert expand_hostlist("gpu[08-10,12],login1") == ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]


def test_cached_state_is_private_json_and_round_trips(tmp_path: Path) -> None:
    job = SSHJob(python_exe="/p", monarch_port=0)
    job.add_mesh("w", ["a", "b"])
    job._status = "running"
    job._apply_id = "abc"
    job._hosts = {"a": {"tcp": "tcp://10.0.0.2:1", "pid": 5, "dir": "/tmp/mnb-job-abc"}}
    path = tmp_path / "state.json"
    job.dump(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    data = json.loads(path.read_text())
    assert data["format"] == "monarch_nb.job/1" and data["type"] == "SSHJob" and data["apply_id"] == "abc"
    back = job_load(str(path))
    assert isinstance(back, SSHJob) and back.active and back._meshes == {"w": ["a", "b"]} and back._hosts == job._hosts
    assert isinstance(job_loads(job.dumps()), SSHJob)


def test_a_record_not_ours_is_refused_unread(tmp_path: Path) -> None:
    job = ProcessJob({"a": 1})
    path = tmp_path / "state.json"
    job.dump(str(path))
    os.chown(path, 65534, 65534)  # nobody's
    with pytest.raises(JobError, match="belongs to uid 65534"):
        job_load(str(path))
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)
    with pytest.raises(JobError, match="others can write it"):
        job_load(str(path))
    # a pickle (Monarch's format) is never loaded
    path.write_bytes(b"\x80\x04K\x01.")
    os.chmod(path, 0o600)
    with pytest.raises(JobError, match="not a monarch_nb job record"):
        job_load(str(path))
    with pytest.raises(JobError, match="unknown job type"):
        job_loads(json.dumps({"format": "monarch_nb.job/1", "type": "os.system", "spec": {}}))


def test_a_record_written_in_a_shared_directory_goes_through_no_file_or_link_of_another_user(tmp_path: Path) -> None:
    # a cached_path in a directory others write (/tmp, a group's project folder): another user
    # pre-creates the temporary name of our pid, or plants a link at the record's name
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    path = shared / "state.json"
    planted = shared / f"state.json.{os.getpid()}.tmp"
    planted.touch()
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o666)
    job = ProcessJob({"a": 1})
    job.dump(str(path))
    st = path.stat()
    # before: the record went into the planted file (readable by its owner) and became theirs
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
    assert planted.read_bytes() == b"" and planted.stat().st_uid == 65534
    assert isinstance(job_load(str(path)), ProcessJob)

    victim = tmp_path / "victim"
    victim.write_text("the user's own file\n")
    link = shared / "linked.json"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    with pytest.raises(JobError, match="symbolic link of uid 65534"):
        job.dump(str(link))
    assert victim.read_text() == "the user's own file\n"
    # a link of the user's own is followed, as before
    mine = tmp_path / "mine.json"
    mine.symlink_to(path)
    job.dump(str(mine))
    assert mine.is_symlink() and isinstance(job_load(str(path)), ProcessJob)
    # a FIFO at the name blocked the kernel in open() until its maker wrote to it
    fifo = shared / "fifo.json"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(JobError, match="not a regular file"):
        job_load(str(fifo))


def test_a_slurm_job_folder_another_user_could_move_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """log_dir is shared with the nodes, often with other users too: a ``.monarch_nb-jobs``
    another user made there first, or a link of theirs, held the job's folder (its key, its
    announcements) where they could move it or point it elsewhere; and the folder was made
    with the umask's mode (0755). Refused before anything is written; our own is 0700."""
    from monarch_nb.errors import ConfigError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'test: no cluster' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr("monarch_nb.job._slurm.controller_ip", lambda: "127.0.0.1")
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o1777)  # a shared folder
    jobs = logs / ".monarch_nb-jobs"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)

    jobs.mkdir()
    os.chown(jobs, 65534, 65534)
    with pytest.raises(
        ConfigError, match=r"inside .*\.monarch_nb-jobs, which belongs to uid 65534.*log_dir=\.\.\.\) a folder of your own"
    ):
        SlurmJob({"w": 1}, log_dir=str(logs)).apply()
    assert list(jobs.iterdir()) == []
    jobs.rmdir()

    jobs.symlink_to(theirs)
    os.lchown(jobs, 65534, 65534)
    with pytest.raises(ConfigError, match="symbolic link of uid 65534"):
        SlurmJob({"w": 1}, log_dir=str(logs)).apply()
    assert list(theirs.iterdir()) == []
    jobs.unlink()

    umask = os.umask(0o022)
    try:
        with pytest.raises(JobError, match="sbatch refused the job: test: no cluster"):  # past the checks
            SlurmJob({"w": 1}, log_dir=str(logs)).apply()
    finally:
        os.umask(umask)
    assert jobs.stat().st_mode & 0o777 == 0o700 and list(jobs.iterdir()) == []


def test_an_ended_slurm_job_says_its_state_without_a_reason_of_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # squeue's reason for a job cancelled with scancel is "None": "CANCELLED (None)" read as a bug
    from monarch_nb.job._slurm import SlurmJobInfo

    job = SlurmJob({"w": 1})
    job._slurm_job_id = "5"
    monkeypatch.setattr(SlurmJob, "query", lambda self: SlurmJobInfo("5", "CANCELLED", "None"))
    with pytest.raises(JobError, match=r"^Slurm job 5 is CANCELLED: its allocators are gone; kill\(\) it and apply again$"):
        job._state()
    monkeypatch.setattr(SlurmJob, "query", lambda self: SlurmJobInfo("5", "TIMEOUT", "TimeLimit"))
    with pytest.raises(JobError, match=r"^Slurm job 5 is TIMEOUT \(TimeLimit: its time_limit ran out\): its allocators"):
        job._state()


def test_a_local_batch_jobs_client_script_is_its_process(tmp_path: Path) -> None:
    """0.7.0's ``LocalJob.process``: the client script ``apply(client_script=...)`` started (an
    AttributeError here before), and ``ValueError('no local batch job')`` when there is none."""
    script = tmp_path / "client.py"
    script.write_text("import os, sys; sys.exit(0 if os.environ.get('MONARCH_BATCH_JOB') == '1' else 3)\n")
    with pytest.raises(ValueError, match="no local batch job"):
        _ = LocalJob().process
    job = LocalJob()
    job.apply(client_script=str(script))
    try:
        assert job.process.wait(timeout=30) == 0
    finally:
        job.kill()
