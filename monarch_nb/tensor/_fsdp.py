"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the ranks, driven from the controller.

On the ranks the module is a real FSDP2 module over the proc mesh's device mesh (HSDP on a 2-D
mesh: replicated over the first dimension, sharded over the second); its forward runs on each
rank's local batch, as FSDP code does. On the controller the shadow is a plain meta copy (for
the forward's shapes) plus meta DTensors standing for the sharded parameters, so nothing of
FSDP's own collectives runs against the fake process group here.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from ._ops import local_slice


def param_placements(ndim: int) -> tuple[Placement, ...]:
    """Where FSDP2 puts each parameter: dim 0 sharded over the last mesh dimension, replicated
    over the other (HSDP)."""
    return (*(Replicate() for _ in range(ndim - 1)), Shard(0))


def _wants(wrap: Any, name: str, module: nn.Module) -> bool:
    if wrap is None:
        return False
    if isinstance(wrap, type) or (isinstance(wrap, tuple) and all(isinstance(c, type) for c in wrap)):
        return isinstance(module, wrap)
    return bool(wrap(name, module))


class FullyShard:
    """Rank side: ``fully_shard`` each submodule ``wrap`` picks, then the root, on the rank's
    device mesh. Gradients are summed, not averaged, across ranks: the loss is computed on the
    global batch (a DTensor), so each rank's gradient is already its part of the global one."""

    def __init__(self, wrap: Any, kwargs: dict[str, Any]) -> None:
        self.wrap = wrap
        self.kwargs = kwargs

    def __call__(self, mesh: Any, device: str, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        m = module.to(device)
        for name, sub in list(m.named_modules()):
            if sub is not m and _wants(self.wrap, name, sub):
                fully_shard(sub, mesh=mesh, **self.kwargs)
        fully_shard(m, mesh=mesh, **self.kwargs)
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)
        return m

    def __str__(self) -> str:
        return "fully_shard"


class FSDPShadow:
    """The controller's stand-in for an FSDP module: ``plain`` (a meta copy) computes forward
    shapes on a local batch; ``params`` are meta DTensors shaped and placed as FSDP's. A
    parameter's gradient lands on the plain copy and is mirrored onto its DTensor, so
    ``p.grad`` is known here as it is for other mesh tensors."""

    def __init__(self, module: nn.Module, mesh: Any, sizes: list[int]) -> None:
        self.plain = copy.deepcopy(module).to("meta")
        pl = param_placements(len(sizes))
        self.params: dict[str, DTensor] = {}
        for name, p in self.plain.named_parameters():
            local = local_slice(p.detach(), [0] * len(sizes), sizes, pl) if p.ndim else p.detach()
            d = DTensor.from_local(local, mesh, pl if p.ndim else [Replicate()] * len(sizes), run_check=False,
                                   shape=p.shape, stride=p.stride())  # fmt: skip
            param = nn.Parameter(d, requires_grad=p.requires_grad)
            self.params[name] = param  # type: ignore[assignment]
            p.register_post_accumulate_grad_hook(_mirror(param))

    def parameters(self) -> list[DTensor]:
        return list(self.params.values())

    def named_parameters(self) -> list[tuple[str, DTensor]]:
        return list(self.params.items())

    def train(self, mode: bool = True) -> FSDPShadow:
        self.plain.train(mode)
        return self

    def __repr__(self) -> str:
        return f"fully_shard({self.plain!r})"


def _mirror(d: torch.Tensor) -> Any:
    def hook(p: torch.Tensor) -> None:
        d.grad = torch.empty_like(d)
        p.grad = None

    return hook


class FSDPCall:
    """A forward call of an FSDP module: mesh-tensor inputs split over the batch (``Shard(0)``
    on every mesh dimension: data parallel over all ranks) are run as each rank's local batch;
    tensor outputs come back as DTensors split the same way (their first dimension the batch)."""

    #: FSDP's all-gathers run on the ranks only (the shadow's forward is a plain meta module)
    has_collectives = True

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        mesh: list[Any] = []
        batch: list[int] = []

        def local(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            if x.ndim == 0 or any(not (isinstance(p, Shard) and p.dim == 0) for p in x.placements):
                raise ValueError(
                    "a fully_shard model runs on each rank's part of the batch: give it mesh tensors with "
                    f"Shard(0) on every mesh dimension (data parallel), not {tuple(map(str, x.placements))}; "
                    "use t.redistribute(placements=[Shard(0), ...]) first"
                )
            mesh.append(x.device_mesh)
            batch.append(x.shape[0])
            return x.to_local()

        a, k = pytree.tree_map(local, (args, kwargs))
        if not mesh:
            raise ValueError("a fully_shard model needs at least one mesh tensor input (the batch)")
        fwd = module.plain if isinstance(module, FSDPShadow) else module
        out = fwd(*a, **k)

        def wrap(y: Any) -> Any:
            if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
                return y
            if y.ndim == 0:
                raise ValueError("a fully_shard model's outputs must keep the batch dimension (compute the loss on them)")
            shape = torch.Size((batch[0], *y.shape[1:]))
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            return DTensor.from_local(y, mesh[0], [Shard(0)] * mesh[0].ndim, run_check=False, shape=shape, stride=stride)

        return pytree.tree_map(wrap, out)

    def __str__(self) -> str:
        return "fully_shard module forward"
