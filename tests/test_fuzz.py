"""A fuzzer for every socket a real allocator, proc and controller listen on (issue 15).

Malformed, truncated, oversized and replayed frames go into each entry point; after each case
a normal call through the same processes must still work, no process dies, none grows past a
bound. A test lists the listening sockets of those processes and fails on one that has no fuzz
case here; from uid 65534 every entry point gets a frame whose pickle would create a file.

Derandomized (the same examples on every run) and bounded: a few hundred cases in all.
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import secrets
import select
import shutil
import socket
import struct
import subprocess
import textwrap
import time
import urllib.parse
from typing import Any

import _inotify
import psutil
import pytest
import zmq
from _nobody import NOBODY, run_as_nobody
from conftest import PY, AllocatorProc, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_nb._runtime import _dataplane as dp
from monarch_nb._wire import frames as wire
from monarch_nb._wire.keys import curve_keypair, generate_key, read_key_file, write_key_file

pytestmark = pytest.mark.timeout(300)

#: every process of these tests gets this limit, so an "oversized" frame is cheap to make
MAX_BYTES = 1 << 20
#: (a heartbeat timeout of 10 s: the allocator detaches a controller silent for 3 of them. On CI's
#: 2 CPUs the fuzzing of the controller's own entry points once held its pings past the default's
#: 6 s; it was detached and its mesh stopped, which is not what these tests check)
ENV = {
    "MONARCH_NB_ZYGOTE_PRELOAD": "",
    "MONARCH_NB_MAX_MESSAGE_BYTES": str(MAX_BYTES),
    "MONARCH_NB_KEY_FILE": "",
    "MONARCH_NB_HEARTBEAT_TIMEOUT": "10",
}
#: how much a process may grow over the whole fuzz run
RSS_BOUND = 64 << 20
FUZZ = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: each kind of listening socket, and the test that fuzzes it
FUZZED_BY = {
    "zmq-ipc": "test_fuzz_zmq_ipc_inbox",
    "fast": "test_fuzz_fast_path",
    "zmq-tcp": "test_fuzz_tcp_wrong_key + test_fuzz_tcp_right_key_garbage",
    "dataplane-unix": "test_fuzz_dataplane",
    "dataplane-tcp": "test_fuzz_dataplane",
}
# Not listeners, so not here: the zygote's request socket is one end of a socketpair made before
# the zygote forks (nothing can connect to it); the REST handlers listen in the Jupyter server
# (test_fuzz_rest_handlers).

_CONTROLLER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    from monarch_nb.actor import Actor, _context, attach_to_workers, endpoint
    from monarch_nb.rdma import RDMABuffer
    from monarch_nb._runtime import _dataplane as dp

    class Target(Actor):
        def __init__(self):
            self.data = bytearray(b"fuzz" * 256)

        @endpoint
        def echo(self, x):
            return x

        @endpoint
        def info(self):
            self.buf = RDMABuffer(memoryview(self.data))  # starts this proc's data server
            rt = _context.runtime()
            s = dp.local_server()
            return {"pid": os.getpid(), "ipc": rt.ipc_addr, "tcp": rt.tcp_addr, "dp_unix": s.unix, "dp_tcp": s.tcp}, self.buf

        @endpoint
        def pull(self, buf):
            dst = bytearray(1024)
            buf.read_into(memoryview(dst)).get(timeout=20)
            return bytes(dst)

    alloc = sys.argv[1]
    hosts = attach_to_workers(workers=[alloc], key_file=sys.argv[2])
    procs = hosts.spawn_procs(per_host={"gpus": 1}, name="fuzzed")
    t = procs.spawn("t", Target)
    pinfo, pbuf = t.info.call_one().get(timeout=60)
    mine = bytearray(b"ctrl" * 256)
    cbuf = RDMABuffer(memoryview(mine))
    rt = _context.runtime()
    s = dp.local_server()
    me = {"pid": os.getpid(), "ipc": rt.ipc_addr, "tcp": rt.tcp_addr, "dp_unix": s.unix, "dp_tcp": s.tcp}
    print(json.dumps({"proc": pinfo, "controller": me}), flush=True)
    n = 0
    for line in sys.stdin:
        if line.strip() != "check":
            break
        n += 1
        try:
            assert t.echo.call_one(n).get(timeout=20) == n
            assert _context.client().request(alloc, "status").get(timeout=20)["host"]
            dst = bytearray(1024)
            pbuf.read_into(memoryview(dst)).get(timeout=20)
            assert dst == b"fuzz" * 256
            assert t.pull.call_one(cbuf).get(timeout=20) == b"ctrl" * 256
            print("ok", n, flush=True)
        except BaseException as e:
            print("failed", repr(e), flush=True)
    procs.stop().get(timeout=30)
    """
)


