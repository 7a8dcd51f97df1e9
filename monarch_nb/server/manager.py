"""What the sidebar shows and does, through monarch_nb's public API only.

No tornado and no kernels here: the state comes from :func:`monarch_nb.introspect.status`
(the runtime directory's connection files plus each live allocator's snapshot) and the actions
are the public functions a script could call. The handlers run these blocking calls on a
worker thread.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Any

from .. import _meshhtml

#: recent log lines: at most this many per rank, from at most this many ranks, this many in all
_LOG_TAIL_PER_RANK = 5
_LOG_MAX_RANKS = 64
_LOG_RECENT = 100
#: bytes read from the end of a rank's log file to find its last lines (logs can be huge)
_LOG_TAIL_BYTES = 16 * 1024
#: concurrent polls (several browser tabs) within this many seconds share one snapshot
_SNAPSHOT_TTL = 0.25

#: ranks remembered after their mesh stopped (for their log view), at most
_SEEN_MAX = 10_000
#: jobs are asked of their schedulers (squeue, ssh probes) at most this often
_JOBS_TTL = 5.0


class MeshManager:
    """Snapshots and actions for the JupyterLab sidebar (one per server)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap: dict[str, Any] | None = None
        self._snap_at = 0.0
        self._jobs: list[dict[str, Any]] = []
        self._jobs_at = -_JOBS_TTL
        #: (mesh, rank) -> host, pid, state and cause when last seen, for a log view after the mesh stopped
        self._seen: dict[tuple[str, int], dict[str, Any]] = {}
        #: mesh name -> what it was when last listed (owner, shape, allocators; no procs): a mesh
        #: whose every allocator stops answering is still shown, not dropped from the list
        self._seen_meshes: dict[str, dict[str, Any]] = {}
        #: recent log lines seen in earlier polls: they outlive the mesh that printed them
        self._recent: collections.OrderedDict[tuple[Any, ...], dict[str, Any]] = collections.OrderedDict()

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """Allocators, hosts, meshes (procs with states), debug sessions and recent log lines."""
        with self._lock:
            if self._snap is not None and time.monotonic() - self._snap_at < _SNAPSHOT_TTL:
                return self._snap
            snap = self._build()
            self._snap, self._snap_at = snap, time.monotonic()
            return snap

    def _invalidate(self) -> None:
        with self._lock:
            self._snap = None

    def _build(self) -> dict[str, Any]:
        from monarch_nb.allocator import list_allocators
        from monarch_nb.config import runtime_dir
        from monarch_nb.introspect import known_status

        jobs = self._job_rows()
        raw = known_status(jobs)
        allocators: list[dict[str, Any]] = []
        meshes: dict[str, dict[str, Any]] = {}
        debug: list[dict[str, Any]] = []
        seen_pids = set()
        for a in raw["allocators"]:
            addr = a.get("addr", "")
            host = a.get("host", "")
            seen_pids.add((host, a.get("pid")))
            allocators.append(
                {
                    "id": a.get("alloc_id", ""),
                    "addr": addr,
                    "tcp": a.get("tcp") or "",
                    "host": host,
                    "pid": a.get("pid"),
                    "alive": "error" not in a,
                    "error": a.get("error", ""),
                    "controllers": len(a.get("controllers", [])),
                    "lease_s": a.get("lease_s"),
                    "meshes": [m["name"] for m in a.get("meshes", [])],
                }
            )
            for m in a.get("meshes", []):
                _merge_mesh(meshes, m, addr, host)
            # the debugger reports its sessions here once it exists; nothing to show until then
            for d in a.get("debug_sessions", []):
                debug.append({**d, "alloc": addr, "host": d.get("host", host)})
        # connection files whose daemon is gone: listed so a user sees why nothing answers
        local = list_allocators()
        for info in local:
            if not info["alive"] and (info.get("host"), info.get("pid")) not in seen_pids:
                allocators.append(
                    {
                        "id": info.get("alloc_id", ""),
                        "addr": info.get("addr", ""),
                        "tcp": info.get("tcp") or "",
                        "host": info.get("host", ""),
                        "pid": info.get("pid"),
                        "alive": False,
                        "error": "not running (stale connection file)",
                        "controllers": 0,
                        "lease_s": None,
                        "meshes": [],
                    }
                )
        debug = _debug_rows(debug)
        paused = {(str(d.get("mesh", "")), int(d.get("rank", -1))) for d in debug if d.get("state", "paused") == "paused"}
        alive = {a["addr"] for a in allocators if a["alive"]}
        # allocators asked that did not answer (busy, stopped, their host cut off), not those known
        # gone (a stale connection file: its meshes went with it)
        silent = {str(a["addr"]): str(a["error"]) for a in raw["allocators"] if "error" in a and a.get("addr")}
        for m in meshes.values():
            self._seen_meshes.pop(m["name"], None)  # newest last: the oldest go first
            self._seen_meshes[m["name"]] = {k: v for k, v in m.items() if k not in ("procs", "states")}
        for name, last in self._seen_meshes.items():
            # listed before, by allocators none of which answers now: its ranks may run on there
            if name not in meshes and last["allocators"] and set(last["allocators"]) <= set(silent):
                meshes[name] = {**last, "procs": [], "states": [], "unreachable": True}
        mesh_list = sorted(meshes.values(), key=lambda m: m["name"])
        for m in mesh_list:
            m.pop("states")
            self._add_lost_ranks(m, alive, silent)
            m["procs"].sort(key=lambda p: p["rank"])
            for p in m["procs"]:
                if p["state"] in ("idle", "busy") and (m["name"], p["rank"]) in paused:
                    p["state"], p["reason"] = "paused", "paused at a breakpoint"
            # the dashboard's and %mesh status's words for the mesh as a whole
            m["state"], m["label"], m["hint"] = _meshhtml.mesh_state([p["state"] for p in m["procs"]])
            if m.pop("unreachable", False):
                # "stop it and spawn it again" would be wrong: nothing says it failed, only that
                # its host does not answer
                m["label"] = "unreachable"
                m["hint"] = (
                    "; ".join(f"allocator at {a} ({h}) did not answer: {silent[a]}" for a, h in zip(m["allocators"], m["hosts"]))
                    + ": its ranks' state is unknown; the mesh is still there if the host comes back"
                )
            for p in m["procs"]:
                self._seen.pop((m["name"], p["rank"]), None)  # newest last: the oldest go first
                self._seen[(m["name"], p["rank"])] = {k: p.get(k) for k in ("host", "pid", "state", "cause", "alloc")}
                self._seen[(m["name"], p["rank"])]["mesh_id"] = m["mesh_id"]
        # a mesh no longer listed was stopped: its ranks are history, never a later same-named mesh's lost ranks.
        # Not listed by an allocator that did not answer (busy, its host lost) says nothing of it
        listed = {m["name"] for m in mesh_list}
        for (name, _rank), seen in self._seen.items():
            if name not in listed and seen.get("alloc") in alive:
                seen["gone"] = True
        for name in [n for n, last in self._seen_meshes.items() if n not in listed and set(last["allocators"]) & alive]:
            del self._seen_meshes[name]
        while len(self._seen_meshes) > _SEEN_MAX:
            del self._seen_meshes[next(iter(self._seen_meshes))]
        while len(self._seen) > _SEEN_MAX:
            del self._seen[next(iter(self._seen))]
        me = socket.gethostname()
        return {
            "time": raw["time"],
            "server_host": me,
            "runtime_dir": runtime_dir(),
            # one legend for the sidebar, the dashboard and the notebook's grids
            "legend": {s: _meshhtml.STATE_COLOURS[s] for s in _meshhtml.LEGEND},
            "colours": dict(_meshhtml.STATE_COLOURS),
            # this runtime directory's own allocator ("Start allocator" starts it; a job's are not it)
            "local_allocator": any(a["alive"] and a.get("host") == me for a in local),
            "allocators": allocators,
            "hosts": _hosts(allocators, mesh_list),
            "meshes": mesh_list,
            "debug_sessions": debug,
            "logs": self._keep_logs(_recent_logs(mesh_list)),
            "jobs": jobs,
        }

    def _add_lost_ranks(self, m: dict[str, Any], alive: set[str], silent: dict[str, str]) -> None:
        """A rank seen before whose allocator no longer answers (its host died, or is cut off)
        is failed, as the dashboard draws it: its allocator cannot list it any more."""
        have = {p["rank"] for p in m["procs"]}
        for (name, rank), seen in list(self._seen.items()):
            # a rank of an earlier mesh of this name (stopped, then spawned again between two
            # polls) is not one of this mesh's: it would fail it for good
            other = bool(seen.get("mesh_id") and m["mesh_id"] and seen["mesh_id"] != m["mesh_id"])
            if name == m["name"] and rank not in have and not other and not seen.get("gone") and seen.get("alloc") not in alive:
                why = silent.get(str(seen.get("alloc")))
                cause = f"its host {seen.get('host')} does not answer (allocator {seen.get('alloc')}" + (
                    f": {why})" if why else ")"
                )
                m["procs"].append(
                    {**seen, "rank": rank, "state": "failed", "proc_state": "unknown", "activity": "", "cause": cause, "log": ""}
                )

    def _keep_logs(self, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The newest lines of this poll and earlier ones, in time order: a stopped mesh's
        last lines stay in view (a stopped mesh is no longer listed, so its files are not read)."""
        for r in fresh:
            self._recent[(r["ts"], r["mesh"], r["rank"], r["stream"], r["line"])] = r
        rows = sorted(self._recent.values(), key=lambda r: r["ts"])[-_LOG_RECENT:]
        self._recent = collections.OrderedDict(((r["ts"], r["mesh"], r["rank"], r["stream"], r["line"]), r) for r in rows)
        return rows

    def _job_rows(self) -> list[dict[str, Any]]:
        """``monarch_nb.job``'s records with their scheduler state, asked at most every few seconds."""
        if time.monotonic() - self._jobs_at < _JOBS_TTL:
            return self._jobs
        from monarch_nb.job import list_jobs

        try:
            rows = list_jobs()
        except Exception as e:  # the sidebar shows what it can
            rows = [{"name": "?", "scheduler": "?", "id": "", "state": f"unknown: {type(e).__name__}: {e}", "hosts": 0}]
        self._jobs = [job_row(r) for r in rows]
        self._jobs_at = time.monotonic()
        return self._jobs

    # ------------------------------------------------------------------ actions
    def start_allocator(self) -> dict[str, Any]:
        """Start this host's embedded allocator (or report the one already running)."""
        from monarch_nb.allocator import list_allocators, start_allocator

        before = {a["pid"] for a in list_allocators() if a["alive"]}
        info = start_allocator()
        self._invalidate()
        return {"started": info["pid"] not in before, "addr": info["addr"], "pid": info["pid"], "host": info.get("host", "")}

    def stop_mesh(self, name: str, alloc: str | None = None) -> dict[str, Any]:
        """Stop a mesh on every allocator that runs it (or only on ``alloc``), whoever owns it."""
        from monarch_nb.allocator import stop_mesh

        if not name:
            raise ValueError("a mesh name is required")
        self._check_alloc(alloc)
        # without alloc, stop_mesh finds it on the jobs' allocators too
        try:
            n = stop_mesh(name, alloc or None, force=True, reason="stopped from the JupyterLab sidebar")
        finally:
            # also when ranks on a lost host were left (ConnectError): the others did stop
            self._invalidate()
        return {"mesh": name, "stopped_procs": n}

    def rank_log(self, mesh: str, rank: int, tail: int | None = 500, alloc: str | None = None) -> dict[str, Any]:
        """The captured output of one rank, kept by its allocator (also after it crashed)."""
        from monarch_nb.errors import MeshError, MonarchNBError
        from monarch_nb.introspect import logs

        if tail is not None and tail < 0:
            raise ValueError(f"tail must be >= 0, got {tail}")
        self._check_alloc(alloc)
        st = self.state()
        proc = next((p for m in st["meshes"] if m["name"] == mesh for p in m["procs"] if p["rank"] == rank), None)
        addr = alloc or None
        if addr is None and proc is not None and any(a["alive"] and a["addr"] == proc.get("alloc") for a in st["allocators"]):
            # the rank's allocator as this server's state has it: its job rows are cached, and a
            # search through logs() would list the jobs again (one squeue per Slurm job) per click
            addr = proc["alloc"]
        try:
            # without an allocator, logs() finds the rank on the jobs' allocators too
            lines = logs(mesh, rank, tail=tail, addr=addr)
        except MonarchNBError as e:
            # (an allocator logs() chose that no longer answers: a rank whose host died)
            if (mesh, rank) not in self._seen or not (isinstance(e, MeshError) or not alloc):
                raise
            # its allocator dropped a stopped mesh's logs, or is gone: what this server kept of them
            lines = [r for r in self._recent.values() if r["mesh"] == mesh and r["rank"] == rank]
        if proc is not None:
            info = {k: proc.get(k) for k in ("host", "pid", "state", "cause")}
        elif (mesh, rank) in self._seen:
            seen = self._seen[(mesh, rank)]
            info = {k: v for k, v in seen.items() if k not in ("gone", "mesh_id")}
            if seen.get("gone") or any(a["alive"] and a["addr"] == seen.get("alloc") for a in st["allocators"]):
                info["state"] = "stopped"
                info["cause"] = info.get("cause") or "its mesh was stopped"
            else:
                # as the dashboard draws a rank its allocator no longer lists: it may run on
                info["state"] = "failed"
                info["cause"] = f"its host {seen.get('host')} does not answer (allocator {seen.get('alloc')})"
        else:
            info = {"host": "", "pid": None, "state": "stopped", "cause": "not running"}
        # how it died, in the words of the rank's state ("killed by SIGKILL", "exited with code 3")
        return {"mesh": mesh, "rank": rank, "lines": lines, "proc": info}

    def _check_alloc(self, alloc: str | None) -> None:
        """A request names only an allocator this server knows: it never connects where a URL says."""
        if not alloc:
            return
        known = {a["addr"] for a in self.state()["allocators"]}
        if alloc not in known:
            self._invalidate()  # one that started a moment ago
            known = {a["addr"] for a in self.state()["allocators"]}
        if alloc not in known:
            raise PermissionError(f"{alloc!r} is not an allocator this server knows (see /monarch-nb/api/state)")


# ---------------------------------------------------------------------- helpers
def _merge_mesh(meshes: dict[str, dict[str, Any]], m: dict[str, Any], addr: str, host: str) -> None:
    """A multi-host mesh shows up on every allocator it spans; the sidebar shows it once."""
    out = meshes.get(m["name"])
    if out is None:
        out = meshes[m["name"]] = {
            "name": m["name"],
            "owner": m.get("owner", ""),
            "persist": m.get("persist", False),
            "labels": list(m.get("labels") or []),
            "sizes": list(m.get("sizes") or []),
            "extent": m.get("extent"),
            "mesh_id": m.get("mesh_id", ""),
            "actors": list(m.get("actors") or []),
            "allocators": [],
            "hosts": [],
            "states": [],
            "procs": [],
        }
    out["allocators"].append(addr)
    out["hosts"].append(host)
    out["states"].append(m.get("state", ""))
    for a in m.get("actors") or []:
        if a not in out["actors"]:
            out["actors"].append(a)
    for p in m.get("procs", []):
        state, reason = _meshhtml.rank_state(p)
        out["procs"].append(
            {
                "rank": p["rank"],
                "pid": p.get("pid"),
                # the dashboard's states (idle, busy, paused, failed, stopped), not the allocator's
                "state": state,
                "proc_state": p.get("state", "unknown"),
                "activity": p.get("activity") or "",
                # a proc that lives on after its actor failed has no cause of its own: the actor's
                "cause": p.get("cause") or (reason if p.get("actor_failed") else ""),
                "host": host,
                "alloc": addr,
                "log": p.get("log") or "",
            }
        )


def _debug_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Debug sessions with where each rank stopped and the ``%mesh attach`` line that reaches
    exactly that session: by actor name when it is the only actor mesh of that name paused there,
    else by actor id (``%mesh attach NAME RANK`` refuses a name two actor meshes share)."""
    import shlex

    ids: dict[tuple[str, int], set[str]] = {}
    for d in rows:
        ids.setdefault((str(d.get("actor") or ""), int(d.get("rank", -1))), set()).add(str(d.get("actor_id") or ""))
    out = []
    for d in rows:
        actor, rank, actor_id = str(d.get("actor") or ""), int(d.get("rank", -1)), str(d.get("actor_id") or "")
        target = actor if actor and len(ids[(actor, rank)]) == 1 else actor_id or actor
        where = f"{d['file']}:{d.get('line', 0)}" if d.get("file") else ""
        if where and d.get("function"):
            where += f" in {d['function']}"
        out.append(
            {**d, "where": d.get("where") or where, "attach": f"%mesh attach {shlex.quote(target)} {rank}" if target else ""}
        )
    return out


def job_row(r: dict[str, Any]) -> dict[str, Any]:
    """A job record for the sidebar and the dashboard: the hosts the scheduler lost listed apart."""
    state = str(r.get("state", ""))
    lost = list(r.get("lost") or [])
    return {
        "name": str(r.get("name", "")),
        "scheduler": str(r.get("scheduler", "?")),
        "id": str(r.get("id", "")),
        "state": "lost" if lost else state,
        "detail": state,
        "hosts": r.get("hosts", 0),
        "lost": lost,
        "age_s": r.get("age_s"),
        "walltime_left_s": r.get("walltime_left_s"),
        "addrs": [str(a) for a in r.get("addrs") or []],
        "key_file": str(r.get("key_file") or ""),
    }


def _hosts(allocators: list[dict[str, Any]], meshes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    hosts: dict[str, dict[str, Any]] = {}
    for a in allocators:
        h = hosts.setdefault(a["host"], {"host": a["host"], "allocators": [], "procs": 0, "states": {}})
        h["allocators"].append(a["addr"])
    for m in meshes:
        for p in m["procs"]:
            h = hosts.setdefault(p["host"], {"host": p["host"], "allocators": [], "procs": 0, "states": {}})
            h["procs"] += 1
            h["states"][p["state"]] = h["states"].get(p["state"], 0) + 1
    return sorted(hosts.values(), key=lambda h: h["host"])


def _recent_logs(meshes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last few lines of each rank, newest last.

    Read from the end of each local log file rather than asked of the allocator, which would
    read whole files every poll (a flooding rank's log can be large). Ranks on other hosts are
    left out here; their full log is one click away (:meth:`MeshManager.rank_log`).
    """
    import json

    me = socket.gethostname()
    out: list[dict[str, Any]] = []
    n = 0
    for m in meshes:
        for p in m["procs"]:
            if n >= _LOG_MAX_RANKS:
                break
            if p["host"] != me or not p["log"]:
                continue
            n += 1
            for raw in _tail_lines(p["log"], _LOG_TAIL_PER_RANK):
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue  # a line the allocator is still writing
                out.append(
                    {
                        "ts": row.get("ts", 0.0),
                        "mesh": m["name"],
                        "rank": p["rank"],
                        "stream": row.get("stream", ""),
                        "line": row.get("line", ""),
                    }
                )
    out.sort(key=lambda r: r["ts"])
    return out[-_LOG_RECENT:]


def _tail_lines(path: str, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if size > _LOG_TAIL_BYTES:
        lines = lines[1:]  # the first one is cut
    return [ln.decode("utf-8", "replace") for ln in lines if ln.strip()][-n:]
