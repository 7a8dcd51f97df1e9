"""An allocator's cache of synced workspaces: content-addressed blobs and materialised trees.

Blobs live once per host under ``blobs/<2 hex>/<sha256>``; each workspace is a tree under
``ws/<workspace id>/`` whose files are hard links to its blobs, so a sync that changes one file
writes one file. Trees survive controllers (and kernel restarts); new procs get them on
``sys.path``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from ..errors import ProtocolError


class CodeCache:
    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(os.path.join(root, "blobs"), mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(root, "ws"), mode=0o700, exist_ok=True)
        #: workspace id -> manifest of what is materialised
        self.manifests: dict[str, dict[str, tuple[str, int, int]]] = {}

    def _blob(self, digest: str) -> str:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ProtocolError(f"not a sha256 digest: {digest[:80]!r}")
        return os.path.join(self.root, "blobs", digest[:2], digest)

    def ws_path(self, ws: str) -> str:
        if not ws or "/" in ws or ws in (".", "..") or "\0" in ws:
            raise ProtocolError(f"bad workspace id {ws!r}")
        return os.path.join(self.root, "ws", ws)

    def missing(self, digests: list[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if not os.path.exists(self._blob(d))]

    def put(self, blobs: dict[str, Any]) -> int:
        """Store blobs (digest -> bytes); each is checked against its digest. Returns bytes written."""
        n = 0
        for digest, data in blobs.items():
            data = bytes(data)
            if hashlib.sha256(data).hexdigest() != digest:
                raise ProtocolError(f"blob {digest[:12]}… does not match its content; refusing it")
            path = self._blob(digest)
            if os.path.exists(path):
                continue
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            n += len(data)
        return n

    def commit(self, ws: str, manifest: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
        """Make the workspace tree match ``manifest``; returns what changed."""
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
        for rel, (digest, _size, _mode) in manifest.items():
            dest = self._dest(root, rel)
            prev = old.get(rel)
            if prev is not None and prev[0] == digest and os.path.exists(dest):
                continue
            (changed if prev is not None else added).append(rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = f"{dest}.mnb-tmp"
            try:
                os.link(self._blob(digest), tmp)
            except OSError:
                shutil.copyfile(self._blob(digest), tmp)
            os.replace(tmp, dest)
        for rel in old:
            if rel not in manifest:
                removed.append(rel)
                try:
                    os.unlink(self._dest(root, rel))
                except FileNotFoundError:
                    pass
        self.manifests.pop(ws, None)  # re-inserted last: the most recent sync wins on sys.path
        self.manifests[ws] = dict(manifest)
        return {"path": root, "added": added, "changed": changed, "removed": removed}

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

    def workspaces(self) -> list[str]:
        """Synced trees, most recently synced first (a module name in two of them comes from the newer)."""
        return [self.ws_path(ws) for ws in reversed(self.manifests)]
