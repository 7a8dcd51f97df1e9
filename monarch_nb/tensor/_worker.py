"""The rank side: one hidden actor per proc mesh holding the table id -> DTensor (or any object
an op made, an optimizer say) and running the controller's op records in the order sent."""

from __future__ import annotations

import collections
import datetime
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from ..actor import Actor, current_rank, endpoint
from ..errors import raised_again
from ._ops import Agree, Factory, Lit, Ref, Spec, Via, WithMesh, op_name
from ._strategies import install as _install_strategies

# before any DTensor op here; the controller's engine imports this module, so its dry run picks
# the same placements as the ranks
_install_strategies()


def _gloo_interface(master: str) -> None:
    """Point gloo at the interface that reaches ``master``: by default it binds the address the
    host name resolves to, which on a host whose name maps to another machine's (or no) address
    leaves it on loopback, unreachable from other hosts."""
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            ip = s.getsockname()[0]
    except OSError:
        return
    if ip.startswith("127."):
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def _agreement_group(mesh: Any, timeout: datetime.timedelta) -> Any:
    """A gloo group of ``mesh``'s ranks (made by every rank of the process group, as a device
    mesh is): where they agree on an op's inputs (:meth:`TensorWorker._states`)."""
    return dist.new_group(sorted(mesh.mesh.flatten().tolist()), timeout=timeout, backend="gloo")


#: a rank's state of an op's inputs (or of a tensor read whole), as the ranks agree on it
_OK, _SKIPPED, _FAILED = 0, 1, 2

#: the attribute of an op's error naming that op
OP_ATTR = "_mesh_tensor_op"
#: the attribute of an op's error holding the id of the op's first result: the controller knows
#: where the user's code issued that op
OP_ID_ATTR = "_mesh_tensor_op_id"
#: the attribute of the error of an op that made no tensor (loss.backward(), an optimizer's
#: step) holding where the user's code issued it, (file, line): no result id names that op
OP_SITE_ATTR = "_mesh_tensor_op_site"


class _Failed:
    """A table entry whose op failed: every op reading it fails with the same error."""

    __slots__ = ("error", "first", "op")

    def __init__(self, error: BaseException, op: str) -> None:
        self.error = error
        self.op = op  # the op that failed with it here (its input's op may have failed first)
        #: whether this op is the one that raised it (not an op reading a failed input)
        self.first = not hasattr(error, OP_ATTR)
        # the op whose error it is, for the controller's header (the error's copies keep it: an
        # op failing on a failed input names the op that failed first)
        if self.first:
            try:
                setattr(error, OP_ATTR, op)
            except AttributeError:  # an exception without a __dict__: the header names the read
                pass


class _Skipped:
    """A table entry of a rank where an op with a collective did not run because an input of it
    failed on other ranks (``where``): every rank skips such an op alike, or the others would
    wait in a collective the failed ranks skip. A read of the whole tensor raises their error."""

    __slots__ = ("op", "where")

    def __init__(self, op: str, where: str) -> None:
        self.op = op
        self.where = where

    def error(self) -> SkippedError:
        e = SkippedError(
            f"{self.op} did not run on this rank: an input of it failed on the rank at {self.where} "
            "(an op with a collective runs on every rank or on none); read the tensor whole (mt.inspect, "
            "full_tensor) for that rank's error"
        )
        e.where = self.where
        return e


class SkippedError(RuntimeError):
    """Reading a :class:`_Skipped` entry on its rank: an op on it there is skipped too."""

    where = ""


