"""A real Slurm cluster on network-namespace hosts, for tests (TOOLCHAIN-cluster.md, 1-4).

`SlurmCluster(n)` builds ``n + 1`` hosts with their own hostnames: ``ctl`` runs munged and
slurmctld (and the test's controller scripts, as a login node would), ``n1..nN`` each run a
slurmd. Debian's daemons (apt: slurmctld slurmd slurm-client munge), by absolute path. Files
every host must see (slurm.conf, the munge socket, job logs, a job's directory) live in
`shared`, a directory under /var/tmp (hosts have private /tmp, /dev/shm and /run).

Missing daemons fail the test (they are part of the suite's environment: .ci/setup installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _netns import NetnsCluster

MUNGED = "/usr/sbin/munged"
MUNGEKEY = "/usr/sbin/mungekey"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
START_TIMEOUT = 30.0

_CONF = """\
ClusterName=mnbtest
SlurmctldHost=ctl({ctl_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={shared}/munge/munge.socket.2
StateSaveLocation=/tmp/slurm/ctld
SlurmdSpoolDir=/tmp/slurm/d
SlurmctldPidFile=/tmp/slurm/slurmctld.pid
SlurmdPidFile=/tmp/slurm/slurmd.pid
SlurmctldLogFile={shared}/log/slurmctld.log
SlurmdLogFile={shared}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
MinJobAge=30
KillWait=5
OverTimeLimit=0
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


def missing_tools() -> list[str]:
    return [p for p in (MUNGED, MUNGEKEY, SLURMCTLD, SLURMD, "/usr/bin/sbatch", "/usr/bin/squeue") if not os.path.exists(p)]


class SlurmCluster:
    """munged + slurmctld on host 0 ("ctl"), a slurmd on each of hosts 1..n ("n1".."nN")."""

    def __init__(self, n_nodes: int = 3, cpus: int = 4) -> None:
        missing = missing_tools()
        if missing:
            raise RuntimeError(f"Slurm/munge binaries missing: {missing}; run .ci/setup (apt-get install slurmctld slurmd munge)")
        self.n_nodes = n_nodes
        self.nodes = [f"n{i}" for i in range(1, n_nodes + 1)]
        self.shared = tempfile.mkdtemp(prefix="mnb-slurm-", dir="/var/tmp")
        os.chmod(self.shared, 0o755)  # munged wants every directory above its socket searchable
        self.net: NetnsCluster | None = None
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        try:
            self._start(cpus)
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> str:
        return os.path.join(self.shared, "slurm.conf")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every command on the cluster's hosts."""
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "SLURM_CONF": self.conf,
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(extra)
        return env

    def _start(self, cpus: int) -> None:
        shared = self.shared
        for d in ("log", "munge", "jobs"):
            os.makedirs(os.path.join(shared, d), exist_ok=True)
        os.chmod(os.path.join(shared, "jobs"), 0o700)
        self.net = net = NetnsCluster(self.n_nodes, hostnames=["ctl", *self.nodes], private_dirs=("/tmp", "/dev/shm", "/run"))
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={net.ip(i + 1)} CPUs={cpus} RealMemory=4000 State=UNKNOWN"
            for i, name in enumerate(self.nodes)
        )
        Path(self.conf).write_text(_CONF.format(ctl_ip=net.ip(0), shared=shared, nodes=nodes, node_names=",".join(self.nodes)))
        munge = os.path.join(shared, "munge")
        os.chmod(munge, 0o755)
        subprocess.run([MUNGEKEY, "--create", f"--keyfile={munge}/munge.key"], check=True, capture_output=True)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(f"{munge}/munge.key", "munge", "munge")
        env = self.env()
        self.daemons["munged"] = net.popen(
            0,
            [
                "/usr/sbin/runuser",
                "-u",
                "munge",
                "--",
                MUNGED,
                "--foreground",
                f"--socket={munge}/munge.socket.2",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(shared, "log", "munged.out"), "wb"),
        )
        self._wait(lambda: os.path.exists(f"{munge}/munge.socket.2"), "munged's socket", "munged")
        net.run(0, ["mkdir", "-p", "/tmp/slurm/ctld"], check=True)
        self.daemons["slurmctld"] = net.popen(
            0,
            [SLURMCTLD, "-D", "-i"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(shared, "log", "slurmctld.out"), "wb"),
        )
        for i, name in enumerate(self.nodes, start=1):
            net.run(i, ["mkdir", "-p", "/tmp/slurm/d"], check=True)
            self.daemons[f"slurmd-{name}"] = net.popen(
                i,
                [SLURMD, "-D"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(shared, "log", f"slurmd-{name}.out"), "wb"),
            )
        self._wait(lambda: self.sinfo() == f"idle {self.n_nodes}", f"{self.n_nodes} idle nodes", "slurm")

    def stop_slurmctld(self) -> None:
        """Stop slurmctld (SIGTERM; its state stays in the host's StateSaveLocation)."""
        p = self.daemons.pop("slurmctld")
        p.terminate()
        p.wait(timeout=30)

    def start_slurmctld(self) -> None:
        """Start slurmctld again on its saved state (the jobs it knew go on); returns once it answers."""
        assert self.net is not None
        self.daemons["slurmctld"] = self.net.popen(
            0,
            [SLURMCTLD, "-D"],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.shared, "log", "slurmctld.out"), "ab"),
        )
        self._wait(lambda: bool(self.sinfo()), "slurmctld to answer", "slurmctld")

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL one node's slurmd (its job steps' processes live on, as on a real node whose
        slurmd crashed); start_slurmd brings it back."""
        p = self.daemons.pop(f"slurmd-{name}")
        p.kill()
        p.wait(timeout=30)

    def start_slurmd(self, name: str) -> None:
        """Start a node's slurmd again; returns once every node is idle."""
        assert self.net is not None
        self.daemons[f"slurmd-{name}"] = self.net.popen(
            self.nodes.index(name) + 1,
            [SLURMD, "-D"],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.shared, "log", f"slurmd-{name}.out"), "ab"),
        )
        self._wait(lambda: self.sinfo() == f"idle {self.n_nodes}", f"{self.n_nodes} idle nodes", "slurm")

    def _wait(self, pred: Any, what: str, log: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not pred():
            dead = self.dead_daemons()
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: daemons dead {dead}; logs:\n{self.logs()}")
            time.sleep(0.05)  # polling daemons that have no readiness signal

    def sinfo(self) -> str:
        assert self.net is not None
        cp = self.net.run(0, ["sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True, env=self.env(), timeout=30)
        return cp.stdout.strip()

    def dead_daemons(self) -> list[str]:
        return [name for name, p in self.daemons.items() if p.poll() is not None]

    def assert_alive(self) -> None:
        """Every daemon (munged, slurmctld, each slurmd) is still running."""
        dead = self.dead_daemons()
        assert not dead, f"Slurm daemons died: {dead}\n{self.logs()}"

    def logs(self) -> str:
        out = []
        for p in sorted(Path(self.shared, "log").glob("*")):
            try:
                out.append(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}")
            except OSError:
                pass
        return "\n".join(out)

    def squeue(self) -> str:
        assert self.net is not None
        return self.net.run(0, ["squeue", "-h"], capture_output=True, text=True, env=self.env()).stdout

    def close(self) -> None:
        """Stop slurmd, then slurmctld, then munged (G11), then the hosts; remove the shared dir."""
        for group in (
            [n for n in self.daemons if n.startswith("slurmd-")],
            ["slurmctld"],
            ["munged"],
        ):
            procs = [self.daemons[n] for n in group if n in self.daemons]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.shared, ignore_errors=True)
