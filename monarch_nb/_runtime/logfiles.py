"""Limits on the logs an allocator leaves in its runtime directory.

A rank's log rotates by itself (:class:`~monarch_nb._runtime.logcapture.ProcLog`). What
outlives its mesh or its allocator is removed here, by age and by a total size: the logs of
allocators that no longer run (``mnb-logs-<id>`` without a live allocator, and the
``allocator-start-<pid>.log`` files no running allocator writes), and the logs of earlier
meshes of the same name (``mnb-logs-<id>/<name>~<time>``). The logs of running
allocators' current meshes are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass

LOG_DIR_PREFIX = "mnb-logs-"
START_LOG_PREFIX = "allocator-start-"


@dataclass(frozen=True)
class Removable:
    path: str
    nbytes: int
    #: seconds since anything in it was written
    age: float


def _scan(path: str) -> tuple[int, float]:
    """Total bytes and newest mtime under ``path``."""
    total, newest = 0, 0.0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
    if newest == 0.0:
        try:
            newest = os.lstat(path).st_mtime
        except OSError:
            pass
    return total, newest


def held_open(pids: set[int]) -> set[str]:
    """The files processes ``pids`` have open (their /proc fd links): a running allocator's
    start log is its stdout and stderr."""
    out: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    return out


def plan(runtime_dir: str, live_ids: set[str], max_total: int, max_age: float, held: set[str] | None = None) -> list[Removable]:
    """What :func:`collect` would remove: oldest first. ``held``: files a running process
    has open (see :func:`held_open`), kept."""
    now = time.time()
    candidates: list[Removable] = []
    kept = 0
    try:
        names = sorted(os.listdir(runtime_dir))
    except OSError:
        return []
    for name in names:
        d = os.path.join(runtime_dir, name)
        if name.startswith(START_LOG_PREFIX) and name.endswith(".log"):
            # a detached allocator's own output (records.start_local_allocator), one file per
            # process that started one: they piled up, one per kernel, and nothing removed them
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if os.path.realpath(d) in (held or set()):
                kept += st.st_size
            elif not os.path.islink(d):
                candidates.append(Removable(d, st.st_size, now - st.st_mtime))
            continue
        if not name.startswith(LOG_DIR_PREFIX) or os.path.islink(d) or not os.path.isdir(d):
            continue
        if name[len(LOG_DIR_PREFIX) :] not in live_ids:
            n, newest = _scan(d)
            candidates.append(Removable(d, n, now - newest))
            continue
        for sub in sorted(os.listdir(d)):
            p = os.path.join(d, sub)
            if os.path.islink(p) or not os.path.isdir(p):
                continue
            n, newest = _scan(p)
            if "~" in sub:
                candidates.append(Removable(p, n, now - newest))
            else:
                kept += n
    candidates.sort(key=lambda r: -r.age)
    out = []
    total = kept + sum(r.nbytes for r in candidates)
    for r in candidates:
        if r.age > max_age or (max_total and total > max_total):
            out.append(r)
            total -= r.nbytes
    return out


def collect(
    runtime_dir: str, live_ids: set[str], max_total: int, max_age: float, dry_run: bool = False, held: set[str] | None = None
) -> list[Removable]:
    """Remove (unless ``dry_run``) the logs :func:`plan` lists; returns them."""
    out = plan(runtime_dir, live_ids, max_total, max_age, held)
    if not dry_run:
        for r in out:
            if os.path.isdir(r.path):
                shutil.rmtree(r.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(r.path)
    return out
