"""What a notebook shows of a job's meshes (`%mesh status`, `monarch_nb.status()`, `%mesh stop`),
from the kernel that made them and from another one, against `monarch-nb status` / `stop`: a
job's allocators keep their records in the job's own directory, not this runtime directory."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _kernel import Cell, Kernel

from monarch_nb.job import job_load, kill_job, list_jobs, named_job_path

pytestmark = pytest.mark.timeout(90)

FAST = {"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"}
LOST = "unreachable +lost: its allocator does not answer"


def _ok(c: Cell) -> Cell:
    assert c.error is None, "\n".join(c.error["traceback"]) if c.error else ""
    return c


def _kill_host(job: str) -> str:
    """SIGKILL the second host's allocator of ProcessJob ``job``: its host is lost; returns its name."""
    slot, info = sorted(job_load(named_job_path(job))._hosts.items())[1]
    os.kill(int(info["pid"]), signal.SIGKILL)
    return slot


def _kill_job(name: str) -> None:
    if any(r["name"] == name for r in list_jobs()):
        kill_job(name)


_SPAWN = """
import os
from monarch_nb.job import ProcessJob, named_job_path
state = ProcessJob({"w": 2}, env=%r).state(cached_path=named_job_path("nbother"))
for name in ("nbo1", "nbo2"):
    state.w.spawn_procs(per_host={"gpus": 1}, name=name, persist=True)
os._exit(0)  # the script is gone; its persistent meshes stay
"""


def test_another_kernel_lists_and_stops_a_jobs_mesh_and_names_its_lost_host() -> None:
    """`%mesh status` and `monarch_nb.status()` read this runtime directory's allocators only: a
    job's meshes, which `monarch-nb status` lists under the job, were not there at all, and
    `%mesh stop NAME` said "no mesh named ... spawn it or `%mesh connect`", though `monarch-nb
    stop NAME` stopped it. A lost host of the job was not named either."""
    subprocess.run([sys.executable, "-c", _SPAWN % FAST], check=True, timeout=60)
    k = None
    try:
        k = Kernel(env=FAST)
        table = _ok(k.run("%mesh status")).result
        assert table.splitlines()[0].split()[:3] == ["job", "host", "allocator"], table
        for name in ("nbo1", "nbo2"):
            rows = [ln for ln in table.splitlines() if f" {name} (persistent) " in ln]
            assert len(rows) == 2 and all(ln.startswith("nbother ") for ln in rows), table
        got = _ok(
            k.run(
                "import monarch_nb\nprint(sorted({(a['job']['name'], m['name']) for a in monarch_nb.status()['allocators']"
                " if 'job' in a for m in a.get('meshes', [])}))"
            )
        ).stream()
        assert got == "[('nbother', 'nbo1'), ('nbother', 'nbo2')]\n", got
        # its script is gone: no --force needed, as with `monarch-nb stop`
        assert _ok(k.run("%mesh stop nbo1")).stream() == "stopped: nbo1\n"
        assert " nbo1 " not in _ok(k.run("%mesh status")).result

        host = _kill_host("nbother")
        t0 = time.monotonic()
        table = _ok(k.run("%mesh status")).result
        assert time.monotonic() - t0 < 3, "a lost host is listed, not waited for"
        assert re.search(rf"\nnbother \(lost: {host}\) +{host} +\S+ +{LOST}", table), table
        said = k.run("%mesh stop nbo2").stream("stderr")
        assert said.startswith(
            "UsageError: %mesh stop: 1 proc of mesh 'nbo2' stopped on the allocators that answered; rank 1 of mesh 'nbo2' "
            f"is on no allocator that answered, and these could not be reached: {host} ("
        ), said
        assert "job nbother): lost: its allocator does not answer" in said, said
    finally:
        if k is not None:
            k.close()
        _kill_job("nbother")


def test_the_kernel_that_made_a_jobs_mesh_lists_it_and_its_stop_names_the_lost_host() -> None:
    """The kernel that launched the job and spawned on it: `%mesh status` listed none of it, and
    `%mesh stop` of a mesh with a rank on a lost host said "could not stop M: Supervision failure:
    host vm: allocator ipc://... lost: no heartbeat ...": not which host of the job that was,
    nor that the live ranks were stopped, as `monarch-nb stop` says."""
    k = None
    try:
        k = Kernel(env=FAST)
        _ok(k.run("%mesh launch process nbsame --hosts 2"))
        _ok(
            k.run(
                "a = nbsame.spawn_procs(per_host={'gpus': 1}, name='nbs1')\nb = nbsame.spawn_procs(per_host={'gpus': 1}, name='nbs2')"
            )
        )
        table = _ok(k.run("%mesh status")).result
        for name in ("nbs1", "nbs2"):
            rows = [ln for ln in table.splitlines() if f" {name} (persistent) " in ln]
            assert len(rows) == 2 and all(re.match(r"nbsame +\S+ +\S+ +\S+ \(persistent\) +this kernel ", ln) for ln in rows), (
                table
            )

        host = _kill_host("nbsame")
        table = _ok(k.run("%mesh status")).result
        assert re.search(rf"\nnbsame \(lost: {host}\) +{host} +\S+ +{LOST}", table), table
        # by the variable that holds it, and by its name
        for line, name in (("%mesh stop a", "nbs1"), ("%mesh stop nbs2", "nbs2")):
            t0 = time.monotonic()
            said = k.run(line).stream("stderr")
            assert time.monotonic() - t0 < 5, "the heartbeat's timeout (2 s), not the spawn timeout"
            assert said.startswith(
                f"UsageError: %mesh stop: 1 proc of mesh {name!r} stopped on the allocators that answered; rank 1 of mesh "
                f"{name!r} is on no allocator that answered, and these could not be reached: {host} ("
            ), said
            assert "job nbsame): lost: its allocator does not answer" in said, said
        table = _ok(k.run("%mesh status")).result
        assert " nbs1 " not in table and " nbs2 " not in table, table
    finally:
        if k is not None:
            k.close()
        _kill_job("nbsame")


def test_another_kernel_is_told_where_a_jobs_mesh_runs_and_stop_all_force_stops_it() -> None:
    """In a kernel that did not spawn it, `%%mesh exec NAME` and `%mesh dashboard NAME` of a job's
    mesh said "spawn it or `%mesh connect` to re-attach", and `%mesh connect` (this host's
    allocator) found nothing; `%mesh stop --all --force` said "stopped: nothing" beside a
    `%mesh status` that listed the job's meshes, which `monarch-nb stop --all --force` stops."""
    subprocess.run([sys.executable, "-c", (_SPAWN % FAST).replace("nbother", "nbadvice")], check=True, timeout=60)
    k = None
    try:
        k = Kernel(env=FAST)
        for cell in ("%%mesh exec nbo1\nprint(1)", "%mesh dashboard nbo1"):
            said = k.run(cell).stream("stderr")
            assert "no mesh named 'nbo1' in this kernel (known: none); it runs on the hosts of job 'nbadvice': " in said, said
            assert "`state = job_load(named_job_path('nbadvice')).state()`" in said, said
        # yours only, without --force
        assert _ok(k.run("%mesh stop --all")).stream() == "stopped: nothing (no running mesh of yours)\n"
        assert _ok(k.run("%mesh stop --all --force")).stream() == "stopped: nbo1, nbo2\n"
        table = _ok(k.run("%mesh status")).result
        assert " nbo1 " not in table and " nbo2 " not in table, table
    finally:
        if k is not None:
            k.close()
        _kill_job("nbadvice")
