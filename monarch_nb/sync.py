"""Send the local workspace to the hosts and reload it in running procs (``%mesh sync``).

Content-addressed and incremental: the controller hashes its files, asks each host's
allocator which contents it lacks, and sends only those, once per host however many procs
run there. The synced tree lives in the host's cache and is first on every proc's
``sys.path``. Running procs then reload the changed modules in place (same PIDs; actors keep
their state and run the new endpoint code from their next call), or re-create the affected
actors (``reload="recreate"``), or are restarted (``reload="restart"``, required after an
environment change to a compiled package).
"""

from __future__ import annotations

import hashlib
import html
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from . import _workspace
from ._numtext import plural
from ._ranks import format_ranks
from ._runtime import records
from .actor import ProcMesh, _context
from .actor._reload import KEEPS
from .errors import ActorError, MonarchNBError, SupervisionError, safe_str

__all__ = ["HostSync", "SyncError", "SyncReport", "sync", "watch"]

#: bytes per message when sending file contents to an allocator
BATCH_BYTES = 16 << 20

_hash_cache: dict[str, tuple[float, int, str]] = {}

#: files of each kind (added, changed, removed) a report lists by name
FILES_SHOWN = 20


@dataclass
class HostSync:
    host: str
    allocator: str
    path: str = ""
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    files_sent: int = 0


@dataclass
class SyncReport:
    """What one sync did: per host, the files added/changed/removed and the bytes that crossed."""

    workspace: str
    root: str
    hosts: list[HostSync]
    reloads: list[dict[str, Any]] = field(default_factory=list)
    staged_bytes: int = 0
    #: procs that could not reload because they are gone (a dead rank of a failed mesh): why
    not_reloaded: list[str] = field(default_factory=list)
    #: symlinked folders left out, and why (a link back into a folder it is in)
    not_followed: list[str] = field(default_factory=list)
    #: procs whose reload raised: mesh, rank, host, pid and the error (an ``ActorError``)
    reload_failed: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(h.bytes_sent for h in self.hosts) + self.staged_bytes

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        return [(h.host, str(len(h.added)), str(len(h.changed)), str(len(h.removed)), f"{h.bytes_sent:,}") for h in self.hosts]

    def _reload_line(self) -> str:
        if not self.reloads and not self.not_reloaded:
            return ""
        mods = sorted({m for r in self.reloads for m in r.get("reloaded", [])})
        actors = sorted({a for r in self.reloads for a in (*r.get("updated", []), *r.get("recreated", []))})
        pids = len({r.get("pid") for r in self.reloads})
        line = f"reloaded {', '.join(mods) or 'nothing'} in {plural(pids, 'proc')} (same PIDs); actors updated: {', '.join(actors) or 'none'}"
        if self.not_reloaded:
            line += f"; not reloaded, gone: {'; '.join(self.not_reloaded)}"
        return line

    def _failed_lines(self) -> list[str]:
        """One line per distinct reload error, with the procs that raised it."""
        by_error: dict[str, list[dict[str, Any]]] = {}
        for f in self.reload_failed:
            # the error alone: what else reloaded in that proc differs from proc to proc
            why = _first_line(f["error"]).removeprefix("reload failed: ").split(KEEPS, 1)[0]
            by_error.setdefault(why, []).append(f)
        lines = []
        for err, fs in by_error.items():
            where: dict[str, list[int]] = {}
            for f in fs:
                where.setdefault(f["mesh"], []).append(f["rank"])
            places = "; ".join(f"mesh {m!r} rank{'s' if len(r) > 1 else ''} {format_ranks(r)}" for m, r in where.items())
            lines.append(f"reload failed in {len(fs)} proc{'s' if len(fs) > 1 else ''} ({places}): {err}")
        if lines:
            lines.append("what failed keeps its previous code there (its actors too) until a sync reloads it")
        return lines

    def _file_lines(self) -> list[str]:
        """The files added, changed and removed, at most ``FILES_SHOWN`` of each, then how many
        more: a list cut at 20 without a word read as all there was."""
        if not self.hosts:
            return []
        h = self.hosts[0]  # every host got the same tree; list the files once
        out: list[str] = []
        for tag, what, files in (("+", "added", h.added), ("~", "changed", h.changed), ("-", "removed", h.removed)):
            out.extend(f"{tag} {f}" for f in files[:FILES_SHOWN])
            if len(files) > FILES_SHOWN:
                out.append(f"{tag} … and {len(files) - FILES_SHOWN} more {what} (.hosts[0].{what} lists them all)")
        return out

    def __repr__(self) -> str:
        lines = [f"synced {self.root} -> {self.workspace}"]
        for host, a, c, r, b in self._rows():
            lines.append(f"  {host}: +{a} added, ~{c} changed, -{r} removed, {b} bytes")
        lines.extend(f"    {f}" for f in self._file_lines())
        lines.extend(f"  not synced: {s}" for s in self.not_followed)
        if self._reload_line():
            lines.append(self._reload_line())
        lines.extend(self._failed_lines())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(h)}</td><td>{a}</td><td>{c}</td><td>{r}</td><td>{b}</td></tr>"
            for h, a, c, r, b in self._rows()
        )
        items = [f"<li><code>{html.escape(f)}</code></li>" for f in self._file_lines()]
        files = f"<ul>{''.join(items)}</ul>" if items else ""
        files += "".join(f"<div>not synced: {html.escape(s)}</div>" for s in self.not_followed)
        return (
            f"<b>synced</b> <code>{html.escape(self.root)}</code>"
            f"<table><tr><th>host</th><th>added</th><th>changed</th><th>removed</th><th>bytes sent</th></tr>{rows}</table>"
            f"{files}<div>{html.escape(self._reload_line())}</div>"
            + "".join(f"<div><b>{html.escape(x)}</b></div>" for x in self._failed_lines())
        )


