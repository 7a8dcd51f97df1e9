"""What travels in an op record, understood alike by the controller (on meta shadows) and the
ranks (on real DTensors): references to table entries, literals, and small picklable callables
standing for a method, an attribute, a factory, a reduction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class Ref:
    """A table entry on the ranks (a handle's id)."""

    id: int


@dataclass(frozen=True)
class Lit:
    """A plain tensor from the controller: a Replicate() DTensor on every rank."""

    value: torch.Tensor


@dataclass(frozen=True)
class Via:
    """A shard too big for a message: the rank reads it from ``buf`` (an RDMABuffer of the
    sender's) into a tensor of ``shape`` and ``dtype`` (the data plane, monarch_nb.rdma)."""

    buf: Any
    shape: tuple[int, ...]
    dtype: torch.dtype

    def receive(self, timeout: float) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype)
        self.buf.read_into(t.view(-1).view(torch.uint8), timeout=int(timeout)).get(timeout=timeout)
        return t


@dataclass(frozen=True)
class Spec:
    """What the controller needs to know of a DTensor on the ranks to make a handle of it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Box:
    """A tree kept as one table entry (a run record stores one object per output id)."""

    value: Any


@dataclass(frozen=True)
class Method:
    """``x.name(*args, **kwargs)``: picklable where a method descriptor may not be."""

    name: str

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.name)(*args, **kwargs)

    def __str__(self) -> str:
        return f"Tensor.{self.name}"


@dataclass(frozen=True)
class Attr:
    """``x.name`` (a property such as ``T`` or ``grad``)."""

    name: str

    def __call__(self, obj: Any) -> Any:
        return getattr(obj, self.name)

    def __str__(self) -> str:
        return f"Tensor.{self.name}"


@dataclass(frozen=True)
class SetAttr:
    """``x.name = value`` (``p.grad = None``, as torch's set-to-none zeroing does)."""

    name: str

    def __call__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.name, value)

    def __str__(self) -> str:
        return f"Tensor.{self.name} ="


@dataclass(frozen=True)
class Factory:
    """``fn(*args, **kwargs)`` made into a DTensor: ``placements`` (Replicate() everywhere when
    None); random factories draw from a generator seeded with ``seed`` on every rank, so the
    global value is the same one torch would make locally with that seed."""

    fn: Any
    placements: tuple[Placement, ...] | None
    seed: int | None

    def __call__(self, mesh: Any, device: str, *args: Any, **kwargs: Any) -> DTensor:
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs["device"] = "meta" if device == "meta" else device
        placements = self.placements or tuple(Replicate() for _ in range(mesh.ndim))
        if self.seed is not None and device != "meta":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                full = self.fn(*args, **{**kwargs, "device": "cpu"}).to(device)
        else:
            full = self.fn(*args, **kwargs)
        coord = mesh.get_coordinate() if device != "meta" else [0] * mesh.ndim
        local = local_slice(full, coord, list(mesh.shape), placements)
        out = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
        return out.requires_grad_() if requires_grad else out  # type: ignore[return-value]

    def __str__(self) -> str:
        return f"torch.{getattr(self.fn, '__name__', self.fn)}"


@dataclass(frozen=True)
class WithMesh:
    """``fn(mesh, device, *args)``: an op that needs the rank's device mesh (as factories do)."""

    fn: Any

    def __str__(self) -> str:
        return str(self.fn)


@dataclass(frozen=True)
class Agree:
    """``fn``, an op with a collective (the controller saw one in its dry run): before it the
    ranks agree whether each has its inputs, so none enters a collective that a rank whose
    input failed there alone would skip (they would wait in it until the collective timeout)."""

    fn: Any

    def __str__(self) -> str:
        return op_name(self.fn)


