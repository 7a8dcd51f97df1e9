"""The ``%mesh`` line magic and ``%%mesh`` cell magic: argument parsing and display only."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .. import logs as _logs
from .. import mesh as _mesh
from .._argtypes import positive_seconds
from .._meshstop import stop_proc_mesh, stopped_elsewhere
from .._numtext import plural
from ..actor import controller_client
from ..errors import AuthenticationError, ConfigError, ConnectError, DebugError, MeshError, MonarchNBError, ProtocolError
from . import _jobs

_SUMMARY = """\
%mesh connect [ADDRESS|CONNECTION_FILE ...]   attach to allocators (none: the local one); re-attach named meshes
%mesh spawn NAME --per-host gpus=8             start a named proc mesh over the attached hosts, bound to NAME
%%mesh exec [NAME] [--ranks 0:4] [--no-block] [--no-aggregate]
                                               run the cell in every proc of the mesh (one namespace per proc)
%mesh status                                   allocators, meshes, procs and their states
%mesh logs NAME [--rank R] [--tail N] [--follow]
                                               the full per-rank logs kept by the allocators
%mesh stop NAME | --all [--force]              stop meshes (your own unless --force)
%mesh env diff | sync                          host environments vs this kernel's; make them match
%mesh debug                                    paused ranks (breakpoint()): actor, rank, host, function, file:line
%mesh debug cast ACTOR RANKS COMMAND           send a pdb command to a rank set (0-3, *) and show each answer
%mesh debug continue                           resume every paused rank
%mesh attach ACTOR RANK                        an interactive pdb on that rank, through this cell's input box
%mesh dashboard [NAME]                         a live view: ranks by state, host resources, logs, errors
%mesh stacks NAME [--ranks R] [--native]       every thread's stack on every rank
%mesh trace [NAME] [--last 30s] [--out PATH] [--factor 2] [--incarnation all|ID]
                                               every rank's spans as a Chrome/Perfetto trace file and a timeline; stragglers named
%mesh sync [PATH ...] [--recreate|--restart] [--watch|--stop-watch] [--via URL]
                                               send the workspace to the hosts, reload it in running procs
