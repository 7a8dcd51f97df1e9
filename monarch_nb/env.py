"""The Python environment of the controller and of each host: compare them, make them match.

``describe()`` lists an interpreter's distributions (name, version, installer, editable or
not), and detects a conda prefix by its ``conda-meta/``. ``diff()`` shows, per host, what
differs from the controller; ``sync()`` makes the hosts match: ``pip install name==version``
where the host reaches a package index, else the controller ships the installed files
content-addressed (an editable install ships as source, through the workspace sync).
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ._pyenv import _norm, critical_mismatches, describe

__all__ = ["EnvDiff", "critical_mismatches", "describe", "diff", "sync"]


@dataclass
class EnvDiff:
    """Per host: distributions that differ from the controller's environment."""

    controller: dict[str, Any]
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)  # allocator -> describe()
    rows: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # allocator -> differences

    def __bool__(self) -> bool:
        return any(self.rows.values())

    def __repr__(self) -> str:
        out = []
        for alloc, rows in self.rows.items():
            h = self.hosts[alloc]
            out.append(f"{alloc} ({h['kind']} {h['prefix']}, python {h['python']}): {len(rows) or 'no'} difference(s)")
            for r in rows:
                out.append(f"  {r['name']:<28} controller {r['controller'] or '-':<14} host {r['host'] or '-':<14} {r['status']}")
        return "\n".join(out)

    def _repr_html_(self) -> str:
        parts = []
        for alloc, rows in self.rows.items():
            h = self.hosts[alloc]
            body = "".join(
                f"<tr><td>{html.escape(r['name'])}</td><td>{html.escape(r['controller'])}</td><td>{html.escape(r['host'])}</td>"
                f"<td>{html.escape(r['installer'])}</td><td>{html.escape(r['status'])}</td></tr>"
                for r in rows
            )
            parts.append(
                # what a host reports about itself is text, not markup
                f"<b>{html.escape(alloc)}</b> ({html.escape(str(h['kind']))}, python {html.escape(str(h['python']))})"
                "<table><tr><th>distribution</th><th>controller</th><th>host</th><th>installer</th><th>status</th></tr>"
                f"{body or '<tr><td colspan=5>same as the controller</td></tr>'}</table>"
            )
        return "".join(parts)


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    if mine["python"].rsplit(".", 1)[0] != theirs["python"].rsplit(".", 1)[0]:
        rows.append(
            {"name": "python", "controller": mine["python"], "host": theirs["python"], "installer": "", "status": "different"}
        )
    for key, d in sorted(mine["dists"].items()):
        t = theirs["dists"].get(key)
        editable = " (editable)" if d["editable"] else ""
        if t is None:
            rows.append(
                {
                    "name": d["name"],
                    "controller": d["version"] + editable,
                    "host": "",
                    "installer": d["installer"],
                    "status": "missing",
                }
            )
        elif t["version"] != d["version"]:
            rows.append(
                {
                    "name": d["name"],
                    "controller": d["version"] + editable,
                    "host": t["version"],
                    "installer": t["installer"],
                    "status": "different",
                }
            )
    for key, t in sorted(theirs["dists"].items()):
        if key not in mine["dists"]:
            rows.append(
                {"name": t["name"], "controller": "", "host": t["version"], "installer": t["installer"], "status": "extra"}
            )
    return rows


def _allocators(addresses: list[str] | None) -> list[str]:
    if addresses:
        from .actor import _context

        client = _context.client()
        for a in addresses:
            if a not in client.hellos:
                # one typed by the user: a precise error (no such address, refused, unreachable, another
                # cluster's key) within the connect timeout, not a request that waits three times that
                client.connect(a)
        return list(addresses)
    from . import _registry

    return [h.alloc for h in _registry.hosts()._refs()]


def diff(addresses: list[str] | None = None) -> EnvDiff:
    """What differs between the controller's environment and each attached host's."""
    from .actor import _context

    client = _context.client()
    mine = describe()
    out = EnvDiff(mine)
    allocs = _allocators(addresses)
    client.revive_lost(allocs)  # the hellos to those declared lost: at once, not one after another
    futs = {a: client.request(a, "env") for a in allocs}
    for a, f in futs.items():
        theirs = f.get(timeout=client.rt.cfg.connect_timeout * 3)
        out.hosts[a] = theirs
        out.rows[a] = [r for r in compare(mine, theirs) if r["status"] != "extra" or r["name"] == "python"]
    return out


def _dist_files(name: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """An installed distribution's files, relative to its site dir: (relpath -> digest, digest -> bytes)."""
    import hashlib

    d = metadata.distribution(name)
    files: dict[str, str] = {}
    blobs: dict[str, bytes] = {}
    for f in d.files or []:
        rel = str(f)
        if rel.startswith("..") or os.path.isabs(rel) or "__pycache__" in rel:
            continue  # scripts outside site-packages and bytecode are not shipped
        path = f.locate()
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        digest = hashlib.sha256(data).hexdigest()
        files[rel] = digest
        blobs[digest] = data
    return files, blobs


def sync(addresses: list[str] | None = None, *, index: bool = True) -> dict[str, list[str]]:
    """Make each host's environment match the controller's; returns what was done per host.

    With ``index`` a host first tries ``pip install name==version``; what it cannot install that
    way is shipped from the controller's installed files. Editable installs are synced as source
    with :func:`monarch_nb.sync.sync`.
    """
    from .actor import _context

    client = _context.client()
    d = diff(addresses)
    done: dict[str, list[str]] = {}
    for alloc, rows in d.rows.items():
        acts: list[str] = []
        todo = [r for r in rows if r["status"] in ("missing", "different") and r["name"] != "python"]
        for r in todo:
            key = _norm(r["name"])
            mine = d.controller["dists"][key]
            if mine["editable"]:
                from . import sync as _sync

                _sync.sync(mine["editable"], reload=None)
                acts.append(f"{r['name']}: editable source synced from {mine['editable']}")
                continue
            spec = f"{mine['name']}=={mine['version']}"
            if index:
                res = client.request(alloc, "env_pip", spec).get(timeout=600)
                if res["ok"]:
                    acts.append(f"{spec}: installed from the package index")
                    continue
            files, blobs = _dist_files(mine["name"])
            missing = client.request(alloc, "sync_missing", list(blobs)).get(timeout=60)
            if missing:
                from . import sync as _sync

                _sync.put_blobs(client, alloc, {k: blobs[k] for k in missing}, 600)
            remove = d.hosts[alloc]["dists"].get(key, {}).get("name", "")
            client.request(alloc, "env_install_files", mine["name"], files, remove).get(timeout=600)
            acts.append(f"{spec}: shipped {len(files)} installed files ({sum(len(b) for b in blobs.values()):,} bytes)")
        done[alloc] = acts
    return done
