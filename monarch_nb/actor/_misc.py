"""The rest of ``monarch.actor``'s surface: context, transports, worker loops, tracing hooks."""

from __future__ import annotations

import enum
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _context
from ._future import Future
from ._shape import Point

logger = logging.getLogger(__name__)


class Context:
    """Who is running: ``context().actor_instance`` and ``context().message_rank``."""

    @property
    def actor_instance(self) -> Any:
        inst = _context.current_instance()
        if inst is not None:
            return inst
        return _ClientInstance()

    @property
    def message_rank(self) -> Point:
        return _context.current_message_rank()


class _ClientInstance:
    """The root "actor" of a controller or of a proc outside any actor: Monarch's ``<root>``."""

    name = "root"
    class_name = None
    creator = None

    def __repr__(self) -> str:
        return "<root>"

    @property
    def rank(self) -> Point:
        return _context.proc_point()

    @property
    def actor_id(self) -> str:
        rt = _context.runtime()
        return f"client@{rt.label}@{rt.hostname}:{rt.pid}"

    @property
    def proc_id(self) -> str:
        rt = _context.runtime()
        return f"{rt.label}@{rt.hostname}:{rt.pid}"

    @property
    def proc(self) -> Any:
        from ._mesh import this_proc

        return this_proc()

    proc_mesh = proc


def context() -> Context:
    return Context()


def current_rank() -> Point:
    """This message's position in the mesh (or slice) it was sent to; ``{}`` on the client."""
    return _context.current_message_rank()


def current_size() -> dict[str, int]:
    return dict(_context.current_message_rank().extent)


def current_actor_name() -> str:
    return str(context().actor_instance.actor_id)


class ChannelTransport(enum.Enum):
    TcpWithLocalhost = "tcp(localhost)"
    TcpWithHostname = "tcp(hostname)"
    MetaTlsWithHostname = "metatls(hostname)"
    MetaTlsWithIpV6 = "metatls(ipv6)"
    Tls = "tls"
    Local = "local"
    Unix = "unix"


_transport = ChannelTransport.Unix


def enable_transport(transport: ChannelTransport | str) -> None:
    """Choose the default transport. monarch_nb uses ipc on one host and CurveZMQ TCP across hosts
    automatically; TLS transports are not provided (use a cluster key file instead)."""
    global _transport
    if isinstance(transport, str):
        table = {"tcp": ChannelTransport.TcpWithHostname, "ipc": ChannelTransport.Unix}
        if transport in table:
            transport = table[transport]
        elif transport.startswith("tcp://"):
            transport = ChannelTransport.TcpWithHostname
        else:
            raise NotImplementedError(f"transport {transport!r} is not supported by monarch_nb (use 'tcp' or 'ipc')")
    if transport in (ChannelTransport.MetaTlsWithHostname, ChannelTransport.MetaTlsWithIpV6, ChannelTransport.Tls):
        raise NotImplementedError(f"{transport} is not supported; monarch_nb secures TCP with CurveZMQ and a cluster key")
    _transport = transport


@dataclass
class Uid:
    label: str = ""
    value: str = field(default_factory=lambda: secrets.token_hex(6))

    @staticmethod
    def anonymous() -> Uid:
        return Uid()

    @staticmethod
    def instance(label: str | None = None) -> Uid:
        return Uid(label or "")

    @staticmethod
    def from_string(uid: str) -> Uid:
        label, _, value = uid.rpartition("<")
        return Uid(label, value.rstrip(">"))

    def __str__(self) -> str:
        return f"{self.label}<{self.value}>"


@dataclass(frozen=True)
class ProcId:
    uid: Uid

    @property
    def label(self) -> str:
        return self.uid.label

    @staticmethod
    def from_string(proc_id: str) -> ProcId:
        return ProcId(Uid.from_string(proc_id))

    def __str__(self) -> str:
        return str(self.uid)


