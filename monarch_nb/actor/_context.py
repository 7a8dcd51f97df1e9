"""Process-wide state: this process's runtime, its client, and the current actor context."""

from __future__ import annotations

import contextvars
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from .._runtime.runtime import Runtime
from .._runtime.transport import Security
from .._wire.keys import read_key_file
from ..config import Config, get_config, runtime_dir
from ._shape import Extent, Point

if TYPE_CHECKING:
    from ._actor import Instance
    from ._client import Client

_lock = threading.RLock()
_runtime: Runtime | None = None
_client: Client | None = None
#: set in procs by the bootstrap: mesh, rank, extent, allocator address, host
proc_spec: dict[str, Any] | None = None

_message_rank: contextvars.ContextVar[Point | None] = contextvars.ContextVar("monarch_nb_message_rank", default=None)
_instance: contextvars.ContextVar[Instance | None] = contextvars.ContextVar("monarch_nb_instance", default=None)

_EMPTY = Extent([], [])


def _default_security(cfg: Config) -> Security:
    path = os.environ.get("MONARCH_NB_KEY_FILE", "")
    return Security(read_key_file(path) if path else None)


def runtime() -> Runtime:
    """This process's runtime, started on first use (controllers start theirs lazily)."""
    global _runtime
    if _runtime is None:
        with _lock:
            if _runtime is None:
                cfg = get_config()
                _runtime = Runtime(cfg, _default_security(cfg), runtime_dir(cfg), label="controller").start()
    return _runtime


def install_runtime(rt: Runtime, spec: dict[str, Any] | None = None) -> None:
    """Used by a proc's bootstrap: the runtime is made from the allocator's spec."""
    global _runtime, proc_spec
    _runtime = rt
    proc_spec = spec


def client() -> Client:
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                from . import _logprefix
                from ._client import Client

                _client = Client(runtime())
                _logprefix.install(proc_spec is None)
    return _client


def controller_client() -> Client:
    """This process's client of its allocators (created on first use), for frontends.

    Its ``cid`` names this controller to allocators; ``request(addr, method, ...)`` and
    ``tell`` make system requests; a frontend routes output through ``log_writer`` (replaces
    the default printer), ``log_taps`` (extra readers), ``on_call`` (told of every call with
    its targets), ``notice`` (shows runtime notices) and ``on_raise`` (told of errors raised
    into code reading a future). A script never needs it.
    """
    return client()


def in_ipython_kernel() -> bool:
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except Exception:
        return False
    return shell is not None and "ipykernel" in sys.modules


def kernel_session() -> str:
    """The connection file of the Jupyter kernel this process is ("" in none): a restart of
    the kernel keeps it, so the allocators tell a restarted kernel from another one."""
    if not in_ipython_kernel():
        return ""
    try:
        from ipykernel.connect import get_connection_file

        return str(get_connection_file())
    except Exception:  # an embedded kernel without a connection file
        return ""


def proc_point() -> Point:
    """Where this process sits in its proc mesh ({} in a controller)."""
    if proc_spec is None:
        return Point(0, _EMPTY)
    labels, sizes = proc_spec["extent"]
    return Point(proc_spec["rank"], Extent(labels, sizes))


def current_message_rank() -> Point:
    p = _message_rank.get()
    return p if p is not None else proc_point()


def current_instance() -> Instance | None:
    return _instance.get()


class CreatorInstance:
    """Who spawned an actor: ``context().actor_instance.creator``, as in Monarch.

    A picklable summary of the spawning actor (or ``<root>``, the controller), linked to its
    own creator; its repr is the chain of names, e.g. ``<root>.<__main__.Trainer trainers{'gpus': 0/2}>``.
    """

    __slots__ = ("rank", "name", "class_name", "creator")

    def __init__(self, rank: Point, name: str, class_name: str | None, creator: CreatorInstance | None) -> None:
        self.rank = rank
        self.name = name
        self.class_name = class_name
        self.creator = creator

    def __repr__(self) -> str:
        return qualified_name(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CreatorInstance, (self.rank, self.name, self.class_name, self.creator))


def qualified_name(ins: Any) -> str:
    """Monarch's name of an actor instance: its creators' names and its own, outermost first."""
    names = []
    while ins is not None:
        prefix = "" if ins.class_name is None else f"{ins.class_name} "
        suffix = repr(ins.rank) if len(ins.rank) > 0 else ""
        names.append(f"<{prefix}{ins.name}{suffix}>")
        ins = ins.creator
    return ".".join(reversed(names))


ROOT = CreatorInstance(Point(0, _EMPTY), "root", None, None)


def lineage() -> tuple[CreatorInstance, Any]:
    """What an actor spawned from here inherits: its creator, and the proc that holds the
    job's controllers (``get_or_spawn_controller``), the root controller's own process."""
    inst = current_instance()
    if inst is not None:
        me = CreatorInstance(inst.rank, inst.name, inst.class_name, inst.creator)
        return me, inst._controllers or controllers_proc()
    # the controller, or a proc's own code outside any actor (a %%mesh exec cell), roots a tree
    return ROOT, controllers_proc()


def controllers_proc() -> Any:
    """This process as a ProcRef that the actors it spawns (and theirs) send controller requests to."""
    from ._mesh import this_proc

    me = this_proc()._procs[0]
    addr = reachable_addr(runtime())
    return me._replace(addr=addr) if addr else me


#: the peer a message being pickled here goes to; set only while this process reaches some
#: hosts through a gateway (see :func:`reachable_addr`), so other processes never pay for it
_pickling_for: contextvars.ContextVar[str] = contextvars.ContextVar("monarch_nb_pickling_for", default="")


def reachable_addr(rt: Runtime) -> str:
    """Our inbox as a message's recipient on another host must see it ("" without a TCP inbox).

    A Port or controller reference travels in a message's arguments; once this process has a
    TCP inbox, procs on other hosts reach it there, except hosts behind a gateway (a notebook
    outside Kubernetes): they reach it through the gateway's reply address. Procs of this host
    reach our unix socket: the procs of a trust-all allocator hold no cluster key and could not
    pass the TCP inbox's handshake."""
    peer = _pickling_for.get()
    if peer.startswith("ipc://") or (peer.startswith("tcp://") and rt.transport.sockets.routes):
        return rt.addr_for(peer)
    return rt.tcp_addr


def addresses_vary(rt: Runtime) -> bool:
    """Whether peers may reach this process at different addresses (it has a TCP inbox or a
    gateway route): only then do pickled addresses of ours depend on the recipient."""
    return bool(rt.transport.tcp_addr or rt.transport.sockets.routes)


class pickling_for:
    """``with pickling_for(rt, peer):`` the addresses pickled inside are the ones ``peer``
    reaches (a no-op until this process has a TCP inbox or a gateway route: before, the one
    address it has is the one every peer reaches)."""

    __slots__ = ("_token", "_peer", "_on")

    def __init__(self, rt: Runtime, peer: str) -> None:
        self._peer = peer
        self._on = addresses_vary(rt)

    def __enter__(self) -> None:
        if self._on:
            self._token = _pickling_for.set(self._peer)

    def __exit__(self, *exc: object) -> None:
        if self._on:
            _pickling_for.reset(self._token)
