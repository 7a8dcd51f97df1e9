"""Distributed tensors driven from the notebook: torch's own DTensor on the ranks of a proc mesh,
a handle (:class:`MeshTensor`) on the controller.

    import monarch_nb.tensor as mt
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    w = mt.distribute(torch.randn(64, 64), procs, [Replicate(), Shard(1)])
    with procs.activate():
        x = torch.rand(8, 64)          # a mesh tensor, Replicate() everywhere
        y = torch.relu(x @ w)          # runs on the ranks; y.shape is known at once
    mt.inspect(y)                      # the global value

Each proc mesh gets one hidden actor (spawned at first use) holding a table id -> DTensor, a
gloo (CPU) or NCCL (GPU) process group and a device mesh named as the proc mesh; a slice of it
(``procs.slice(hosts=0)``) gets a device mesh of its own over the same actor and process group. Ops are sent
to every rank in one ordered stream of small records; each result's shape and placements come
from running the op on meta shadows here, against torch's fake process group, so an op
returns at once even while the ranks are busy, and an op DTensor cannot shard fails here,
before anything is sent. An op failing on the ranks stores its error under its results: reading
them (or any op using them) raises it; other tensors keep working.

Differences from Monarch's tensor engine, on purpose: ``inspect(t)`` returns the global value
(Monarch's returns one shard; ``inspect(t, gpus=1)`` returns that rank's shard here too);
tensors are DTensors with placements, so factories inside ``activate()`` are ``Replicate()``
on every dimension and ``reduce`` makes the reduced dimensions ``Replicate()``.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from ..actor import Future
from ..actor._mesh import ProcMesh, set_tensor_hooks
from . import _engine
from ._engine import (
    COLLECTIVE_TIMEOUT_S,
    ActivateMode,
    Engine,
    MeshModule,
    MeshTensor,
    TensorOpError,
    _Controller,
    dispatch,
    engine_for,
    make,
)
from ._ops import REDUCE_OPS, Reduce, Ref, local_shape, local_slice

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "MeshModule",
    "MeshTensor",
    "Optimizer",
    "Partial",
    "Replicate",
    "Shard",
    "TensorOpError",
    "activate",
    "distribute",
    "distribute_module",
    "fetch_shard",
    "full_tensor",
    "fully_shard",
    "inspect",
    "ones",
    "rand",
    "randn",
    "rank_tensor",
    "reduce",
    "remote",
    "setup",
    "slice_mesh",
    "stats",
    "to_mesh",
    "zeros",
]


def activate(procs: ProcMesh) -> ActivateMode:
    """``with activate(procs):`` (or ``with procs.activate():``) torch factories make mesh tensors."""
    return ActivateMode(engine_for(procs))


def rank_tensor(procs: ProcMesh, dim: str) -> MeshTensor:
    """Each rank's coordinate along ``dim``, as a mesh tensor: ``arange(size)`` sharded over
    ``dim`` (Shard(0)) and replicated over the others, so rank ``c``'s local tensor is ``[c]``
    (Monarch's holds the scalar ``c``)."""
    e = engine_for(procs)
    if dim not in e.labels:
        raise ValueError(f"{dim!r} is not a dimension of {procs!r}; its dimensions are {list(e.labels)}")
    n = e.sizes[e.labels.index(dim)]
    pl = [Shard(0) if name == dim else Replicate() for name in e.labels]
    return make(e, torch.arange, (n,), {}, pl, False)


set_tensor_hooks(activate=activate, rank_tensor=rank_tensor)


def setup(procs: ProcMesh) -> str:
    """Start the mesh's tensor engine now (the hidden actor, the process group named as the
    mesh's dimensions); otherwise the first op does. Returns the backend, gloo or nccl."""
    e = engine_for(procs)
    e.start()
    return e.backend


def _placements(procs: ProcMesh, placements: Sequence[Placement] | None) -> tuple[Placement, ...]:
    e = engine_for(procs)
    if placements is None:
        return tuple(Replicate() for _ in e.sizes)
    # one placement alone (Shard(0), not [Shard(0)]) was "TypeError: 'Shard' object is not iterable"
    pl = tuple(placements) if isinstance(placements, Iterable) else (placements,) * (len(e.sizes) + 1)
    if len(pl) != len(e.sizes) or not all(isinstance(p, Placement) for p in pl):
        raise ValueError(
            f"placements must be {len(e.sizes)} DTensor placements (Shard(d), Replicate(), Partial()), one per "
            f"dimension {list(e.labels)} of {procs!r}; got {placements!r}"
        )
    return pl


def distribute(t: torch.Tensor, procs: ProcMesh, placements: Sequence[Placement] | None = None) -> MeshTensor:
    """Put ``t`` on the ranks of ``procs`` as a DTensor with ``placements`` (one per mesh dim;
    Replicate() everywhere when None). Each rank is sent only its own shard, once."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"distribute needs a torch.Tensor, got {type(t).__name__}")
    e = engine_for(procs)
    pl = _placements(procs, placements)
    for p in pl:
        if isinstance(p, Shard) and not -t.ndim <= p.dim < t.ndim:
            raise ValueError(f"{p} is out of range for a tensor of {t.ndim} dimensions")
    pl = tuple(Shard(p.dim % t.ndim) if isinstance(p, Shard) else p for p in pl)
    from torch.distributed.tensor import DTensor

    src = t.detach().cpu().contiguous()
    with _Controller():
        shadow = DTensor.from_local(
            local_slice(torch.empty_like(src, device="meta"), [0] * len(e.sizes), list(e.sizes), pl),
            e.shadow_mesh, pl, run_check=False, shape=src.shape, stride=src.stride(),
        )  # fmt: skip
    h = MeshTensor(e, e.new_id(), shadow)
    # each rank gets its own piece straight from here (small ones in a message, large ones
    # through the data plane), never through another rank; ranks holding the same piece
    # (Replicate) share one copy of it
    pieces: dict[int, torch.Tensor] = {}
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    for r in range(e.size):
        c = e.coords_of(r)
        key = tuple(c[i] if isinstance(p, Shard) else (c[i] != 0 if isinstance(p, Partial) else None) for i, p in enumerate(pl))
        if key not in made:
            big = math.prod(local_shape(list(src.shape), c, list(e.sizes), pl)) * src.element_size()
            made[key] = local_slice(src, c, list(e.sizes), pl, shared=big >= _engine.DISTRIBUTE_DATA_PLANE_BYTES)
        pieces[r] = made[key]
    e.put_pieces(h._id, pieces, pl, tuple(src.shape), src.stride())
    if t.requires_grad:
        h.requires_grad_()
    return h


def _factory(
    fn: Any, random: bool, size: tuple[Any, ...], procs: ProcMesh, placements: Any, kwargs: dict[str, Any]
) -> MeshTensor:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return make(engine_for(procs), fn, tuple(size), kwargs, _placements(procs, placements), random)


def zeros(*size: Any, procs: ProcMesh, placements: Sequence[Placement] | None = None, **kwargs: Any) -> MeshTensor:
    """``torch.zeros(*size)`` made on the ranks (only the size is sent)."""
    return _factory(torch.zeros, False, size, procs, placements, kwargs)


def ones(*size: Any, procs: ProcMesh, placements: Sequence[Placement] | None = None, **kwargs: Any) -> MeshTensor:
    """``torch.ones(*size)`` made on the ranks (only the size is sent)."""
    return _factory(torch.ones, False, size, procs, placements, kwargs)


def rand(*size: Any, procs: ProcMesh, placements: Sequence[Placement] | None = None, **kwargs: Any) -> MeshTensor:
    """``torch.rand(*size)`` made on the ranks from a seed drawn here (``torch.manual_seed`` here
    makes it reproducible); its global value is what torch.rand gives locally with that seed."""
    return _factory(torch.rand, True, size, procs, placements, kwargs)


def randn(*size: Any, procs: ProcMesh, placements: Sequence[Placement] | None = None, **kwargs: Any) -> MeshTensor:
    """``torch.randn(*size)`` made on the ranks, seeded as :func:`rand`."""
    return _factory(torch.randn, True, size, procs, placements, kwargs)


def _shard_index(t: MeshTensor, shard: dict[str, int] | None, kwargs: dict[str, int]) -> int:
    coords = dict(shard or {})
    coords.update(kwargs)
    return t._engine.rank_of(coords)


def fetch_shard(t: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Future[Any]:
    """A Future of the local tensor of the rank at ``shard`` (dims not named: coordinate 0). As
    Monarch's, ``t`` may be a pytree (``fetch_shard((loss, acc), gpus=1)``): the Future holds the
    same tree with each mesh tensor's piece in its place (other leaves kept as they are)."""
    if isinstance(t, MeshTensor):
        return _fetch_one(t, shard, kwargs)
    leaves, spec = pytree.tree_flatten(t)
    if not any(isinstance(x, MeshTensor) for x in leaves):
        raise TypeError(f"fetch_shard needs a MeshTensor (or a pytree of them), got {type(t).__name__}")
    # every leaf's coordinates checked (and its read started) before any wait
    futs = [_fetch_one(x, shard, kwargs) if isinstance(x, MeshTensor) else None for x in leaves]
    out: Future[Any] = Future._create("fetch_shard()")
    left = [sum(f is not None for f in futs)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            # each piece is read (a large one by the data plane) in the thread reading ``out``
            out._set_raw(
                futs, lambda fs: pytree.tree_unflatten([f.get() if f is not None else x for f, x in zip(fs, leaves)], spec)
            )

    for f in futs:
        if f is not None:
            f.add_done_callback(one_done)
    return out


def _fetch_one(t: MeshTensor, shard: dict[str, int] | None, kwargs: dict[str, int]) -> Future[torch.Tensor]:
    t._check_live("fetch_shard()")
    r = _shard_index(t, shard, kwargs)
    e = t._engine
    out: Future[torch.Tensor] = Future._create("fetch_shard()")
    shape = tuple(local_shape(list(t.shape), e.coords_of(r), list(e.sizes), t.placements))
    if math.prod(shape) * t.dtype.itemsize >= _engine.DATA_PLANE_BYTES:
        # a large piece comes by the data plane: the rank lends it as an RDMABuffer, read here
        # (in the thread that first reads the future, never on the I/O thread)
        lent = e.gather("share", ([], t._id), [r], f"fetch_shard(rank {r})")
        lent.add_done_callback(lambda f: out._set_raw(f, lambda g: e.read_lent(g.get()[r], shape, t.dtype)))
        return out
    fut = e.gather("fetch", ([], t._id), [r], f"fetch_shard(rank {r})")
    fut.add_done_callback(lambda f: out._set_raw(f, lambda g: g.get()[r]))
    return out


def inspect(t: Any, shard: dict[str, int] | None = None, **kwargs: int) -> Any:
    """The global value of ``t`` (Monarch's returns a shard: name one, ``inspect(t, gpus=1)``,
    for that rank's local tensor). As Monarch's, ``t`` may be a pytree of mesh tensors
    (``loss, acc = mt.inspect((loss, acc))``)."""
    if shard or kwargs:
        return fetch_shard(t, shard, **kwargs).get()
    if isinstance(t, MeshTensor):
        return t.full_tensor()
    if not any(isinstance(x, MeshTensor) for x in pytree.tree_leaves(t)):
        raise TypeError(f"inspect needs a MeshTensor (or a pytree of them), got {type(t).__name__}")
    return pytree.tree_map(lambda x: x.full_tensor() if isinstance(x, MeshTensor) else x, t)


def to_mesh(tensors: Any, procs: ProcMesh) -> Any:
    """Monarch's ``to_mesh``: every mesh tensor in ``tensors`` (a pytree) moved to ``procs`` (see
    :meth:`MeshTensor.to_mesh`)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.to_mesh(procs) if isinstance(x, MeshTensor) else x, tensors)


def slice_mesh(tensors: Any, **coords: int | slice) -> Any:
    """Monarch's ``slice_mesh``: every mesh tensor in ``tensors`` (a pytree) as the ranks of that
    slice hold it (see :meth:`MeshTensor.slice_mesh`)."""
    return pytree.tree_map(lambda x: x.slice_mesh(**coords) if isinstance(x, MeshTensor) else x, tensors)


def full_tensor(t: MeshTensor) -> torch.Tensor:
    return t.full_tensor()


def reduce(
    tensors: Any,
    dims: str | Sequence[str],
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
    _inplace: bool = False,
) -> Any:
    """Monarch's ``reduce``: combine every rank's local tensor across the mesh dims ``dims`` with
    ``reduction`` (sum, avg, max, min, product); those dims become Replicate(). ``tensors`` is a
    mesh tensor or a pytree of them (each reduced). Monarch's ``scatter``, ``mesh`` and
    ``_inplace`` are refused with the way to get the same here, never ignored."""
    if scatter:
        raise NotImplementedError(
            "reduce(..., scatter=True) (a reduce-scatter) is not supported on mesh tensors: reduce, then shard "
            "the result over those dims, e.g. mt.reduce(t, 'gpus').redistribute(placements=[Shard(0)])"
        )
    if mesh is not None:
        raise NotImplementedError(
            "reduce(..., mesh=...) is not supported on mesh tensors: reduce, then move the result with "
            "mt.reduce(t, dims).slice_mesh(...) or .to_mesh(procs)"
        )
    if _inplace:
        raise NotImplementedError("reduce(..., _inplace=True) is not supported on mesh tensors: t = mt.reduce(t, dims)")
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if reduction not in REDUCE_OPS:
        raise ValueError(
            f"reduction must be one of {REDUCE_OPS}, got {reduction!r} (Monarch's 'stack', 'band', 'bor' and "
            "'bxor' are not here: to gather a sharded tensor, t.redistribute(placements=[Replicate(), ...]); "
            "each rank's piece, mt.fetch_shard(t, dim=i))"
        )
    leaves = pytree.tree_leaves(tensors)
    if not leaves or not all(isinstance(t, MeshTensor) for t in leaves):
        got = next((type(t).__name__ for t in leaves if not isinstance(t, MeshTensor)), "nothing")
        raise TypeError(f"reduce needs a MeshTensor (or a pytree of them), got {got}")
    for t in leaves:
        bad = [d for d in names if d not in t._engine.labels]
        if bad:
            raise ValueError(f"{bad} are not dimensions of {t.mesh!r}; its dimensions are {list(t._engine.labels)}")
        _check_equal_pieces(t, names)
    return pytree.tree_map(lambda t: dispatch(Reduce(names, reduction), (t,), {}), tensors)


def _check_equal_pieces(t: MeshTensor, names: tuple[str, ...]) -> None:
    """Refuse, before sending, a reduce whose ranks hold local tensors of different shapes
    along ``names`` (a dim sharded unevenly): their all-reduce would wait until
    ``COLLECTIVE_TIMEOUT_S`` and leave the mesh's process group broken for every tensor."""
    e = t._engine
    uneven = _engine.uneven_pieces(t, [e.labels.index(d) for d in names])
    if uneven:
        raise ValueError(
            f"reduce over {list(names)}: the ranks' local tensors differ in shape there ({uneven}): a tensor of "
            f"shape {tuple(t.shape)} with placements {tuple(map(str, t.placements))} is not split evenly over those "
            "dims, and reduce combines the local tensors element by element. Nothing was sent: pad the tensor to "
            "a multiple of those dims' sizes"
        )


class remote:
    """``remote(fn)(*mesh_tensors)`` runs ``fn`` on every rank, on the DTensors; the controller
    runs it on meta shadows for the result's shape, so ``fn`` must work on meta tensors. As in
    Monarch, if ``fn`` fails on the ranks its results hold the error, and so do the inputs it
    changes in place (``x.mul_(2)``); an input it hands back unchanged is a new handle, so the
    error does not stick to the input. ``fn`` returns tensors (or None): a plain value (an int)
    is refused at once, since only its value on the meta shadows here would be known, not the
    ranks'.

    As Monarch's, ``fn`` may be a dotted name (``remote("torch.nn.functional.relu")``), imported
    here, and ``@remote()`` decorates as ``@remote`` does. Monarch's ``propagate=`` (the shape
    function its controller runs instead of ``fn``) is refused: here the shapes come from ``fn``
    itself on meta tensors, global DTensors rather than Monarch's local shards."""

    def __init__(self, function: Any = None, *, propagate: Any = None) -> None:
        if propagate is not None:
            raise NotImplementedError(
                "remote(..., propagate=...) is not supported on mesh tensors: the controller runs fn itself on "
                "meta tensors for its results' shapes, so pass fn alone (it must work on meta tensors: no .item() "
                "or other reads of values)"
            )
        if isinstance(function, str):
            import importlib

            module, _, name = function.rpartition(".")
            try:
                function = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(
                    f"remote({function!r}): cannot import it here ({type(e).__name__}: {e}); the controller "
                    "runs fn on meta tensors for its results' shapes, so it must import"
                ) from e
        self.fn = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:  # @remote(): this call is the decoration
            return remote(*args, **kwargs)
        return dispatch(self.fn, args, kwargs, user_fn=True)


class _DistributeModule:
    def __init__(self, partition_fn: Any) -> None:
        self.partition_fn = partition_fn

    def __call__(self, mesh: Any, device: str, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.tensor import distribute_module as dm

        return dm(module.to(device), mesh, self.partition_fn)

    def __str__(self) -> str:
        return "distribute_module"


def distribute_module(module: torch.nn.Module, procs: ProcMesh, partition_fn: Any = None) -> MeshModule:
    """``torch.distributed.tensor.distribute_module`` on the ranks: the module (weights and all)
    goes to every rank, ``partition_fn(name, submodule, device_mesh)`` shards its parameters
    there (every parameter Replicate() when None). Returns a handle: call it on mesh tensors,
    hand ``m.parameters()`` to :class:`Optimizer`."""
    import copy

    from ._engine import WithMesh

    e = engine_for(procs)
    fn = _DistributeModule(partition_fn)
    try:
        with _Controller():
            shadow = fn(e.shadow_mesh, "meta", copy.deepcopy(module))
    except Exception as err:
        raise TensorOpError(f"distribute_module: {type(err).__name__}: {err}") from err
    h = MeshModule(e, e.new_id(), shadow)
    e.send([(WithMesh(fn), (module.cpu(),), {}, [h._id], torch.is_grad_enabled())])
    return h


def fully_shard(
    module: torch.nn.Module,
    procs: ProcMesh,
    *,
    wrap: type | tuple[type, ...] | Any = None,
    reshard_after_forward: bool = True,
) -> MeshModule:
    """FSDP2's ``torch.distributed.fsdp.fully_shard`` on the ranks of ``procs``: the module goes
    to every rank, each submodule ``wrap`` picks (module classes, or ``fn(name, module) -> bool``)
    is sharded as its own unit, then the root; on a 2-D mesh it is HSDP (replicated over the
    first dimension, sharded over the second). Returns a handle: call it on a batch split over
    every rank (``Shard(0)`` on each mesh dimension), compute the loss on the result as on any
    mesh tensor, and step an :class:`Optimizer` over ``m.parameters()`` (DTensors ``Shard(0)``
    as FSDP makes them). Gradients are those of the loss on the global batch."""
    from ._engine import WithMesh
    from ._fsdp import FSDPCall, FSDPShadow, FullyShard

    e = engine_for(procs)
    if len(e.sizes) > 2:
        raise ValueError(
            f"fully_shard runs on a 1-D mesh (FSDP) or a 2-D one (HSDP); {procs!r} has {len(e.sizes)} dimensions: "
            "spawn the procs with one or two"
        )
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fully_shard needs a torch.nn.Module, got {type(module).__name__}")
    try:
        with _Controller():
            shadow = FSDPShadow(module, e.shadow_mesh, list(e.sizes))
    except Exception as err:
        raise TensorOpError(f"fully_shard: {type(err).__name__}: {err}") from err
    h = MeshModule(e, e.new_id(), shadow, FSDPCall())
    fn = FullyShard(wrap, {"reshard_after_forward": reshard_after_forward})
    e.send([(WithMesh(fn), (module.cpu(),), {}, [h._id], torch.is_grad_enabled())])
    return h


class _MakeOptimizer:
    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls = cls
        self.kwargs = kwargs

    def __call__(self, params: list[Any]) -> Any:
        return self.cls(params, **self.kwargs)

    def __str__(self) -> str:
        return f"Optimizer({getattr(self.cls, '__name__', self.cls)})"


class Optimizer(torch.optim.Optimizer):
    """A torch optimizer over mesh tensors, living on the ranks: ``step()`` and ``zero_grad()``
    are one message each. ``Optimizer(torch.optim.SGD, [w1, w2], lr=0.1)``.

    ``param_groups`` holds the hyperparameters here, as torch's does: change them
    (``g["lr"] = 0.01``, or a ``torch.optim.lr_scheduler`` over this optimizer) and the next
    ``step()`` carries the new values to the ranks' optimizer, whose state (momentum, Adam's
    moments) stays as it was. Its ``params`` are the mesh tensors."""

    def __init__(self, cls: type, params: Iterable[MeshTensor], **kwargs: Any) -> None:
        # torch.optim.Optimizer's __init__ is not run: it would hold the parameters here; this
        # class subclasses it so that lr schedulers (which check isinstance) take it
        ps = list(params)
        if not ps or not all(isinstance(p, MeshTensor) for p in ps):
            raise TypeError("Optimizer needs a non-empty list of MeshTensors")
        self._engine: Engine = ps[0]._engine
        others = [p for p in ps if p._engine is not self._engine]
        if others:
            # ids are per proc mesh: another mesh's parameter would name a tensor of this one
            raise ValueError(
                f"Optimizer: its parameters live on different proc meshes ({self._engine.procs!r}, "
                f"{others[0]._engine.procs!r}); make one optimizer per mesh"
            )
        make = _MakeOptimizer(cls, kwargs)
        try:
            # on the shadows first, as any op: a bad argument (lr=-1) is said here, at once,
            # instead of failing the ranks' optimizer, read only by a later step
            with _Controller():
                shadow = make([p._shadow for p in ps])
        except Exception as err:
            raise TensorOpError(f"{make}: {type(err).__name__}: {err}") from err
        self._cls = cls
        self.defaults = dict(shadow.defaults)
        self.param_groups = [{**g, "params": ps} for g in shadow.param_groups]
        self.state: Any = {}
        self._sent = _hyper(self.param_groups)
        self._params = ps
        self._id = self._engine.new_id()
        self._engine.send([(make, ([_ref(p) for p in ps],), {}, [self._id], False)])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise TypeError("Optimizer.step(closure) is not supported on mesh tensors: compute the loss before step()")
        hyper = _hyper(self.param_groups)
        try:
            changed = bool(hyper != self._sent)
        except RuntimeError:  # a tensor lr compares elementwise: send it
            changed = True
        self._sent = hyper
        self._engine.send([(_Step(hyper if changed else None), (_ref_id(self._id),), {}, [], False)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            for p in self._params:
                p._shadow.grad = None
        self._engine.send([(_ZeroGrad(set_to_none), (_ref_id(self._id),), {}, [], False)])

    def state_dict(self) -> dict[str, Any]:
        """torch's form, ``{"state": {i: {...}}, "param_groups": [...]}``, with each state
        tensor sharded as the ranks hold it (momentum buffers, Adam's moments) a mesh tensor: a
        copy taken now, kept on the ranks (read with ``mt.inspect`` to save it); other values
        (Adam's step count) are fetched. One round trip."""
        from ._ops import Spec

        e = self._engine
        sid = e.new_id()
        e.send([(_StateDict(), (_ref_id(self._id),), {}, [sid], False)])
        try:
            desc = e.gather("describe", ([], sid), [0], "Optimizer.state_dict()").get()[0]
            specs = [x for x in pytree.tree_leaves(desc) if isinstance(x, Spec)]
            handles = [_handle_of(e, x) for x in specs]
            if handles:
                e.send([(_Unbox(), (Ref(sid),), {}, [h._id for h in handles], False)])
        finally:
            # after the unbox: frees ride on the next message and are done before its records
            e.frees.append(sid)
        it = iter(handles)
        out = pytree.tree_map(lambda x: next(it) if isinstance(x, Spec) else x, desc)
        # the hyperparameters are this controller's (newer than the ranks' until the next step)
        out["param_groups"] = [{**h, "params": g["params"]} for h, g in zip(_hyper(self.param_groups), out["param_groups"])]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: its state tensors mesh tensors (of this optimizer's mesh) or
        plain tensors (from ``mt.inspect``, a checkpoint), which are sent to the ranks sharded as
        their parameter; the hyperparameters go with it."""
        groups = state_dict.get("param_groups")
        state = state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise ValueError("Optimizer.load_state_dict needs a dict with 'state' and 'param_groups', as state_dict() gives")
        if len(groups) != len(self.param_groups) or any(
            len(g.get("params", ())) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "Optimizer.load_state_dict: its parameter groups do not match this optimizer's "
                f"({[len(g.get('params', ())) for g in groups]} parameters, here {[len(g['params']) for g in self.param_groups]})"
            )
        index = {i: p for g, mine in zip(groups, self.param_groups) for i, p in zip(g["params"], mine["params"])}

        keep: list[MeshTensor] = []

        def remote(i: Any, x: Any) -> Any:
            if isinstance(x, MeshTensor):
                if x._engine is not self._engine:
                    raise ValueError(f"Optimizer.load_state_dict: state of parameter {i} lives on another proc mesh ({x.mesh!r})")
                return Ref(x._id)
            p = index.get(i)
            if isinstance(x, torch.Tensor) and p is not None and tuple(x.shape) == tuple(p.shape) and x.ndim:
                # a tensor of its parameter's shape (a momentum buffer read back): sharded as that parameter
                h = distribute(x, p.mesh, p.placements)
                keep.append(h)  # until sent: a collected handle's free would go first, in the same message
                return Ref(h._id)
            return x

        remote_state = {i: pytree.tree_map(lambda x, i=i: remote(i, x), v) for i, v in state.items()}
        for g, mine in zip(groups, self.param_groups):
            mine.update({k: v for k, v in g.items() if k != "params"})
        hyper = _hyper(self.param_groups)
        self._sent = hyper
        self._engine.send([(_LoadState(hyper), (_ref_id(self._id), remote_state), {}, [], False)])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("Optimizer.add_param_group() of mesh tensors: make another mt.Optimizer")

    def __repr__(self) -> str:
        return f"mt.Optimizer({getattr(self._cls, '__name__', self._cls)}, {len(self._params)} params)"

    def __getstate__(self) -> Any:
        raise TypeError("an mt.Optimizer lives on the ranks and cannot be pickled")

    def __del__(self) -> None:
        try:
            self._engine.frees.append(self._id)
        except AttributeError:
            pass


def _hyper(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's hyperparameters (everything but its params), copied."""
    return [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in groups]


def _handle_of(e: Engine, spec: Any) -> MeshTensor:
    """A handle for a DTensor the ranks made, known here by its spec."""
    from torch.distributed.tensor import DTensor

    pl = tuple(spec.placements)
    with _Controller():
        shadow = DTensor.from_local(
            local_slice(torch.empty(spec.shape, dtype=spec.dtype, device="meta"), [0] * len(e.sizes), list(e.sizes), pl),
            e.shadow_mesh, pl, run_check=False, shape=torch.Size(spec.shape), stride=spec.stride,
        )  # fmt: skip
    return MeshTensor(e, e.new_id(), shadow)


class _StateDict:
    def __call__(self, opt: Any) -> Any:
        from ._ops import Box

        # a copy: the next step changes the optimizer's tensors in place
        sd = opt.state_dict()
        return Box({"state": pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, sd["state"]),
                    "param_groups": sd["param_groups"]})  # fmt: skip

    def __str__(self) -> str:
        return "Optimizer.state_dict"


class _Unbox:
    def __call__(self, box: Any) -> list[Any]:
        from torch.distributed.tensor import DTensor

        return [x for x in pytree.tree_leaves(box.value) if isinstance(x, DTensor)]

    def __str__(self) -> str:
        return "Optimizer.state_dict"


class _LoadState:
    def __init__(self, hyper: list[dict[str, Any]]) -> None:
        self.hyper = hyper

    def __call__(self, opt: Any, state: dict[Any, Any]) -> None:
        groups = [{**h, "params": g["params"]} for h, g in zip(self.hyper, opt.state_dict()["param_groups"])]
        # copies: torch keeps the loaded tensors, and a handle the user holds must not change with the steps
        state = pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)
        opt.load_state_dict({"state": state, "param_groups": groups})

    def __str__(self) -> str:
        return "Optimizer.load_state_dict"


class _Step:
    def __init__(self, hyper: list[dict[str, Any]] | None = None) -> None:
        self.hyper = hyper

    def __call__(self, opt: Any) -> None:
        if self.hyper is not None:
            for g, h in zip(opt.param_groups, self.hyper):
                g.update(h)
        opt.step()

    def __str__(self) -> str:
        return "Optimizer.step"


class _ZeroGrad:
    def __init__(self, set_to_none: bool = True) -> None:
        self.set_to_none = set_to_none

    def __call__(self, opt: Any) -> None:
        opt.zero_grad(set_to_none=self.set_to_none)

    def __str__(self) -> str:
        return "Optimizer.zero_grad"


def _ref(p: MeshTensor) -> Any:
    from ._ops import Ref

    return Ref(p._id)


def _ref_id(i: int) -> Any:
    from ._ops import Ref

    return Ref(i)


def stats(procs: ProcMesh) -> dict[str, Any]:
    """What the mesh's tensor engine sent and received: messages sent, bytes of values received."""
    e = engine_for(procs)
    return {"messages_sent": e.messages_sent, "bytes_received": e.bytes_received, "backend": e.backend}


__all__ += ["Engine"]
