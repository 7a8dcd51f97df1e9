"""``SlurmJob``: one sbatch job, one allocator per node (Monarch's SlurmJob, same arguments).

- The job's directory lives in ``log_dir`` (which, as for Monarch, must be on a file system
  every node sees): the cluster key (0600, never on a command line or in the environment) and
  the allocators' announcements. Each allocator binds the address its node uses to reach the
  controller and announces it there; ``squeue`` is read only for the job's state.
- ``squeue --json`` of Slurm 22.05 (plain strings) and of 23.02+/24.11 (state lists, numbers as
  ``{"set", "infinite", "number"}``) both parse; without the JSON plugin, the text format.
- A pending job waits for as long as ``job_start_timeout`` allows (forever by default) and says
  why it waits (the queue reason) whenever that changes; once the job runs, a node that has not
  announced within ``announce_timeout`` fails the job with that node's name.
- The allocators are the job's srun step: scancel or the walltime ends them (and their procs),
  and they exit after the lease with no controller.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._runtime import records
from .._runtime.transport import route_ip
from .._wire.keys import write_key_file
from ..actor import HostMesh
from ..config import check_path_to
from ._common import (
    answering,
    command_args,
    expand_hostlist,
    forwarded_config,
    held_key,
    host_meshes,
    mesh_size,
    port_number,
    python_path,
    wait_announced,
)
from ._job import JobError, JobTrait

logger = logging.getLogger("monarch_nb.job")

#: set in a batch job's client script: the job record it attaches to
BATCH_ENV = "MONARCH_NB_BATCH_JOB"

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "REQUEUED", "SUSPENDED", "STAGE_OUT", "SIGNALING"}
TERMINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
#: base states; the rest of a 23.02+ state list are flags
BASE = {"PENDING", "RUNNING", "SUSPENDED"} | TERMINAL


@dataclasses.dataclass
class SlurmJobInfo:
    """What squeue says about one job."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    time_limit_min: int | None = None
    start_time: int | None = None
    #: how many times Slurm requeued it (a node failure, `scontrol requeue`); JSON only
    restarts: int = 0

    @property
    def node_names(self) -> list[str]:
        return expand_hostlist(self.nodes) if self.nodes and self.nodes != "(null)" else []


def _number(v: Any) -> int | None:
    """A number of any squeue JSON version: a plain int (22.05) or {"set", "infinite", "number"}."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def parse_squeue_json(text: str, job_id: str) -> SlurmJobInfo | None:
    """The job ``job_id`` in ``squeue --json`` output (22.05's or 24.11's), or None."""
    data = json.loads(text)
    for j in data.get("jobs") or []:
        if str(_number(j.get("job_id"))) != str(job_id):
            continue
        state = j.get("job_state")
        if isinstance(state, list):  # 23.02+: a base state and flags (COMPLETING, CONFIGURING...)
            state = next((s for s in state if s in BASE), state[0] if state else "UNKNOWN")
        return SlurmJobInfo(
            job_id=str(job_id),
            state=str(state or "UNKNOWN"),
            reason=str(j.get("state_reason") or ""),
            nodes=str(j.get("nodes") or ""),
            time_limit_min=_number(j.get("time_limit")),
            start_time=_number(j.get("start_time")),
            restarts=_number(j.get("restart_cnt")) or 0,
        )
    errors = data.get("errors") or []
    if errors:
        # squeue exits 0 with an empty job list when it could not ask slurmctld (22.05: down or
        # restarting): "not in the queue" would make a running job look gone, and state()
        # would drop its cache and submit another
        said = "; ".join(
            f"{e.get('source') or 'squeue'}: {e.get('description') or e.get('error') or e}" if isinstance(e, dict) else str(e)
            for e in errors
        )
        raise JobError(f"squeue could not tell the state of Slurm job {job_id} ({said}): is slurmctld up?")
    return None


TEXT_FORMAT = "%i|%T|%r|%N|%l"


def parse_squeue_text(text: str, job_id: str) -> SlurmJobInfo | None:
    """The job in ``squeue -h -o '%i|%T|%r|%N|%l'`` output, or None."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4 and parts[0] == str(job_id):
            limit = parts[4] if len(parts) > 4 else ""
            return SlurmJobInfo(str(job_id), parts[1], parts[2], parts[3], _minutes(limit))
    return None


