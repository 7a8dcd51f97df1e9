"""Plain, picklable references to hosts and procs: what meshes are made of."""

from __future__ import annotations

from typing import NamedTuple


class HostRef(NamedTuple):
    #: the allocator's address as this cluster reaches it (ipc on one host, tcp across hosts)
    alloc: str
    host: str


class ProcRef(NamedTuple):
    addr: str
    #: the allocator that owns the proc, or "" for a controller's own process
    alloc: str
    host: str
    pid: int
    mesh: str
    rank: int
