"""Mends to torch's DTensor sharding strategies, installed alike on the controller (its dry run
on meta shadows) and on the ranks, so both pick the same placements.

torch 2.13's ``aten.gather`` strategy offers placements that give wrong values or fail, where
a replicated gather (the strategy it always also offers) gives torch's:

- ``Shard(d)`` of input, index and output along a dim ``d`` other than ``dim`` is offered
  whatever the sizes there, but the pieces line up only when input and index have the same
  size on ``d`` (the scatter strategies check it; gather does not): ``t.gather(1, idx)`` with
  ``idx`` of fewer rows than ``t`` gathered a row from the wrong one, without a word;
- the input sharded along ``dim`` with the index masked (``_MaskPartial``) fails on a rank
  whose piece of ``dim`` is empty (``index 0 is out of bounds``), and mixed with the index
  sharded on another mesh dim, or the input sharded along ``dim`` on two, fails or is wrong
  (a mask of another piece's shape; offsets of one mesh dim's piece).

Those are dropped from what the strategy offers; DTensor then redistributes to one that holds.

``aten.embedding`` (``F.embedding`` of a weight sharded by rows) has the same masked strategy,
expanded over the mesh's dims from one dim's (``_embedding_holds``), and the same faults.
``aten.nll_loss_forward`` (``F.cross_entropy``, ``F.nll_loss``) averages the pieces' means;
its handler (``_nll_loss_forward``) divides the batch's sums instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, _sharding_prop
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpStrategy
from torch.distributed.tensor._ops._math_ops import Reduction
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import _MaskPartial

aten = torch.ops.aten


def _masked_holds(spec: Any, dim: int, size: int, index_now: Any, mesh: Any) -> bool:
    """Whether ``spec`` (output, then a tensor indexed along ``dim`` of ``size``, then the index)
    holds where the index is masked (``_MaskPartial``) on some mesh dim. The mask is made from the
    index's piece when it is redistributed to it: a piece of a sharded index (or one sharded
    after) is masked with another shape than the output's; the mask's offsets are those of the
    indexed tensor's piece along one mesh dim alone; a rank whose piece is empty has nothing to
    index."""
    inp, index = spec.input_specs[0].placements, spec.input_specs[1].placements
    masked = [m for m, p in enumerate(index) if isinstance(p, _MaskPartial)]
    if not masked:
        return True
    if len(masked) > 1 or any(not p.is_replicate() for p in index_now):
        return False
    for m, (p, q) in enumerate(zip(inp, index, strict=True)):
        if m not in masked and (not q.is_replicate() or (isinstance(p, Shard) and p.dim == dim)):
            return False
    n = mesh.size(masked[0])
    return all(Shard.local_shard_size_and_offset(size, n, c)[0] for c in range(n))


def _holds(spec: Any, dim: int, input_shape: Any, index_shape: Any, index_now: Any, mesh: Any) -> bool:
    """Whether one of gather's offered placements (``spec``: output, then input and index) gives
    torch's values; ``index_now``: the index's placements before the op."""
    for p in spec.input_specs[1].placements:
        if isinstance(p, Shard) and p.dim != dim and input_shape[p.dim] != index_shape[p.dim]:
            return False
    return _masked_holds(spec, dim, input_shape[dim], index_now, mesh)


def _gather_strategy(strategy: Any, op_schema: Any) -> Any:
    out = strategy(op_schema)
    input_strategy, dim, index_strategy = op_schema.args_schema[:3]
    dim %= max(1, input_strategy.ndim)
    mesh = op_schema.get_mesh_from_args()
    index_now = index_strategy.strategies[0].output_spec.placements
    return _kept(out, lambda s: _holds(s, dim, input_strategy.shape, index_strategy.shape, index_now, mesh))


def _embedding_holds(spec: Any, weight_shape: Any, index_now: Any, mesh: Any) -> bool:
    """Whether one of embedding's offered placements (output, then weight and indices) gives
    torch's values. torch offers the weight ``Shard(0)`` with the indices masked
    (``_MaskPartial``) on any mesh dims, whatever else: it fails on a rank whose weight piece is
    empty (``index_select(): self indexing axis dim should be positive``), masked on two mesh dims
    (``MaskBuffer has been materialized with conflicting data``), or with the indices sharded on
    another mesh dim, before or after (a mask of another piece's shape)."""
    return _masked_holds(spec, 0, weight_shape[0], index_now, mesh)


def _embedding_kept(out: Any, op_schema: Any, mesh: Any) -> Any:
    weight_strategy, index_strategy = op_schema.args_schema[:2]
    index_now = index_strategy.strategies[0].output_spec.placements
    return _kept(out, lambda s: _embedding_holds(s, weight_strategy.shape, index_now, mesh))


def _kept(out: Any, holds: Any) -> Any:
    kept = [s for s in out.strategies if holds(s)]
    # all-replicate is always offered and always holds, so something is always kept
    return OpStrategy(kept) if kept and len(kept) != len(out.strategies) else out


def _spec(mesh: Any, placements: Any, t: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))


