"""monarch-nb: allocator daemon, status, rank logs, stacks, keys, debugger."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ._argtypes import positive_seconds
from ._numtext import plural


def _in_one_line(
    what: str, errors: tuple[type[Exception], ...], action: Callable[[argparse.Namespace], int], args: argparse.Namespace
) -> int:
    """``action(args)``, with ``errors`` (what the command line got wrong, or a refusal that says
    what to fix) printed as one line and exit status 1, not a traceback."""
    try:
        return action(args)
    except errors as e:
        print(f"monarch-nb {what}: {e}", file=sys.stderr)
        return 1


def _allocator(args: argparse.Namespace) -> int:
    from .errors import MonarchNBError

    # a bind address that is none, a key that is missing
    return _in_one_line(f"allocator {args.action or 'run'}", (ValueError, MonarchNBError), _allocator_action, args)


def _allocator_action(args: argparse.Namespace) -> int:
    from .allocator import list_allocators, run_allocator, start_allocator, stop_allocator

    action = args.action or "run"
    if action == "run":
        run_allocator(
            bind=args.bind,
            key_file=args.key_file,
            trust_all=args.trust_all,
            lease=args.lease,
            announce_dir=args.announce_dir,
            announce_name=args.announce_name,
            exit_on_lease=args.exit_on_lease,
            gateway=args.gateway,
        )
        return 0
    if action == "start":
        extra = []
        if args.bind:
            extra += ["--bind", args.bind]
        if args.key_file:
            extra += ["--key-file", args.key_file]
        if args.trust_all:
            extra += ["--trust-all"]
        if args.lease is not None:
            extra += ["--lease", str(args.lease)]
        if args.gateway:
            extra += ["--gateway", args.gateway]
        running = {int(r["pid"]) for r in list_allocators() if r["alive"]}
        info = start_allocator(extra)
        if extra and int(info["pid"]) in running:
            # start returns the allocator already serving this runtime directory, as it is
            print(
                f"monarch-nb allocator start: allocator pid {info['pid']} already serves {info['addr']} with its own "
                f"settings, not {' '.join(extra)}: `monarch-nb allocator stop` it first",
                file=sys.stderr,
            )
            return 1
        print(f"allocator pid {info['pid']} at {info['addr']} {info.get('tcp') or ''}".rstrip())
        return 0
    if action == "stop":
        dead = {int(r["pid"]) for r in list_allocators() if not r["alive"]}
        pids = stop_allocator(args.pid)
        stopped, gone = [p for p in pids if p not in dead], [p for p in pids if p in dead]
        if stopped:
            print(f"stopped {len(stopped)} allocator(s): {stopped}")
        if gone:
            print(f"removed the record of {len(gone)} allocator(s) whose process had already exited: {gone}")
        if not pids and args.pid is not None:
            alive = [int(r["pid"]) for r in list_allocators() if r["alive"]]
            print(f"no allocator with pid {args.pid} on this host (running: {', '.join(map(str, alive)) or 'none'})")
        elif not pids:
            print("no allocator running on this host")
        return 0
    if action == "status":
        rows = list_allocators()
        if not rows:
            print("no allocators registered")
        for r in rows:
            line = f"{r['pid']:>8} {'alive' if r['alive'] else 'dead ':5} {r['host']:20} {r['addr']} {r.get('tcp') or ''}"
            if not r["alive"]:
                # killed (SIGKILL, the OOM killer) before it could remove its record: still listed,
                # as the sidebar lists it, so that a user learns it died; the next spawn starts another
                line = (
                    f"{line.rstrip()}  (its process is gone: killed, or the host restarted; its meshes' procs "
                    f"went with it. `monarch-nb allocator stop --pid {r['pid']}` removes this record)"
                )
            print(line.rstrip())
        return 0
    raise SystemExit(f"unknown allocator action {action!r}")


def _status(args: argparse.Namespace) -> int:
    from .introspect import known_status

    # the jobs' allocators too: ProcessJob, SSHJob and SlurmJob keep their records in the job's directory
    s = known_status()
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    mine = [a for a in s["allocators"] if "job" not in a]
    jobs: dict[tuple[str, ...], list[dict]] = {}
    for a in s["allocators"]:
        if "job" in a:
            j = a["job"]
            jobs.setdefault(tuple(str(j.get(k) or "") for k in ("name", "type", "scheduler", "id", "state")), []).append(a)
    if not s["allocators"]:
        from .config import runtime_dir

        print(
            f"no allocator running (runtime directory {runtime_dir()}): a notebook's first spawn starts one, "
            "or `monarch-nb allocator start`"
        )
    for a in mine:
        _print_allocator(a, "")
    for (name, kind, scheduler, ident, state), allocs in jobs.items():
        print(f"job {name} ({kind}, {scheduler}{' ' + ident if ident else ''}): {state}")
        for a in allocs:
            _print_allocator(a, "  ")
    return 0


def _print_allocator(a: dict, indent: str) -> None:
    if a.get("lost"):  # a job's host whose allocator did not answer the job: never asked, so no id or pid
        print(f"{indent}allocator on {a.get('host')} ({a.get('addr') or 'address unknown'}): {a['error']}")
        return
    print(f"{indent}allocator {a.get('alloc_id', '?')} on {a.get('host')} pid {a.get('pid')}: {a.get('error') or 'ok'}")
    attached = {c.get("cid") for c in a.get("controllers", [])}
    for m in a.get("meshes", []):
        states: dict[str, int] = {}
        for p in m["procs"]:
            states[p["state"]] = states.get(p["state"], 0) + 1
        labels, sizes = m.get("extent") or (m.get("labels", []), m.get("sizes", []))
        shape = "{" + ", ".join(f"{k}: {v}" for k, v in zip(labels, sizes)) + "}"
        # a persistent mesh whose kernel is gone holds its procs until someone stops it
        gone = "" if m["owner"] in attached else " (gone)"
        print(f"{indent}  mesh {m['name']} {shape} {m['state']} owner={m['owner']}{gone} procs={states}")


def _logs(args: argparse.Namespace) -> int:
    import warnings

    from .errors import ConnectError, MeshError

    with warnings.catch_warnings():
        # ranks on a job's host that does not answer: one line, as the errors are
        warnings.showwarning = lambda message, *_a, **_k: print(f"monarch-nb logs: {message}", file=sys.stderr)
        return _in_one_line("logs", (ValueError, MeshError, ConnectError), _logs_action, args)


def _logs_action(args: argparse.Namespace) -> int:
    """A mesh's rank logs as this host's allocators keep them: no controller or kernel needed,
    also for a mesh whose kernel is gone (persistent procs) or whose allocator has stopped; a
    running mesh of a job's allocators (their logs are in the job's directory) is asked of them."""
    from .config import runtime_dir
    from .errors import MeshError, MeshNotFoundError
    from .logs import follow, format_line, local_meshes, logs

    here = local_meshes()
    printed = False
    try:
        rows = (
            follow(args.mesh, args.rank, args.tail if args.tail is not None else 10)
            if args.follow
            else logs(args.mesh, args.rank, args.tail)
        )
        for r in rows:
            printed = True
            print(
                format_line(r["rank"], r["line"]), file=sys.stderr if r["stream"] == "stderr" else sys.stdout, flush=args.follow
            )
    except KeyboardInterrupt:
        return 130
    except MeshError:
        if printed or args.mesh in here:
            raise
        # the name is known nowhere: say where it was looked for (not the notebook's "spawn it")
        raise MeshNotFoundError(
            f"no logs of a mesh named {args.mesh!r} on this host (runtime directory {runtime_dir()}; meshes with "
            f"logs here: {', '.join(here) or 'none'}), nor a running one on its allocators or its jobs'; "
            "a mesh on other hosts: %mesh logs in its notebook, or this command on each host",
            args.mesh,
        ) from None
    return 0


def _stop(args: argparse.Namespace) -> int:
    from .errors import ConnectError, MeshError

    # an unknown name, a mesh a running controller owns (without --force), ranks on a host that is lost
    return _in_one_line("stop", (MeshError, PermissionError, ValueError, ConnectError), _stop_action, args)


def _stop_action(args: argparse.Namespace) -> int:
    """Stop proc meshes of this host's allocators, as ``%mesh stop`` does in their notebook: a
    persistent mesh whose kernel is gone needs no Python, and no ``allocator stop`` of all of them."""
    from .allocator import stop_mesh
    from .config import get_config, runtime_dir
    from .errors import ConnectError, MeshNotFoundError
    from .introspect import _unreached_note, _unreached_where, known_status

    if args.name is not None and args.all:
        # "name a mesh or pass --all" alone read as if neither had been given
        raise ValueError(f"name a mesh or pass --all, not both: `monarch-nb stop {args.name}` stops only it")
    if (args.name is None) == (not args.all):
        raise ValueError("name a mesh (as `monarch-nb status` lists it) or pass --all")
    # name -> (allocators that run it, the owner, whether the owner is a running controller);
    # the jobs' allocators too (ProcessJob, SSHJob, SlurmJob keep their records apart)
    meshes: dict[str, tuple[list[str], str, bool]] = {}
    allocators = known_status()["allocators"]
    for a in allocators:
        attached = {c.get("cid") for c in a.get("controllers", [])}
        for m in a.get("meshes", []):
            addrs, owner, live = meshes.get(m["name"], ([], m["owner"], False))
            meshes[m["name"]] = ([*addrs, a["addr"]], owner, live or m["owner"] in attached)
    if args.name is not None and args.name not in meshes:
        # one too busy to list its meshes in time may run it: "no mesh" alone sent the user away
        silent = "".join(f"; {a.get('addr') or a.get('host')} did not answer: {a['error']}" for a in allocators if a.get("error"))
        raise MeshNotFoundError(
            f"no mesh named {args.name!r} on this host's allocators or its jobs' (runtime directory {runtime_dir()}; "
            f"meshes: {', '.join(sorted(meshes)) or 'none'}{silent})",
            args.name,
        )
    todo = [args.name] if args.name is not None else sorted(meshes)
    if not todo:
        print("no meshes on this host's allocators")
    timeout = get_config().spawn_timeout
    rc = 0
    for name in todo:
        addrs, owner, live = meshes[name]
        if live and not args.force:
            # %mesh stop's rule: another controller's mesh only with --force
            msg = f"mesh {name!r} is owned by controller {owner}, which is running: --force stops it anyway"
            if args.name is not None:
                raise PermissionError(msg)
            print(f"left {msg}")
            continue
        reason = "stopped by `monarch-nb stop` on the command line"
        n = sum(stop_mesh(name, a, force=args.force, reason=reason, timeout=timeout) for a in addrs)
        print(f"stopped mesh {name!r} ({plural(n, 'proc')})", flush=True)
        # ranks on a host that did not answer (a job's lost host): said, and the exit status says
        # not everything was stopped, as ssh/pdsh report a host they could not reach
        note = _unreached_note(name, allocators)
        if note and args.name is not None:
            raise ConnectError(note)
        if note:
            print(f"monarch-nb stop: {note}", file=sys.stderr)
            rc = 1
    gone = _unreached_where(allocators)
    if args.all and gone and not rc:
        # their meshes are listed nowhere: "no meshes" alone read as "nothing left running"
        print(f"monarch-nb stop: these could not be reached, and no mesh of theirs was stopped: {gone}", file=sys.stderr)
        rc = 1
    return rc


def _stacks(args: argparse.Namespace) -> int:
    from .errors import MeshError

    # an unknown name, a --ranks that names no rank of the mesh
    return _in_one_line("stacks", (MeshError, ValueError), _stacks_action, args)


def _stacks_action(args: argparse.Namespace) -> int:
    """Every thread's stack on a mesh's ranks, as ``%mesh stacks`` shows them: for a kernel stuck
    in a cell or gone, asked from a terminal as another controller, its owner left as it is."""
    from .debug import stacks

    print(stacks(args.mesh, args.ranks, native=args.native, timeout=args.timeout))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    import os
    import stat

    from ._wire.keys import read_key_file, write_key_file
    from .errors import ConfigError

    if not args.force and os.path.isfile(args.path):
        try:
            read_key_file(args.path)
        except ConfigError:
            pass  # no working key there (a stray file, one others can read): replaced as before
        else:
            # a new key locks out every host and job that holds this one, with no way back
            print(
                f"monarch-nb keygen: {args.path} already holds a cluster key, and every host given it would refuse "
                "the new one; pass --force to replace it",
                file=sys.stderr,
            )
            return 1
    try:
        write_key_file(args.path)
    except ConfigError as e:
        print(f"monarch-nb keygen: {e}", file=sys.stderr)
        return 1
    mode = stat.S_IMODE(os.lstat(args.path).st_mode)
    print(f"wrote a new cluster key to {args.path} (mode {mode:o}); copy it to every host over a secure channel")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .allocator import gc_code, gc_logs

    verb = "would remove" if args.dry_run else "removed"
    for what, gone, unit in (
        ("log", gc_logs(dry_run=args.dry_run), ("directory or file", "directories and files")),
        ("code cache", gc_code(dry_run=args.dry_run), ("entry", "entries")),
    ):
        for g in gone:
            print(f"{verb} {g['path']} ({g['bytes'] / 1e6:.1f} MB, {g['age_days']:.1f} days old)")
        total = sum(g["bytes"] for g in gone)
        print(f"{verb} {len(gone)} {what} {unit[0] if len(gone) == 1 else unit[1]}, {total / 1e6:.1f} MB")
    return 0


def _kernelspec(args: argparse.Namespace) -> int:
    # an interpreter that is not there, --user with --prefix, a kernel name Jupyter refuses, a prefix not writable
    return _in_one_line(f"kernelspec {args.action}", (OSError, ValueError), _kernelspec_action, args)


def _kernelspec_action(args: argparse.Namespace) -> int:
    from .kernelspec import install

    path = install(python=args.python, name=args.name, user=args.user, prefix=args.prefix)
    print(f"installed kernel spec {args.name!r} in {path}")
    return 0


def _debug(args: argparse.Namespace) -> int:
    from .errors import MonarchNBError

    # an --addr that does not answer or is no address, a key file that is missing or refused
    return _in_one_line("debug", (MonarchNBError, ValueError), _debug_action, args)


def _debug_action(args: argparse.Namespace) -> int:
    from .debug import run_cli

    return run_cli(args.addr or None, args.key_file, args.command or None)


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    v = int(v)
    return f"{v // 3600}h{v % 3600 // 60:02d}m" if v >= 3600 else f"{v // 60}m{v % 60:02d}s"


def _job(args: argparse.Namespace) -> int:
    import warnings

    from .job import JobError

    with warnings.catch_warnings():
        # a cached job replaced (JobReplacedWarning): one line, not this file's name and source line
        warnings.showwarning = lambda message, *_a, **_k: print(f"monarch-nb job {args.action}: {message}", file=sys.stderr)
        # a spec that names nothing, a job that does not exist, a scheduler's refusal
        return _in_one_line(f"job {args.action}", (JobError, ValueError, TypeError, AttributeError), _job_action, args)


def _job_action(args: argparse.Namespace) -> int:
    from .job import apply_spec, kill_job, list_jobs

    if args.action == "apply":
        if not args.target:
            raise SystemExit("monarch-nb job apply needs a job spec: module.attr (a JobTrait object)")
        job = apply_spec(args.target, args.cached_path)
        row = job.describe()
        print(f"applied {args.target}: {type(job).__name__} {row['scheduler']} {row['id']} {row['state']}")
        return 0
    if args.action == "status":
        rows = list_jobs()
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
            return 0
        if not rows:
            print("no jobs")
        for r in rows:
            print(
                f"{r['name']:16} {r['scheduler']:8} {r['id']:10} {r['state']:24} hosts={r['hosts']:<3} "
                f"age={_fmt_s(r.get('age_s'))} walltime_left={_fmt_s(r.get('walltime_left_s'))}"
            )
        return 0
    if args.action == "kill":
        kill_job(args.target)
        print(f"killed {args.target or 'the current job'}")
        return 0
    raise SystemExit(f"unknown job action {args.action!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch-nb", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allocator", help="run or manage this host's allocator daemon")
    a.add_argument("action", nargs="?", choices=["run", "start", "stop", "status"], help="default: run in the foreground")
    a.add_argument(
        "--bind",
        help="tcp://IP:PORT to serve other hosts, or ipc://PATH: a socket file served too (ipc is always served in the runtime dir)",
    )
    a.add_argument("--key-file", help="cluster key file (required for TCP off loopback)")
    a.add_argument(
        "--trust-all",
        action="store_true",
        help="Monarch's trust_all_connections: loopback only, authenticated with the runtime directory's key",
    )
    a.add_argument("--lease", type=positive_seconds, help="seconds without any controller before meshes are reaped")
    a.add_argument("--pid", type=int, help="with stop: only this allocator")
    a.add_argument("--announce-dir", help="a job's directory: write this allocator's addresses there (0600) once serving")
    a.add_argument("--announce-name", help="the file name to announce under (default: this host's name)")
    a.add_argument("--exit-on-lease", action="store_true", help="exit after the lease passes with no controller attached")
    a.add_argument(
        "--gateway",
        metavar="127.0.0.1:PORT",
        help="serve a tunnel for a controller outside the cluster (reached by port-forward; loopback only, needs --key-file)",
    )
    a.set_defaults(fn=_allocator)
    s = sub.add_parser("status", help="allocators (this host's and its jobs'), meshes and procs")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_status)
    lg = sub.add_parser("logs", help="a mesh's rank logs on this host (also with no kernel, or its allocator stopped)")
    lg.add_argument("mesh", help="the proc mesh's name, as `monarch-nb status` lists it")
    lg.add_argument("--rank", type=int, help="only this rank")
    lg.add_argument("--tail", type=int, help="the last N lines of each rank")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    lg.set_defaults(fn=_logs)
    sp = sub.add_parser("stop", help="stop a proc mesh of this host's allocators (also one whose kernel is gone)")
    sp.add_argument("name", nargs="?", help="the proc mesh's name, as `monarch-nb status` lists it")
    sp.add_argument("--all", action="store_true", help="every mesh whose controller is gone (with --force: every mesh)")
    sp.add_argument("--force", action="store_true", help="also meshes of a controller that is still running")
    sp.set_defaults(fn=_stop)
    sk = sub.add_parser(
        "stacks", help="every thread's Python stack on a mesh's ranks, merged, as %%mesh stacks (also a hung kernel's mesh)"
    )
    sk.add_argument("mesh", help="the proc mesh's name, as `monarch-nb status` lists it")
    sk.add_argument("--ranks", help="a subset of ranks: 0:4, 0-3, 1,3")
    sk.add_argument("--native", action="store_true", help="add native frames (py-spy dump --native, if installed)")
    sk.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds every rank has to answer (default 5)")
    sk.set_defaults(fn=_stacks)
    k = sub.add_parser("keygen", help="write a new cluster key file")
    k.add_argument("path")
    k.add_argument("--force", action="store_true", help="replace a cluster key already at PATH")
    k.set_defaults(fn=_keygen)
    g = sub.add_parser(
        "gc",
        help="remove old logs of stopped allocators and meshes (log_max_age, log_max_total_bytes) "
        "and old synced code (code_max_age, code_max_total_bytes)",
    )
    g.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    g.set_defaults(fn=_gc)
    ks = sub.add_parser("kernelspec", help="install the 'Python 3 (monarch_nb)' Jupyter kernel")
    ks.add_argument("action", choices=["install"])
    ks.add_argument("--python", default=sys.executable, help="interpreter the kernel runs (default: this one)")
    ks.add_argument("--name", default="monarch-nb", help="kernel name (default: monarch-nb)")
    ks.add_argument("--user", action="store_true", help="install for this user (~/.local/share/jupyter)")
    ks.add_argument("--prefix", help="install under PREFIX/share/jupyter (default: this environment)")
    ks.set_defaults(fn=_kernelspec)
    d = sub.add_parser("debug", help="attach to ranks stopped at breakpoint() (list, attach, cast, continue)")
    d.add_argument("--addr", action="append", help="an allocator address (tcp://HOST:PORT); local ones are found")
    d.add_argument("--key-file", help="cluster key file, for allocators on other hosts")
    d.add_argument("-c", "--command", action="append", help="run this command and exit (repeatable)")
    d.set_defaults(fn=_debug)
    j = sub.add_parser("job", help="apply, list and kill jobs (Slurm, ssh, Kubernetes, local processes)")
    j.add_argument("action", choices=["apply", "status", "kill"])
    j.add_argument("target", nargs="?", help="apply: module.attr of a JobTrait; kill: a job name (default: the current job)")
    j.add_argument("--cached-path", help="apply: where to cache the job (default: the runtime directory)")
    j.add_argument("--json", action="store_true", help="status: JSON rows")
    j.set_defaults(fn=_job)
    args = p.parse_args(argv)
    from .errors import ConfigError

    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:
        # `monarch-nb logs NAME | head`: the reader has what it wanted. Python's traceback, and
        # its second complaint at exit when it flushes stdout again, were all the user saw
        import os
        import signal

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ConfigError as e:
        # a MONARCH_NB_* variable no setting means, a runtime directory refused: every command
        # reads them, and each says which in one line
        print(f"monarch-nb {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