class SyncError(ActorError):
    """The files reached the hosts, but a synced module raised while reloading in some procs.

    ``reports`` (one per synced path; ``report``, the first with a failure) say what was synced,
    what reloaded, and which module failed on which ranks; the error itself is the first failing
    proc's, with its remote traceback. What failed keeps its previous code until a sync reloads it.
    """

    reports: list[SyncReport]

    @classmethod
    def _of(cls, reports: list[SyncReport]) -> SyncError:
        report = next(r for r in reports if r.reload_failed)
        first = report.reload_failed[0]
        e: ActorError = first["error"]
        err = cls(e.exception, e.remote_traceback, rank=first["rank"], host=first["host"], message=e.message)
        err.reports = reports
        return err

    @property
    def report(self) -> SyncReport:
        return next(r for r in self.reports if r.reload_failed)

    def _summary(self) -> str:
        first = self.report.reload_failed[0]
        return "\n".join(map(repr, self.reports)) + f"\nRemote traceback of mesh {first['mesh']!r} rank {first['rank']}:"

    def __str__(self) -> str:
        if not getattr(self, "reports", None):
            return super().__str__()
        from ._errgroup import clean_traceback

        return f"{self._headline()}\n{self._summary()}\n{clean_traceback(self.exception_formatted)}"

    def _render_traceback_(self) -> list[str]:
        lines = super()._render_traceback_()
        if getattr(self, "reports", None) and len(lines) > 1 and lines[1] == "Remote traceback:":
            lines[1:2] = self._summary().splitlines()
        return lines


def _add_hosts(allocs: dict[str, str], meshes: list[ProcMesh]) -> None:
    for m in meshes:
        for p in m._procs:
            if p.alloc:
                allocs.setdefault(p.alloc, p.host)


def _targets(meshes: list[ProcMesh] | None, named_only: bool = False) -> tuple[dict[str, str], list[ProcMesh], set[str]]:
    """Allocator address -> host name, the meshes whose procs reload, and the allocators that
    only an unnamed mesh brought in (one of those that is gone is skipped, not an error)."""
    from . import _registry

    if meshes is not None:
        allocs: dict[str, str] = {}
        _add_hosts(allocs, meshes)
        return allocs, meshes, set()
    # the named ones (%mesh spawn, re-attached) and every other live one this controller
    # spawned (this_host().spawn_procs(...), Monarch's way), which used to get the files
    # but not the reload: its running procs never saw the synced tree on their sys.path.
    # A restart replaces a mesh under its %mesh name: a mesh the user holds only as a
    # variable would be stopped under them, so a restart takes the named ones only
    named = [m for m in _registry.meshes().values() if not m._stopped]
    allocs = {h.alloc: h.host for h in _registry.hosts()._refs()}
    _add_hosts(allocs, named)
    required = set(allocs)
    unnamed: list[ProcMesh] = []
    if not named_only:
        client = _context.client()
        seen = {id(m) for m in named}
        for m in list(client.owned.values()):
            hosts_of = {p.alloc for p in m._procs if p.alloc}
            if id(m) in seen or m._stopped or (hosts_of and all(map(client.rt.supervision.is_lost, hosts_of))):
                continue  # one whose hosts are all known lost has nothing to take the files
            seen.add(id(m))
            unnamed.append(m)
    _add_hosts(allocs, unnamed)
    return allocs, named + unnamed, set(allocs) - required


