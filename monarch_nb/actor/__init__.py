"""The actor API, compatible with ``monarch.actor`` (torchmonarch 0.7): change the import, keep the code.

from monarch_nb.actor import Actor, endpoint, this_host

class Trainer(Actor):
    @endpoint
    def train(self, step: int) -> float: ...

procs = this_host().spawn_procs(per_host={"gpus": 8})
trainers = procs.spawn("trainers", Trainer)
trainers.train.call(step=0).get()
"""

from ..errors import ActorError, SupervisionError
from ._actor import Actor
from ._context import controller_client
from ._endpoint import (
    Accumulator,
    Endpoint,
    as_endpoint,
    concurrent_endpoint,
    endpoint,
    send,
)
from ._future import Future, blocked_on, returns_future
from ._mesh import (
    ActorMesh,
    HostMesh,
    ProcMesh,
    ProcsKilledWarning,
    ValueMesh,
    attach_to_workers,
    get_or_spawn_controller,
    proc_mesh,
    this_host,
    this_proc,
)
from ._misc import (
    BootstrapCommand,
    ChannelTransport,
    Context,
    ProcId,
    Uid,
    attach,
    config,
    context,
    current_actor_name,
    current_rank,
    current_size,
    debug_controller,
    default_bootstrap_cmd,
    enable_transport,
    run_worker_loop_forever,
    run_worker_loop_until_shutdown,
    shutdown_context,
    start_worker_loop_forever,
)
from ._port import Channel, Port, PortReceiver
from ._shape import Extent, Point
from ._spans import get_meter, span, traced
from ._supervision import MeshFailure, unhandled_failures, unhandled_fault_hook

__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "BootstrapCommand",
    "Channel",
    "ChannelTransport",
    "Context",
    "Endpoint",
    "Extent",
    "Future",
    "HostMesh",
    "MeshFailure",
    "Point",
    "Port",
    "PortReceiver",
    "ProcId",
    "ProcMesh",
    "ProcsKilledWarning",
    "SupervisionError",
    "Uid",
    "ValueMesh",
    "as_endpoint",
    "attach",
    "attach_to_workers",
    "blocked_on",
    "concurrent_endpoint",
    "config",
    "context",
    "controller_client",
    "current_actor_name",
    "current_rank",
    "current_size",
    "debug_controller",
    "default_bootstrap_cmd",
    "enable_transport",
    "endpoint",
    "get_meter",
    "get_or_spawn_controller",
    "proc_mesh",
    "returns_future",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "send",
    "shutdown_context",
    "span",
    "start_worker_loop_forever",
    "this_host",
    "this_proc",
    "traced",
    "unhandled_failures",
    "unhandled_fault_hook",
]
