"""Debug sessions as data: list them, parse rank sets, attach a pdb client, cast, continue.

Every call reaches sessions through allocators (``debug_list``/``debug_send``), so it works from
any controller: the one that made the call, a restarted kernel, or a terminal.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._deadline import budget
from .._runtime.records import read_connection_files
from .._runtime.runtime import pid_alive as _alive
from ..actor import _context, _debugwait
from ..actor._future import Future
from ..config import runtime_dir
from ..errors import DebugError


@dataclasses.dataclass(frozen=True)
class Session:
    """One actor paused at a breakpoint (or gone while paused)."""

    sid: str
    actor: str
    rank: int
    coords: dict[str, int]
    host: str
    pid: int
    mesh: str
    function: str
    file: str
    line: int
    since: float
    call_id: str
    method: str
    #: "paused" (at the prompt), "running" (a command such as ``n`` is executing) or "gone"
    state: str
    cause: str
    #: the allocator through which this session is reached
    alloc: str
    #: pdb's "> file(line)function()\n-> source" for the current frame
    header: str = ""
    #: where ``breakpoint()`` was called (pdb stops on the line after it)
    bp_file: str = ""
    #: the actor mesh's own id (each spawn is its own mesh; ``actor`` is the name it was given)
    actor_id: str = ""
    bp_line: int = 0
    #: a post-mortem session: the exception its call raised ("Type: message"), which reaches the
    #: caller once the rank continues; "" for a breakpoint
    post_mortem: str = ""

    @property
    def waiting_s(self) -> float:
        return max(0.0, time.time() - self.since)

    @property
    def where(self) -> str:
        return _where(self.file, self.line)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for frontends (JSON-able), with ``waiting_s`` computed now."""
        return {**dataclasses.asdict(self), "waiting_s": self.waiting_s}

    @classmethod
    def _from(cls, rec: Mapping[str, Any], alloc: str = "") -> Session:
        return cls(
            sid=rec["sid"],
            actor=rec.get("actor") or "",
            rank=int(rec.get("rank", 0)),
            coords=dict(rec.get("coords") or {}),
            host=rec.get("host", ""),
            pid=int(rec.get("pid", 0)),
            mesh=rec.get("mesh", ""),
            function=rec.get("function", ""),
            file=rec.get("file", ""),
            line=int(rec.get("line", 0)),
            since=float(rec.get("since", 0.0)),
            call_id=rec.get("call_id", ""),
            method=rec.get("method", ""),
            state=rec.get("state", "paused"),
            cause=rec.get("cause", ""),
            alloc=alloc or _reach(rec),
            header=_cell_header(rec.get("header", "")),
            bp_file=rec.get("bp_file") or rec.get("file", ""),
            bp_line=int(rec.get("bp_line") or rec.get("line", 0)),
            actor_id=rec.get("actor_id") or "",
            post_mortem=rec.get("post_mortem") or "",
        )


def _reach(rec: Mapping[str, Any]) -> str:
    """The address to reach a record's allocator from here: its ipc socket when on this host."""
    ipc = rec.get("alloc_ipc", "")
    if ipc and rec.get("host") == socket.gethostname() and os.path.exists(ipc[len("ipc://") :]):
        return ipc
    return rec.get("alloc", "") or ipc


# ---------------------------------------------------------------------------- listing
def _allocators(addresses: Iterable[str] | None) -> list[str]:
    client = _context.client()
    out: dict[str, None] = dict.fromkeys(addresses or [])
    host = socket.gethostname()
    for info in read_connection_files(runtime_dir()):
        if info.get("host") == host and _alive(int(info.get("pid", 0))):
            out[info["addr"]] = None
    for a in [*client.hellos, *client.rt.supervision.watches]:
        # an allocator of this host that stopped since we connected took its socket with it:
        # asking it would only wait out the timeout
        if a.startswith("ipc://") and not os.path.exists(a[len("ipc://") :]):
            continue
        out[a] = None
    return list(out)


