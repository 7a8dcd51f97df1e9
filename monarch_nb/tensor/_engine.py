"""The controller side: a handle per mesh tensor, its meta "shadow" DTensor (shape, dtype,
placements and autograd structure, known at once), and one engine per proc mesh that sends
op records to the ranks in one ordered stream."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import os
import pickle
import sys
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._wire.serialize import loads, nbytes
from ..actor import Future
from ..actor._mesh import ProcMesh
from ..errors import ActorError, MeshClosedError, MonarchNBError, SupervisionError
from ._ops import (
    Agree,
    Attr,
    Factory,
    Lit,
    Method,
    Ref,
    SetAttr,
    Via,
    WithMesh,
    chunk_range,
    local_shape,
    local_view,
    op_name,
)
from ._worker import OP_ATTR, OP_ID_ATTR, OP_SITE_ATTR, TensorWorker

#: seconds a collective on the ranks may wait for a peer before it fails (a dead rank)
COLLECTIVE_TIMEOUT_S = 60.0
#: seconds the controller waits for a value (full_tensor, inspect, setup) before giving up
VALUE_TIMEOUT_S = 300.0
#: how long showing a mesh tensor (its repr in a cell) waits for the ranks' first values
PREVIEW_WAIT_S = 10.0
#: full_tensor of a tensor from this size up reads each piece from its rank by the data plane
#: (an RDMABuffer the controller reads: a shared-memory copy on one host, a direct stream across
#: hosts) instead of an all-gather on the ranks and rank 0's reply; faster from 16 MiB to 256 MiB
#: here (bench/tensor_ops.py)
DATA_PLANE_BYTES = 1 << 20
#: distribute sends a piece from this size up as an RDMABuffer the rank reads, smaller ones
#: inside its message (which the transport already moves out of band): making the buffer costs
#: more than it saves below pieces of tens of MiB on this machine (bench/tensor_ops.py)
DISTRIBUTE_DATA_PLANE_BYTES = 32 << 20


class TensorOpError(MonarchNBError, RuntimeError):
    """An op that DTensor cannot run on these placements; raised on the controller before
    anything is sent (nothing is computed on the controller).

    ``error``: torch's own error, when the op's dry run on meta tensors raised one (its text is
    in this one's message; its traceback, torch's sharding propagation and fake tensors, is not
    shown: the user's frames of it are, see ``_render_traceback_``).
    """

    error: BaseException | None = None

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the chain: torch's error (~20 frames of sharding
        # propagation and fake tensors) then ours through the engine, 140 lines whose message
        # was already in ours. What the user wrote is what locates the bug: the cell's line that
        # issued the op, and a mesh.remote fn's own line where its dry run failed
        import traceback

        from .._errgroup import cell_number, clean_traceback

        frames = [f for f in traceback.extract_tb(self.__traceback__) if _users(f.filename)]
        if self.error is not None:
            frames += [f for f in traceback.extract_tb(self.error.__traceback__) if _users(f.filename)]
        cells = [i for i, f in enumerate(frames) if cell_number(f.filename) is not None]
        frames = frames[cells[0] :] if cells else frames  # not IPython's own, which ran the cell
        lines = (str(self) or type(self).__name__).splitlines()
        out = [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {lines[0]}", *lines[1:]]
        if frames:
            tb = clean_traceback("".join(traceback.format_list(frames)), internal=False)
            out += ["Traceback (most recent call last):", *tb.rstrip("\n").splitlines()]
        return out + self._note_lines()


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@functools.lru_cache(maxsize=1024)
def _users(path: str) -> bool:
    """A frame of the user's code: neither monarch_nb's (the engine) nor torch's (DTensor's
    dispatch, fake tensors), where a mesh tensor op's dry run fails. Cached: every op walks its
    caller's frames through here, and ``_internal`` stats a file per frame."""
    from .._errgroup import _internal

    return not path.startswith(_TORCH_DIR) and not _internal(path)


def _op_error(message: str, error: BaseException) -> TensorOpError:
    """A TensorOpError for ``error`` (torch's, from an op's dry run), raised ``from None``: its text
    is in ``message``, and its chained traceback (torch's frames) would bury the user's line."""
    err = TensorOpError(message)
    err.error = error
    return err


_shadow_lock = threading.Lock()
_shadow_meshes: dict[tuple[tuple[str, ...], tuple[int, ...]], Any] = {}


