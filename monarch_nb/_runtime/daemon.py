"""Serving as this host's allocator in the foreground: what ``monarch-nb allocator`` runs."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal

from .._wire.keys import read_key_file
from ..config import get_config, runtime_dir
from ..errors import ConfigError
from .allocator import Allocator
from .transport import LOCAL_KEY_FILE, Security, is_wildcard, route_ip, split_tcp, worker_address

__all__ = ["check_bind", "run_allocator"]


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

    ``bind`` is ``tcp://IP:PORT`` for a multi-host allocator (ipc is always served too), or
    ``ipc://PATH``: a socket file served besides the one in the runtime directory (Monarch's
    worker loop address; a relative PATH is against the working directory);
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
    key = read_key_file(key_file) if key_file else None
    security = Security(key, trust_all)
    bind, advertise = check_bind(bind, key)
    tcp_ip = None
    port = 0
    extra_ipc = ""
    if bind and bind.startswith("ipc://"):
        extra_ipc = bind
    elif bind:
        tcp_ip, port = split_tcp(bind)
    if gateway and (key is None or not tcp_ip):
        raise ValueError("--gateway needs --key-file and a --bind address (what the job's hosts reach this one at)")
    # read before the allocator serves: a gateway it cannot open killed it after `allocator start`
    # had reported it running
    gw_listen = gateway_listen(gateway) if gateway else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # a daemon that crashes leaves every thread's Python stack in its log, not only an exit code
    faulthandler.enable()
    alloc = Allocator(cfg, security, runtime_dir(cfg), tcp_ip=tcp_ip, tcp_port=port)
    alloc.exit_on_lease = exit_on_lease
    if advertise:
        # peers dial the advertised address; procs still bind where the allocator does
        alloc.rt.transport.advertise = advertise
    alloc.rt.transport.extra_ipc = extra_ipc
    alloc.start(key_file or "")
    if bind and key is None:
        logging.getLogger(__name__).info(
            "TCP at %s is authenticated with this runtime directory's key %s: only processes of this user "
            "sharing MONARCH_NB_RUNTIME_DIR can connect (others need a cluster key: --key-file)",
            alloc.rt.tcp_addr,
            os.path.join(alloc.runtime_dir, LOCAL_KEY_FILE),
        )
    if gw_listen and key is not None:
        from .gateway import GatewayServer

        # the reverse listener binds the address the allocator serves at (a wildcard resolved)
        srv = GatewayServer(gw_listen, split_tcp(alloc.rt.tcp_addr)[0], key)
        logging.getLogger(__name__).info("gateway for controllers outside the cluster at %s:%d", *srv.addr[:2])
    signal.signal(
        signal.SIGTERM,
        lambda *_: alloc.rt.loop.call_soon_threadsafe(
            alloc.stop, "SIGTERM: from `monarch-nb allocator stop`, stop_allocator(), a scheduler ending the job, or the system"
        ),
    )
    if announce_dir:
        from .records import announce

        announce(announce_dir, announce_name or "", alloc)
    alloc.serve_forever()


def gateway_listen(gateway: str) -> tuple[str, int]:
    """(IP, port) of ``--gateway [127.0.0.1:]PORT``, or a ValueError saying what it takes."""
    import ipaddress

    host, _, port = gateway.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not (port.isdigit() and int(port) < 65536 and loopback):
        raise ValueError(
            f"--gateway {gateway!r}: expected 127.0.0.1:PORT (a loopback IP and a port up to 65535), "
            "where a port-forward reaches this host"
        )
    return host, int(port)


def check_bind(bind: str | None, key: bytes | None) -> tuple[str | None, str]:
    """(where to bind, the address to advertise or "") for ``--bind`` in any of Monarch's forms
    (``[proc-id@]tcp://advertised:port[@tcp://bind-ip:port]``) or ``tcp://route:PEER:PORT``;
    refuses (``ConfigError``) TCP that no key would authenticate: a wildcard or off-loopback
    address without a cluster key, whatever ``trust_all`` says."""
    if not bind:
        return bind, ""
    advertise = ""
    if not bind.startswith("tcp://route:"):
        advertise, bind = worker_address(bind)
        if advertise == bind:
            advertise = ""
        elif advertise.startswith("tcp://"):
            split_tcp(advertise)  # peers dial it: a port past 65535 is refused here, not by each of them
        if bind.startswith("ipc://"):
            # served besides the runtime directory's socket, as Monarch's worker loop serves it
            return bind, ""
    else:
        import socket as _socket

        peer, _, port_s = bind[len("tcp://route:") :].rpartition(":")
        bind = f"tcp://{route_ip(_socket.gethostbyname(peer.strip('[]')))}:{port_s}"
    tcp_ip, port = split_tcp(bind)
    if key is None and is_wildcard(tcp_ip):
        raise ConfigError(
            f"refusing unauthenticated TCP on every interface ({bind}): a wildcard bind serves other hosts, "
            "and off loopback every connection is authenticated with a cluster key. Make one with "
            "`monarch-nb keygen KEYFILE`, copy it to every host and pass it (--key-file KEYFILE, ca=KEYFILE, "
            "MONARCH_NB_KEY_FILE=KEYFILE), or bind loopback (tcp://127.0.0.1:PORT); "
            "ca='trust_all_connections' / --trust-all only serve loopback"
        )
    security = Security(key)
    security.check_address(f"tcp://{route_ip('10.255.255.255') if is_wildcard(tcp_ip) else tcp_ip}:{port}")
    if advertise:
        security.check_address(advertise)
    return bind, advertise
