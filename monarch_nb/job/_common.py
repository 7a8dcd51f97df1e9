"""What the launchers share: the configuration allocators inherit, waiting for announcements,
stopping local daemons by pid, hostlists."""

from __future__ import annotations

import os
import re
import shlex
import socket
import time
from collections.abc import Callable
from typing import Any

from .._runtime import records
from .._runtime._pids import pid_is, terminate
from .._runtime.transport import split_tcp
from ..actor import HostMesh, attach_to_workers
from ._job import JobError

#: settings that belong to the controller's host, not to an allocator elsewhere
_NOT_FORWARDED = {"MONARCH_NB_RUNTIME_DIR", "MONARCH_NB_KEY_FILE", "MONARCH_NB_TEST_SESSION_DIR"}


def forwarded_config() -> dict[str, str]:
    """The controller's ``MONARCH_NB_*`` settings, for the allocators a job starts (heartbeats,
    lease, zygote preload...): a job behaves as the controller was configured."""
    return {k: v for k, v in os.environ.items() if k.startswith("MONARCH_NB_") and k not in _NOT_FORWARDED}


def mesh_size(job: str, name: str, n: Any, unit: str = "hosts") -> int:
    """A mesh's size as the job was given it: a positive int, or an error saying so (at the
    constructor, not as a scheduler's refusal or a TypeError at ``apply()``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{job}: mesh {name!r} needs a positive number of {unit}, got {n!r}")
    return n


def mesh_hosts(job: str, name: str, hosts: Any) -> list[str]:
    """A mesh's host names as the job was given them: a non-empty list of names."""
    if isinstance(hosts, str):
        # list("node1") would be five one-letter hosts
        raise ValueError(f"{job}: mesh {name!r} needs a list of host names, got the string {hosts!r}: write [{hosts!r}]")
    out = list(hosts) if isinstance(hosts, (list, tuple)) else None
    if not out or not all(isinstance(h, str) and h for h in out):
        raise ValueError(f"{job}: mesh {name!r} needs a non-empty list of host names, got {hosts!r}")
    twice = sorted({h for h in out if out.count(h) > 1})
    if twice:
        # one allocator serves a host: the mesh would list it twice and its first spawn_procs
        # fail with "a mesh named ... already exists on host"
        raise ValueError(
            f"{job}: mesh {name!r} lists host {', '.join(map(repr, twice))} more than once: a job runs one allocator "
            "per host and a host mesh has one rank per host; for more procs on a host, spawn them per host "
            "(spawn_procs(per_host={'gpus': N}))"
        )
    return out


def command_args(job: str, param: str, args: Any) -> list[str]:
    """Arguments a job hands to a command (ssh's, sbatch's): a list of strings."""
    if isinstance(args, str):
        # list("-p 2222") would be six one-character arguments
        raise ValueError(
            f"{job}({param}=...) takes a list of arguments, got the string {args!r}: write {param}={shlex.split(args)!r}"
        )
    out = list(args) if isinstance(args, (list, tuple)) else None
    if out is None or not all(isinstance(a, str) for a in out):
        raise ValueError(f"{job}({param}=...) takes a list of strings, got {args!r}")
    return out


def port_number(job: str, param: str, port: Any) -> int:
    """A TCP port the job's allocators listen on: 1..65535, or 0 for any free one (a string of
    digits is taken too)."""
    n = int(port) if isinstance(port, str) and port.isdigit() else port
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 65535:
        raise ValueError(f"{job}({param}=...) needs a TCP port number from 1 to 65535 (0: any free one), got {port!r}")
    return n


def python_path(job: str, exe: Any, hint: str = "") -> str:
    """The remote hosts' Python, as a job was given it: a non-empty string."""
    if not isinstance(exe, (str, os.PathLike)) or not str(exe):
        raise ValueError(f"{job}(python_exe=...) is the Python to run on the hosts, a path, got {exe!r}{hint}")
    return os.fspath(exe)