class Cluster:
    """A real allocator (ipc + authenticated loopback TCP), one proc, and a controller process."""

    def __init__(self, tmp: str) -> None:
        self.keydir = tempfile_dir()
        self.keyfile = os.path.join(self.keydir, "cluster.key")
        write_key_file(self.keyfile)
        self.key = read_key_file(self.keyfile)
        self.alloc = AllocatorProc(tmp, "--bind", "tcp://127.0.0.1:0", "--key-file", self.keyfile, env=ENV)
        env = {k: v for k, v in self.alloc.env.items() if k != "PYTHONUNBUFFERED"}
        # a file, not a pipe: the controller logs every frame it drops, and a full pipe would stop it
        self.ctl_log = os.path.join(self.alloc.rdir, "controller.log")
        with open(self.ctl_log, "wb") as err:
            self.ctl = subprocess.Popen(
                [PY, "-c", _CONTROLLER, self.alloc.info["tcp"], self.keyfile],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        try:
            line = self._line(90)
            info = json.loads(line)
        except BaseException:
            self.stop()
            raise
        self.proc, self.controller = info["proc"], info["controller"]
        self.allocator = {"pid": self.alloc.proc.pid, "ipc": self.alloc.addr, "tcp": self.alloc.info["tcp"]}
        self.pids = {"allocator": self.alloc.proc.pid, "proc": self.proc["pid"], "controller": self.ctl.pid}
        self.checks = 0
        self.check()
        self.rss0 = {name: psutil.Process(pid).memory_info().rss for name, pid in self.pids.items()}

    def _line(self, timeout: float) -> str:
        assert self.ctl.stdout is not None
        r, _, _ = select.select([self.ctl.stdout], [], [], timeout)
        if not r:
            raise AssertionError(f"the controller said nothing in {timeout} s")
        line = self.ctl.stdout.readline()
        if not line:
            with open(self.ctl_log, errors="replace") as f:
                err = f.read()
            raise AssertionError(f"the controller exited ({self.ctl.poll()}): {err[-3000:]}")
        return line

    def check(self) -> None:
        """A normal call through every process (and both data servers) still works."""
        assert self.ctl.stdin is not None
        self.ctl.stdin.write("check\n")
        self.ctl.stdin.flush()
        self.checks += 1
        line = self._line(60)
        assert line.split()[:2] == ["ok", str(self.checks)], line
        for name, pid in self.pids.items():
            assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE, f"the {name} died"

    def assert_bounded(self) -> None:
        for name, pid in self.pids.items():
            try:
                grown = psutil.Process(pid).memory_info().rss - self.rss0[name]
            except psutil.NoSuchProcess:
                # every fuzz case was followed by a check that all of them lived; after the last
                # one, only the daemon must still be there (a proc may have been reaped with its
                # controller's mesh)
                assert name != "allocator", "the allocator died after the last fuzz case"
                continue
            assert grown < RSS_BOUND, f"the {name} grew by {grown >> 20} MiB under fuzzing"

    def targets(self) -> dict[str, dict[str, Any]]:
        return {"allocator": self.allocator, "proc": self.proc, "controller": self.controller}

    def stop(self) -> None:
        if self.ctl.poll() is None:
            try:
                self.ctl.stdin.write("quit\n")  # type: ignore[union-attr]
                self.ctl.stdin.flush()  # type: ignore[union-attr]
                self.ctl.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.ctl.kill()
                self.ctl.wait()
        self.alloc.stop()
        shutil.rmtree(self.keydir, ignore_errors=True)


def tempfile_dir() -> str:
    import tempfile

    d = tempfile.mkdtemp(prefix="mnbf-", dir="/tmp")
    os.chmod(d, 0o711)  # uid 65534 may run its client from here, never read the key
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = Cluster(str(tmp_path_factory.mktemp("fuzz")))
    yield c
    try:
        c.assert_bounded()
    finally:
        c.stop()


# ---------------------------------------------------------------- what the fuzzer sends


def _actor_frame(actor: str, method: str, stream: str = "", seq: int = 0, body: bytes = b"", reply: str = "") -> bytes:
    meta = (actor, method, reply, 7, 0, ((), ()), "fuzz", stream, seq)
    return wire.encode(wire.ACTOR, meta, body or pickle.dumps(((), {})))[0]


VALID = [
    _actor_frame("__allocator__", "status"),
    _actor_frame("no-such-actor", "nothing"),
    wire.encode(wire.PORT, (987654, 0, wire.OK), pickle.dumps(None))[0],
    wire.encode(wire.PORT, (1, 0, wire.ERROR), b"\x80\x05not a pickle")[0],
    wire.encode(wire.FANOUT, ("a", "m", 1, ((), ()), "c", (("ipc:///nowhere", 0, "", "", 0),)), b"")[0],
    wire.refusal("fuzz"),
]


SYSTEM_ACTORS = ["__allocator__", "__sys__", "t", "no-such-actor"]
#: system methods a stranger's arguments could not make do harm (not shutdown, stop, spawn, interrupt...)
SAFE_METHODS = [
    "status",
    "ping",
    "hello",
    "logs",
    "state",
    "lookup",
    "env",
    "source",
    "subscribe",
    "stream_logs",
    "debug_list",
    "flush_logs",
    "set_log_level",
    "sync_missing",
    "echo",
    "no_such_method",
    "__init__",
    "",
]
#: where a fuzzed request asks for its answer: nowhere, nothing listening, nothing reachable. A
#: small fixed set: a daemon keeps a socket (an fd) per address it answered until it has been
#: unused for peer_idle_close (test_security checks that bound), longer than a fuzz run
REPLY_ADDRS = ["", "ipc:///nonexistent/mnb-x.sock", "tcp://127.0.0.1:9", "not an address"]
#: bodies of the wrong shape: not a pickle, or not an ``(args, kwargs)`` pair that fits
bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([None, (), (1, 2, 3), ((), "kwargs"), (("x",) * 5, {}), ((), {"nope": 1}), ((-1,), {}), (("..",), {})]).map(
        lambda v: pickle.dumps(v, protocol=5)
    ),
)


