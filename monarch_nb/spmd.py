"""SPMD programs (torch.distributed, torchrun-style scripts) inside a proc mesh.

:class:`SPMDActor` is Monarch's: each proc of a mesh gets torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…) and can run a training script or module as
``torchrun`` would (``main``). :func:`setup_torch_elastic_env` sets the variables only, for
code that then calls ``torch.distributed.init_process_group()`` itself.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from .actor import Actor, current_rank, endpoint
from .actor._mesh import ProcMesh
from .actor._reload import modules_under
from .errors import PEER_GONE_MARK, peer_gone

__all__ = ["SPMDActor", "setup_env_for_distributed", "setup_torch_elastic_env", "setup_torch_elastic_env_async"]

#: the dimensions that count hosts: never a host's local one
_HOST_DIMS = ("hosts", "host")
#: the dimensions that count a host's devices: the allocator gives each proc the device of its
#: coordinate there (``CUDA_VISIBLE_DEVICES``)
_DEVICE_DIMS = ("gpus", "gpu")


def _place() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) of this actor in the mesh it was
    spawned on. The local dimension is the devices' (``gpus``) where the mesh has one, else its
    last, as Monarch 0.7.0's ``SPMDActor`` takes it (on ``{"replicas": 2, "gpus": 4}`` the
    ``gpus`` coordinate, so ``torch.cuda.set_device(LOCAL_RANK)`` picks the device the allocator
    gave the proc); a last dimension that counts hosts is not local (one proc per host: 0.7.0
    makes ``{"hosts": 2}`` two local ranks of one host). Read at construction: in an endpoint,
    ``current_rank()`` is the rank in the slice the call was sent to."""
    p = current_rank()
    labels = list(p.extent.labels)
    local = next((label for label in labels if label in _DEVICE_DIMS), labels[-1] if labels else None)
    if local is None or local in _HOST_DIMS:
        return p.rank, p.extent.nelements, 0, 1
    return p.rank, p.extent.nelements, p[local], p.size(local)


