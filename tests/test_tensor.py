"""Mesh tensors (monarch_nb.tensor): every supported op against the same op on a plain local
tensor, on a 1-D {gpus: 4} and a 2-D {hosts: 2, gpus: 2} mesh of real procs (gloo)."""

from __future__ import annotations

import gc
import inspect
import itertools
import logging
import math
import os
import re
import time

import _gate
import pytest
import torch
import torch.nn.functional as F

import monarch_nb.tensor as mt
from monarch_nb.actor import Actor, concurrent_endpoint, endpoint, this_host
from monarch_nb.errors import MeshClosedError, SupervisionError
from monarch_nb.tensor import Partial, Replicate, Shard, TensorOpError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def float64():  # type: ignore[no-untyped-def]
    """The oracle compares in float64 (the ranks get the dtype with each tensor or factory)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def mesh1():  # type: ignore[no-untyped-def]
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="tensor1d")
    yield procs
    procs.stop().get(timeout=30)


@pytest.fixture(scope="module")
def mesh2():  # type: ignore[no-untyped-def]
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="tensor2d")
    yield procs
    procs.stop().get(timeout=30)


@pytest.fixture(params=["1d", "2d"])
def procs(request, mesh1, mesh2):  # type: ignore[no-untyped-def]
    return mesh1 if request.param == "1d" else mesh2


def gen(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


#: placements of the first input, per mesh rank: Shard(0), Shard(1), Replicate(), Partial()
PLACEMENTS = {
    1: {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()], "P": [Partial()]},
    2: {
        "S0": [Shard(0), Replicate()],
        "S1": [Replicate(), Shard(1)],
        "R": [Replicate(), Replicate()],
        "P": [Partial(), Shard(0)],
    },
}


def fit(placements: list, ndim: int) -> list:
    """The same placements for a tensor of ``ndim`` dims (a Shard past its last dim replicates)."""
    return [Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in placements]


# name -> (fn, shapes of its inputs); each input is distributed, then fn runs on the handles
# and on the local tensors
OPS = {
    "add": (lambda a, b: a + b, [(8, 6), (8, 6)]),
    "sub_scalar": (lambda a: 1.5 - a, [(8, 6)]),
    "mul": (lambda a, b: a * b, [(8, 6), (8, 6)]),
    "div": (lambda a: a / 4 + a / (a.abs() + 1), [(8, 6)]),
    "neg_pow": (lambda a: (-a) ** 2, [(8, 6)]),
    "matmul": (lambda a, b: a @ b, [(8, 6), (6, 4)]),
    "torch_matmul": (lambda a, b: torch.matmul(a, b), [(8, 6), (6, 4)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(8, 6), (4, 6), (4,)]),
    "relu": (lambda a: torch.relu(a), [(8, 6)]),
    "F_relu": (lambda a: F.relu(a), [(8, 6)]),
    "gelu": (lambda a: F.gelu(a), [(8, 6)]),
    "softmax": (lambda a: F.softmax(a, dim=-1), [(8, 6)]),
    "log_softmax": (lambda a: F.log_softmax(a, dim=1), [(8, 6)]),
    "sum": (lambda a: a.sum(), [(8, 6)]),
    "sum_dim0": (lambda a: a.sum(dim=0), [(8, 6)]),
    "sum_dim1": (lambda a: torch.sum(a, dim=1), [(8, 6)]),
    "mean": (lambda a: a.mean(), [(8, 6)]),
    "mean_dim1": (lambda a: a.mean(dim=1), [(8, 6)]),
    "transpose": (lambda a: a.transpose(0, 1), [(8, 6)]),
    "T": (lambda a: a.T @ a, [(8, 6)]),
    "view": (lambda a: a.view(48), [(8, 6)]),
    "reshape": (lambda a: a.reshape(4, 12), [(8, 6)]),
    "slice_rows": (lambda a: a[2:6], [(8, 6)]),
    "slice_cols": (lambda a: a[:, 1:4], [(8, 6)]),
    "index": (lambda a: a[3], [(8, 6)]),
    # Python's reflected and unary operators: a plain int or bool on the left, + on the handle
    "reflected": (lambda a: 7 // (a.abs() + 1) + 5 % (a.abs() + 1) + (+a), [(8, 6)]),
    "bitwise": (lambda a, b: ((a > 0) ^ (b > 0)) | (True & (a < b)), [(8, 6), (8, 6)]),
}


@pytest.mark.parametrize("pl", ["S0", "S1", "R", "P"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_matches_local(procs, op, pl):  # type: ignore[no-untyped-def]
    fn, shapes = OPS[op]
    placements = PLACEMENTS[len(procs.extent)][pl]
    local = [gen(*s, seed=i) for i, s in enumerate(shapes)]
    handles = [mt.distribute(t, procs, fit(placements, t.ndim)) for t in local]
    out = fn(*handles)
    want = fn(*local)
    assert isinstance(out, mt.MeshTensor)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(mt.inspect(out), want)


def _in_place_and_shifts(a):  # type: ignore[no-untyped-def]
    a = a * 1
    a **= 2
    a %= 3
    b = a > 1
    b ^= a > 0
    b |= a < 0.5
    b &= a < 2
    c = b.int() + (a * 4).int()
    c <<= 3
    c >>= 1
    # DTensor's own Tensor.__lshift__ / __rshift__ return their input unshifted (torch 2.13):
    # the handle's must shift, as a plain tensor's do
    return (c << 2) + (c >> 1) + (2 << c % 4) + (256 >> c % 4)


@pytest.mark.parametrize("pl", ["S0", "S1", "R"])
def test_in_place_and_shift_operators_run_on_the_ranks(procs, pl):  # type: ignore[no-untyped-def]
    t = gen(8, 6)
    h = mt.distribute(t, procs, PLACEMENTS[len(procs.extent)][pl])
    out = _in_place_and_shifts(h)
    assert isinstance(out, mt.MeshTensor)
    torch.testing.assert_close(mt.inspect(out), _in_place_and_shifts(t))


#: per mesh rank, the placements of the LocalTensorMode oracle (one set per mesh keeps it short;
#: the value oracle above covers every placement)
LTM_PLACEMENTS = {1: "S0", 2: "S1"}


@pytest.mark.parametrize("op", sorted(OPS))
def test_each_ranks_piece_matches_local_tensor_mode(procs, op):  # type: ignore[no-untyped-def]
    """torch's LocalTensorMode runs the same DTensor program for every rank in this process:
    each rank's local tensor (Partial pieces included) and the placements must be its."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    fn, shapes = OPS[op]
    e = mt._engine.engine_for(procs)
    placements = PLACEMENTS[len(procs.extent)][LTM_PLACEMENTS[len(procs.extent)]]
    local = [gen(*s, seed=i) for i, s in enumerate(shapes)]
    out = fn(*[mt.distribute(t, procs, fit(placements, t.ndim)) for t in local])
    futs = [mt.fetch_shard(out, dict(zip(e.labels, e.coords_of(r)))) for r in range(e.size)]
    with LocalTensorMode(frozenset(range(e.size))):
        mesh = init_device_mesh("cpu", e.sizes, mesh_dim_names=e.labels)
        want = fn(*[distribute_tensor(t, mesh, fit(placements, t.ndim)) for t in local])
        pieces = want.to_local()._local_tensors
    assert out.placements == want.placements and out.shape == want.shape
    for r, f in enumerate(futs):
        torch.testing.assert_close(f.get(timeout=30), pieces[r], msg=lambda m, r=r: f"rank {r}: {m}")


def test_a_mean_loss_over_pieces_of_different_sizes_is_refused_not_biased(mesh1):  # type: ignore[no-untyped-def]
    # torch's DTensor makes F.mse_loss (and smooth_l1, huber, bce_with_logits) Partial("avg") of
    # each rank's own mean: 7 rows over 4 ranks (2, 2, 2, 1) gave 1.112 for 1.138, without a word
    x, y = gen(7, 5), gen(7, 5, seed=1)
    a, b = mt.distribute(x, mesh1, [Shard(0)]), mt.distribute(y, mesh1, [Shard(0)])
    sent = mt.stats(mesh1)["messages_sent"]
    for loss in (F.mse_loss, F.smooth_l1_loss, F.huber_loss):
        with pytest.raises(
            TensorOpError, match=r"differ in size \(gpus=0 holds \[2, 5\], gpus=3 holds \[1, 5\].*biased mean.*reduction='sum'"
        ):
            loss(a, b)
    assert mt.stats(mesh1)["messages_sent"] == sent
    # what it says to do gives the mean; even pieces are averaged as before
    torch.testing.assert_close(mt.inspect(F.mse_loss(a, b, reduction="sum") / x.numel()), F.mse_loss(x, y))
    even = mt.distribute(gen(8, 5), mesh1, [Shard(0)])
    torch.testing.assert_close(mt.inspect(F.mse_loss(even, even * 2)), F.mse_loss(gen(8, 5), gen(8, 5) * 2))


def test_an_argmax_over_an_empty_piece_is_refused_before_it_hangs(mesh1):  # type: ignore[no-untyped-def]
    # torch 2.13's DTensor argmax/argmin fail on a rank whose piece is empty while the other
    # ranks wait for it in the op's all-gather: reading the result took COLLECTIVE_TIMEOUT_S and
    # broke the mesh's process group for every tensor
    cols, rows = gen(3, 5), gen(3, 4)
    t = mt.distribute(cols, mesh1, [Shard(1)])  # pieces of 2, 2, 1, 0 columns
    r = mt.distribute(rows, mesh1, [Shard(0)])  # 1, 1, 1, 0 rows
    sent = mt.stats(mesh1)["messages_sent"]
    line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
    refused = {
        "t.argmax()": (lambda: t.argmax(), "5 along dim 1 sharded over the 4 ranks of 'gpus' makes pieces of 2, 2, 1, 0"),
        "t.argmin()": (lambda: torch.argmin(t), "5 along dim 1"),
        "t.argmax(1)": (lambda: t.argmax(-1, keepdim=True), "5 along dim 1"),
        "t.argmin(0)": (lambda: r.argmin(0), "3 along dim 0 sharded over the 4 ranks of 'gpus' makes pieces of 1, 1, 1, 0"),
    }
    for i, (what, (op, why)) in enumerate(refused.items()):
        with pytest.raises(TensorOpError) as err:
            op()
        text = str(err.value)
        assert text.startswith(f"{what} of a mesh tensor of shape"), text
        assert "refused, nothing sent: the piece of gpus=3 is empty (" + why in text, text
        assert "wait for it in the op's all-gather, for mt.COLLECTIVE_TIMEOUT_S" in text, text
        assert "Redistribute it first (t.redistribute(placements=[Replicate()])." in text, text
        assert text.splitlines()[-1].startswith(f"issued by {__file__}:{line + 2 + i}: "), text
    assert mt.stats(mesh1)["messages_sent"] == sent
    # the tensors and the mesh's process group stay usable; what it says to do gives torch's answer
    start = time.monotonic()
    assert mt.inspect(t.redistribute(placements=[Replicate()]).argmax()).item() == cols.argmax().item()
    torch.testing.assert_close(mt.inspect(t.argmax(0)), cols.argmax(0))  # not along the sharded dim: runs
    torch.testing.assert_close(mt.inspect(r.argmax(1)), rows.argmax(1))
    assert time.monotonic() - start < mt.COLLECTIVE_TIMEOUT_S
    torch.testing.assert_close(mt.inspect(t * 2), cols * 2)


#: gather's (input shape, index shape, dim) where torch 2.13's DTensor picks placements that do
#: not hold: an index of fewer rows sharded like the input's rows (a row from the wrong one), an
#: input sharded along ``dim`` with a rank's piece empty or over two mesh dims (IndexError)
GATHERS = [((3, 8), (2, 5), 1), ((4, 5), (4, 1), 1), ((3, 7), (2, 1), 1), ((5, 6), (3, 6), 0), ((3, 7), (3, 7), 1)]
GATHER_PLACEMENTS = {
    1: [[Shard(0)], [Shard(1)], [Replicate()]],
    2: [[Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(1), Shard(0)], [Shard(1), Shard(1)], [Replicate(), Replicate()]],
}


def test_gather_gives_torchs_values_whatever_the_placements(procs):  # type: ignore[no-untyped-def]
    # without the mend (tensor/_strategies.py) 11 of these 50 pairs on the 2-D mesh gave wrong
    # values, without a word, and others failed on the ranks: torch's own DTensor does the same
    g = torch.Generator().manual_seed(3)
    pairs = GATHER_PLACEMENTS[len(procs.extent)]
    for shape, index_shape, dim in GATHERS:
        t = torch.randn(*shape, generator=g)
        idx = torch.randint(0, shape[dim], index_shape, generator=g)
        want = t.gather(dim, idx)
        for a, b in itertools.product(pairs, pairs):
            got = mt.inspect(mt.distribute(t, procs, a).gather(dim, mt.distribute(idx, procs, b)))
            assert torch.equal(got, want), f"{shape}.gather({dim}, {index_shape}) with {a} and {b}:\n{got}\n{want}"
    # torch.take_along_dim is gather under the hood
    x, i = gen(4, 8), torch.randint(0, 8, (4, 5), generator=g)
    got = mt.inspect(torch.take_along_dim(mt.distribute(x, procs, pairs[0]), mt.distribute(i, procs, pairs[0]), 1))
    assert torch.equal(got, torch.take_along_dim(x, i, 1))


def test_a_mean_cross_entropy_with_ignored_targets_or_class_weights_gives_torchs_value(procs):  # type: ignore[no-untyped-def]
    # torch 2.13's DTensor averaged the pieces' means of a batch-sharded loss: with targets
    # ignored (-100 labels padding) or class weights that is not the mean, and nan where a
    # piece is all ignored, without a word
    x = gen(8, 3)
    y = torch.tensor([-100, -100, -100, -100, 2, 1, 2, 1])
    w = torch.tensor([0.2, 1.0, 3.0])
    n = len(procs.extent)
    for pl in ([Shard(0)] + [Replicate()] * (n - 1), [Replicate()] * (n - 1) + [Shard(0)], [Shard(1)] * n):
        xs = mt.distribute(x, procs, pl)
        ys = mt.distribute(y, procs, [Shard(0)] + [Replicate()] * (n - 1))
        for kw in ({}, {"label_smoothing": 0.1}, {"weight": w}):
            yy = y.clamp(min=0) if kw.get("weight") is not None else y
            want = F.cross_entropy(x, yy, **kw)
            got = F.cross_entropy(xs, ys.clamp(min=0) if "weight" in kw else ys, **kw)
            torch.testing.assert_close(mt.inspect(got), want, msg=lambda m, pl=pl, kw=kw: f"{pl} {kw}: {m}")


