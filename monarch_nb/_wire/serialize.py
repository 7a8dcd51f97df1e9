"""Payload serialization: cloudpickle (classes from ``__main__`` travel by value) with
pickle protocol 5, so buffers of arrays and tensors travel out of band without copies."""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj``; return the body and its out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    cloudpickle.CloudPickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return f.getvalue(), buffers


def loads(body: Any, buffers: list[Any] = ()) -> Any:  # type: ignore[assignment]
    return pickle.loads(body, buffers=buffers)


def nbytes(body: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    return len(body) + sum(memoryview(b).nbytes for b in buffers)
