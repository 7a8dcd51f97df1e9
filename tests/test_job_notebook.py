"""The cells of notebooks/07_cluster.ipynb on the test Slurm cluster, in a real kernel on the login
node, with a kernel restart (jupyter_client) in the middle: the new kernel re-attaches to the job
and to the same procs, whose actors kept their state."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jupyter_client
import nbformat
import pytest
from conftest import wait_for
from jupyter_client.kernelspec import KernelSpecManager

sys.path.insert(0, str(Path(__file__).parent))
from _jobhelp import PY
from _kernel import Kernel
from _slurm import SlurmCluster

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "07_cluster.ipynb"


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    c = SlurmCluster(2)
    try:
        yield c
        c.assert_alive()
    finally:
        c.close()


class LoginNodeKernel(Kernel):
    """An IPython kernel on the cluster's host 0, reached over ipc sockets in the shared directory
    (the host's loopback is not reachable from the test's namespace; files are)."""

    def __init__(self, c: SlurmCluster) -> None:
        assert c.net is not None
        spec_dir = Path(c.shared, "kernels", "mnb-login")
        spec_dir.mkdir(parents=True, exist_ok=True)
        argv = c.net.wrap(0, [PY, "-m", "ipykernel_launcher", "-f", "{connection_file}"], cwd="/")
        (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "login", "language": "python"}))
        runtime = Path(c.shared, "jupyter")
        runtime.mkdir(exist_ok=True)
        ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
        self.km = jupyter_client.KernelManager(
            kernel_name="mnb-login",
            kernel_spec_manager=ksm,
            transport="ipc",
            connection_file=str(runtime / "kernel.json"),
            ip=str(runtime / "k"),
        )
        env = c.env(
            MONARCH_NB_RUNTIME_DIR="/tmp/mnb",
            MONARCH_NB_ZYGOTE_PRELOAD="",
            MONARCH_NB_HEARTBEAT_INTERVAL="0.2",
            MONARCH_NB_HEARTBEAT_TIMEOUT="1.5",
            JUPYTER_RUNTIME_DIR=str(runtime),
        )
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.log = []
        self._ok(self.run("%load_ext monarch_nb"))

    @staticmethod
    def _ok(cell):
        assert cell.error is None, "\n".join(cell.error["traceback"]) if cell.error else ""
        return cell

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)
        self._ok(self.run("%load_ext monarch_nb"))


def _cells() -> list[str]:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_notebook_cells_on_slurm_with_a_kernel_restart(slurm: SlurmCluster) -> None:
    log_dir = os.path.join(slurm.shared, "jobs")
    slurm_job = f'SlurmJob(meshes={{"trainers": 2}}, python_exe={PY!r}, log_dir={log_dir!r}, monarch_port=0, exclusive=False)'
    cells = [
        src.replace("from monarch_nb.job import ProcessJob", "from monarch_nb.job import SlurmJob").replace(
            'ProcessJob({"trainers": 2})', slurm_job
        )
        for src in _cells()
    ]
    setup, train, show, reattach, _check, kill = cells
    k = LoginNodeKernel(slurm)
    try:
        assert k._ok(k.run("import socket; socket.gethostname()")).result == "'ctl'"  # the login node
        assert k._ok(k.run(setup, timeout=120)).result == "{hosts: 2}"
        k._ok(k.run(train, timeout=120))
        first = k._ok(k.run(show)).result
        assert first.startswith("ValueMesh({hosts: 2, gpus: 2})"), first
        pids = k._ok(k.run("sorted(p.pid for p in procs._procs)")).result
        job_id = k._ok(k.run("job.job_id")).result

        k.restart()
        # the new kernel has nothing but the cells it runs: the job spec, and the re-attach cell
        assert k._ok(k.run(setup, timeout=120)).result == "{hosts: 2}"
        k._ok(k.run(reattach, timeout=120))
        assert k._ok(k.run("again.apply_id == job.apply_id")).result == "True"
        assert k._ok(k.run("job._running.job_id")).result == job_id
        assert k._ok(k.run("sorted(p.pid for p in procs2._procs)")).result == pids
        losses2 = k._ok(k.run("losses2")).result
        assert _loss(losses2) < _loss(first), (first, losses2)  # the actors kept training, not restarted
        assert k._ok(k.run(kill, timeout=120)).result == "False"
    finally:
        k.close()
    wait_for(lambda: not slurm.squeue().strip(), 60, "the job to leave the queue")


def _loss(valuemesh_repr: str) -> float:
    return float(re.findall(r", ([0-9.e-]+)\)", valuemesh_repr)[0])