def test_a_mean_cross_entropy_of_a_batch_sharded_input_keeps_the_logits_sharded(procs):  # type: ignore[no-untyped-def]
    # its mean was taken over the input replicated (all-gathered logits: a batch x 128k-vocab
    # piece per rank onto every rank, every step); the batch's sums are all-reduced instead.
    # Batches that split unevenly (7 or 3 rows on 4 ranks) were refused; now they give torch's
    from torch.distributed.tensor.debug import CommDebugMode

    n = len(procs.extent)
    for rows in (8, 7, 3):
        x, y = gen(rows, 50, seed=rows), torch.randint(0, 50, (rows,), generator=torch.Generator().manual_seed(rows))
        y[0] = -100
        xs = mt.distribute(x, procs, [Shard(0)] + [Replicate()] * (n - 1)).requires_grad_()
        ys = mt.distribute(y, procs, [Shard(0)] + [Replicate()] * (n - 1))
        with CommDebugMode() as comms:  # the controller plans each rank's collectives on its shadows
            loss = F.cross_entropy(xs, ys)
        assert {str(op) for op in comms.get_comm_counts()} == {"c10d_functional.all_reduce"}, (rows, comms.get_comm_counts())
        loss.backward()
        xl = x.clone().requires_grad_()
        want = F.cross_entropy(xl, y)
        want.backward()
        torch.testing.assert_close(mt.inspect(loss), want.detach(), msg=lambda m, r=rows: f"{r} rows: {m}")
        torch.testing.assert_close(mt.inspect(xs.grad), xl.grad, msg=lambda m, r=rows: f"{r} rows, gradient: {m}")
        assert xs.grad.placements == xs.placements


#: ops that docs/tensors.md says give torch's value on a tensor with an empty piece
EMPTY_PIECE_OPS = {
    "sort": lambda t, d: tuple(t.sort(d)),
    "argsort": lambda t, d: t.argsort(d),
    "topk": lambda t, d: tuple(t.topk(2, d)),
    "median": lambda t, d: tuple(t.median(d)),
    "nanmedian": lambda t, d: tuple(t.nanmedian(d)),
    "mode": lambda t, d: tuple(t.round().mode(d)),
    "kthvalue": lambda t, d: tuple(t.kthvalue(2, d)),
    "max(dim)": lambda t, d: tuple(t.max(d)),
    "min(dim)": lambda t, d: tuple(t.min(d)),
    "cumsum": lambda t, d: t.cumsum(d),
    "cummax": lambda t, d: tuple(t.cummax(d)),
    "softmax": lambda t, d: t.softmax(d),
    "logsumexp": lambda t, d: t.logsumexp(d),
    "norm(3)": lambda t, d: t.norm(3, d),
    "std": lambda t, d: t.std(d),
    "var": lambda t, d: t.var(d),
}


def test_ops_over_a_tensor_with_an_empty_piece_give_torchs_values(mesh1):  # type: ignore[no-untyped-def]
    # 5 columns on 4 ranks: pieces of 2, 2, 1 and 0 columns; along the sharded dim and the other
    t = gen(6, 5) * 3
    x = mt.distribute(t, mesh1, [Shard(1)])
    for name, fn in EMPTY_PIECE_OPS.items():
        for d in (1, 0):
            got = fn(x, d)
            got = tuple(map(mt.inspect, got)) if isinstance(got, tuple) else mt.inspect(got)
            torch.testing.assert_close(got, fn(t, d), msg=lambda m, name=name, d=d: f"{name} along dim {d}: {m}")


#: F.embedding's weight placements where torch 2.13's DTensor masks the indices into a weight
#: sharded by rows and fails: an empty piece (5 rows on 4 ranks), masked on two mesh dims, the
#: indices sharded on the other mesh dim; and a few that held
EMBEDDING_PLACEMENTS = {
    1: [[Shard(0)], [Shard(1)], [Replicate()]],
    2: [[Shard(0), Shard(0)], [Shard(0), Replicate()], [Shard(1), Shard(0)], [Replicate(), Shard(1)]],
}


def test_embedding_gives_torchs_values_whatever_the_placements(procs):  # type: ignore[no-untyped-def]
    # without the mend (tensor/_strategies.py) rows of the weight on 4 ranks failed with
    # "index_select(): self indexing axis dim should be positive" on the empty piece's rank
    g = torch.Generator().manual_seed(4)
    pls = EMBEDDING_PLACEMENTS[len(procs.extent)]
    index_pls = [pls[-1], [Shard(0)] + [Replicate()] * (len(pls[0]) - 1), [Replicate()] * len(pls[0])]
    for rows, cols in [(5, 6), (3, 7)]:
        w, i = torch.randn(rows, cols, generator=g), torch.randint(0, rows, (2, 5), generator=g)
        want = F.embedding(i, w)
        for a, b in itertools.product(pls, index_pls):
            got = mt.inspect(F.embedding(mt.distribute(i, procs, b), mt.distribute(w, procs, a)))
            assert torch.equal(got, want), f"embedding of {(rows, cols)} with {a} and {b}:\n{got}\n{want}"


def _clamp_to_max(x):  # type: ignore[no-untyped-def]
    return x.clamp(max=x.amax())


@pytest.mark.timeout(20)  # well under COLLECTIVE_TIMEOUT_S (60 s), which is what it waited
def test_a_max_over_an_empty_piece_is_refused_before_an_op_on_it_hangs(mesh1):  # type: ignore[no-untyped-def]
    # max(), amax(), aminmax() ... over the sharded dim failed on the empty rank alone; an op
    # with a collective on that result (clamp all-reduces the Partial max) had the other ranks
    # wait for it until COLLECTIVE_TIMEOUT_S, the empty rank's next collective paired with theirs
    # (a garbled error, or gloo aborting a rank), and the mesh's process group was broken
    cols, rows = gen(3, 5), gen(3, 4)
    t = mt.distribute(cols, mesh1, [Shard(1)])  # pieces of 2, 2, 1, 0 columns
    r = mt.distribute(rows, mesh1, [Shard(0)])  # 1, 1, 1, 0 rows
    sent = mt.stats(mesh1)["messages_sent"]
    cut_cols = "5 along dim 1 sharded over the 4 ranks of 'gpus' makes pieces of 2, 2, 1, 0"
    cut_rows = "3 along dim 0 sharded over the 4 ranks of 'gpus' makes pieces of 1, 1, 1, 0"
    refused = {
        "t.max()": (lambda: mt.inspect(t.clamp(max=t.max())), cut_cols),
        "t.aminmax(dim=0)": (lambda: mt.inspect(r - torch.aminmax(r, dim=0).min), cut_rows),
        "t.amin((0, 1))": (lambda: mt.inspect(t / t.amin((1, -2), keepdim=True)), cut_cols),
        "t.amax()": (lambda: mt.inspect(mt.remote(_clamp_to_max)(t)), cut_cols),
        "t.norm(float('inf'))": (lambda: mt.inspect(t / t.norm(float("inf"))), cut_cols),
    }
    for what, (op, why) in refused.items():
        start = time.monotonic()
        with pytest.raises(TensorOpError) as err:
            op()
        assert time.monotonic() - start < 5
        text = str(err.value)
        assert text.startswith(f"{what} of a mesh tensor of shape"), text
        assert "refused, nothing sent: the piece of gpus=3 is empty (" + why in text, text
        assert "an op with a collective on its result (t.clamp(max=t.max()), a redistribute" in text, text
        assert f"Redistribute it first (t.redistribute(placements=[Replicate()]).{what[2:]})" in text, text
        # the user's line, also for an op inside an mt.remote fn
        fn = _clamp_to_max if what == "t.amax()" else op
        at = fn.__code__.co_firstlineno + (fn is _clamp_to_max)
        assert text.splitlines()[-1].startswith(f"issued by {__file__}:{at}: "), text
    assert mt.stats(mesh1)["messages_sent"] == sent
    # the mesh's process group still works; what it says to do, and a dim not sharded, give torch's values
    start = time.monotonic()
    whole = t.redistribute(placements=[Replicate()])
    torch.testing.assert_close(mt.inspect(t.clamp(max=whole.max())), cols.clamp(max=cols.max()))
    torch.testing.assert_close(mt.inspect(t - t.amax(0)), cols - cols.amax(0))
    torch.testing.assert_close(mt.inspect(t / t.norm(float("inf"), dim=0)), cols / cols.norm(float("inf"), dim=0))
    torch.testing.assert_close(mt.inspect(t / t.norm()), cols / cols.norm())
    lo, hi = torch.aminmax(r, dim=1)
    torch.testing.assert_close((mt.inspect(lo), mt.inspect(hi)), tuple(torch.aminmax(rows, dim=1)))
    assert time.monotonic() - start < 10


def test_cross_entropy_with_a_local_target(procs):  # type: ignore[no-untyped-def]
    logits, target = gen(8, 5), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    for pl in PLACEMENTS[len(procs.extent)].values():
        loss = F.cross_entropy(mt.distribute(logits, procs, pl), target)
        assert loss.shape == ()
        torch.testing.assert_close(mt.inspect(loss), F.cross_entropy(logits, target))


PAIRS = list(itertools.product(["S0", "S1", "R", "P"], repeat=2))


@pytest.mark.parametrize("src,dst", PAIRS)
def test_redistribute_between_every_pair(procs, src, dst):  # type: ignore[no-untyped-def]
    e = mt._engine.engine_for(procs)
    pl = PLACEMENTS[len(procs.extent)]
    t = gen(8, 6)
    h = mt.distribute(t, procs, pl[src])
    if dst == "P" and src != "P":
        # DTensor itself refuses (Partial is for its internal use): said on the controller, nothing sent
        sent = mt.stats(procs)["messages_sent"]
        with pytest.raises(TensorOpError, match="redistribute"):
            h.redistribute(placements=pl[dst])
        assert mt.stats(procs)["messages_sent"] == sent
        return
    r = h.redistribute(placements=pl[dst])
    assert r.placements == tuple(pl[dst])
    torch.testing.assert_close(mt.inspect(r), t)
    # every rank holds the piece its placement says
    coords = [dict(zip(e.labels, e.coords_of(k))) for k in range(e.size)]
    for c, f in [(c, mt.fetch_shard(r, c)) for c in coords]:
        assert list(f.get(timeout=30).shape) == r.local_shape(**c)


def test_distribute_sends_each_rank_its_shard_even_when_uneven(mesh1):  # type: ignore[no-untyped-def]
    t = gen(7, 5)
    h = mt.distribute(t, mesh1, [Shard(0)])
    pieces = list(torch.chunk(t, 4, dim=0))
    for g in range(4):
        torch.testing.assert_close(mt.fetch_shard(h, gpus=g).get(timeout=30), pieces[g])
    torch.testing.assert_close(h.full_tensor(), t)
    assert mt.inspect(h, gpus=2).shape == (2, 5)
    rows = list(h)
    assert len(rows) == 7 and rows[6].shape == (5,)
    torch.testing.assert_close(mt.inspect(rows[6]), t[6])


def test_partial_placements_of_every_reduction_hold_the_value(procs):  # type: ignore[no-untyped-def]
    # the ranks past 0 of a Partial() dim held zeros whatever its reduction: right for a sum,
    # but Partial("max") gave max(t, 0), Partial("min") min(t, 0) and Partial("avg") t / n
    t = gen(4, 3)
    n = len(procs.extent)
    for op in ("sum", "avg", "max", "min"):
        pl = [Partial(op)] + [Replicate()] * (n - 1)
        h = mt.distribute(t, procs, pl)
        torch.testing.assert_close(mt.inspect(h), t, msg=lambda m, op=op: f"Partial({op!r}): {m}")
        torch.testing.assert_close(mt.inspect(h.redistribute(placements=[Replicate()] * n)), t)
        torch.testing.assert_close(mt.inspect(mt.ones(4, 3, procs=procs, placements=pl)), torch.ones(4, 3))


def test_factories_and_activate(mesh2):  # type: ignore[no-untyped-def]
    z = mt.zeros(4, 6, procs=mesh2, placements=[Shard(0), Shard(1)])
    assert z.shape == (4, 6) and z.placements == (Shard(0), Shard(1))
    assert mt.fetch_shard(z, hosts=1, gpus=1).get(timeout=30).shape == (2, 3)
    torch.testing.assert_close(mt.inspect(mt.ones(3, procs=mesh2) + z.sum()), torch.ones(3))
    torch.manual_seed(7)
    a = mt.inspect(mt.rand(8, 6, procs=mesh2, placements=[Shard(0), Replicate()]))
    torch.manual_seed(7)
    b = mt.rand(8, 6, procs=mesh2, placements=[Replicate(), Shard(1)])
    torch.testing.assert_close(mt.inspect(b), a)  # seeded alike, whatever the placements
    with mesh2.activate():
        r = torch.rand(3, 4)
        s = torch.rand(3, 4)
        y = (r * 2).sum(dim=0)
    assert r.placements == (Replicate(), Replicate()) and y.shape == (4,)
    ones = torch.ones(4, 6)
    with mesh2.activate():  # monarch_nb.tensor's own calls inside the block still work
        z2 = mt.zeros(4, 6, procs=mesh2, placements=[Shard(0), Shard(1)]) + mt.rand(4, 6, procs=mesh2) * 0
        d = mt.distribute(ones, mesh2) + z2
    torch.testing.assert_close(mt.inspect(d), torch.ones(4, 6))
    shards = [mt.fetch_shard(r, hosts=h, gpus=g).get(timeout=30) for h in range(2) for g in range(2)]
    assert all(torch.equal(shards[0], x) for x in shards)  # random, yet the same on every rank
    assert not torch.equal(mt.inspect(s), shards[0])
    torch.testing.assert_close(mt.inspect(y), (shards[0] * 2).sum(dim=0))
    assert not isinstance(torch.rand(2), mt.MeshTensor)  # outside the block: a plain tensor
    html = z._repr_html_()
    assert "hosts=1, gpus=1" in html and "(2, 3)" in html and "placements=(S(0), S(1))" in html


def test_a_factorys_device_is_checked_not_ignored(mesh1):  # type: ignore[no-untyped-def]
    # each rank makes its tensor on its own device: "cpu" (these ranks' kind) is fine, a typo
    # or a GPU on a CPU mesh is refused before anything is sent, in the call and in activate()
    torch.testing.assert_close(mt.inspect(mt.ones(2, procs=mesh1, device="cpu")), torch.ones(2))
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(ValueError, match="'gpu' is not a torch device name"):
        mt.zeros(2, 2, procs=mesh1, device="gpu")
    with pytest.raises(ValueError, match="live on its ranks' cpu devices"):
        mt.rand(2, 2, procs=mesh1, device="cuda")
    with mesh1.activate(), pytest.raises(ValueError, match="live on its ranks' cpu devices"):
        torch.zeros(2, device="cuda:0")
    assert mt.stats(mesh1)["messages_sent"] == sent


