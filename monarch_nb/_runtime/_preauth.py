"""Connections to a TCP inbox that have not yet proved the key: few, brief and small.

libzmq reads a CurveZMQ handshake command as it reads any message: a peer without the key may
announce one of up to ``MAXMSGSIZE`` (8 GiB, what an authenticated message may be), and the
inbox holds every byte it sends until the handshake's deadline (30 s by default). It also keeps
every connection that says nothing until then. Before session 31 a stranger streaming into an
allocator's TCP port made it hold 2.6 GB after 8 s, and one holding a few hundred silent
connections took every descriptor of an allocator that had 400: libzmq's IPC listener aborts its
process when an accept finds no descriptor, so the next controller to attach killed the
allocator and every mesh on it. libzmq has no limit of its own for either, so the inbox's
monitor, whose ACCEPTED events carry each connection's descriptor, keeps a list of the
connections in their handshake; a look at each (``TCP_INFO``) every :data:`CHECK_S` drops those
that proved the key (:data:`PROVEN`) and cuts (``shutdown``) any that sent more than
:data:`HANDSHAKE_BYTES` (a whole handshake is under 1 KiB), then the oldest of those whose
peer has not said a valid HELLO past :data:`PENDING_MAX` (after :data:`MIN_AGE_S`, or at once
while they hold a quarter of the descriptors). The handshake itself must end within
:data:`HANDSHAKE_S`. What a stranger holds is then what it sends in :data:`CHECK_S`, and a
quarter of the descriptors at most.

A descriptor number is reused as soon as libzmq closes it, and its events reach us later: a
connection is known by its addresses (unique among open TCP connections), compared on the
descriptor again before anything is done to it, so nothing else that took the number is cut.
"""

from __future__ import annotations

import resource
import socket
import struct
import time
from typing import Any, NamedTuple

import zmq

from ._refusals import Refusals

#: connections whose peer has not yet said a valid HELLO, at once; past it the oldest of those
#: waiting for longer than :data:`MIN_AGE_S` is cut, or, while the connections in their handshake
#: hold a quarter of the descriptors the process may open, the oldest whatever their age
PENDING_MAX = 128
#: an honest peer says its HELLO within a round trip; in a burst of hundreds connecting at once
#: (procs of other hosts replying to a controller) libzmq answers them one by one, all within a
#: few hundred ms: 300 at once lost half of theirs to the cut without this grace
MIN_AGE_S = 1.0
#: bytes a connection may send before its handshake is done (greeting 64, HELLO 200, INITIATE
#: ~300 with its metadata)
HANDSHAKE_BYTES = 64 << 10
#: seconds a handshake may take (``ZMQ_HANDSHAKE_IVL``): two round trips, even through a gateway
HANDSHAKE_S = 10.0
#: seconds between two looks at the connections in their handshake
CHECK_S = 0.05
#: what the inbox sends before its READY: its greeting (64 bytes) and WELCOME (a 168-byte
#: command in a 2-byte frame). A peer that acknowledged more has had the READY, which goes out
#: only once its INITIATE proved the key (libzmq's HANDSHAKE_SUCCEEDED event does not say
#: which connection it is about); an honest peer sends its first message only after the READY
PROVEN = 64 + 2 + 168
#: our greeting: a peer that acknowledged more has had the WELCOME, which answers only a HELLO
#: made with the inbox's public key (derived from the cluster key, never sent): it is not cut to
#: make room for others
GREETED = 64
# offsets in struct tcp_info (linux/tcp.h, Linux 4.1 and later)
_BYTES_ACKED, _BYTES_RECEIVED = 120, 128

Identity = tuple[Any, Any]

#: the events after which a connection is gone
_ENDED = frozenset({zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED})
#: the monitor's events :meth:`Handshakes.event` follows
FOLLOWED = frozenset({zmq.EVENT_ACCEPTED, *_ENDED})


class _State(NamedTuple):
    ident: Identity
    received: int
    acked: int


