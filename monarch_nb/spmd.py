"""Helpers for SPMD programs (torch.distributed) inside a proc mesh."""

from __future__ import annotations

import socket
from typing import Any

from .actor import Actor, current_rank, endpoint
from .actor._mesh import ProcMesh

__all__ = ["setup_env_for_distributed", "setup_torch_elastic_env", "setup_torch_elastic_env_async"]


class _EnvSetter(Actor):
    @endpoint
    def free_port(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return socket.gethostbyname(socket.gethostname()), s.getsockname()[1]

    @endpoint
    def ip_addr(self) -> str:
        # the address other hosts reach: the one the default route leaves from
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))
                return str(s.getsockname()[0])
            except OSError:
                return socket.gethostbyname(socket.gethostname())

    @endpoint
    def set_env(self, master_addr: str, master_port: int, local_size: int) -> dict[str, str]:
        import os

        p = current_rank()
        rank, world = p.rank, p.extent.nelements
        env = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % local_size),
            "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(rank // local_size),
            "GROUP_WORLD_SIZE": str(world // local_size),
        }
        os.environ.update(env)
        return env


def setup_env_for_distributed(
    proc_mesh: ProcMesh, master_addr: str | None = None, master_port: int | None = None, use_ipaddr: bool | None = None
) -> Any:
    """Set MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK… in every proc of ``proc_mesh``.

    Rank 0 of the mesh hosts the rendezvous, at its host name's address, or with
    ``use_ipaddr=True`` at the IP address its default route leaves from (for hosts whose names
    do not resolve to a reachable address). Returns an awaitable that is already done, so
    both ``setup_env_for_distributed(pm)`` and ``await setup_env_for_distributed(pm)`` work.
    """
    setter = proc_mesh.spawn(f"_spmd_env_{id(proc_mesh) & 0xFFFFFF:x}", _EnvSetter)
    if master_addr is None or master_port is None:
        first = setter.slice(**{k: 0 for k in setter.extent}) if len(setter.extent) else setter
        addr, port = first.free_port.call_one().get()
        if use_ipaddr and master_addr is None:
            addr = _tcp_host(proc_mesh) or first.ip_addr.call_one().get()
        master_addr = master_addr or addr
        master_port = master_port or port
    hosts_dims = [d for d in proc_mesh.extent if d in ("hosts", "host")]
    local = proc_mesh.size() // (proc_mesh.size(hosts_dims) if hosts_dims else 1)
    setter.set_env.call(master_addr, master_port, local).get()
    setter.stop().get()
    return _Awaitable()


def _tcp_host(proc_mesh: ProcMesh) -> str:
    """The IP address the runtime reaches rank 0 at, when it is a TCP one (procs on other hosts)."""
    addr = proc_mesh._procs[proc_mesh._view.ranks[0]].addr
    if addr.startswith("tcp://"):
        host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host and not host.startswith("127.") and host != "0.0.0.0":
            return host
    return ""


def setup_torch_elastic_env(
    proc_mesh: ProcMesh, master_addr: str | None = None, master_port: int | None = None, use_ipaddr: bool | None = None
) -> None:
    """Monarch's name for :func:`setup_env_for_distributed`: the torchelastic variables
    (``MASTER_ADDR``, ``RANK``, ``LOCAL_RANK``…) in every proc, so that
    ``torch.distributed.init_process_group()`` with no arguments works there."""
    setup_env_for_distributed(proc_mesh, master_addr, master_port, use_ipaddr)


async def setup_torch_elastic_env_async(
    proc_mesh: ProcMesh, master_addr: str | None = None, master_port: int | None = None, use_ipaddr: bool | None = None
) -> None:
    """:func:`setup_torch_elastic_env` for an ``async`` cell: the calls run on a worker thread."""
    import asyncio

    await asyncio.get_running_loop().run_in_executor(
        None, setup_env_for_distributed, proc_mesh, master_addr, master_port, use_ipaddr
    )


class _Awaitable:
    def __await__(self) -> Any:
        if False:
            yield
        return None