def test_rank_tensor_holds_each_ranks_coordinate(mesh2):  # type: ignore[no-untyped-def]
    g = mesh2.rank_tensor("gpus")
    assert g.shape == (2,) and g.placements == (Replicate(), Shard(0))
    assert [int(mt.fetch_shard(g, hosts=h, gpus=c).get(timeout=30).item()) for h in range(2) for c in range(2)] == [0, 1, 0, 1]
    total = mt.reduce(mt.rank_tensor(mesh2, "hosts"), ["hosts", "gpus"], "sum")
    assert int(mt.fetch_shard(total, gpus=1).get(timeout=30).item()) == 0 + 0 + 1 + 1


def test_reduce_combines_local_tensors_across_named_dims(mesh2):  # type: ignore[no-untyped-def]
    t = gen(8, 6)
    h = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    locals_ = {(i, j): torch.chunk(torch.chunk(t, 2, 0)[i], 2, 1)[j] for i in range(2) for j in range(2)}
    r = mt.reduce(h, "gpus", "sum")
    assert r.placements == (Shard(0), Replicate())
    for i, j in locals_:
        torch.testing.assert_close(mt.fetch_shard(r, hosts=i, gpus=j).get(timeout=30), locals_[i, 0] + locals_[i, 1])
    m = mt.reduce(h, ["hosts", "gpus"], "max")
    torch.testing.assert_close(mt.fetch_shard(m, gpus=1).get(timeout=30), torch.stack(list(locals_.values())).amax(0))
    a = mt.reduce(h, ("hosts",), "avg")
    torch.testing.assert_close(mt.fetch_shard(a, gpus=1).get(timeout=30), (locals_[0, 1] + locals_[1, 1]) / 2)
    with pytest.raises(ValueError, match="not dimensions"):
        mt.reduce(h, "nodes")
    # Monarch's signature: a pytree of tensors is reduced leaf by leaf; its scatter, mesh and
    # _inplace were swallowed by **_ (scatter=True gave an all-reduce), now refused with the way
    both = mt.reduce({"a": h, "b": [h]}, "gpus")
    torch.testing.assert_close(mt.inspect(both["b"][0]), mt.inspect(r))
    sent = mt.stats(mesh2)["messages_sent"]
    for kw, words in [("scatter", r"redistribute\(placements"), ("mesh", "to_mesh"), ("_inplace", r"t = mt.reduce")]:
        with pytest.raises(NotImplementedError, match=words):
            mt.reduce(h, "gpus", **{kw: True})
    with pytest.raises(NotImplementedError, match="scatter=True"):
        mt.reduce(h, "gpus", "sum", True)
    with pytest.raises(ValueError, match=r"'stack'.*redistribute"):
        mt.reduce(h, "gpus", "stack")
    assert mt.stats(mesh2)["messages_sent"] == sent


def test_reduce_of_pieces_of_different_shapes_is_refused_before_sending(mesh2):  # type: ignore[no-untyped-def]
    # 5 rows over hosts=2 are pieces of 3 and 2 rows: their all-reduce waited
    # COLLECTIVE_TIMEOUT_S (60 s) and left the process group broken for every tensor of the mesh
    t = gen(5, 4)
    h = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    ints = mt.distribute(torch.arange(8).reshape(4, 2), mesh2, [Shard(0), Replicate()])
    sent = mt.stats(mesh2)["messages_sent"]
    with pytest.raises(ValueError, match=r"differ in shape.*hosts=0, gpus=0 holds \[3, 2\], hosts=1, gpus=0 holds \[2, 2\].*pad"):
        mt.reduce(h, "hosts")
    with pytest.raises(ValueError, match="differ in shape"):
        h.reduce(["hosts", "gpus"], "max")
    # an average of integers cannot be kept in their dtype: said here, as torch says it, not on the ranks
    with pytest.raises(TensorOpError, match="can't be cast"):
        mt.reduce(ints, "gpus", "avg")
    assert mt.stats(mesh2)["messages_sent"] == sent
    # the 4 columns split evenly over gpus: reduced as before, and the mesh still works
    r = mt.reduce(h, "gpus")
    torch.testing.assert_close(mt.fetch_shard(r, hosts=1).get(timeout=30), t[3:, :2] + t[3:, 2:])
    torch.testing.assert_close(mt.inspect(h * 2), t * 2)


def _wait_for_flag(x: torch.Tensor, path: str) -> torch.Tensor:
    # on the controller's meta shadow this returns at once; on the ranks it blocks until released
    if x.device.type != "meta":
        _gate.wait(path, 60)
    return x


def test_shapes_are_known_while_ranks_are_blocked(mesh1, gate):  # type: ignore[no-untyped-def]
    flag = gate()
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    blocked = mt.remote(_wait_for_flag)(x, flag.path)
    try:
        y = (blocked @ blocked.T).relu().sum(dim=1)  # sent while the ranks wait: answered here
        assert y.shape == (8,) and y.placements == (Shard(0),)
        fut = mt.fetch_shard(y, gpus=3)
        assert not fut.done()
    finally:
        flag.open()
    want = (gen(8, 6) @ gen(8, 6).T).relu().sum(dim=1)
    torch.testing.assert_close(fut.get(timeout=60), want[6:])


def test_an_interrupted_inspect_says_the_read_goes_on_without_offering_a_future(mesh1, gate):  # type: ignore[no-untyped-def]
    # the note said "full_tensor() goes on, and .get() or await waits for it again": mt.inspect
    # returns a tensor, and gives the user no future to wait on
    import signal
    import threading

    from monarch_nb.actor._future import blocked

    flag = gate()
    y = mt.remote(_wait_for_flag)(mt.distribute(gen(8, 6), mesh1, [Shard(0)]), flag.path)
    main = threading.main_thread().ident or 0

    def interrupt_once_waiting() -> None:
        deadline = time.monotonic() + 30
        while main not in blocked and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)  # a kernel's interrupt

    threading.Thread(target=interrupt_once_waiting, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt) as ei:
            mt.inspect(y)
    finally:
        flag.open()
    assert getattr(ei.value, "__notes__", []) == ["monarch_nb: only the wait stopped: full_tensor() goes on."]
    torch.testing.assert_close(mt.inspect(y), gen(8, 6))


def _interrupt_main_once_waiting_on(step: str) -> None:
    """SIGINT the main thread (a kernel's interrupt) once it waits on a future of ``step``;
    never, if it does not within 30 s (the test then fails, not a later one)."""
    import signal
    import threading

    from monarch_nb.actor._future import blocked

    main = threading.main_thread().ident or 0

    def run() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            f = blocked.get(main)
            if f is not None and step in f._what:
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.002)

    threading.Thread(target=run, daemon=True).start()


def test_an_interrupted_setup_of_mesh_tensors_names_no_hidden_actor_and_the_next_op_works() -> None:
    # the first op on a mesh sets up its process group (seconds): an interrupt there said
    # "_tensor_engine.setup.call() still runs on 2 of 2 ranks ... stopping the mesh ends it now"
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        _interrupt_main_once_waiting_on("_tensor_engine.setup")
        with pytest.raises(KeyboardInterrupt) as ei:
            mt.distribute(gen(4, 4), procs, [Shard(0)])
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        want = f"the ranks of proc mesh {procs._name!r} still set up their process group for mesh tensors, and the next op waits"
        assert want in notes and "_tensor_engine" not in notes, notes
        torch.testing.assert_close(mt.inspect(mt.distribute(gen(4, 4), procs, [Shard(0)]) * 2), gen(4, 4) * 2)
    finally:
        procs.stop().get(timeout=30)


def test_showing_a_tensor_whose_ops_still_run_waits_once_and_says_so(mesh1, gate, monkeypatch):  # type: ignore[no-untyped-def]
    # a cell's display asks text/plain and text/html in turn: each waited PREVIEW_WAIT_S (10 s)
    # for the values, 20 s of a blocked cell, then showed a bare TimeoutError
    from IPython.core.formatters import DisplayFormatter

    monkeypatch.setattr(mt._engine, "PREVIEW_WAIT_S", 2.0)
    flag = gate()
    y = mt.remote(_wait_for_flag)(mt.distribute(gen(8, 6), mesh1, [Shard(0)]), flag.path)
    try:
        t0 = time.monotonic()
        shown, _ = DisplayFormatter().format(y)
        took = time.monotonic() - t0
    finally:
        flag.open()
    assert took < 3.5, "one wait for both formatters"
    for text in (shown["text/plain"], shown["text/html"]):
        assert "(not computed after 2 s: the ranks are still busy with earlier ops; mt.inspect(t) waits" in text
    assert "not computed" not in DisplayFormatter().format(y * 1)[0]["text/html"]


def test_an_error_stays_on_the_handle_that_caused_it(mesh1):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(8, 5), mesh1, [Shard(0)])
    bad = F.cross_entropy(x, torch.full((8,), 99))  # class 99 of 5: only the ranks can tell
    assert bad.shape == ()
    with pytest.raises(Exception, match="out of bounds") as first:
        mt.inspect(bad)
    later = (bad * 2).relu()
    with pytest.raises(type(first.value), match="out of bounds"):
        mt.fetch_shard(later, gpus=2).get(timeout=30)
    torch.testing.assert_close(mt.inspect(x + 1), gen(8, 5) + 1)  # the rest keeps working


def _fails_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    # data that only one rank holds can fail there alone (a label out of range in its shard)
    from monarch_nb.actor import current_rank

    if x.device.type != "meta" and current_rank().rank == 1:
        raise IndexError("index 99 is out of bounds (rank 1's shard only)")
    return x * 2


def test_an_error_on_one_rank_only_stays_on_its_handle(procs):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(8, 6), procs, [Shard(0)] + [Replicate()] * (len(procs.extent) - 1))
    bad = mt.remote(_fails_on_rank_1)(x)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rank 1's shard only"):
        mt.inspect(bad)
    # the healthy ranks did not wait in an all-gather rank 1 skipped (until the collective
    # timeout, leaving the process group broken for every later tensor)
    torch.testing.assert_close(mt.inspect(x + 1), gen(8, 6) + 1)
    assert time.monotonic() - t0 < mt.COLLECTIVE_TIMEOUT_S / 2


def _redistributed(x: torch.Tensor) -> torch.Tensor:
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim) + 0


def _over_piece_max(x: torch.Tensor) -> torch.Tensor:
    # a user's fn on each rank's piece: the max of an empty piece fails on its rank alone
    from torch.distributed.tensor import DTensor

    local = x.to_local()  # type: ignore[attr-defined]
    return DTensor.from_local(local / local.max(), x.device_mesh, x.placements, shape=x.shape, stride=x.stride())  # type: ignore[attr-defined]


@pytest.mark.timeout(60)  # each read well under COLLECTIVE_TIMEOUT_S (60 s), which is what the others waited
def test_an_op_with_a_collective_on_a_tensor_failed_on_one_rank_raises_that_error(procs):  # type: ignore[no-untyped-def]
    # a tensor whose op failed on one rank alone, then an op with a collective on it: the other
    # ranks entered the collective that rank skipped, waited there until COLLECTIVE_TIMEOUT_S,
    # its next collective (a read's) paired with theirs (an AttributeError from inspect, or
    # gloo aborting a rank: "collective mismatch"), and the mesh's process group was broken
    n = len(procs.extent)
    rest = [Replicate()] * (n - 1)
    t, cols = gen(8, 6), gen(3, 5)
    x = mt.distribute(t, procs, [Shard(0), *rest])
    at = "gpus=1" if n == 1 else "hosts=0, gpus=1"
    failed = {
        at: (mt.remote(_fails_on_rank_1)(x), "rank 1's shard only", "test_tensor._fails_on_rank_1"),
    }
    if n == 1:  # 5 columns over 4 ranks: pieces of 2, 2, 1, 0; max() of the empty one fails
        failed["gpus=3"] = (
            mt.remote(_over_piece_max)(mt.distribute(cols, procs, [Shard(1)])),
            "max\\(\\): Expected reduction dim",
            "test_tensor._over_piece_max",
        )
    for where, (bad, said, op) in failed.items():
        after = {
            "the read": lambda b: b,
            "a redistribute": lambda b: b.redistribute(placements=[Replicate()] * n),
            "clamp to its sum (an all-reduce)": lambda b: b.clamp(max=b.sum()),
            "a sharded matmul": lambda b: b @ b.T,
            "an op without a collective, then one with": lambda b: (b * 2).redistribute(placements=[Replicate()] * n),
            "two ops with collectives": lambda b: (b @ b.T).sum() + x.sum(),
            "a redistribute in an mt.remote fn": lambda b: mt.remote(_redistributed)(b),
        }
        if where == at:  # reduce refuses pieces of different shapes before sending
            after["mt.reduce"] = lambda b: mt.reduce(b, tuple(procs.extent))
        for what, make in after.items():
            start = time.monotonic()
            with pytest.raises(Exception, match=said) as err:
                mt.inspect(make(bad))
            text = str(err.value)
            assert f"Mesh tensor op {op} failed" in text, f"{what}: {text}"
            assert "AttributeError" not in text and "did not run" not in text, f"{what}: {text}"
            assert time.monotonic() - start < 10, what
        # a rank where the op did not run (its input failed on the other) says so when read alone
        with pytest.raises(Exception, match=f"did not run on this rank: an input of it failed on the rank at {where} "):
            mt.fetch_shard(bad.clamp(max=bad.sum()), {k: 0 for k in procs.extent}).get(timeout=10)
    # the mesh's process group still works
    start = time.monotonic()
    torch.testing.assert_close(mt.inspect(x.redistribute(placements=[Replicate()] * n)), t)
    torch.testing.assert_close(mt.inspect(x.clamp(max=x.sum()) @ x.T), t.clamp(max=t.sum()) @ t.T)
    assert time.monotonic() - start < 10


def test_an_error_on_the_ranks_shows_the_line_of_the_users_function_that_raised(mesh1):  # type: ignore[no-untyped-def]
    # the error is kept on the rank and raised again to each reader: its traceback must still
    # lead to the user's code, as an endpoint's does, however it is read
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    bad = mt.remote(_fails_on_rank_1)(x)
    frame = f'{__file__}", line {_fails_on_rank_1.__code__.co_firstlineno + 5}, in _fails_on_rank_1'
    reads = {
        "inspect": lambda: mt.inspect(bad),
        "fetch_shard": lambda: mt.fetch_shard(bad, gpus=1).get(timeout=30),
        "a later op": lambda: mt.inspect(bad + 1),
    }
    for how, read in reads.items():
        with pytest.raises(Exception, match="rank 1's shard only") as err:
            read()
        text = str(err.value)
        assert frame in text and 'raise IndexError("index 99' in text, f"{how}: {text}"
        assert "torch/utils/_pytree.py" not in text, f"{how}: {text}"


