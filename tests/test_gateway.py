"""The gateway's two ends (monarch_nb/_runtime/gateway.py) on real sockets: who may open a tunnel,
and where a tunnel may lead. The whole path through a Kubernetes port-forward, with the controller
cut off from the pods, is tests/test_job_k8s.py's gateway test."""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest
from _nobody import hold_silent_as_nobody
from conftest import wait_for

from monarch_nb._runtime._tunnel import CHUNK, HOLD_MAX, Mux, Streams
from monarch_nb._runtime.gateway import GatewayClient, GatewayError, GatewayServer

pytestmark = pytest.mark.timeout(60)


def _socks_connect(proxy: str, user: str, password: str, host: str, port: int) -> int:
    """A SOCKS5 CONNECT as zmq makes it; the reply code (0: connected)."""
    h, p = proxy.rsplit(":", 1)
    with socket.create_connection((h, int(p)), timeout=20) as s:
        s.sendall(b"\x05\x01\x02")
        assert s.recv(2) == b"\x05\x02"
        s.sendall(bytes([1, len(user)]) + user.encode() + bytes([len(password)]) + password.encode())
        if s.recv(2) != b"\x01\x00":
            return -1
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port))
        return s.recv(10)[1]


KEY = secrets.token_bytes(32)


@pytest.fixture
def server() -> Iterator[GatewayServer]:
    srv = GatewayServer(("127.0.0.1", 0), "127.0.0.1", KEY)
    yield srv
    srv.close()


def _tunnel(srv: GatewayServer) -> Callable[[], socket.socket]:
    return lambda: socket.create_connection(srv.addr[:2], timeout=10)


def test_a_tunnel_needs_the_cluster_key(server: GatewayServer) -> None:
    with pytest.raises(GatewayError, match="another cluster key|does not hold"):
        GatewayClient(_tunnel(server), secrets.token_bytes(32), ["127.0.0.1"], lambda: "")
    assert server.tunnels == 0


def test_streams_go_only_to_the_jobs_hosts_and_carry_bytes_both_ways(server: GatewayServer) -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]
    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: "")
    try:
        # a host that is not one of the job's allocators: refused at the gateway
        assert _socks_connect(gw.proxy, gw.username, gw.password, "127.0.0.2", port) == 5
        # the wrong SOCKS password: refused at the controller's end
        assert _socks_connect(gw.proxy, gw.username, "x" * 32, "127.0.0.1", port) == -1
        h, p = gw.proxy.rsplit(":", 1)
        with socket.create_connection((h, int(p)), timeout=20) as s:
            s.sendall(b"\x05\x01\x02")
            s.recv(2)
            s.sendall(bytes([1, 16]) + gw.username.encode() + bytes([32]) + gw.password.encode())
            assert s.recv(2) == b"\x01\x00"
            s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port))
            assert s.recv(10)[1] == 0
            conn, _ = echo.accept()
            conn.sendall(b"hello")  # the far end speaks first, as a zmq peer greets
            assert s.recv(5) == b"hello"
            s.sendall(b"x" * 1_000_000)
            got = b""
            while len(got) < 1_000_000:
                got += conn.recv(1 << 20)
            assert got == b"x" * 1_000_000
            conn.close()
    finally:
        gw.close()
        echo.close()
    assert not gw.alive


def test_a_dropped_tunnel_is_opened_again_with_the_same_reply_address(server: GatewayServer) -> None:
    inbox = socket.create_server(("127.0.0.1", 0))
    echo = socket.create_server(("127.0.0.1", 0))
    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: f"tcp://127.0.0.1:{inbox.getsockname()[1]}")
    try:
        reverse, first = gw.reverse, gw.mux
        first.close()  # the port-forward drops
        # the next connection the controller makes opens a new tunnel, in the same session
        assert _socks_connect(gw.proxy, gw.username, gw.password, "127.0.0.1", echo.getsockname()[1]) == 0
        assert gw.mux is not first and gw.reverse == reverse and server.tunnels == 2
        # a host answering at the reply address the procs already hold reaches the controller
        h, p = reverse[len("tcp://") :].rsplit(":", 1)
        with socket.create_connection((h, int(p)), timeout=10) as c:
            c.sendall(b"answer")
            conn, _ = inbox.accept()
            conn.settimeout(10)
            assert conn.recv(6) == b"answer"
            conn.close()
    finally:
        gw.close()
        inbox.close()
        echo.close()


