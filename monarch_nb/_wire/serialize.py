"""Payload serialization: cloudpickle (classes from ``__main__`` travel by value) with
pickle protocol 5, so buffers of arrays and tensors travel out of band without copies."""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle

#: leaf types the C pickler writes exactly as cloudpickle would (by value, no class lookup)
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _plain(obj: Any) -> bool:
    t = type(obj)
    if t in _PLAIN:
        return True
    if t is tuple or t is list:
        return len(obj) <= 16 and all(_plain(x) for x in obj)
    if t is dict:
        return len(obj) <= 16 and all(type(k) is str and _plain(v) for k, v in obj.items())
    return False


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj``; return the body and its out-of-band buffers."""
    if _plain(obj):
        # small calls and replies (``((), {})``, ``0``, ``(("x", 1), {})``) skip building a
        # CloudPickler, which costs more than the pickling itself
        return pickle.dumps(obj, protocol=5), []
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    cloudpickle.CloudPickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return f.getvalue(), buffers


def loads(body: Any, buffers: list[Any] = ()) -> Any:  # type: ignore[assignment]
    return pickle.loads(body, buffers=buffers)


def nbytes(body: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    return len(body) + sum(memoryview(b).nbytes for b in buffers)