class _Scales(Actor):
    @endpoint
    def scale(self, t: torch.Tensor, k: float) -> torch.Tensor:
        assert type(t) is torch.Tensor  # the rank's local tensor, as Monarch's actors get it
        return t * k

    @endpoint
    def hold(self, path: str) -> None:
        _gate.wait(path, 60)


def test_an_actor_endpoint_gets_each_ranks_local_tensor_of_a_mesh_tensor(mesh1, gate, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mt._engine, "VALUE_TIMEOUT_S", 20.0)  # how long an actor's call waits for its tensor
    t = gen(8, 6)
    x = mt.distribute(t, mesh1, [Shard(0)])
    a = mesh1.spawn("scales", _Scales)
    other = None
    try:
        got = a.scale.call(x, 2.0).get(timeout=30).values()
        for g in range(4):
            torch.testing.assert_close(got[g], t[2 * g : 2 * g + 2] * 2)
        # the op making the tensor still runs on the ranks: the actor's call waits for it
        flag = gate()
        blocked = mt.remote(_wait_for_flag)(x, flag.path)
        pending = a.scale.call(blocked + 1, 1.0)
        try:
            assert not pending.done()
        finally:
            flag.open()
        torch.testing.assert_close(pending.get(timeout=60).values()[3], t[6:] + 1)
        # the handle dropped, and its free run on the ranks, before the busy actor reads the call
        busy = gate("busy")
        held = a.hold.call(busy.path)
        try:
            pending = a.scale.call(x + 1, 3.0)
            gc.collect()
            mt.inspect(x * 2)  # carries the free of x + 1, and has run on every rank
        finally:
            busy.open()
        held.get(timeout=30)
        torch.testing.assert_close(pending.get(timeout=60).values()[1], (t[2:4] + 1) * 3)
        # a tensor whose op failed there: the call fails with that error, and its frames
        with pytest.raises(Exception, match="rank 1's shard only") as err:
            a.scale.call(mt.remote(_fails_on_rank_1)(x), 1.0).get(timeout=30)
        assert "in _fails_on_rank_1" in str(err.value)
        # an actor on other procs has no local tensor of it: told so, not handed another's
        other = this_host().spawn_procs(per_host={"gpus": 4}, name="tensor_other")
        mt.inspect(mt.ones(2, procs=other))  # its own mesh tensors, ids like x's
        with pytest.raises(Exception, match="passed to an actor on other procs"):
            other.spawn("scales", _Scales).scale.call(x, 1.0).get(timeout=30)
    finally:
        a.stop().get(timeout=30)
        if other is not None:
            other.stop().get(timeout=30)


def test_a_slices_tensor_passed_to_an_actor_on_the_whole_mesh_says_so_at_once(mesh1, monkeypatch):  # type: ignore[no-untyped-def]
    # the ranks outside the slice never make the tensor: their call waited for it until
    # VALUE_TIMEOUT_S (300 s by default), then said the op "still runs there"
    monkeypatch.setattr(mt._engine, "VALUE_TIMEOUT_S", 30.0)
    t = gen(4, 6)
    half = mesh1.slice(gpus=slice(0, 2))
    x = mt.distribute(t, half, [Shard(0)])
    a = mesh1.spawn("scales_of_a_slice", _Scales)
    try:
        got = a.slice(gpus=slice(0, 2)).scale.call(x, 2.0).get(timeout=30).values()
        torch.testing.assert_close(got[1], t[2:] * 2)
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"lives on a slice of proc mesh 'tensor1d' \(its ranks \[0, 1\]\)") as err:
            a.scale.call(x, 2.0).get(timeout=60)
        assert time.monotonic() - t0 < 10
        assert "rank 2 of it, is not in the slice" in str(err.value) and "actor.slice(...)" in str(err.value)
    finally:
        a.stop().get(timeout=30)


class _AsyncScales(Actor):
    @concurrent_endpoint
    async def scale(self, t: torch.Tensor, k: float) -> torch.Tensor:
        assert type(t) is torch.Tensor
        return t * k

    @concurrent_endpoint
    async def ping(self) -> str:
        return "pong"


def test_an_async_actor_serves_on_while_its_calls_tensor_is_still_being_made(mesh1, gate, monkeypatch):  # type: ignore[no-untyped-def]
    # its loop used to wait inside the call's unpickling for the tensor: every other task of
    # the actor (a concurrent endpoint here) stood still until the op on the rank was done
    monkeypatch.setattr(mt._engine, "VALUE_TIMEOUT_S", 20.0)
    t = gen(8, 6)
    x = mt.distribute(t, mesh1, [Shard(0)])
    a = mesh1.spawn("async_scales", _AsyncScales)
    try:
        torch.testing.assert_close(a.scale.call(x, 2.0).get(timeout=30).values()[1], t[2:4] * 2)
        flag = gate()
        blocked = mt.remote(_wait_for_flag)(x, flag.path)
        try:
            pending = a.scale.call(blocked + 1, 3.0)
            assert a.ping.call().get(timeout=20).values() == ["pong"] * 4
            assert not pending.done()
        finally:
            flag.open()
        torch.testing.assert_close(pending.get(timeout=60).values()[3], (t[6:] + 1) * 3)
        # a tensor whose op fails while the call waits for it: the call fails with that error
        flag2 = gate("second")
        failing = mt.remote(_fails_on_rank_1)(mt.remote(_wait_for_flag)(x, flag2.path))
        try:
            pending = a.scale.call(failing, 1.0)
            assert a.ping.call().get(timeout=20).values() == ["pong"] * 4
        finally:
            flag2.open()
        with pytest.raises(Exception, match="rank 1's shard only") as err:
            pending.get(timeout=30)
        assert "in _fails_on_rank_1" in str(err.value)
        # the wait is bounded: a tensor never made on the rank fails the call in words
        monkeypatch.setattr(mt._engine, "VALUE_TIMEOUT_S", 1.0)
        flag3 = gate("third")
        slow = mt.remote(_wait_for_flag)(x, flag3.path) + 1
        try:
            with pytest.raises(Exception, match="was not made on this rank within 1.0 s"):
                a.scale.call(slow, 1.0).get(timeout=30)
        finally:
            flag3.open()
    finally:
        a.stop().get(timeout=30)


def test_an_in_place_op_whose_result_type_cannot_be_cast_is_refused_at_once(mesh1):  # type: ignore[no-untyped-def]
    # the shadows' meta kernels skip this check of torch's: the ranks failed, and the changed
    # tensor took the error for good (its value, unchanged there, could not be read again)
    i = mt.distribute(torch.arange(8), mesh1, [Shard(0)])
    f = mt.distribute(torch.ones(8), mesh1, [Shard(0)])
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(
        TensorOpError, match=r"Tensor.mul_: result type torch.float64 can't be cast .* torch.int64 .*nothing was sent"
    ):
        i.mul_(f)
    with pytest.raises(TensorOpError, match="can't be cast"):
        i *= 2.5
    with pytest.raises(TensorOpError, match="can't be cast"):
        f.add_(torch.ones(8, dtype=torch.complex64))
    assert mt.stats(mesh1)["messages_sent"] == sent
    i.mul_(3)
    f.mul_(i)  # an int into a float is fine, as in torch
    torch.testing.assert_close(mt.inspect(i), torch.arange(8) * 3)
    torch.testing.assert_close(mt.inspect(f), torch.arange(8.0) * 3)


def test_ops_promote_to_the_controllers_default_dtype_on_the_ranks(mesh1):  # type: ignore[no-untyped-def]
    # this module's default dtype is float64: the shadows promoted with it, the ranks with theirs
    # (float32), so a handle saying float64 held float32, and a view of it had another shape
    i = mt.distribute(torch.arange(4), mesh1, [Shard(0)])
    y = i / 3
    assert y.dtype == torch.float64
    torch.testing.assert_close(mt.inspect(y), torch.arange(4) / 3)
    torch.testing.assert_close(mt.inspect(torch.sigmoid(i)), torch.sigmoid(torch.arange(4)))
    assert mt.inspect(y.view(torch.int64)).shape == y.view(torch.int64).shape == (4,)
    with mesh1.activate():
        f = torch.full((4,), 1 / 3)
        r = torch.arange(0.0, 4.0)
    torch.testing.assert_close(mt.inspect(f), torch.full((4,), 1 / 3))
    torch.testing.assert_close(mt.inspect(r), torch.arange(0.0, 4.0))
    # and back to float32 here: so on the ranks (their default was restored after each message)
    torch.set_default_dtype(torch.float32)
    try:
        torch.testing.assert_close(mt.inspect(i / 3), torch.arange(4) / 3)
    finally:
        torch.set_default_dtype(torch.float64)


def test_an_op_dtensor_cannot_shard_fails_here_and_is_never_sent(mesh1, caplog):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(TensorOpError, match="nonzero"):
        torch.nonzero(x)
    # a shape the meta kernel refuses: said once, as the TensorOpError (torch logged its traceback too)
    with caplog.at_level(logging.DEBUG), pytest.raises(TensorOpError, match=r"same reduction dim, but got \[8, 6\] X \[3, 3\]"):
        x @ torch.ones(3, 3)
    assert not [r for r in caplog.records if "failed while attempting to run meta" in r.getMessage()]
    with pytest.raises(TypeError, match="truth value"):
        bool(x)
    assert mt.stats(mesh1)["messages_sent"] == sent


def test_quantile_says_what_to_do_instead_and_what_it_says_works(mesh1):  # type: ignore[no-untyped-def]
    # torch's DTensor fails quantile inside on every placement ("mixed torch.Tensor and
    # DTensor"), which said nothing a user could do
    t = gen(6, 5)
    x = mt.distribute(t, mesh1, [Shard(1)])
    for call in (lambda: torch.quantile(x, 0.3, dim=1), lambda: x.quantile(0.3, dim=1)):
        with pytest.raises(TensorOpError, match=r"quantile[\s\S]*t\.nanquantile\(q, dim=d\)[\s\S]*mt\.inspect\(t\)"):
            call()
    want = torch.quantile(t, 0.3, dim=1)
    for pl in ([Shard(0)], [Shard(1)], [Replicate()]):
        x = mt.distribute(t, mesh1, pl)
        torch.testing.assert_close(mt.inspect(x.nanquantile(0.3, dim=1)), want)
    torch.testing.assert_close(torch.quantile(mt.inspect(x), 0.3, dim=1), want)


def test_a_view_of_a_dim_sharded_unevenly_on_two_mesh_dims_says_what_to_do(mesh2):  # type: ignore[no-untyped-def]
    # [Shard(0), Shard(0)] of 6 rows: 3 and 3, then 2 and 1; torch's DTensor views each piece
    # with the first split's shape and said only "shape '[3]' is invalid for input of size 4"
    t = gen(6, 2)
    x = mt.distribute(t, mesh2, [Shard(0), Shard(0)])
    with pytest.raises(TensorOpError, match=r"invalid[\s\S]*t\.redistribute\(placements=\[Replicate\(\), Replicate\(\)\]\)"):
        x.flatten()
    torch.testing.assert_close(mt.inspect(x.redistribute(placements=[Replicate(), Replicate()]).flatten()), t.flatten())


def test_item_assignment_and_python_numbers_say_what_to_do_instead(mesh1):  # type: ignore[no-untyped-def]
    # t[0] = 5.0 used to fail with DTensor's "mixed torch.Tensor and DTensor", or, on a sharded
    # dim with a tensor value, to leave the ranks' tensor as it was without a word
    ref = gen(4, 3)
    x = mt.distribute(ref, mesh1, [Shard(0)])
    one = x.sum()
    sent = mt.stats(mesh1)["messages_sent"]
    for key, value in [(0, 5.0), (1, torch.tensor(9.0)), (slice(0, 2), 5.0), (1, torch.arange(3.0))]:
        with pytest.raises(TensorOpError, match=r"item assignment \(t\[...\] = value\) is not supported.*t.masked_fill"):
            x[key] = value
    for conv, word in [(float, "float()"), (int, "int()"), (complex, "complex()"), ([1, 2].__getitem__, "an index")]:
        with pytest.raises(TypeError, match=rf"{re.escape(word)} of a mesh tensor|{word} needs its value") as err:
            conv(one)
        assert "use t.item()" in str(err.value)
    # item() of more than one element: torch's error, before the whole tensor is read back
    got = mt.stats(mesh1)["bytes_received"]
    with pytest.raises(RuntimeError, match="a Tensor with 12 elements cannot be converted to Scalar"):
        x.item()
    assert mt.stats(mesh1)["bytes_received"] == got
    assert mt.stats(mesh1)["messages_sent"] == sent  # refused here, nothing sent
    # what the message offers does it, on the ranks
    rows = torch.arange(4)[:, None].expand(4, 3)
    torch.testing.assert_close(mt.inspect(x.masked_fill(rows == 1, 5.0)), ref.masked_fill(rows == 1, 5.0))
    assert one.item() == pytest.approx(ref.sum().item())


def test_to_a_device_is_checked_against_the_ranks_not_this_controller(mesh1, monkeypatch):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(4, 3), mesh1, [Shard(0)])
    # the ranks' own kind: already there (it used to fail: "Cannot copy out of meta tensor")
    assert x.to("cpu") is x and x.cpu() is x and x.to(device="cpu") is x
    y = x.to("cpu", torch.float32)
    assert y.dtype == torch.float32 and y.placements == x.placements
    torch.testing.assert_close(mt.inspect(y), gen(4, 3).float())
    # a GPU on a CPU mesh: said in the ranks' words, not "Torch not compiled with CUDA enabled"
    for move in (lambda: x.to("cuda"), lambda: x.cuda(), lambda: x.to(torch.device("cuda", 0))):
        with pytest.raises(ValueError, match=r"live on its ranks' cpu devices \(gloo\), which have no cuda device"):
            move()
    # ranks with GPUs, driven from a controller without CUDA: the ranks' kind is what counts
    monkeypatch.setattr(mt._engine.engine_for(mesh1), "backend", "nccl")
    assert x.to("cuda") is x and x.cuda() is x
    with pytest.raises(ValueError, match="live on its ranks' cuda devices"):
        x.to("cpu")


