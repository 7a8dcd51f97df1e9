"""Launchers on real daemons: time from ``job.state()`` to every host attached, and from a new
controller (a kernel restart) to the first call answered on the re-attached procs.

    sudo .venv/bin/python -m bench.job_attach [--nodes 3 8] [--ssh-hosts 3] [--monarch-python PATH]

Slurm: Debian's slurmctld/slurmd/munged on network-namespace hosts (tests/_slurm.py), the
controller on the "login node"; SSH: sshd per host (tests/_sshd.py). With ``--monarch-python``,
Monarch's own ``SlurmJob`` is run on the same cluster too and what happens is recorded (Slurm
22.05's ``squeue --json`` is not the shape it reads). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _jobhelp import PY, run_controller  # noqa: E402
from _slurm import SlurmCluster  # noqa: E402
from _sshd import SshCluster  # noqa: E402

_HEAD = """
import json, os, time
t_import = time.monotonic()
from monarch_nb.actor import Actor, ProcMesh, endpoint
from monarch_nb.job import SlurmJob, SSHJob

class Pid(Actor):
    @endpoint
    def pid(self):
        return os.getpid()

def make():
{make}
"""

_FIRST = """
t0 = time.monotonic()
job = make()
state = job.state(cached_path="/tmp/bench-job.json")
mesh = getattr(state, "hosts")
t_attached = time.monotonic()
procs = mesh.spawn_procs(per_host={"gpus": 1}, name="bench", persist=True)
procs.spawn("p", Pid).pid.call().get()
print(json.dumps({"apply_to_attached_s": t_attached - t0, "spawn_and_call_s": time.monotonic() - t_attached}), flush=True)
os._exit(0)
"""

_SECOND = """
t0 = time.monotonic()
job = make()
state = job.state(cached_path="/tmp/bench-job.json")
t_attached = time.monotonic()
procs = ProcMesh.lookup("bench", state.hosts)
procs.actor_mesh("p").pid.call().get()
t_call = time.monotonic()
print(json.dumps({"reattach_s": t_attached - t0, "restart_to_first_call_s": t_call - t0,
                  "import_s": t0 - t_import}), flush=True)
job.kill()
"""


def _script(make: str, body: str) -> str:
    return textwrap.dedent(_HEAD).format(make=textwrap.indent(textwrap.dedent(make), "    ")) + textwrap.dedent(body)


def _env(c: Any) -> dict[str, str]:
    return c.env(MONARCH_NB_RUNTIME_DIR="/tmp/mnb", MONARCH_NB_ZYGOTE_PRELOAD="")


def bench_slurm(n: int) -> dict[str, Any]:
    c = SlurmCluster(n)
    try:
        make = f"""
        return SlurmJob(meshes={{"hosts": {n}}}, python_exe={PY!r}, log_dir={os.path.join(c.shared, "jobs")!r},
                        monarch_port=0, exclusive=False)
        """
        first = run_controller(c.net, c.shared, _script(make, _FIRST), _env(c), timeout=300)[0]
        second = run_controller(c.net, c.shared, _script(make, _SECOND), _env(c), timeout=300)[0]
        c.assert_alive()
        return {**first, **second}
    finally:
        c.close()


def bench_ssh(n: int) -> dict[str, Any]:
    c = SshCluster(n)
    try:
        hosts = [f"root@{h}" for h in c.names]
        make = f"""
        job = SSHJob(python_exe={PY!r}, ssh_args={c.ssh_args()!r}, monarch_port=0)
        job.add_mesh("hosts", {hosts!r})
        return job
        """
        first = run_controller(c.net, c.shared, _script(make, _FIRST), _env(c), timeout=300)[0]
        second = run_controller(c.net, c.shared, _script(make, _SECOND), _env(c), timeout=300)[0]
        c.assert_alive()
        return {**first, **second}
    finally:
        c.close()


_MONARCH = """
import json, sys, time, traceback
t0 = time.monotonic()
try:
    from monarch.job import SlurmJob
    job = SlurmJob(meshes={"hosts": %d}, python_exe=%r, log_dir=%r, exclusive=False, job_start_timeout=60)
    state = job.state(cached_path=None)
    print(json.dumps({"ok": True, "state_s": time.monotonic() - t0}))
    job.kill()
except BaseException as e:
    print(json.dumps({"ok": False, "after_s": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}",
                      "where": traceback.format_exc().strip().splitlines()[-3:]}))
"""


def bench_monarch_slurm(n: int, monarch_python: str) -> dict[str, Any]:
    c = SlurmCluster(n)
    try:
        path = Path(c.shared, "monarch_slurm.py")
        path.write_text(_MONARCH % (n, monarch_python, os.path.join(c.shared, "jobs")))
        cp = c.net.run(0, [monarch_python, str(path)], capture_output=True, text=True, env=_env(c), timeout=180)
        lines = [json.loads(x) for x in cp.stdout.splitlines() if x.startswith("{")]
        out = lines[-1] if lines else {"ok": False, "error": cp.stderr[-800:]}
        out["squeue_after"] = c.squeue().strip()
        return out
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="*", default=[3, 8])
    p.add_argument("--ssh-hosts", type=int, nargs="*", default=[3])
    p.add_argument("--monarch-python", help="an interpreter with torchmonarch installed")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()}, "slurm": {}, "ssh": {}}
    for n in args.nodes:
        result["slurm"][str(n)] = bench_slurm(n)
    for n in args.ssh_hosts:
        result["ssh"][str(n)] = bench_ssh(n)
    if args.monarch_python:
        result["monarch_slurm"] = {str(n): bench_monarch_slurm(n, args.monarch_python) for n in args.nodes[:1]}
    result["machine"]["load_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
