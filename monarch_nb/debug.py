"""Debug any rank: list paused sessions, attach a pdb, cast a command to many ranks, continue.

``breakpoint()`` (or ``pdb.set_trace()``) in an endpoint pauses that actor and registers a
session with its host's allocator. Everything here reaches sessions through allocators, so it
works from any controller: the notebook that made the call, another kernel, a restarted one,
or ``monarch-nb debug`` in a terminal.

>>> from monarch_nb import debug
>>> debug.sessions()                       # the session table, as records
>>> s = debug.attach("debugee", 13)        # a pdb on rank 13
>>> print(s.send("p rank")); s.send("c")
>>> debug.cast("debugee", "0-3", "p rank") # {rank: output}
>>> debug.continue_all()

:class:`Console` is the interactive loop (``list``, ``attach``, ``cast``, ``continue``, also in
Monarch's spelling ``attach debugee 13``, ``cast debugee ranks(0:4) p x``) shared by the
blocked cell, the ``%mesh`` magics and the CLI. A controller whose main thread is blocked on
a call whose rank stops runs it through ``input()``: in a kernel, the cell's input box.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .actor import _context, _debugwait
from .actor._client import _alive, read_connection_files
from .actor._future import Future
from .config import get_config, runtime_dir
from .errors import ConfigError, DebugError

__all__ = [
    "Console",
    "DebugClient",
    "RankSet",
    "Session",
    "attach",
    "cast",
    "continue_all",
    "format_table",
    "parse_ranks",
    "sessions",
]


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
    bp_line: int = 0

    @property
    def waiting_s(self) -> float:
        return max(0.0, time.time() - self.since)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

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
            header=rec.get("header", ""),
            bp_file=rec.get("bp_file") or rec.get("file", ""),
            bp_line=int(rec.get("bp_line") or rec.get("line", 0)),
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
    for a in list(client.hellos):
        out[a] = None
    for a in list(client.rt._watches):
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
    futs = [(a, client.request(a, "debug_list")) for a in _allocators(addresses)]
    seen: set[str] = set()
    out = []
    for a, f in futs:
        try:
            with _debugwait.quiet():
                recs = f.get(timeout=timeout)
        except Exception:
            continue
        for rec in recs:
            if rec["sid"] in seen:  # the same allocator reached through two addresses
                continue
            seen.add(rec["sid"])
            s = Session._from(rec, a)
            if actor is not None and s.actor != actor:
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
            s.function,
            f"{_short(s.file)}:{s.line}",
            _dur(s.waiting_s),
            s.state if s.state != "gone" else f"gone ({s.cause})",
        )
        for s in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [head, *body]]
    return "\n".join(lines) + "\n"


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
        "examples: '*', '0-3', '1,5', 'ranks(0:4)', 'ranks(gpu=0)'"
    )


def parse_ranks(spec: str | Iterable[int] | RankSet | None) -> RankSet:
    """``None``/``"*"`` (all), ``"3"``, ``"0-3"``, ``"1,5,7"``, ``"0:8:2"``, Monarch's ``"ranks(0:4)"``,
    coordinates ``"ranks(host=1, gpu=0:2)"``, or an iterable of ints."""
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
    for part in inner.split(","):
        if "=" in part:
            label, _, sel = part.partition("=")
            coords.setdefault(label.strip(), []).append(_one(sel, spec))
        else:
            rank_preds.append(_one(part, spec))
    ranks = (lambda r: any(p(r) for p in rank_preds)) if rank_preds else None
    return RankSet(ranks, {k: (lambda c, ps=ps: any(p(c) for p in ps)) for k, ps in coords.items()}, text)


# ---------------------------------------------------------------------------- attach / cast
class DebugClient:
    """A pdb on one paused rank, driven one command at a time (``attach()`` returns it)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.ended = False

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
            self.session = dataclasses.replace(
                self.session, **{k: res[k] for k in ("function", "file", "line", "header") if k in res}, state="paused"
            )
        else:
            self.ended = True
            _debugwait.forget(self.session.sid)
        return str(res.get("output", ""))

    def detach(self) -> None:
        """Stop driving this session; the rank stays paused for a later attach."""

    def __repr__(self) -> str:
        s = self.session
        return f"<DebugClient {s.actor}[{s.rank}] {s.where} {'ended' if self.ended else s.state}>"