def _nll_loss_forward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor's handler of ``aten.nll_loss_forward`` (and ``_2d``): a mean loss is the sum of
    the losses over the sum of the weights of the whole batch, both summed across the pieces
    (one all-reduce of two scalars) and divided on each rank.

    torch offers the mean of a batch-sharded input as ``Partial("avg")`` of the pieces' means,
    which is torch's mean only where every piece has the same total weight: with
    ``ignore_index`` hit (-100, the default, is how padding is labelled) or class weights, it
    was the mean of the pieces' means (nan where a piece is all ignored), without a word, and
    a batch that does not split evenly was refused. The batch stays sharded; the total weight
    handed back (autograd keeps it for the backward, which divides by it) is the whole
    batch's, so each piece's gradient is torch's too."""
    disp = DTensor._op_dispatcher
    names = [a.name for a in op_call._schema.arguments]
    full = [*args, *(kwargs[n] for n in names[len(args) :])]
    mean = full[3] == Reduction.MEAN.value
    if mean:
        full[3] = Reduction.SUM.value
    op_info = disp.unwrap_to_op_info(op_call, tuple(full), {})
    disp.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    assert sharding is not None
    local: Any = disp._dispatch_get_local_results_slow_path(op_call, tuple(full), op_info)
    if not mean:
        return disp.wrap(local, sharding.output_spec)
    loss: torch.Tensor = local[0]
    total: torch.Tensor = local[1]
    spec: Any = sharding.output_spec[0]  # type: ignore[index]
    mesh = spec.mesh
    whole = tuple(Replicate() for _ in range(mesh.ndim))
    if any(p.is_partial() for p in spec.placements):
        both = torch.stack([loss, total.to(loss.dtype)])
        both = redistribute_local_tensor(both, _spec(mesh, spec.placements, both), _spec(mesh, whole, both))
        loss, total = both[0], both[1].to(total.dtype)
    loss = loss / total
    return tuple(disp.wrap(t, _spec(mesh, whole, t)) for t in (loss, total))


#: ops whose strategy torch writes for one mesh dim (expanded over the mesh's dims by
#: ``_expand_single_dim_strategy_to_mesh``): what filters the expanded strategy
_SINGLE_DIM_MENDS: dict[Any, Any] = {aten.embedding.default: _embedding_kept}


def _expand_mended(expand: Any, mesh: Any, op_schema: Any, info: Any, out_meta: Any) -> Any:
    expanded = expand(mesh, op_schema, info, out_meta)
    mend = _SINGLE_DIM_MENDS.get(op_schema.op)
    if mend is None:
        return expanded

    def mended(op: Any, args: Any, kwargs: Any) -> Any:
        out = expanded(op, args, kwargs)
        return mend(out, op_schema, mesh) if isinstance(out, OpStrategy) else out

    return mended


def install() -> None:
    """Replace the strategies mended here in DTensor's registry (once; idempotent)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    funcs = prop.op_strategy_funcs
    current = funcs.get(aten.gather.default)
    if current is not None and not isinstance(current, functools.partial):
        funcs[aten.gather.default] = functools.partial(_gather_strategy, current)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
        handlers.setdefault(op, _nll_loss_forward)
    expand = _sharding_prop._expand_single_dim_strategy_to_mesh
    if not isinstance(expand, functools.partial):
        _sharding_prop._expand_single_dim_strategy_to_mesh = functools.partial(_expand_mended, expand)
    # placements already decided for gather's shapes were decided by the old strategy
    clear = getattr(prop.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()