@st.composite
def mutated(draw: Any) -> bytes:
    """A valid frame, truncated, with bytes changed, or with bytes inserted."""
    f = bytearray(draw(st.sampled_from(VALID)))
    how = draw(st.sampled_from(["truncate", "flip", "insert", "header", "port", "system"]))
    if how == "port":  # a value for a port that may be open (a pending call's, a log subscription's)
        meta = (draw(st.integers(0, 8)), draw(st.integers(-1, 3)), draw(st.integers(0, 5)))
        return wire.encode(wire.PORT, meta, draw(bodies))[0]
    if how == "system":  # a request for a system actor, its arguments of the wrong shape
        stream, seq = draw(st.sampled_from([("", 0), ("fuzz-sys", 1), ("fuzz-sys", 2**40)]))
        reply = draw(st.sampled_from(REPLY_ADDRS))
        return _actor_frame(
            draw(st.sampled_from(SYSTEM_ACTORS)), draw(st.sampled_from(SAFE_METHODS)), stream, seq, draw(bodies), reply
        )
    if how == "truncate":
        return bytes(f[: draw(st.integers(0, len(f)))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            f[draw(st.integers(0, len(f) - 1))] = draw(st.integers(0, 255))
        return bytes(f)
    if how == "insert":
        at = draw(st.integers(0, len(f)))
        return bytes(f[:at]) + draw(st.binary(min_size=1, max_size=64)) + bytes(f[at:])
    # a header of any version/kind/flags/meta length over whatever meta follows
    head = wire.MAGIC + bytes([draw(st.integers(0, 5)), draw(st.integers(0, 6)), draw(st.integers(0, 7))])
    return head + struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + draw(st.binary(max_size=128))


frame = st.one_of(st.binary(max_size=256), mutated())
message = st.lists(st.one_of(frame, st.binary(max_size=64)), min_size=1, max_size=4)


def _replay(sendmsg: Any) -> None:
    """An ordered message, sent twice (the second is a replay), then one far ahead of its stream."""
    stream = "fuzz-" + secrets.token_hex(4)
    m = _actor_frame("__allocator__", "status", stream, 1)
    sendmsg([m])
    sendmsg([m])
    sendmsg([_actor_frame("__allocator__", "status", stream, 10**9)])


def _zmq_dealer(ctx: zmq.Context, addr: str, server_key: bytes | None = None, client_key: bytes | None = None) -> zmq.Socket:
    """A DEALER to ``addr``; over TCP it speaks CurveZMQ to the server of ``server_key`` holding ``client_key``."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndtimeo = 2000
    if server_key is not None:
        s.curve_serverkey = curve_keypair(server_key)[0]
        s.curve_publickey, s.curve_secretkey = curve_keypair(client_key or server_key)
    s.connect(addr)
    return s


# ---------------------------------------------------------------- zmq inboxes
# ---------------------------------------------------------------- zmq inboxes

TARGETS = st.sampled_from(["allocator", "proc", "controller"])


class _Zmq:
    """The fuzzer's zmq context, and one connection per inbox for the whole run."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.dealers: dict[str, zmq.Socket] = {}

    def dealer(self, addr: str, key: bytes | None = None) -> zmq.Socket:
        s = self.dealers.get(addr)
        if s is None:
            s = self.dealers[addr] = _zmq_dealer(self.ctx, addr, key)
        return s


@pytest.fixture(scope="module")
def zctx():  # type: ignore[no-untyped-def]
    z = _Zmq()
    yield z
    z.ctx.destroy(linger=0)


@FUZZ
@given(target=TARGETS, msg=message)
def test_fuzz_zmq_ipc_inbox(cluster, zctx, target: str, msg: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    zctx.dealer(cluster.targets()[target]["ipc"]).send_multipart(msg)
    cluster.check()


@pytest.mark.parametrize("target", ["allocator", "proc", "controller"])
def test_zmq_ipc_oversized_and_replayed(cluster, zctx, target: str) -> None:  # type: ignore[no-untyped-def]
    addr = cluster.targets()[target]["ipc"]
    s = _zmq_dealer(zctx.ctx, addr)
    try:
        s.send_multipart([VALID[0][:16], b"x" * (MAX_BYTES + 1)])  # over the limit: zmq drops the peer
        _replay(zctx.dealer(addr).send_multipart)
    finally:
        s.close(linger=2000)
    cluster.check()
    if target == "allocator":
        wait_for(lambda: "already delivered (a replay?)" in cluster.alloc.logtext(), 10, "the allocator to drop the replay")


def _tcp_targets(cluster: Cluster) -> list[str]:
    return [name for name, t in cluster.targets().items() if t["tcp"]]


def _wait_handshake_end(mon: zmq.Socket, timeout: float = 5.0) -> int:
    """Wait on a client's monitor until its handshake failed or the server hung up (the event, or 0)."""
    from zmq.utils.monitor import recv_monitor_message

    ends = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if mon.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
            ev = recv_monitor_message(mon)["event"]
            if ev in ends:
                return int(ev)
    return 0


@settings(FUZZ, max_examples=30)
@given(data=st.data(), msg=message)
def test_fuzz_tcp_wrong_key(cluster, zctx, data, msg: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    target = data.draw(st.sampled_from(_tcp_targets(cluster)))
    addr = cluster.targets()[target]["tcp"]
    s = zctx.ctx.socket(zmq.DEALER)
    s.curve_serverkey = curve_keypair(cluster.key)[0]  # the server's public key is no secret
    s.curve_publickey, s.curve_secretkey = curve_keypair(generate_key())
    mon = s.get_monitor_socket()  # before connecting: the handshake's end is not missed
    tag = secrets.token_hex(4)  # the 8 bytes a dropped frame's log line quotes
    marker = os.path.join(cluster.keydir, f"wrong-key-{tag}")
    try:
        s.connect(addr)
        s.send_multipart([tag.encode()], zmq.NOBLOCK)  # logged by name if it were ever decoded
        s.send_multipart([evil_frames(marker), *msg], zmq.NOBLOCK)
        assert _wait_handshake_end(mon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH, f"{target}'s TCP inbox took a stranger's key"
    finally:
        s.disable_monitor()
        mon.close(linger=0)
        s.close(linger=0)
    cluster.check()
    assert not os.path.exists(marker) and not os.path.exists(marker + "-body")
    # the allocator's log, and the controller's (which also shows the proc's): never decoded
    assert tag not in cluster.alloc.logtext()
    with open(cluster.ctl_log, errors="replace") as f:
        assert tag not in f.read()


@settings(FUZZ, max_examples=40)
@given(data=st.data(), raw=st.binary(min_size=1, max_size=512))
def test_fuzz_tcp_not_zmtp(cluster, data, raw: bytes) -> None:  # type: ignore[no-untyped-def]
    """Bytes that are not even ZMTP, on every TCP listener (zmq inboxes and data servers)."""
    addrs = [t["tcp"][len("tcp://") :] for t in cluster.targets().values() if t["tcp"]]
    addrs += [t["dp_tcp"] for t in cluster.targets().values() if t.get("dp_tcp")]
    host, port = data.draw(st.sampled_from(addrs)).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(raw)
        except OSError:
            pass  # the server hung up first
    cluster.check()


@FUZZ
@given(data=st.data(), msg=message)
def test_fuzz_tcp_right_key_garbage(cluster, zctx, data, msg: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    target = data.draw(st.sampled_from(_tcp_targets(cluster)))
    zctx.dealer(cluster.targets()[target]["tcp"], cluster.key).send_multipart(msg)
    cluster.check()


def test_tcp_right_key_oversized_and_replayed(cluster, zctx) -> None:  # type: ignore[no-untyped-def]
    for target in _tcp_targets(cluster):
        addr = cluster.targets()[target]["tcp"]
        s = _zmq_dealer(zctx.ctx, addr, cluster.key)
        try:
            s.send_multipart([VALID[0][:16], b"x" * (MAX_BYTES + 1)])
            _replay(zctx.dealer(addr, cluster.key).send_multipart)
        finally:
            s.close(linger=2000)
        cluster.check()


# ---------------------------------------------------------------- the direct path


def _fast_conn(ipc: str) -> socket.socket:
    from monarch_nb._runtime import fastpath

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(fastpath.path_for(ipc))
    greeting = b""
    while len(greeting) < 4:
        b = s.recv(4 - len(greeting))
        assert b, "the direct socket hung up before greeting"
        greeting += b
    assert greeting == wire.MAGIC + bytes([wire.VERSION])
    return s


def _framed(frames: list[bytes]) -> bytes:
    return struct.pack(f"<B{len(frames)}I", len(frames), *map(len, frames)) + b"".join(frames)


@st.composite
def fast_payload(draw: Any) -> bytes:
    how = draw(st.sampled_from(["message", "raw", "truncated", "lengths", "several"]))
    if how == "message":
        return _framed(draw(message))
    if how == "raw":
        return draw(st.binary(min_size=1, max_size=512))
    if how == "truncated":
        m = _framed(draw(message))
        return m[: draw(st.integers(0, len(m) - 1))]
    if how == "lengths":  # any count and lengths (over the limit, zero frames, frames left unfinished)
        n = draw(st.one_of(st.integers(0, 3), st.integers(0, 255)))
        length = st.one_of(st.integers(0, 300), st.integers(0, MAX_BYTES), st.integers(0, 2**32 - 1))
        lens = draw(st.lists(length, min_size=n, max_size=n))
        return struct.pack(f"<B{n}I", n, *lens) + draw(st.binary(max_size=64))
    return b"".join(_framed(m) for m in draw(st.lists(message, min_size=2, max_size=4)))


@FUZZ
@given(target=TARGETS, payload=fast_payload())
def test_fuzz_fast_path(cluster, target: str, payload: bytes) -> None:  # type: ignore[no-untyped-def]
    with _fast_conn(cluster.targets()[target]["ipc"]) as s:
        try:
            s.sendall(payload)
        except OSError:
            pass  # the receiver dropped the connection (a message over the limit)
    cluster.check()


@pytest.mark.parametrize("target", ["allocator", "proc", "controller"])
def test_fast_path_oversized_and_replayed(cluster, target: str) -> None:  # type: ignore[no-untyped-def]
    ipc = cluster.targets()[target]["ipc"]
    with _fast_conn(ipc) as s:
        try:  # really over the limit, not just announced so
            s.sendall(_framed([VALID[0][:16], b"x" * (MAX_BYTES + 1)]))
        except OSError:
            pass
    with _fast_conn(ipc) as s:
        _replay(lambda frames: s.sendall(_framed(frames)))
    cluster.check()
    if target == "allocator":
        wait_for(
            lambda: "dropped a direct connection to allocator" in cluster.alloc.logtext(), 10, "the oversized message dropped"
        )


# ---------------------------------------------------------------- the data plane


def _dp_unix(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(name)
    return s


@st.composite
def dp_request(draw: Any) -> bytes:
    how = draw(st.sampled_from(["raw", "request", "requests"]))
    if how == "raw":
        return draw(st.binary(min_size=1, max_size=256))
    reqs = []
    for _ in range(1 if how == "request" else draw(st.integers(2, 4))):
        op = draw(st.sampled_from([dp.OP_READ, dp.OP_WRITE, dp.OP_DROP, 0, 255]))
        off = draw(st.sampled_from([0, 1, 1023, 1024, 2**63, 2**64 - 1]))
        n = draw(st.sampled_from([0, 1, 1024, 1 << 20, 2**64 - 1]))
        reqs.append(dp._REQ.pack(op, draw(st.binary(min_size=16, max_size=16)), off, n) + draw(st.binary(max_size=32)))
    return b"".join(reqs)


@FUZZ
@given(data=st.data(), payload=dp_request())
def test_fuzz_dataplane(cluster, data, payload: bytes) -> None:  # type: ignore[no-untyped-def]
    """Requests into both data servers (proc, controller): on the unix socket, and on TCP as
    bytes before the handshake, a wrong key's proof, and records after a right-key handshake."""
    target = data.draw(st.sampled_from(["proc", "controller"]))
    t = cluster.targets()[target]
    ways = ["unix"] + (["tcp-raw", "tcp-wrong-key", "tcp-sealed"] if t["dp_tcp"] else [])
    way = data.draw(st.sampled_from(ways))
    if way == "unix":
        s = _dp_unix(t["dp_unix"])
    else:
        host, port = t["dp_tcp"].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    with s:
        try:
            if way == "tcp-wrong-key":  # a hello, then a proof made without the key, then a request
                s.sendall(dp._MAGIC + secrets.token_bytes(dp._NONCE))
                got = b""
                while len(got) < dp._NONCE + 32 and (b := s.recv(dp._NONCE + 32 - len(got))):
                    got += b
                s.sendall(secrets.token_bytes(32) + payload)
                s.settimeout(5)
                assert s.recv(100) == b"", "the data server answered a peer without the key"
            elif way == "tcp-sealed":
                ch = dp._client_handshake(s, cluster.key)
                if data.draw(st.booleans()):
                    ch.send(payload)  # well-sealed garbage requests
                else:
                    s.sendall(struct.pack("!I", len(payload) + 16) + payload + bytes(16))  # forged records
            else:
                s.sendall(payload)
        except OSError:
            pass
    cluster.check()


# ---------------------------------------------------------------- every listener has a case


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[len("socket:[") : -1]))
    return out


def listeners(pid: int) -> list[tuple[str, str]]:
    """``(protocol, address)`` of every socket ``pid`` listens on (or, for UDP, is bound to)."""
    out = []
    for c in psutil.Process(pid).net_connections(kind="inet"):
        if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
            out.append(("tcp", f"{c.laddr.ip}:{c.laddr.port}"))
        elif c.type == socket.SOCK_DGRAM and c.laddr:
            out.append(("udp", f"{c.laddr.ip}:{c.laddr.port}"))
    mine = _socket_inodes(pid)
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            accepting = int(fields[3], 16) & 0x10000  # __SO_ACCEPTCON: listen() was called
            if accepting and int(fields[6]) in mine:
                out.append(("unix", fields[7] if len(fields) > 7 else ""))
    return out


def classify(proto: str, addr: str, info: dict[str, Any]) -> str | None:
    """The kind of a listener of the process ``info`` describes (None: one nobody fuzzes)."""
    ipc = info["ipc"][len("ipc://") :]
    if proto == "unix":
        if addr == ipc:
            return "zmq-ipc"
        if addr == ipc[: -len(".sock")] + ".fast":
            return "fast"
        if info.get("dp_unix") and addr == "@" + info["dp_unix"][1:]:
            return "dataplane-unix"
    if proto == "tcp":
        if info["tcp"] and addr == info["tcp"][len("tcp://") :]:
            return "zmq-tcp"
        if info.get("dp_tcp") and addr == info["dp_tcp"]:
            return "dataplane-tcp"
    return None


def test_every_listening_socket_has_a_fuzz_case(cluster) -> None:  # type: ignore[no-untyped-def]
    alloc = psutil.Process(cluster.pids["allocator"])
    zygotes = [p for p in alloc.children(recursive=True) if p.pid != cluster.pids["proc"]]
    procs: dict[str, tuple[int, dict[str, Any]]] = {name: (t["pid"], t) for name, t in cluster.targets().items()}
    for z in zygotes:  # the zygote (and anything else the allocator runs) must listen on nothing
        procs[f"allocator's child {z.pid} {z.name()}"] = (z.pid, {"ipc": "ipc://-", "tcp": ""})
    unfuzzed = []
    seen: dict[str, set[str]] = {}
    for name, (pid, info) in procs.items():
        for proto, addr in listeners(pid):
            kind = classify(proto, addr, info)
            if kind is None or kind not in FUZZED_BY:
                unfuzzed.append(f"{name} (pid {pid}) listens on {proto} {addr!r} and no test here fuzzes it")
            else:
                seen.setdefault(name, set()).add(kind)
    assert not unfuzzed, "\n".join(unfuzzed)
    # and what the fuzz tests send to was found listening (the enumeration sees them)
    assert seen["allocator"] >= {"zmq-ipc", "fast", "zmq-tcp"}, seen
    assert seen["proc"] >= {"zmq-ipc", "fast", "dataplane-unix"}, seen
    assert seen["controller"] >= {"zmq-ipc", "fast", "dataplane-unix"}, seen


# ---------------------------------------------------------------- uid 65534


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


def evil_frames(marker: str) -> bytes:
    """An ACTOR frame whose meta, and whose body, would each create ``marker`` once unpickled."""
    meta = pickle.dumps(_Exploit(marker), protocol=5)
    body = pickle.dumps(_Exploit(marker + "-body"), protocol=5)
    head = wire.MAGIC + bytes([wire.VERSION, wire.ACTOR, wire.INLINE]) + len(meta).to_bytes(4, "little") + meta
    return head + body


#: a client in the standard library only (what any local user can run) for each kind of entry
#: point: it sends the frame the way that socket expects it, and reports how far it got
_NOBODY_CLIENT = r"""
import os, socket, struct, sys
kind, addr, frame = sys.argv[1], bytes.fromhex(sys.argv[2]).decode(), bytes.fromhex(sys.argv[3])
def recv_exactly(s, n):
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionResetError("hung up")
        out += b
    return out
def zframe(flags, body):
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
try:
    if kind.endswith("tcp"):
        host, port = addr.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(addr)
except OSError as e:
    print("refused at connect:", e)
    sys.exit(0)
try:
    if kind.startswith("zmq"):  # ZMTP 3.0, NULL mechanism (no key)
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32))
        recv_exactly(s, 64)
        props = bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(zframe(4, bytes([5]) + b"READY" + props))
        s.sendall(zframe(0, frame))
    elif kind == "fast":
        recv_exactly(s, 4)
        s.sendall(b"\x01" + len(frame).to_bytes(4, "little") + frame)
    elif kind == "dataplane-tcp":
        s.sendall(b"MNBDP1" + os.urandom(32))
        recv_exactly(s, 64)
        s.sendall(frame)
    else:
        s.sendall(frame)
    while s.recv(4096):
        pass
    print("sent; the server hung up")
except OSError as e:
    print("sent or refused:", e)
"""


def entry_points(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(process, kind, address) of every entry point, as a stranger would dial it."""
    out = []
    for name, t in cluster.targets().items():
        ipc = t["ipc"][len("ipc://") :]
        out += [(name, "zmq-ipc", ipc), (name, "fast", ipc[: -len(".sock")] + ".fast")]
        if t["tcp"]:
            out.append((name, "zmq-tcp", t["tcp"][len("tcp://") :]))
        if t.get("dp_unix"):
            out.append((name, "dataplane-unix", t["dp_unix"]))
        if t.get("dp_tcp"):
            out.append((name, "dataplane-tcp", t["dp_tcp"]))
    return out


def _as_nobody(kind: str, addr: str, frame: bytes) -> str:
    return run_as_nobody(_NOBODY_CLIENT, kind, addr.encode().hex(), frame.hex()).strip()


def _assert_none_made(markers: list[str], outcomes: list[str], seconds: float = 2.0) -> None:
    _inotify.assert_none_appear(markers, seconds, "\n".join(outcomes) + f"\na frame from uid {NOBODY} ran code")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send frames as uid 65534")
def test_no_entry_point_runs_a_strangers_pickle(cluster) -> None:  # type: ignore[no-untyped-def]
    markers = []
    outcomes = []
    for name, kind, addr in entry_points(cluster):
        marker = os.path.join(cluster.keydir, f"pwned-{name}-{kind}")
        markers += [marker, marker + "-body"]
        outcomes.append(f"{name} {kind}: {_as_nobody(kind, addr, evil_frames(marker))}")
    cluster.check()  # every process took its frames (or refused them) and still answers
    _assert_none_made(markers, outcomes)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send frames as uid 65534")
def test_direct_path_checks_the_peer_uid_behind_the_file_mode(cluster) -> None:  # type: ignore[no-untyped-def]
    """The ipc sockets' first defence is the 0700 runtime directory (above, uid 65534 cannot even
    connect). The direct path also checks the peer's uid: open the directory and the direct
    sockets to everyone for a moment, and a stranger's frame is still refused unread."""
    rdir = cluster.alloc.rdir
    fast = [(name, addr) for name, kind, addr in entry_points(cluster) if kind == "fast"]
    dir_mode = os.stat(rdir).st_mode & 0o777
    # each live process serves its direct socket until it exits; once (CI, 36678a3) one was gone
    gone = [f"{name} ({addr})" for name, addr in fast if not os.path.exists(addr)]
    assert not gone, f"direct sockets gone: {gone}; {sorted(os.listdir(rdir))}; allocator log:\n{cluster.alloc.logtext()[-3000:]}"
    modes = {addr: os.stat(addr).st_mode & 0o777 for _, addr in fast}
    markers, outcomes = [], []
    try:
        os.chmod(rdir, 0o711)
        for name, addr in fast:
            os.chmod(addr, 0o666)
            marker = os.path.join(cluster.keydir, f"pwned-{name}-open-fast")
            markers += [marker, marker + "-body"]
            outcomes.append(f"{name}: {_as_nobody('fast', addr, evil_frames(marker))}")
    finally:
        os.chmod(rdir, dir_mode)
        for addr, mode in modes.items():
            os.chmod(addr, mode)
    assert not [o for o in outcomes if "refused at connect" in o], outcomes  # the check was reached
    wait_for(lambda: f"refused a direct connection from uid {NOBODY}" in cluster.alloc.logtext(), 10, "the refusal logged")
    cluster.check()
    _assert_none_made(markers, outcomes)


# ---------------------------------------------------------------- the sidebar's REST handlers


@pytest.fixture(scope="module")
def jserver():  # type: ignore[no-untyped-def]
    from _jupyter import JupyterServer

    s = JupyterServer("server")
    rss0 = psutil.Process(s.proc.pid).memory_info().rss
    yield s
    try:
        grown = psutil.Process(s.proc.pid).memory_info().rss - rss0
        assert grown < RSS_BOUND, f"the Jupyter server grew by {grown >> 20} MiB under fuzzing"
    finally:
        s.stop()


def _raw_request(base: str, method: str, path: str, body: bytes | None, token: str) -> int:
    u = urllib.parse.urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        headers = {"Authorization": f"token {token}"} if token else {}
        if body is not None:
            headers["Content-Type"] = "application/json"
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


_segment = st.text(min_size=1, max_size=40).map(lambda t: urllib.parse.quote(t, safe=""))


@st.composite
def rest_case(draw: Any) -> tuple[str, str, bytes | None]:
    name = draw(st.one_of(_segment, st.sampled_from(["..", "%2e%2e", "a%2Fb", "%00", "demo"])))
    which = draw(st.sampled_from(["state", "stop", "log"]))
    if which == "state":
        path, method = "state", draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    elif which == "stop":
        path, method = f"meshes/{name}/stop", draw(st.sampled_from(["POST", "GET"]))
    else:
        rank = draw(st.sampled_from(["0", "1", "99999999999999999999999", "-1", "x"]))
        q = urllib.parse.urlencode(
            {
                "tail": draw(st.sampled_from(["", "all", "10", "-5", "1e9", "x", "99999999999999999999"])),
                "alloc": draw(st.sampled_from(["", "tcp://127.0.0.1:9", "ipc:///etc/passwd", "garbage"])),
            }
        )
        path, method = f"meshes/{name}/ranks/{rank}/log?{q}", "GET"
    body = draw(
        st.one_of(
            st.none(),
            st.binary(max_size=128),
            st.dictionaries(st.sampled_from(["alloc", "x"]), st.one_of(st.text(max_size=20), st.integers(), st.none()))
            .map(json.dumps)
            .map(str.encode),
        )
    )
    return method, "/monarch-nb/api/" + path, (body if method != "GET" else None)


@settings(FUZZ, max_examples=80)
@given(case=rest_case(), token=st.sampled_from(["good", "good", "", "wrong"]))
def test_fuzz_rest_handlers(jserver, case: tuple[str, str, bytes | None], token: str) -> None:  # type: ignore[no-untyped-def]
    from _jupyter import TOKEN

    method, path, body = case
    status = _raw_request(jserver.base, method, path, body, TOKEN if token == "good" else token)
    assert status < 500 or status == 502, f"{method} {path} {body!r}: {status}\n{jserver.logtext()[-2000:]}"
    if token != "good":
        assert status in (401, 403, 404, 405), (method, path, status)
    assert jserver.proc.poll() is None
    assert _raw_request(jserver.base, "GET", "/monarch-nb/api/state", None, TOKEN) == 200


# ---------------------------------------------------------------- files other processes read

json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _job_records() -> list[dict[str, Any]]:
    from monarch_nb.job import LocalJob, ProcessJob

    out = []
    for job in (LocalJob(("a", "b")), ProcessJob({"trainers": 2}, env={"X": "1"})):
        rec = json.loads(job.dumps())
        out.append(rec)
        out.append(dict(rec, running=True, apply_id="abc", started=1.0, runtime={"dir": "/nowhere", "hosts": {}}))
    return out


@st.composite
def job_record(draw: Any) -> bytes:
    """A real job record with one field (at any depth) replaced by any JSON value, or removed."""
    rec = json.loads(json.dumps(draw(st.sampled_from(_job_records()))))
    node = rec
    while True:
        keys = list(node)
        key = draw(st.sampled_from(keys))
        if isinstance(node[key], dict) and node[key] and draw(st.booleans()):
            node = node[key]
            continue
        if draw(st.booleans()):
            node[key] = draw(json_value)
        else:
            del node[key]
        break
    return json.dumps(rec).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=64))


@FUZZ
@given(raw=job_record())
def test_fuzz_job_state_files(raw: bytes) -> None:
    """A cached job state that is not what ``dump()`` wrote is a ``JobError`` that says so."""
    from monarch_nb.job import JobError, job_loads

    try:
        job_loads(raw)
    except JobError:
        pass


@settings(FUZZ, max_examples=60)
@given(
    infos=st.lists(
        st.one_of(json_value, st.fixed_dictionaries({"name": st.just("n0")}, optional={"tcp": json_value})), max_size=3
    )
)
def test_fuzz_announcements_and_connection_files(tmp_path_factory, infos: list[Any]) -> None:  # type: ignore[no-untyped-def]
    """Whatever JSON sits in a job's announcement directory or a runtime directory's connection
    files, the readers skip what they cannot use and raise nothing."""
    from monarch_nb._runtime import records

    d = str(tmp_path_factory.mktemp("files"))
    os.chmod(d, 0o700)
    for i, info in enumerate(infos):
        records.write_private(os.path.join(d, f"n{i}.json"), json.dumps(info).encode())
        records.write_private(records.path_for(d, f"{i:012x}"), json.dumps(info).encode())
    for info in records.read_announcements(d).values():
        assert isinstance(info, dict)
    records.read_connection_files(d)
    assert records.find_local_allocator(d) is None