def _send(session: Session, cmd: str) -> Future[dict[str, Any]]:
    return _context.client().request(session.alloc, "debug_send", session.sid, cmd)


def attach(actor: str | None, rank: int, *, addresses: Iterable[str] | None = None) -> DebugClient:
    """A :class:`DebugClient` on ``actor``'s paused ``rank`` (``actor=None``: whichever actor)."""
    found = [s for s in sessions(actor, [rank], addresses=addresses) if s.state != "gone"]
    if not found:
        gone = [s for s in sessions(actor, [rank], addresses=addresses) if s.state == "gone"]
        if gone:
            raise DebugError(f"rank {rank} of {gone[0].actor} is gone: {gone[0].cause}")
        have = ", ".join(f"{s.actor} {s.rank}" for s in sessions(include_gone=False, addresses=addresses)) or "none"
        raise DebugError(f"no paused session for {actor or 'any actor'} rank {rank}; paused: {have}")
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
    targets = [s for s in sessions(actor, ranks, addresses=addresses) if s.state != "gone"]
    futs = [(s, _send(s, cmd)) for s in targets]
    out: dict[int, str] = {}
    for s, f in futs:
        try:
            with _debugwait.quiet():
                res = f.get(timeout=timeout)
            if res.get("state") != "paused":
                _debugwait.forget(s.sid)
            out[s.rank] = str(res.get("output", ""))
        except Exception as e:
            out[s.rank] = f"error: {getattr(e, 'message', None) or e}"
    return dict(sorted(out.items()))


def continue_all(
    actor: str | None = None,
    ranks: str | Iterable[int] | RankSet | None = None,
    *,
    timeout: float | None = 60.0,
    addresses: Iterable[str] | None = None,
) -> dict[int, str]:
    """Resume every paused rank (of ``actor``, in ``ranks``); ``{rank: output}``."""
    return cast(actor, ranks, "c", timeout=timeout, addresses=addresses)


# ---------------------------------------------------------------------------- console
_HELP = """\
Commands:
  list                          the session table
  attach [ACTOR] RANK           a pdb on that rank (pdb commands: p, n, s, l, w, up, c, ...; 'detach' returns here)
  cast [ACTOR] RANKS COMMAND    run a pdb command on a rank set: 0-3, 1,5, *, ranks(0:4), ranks(gpu=0)
  continue                      resume every paused rank
  quit                          leave the debugger (paused ranks stay paused)
  help                          this text
"""


_RANKS_CMD = re.compile(r"^(ranks\([^)]*\)|\S+)\s+(.+)$")