def _shadow_mesh(labels: tuple[str, ...], sizes: tuple[int, ...]) -> Any:
    """A DeviceMesh of the proc mesh's shape in this process, over torch's fake process group:
    DTensor's sharding propagation runs on meta tensors against it; no byte moves."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (labels, sizes)
    with _shadow_lock:
        if key in _shadow_meshes:
            return _shadow_meshes[key]
        if not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore

            hook = sys.excepthook
            dist.init_process_group("fake", rank=0, world_size=1 << 16, store=FakeStore())
            # torch prefixes every line of an uncaught error's traceback with "[rank0]: " (its
            # hook, set by init_process_group): this process is the controller, rank 0 of nothing,
            # and a script's failed op read as rank 0's, its controller frames included
            sys.excepthook = hook
        elif dist.get_backend() != "fake":
            raise TensorOpError(
                "this controller already has a torch.distributed process group; mesh tensors need "
                "the controller's default group to be torch's fake one (do not init_process_group here)"
            )
        n = math.prod(sizes)
        mesh = DeviceMesh("cpu", torch.arange(n).reshape(sizes), mesh_dim_names=labels)
        _shadow_meshes[key] = mesh
        return mesh


class Engine:
    """One per proc mesh: the hidden worker actor, the id counter, the frees to send."""

    def __init__(self, procs: ProcMesh, root: Engine | None = None) -> None:
        self.procs = procs
        ext = procs.extent
        self.labels = tuple(ext.keys()) or ("ranks",)
        self.sizes = tuple(ext.values()) or (1,)
        self.size = math.prod(self.sizes)
        self.shadow_mesh = _shadow_mesh(self.labels, self.sizes)
        #: a slice's engine drives the whole mesh's worker (one table, one ordered stream, one
        #: process group): its messages carry ``key`` and go to every rank, and ``ranks`` maps
        #: its ranks to the whole mesh's
        self.root = root
        self.key: tuple[int, ...] | None = None
        self.ranks = list(range(self.size))
        if root is not None:
            pos = {g: i for i, g in enumerate(root.procs._view.ranks)}
            self.ranks = [pos[g] for g in procs._view.ranks]
            self.key = tuple(self.ranks)
        self._ids: itertools.count[int] = root._ids if root is not None else itertools.count(1)
        #: names this engine's worker on the ranks, for a handle passed to an actor there
        self.token: str = root.token if root is not None else os.urandom(8).hex()
        #: ids of handles collected on the controller, sent with the next broadcast
        self.frees: collections.deque[Any] = root.frees if root is not None else collections.deque()
        #: id -> how many times its handle was pickled into an actor call: its free then says so,
        #: and each rank keeps the tensor until that many calls took it (or a timeout)
        self.lends: dict[int, int] = root.lends if root is not None else {}
        #: id -> where the user's code issued the op making it (file, line): an op's error on the
        #: ranks is read later, by another line, and its traceback there has torch's frames only
        self.sites: dict[int, tuple[str, int]] = root.sites if root is not None else {}
        self.actor: Any = None
        #: the worker and its setup call, while a setup whose wait was interrupted goes on
        self._setting_up: tuple[Any, Any] | None = None
        self._start_lock = threading.Lock()
        self.backend = ""
        self.bytes_received = 0
        self.messages_sent = 0
        self.slices: dict[Any, Engine] = {}

    def __repr__(self) -> str:
        return f"<tensor engine on {self.procs!r}>"

    def new_id(self) -> int:
        return next(self._ids)

    def check_open(self) -> None:
        if self.procs._closed_error() is not None:
            # said in tensor words: the worker's own error would name a hidden actor
            raise MeshClosedError(
                f"the mesh tensors of proc mesh {self.procs._name!r} are gone: it was stopped "
                "(distribute them again on new procs)"
            )

    def start(self) -> Any:
        self.check_open()
        if self.root is not None:
            with self._start_lock:
                if self.actor is None:
                    actor = self.root.start()
                    actor.define.broadcast(self.take_frees(), self.key, self.ranks, list(self.labels), list(self.sizes))
                    self.backend = self.root.backend
                    self.actor = actor
            return self.actor
        with self._start_lock:
            if self.actor is None:
                try:
                    self._set_up()
                except KeyboardInterrupt as e:
                    # the notes named our hidden actors ("_tensor_engine.setup.call() still runs on
                    # 2 of 2 ranks ... stopping the mesh ends it now") and a future the user never had
                    e.__notes__ = [n for n in getattr(e, "__notes__", []) if not n.startswith("monarch_nb:")]
                    name = self.procs._name
                    e.add_note(
                        f"monarch_nb: only the wait stopped: the ranks of proc mesh {name!r} still set up their "
                        "process group for mesh tensors, and the next op waits for that."
                        if self._setting_up is not None
                        else f"monarch_nb: the setup of mesh tensors on proc mesh {name!r} was interrupted; the next "
                        "op sets them up again."
                    )
                    raise
        return self.actor

    def _set_up(self) -> None:
        if self._setting_up is None:
            from ..spmd import _tcp_host, setup_torch_elastic_env

            # procs on other hosts: rendezvous at the address the runtime reaches rank 0 at
            setup_torch_elastic_env(self.procs, use_ipaddr=bool(_tcp_host(self.procs)) or None)
            actor = self.procs.spawn("_tensor_engine", TensorWorker)
            call = actor.setup.call(list(self.labels), list(self.sizes), COLLECTIVE_TIMEOUT_S, self.token)
            self._setting_up = (actor, call)
        actor, call = self._setting_up
        try:
            self.backend = call.get(timeout=VALUE_TIMEOUT_S).values()[0]
        except KeyboardInterrupt:
            raise  # the setup goes on: the next op waits for it, not for a second one
        except BaseException:
            self._setting_up = None
            raise
        self._setting_up = None
        self.actor = actor

    def take_frees(self) -> list[int]:
        out: list[Any] = []
        while True:
            try:
                f = self.frees.popleft()
            except IndexError:
                return out
            out.append(f)
            self.sites.pop(f if isinstance(f, int) else f[0], None)

    def put_back_frees(self, frees: list[int]) -> None:
        """Frees taken for a message that was not sent: they go with the next one (else the
        ranks would keep those tensors for as long as the mesh lives)."""
        self.frees.extendleft(reversed(frees))

    def send(self, records: list[tuple[Any, ...]]) -> None:
        actor = self.start()
        site = _call_site() if records else None
        made = [_made(r) for r in records] if site is not None else []
        if site is not None:
            # an op making no tensor (loss.backward(), an optimizer's step) has no result id to
            # look its line up by when its error is read: the line travels with it
            records = [r if m is not None else (*r[:5], r[5] if len(r) > 5 else [], site) for r, m in zip(records, made)]
        frees = self.take_frees()
        # ops promote to the default dtype (int / 2, torch.full(..., 1.5)), on the shadows here
        # with this controller's: the ranks are told it where it is not torch's float32
        dtype = torch.get_default_dtype()
        try:
            if dtype != torch.float32:
                actor.run.broadcast(frees, records, self.key, dtype)
            elif self.key is None:
                actor.run.broadcast(frees, records)
            else:
                actor.run.broadcast(frees, records, self.key)
        except BaseException as e:
            self.put_back_frees(frees)
            if isinstance(e, (TypeError, pickle.PicklingError)):
                # pickling refused a function or value: say which op, and that nothing ran
                ops = ", ".join(_name(r[0]) for r in records)
                e.add_note(
                    f"mesh tensors: {ops} could not be sent to the ranks of {self.procs!r}, so nothing ran; "
                    "the function and arguments of an op on mesh tensors must be picklable"
                )
            raise
        self.messages_sent += 1
        if site is not None:
            for m in made:
                if m is not None:
                    self.sites[m] = site

    def put(self, rank: int, *args: Any) -> None:
        self.start().put._send(([], *args, self.key), {}, None, None, [self.ranks[rank]])
        self.messages_sent += 1

    def put_pieces(self, id: int, pieces: dict[int, torch.Tensor], placements: Any, shape: Any, stride: Any) -> None:
        """Send rank r its local tensor ``pieces[r]``; a large one goes as an RDMABuffer the rank
        reads (one buffer per distinct piece, dropped once every rank that needs it has it)."""
        from ..rdma import RDMABuffer

        lent: dict[int, tuple[Any, list[int]]] = {}
        for r, piece in pieces.items():
            if piece.numel() * piece.element_size() < DISTRIBUTE_DATA_PLANE_BYTES:
                self.put(r, id, piece, placements, shape, stride)
                continue
            key = piece.data_ptr()
            if key not in lent:
                lent[key] = (RDMABuffer(piece.view(-1).view(torch.uint8)), [])
            lent[key][1].append(r)
        for buf, ranks in lent.values():
            via = Via(buf, tuple(pieces[ranks[0]].shape), pieces[ranks[0]].dtype)
            fut = self.gather("put", ([], id, via, placements, shape, stride, self.key), ranks, "distribute()")
            self.messages_sent += 1
            fut.add_done_callback(_dropper(buf))

    def full_by_pieces(self, h: MeshTensor) -> torch.Tensor | None:
        """The global value read piece by piece from the ranks holding distinct pieces (no
        collective); None where a placement is Partial (the ranks must sum first)."""
        pl = h.placements
        if any(not isinstance(p, (Shard, Replicate)) for p in pl):
            return None
        holders = [r for r in range(self.size) if all(c == 0 for c, p in zip(self.coords_of(r), pl) if not isinstance(p, Shard))]
        bufs = self.gather("share", ([], h._id), holders, "full_tensor()").get(timeout=VALUE_TIMEOUT_S)
        out = torch.empty(h.shape, dtype=h.dtype)
        try:
            for r in holders:
                if bufs[r] is None:
                    continue
                view = local_view(out, self.coords_of(r), list(self.sizes), pl)
                dst = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype)
                bufs[r].read_into(dst.view(-1).view(torch.uint8), timeout=int(VALUE_TIMEOUT_S)).get(timeout=VALUE_TIMEOUT_S)
                if dst is not view:
                    view.copy_(dst)
                self.bytes_received += bufs[r].size()
        finally:
            for r in holders:
                if bufs[r] is not None:
                    bufs[r].drop()
        return out

    def read_lent(self, buf: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A rank's local tensor read from the RDMABuffer its ``share`` lent (None: empty),
        which is then dropped."""
        out = torch.empty(shape, dtype=dtype)
        if buf is None:
            return out
        try:
            buf.read_into(out.view(-1).view(torch.uint8), timeout=int(VALUE_TIMEOUT_S)).get(timeout=VALUE_TIMEOUT_S)
            self.bytes_received += buf.size()
        finally:
            buf.drop()
        return out

    def gather(self, method: str, args: tuple[Any, ...], ranks: list[int] | None, what: str) -> Future[list[Any]]:
        """Call ``method`` on ``ranks`` (all when None); the future holds their results, and
        the bytes of every reply are counted as received by the controller."""

        def decode(raws: list[Any]) -> list[Any]:
            out = []
            for r in raws:
                if r is not None:
                    self.bytes_received += nbytes(*r)
                out.append(loads(*r) if r is not None else None)
            # indexed by this engine's ranks (a slice's differ from the whole mesh's)
            return out if self.key is None else [out[i] for i in self.ranks]

        to = self.ranks if ranks is None else [self.ranks[r] for r in ranks]
        fut = getattr(self.start(), method)._gather(args, {}, None if self.key is None and ranks is None else to, what, decode)
        out: Future[list[Any]] = Future._create(what)
        mesh = (self.root or self).procs._name
        sites = self.sites
        fut.add_done_callback(lambda f: out._set_raw(f, lambda g: _said_as_op(g, what, mesh, sites)))
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        bad = set(coords) - set(self.labels)
        if bad:
            raise ValueError(f"{sorted(bad)} are not dimensions of {self.procs!r}; its dimensions are {list(self.labels)}")
        r = 0
        for name, size in zip(self.labels, self.sizes):
            c = coords.get(name, 0)
            if not isinstance(c, int):
                raise TypeError(f"{name}={c!r}: a coordinate is an int from 0 to {size - 1}")
            if not 0 <= c < size:
                raise ValueError(f"{name}={c} is out of range for a dimension of size {size}")
            r = r * size + c
        return r

    def coords_of(self, rank: int) -> list[int]:
        out = []
        for size in reversed(self.sizes):
            out.append(rank % size)
            rank //= size
        return out[::-1]


def _made(record: tuple[Any, ...]) -> int | None:
    """The id of an op record's first result: the controller keeps its op's line under it."""
    return next((i for i in record[3] if i is not None), None)


