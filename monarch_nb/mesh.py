"""What the ``%mesh`` magics do, as plain functions a script can call too.

The controller keeps a registry of named proc meshes. :func:`connect` attaches to allocators
(the embedded local one by default) and re-attaches the meshes already running there, e.g.
after a kernel restart; :func:`spawn` starts a named mesh over every attached host;
:func:`exec_cell` runs source code in every proc of a mesh, each proc keeping its own
namespace; :func:`stop` stops meshes this controller owns.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from typing import Any

from ._ranks import parse_ranks
from .actor import Future, HostMesh, ProcMesh, ValueMesh, controller_client, this_host
from .actor._mesh import View, attach_to_workers
from .actor._refs import HostRef
from .actor._shape import Extent
from .errors import ConnectError, ExecError, MeshError, SpawnError

__all__ = ["connect", "exec_cell", "get", "hosts", "interrupt", "meshes", "spawn", "status", "stop"]

_lock = threading.RLock()
_hosts: HostMesh | None = None
_meshes: dict[str, ProcMesh] = {}
_exec_meshes: dict[str, Any] = {}
_cell_counter = itertools.count(1)


def _read_target(target: str) -> str:
    """An allocator address, or the address in a connection file."""
    if target.startswith(("tcp://", "ipc://")):
        return target
    path = os.path.expanduser(target)
    if not os.path.exists(path):
        raise ConnectError(f"{target!r} is neither an allocator address (tcp://HOST:PORT, ipc://PATH) nor a connection file")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ConnectError(f"cannot read connection file {path}: {e}") from None
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


def _reattach(hm: HostMesh) -> None:
    client = controller_client()
    refs = hm._refs()
    by_name: dict[str, list[HostRef]] = {}
    for h in refs:
        st = client.request(h.alloc, "status").get(timeout=client.rt.cfg.connect_timeout)
        for m in st["meshes"]:
            if m["state"] == "running" and not m["name"].startswith("anon-"):
                by_name.setdefault(m["name"], []).append(h)
    for name, hs in by_name.items():
        if name in _meshes and not _meshes[name]._stopped:
            continue
        sub = HostMesh(hs, View(["hosts"], [len(hs)]) if len(hs) > 1 else View([], []))
        try:
            _meshes[name] = ProcMesh.lookup(name, sub)
        except MeshError:
            continue  # stopped meanwhile


def hosts() -> HostMesh:
    """The hosts :func:`connect` attached to (connecting to the local allocator first if needed)."""
    return _hosts if _hosts is not None else connect()


def spawn(name: str, per_host: dict[str, int] | None = None, *, persist: bool | None = None, **kwargs: Any) -> ProcMesh:
    """A named proc mesh over every attached host, shaped ``per_host`` on each."""
    if not name.isidentifier():
        raise ValueError(f"mesh name {name!r} must be a Python identifier (the notebook binds a variable to it)")
    with _lock:
        old = _meshes.get(name)
        if old is not None and not old._stopped:
            if not old._failed:
                raise MeshError(f"a mesh named {name!r} is already running; `%mesh stop {name}` first or choose another name")
            # respawn after a failure: the failed mesh's remaining procs go first
            old.stop(reason="respawned", force=True).exception(timeout=controller_client().rt.cfg.spawn_timeout)
        pm = hosts().spawn_procs(per_host=per_host, name=name, persist=persist, **kwargs)
        _meshes[name] = pm
        _exec_meshes.pop(name, None)
        return pm


def get(name: str) -> ProcMesh:
    """The named mesh this controller spawned or re-attached."""
    pm = _meshes.get(name)
    if pm is None:
        known = ", ".join(sorted(_meshes)) or "none"
        raise MeshError(f"no mesh named {name!r} (known: {known}); spawn it or `%mesh connect` to re-attach")
    return pm


def meshes() -> dict[str, ProcMesh]:
    """Named meshes known to this controller, including stopped ones until re-spawned."""
    return dict(_meshes)


def _resolve(mesh: ProcMesh | str | None) -> ProcMesh:
    if isinstance(mesh, ProcMesh):
        return mesh
    if mesh is None:
        live = [m for m in _meshes.values() if not m._stopped]
        if len(live) != 1:
            names = ", ".join(sorted(m.name for m in live)) or "none"
            raise MeshError(f"name the mesh to use: {len(live)} are running ({names})")
        return live[0]
    return get(mesh)


def _exec_actors(pm: ProcMesh) -> Any:
    from ._exec import EXEC_ACTOR, ExecActor

    am = _exec_meshes.get(pm.name)
    if am is None:
        try:
            am = pm.spawn(EXEC_ACTOR, ExecActor)
        except SpawnError as e:
            if "already exists" not in str(e):
                raise
            am = pm.actor_mesh(EXEC_ACTOR)  # a namespace from before a kernel restart
        _exec_meshes[pm.name] = am
    return am


def _target_ranks(pm: ProcMesh, ranks: str | list[int] | None) -> list[int] | None:
    if ranks is None:
        return None
    n = len(pm._view.ranks)
    return parse_ranks(ranks, n) if isinstance(ranks, str) else sorted(ranks)


def exec_cell(
    mesh: ProcMesh | str | None,
    source: str,
    *,
    ranks: str | list[int] | None = None,
    block: bool = True,
    timeout: float | None = None,
    label: str = "",
) -> ValueMesh[Any] | Future[ValueMesh[Any]]:
    """Run ``source`` in every proc of ``mesh`` (or ``ranks`` of it, e.g. ``"0:4"``).

    Returns a ValueMesh of each rank's last expression; when any rank raises, an
    :class:`~monarch_nb.errors.ExecError` shows every failing rank's remote traceback. With
    ``block=False`` returns a Future of that instead.
    """
    pm = _resolve(mesh)
    am = _exec_actors(pm)
    sel = _target_ranks(pm, ranks)
    what = f"%%mesh exec on {pm.name}"
    if not label:
        label = str(next(_cell_counter))
    import linecache

    filename = f"<mesh exec {label}>"  # the name ExecActor compiles it under
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    idx = sel if sel is not None else list(range(len(pm._view.ranks)))

    def collect(raw: list[tuple[bool, Any]]) -> ValueMesh[Any]:
        failures = {}
        results = []
        for i, (ok, v) in zip(idx, raw):
            results.append(v if ok else None)
            if not ok:
                failures[i] = v
        if failures:
            raise ExecError(failures, len(idx), pm.name)
        if sel is None:
            return ValueMesh._from_view(pm._view, results)
        return ValueMesh(Extent(["ranks"], [len(results)]), results)

    out = am.run.call_ranks(sel, source, label).then(collect, what)
    if not block:
        return out
    try:
        return out.get(timeout=timeout)
    except KeyboardInterrupt:
        interrupt(pm, sel)
        raise


def interrupt(mesh: ProcMesh | str | None, ranks: list[int] | None = None) -> int:
    """Send an interrupt (SIGINT) to code running in ``%%mesh exec`` on the mesh; returns how many were busy."""
    pm = _resolve(mesh)
    client = controller_client()
    procs = [pm._procs[r] for r in pm._view.ranks]
    if ranks is not None:
        procs = [procs[i] for i in ranks]
    futs = [client.request(p.addr, "interrupt", _actor="__sys__") for p in procs]
    n = 0
    for f in futs:
        try:
            n += bool(f.get(timeout=2))
        except Exception:
            pass
    return n


def stop(name: str | None = None, *, all: bool = False, force: bool = False) -> list[str]:
    """Stop the named mesh (or every mesh with ``all=True``); only this controller's unless ``force``."""
    if (name is None) == (not all):
        raise ValueError("give a mesh name or all=True")
    with _lock:
        targets = [m for m in _meshes.values() if not m._stopped] if all else [get(name)]  # type: ignore[arg-type]
        client = controller_client()
        stopped = []
        errors = []
        for pm in targets:
            if all and not force and not _owned(client, pm):
                continue
            try:
                pm.stop(force=force).get(timeout=client.rt.cfg.spawn_timeout)
                stopped.append(pm.name)
            except Exception as e:
                errors.append(f"{pm.name}: {e}")
            _exec_meshes.pop(pm.name, None)
        if errors:
            raise MeshError("could not stop " + "; ".join(errors))
        return stopped


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


def _owned(client: Any, pm: ProcMesh) -> bool:
    return any(client.owned.get(p.addr) is not None for p in pm._procs)


def status(addresses: list[str] | None = None) -> dict[str, Any]:
    """Allocators, meshes, procs and their states (``monarch_nb.status()``)."""
    from .introspect import status as _status

    return _status(addresses)