def sync(
    paths: list[str] | str | None = None,
    *,
    meshes: list[ProcMesh] | ProcMesh | None = None,
    excludes: list[str] | tuple[str, ...] = (),
    via: str | None = None,
    reload: str | None = "inplace",
) -> list[SyncReport]:
    """Sync each path (default: the current directory, a notebook's folder) to the hosts.

    ``meshes`` (default: every live mesh this controller spawned or re-attached, and the attached
    hosts) are the procs that reload; ``via`` is an fsspec URL the hosts pull from instead of receiving the
    contents over their allocator connection; ``reload`` is ``"inplace"``, ``"recreate"``,
    ``"restart"`` or ``None``.

    Raises ``SyncError`` when a synced module failed to reload, and ``PermissionError`` naming
    every file or folder of the paths this user cannot read (before anything is sent).
    """
    if reload not in ("inplace", "recreate", "restart", None):
        raise ValueError(f"reload must be 'inplace', 'recreate', 'restart' or None, not {reload!r}")
    roots = [paths] if isinstance(paths, str) else list(paths or [os.getcwd()])
    if isinstance(meshes, ProcMesh):
        meshes = [meshes]
    allocs, target_meshes, optional = _targets(meshes, named_only=reload == "restart")
    if not allocs:
        raise ValueError("no hosts to sync to: `%mesh connect` first")
    scanned = []
    for root in roots:
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"cannot sync {root}: not a directory")
        skipped: list[str] = []
        # every path before any is sent: an unreadable file in the second one raised after the
        # first was synced and reloaded, and its report was lost with the error
        scanned.append((root, _workspace.scan(root, excludes, _hash_cache, skipped), skipped))
    reports = []
    for root, manifest, skipped in scanned:
        reports.append(_sync_root(root, manifest, skipped, allocs, target_meshes, via, reload, optional))
    if any(r.reload_failed for r in reports):
        # after every path was synced: the report says what did reach the hosts and reload
        raise SyncError._of(reports)
    return reports


def _sync_root(
    root: str,
    manifest: _workspace.Manifest,
    skipped: list[str],
    allocs: dict[str, str],
    meshes: list[ProcMesh],
    via: str | None,
    reload: str | None,
    optional: set[str],
) -> SyncReport:
    client = _context.client()
    ws = _workspace.workspace_id(root)
    report = SyncReport(ws, root, [HostSync(host, alloc) for alloc, host in allocs.items()], not_followed=skipped)
    state = _Progress()
    try:
        _sync_steps(client, report, root, manifest, allocs, meshes, via, reload, optional, state)
    except KeyboardInterrupt as e:
        _note_interrupted(e, report, root, meshes, reload, state)
        raise
    return report


def _sync_steps(
    client: Any,
    report: SyncReport,
    root: str,
    manifest: _workspace.Manifest,
    allocs: dict[str, str],
    meshes: list[ProcMesh],
    via: str | None,
    reload: str | None,
    optional: set[str],
    state: _Progress,
) -> None:
    timeout = client.rt.cfg.spawn_timeout
    ws = report.workspace
    by_digest = {d: rel for rel, (d, _s, _m) in manifest.items()}
    digests = list(by_digest)
    client.revive_lost(hs.allocator for hs in report.hosts)  # those declared lost: their hellos at once
    missing = {hs.allocator: client.request(hs.allocator, "sync_missing", digests) for hs in report.hosts}
    lacking: dict[str, Any] = {}
    gone: set[str] = set()
    for a, f in missing.items():
        try:
            lacking[a] = f.get(timeout=timeout)
        except MonarchNBError as e:
            if a not in optional:
                raise
            # the allocator of an unnamed mesh that is gone (its host or job ended since)
            gone.add(a)
            report.not_reloaded.append(f"host {allocs[a]} ({a}): {_first_line(e)}")
    if gone:
        # its procs get no reload: _reload asks only procs of the hosts left in the report
        report.hosts = [hs for hs in report.hosts if hs.allocator not in gone]
    if via:
        report.staged_bytes = _stage(via, root, by_digest, sorted({d for ds in lacking.values() for d in ds}))
        pulls = [client.request(a, "sync_pull", via, ds) for a, ds in lacking.items() if ds]
        for f in pulls:
            f.get(timeout=timeout)
    else:
        for hs in report.hosts:
            small = [d for d in lacking[hs.allocator] if manifest[by_digest[d]][1] < BATCH_BYTES]
            for batch in _batches(root, by_digest, small):
                client.request(hs.allocator, "sync_put", batch).get(timeout=timeout)
                hs.bytes_sent += sum(len(b) for b in batch.values())
                hs.files_sent += len(batch)
            for d in lacking[hs.allocator]:
                if manifest[by_digest[d]][1] >= BATCH_BYTES:
                    rel = by_digest[d]
                    hs.bytes_sent += _put_parts(client, hs.allocator, root, rel, d, manifest[rel][1], timeout)
                    hs.files_sent += 1
    state.stage = "commit"
    for hs in report.hosts:
        state.commits[hs.allocator] = client.request(hs.allocator, "sync_commit", ws, manifest)
    for hs in report.hosts:
        _committed(hs, state.commits[hs.allocator].get(timeout=timeout))
    state.stage = "reload"
    if reload is not None and meshes:
        report.reloads = _reload(report, meshes, reload)