def _said_as_op(fut: Future[Any], what: str, mesh: str = "", sites: dict[int, tuple[str, int]] | None = None) -> Any:
    """``fut``'s result; its error headed with the op that failed on the ranks (or the read,
    ``what``), not with the hidden actor's endpoint ("Actor call _tensor_engine.full failed."),
    and the line of the user's code that issued it (``sites``: the engine's)."""
    try:
        return fut.get()
    except ActorError as err:
        for e in [err, *(err.failures or {}).values()]:
            op = getattr(e.exception, OP_ATTR, None)
            e.message = f"Mesh tensor op {op} failed." if op else f"{what} of a mesh tensor failed."
            e.actor = ""  # the hidden worker's name says nothing to the user; rank and host stay
            e.headline = e.message
            e.args = (e._headline(),)
            site = (sites or {}).get(getattr(e.exception, OP_ID_ATTR, None)) or getattr(  # type: ignore[arg-type]
                e.exception, OP_SITE_ATTR, None
            )
            if site is not None:
                e.origin = _site_text(*site)
        raise
    except SupervisionError as err:
        # the first line named the hidden worker's endpoint ("Endpoint call _tensor_engine.full()
        # failed, The actor ... TensorWorker ...") and said nothing of the tensors or what to do
        if getattr(err, "_said_as_op", False):  # one error read again
            raise
        err._said_as_op = True  # type: ignore[attr-defined]
        mesh = mesh or err.mesh
        words = "\n".join(err.message.splitlines()[1:]) or err.cause
        err.message = (
            f"{what} of a mesh tensor failed: a process of proc mesh {mesh!r} is gone, and with it its pieces "
            f"of every mesh tensor there (the other ranks' pieces stay readable with fetch_shard):\n{words}\n"
            f"To go on: stop the proc mesh (procs.stop()), spawn it again and distribute the tensors again."
        )
        err.args = (err.message,)
        raise


def _failed_rows(err: ActorError, size: int) -> list[str]:
    """A failed tensor's preview rows: each failing rank's own error (``IndexError: index 99 is
    out of bounds``), and for the others which ranks failed (every row said "ActorError: Mesh
    tensor op f failed.", as if every rank had, when one had)."""
    from .._errgroup import clip, ranks_text

    failures = err.failures or {}
    if not failures:
        return [f"({clip(err.message)})"] * size
    said = {}
    for r, f in failures.items():
        _, etype, msg, _ = f._failure_tuple(r)
        said[r] = f"({etype}: {clip(msg)})" if msg else f"({etype})"
    others = f"(not fetched: the op failed on {ranks_text(sorted(failures))}; mt.inspect(t) raises its error)"
    return [said.get(r, others) for r in range(size)]


def _call_site() -> tuple[str, int] | None:
    """Where the user's code called into the engine: the innermost frame neither monarch_nb's
    nor torch's (``F.cross_entropy(x, t)`` goes through torch's function before it gets here)."""
    f = sys._getframe(1)
    while f is not None:
        if _users(f.f_code.co_filename):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back  # type: ignore[assignment]
    return None


def _site_text(filename: str, line: int) -> str:
    """``issued by Cell In[4], line 1: y = x @ w`` (``file:line`` outside a notebook)."""
    import linecache

    from .._errgroup import cell_location, clip

    src = linecache.getline(filename, line).strip()
    return f"issued by {cell_location(filename, line)}" + (f": {clip(src)}" if src else "")


def _local_of(
    token: str, id: int, mesh: str, timeout_s: float, dtype: torch.dtype | None = None, ranks: list[int] | None = None
) -> Any:
    from ._worker import local_of

    return local_of(token, id, mesh, timeout_s, dtype, ranks)


def _dropper(buf: Any) -> Any:
    def drop(_: Any) -> None:
        buf.drop()

    return drop


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def engine_for(procs: ProcMesh) -> Engine:
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"mesh tensors live on a ProcMesh, got {type(procs).__name__}")
    root = getattr(procs, "_root", procs)
    with _engines_lock:
        e = _engines.get(procs.name)
        if e is None or e.procs._stopped:
            e = _engines[procs.name] = Engine(root)
        if root is procs or (
            list(procs._view.ranks) == list(root._view.ranks) and tuple(procs.extent.items()) == tuple(root.extent.items())
        ):
            return e
        # (a slice of every rank that drops a dimension of size 1, procs.slice(hosts=0) on one
        # host, is a slice too: its tensors have its dimensions, not the whole mesh's)
        # a slice: its own device mesh (named as the slice) over the whole mesh's worker
        key = (tuple(procs._view.ranks), tuple(procs.extent.items()))
        s = e.slices.get(key)
        if s is None:
            s = e.slices[key] = Engine(procs, e)
        return s


# --- handles ---------------------------------------------------------------------------------


