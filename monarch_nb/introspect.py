"""Read-only introspection: what frontends (status, dashboard, sidebar) show.

It reads the runtime directory's connection files and asks each live allocator for a
snapshot. It registers no controller, so it holds no lease and keeps nothing alive.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ._deadline import budget
from ._ranks import format_ranks
from ._runtime.records import read_connection_files
from ._runtime.runtime import pid_alive
from ._runtime.transport import Security
from ._wire.keys import read_key_file
from .actor import _context, _debugwait
from .config import runtime_dir

__all__ = ["known_status", "logs", "on_state_change", "status"]


def status(
    addresses: list[str] | None = None, timeout: float = 2.0, *, key_file: str | None = None, local: bool = True
) -> dict[str, Any]:
    """Allocators (local connection files plus ``addresses``), their meshes and procs, and the
    debug sessions of ranks paused at ``breakpoint()`` (``debug_sessions``, also per allocator).

    ``key_file``: the cluster key ``addresses`` hold (a job's own key); this process adopts it
    unless it already holds another one (one process joins one cluster: then each of them reads
    as an error saying so). ``local=False`` leaves this machine's connection files out.
    """
    client = _context.client()
    targets: list[tuple[str, dict[str, Any]]] = []
    host = socket.gethostname()
    for info in read_connection_files(runtime_dir()) if local else []:
        if info.get("host") == host and not pid_alive(int(info.get("pid", 0))):
            continue
        targets.append((info["addr"], info))
    known = {t[0] for t in targets} | {t[1].get("tcp") for t in targets}
    refused = ""
    if key_file and addresses:
        try:
            key = read_key_file(key_file)
            if client.rt.sockets.security.key != key:
                client.rt.sockets.set_security(Security(key))
        except Exception as e:  # another cluster's key, or an unreadable file: said per allocator
            refused = f"cannot ask it with the key {key_file}: {e}"
    for a in addresses or []:
        if a not in known:
            known.add(a)
            targets.append((a, {"addr": a}))
    mine = set(addresses or [])
    # one this process declared lost gets a hello first: all at once, within this query's timeout
    client.revive_lost([addr for addr, _info in targets if not (refused and addr in mine)], timeout)
    futs = [(addr, info, None if refused and addr in mine else client.request(addr, "status")) for addr, info in targets]
    out = []
    left = budget(timeout)
    for addr, info, f in futs:
        if f is None:
            out.append({**info, "error": refused})
            continue
        try:
            with _debugwait.quiet():  # a status query is not a wait that should open the debugger
                # ``addr`` is where this process reaches it: an allocator of another host (a job's)
                # answers with its own ipc address, a socket file there, and a stop or a logs
                # request sent to that waited out its whole timeout
                out.append({**f.get(timeout=left()), "addr": addr})
        except TimeoutError:
            out.append({**info, "error": f"no answer within {timeout:g} s: not running, or not reachable from here"})
        except Exception as e:
            out.append({**info, "error": f"{type(e).__name__}: {e}"})
    # paused ranks (breakpoint()), flattened for the dashboard and the sidebar
    debug = [dict(r, alloc_id=a.get("alloc_id")) for a in out for r in a.get("debug_sessions", [])]
    return {"time": time.time(), "allocators": out, "debug_sessions": debug}


def known_status(
    jobs: list[dict[str, Any]] | None = None, timeout: float = 2.0, *, addresses: list[str] | None = None
) -> dict[str, Any]:
    """:func:`status` of every allocator known here: this runtime directory's, ``addresses``, and
    those of the jobs on record (``monarch_nb.job.list_jobs()``, or its rows ``jobs``). A job's
    allocators carry ``job``: its row's name, type, scheduler, id and state.

    A job's allocators keep their connection files in the job's own directory (on another host,
    for SSH and Slurm), so they are asked by address, with the job's own cluster key. A job's
    host that the job lists as lost (its allocator does not answer) is not asked: it is listed
    with ``lost: True``, its ``host``, its ``addr`` where the job knows it, and ``error``. With no
    job on record nothing is asked of a scheduler: this is :func:`status`.
    """
    if jobs is None:
        from .job import list_jobs

        jobs = list_jobs()
    by_key: dict[str, set[str]] = {}
    owner: dict[str, dict[str, Any]] = {}
    lost: list[dict[str, Any]] = []
    for j in jobs:
        addrs = [str(a) for a in j.get("addrs") or []]
        by_key.setdefault(str(j.get("key_file") or ""), set()).update(addrs)
        tag = {k: j.get(k, "") for k in ("name", "type", "scheduler", "id", "state")}
        owner.update((a, tag) for a in addrs)
        # listed, not asked: the job found them silent already (a stop or a logs request that
        # waited on one waited out its whole timeout), and left out, a stop of a mesh with ranks
        # there said nothing of them
        where = j.get("lost_addrs") or {}
        for h in j.get("lost") or []:
            error = "lost: its allocator does not answer"
            lost.append({"addr": str(where.get(h) or ""), "host": str(h), "error": error, "lost": True, "job": tag})
    raw = status(sorted(by_key.pop("", set()) | set(addresses or [])) or None, timeout)
    for key_file, asked in sorted(by_key.items()):
        if asked:
            more = status(sorted(asked), timeout, key_file=key_file, local=False)
            raw["allocators"] += more["allocators"]
            raw["debug_sessions"] += more["debug_sessions"]
    for a in raw["allocators"]:
        # asked by its ipc address or its tcp one; one that did not answer has the one asked
        job = owner.get(str(a.get("addr") or "")) or owner.get(str(a.get("tcp") or ""))
        if job is not None:
            a["job"] = job
    raw["allocators"] += lost
    return raw


def _missing_ranks(name: str, allocators: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """The size of mesh ``name`` as the allocators that answered list it (0: none lists it), and
    its ranks that none of them runs."""
    ranks: set[int] = set()
    size = 0
    for a in allocators:
        for m in a.get("meshes", []) if not a.get("error") else []:
            if m["name"] == name:
                _labels, sizes = m.get("extent") or (m.get("labels", []), m.get("sizes", []))
                size = max(size, math.prod(sizes))
                ranks.update(p["rank"] for p in m["procs"])
    return size, sorted(set(range(size)) - ranks)


def _unreached_where(allocators: list[dict[str, Any]]) -> str:
    """The allocators of ``allocators`` that did not answer, each with its host, address, job and why."""
    return "; ".join(
        f"{a.get('host') or '?'} ({a.get('addr') or 'address unknown'}"
        + (f", job {a['job'].get('name')}" if a.get("job") else "")
        + f"): {a['error']}"
        for a in allocators
        if a.get("error")
    )


def _unreached_note(
    name: str, allocators: list[dict[str, Any]], found_it: bool | None = None, missing: list[int] | None = None
) -> str:
    """What a user stopping mesh ``name`` must know when some of ``allocators`` (as
    :func:`known_status` lists them) did not answer: which ranks may be there, which hosts, and
    what became of their procs. Empty when none is missing: every rank of the mesh was found
    on one that answered, or every allocator answered. ``found_it``: the mesh was found (default:
    listed by one that answered). ``missing``: its ranks there, where the caller knows them (its
    controller, from the mesh's procs; default: those no allocator that answered lists)."""
    gone = [a for a in allocators if a.get("error")]
    if not gone:
        return ""
    if missing is None:
        size, missing = _missing_ranks(name, allocators)
        if found_it is None:
            found_it = bool(size)
        if found_it and size and not missing:
            return ""
    elif not missing:
        return ""
    what = (
        f"{'rank' if len(missing) == 1 else 'ranks'} {format_ranks(missing)} of mesh {name!r} "
        f"{'is' if len(missing) == 1 else 'are'} on no allocator that answered"
        if missing
        else f"no allocator that answered has a mesh named {name!r}"
    )
    jobs = sorted({str(a["job"].get("name")) for a in gone if a.get("job")})
    # who could tell which: a killed allocator's zygote and procs die with it (PDEATHSIG); a cut
    # link leaves all of them running on the far side
    return (
        f"{what}, and these could not be reached: {_unreached_where(gone)}. "
        "What ran there was not stopped: if the allocator died (killed, or its host went down), its procs "
        "died with it; if the host is only cut off, they run on until you stop the mesh again once the host "
        "answers, or until that allocator's lease (MONARCH_NB_LEASE) passes with no controller attached"
        + (f"; `monarch-nb job kill {jobs[0]}` stops the job's allocators, these too once they answer" if len(jobs) == 1 else "")
    )


def logs(mesh: str, rank: int, tail: int | None = None, addr: str | None = None, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The captured output of one rank (``tail``: only the last lines), as dicts with ``ts``,
    ``rank``, ``stream``, ``call`` and ``line``. ``addr`` is the allocator that runs that rank
    (default: found among the known allocators, the jobs' too: see :func:`known_status`).

    ``MeshNotFoundError`` when no allocator runs that rank; ``ConnectError`` when it may be on
    one that did not answer (a lost host, a busy allocator)."""
    from .errors import ConnectError, MeshNotFoundError

    if addr is None:
        found = known_status()["allocators"]
        for a in found:
            for m in a.get("meshes", []):
                if m["name"] == mesh and any(p["rank"] == rank for p in m["procs"]):
                    addr = a["addr"]
        if addr is None:
            gone = _unreached_where(found)
            said = f"no rank {rank} of a mesh named {mesh!r} on any known allocator" + (
                f" that answered, and these could not be reached: {gone}" if gone else ""
            )
            size, missing = _missing_ranks(mesh, found)
            # a rank the mesh's listed extent leaves out is not there, whoever did not answer
            if gone and (size == 0 or rank in missing):
                raise ConnectError(said)
            raise MeshNotFoundError(said, mesh)
    return _context.client().request(addr, "logs", mesh, rank, tail).get(timeout=timeout)


def on_state_change(callback: Callable[[dict[str, Any]], None], interval: float = 1.0) -> Callable[[], None]:
    """Call ``callback(snapshot)`` whenever the status changes; returns a function that stops it."""
    stop = threading.Event()

    def key(s: dict[str, Any]) -> Any:
        return [
            (
                a.get("alloc_id"),
                a.get("error"),
                [(m["name"], m["state"], [(p["rank"], p["state"]) for p in m["procs"]]) for m in a.get("meshes", [])],
                [(d["sid"], d["state"], d.get("line")) for d in a.get("debug_sessions", [])],
            )
            for a in s["allocators"]
        ]

    def loop() -> None:
        last = None
        while not stop.is_set():
            s = status()
            k = key(s)
            if k != last:
                last = k
                callback(s)
            stop.wait(interval)

    threading.Thread(target=loop, name="monarch_nb-status-watch", daemon=True).start()
    return stop.set