def test_an_ops_error_is_headed_with_the_op_not_the_hidden_actor(mesh1):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    bad = mt.remote(_fails_on_rank_1)(x)
    issued = f"issued by {__file__}:{inspect.currentframe().f_lineno - 1}: bad = mt.remote(_fails_on_rank_1)(x)"  # type: ignore[union-attr]
    reads = {
        "inspect": lambda: mt.inspect(bad),
        "fetch_shard": lambda: mt.fetch_shard(bad, gpus=1).get(timeout=30),
        "a later op": lambda: mt.inspect(bad * 3),  # the op that failed first, not the later one
    }
    for how, read in reads.items():
        with pytest.raises(Exception, match="rank 1's shard only") as err:
            read()
        for text in (str(err.value), err.value.grouped_text()):
            assert text.splitlines()[0] == "Mesh tensor op test_tensor._fails_on_rank_1 failed.", f"{how}: {text}"
            # the read raised it, another line: the line that issued the op is the user's bug
            assert text.splitlines()[1] == issued, f"{how}: {text}"
            assert "_tensor_engine" not in text, f"{how}: {text}"
    # shown in a cell: each rank's row says what went wrong there (each said "ActorError: Mesh
    # tensor op … failed.", as if all 4 ranks had failed)
    from IPython.lib.pretty import pretty

    rows = pretty(bad).splitlines()[1:]
    assert rows[1] == "  gpus=1: local (2, 6): [(IndexError: index 99 is out of bounds (rank 1's shard only))]", rows
    others = "[(not fetched: the op failed on rank 1; mt.inspect(t) raises its error)]"
    assert [r.endswith(others) for r in rows] == [True, False, True, True], rows


def _checks_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    from monarch_nb.actor import current_rank

    if x.device.type != "meta" and current_rank().rank == 1:
        raise ValueError("rank 1's shard fails the check")
    return x  # handed back unchanged


def _doubles_in_place_then_fails_on_rank_1(x: torch.Tensor) -> None:
    from monarch_nb.actor import current_rank

    x.mul_(2)
    if x.device.type != "meta" and current_rank().rank == 1:
        raise ValueError("rank 1 failed after doubling in place")


def test_a_remote_fn_handing_back_its_input_leaves_the_input_alone(mesh1):  # type: ignore[no-untyped-def]
    # it was taken for an in-place op: the function's error then stuck to its input, so x
    # itself could no longer be read (Monarch 0.7.0 fails only the results, and the inputs
    # the function changes in place)
    ref = gen(8, 6)
    x = mt.distribute(ref, mesh1, [Shard(0)])
    y = mt.remote(_checks_on_rank_1)(x)
    assert y.shape == x.shape and y.placements == x.placements
    with pytest.raises(Exception, match="rank 1's shard fails the check"):
        mt.inspect(y)
    torch.testing.assert_close(mt.inspect(x), ref)
    torch.testing.assert_close(mt.inspect(x + 1), ref + 1)
    assert y is not x
    # changed in place: the input does hold the error, even though the function returned nothing
    mt.remote(_doubles_in_place_then_fails_on_rank_1)(x)
    with pytest.raises(Exception, match="rank 1 failed after doubling in place"):
        mt.inspect(x)
    torch.testing.assert_close(mt.fetch_shard(x, gpus=0).get(timeout=30), ref[:2] * 2)


class _BackwardFailsOnRank1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 1

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        from monarch_nb.actor import current_rank

        if grad.device.type != "meta" and current_rank().rank == 1:
            raise RuntimeError("backward of rank 1's shard only")
        return grad


def _backward_fails_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    return _BackwardFailsOnRank1.apply(x)