def sessions(
    actor: str | None = None,
    ranks: str | Iterable[int] | RankSet | None = None,
    *,
    include_gone: bool = True,
    addresses: Iterable[str] | None = None,
    timeout: float = 5.0,
) -> list[Session]:
    """Debug sessions on every allocator this process knows (local ones, connected ones, ``addresses``).

    Filter by ``actor`` name and ``ranks`` (``"0-3"``, ``"*"``, ``"ranks(0:4)"``, ``"gpu=0"``, or
    ints); sorted by actor, rank. Allocators that do not answer in ``timeout`` are skipped.
    """
    client = _context.client()
    sel = parse_ranks(ranks)
    allocs = _allocators(addresses)
    client.revive_lost(allocs, timeout)  # the hellos to those declared lost: at once, in the timeout
    futs = [(a, client.request(a, "debug_list")) for a in allocs]
    seen: set[str] = set()
    out = []
    left = budget(timeout)
    for a, f in futs:
        try:
            with _debugwait.quiet():
                recs = f.get(timeout=left())
        except Exception:
            continue
        for rec in recs:
            if rec["sid"] in seen:  # the same allocator reached through two addresses
                continue
            seen.add(rec["sid"])
            s = Session._from(rec, a)
            if actor is not None and s.actor != actor and s.actor_id != actor:
                continue
            if not sel.matches(s.rank, s.coords) or (not include_gone and s.state == "gone"):
                continue
            out.append(s)
    out.sort(key=lambda s: (s.actor, s.mesh, s.rank, s.since))
    return out


def format_table(rows: Iterable[Session]) -> str:
    """The session table as text (what ``list`` and ``%mesh debug`` print)."""
    rows = list(rows)
    if not rows:
        return "no debug sessions (no actor is stopped at a breakpoint)\n"
    head = ("actor", "rank", "coords", "host", "pid", "function", "file:line", "waiting", "state")
    body = [
        (
            s.actor or "-",
            str(s.rank),
            ",".join(f"{k}={v}" for k, v in s.coords.items()) or "-",
            s.host,
            str(s.pid),
            f"{s.function} (post-mortem)" if s.post_mortem else s.function,
            _where(s.file, s.line),
            _dur(s.waiting_s),
            s.state if s.state != "gone" else f"gone ({s.cause})",
        )
        for s in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [head, *body]]
    return "\n".join(lines) + "\n"


def _where(path: str, line: int) -> str:
    """``Cell In[12], line 3`` for code from a notebook cell (as IPython names it), else file:line."""
    from .._errgroup import cell_number

    n = cell_number(path)
    return f"Cell In[{n}], line {line}" if n is not None else f"{_short(path)}:{line}"


#: a frame's location as pdb prints it: ``> /tmp/ipykernel_1/2.py(10)go()`` (where it stops),
#: ``  file(10)go()`` (``w``'s other frames)
_PDB_LOC = re.compile(r"^(?P<lead>> |  )(?P<path>[^\s(][^(\n]*)\((?P<line>\d+)\)(?P<func>[^\n]*)$", re.M)


def _cell_header(text: str) -> str:
    """pdb's ``> /tmp/ipykernel_…/….py(10)train()`` lines as ``> Cell In[1], line 10, in train()``:
    the rank formats them, but only this kernel knows which cell compiled that file (the
    sessions table's and the tracebacks' name for it)."""
    from .._errgroup import cell_number

    def named(m: re.Match[str]) -> str:
        n = cell_number(m.group("path"))
        if n is None:
            return m.group(0)
        return f"{m.group('lead')}Cell In[{n}], line {m.group('line')}, in {m.group('func')}"

    return _PDB_LOC.sub(named, text) if text else text


def _short(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home) :] if home != "/" and path.startswith(home + "/") else path