def _committed(hs: HostSync, diff: dict[str, Any]) -> None:
    hs.path, hs.added, hs.changed, hs.removed = diff["path"], diff["added"], diff["changed"], diff["removed"]


#: how long an interrupted sync waits for the hosts to answer the commit they were sent
COMMIT_WAIT = 2.0


@dataclass
class _Progress:
    """How far a sync got, for an interrupt's note: sending the files, the hosts' commit (whose
    futures are kept), or the reloads."""

    stage: Literal["send", "commit", "reload"] = "send"
    commits: dict[str, Any] = field(default_factory=dict)


def _note_interrupted(
    e: BaseException,
    report: SyncReport,
    root: str,
    meshes: list[ProcMesh],
    reload: str | None,
    state: _Progress,
) -> None:
    """What an interrupted sync left: the future's "only the wait stopped: reload on ipc://…
    goes on, and .get() or await waits for it again" named a socket, and a future the user does
    not have. An interrupt between the hosts' commit and the reloads left the procs on the old
    code for good: a second sync found nothing changed, and reloaded nothing. That step is
    finished here instead (the commit is a quick answer; the reloads are sent, not waited for)."""
    e.__notes__ = [n for n in getattr(e, "__notes__", []) if "only the wait stopped" not in n]
    stage = state.stage
    if stage == "send":
        e.add_note(
            f"monarch_nb: the sync of {root} stopped before the hosts took the new files: the procs run the code "
            "they had; syncing again sends what is still missing."
        )
        return
    if stage == "commit":
        from ._deadline import budget

        left = budget(COMMIT_WAIT)
        try:
            for hs in report.hosts:
                # no commit future: the interrupt came while they were being sent
                f = state.commits.get(hs.allocator)
                if not hs.path and f is not None:
                    _committed(hs, f.get(timeout=left()))
        except (KeyboardInterrupt, Exception):
            pass  # interrupted again, or a host that failed to answer: told as not known to have taken them
        if not all(hs.path for hs in report.hosts):
            e.add_note(
                f"monarch_nb: the sync of {root} stopped while the hosts took the new files; if they did, the procs "
                "did not reload them, and syncing again finds nothing changed: %mesh sync --restart restarts them."
            )
            return
        if reload == "restart" and meshes:
            e.add_note(
                f"monarch_nb: only the wait stopped: the hosts took the new files of {root}; "
                "`%mesh sync --restart` restarts the procs."
            )
            return
        if reload is not None and meshes:
            _reload_requests(report, meshes, reload)
    n = sum(len({p.addr for p in m._procs}) for m in meshes)
    names = ("mesh " if len(meshes) == 1 else "meshes ") + ", ".join(repr(m.name) for m in meshes)
    if reload is None or not meshes:
        e.add_note(f"monarch_nb: only the wait stopped: the hosts took the new files of {root}; no reload was asked.")
    elif reload == "restart":
        e.add_note(
            f"monarch_nb: the hosts took the new files of {root}; the restart of {names} was interrupted: "
            "`%mesh status` shows which procs are up, `%mesh sync --restart` restarts them again."
        )
    else:
        e.add_note(
            f"monarch_nb: only the wait stopped: the hosts took the new files of {root}, and {plural(n, 'proc')} of "
            f"{names} reload them on: the wait for them stopped, not the reload."
        )


