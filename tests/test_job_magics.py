"""%mesh launch | jobs | kill and `monarch-nb job` through a real kernel (jupyter_client): a job
launched in one kernel is re-attached by name from the next one (a kernel restart), with its procs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._kernel import Kernel

pytestmark = pytest.mark.timeout(180)
# the kernel's settings reach the allocators it launches: a short lease ends what a failed test leaves
FAST = {"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"}


def _ok(c):
    assert c.error is None, "\n".join(c.error["traceback"]) if c.error else ""
    return c


def test_launch_jobs_restart_reattach_kill() -> None:
    try:
        _launch_jobs_restart_reattach_kill()
    finally:
        from monarch_nb.job import list_jobs

        if any(r["name"] == "work" for r in list_jobs()):  # the test failed before %mesh kill
            subprocess.run([sys.executable, "-m", "monarch_nb", "job", "kill", "work"], capture_output=True, timeout=60)


def _launch_jobs_restart_reattach_kill() -> None:
    k = Kernel(env=FAST)
    try:
        c = _ok(k.run("%mesh launch process work --hosts 2"))
        assert "work: 2 host(s)" in c.stream(), c.msgs
        assert "HostMesh(extent={hosts: 2}" in _ok(k.run("work")).result
        _ok(k.run("procs = work.spawn_procs(per_host={'gpus': 2}, name='wp')\npids = sorted(p.pid for p in procs._procs)"))
        pids = _ok(k.run("pids")).result
        table = _ok(k.run("%mesh jobs")).result
        row = next(line for line in table.splitlines() if line.startswith("work"))
        assert re.search(r"work\s+process\s+([0-9a-f]{8})\s+running\s+2\s", row), table
        job_id = row.split()[2]
        for code, text in [
            ("%mesh launch slurm x --ssh-arg=-v", "does not apply to slurm"),
            ("%mesh kill nosuchjob", "no job named 'nosuchjob'"),
            ("%mesh launch k8s x", "not inside a pod"),  # no kubeconfig, no service account
        ]:
            bad = k.run(code)
            assert bad.reply["content"]["status"] == "error", code
            assert text in bad.stream("stderr") + str(bad.error), (code, bad.msgs)
    finally:
        k.close()

    k = Kernel(env=FAST)  # a new kernel, as after a restart
    try:
        c = _ok(k.run("%mesh launch process work --hosts 2"))
        assert "work: 2 host(s)" in c.stream()
        table = _ok(k.run("%mesh jobs")).result
        assert job_id in table, (job_id, table)  # re-attached, not applied again
        again = _ok(k.run("from monarch_nb.actor import ProcMesh\nsorted(p.pid for p in ProcMesh.lookup('wp', work)._procs)"))
        assert again.result == pids
        out = subprocess.run([sys.executable, "-m", "monarch_nb", "job", "status"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and re.search(rf"work\s+process\s+{job_id}\s+running", out.stdout), out
        # another shape under the same name replaces the job, and says so
        c = _ok(k.run("%mesh launch process work --hosts 3"))
        said = c.stream().splitlines()
        assert said[0].startswith(f"work: replaced the ProcessJob {job_id} cached at ") and said[1].startswith(
            "work: 3 host(s)"
        ), said
        assert "so it was stopped with every proc on its hosts" in said[0] and not c.stream("stderr"), c.msgs
        c = _ok(k.run("%mesh kill work"))
        assert "killed job work" in c.stream()
        assert "no jobs" in _ok(k.run("%mesh jobs")).result or "work" not in _ok(k.run("%mesh jobs")).result
    finally:
        k.close()
    for pid in map(int, re.findall(r"\d+", pids)):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
