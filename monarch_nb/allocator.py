"""Run, find and stop allocator daemons (public; the CLI is a thin layer over this)."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from ._runtime.allocator import Allocator
from ._runtime.transport import Security, route_ip, split_tcp
from ._wire.keys import read_key_file
from .actor._client import find_local_allocator, read_connection_files, start_local_allocator
from .config import get_config, runtime_dir


def run_allocator(
    *,
    bind: str | None = None,
    key_file: str | None = None,
    trust_all: bool = False,
    lease: float | None = None,
    announce_dir: str | None = None,
    announce_name: str | None = None,
    exit_on_lease: bool = False,
) -> None:
    """Serve as this host's allocator in the foreground until shut down.

    ``bind`` is ``tcp://IP:PORT`` for a multi-host allocator (ipc is always served too);
    TCP off loopback needs ``key_file`` (a cluster key, see ``monarch-nb keygen``).
    ``bind`` may also be ``tcp://route:PEER:PORT``: the address this host uses to reach PEER
    (the controller), which is the one address of a multi-homed node the controller can reach.
    ``announce_dir``: a job launcher's directory; once serving, the allocator writes its
    addresses there (``<announce_name>.json``, 0600), so nobody scrapes scheduler output.
    ``exit_on_lease``: a job's allocator exits (not only reaps its meshes) after the lease
    passes with no controller attached.
    """
    cfg = get_config()
    if lease is not None:
        cfg = cfg.replace(lease=lease)
    if bind and bind.startswith("tcp://route:"):
        import socket as _socket

        peer, _, port_s = bind[len("tcp://route:") :].rpartition(":")
        bind = f"tcp://{route_ip(_socket.gethostbyname(peer.strip('[]')))}:{port_s}"
    key = read_key_file(key_file) if key_file else None
    security = Security(key, trust_all)
    tcp_ip = None
    port = 0
    if bind:
        if not bind.startswith("tcp://"):
            raise ValueError(f"--bind takes tcp://IP:PORT, got {bind!r}")
        tcp_ip, port = split_tcp(bind)
        security.check_address(f"tcp://{route_ip('10.255.255.255') if tcp_ip in ('0.0.0.0', '*') else tcp_ip}:{port}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    alloc = Allocator(cfg, security, runtime_dir(cfg), tcp_ip=tcp_ip, tcp_port=port)
    alloc.exit_on_lease = exit_on_lease
    alloc.start(key_file or "")
    signal.signal(signal.SIGTERM, lambda *_: alloc.rt.loop.call_soon_threadsafe(alloc.stopped.set))
    if announce_dir:
        from ._runtime._jobrecords import announce

        announce(announce_dir, announce_name or "", alloc)
    alloc.serve_forever()


def list_allocators() -> list[dict[str, Any]]:
    """Connection files in the runtime directory, with whether their daemon is alive."""
    out = []
    for info in read_connection_files(runtime_dir()):
        try:
            os.kill(int(info["pid"]), 0)
            info["alive"] = True
        except (ProcessLookupError, ValueError):
            info["alive"] = False
        except PermissionError:
            info["alive"] = True
        out.append(info)
    return out


def start_allocator(extra_args: list[str] | None = None) -> dict[str, Any]:
    """Start this host's allocator detached (or return the one already running)."""
    rdir = runtime_dir()
    return find_local_allocator(rdir) or start_local_allocator(rdir, extra_args=extra_args)


def stop_allocator(pid: int | None = None, timeout: float = 15.0) -> list[int]:
    """Stop allocator daemons (all on this host, or the one with ``pid``); returns the pids stopped."""
    import socket

    stopped = []
    for info in list_allocators():
        if info.get("host") != socket.gethostname() or (pid is not None and int(info["pid"]) != pid):
            continue
        p = int(info["pid"])
        if info["alive"]:
            os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    os.kill(p, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)  # waiting for another process to exit; no event to wait on
            else:
                os.kill(p, signal.SIGKILL)
        try:
            os.unlink(info["file"])
        except OSError:
            pass
        stopped.append(p)
    return stopped


def stop_mesh(
    name: str,
    addr: str | None = None,
    *,
    force: bool = True,
    reason: str = "stopped from outside its controller",
    timeout: float = 15.0,
) -> int:
    """Stop the mesh ``name`` on the allocator at ``addr`` (default: every known allocator that has it).

    This is for tools that do not own the mesh (a CLI, the JupyterLab sidebar): with ``force``
    it stops a mesh even while its owning controller is attached; without, an attached owner's
    mesh is refused with ``PermissionError``. Returns the number of procs that were stopped.
    """
    from .actor import _context
    from .errors import MeshError
    from .introspect import status

    if addr is None:
        addrs = [a["addr"] for a in status()["allocators"] if any(m["name"] == name for m in a.get("meshes", []))]
        if not addrs:
            raise MeshError(f"no mesh named {name!r} on any known allocator")
    else:
        addrs = [addr]
    client = _context.client()
    # an empty cid skips the owner check on the allocator; our own cid is never an owner, so it triggers it
    cid = "" if force else client.cid
    futs = [client.request(a, "stop_mesh", name, cid, force, reason) for a in addrs]
    return sum(int(f.get(timeout=timeout) or 0) for f in futs)