class BootstrapCommand:
    """How a proc is started when it must be exec'd rather than forked from the zygote
    (Monarch's signature). ``env`` is applied on top of the host's environment when
    ``inherit_env`` (the default), else on top of an empty one; a ``None`` value removes a
    variable."""

    def __init__(
        self,
        program: str,
        arg0: str | None,
        args: list[str],
        env: Mapping[str, str | None] | None = None,
        inherit_env: bool = True,
    ) -> None:
        self.exe = program
        self.argv0 = arg0
        self.args = list(args)
        self.env: dict[str, str | None] = dict(env or {})
        self.inherit_env = inherit_env

    @property
    def program(self) -> str:
        return self.exe

    def with_env(self, env: Mapping[str, str | None] | None = None, **more: str | None) -> BootstrapCommand:
        """A copy with ``env`` (and keyword variables) merged on top; ``None`` removes a variable."""
        return BootstrapCommand(self.exe, self.argv0, self.args, {**self.env, **(env or {}), **more}, self.inherit_env)

    def argv(self) -> list[str]:
        return [self.exe, *self.args]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BootstrapCommand) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return (
            f"BootstrapCommand(program={self.exe!r}, arg0={self.argv0!r}, args={self.args!r}, env={self.env!r}, "
            f"inherit_env={self.inherit_env})"
        )


def default_bootstrap_cmd() -> BootstrapCommand:
    """The exec'd alternative to a zygote fork: this interpreter running the proc bootstrap."""
    return BootstrapCommand(sys.executable, None, ["-m", "monarch_nb.actor._bootstrap"], {})


def debug_controller() -> Any:
    raise NotImplementedError(
        "monarch_nb has no debug controller actor: use monarch_nb.debug (sessions, attach, cast, continue_all), "
        "`%mesh debug` in a notebook, or `monarch-nb debug` in a terminal"
    )


def attach(addr: str) -> None:
    """Monarch reaches meshes through a gateway; here every process talks to allocators directly,
    so attaching means connecting to the allocator at ``addr``."""
    _context.client().connect(addr)


def shutdown_context(host_timeout: float | None = None) -> Future[None]:
    """Detach this client from its allocators (a script's meshes stop)."""
    if _context._client is not None:
        _context._client.shutdown()
    return Future._completed(None)


def _run_allocator(address: str, ca: Any, private_key: Any, forever: bool) -> None:
    from .._runtime.daemon import run_allocator

    key_file = ca if isinstance(ca, (str, os.PathLike)) and ca != "trust_all_connections" else None
    run_allocator(bind=address, key_file=os.fspath(key_file) if key_file else None, trust_all=ca == "trust_all_connections")


def run_worker_loop_forever(*, ca: Any, address: str, private_key: Any = None) -> None:
    """Serve as a worker host (an allocator) at ``address`` until killed."""
    _run_allocator(address, ca, private_key, True)


def run_worker_loop_until_shutdown(*, ca: Any, address: str, private_key: Any = None) -> None:
    """Serve as a worker host at ``address`` until a controller shuts it down."""
    _run_allocator(address, ca, private_key, False)


def start_worker_loop_forever(*, ca: Any, address: str, private_key: Any = None) -> Future[None]:
    """Start a worker host (allocator daemon) in the background; the future completes once it serves."""
    import subprocess

    from .._runtime.daemon import check_bind
    from .._wire.keys import read_key_file

    key_file = ca if isinstance(ca, (str, os.PathLike)) and ca != "trust_all_connections" else None
    # refused here, where the caller sees it, rather than in the background process
    check_bind(address, read_key_file(os.fspath(key_file)) if key_file else None)
    argv = [sys.executable, "-m", "monarch_nb", "allocator", "--bind", address]
    if key_file:
        argv += ["--key-file", os.fspath(key_file)]
    elif ca == "trust_all_connections":
        argv += ["--trust-all"]
    subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    return Future._completed(None)


class _Config:
    prefix_python_logs_with_actor = True

    def __reduce__(self) -> str:
        # by reference, as Monarch's config module is: an actor setting it sets its own process's
        return "config"


config = _Config()
