"""Rank output for people: aggregation of many ranks' lines, and the full per-rank logs.

Every line a proc writes is kept by its host's allocator (``rank-N.jsonl``); what reaches a
notebook or terminal is a summary of it. :class:`Aggregator` collapses the lines of one time
window across ranks, never across a rank's own successive lines: the k-th line of each rank
with a given template forms one group, so identical lines from many ranks become one line with
a count and the rank set (``[ranks 0-7 ×8] ready``), lines that differ only in their numbers
become one line with each number summarised as ``min…max`` (``[ranks 0-7 ×8] loss=0.51…0.58``),
and 8 steps printed by every rank stay 8 lines, in order. :func:`logs` and
:func:`follow` read the full log, also of a proc that has crashed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ._numtext import NUM, summarise
from ._ranks import format_ranks
from ._runtime.logcapture import check_tail

__all__ = ["Aggregator", "follow", "format_line", "format_ranks", "local_meshes", "logs"]

#: (rank, stream, ts, call_id, line) as the allocator sends them
LogLine = tuple[int, str, float, str, str]

#: the point of Monarch's ``[actor=<root>.<__main__.T ts{'gpus': 1/4}>]`` log prefix: the
#: rank tag already says it, so it is not part of the line's text (ranks' records collapse)
_ACTOR_POINT = re.compile(r"(\[actor=[^\]]*?)\{[^{}]*\}>\]")


def format_line(rank: int, line: str, mesh: str = "") -> str:
    """One line of one rank, unaggregated: ``[3] text`` (``[trainer 3] text`` when ``mesh`` is given)."""
    return f"[{mesh + ' ' if mesh else ''}{rank}] {line}"


class _Group:
    __slots__ = ("parts", "ranks", "count", "nums", "texts", "order")

    def __init__(self, parts: list[str]) -> None:
        self.order = (1 << 62, 0)  # (lowest rank, that rank's line number): a stable place in the summary
        self.parts = parts  # the text between the numbers
        self.ranks: set[int] = set()
        self.count = 0
        self.nums: list[list[str]] = []  # per number slot, every value seen
        self.texts: set[str] = set()


class Aggregator:
    """Collects lines for one window and summarises them on :meth:`flush`.

    Not thread-safe; the caller serialises ``add`` and ``flush``.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str, str, int], _Group] = {}
        self._meshes: set[str] = set()
        self._seq: dict[tuple[str, int], int] = {}
        #: (mesh, rank, stream, template) -> lines of that rank with that template so far
        self._occ: dict[tuple[str, int, str, str], int] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, mesh: str, lines: Iterable[LogLine]) -> None:
        self._meshes.add(mesh)
        groups = self._groups
        seq = self._seq
        occ = self._occ
        for rank, stream, _ts, _call, line in lines:
            n = seq[(mesh, rank)] = seq.get((mesh, rank), -1) + 1
            if "[actor=" in line:
                line = _ACTOR_POINT.sub(r"\1>]", line, 1)
            nums = NUM.findall(line)
            template = NUM.sub("\0", line) if nums else line
            okey = (mesh, rank, stream, template)
            k = occ[okey] = occ.get(okey, -1) + 1
            key = (mesh, stream, template, k)
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group(template.split("\0"))
                g.nums = [[] for _ in nums]
            g.ranks.add(rank)
            g.count += 1
            if (rank, n) < g.order:
                g.order = (rank, n)
            if len(g.texts) < 2:
                g.texts.add(line)
            for slot, n in zip(g.nums, nums):
                slot.append(n)

    def flush(self) -> list[tuple[str, str]]:
        """The window's summary as ``(stream, text)`` pairs.

        Groups are ordered by their lowest rank and where that rank printed them, so the
        summary does not depend on which rank's output happened to arrive first.
        """
        show_mesh = len(self._meshes) > 1
        out: list[tuple[str, str]] = []
        for (mesh, stream, _t, _k), g in sorted(self._groups.items(), key=lambda kv: (kv[0][0], kv[1].order)):
            if len(g.texts) == 1:
                text = next(iter(g.texts))
            else:
                pieces = [g.parts[0]]
                for slot, part in zip(g.nums, g.parts[1:]):
                    pieces.append(summarise(slot))
                    pieces.append(part)
                text = "".join(pieces)
            who = f"{mesh} " if show_mesh else ""
            if g.count == 1:
                prefix = f"[{who}{next(iter(g.ranks))}]"
            elif len(g.ranks) == 1:
                prefix = f"[{who}{next(iter(g.ranks))} ×{g.count}]"
            else:
                prefix = f"[{who}ranks {format_ranks(g.ranks)} ×{g.count}]"
            out.append((stream, f"{prefix} {text}"))
        self._groups = {}
        self._meshes = set()
        self._seq = {}
        self._occ = {}
        return out


# ---------------------------------------------------------------- the full logs