@dataclass(frozen=True)
class Reduce:
    """Monarch's ``reduce``: combine each rank's local tensor across the named mesh dims; the
    result is the same on every rank of those dims, so they become Replicate()."""

    dims: tuple[str, ...]
    op: str

    #: its all-reduce runs on the ranks only, not on the meta shadows
    has_collectives = True

    def __call__(self, x: DTensor) -> DTensor:
        import torch.distributed as dist

        mesh = x.device_mesh
        names = list(mesh.mesh_dim_names or ())
        local = x.to_local().detach().clone()
        if local.device.type != "meta":
            red = {
                "sum": dist.ReduceOp.SUM,
                "avg": dist.ReduceOp.SUM,
                "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN,
                "product": dist.ReduceOp.PRODUCT,
            }[self.op]
            for d in self.dims:
                dist.all_reduce(local, red, group=mesh.get_group(d))
        if self.op == "avg":
            # on the meta shadow too: an integer tensor is refused here, before anything is sent
            local /= math.prod(mesh.size(names.index(d)) for d in self.dims)
        placements = [Replicate() if n in self.dims else p for n, p in zip(names, x.placements)]
        return DTensor.from_local(local, mesh, placements, run_check=False)

    def __str__(self) -> str:
        return f"reduce({', '.join(self.dims)}, {self.op!r})"


REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def chunk_range(length: int, n: int, k: int) -> tuple[int, int]:
    """Piece ``k`` of ``n`` of a dim of ``length``, as torch.chunk cuts it (DTensor's Shard)."""
    size = -(-length // n) if length else 0
    start = min(k * size, length)
    return start, min(start + size, length)


def local_slice(t: torch.Tensor, coord: list[int], sizes: list[int], placements: Any, shared: bool = False) -> torch.Tensor:
    """The local tensor of the rank at ``coord`` for a global ``t`` (a fresh tensor, so that
    pickling it sends this piece only, not the storage it was cut from); ``shared``: made in
    shared memory where there is room (a piece an RDMABuffer lends, which would otherwise copy
    the fresh tensor there: a second copy of it on the controller while it waits to be read)."""
    out = t
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            a, b = chunk_range(out.shape[p.dim], sizes[i], coord[i])
            out = out.narrow(p.dim, a, b - a)
        elif isinstance(p, Partial) and coord[i] != 0:
            # the other ranks' pieces reduce with rank 0's to the value: the identity of a sum
            # (or product), the value itself for avg, max and min (zeros made max(t, 0), avg t / n)
            op = p.reduce_op
            if op in ("sum", "bxor"):
                out = torch.zeros_like(out)
            elif op in ("product", "prod"):
                out = torch.ones_like(out)
    if out.device.type == "meta":
        return out.contiguous()
    if shared:
        dst = torch.empty(out.shape, dtype=out.dtype)
        try:
            dst.share_memory_()  # its pages were never touched: moving them costs no memory
        except RuntimeError:  # /dev/shm full: the buffer serves it over its stream, with a warning
            return out.clone()
        return dst.copy_(out)
    return out.clone()


def local_view(t: torch.Tensor, coord: list[int], sizes: list[int], placements: Any) -> torch.Tensor:
    """The region of a global ``t`` that the rank at ``coord`` holds (a view into ``t``; no
    Partial placements)."""
    out = t
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            a, b = chunk_range(out.shape[p.dim], sizes[i], coord[i])
            out = out.narrow(p.dim, a, b - a)
    return out


def local_shape(shape: list[int], coord: list[int], sizes: list[int], placements: Any) -> list[int]:
    shape = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            a, b = chunk_range(shape[p.dim], sizes[i], coord[i])
            shape[p.dim] = b - a
    return shape


def op_name(func: Any) -> str:
    """How an op is named to the user (in errors): ``Tensor.add``, ``torch.relu``, their function's name."""
    if isinstance(func, (Method, Attr, SetAttr, Factory, WithMesh)) or type(func).__str__ is not object.__str__:
        return str(func)  # an op object naming itself (Optimizer.step); a function's str is its repr
    mod = getattr(func, "__module__", None) or ""
    return f"{mod + '.' if mod else ''}{getattr(func, '__qualname__', getattr(func, '__name__', repr(func)))}"
