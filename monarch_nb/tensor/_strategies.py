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
``aten.nll_loss_forward`` (``F.cross_entropy``, ``F.nll_loss``) averages the pieces' means
(``_nll_loss_strategy``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, _sharding_prop
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
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


def _nll_loss_strategy(strategy: Any, op_schema: Any) -> Any:
    """torch offers the mean loss of a batch-sharded input as ``Partial("avg")`` of the pieces'
    means, which is torch's mean only where every piece has the same total weight: with
    ``ignore_index`` hit (-100, the default, is how padding is labelled) or class weights, it is
    the mean of the pieces' means (nan where a piece is all ignored), without a word. The mean
    is taken over the whole batch instead (inputs replicated; ``reduction="sum"`` divided by
    the count keeps the batch sharded)."""
    out = strategy(op_schema)
    if op_schema.args_schema[3] != 1:  # Reduction.MEAN
        return out
    mesh = op_schema.get_mesh_from_args()
    tensors = [a for a in op_schema.args_schema[:3] if isinstance(a, OpStrategy)]
    whole = tuple(Replicate() for _ in range(mesh.ndim))
    specs = []
    for spec in out.strategies:
        if not any(isinstance(p, Partial) and p.reduce_op == "avg" for p in spec.output_specs[0].placements):
            specs.append(spec)
            continue
        inputs = [DTensorSpec(mesh, whole, tensor_meta=i.tensor_meta) for i in spec.input_specs]
        specs.append(
            OpSpec(
                output_specs=tuple(DTensorSpec(mesh, whole, tensor_meta=o.tensor_meta) for o in spec.output_specs),
                input_specs=inputs,
                redistribute_cost=[generate_redistribute_costs(t, i) for t, i in zip(tensors, inputs, strict=True)],
            )
        )
    return OpStrategy(specs)


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
    mends = {
        aten.gather.default: _gather_strategy,
        aten.nll_loss_forward.default: _nll_loss_strategy,
        aten.nll_loss2d_forward.default: _nll_loss_strategy,
    }
    for op, mend in mends.items():
        current = funcs.get(op)
        if current is not None and not isinstance(current, functools.partial):
            funcs[op] = functools.partial(mend, current)
    expand = _sharding_prop._expand_single_dim_strategy_to_mesh
    if not isinstance(expand, functools.partial):
        _sharding_prop._expand_single_dim_strategy_to_mesh = functools.partial(_expand_mended, expand)
    # placements already decided for gather's shapes were decided by the old strategy
    clear = getattr(prop.propagate_op_sharding, "cache_clear", None)
    if clear is not None:
        clear()