class _SGDFailsOnRank1(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        from monarch_nb.actor import current_rank

        if current_rank().rank == 1:
            raise RuntimeError("step of rank 1 only")
        return super().step(closure)


def test_an_error_of_an_op_without_a_result_is_raised_at_the_next_read(mesh1):  # type: ignore[no-untyped-def]
    # loss.backward() and an optimizer's step make no tensor to keep their error on: a failure
    # on the ranks was lost without a word, and the loss read as if all went well
    ref = gen(8, 6)
    w = mt.distribute(ref, mesh1, [Replicate()]).requires_grad_()
    loss = mt.remote(_backward_fails_on_rank_1)(w).sum()
    loss.backward()
    backward = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    with pytest.raises(Exception, match="backward of rank 1's shard only") as err:
        loss.item()
    text = str(err.value)
    assert text.splitlines()[0] == "Mesh tensor op Tensor.backward failed.", text
    # the line that issued it, as an op with a result has (the read raising it is another line)
    assert text.splitlines()[1] == f"issued by {__file__}:{backward}: loss.backward()", text
    assert "made no mesh tensor to keep this error, so it is raised here, at the next read from rank 1" in text
    assert loss.item() == pytest.approx(ref.sum().item())  # said once; the next read reads
    # rank 1 has no gradient: said so, not "mesh tensor 5 is not on rank 1 (freed?)"
    with pytest.raises(Exception, match="Tensor.grad gave None on rank 1 where the controller expected a tensor"):
        mt.inspect(w.grad)
    opt = mt.Optimizer(_SGDFailsOnRank1, [w], lr=0.1)
    opt.step()
    with pytest.raises(Exception, match="step of rank 1 only") as err:
        mt.fetch_shard(w, gpus=1).get(timeout=30)
    step = f"issued by {__file__}:{inspect.currentframe().f_lineno - 3}: opt.step()"  # type: ignore[union-attr]
    assert str(err.value).splitlines()[:2] == ["Mesh tensor op Optimizer.step failed.", step]
    torch.testing.assert_close(mt.inspect(w.detach(), gpus=1), ref)  # rank 1 did not step
    torch.testing.assert_close(mt.inspect(mt.distribute(ref, mesh1, [Shard(0)]) + 1), ref + 1)  # the rest works


class _SGDMadeOnRank0Only(torch.optim.SGD):
    def __init__(self, params, **kwargs):  # type: ignore[no-untyped-def]
        from monarch_nb.actor import current_rank

        params = list(params)
        if params[0].device.type != "meta" and current_rank().rank == 1:
            raise RuntimeError("no optimizer on rank 1")
        super().__init__(params, **kwargs)


def test_an_optimizers_bad_argument_is_refused_at_once(mesh1):  # type: ignore[no-untyped-def]
    # it used to be sent as is: the ranks' optimizer failed, and the error came back only at a
    # read after a later step, headed "Mesh tensor op monarch_nb.tensor.<... object at 0x...>"
    w = mt.distribute(gen(8, 6), mesh1, [Shard(0)]).requires_grad_()
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(TensorOpError, match=r"Optimizer\(SGD\): ValueError: Invalid learning rate: -1"):
        mt.Optimizer(torch.optim.SGD, [w], lr=-1)
    assert mt.stats(mesh1)["messages_sent"] == sent
    # one that fails on the ranks only: named as the optimizer, read after its step
    opt = mt.Optimizer(_SGDMadeOnRank0Only, [w], lr=0.1)
    opt.step()
    with pytest.raises(Exception, match="no optimizer on rank 1") as err:
        mt.inspect(w.detach())
    text = str(err.value)
    assert text.splitlines()[0] == "Mesh tensor op Optimizer(_SGDMadeOnRank0Only) failed.", text
    assert "Optimizer.step made no mesh tensor to keep this error" in text


def test_a_gradient_can_be_set_to_none_or_another_mesh_tensor(mesh1):  # type: ignore[no-untyped-def]
    # p.grad = None (torch's set-to-none zeroing) raised "property 'grad' of 'MeshTensor' object has no setter"
    ref = gen(8, 6)
    w = mt.distribute(ref, mesh1, [Shard(0)]).requires_grad_()
    (w * 3).sum().backward()
    torch.testing.assert_close(mt.inspect(w.grad), torch.full((8, 6), 3.0))
    w.grad = None
    assert w.grad is None
    (w * 2).sum().backward()  # accumulates onto nothing: 2, not 3 + 2
    torch.testing.assert_close(mt.inspect(w.grad), torch.full((8, 6), 2.0))
    w.grad = w.detach() * 0 + 1
    torch.testing.assert_close(mt.inspect(w.grad), torch.ones(8, 6))
    with pytest.raises(TypeError, match="grad is None or a mesh tensor"):
        w.grad = torch.ones(8, 6)
    with pytest.raises(TensorOpError, match="Tensor.grad ="):
        w.grad = mt.distribute(torch.ones(3), mesh1, [Replicate()])  # torch refuses another shape
    # zero_grad(set_to_none=False) keeps zeroed gradients, as torch's (they were dropped: p.grad None)
    opt = mt.Optimizer(torch.optim.SGD, [w], lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert w.grad is not None
    torch.testing.assert_close(mt.inspect(w.grad), torch.zeros(8, 6))
    opt.zero_grad()
    assert w.grad is None


def _with_rank(t):  # type: ignore[no-untyped-def]
    from monarch_nb.actor import current_rank

    return t * 1, current_rank().rank + 5


def _double_in_place(t):  # type: ignore[no-untyped-def]
    t.mul_(2)


def test_a_remote_fn_returning_a_plain_value_is_refused_at_once(mesh1):  # type: ignore[no-untyped-def]
    # it handed back the value fn gave here on meta shadows (rank 0's, 5 on every rank), silently
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(TensorOpError, match=r"returns a plain int, not a tensor: .* not the ranks'.* actor endpoint"):
        mt.remote(_with_rank)(x)
    with pytest.raises(TensorOpError, match=r"returns a plain tuple|returns a plain int"):
        mt.remote(lambda t: (3, 4.5))(x)
    with pytest.raises(TensorOpError, match=r"item\(\) cannot be called on meta tensors.*\n.*must work on them"):
        mt.remote(lambda t: int(t.sum().item()))(x)
    assert mt.stats(mesh1)["messages_sent"] == sent  # nothing sent
    # None (a fn changing its input in place) is still fine
    assert mt.remote(_double_in_place)(x) is None
    torch.testing.assert_close(mt.inspect(x), gen(8, 6) * 2)


def test_an_optimizers_learning_rate_can_be_scheduled_and_keeps_its_momentum(mesh2):  # type: ignore[no-untyped-def]
    # mt.Optimizer had no param_groups, and lr_scheduler refused it ("Optimizer is not an
    # Optimizer"): a new learning rate needed a new optimizer, which lost the momentum
    X, W = gen(8, 6, seed=1), gen(6, 3, seed=2)
    wl = W.clone().requires_grad_()
    opt_l = torch.optim.SGD([wl], lr=0.1, momentum=0.9)
    sched_l = torch.optim.lr_scheduler.StepLR(opt_l, step_size=2, gamma=0.5)
    x = mt.distribute(X, mesh2, [Shard(0), Replicate()])
    w = mt.distribute(W, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    opt = mt.Optimizer(torch.optim.SGD, [w], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert opt.param_groups[0]["params"] == [w] and opt.param_groups[0]["momentum"] == 0.9
    for i in range(6):
        if i == 3:
            for o in (opt, opt_l):
                for g in o.param_groups:
                    g["lr"] = 0.3
        for o, s, xx, ww in ((opt_l, sched_l, X, wl), (opt, sched, x, w)):
            o.zero_grad()
            (xx @ ww).pow(2).mean().backward()
            o.step()
            s.step()
    assert opt.param_groups[0]["lr"] == opt_l.param_groups[0]["lr"]
    torch.testing.assert_close(mt.inspect(w.detach()), wl.detach())
    # the momentum buffers, as the ranks hold them
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr"] == opt_l.param_groups[0]["lr"] and sd["param_groups"][0]["params"] == [0]
    buf = sd["state"][0]["momentum_buffer"]
    assert isinstance(buf, mt.MeshTensor) and buf.shape == w.shape
    torch.testing.assert_close(mt.inspect(buf), opt_l.state_dict()["state"][0]["momentum_buffer"])


def _step(opt, x, w) -> None:  # type: ignore[no-untyped-def]
    opt.zero_grad()
    (x @ w).pow(2).mean().backward()
    opt.step()


def test_an_optimizers_state_dict_checkpoints_and_restores_its_state(mesh2):  # type: ignore[no-untyped-def]
    X, W = gen(8, 6, seed=1), gen(6, 3, seed=2)
    wl = W.clone().requires_grad_()
    opt_l = torch.optim.Adam([wl], lr=0.05)
    x = mt.distribute(X, mesh2, [Shard(0), Replicate()])
    w = mt.distribute(W, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    opt = mt.Optimizer(torch.optim.Adam, [w], lr=0.05)
    for _ in range(3):
        _step(opt_l, X, wl)
        _step(opt, x, w)
    sd = opt.state_dict()
    want = opt_l.state_dict()["state"][0]
    assert set(sd["state"][0]) == set(want) == {"step", "exp_avg", "exp_avg_sq"}
    # a plain value, fetched (float32: the ranks keep torch's default dtype, float64 only here)
    torch.testing.assert_close(sd["state"][0]["step"], want["step"], check_dtype=False)
    assert isinstance(sd["state"][0]["exp_avg"], mt.MeshTensor)
    # a checkpoint: every state tensor read back here
    ckpt = {
        "state": {
            i: {k: mt.inspect(v) if isinstance(v, mt.MeshTensor) else v for k, v in st.items()} for i, st in sd["state"].items()
        },
        "param_groups": sd["param_groups"],
    }
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ckpt["state"][0][k], want[k])
    w_ckpt = mt.inspect(w.detach())
    for _ in range(2):
        _step(opt, x, w)
    torch.testing.assert_close(
        mt.inspect(sd["state"][0]["exp_avg"]), ckpt["state"][0]["exp_avg"]
    )  # a copy, not moved by the steps
    # restored into a new optimizer (another lr given, the checkpoint's wins), it steps as the first one did
    w2 = mt.distribute(w_ckpt, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    opt2 = mt.Optimizer(torch.optim.Adam, [w2], lr=0.5)
    opt2.load_state_dict(ckpt)
    assert opt2.param_groups[0]["lr"] == 0.05
    for _ in range(2):
        _step(opt2, x, w2)
        _step(opt_l, X, wl)
    torch.testing.assert_close(mt.inspect(w2.detach()), mt.inspect(w.detach()))
    torch.testing.assert_close(mt.inspect(w2.detach()), wl.detach())
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt2.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


def _clip(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_([a, b], 1.0)


def test_clip_grad_norm_says_to_run_it_on_the_ranks_and_does_there(mesh1):  # type: ignore[no-untyped-def]
    # it failed with a bare "'MeshTensor' object has no attribute 'device'"
    W1, W2 = gen(8, 6, seed=1), gen(6, 3, seed=2)
    w1 = mt.distribute(W1, mesh1, [Shard(1)]).requires_grad_()
    w2 = mt.distribute(W2, mesh1, [Shard(0)]).requires_grad_()
    l1, l2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    ((mt.distribute(torch.ones(4, 8), mesh1, [Replicate()]) @ w1) @ w2).pow(2).sum().backward()
    ((torch.ones(4, 8) @ l1) @ l2).pow(2).sum().backward()
    with pytest.raises(AttributeError, match=r"has no one device .* mt.remote\(lambda a, b: torch.nn.utils.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_([w1, w2], 1.0)
    norm = mt.remote(_clip)(w1, w2)
    torch.testing.assert_close(norm.item(), _clip(l1, l2).item())
    torch.testing.assert_close(mt.inspect(w1.grad), l1.grad)
    torch.testing.assert_close(mt.inspect(w2.grad), l2.grad)


def test_training_moves_metadata_only_and_matches_local_training(mesh2):  # type: ignore[no-untyped-def]
    """50 steps of an MLP, data parallel on hosts and tensor parallel on gpus, in float64."""
    X, Y = gen(16, 8, seed=1), torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(2))
    W1, W2 = gen(8, 16, seed=3) * 0.3, gen(16, 4, seed=4) * 0.3

    def step_local(w1, w2):  # type: ignore[no-untyped-def]
        return F.cross_entropy(F.gelu(X @ w1) @ w2, Y)

    w1l, w2l = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    opt_l = torch.optim.SGD([w1l, w2l], lr=0.5)
    for _ in range(50):
        opt_l.zero_grad()
        last = step_local(w1l, w2l)
        last.backward()
        opt_l.step()

    x = mt.distribute(X, mesh2, [Shard(0), Replicate()])
    y = mt.distribute(Y, mesh2, [Shard(0), Replicate()])
    w1 = mt.distribute(W1, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    w2 = mt.distribute(W2, mesh2, [Replicate(), Shard(0)]).requires_grad_()
    opt = mt.Optimizer(torch.optim.SGD, [w1, w2], lr=0.5)
    before = mt.stats(mesh2)["bytes_received"]
    for _ in range(50):
        opt.zero_grad()
        loss = F.cross_entropy(F.gelu(x @ w1) @ w2, y)
        loss.backward()
        assert w1.grad is not None and w1.grad.shape == (8, 16)
        opt.step()
    assert mt.stats(mesh2)["bytes_received"] == before  # 50 steps, not a byte of values back
    torch.testing.assert_close(mt.inspect(w1), w1l.detach())
    torch.testing.assert_close(mt.inspect(w2), w2l.detach())
    torch.testing.assert_close(mt.inspect(loss), last.detach())
    assert mt.fetch_shard(w1, hosts=1, gpus=1).get(timeout=30).shape == (8, 8)
    assert mt.fetch_shard(w2, hosts=0, gpus=1).get(timeout=30).shape == (8, 4)


def _table_size(procs) -> int:  # type: ignore[no-untyped-def]
    return mt._engine.engine_for(procs).actor.count.call().get(timeout=30).values()[0]


def test_a_collected_handle_frees_the_ranks_tensor(mesh1):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    gc.collect()
    y = x * 1
    mt.inspect(y)  # the message flushes what earlier tests dropped
    base = _table_size(mesh1)
    hs = [x + i for i in range(10)]
    mt.inspect(hs[-1])
    assert _table_size(mesh1) == base + 10
    del hs
    gc.collect()
    z = x * 1  # the frees ride on the next message
    mt.inspect(z)
    assert _table_size(mesh1) == base + 1
    # Monarch's t.drop(): freed now, while a reference lives on (a notebook's Out) and with no
    # later op; was AttributeError. The handle then says so
    out = [z]
    z.drop()
    mt.inspect(x)
    assert z.dropped and _table_size(mesh1) == base
    with pytest.raises(TensorOpError, match=r"Tensor.__add__: this mesh tensor was dropped \(t.drop\(\)\)"):
        z + 1
    with pytest.raises(TensorOpError, match="fetch_shard.*dropped"):
        mt.fetch_shard(z)
    z.drop()
    assert "(dropped)" in z._repr_html_()
    del out, z
    gc.collect()
    w = x * 1
    mt.inspect(w)
    assert _table_size(mesh1) == base + 1  # w; z collected after its drop sent no second free


def test_an_op_that_cannot_be_sent_says_so_and_keeps_the_frees(mesh1):  # type: ignore[no-untyped-def]
    import threading

    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    gc.collect()
    y = x * 1
    mt.inspect(y)  # the message flushes what earlier tests dropped
    base = _table_size(mesh1)
    hs = [x + i for i in range(10)]
    mt.inspect(hs[-1])
    del hs
    gc.collect()
    lock = threading.Lock()
    with pytest.raises(TypeError, match="pickle") as err:
        mt.remote(lambda t: t + (1 if lock else 0))(x)  # a lock cannot travel
    assert "could not be sent to the ranks" in "\n".join(getattr(err.value, "__notes__", []))
    # the frees that message would have carried go with the next one
    z = x * 1
    mt.inspect(z)
    assert _table_size(mesh1) == base + 1


def _named_as_the_proc_mesh(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    ok = float(x.device_mesh.mesh_dim_names == ("hosts", "gpus") and tuple(x.device_mesh.shape) == (2, 2))
    return DTensor.from_local(torch.full((2,), ok), x.device_mesh, [Replicate(), Replicate()], run_check=False)


def test_setup_torch_elastic_env(mesh2):  # type: ignore[no-untyped-def]
    from monarch_nb.spmd import setup_torch_elastic_env, setup_torch_elastic_env_async

    x = mt.zeros(2, procs=mesh2)  # starts the engine: the rendezvous went through the env
    assert mt.stats(mesh2)["backend"] == "gloo"
    assert mt.inspect(x).shape == (2,)
    named = mt.remote(_named_as_the_proc_mesh)(x)  # the ranks' device mesh: the proc mesh's names
    assert mt.inspect(named).tolist() == [1.0, 1.0]
    import asyncio

    setup_torch_elastic_env(mesh2, use_ipaddr=True)
    asyncio.run(setup_torch_elastic_env_async(mesh2))


class _StoreProbe(Actor):
    @endpoint
    def store(self) -> dict:
        """MASTER_ADDR and where this proc listens at MASTER_PORT, and whether another address
        of the host (127.0.0.2, loopback too) is refused there."""
        import socket

        import psutil

        port = int(os.environ["MASTER_PORT"])
        conns = psutil.Process(os.getpid()).net_connections("tcp")
        with socket.socket() as s:
            s.settimeout(5)
            refused = s.connect_ex(("127.0.0.2", port)) != 0
        return {
            "addr": os.environ["MASTER_ADDR"],
            "listening": sorted(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port),
            "refused": refused,
        }


def test_the_engine_s_rendezvous_store_listens_on_loopback_alone_on_one_host():  # type: ignore[no-untyped-def]
    """The engine's process group kept rank 0's store listening on every interface (``::``)
    for as long as it lived, though the ranks met at a loopback address: anyone reaching the
    port read and wrote its keys. It listens on 127.0.0.1 alone now."""
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="tensorstore")
    try:
        x = mt.ones(2, procs=procs)  # starts the engine: its group lives from here on
        got = procs.spawn("probe", _StoreProbe).store.call().get(timeout=30).values()
        assert got[0] == {"addr": "127.0.0.1", "listening": ["127.0.0.1"], "refused": True}, got
        assert got[1]["listening"] == [] and got[1]["addr"] == "127.0.0.1", got
        assert mt.inspect(x.sum()).item() == 2.0  # the group still works
    finally:
        procs.stop().get(timeout=30)


def test_a_dead_rank_fails_pending_reads_and_the_mesh_can_be_stopped_and_respawned(gate, monkeypatch):  # type: ignore[no-untyped-def]
    import signal

    monkeypatch.setattr(mt._engine, "COLLECTIVE_TIMEOUT_S", 5.0)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="tensordead")
    try:
        x = mt.distribute(torch.arange(4.0), procs, [Shard(0)])
        pids = mt.remote(_pid)(x)
        pid = int(mt.fetch_shard(pids, gpus=1).get(timeout=30).item())
        flag = gate("never")
        y = mt.remote(_wait_for_flag)(x, flag.path).redistribute(placements=[Replicate()])
        pending = mt.fetch_shard(y, gpus=1)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(SupervisionError):
            pending.get(timeout=30)
        assert time.monotonic() - t0 < 10, "a dead rank is detected within 10 s (heartbeat timeout + margin)"
        # said as the read that failed and what to do, not as the hidden worker's endpoint
        with pytest.raises(
            SupervisionError,
            match=r"(?s)fetch_shard\(rank 1\) of a mesh tensor failed: a process of proc mesh 'tensordead' is gone.*SIGKILL.*stop the proc mesh",
        ) as ei:
            mt.fetch_shard(x, gpus=1).get(timeout=30)
        assert "_tensor_engine" not in str(ei.value)
        # the survivor, released into the collective, leaves it (peer gone or the 5 s timeout)
        # with an error stored on the result, and answers the next read
        flag.open()
        with pytest.raises(Exception, match="(?i)timed? ?out|closed|connection|peer|reset"):
            mt.fetch_shard(y, gpus=0).get(timeout=30)
        torch.testing.assert_close(mt.fetch_shard(x, gpus=0).get(timeout=30), torch.arange(2.0))
    finally:
        procs.stop().get(timeout=60)
    # its tensors are gone, said in tensor words (not as a hidden actor's stop)
    with pytest.raises(MeshClosedError, match="the mesh tensors of proc mesh 'tensordead' are gone: it was stopped"):
        mt.inspect(x + 1)
    # stopped, the mesh respawns under its name with a fresh process group and mesh tensors
    again = this_host().spawn_procs(per_host={"gpus": 2}, name="tensordead")
    try:
        z = mt.distribute(torch.arange(4.0), again, [Shard(0)])
        torch.testing.assert_close(mt.inspect(z + 1), torch.arange(1.0, 5.0))
        # an old tensor with a new one (a notebook's spawn cell rerun): the old mesh was stopped,
        # not "different proc meshes ('tensordead', 'tensordead'): move one by to_mesh"
        for a, b in ((x, z), (z, x)):
            with pytest.raises(MeshClosedError, match="proc mesh 'tensordead' are gone: it was stopped"):
                a + b
    finally:
        again.stop().get(timeout=60)


def _pid(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    pid = torch.tensor(float(os.getpid()), device=x.device)
    return DTensor.from_local(pid, x.device_mesh, [Replicate()], run_check=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the NCCL path)")
def test_nccl_mesh_tensors_on_gpus():  # type: ignore[no-untyped-def]
    n = min(torch.cuda.device_count(), 2)
    procs = this_host().spawn_procs(per_host={"gpus": n}, name="tensorcuda")
    try:
        t = gen(8, 6)
        h = mt.distribute(t, procs, [Shard(0)])
        assert mt.stats(procs)["backend"] == "nccl"
        torch.testing.assert_close(mt.inspect((h @ h.T).relu()), (t @ t.T).relu())
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(180)
def test_a_handle_dropped_in_a_kernel_frees_the_ranks_tensor():  # type: ignore[no-untyped-def]
    """In a real kernel, ``Out`` pins a displayed handle: ``del`` plus ``%reset -f out`` frees it."""
    from _kernel import Kernel

    k = Kernel(load_ext=False)
    try:

        def ok(code: str) -> str:
            c = k.run(code, timeout=120)
            assert c.error is None, "\n".join(c.error["traceback"])
            return c.result or c.stream()

        ok(
            "import gc, torch\nimport monarch_nb.tensor as mt\nfrom monarch_nb.actor import this_host\n"
            "procs = this_host().spawn_procs(per_host={'gpus': 2}, name='tensorkernel')\n"
            "x = mt.distribute(torch.ones(4, 2), procs, [mt.Shard(0)])\n"
            "count = lambda: mt._engine.engine_for(procs).actor.count.call().get(timeout=30).values()[0]"
        )
        assert "MeshTensor(shape=(4, 2)" in ok("h = x + 1\nh")  # displayed: Out[2] holds it now
        before = int(ok("gc.collect(); y = x * 1; mt.inspect(y); count()"))
        ok("del h\ngc.collect()\nz = x * 2; mt.inspect(z)")
        assert int(ok("count()")) == before + 1, "Out still pins the handle"
        ok("%reset -f out")
        ok("gc.collect(); w = x * 3; mt.inspect(w)")
        assert int(ok("count()")) == before + 1, "h freed (-1), w made (+1)"
        ok("procs.stop().get(timeout=30)")
    finally:
        k.close()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.timeout(180)
def test_a_failed_op_reads_as_a_grouped_error_in_a_kernel():  # type: ignore[no-untyped-def]
    """A notebook's view of an op that failed on the ranks: the grouped error's header, the line
    of the cell that issued the op (the error is raised by a later read, and the ranks' traceback
    has torch's frames only); an op DTensor refuses here: the cell's line, not 140 lines of
    torch's sharding propagation and the engine."""
    from _kernel import Kernel

    k = Kernel(load_ext=False)
    try:

        def run(code: str) -> list[str]:
            c = k.run(code, timeout=120)
            return _ANSI.sub("", "\n".join(c.error["traceback"])).splitlines() if c.error else []

        assert not run(
            "import torch\nimport monarch_nb.tensor as mt\nfrom monarch_nb.actor import this_host\n"
            "procs = this_host().spawn_procs(per_host={'gpus': 4}, name='tensorerrk')\n"
            "x = mt.distribute(torch.randn(8, 6), procs, [mt.Shard(0)])"
        )
        assert not run("y = torch.nn.functional.cross_entropy(x, torch.full((8,), 99))  # class 99 of 6")  # In[2]
        shown = run("z = y * 2\nmt.inspect(z)")  # In[3]
        text = "\n".join(shown)
        assert shown[:3] == [
            "ActorError: Mesh tensor op torch.nn.functional.cross_entropy failed.",
            "issued by Cell In[2], line 1: y = torch.nn.functional.cross_entropy(x, torch.full((8,), 99))  # class 99 of 6",
            "IndexError on 4 of 4 ranks: 0-3",
        ], text
        assert text.count("Traceback") == 1 and "IndexError: Target 99 is out of bounds." in text, text
        assert "[rank" not in text and "monarch_nb/" not in text, text

        shown = run("w = mt.distribute(torch.randn(5, 3), procs, [mt.Replicate()])\nh = x @ w")  # In[4]
        text = "\n".join(shown)
        assert shown[0].startswith("TensorOpError: Tensor.__matmul__ cannot run on mesh tensors"), text
        assert "a and b must have same reduction dim" in shown[0], text
        assert shown[-4:] == [
            "Traceback (most recent call last):",
            "  Cell In[4], line 2, in <module>",
            "    h = x @ w",
            "        ~~^~~",
        ], text
        assert len(shown) < 10 and "torch/" not in text and "monarch_nb/" not in text, text
        # the type users catch is kept
        assert k.run("try:\n    x @ w\nexcept RuntimeError as e:\n    print(type(e).__name__)").stream() == "TensorOpError\n"
        # mt.remote(fn)'s dry run on meta tensors: the line of fn that failed, past torch's frames
        assert not run("def g(t):\n    return (t * 2).reshape(7, 7)")  # In[6]
        shown = run("mt.remote(g)(x)")  # In[7]
        assert shown[0].startswith("TensorOpError: __main__.g cannot run on mesh tensors"), shown
        assert shown[-6:-1] == [
            "Traceback (most recent call last):",
            "  Cell In[7], line 1, in <module>",
            "    mt.remote(g)(x)",
            "  Cell In[6], line 2, in g",
            "    return (t * 2).reshape(7, 7)",
        ], shown
        assert not run("procs.stop().get(timeout=30)")
    finally:
        k.close()


@pytest.mark.timeout(180)
def test_a_failed_op_in_a_script_is_not_said_to_be_rank_0s(tmp_path):  # type: ignore[no-untyped-def]
    """An uncaught error in a script: the controller's traceback as Python prints it, without the
    "[rank0]: " torch put before every line (its excepthook, set by the controller's fake
    process group), and the line of the script that issued the op."""
    import subprocess
    import sys

    script = tmp_path / "fails.py"
    script.write_text(
        "import torch\nimport monarch_nb.tensor as mt\nfrom monarch_nb.actor import this_host\n"
        "procs = this_host().spawn_procs(per_host={'gpus': 2}, name='tensorerrs')\n"
        "try:\n"
        "    x = mt.distribute(torch.randn(8, 6), procs, [mt.Shard(0)])\n"
        "    y = torch.nn.functional.cross_entropy(x, torch.full((8,), 99))\n"
        "    mt.inspect(y)\n"
        "finally:\n"
        "    procs.stop().get(timeout=30)\n"
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert p.returncode == 1, p.stderr
    assert "[rank0]" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    head = lines.index("monarch_nb.errors.ActorError: Mesh tensor op torch.nn.functional.cross_entropy failed.")
    assert lines[head + 1 : head + 3] == [
        f"issued by {script}:7: y = torch.nn.functional.cross_entropy(x, torch.full((8,), 99))",
        "IndexError on 2 of 2 ranks: 0-1",
    ], p.stderr


def test_a_script_reading_by_the_data_plane_exits_with_its_connections_closed(tmp_path):  # type: ignore[no-untyped-def]
    """The idle data-plane connections a read left pooled were found open by Python's finalizer:
    one ResourceWarning per connection (``unclosed <socket ... monarch_nb-dp-...>``) at the exit
    of any process that read a large mesh tensor, shown under ``python -X dev`` and pytest."""
    import subprocess
    import sys

    script = tmp_path / "reads.py"
    script.write_text(
        "import torch\nimport monarch_nb.tensor as mt\nfrom monarch_nb.actor import this_host\n"
        "procs = this_host().spawn_procs(per_host={'gpus': 2}, name='tensorexit')\n"
        "x = mt.distribute(torch.ones(1024, 512), procs, [mt.Shard(0)])\n"
        "print(mt.inspect(x * 2).sum().item(), mt.stats(procs)['bytes_received'] >= 2 << 20)\n"
        "procs.stop().get(timeout=30)\n"
    )
    p = subprocess.run([sys.executable, "-X", "dev", str(script)], capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(2.0 * 1024 * 512), "True"], p.stdout  # its 2 MiB came by the data plane
    assert "ResourceWarning" not in p.stderr, p.stderr


def _shard_linears(name, mod, mesh):  # type: ignore[no-untyped-def]
    from torch import nn
    from torch.distributed.tensor import distribute_tensor

    if isinstance(mod, nn.Linear):
        for n, p in list(mod.named_parameters()):
            mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Replicate(), Shard(0)])))


def test_distribute_module_trains_on_the_ranks(mesh2):  # type: ignore[no-untyped-def]
    import copy

    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    local = copy.deepcopy(model)
    m = mt.distribute_module(model, mesh2, _shard_linears)
    params = m.parameters()
    assert (tuple(params[0].shape), params[0].placements) == ((16, 8), (Replicate(), Shard(0)))
    X, Y = gen(16, 8), torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(1))
    x, y = mt.distribute(X, mesh2, [Shard(0), Replicate()]), mt.distribute(Y, mesh2, [Shard(0), Replicate()])
    opt, opt_l = mt.Optimizer(torch.optim.SGD, params, lr=0.3), torch.optim.SGD(local.parameters(), lr=0.3)
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt_l.zero_grad()
        want = F.cross_entropy(local(X), Y)
        want.backward()
        opt_l.step()
        torch.testing.assert_close(mt.inspect(loss), want.detach())
    torch.testing.assert_close(mt.inspect(params[2]), local[2].weight.detach())


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


@pytest.mark.parametrize("dims", ["1d", "2d"])
def test_fully_shard_trains_as_single_process_training(mesh1, mesh2, dims):  # type: ignore[no-untyped-def]
    """FSDP2 (HSDP on the 2-D mesh) on the ranks, Adam stepped with one message: five steps
    match the same model trained in one process, in float64."""
    import copy

    from torch import nn

    procs = mesh1 if dims == "1d" else mesh2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), _Block(10), _Block(10), nn.Linear(10, 3))
    local = copy.deepcopy(model)
    m = mt.fully_shard(model, procs, wrap=_Block)
    params = m.parameters()
    n = len(procs.extent)
    assert (tuple(params[0].shape), params[0].placements) == ((10, 6), (*[Replicate()] * (n - 1), Shard(0)))
    # FSDP's own shards: dim 0 split over the last mesh dimension
    assert mt.fetch_shard(params[0], gpus=1).get(timeout=30).shape == ((10 + 3) // 4 if n == 1 else 5, 6)
    X, Y = gen(16, 6, seed=5), torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(6))
    batch = [Shard(0)] * n
    x, y = mt.distribute(X, procs, batch), mt.distribute(Y, procs, batch)
    opt = mt.Optimizer(torch.optim.Adam, params, lr=0.01)
    opt_l = torch.optim.Adam(local.parameters(), lr=0.01)
    sent = mt.stats(procs)["messages_sent"]
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt_l.zero_grad()
        want = F.cross_entropy(local(X), Y)
        want.backward()
        opt_l.step()
        torch.testing.assert_close(mt.inspect(loss), want.detach())
    assert params[0].grad is not None and params[0].grad.shape == (10, 6)
    for p, q in zip(params, local.parameters()):
        torch.testing.assert_close(mt.inspect(p), q.detach())
    with pytest.raises(TensorOpError, match="Shard\\(0\\) on every mesh dimension"):
        m(mt.distribute(X, procs, [Replicate()] * n))
    assert mt.stats(procs)["messages_sent"] - sent < 5 * 12, "each step is a handful of messages"


def _rdma_read(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from monarch_nb.rdma import bytes_moved

    v = float(bytes_moved()["read"]) if x.device.type != "meta" else 0.0
    n = x.device_mesh.ndim
    return DTensor.from_local(torch.tensor(v, device=x.device), x.device_mesh, [Replicate()] * n, run_check=False)


def test_large_shards_travel_by_the_data_plane(mesh2, monkeypatch):  # type: ignore[no-untyped-def]
    """Large pieces: distribute hands each rank an RDMABuffer of its piece and full_tensor reads
    each distinct piece from its rank: values right for every placement, bytes counted."""
    from monarch_nb.rdma import bytes_moved

    monkeypatch.setattr(mt._engine, "DISTRIBUTE_DATA_PLANE_BYTES", 1 << 20)  # 32 MiB pieces by default

    t = gen(1024, 520)  # 4.3 MB of float64: each of 4 pieces over 1 MiB
    ranks = [(h, g) for h in range(2) for g in range(2)]
    for pl in (
        [Shard(0), Shard(1)],
        [Replicate(), Shard(0)],
        [Shard(1), Shard(1)],
        [Replicate(), Replicate()],
        [Partial(), Shard(0)],
    ):
        counts = mt.remote(_rdma_read)(mt.zeros(1, procs=mesh2))
        before = [mt.fetch_shard(counts, hosts=h, gpus=g).get(timeout=30).item() for h, g in ranks]
        h = mt.distribute(t, mesh2, pl)
        counts = mt.remote(_rdma_read)(h)
        for (i, j), b in zip(ranks, before):
            got = mt.fetch_shard(counts, hosts=i, gpus=j).get(timeout=30).item() - b
            want = math.prod(h.local_shape(hosts=i, gpus=j)) * 8
            assert got == want, f"rank {i, j} read its piece through the data plane ({pl})"
        read, received = bytes_moved()["read"], mt.stats(mesh2)["bytes_received"]
        torch.testing.assert_close(h.full_tensor(), t)
        if isinstance(pl[0], Partial):  # summed on the ranks first: the collective, rank 0 sends it
            assert bytes_moved()["read"] == read
        else:  # each distinct piece once, straight from its rank
            assert bytes_moved()["read"] - read == t.numel() * 8
            got = mt.stats(mesh2)["bytes_received"] - received
            assert t.numel() * 8 <= got < t.numel() * 8 + 4096  # the values, and the buffers' small handles


def _mib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(field + ":")[1].split()[0]) >> 10


def test_distribute_holds_one_copy_of_a_large_tensor_while_the_ranks_read_it(mesh1):  # type: ignore[no-untyped-def]
    # the piece the ranks read was a clone that RDMABuffer then copied into shared memory: two
    # copies on the controller, 128 MiB more at peak for a 64 MiB tensor; now made there at once
    t = torch.full((16 << 20,), 2.0, dtype=torch.float32)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from here
    base = _mib("VmRSS")
    h = mt.distribute(t, mesh1, [Replicate()])
    assert mt.inspect(h.sum()).item() == 2.0 * t.numel()
    assert _mib("VmHWM") - base < 96, "one copy of the 64 MiB tensor while the ranks read it"


def test_fetch_shard_of_a_large_piece_reads_it_by_the_data_plane(mesh2, gate):  # type: ignore[no-untyped-def]
    """A local tensor of 1 MiB and more is lent by its rank as an RDMABuffer and read here:
    the right piece for every placement, its bytes counted once, the future still a future."""
    from monarch_nb.rdma import bytes_moved

    t = gen(1024, 520)  # each rank's piece of Shard(0), Shard(1): 512 x 260 float64, just over 1 MiB
    for pl, coords, want in [
        ([Shard(0), Shard(1)], {"hosts": 1, "gpus": 0}, t[512:, :260]),
        ([Replicate(), Shard(0)], {"hosts": 1, "gpus": 1}, t[512:]),
        ([Partial(), Replicate()], {"hosts": 0, "gpus": 1}, t),  # Partial: host 0 holds the value
        ([Partial(), Replicate()], {"hosts": 1, "gpus": 1}, torch.zeros_like(t)),
    ]:
        h = mt.distribute(t, mesh2, pl) * 1
        read, received = bytes_moved()["read"], mt.stats(mesh2)["bytes_received"]
        got = mt.fetch_shard(h, coords).get(timeout=60)
        assert torch.equal(got, want), (pl, coords)
        assert bytes_moved()["read"] - read == want.numel() * 8
        assert want.numel() * 8 <= mt.stats(mesh2)["bytes_received"] - received < want.numel() * 8 + 4096
    flag = gate()
    x = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    blocked = mt.remote(_wait_for_flag)(x, flag.path)
    try:
        pending = [mt.fetch_shard(blocked, hosts=1, gpus=1) for _ in range(2)]  # two reads of one piece
        assert not pending[0].done()
    finally:
        flag.open()
    for f in pending:
        torch.testing.assert_close(f.get(timeout=60), t[512:, 260:])
    small = mt.distribute(gen(8, 6), mesh2, [Shard(0), Shard(1)])
    read = bytes_moved()["read"]
    torch.testing.assert_close(mt.fetch_shard(small, hosts=1).get(timeout=30), gen(8, 6)[4:, :3])
    assert bytes_moved()["read"] == read  # a small piece comes in its reply


def test_to_mesh_moves_each_ranks_piece_to_the_same_coordinates(mesh1, mesh2, gate):  # type: ignore[no-untyped-def]
    other = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="tensor2d_b")
    try:
        for pl in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Partial(), Replicate()]):
            t = gen(7, 6)
            h = mt.distribute(t, mesh2, pl) * 2
            y = h.to_mesh(other)
            assert y.mesh is not h.mesh and (y.shape, y.placements) == (t.shape, tuple(pl))
            torch.testing.assert_close(mt.inspect(y + 1), t * 2 + 1)
            with pytest.raises(ValueError, match=r"different proc meshes .*; move one to the other's first, e.g. t.to_mesh"):
                y + h
            for i, j in itertools.product(range(2), range(2)):
                mine = mt.fetch_shard(y, hosts=i, gpus=j).get(timeout=30)
                assert torch.equal(mine, mt.fetch_shard(h, hosts=i, gpus=j).get(timeout=30))
        big = gen(1024, 520)
        (moved,) = mt.to_mesh([mt.distribute(big, mesh2, [Shard(0), Replicate()])], other)
        assert torch.equal(moved.full_tensor(), big)
        with pytest.raises(ValueError, match="this tensor's dimensions"):
            h.to_mesh(mesh1)
        with pytest.raises(ValueError, match="requires grad"):
            h.requires_grad_().to_mesh(other)
        # queued: the destination's ranks pull their pieces in its ordered stream, so neither
        # to_mesh nor the ops after it wait for the source here
        t = gen(8, 6)
        flag = gate()
        blocked = mt.remote(_wait_for_flag)(mt.distribute(t, mesh2, [Shard(0), Shard(1)]), flag.path)
        try:
            moved = blocked.to_mesh(other) + 1
            assert moved.shape == (8, 6)
            pending = mt.fetch_shard(moved, hosts=1, gpus=1)
            assert not pending.done()
        finally:
            flag.open()
        torch.testing.assert_close(pending.get(timeout=60), t[4:, 3:] + 1)
        bad = F.cross_entropy(mt.distribute(gen(8, 5), mesh2, [Shard(0), Replicate()]), torch.full((8,), 99))
        with pytest.raises(Exception, match="out of bounds"):  # the source's error, on the destination's tensor
            mt.inspect(bad.reshape(1).to_mesh(other) * 2)
    finally:
        other.stop().get(timeout=30)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (FSDP2 over NCCL)")