def wait_announced(
    directory: str,
    names: set[str] | int,
    timeout: float,
    check: Callable[[], str | None] | None = None,
    what: str = "allocator",
) -> dict[str, dict[str, Any]]:
    """Wait until every allocator in ``names`` (or that many) announced itself in ``directory``.

    ``check`` returns an error text when waiting is pointless (a process died, the job ended).
    """
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        got = records.read_announcements(directory)
        done = len(got) >= names if isinstance(names, int) else set(names) <= set(got)
        if done:
            return got
        if check is not None:
            err = check()
            if err:
                raise JobError(err)
        if time.monotonic() > deadline:
            if isinstance(names, int):
                missing = f"{names - len(got)} of {names}"
            else:
                missing = ", ".join(sorted(set(names) - set(got)))
            raise JobError(f"{what}(s) {missing} did not announce themselves within {timeout:.0f} s")
        time.sleep(delay)  # polling files the allocators write; there is no event to wait on
        delay = min(delay * 1.5, 0.25)


def listening(addr: str, timeout: float = 3.0) -> bool:
    """Does something accept TCP connections at ``addr`` (an allocator's port, ``tcp://h:p``)?"""
    try:
        host, port = split_tcp(addr)
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def answering(addrs: list[str], key_file: str, timeout: float = 1.0) -> set[str]:
    """Which of ``addrs`` (allocators' ``tcp://h:p``) complete a CurveZMQ handshake with the key
    in ``key_file`` within ``timeout``: all probed at once, and quietly (a bare TCP probe is
    logged by the allocator as a failed handshake, on every poll of a job table)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from .._wire.keys import curve_keypair, read_key_file

    if not addrs:
        return set()
    try:
        public, secret = curve_keypair(read_key_file(key_file))
    except Exception:  # no key (a job being killed): nothing can be asked
        return set()
    ctx = zmq.Context()
    socks, mons = [], {}
    try:
        for a in addrs:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = public, public, secret
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            s.connect(a)
            socks.append(s)
            mons[mon] = a
        ok: set[str] = set()
        poller = zmq.Poller()
        for mon in mons:
            poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while len(ok) < len(addrs) and (left := deadline - time.monotonic()) > 0:
            for mon, _ in poller.poll(int(left * 1000) + 1):
                recv_monitor_message(mon)
                ok.add(mons[mon])
                poller.unregister(mon)
        return ok
    finally:
        for s in socks:
            s.disable_monitor()
        for mon in mons:
            mon.close(0)
        for s in socks:
            s.close(0)
        ctx.term()


def stop_pids(pids: list[int], marker: str, timeout: float = 15.0) -> list[int]:
    """SIGTERM our daemons (checked by ``marker``), SIGKILL what is left at ``timeout``; returns
    the pids that were still alive afterwards."""
    from ._job import _children

    live = [p for p in pids if pid_is(p, marker)]
    return terminate(live, timeout, reap=lambda: [c.poll() for c in _children])


def host_meshes(meshes: dict[str, list[str]], key_file: str | None = None) -> dict[str, HostMesh]:
    """One ``{hosts: N}`` mesh per name over allocators at the given addresses."""
    out = {}
    for name, addrs in meshes.items():
        if key_file:
            out[name] = attach_to_workers(workers=addrs, name=name, key_file=key_file)
        else:
            out[name] = attach_to_workers(workers=addrs, name=name)
    return out


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's hostlist expression (``h[1-3,5],gpu[01-02]-ib,x``) as host names, in order."""
    out: list[str] = []
    for part in _split_top(expr):
        out.extend(_expand_one(part))
    return out


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur:
                parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if m is None:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    names: list[str] = []
    for rng in m.group(1).split(","):
        r = _RANGE.match(rng.strip())
        if r is None:
            raise ValueError(f"bad hostlist range {rng!r} in {part!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        width = len(lo) if lo.startswith("0") else 0
        for i in range(int(lo), int(hi) + 1):
            names.extend(f"{head}{str(i).zfill(width)}{t}" for t in _expand_one(tail))
    return names


def held_key() -> bytes | None:
    """The cluster key this process already holds (an earlier job's), or None.

    One process holds one cluster key: a job applied after another in the same kernel (the
    first one ended, was killed, or still runs) gets the key already held, or attaching to it
    would fail with "this process already uses another cluster key", its allocation left running.
    """
    from ..actor import _context

    client = _context._client
    return client.rt.sockets.security.key if client is not None else None


def forget_hosts(addrs: list[str]) -> None:
    """This controller stops watching allocators its job is about to stop: what is still pending
    on them fails at once, and no "allocator lost" alarm follows a deliberate kill()."""
    from ..actor import _context

    client = _context._client
    if client is not None:
        client.forget_allocators(addrs, "allocator {addr} stopped: its job was killed (mesh stopped)")