def _mesh_allocators(mesh: Any) -> list[str]:
    return sorted({p.alloc for p in mesh._procs if p.alloc})


def logs(
    mesh: Any, rank: int | None = None, tail: int | None = None, *, start: dict[int, int] | None = None
) -> list[dict[str, Any]]:
    """The lines a proc mesh's ranks wrote, oldest first, from the allocators' logs.

    ``mesh`` is a :class:`~monarch_nb.actor.ProcMesh` (or the name of one this controller knows);
    each row has ``ts``, ``rank``, ``stream``, ``call`` and ``line``. ``tail`` keeps the last N
    lines per rank; ``start`` skips the first N lines of each rank. Works for procs that have
    exited or crashed, and, on this host, for meshes of an allocator that has stopped since
    (a name this controller does not know is looked up in the runtime directory's logs, then
    on the running allocators of this host and of the jobs on record).
    """
    from .actor import _context
    from .errors import MeshNotFoundError, MonarchNBError

    if tail is not None:
        check_tail(tail)  # here too: before a request to every allocator
    if isinstance(mesh, str):
        from ._registry import get

        try:
            mesh = get(mesh)
        except MeshNotFoundError:
            # a running mesh of that name first (a job's keeps its logs in the job's directory on
            # its hosts): the files here may be an earlier, stopped mesh's of the same name
            unreached: list[str] = []
            where = _job_ranks(mesh, unreached)
            local = None if where else _local_logs(mesh, rank, tail, start, name_given=True)
            if local is None:
                local = _job_logs(mesh, rank, tail, start, where, unreached)
            if local is None:
                raise
            return local
    client = _context.client()
    known = {p.rank: p for p in mesh._procs}
    ranks = sorted(known) if rank is None else [rank]
    if rank is not None and rank not in known:
        raise ValueError(f"mesh {mesh._name!r} has no rank {rank} (ranks {format_ranks(known)})")
    client.revive_lost(known[r].alloc for r in ranks)  # those declared lost: their hellos at once
    futs = [client.request(known[r].alloc, "logs", known[r].mesh, r, tail, start.get(r, 0) if start else 0) for r in ranks]
    rows: list[dict[str, Any]] = []
    for r, f in zip(ranks, futs):
        try:
            rows.extend(f.get(timeout=client.rt.cfg.connect_timeout))
        except MonarchNBError:
            # its allocator is gone: on this host its files are still there
            local = _local_logs(known[r].mesh, r, tail, start)
            if local is None:
                raise
            rows.extend(local)
    rows.sort(key=lambda r: (r["ts"], r["rank"]))
    return rows


def local_meshes() -> list[str]:
    """The names of the meshes whose logs this host's runtime directory keeps (running or not)."""
    import glob
    import os

    from .config import runtime_dir

    found = glob.glob(os.path.join(glob.escape(runtime_dir()), "mnb-logs-*", "*", "rank-*.jsonl"))
    return sorted({os.path.basename(os.path.dirname(f)) for f in found})


def _local_logs(
    name: str, rank: int | None, tail: int | None, start: dict[int, int] | None, name_given: bool = False
) -> list[dict[str, Any]] | None:
    """The newest logs of mesh ``name`` kept in this host's runtime directory, by any allocator;
    None: none here (``name_given``: a rank the logs here lack is a ValueError naming those they have)."""
    import glob
    import os
    import re

    from ._runtime.logcapture import rank_log_path, read_log
    from .config import runtime_dir

    rank_log_path("", name, 0)  # a name that would leave the log directory is an error
    dirs = [d for d in glob.glob(os.path.join(glob.escape(runtime_dir()), "mnb-logs-*", glob.escape(name))) if os.path.isdir(d)]
    if not dirs:
        return None
    d = max(dirs, key=os.path.getmtime)
    ranks = sorted(int(m.group(1)) for f in os.listdir(d) if (m := re.fullmatch(r"rank-(\d+)\.jsonl", f)))
    if rank is not None:
        if rank not in ranks:
            if name_given:
                raise ValueError(f"mesh {name!r} has no rank {rank} in its logs here (ranks {format_ranks(ranks)})")
            return None
        ranks = [rank]
    rows: list[dict[str, Any]] = []
    for r in ranks:
        rows.extend(read_log(os.path.join(d, f"rank-{r}.jsonl"), tail, start.get(r, 0) if start else 0))
    rows.sort(key=lambda row: (row["ts"], row["rank"]))
    return rows


def _registered(name: str) -> bool:
    """Whether this controller knows mesh ``name``."""
    from ._registry import get
    from .errors import MeshNotFoundError

    try:
        get(name)
    except MeshNotFoundError:
        return False
    return True