def _minutes(limit: str) -> int | None:
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", limit.strip())
    if not m:
        return None
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return d * 1440 + h * 60 + mi + (1 if s else 0)


class SlurmJob(JobTrait):
    """Submit one Slurm job that starts an allocator on each of its nodes.

    Arguments are Monarch's. ``meshes`` maps names to node counts; ``log_dir`` (default: the
    current directory) must be visible on every node. ``announce_timeout`` (ours): seconds a
    running job's nodes get to announce their allocators.
    """

    def __init__(
        self,
        meshes: dict[str, int],
        python_exe: str = "python",
        slurm_args: Sequence[str] = (),
        monarch_port: int = 22222,
        job_name: str = "monarch_job",
        ntasks_per_node: int = 1,
        time_limit: str | None = None,
        partition: str | None = None,
        log_dir: str | None = None,
        exclusive: bool = True,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        job_start_timeout: int | None = None,
        account: str | None = None,
        qos: str | None = None,
        out_of_cluster: bool = False,
        attach_to: str | None = None,
        bind_to: str | None = None,
        *,
        announce_timeout: float = 120.0,
    ) -> None:
        if out_of_cluster:
            raise NotImplementedError(
                "SlurmJob(out_of_cluster=True): run the controller on a login node (or any host the nodes can reach)"
            )
        if attach_to is not None:
            raise NotImplementedError("SlurmJob(attach_to=...): a gateway for out-of-cluster access is not implemented")
        if bind_to is not None:
            raise NotImplementedError(
                "SlurmJob(bind_to=...): each allocator binds the address its node uses to reach the controller "
                "and announces it; a separate listen address is not implemented"
            )
        if ntasks_per_node < 1:
            raise ValueError(f"ntasks_per_node must be >= 1, got {ntasks_per_node}")
        slurm_args = command_args("SlurmJob", "slurm_args", slurm_args)
        for arg in slurm_args:
            if not arg.startswith("-"):
                raise ValueError(f"slurm_args are sbatch options (starting with '-'), got {arg!r}")
        super().__init__()
        self._meshes = {name: mesh_size("SlurmJob", name, n, "nodes") for name, n in meshes.items()}
        self._python_exe = python_path("SlurmJob", python_exe)
        self._slurm_args = slurm_args
        self._port = port_number("SlurmJob", "monarch_port", monarch_port)
        self._job_name = job_name
        self._ntasks_per_node = ntasks_per_node
        self._time_limit = time_limit
        self._partition = partition
        self._log_dir_arg = log_dir
        self._log_dir = os.path.abspath(log_dir if log_dir is not None else os.getcwd())
        self._exclusive = exclusive
        self._gpus_per_node = gpus_per_node
        self._cpus_per_task = cpus_per_task
        self._mem = mem
        self._job_start_timeout = job_start_timeout
        self._account = account
        self._qos = qos
        self._announce_timeout = float(announce_timeout)
        self._slurm_job_id: str | None = None
        self._dir = ""
        self._hosts: list[dict[str, Any]] = []

    _scheduler = "slurm"

    def _describe(self) -> dict[str, Any]:
        info = self.query()
        row: dict[str, Any] = {"id": self._slurm_job_id or "", "hosts": len(self._hosts)}
        if info is None:
            row["state"] = "gone"
            return row
        row["state"] = info.state if info.reason in ("", "None") else f"{info.state} ({info.reason})"
        if info.time_limit_min is not None and info.start_time and info.state == "RUNNING":
            row["walltime_left_s"] = info.start_time + 60 * info.time_limit_min - time.time()
        if info.state == "RUNNING" and self._hosts:
            # lost: a node Slurm marks down or not responding, or whose allocator does not answer
            # (Slurm notices a cut link only after SlurmdTimeout; the allocator's port at once)
            down = nodes_down([h["name"] for h in self._hosts])
            live = answering([h["tcp"] for h in self._hosts], self._key_path())
            lost = sorted(h["name"] for h in self._hosts if h["name"] in down or h["tcp"] not in live)
            row["lost"] = lost
            row["lost_addrs"] = {h["name"]: h["tcp"] for h in self._hosts if h["name"] in lost}
            # the sidebar asks the live allocators only: a dead one would make every poll wait for it
            row["addrs"] = [h["tcp"] for h in self._hosts if h["name"] not in lost]
            if lost:
                row["state"] = f"RUNNING, lost: {', '.join(f'{n} ({down[n]})' if n in down else n for n in lost)}"
        return row

    def add_mesh(self, name: str, num_nodes: int) -> None:
        self._meshes[name] = mesh_size("SlurmJob", name, num_nodes, "nodes")

    def _spec(self) -> dict[str, Any]:
        return {
            "meshes": dict(self._meshes),
            "python_exe": self._python_exe,
            "slurm_args": list(self._slurm_args),
            "monarch_port": self._port,
            "job_name": self._job_name,
            "ntasks_per_node": self._ntasks_per_node,
            "time_limit": self._time_limit,
            "partition": self._partition,
            "log_dir": self._log_dir,
            "exclusive": self._exclusive,
            "gpus_per_node": self._gpus_per_node,
            "cpus_per_task": self._cpus_per_task,
            "mem": self._mem,
            "job_start_timeout": self._job_start_timeout,
            "account": self._account,
            "qos": self._qos,
            "announce_timeout": self._announce_timeout,
        }

    def _runtime(self) -> dict[str, Any]:
        return {"job_id": self._slurm_job_id, "dir": self._dir, "hosts": self._hosts}

    def _load_runtime(self, data: dict[str, Any]) -> None:
        self._slurm_job_id = data.get("job_id")
        self._dir = data.get("dir", "")
        self._hosts = list(data.get("hosts") or [])

    def _host_addrs(self) -> list[str]:
        return [h["tcp"] for h in self._hosts]

    def _key_path(self) -> str:
        return os.path.join(self._dir, "key") if self._dir else ""

    @property
    def job_id(self) -> str | None:
        """Slurm's id of the submitted job."""
        return self._slurm_job_id

    # ------------------------------------------------------------ the sbatch script
    def _num_nodes(self) -> int:
        return sum(self._meshes.values())

    def batch_script(
        self, job_dir: str = "<job dir>", controller_ip: str = "<controller ip>", client_script: str | None = None
    ) -> str:
        """The sbatch script this job submits (every argument shows in it).

        With ``client_script`` (batch mode) the allocators run as a background step and the
        script runs on the batch host as the job's controller; the job ends with it.
        """
        n = self._num_nodes()
        out = os.path.join(self._log_dir, f"slurm_%j_{self._job_name}.out")
        err = os.path.join(self._log_dir, f"slurm_%j_{self._job_name}.err")
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={self._job_name}",
            f"#SBATCH --nodes={n}",
            f"#SBATCH --ntasks-per-node={self._ntasks_per_node}",
            f"#SBATCH --output={out}",
            f"#SBATCH --error={err}",
        ]
        if self._time_limit is not None:
            lines.append(f"#SBATCH --time={self._time_limit}")
        if self._gpus_per_node is not None:
            lines.append(f"#SBATCH --gpus-per-node={self._gpus_per_node}")
        if self._cpus_per_task is not None:
            lines.append(f"#SBATCH --cpus-per-task={self._cpus_per_task}")
        if self._mem is not None:
            lines.append(f"#SBATCH --mem={self._mem}")
        if self._exclusive:
            lines.append("#SBATCH --exclusive")
        if self._partition is not None:
            lines.append(f"#SBATCH --partition={self._partition}")
        if self._account is not None:
            lines.append(f"#SBATCH --account={self._account}")
        if self._qos is not None:
            lines.append(f"#SBATCH --qos={self._qos}")
        lines += [f"#SBATCH {a}" for a in self._slurm_args]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(forwarded_config().items())]
        # node-local: ipc sockets and proc logs of each node's allocator. Its name is not the job
        # id's alone: squeue shows that to every user, who could make the folder on a node first
        # and have the allocator there refuse to start (a folder of another uid)
        lines.append(f'export MONARCH_NB_RUNTIME_DIR="${{TMPDIR:-/tmp}}/mnb-slurm-$SLURM_JOB_ID-{secrets.token_hex(8)}"')
        allocator = [
            self._python_exe,
            "-m",
            "monarch_nb",
            "allocator",
            "--bind",
            f"tcp://route:{controller_ip}:{self._port}",
            "--key-file",
            os.path.join(job_dir, "key"),
            "--announce-dir",
            os.path.join(job_dir, "announce"),
            "--exit-on-lease",
        ]
        # one allocator per node, whatever ntasks_per_node reserved: the procs per node are
        # spawn_procs(per_host=...)'s business
        srun = f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --kill-on-bad-exit=0 " + shlex.join(allocator)
        if client_script is None:
            lines.append(f"exec {srun}")
        else:
            lines += [
                f"{srun} &",
                "step=$!",
                # the client's job.state() attaches to this allocation, not to a new one
                f"export {BATCH_ENV}={shlex.quote(os.path.join(job_dir, 'job.json'))}",
                f"{shlex.quote(self._python_exe)} {shlex.quote(os.path.abspath(client_script))}",
                "rc=$?",
                'kill "$step" 2>/dev/null; wait "$step"',
                'exit "$rc"',
            ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------ squeue
    def query(self) -> SlurmJobInfo | None:
        """What squeue says about this job now (None once Slurm forgot it)."""
        if self._slurm_job_id is None:
            return None
        return squeue(self._slurm_job_id)

    # ------------------------------------------------------------ the job
    def _create(self, client_script: str | None) -> None:
        if client_script is not None and not os.path.isfile(client_script):
            raise FileNotFoundError(f"client_script {client_script!r} does not exist")
        # asked first: a machine with no Slurm cluster fails here, before a key is written to disk
        ip = controller_ip()
        os.makedirs(self._log_dir, exist_ok=True)
        jobs = os.path.join(self._log_dir, ".monarch_nb-jobs")
        job_dir = os.path.join(jobs, f"{self._job_name}-{self._apply_id[:8]}")  # type: ignore[index]
        # log_dir is shared (with the nodes, so often with other users): a .monarch_nb-jobs
        # another user made first, or a link of theirs there, would let them move the job's
        # folder (its key, its announcements) or point it elsewhere after it was made
        check_path_to(
            job_dir,
            "the job's folder",
            f"it holds the job's cluster key; pass SlurmJob(log_dir=...) a folder of your own, or remove {jobs}",
            trusted=self._log_dir,
        )
        records.make_private_dir(jobs)  # 0700 whatever the umask: job names are nobody else's business
        self._dir = records.make_private_dir(job_dir)
        write_key_file(os.path.join(self._dir, "key"), held_key())
        records.make_private_dir(os.path.join(self._dir, "announce"))
        if client_script is not None:
            # what the client, inside the allocation, attaches to (its job id comes from Slurm)
            record = self._to_json()
            record.update(running=True, apply_id=self._apply_id, started=self._started, runtime=self._runtime())
            records.write_json(os.path.join(self._dir, "job.json"), record)
        script = self.batch_script(self._dir, ip, client_script)
        try:
            cp = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise JobError("sbatch was not found: run this on a Slurm login node (slurm-client installed)") from None
        if cp.returncode != 0:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise JobError(f"sbatch refused the job: {cp.stderr.strip()}")
        self._slurm_job_id = cp.stdout.strip().split(";")[0]
        logger.info("submitted Slurm job %s (%d nodes)", self._slurm_job_id, self._num_nodes())
        if client_script is not None:
            logger.info("batch mode: %s runs inside job %s; %s", client_script, self._slurm_job_id, self._logs_hint())
            return
        self._submitted()
        self._wait_or_cancel()

    def _wait_or_cancel(self) -> None:
        try:
            self._wait_started()
        except KeyboardInterrupt:
            job_id = self._slurm_job_id
            self._kill()
            # the cell shows only "KeyboardInterrupt": say the job did not stay in the queue
            print(f"Slurm job {job_id} cancelled: interrupted before it started", file=sys.stderr, flush=True)
            raise
        except BaseException:
            self._kill()
            raise

    def _wait_started(self) -> None:
        job_id = self._slurm_job_id
        start = time.monotonic()
        last_reason = None
        delay = 0.1
        asked = ""
        while True:
            try:
                info = self.query()
            except JobError as e:
                # slurmctld restarting (or busy) while the job waits: the job is still queued, so
                # keep waiting, as for a pending job; say so once
                if str(e) != asked:
                    print(f"{e}; still waiting (interrupt to stop)", file=sys.stderr, flush=True)
                    asked = str(e)
                if self._job_start_timeout is not None and time.monotonic() - start > self._job_start_timeout:
                    raise
                time.sleep(delay)  # polling the scheduler
                delay = min(delay * 1.5, 2.0)
                continue
            if info is None:
                raise JobError(f"Slurm job {job_id} disappeared from the queue before it started")
            if info.state == "RUNNING":
                break
            if info.state in TERMINAL:
                raise JobError(f"Slurm job {job_id} ended ({info.state}, {info.reason}) before it started; {self._logs_hint()}")
            if info.state == "PENDING" and info.reason != last_reason:
                # shown live in the cell: why the allocation is not there yet. At once, also before
                # Slurm gives a reason: on a busy slurmctld "None" lasted the whole of a 110 s wait,
                # and the cell said nothing of the job it waited for
                why = _explain(info.reason) if info.reason not in ("", "None") else _NO_REASON_YET
                print(
                    f"Slurm job {job_id} pending: {why} (waiting for it to start; interrupt to cancel it)",
                    file=sys.stderr,
                    flush=True,
                )
                last_reason = info.reason
            if self._job_start_timeout is not None and time.monotonic() - start > self._job_start_timeout:
                raise JobError(
                    f"Slurm job {job_id} did not start within job_start_timeout={self._job_start_timeout} s "
                    f"(state {info.state}, reason {info.reason}); it was cancelled"
                )
            time.sleep(delay)  # polling the scheduler; squeue has no way to wait
            delay = min(delay * 1.5, 2.0)
        nodes = info.node_names
        n = self._num_nodes()
        announce = os.path.join(self._dir, "announce")

        def ended() -> str | None:
            now = self.query()
            if now is None or now.state in TERMINAL:
                return f"Slurm job {job_id} ended ({now.state if now else 'gone'}) while its nodes started; {self._logs_hint()}"
            return None

        try:
            got = wait_announced(announce, set(nodes) if len(nodes) == n else n, self._announce_timeout, ended, what="node")
        except JobError as e:
            raise JobError(f"Slurm job {job_id} is running on {info.nodes}, but {e}; {self._logs_hint()}") from None
        order = {name: i for i, name in enumerate(nodes)}
        hosts = sorted(got.values(), key=lambda a: (int(a["scheduler"].get("SLURM_NODEID", 1 << 30)), order.get(a["name"], 0)))
        self._hosts = [{"name": a["name"], "tcp": a["tcp"], "pid": a["pid"]} for a in hosts]

    def _enter_batch(self) -> None:
        """Inside our own allocation (batch mode): find its allocators."""
        self._slurm_job_id = os.environ.get("SLURM_JOB_ID") or self._slurm_job_id
        if not self._hosts:
            self._wait_started()

    def _in_own_batch(self) -> bool:
        return bool(os.environ.get(BATCH_ENV)) and os.environ.get("SLURM_JOB_ID") == self._slurm_job_id

    def _logs_hint(self) -> str:
        return f"see {os.path.join(self._log_dir, f'slurm_{self._slurm_job_id}_{self._job_name}.err')}"

    def _state(self) -> dict[str, HostMesh]:
        if not self._hosts and not self._in_own_batch():
            # recorded while queued by a kernel that then went away: wait for it here
            info = self.query()
            if info is not None and info.state in ("PENDING", "CONFIGURING", "RUNNING"):
                self._wait_or_cancel()
        info = self.query()
        if info is None or info.state != "RUNNING":
            if info is None:
                state = "no longer known to Slurm"
            else:
                state = info.state if info.reason in ("", "None") else f"{info.state} ({_explain(info.reason)})"
            raise JobError(f"Slurm job {self._slurm_job_id} is {state}: its allocators are gone; kill() it and apply again")
        out: dict[str, list[str]] = {}
        i = 0
        for name, count in self._meshes.items():
            out[name] = [h["tcp"] for h in self._hosts[i : i + count]]
            i += count
        return host_meshes(out, os.path.join(self._dir, "key"))

    def can_run(self, spec: JobTrait) -> bool:
        # where logs go and how long to wait do not change what the allocation is
        loose = ("log_dir", "announce_timeout", "job_start_timeout")
        mine = {k: v for k, v in self._spec().items() if k not in loose}
        if not isinstance(spec, SlurmJob) or {k: v for k, v in spec._spec().items() if k not in loose} != mine:
            return False
        info = self.query()
        # a job recorded while queued (no hosts yet) is waited for, not replaced
        return info is not None and (info.state == "RUNNING" or (not self._hosts and info.state in ("PENDING", "CONFIGURING")))

    def _replaced_why(self, was: dict[str, Any], cached_path: str) -> str | None:
        info = self.query()
        if info is None or not self._hosts:
            return None
        nodes = ", ".join(h["name"] for h in self._hosts)
        if info.state == "NODE_FAIL":
            what = f"Slurm job {self._slurm_job_id} ended when a node of it failed (NODE_FAIL)"
        elif info.state in ACTIVE and info.state != "RUNNING" and (info.restarts or info.state == "REQUEUED"):
            # its batch script would run again with new allocators, announced to nobody
            what = (
                f"Slurm requeued job {self._slurm_job_id} (restart {info.restarts}, now {was.get('state')}): a node of it "
                "failed (or someone ran `scontrol requeue`)"
            )
        else:
            return None
        return (
            f"{what}; its allocators and every proc on {nodes} were gone with it, so the job cached at {cached_path} "
            "was cancelled and job {new} submitted in its place. Spawn your proc meshes again on the new job's hosts "
            "(state.<mesh>.spawn_procs(...)): what the old procs held in memory is lost (resume from a checkpoint)"
        )

    def _kill(self) -> None:
        if self._in_own_batch():
            # the batch script ends the allocation when the client exits; cancelling it here
            # would kill the client itself
            logger.info("kill() inside batch job %s: the job ends when this script does", self._slurm_job_id)
            return
        job_id = self._slurm_job_id
        if job_id is not None:
            cp = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
            if cp.returncode != 0 and "Invalid job id" not in cp.stderr:
                raise JobError(f"scancel {job_id} failed: {cp.stderr.strip()}")
            # gone once Slurm says the job ended: its step (the allocators) was killed by then
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = self.query()
                if info is None or info.state in TERMINAL:
                    break
                time.sleep(0.1)  # polling the scheduler
            else:
                raise JobError(f"Slurm job {job_id} did not end within 60 s of scancel")
            self._stop_unreached()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._slurm_job_id = None
        self._hosts = []

    def _stop_unreached(self) -> None:
        """Stop the allocators scancel could not reach: on a node whose slurmd died (Slurm marks
        it down) the step's processes live on after the job ended, holding the node's procs (and
        GPUs) until their lease; the allocator itself still answers, so it is asked to stop."""
        down = nodes_down([h["name"] for h in self._hosts])
        if not down:
            return
        addrs = answering([h["tcp"] for h in self._hosts if h["name"] in down], self._key_path())
        left = [h for h in self._hosts if h["tcp"] in addrs]
        if not left:
            return
        names = ", ".join(f"{h['name']} ({down[h['name']]}, allocator pid {h['pid']})" for h in left)
        logger.info("Slurm job %s ended, but its allocators on %s did not: stopping them", self._slurm_job_id, names)
        try:
            hosts = host_meshes({"unreached": [h["tcp"] for h in left]}, self._key_path())["unreached"]
            hosts.shutdown().get(timeout=30)
        except Exception as e:
            raise JobError(
                f"Slurm job {self._slurm_job_id} ended, but Slurm could not stop its allocators on {names}, "
                f"and asking them failed ({e}); kill those pids on their nodes, or they exit after their lease "
                "(MONARCH_NB_LEASE); kill() again retries"
            ) from None


_NEVER = "it may never start as asked: interrupt, and ask for"
_REASONS = {
    "TimeLimit": "TimeLimit: its time_limit ran out",
    "NodeDown": "NodeDown: a node of the job failed",
    "NodeFail": "NodeFail: a node of the job failed",
    # pending reasons Slurm keeps for good unless the partition changes (EnforcePartLimits=NO,
    # Slurm's default, queues such a job instead of refusing it at sbatch)
    "PartitionNodeLimit": f"PartitionNodeLimit: more nodes than the partition allows or has up; {_NEVER} fewer nodes or another partition",
    "PartitionTimeLimit": f"PartitionTimeLimit: a time_limit over the partition's MaxTime; {_NEVER} less time or another partition",
    "PartitionConfig": "PartitionConfig: the request does not fit the partition's limits (nodes, time, account)",
    "BeginTime": "BeginTime: Slurm requeued it after a node failure, or it has a start time",
}


#: a pending job's reason before the scheduler has looked at it (squeue's "None")
_NO_REASON_YET = "no reason from Slurm yet (its scheduler has not looked at the job)"


def _explain(reason: str) -> str:
    return _REASONS.get(reason, reason)


def squeue(job_id: str) -> SlurmJobInfo | None:
    """One job's state from squeue: JSON when the plugin is there, text otherwise."""
    try:
        cp = subprocess.run(["squeue", "--json"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise JobError("squeue was not found: run this on a Slurm login node (slurm-client installed)") from None
    if cp.returncode == 0 and cp.stdout.lstrip().startswith("{"):
        try:
            # 22.05 ignores -j/-t with --json: every job comes back, and we pick ours
            return parse_squeue_json(cp.stdout, job_id)
        except ValueError:
            pass
    cp = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", TEXT_FORMAT], capture_output=True, text=True, timeout=60)
    if cp.returncode != 0:
        if "Invalid job id" in cp.stderr:
            return None
        raise JobError(f"squeue failed: {cp.stderr.strip()}")
    return parse_squeue_text(cp.stdout, job_id)


#: node states (sinfo's long names, lower case) in which a node no longer runs its jobs' work
#: ("unknown" is not one: every node is unknown for a moment after slurmctld restarts, until its
#: slurmd registers again; the allocator's own answer then tells)
_LOST_STATES = {"down", "fail", "failing", "not_responding", "no_respond"}


def parse_sinfo_nodes(text: str) -> dict[str, str]:
    """The nodes of ``sinfo -h -N -o '%N|%T'`` output that are lost, with their state: down,
    failed, or not responding (sinfo's ``*`` suffix, as in ``allocated*``)."""
    out = {}
    for line in text.splitlines():
        name, sep, state = line.strip().partition("|")
        state = state.strip().lower()
        if not sep or not name:
            continue
        base = state.rstrip("*~#!%$@^-+").split("+")[0]
        if state.endswith("*") or base in _LOST_STATES:
            out[name] = state
    return out


def nodes_down(names: list[str]) -> dict[str, str]:
    """Which of ``names`` Slurm says are down or not responding (node -> its state); empty when
    sinfo cannot be asked (the allocators' own answers still tell a lost host)."""
    try:
        cp = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_sinfo_nodes(cp.stdout) if cp.returncode == 0 else {}


def controller_ip() -> str:
    """This controller's address on the cluster's network: the one it uses to reach slurmctld
    (the nodes bind the address they use to reach it, so controller and nodes agree)."""
    try:
        cp = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise JobError("scontrol was not found: run this on a Slurm login node (slurm-client installed)") from None
    except subprocess.TimeoutExpired:
        # a slurm.conf that is missing makes scontrol retry for a minute
        raise JobError(
            "`scontrol show config` did not answer within 30 s (is SLURM_CONF a file that exists?): "
            "run the controller on a login node of the cluster, where sbatch and squeue work"
        ) from None
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", cp.stdout, re.M)
    if m is None and "Unable to contact slurm controller" in cp.stderr:
        # a configured cluster whose slurmctld is down or restarting: not a laptop
        raise JobError(
            f"the Slurm controller did not answer (`scontrol show config`: {cp.stderr.strip().splitlines()[-1]}): "
            "is slurmctld up? Try again once it answers"
        )
    if m is None and cp.returncode != 0:
        # slurm-client without a slurm.conf (or a DNS SRV record) for a cluster: a laptop, say
        said = cp.stderr.strip().splitlines()
        raise JobError(
            "this machine is not set up for a Slurm cluster (`scontrol show config` failed: "
            f"{said[-1] if said else f'exit code {cp.returncode}'}): run the controller on a login node of "
            "the cluster, where sbatch and squeue work"
        )
    if m is None:
        raise JobError(f"cannot find SlurmctldHost in `scontrol show config`: {cp.stderr.strip() or cp.stdout[:200]}")
    target = m.group(2) or m.group(1)
    import socket

    try:
        addr = socket.gethostbyname(target)
    except OSError as e:
        raise JobError(f"cannot resolve the Slurm controller host {target!r}: {e}") from None
    ip = route_ip(addr)
    if ip.startswith("127.") and not addr.startswith("127."):
        raise JobError(f"no route from this host to the Slurm controller at {addr}")
    return ip