def _dur(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


# ---------------------------------------------------------------------------- rank sets
class RankSet:
    """A set of ranks: all, explicit ranks/ranges, and/or coordinate constraints."""

    def __init__(
        self, ranks: Callable[[int], bool] | None = None, coords: dict[str, Callable[[int], bool]] | None = None, text: str = "*"
    ) -> None:
        self._ranks = ranks
        self._coords = coords or {}
        self.text = text

    def matches(self, rank: int, coords: Mapping[str, int] | None = None) -> bool:
        if self._ranks is not None and not self._ranks(rank):
            return False
        for label, pred in self._coords.items():
            if coords is None or label not in coords or not pred(coords[label]):
                return False
        return True

    def __contains__(self, rank: int) -> bool:
        return self.matches(rank, None) if not self._coords else False

    def __repr__(self) -> str:
        return f"RankSet({self.text!r})"


_INT = re.compile(r"^\d+$")


def _one(sel: str, spec: str) -> Callable[[int], bool]:
    sel = sel.strip()
    if sel in ("*", ""):
        return lambda r: True
    if _INT.match(sel):
        n = int(sel)
        return lambda r: r == n
    m = re.match(r"^(\d*):(\d*)(?::(\d+))?$", sel)
    if m:
        lo = int(m.group(1) or 0)
        hi = int(m.group(2)) if m.group(2) else None
        step = int(m.group(3) or 1)
        if step < 1:
            raise ValueError(f"bad rank set {spec!r}: the step of {sel!r} must be at least 1")
        return lambda r: r >= lo and (hi is None or r < hi) and (r - lo) % step == 0
    m = re.match(r"^(\d+)-(\d+)$", sel)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        return lambda r: lo <= r <= hi
    raise ValueError(
        f"bad rank set {spec!r}: {sel!r} is not a rank, a range (0-3), a slice (0:4, 0:8:2) or '*'; "
        "examples: '*', '0-3', '1,5', 'ranks(0:4)', 'ranks(gpu=0)', 'ranks(hosts=0, gpus=(1,3))'"
    )


def _top_level(text: str, spec: str) -> list[str]:
    """``text`` split at the commas outside parentheses: ``hosts=0, gpu=(1,3)`` is two parts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"bad rank set {spec!r}: unbalanced parentheses")
    return [*parts, text[start:]]


def parse_ranks(spec: str | Iterable[int] | RankSet | None) -> RankSet:
    """``None``/``"*"`` (all), ``"3"``, ``"0-3"``, ``"1,5,7"``, ``"0:8:2"``, Monarch's ``"ranks(0:4)"``,
    ``"ranks(1,3)"``, coordinates ``"ranks(hosts=1, gpus=0:2)"``, ``"ranks(gpus=(1,3))"``, or an
    iterable of ints."""
    if isinstance(spec, RankSet):
        return spec
    if spec is None:
        return RankSet()
    if not isinstance(spec, str):
        want = {int(r) for r in spec}
        return RankSet(want.__contains__, text=",".join(map(str, sorted(want))))
    text = spec.strip()
    inner = text
    m = re.match(r"^ranks\((.*)\)$", text)
    if m:
        inner = m.group(1)
    if inner.strip() in ("*", "all", ""):
        return RankSet(text=text)
    rank_preds: list[Callable[[int], bool]] = []
    coords: dict[str, list[Callable[[int], bool]]] = {}
    for part in _top_level(inner, spec):
        if "=" in part:
            label, _, sel = part.partition("=")
            sel = sel.strip()
            # Monarch's list of coordinates, ranks(gpu=(1,3)); a list reads the same
            if sel[:1] + sel[-1:] in ("()", "[]"):
                items = [x for x in sel[1:-1].split(",") if x.strip()]
                if not items:
                    raise ValueError(f"bad rank set {spec!r}: {label.strip()}={sel} lists no coordinate")
                coords.setdefault(label.strip(), []).extend(_one(x, spec) for x in items)
            else:
                coords.setdefault(label.strip(), []).append(_one(sel, spec))
        else:
            rank_preds.append(_one(part, spec))
    ranks = (lambda r: any(p(r) for p in rank_preds)) if rank_preds else None
    return RankSet(ranks, {k: (lambda c, ps=ps: any(p(c) for p in ps)) for k, ps in coords.items()}, text)  # type: ignore[misc]


# ---------------------------------------------------------------------------- attach / cast
class DebugClient:
    """A pdb on one paused rank, driven one command at a time (``attach()`` returns it)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.ended = False
        #: the command that ended the session quit pdb (``q``): the endpoint raises BdbQuit
        #: instead of going on, so the call it serves fails
        self.quit = False

    @property
    def header(self) -> str:
        """Where the rank is stopped: pdb's ``> file(line)function()`` and ``-> source`` lines."""
        return self.session.header

    def send(self, cmd: str, timeout: float | None = None) -> str:
        """Run one pdb command (``p x``, ``n``, ``l``, ``w``, ``c``…) on the rank; returns its output.

        After a command that resumes the rank (``c``, ``q``, stepping out of the endpoint)
        :attr:`ended` is True. A rank that died raises :class:`DebugError`.
        """
        if self.ended:
            raise DebugError(f"the session of rank {self.session.rank} has continued; attach again when it stops")
        try:
            with _debugwait.quiet():
                res = _send(self.session, cmd).get(timeout=timeout)
        except DebugError:
            self.ended = True
            raise
        if res.get("state") == "paused":
            moved = {k: res[k] for k in ("function", "file", "line", "header") if k in res}
            if "header" in moved:
                moved["header"] = _cell_header(moved["header"])
            self.session = dataclasses.replace(self.session, **moved, state="paused")
        else:
            self.ended = True
            self.quit = bool(res.get("quit"))
            _debugwait.forget(self.session.sid)
        return _cell_header(str(res.get("output", "")))

    def detach(self) -> None:
        """Stop driving this session; the rank stays paused for a later attach."""

    def __repr__(self) -> str:
        s = self.session
        return f"<DebugClient {s.actor}[{s.rank}] {s.where} {'ended' if self.ended else s.state}>"


def _send(session: Session, cmd: str) -> Future[dict[str, Any]]:
    return _context.client().request(session.alloc, "debug_send", session.sid, cmd)


def attach(actor: str | None, rank: int, *, addresses: Iterable[str] | None = None) -> DebugClient:
    """A :class:`DebugClient` on ``actor``'s paused ``rank`` (``actor=None``: whichever actor)."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank is the rank's number, got {rank!r}")
    found = [s for s in sessions(actor, [rank], addresses=addresses) if s.state != "gone"]
    if not found:
        gone = [s for s in sessions(actor, [rank], addresses=addresses) if s.state == "gone"]
        if gone:
            raise DebugError(f"rank {rank} of {gone[0].actor} is gone: {gone[0].cause}")
        paused = sessions(include_gone=False, addresses=addresses)
        have = ", ".join(f"{s.actor or '-'} {s.rank}" for s in paused) or "none"
        if any(not s.actor for s in paused):
            # breakpoint() outside any endpoint (a thread the actor started) has no actor to name
            have += " ('-': stopped outside an endpoint, e.g. in a thread an actor started; attach it by rank alone: attach RANK)"
        raise DebugError(f"no paused session for {actor or 'any actor'} rank {rank}; paused: {have}")
    meshes = {s.actor_id for s in found if s.actor_id}
    if actor is not None and len(meshes) > 1:
        # actor meshes spawned under one name: which one is the user's to say
        rows = "\n".join(
            f"  {s.actor_id}: rank {s.rank} of proc mesh {s.mesh!r}, pid {s.pid} on {s.host}, "
            f"paused at {s.where} for {s.waiting_s:.0f} s"
            for s in sorted(found, key=lambda s: s.since)
        )
        raise DebugError(
            f"{len(meshes)} actor meshes named {actor!r} have rank {rank} paused:\n{rows}\n"
            f"pick one by its id: %mesh attach ACTOR_ID {rank} (debug.attach(ACTOR_ID, {rank}))"
        )
    return DebugClient(max(found, key=lambda s: s.since))


def cast(
    actor: str | None,
    ranks: str | Iterable[int] | RankSet | None,
    cmd: str,
    *,
    timeout: float | None = 60.0,
    addresses: Iterable[str] | None = None,
) -> dict[int, str]:
    """Send pdb command ``cmd`` to every paused rank of ``actor`` in ``ranks``; ``{rank: output}``.

    A rank that is gone (or fails) maps to a line starting with ``error:``.
    """
    return dict(sorted((s.rank, out) for s, out in cast_sessions(actor, ranks, cmd, timeout=timeout, addresses=addresses)))


def cast_sessions(
    actor: str | None,
    ranks: str | Iterable[int] | RankSet | None,
    cmd: str,
    *,
    timeout: float | None = 60.0,
    addresses: Iterable[str] | None = None,
    sids: set[str] | None = None,
) -> list[tuple[Session, str]]:
    """:func:`cast`, one ``(session, output)`` per session: with no ``actor``, ranks of several
    actors (two meshes each paused at rank 0) are each their own entry, where :func:`cast`'s
    ``{rank: output}`` keeps one of them. ``sids``: only those sessions."""
    targets = [s for s in sessions(actor, ranks, addresses=addresses) if s.state != "gone" and (sids is None or s.sid in sids)]
    futs = [(s, _send(s, cmd)) for s in targets]
    out: list[tuple[Session, str]] = []
    left = budget(timeout)
    for s, f in futs:
        try:
            with _debugwait.quiet():
                res = f.get(timeout=left())
            if res.get("state") != "paused":
                _debugwait.forget(s.sid)
            out.append((s, _cell_header(str(res.get("output", "")))))
        except Exception as e:
            out.append((s, f"error: {getattr(e, 'message', None) or e}"))
    return out


def continue_all(
    actor: str | None = None,
    ranks: str | Iterable[int] | RankSet | None = None,
    *,
    timeout: float | None = 60.0,
    addresses: Iterable[str] | None = None,
) -> dict[int, str]:
    """Resume every paused rank (of ``actor``, in ``ranks``); ``{rank: output}``."""
    return cast(actor, ranks, "c", timeout=timeout, addresses=addresses)
