"""Multipart frame layout.

A message is ``[head, *rest]``:

* ``head`` = ``MAGIC`` (3 bytes) + version + kind + flags (1 byte each) + the length of the
  pickled meta tuple (4 bytes, little-endian) + the meta tuple (small: names, port ids; never
  user objects) + the pickled payload when it is small (flag ``INLINE``);
* ``rest`` = the payload when it is large (its own frame, never copied), then its
  out-of-band pickle-5 buffers, each its own frame so large arrays are never copied into
  the body.

A small message is one frame: every frame costs a send and a receive call (and a GIL
round trip) on both sides, which dominated a small call.

Everything here is pure; errors are :class:`ProtocolError` so a receiver can log and drop.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from ..errors import ProtocolError, VersionMismatchError

MAGIC = b"MNB"
VERSION = 2

#: a message for an actor: meta = (actor, method, reply_addr, reply_port, index, extent, call_id)
ACTOR = 1
#: a value for a port: meta = (port_id, index, status)
PORT = 2

#: PORT status values
OK = 0
ERROR = 1
#: a stream/channel value that does not complete the port
ITEM = 2

#: flags: the payload follows the meta in the head frame
INLINE = 1
#: payloads up to this size travel in the head frame (one small copy beats a second frame)
INLINE_MAX = 1 << 16

_LEN = struct.Struct("<I")
_PREFIX = len(MAGIC) + 3
_HEADS = {(kind, flags): MAGIC + bytes([VERSION, kind, flags]) for kind in (ACTOR, PORT) for flags in (0, INLINE)}
_WANT = {ACTOR: 7, PORT: 3}


def encode(kind: int, meta: tuple[Any, ...], body: bytes | memoryview, buffers: list[Any] = ()) -> list[Any]:  # type: ignore[assignment]
    m = pickle.dumps(meta, protocol=5)
    if len(body) <= INLINE_MAX:
        return [b"".join((_HEADS[kind, INLINE], _LEN.pack(len(m)), m, body)), *buffers]
    return [b"".join((_HEADS[kind, 0], _LEN.pack(len(m)), m)), body, *buffers]


def decode(frames: list[Any]) -> tuple[int, tuple[Any, ...], Any, list[Any]]:
    """Return ``(kind, meta, body, buffers)``; raise :class:`ProtocolError` for anything foreign or broken."""
    head = frames[0]
    if len(head) < 4 or head[:3] != MAGIC:
        raise ProtocolError(f"not a monarch_nb frame (starts {bytes(head[:8])!r})")
    if head[3] != VERSION:
        raise VersionMismatchError(f"peer speaks wire version {head[3]}, this process speaks {VERSION}")
    if len(head) < _PREFIX + 4:
        raise ProtocolError(f"truncated header ({len(head)} bytes)")
    kind, flags = head[4], head[5]
    want = _WANT.get(kind)
    if want is None:
        raise ProtocolError(f"unknown message kind {kind}")
    (n,) = _LEN.unpack_from(head, _PREFIX)
    start = _PREFIX + 4
    if start + n > len(head):
        raise ProtocolError("malformed header: meta runs past the frame")
    try:
        meta = pickle.loads(memoryview(head)[start : start + n])
    except Exception as e:
        raise ProtocolError(f"malformed header: {e}") from e
    if not isinstance(meta, tuple):
        raise ProtocolError("malformed header: meta is not a tuple")
    if len(meta) != want:
        raise ProtocolError(f"malformed header: kind {kind} needs {want} fields, got {len(meta)}")
    if flags & INLINE:
        return kind, meta, memoryview(head)[start + n :], frames[1:]
    if len(frames) < 2:
        raise ProtocolError("malformed message: no payload frame")
    return kind, meta, frames[1], frames[2:]