class MeshTensor:
    """A DTensor living on the ranks of a proc mesh, held by the controller.

    Shape, dtype, placements and ``requires_grad`` are known here at once (from a meta shadow);
    torch ops on it are sent to the ranks and return new handles; values come back only with
    ``full_tensor()``, :func:`fetch_shard`, :func:`inspect` and :func:`reduce`.
    """

    __slots__ = ("_engine", "_id", "_shadow", "_keep", "_shown", "_dropped", "__weakref__")
    _keep: MeshTensor
    #: the last previews: (shadow version, when, rows), for the other formatters of one display
    _shown: tuple[int, float, list[str]]

    def __init__(self, engine: Engine, id: int, shadow: DTensor) -> None:
        self._engine = engine
        self._id = id
        self._shadow = shadow

    def __del__(self) -> None:
        try:
            if self.dropped:
                return
            lent = self._engine.lends.pop(self._id, 0)
            # a handle pickled into actor calls: the calls may reach the rank after this free
            self._engine.frees.append((self._id, lent) if lent else self._id)
        except AttributeError:  # a half-built handle
            pass

    def drop(self) -> None:
        """Monarch's ``drop()``: free this tensor on the ranks now (its memory goes once no other
        mesh tensor is a view of it), where ``del t`` waits for the handle to be collected, which
        a notebook's ``Out`` or a traceback can put off for long. Using it afterwards raises."""
        if self.dropped:
            return
        self.__del__()
        self._dropped = True
        e = self._engine.root or self._engine
        if e.actor is not None and e.procs._closed_error() is None:
            e.send([])  # the free goes now, not with the next op

    def reduce(
        self,
        dims: str | Sequence[str],
        reduction: str = "sum",
        scatter: bool = False,
        mesh: Any = None,
        _inplace: bool = False,
        out: Any = None,
    ) -> MeshTensor:
        """Monarch's ``t.reduce(dims, reduction)``: ``monarch_nb.tensor.reduce(t, ...)``."""
        if out is not None:
            raise NotImplementedError("t.reduce(..., out=...) is not supported on mesh tensors: out = t.reduce(dims)")
        from . import reduce

        result: MeshTensor = reduce(self, dims, reduction, scatter, mesh, _inplace)
        return result

    @property
    def dropped(self) -> bool:
        # a slot set only by drop() (and absent on a half-built handle)
        return getattr(self, "_dropped", False)

    def _check_live(self, what: str) -> None:
        if self.dropped:
            raise TensorOpError(
                f"{what}: this mesh tensor was dropped (t.drop()), and its value freed on the ranks; "
                "make it again (or keep a handle and drop it later)"
            )

    def __reduce__(self) -> Any:
        # among an actor endpoint's arguments (Monarch's actors take its tensors): each rank's
        # actor gets that rank's local tensor; the engine is started, so the op making it was sent
        self._check_live("an actor call's argument")
        e = self._engine.root or self._engine
        e.start()
        e.lends[self._id] = e.lends.get(self._id, 0) + 1
        # a slice's tensor: the ranks outside it must say so at once, not wait for it
        ranks = self._engine.ranks if self._engine.root is not None else None
        return (_local_of, (e.token, self._id, e.procs._name, VALUE_TIMEOUT_S, self.dtype, ranks))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return dispatch(func, args, kwargs or {})

    # metadata, answered here
    @property
    def shape(self) -> torch.Size:
        return self._shadow.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._shadow.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(self._shadow.placements)

    @property
    def ndim(self) -> int:
        return self._shadow.ndim

    @property
    def requires_grad(self) -> bool:
        return self._shadow.requires_grad

    @property
    def is_leaf(self) -> bool:
        return self._shadow.is_leaf

    @property
    def mesh(self) -> ProcMesh:
        return self._engine.procs

    def size(self, dim: int | None = None) -> Any:
        return self._shadow.size() if dim is None else self._shadow.size(dim)

    def dim(self) -> int:
        return self._shadow.dim()

    def numel(self) -> int:
        return self._shadow.numel()

    def __len__(self) -> int:
        return len(self._shadow)

    def __iter__(self) -> Any:
        # without it, Python would iterate through __getitem__ until an IndexError, which the
        # shadow raises as a TensorOpError
        return (self[i] for i in range(len(self)))  # type: ignore[index]

    def local_shape(self, **coords: int) -> list[int]:
        """The shape of the local tensor of the rank at ``coords`` (0 for dims not named)."""
        e = self._engine
        return local_shape(list(self.shape), e.coords_of(e.rank_of(coords)), list(e.sizes), self.placements)

    # values
    def full_tensor(self) -> torch.Tensor:
        """The global value, as a plain tensor here: a large one read piece by piece from the
        ranks holding them (the data plane), a small one gathered on the ranks (a collective)
        and sent by rank 0."""
        self._check_live("full_tensor()")
        if self.numel() * self.dtype.itemsize >= DATA_PLANE_BYTES:
            out = self._engine.full_by_pieces(self)
            if out is not None:
                return out
        fut = self._engine.gather("full", ([], self._id, self._engine.key), None, "full_tensor()")
        return fut.get(timeout=VALUE_TIMEOUT_S)[0]

    def item(self) -> Any:
        if self.numel() != 1:
            # torch's words, said before reading back what may be gigabytes only to refuse them
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
        return self.full_tensor().item()

    def tolist(self) -> Any:
        return self.full_tensor().tolist()

    def __bool__(self) -> bool:
        raise TypeError("the truth value of a mesh tensor needs its value: use inspect(t) or t.item()")

    # Python's conversions would fail with "must be a real number, not 'MeshTensor'"; its value
    # lives on the ranks, and reading it is a round trip the user should see (Monarch 0.7.0
    # raises DataDependentOutputException here, and for item() too)
    def __float__(self) -> float:
        raise TypeError("float() of a mesh tensor needs its value, which is on the ranks: use t.item() or mt.inspect(t)")

    def __int__(self) -> int:
        raise TypeError("int() of a mesh tensor needs its value, which is on the ranks: use t.item() or mt.inspect(t)")

    def __index__(self) -> int:
        raise TypeError("a mesh tensor as an index needs its value, which is on the ranks: use t.item() or mt.inspect(t)")

    def __complex__(self) -> complex:
        raise TypeError("complex() of a mesh tensor needs its value, which is on the ranks: use t.item() or mt.inspect(t)")

    def __setitem__(self, key: Any, value: Any) -> None:
        # torch 2.13's DTensor refuses a plain value ("mixed torch.Tensor and DTensor") and, on a
        # sharded dim, writes into a temporary copy, so the ranks' tensor stayed as it was without
        # a word; the out-of-place ops below do it on every placement
        raise TensorOpError(
            "item assignment (t[...] = value) is not supported on mesh tensors (torch's DTensor cannot do it "
            "in place on sharded placements); make the new tensor instead: t = torch.where(mask, value, t), "
            "t = t.masked_fill(mask, value) (in place: t.masked_fill_(mask, value)), "
            "t = t.index_fill(dim, index, value) or t = t.index_put(indices, values)"
        )

    def to(self, *args: Any, **kwargs: Any) -> MeshTensor:
        """As ``Tensor.to``; a device names the ranks' kind of device (each rank's tensor is on
        its own), so it is checked against the ranks, not against this controller's torch."""
        try:
            device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except TypeError:  # another tensor's dtype and device (t.to(other)): torch says what is wrong
            return dispatch(Method("to"), (self, *args), kwargs)
        if device is not None:
            _check_device(self._engine, device, f"t.to({str(device)!r})")
        out: dict[str, Any] = {}
        if dtype is not None and dtype != self.dtype:
            out["dtype"] = dtype
        if memory_format is not None and memory_format != torch.preserve_format:
            out["memory_format"] = memory_format
        if kwargs.get("copy"):
            out["copy"] = True
        if not out:
            return self  # as torch's: already there
        return dispatch(Method("to"), (self,), out)

    def cuda(self, device: Any = None, non_blocking: bool = False) -> MeshTensor:
        return self.to("cuda" if device is None else device)

    def cpu(self) -> MeshTensor:
        return self.to("cpu")

    # ops with no torch function of their own
    @property
    def grad(self) -> MeshTensor | None:
        if self._shadow.grad is None:
            return None
        return dispatch(Attr("grad"), (self,), {})

    @grad.setter
    def grad(self, value: MeshTensor | None) -> None:
        # torch's way to drop a gradient (p.grad = None); without a setter it raised AttributeError
        if value is not None and not isinstance(value, MeshTensor):
            raise TypeError(f"a mesh tensor's grad is None or a mesh tensor of its mesh, not {type(value).__name__}")
        dispatch(SetAttr("grad"), (self, value), {})

    @property
    def T(self) -> MeshTensor:
        return dispatch(Attr("T"), (self,), {})

    @property
    def mT(self) -> MeshTensor:
        return dispatch(Attr("mT"), (self,), {})

    @property
    def data(self) -> MeshTensor:
        return dispatch(Attr("data"), (self,), {})

    def redistribute(self, device_mesh: Any = None, placements: Any = None) -> MeshTensor:
        """As DTensor's: the same global value with other placements (collectives on the ranks)."""
        if placements is None:
            raise ValueError("redistribute needs placements, one per mesh dimension")
        return dispatch(Method("redistribute"), (self,), {"placements": tuple(placements)})

    def to_mesh(self, procs: ProcMesh) -> MeshTensor:
        """Monarch's ``to_mesh``: this tensor on another proc mesh (or slice) that has this one's
        dimensions, same names and sizes; each rank's local tensor goes to the rank at the same
        coordinates, straight from proc to proc (an RDMABuffer the receiving rank reads), and is
        broadcast over dimensions the destination has beyond these (``Replicate()`` there), so
        ``t.slice_mesh(hosts=0).to_mesh(procs)`` copies stage 0's tensor to every host. This
        returns at once, as any op does: between slices of one proc mesh the pieces go point to
        point over its process group, in the ordered stream; between two proc meshes each
        destination rank, in its mesh's ordered stream, asks the source rank for its piece
        (until the source has made it, within ``VALUE_TIMEOUT_S``) and reads it by the data plane."""
        self._check_live("to_mesh()")
        src, dst = self._engine, engine_for(procs)
        if dst is src:
            return self
        src_dims = dict(zip(src.labels, src.sizes))
        dst_dims = dict(zip(dst.labels, dst.sizes))
        if any(dst_dims.get(n) != size for n, size in src_dims.items()):
            raise ValueError(
                f"to_mesh needs a mesh with this tensor's dimensions (same names and sizes; more are "
                f"broadcast to): this tensor's are {src_dims}, {procs!r} has {dst_dims}"
            )
        if self.requires_grad:
            raise ValueError("to_mesh of a tensor that requires grad: move t.detach() (gradients do not cross meshes)")
        by_name = dict(zip(src.labels, self.placements))
        pl = tuple(by_name.get(n, Replicate()) for n in dst.labels)
        shape, stride = tuple(self.shape), self._shadow.stride()
        with _Controller():
            local = torch.empty(local_shape(list(shape), [0] * len(pl), list(dst.sizes), pl), dtype=self.dtype, device="meta")
            shadow = DTensor.from_local(local, dst.shadow_mesh, pl, run_check=False, shape=self.shape, stride=stride)
        readers: dict[int, list[int]] = collections.defaultdict(list)
        for r in range(dst.size):
            c = dict(zip(dst.labels, dst.coords_of(r)))
            readers[src.rank_of({n: c[n] for n in src.labels if n in c})].append(r)
        if (src.root or src) is (dst.root or dst):
            # slices of one proc mesh share its process group: point to point in the ordered
            # stream, so this returns at once, as any op does
            dst.start()  # the destination slice's device mesh, defined on every rank
            h = MeshTensor(dst, dst.new_id(), shadow)
            pairs = [
                (src.ranks[s], dst.ranks[r], tuple(local_shape(list(shape), dst.coords_of(r), list(dst.sizes), pl)))
                for s, ranks in readers.items()
                for r in ranks
            ]
            base = src.root or src
            base.start().transfer.broadcast(base.take_frees(), self._id, h._id, pairs, self.dtype, dst.key, pl, shape, stride)
            base.messages_sent += 1
            return h
        # between two proc meshes: each destination rank pulls its piece from the source rank,
        # in the destination's ordered stream (later ops there wait for it), so this returns at once
        dst.start()
        h = MeshTensor(dst, dst.new_id(), shadow)
        h._keep = self  # the source's tensor lives until the destination's is collected
        src_base, dst_base = src.root or src, dst.root or dst
        sources: dict[int, dict[str, int]] = {}
        local_shapes: dict[int, tuple[int, ...]] = {}
        for s, ranks in readers.items():
            at = dict(zip(src_base.procs.extent.keys(), src_base.coords_of(src.ranks[s])))
            for r in ranks:
                sources[dst.ranks[r]] = at
                local_shapes[dst.ranks[r]] = tuple(local_shape(list(shape), dst.coords_of(r), list(dst.sizes), pl))
        dst_base.start().pull.broadcast(
            dst_base.take_frees(), h._id, src_base.start(), sources, self._id, local_shapes, self.dtype, pl, shape,
            stride, dst.key, VALUE_TIMEOUT_S,
        )  # fmt: skip
        dst_base.messages_sent += 1
        return h

    def slice_mesh(self, **coords: int | slice) -> MeshTensor:
        """Monarch's ``slice_mesh``: this tensor as the ranks of ``mesh.slice(**coords)`` hold
        it, a mesh tensor on that slice (for ``to_mesh``). An int drops the dimension, a range
        (``gpus=slice(1, 3)``) keeps it; a dimension sharded here keeps the pieces of the ranks
        chosen (so the slice's tensor is their concatenation, which must be cut as DTensor cuts
        it: ``torch.chunk``); one ``Partial()`` here must be redistributed first unless kept whole."""
        self._check_live("slice_mesh()")
        e = self._engine
        if not coords or any(not isinstance(v, (int, slice)) for v in coords.values()):
            raise ValueError(
                "slice_mesh takes a coordinate (an int, which drops the dimension) or a range (a slice, "
                "which keeps it) per dimension, e.g. slice_mesh(hosts=0) or slice_mesh(gpus=slice(0, 2))"
            )
        sub = e.procs.slice(**coords)
        shape = list(self.shape)
        keep: list[Placement] = []
        cut: list[tuple[str, int]] = []  # (mesh dim, tensor dim) of each Shard a slice cuts
        for name, size, p in zip(e.labels, e.sizes, self.placements):
            v = coords.get(name)
            rng = range(size)[v] if isinstance(v, slice) else range(v, v + 1) if isinstance(v, int) else None
            if rng is None or (isinstance(v, slice) and rng == range(size)):
                keep.append(p)
            elif isinstance(p, Shard):
                pieces = [chunk_range(shape[p.dim], size, k) for k in rng]
                lens = [b - a for a, b in pieces]
                if isinstance(v, slice):
                    recut = [b - a for a, b in (chunk_range(sum(lens), len(lens), i) for i in range(len(lens)))]
                    if recut != lens:
                        raise ValueError(
                            f"slice_mesh: ranks {v.start}:{v.stop}:{v.step or 1} of {name!r} hold pieces of "
                            f"{lens} along dim {p.dim}, which DTensor would not cut that way; redistribute first"
                        )
                    keep.append(p)
                cut.append((name, p.dim))
                shape[p.dim] = sum(lens)
            elif isinstance(p, Replicate):
                if isinstance(v, slice):
                    keep.append(p)
            else:
                raise ValueError(f"slice_mesh: {p} over {name!r} has no value of its own on a slice; redistribute first")
        dropped = {n for n, v in coords.items() if isinstance(v, int)}
        for name, dim in cut:
            # dropped dims narrow one after another, as DTensor nests them; any other mix does not
            others = {n for n, p in zip(e.labels, self.placements) if isinstance(p, Shard) and p.dim == dim} - {name}
            if others and not (name in dropped and others <= dropped):
                raise ValueError(
                    f"slice_mesh: tensor dim {dim} is sharded over {name!r} and another mesh dimension; redistribute first"
                )
        d = engine_for(sub)
        keep = keep or [Replicate()]  # every dimension dropped: a mesh of one rank
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        with _Controller():
            local = torch.empty(local_shape(shape, [0] * len(keep), list(d.sizes), keep), dtype=self.dtype, device="meta")
            shadow = DTensor.from_local(local, d.shadow_mesh, keep, run_check=False, shape=torch.Size(shape), stride=stride)
        h = MeshTensor(d, d.new_id(), shadow)
        fn = WithMesh(_Restrict(tuple(keep), tuple(shape), stride))
        d.send([(fn, (Ref(self._id),), {}, [h._id], torch.is_grad_enabled())])
        return h

    def backward(self, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False, inputs: Any = None) -> None:
        kw = {"gradient": gradient, "retain_graph": retain_graph, "create_graph": create_graph}
        if inputs is not None:
            kw["inputs"] = inputs
        dispatch(Method("backward"), (self,), kw)

    def __getattr__(self, name: str) -> Any:
        if name == "device":
            # torch's helpers over lists of tensors (clip_grad_norm_, foreach ops) read it first
            # and would fail with a bare AttributeError: they run on the ranks' DTensors instead
            raise AttributeError(
                "a mesh tensor has no one device (each rank's piece is on that rank's): run a function that "
                "needs one on the ranks, e.g. mt.remote(lambda a, b: torch.nn.utils.clip_grad_norm_([a, b], 1.0))(w1, w2)"
            )
        if name.startswith("_") or not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        m = Method(name)
        return lambda *args, **kwargs: dispatch(m, (self, *args), kwargs)

    def __repr__(self) -> str:
        pl = ", ".join(map(str, self.placements))
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"MeshTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placements=({pl}), mesh={dict(zip(self._engine.labels, self._engine.sizes))}{grad})"

    def _previews(self, k: int = 6) -> list[str]:
        if self.dropped:
            return ["(dropped)"] * self._engine.size
        # a notebook's display asks for text/plain and text/html in turn: each fetched on its
        # own, and a tensor whose ops were still running held the cell for twice PREVIEW_WAIT_S
        version = self._shadow._version  # an in-place op here moves it: values seen are stale
        shown = getattr(self, "_shown", None)
        if shown is not None and shown[0] == version and time.monotonic() - shown[1] < 1.0:
            return shown[2]
        try:
            vals = self._engine.gather("fetch", ([], self._id, k), None, "preview").get(timeout=PREVIEW_WAIT_S)
            rows = [", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in t.tolist()) for t in vals]
        except TimeoutError:
            rows = [
                f"(not computed after {PREVIEW_WAIT_S:g} s: the ranks are still busy with earlier ops; "
                "mt.inspect(t) waits for the value)"
            ] * self._engine.size
        except ActorError as e:  # each rank's row says what went wrong there
            rows = _failed_rows(e, self._engine.size)
        except Exception as e:  # a preview shows what went wrong instead
            rows = [f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"] * self._engine.size
        self._shown = (version, time.monotonic(), rows)
        return rows

    def _rows(self) -> list[tuple[str, str, str]]:
        e = self._engine
        rows = []
        for r, pv in enumerate(self._previews()):
            c = e.coords_of(r)
            coord = ", ".join(f"{n}={v}" for n, v in zip(e.labels, c))
            ls = local_shape(list(self.shape), c, list(e.sizes), self.placements)
            rows.append((coord, str(tuple(ls)), pv))
        return rows

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        lines = [repr(self)] + [f"  {c}: local {s}: [{v}{'' if len(v.split(',')) < 6 else ', …'}]" for c, s, v in self._rows()]
        p.text("\n".join(lines))

    def _repr_html_(self) -> str:
        import html

        head = html.escape(repr(self))
        body = "".join(
            f"<tr><td>{html.escape(c)}</td><td>{html.escape(s)}</td><td><code>{html.escape(v)}</code></td></tr>"
            for c, s, v in self._rows()
        )
        return (
            f"<div><code>{head}</code><table><thead><tr><th>rank</th><th>local shape</th><th>first values</th>"
            f"</tr></thead><tbody>{body}</tbody></table></div>"
        )


class MeshModule:
    """An ``nn.Module`` living on the ranks (its parameters DTensors), held by the controller:
    calling it runs forward on the ranks; ``parameters()`` are mesh tensors."""

    __slots__ = ("_engine", "_id", "_shadow", "_call", "__weakref__")

    def __init__(self, engine: Engine, id: int, shadow: Any, call: Any = None) -> None:
        self._engine = engine
        self._id = id
        self._shadow = shadow
        #: the op a forward call sends (FSDP modules run theirs on the local batch)
        self._call = call or _CallModule()

    def __del__(self) -> None:
        try:
            self._engine.frees.append(self._id)
        except AttributeError:
            pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self._call, (self, *args), kwargs)

    def parameters(self) -> list[MeshTensor]:
        return dispatch(_Parameters(), (self,), {})

    def named_parameters(self) -> dict[str, MeshTensor]:
        return dispatch(_NamedParameters(), (self,), {})

    def train(self, mode: bool = True) -> MeshModule:
        return dispatch(Method("train"), (self, mode), {})

    def eval(self) -> MeshModule:
        return self.train(False)

    def __repr__(self) -> str:
        return f"MeshModule on {self._engine.procs!r}:\n{self._shadow!r}"


class _Restrict:
    """Rank side of slice_mesh: this rank's local tensor, as a DTensor on the slice's mesh."""

    def __init__(self, placements: tuple[Placement, ...], shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.placements, self.shape, self.stride = placements, shape, stride

    def __call__(self, mesh: Any, device: str, x: DTensor) -> DTensor:
        return DTensor.from_local(
            x.to_local(), mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=self.stride
        )

    def __str__(self) -> str:
        return "slice_mesh"


class _CallModule:
    #: a module's forward is large and its hooks run user code (distribute_module's input_fn)
    has_collectives = True

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    def __str__(self) -> str:
        return "module forward"


class _Parameters:
    def __call__(self, module: Any) -> list[Any]:
        return list(module.parameters())


class _NamedParameters:
    def __call__(self, module: Any) -> dict[str, Any]:
        return dict(module.named_parameters())


_HANDLES = (MeshTensor, MeshModule)


def _binop(name: str) -> Any:
    m = Method(name)

    def op(self: MeshTensor, *args: Any) -> Any:
        return dispatch(m, (self, *args), {})

    op.__name__ = name
    return op


for _dunder in (
    "__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ "
    "__itruediv__ __floordiv__ __matmul__ __rmatmul__ __pow__ __rpow__ __neg__ __abs__ __getitem__ "
    "__lt__ __le__ __gt__ __ge__ __eq__ __ne__ __and__ __or__ __invert__ __mod__ __pos__ __rfloordiv__ "
    "__ifloordiv__ __rmod__ __imod__ __ipow__ __rand__ __iand__ __ror__ __ior__ __xor__ __rxor__ __ixor__ "
    "__lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__"
).split():
    setattr(MeshTensor, _dunder, _binop(_dunder))


def _shift(fn: Any) -> Any:
    def op(self: MeshTensor, other: Any) -> Any:
        return dispatch(fn, (self, other), {})

    op.__name__ = fn.__name__
    return op


# DTensor's Tensor.__lshift__/__rshift__ hand back their input unshifted (torch 2.13); torch's
# functions for them shift (as do the in-place and reflected forms)
for _dunder, _fn in (("__lshift__", torch.bitwise_left_shift), ("__rshift__", torch.bitwise_right_shift)):
    setattr(MeshTensor, _dunder, _shift(_fn))
MeshTensor.__hash__ = object.__hash__  # type: ignore[method-assign]


# --- dispatch --------------------------------------------------------------------------------

_portable_cache: dict[Any, Any] = {}

#: set while this thread computes shadows or seeds: an active ActivateMode lets torch be torch
_local = threading.local()


class _QuietShadows(logging.Filter):
    """torch logs a meta kernel's failure, with its traceback, at ERROR; on a shadow that failure
    is the TensorOpError raised here, and is said once, there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(_local, "depth", 0) == 0


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietShadows())


class _Controller:
    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *_: Any) -> None:
        _local.depth -= 1


def _portable(func: Any) -> Any:
    """``func`` as something the ranks can unpickle (method descriptors and property getters
    become :class:`Method`/:class:`Attr`)."""
    try:
        return _portable_cache[func]
    except (KeyError, TypeError):
        pass
    out = func
    owner = getattr(func, "__self__", None)
    if isinstance(owner, (types.GetSetDescriptorType, property)) or type(owner).__name__ == "getset_descriptor":
        out = Attr(owner.__name__)  # type: ignore[union-attr]
    else:
        try:
            pickle.dumps(func)
        except Exception:  # anything unpicklable named like a method is one
            name = getattr(func, "__name__", "")
            if name and hasattr(torch.Tensor, name):
                out = Method(name)
    try:
        _portable_cache[func] = out
    except TypeError:
        pass
    return out


_name = op_name


#: ops torch 2.13's DTensor fails inside whatever the placements (``quantile`` makes a plain
#: tensor in its decomposition: "mixed torch.Tensor and DTensor"): what to do instead
_INSTEAD = {
    "quantile": "torch's DTensor cannot run quantile on any placements. t.nanquantile(q, dim=d) gives the same "
    "value where t has no NaN (with a float q and a dim it runs on every placement), or read t and run it "
    "here: torch.quantile(mt.inspect(t), q, dim=d)",
}


def _nested_view_hint(e: BaseException, handles: Any) -> str | None:
    """What to do where torch 2.13's DTensor views a dim sharded on two mesh dims whose pieces
    split again unevenly (``[Shard(0), Shard(0)]`` of 6 rows: 3 and 3, then 2 and 1): it views
    each piece with the first split's shape, and the view fails ("shape '[3]' is invalid for
    input of size 4")."""
    if "is invalid for input of size" not in str(e):
        return None
    for h in handles:
        shards = [p.dim for p in getattr(h, "placements", ()) if isinstance(p, Shard)]
        nested = {d for d in shards if shards.count(d) > 1}
        if nested:
            fix = ", ".join(repr(Replicate() if isinstance(p, Shard) and p.dim in nested else p) for p in h.placements)
            return (
                f"dim {min(nested)} of a tensor of shape {tuple(h.shape)} is sharded on {len(h.placements)} mesh dims "
                f"into pieces that do not split evenly, which torch's DTensor cannot view or reshape: redistribute "
                f"it first, e.g. t.redistribute(placements=[{fix}])"
            )
    return None


def dispatch(func: Any, args: Any, kwargs: dict[str, Any], run_shadow: bool = True, user_fn: bool = False) -> Any:
    """Run ``func`` on the shadows here (shape, placements, errors at once), send it to the
    ranks, and hand back handles for its tensor results. An input the op changes in place
    (its shadow's version moved) takes the op's error on the ranks, as in Monarch; one a
    ``user_fn`` (``mt.remote``) hands back unchanged is a new handle of the same tensor."""
    leaves = pytree.tree_leaves((args, kwargs))
    handles = [x for x in leaves if isinstance(x, _HANDLES)]
    if not handles:
        return func(*args, **kwargs)
    for h in handles:
        # first: a tensor of a mesh stopped and spawned again under its name (a notebook's
        # spawn cell rerun) was said to live on "different proc meshes" named alike, to move by
        # to_mesh, which cannot read a stopped mesh
        h._engine.check_open()
    engine = handles[0]._engine
    for h in handles:
        if h._engine is not engine:
            raise ValueError(
                f"{_name(func)}: its mesh tensors live on different proc meshes ({engine.procs!r}, {h._engine.procs!r}); "
                f"move one to the other's first, e.g. t.to_mesh(procs) (nothing was sent)"
            )
    for h in handles:
        if isinstance(h, MeshTensor):
            h._check_live(_name(func))
    by_shadow = {id(h._shadow): h for h in handles}

    def shadow(x: Any) -> Any:
        if isinstance(x, _HANDLES):
            return x._shadow
        if isinstance(x, torch.Tensor):
            return DTensor.from_local(
                torch.empty_like(x, device="meta"), engine.shadow_mesh, [Replicate()] * len(engine.sizes), run_check=False
            )
        return x

    def remote(x: Any) -> Any:
        if isinstance(x, _HANDLES):
            return Ref(x._id)
        if isinstance(x, torch.Tensor):
            return Lit(x.detach().cpu())
        return x

    s_args, s_kwargs = pytree.tree_map(shadow, (args, kwargs))
    _check_in_place_cast(func, s_args, s_kwargs)
    versions = {h._id: h._shadow._version for h in handles if isinstance(h, MeshTensor)}
    _local.collective = False
    try:
        with _Controller():
            out = func(*s_args, **s_kwargs)
    except Exception as e:
        refused = _chained(e, _EmptyPieceError)
        if refused is not None:  # said whole, wherever in torch's dispatch it was raised
            raise refused from None
        instead = _INSTEAD.get(_name(func).rsplit(".", 1)[-1]) or _nested_view_hint(e, handles)
        raise _op_error(
            f"{_name(func)} cannot run on mesh tensors with placements "
            f"{[tuple(map(str, h.placements)) for h in handles if isinstance(h, MeshTensor)]}: {type(e).__name__}: {e}"
            + (f"\n{instead}" if instead else "")
            + (
                "\n(mt.remote(fn) runs fn here on meta tensors first, for its results' shapes: fn must work on "
                "them, so no .item() or other reads of values)"
                if user_fn
                else ""
            ),
            e,
        ) from (e if user_fn else None)  # a script's traceback: the chain has the line of fn that failed
    changed = {h._id for h in handles if isinstance(h, MeshTensor) and h._shadow._version != versions[h._id]}
    flat, spec = pytree.tree_flatten(out)
    ids: list[int | None] = []
    results: list[Any] = []
    for v in flat:
        given = by_shadow.get(id(v))
        if given is not None and not (user_fn and isinstance(given, MeshTensor) and given._id not in changed):
            # an input handed back (an in-place op, requires_grad_(), Module.train()): the
            # op's error on the ranks is that input's
            ids.append(given._id)
            results.append(given)
        elif isinstance(v, DTensor):
            h = MeshTensor(engine, engine.new_id(), v)
            ids.append(h._id)
            results.append(h)
        elif isinstance(v, torch.Tensor):
            raise TensorOpError(f"{_name(func)} returns a plain tensor, not a DTensor; mesh tensors cannot hold it")
        elif user_fn and v is not None:
            # the value here is fn's on meta shadows, not the ranks' (which may differ by rank):
            # handing it back would be a silent wrong answer
            raise TensorOpError(
                f"mt.remote({_name(func)}) returns a plain {type(v).__name__}, not a tensor: only its value "
                "computed here on meta tensors is known, not the ranks'. Return it as a mesh tensor "
                "(e.g. DTensor.from_local(torch.tensor([v]), t.device_mesh, [Shard(0)] * t.device_mesh.ndim), "
                "read with mt.inspect), or pass the mesh tensor to an actor endpoint, which gets each rank's "
                "local tensor and returns each rank's value"
            )
        else:
            ids.append(None)
            results.append(v)
    _check_biased_mean(func, handles, results)
    r_args, r_kwargs = pytree.tree_map(remote, (args, kwargs))
    portable = _portable(func)
    # an op with a collective on the ranks: DTensor redistributed its inputs in the dry run, or
    # it may have one that the dry run does not show (reduce's, an FSDP forward's, a user's fn)
    if _local.collective or user_fn or getattr(func, "has_collectives", False) or func in _COLLECTIVE_METHODS:
        portable = Agree(portable)
    record: tuple[Any, ...] = (portable, r_args, r_kwargs, ids, torch.is_grad_enabled())
    mutates = sorted(changed - set(ids))
    if mutates:  # changed in place and not handed back: the ranks fail them too if the op fails
        record += (mutates,)
    engine.send([record])
    return pytree.tree_unflatten(results, spec)


def uneven_pieces(h: MeshTensor, dims: list[int]) -> str:
    """Two ranks differing only along mesh dims ``dims`` whose local tensors of ``h`` differ in
    shape (a dim sharded unevenly there), said as "gpus=0 holds [2, 5], gpus=3 holds [1, 5]";
    "" when there are none."""
    e = h._engine
    first: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    for r in range(e.size):
        c = e.coords_of(r)
        shape = local_shape(list(h.shape), c, list(e.sizes), h.placements)
        c0, shape0 = first.setdefault(tuple(x for i, x in enumerate(c) if i not in dims), (c, shape))
        if shape != shape0:
            where = lambda c: ", ".join(f"{n}={x}" for n, x in zip(e.labels, c))  # noqa: E731
            return f"{where(c0)} holds {shape0}, {where(c)} holds {shape}"
    return ""


def _check_biased_mean(func: Any, handles: list[Any], results: list[Any]) -> None:
    """torch's DTensor makes a mean-reduced loss (mse_loss, smooth_l1_loss, huber_loss,
    binary_cross_entropy_with_logits) Partial("avg") of each rank's own mean: over pieces of
    different sizes that is not the mean, and nothing said so (its nll_loss refuses the same)."""
    avg = {i for r in results if isinstance(r, MeshTensor) for i, p in enumerate(r.placements) if p == Partial("avg")}
    if not avg:
        return
    for h in handles:
        if isinstance(h, MeshTensor):
            uneven = uneven_pieces(h, sorted(avg))
            if uneven:
                raise TensorOpError(
                    f"{_name(func)} would average each rank's own mean, but the pieces of an input differ in size "
                    f"({uneven}: shape {tuple(h.shape)}, placements {tuple(map(str, h.placements))}), so the "
                    "result would be a biased mean (torch's DTensor gives it without a word). Nothing was sent: "
                    "pad the batch to a multiple of the mesh's size, or use reduction='sum' and divide by the "
                    "number of elements"
                )


class _EmptyPieceError(TensorOpError):
    """An op refused in its dry run here because some rank's piece is empty (said whole: not
    wrapped in the "cannot run on mesh tensors with placements" of torch's own errors)."""


def _chained(e: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``e``'s chain of causes (torch's sharding propagation wraps what
    it raises in a RuntimeError or NotImplementedError of its own)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _empty_piece(
    shape: list[int], coord: list[int], sizes: list[int], placements: Any, dims: Sequence[int] | None
) -> tuple[int, int, int] | None:
    """Where the rank at ``coord`` gets an empty piece of a tensor of ``shape``, for a reduction
    over ``dims`` (every dim when None): (the length cut, its tensor dim, the mesh dim cutting
    it into an empty chunk); None when its piece is not empty there."""
    shape = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard) and (dims is None or p.dim in dims):
            a, b = chunk_range(shape[p.dim], sizes[i], coord[i])
            if b == a and shape[p.dim]:
                return shape[p.dim], p.dim, i
            shape[p.dim] = b - a
    return None


def _refuse_empty_pieces(
    name: str, shape: list[int], placements: Any, mesh: Any, dims: Sequence[int] | None, args: str, why: str
) -> None:
    """Refuse, before it is sent, ``t.name(args)`` reducing ``dims`` (every dim when None) of a
    tensor of ``shape`` cut by ``placements`` over ``mesh`` where some rank's piece is empty
    along the reduction and another's is not: torch's DTensor fails it on the empty ranks alone,
    ``why`` says what the other ranks then do. Every rank empty is the whole tensor empty, and
    torch's own error on every rank."""
    sizes = list(mesh.shape)
    labels = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(len(sizes))])
    empty: list[str] = []
    cut: tuple[int, int, int] | None = None
    for coord in itertools.product(*(range(n) for n in sizes)):
        found = _empty_piece(shape, list(coord), sizes, placements, dims)
        if found is not None:
            cut = cut or found
            where = ", ".join(f"{n}={c}" for n, c in zip(labels, coord))
            empty.append(where if len(sizes) == 1 else f"({where})")
    if cut is None or len(empty) == math.prod(sizes):
        return
    n, d, i = cut
    pieces = ", ".join(str(b - a) for a, b in (chunk_range(n, sizes[i], k) for k in range(sizes[i])))
    fix = [Replicate() if isinstance(p, Shard) and (dims is None or p.dim in dims) else p for p in placements]
    site = _call_site()
    raise _EmptyPieceError(
        f"t.{name}({args}) of a mesh tensor of shape {tuple(shape)} with placements {tuple(map(str, placements))} "
        f"was refused, nothing sent: "
        + (f"the piece of {empty[0]} is" if len(empty) == 1 else f"the pieces of {', '.join(empty[:4])}")
        + (", ... are" if len(empty) > 4 else " are" if len(empty) > 1 else "")
        + f" empty ({n} along dim {d} sharded over the {sizes[i]} ranks of {labels[i]!r} makes pieces of "
        f"{pieces}). {why}, for mt.COLLECTIVE_TIMEOUT_S, and the mesh's process group is broken after that. "
        f"Redistribute it first (t.redistribute(placements=[{', '.join(map(repr, fix))}]).{name}({args})), "
        f"or give dim {d} a size that {sizes[i]} divides" + (f"\n{_site_text(*site)}" if site is not None else "")
    )