class Console:
    """The debugger's command loop: one line in, text out.

    ``execute(line)`` runs one command (``False`` after ``quit``); ``interact(read)`` loops over
    ``read(prompt)`` (``input`` in a terminal or a kernel cell). ``write`` receives all output.
    """

    prompt = "monarch_dbg> "

    def __init__(self, write: Callable[[str], Any] | None = None, *, addresses: Iterable[str] | None = None) -> None:
        self.write = write or _stdout_write
        self.addresses = list(addresses or [])
        self.attached: DebugClient | None = None
        self.quit = False

    @property
    def current_prompt(self) -> str:
        if self.attached is not None:
            s = self.attached.session
            return f"(Pdb {s.actor} {s.rank}) " if s.actor else f"(Pdb {s.rank}) "
        return self.prompt

    def banner(self) -> None:
        self.write(
            "\n" + "*" * 24 + " MONARCH_NB DEBUGGER " + "*" * 24 + "\n\n"
            "Enter 'help' for a list of commands.\nEnter 'list' to show all active breakpoints.\n\n"
        )

    def show_table(self) -> None:
        self.write(format_table(sessions(addresses=self.addresses)))

    def interact(
        self,
        read: Callable[[str], str] = input,
        *,
        first: str | None = None,
        until: Callable[[], bool] | None = None,
        leave_on_detach: bool = False,
    ) -> None:
        """Read and run commands until ``quit``, end of input, or ``until()`` (checked when not attached).

        ``first`` runs before the first read (``%mesh attach`` passes ``"attach ACTOR RANK"``);
        ``leave_on_detach`` returns once an attached session is detached or continues.
        """
        if first and not self.execute(first):
            return
        while True:
            if self.attached is None:
                if leave_on_detach and first:
                    return
                if until is not None and until():
                    return
            try:
                line = read(self.current_prompt)
            except EOFError:
                self.write("\n")
                return
            if not self.execute(line):
                return

    def execute(self, line: str) -> bool:
        """Run one command; returns False when the user asked to leave."""
        try:
            if self.attached is not None:
                return self._pdb(line)
            return self._command(line)
        except (DebugError, ValueError, TimeoutError, ConnectionError) as e:
            self.write(f"error: {e}\n")
            return True

    def _pdb(self, line: str) -> bool:
        client = self.attached
        assert client is not None
        if line.strip() == "detach":
            self.write(f"Detached from rank {client.session.rank}; it stays paused.\n")
            client.detach()
            self.attached = None
            return True
        try:
            out = client.send(line)
        except DebugError as e:
            self.write(f"error: {e}\n")
            self.attached = None
            return True
        self.write(out if not out or out.endswith("\n") else out + "\n")
        if client.ended:
            self.write(f"rank {client.session.rank} continued.\n")
            self.attached = None
        return True

    def _command(self, line: str) -> bool:
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        if not words:
            return True
        cmd, args = words[0].lower(), words[1:]
        if cmd in ("help", "h", "?"):
            self.write(_HELP)
        elif cmd in ("list", "ls", "sessions"):
            self.show_table()
        elif cmd in ("attach", "a"):
            self._attach(args)
        elif cmd == "cast":
            self._cast(line)
        elif cmd in ("continue", "c", "cont"):
            res = continue_all(addresses=self.addresses)
            self.write(f"continued {len(res)} rank(s)\n" if res else "no paused ranks\n")
            for rank, out in res.items():
                if out.strip():
                    self.write(f"[{rank}] {out.rstrip()}\n")
        elif cmd in ("quit", "exit", "q"):
            self.quit = True
            return False
        else:
            self.write(f"unknown command {cmd!r}; type 'help'\n")
        return True

    def _attach(self, args: list[str]) -> None:
        if len(args) == 1 and _INT.match(args[0]):
            actor, rank = None, int(args[0])
        elif len(args) == 2 and _INT.match(args[1]):
            actor, rank = args[0], int(args[1])
        else:
            self.write("usage: attach [ACTOR] RANK\n")
            return
        client = attach(actor, rank, addresses=self.addresses)
        s = client.session
        self.attached = client
        self.write(f"Attached to debug session for rank {s.rank} ({s.host})\n{s.header}\n")

    def _cast(self, line: str) -> None:
        m = re.match(r"^\s*cast\s+(ranks\([^)]*\)|\S+)\s+(.+)$", line)
        if m is None:
            self.write("usage: cast [ACTOR] RANKS COMMAND\n")
            return
        actor: str | None = None
        ranks, cmd = m.group(1), m.group(2)
        m2 = _RANKS_CMD.match(cmd)
        if m2 is not None and ranks in {s.actor for s in sessions(addresses=self.addresses)}:
            actor, ranks, cmd = ranks, m2.group(1), m2.group(2)  # the first word was an actor name
        res = cast(actor, parse_ranks(ranks), cmd, addresses=self.addresses)
        if not res:
            self.write(f"no paused ranks match {ranks}\n")
        for rank, out in res.items():
            self.write(f"[{rank}] " + (out.rstrip().replace("\n", f"\n[{rank}] ") if out.strip() else "") + "\n")


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---------------------------------------------------------------------------- the blocked cell
def _stdin_available() -> bool:
    """Can ``input()`` reach a person? (A kernel request with allow_stdin, or a TTY.)"""
    if _context.in_ipython_kernel():
        from IPython import get_ipython  # only reached inside a kernel, where IPython is loaded

        kernel = getattr(get_ipython(), "kernel", None)
        return bool(getattr(kernel, "_allow_stdin", False))
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def _settle(quiet: float = 0.15, limit: float = 1.0) -> None:
    """Let ranks of one call that stop together arrive before the first table (UI debounce)."""
    end = time.monotonic() + limit
    with _debugwait.changed:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not _debugwait.changed.wait(min(quiet, left)):
                return


