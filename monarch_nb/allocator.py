"""Run, find and stop allocator daemons (public; the CLI is a thin layer over this)."""

from __future__ import annotations

import os
from typing import Any

from ._deadline import budget
from ._numtext import plural
from ._runtime._pids import pid_alive, terminate
from ._runtime.allocator import unlink_ipc
from ._runtime.daemon import run_allocator
from ._runtime.records import local_allocator, read_connection_files
from .config import get_config, runtime_dir

__all__ = [
    "gc_code",
    "gc_logs",
    "list_allocators",
    "run_allocator",
    "start_allocator",
    "stop_allocator",
    "stop_mesh",
]


def list_allocators() -> list[dict[str, Any]]:
    """Connection files in the runtime directory, with whether their daemon is alive."""
    out = []
    for info in read_connection_files(runtime_dir()):
        try:
            info["alive"] = pid_alive(int(info["pid"]))
        except ValueError:
            info["alive"] = False
        out.append(info)
    return out


def gc_logs(dry_run: bool = False) -> list[dict[str, Any]]:
    """Remove logs of stopped allocators and earlier meshes older than ``log_max_age``, oldest
    first, and more of them while all logs together exceed ``log_max_total_bytes``. Running
    allocators' current meshes keep theirs. Returns what was (with ``dry_run``: would be) removed."""
    from ._runtime.logfiles import collect, held_open

    cfg = get_config()
    alive = [a for a in list_allocators() if a["alive"]]
    live = {str(a.get("alloc_id", "")) for a in alive}
    held = held_open({int(a["pid"]) for a in alive})
    gone = collect(runtime_dir(cfg), live, cfg.log_max_total_bytes, cfg.log_max_age, dry_run, held)
    return [{"path": r.path, "bytes": r.nbytes, "age_days": r.age / 86400} for r in gone]


def gc_code(dry_run: bool = False) -> list[dict[str, Any]]:
    """Remove synced workspaces of the code cache not synced for ``code_max_age``, least
    recently synced first, and more while the cache exceeds ``code_max_total_bytes``; then the
    blobs no workspace links. Workspaces of running allocators stay. Returns what was (with
    ``dry_run``: would be) removed."""
    from ._runtime.codecache import collect

    cfg = get_config()
    live = {str(a.get("alloc_id", "")) for a in list_allocators() if a["alive"]}
    gone = collect(runtime_dir(cfg), live, cfg.code_max_total_bytes, cfg.code_max_age, dry_run)
    return [{"path": r.path, "bytes": r.nbytes, "age_days": r.age / 86400} for r in gone]


def start_allocator(extra_args: list[str] | None = None) -> dict[str, Any]:
    """Start this host's allocator detached (or return the one already running)."""
    rdir = runtime_dir()
    return local_allocator(rdir, extra_args=extra_args)


def stop_allocator(pid: int | None = None, timeout: float = 15.0) -> list[int]:
    """Stop allocator daemons (all on this host, or the one with ``pid``); returns the pids stopped."""
    import socket

    from .actor import _context

    stopped = []
    for info in list_allocators():
        if info.get("host") != socket.gethostname() or (pid is not None and int(info["pid"]) != pid):
            continue
        p = int(info["pid"])
        client = _context._client
        if client is not None and info.get("addr"):
            # this process's own client hears why its calls there fail, and raises no alarm
            client.forget_allocators([str(info["addr"])], "allocator {addr} stopped by stop_allocator() (mesh stopped)")
        if info["alive"]:
            terminate([p], timeout)
        else:
            # killed before it could remove its socket files (nobody serves them now)
            unlink_ipc(str(info.get("addr", "")), inside=os.path.dirname(info["file"]))
        try:
            os.unlink(info["file"])
        except OSError:
            pass
        stopped.append(p)
    return stopped