def _stream(gw: GatewayClient, echo: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A stream through the gateway as zmq opens one: (the controller's end, the far end)."""
    h, p = gw.proxy.rsplit(":", 1)
    s = socket.create_connection((h, int(p)), timeout=20)
    s.sendall(b"\x05\x01\x02")
    assert s.recv(2) == b"\x05\x02"
    s.sendall(bytes([1, 16]) + gw.username.encode() + bytes([32]) + gw.password.encode())
    assert s.recv(2) == b"\x01\x00"
    s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", echo.getsockname()[1]))
    assert s.recv(10)[1] == 0
    conn, _ = echo.accept()
    conn.settimeout(20)
    return s, conn


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(256)) * (n // 256)


@pytest.fixture
def link(server: GatewayServer) -> Iterator[tuple[GatewayClient, socket.socket, socket.socket]]:
    """A controller's end on ``server`` and one stream through it: (client, our end, far end)."""
    echo = socket.create_server(("127.0.0.1", 0))
    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: "")
    s, conn = _stream(gw, echo)
    yield gw, s, conn
    s.close()
    conn.close()
    gw.close()
    echo.close()


def test_a_tunnel_that_drops_mid_stream_loses_no_byte_either_way(
    server: GatewayServer, link: tuple[GatewayClient, socket.socket, socket.socket]
) -> None:
    # a port-forward drops while zmq has bytes in it, both ways: the next tunnel opens at once
    # and each stream resumes where the far end stopped; neither local socket sees the drop
    gw, s, conn = link
    out, back = _pattern(16 << 20, 1), _pattern(16 << 20, 2)
    got: dict[str, bytearray] = {"out": bytearray(), "back": bytearray()}
    progress = threading.Condition()

    def read(sock: socket.socket, key: str, n: int) -> None:
        while len(got[key]) < n:
            b = sock.recv(1 << 16)
            if not b:
                return
            with progress:
                got[key] += b
                progress.notify_all()

    readers = [
        threading.Thread(target=read, args=(conn, "out", len(out))),
        threading.Thread(target=read, args=(s, "back", len(back))),
    ]
    writers = [threading.Thread(target=s.sendall, args=(out,)), threading.Thread(target=conn.sendall, args=(back,))]
    for t in readers + writers:
        t.start()
    level, dropped = 0, None
    for _ in range(3):  # three drops, each with both directions in flight
        with progress:
            # a MiB more each way since the last drop, and a new tunnel carries it
            assert progress.wait_for(
                lambda lv=level, d=dropped: gw.mux is not d and min(len(v) for v in got.values()) >= lv + (1 << 20),
                timeout=30,
            )
            level, dropped = min(len(v) for v in got.values()), gw.mux
        dropped.close()
    for t in readers + writers:
        t.join(30)
    assert got["out"] == out and got["back"] == back
    assert server.tunnels == 4
    # the stream is still the one it was: it carries the next bytes too
    s.sendall(b"after")
    assert conn.recv(5) == b"after"


def test_a_message_sent_right_after_a_drop_arrives(
    server: GatewayServer, link: tuple[GatewayClient, socket.socket, socket.socket]
) -> None:
    # the k8s gateway test's call made just after the port-forward dropped: before, its bytes
    # went into a connection the drop had closed and the call waited for ever
    gw, s, conn = link
    for i in range(20):
        gw.mux.close()
        s.sendall(b"call %02d" % i)
        assert conn.recv(7) == b"call %02d" % i
        conn.sendall(b"answer")
        assert s.recv(6) == b"answer"
    assert server.tunnels == 21


def test_streams_close_when_the_gateway_restarted(server: GatewayServer) -> None:
    # a new gateway (rank 0's pod restarted) has none of the session's streams: they close at
    # once, so zmq reconnects and the error says to re-attach
    echo = socket.create_server(("127.0.0.1", 0))
    target = [server]
    gw = GatewayClient(lambda: _tunnel(target[0])(), KEY, ["127.0.0.1"], lambda: "")
    s, conn = _stream(gw, echo)
    target[0] = GatewayServer(("127.0.0.1", 0), "127.0.0.1", KEY)
    try:
        gw.mux.close()
        s.settimeout(20)
        assert s.recv(1) == b""  # closed, not left waiting
        assert _socks_connect(gw.proxy, gw.username, gw.password, "127.0.0.1", echo.getsockname()[1]) != 0
        with pytest.raises(GatewayError, match="restarted.*re-attach"):
            gw._live()
    finally:
        s.close()
        conn.close()
        gw.close()
        target[0].close()
        echo.close()


def test_a_gateway_of_another_protocol_version_is_named() -> None:
    old = socket.create_server(("127.0.0.1", 0))

    def greet() -> None:
        c, _ = old.accept()
        c.sendall(b"MNBGW1\n" + bytes(32))  # session 17's gateway
        c.recv(1 << 16)
        c.close()

    t = threading.Thread(target=greet)
    t.start()
    try:
        with pytest.raises(GatewayError, match="protocol 1, this controller 2: install the same monarch_nb"):
            GatewayClient(lambda: socket.create_connection(old.getsockname(), timeout=10), KEY, ["127.0.0.1"], lambda: "")
    finally:
        t.join(10)
        old.close()


def test_a_controller_that_closes_ends_its_streams_at_the_gateway(
    server: GatewayServer, link: tuple[GatewayClient, socket.socket, socket.socket]
) -> None:
    # a kernel that shuts down says so: the job's side of its connections closes now, not when
    # the session's grace (120 s, for a dropped tunnel) runs out
    gw, s, conn = link
    s.sendall(b"last words")
    assert conn.recv(10) == b"last words"
    gw.close()
    assert conn.recv(1) == b""  # within the recv timeout (20 s), not the session's grace
    assert not server.sessions


def _push_until_blocked(s: socket.socket, data: bytes) -> int:
    """Write ``data`` until 5 s pass without progress (the writer is pushed back); how much went."""
    s.settimeout(5)
    accepted = 0
    try:
        while accepted < len(data):
            accepted += s.send(data[accepted : accepted + (1 << 20)])
    except TimeoutError:
        pass
    return accepted


def test_a_stream_without_a_tunnel_holds_a_bounded_amount_then_pushes_back(
    link: tuple[GatewayClient, socket.socket, socket.socket],
) -> None:
    # the port-forward is gone for a while and the controller keeps writing: the stream keeps
    # at most HOLD_MAX (8 MiB) for the next tunnel, then stops reading, so the writer blocks
    # (zmq would reach its high-water mark) instead of the controller's memory growing
    gw, s, conn = link
    reconnect = threading.Event()
    way_in = gw._connect

    def connect() -> socket.socket:
        if not reconnect.is_set():
            raise OSError("the port-forward is gone")
        return way_in()

    gw._connect = connect
    gw.mux.close()
    data = _pattern(64 << 20, 3)
    accepted = _push_until_blocked(s, data)
    # the hold, plus what the two local socket buffers take
    assert 8 << 20 <= accepted < 32 << 20, accepted
    reconnect.set()  # the way in is back: the next attempt (within a second) opens a tunnel
    got = bytearray()
    while len(got) < accepted:
        got += conn.recv(1 << 20)
    assert got == data[:accepted]


def test_a_stream_not_yet_attached_holds_a_bounded_amount_then_gets_it_all() -> None:
    # bytes for a stream this end is still setting up (its SOCKS reply is on the way) are held
    # until it is attached; unacknowledged, so the far end's writer stops at its own HOLD_MAX
    # instead of this end's memory growing with whatever the far end sends meanwhile
    a_end, b_end = socket.socketpair()
    a, b = Streams(first_sid=1), Streams(first_sid=2)
    mux_a, mux_b = Mux(a_end, 1), Mux(b_end, 1)
    a.bind(mux_a)
    b.bind(mux_b)
    readers = [threading.Thread(target=m.run, args=(s.on_frame,), daemon=True) for m, s in ((mux_a, a), (mux_b, b))]
    for t in readers:
        t.start()
    writer, b_local = socket.socketpair()
    reader, a_local = socket.socketpair()
    try:
        a.expect(5, mux_a)  # not attached yet
        b.expect(5, mux_b)
        b.attach(5, b_local)
        data = _pattern(64 << 20, 5)
        accepted = _push_until_blocked(writer, data)
        held = sum(len(x) for x in a.streams[5].held)
        assert held <= HOLD_MAX + CHUNK, held
        # the tunnel drops meanwhile and the next one resumes: still no more than that
        for m in (mux_a, mux_b):
            m.close()
        a_end, b_end = socket.socketpair()
        mux_a, mux_b = Mux(a_end, 2), Mux(b_end, 2)
        for m, st in ((mux_a, a), (mux_b, b)):
            st.bind(m)
            readers.append(threading.Thread(target=m.run, args=(st.on_frame,), daemon=True))
            readers[-1].start()
        accepted += _push_until_blocked(writer, data[accepted:])
        held = sum(len(x) for x in a.streams[5].held)
        assert held <= HOLD_MAX + CHUNK, held
        assert accepted < 32 << 20, accepted
        writer.settimeout(20)
        reader.settimeout(20)
        got = bytearray()

        def read() -> None:
            while len(got) < len(data):
                got.extend(reader.recv(1 << 20))

        taker = threading.Thread(target=read, daemon=True)
        taker.start()  # as zmq's I/O thread: reading before and while the held bytes go out
        a.attach(5, a_local)
        writer.sendall(data[accepted:])
        taker.join(20)
        assert got == data
    finally:
        a.close_all()
        b.close_all()
        mux_a.close()
        mux_b.close()
        for s in (writer, reader):
            s.close()
        for t in readers:
            t.join(10)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that ended any thread meanwhile (a reader killed by bad input)."""
    seen: list[BaseException] = []
    before = threading.excepthook
    threading.excepthook = lambda a: seen.append(a.exc_value) if a.exc_value is not None else None
    yield seen
    threading.excepthook = before


def _works(gw: GatewayClient) -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    try:
        s, conn = _stream(gw, echo)
        s.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        s.close()
        conn.close()
    finally:
        echo.close()


def _until_closed(c: socket.socket) -> bytes:
    """What the other end said before it closed (a reset, if it left bytes of ours unread),
    once it has all we sent."""
    out = b""
    try:
        c.shutdown(socket.SHUT_WR)  # what was cut short stays so: no more is coming
        while chunk := c.recv(1 << 16):
            out += chunk
    except OSError:
        pass  # reset, or closed before our shutdown (ENOTCONN)
    return out


def _hello(doc: bytes, mac: bytes = bytes(32)) -> bytes:
    return secrets.token_bytes(32) + struct.pack("!I", len(doc)) + doc + mac


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(range(256)) * 3,
        secrets.token_bytes(32) + b"\xff\xff\xff\xff",  # a 4 GiB handshake document
        _hello(b"not json at all"),
        _hello(b"[1, 2, 3]"),
        _hello(b'{"hosts": ["127.0.0.1"], "session": "s"}'),  # without the key's MAC
        secrets.token_bytes(10),  # cut short
    ],
    ids=["http", "bytes", "huge-length", "not-json", "not-an-object", "wrong-mac", "short"],
)
def test_garbage_before_the_handshake_is_refused_and_the_gateway_serves_on(
    server: GatewayServer, garbage: bytes, thread_errors: list[BaseException]
) -> None:
    with socket.create_connection(server.addr[:2], timeout=20) as c:
        assert c.recv(len(b"MNBGW2\n") + 32).startswith(b"MNBGW2\n")
        c.sendall(garbage)
        assert _until_closed(c) == b""  # closed without a word: no session, no reply address
    assert server.tunnels == 0 and not server.sessions
    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: "")
    try:
        _works(gw)
    finally:
        gw.close()
    assert not thread_errors


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00",  # SOCKS4
        b"\x05\x01\x00",  # no authentication offered
        b"\x05\x00",  # no method at all
        bytes(range(256)),
        "auth+\x05\x01\x00\x03\x04\xff\xfe\xfd\xfc\x00\x50",  # a host name that is not UTF-8
        "auth+\x05\x02\x00\x01\x7f\x00\x00\x01\x00\x50",  # BIND, not CONNECT
        "auth+\x05\x01\x00\x09",  # an unknown address type, cut short
    ],
    ids=["socks4", "no-auth", "no-method", "bytes", "host-not-utf8", "bind", "bad-atyp"],
)
def test_garbage_on_the_socks_end_is_refused_and_it_serves_on(
    server: GatewayServer, garbage: bytes | str, thread_errors: list[BaseException]
) -> None:
    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: "")
    try:
        h, p = gw.proxy.rsplit(":", 1)
        with socket.create_connection((h, int(p)), timeout=20) as c:
            if isinstance(garbage, str):
                c.sendall(b"\x05\x01\x02")
                assert c.recv(2) == b"\x05\x02"
                c.sendall(bytes([1, 16]) + gw.username.encode() + bytes([32]) + gw.password.encode())
                assert c.recv(2) == b"\x01\x00"
                garbage = garbage.removeprefix("auth+").encode("latin-1")
            c.sendall(garbage)
            answer = _until_closed(c)
            assert len(answer) < 64 and (not answer or answer[1] != 0), answer  # never "connected"
        _works(gw)
    finally:
        gw.close()
    assert not thread_errors


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("!BIQI", 4, 1, 0, 1 << 30),  # DATA of 1 GiB
        struct.pack("!BIQI", 1, 7, 0, 4) + b"\xff\xfe:1",  # OPEN to an address that is not UTF-8
    ],
    ids=["huge-frame", "open-not-utf8"],
)
def test_a_tunnel_that_speaks_out_of_turn_is_closed_and_the_next_resumes(
    server: GatewayServer,
    link: tuple[GatewayClient, socket.socket, socket.socket],
    frame: bytes,
    thread_errors: list[BaseException],
) -> None:
    # an authenticated end that sends a frame no monarch_nb sends (a bug, a corrupted stream):
    # the gateway closes that tunnel instead of sizing a buffer by it or losing its reader,
    # and the streams go on over the next one
    gw, s, conn = link
    first = gw.mux
    with first.wlock:
        first.tunnel.sendall(frame)
    assert first.closed.wait(20)
    s.sendall(b"after")
    assert conn.recv(5) == b"after"
    assert server.tunnels == 2
    assert not thread_errors


def _fake_gateway(answer: Callable[[bytes, bytes], bytes]) -> tuple[socket.socket, threading.Thread]:
    """A gateway that holds the key and answers the handshake with ``answer(nonce_c, nonce_s)``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            nonce_s = secrets.token_bytes(32)
            c.sendall(b"MNBGW2\n" + nonce_s)
            nonce_c = c.recv(32)
            c.sendall(answer(nonce_c, nonce_s))
            c.recv(1 << 16)

    t = threading.Thread(target=serve)
    t.start()
    return srv, t


@pytest.mark.parametrize(
    ("doc", "says"),
    [(b'"a string"', "not a JSON object"), (b'{"reverse": 5}', "gave no reply address"), (b"{]", "not a JSON object")],
    ids=["string", "no-reverse", "not-json"],
)
def test_a_malformed_answer_from_the_gateway_is_named(doc: bytes, says: str) -> None:
    from monarch_nb._runtime.gateway import _mac

    srv, t = _fake_gateway(lambda nc, ns: struct.pack("!I", len(doc)) + doc + _mac(KEY, b"server", nc, ns, doc))
    try:
        with pytest.raises(GatewayError, match=says):
            GatewayClient(lambda: socket.create_connection(srv.getsockname(), timeout=10), KEY, ["127.0.0.1"], lambda: "")
    finally:
        t.join(10)
        srv.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as uid 65534")
def test_silent_connections_to_the_socks_end_hold_a_bounded_number_of_threads(server: GatewayServer) -> None:
    """The controller's SOCKS5 end listens on 127.0.0.1, where every local user can connect: each
    connection took a thread (and a descriptor) of the notebook's kernel for up to 15 s a byte,
    with no bound, so a stranger could fill the kernel with threads until its own code found
    none to start. Past SOCKS_GREETING_MAX the oldest negotiation is cut, and the
    controller's own streams still open during the flood."""
    from monarch_nb._runtime.gateway import SOCKS_GREETING_MAX

    gw = GatewayClient(_tunnel(server), KEY, ["127.0.0.1"], lambda: "")
    host, port = gw.proxy.rsplit(":", 1)
    try:
        holder, opened = hold_silent_as_nobody(host, port, 300)
    except BaseException:
        gw.close()
        raise
    try:
        assert opened == 300

        def negotiating() -> int:
            return sum(t.name == "gateway-socks-conn" for t in threading.enumerate())

        # a cut negotiation's thread ends a moment after its socket is shut; unbounded, 300 stay
        wait_for(lambda: negotiating() <= SOCKS_GREETING_MAX, 10, f"at most {SOCKS_GREETING_MAX} threads negotiating")
        _works(gw)
        assert gw.refusals.count >= 300 - SOCKS_GREETING_MAX
    finally:
        holder.kill()
        holder.wait()
        gw.close()
