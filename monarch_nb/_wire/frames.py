"""Multipart frame layout.

A message is ``[header, body, *buffers]``:

* ``header`` = ``MAGIC`` (3 bytes) + version (1 byte) + kind (1 byte) + pickled meta tuple
  (small: names, port ids, flags; never user objects);
* ``body`` = the pickled payload; ``buffers`` = its out-of-band pickle-5 buffers, sent as
  their own frames so large arrays are never copied into the body.

Everything here is pure; errors are :class:`ProtocolError` so a receiver can log and drop.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..errors import ProtocolError, VersionMismatchError

MAGIC = b"MNB"
VERSION = 1

#: a message for an actor: meta = (actor, method, reply_addr, reply_port, index, call_id, flags)
ACTOR = 1
#: a value for a port: meta = (port_id, index, status)
PORT = 2

#: PORT status values
OK = 0
ERROR = 1
#: a stream/channel value that does not complete the port
ITEM = 2

_HEAD = MAGIC + bytes([VERSION])


def encode(kind: int, meta: tuple[Any, ...], body: bytes | memoryview, buffers: list[Any] = ()) -> list[Any]:  # type: ignore[assignment]
    return [_HEAD + bytes([kind]) + pickle.dumps(meta, protocol=5), body, *buffers]


def decode_header(header: bytes | memoryview) -> tuple[int, tuple[Any, ...]]:
    """Return ``(kind, meta)``; raise :class:`ProtocolError` for anything foreign or broken."""
    h = bytes(header)
    if len(h) < 5 or h[:3] != MAGIC:
        raise ProtocolError(f"not a monarch_nb frame (starts {h[:8]!r})")
    if h[3] != VERSION:
        raise VersionMismatchError(f"peer speaks wire version {h[3]}, this process speaks {VERSION}")
    kind = h[4]
    if kind not in (ACTOR, PORT):
        raise ProtocolError(f"unknown message kind {kind}")
    try:
        meta = pickle.loads(h[5:])
    except Exception as e:
        raise ProtocolError(f"malformed header: {e}") from e
    if not isinstance(meta, tuple):
        raise ProtocolError("malformed header: meta is not a tuple")
    want = 7 if kind == ACTOR else 3
    if len(meta) != want:
        raise ProtocolError(f"malformed header: kind {kind} needs {want} fields, got {len(meta)}")
    return kind, meta