%mesh help                                     this text; `%mesh SUBCOMMAND --help` for details"""
_SUMMARY += "\n" + _jobs.SUMMARY
_SUMMARY += "\nNAME of a mesh: a %mesh spawn name, or a notebook variable holding one (procs = this_host().spawn_procs(...))"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        # --help printed its text; stop the magic without a traceback
        raise _HelpShown


class _HelpShown(Exception):
    pass


def _kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.replace(",", " ").split():
        k, sep, v = part.partition("=")
        if not sep or not k.isidentifier():
            raise UsageError(f"--per-host wants NAME=SIZE pairs like gpus=8 or hosts=2,gpus=4, got {part!r}")
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"--per-host size for {k!r} must be a positive integer, got {v!r}")
        if k in out:
            # the last one won: gpus=1,gpus=2 spawned 2 procs, a shape the line did not say
            raise UsageError(f"--per-host names {k!r} twice ({text!r}): give each dimension once, e.g. hosts=2,gpus=4")
        out[k] = n
    return out


def _parsers() -> dict[str, _Parser]:
    p: dict[str, _Parser] = {}
    c = p["connect"] = _Parser(prog="%mesh connect", description="Attach to allocators and re-attach their named meshes.")
    c.add_argument("targets", nargs="*", help="allocator addresses (tcp://HOST:PORT, ipc://PATH) or connection files")
    c.add_argument("--key-file", help="cluster key file for tcp allocators (default $MONARCH_NB_KEY_FILE)")
    s = p["spawn"] = _Parser(prog="%mesh spawn", description="Start a named proc mesh on every attached host.")
    s.add_argument("name", help="mesh name; also the notebook variable bound to it")
    s.add_argument("--per-host", default="", help="shape per host, e.g. gpus=8 or procs=2,gpus=4")
    s.add_argument("--no-persist", action="store_true", help="stop the mesh when this kernel exits")
    e = p["exec"] = _Parser(prog="%%mesh exec", description="Run the cell in every proc of a mesh.")
    e.add_argument("name", nargs="?", help="mesh name (optional when one mesh runs)")
    e.add_argument("--ranks", help="a subset of ranks: 0:4, 0-3, 1,3")
    e.add_argument("--no-block", action="store_true", help="return a Future at once instead of waiting")
    e.add_argument("--no-aggregate", action="store_true", help="show every line of every rank as it comes")
    st = p["status"] = _Parser(prog="%mesh status", description="Allocators, meshes, procs and their states.")
    st.add_argument("addresses", nargs="*", help="extra allocator addresses to ask")
    lg = p["logs"] = _Parser(prog="%mesh logs", description="The full per-rank logs the allocators keep.")
    lg.add_argument("name", help="mesh name")
    lg.add_argument("--rank", type=int, help="only this rank")
    lg.add_argument("--tail", type=int, help="only the last N lines per rank")
    lg.add_argument("--follow", action="store_true", help="keep printing new lines (interrupt the kernel to stop)")
    sp = p["stop"] = _Parser(
        prog="%mesh stop",
        description="Stop meshes this kernel owns; by name, also one it does not hold (a job's, a kernel's gone).",
    )
    sp.add_argument("name", nargs="?", help="mesh name")
    sp.add_argument(
        "--all", action="store_true", help="every mesh this kernel owns (with --force: every mesh %%mesh status lists)"
    )
    sp.add_argument("--force", action="store_true", help="also meshes owned by other controllers")
    sy = p["sync"] = _Parser(prog="%mesh sync", description="Send the workspace to the hosts and reload it in running procs.")
    sy.add_argument("paths", nargs="*", help="folders to sync (default: the notebook's folder)")
    sy.add_argument("--mesh", action="append", help="only reload this mesh (repeatable; default: all)")
    sy.add_argument("--exclude", action="append", default=[], help="glob to leave out (repeatable; .gitignore is honoured)")
    sy.add_argument("--via", help="fsspec URL of a staging area the hosts pull from (s3://..., file:///shared/...)")
    how = sy.add_mutually_exclusive_group()
    how.add_argument("--recreate", action="store_true", help="re-create the affected actors from their constructor arguments")
    how.add_argument("--restart", action="store_true", help="restart the procs (needed after changing a compiled package)")
    how.add_argument("--no-reload", action="store_true", help="only send the files")
    sy.add_argument("--watch", action="store_true", help="re-sync whenever a file changes")
    sy.add_argument("--stop-watch", action="store_true", help="stop watching")
    env = p["env"] = _Parser(
        prog="%mesh env", description="Compare the hosts' Python environments with this kernel's, or make them match."
    )
    env.add_argument("action", choices=["diff", "sync"])
    env.add_argument("addresses", nargs="*", help="allocators (default: the attached hosts)")
    env.add_argument("--no-index", action="store_true", help="sync: ship installed files instead of trying pip on the host")
    dbg = p["debug"] = _Parser(prog="%mesh debug", description="Ranks paused at breakpoint(): list, cast, continue.")
    dbg.add_argument("action", nargs="?", choices=["list", "cast", "continue"], default="list")
    dbg.add_argument("rest", nargs=argparse.REMAINDER, help="for cast: ACTOR RANKS COMMAND...")
    at = p["attach"] = _Parser(prog="%mesh attach", description="Attach pdb to a paused rank (detach returns to the table).")
    at.add_argument("actor")
    at.add_argument("rank", type=int)
    d = p["dashboard"] = _Parser(prog="%mesh dashboard", description="A live dashboard of a mesh (ipywidgets).")
    d.add_argument("name", nargs="?", help="mesh name (optional when one mesh runs)")
    d.add_argument("--interval", type=positive_seconds, default=1.0, help="seconds between refreshes")
    sk = p["stacks"] = _Parser(prog="%mesh stacks", description="Every thread's Python stack on every rank, merged.")
    sk.add_argument("name", nargs="?", help="mesh name, or a variable holding a proc or actor mesh (optional when one mesh runs)")
    sk.add_argument("--ranks", help="a subset of ranks: 0:4, 0-3, 1,3")
    sk.add_argument("--native", action="store_true", help="add native frames (py-spy dump --native, if installed)")
    sk.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds every rank has to answer")
    tr = p["trace"] = _Parser(
        prog="%mesh trace", description="Every rank's spans of the last while: a trace file and a timeline."
    )
    tr.add_argument("name", nargs="?", help="mesh name (default: every mesh of every attached allocator)")
    tr.add_argument("--last", default="30s", help="how far back: 30s, 5m, 2h (default 30s)")
    tr.add_argument("--out", help="trace file (default trace-NAME-TIME.json here)")
    tr.add_argument("--factor", type=float, default=2.0, help="a straggler is this many times slower than the others' median")
    tr.add_argument(
        "--incarnation",
        default="latest",
        help="a name reused after a stop: 'latest' (default, the newest mesh of that name), 'all', or a mesh id",
    )
    _jobs.add_parsers(p, _Parser)
    return p


@magics_class
class MeshMagics(Magics):
    """``%mesh SUBCOMMAND ...``; ``%mesh help`` lists them."""

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%mesh: {e}") from None
        if not argv or argv[0] in ("help", "-h", "--help"):
            print(_SUMMARY)
            return None
        sub, rest = argv[0], argv[1:]
        parsers = _parsers()
        if sub not in parsers:
            raise UsageError(f"%mesh: unknown subcommand {sub!r}\n{_SUMMARY}")
        if (sub == "exec") != (cell is not None) and not ({"-h", "--help"} & set(rest)):
            raise UsageError(
                "exec is a cell magic: start the cell with %%mesh exec"
                if sub == "exec"
                else f"%%mesh {sub} takes no cell body; use %mesh {sub}"
            )
        try:
            args = parsers[sub].parse_args(rest)
        except _HelpShown:
            return None
        run = getattr(self, f"_do_{sub}")
        try:
            if sub in ("exec", "attach", "debug"):
                return run(args, cell)
            # the other subcommands' waits are housekeeping: paused ranks must not open the debugger there
            from ..debug import quiet

            with quiet():
                try:
                    return run(args, cell)
                except _ONE_LINE as e:
                    # housekeeping failed: say why in one line, as IPython says a usage error
                    raise UsageError(f"%mesh {sub}: {e}") from None
        except _TYPED_WRONG.get(sub, ()) as e:
            raise UsageError(f"{'%%' if cell is not None else '%'}mesh {sub}: {e}") from None

    # ------------------------------------------------------------ subcommands
    def _bind(self, name: str, value: Any) -> None:
        self.shell.user_ns[name] = value  # type: ignore[union-attr]

    def _taken(self, name: str) -> str | None:
        """What binding a mesh to the notebook variable ``name`` would lose (a value of the
        user's that is no mesh, or a builtin it would hide), in words; None when nothing."""
        import builtins

        from ..actor import ActorMesh, HostMesh, ProcMesh

        ns = self.shell.user_ns  # type: ignore[union-attr]
        if name in ns:
            v = ns[name]
            return (
                None
                if isinstance(v, (ProcMesh, ActorMesh, HostMesh))
                else f"the notebook variable {name!r} holds a {type(v).__name__}"
            )
        return f"{name!r} is a Python builtin" if hasattr(builtins, name) else None

    def _refuse_taken(self, what: str, name: str) -> None:
        # binding over it silently replaced the user's value (`data = load()`, then `%mesh spawn
        # data`) or hid a builtin (`%mesh spawn print`: every print() then failed)
        taken = self._taken(name)
        if taken is not None:
            undo = f" or `del {name}` first" if name in self.shell.user_ns else ""  # type: ignore[union-attr]
            raise UsageError(f"{what}: {taken}, which the mesh's variable would replace: choose another name{undo}")

    def _bind_found(self, name: str, pm: Any) -> None:
        """Bind a mesh found on the allocators (re-attached, restarted), unless that loses a value."""
        taken = self._taken(name)
        if taken is None:
            self._bind(name, pm)
        else:
            print(f"not bound: {taken}; ProcMesh.lookup({name!r}) gives the mesh", file=sys.stderr)

    def _do_connect(self, args: argparse.Namespace, cell: str | None) -> Any:
        if args.key_file and not args.targets:
            # the local allocator takes no key: the file went unread, a wrong path unnoticed
            raise UsageError(
                "%mesh connect: --key-file is for the tcp:// allocators named with it: "
                "%mesh connect tcp://HOST:PORT --key-file KEYFILE (the local allocator needs none)"
            )
        hm = _mesh.connect(*args.targets, key_file=args.key_file)
        found = _mesh.meshes()
        orphans = set(_mesh.orphaned_meshes())
        for name, pm in found.items():
            if not pm._stopped and name not in orphans:
                self._bind_found(name, pm)
        hosts = [h.host for h in hm._refs()]
        names = ", ".join(f"{n} {pm.extent}" for n, pm in found.items() if not pm._stopped and n not in orphans) or "none"
        print(f"connected to {len(hosts)} host(s): {', '.join(hosts)}; meshes: {names}")
        for name in sorted(orphans):
            orphan = found.get(name)
            if orphan is not None and not orphan._stopped:
                print(
                    f"found {name} {orphan.extent}: procs an earlier kernel spawned with no %mesh name; "
                    f"`%mesh stop {name}` frees them, `%%mesh exec {name}` or ProcMesh.lookup({name!r}) uses them"
                )
        for _name, why in _mesh.ambiguous_meshes().items():
            print(f"not bound: {why}", file=sys.stderr)
        return None

    def _do_spawn(self, args: argparse.Namespace, cell: str | None) -> Any:
        per_host = _kv(args.per_host)
        self._refuse_taken("%mesh spawn", args.name)
        pm = _mesh.spawn(args.name, per_host, persist=False if args.no_persist else None)
        self._bind(args.name, pm)
        print(f"{args.name}: {plural(len(pm._procs), 'proc')} {pm.extent} on {len({p.host for p in pm._procs})} host(s)")
        return None

    def _do_exec(self, args: argparse.Namespace, cell: str | None) -> Any:
        from . import output

        if args.no_aggregate:
            out = output()
            if out is not None and out.current is not None:
                out.current.window = 0.0
        try:
            # a blank first line keeps line numbers those of the cell (its first line is the magic),
            # and the label names it as IPython names cells: tracebacks read "Cell In[N], line L"
            n = _running_cell_number(self.shell)
            source, label = ("\n" + (cell or ""), f"In[{n}]") if n else (cell or "", "")
            return _mesh.exec_cell(self._named(args.name), source, ranks=args.ranks, block=not args.no_block, label=label)
        finally:
            out = output()
            if out is not None and not args.no_block:
                out.flush_now()

    def _do_status(self, args: argparse.Namespace, cell: str | None) -> Any:
        from ._tables import StatusTable

        return StatusTable(_mesh.status(args.addresses or None), controller_client().cid, _mesh._held_procs())

    def _do_logs(self, args: argparse.Namespace, cell: str | None) -> Any:
        # a name this kernel does not know may still have logs of an earlier allocator on this host
        pm = self._named(args.name)
        if isinstance(pm, str):
            pm = _mesh.meshes().get(pm) or (_mesh.get(pm) if args.follow else pm)
        if args.follow:
            try:
                for r in _logs.follow(pm, args.rank, tail=args.tail if args.tail is not None else 10):
                    _print_row(r)
            except KeyboardInterrupt:
                return None
            print(f"(mesh {args.name} is stopped: no more lines will come)")
            return None
        rows = _logs.logs(pm, args.rank, args.tail)
        for r in rows:
            _print_row(r)
        if not rows:
            print(f"(no output from mesh {args.name})")
        return None

    def _do_sync(self, args: argparse.Namespace, cell: str | None) -> Any:
        from .. import sync as _sync

        global _watcher
        if args.stop_watch:
            if _watcher is not None:
                _watcher.stop()
                _watcher = None
            print("not watching")
            return None
        mode = "recreate" if args.recreate else "restart" if args.restart else None if args.no_reload else "inplace"
        meshes = [m if not isinstance(m := self._named(n), str) else _mesh.get(m) for n in args.mesh] if args.mesh else None
        kw: dict[str, Any] = {"meshes": meshes, "excludes": args.exclude, "via": args.via, "reload": mode}
        if args.watch:
            if _watcher is not None:
                _watcher.stop()
            _watcher = _sync.watch(args.paths or None, **kw)
            return _watcher
        reports = _sync.sync(args.paths or None, **kw)
        if mode == "restart":
            for name, pm in _mesh.meshes().items():
                self._bind_found(name, pm)
        return reports[0] if len(reports) == 1 else reports

    def _do_env(self, args: argparse.Namespace, cell: str | None) -> Any:
        from .. import env

        if args.action == "diff":
            return env.diff(args.addresses or None)
        done = env.sync(args.addresses or None, index=not args.no_index)
        for alloc, acts in done.items():
            print(f"{alloc}: " + ("; ".join(acts) if acts else "already matches"))
        if any(done.values()):
            print("procs import the new versions once restarted: %mesh sync --restart (compiled packages need it)")
        return None

    def _do_debug(self, args: argparse.Namespace, cell: str | None) -> Any:
        from .. import debug

        if args.action == "list":
            print(debug.format_table(debug.sessions()))
            return None
        if args.action == "continue":
            _console_command(debug.Console(raise_errors=True), "continue", "%mesh debug continue")
            return None
        if len(args.rest) < 3:
            raise UsageError("%mesh debug cast ACTOR RANKS COMMAND, e.g. %mesh debug cast debugee 0-3 p rank")
        _console_command(debug.Console(raise_errors=True), "cast " + " ".join(args.rest), "%mesh debug cast")
        return None

    def _do_attach(self, args: argparse.Namespace, cell: str | None) -> Any:
        from .. import debug

        con = debug.Console(raise_errors=True)
        _console_command(con, f"attach {args.actor} {args.rank}", "%mesh attach")
        # attached: pdb's own errors are the user's to read and go on from, as at a terminal
        con.raise_errors = False
        con.interact(leave_on_detach=True)
        return None

    _do_launch = _jobs.do_launch
    _do_jobs = _jobs.do_jobs
    _do_kill = _jobs.do_kill

    def _do_dashboard(self, args: argparse.Namespace, cell: str | None) -> Any:
        from ..widgets import Dashboard

        return Dashboard(self._find_proc_mesh(args.name), interval=args.interval)

    def _held(self, name: str | None) -> Any:
        """The mesh of the Python API (a ProcMesh or an ActorMesh) that notebook variable
        ``name`` holds (``procs = this_host().spawn_procs(...)``), or None: also when a ``%mesh``
        name is ``name``, which wins."""
        from ..actor import ActorMesh, ProcMesh

        if not name or name in _mesh.meshes():
            return None
        v = self.shell.user_ns.get(name)  # type: ignore[union-attr]
        return v if isinstance(v, (ProcMesh, ActorMesh)) else None

    def _named(self, name: str | None) -> Any:
        """``name`` as the subcommands take it: a ``%mesh`` name as it is, or the proc mesh of a
        notebook variable holding a mesh spawned through the Python API (``procs =
        this_host().spawn_procs(...)``, then ``%%mesh exec procs``)."""
        from ..actor import ActorMesh

        v = self._held(name)
        if isinstance(v, ActorMesh):
            v = v._proc_mesh
        return name if v is None else v

    def _find_proc_mesh(self, name: str | None, adopt: bool = True) -> Any:
        """A named mesh: this controller's, a notebook variable (or the mesh a variable holds,
        spawned through the Python API), else one running on this host's allocator: adopted
        into this kernel (ProcMesh.lookup), or with ``adopt=False`` its name, for a read-only
        look (``debug.stacks(name)``) that leaves its owner's mesh and output as they are."""
        from ..actor import ProcMesh

        found = self._named(name)
        if not isinstance(found, str) or not name or name in _mesh.meshes():
            return _mesh._resolve(found)
        ns = self.shell.user_ns  # type: ignore[union-attr]
        for v in list(ns.values()):
            if isinstance(v, ProcMesh) and v.name == name and not v._stopped:
                return v
        if not adopt:
            return name
        try:
            return ProcMesh.lookup(name)
        except Exception:
            return _mesh._resolve(name)  # its error lists the meshes there are

    def _do_stacks(self, args: argparse.Namespace, cell: str | None) -> Any:
        from .. import debug

        # a notebook variable holding a mesh (an actor mesh's stacks are its actors'), else a
        # mesh by name, also one spawned through the Python API with a name=
        target = self._held(args.name)
        if target is None:
            target = self._find_proc_mesh(args.name, adopt=False)
        return debug.stacks(target, args.ranks, native=args.native, timeout=args.timeout)

    def _do_trace(self, args: argparse.Namespace, cell: str | None) -> Any:
        from . import _trace

        target = self._named(args.name)
        return _trace.trace(
            target if isinstance(target, str) or target is None else target.name,
            args.last,
            args.out,
            args.factor,
            args.incarnation,
        )

    def _do_stop(self, args: argparse.Namespace, cell: str | None) -> Any:
        if not args.all and not args.name:
            raise UsageError("%mesh stop: name a mesh or pass --all")
        if args.all and args.name:
            raise UsageError(f"%mesh stop: name a mesh or pass --all, not both: `%mesh stop {args.name}` stops only it")
        from ..actor import ActorMesh, ProcMesh

        # a mesh of the Python API, by the variable that holds it
        held = None if args.all else self._held(args.name)
        if isinstance(held, ActorMesh):
            # its actors, not the procs they run on (as held.stop())
            held.stop().get(timeout=controller_client().rt.cfg.spawn_timeout)
            print(f"stopped: {args.name} (actors {held._label!r}; their procs run on)")
            return None
        if isinstance(held, ProcMesh):
            stop_proc_mesh(held, args.force)
            gone = stopped_elsewhere(held)
            print(gone or f"stopped: {args.name} ({held.name})")
            return None
        stopped = _mesh.stop(args.name, all=args.all, force=args.force)
        if stopped or args.all:  # else it was stopped already, and mesh.stop said by whom
            print(f"stopped: {', '.join(stopped) or 'nothing (no running mesh of yours)'}")
        return None


_watcher: Any = None

#: errors a housekeeping subcommand reports as one line, not as a library traceback (a call's
#: ActorError and SupervisionError keep theirs: that traceback is the user's code)
_ONE_LINE = (MeshError, ConnectError, ConfigError, DebugError, ProtocolError, AuthenticationError)

#: per subcommand, what its functions raise when the line names something that is not there (a
#: mesh name that is no identifier, a rank set the mesh lacks, a folder that is none, an address
#: that is none): said in one line as well. An exec cell's own errors are an ExecError, never these
_TYPED_WRONG: dict[str, tuple[type[Exception], ...]] = {
    # OSError: too few file descriptors for the procs asked for (it says what to raise the limit to)
    "spawn": (ValueError, OSError),
    "exec": (MeshError, ValueError),
    "logs": (ValueError,),
    "sync": (FileNotFoundError, ValueError),
    "env": (ValueError,),
    "stacks": (ValueError,),
    "trace": (ValueError,),
}


def _console_command(con: Any, line: str, what: str) -> None:
    """Run one debugger console command for a magic: a command that fails (no such session, a
    bad rank set) fails the cell with its message, so "Run all" stops there."""
    try:
        con.execute(line)
    except (MonarchNBError, ValueError) as e:
        raise UsageError(f"{what}: {e}") from None


def _running_cell_number(shell: Any) -> int:
    """The In[N] of the cell running now: the last one IPython compiled (its execution_count
    has already moved on to the next cell's number by then)."""
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if numbers:
        return int(max(numbers.values()))
    return max(0, int(getattr(shell, "execution_count", 1)) - 1)


def _print_row(r: dict[str, Any]) -> None:
    stream = sys.stderr if r.get("stream") == "stderr" else sys.stdout
    line = r["line"]
    if line.startswith("\r"):
        return  # intermediate states of a progress bar; its final line follows
    print(_logs.format_line(r["rank"], line.rsplit("\r", 1)[-1]), file=stream)