def _blocked(fut: Future[Any]) -> None:
    """The console of a main thread blocked on ``fut`` while ranks of its calls are paused."""
    if not _stdin_available():
        _no_input()
        return
    _settle()
    ours = _debugwait.paused()
    seen = set(ours)
    con = Console()
    con.write(
        f"\nmonarch_nb: {len(ours)} rank(s) stopped at a breakpoint while waiting for {fut._what}.\n"
        "Type 'attach ACTOR RANK' to debug one, 'continue' to resume all, 'help' for more.\n"
    )
    con.show_table()

    def until() -> bool:
        now = _debugwait.paused()
        seen.update(now)
        return not now

    try:
        con.interact(input, until=until)
    except NotImplementedError:  # a frontend that says allow_stdin but cannot answer (StdinNotImplementedError)
        _no_input()
        return
    finally:
        _debugwait.mark_seen(seen)
    left = _debugwait.paused()
    if left:
        con.write(
            f"left the debugger; {len(left)} rank(s) stay paused and this call keeps waiting "
            "(attach with monarch_nb.debug or `monarch-nb debug`, or interrupt to stop waiting)\n"
        )
    else:
        con.write("all ranks continued; waiting for the result\n")


def _no_input() -> None:
    cfg = get_config()
    policy = cfg.debug_no_input
    if policy not in ("continue", "raise", "wait"):
        raise ConfigError(f"debug_no_input must be 'continue', 'raise' or 'wait', not {policy!r}")
    ours = _debugwait.paused()
    _debugwait.mark_seen(set(ours))
    if policy == "wait":
        for r in ours.values():
            print(
                f"breakpoint at {r.get('bp_file')}:{r.get('bp_line')} on rank {r.get('rank')}: no input here; "
                "waiting for an attach (run `monarch-nb debug` in a terminal)",
                file=sys.stderr,
                flush=True,
            )
        return
    if cfg.debug_no_input_timeout > 0:
        _debugwait.wait_closed(set(ours), cfg.debug_no_input_timeout)
    still = [Session._from(r) for s, r in _debugwait.paused().items() if s in ours]
    futs = [(s, _send(s, "c")) for s in still]
    for s, f in futs:
        try:
            f.get(timeout=30)
        except Exception as e:
            print(f"monarch_nb: could not continue rank {s.rank}: {e}", file=sys.stderr, flush=True)
        _debugwait.forget(s.sid)
        print(f"breakpoint at {s.bp_file}:{s.bp_line} on rank {s.rank} skipped (no input)", file=sys.stderr, flush=True)
    if policy == "raise" and still:
        where = ", ".join(f"{s.bp_file}:{s.bp_line} on rank {s.rank}" for s in still)
        raise DebugError(f"breakpoint at {where} with no input to debug it (debug_no_input='raise'); the ranks were continued")


_debugwait.console = _blocked


# ---------------------------------------------------------------------------- the CLI
def run_cli(addresses: list[str] | None = None, key_file: str | None = None, commands: list[str] | None = None) -> int:
    """``monarch-nb debug``: the console in a terminal (or over a pipe), or run ``commands`` and exit."""
    if key_file:
        if _context._runtime is not None:
            raise ConfigError("set the key file before monarch_nb starts its runtime")
        os.environ["MONARCH_NB_KEY_FILE"] = key_file
    con = Console(addresses=addresses)
    if commands:
        for c in commands:
            con.write(con.current_prompt + c + "\n")
            if not con.execute(c):
                break
        return 0
    con.banner()
    try:
        con.interact(input)
    except KeyboardInterrupt:
        con.write("\n")
    return 0
