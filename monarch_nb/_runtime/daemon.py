"""Serving as this host's allocator in the foreground: what ``monarch-nb allocator`` runs."""

from __future__ import annotations

import logging
import os
import signal

from .._wire.keys import read_key_file
from ..config import get_config, runtime_dir
from .allocator import Allocator
from .transport import LOCAL_KEY_FILE, Security, route_ip, split_tcp

__all__ = ["run_allocator"]


def run_allocator(
    *,
    bind: str | None = None,
    key_file: str | None = None,
    trust_all: bool = False,
    lease: float | None = None,
    announce_dir: str | None = None,
    announce_name: str | None = None,
    exit_on_lease: bool = False,
    gateway: str | None = None,
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
    ``gateway``: ``127.0.0.1:PORT``, where a controller outside the cluster's network opens its
    one tunnel (a port-forward) to reach this job's allocators (see gateway.py).
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
    if gateway and (key is None or not tcp_ip):
        raise ValueError("--gateway needs --key-file and a --bind address (what the job's hosts reach this one at)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    alloc = Allocator(cfg, security, runtime_dir(cfg), tcp_ip=tcp_ip, tcp_port=port)
    alloc.exit_on_lease = exit_on_lease
    alloc.start(key_file or "")
    if bind and key is None:
        logging.getLogger(__name__).info(
            "TCP at %s is authenticated with this runtime directory's key %s: only processes of this user "
            "sharing MONARCH_NB_RUNTIME_DIR can connect (others need a cluster key: --key-file)",
            alloc.rt.tcp_addr,
            os.path.join(alloc.runtime_dir, LOCAL_KEY_FILE),
        )
    if gateway and key is not None:
        from .gateway import GatewayServer

        gw_host, _, gw_port = gateway.rpartition(":")
        # the reverse listener binds the address the allocator serves at (a wildcard resolved)
        srv = GatewayServer((gw_host or "127.0.0.1", int(gw_port)), split_tcp(alloc.rt.tcp_addr)[0], key)
        logging.getLogger(__name__).info("gateway for controllers outside the cluster at %s:%d", *srv.addr[:2])
    signal.signal(signal.SIGTERM, lambda *_: alloc.rt.loop.call_soon_threadsafe(alloc.stopped.set))
    if announce_dir:
        from .records import announce

        announce(announce_dir, announce_name or "", alloc)
    alloc.serve_forever()