def test_nccl_fully_shard_on_gpus():  # type: ignore[no-untyped-def]
    import copy

    from torch import nn

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="tensorcudafsdp")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        local = copy.deepcopy(model)
        m = mt.fully_shard(model, procs)
        assert mt.stats(procs)["backend"] == "nccl"
        X = gen(8, 6)
        torch.testing.assert_close(mt.inspect(m(mt.distribute(X, procs, [Shard(0)]))), local(X).detach())
    finally:
        procs.stop().get(timeout=30)


def test_wrong_input_is_refused_here_before_anything_is_sent(mesh1, mesh2):  # type: ignore[no-untyped-def]
    x = mt.distribute(gen(4, 4), mesh1, [Shard(0)])
    y = mt.distribute(gen(4, 4), mesh2, [Shard(0), Replicate()])
    # (a slice no other test makes: a slice's tensors report the first slice object made for it as .mesh)
    half = mt.distribute(gen(4, 4), mesh2.slice(gpus=0), [Shard(0)])
    for p in (x, y, half):
        p.requires_grad_()
    sent = mt.stats(mesh1)["messages_sent"], mt.stats(mesh2)["messages_sent"]
    # each proc mesh numbers its own tensors: mesh2's parameter would have named one of mesh1's
    # (the optimizer stepped x twice and never y)
    for a, b in ((x, y), (y, half)):
        with pytest.raises(ValueError, match="Optimizer: its parameters live on different proc meshes"):
            mt.Optimizer(torch.optim.SGD, [a, b], lr=0.1)
    # one placement where a list is wanted: said as a wrong placements argument, not "'Shard' object is not iterable"
    for make in (lambda: mt.distribute(gen(4, 4), mesh1, Shard(0)), lambda: mt.zeros(4, procs=mesh1, placements=Shard(0))):
        with pytest.raises(
            ValueError, match=r"placements must be 1 DTensor placements .* one per dimension \['gpus'\].*got Shard\(dim=0\)"
        ):
            make()
    # a 0-d tensor has no dimension to shard (it was a ZeroDivisionError)
    with pytest.raises(ValueError, match=r"S\(0\) is out of range for a tensor of 0 dimensions"):
        mt.distribute(torch.tensor(3.0), mesh1, [Shard(0)])
    for bad in ("1", 1.0):  # was torch's or Python's words about comparing and indexing
        with pytest.raises(TypeError, match="a coordinate is an int from 0 to 3"):
            mt.fetch_shard(x, gpus=bad)
    assert (mt.stats(mesh1)["messages_sent"], mt.stats(mesh2)["messages_sent"]) == sent


