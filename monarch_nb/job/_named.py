"""Named jobs, for the ``%mesh launch|jobs|kill`` magics and ``monarch-nb job``: a job cached
under ``<runtime dir>/jobs/<name>.json``, so any kernel or shell on this machine finds it by name."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ..config import runtime_dir
from ._job import (
    JobError,
    JobState,
    JobTrait,
    LocalJob,
    _default_job_path,
    import_job,
    job_load,
    set_current_job,
)
from ._process import ProcessJob
from ._slurm import SlurmJob
from ._ssh import SSHJob

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
SCHEDULERS = ("slurm", "ssh", "process", "local", "k8s")


def named_job_path(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"job name {name!r}: use letters, digits, '_' and '-' (it also names the host mesh)")
    return os.path.join(runtime_dir(), "jobs", f"{name}.json")


def make_job(scheduler: str, name: str, hosts: str | int, **options: Any) -> JobTrait:
    """A job spec whose one mesh is ``name``: ``hosts`` is a count (slurm, process, k8s) or a comma
    separated host list (ssh); ``options`` are the scheduler's constructor arguments."""
    if scheduler == "slurm":
        return SlurmJob(meshes={name: _count(scheduler, hosts)}, **options)
    if scheduler == "process":
        return ProcessJob({name: _count(scheduler, hosts)}, **options)
    if scheduler == "local":
        return LocalJob((name,), **options)
    if scheduler == "ssh":
        if str(hosts).isdigit() or not str(hosts).strip():
            # a count, as the other schedulers take, or none (%mesh launch ssh NAME without --hosts):
            # ssh tried to reach a host named "1" (0.0.0.1)
            raise ValueError(f"an ssh job needs its hosts' names, comma-separated (--hosts h1,h2), got {hosts!r}")
        job = SSHJob(**options)
        job.add_mesh(name, [h for h in str(hosts).split(",") if h])
        return job
    if scheduler in ("k8s", "kubernetes"):
        from .kubernetes import make_job as make_k8s_job  # only here: the kubernetes client is optional

        return make_k8s_job(name, _count(scheduler, hosts), **options)
    raise ValueError(f"unknown scheduler {scheduler!r}; one of {', '.join(SCHEDULERS)}")


def _count(scheduler: str, hosts: str | int) -> int:
    try:
        return int(hosts)
    except ValueError:
        raise ValueError(f"hosts for a {scheduler} job is a number of hosts, got {hosts!r}") from None


def launch(scheduler: str, name: str, hosts: str | int, **options: Any) -> JobState:
    """Apply (or re-attach to) the named job and return its state; ``state.<name>`` is its hosts."""
    job = make_job(scheduler, name, hosts, **options)
    return job.state(cached_path=named_job_path(name))


def _job_files() -> dict[str, str]:
    out = {}
    d = os.path.join(runtime_dir(), "jobs")
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        names = []
    for n in names:
        if n.endswith(".json") and _NAME.fullmatch(n[:-5]) and n != "job_state.json":
            out[n[:-5]] = os.path.join(d, n)
    default = _default_job_path()
    if os.path.exists(default):
        out.setdefault("(current)", default)
    return out


def jobs() -> list[dict[str, Any]]:
    """One row per job known on this machine: name, type, scheduler, id, state, hosts, age, walltime left."""
    rows = []
    for name, path in _job_files().items():
        try:
            job = job_load(path)
        except Exception as e:  # one unreadable record must not hide the others
            rows.append(
                {"name": name, "type": "?", "scheduler": "?", "id": "", "state": f"unreadable: {e}", "hosts": 0, "path": path}
            )
            continue
        try:
            row = {"name": name, "type": type(job).__name__, **job.describe()}
        except Exception as e:  # the scheduler did not answer: say so in the row
            row = {
                "name": name,
                "type": type(job).__name__,
                "scheduler": job._scheduler,
                "id": "",
                "state": f"unknown: {e}",
                "hosts": 0,
            }
        row["path"] = path
        rows.append(row)
    return rows


def kill(name: str | None = None) -> None:
    """Kill the named job (default: the current one, at ``DEFAULT_JOB_PATH`` as it is now)."""
    path = named_job_path(name) if name and name != "(current)" else _default_job_path()
    try:
        job = job_load(path)
    except FileNotFoundError:
        known = ", ".join(_job_files()) or "none"
        if not name or name == "(current)":
            # "no job named '(current)'" named a job nobody had called so
            raise JobError(
                f"no current job (none applied with `monarch-nb job apply`: no {path}); name one to kill (known: {known})"
            ) from None
        raise JobError(f"no job named {name!r} (no {path}); known: {known}") from None
    job.kill()
    if os.path.exists(path):
        os.unlink(path)


def apply_spec(spec: str, cached_path: str | None = None) -> JobTrait:
    """``monarch-nb job apply module.attr``: import the job, make it current, apply and cache it."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    job = import_job(spec)
    set_current_job(spec)
    # as state() does, without attaching: a job already cached there that can run this spec is
    # kept (applying again submitted a second one and the record forgot the first)
    job._apply_cached(cached_path or _default_job_path())
    return job


__all__ = ["apply_spec", "jobs", "kill", "launch", "make_job", "named_job_path"]
