"""The local workspace as a content-addressed manifest: which files, what content.

Honours ``.gitignore`` files (the common subset: globs, ``**``, anchored ``/x``, directory-only
``x/``, negation ``!x``) and explicit excludes; always skips VCS folders, virtual and conda
environments (by name or by their ``pyvenv.cfg``/``conda-meta``), caches and notebook checkpoints.
Symlinks are followed (files and folders), except a folder's link back into itself.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass

ALWAYS_EXCLUDED = (
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".ipynb_checkpoints",
    ".venv",
    "venv",
    "node_modules",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "*.pyc",
    "*.pyo",
)

#: relpath -> (sha256 hex, size, mode bits)
Manifest = dict[str, tuple[str, int, int]]


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _compile(pattern: str, base: str) -> _Rule | None:
    p = pattern.rstrip("\n").rstrip()
    if not p or p.startswith("#"):
        return None
    negate = p.startswith("!")
    if negate:
        p = p[1:]
    dir_only = p.endswith("/")
    p = p.rstrip("/")
    anchored = "/" in p
    p = p.lstrip("/")
    rx = ""
    i = 0
    while i < len(p):
        if p.startswith("**/", i):
            rx += "(?:.*/)?"
            i += 3
        elif p.startswith("**", i):
            rx += ".*"
            i += 2
        elif p[i] == "*":
            rx += "[^/]*"
            i += 1
        elif p[i] == "?":
            rx += "[^/]"
            i += 1
        else:
            rx += re.escape(p[i])
            i += 1
    prefix = re.escape(base + "/") if base else ""
    full = f"^{prefix}{rx}$" if anchored else f"^{prefix}(?:.*/)?{rx}$"
    return _Rule(re.compile(full), negate, dir_only)


class Ignore:
    """Decides what of a tree to leave out."""

    def __init__(self, excludes: tuple[str, ...] | list[str] = ()) -> None:
        self.rules: list[_Rule] = []
        self.excludes = tuple(ALWAYS_EXCLUDED) + tuple(excludes)

    def add_gitignore(self, path: str, base: str) -> None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    r = _compile(line, base)
                    if r is not None:
                        self.rules.append(r)
        except OSError:
            pass

    def ignored(self, rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(name, x) or fnmatch.fnmatch(rel, x) for x in self.excludes):
            return True
        out = False
        for r in self.rules:
            if r.dir_only and not is_dir:
                continue
            if r.regex.match(rel):
                out = not r.negate
        return out


def _is_environment(path: str) -> bool:
    """A virtual environment or conda environment by its marker, whatever its name (``env``,
    ``.env-cuda``): hosts have their own (``%mesh env sync``), and it is often gigabytes."""
    return os.path.isfile(os.path.join(path, "pyvenv.cfg")) or os.path.isdir(os.path.join(path, "conda-meta"))


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _loop(target: str, chain: list[str]) -> bool:
    """Whether a link to ``target`` from the folders ``chain`` (real paths, the workspace's root
    first) leads back into one of them: walking it would never end."""
    return any(c == target or c.startswith(target.rstrip(os.sep) + os.sep) for c in chain)


#: unreadable files a scan names one by one; past it, how many more
UNREADABLE_SHOWN = 10


def _describe(path: str) -> str:
    """``mode 000, owner uid 0``: what makes a file unreadable to this user."""
    try:
        st = os.stat(path)
    except OSError:
        return "in a folder this user cannot enter: it lacks x"
    return f"mode {st.st_mode & 0o777:03o}, owner uid {st.st_uid}"


def unreadable_error(root: str, rels: list[str], after: str = "nothing was sent") -> PermissionError:
    """What a sync raises for files (or folders, ``rel/``) of ``root`` this user cannot read:
    which, why, and the two ways out. It was open()'s ``[Errno 13] Permission denied`` from
    deep inside the scan, naming the file and neither the cause nor what to do."""
    rels = sorted(rels)
    who = f"this user (uid {os.getuid()})"
    if "./" in rels:
        return PermissionError(f"cannot sync {root}: {who} cannot read that folder ({_describe(root)}); {after}")
    shown = [f"{r} ({_describe(os.path.join(root, r))})" for r in rels[:UNREADABLE_SHOWN]]
    if len(rels) > UNREADABLE_SHOWN:
        shown.append(f"and {len(rels) - UNREADABLE_SHOWN} more")
    one = len(rels) == 1
    what = ("a folder" if rels[0].endswith("/") else "a file") if one else f"{len(rels)} files and folders"
    it = "it" if one else "them"
    pattern = rels[0].rstrip("/")
    return PermissionError(
        f"cannot sync {root}: {what} {who} cannot read: {'; '.join(shown)}. Make {it} readable "
        f"(chmod u+r, or chown), or leave {it} out: excludes=[{pattern!r}] (`%mesh sync --exclude {pattern}`) "
        f"or a line in .gitignore; {after}"
    )


def scan(
    root: str,
    excludes: tuple[str, ...] | list[str] = (),
    cache: dict[str, tuple[float, int, str]] | None = None,
    skipped: list[str] | None = None,
) -> Manifest:
    """The manifest of ``root``. ``cache`` (path -> (mtime, size, hash)) skips re-hashing unchanged files.

    A symlinked file is its content and a symlinked folder is followed, wherever it points
    (``ln -s ../common common`` in a notebook's folder imports there, so it must on the procs
    too), except a link back into a folder it sits in (``..``, ``~``, a loop): that one is left
    out, and ``skipped`` gets a line saying so. Files and folders this user cannot read raise
    :func:`unreadable_error`, a ``PermissionError`` naming them all."""
    root = os.path.abspath(root)
    ig = Ignore(excludes)
    out: Manifest = {}
    # left out silently, they were: an unreadable folder (os.walk skips it) and a file in a
    # folder without x; an unreadable file raised open()'s bare PermissionError
    unreadable: list[str] = []

    def walk_error(e: OSError) -> None:
        if isinstance(e, PermissionError) and e.filename:
            rel = os.path.relpath(e.filename, root).replace(os.sep, "/")
            unreadable.append("./" if rel == "." else f"{rel}/")

    # rel folder -> real paths of it and the folders it sits in, for the loop check
    chains: dict[str, list[str]] = {"": [os.path.realpath(root)]}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=walk_error):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if ".gitignore" in filenames:
            ig.add_gitignore(os.path.join(dirpath, ".gitignore"), rel_dir)
        keep = []
        chain = chains.pop(rel_dir, [])
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            path = os.path.join(dirpath, d)
            if ig.ignored(rel, True) or _is_environment(path):
                continue
            real = os.path.realpath(path)
            if os.path.islink(path) and _loop(real, chain):
                if skipped is not None:
                    skipped.append(f"{rel} -> {os.readlink(path)}: a link to a folder it is in, not followed")
                continue
            chains[rel] = [*chain, real]
            keep.append(d)
        dirnames[:] = keep
        for fn in sorted(filenames):
            rel = f"{rel_dir}/{fn}" if rel_dir else fn
            if ig.ignored(rel, False):
                continue
            path = os.path.join(dirpath, fn)
            try:
                st = os.stat(path)
            except PermissionError:
                unreadable.append(rel)
                continue
            except OSError:
                if skipped is not None and os.path.islink(path):
                    # left out silently, the procs' FileNotFoundError was the first anyone heard of it
                    skipped.append(f"{rel} -> {os.readlink(path)}: a link to nothing, not followed")
                continue
            if not os.path.isfile(path):
                continue
            hit = cache.get(path) if cache is not None else None
            if hit is not None and hit[0] == st.st_mtime and hit[1] == st.st_size:
                digest = hit[2]
            else:
                try:
                    digest = file_hash(path)
                except FileNotFoundError:
                    continue  # removed since it was listed (an editor's temporary file): not in the tree now
                except PermissionError:
                    unreadable.append(rel)
                    continue
                if cache is not None:
                    cache[path] = (st.st_mtime, st.st_size, digest)
            out[rel] = (digest, st.st_size, st.st_mode & 0o777)
    if unreadable:
        # before anything is sent: the hosts keep the tree the last sync left, whole
        raise unreadable_error(root, unreadable)
    return out


def workspace_id(root: str) -> str:
    """A stable name for a local workspace: its folder name and a hash of its absolute path."""
    root = os.path.abspath(root)
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(root) or "root")
    return f"{base}-{hashlib.sha256(root.encode()).hexdigest()[:10]}"
