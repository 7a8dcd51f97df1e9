"""This controller's named proc meshes and the hosts it attached to.

Shared by the features that act on "every mesh" or "the attached hosts" by default (sync,
logs, env) and by :mod:`monarch_nb.mesh`, whose magic-shaped functions re-export these:
:func:`connect` attaches to allocators (the embedded local one by default) and re-attaches
the meshes already running there, e.g. after a kernel restart; :func:`spawn` starts a named
mesh over every attached host.
"""

from __future__ import annotations

import keyword
import os
import re
import threading
import time
from typing import Any

from ._runtime import records
from .actor import HostMesh, ProcMesh, attach_to_workers, controller_client, this_host
from .actor._mesh import View
from .actor._refs import HostRef
from .errors import ConnectError, MeshError, MeshNotFoundError

__all__ = ["connect", "get", "hosts", "meshes", "restart", "spawn"]

_lock = threading.RLock()
_hosts: HostMesh | None = None
_meshes: dict[str, ProcMesh] = {}
#: proc mesh name -> the actor mesh running its ``%%mesh exec`` cells (dropped with the proc mesh)
_exec_meshes: dict[str, Any] = {}


def _read_target(target: str) -> str:
    """An allocator address, or the address in a connection file."""
    if target.startswith(("tcp://", "ipc://")):
        return target
    path = os.path.expanduser(target)
    if not os.path.exists(path):
        hint = f"; for a TCP address write tcp://{target}" if re.fullmatch(r"[\w.\-\[\]:]+:\d+", target) else ""
        raise ConnectError(
            f"{target!r} is neither an allocator address (tcp://HOST:PORT, ipc://PATH) nor a connection file{hint}"
        )
    info = records.read_connection_file(path)
    import socket

    if info.get("host") == socket.gethostname() and info.get("addr"):
        return str(info["addr"])
    if info.get("tcp"):
        return str(info["tcp"])
    raise ConnectError(f"connection file {path} names no address reachable from this host")


def connect(*targets: str, key_file: str | None = None) -> HostMesh:
    """Attach to allocators by address or connection file; with none, the embedded local one.

    Meshes already running on them (spawned before a kernel restart, say) are re-attached and
    returned by :func:`meshes`.
    """
    global _hosts
    with _lock:
        if targets:
            hm = attach_to_workers(workers=[_read_target(t) for t in targets], key_file=key_file)
        else:
            hm = this_host()
        _hosts = hm
        _reattach(hm)
        return hm


#: names that :func:`connect` found on several hosts as distinct meshes: name -> the candidates
ambiguous: dict[str, str] = {}
#: meshes without a ``%mesh`` name whose controller is gone (a kernel restarted since it ran
#: ``this_host().spawn_procs(...)``), re-attached by the last :func:`connect`
orphans: list[str] = []


def _reattach(hm: HostMesh) -> None:
    client = controller_client()
    ambiguous.clear()
    orphans.clear()
    refs = hm._refs()
    by_name: dict[str, list[HostRef]] = {}
    # asked together: a host that is slow to answer costs its wait once, not once per host before it
    timeout = client.rt.cfg.connect_timeout
    asked = [(h, client.request(h.alloc, "status")) for h in refs]
    deadline = time.monotonic() + timeout
    for h, fut in asked:
        st = fut.get(timeout=max(0.0, deadline - time.monotonic()))
        attached = {c["cid"] for c in st.get("controllers", [])}
        for m in st["meshes"]:
            if m["state"] != "running":
                continue
            if not m["name"].startswith("anon-"):
                by_name.setdefault(m["name"], []).append(h)
            elif m["owner"] not in attached:
                # persistent procs nobody can reach by a name: found here, they can be used or
                # stopped; left alone, they would hold their host (and its GPUs) until the
                # allocator's lease, which never runs out while any controller is attached
                by_name.setdefault(m["name"], []).append(h)
                if m["name"] not in orphans:
                    orphans.append(m["name"])
    for name, hs in by_name.items():
        if name in _meshes and not _meshes[name]._stopped:
            continue
        sub = HostMesh(hs, View(["hosts"], [len(hs)]) if len(hs) > 1 else View([], []))
        try:
            _meshes[name] = ProcMesh.lookup(name, sub)
        except MeshError as e:
            if "not one mesh" in str(e):
                # procs of unrelated meshes that share a name: which one is the user's to say
                ambiguous[name] = str(e)
            continue  # else stopped meanwhile


def hosts() -> HostMesh:
    """The hosts :func:`connect` attached to (connecting to the local allocator first if needed)."""
    global _hosts
    if _hosts is not None and _hosts._controller_env:
        # the local allocator: one stopped or killed since is replaced, as this_host() replaces
        # it, or `%mesh spawn` kept naming a socket file that no longer exists
        _hosts = this_host()
    return _hosts if _hosts is not None else connect()


