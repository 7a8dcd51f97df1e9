"""This interpreter's Python environment, described with the standard library only.

Used by allocators (to answer ``env`` and ``hello``), by controllers (to warn about version
mismatches at connect) and by :mod:`monarch_nb.env`, which compares and syncs environments.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import sys
import sysconfig
from importlib import metadata
from typing import Any

#: distributions whose versions must match for pickles to load on the other side
CRITICAL = ("cloudpickle", "torch", "numpy", "monarch-nb")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _editable(d: metadata.Distribution) -> str:
    try:
        raw = d.read_text("direct_url.json")
    except Exception:
        raw = None
    if not raw:
        return ""
    try:
        info = json.loads(raw)
    except ValueError:
        return ""
    if info.get("dir_info", {}).get("editable"):
        url = str(info.get("url", ""))
        return url[len("file://") :] if url.startswith("file://") else url
    return ""


def describe(prefix: str | None = None) -> dict[str, Any]:
    """This interpreter's environment (or a conda ``prefix``'s packages)."""
    prefix = prefix or sys.prefix
    conda = os.path.isdir(os.path.join(prefix, "conda-meta"))
    dists: dict[str, dict[str, Any]] = {}
    if prefix == sys.prefix:
        for d in metadata.distributions():
            name = d.metadata["Name"]
            if not name:
                continue
            try:
                installer = (d.read_text("INSTALLER") or "").strip()
            except Exception:
                installer = ""
            dists[_norm(name)] = {"name": name, "version": d.version, "installer": installer, "editable": _editable(d)}
    if conda:
        for path in glob.glob(os.path.join(prefix, "conda-meta", "*.json")):
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            key = _norm(rec.get("name", ""))
            if key and key not in dists:
                dists[key] = {"name": rec["name"], "version": rec.get("version", ""), "installer": "conda", "editable": ""}
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "prefix": prefix,
        "kind": "conda" if conda else ("venv" if sys.prefix != sys.base_prefix else "system"),
        "purelib": sysconfig.get_paths()["purelib"],
        "dists": dists,
    }


def critical_mismatches(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Differences (python, cloudpickle, torch, …) that break unpickling, each with its fix."""
    out = []
    if mine.get("python", "").rsplit(".", 1)[0] != theirs.get("python", "").rsplit(".", 1)[0]:
        out.append(f"python {mine.get('python')} here but {theirs.get('python')} on the host: use the same Python minor version")
    for name in CRITICAL:
        a, b = mine.get(name), theirs.get(name)
        if a and b and a != b:
            out.append(f"{name} {a} here but {b} on the host: run `%mesh env sync` (or `pip install {name}=={a}` on the host)")
    return out


@functools.cache
def critical_versions() -> dict[str, str]:
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in CRITICAL:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