class _Table(dict[int, Any]):
    """id -> DTensor (or _Failed): wakes an actor's call whose arguments wait for an id here."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if _waiting:
            with _arrived:
                _arrived.notify_all()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


#: this process's tensor workers, by their engine's token (a proc serves one proc mesh, but a
#: mesh spawned again under a name gets a new engine, and ids restart there)
_workers: dict[str, TensorWorker] = {}
_arrived = threading.Condition()
_waiting = 0


def local_of(
    token: str, id: int, mesh: str, timeout_s: float, dtype: torch.dtype | None = None, ranks: list[int] | None = None
) -> Any:
    """What an actor's endpoint gets for a mesh tensor among its arguments (as Monarch's actors
    do): this rank's local tensor of it, once this rank's tensor worker has run the op making it
    (the op went to the worker first, by another path, so it may be a moment behind, or still
    running). An async actor's loop does not wait for it: the argument is filled in by a wait in
    a thread before the call starts, so its other tasks go on meanwhile."""
    from ..actor._host import wait_for_argument

    worker = _workers.get(token)
    if worker is None:
        raise ValueError(
            f"a mesh tensor of proc mesh {mesh!r} was passed to an actor on other procs: an actor gets each "
            f"rank's local tensor only when it runs on that mesh's procs (else pass mt.fetch_shard(t, ...).get())"
        )
    if ranks is not None and dist.get_rank() not in ranks:
        # a tensor of a slice (``ranks``, of the whole mesh): this rank never makes it, and the
        # call would wait for it until the timeout
        raise ValueError(
            f"mesh tensor {id} lives on a slice of proc mesh {mesh!r} (its ranks {ranks}) and this actor's proc, "
            f"rank {dist.get_rank()} of it, is not in the slice, so it has no local tensor of it: call the actor's slice over the "
            "tensor's procs (actor.slice(...) with the coordinates of procs.slice(...)), or pass a tensor of the whole mesh"
        )
    deadline = time.monotonic() + timeout_s
    if dtype is not None:
        with _arrived:
            v = worker.take(id)
        if v is None:
            out = torch.empty(0, dtype=dtype, device=worker.device)

            def fill() -> None:
                out.set_(_local(_wait_take(worker, id, mesh, deadline, timeout_s)))

            if wait_for_argument(fill):
                return out
        else:
            return _local(v)
    return _local(_wait_take(worker, id, mesh, deadline, timeout_s))


def _wait_take(worker: TensorWorker, id: int, mesh: str, deadline: float, timeout_s: float) -> Any:
    global _waiting

    with _arrived:
        _waiting += 1
        try:
            while (v := worker.take(id)) is None:
                if id in worker.expired:
                    raise KeyError(
                        f"mesh tensor {id} of proc mesh {mesh!r} was freed on this rank before this call read it "
                        "(its handle was dropped, and the call came more than 300 s later)"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"mesh tensor {id} of proc mesh {mesh!r} was not made on this rank within {timeout_s} s "
                        "(the op making it still runs there, or waits behind one that does)"
                    )
                _arrived.wait(left)
        finally:
            _waiting -= 1
    return v


def _local(v: Any) -> Any:
    if isinstance(v, _Failed):
        raise raised_again(v.error).with_traceback(v.error.__traceback__)
    if isinstance(v, _Skipped):
        raise v.error()
    return (v.to_local() if isinstance(v, DTensor) else v).detach() if isinstance(v, torch.Tensor) else v


class TensorWorker(Actor):
    def __init__(self) -> None:
        self.table: dict[int, Any] = _Table()
        self.mesh: Any = None
        #: device meshes of slices of the proc mesh, by the slice's key (its ranks); a rank
        #: outside a slice holds it too (DeviceMesh is built by every rank), coordinate None
        self.meshes: dict[Any, Any] = {}
        #: id of a device mesh -> its ranks' gloo group for agreeing on op inputs (_states)
        self._agreeing: dict[int, Any] = {}
        self.device = "cpu"
        #: RDMABuffers lent to the controller (full_tensor, fetch_shard), by id: kept alive until it drops them
        self.lent: dict[int, list[Any]] = {}
        #: (under _arrived) tensors handed to actor calls: id -> calls here that took it, and
        #: freed ones some call has not taken yet: id -> [value, calls still to come, deadline]
        self.taken: dict[int, int] = {}
        self.kept: dict[int, list[Any]] = {}
        #: (under _arrived) the last ids whose kept tensor expired unread: a call reading one is told so
        self.expired: collections.deque[int] = collections.deque(maxlen=1024)
        #: errors of ops that made no tensor to keep them (loss.backward(), an optimizer's step),
        #: the first kept and how many followed: the next read from this rank raises it
        self.unread: _Failed | None = None
        self.unread_more = 0

    def take(self, id: int) -> Any:
        """(under _arrived) ``id``'s entry for an actor call on this rank, or None: not made yet."""
        v = self.table.get(id)
        if v is not None:
            self.taken[id] = self.taken.get(id, 0) + 1
            return v
        k = self.kept.get(id)
        if k is None:
            return None
        k[1] -= 1
        if k[1] <= 0:
            del self.kept[id]
        return k[0]

    @endpoint
    def setup(self, labels: list[str], sizes: list[int], timeout_s: float, token: str = "") -> str:
        """Join (or reuse) the default process group and build the device mesh named as the
        proc mesh; collectives time out after ``timeout_s`` so a dead peer cannot hang a rank."""
        from torch.distributed.device_mesh import init_device_mesh

        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            self.device = f"cuda:{local}"
        if "GLOO_SOCKET_IFNAME" not in os.environ:  # under NCCL too: the ranks agree on a gloo group (_states)
            _gloo_interface(os.environ.get("MASTER_ADDR", ""))
        timeout = self._timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            from ..spmd import _rendezvous_store

            # our store, not env://'s: rank 0's listens on MASTER_ADDR alone, not on every interface
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = _rendezvous_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, timeout)
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                store=store,
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=torch.device(self.device) if cuda else None,
            )
        if token:
            _workers[token] = self
        names = tuple(labels) if labels else ("ranks",)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", tuple(sizes) or (1,), mesh_dim_names=names)
        self._agreeing[id(self.mesh)] = _agreement_group(self.mesh, timeout)
        return dist.get_backend()

    def _keep_unread(self, failed: _Failed) -> None:
        if self.unread is None:
            self.unread = failed
        else:
            self.unread_more += 1

    def _unread_error(self) -> BaseException | None:
        """The error of an op that made no tensor, to raise at this read (once): without it,
        a backward or an optimizer step failing here would be lost without a word."""
        failed, more = self.unread, self.unread_more
        if failed is None:
            return None
        self.unread, self.unread_more = None, 0
        err = failed.error
        e = raised_again(err).with_traceback(err.__traceback__)
        note = (
            f"{failed.op} made no mesh tensor to keep this error, so it is raised here, at the next read from "
            f"rank {current_rank().rank}" + (f"; {more} more such op(s) failed after it there" if more else "")
        )
        e.__notes__ = [*getattr(err, "__notes__", []), note]  # a list of its own: err stays as it was
        return e

    def _raise_unread(self) -> None:
        e = self._unread_error()
        if e is not None:
            raise e

    def _get(self, r: Ref) -> Any:
        v = self.table.get(r.id, None)
        if v is None:
            raise KeyError(f"mesh tensor {r.id} is not on rank {current_rank().rank} (freed?)")
        if isinstance(v, _Failed):
            # a copy each time (its own frames, none piling up on the kept error) that still
            # carries the failing op's frames: the caller's remote traceback shows the line of
            # the user's function that raised, not only the error's last line
            raise raised_again(v.error).with_traceback(v.error.__traceback__)
        if isinstance(v, _Skipped):
            raise v.error()
        return v

    def _mesh(self, key: Any) -> Any:
        """The device mesh a message is for (the whole proc mesh's when ``key`` is None), or
        None when this rank is not in it."""
        m = self.mesh if key is None else self.meshes[key]
        if isinstance(m, BaseException):
            raise m
        return m if m.get_coordinate() is not None else None

    @endpoint
    def define(self, frees: list[int], key: Any, ranks: list[int], labels: list[str], sizes: list[int]) -> None:
        """The device mesh of a slice of the proc mesh (``ranks`` in the process group): built
        by every rank, since its process groups are made collectively."""
        from torch.distributed.device_mesh import DeviceMesh

        self._free(frees)
        if key not in self.meshes:
            mesh = torch.tensor(ranks, dtype=torch.int).reshape(tuple(sizes) or (1,))
            names = tuple(labels) if labels else ("ranks",)
            try:
                m = self.meshes[key] = DeviceMesh(self.mesh.device_type, mesh, mesh_dim_names=names)
                self._agreeing[id(m)] = _agreement_group(m, self._timeout)
            except Exception as e:  # every op on the slice fails with it; the actor lives on
                self.meshes[key] = e

    def _resolve(self, tree: Any, mesh: Any = None) -> Any:
        mesh = mesh if mesh is not None else self.mesh

        def one(x: Any) -> Any:
            if isinstance(x, Ref):
                return self._get(x)
            if isinstance(x, Lit):
                t = x.value.to(self.device)
                return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
            return x

        # a loop here, not tree_map: a failed input's error then carries no torch frames
        leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, (Ref, Lit)))
        return pytree.tree_unflatten([one(x) for x in leaves], spec)

    def _free(self, frees: list[Any]) -> None:
        for i in frees:
            if isinstance(i, tuple):
                self._free_lent(*i)
                continue
            self.table.pop(i, None)
            self.lent.pop(i, None)

    def _free_lent(self, id: int, calls: int) -> None:
        """Free a tensor whose handle went into ``calls`` actor calls: those that have not taken
        it on this rank yet (their message may come after this free) still get it, until
        VALUE_TIMEOUT_S (a call sent to a slice without this rank never takes it)."""
        v = self.table.pop(id, None)
        self.lent.pop(id, None)
        now = time.monotonic()
        with _arrived:
            for k in [k for k, e in self.kept.items() if e[2] < now]:
                del self.kept[k]
                self.expired.append(k)
            left = calls - self.taken.pop(id, 0)
            if v is not None and left > 0:
                self.kept[id] = [v, left, now + 300.0]

    @endpoint
    def run(self, frees: list[int], records: list[tuple[Any, ...]], key: Any = None, dtype: Any = None) -> None:
        """Run op records in order; a failing one stores its error under its outputs' ids and
        the inputs it changes in place (a record's optional sixth item), or, when it has
        neither (loss.backward(), an optimizer's step), keeps it for the next read from this rank.
        Records for a slice (``key``) are sent to every rank; those outside it skip them.
        ``dtype``: the controller's default dtype where it is not float32, in force while they run."""
        dtype = dtype or torch.float32
        if dtype == torch.get_default_dtype():
            self._run(frees, records, key)
            return
        # the controller's shadows promote with its default (int / 2 is float64 there): the
        # ranks must too, or a handle saying float64 held float32 (and a view of it another shape)
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            self._run(frees, records, key)
        finally:
            torch.set_default_dtype(old)

    def _run(self, frees: list[int], records: list[tuple[Any, ...]], key: Any) -> None:
        self._free(frees)
        try:
            mesh = self._mesh(key)
        except Exception as e:
            for fn, _, _, out_ids, _, *rest in records:
                self._fail(_Failed(e, op_name(fn)), out_ids, rest[:1], rest[1] if len(rest) > 1 else None)
            return
        if mesh is None:
            return
        for fn, args, kwargs, out_ids, grad, *rest in records:
            # optional: the ids it changes in place, then where an op making no tensor was issued
            mutates, site = rest[:1], rest[1] if len(rest) > 1 else None
            agree = isinstance(fn, Agree)
            fn = fn.fn if agree else fn
            try:
                if agree:
                    mine = self._inputs_state((args, kwargs))
                    where = self._agree(mine, mesh)  # a dead peer fails it: the op's error, as its own collective's
                    if where is not None and mine == _OK:
                        # some rank's input failed: none enters the op's collective; the failed
                        # ranks keep their error (below, reading it), the others this skip
                        self._skip(_Skipped(op_name(fn), where), out_ids, mutates)
                        continue
                with torch.set_grad_enabled(grad):
                    if isinstance(fn, Factory):
                        out = fn(mesh, self.device, *args, **kwargs)
                    elif isinstance(fn, WithMesh):
                        a, k = self._resolve((args, kwargs), mesh)
                        out = fn.fn(mesh, self.device, *a, **k)
                    else:
                        a, k = self._resolve((args, kwargs), mesh)
                        out = fn(*a, **k)
                leaves = pytree.tree_leaves(out)
                lost = [i for i in out_ids[len(leaves) :] if i is not None]
                for i, v in zip(out_ids, leaves):
                    if i is None:
                        continue
                    if v is None:
                        lost.append(i)
                    else:
                        self.table[i] = v
                if lost:
                    # a None here where the controller's shadow had a tensor (p.grad of a
                    # backward that failed on this rank): the id would be missing, and its
                    # read would say "freed?"
                    missing = RuntimeError(
                        f"{op_name(fn)} gave None on rank {current_rank().rank} where the controller expected a "
                        "tensor (p.grad: no backward made one on this rank)"
                    )
                    self._fail(_Failed(missing, op_name(fn)), lost, [])
            except SkippedError as e:  # an input skipped here: so is this op, whose error is another rank's
                self._skip(_Skipped(op_name(fn), e.where), out_ids, mutates)
            except Exception as e:  # the error belongs to the op's outputs
                self._fail(_Failed(e, op_name(fn)), out_ids, mutates, site)

    def _skip(self, skipped: _Skipped, out_ids: list[int | None], mutates: list[Any]) -> None:
        for i in [i for i in out_ids if i is not None] + [i for m in mutates for i in m]:
            self.table[i] = skipped

    def _inputs_state(self, tree: Any) -> int:
        """_OK when every input of an op is here, _SKIPPED when one was skipped here (its op's
        input failed on another rank), _FAILED when one failed here (or is missing)."""
        state = _OK
        for x in pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (Ref, Lit))):
            if isinstance(x, Ref):
                v = self.table.get(x.id)
                if v is None or isinstance(v, _Failed):
                    return _FAILED
                if isinstance(v, _Skipped):
                    state = _SKIPPED
        return state

    def _agree(self, mine: int, mesh: Any) -> str | None:
        """Where (mesh coordinates) some rank's state is not _OK, the failed ranks' first, or None
        when none: a small all-reduce every rank of ``mesh`` joins whatever its own state, in the
        same place of the ordered stream, so all take the same branch after it."""
        states = self._states(mine, mesh)
        bad = [i for i, s in enumerate(states) if s == _FAILED] or [i for i, s in enumerate(states) if s != _OK]
        if not bad:
            return None
        names = mesh.mesh_dim_names or ()
        shape = list(mesh.shape)

        def coords(i: int) -> str:
            out = []
            for n, size in zip(reversed(names), reversed(shape)):
                out.append(f"{n}={i % size}")
                i //= size
            return ", ".join(reversed(out))

        return "; ".join(coords(i) for i in bad)

    def _states(self, mine: int, mesh: Any) -> list[int]:
        """Every rank of ``mesh``'s state, in its flat order: one-hot vectors summed in one
        all-reduce on the mesh's gloo group of its own, on the CPU (on the device, under NCCL,
        reading the sum would wait for every op queued on the GPU, before every op with a
        collective)."""
        coord = mesh.get_coordinate()
        flat = 0
        for c, size in zip(coord, mesh.shape):
            flat = flat * size + c
        vec = torch.zeros(mesh.size(), dtype=torch.int32)
        vec[flat] = mine
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self._agreeing[id(mesh)])
        return vec.tolist()

    def _fail(self, failed: _Failed, out_ids: list[int | None], mutates: list[Any], site: Any = None) -> None:
        made = [i for i in out_ids if i is not None]
        if failed.first and not hasattr(failed.error, OP_ID_ATTR) and not hasattr(failed.error, OP_SITE_ATTR):
            try:
                if made:
                    setattr(failed.error, OP_ID_ATTR, made[0])
                elif site is not None:
                    setattr(failed.error, OP_SITE_ATTR, site)
            except AttributeError:  # no __dict__: the header names no line
                pass
        ids = made + [i for m in mutates for i in m]
        for i in ids:
            self.table[i] = failed
        if not ids:
            self._keep_unread(failed)

    @endpoint
    def put(
        self, frees: list[int], id: int, local: torch.Tensor, placements: Any, shape: Any, stride: Any, key: Any = None
    ) -> None:
        """This rank's shard of a distributed tensor, sent to it alone (in the message, or, when
        large, read from the controller's RDMABuffer)."""
        self._free(frees)
        try:
            if isinstance(local, Via):
                local = local.receive(timeout=300.0)
            self.table[id] = DTensor.from_local(
                local.to(self.device), self._mesh(key), placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
            )
        except Exception as e:  # the error belongs to the tensor (a put without a reply would abort the actor)
            self.table[id] = _Failed(e, "distribute")

    @endpoint
    def fetch(self, frees: list[int], id: int, limit: int = -1) -> torch.Tensor:
        """This rank's local tensor (its first ``limit`` elements, flattened, when >= 0)."""
        self._free(frees)
        self._raise_unread()
        t = self._get(Ref(id))
        local = t.to_local() if isinstance(t, DTensor) else t
        local = local.detach()
        if limit >= 0:
            local = local.reshape(-1)[:limit]
        return local.cpu().clone()

    @endpoint
    def full(self, frees: list[int], id: int, key: Any = None) -> torch.Tensor | None:
        """The global value (a collective: every rank must be asked); rank 0 returns it."""
        self._free(frees)
        entry = self.table.get(id)
        try:
            t, error = self._get(Ref(id)), self._unread_error()
        except Exception as e:
            t, error = None, self._unread_error() or e
        mine = _OK if error is None else _SKIPPED if isinstance(entry, _Skipped) and isinstance(error, SkippedError) else _FAILED
        # an op can fail on some ranks only (an index out of range in one shard): the ranks that
        # have a value must not enter the all-gather the others skip, or they wait there until
        # the collective timeout and leave the process group broken for every later tensor
        mesh = self._mesh(key)
        states = self._states(mine, mesh) if mesh is not None else [mine]
        if any(s != _OK for s in states):
            if mine == _FAILED or (mine == _SKIPPED and _FAILED not in states):
                raise error  # type: ignore[misc]
            return None  # the failing ranks' errors are the reply
        full = t.full_tensor().detach() if isinstance(t, DTensor) else t
        first = not isinstance(t, DTensor) or all(c == 0 for c in t.device_mesh.get_coordinate() or [1])
        return full.cpu() if first else None

    @endpoint
    def transfer(
        self, frees: list[int], src: int, dst: int, pairs: list[tuple[int, int, tuple[int, ...]]], dtype: torch.dtype,
        key: Any, placements: Any, shape: Any, stride: Any,
    ) -> None:  # fmt: skip
        """to_mesh between slices of this proc mesh, in the ordered stream: rank ``s`` sends its
        local tensor of ``src`` to rank ``d`` (process-group ranks) over the process group; ``d``
        stores it as ``dst`` on its slice's mesh. A status goes first, so a source without a
        value fails its destinations' tensor instead of leaving them waiting."""
        self._free(frees)
        try:
            self._transfer(src, dst, pairs, dtype, key, placements, shape, stride)
        except Exception as e:  # the error belongs to the destinations' tensor; the actor lives on
            if any(d == dist.get_rank() for _, d, _ in pairs):
                self.table[dst] = _Failed(e, "to_mesh")

    def _transfer(
        self, src: int, dst: int, pairs: list[tuple[int, int, tuple[int, ...]]], dtype: torch.dtype,
        key: Any, placements: Any, shape: Any, stride: Any,
    ) -> None:  # fmt: skip
        me = dist.get_rank()
        local: torch.Tensor | None = None
        error: BaseException | None = None
        if any(s == me for s, _, _ in pairs):
            try:
                t = self._get(Ref(src))
                local = (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()
            except Exception as e:
                error = e
        status: dict[tuple[int, int], torch.Tensor] = {}
        reqs: list[Any] = []
        for s, d, _ in pairs:
            if s == d:
                continue
            if s == me:
                status[s, d] = torch.tensor([int(local is not None)], device=self.device)
                reqs.append(dist.isend(status[s, d], d))
            elif d == me:
                status[s, d] = torch.zeros(1, dtype=torch.int64, device=self.device)
                reqs.append(dist.irecv(status[s, d], s))
        for r in reqs:
            r.wait()
        reqs = []
        got: dict[int, torch.Tensor | None] = {}
        for s, d, ls in pairs:
            if s == me and d == me:
                got[s] = local.clone() if local is not None else None
            elif s == me and local is not None:
                reqs.append(dist.isend(local, d))
            elif d == me and int(status[s, d].item()):
                buf = got[s] = torch.empty(ls, dtype=dtype, device=self.device)
                reqs.append(dist.irecv(buf, s))
            elif d == me:
                got[s] = None
        for r in reqs:
            r.wait()
        for s, d, _ in pairs:
            if d != me:
                continue
            piece = got.get(s)
            if piece is None:
                why = f": {type(error).__name__}: {error}" if s == me and error is not None else ""
                self.table[dst] = _Failed(RuntimeError(f"to_mesh: the source tensor on rank {s} has no value{why}"), "to_mesh")
            else:
                self.table[dst] = DTensor.from_local(
                    piece, self._mesh(key), placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
                )

    @endpoint
    def describe(self, frees: list[int], id: int) -> Any:
        """The object under ``id`` (an optimizer's state) with each DTensor in it as its
        :class:`Spec`, other tensors as their values: what the controller makes handles from."""
        self._free(frees)
        self._raise_unread()

        def one(x: Any) -> Any:
            if isinstance(x, DTensor):
                return Spec(tuple(x.shape), tuple(x.stride()), x.dtype, tuple(x.placements))
            if isinstance(x, torch.Tensor):
                return x.detach().cpu().clone()
            return x

        return pytree.tree_map(one, self._get(Ref(id)).value)

    @endpoint
    def share(self, frees: list[int], id: int) -> Any:
        """This rank's local tensor as an RDMABuffer, for the controller to read (full_tensor of
        a large tensor: each piece straight from its rank, no collective)."""
        self._free(frees)
        self._raise_unread()
        return self._lend(id)

    @endpoint
    def lend(self, id: int) -> tuple[str, Any]:
        """For a rank of another proc mesh pulling this tensor (to_mesh): ``("wait", None)``
        until this rank has run the op that makes ``id``, then ``("ok", RDMABuffer or None)``,
        or ``("error", the op's error)``."""
        v = self.table.get(id)
        if v is None:
            return ("wait", None)
        if isinstance(v, _Failed):
            return ("error", v.error)
        if isinstance(v, _Skipped):
            return ("error", v.error())
        return ("ok", self._lend(id))

    @endpoint
    def pull(
        self, frees: list[int], id: int, source: Any, sources: dict[int, dict[str, int]], src: int,
        local_shapes: dict[int, tuple[int, ...]], dtype: torch.dtype, placements: Any, shape: Any, stride: Any,
        key: Any, timeout_s: float,
    ) -> None:  # fmt: skip
        """to_mesh from another proc mesh, in this mesh's ordered stream (so later ops on ``id``
        wait for it): this rank asks the source rank at ``sources[me]`` (a worker of ``source``)
        for its piece of ``src``, until that rank has made it or ``timeout_s`` passes, reads it
        by the data plane and stores it as ``id``."""
        import time

        self._free(frees)
        me = current_rank().rank
        if me not in sources:
            return
        try:
            mesh = self._mesh(key)
            target = source.slice(**sources[me])
            deadline = time.monotonic() + timeout_s
            pause = 0.001
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"to_mesh: the source rank {sources[me]} had no mesh tensor {src} within {timeout_s} s")
                state, v = target.lend.call_one(src).get(timeout=left)
                if state == "ok":
                    break
                if state == "error":
                    raise v
                time.sleep(pause)  # the source has not run the op yet: ask again shortly
                pause = min(pause * 2, 0.05)
            local = torch.empty(local_shapes[me], dtype=dtype)
            if v is not None:
                try:
                    v.read_into(local.view(-1).view(torch.uint8), timeout=int(timeout_s)).get(timeout=timeout_s)
                finally:
                    v.drop()
            self.table[id] = DTensor.from_local(
                local.to(self.device), mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride)
            )
        except Exception as e:  # the error belongs to the tensor; the actor lives on
            self.table[id] = _Failed(e, "to_mesh")

    def _lend(self, id: int) -> Any:
        from ..rdma import RDMABuffer

        t = self._get(Ref(id))
        local = (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().contiguous().clone()
        if local.numel() == 0:
            return None
        buf = RDMABuffer(local.view(-1).view(torch.uint8))
        # several reads of one tensor may be under way (fetch_shard futures not yet read); the
        # last few stay alive until the controller drops them or the tensor is freed
        lent = self.lent.setdefault(id, [])
        lent.append(buf)
        del lent[:-8]
        return buf

    @endpoint
    def count(self) -> int:
        return len(self.table)