def _first_line(e: BaseException) -> str:
    return (safe_str(e).splitlines() or [type(e).__name__])[0]


def _changed(root: str, rel: str) -> RuntimeError:
    # the host refused it as "blob … does not match its content", naming neither the file nor
    # the cause (an editor saving, or a watch firing, in the middle of a sync)
    return RuntimeError(f"{rel} changed in {root} while it was being synced: sync again")


def _unreadable(root: str, rel: str) -> PermissionError:
    # read for a host that lacks it, after a scan that took its hash from the cache (a chmod
    # leaves the mtime as it was): nothing of this path is committed until every file is sent
    return _workspace.unreadable_error(root, [rel], after=f"the hosts keep the tree of {root} the last sync left")


def _read(root: str, rel: str, digest: str = "") -> bytes:
    try:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{rel} was removed from {root} while it was being synced: sync again") from None
    except PermissionError:
        raise _unreadable(root, rel) from None
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise _changed(root, rel)
    return data


def _batches(root: str, by_digest: dict[str, str], digests: list[str]) -> Any:
    batch: dict[str, bytes] = {}
    size = 0
    for d in digests:
        data = _read(root, by_digest[d], d)
        batch[d] = data
        size += len(data)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def _put_parts(client: Any, alloc: str, root: str, rel: str, digest: str, size: int, timeout: float) -> int:
    """Send one large file in parts of ``BATCH_BYTES``: as one message, hundreds of MiB kept
    the host's allocator from answering heartbeats for seconds (a remote host is lost after
    ``heartbeat_timeout``, and every mesh on it with it). Returns bytes sent."""
    token = os.urandom(8).hex()  # this upload's, should another controller send the same file
    try:
        f = open(os.path.join(root, rel), "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{rel} was removed from {root} while it was being synced: sync again") from None
    except PermissionError:
        raise _unreadable(root, rel) from None
    offset = 0
    h = hashlib.sha256()
    with f:
        while offset < size:
            data = f.read(min(BATCH_BYTES, size - offset))
            h.update(data)
            if not data or (offset + len(data) == size and h.hexdigest() != digest):
                raise _changed(root, rel)
            client.request(alloc, "sync_put_part", digest, token, offset, data, size).get(timeout=timeout)
            offset += len(data)
    return offset


def put_blobs(client: Any, alloc: str, blobs: dict[str, bytes], timeout: float) -> int:
    """Send contents already in memory (digest -> bytes) to an allocator in messages of about
    ``BATCH_BYTES``, a large one in parts (``%mesh env sync`` ships a distribution's files: one
    message of all of them held the host's I/O thread, and its heartbeats, for seconds).
    Returns bytes sent."""
    n = size = 0
    batch: dict[str, bytes] = {}
    for d, data in blobs.items():
        if len(data) >= BATCH_BYTES:
            token = os.urandom(8).hex()
            for off in range(0, len(data), BATCH_BYTES):
                part = data[off : off + BATCH_BYTES]
                client.request(alloc, "sync_put_part", d, token, off, part, len(data)).get(timeout=timeout)
            n += len(data)
            continue
        batch[d] = data
        size += len(data)
        if size >= BATCH_BYTES:
            client.request(alloc, "sync_put", batch).get(timeout=timeout)
            n, size, batch = n + size, 0, {}
    if batch:
        client.request(alloc, "sync_put", batch).get(timeout=timeout)
        n += size
    return n


