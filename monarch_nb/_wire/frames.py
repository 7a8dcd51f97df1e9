"""Multipart frame layout.

A message is ``[head, *rest]``:

* ``head`` = ``MAGIC`` (3 bytes) + version + kind + flags (1 byte each) + the length of the
  pickled meta tuple (4 bytes, little-endian) + the meta tuple (small: names, port ids; never
  user objects) + the pickled payload when it is small (flag ``INLINE``);
* ``rest`` = the payload when it is large (its own frame, never copied), then its
  out-of-band pickle-5 buffers, each its own frame so large arrays are never copied into
  the body. With flag ``SHM`` a frame right after the head lists ``(index, name, nbytes)``
  of buffers that travel through shared memory (their frames are empty); a name ending in
  ``.back`` is the receiver's own segment, sent back (see ``_runtime/shm``).

A small message is one frame: every frame costs a send and a receive call (and a GIL
round trip) on both sides, which dominated a small call.

A frame that starts with ``REFUSED`` (magic, then a zero byte where the version goes) is a
receiver's answer to a message it could not take, e.g. one of another wire version; it is
the same in every version so that a peer of any version can read why it was refused.

Everything here is pure; errors are :class:`ProtocolError` so a receiver can log and drop.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import ProtocolError, VersionMismatchError

MAGIC = b"MNB"
#: 4: rank output travels as runs of lines (``logcapture.LogRun``), not a tuple per line;
#: 5: a pooled shared-memory segment holds its buffer at ``shm.DATA_OFF``, not at its start;
#: 6: a reply may name its caller's own segment (``shm.BACK``), sending a ``bytes`` back uncopied
VERSION = 6

#: a message for an actor: meta is an :class:`ActorMeta`
ACTOR = 1
#: a value for a port: meta is a :class:`PortMeta`
PORT = 2
#: one message for several procs of an allocator, which sends each its ACTOR message: meta
#: is a :class:`FanoutMeta`
FANOUT = 3


# The meta of each kind, field by field. It travels as a plain tuple (a NamedTuple would
# pickle its class with it) and is read by position: the constants below name the positions.
class ActorMeta(NamedTuple):
    actor: str
    method: str
    #: where the reply goes ("" for none) and the port there
    reply_addr: str
    reply_port: int
    #: the receiver's index in the call; its reply carries it back
    call_index: int
    #: (labels, sizes) of the mesh the call went to
    extent: tuple[tuple[str, ...], tuple[int, ...]]
    call_id: str
    #: ``seq`` > 0 numbers the sender's messages on ``stream`` (one per sending process and
    #: destination) so the receiver delivers them in the order they were sent whichever path
    #: each took; 0 means unordered (system requests)
    stream: str
    seq: int


class PortMeta(NamedTuple):
    port: int
    #: the index of the ActorMeta this answers
    call_index: int
    #: OK, ERROR, ITEM or PRINTED
    status: int


class FanoutTarget(NamedTuple):
    """One proc of a FANOUT message, and the fields of its ACTOR message that are its own."""

    proc_addr: str
    call_index: int
    reply_addr: str
    stream: str
    seq: int


class FanoutMeta(NamedTuple):
    actor: str
    method: str
    reply_port: int
    extent: tuple[tuple[str, ...], tuple[int, ...]]
    call_id: str
    targets: tuple[FanoutTarget, ...]


#: positions of :class:`ActorMeta` fields
ACTOR_NAME, METHOD, REPLY_ADDR, REPLY_PORT, CALL_INDEX, EXTENT, CALL_ID, STREAM, SEQ = range(9)

#: the start of a refusal frame: magic and a zero version, then the reason in UTF-8
REFUSED = MAGIC + b"\x00"

#: PORT status values
OK = 0
ERROR = 1
#: a stream/channel value that does not complete the port
ITEM = 2
#: an endpoint's value (as OK) from a call that printed: its text went to the proc's allocator
#: first, and a script's controller shows it before the value (Client.after_output)
PRINTED = 3

#: flags: the payload follows the meta in the head frame
INLINE = 1
#: flags: a shared-memory table follows the head
SHM = 2
#: payloads up to this size travel in the head frame (one small copy beats a second frame)
INLINE_MAX = 1 << 16

_LEN = struct.Struct("<I")
_PREFIX = len(MAGIC) + 3
_HEADS = {(kind, flags): MAGIC + bytes([VERSION, kind, flags]) for kind in (ACTOR, PORT, FANOUT) for flags in range(4)}
_WANT = {ACTOR: len(ActorMeta._fields), PORT: len(PortMeta._fields), FANOUT: len(FanoutMeta._fields)}
_KINDS = {h: kf for kf, h in _HEADS.items()}
#: where a frame's pickled meta starts (after the prefix and its length)
_META_AT = _PREFIX + 4


def encode(
    kind: int,
    meta: tuple[Any, ...],
    body: bytes | memoryview,
    buffers: Sequence[Any] = (),
    shm: list[tuple[int, str, int]] | None = None,
) -> list[Any]:
    m = pickle.dumps(meta, protocol=5)
    table = [pickle.dumps(shm, protocol=5)] if shm else []
    flags = SHM if shm else 0
    if len(body) <= INLINE_MAX:
        return [b"".join((_HEADS[kind, flags | INLINE], _LEN.pack(len(m)), m, body)), *table, *buffers]
    return [b"".join((_HEADS[kind, flags], _LEN.pack(len(m)), m)), *table, body, *buffers]


def encode_one(kind: int, meta: tuple[Any, ...], body: bytes) -> bytes:
    """The one frame of a small message (``len(body) <= INLINE_MAX``, no buffers): what
    :func:`encode` makes of it, without the list."""
    m = pickle.dumps(meta, protocol=5)
    return b"".join((_HEADS[kind, INLINE], _LEN.pack(len(m)), m, body))


_PORT_INLINE_HEAD = _HEADS[PORT, INLINE]


def port_value(head: Any) -> tuple[int, int, int, memoryview] | None:
    """``(port, index, status, body)`` of a message of one frame that is a port's value (a
    reply: one per rank of a call to many actors), read without :func:`decode`'s generality
    (0.3 us less); None for any other frame, or a malformed one (:func:`decode` says what is
    wrong with it)."""
    if head[:_PREFIX] != _PORT_INLINE_HEAD:
        return None
    try:
        (n,) = _LEN.unpack_from(head, _PREFIX)
        end = _PREFIX + 4 + n
        if end > len(head):
            return None
        port, index, status = pickle.loads(head[_PREFIX + 4 : end])
    except Exception:
        return None
    if type(port) is not int or type(index) is not int or type(status) is not int:
        return None
    return port, index, status, memoryview(head)[end:]


def decode(frames: list[Any]) -> tuple[int, tuple[Any, ...], Any, list[Any], list[tuple[int, str, int]]]:
    """Return ``(kind, meta, body, buffers, shm)``; raise :class:`ProtocolError` for anything foreign or broken."""
    head = frames[0]
    # one slice and one lookup check magic, version, kind and flags of a well-formed head
    kf = _KINDS.get(head[:_PREFIX]) if type(head) is bytes else None
    kind, flags = _check_head(head) if kf is None else kf
    size = len(head)
    if size < _META_AT:
        raise ProtocolError(f"truncated header ({size} bytes)")
    end = _META_AT + _LEN.unpack_from(head, _PREFIX)[0]
    if end > size:
        raise ProtocolError("malformed header: meta runs past the frame")
    try:
        meta = pickle.loads(head[_META_AT:end])
    except Exception as e:
        raise ProtocolError(f"malformed header: {e}") from e
    if not isinstance(meta, tuple):
        raise ProtocolError("malformed header: meta is not a tuple")
    if len(meta) != _WANT[kind]:
        raise ProtocolError(f"malformed header: kind {kind} needs {_WANT[kind]} fields, got {len(meta)}")
    if flags == INLINE and len(frames) == 1:
        return kind, meta, memoryview(head)[end:], [], []  # a small message: the commonest
    rest = frames[1:] if len(frames) > 1 else []
    shm: list[tuple[int, str, int]] = []
    if flags & SHM:
        if not rest:
            raise ProtocolError("malformed message: no shared-memory table")
        shm = _shm_table(rest[0])
        rest = rest[1:]
    if flags & INLINE:
        body = memoryview(head)[end:]
    elif rest:
        body, rest = rest[0], rest[1:]
    else:
        raise ProtocolError("malformed message: no payload frame")
    if shm and any(i >= len(rest) for i, _, _ in shm):
        raise ProtocolError("malformed shared-memory table: index out of range")
    return kind, meta, body, rest, shm


def _check_head(head: Any) -> tuple[int, int]:
    """``(kind, flags)`` of a head that is not a plain well-formed ``bytes`` one, or the error
    that says what is wrong with it."""
    if len(head) < 4 or head[:3] != MAGIC:
        raise ProtocolError(f"not a monarch_nb frame (starts {bytes(head[:8])!r})")
    if head[3] != VERSION:
        if head[3] == 0:
            raise ProtocolError(f"refused by the peer: {refusal_reason(head)}")
        raise VersionMismatchError(f"peer speaks wire version {head[3]}, this process speaks {VERSION}")
    if len(head) < _PREFIX + 4:
        raise ProtocolError(f"truncated header ({len(head)} bytes)")
    kind, flags = head[4], head[5]
    if kind not in _WANT:
        raise ProtocolError(f"unknown message kind {kind}")
    return kind, flags


def _shm_table(frame: Any) -> list[tuple[int, str, int]]:
    try:
        table: list[tuple[int, str, int]] = pickle.loads(frame)
        ok = isinstance(table, list) and all(
            isinstance(e, tuple) and len(e) == 3 and type(e[0]) is int and e[0] >= 0 and type(e[1]) is str and type(e[2]) is int
            for e in table
        )
    except Exception:
        ok = False
    if not ok:
        raise ProtocolError("malformed shared-memory table")
    return table


def refusal(reason: str) -> bytes:
    """A frame telling a sender why its message was not taken (readable by any wire version)."""
    return REFUSED + reason.encode("utf-8", "replace")[:1000]


def refusal_reason(frame: Any) -> str | None:
    """The reason in a refusal frame, or None if ``frame`` is not one."""
    b = bytes(frame[:1004])
    if not b.startswith(REFUSED):
        return None
    return b[len(REFUSED) :].decode("utf-8", "replace")