def _job_ranks(name: str, unreached: list[str] | None = None) -> dict[int, str]:
    """Rank -> allocator of the running mesh ``name`` as the allocators list it, the jobs' too
    (:func:`monarch_nb.introspect.known_status`). ``unreached`` gets what to say of the ranks
    that may be on an allocator that did not answer (a job's lost host), if any."""
    from .introspect import _missing_ranks, _unreached_where, known_status

    found = known_status()["allocators"]
    gone = _unreached_where(found)
    if unreached is not None and gone:
        size, missing = _missing_ranks(name, found)
        if missing or not size:
            what = (
                f"{'rank' if len(missing) == 1 else 'ranks'} {format_ranks(missing)} of mesh {name!r} "
                f"{'is' if len(missing) == 1 else 'are'} on no allocator that answered"
                if missing
                else f"no allocator that answered has a mesh named {name!r}"
            )
            unreached.append(
                f"{what}, and these could not be reached: {gone} (an allocator keeps its ranks' logs "
                "on its host: `monarch-nb logs` there, or here once it answers)"
            )
    return {
        p["rank"]: a["addr"]
        for a in found
        for m in a.get("meshes", [])
        if m["name"] == name and not a.get("error")
        for p in m["procs"]
    }


def _job_logs(
    name: str,
    rank: int | None,
    tail: int | None,
    start: dict[int, int] | None,
    where: dict[int, str] | None = None,
    unreached: list[str] | None = None,
) -> list[dict[str, Any]] | None:
    """The logs of the running mesh ``name`` from the allocators ``where`` its ranks are
    (default: :func:`_job_ranks`, which also fills ``unreached``); None: no allocator lists it.
    Ranks on a job's host that does not answer: ``ConnectError`` for one asked by number, a
    ``RuntimeWarning`` when all are."""
    import warnings

    from .actor import _context
    from .errors import ConnectError

    if where is None:
        unreached = []
        where = _job_ranks(name, unreached)
    unreached = unreached or []
    if not where:
        if unreached:
            # a mesh on a lost host only: "no such mesh" alone sent the user looking elsewhere
            raise ConnectError(unreached[0])
        return None
    if rank is not None and rank not in where:
        if unreached:
            raise ConnectError(unreached[0])
        raise ValueError(f"mesh {name!r} has no rank {rank} (ranks {format_ranks(where)})")
    if rank is None and unreached:
        warnings.warn(unreached[0], RuntimeWarning, stacklevel=3)
    ranks = sorted(where) if rank is None else [rank]
    client = _context.client()
    client.revive_lost(where[r] for r in ranks)  # those declared lost: their hellos at once
    futs = [client.request(where[r], "logs", name, r, tail, start.get(r, 0) if start else 0) for r in ranks]
    rows = [row for f in futs for row in f.get(timeout=client.rt.cfg.connect_timeout)]
    rows.sort(key=lambda row: (row["ts"], row["rank"]))
    return rows


def follow(mesh: Any, rank: int | None = None, tail: int = 10, poll: float = 0.25) -> Iterator[dict[str, Any]]:
    """Yield the last ``tail`` lines, then new lines as ranks write them (until the caller stops,
    or, for a proc mesh this process knows is stopped, until its last lines are read). Ranks on
    a job's host that does not answer: as :func:`logs`."""
    import warnings

    from .errors import ConnectError

    check_tail(tail)
    seen: dict[int, int] = {}

    def fetch(start: dict[int, int] | None) -> list[dict[str, Any]]:
        return logs(mesh, rank, start=start)

    if isinstance(mesh, str) and not _registered(mesh):
        # a running mesh (a job's), found once: no scheduler (squeue, ssh) asked again at every
        # poll; the files here (an earlier mesh's of that name) only when none runs it
        unreached: list[str] = []
        where = _job_ranks(mesh, unreached)
        files = not where and mesh in local_meshes()
        if unreached and not files and (not where or (rank is not None and rank not in where)):
            raise ConnectError(unreached[0])
        if unreached:
            warnings.warn(unreached[0], RuntimeWarning, stacklevel=2)

        def fetch(start: dict[int, int] | None) -> list[dict[str, Any]]:
            if where:
                return _job_logs(mesh, rank, None, start, where) or []
            got = _local_logs(mesh, rank, None, start, name_given=True)
            return logs(mesh, rank, start=start) if got is None else got  # (its error: no such mesh)

    rows = fetch(None)
    for r in rows:
        seen[r["rank"]] = seen.get(r["rank"], 0) + 1
    yield from rows[-tail:] if tail else []
    while True:
        # a mesh this process knows is stopped writes no more: following it waited until the
        # caller gave up (`%mesh logs NAME --follow` held the kernel until interrupted)
        stopped = bool(getattr(mesh, "_stopped", False))
        time.sleep(poll)  # the allocator keeps files, not subscriptions, for ranks' past output
        rows = fetch(seen)
        for r in rows:
            seen[r["rank"]] = seen.get(r["rank"], 0) + 1
        yield from rows
        if stopped and not rows:
            return
