"""Payload serialization: cloudpickle (classes from ``__main__`` travel by value) with
pickle protocol 5, so buffers of arrays and tensors travel out of band without copies.

Out of band too: large ``bytes`` (in the arguments or the value, a few containers deep) and
dense CPU torch tensors, whose default pickling copies their storage into the body.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Iterable
from typing import Any

import cloudpickle

from . import _rawbuf

#: leaf types the C pickler writes exactly as cloudpickle would (by value, no class lookup)
_PLAIN = frozenset({int, float, str, bool, type(None)})


#: buffers at least this large travel out of band (their own frame, or shared memory)
OOB_MIN = 1 << 16


def _plain(obj: Any) -> bool:
    # loops, not all() over a generator, and leaves checked in place: this runs on every
    # call and reply, where a generator and a call per element cost more than the pickling
    t = type(obj)
    if t in _PLAIN:
        return True
    if t is bytes:
        return len(obj) < OOB_MIN
    if t is tuple or t is list:
        if len(obj) > 16:
            return False
        for x in obj:
            if type(x) not in _PLAIN and not _plain(x):
                return False
        return True
    if t is dict:
        if len(obj) > 16:
            return False
        for k, v in obj.items():
            if type(k) is not str or (type(v) not in _PLAIN and not _plain(v)):
                return False
        return True
    return False


#: the body of a call without arguments (``dumps(((), {}))``), the commonest one
_NO_ARGS = pickle.dumps(((), {}), protocol=5)


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj``; return the body and its out-of-band buffers."""
    if _plain(obj):
        # small calls and replies (``((), {})``, ``0``, ``(("x", 1), {})``) skip building a
        # CloudPickler, which costs more than the pickling itself
        return pickle.dumps(obj, protocol=5), []
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(_lift_bytes(obj, 3))
    return f.getvalue(), buffers


class _OOBBytes:
    """Stands in for a large ``bytes`` (which the pickler never offers to reducer_override)."""

    __slots__ = ("b",)

    def __init__(self, b: bytes) -> None:
        self.b = b

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_bytes_from, (pickle.PickleBuffer(self.b),))


def _bytes_from(buf: Any) -> bytes:
    # a pooled shared-memory segment can carry the object itself (``as_bytes``: laid over it,
    # no copy; the segment goes back once nobody holds it)
    mv = memoryview(buf)
    lease = mv.obj
    if type(lease) is bytes and len(lease) == mv.nbytes:
        return lease  # the whole of an immutable bytes (one sent back, a frame): no copy needed
    as_bytes = getattr(lease, "as_bytes", None)
    if as_bytes is not None and (laid := as_bytes()) is not None:
        return laid  # type: ignore[no-any-return]
    # else the one copy a bytes object needs to own its data; a shared-memory segment the
    # sender may reuse says so (``copied``) and is handed back once its content is out
    out = _rawbuf.to_bytes(buf)
    copied = getattr(lease, "copied", None)
    if copied is not None:
        copied()
    return out


def _lift_bytes(obj: Any, depth: int) -> Any:
    t = type(obj)
    if t is bytes:
        return _OOBBytes(obj) if len(obj) >= OOB_MIN else obj
    if depth == 0:
        return obj
    if t is tuple or t is list:
        if len(obj) > 64:
            return obj
        items = [_lift_bytes(x, depth - 1) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return tuple(items) if t is tuple else items
    if t is dict and len(obj) <= 64:
        d = {k: _lift_bytes(v, depth - 1) for k, v in obj.items()}
        if all(d[k] is v for k, v in obj.items()):
            return obj
        return d
    return obj


_tensor_type: Any = None


def _tensor_cls() -> Any:
    global _tensor_type
    if _tensor_type is None:
        torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
        if torch is None:
            return None
        _tensor_type = torch.Tensor
    return _tensor_type


def _reduce_tensor(t: Any) -> Any:
    """Out-of-band reduction of a dense CPU tensor that owns its whole storage, else None."""
    import torch

    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or not t.is_contiguous()
        or t.nbytes < OOB_MIN
        # a view of a larger storage keeps torch's pickling (which keeps aliasing within a
        # message); two whole-storage tensors of one storage in one message arrive unaliased
        or t.untyped_storage().nbytes() != t.nbytes
    ):
        return None
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), str(t.dtype).removeprefix("torch."), tuple(t.shape)))


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    mv = memoryview(buf)
    if mv.readonly:
        mv = memoryview(bytearray(mv))  # tensors are writable; never alias read-only memory
    return torch.frombuffer(mv, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


_DYNAMIC = "<dynamic-code>"
_cloud_code_reduce = cloudpickle.CloudPickler.dispatch_table[types.CodeType]


def _code_reduce(code: types.CodeType) -> Any:
    # cloudpickle 3.1.3 names all code it ships "<dynamic-code>", for deterministic payloads;
    # ours must keep the notebook cell's file name, which tracebacks, stack dumps, log
    # prefixes and the debugger's source fetch (from the controller's linecache) go by
    rebuild, args = _cloud_code_reduce(code)
    if code.co_filename != _DYNAMIC and _DYNAMIC in args:
        i = args.index(_DYNAMIC)
        args = (*args[:i], code.co_filename, *args[i + 1 :])
    return rebuild, args


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.CloudPickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        cls = _tensor_type or _tensor_cls()
        if cls is not None and type(obj) is cls:
            r = _reduce_tensor(obj)
            if r is not None:
                return r
        return super().reducer_override(obj)


def dumps_by_value(obj: Any) -> bytes:
    """``obj`` (a class, a function) pickled by cloudpickle as one blob, its code keeping its
    file name."""
    f = io.BytesIO()
    _Pickler(f, protocol=5).dump(obj)
    return f.getvalue()


def dumps_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """``dumps((args, kwargs))``: the arguments of a call."""
    if not args and not kwargs:
        return _NO_ARGS, []
    return dumps((args, kwargs))


def dumps_leaf(value: Any) -> bytes | None:
    """The body of a reply that is one int, float, str, bool or None (the commonest reply),
    made without :func:`dumps`' look for buffers; None for any other value."""
    if type(value) in _PLAIN:
        return pickle.dumps(value, protocol=5)
    return None


def loads(body: Any, buffers: Iterable[Any] = ()) -> Any:
    return pickle.loads(body, buffers=buffers)


#: :func:`loads` without its Python frame (``buffers`` by keyword): a proc's every call
loads_fast = pickle.loads


def nbytes(body: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    if not buffers:  # most messages: no generator to start
        return len(body)
    return len(body) + sum(memoryview(b).nbytes for b in buffers)