def test_tensors_on_slices_of_a_proc_mesh_and_between_them(mesh2, gate):  # type: ignore[no-untyped-def]
    """A slice of a proc mesh holds mesh tensors of its own (its device mesh named as the slice);
    to_mesh moves one from a slice to another, as pipeline stages do."""
    stage0, stage1 = mesh2.slice(hosts=0), mesh2.slice(hosts=1)
    t, w = gen(8, 6), gen(6, 4, seed=1)
    x = mt.distribute(t, stage0, [Shard(0)])
    assert x.mesh is stage0 and x.placements == (Shard(0),)
    html = x._repr_html_()  # one row per rank of the slice, each with its own piece
    assert html.count("<tr><td>gpus=") == 2 and "-2.31" in html and "1.011" in html
    y = torch.relu(x @ mt.distribute(w, stage0, [Replicate()]))
    torch.testing.assert_close(mt.inspect(y), torch.relu(t @ w))
    torch.testing.assert_close(mt.inspect(y.redistribute(placements=[Replicate()])), torch.relu(t @ w))
    assert mt.fetch_shard(y, gpus=1).get(timeout=30).shape == (4, 4)
    z = y.to_mesh(stage1) * 2  # stage 0's rank gpus=g sends its piece to stage 1's gpus=g
    assert z.mesh is stage1
    torch.testing.assert_close(mt.inspect(z), torch.relu(t @ w) * 2)
    with stage1.activate():
        ones = torch.ones(4)
    torch.testing.assert_close(mt.inspect(mt.reduce(ones, "gpus", "sum")), torch.full((4,), 2.0))
    # the whole mesh's tensors are untouched by the slices' ops, and work alongside
    whole = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    torch.testing.assert_close(mt.inspect(whole + 1), t + 1)
    with pytest.raises(ValueError, match="different proc meshes"):
        x + mt.distribute(t, stage1, [Shard(0)])
    # between slices of one mesh: point to point in the ordered stream, so no wait here
    flag = gate()
    blocked = mt.remote(_wait_for_flag)(x, flag.path)
    try:
        moved = blocked.to_mesh(stage1)
        assert moved.shape == (8, 6)
        pending = mt.fetch_shard(moved, gpus=1)
        assert not pending.done()
    finally:
        flag.open()
    torch.testing.assert_close(pending.get(timeout=60), t[4:])
    bad = F.cross_entropy(mt.distribute(gen(8, 5), stage0, [Shard(0)]), torch.full((8,), 99)).reshape(1)
    with pytest.raises(Exception, match="to_mesh: the source tensor on rank 0 has no value"):
        mt.inspect(bad.to_mesh(stage1))
    cols = mesh2.slice(gpus=1)  # a slice across the hosts
    c = mt.distribute(t, cols, [Shard(1)])
    torch.testing.assert_close(mt.inspect(c.sum(dim=1)), t.sum(dim=1))


def test_a_slice_dropping_a_dimension_of_size_one_holds_tensors_of_its_own_dimensions():  # type: ignore[no-untyped-def]
    # pipeline code written for N hosts, run on one: procs.slice(hosts=0) has every rank of the
    # mesh, and was taken for the whole mesh ("placements must be 2 ..., one per dimension
    # ['hosts', 'gpus'] of ProcMesh(extent={gpus: 2})")
    procs = this_host().spawn_procs(per_host={"hosts": 1, "gpus": 2}, name="tensorone")
    try:
        stage = procs.slice(hosts=0)
        t = gen(5, 3)
        h = mt.distribute(t, stage, [Shard(0)])
        assert h.placements == (Shard(0),)
        torch.testing.assert_close(mt.inspect(h), t)
        torch.testing.assert_close(mt.fetch_shard(h, gpus=1).get(timeout=30), t[3:])
        torch.testing.assert_close(mt.inspect(torch.relu(h).sum(0)), torch.relu(t).sum(0))
        # and to the whole mesh, broadcast over its hosts dimension
        w = h.to_mesh(procs)
        assert w.placements == (Replicate(), Shard(0))
        torch.testing.assert_close(mt.inspect(w), t)
        torch.testing.assert_close(mt.inspect(mt.distribute(t, procs, [Replicate(), Shard(1)]) * 2), t * 2)
    finally:
        procs.stop().get(timeout=60)


def test_slice_mesh_then_to_mesh_broadcasts_over_the_missing_dimension(mesh1, mesh2):  # type: ignore[no-untyped-def]
    """Monarch's ``t.slice_mesh(hosts=1).to_mesh(mesh)``: host 1's piece, copied to every host."""
    t = gen(8, 6)
    h = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    s = h.slice_mesh(hosts=1)
    assert (s.shape, s.placements) == ((4, 6), (Shard(1),))
    torch.testing.assert_close(mt.inspect(s), t[4:])
    b = s.to_mesh(mesh2)
    assert (b.shape, b.placements) == ((4, 6), (Replicate(), Shard(1)))
    torch.testing.assert_close(mt.inspect(b), t[4:])
    for host in range(2):
        torch.testing.assert_close(mt.fetch_shard(b, hosts=host, gpus=1).get(timeout=30), t[4:, 3:])
    one = mt.distribute(t, mesh1, [Replicate()]).slice_mesh(gpus=2)  # a mesh of one rank
    torch.testing.assert_close(mt.inspect(one * 2), t * 2)
    with pytest.raises(ValueError, match="redistribute first"):
        mt.distribute(t, mesh2, [Partial(), Replicate()]).slice_mesh(hosts=0)
    with pytest.raises(ValueError, match="this tensor's dimensions"):
        s.to_mesh(mesh1)  # gpus: 2 here, 4 there


def test_slice_mesh_with_ranges_keeps_the_chosen_ranks_pieces(mesh1, mesh2):  # type: ignore[no-untyped-def]
    """``slice_mesh(gpus=slice(a, b))`` keeps the dimension: the slice's tensor is the
    concatenation of the chosen ranks' pieces, each still on its own rank."""
    t = gen(7, 6)
    h = mt.distribute(t, mesh1, [Shard(0)])  # rows 2, 2, 2, 1 on gpus 0..3
    for rng, want in [
        (slice(1, 3), t[2:6]),
        (slice(2, 4), t[4:]),
        (slice(0, 4, 2), torch.cat([t[0:2], t[4:6]])),
        (slice(None), t),
    ]:
        s = h.slice_mesh(gpus=rng)
        assert (s.shape, s.placements) == (want.shape, (Shard(0),))
        torch.testing.assert_close(mt.inspect(s), want)
        torch.testing.assert_close(mt.inspect((s * 2).sum(dim=0)), (want * 2).sum(dim=0))
        for k, g in enumerate(range(4)[rng]):
            torch.testing.assert_close(mt.fetch_shard(s, gpus=k).get(timeout=30), torch.chunk(t, 4)[g])
    r = mt.distribute(t, mesh1, [Replicate()]).slice_mesh(gpus=slice(1, 3))
    assert dict(r.mesh.extent) == {"gpus": 2}
    torch.testing.assert_close(mt.inspect(r.redistribute(placements=[Shard(1)])), t)

    u = gen(8, 6)
    p = mt.distribute(u, mesh2, [Partial(), Shard(0)])  # Partial kept whole, the Shard cut
    s2 = p.slice_mesh(hosts=slice(None), gpus=slice(1, 2))
    assert (s2.shape, s2.placements) == ((4, 6), (Partial(), Shard(0)))
    torch.testing.assert_close(mt.inspect(s2), u[4:])
    both = mt.distribute(u, mesh2, [Shard(0), Shard(1)]).slice_mesh(hosts=1, gpus=slice(0, 1))
    assert (both.shape, both.placements) == ((4, 3), (Shard(1),))
    torch.testing.assert_close(mt.inspect(both), u[4:, :3])

    with pytest.raises(ValueError, match="would not cut that way"):
        mt.distribute(gen(5, 2), mesh1, [Shard(0)]).slice_mesh(gpus=slice(1, 4))  # rows 2, 1, 0
    with pytest.raises(ValueError, match="redistribute first"):
        p.slice_mesh(hosts=slice(0, 1))
    with pytest.raises(ValueError, match="an int, which drops the dimension. or a range"):
        h.slice_mesh(gpus="0")


def test_monarchs_method_forms_reduce_rank_tensors_and_slice_mesh(mesh2):  # type: ignore[no-untyped-def]
    # 0.7.0's ``t.reduce(dims, reduction)`` and ``procs.rank_tensors()``: an AttributeError here
    h = mt.distribute(gen(8, 6), mesh2, [Shard(0), Shard(1)])
    torch.testing.assert_close(mt.inspect(h.reduce("gpus", "avg")), mt.inspect(mt.reduce(h, "gpus", "avg")))
    with pytest.raises(NotImplementedError, match=r"out = t.reduce\(dims\)"):
        h.reduce("gpus", out=h)
    with pytest.raises(NotImplementedError, match="scatter=True"):
        h.reduce("gpus", "sum", True)
    # and the module's slice_mesh over a pytree, as its to_mesh
    pieces = mt.slice_mesh({"h": [h], "n": 3}, hosts=1)
    assert pieces["n"] == 3 and pieces["h"][0].placements == (Shard(1),)
    torch.testing.assert_close(mt.inspect(pieces["h"][0]), gen(8, 6)[4:])
    ranks = mesh2.rank_tensors()
    assert list(ranks) == ["hosts", "gpus"]
    assert [int(mt.fetch_shard(ranks["hosts"], hosts=1, gpus=c).get(timeout=30).item()) for c in range(2)] == [1, 1]


def test_fetch_shard_and_inspect_take_a_pytree_as_monarchs(mesh2, monkeypatch):  # type: ignore[no-untyped-def]
    # 0.7.0's fetch_shard(obj, ...) and inspect(obj, ...) take a pytree; here a tuple was a
    # TypeError and inspect of a dict an AttributeError ('dict' object has no attribute 'full_tensor')
    monkeypatch.setattr(mt._engine, "DATA_PLANE_BYTES", 100)  # b's pieces (192 B) by the data plane, a's (96 B) in replies
    t = gen(8, 6)
    a = mt.distribute(t, mesh2, [Shard(0), Shard(1)])
    b = mt.distribute(t * 2, mesh2, [Replicate(), Shard(0)])
    got = mt.fetch_shard({"a": a, "rest": (b, "step", 3)}, hosts=1, gpus=1).get(timeout=30)
    assert got["rest"][1:] == ("step", 3)
    torch.testing.assert_close(got["a"], t[4:, 3:])
    torch.testing.assert_close(got["rest"][0], t[4:] * 2)
    x, y = mt.inspect((a, b))
    torch.testing.assert_close(x, t)
    torch.testing.assert_close(y, t * 2)
    torch.testing.assert_close(mt.inspect([a], gpus=1)[0], t[:4, 3:])
    for fn in (mt.fetch_shard, mt.inspect):
        with pytest.raises(TypeError, match=r"a MeshTensor \(or a pytree of them\), got tuple"):
            fn((t, 1))
    with pytest.raises(ValueError, match="out of range"):  # checked before anything is read
        mt.fetch_shard((a, b), gpus=2)


def test_backward_takes_torchs_inputs_to_accumulate_into_only_those(mesh1):  # type: ignore[no-untyped-def]
    # torch's (and so 0.7.0's) backward(inputs=...): a TypeError here before
    w = mt.distribute(torch.ones(8, 2), mesh1, [Shard(0)]).requires_grad_()
    v = mt.distribute(torch.ones(8, 2), mesh1, [Shard(0)]).requires_grad_()
    (w * 3 + v * 5).sum().backward(inputs=[w])
    torch.testing.assert_close(mt.inspect(w.grad), torch.full((8, 2), 3.0))
    assert v.grad is None
    (w * 3 + v * 5).sum().backward(inputs=v)
    torch.testing.assert_close(mt.inspect(v.grad), torch.full((8, 2), 5.0))


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_remote_takes_monarchs_dotted_name_and_decorator_call(mesh1):  # type: ignore[no-untyped-def]
    # 0.7.0's remote("pkg.fn") and @remote(): a TypeError and a call of None here before
    x = mt.distribute(gen(8, 6), mesh1, [Shard(0)])
    relu = mt.remote("torch.nn.functional.relu")
    torch.testing.assert_close(mt.inspect(relu(x - 0.5)), F.relu(gen(8, 6) - 0.5))
    torch.testing.assert_close(mt.inspect(mt.remote()(_double)(x)), gen(8, 6) * 2)
    sent = mt.stats(mesh1)["messages_sent"]
    with pytest.raises(NotImplementedError, match="propagate=.*pass fn alone"):
        mt.remote(_double, propagate=lambda t: t)
    with pytest.raises(ValueError, match=r"remote\('no_such_module_x.fn'\): cannot import it here"):
        mt.remote("no_such_module_x.fn")
    assert mt.stats(mesh1)["messages_sent"] == sent