def _torchrun_env(place: tuple[int, int, int, int], master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for the proc at ``place`` (see :func:`_place`)."""
    rank, world, local_rank, per_host = place
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_host),
        "GROUP_RANK": str(rank // per_host),
        "GROUP_WORLD_SIZE": str(-(-world // per_host)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "rank",
    }


def _torchrun_devices(local_rank: int, script: bool) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` as a torchrun script expects it: every GPU the allocator shares out
    on this host (``MONARCH_NB_HOST_GPUS``), so that ``torch.cuda.set_device(LOCAL_RANK)``
    finds this proc's device. The allocator gave the proc its own device alone; CUDA reads the
    variable once, when it starts, so it can be widened only while the proc has not used CUDA;
    a ``script`` whose ``LOCAL_RANK`` is then out of sight is warned (the tensor engine, also set
    up through here, takes ``LOCAL_RANK`` modulo the devices it sees)."""
    devices = os.environ.get("MONARCH_NB_HOST_GPUS", "")
    if not devices:
        return {}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        seen = torch.cuda.device_count()
        if script and local_rank >= seen:
            warnings.warn(
                f"CUDA started in this proc before torch.distributed's variables were set (an earlier "
                f"actor used it), seeing {seen} device(s) (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')}): torch.cuda.set_device(LOCAL_RANK={local_rank}) "
                "fails here. Use torch.cuda.set_device(0) (this proc's own GPU), or run SPMDActor on "
                "procs where nothing has used CUDA yet",
                RuntimeWarning,
                stacklevel=3,
            )
        return {}
    return {} if os.environ.get("CUDA_VISIBLE_DEVICES") == devices else {"CUDA_VISIBLE_DEVICES": devices}


class SPMDActor(Actor):
    """torchrun in an actor, as Monarch's: spawn it on a proc mesh, ask one rank for a
    rendezvous address, then run a script (or ``-m module``) on every rank::

        spmd = procs.spawn("_SPMDActor", SPMDActor)
        addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None).get()
        spmd.main.call(addr, port, ["-m", "train", "--lr", "0.001"]).get()

    A script that ends with ``sys.exit(0)`` (or ``sys.exit()``) has succeeded; another exit
    code fails its actor, as any ``SystemExit`` in an endpoint does.

    As under torchrun, the script's folder is on ``sys.path`` while it runs (the modules it
    imports from there are imported afresh by the next run); a default process
    group the script started is destroyed when it ends (succeeded or not), so the same mesh can
    run it again; numbers in ``script_args`` are passed as strings. When the script fails on a
    rank, what its globals hold (a DeviceMesh, a DDP model) is dropped too, so the ranks waiting
    for it in a collective fail at once, and the error raised is that rank's (0.7.0 leaves all
    of this as it is: docs/monarch-compat.md).
    """

    def __init__(self) -> None:
        self._place = _place()

    @endpoint
    def get_host_port(self, use_ipaddr: Any = None) -> tuple[str, int]:
        """This host's name (or, with ``use_ipaddr``, the IP address its default route leaves
        from) and a port free on it, for the rendezvous."""
        return (_ip_addr() if use_ipaddr else socket.gethostname()), _free_port()

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> None:
        env = _torchrun_env(self._place, master_addr, master_port)
        os.environ.update(env | _torchrun_devices(int(env["LOCAL_RANK"]), script=False))
        _serve_env_rendezvous(master_addr, master_port)

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Set the variables, then run ``script_args``: ``["-m", "module", args...]`` or
        ``["path/to/script.py", args...]``, as ``__main__`` with that ``sys.argv``."""
        script_args = _argv(script_args)
        if not script_args or (script_args[0] == "-m" and len(script_args) < 2):
            raise ValueError("No script or module specified: give ['-m', 'module', ...] or ['script.py', ...]")
        env = _torchrun_env(self._place, master_addr, master_port)
        os.environ.update(env | _torchrun_devices(int(env["LOCAL_RANK"]), script=True))
        _serve_env_rendezvous(master_addr, master_port)
        # torchrun runs each script in a fresh process; this proc outlives the script, so what a
        # script leaves behind must not break its next run here: the default process group it
        # started (init_process_group again raises "initialize the default process group
        # twice", after a failure or from a script that never destroys it) and the script's
        # folder on sys.path
        had_group = _default_group_initialized()
        folder = ""
        before = set(sys.modules)
        try:
            if script_args[0] == "-m":
                sys.argv = [script_args[1], *script_args[2:]]
                runpy.run_module(script_args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(script_args)
                if os.path.isfile(script_args[0]):
                    # `python train.py` (torchrun) imports the modules next to train.py
                    folder = os.path.dirname(os.path.realpath(script_args[0]))
                    sys.path.insert(0, folder)
                runpy.run_path(script_args[0], run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        except Exception as e:
            if peer_gone(type(e), str(e)):
                # the grouped error raises and shows first the rank whose own script failed: the
                # lowest rank's was a survivor's "Connection closed by peer", the cause a line below
                e.add_note(PEER_GONE_NOTE)
                e.__dict__[PEER_GONE_MARK] = True
            if not had_group:
                _drop_script_objects(e)
            raise
        finally:
            if folder and folder in sys.path:
                sys.path.remove(folder)
            if folder:
                # the next run imports them afresh, as torchrun's new process would: an edited
                # model.py next to train.py is what the next run gets
                for name in modules_under(folder).keys() - before:
                    del sys.modules[name]
            if not had_group:
                _destroy_default_group()
        return True

    @endpoint
    def free_port(self) -> tuple[str, int]:
        return socket.gethostbyname(socket.gethostname()), _free_port()

    @endpoint
    def ip_addr(self) -> str:
        return _ip_addr()


def _argv(script_args: Any) -> list[str]:
    """``script_args`` as the command line torchrun would give the script. A bare string ran
    its first character as the script ("can't find '__main__' module in '/'") and a number
    reached the script's argparse as an int ("'int' object is not subscriptable")."""
    if isinstance(script_args, (str, bytes, os.PathLike)):
        raise TypeError(
            f"script_args is a list of command-line words, not {type(script_args).__name__} {script_args!r}: "
            f"give [{os.fsdecode(script_args)!r}, ...] or ['-m', 'module', ...]"
        )
    out = []
    for a in script_args:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = str(a)
        elif isinstance(a, os.PathLike):
            a = os.fsdecode(a)
        if not isinstance(a, str):
            raise TypeError(f"script_args holds {type(a).__name__} {a!r}: a command line has only strings (and numbers)")
        out.append(a)
    return out


PEER_GONE_NOTE = (
    "this rank's collective failed because another rank's script failed first (or its process died) "
    "and closed its connections; that rank's error is the cause"
)


#: what a failed script's globals keep (its exception's class and methods may read them):
#: none of these holds a process group
_KEPT = (type(sys), type, type(_place), type(len), str, bytes, int, float, bool, type(None))


def _drop_script_objects(e: BaseException) -> None:
    """Drop what the failed script's globals hold besides modules, classes, functions and
    constants, and the locals of the frames it failed in. Its traceback keeps those frames, and
    a ``pg = dist.group.WORLD`` or a DDP model there (a global, or a local of the ``main()``
    most scripts have) kept its gloo group, so destroying the group did not close its
    connections: the ranks waiting for this one in a collective stayed blocked until the proc
    mesh stopped (torchrun's process would have exited and closed them). gloo's ``abort()``
    does not close them."""
    import gc
    import traceback

    mine = getattr(sys.modules.get("__main__"), "__dict__", None)
    seen: set[int] = set()
    chain: list[BaseException] = []
    err: BaseException | None = e
    while err is not None and all(err is not c for c in chain):  # an error raised while handling another
        chain.append(err)
        err = err.__cause__ or err.__context__
    for err in chain:
        tb = err.__traceback__
        while tb is not None:
            g = tb.tb_frame.f_globals
            if g.get("__name__") == "__main__" and g is not mine and id(g) not in seen:
                seen.add(id(g))
                for k in [k for k, v in g.items() if not k.startswith("__") and not isinstance(v, _KEPT)]:
                    del g[k]
            tb = tb.tb_next
        # the frames that finished (the script's, and those it called); the ones still running
        # (this endpoint's) are left as they are. The error's text is made from the traceback's
        # code and line numbers, which stay
        traceback.clear_frames(err.__traceback__)
    gc.collect()  # a DDP model's hooks are reference cycles


def _default_group_initialized() -> bool:
    # a script that never imported torch.distributed started no group: torch is not imported for it
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


#: how long main() waits for the script's process group to be destroyed before it reports the
#: script's outcome anyway
_DESTROY_WAIT = 10.0


def _destroy_default_group() -> None:
    if not _default_group_initialized():
        return
    import threading

    import torch.distributed as dist

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            _forget_destroyed_groups()
        except Exception as e:  # the script's own outcome is what the caller must see
            print(f"SPMDActor: could not destroy the process group the script left: {e!r}", file=sys.stderr)

    # gloo's is at once; NCCL's shutdown can wait for a collective in flight whose peers are
    # gone, and the caller would not hear of the script's error meanwhile
    t = threading.Thread(target=destroy, name="spmd-destroy-group", daemon=True)
    t.start()
    t.join(_DESTROY_WAIT)
    if t.is_alive():
        print(
            f"SPMDActor: the process group the script left is not destroyed after {_DESTROY_WAIT:g} s "
            "(a collective in flight?); reporting the script's outcome now",
            file=sys.stderr,
        )


def _forget_destroyed_groups() -> None:
    """Take the destroyed process groups out of torch.distributed's default arguments.

    ``torch.distributed.nn.functional``'s collectives (and ZeroRedundancyOptimizer's helpers)
    take ``group=group.WORLD``, read once, when the module is imported: imported while a
    script's group exists (DDP's constructor imports ``torch._dynamo``, which imports it), they
    kept that group, its gloo connections and threads, after ``destroy_process_group()``: the
    ranks waiting for a failed one in a collective stayed blocked until the proc mesh stopped,
    and every later run of the script left one more group open. ``None`` is what they read as
    the default group now."""
    import types

    import torch.distributed as dist

    if dist.is_initialized():
        return  # every group goes with the default one: none is destroyed while it lives

    def dead(d: Any) -> bool:
        # type(), not isinstance(): that reads __class__, and a deprecated alias warns on it
        return issubclass(type(d), dist.ProcessGroup)

    for name, mod in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or mod is None:
            continue
        for f in list(vars(mod).values()):
            if type(f) is not types.FunctionType:
                continue
            if f.__defaults__ and any(map(dead, f.__defaults__)):
                f.__defaults__ = tuple(None if dead(d) else d for d in f.__defaults__)
            if f.__kwdefaults__ and any(map(dead, f.__kwdefaults__.values())):
                f.__kwdefaults__ = {k: None if dead(d) else d for k, d in f.__kwdefaults__.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _rendezvous_store(addr: str, port: int, rank: int, world_size: int, timeout: Any) -> Any:
    """The TCPStore of a process group's rendezvous at ``addr``:``port``: rank 0 hosts it,
    listening on ``addr``'s IP address alone, the other ranks connect to it.

    torch's own (env://) listens on every interface (``::``) whatever MASTER_ADDR says, so
    anyone reaching that port while the group lives reads and writes its keys. Its
    ``master_listen_fd`` takes a socket bound where we choose (libuv's backend and the old one
    alike); the store owns a duplicate of it and closes it when it goes."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(addr, port, world_size, False, timeout=timeout)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        ip = str(sockaddr[0])
    except OSError as e:
        raise ValueError(
            f"the rendezvous address {addr!r} (MASTER_ADDR) does not resolve on rank 0's host "
            f"{socket.gethostname()!r} ({e.strerror}): give master_addr an address or name of that host"
        ) from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as e:
            raise ValueError(
                f"rank 0 cannot host the rendezvous at {addr!r} port {port} ({ip}): {e.strerror}. "
                f"MASTER_ADDR must be an address of rank 0's host {socket.gethostname()!r} and the port free "
                "there: give master_addr/master_port that are, or leave them out to have them chosen"
            ) from None
        sock.listen(socket.SOMAXCONN)
        # a duplicate: the store closes the fd it is given, also when its constructor fails
        # (and a second close of that number could hit a file opened meanwhile)
        return TCPStore(ip, port, world_size, True, timeout=timeout, master_listen_fd=os.dup(sock.fileno()))


#: (MASTER_ADDR, MASTER_PORT) this proc's env:// rendezvous serves with :func:`_rendezvous_store`,
#: as SPMDActor set them; torch's own handler for any other
_served: tuple[str, str] | None = None
#: torch's env:// handler, for a rendezvous at an address we did not set
_torch_env_handler: Any = None


def _serve_env_rendezvous(master_addr: str, master_port: int) -> None:
    """Have an unchanged script's ``init_process_group()`` (env://) meet at a store listening
    on MASTER_ADDR alone. A fresh store for each group, as torch's own: one kept for as long as
    the variables are set (torchrun's agent store, TORCHELASTIC_USE_AGENT_STORE) kept the last
    group's keys, and a second init_process_group's gloo read a gone rank's address from them
    ("Gloo connectFullMesh failed ... Connection refused") about one time in two."""
    global _served, _torch_env_handler
    import importlib

    try:
        # the module: torch.distributed's attribute of that name is its function
        handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    except ImportError:
        return  # no torch.distributed here: the variables alone, for whatever reads them
    if _torch_env_handler is None:
        _torch_env_handler = handlers["env"]
        handlers["env"] = _env_rendezvous_handler
    _served = (master_addr, str(master_port))


def _env_rendezvous_handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    from urllib.parse import parse_qsl, urlparse

    from torch.distributed.constants import default_pg_timeout

    served = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    if served != _served:
        yield from _torch_env_handler(url, timeout=timeout or default_pg_timeout, **kwargs)
        return
    # what torch's handler reads: rank and world_size from the url (init_process_group puts
    # them there when given), else from the environment
    query = dict(parse_qsl(urlparse(url).query))
    rank = int(query.get("rank", os.environ.get("RANK", "-1")))
    world = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    addr, port = served
    yield _rendezvous_store(str(addr), int(str(port)), rank, world, timeout or default_pg_timeout), rank, world
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _ip_addr() -> str:
    # the address other hosts reach: the one the default route leaves from
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def setup_env_for_distributed(
    proc_mesh: ProcMesh, master_addr: str | None = None, master_port: int | None = None, use_ipaddr: bool | None = None
) -> Any:
    """Set MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK… in every proc of ``proc_mesh``.

    Rank 0 of the mesh hosts the rendezvous, listening on MASTER_ADDR alone: 127.0.0.1 when
    every proc is on one host; else its host name's address, or with ``use_ipaddr=True`` the IP
    address its default route leaves from (for hosts whose names do not resolve to a reachable
    address); or the ``master_addr`` given. Returns an awaitable that is already done, so
    both ``setup_env_for_distributed(pm)`` and ``await setup_env_for_distributed(pm)`` work.
    """
    setter = proc_mesh.spawn(f"_spmd_env_{id(proc_mesh) & 0xFFFFFF:x}", SPMDActor)
    try:
        if master_addr is None or master_port is None:
            first = setter.slice(**{k: 0 for k in setter.extent}) if len(setter.extent) else setter
            addr, port = first.free_port.call_one().get()
            if _one_host(proc_mesh):
                # no other host has to reach it: nothing outside this one can
                addr = "127.0.0.1"
            elif use_ipaddr and master_addr is None:
                addr = _tcp_host(proc_mesh) or first.ip_addr.call_one().get()
            master_addr = master_addr or addr
            master_port = master_port or port
        setter.setup_env.call(master_addr, master_port).get()
    except KeyboardInterrupt as e:
        # its helper actors go once they have done what they were sent (an actor takes its messages
        # in order); the note named them ("_spmd_env_3fa2c1.setup_env.call() still runs ...")
        setter.stop()
        e.__notes__ = [n for n in getattr(e, "__notes__", []) if "only the wait stopped" not in n]
        e.add_note(
            f"monarch_nb: the setup of torch.distributed's environment on proc mesh {proc_mesh._name!r} was "
            "interrupted: calling it again sets every variable anew."
        )
        raise
    setter.stop().get()
    return _Awaitable()


def _proc_host(proc_mesh: ProcMesh, rank: int) -> str:
    """The host part of the TCP address the runtime reaches ``rank``'s proc at; "" for a proc
    of this host's allocator (reached over ipc)."""
    addr = proc_mesh._procs[rank].addr
    return addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]") if addr.startswith("tcp://") else ""


def _tcp_host(proc_mesh: ProcMesh) -> str:
    """The IP address the runtime reaches rank 0 at, when it is a TCP one (procs on other hosts)."""
    host = _proc_host(proc_mesh, proc_mesh._view.ranks[0])
    return host if host and not host.startswith("127.") and host != "0.0.0.0" else ""


def _one_host(proc_mesh: ProcMesh) -> bool:
    """Whether every proc of ``proc_mesh`` is on one host: those of this host's allocator are
    reached over ipc, another host's at its TCP address."""
    return len({_proc_host(proc_mesh, r) for r in proc_mesh._view.ranks}) == 1


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
    """What :func:`setup_env_for_distributed` returns: done already, awaited or not."""

    def __await__(self) -> Any:
        if False:
            yield
        return None

    def _ipython_display_(self) -> None:
        # a cell ending in the call without ``await`` shows nothing, as for a function returning None
        pass