def _look(fd: int, known: Identity | None) -> _State | None:
    """What the kernel says of TCP connection ``fd``; None if ``fd`` is not one now, or not the
    connection ``known`` names."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None  # closed meanwhile, or no socket
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        ident = (s.getsockname(), s.getpeername())
        if known is not None and ident != known:
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _BYTES_RECEIVED + 8:
            return _State(ident, 0, PROVEN + 1)  # a kernel that does not say: never cut for size
        acked, received = struct.unpack_from("=QQ", info, _BYTES_ACKED)
        return _State(ident, received, acked)
    except OSError:
        return None
    finally:
        s.detach()  # libzmq's descriptor: never closed here


def _shutdown(fd: int, known: Identity) -> bool:
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if (s.getsockname(), s.getpeername()) != known:
            return False  # no longer that connection
        s.shutdown(socket.SHUT_RDWR)  # libzmq reads the end and closes the connection itself
        return True
    except OSError:
        return False
    finally:
        s.detach()


class Handshakes:
    """The connections of one TCP inbox (listening on ``port``) in their handshake, fed with its
    monitor's events."""

    def __init__(self, port: int, where: str, refusals: Refusals) -> None:
        self._port = port
        self._where = where
        self._refusals = refusals
        #: descriptor -> its addresses, oldest first
        self.pending: dict[int, Identity] = {}
        #: descriptor -> when it was accepted
        self._since: dict[int, float] = {}
        #: when :meth:`check` last ran
        self.checked = 0.0
        #: connections cut
        self.cut = 0

    def event(self, kind: int, fd: int) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            self.pending.pop(fd, None)
            got = _look(fd, None)
            # the number may already belong to something else (the connection ended and its
            # DISCONNECTED event is still queued): only a connection to this port is listed
            if got is not None and got.ident[0][1] == self._port:
                self.pending[fd] = got.ident
                self._since[fd] = time.monotonic()
        elif kind in _ENDED:
            self.pending.pop(fd, None)

    def scarce(self) -> bool:
        """Whether the connections in their handshake hold a quarter of the descriptors this
        process may open: the grace of :data:`MIN_AGE_S` ends (libzmq aborts the process when
        its IPC listener finds none)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft != resource.RLIM_INFINITY and len(self.pending) > soft // 4

    def due(self) -> bool:
        """Whether the monitor's events should be followed by a :meth:`check` now rather than at
        the next look: past :data:`PENDING_MAX`, once per :data:`CHECK_S` (each is a few system
        calls per connection) or at once when descriptors run short."""
        if len(self.pending) <= PENDING_MAX:
            return False
        return self.scarce() or time.monotonic() - self.checked >= CHECK_S

    def check(self) -> None:
        """Drop from the list the connections that proved the key or are gone; cut those that
        sent more than a handshake's bytes, then the oldest of those without a WELCOME past
        :data:`PENDING_MAX`."""
        self.checked = time.monotonic()
        states: dict[int, _State] = {}
        for fd, ident in list(self.pending.items()):
            st = _look(fd, ident)
            if st is None or st.acked > PROVEN:
                del self.pending[fd]
            elif st.received > HANDSHAKE_BYTES:
                del self.pending[fd]
                self._cut(fd, st, f"it sent more than {HANDSHAKE_BYTES >> 10} KiB before proving the key")
            else:
                states[fd] = st
        for fd in list(self._since):
            if fd not in self.pending:
                del self._since[fd]
        unanswered = [fd for fd, st in states.items() if st.acked <= GREETED]
        excess = len(unanswered) - PENDING_MAX
        if excess <= 0:
            return
        scarce = self.scarce()
        old = time.monotonic() - MIN_AGE_S
        for fd in unanswered[:excess]:  # oldest first
            if scarce or self._since.get(fd, 0.0) < old:
                del self.pending[fd]
                self._cut(fd, states[fd], f"more than {PENDING_MAX} connections were in their handshake at once")

    def _cut(self, fd: int, st: _State, why: str) -> None:
        if not _shutdown(fd, st.ident):
            return
        self.cut += 1
        # said once a minute at most, whatever the peer (_refusals.py): not a line per connection
        self._refusals.refused("cut a connection to %s from %s in its security handshake: %s", self._where, st.ident[1][0], why)
