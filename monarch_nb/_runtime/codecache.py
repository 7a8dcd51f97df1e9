"""An allocator's cache of synced workspaces: content-addressed blobs and materialised trees.

Blobs live once per host under ``blobs/<2 hex>/<sha256>``; each workspace is a tree under
``ws/<workspace id>/`` whose files are hard links to its blobs, so a sync that changes one file
writes one file. Trees survive controllers (and kernel restarts); new procs get them on
``sys.path``.

The cache has limits (``code_max_age``, ``code_max_total_bytes``), applied by
``monarch-nb gc`` (:func:`collect`): a workspace not synced for the age, or the least recently
synced ones while the cache is over the size, go, unless a running allocator serves it (each
lists its workspaces in ``in-use-<allocator id>``); then every blob no tree links any more.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError
from ._private import private


def _private_dirs(path: str) -> None:
    """``os.makedirs(path)``, each folder it makes 0700 (makedirs gives the umask's mode to all
    but the last): a workspace's folders are as private as the cache's own, whatever the umask."""
    if os.path.isdir(path):
        return
    _private_dirs(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _copy_private(src: str, dst: str, mode: int) -> None:
    """Copy ``src`` to ``dst`` with ``mode`` (the user's bits only): ``shutil.copyfile`` gives
    the umask's (0644), and a file left by a crash keeps its own."""
    with open(src, "rb") as f, open(dst, "wb", opener=private) as g:
        os.fchmod(g.fileno(), mode)
        shutil.copyfileobj(f, g)


class CodeCache:
    def __init__(self, root: str, owner: str = "") -> None:
        self.root = root
        #: the allocator whose procs import from these trees (named in ``in-use-<owner>``)
        self.owner = owner
        # makedirs gives only the leaf its mode: the cache's own folder is made 0700 first
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(root, "blobs"), mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(root, "ws"), mode=0o700, exist_ok=True)
        #: workspace id -> manifest of what is materialised
        self.manifests: dict[str, dict[str, tuple[str, int, int]]] = {}
        # commits run on worker threads (two controllers may sync at once), spawns read the trees
        self._lock = threading.Lock()
        self._stamps = self._keeps_stamps()

    def _keeps_stamps(self) -> bool:
        """Whether this file system keeps the nanoseconds of an mtime (a stamp; not on coarse ones)."""
        probe = os.path.join(self.root, "blobs", f".stamp-{os.getpid()}-{threading.get_ident()}")
        try:
            with open(probe, "wb", opener=private):
                pass
            os.utime(probe, ns=(0, 5 * NS + 123456789))
            return os.stat(probe).st_mtime_ns == 5 * NS + 123456789
        except OSError:
            return False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _stamp(self, path: str, digest: str) -> None:
        """Mark ``path`` (a blob, or a copy of one) as holding ``digest``'s content: the nanoseconds
        of its mtime encode the digest, and any write through any of its links sets the mtime anew."""
        if self._stamps:
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - st.st_mtime_ns % NS + _mark(digest)))

    def _intact(self, path: str, digest: str) -> bool:
        """Whether ``path`` still holds what it was stored with. A tree's files are hard links to
        the blobs: a rank that rewrote a synced file in place (a results file kept in the repo)
        changed the blob, and every later sync of that content, in any workspace, got the
        rank's bytes, and re-syncing did not repair it (the host "had" the blob)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return not self._stamps or st.st_mtime_ns % NS == _mark(digest)

    def _blob(self, digest: str) -> str:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ProtocolError(f"not a sha256 digest: {digest[:80]!r}")
        return os.path.join(self.root, "blobs", digest[:2], digest)

    def ws_path(self, ws: str) -> str:
        if not ws or "/" in ws or ws in (".", "..") or "\0" in ws:
            raise ProtocolError(f"bad workspace id {ws!r}")
        return os.path.join(self.root, "ws", ws)

    def missing(self, digests: list[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if not self._intact(self._blob(d), d)]

    def put(self, blobs: dict[str, Any]) -> int:
        """Store blobs (digest -> bytes); each is checked against its digest. Returns bytes written."""
        n = 0
        for digest, data in blobs.items():
            data = bytes(data)
            if hashlib.sha256(data).hexdigest() != digest:
                raise ProtocolError(f"blob {digest[:12]}… does not match its content; refusing it")
            path = self._blob(digest)
            if self._intact(path, digest):
                continue
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            # puts run on worker threads, the same blob perhaps on two at once
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb", opener=private) as f:
                f.write(data)
            self._stamp(tmp, digest)
            os.replace(tmp, path)
            n += len(data)
        return n

    def put_part(self, digest: str, token: str, offset: int, data: Any, size: int) -> int:
        """Store ``data`` at ``offset`` of blob ``digest`` (``size`` bytes in all), sent in parts:
        one message of a whole large file kept this host's I/O thread from answering heartbeats
        for seconds. ``token`` names one sender's upload; the last part checks the digest and
        publishes the blob. Returns bytes written."""
        from .._workspace import file_hash

        path = self._blob(digest)
        if not token.isalnum() or len(token) > 32 or offset < 0 or size < 0:
            raise ProtocolError(f"bad part of blob {digest[:12]}…: token {token[:40]!r}, offset {offset}, size {size}")
        if self._intact(path, digest):
            return 0
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        part = f"{path}.{token}.part"
        with open(part, "r+b" if offset else "wb", opener=private) as f:
            f.seek(offset)
            f.write(data)
        if offset + len(data) < size:
            return len(data)
        if os.path.getsize(part) != size or file_hash(part) != digest:
            os.unlink(part)
            raise ProtocolError(f"blob {digest[:12]}… does not match its content; refusing it")
        self._stamp(part, digest)
        os.replace(part, path)
        return len(data)

    def commit(self, ws: str, manifest: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
        """Make the workspace tree match ``manifest``; returns what changed."""
        with self._lock:
            return self._commit(ws, manifest)

    def _commit(self, ws: str, manifest: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
        root = self.ws_path(ws)
        old = self.manifests.get(ws)
        if old is None:
            old = self._read_tree(root)
        lacking = self.missing([d for d, _s, _m in manifest.values()])
        if lacking:
            raise ProtocolError(f"cannot commit workspace {ws}: {len(lacking)} blobs were never sent")
        added: list[str]
        changed: list[str]
        added, changed, removed = [], [], []
        # removals first: a file that became a folder (``cfg`` -> ``cfg/a.py``), or a folder
        # that became a file, takes the place of what it replaces
        for rel in old:
            if rel not in manifest:
                removed.append(rel)
                dest = self._dest(root, rel)
                try:
                    os.unlink(dest)
                except FileNotFoundError:
                    pass
                self._prune(root, os.path.dirname(dest))
        for rel, (digest, _size, mode) in manifest.items():
            dest = self._dest(root, rel)
            prev = old.get(rel)
            exe = bool(mode & 0o111)
            # bool: the tree keeps only the owner's x bit (a tree an earlier allocator left is read
            # back with it), the manifest has the workspace's
            if prev is not None and prev[0] == digest and bool(prev[2] & 0o111) == exe and self._intact(dest, digest):
                continue
            (changed if prev is not None else added).append(rel)
            if os.path.isdir(dest) and not os.path.islink(dest):
                # what is left of a folder whose files were all removed above (a proc's __pycache__)
                shutil.rmtree(dest)
            _private_dirs(os.path.dirname(dest))
            tmp = f"{dest}.mnb-tmp"
            if exe:
                # a script a proc runs keeps its x bit; a hard link would share its mode with
                # the blob and every tree linking it, so it gets a copy of its own
                _copy_private(self._blob(digest), tmp, 0o700)
                self._stamp(tmp, digest)
            else:
                try:
                    os.link(self._blob(digest), tmp)
                except OSError:
                    _copy_private(self._blob(digest), tmp, 0o600)
                    self._stamp(tmp, digest)
            os.replace(tmp, dest)
        self.manifests.pop(ws, None)  # re-inserted last: the most recent sync wins on sys.path
        self.manifests[ws] = dict(manifest)
        os.utime(root)  # the tree's age, for gc, is the time since its last sync
        self._note_in_use()
        return {"path": root, "added": added, "changed": changed, "removed": removed}

    @staticmethod
    def _prune(root: str, d: str) -> None:
        """Remove ``d`` and its parents up to ``root`` while empty: a folder left behind by a
        removed or renamed package would still import, as an empty namespace package."""
        while d.startswith(root + os.sep):
            try:
                os.rmdir(d)
            except OSError:
                return  # not empty
            d = os.path.dirname(d)

    def _dest(self, root: str, rel: str) -> str:
        dest = os.path.normpath(os.path.join(root, rel))
        if not dest.startswith(root + os.sep):
            raise ProtocolError(f"path {rel!r} leaves the workspace")
        return dest

    def _read_tree(self, root: str) -> dict[str, tuple[str, int, int]]:
        """What an earlier allocator left materialised (the cache outlives allocators)."""
        from .._workspace import file_hash

        out: dict[str, tuple[str, int, int]] = {}
        if not os.path.isdir(root):
            return out
        for dirpath, _dirs, files in os.walk(root):
            for fn in files:
                p = os.path.join(dirpath, fn)
                rel = os.path.relpath(p, root).replace(os.sep, "/")
                st = os.stat(p)
                out[rel] = (file_hash(p), st.st_size, st.st_mode & 0o777)
        return out

    def _note_in_use(self) -> None:
        if not self.owner:
            return
        path = os.path.join(self.root, f"{IN_USE}{self.owner}")
        tmp = f"{path}.tmp"
        with open(tmp, "w", opener=private) as f:
            f.write("\n".join(self.manifests) + "\n")
        os.replace(tmp, path)

    def workspaces(self) -> list[str]:
        """Synced trees, most recently synced first (a module name in two of them comes from the newer)."""
        with self._lock:
            return [self.ws_path(ws) for ws in reversed(self.manifests)]


NS = 1_000_000_000


def _mark(digest: str) -> int:
    """The nanoseconds of a stored file's mtime that say it holds ``digest``'s content."""
    return int(digest[:8], 16) % NS


#: ``in-use-<allocator id>``: the workspaces a running allocator's procs import from
IN_USE = "in-use-"
#: a blob no tree links is kept this long (a sync puts its blobs before it commits them)
BLOB_GRACE = 3600.0


@dataclass(frozen=True)
class Removable:
    path: str
    nbytes: int
    #: seconds since it was last synced (written)
    age: float


def _files(path: str) -> dict[int, tuple[int, int]]:
    """Inode -> (size, links) of every file under ``path``."""
    out: dict[int, tuple[int, int]] = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            out[st.st_ino] = (st.st_size, st.st_nlink)
    return out


def plan(runtime_dir: str, live_ids: set[str], max_total: int, max_age: float) -> list[Removable]:
    """What :func:`collect` would remove from the code cache of ``runtime_dir``: workspaces,
    least recently synced first, then the blobs nothing links once they are gone."""
    root = os.path.join(runtime_dir, "mnb-code")
    if not os.path.isdir(root) or os.path.islink(root):
        return []
    now = time.time()
    in_use: set[str] = set()
    for name in os.listdir(root):
        if name.startswith(IN_USE) and name[len(IN_USE) :] in live_ids:
            with open(os.path.join(root, name)) as f:
                in_use.update(line.strip() for line in f if line.strip())
    blobs: dict[int, tuple[str, int, int, float]] = {}  # inode -> path, size, links, mtime
    for dirpath, _dirs, files in os.walk(os.path.join(root, "blobs")):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            blobs[st.st_ino] = (p, st.st_size, st.st_nlink, st.st_mtime)
    # each inode counted once: a tree's files are hard links to blobs (or copies of them)
    total = sum(b[1] for b in blobs.values())
    trees = []
    wdir = os.path.join(root, "ws")
    for ws in sorted(os.listdir(wdir)) if os.path.isdir(wdir) else []:
        p = os.path.join(wdir, ws)
        if os.path.islink(p) or not os.path.isdir(p):
            continue
        tree = _files(p)
        total += sum(size for i, (size, _n) in tree.items() if i not in blobs)
        # what removing it frees: its copies, and the blobs no other tree links
        frees = sum(size for i, (size, links) in tree.items() if i not in blobs or links <= 2)
        trees.append((now - os.lstat(p).st_mtime, ws, p, frees, tree))
    out: list[Removable] = []
    unlinked: dict[int, int] = {}  # blob inode -> links held by the trees removed
    for age, ws, p, frees, tree in sorted(trees, key=lambda t: -t[0]):
        if ws in in_use or not (age > max_age or (max_total and total > max_total)):
            continue
        out.append(Removable(p, frees, age))
        total -= frees
        for i in tree:
            if i in blobs:
                unlinked[i] = unlinked.get(i, 0) + 1
    for i, (p, size, links, mtime) in sorted(blobs.items(), key=lambda kv: kv[1][0]):
        if links - unlinked.get(i, 0) <= 1 and now - mtime > BLOB_GRACE:
            out.append(Removable(p, size, now - mtime))
    return out


def collect(runtime_dir: str, live_ids: set[str], max_total: int, max_age: float, dry_run: bool = False) -> list[Removable]:
    """Remove (unless ``dry_run``) what :func:`plan` lists; returns it."""
    out = plan(runtime_dir, live_ids, max_total, max_age)
    if not dry_run:
        for r in out:
            if os.path.isdir(r.path):
                shutil.rmtree(r.path, ignore_errors=True)
            else:
                try:
                    os.unlink(r.path)
                except OSError:
                    pass
        # the in-use lists of allocators that no longer run
        root = os.path.join(runtime_dir, "mnb-code")
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(IN_USE) and name[len(IN_USE) :] not in live_ids:
                try:
                    os.unlink(os.path.join(root, name))
                except OSError:
                    pass
    return out