def spawn(name: str, per_host: dict[str, int] | None = None, *, persist: bool | None = None, **kwargs: Any) -> ProcMesh:
    """A named proc mesh over every attached host, shaped ``per_host`` on each."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"mesh name {name!r} must be a Python identifier, not a keyword (the notebook binds a variable to it)")
    with _lock:
        old = _meshes.get(name)
        if old is not None and not old._stopped:
            if not (old._failed or old._actor_failed or _a_proc_died(old)):
                raise MeshError(f"a mesh named {name!r} is already running; `%mesh stop {name}` first or choose another name")
            # respawn after a failure (a dead proc, or an actor's: its procs take no new actors):
            # the failed mesh's remaining procs go first
            old.stop(reason="respawned", force=True).exception(timeout=controller_client().rt.cfg.spawn_timeout)
        pm = hosts().spawn_procs(per_host=per_host, name=name, persist=persist, **kwargs)
        _meshes[name] = pm
        _exec_meshes.pop(name, None)
        return pm


def _a_proc_died(pm: ProcMesh) -> bool:
    """A proc of ``pm`` is known dead: the calls to it have failed already, though the mesh is
    marked failed only once that failure has been reported (after the fault hook has run), and
    a script that respawns as soon as its call fails must not hear "already running"."""
    rt = controller_client().rt
    return any(rt.peer_error(p.addr) is not None for p in pm._procs)


def get(name: str) -> ProcMesh:
    """The named mesh this controller spawned or re-attached."""
    pm = _meshes.get(name)
    if pm is None:
        known = ", ".join(sorted(_meshes)) or "none"
        job = _job_running(name)
        if job:
            # `%mesh connect` attaches this host's allocator, not a job's: its advice found nothing
            raise MeshNotFoundError(
                f"no mesh named {name!r} in this kernel (known: {known}); it runs on the hosts of job {job!r}: "
                f"re-attach to the job (`state = job_load(named_job_path({job!r})).state()`, from monarch_nb.job), "
                f"then `procs = ProcMesh.lookup({name!r}, state.<its host mesh>)` and use `procs`",
                name,
            )
        raise MeshNotFoundError(f"no mesh named {name!r} (known: {known}); spawn it or `%mesh connect` to re-attach", name)
    return pm


def _job_running(name: str) -> str:
    """The job on record whose allocators run a mesh named ``name``, or ""."""
    from .introspect import known_status

    try:
        found = known_status()["allocators"]
    except Exception:
        return ""  # only an error's advice: the error itself is the news
    for a in found:
        if a.get("job") and any(m["name"] == name for m in a.get("meshes", [])):
            return str(a["job"].get("name") or "")
    return ""


def meshes() -> dict[str, ProcMesh]:
    """Named meshes known to this controller, including stopped ones until re-spawned."""
    return dict(_meshes)


def _resolve(mesh: ProcMesh | str | None) -> ProcMesh:
    if isinstance(mesh, ProcMesh):
        return mesh
    if mesh is None:
        live = [m for m in _meshes.values() if not m._stopped]
        if not live:
            # meshes of the Python API (procs = this_host().spawn_procs(...)) are not listed here:
            # "0 are running" read as if the user's running mesh were gone
            raise MeshError(
                "no mesh named by %mesh spawn is running: name the mesh to use (a variable holding a proc or "
                "actor mesh works too), or start one with %mesh spawn NAME --per-host gpus=N"
            )
        if len(live) > 1:
            names = ", ".join(sorted(m.name for m in live))
            raise MeshError(f"name the mesh to use: {len(live)} are running ({names})")
        return live[0]
    return get(mesh)


def restart(pm: ProcMesh | str) -> dict[str, Any]:
    """Stop a mesh and start it again, same name and shape, from the hosts' warm zygotes.

    Needed after an environment change to a compiled package; actors and ``%%mesh exec``
    namespaces are gone afterwards (spawn the actors again).
    """
    pm = _resolve(pm)
    client = controller_client()
    hm = pm._host_mesh or hosts()
    nh = len(hm._view.labels)
    per_host = dict(zip(pm._view.labels[nh:], pm._view.sizes[nh:]))
    with _lock:
        pm.stop(reason="restarted", force=True).get(timeout=client.rt.cfg.spawn_timeout)
        new = hm.spawn_procs(per_host=per_host, name=pm.name, persist=pm._persist)
        _meshes[pm.name] = new
        _exec_meshes.pop(pm.name, None)
    return {"pids": [p.pid for p in new._procs]}