def _argminmax_checked(handler: Any, op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch 2.13's DTensor argmax/argmin (``argminmax_handler``) reduces each rank's piece, then
    all-gathers the ranks' results: a rank whose piece is empty along the reduction fails before
    the all-gather (``max(): Expected reduction dim to be specified for input.numel() == 0``) while
    the others wait in it until ``COLLECTIVE_TIMEOUT_S``, and the mesh's process group is broken
    for every tensor after that. The shadow's dry run here knows every rank's piece: such an op
    is refused before it is sent (the reductions with no identity that fail on the empty rank
    alone are :func:`_no_identity_checked`'s)."""
    x = args[0] if args else None
    if getattr(_local, "depth", 0) and isinstance(x, DTensor) and x._local_tensor.device.type == "meta":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is not None:
            dim = dim % max(x.ndim, 1)
        name = op_call._schema.name.split("::")[-1]
        _refuse_empty_pieces(
            name,
            list(x.shape),
            x.placements,
            x.device_mesh,
            None if dim is None else [dim],
            "" if dim is None else str(dim),
            f"torch's DTensor fails the {name} there while the other ranks wait for it in the op's all-gather",
        )
    return handler(op_call, args, kwargs)


def _guard_argminmax() -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (torch.ops.aten.argmax.default, torch.ops.aten.argmin.default):
        handler = handlers.get(op)
        if handler is not None and not isinstance(handler, functools.partial):
            handlers[op] = functools.partial(_argminmax_checked, handler)


_guard_argminmax()

#: reductions with no identity (torch fails them on an empty tensor) that torch 2.13's DTensor
#: runs on each rank's piece, making a Partial("max"/"min") of the results (the vector norm for
#: an infinite ord only); where their dims are (argument index, keyword), (None, None) for every dim
_NO_IDENTITY: dict[Any, tuple[int | None, str | None]] = {
    torch.ops.aten.max.default: (None, None),
    torch.ops.aten.min.default: (None, None),
    torch.ops.aten.amax.default: (1, "dim"),
    torch.ops.aten.amin.default: (1, "dim"),
    torch.ops.aten.aminmax.default: (None, "dim"),
    torch.ops.aten.linalg_vector_norm.default: (2, "dim"),
}


def _no_identity_checked(propagate: Any, op_schema: Any) -> Any:
    """``max()``, ``min()``, ``amax()``, ``amin()``, ``aminmax()``, ``norm(float('inf'))`` over
    all dims or along a sharded dim fail on a rank whose piece is empty there, alone: its result
    is that rank's error, and an op with a collective on it (``t.clamp(max=t.max())``, a
    redistribute) had the other ranks wait in the collective until ``COLLECTIVE_TIMEOUT_S``, the
    mesh's process group broken after that. Checked where DTensor propagates an op's shapes, on a shadow mesh only, so
    in the dry run here, for a user's line, an ``mt.remote`` fn or a module alike. A refusal is
    never cached, and whether an op is refused depends only on its schema (shapes, placements,
    mesh, dims), which keys torch's caches: a cached op is one that passed."""
    where = _NO_IDENTITY.get(op_schema.op)
    x: Any = op_schema.args_schema[0] if op_schema.args_schema else None
    if where is not None and isinstance(x, DTensorSpec) and _is_shadow(x.mesh):
        i, key = where
        dim = op_schema.args_schema[i] if i is not None and len(op_schema.args_schema) > i else None
        if key is not None:
            dim = op_schema.kwargs_schema.get(key, dim)
        n = max(len(x.shape), 1)
        dims = None if dim is None or dim == [] else sorted({d % n for d in ([dim] if isinstance(dim, int) else dim)})
        name = op_schema.op._schema.name.split("::")[-1]
        if dims is None:
            args = ""
        elif key == "dim" and i is None:  # aminmax's dim is keyword-only
            args = f"dim={dims[0]}"
        else:
            args = str(dims[0]) if len(dims) == 1 else str(tuple(dims))
        if op_schema.op is torch.ops.aten.linalg_vector_norm.default:
            p = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else op_schema.kwargs_schema.get("ord", 2)
            if not (isinstance(p, (int, float)) and math.isinf(p)):  # a sum of powers: 0 on an empty piece
                return propagate(op_schema)
            name, args = "norm", ", ".join(a for a in (f"float({str(float(p))!r})", args) if a)
        _refuse_empty_pieces(
            name,
            list(x.shape),
            x.placements,
            x.mesh,
            dims,
            args,
            f"torch's DTensor fails the {name} there, on that rank alone ({name} of an empty piece has no value), "
            f"and an op with a collective on its result (t.clamp(max=t.max()), a redistribute, a sharded matmul) "
            f"has the other ranks wait for it",
        )
    return propagate(op_schema)


def _is_shadow(mesh: Any) -> bool:
    return any(m is mesh for m in list(_shadow_meshes.values()))  # list: another thread may add one


def _guard_no_identity() -> None:
    # not the ops' strategy functions: aminmax has none (DTensor decomposes it, trying
    # placements it does not have on a mesh of its own); every op's shapes pass through here,
    # with the op's own schema, before any strategy runs
    prop = DTensor._op_dispatcher.sharding_propagator
    meta = prop._propagate_tensor_meta_non_cached
    if not isinstance(meta, functools.partial):
        prop._propagate_tensor_meta_non_cached = functools.partial(_no_identity_checked, meta)  # type: ignore[method-assign]


_guard_no_identity()

#: methods with a collective on the ranks that DTensor's dispatcher does not run here (an explicit
#: redistribute; backward, whose ops autograd runs on the shadows' graph)
_COLLECTIVE_METHODS = frozenset({Method("redistribute"), Method("full_tensor"), Method("backward")})


def _noted(fn: Any) -> Any:
    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> Any:
        _local.collective = True
        return fn(*args, **kwargs)

    noted._mnb_noted = True  # type: ignore[attr-defined]
    return noted


def _watch_collectives() -> None:
    """Note (on this thread, for the dry run in progress) where DTensor's dispatcher runs a
    collective: when it redistributes an op's inputs (a sharded matmul, clamp of a Partial) and
    in its own handlers (argmax's all-gather). Both are off the common path, so an op without
    one pays nothing to be watched (a TorchDispatchMode seeing every op doubled a dry run)."""
    d = DTensor._op_dispatcher
    if not getattr(d.redistribute_local_args, "_mnb_noted", False):
        d.redistribute_local_args = _noted(d.redistribute_local_args)  # type: ignore[method-assign]
    local_only = {torch.ops.aten.is_same_size.default, torch.ops.aten.is_pinned.default}
    for op, handler in list(d._custom_op_handlers.items()):
        if op not in local_only and not getattr(handler, "_mnb_noted", False):
            d._custom_op_handlers[op] = _noted(handler)


_watch_collectives()


#: in-place binary ops whose meta kernels (the shadows') skip torch's check that the result's
#: dtype can be cast to the changed tensor's (``i64.mul_(f64)``, ``f32.add_(c64)``): the ranks
#: then failed, and the changed tensor took that error for good, its value unreadable
_IN_PLACE_BINARY = frozenset(
    "add_ sub_ subtract_ mul_ multiply_ div_ divide_ true_divide_ floor_divide_ remainder_ fmod_ pow_ "
    "atan2_ arctan2_ hypot_ copysign_ bitwise_and_ bitwise_or_ bitwise_xor_ __iadd__ __isub__ __imul__ "
    "__itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ __ior__ __ixor__".split()
)


def _check_in_place_cast(func: Any, s_args: Any, s_kwargs: dict[str, Any]) -> None:
    name = func.name if isinstance(func, Method) else getattr(func, "__name__", "")
    if name not in _IN_PLACE_BINARY or not s_args or not isinstance(s_args[0], DTensor):
        return
    other = s_args[1] if len(s_args) > 1 else s_kwargs.get("other", s_kwargs.get("exponent"))
    if other is None:
        return
    mine = s_args[0]._local_tensor
    try:
        rt = torch.result_type(mine, other._local_tensor if isinstance(other, DTensor) else other)
    except Exception:  # not a tensor or number: the shadow run says what is wrong
        return
    if not torch.can_cast(rt, mine.dtype):
        raise TensorOpError(
            f"{_name(func)}: result type {rt} can't be cast to the desired output type {mine.dtype} of the mesh "
            f"tensor it changes in place (as torch refuses); nothing was sent and the tensor is unchanged. "
            f"Cast the other operand first (x.to({mine.dtype})) or make a new tensor (t = t.to({rt}) then the op)"
        )


def make(engine: Engine, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], placements: Any, random: bool) -> MeshTensor:
    """A factory run on the ranks (no data sent): ``fn(*args, **kwargs)`` cut to ``placements``."""
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    if device is not None:
        _check_device(engine, device)
    if kwargs.pop("generator", None) is not None:
        raise ValueError(
            "mesh tensor factories seed their own generator: leave generator= out (torch.manual_seed here seeds them)"
        )
    pl = tuple(placements) if placements is not None else None
    if pl is not None and len(pl) != len(engine.sizes):
        raise ValueError(f"{len(pl)} placements for a mesh of {len(engine.sizes)} dimensions {list(engine.labels)}")
    if fn in _FLOAT_FACTORIES and "dtype" not in kwargs:
        # the ranks' default dtype is not the controller's
        kwargs["dtype"] = torch.get_default_dtype()
    with _Controller():
        seed = int(torch.randint(0, 2**62, ()).item()) if random else None
    fac = Factory(fn, pl, seed)
    try:
        with _Controller():
            shadow = Factory(fn, pl, None)(engine.shadow_mesh, "meta", *args, **kwargs)
    except Exception as e:
        raise _op_error(f"{fac}: {type(e).__name__}: {e}", e) from None
    h = MeshTensor(engine, engine.new_id(), shadow)
    engine.send([(fac, args, kwargs, [h._id], torch.is_grad_enabled())])
    return h


def _check_device(engine: Engine, device: Any, what: str = "") -> None:
    """A factory's ``device=`` (or ``t.to(device)``, ``what``): each rank makes its tensor on
    its own device, so the name only has to be a device of the ranks' kind; a typo or another
    kind is refused here rather than ignored (a tensor on the CPU where the user asked for a
    GPU, or the reverse). The ranks' kind, not this controller's: a CPU-only notebook drives GPUs."""
    what = what or f"device={device!r}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what}: {device!r} is not a torch device name ('cpu', 'cuda', 'cuda:0'…): {e}") from e
    engine.start()  # the backend says which kind the ranks have
    kind = "cuda" if engine.backend == "nccl" else "cpu"
    if dev.type != kind:
        raise ValueError(
            f"{what}: the mesh tensors of {engine.procs!r} live on its ranks' {kind} devices "
            f"({engine.backend}), which have no {dev.type} device for them; leave the device out "
            f"(each rank uses its own) or give {kind!r}"
        )


_FLOAT_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.rand, torch.randn, torch.eye, torch.linspace}

# --- activate() ------------------------------------------------------------------------------

_FACTORIES = {
    torch.zeros: False,
    torch.ones: False,
    torch.empty: False,
    torch.full: False,
    torch.arange: False,
    torch.eye: False,
    torch.linspace: False,
    torch.rand: True,
    torch.randn: True,
    torch.randint: True,
    torch.randperm: True,
    torch.normal: True,
}


class ActivateMode(TorchFunctionMode):
    """Inside ``with procs.activate():`` torch factories make mesh tensors (Replicate() on every
    dimension, random ones seeded alike on every rank); ops on mesh tensors go to the ranks."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(_local, "depth", 0):
            return func(*args, **kwargs)
        if any(isinstance(x, _HANDLES) for x in pytree.tree_leaves((args, kwargs))):
            return dispatch(func, args, kwargs)
        if func in _FACTORIES and not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))):
            return make(self.engine, func, tuple(args), kwargs, None, _FACTORIES[func])
        return func(*args, **kwargs)