def stop_mesh(
    name: str,
    addr: str | None = None,
    *,
    force: bool = True,
    reason: str | None = None,
    timeout: float = 15.0,
) -> int:
    """Stop the mesh ``name`` on the allocator at ``addr`` (default: every known allocator that
    has it: this runtime directory's and those of the jobs on record, see ``introspect.known_status``).

    This is for tools that do not own the mesh (a CLI, the JupyterLab sidebar): with ``force``
    it stops a mesh even while its owning controller is attached; without, an attached owner's
    mesh is refused with ``PermissionError``. Returns the number of procs that were stopped.
    Found on no allocator that answered, it is asked of those that did not answer the search
    (busy, say): ``MeshNotFoundError`` (a ``MeshError``) when none has it. Where ranks of the
    mesh may be on an allocator that cannot be reached (a job's host that is lost, one still
    silent after ``timeout``), the others are stopped and then ``ConnectError`` names it and
    says what became of its procs; it has ``stopped`` (the procs stopped) and ``unreached``
    (the allocators, as ``known_status`` lists them). A job's lost host is not waited for.
    ``reason`` is what its owner's calls and stop then say stopped it (default: this function,
    in this process, on this host).
    """
    from .actor import _context
    from .errors import ConnectError, MeshNotFoundError
    from .introspect import _unreached_note, known_status

    if reason is None:
        import socket

        reason = f"stopped by monarch_nb.allocator.stop_mesh() in process {os.getpid()} on host {socket.gethostname()}"
    client = _context.client()
    # an empty cid skips the owner check on the allocator; our own cid is never an owner, so it triggers it
    cid = "" if force else client.cid
    if addr is not None:
        return int(client.request(addr, "stop_mesh", name, cid, force, reason).get(timeout=timeout) or 0)
    found = known_status()["allocators"]
    having = [a["addr"] for a in found if not a.get("error") and any(m["name"] == name for m in a.get("meshes", []))]
    # an allocator too busy to list its meshes within known_status()'s 2 s may run (part of) it: read as
    # "no mesh", the mesh kept running (a test's cleanup passed over it, a CLI said no such mesh)
    maybe_there = bool(_unreached_note(name, found))  # not every rank found, and someone did not answer
    silent = [a for a in found if a.get("error") and a.get("addr") and not a.get("lost")] if maybe_there else []
    if not having and not maybe_there:
        raise MeshNotFoundError(f"no mesh named {name!r} on any known allocator ({_where(found)})", name)
    futs = [client.request(a, "stop_mesh", name, cid, force, reason) for a in having]
    asked = [(a, client.request(a["addr"], "stop_mesh", name, cid, force, reason)) for a in silent]
    left = budget(timeout)
    stopped = sum(int(f.get(timeout=left()) or 0) for f in futs)
    found_it = bool(having)
    late = []
    for a, f in asked:
        try:
            stopped += int(f.get(timeout=left()) or 0)
            found_it = True
        except MeshNotFoundError:
            pass  # not there either: the search was right about it
        except TimeoutError:
            late.append({**a, "error": f"{a['error']}; no answer to the stop either, within {timeout:g} s"})
    asked_addrs = {a["addr"] for a, _ in asked}
    # still unreached: those that did not answer the stop, the jobs' lost hosts, and any other that
    # could not be asked (another cluster's key)
    unreached = late + [a for a in found if a.get("error") and a.get("addr") not in asked_addrs]
    note = _unreached_note(name, [a for a in found if not a.get("error")] + unreached, found_it=found_it)
    if note:
        head = f"{plural(stopped, 'proc')} of mesh {name!r} stopped on the allocators that answered; " if found_it else ""
        err = ConnectError(head + note)
        err.stopped, err.unreached = stopped, unreached  # type: ignore[attr-defined]
        raise err
    if not found_it:
        raise MeshNotFoundError(f"no mesh named {name!r} on any known allocator ({_where(found)})", name)
    return stopped


def _where(allocators: list[dict[str, Any]]) -> str:
    """Where a name was looked for, for a "no mesh named" error: the runtime directory (the jobs
    on record live under it) and the meshes that are there."""
    names = sorted({m["name"] for a in allocators for m in a.get("meshes", [])})
    return f"runtime directory {runtime_dir()} and its jobs; meshes: {', '.join(names) or 'none'}"