def _stage(url: str, root: str, by_digest: dict[str, str], digests: list[str]) -> int:
    """Put contents the hosts lack into the staging area; returns bytes uploaded."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, base = fsspec.core.url_to_fs(url)
    base = base.rstrip("/")
    local = isinstance(fs, LocalFileSystem)
    if local:
        _private_staging(f"{base}/blobs")
    else:  # an object store's permissions are its bucket's
        fs.makedirs(f"{base}/blobs", exist_ok=True)
    n = 0
    for d in digests:
        path = f"{base}/blobs/{d}"
        if fs.exists(path):
            continue
        data = _read(root, by_digest[d], d)
        if local:
            # 0600 whatever the umask, through a fresh name (O_EXCL follows no link), removed if
            # the write fails; a blob can be staged again, so no fsync
            records.write_private(path, data, fsync=False)
        else:
            fs.pipe_file(path, data)
        n += len(data)
    return n


def _private_staging(blobs: str) -> None:
    """The staging area's ``blobs`` folder on a file system (shared with the hosts, and so with
    other users of them): made 0700 whatever the umask, and refused unless it is ours. With the
    umask's 0755 and 0644 every user of the file system could read the synced code."""
    os.makedirs(os.path.dirname(blobs), exist_ok=True)  # the folder the user named: its mode is theirs
    try:
        os.mkdir(blobs, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(blobs)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
        raise PermissionError(
            f"cannot stage in {blobs}: it is {what}, not a folder of this user's (uid {os.geteuid()}); "
            "pass sync(via=...) a staging folder of your own"
        )
    if st.st_mode & 0o077:
        os.chmod(blobs, 0o700)  # staged before session 28, with the umask's mode


def _reload_requests(report: SyncReport, meshes: list[ProcMesh], mode: str) -> list[tuple[Any, Any]]:
    """Ask every proc of ``meshes`` to reload what changed on its host: ``(proc, future)`` pairs."""
    client = _context.client()
    changed_by_alloc = {hs.allocator: (hs.path, hs.changed + hs.removed) for hs in report.hosts}
    futs = []
    for m in meshes:
        for p in {p.addr: p for p in m._procs}.values():
            path, changed = changed_by_alloc.get(p.alloc, ("", []))
            if path:
                futs.append((p, client.request(p.addr, "reload", path, changed, mode, report.root, _actor="__sys__")))
    return futs


def _reload(report: SyncReport, meshes: list[ProcMesh], mode: str) -> list[dict[str, Any]]:
    client = _context.client()
    if mode == "restart":
        from . import _registry

        out = []
        for m in meshes:
            out.append({"restarted": m.name, **_registry.restart(m)})
        return out
    futs = _reload_requests(report, meshes, mode)
    out = []
    for p, f in futs:
        try:
            out.append(f.get(timeout=client.rt.cfg.spawn_timeout))
        except SupervisionError as e:
            # a dead rank of a failed mesh: the other procs, and the sync itself, go on
            report.not_reloaded.append(_first_line(e))
        except ActorError as e:
            # a module that raised at import: every proc is asked, and sync() raises with the report
            report.reload_failed.append({"mesh": p.mesh, "rank": p.rank, "host": p.host, "pid": p.pid, "error": e})
    return out


class Watcher:
    """Re-syncs when files under the roots change; ``stop()`` ends it."""

    def __init__(self, paths: list[str] | None, interval: float, kwargs: dict[str, Any]) -> None:
        self.roots = [os.path.abspath(p) for p in (paths or [os.getcwd()])]
        for root in self.roots:
            if not os.path.isdir(root):
                # as sync() says it, not a watch that never fires
                raise FileNotFoundError(f"cannot sync {root}: not a directory")
        self.interval = interval
        self.kwargs = kwargs
        self.reports: list[SyncReport] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._last = {r: _workspace.scan(r, kwargs.get("excludes", ()), _hash_cache) for r in self.roots}
        self._thread = threading.Thread(target=self._run, name="monarch_nb-sync-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing: dict[str, str] = {}  # root -> why its last scan failed, said once
        while not self._stop.wait(self.interval):
            for r in self.roots:
                try:
                    now = _workspace.scan(r, self.kwargs.get("excludes", ()), _hash_cache)
                except Exception as e:
                    # it ended the watch's thread (an unreadable file saved into the tree): the
                    # watch still said "watching" and never synced again
                    if failing.get(r) != str(e):
                        failing[r] = str(e)
                        self.errors.append(str(e))
                        print(f"monarch_nb: sync of {r} failed: {e}", flush=True)
                    continue
                failing.pop(r, None)
                if now == self._last[r]:
                    continue
                self._last[r] = now
                try:
                    rep = sync(r, **self.kwargs)[0]
                    self.reports.append(rep)
                    print(rep, flush=True)
                except Exception as e:
                    self.errors.append(str(e))
                    print(f"monarch_nb: sync of {r} failed: {e}", flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __repr__(self) -> str:
        return f"<watching {', '.join(self.roots)} every {self.interval} s; {len(self.reports)} syncs>"


def watch(paths: list[str] | None = None, interval: float = 0.5, **kwargs: Any) -> Watcher:
    """Sync (and reload) whenever a file under ``paths`` changes, until ``.stop()``."""
    return Watcher(paths, interval, kwargs)
