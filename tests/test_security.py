"""Hardening against other local users and unlucky inputs (issue 15).

An attacker here is another uid on the same host (``nobody``, 65534) who can reach every TCP
port on loopback: the frame it sends would create a file if anything unpickled it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import tempfile
import textwrap
import threading
import time

import _gate
import _inotify
import psutil
import pytest
from _nobody import NOBODY, hold_silent_as_nobody, run_as_nobody
from conftest import PY, AllocatorProc, run_script, wait_for

from monarch_nb._wire import frames
from monarch_nb.actor import Actor, ActorError, endpoint, this_host

pytestmark = pytest.mark.timeout(240)

#: allocators of these tests run code that needs no torch: their zygote starts in a fraction of the time
LIGHT = {"MONARCH_NB_ZYGOTE_PRELOAD": ""}


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def evil_frame(marker: str) -> bytes:
    """An ACTOR frame whose meta, once unpickled, creates ``marker``."""
    meta = pickle.dumps(_Exploit(marker), protocol=5)
    return frames.MAGIC + bytes([frames.VERSION, frames.ACTOR, frames.INLINE]) + len(meta).to_bytes(4, "little") + meta


#: a ZMTP 3.0 client with the NULL mechanism (no key) in the standard library only: what any
#: local user can write without our virtualenv (which may sit in a directory they cannot read)
_ZMTP_CLIENT = """
import socket, struct, sys
host, port = sys.argv[1][len("tcp://"):].rsplit(":", 1)
frame = bytes.fromhex(sys.argv[2])
s = socket.create_connection((host, int(port)), timeout=5)
def recv_exactly(n):
    out = b""
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            sys.exit(0)  # the server hung up: it wants a mechanism we do not speak
        out += b
    return out
def frame_of(flags, body):
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
try:
    s.sendall(b"\\xff" + bytes(8) + b"\\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\\0") + bytes(32))
    recv_exactly(64)
    props = bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(frame_of(4, bytes([5]) + b"READY" + props))
    flags = recv_exactly(1)[0]
    recv_exactly(recv_exactly(1)[0] if not flags & 2 else struct.unpack(">Q", recv_exactly(8))[0])
    s.sendall(frame_of(0, frame))
    while s.recv(4096):
        pass
except OSError:
    pass
"""


def send_as_nobody(addr: str, frame: bytes) -> None:
    """Connect to ``addr`` as uid 65534 without a key and send ``frame`` (what any local user can do)."""
    run_as_nobody(_ZMTP_CLIENT, addr, frame.hex())


def assert_never_appears(path: str, seconds: float = 2.0) -> None:
    _inotify.assert_none_appear([path], seconds, f"a frame from uid {NOBODY} ran code")


def tcp_listeners(pid: int) -> list[str]:
    out = []
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN:
            out.append(f"tcp://{c.laddr.ip}:{c.laddr.port}")
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send a frame as uid 65534")
@pytest.mark.parametrize("trust_all", [False, True], ids=["keyless", "trust-all"])
def test_loopback_tcp_allocator_refuses_another_uid(tmp_path, trust_all: bool) -> None:
    args = ["--bind", "tcp://127.0.0.1:0"] + (["--trust-all"] if trust_all else [])
    a = AllocatorProc(str(tmp_path), *args, env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    try:
        assert a.info["tcp"].startswith("tcp://127.0.0.1:")
        marker = str(tmp_path / "pwned-allocator")
        send_as_nobody(a.info["tcp"], evil_frame(marker))
        # the daemon saw the connection and refused it before reading a frame (or ran it)
        wait_for(lambda: os.path.exists(marker) or "security handshake" in a.logtext(), 10, "the allocator to take the frame")
        assert_never_appears(marker)
        assert a.proc.poll() is None
        key = os.path.join(a.rdir, "loopback-tcp.key")
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        assert f"authenticated with this runtime directory's key {key}" in a.logtext()
    finally:
        a.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send a frame as uid 65534")
def test_keyless_controller_on_loopback_tcp(tmp_path) -> None:
    """The same user's keyless controller reaches a loopback TCP allocator (the runtime directory's
    key), and whatever TCP inbox the controller opens for the replies refuses a stranger."""
    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    script = textwrap.dedent(
        f"""
        import sys
        from monarch_nb.actor import Actor, endpoint, attach_to_workers
        from monarch_nb.actor import _context

        class Echo(Actor):
            @endpoint
            def echo(self, x):
                return x

        hosts = attach_to_workers(workers=[{a.info["tcp"]!r}])
        procs = hosts.spawn_procs(per_host={{"gpus": 1}})
        e = procs.spawn("e", Echo)
        print("echo", e.echo.call_one(41).get(timeout=60) + 1, flush=True)
        sys.stdin.readline()
        procs.stop().get(timeout=30)
        """
    )
    env = dict(a.env, MONARCH_NB_KEY_FILE="", PYTHONPATH=os.path.dirname(__file__))
    p = subprocess.Popen(
        [PY, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "echo 42", p.stderr.read()  # type: ignore[union-attr]
        listeners = tcp_listeners(p.pid)
        for i, addr in enumerate(listeners):
            marker = str(tmp_path / f"pwned-controller-{i}")
            send_as_nobody(addr.replace("0.0.0.0", "127.0.0.1"), evil_frame(marker))
            assert_never_appears(marker)
        p.stdin.write("done\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        assert p.wait(60) == 0, p.stderr.read()  # type: ignore[union-attr]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        a.stop()


def test_tcp_off_loopback_without_key_is_refused(tmp_path) -> None:
    from monarch_nb._runtime.transport import Security
    from monarch_nb.errors import ConfigError

    for trust_all in (False, True):
        with pytest.raises(ConfigError, match="monarch-nb keygen"):
            Security(None, trust_all).check_address("tcp://192.0.2.1:26600")


@pytest.mark.parametrize("kind", ["0644-file", "symlink"])
def test_keygen_leaves_no_readable_secret(tmp_path, kind: str) -> None:
    path = tmp_path / "cluster.key"
    target = tmp_path / "elsewhere"
    target.write_text("not a key\n")
    os.chmod(target, 0o644)
    if kind == "symlink":
        os.symlink(target, path)
    else:
        path.write_text("old\n")
        os.chmod(path, 0o644)
    r = subprocess.run([PY, "-m", "monarch_nb", "keygen", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert "(mode 600)" in r.stdout
    assert target.read_text() == "not a key\n"  # the link was not written through
    from monarch_nb._wire.keys import read_key_file

    assert len(read_key_file(str(path))) == 32


def test_a_key_path_that_is_not_a_file_is_refused_at_once(tmp_path) -> None:
    """A FIFO at the key's path (one another user made where the key was to be) blocked the
    open, and the kernel or allocator reading it with it, until someone wrote to it."""
    from monarch_nb._wire.keys import read_key_file
    from monarch_nb.errors import ConfigError

    fifo = tmp_path / "cluster.key"
    os.mkfifo(fifo, 0o600)
    r = subprocess.run(
        [PY, "-m", "monarch_nb", "allocator", "start", "--bind", "tcp://127.0.0.1:0", "--key-file", str(fifo)],
        env=dict(os.environ, MONARCH_NB_RUNTIME_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "is not a regular file" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_key_file(str(tmp_path))


# ---------------------------------------------------------------- unlucky exceptions (item 3)


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class NeedsTwoArgs(Exception):
    """Pickles fine, but unpickling calls ``__init__`` with one argument and raises."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")


def _refuse_to_unpickle() -> None:
    raise ValueError("this argument does not unpickle here")


class BadArg:
    def __reduce__(self):
        return (_refuse_to_unpickle, ())


class BadArgStrRaises:
    def __reduce__(self):
        return (_raise_str_raises, ())


def _raise_str_raises() -> None:
    raise StrRaises()


class Raiser(Actor):
    @endpoint
    def raise_it(self, kind: str) -> None:
        raise {"str": StrRaises(), "unpicklable": Unpicklable(), "two": NeedsTwoArgs(1, 2)}[kind]

    @endpoint
    def take(self, x: object) -> str:
        return "took it"

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def big(self, n: int) -> bytes:
        return b"x" * n


@pytest.fixture(scope="module")
def raiser():
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="raiser")
    try:
        yield procs.spawn("raiser", Raiser)
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.parametrize("kind", ["str", "unpicklable", "two"])
def test_endpoint_exception_that_resists_formatting_or_pickling(raiser, kind: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ActorError) as ei:
        raiser.raise_it.call_one(kind).get(timeout=10)
    assert time.monotonic() - t0 < 10
    assert type(ei.value.exception).__name__ in ({"str": "StrRaises", "unpicklable": "RuntimeError", "two": "RuntimeError"}[kind])
    assert "raise_it" in str(ei.value)
    assert raiser.ping.call_one().get(timeout=10) == "pong"


@pytest.mark.parametrize("arg", [BadArg(), BadArgStrRaises()], ids=["raises", "raises-str-raises"])
def test_arguments_that_fail_to_unpickle_in_the_actor(raiser, arg: object) -> None:
    with pytest.raises(ActorError, match="unpickling its arguments"):
        raiser.take.call_one(arg).get(timeout=10)
    assert raiser.ping.call_one().get(timeout=10) == "pong"


def test_exception_class_from_main_arrives_as_itself() -> None:
    """A class defined in ``__main__`` (a notebook cell, a script) is caught by ``except MyError``."""
    r = run_script(
        textwrap.dedent(
            """
            from monarch_nb.actor import Actor, ActorError, endpoint, this_host

            class MyError(Exception):
                pass

            class A(Actor):
                @endpoint
                def fail(self):
                    raise MyError("from the actor")

            procs = this_host().spawn_procs(per_host={"gpus": 1})
            a = procs.spawn("a", A)
            try:
                a.fail.call_one().get(timeout=30)
            except ActorError as e:
                print("caught", type(e.exception).__name__, isinstance(e.exception, MyError), e.exception)
            procs.stop().get(timeout=30)
            """
        ),
        timeout=90,
    )
    assert "caught MyError True from the actor" in r.stdout, r.stdout + r.stderr


def test_reply_over_max_message_bytes_fails_the_call(tmp_path) -> None:
    limit = {"MONARCH_NB_MAX_MESSAGE_BYTES": str(1 << 20)}
    a = AllocatorProc(str(tmp_path), env=dict(LIGHT, **limit))
    try:
        r = run_script(
            textwrap.dedent(
                f"""
                import time
                from monarch_nb.actor import ActorError, attach_to_workers
                from test_security import Raiser

                hosts = attach_to_workers(workers=[{a.addr!r}])
                procs = hosts.spawn_procs(per_host={{"gpus": 1}})
                r = procs.spawn("r", Raiser)
                t0 = time.monotonic()
                try:
                    r.big.call_one(2 << 20).get(timeout=30)
                except ActorError as e:
                    print("failed after", time.monotonic() - t0, "s:", e.message)
                print("then", len(r.big.call_one(1000).get(timeout=10)))
                procs.stop().get(timeout=30)
                """
            ),
            timeout=90,
            env=dict(limit, MONARCH_NB_RUNTIME_DIR=a.rdir, PYTHONPATH=os.path.dirname(__file__)),
        )
        assert "max_message_bytes=1048576" in r.stdout and "too large to send back" in r.stdout, r.stdout + r.stderr
        assert float(r.stdout.split("failed after ")[1].split()[0]) < 10, r.stdout
        assert "then 1000" in r.stdout
    finally:
        a.stop()


# ---------------------------------------------------------------- a full /dev/shm (item 2)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a private /dev/shm")
def test_full_dev_shm_falls_back_to_the_socket(tmp_path) -> None:
    """In a mount namespace whose /dev/shm holds 16 MiB, 32 MiB go to an echo actor and back."""
    rdir = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    script = textwrap.dedent(
        """
        import os
        from monarch_nb.actor import Actor, endpoint, this_host

        class Echo(Actor):
            @endpoint
            def echo(self, b):
                return b

        data = os.urandom(32 << 20)
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        back = procs.spawn("echo", Echo).echo.call_one(data).get(timeout=60)
        print("same bytes back:", back == data, flush=True)
        procs.stop().get(timeout=30)
        """
    )
    (tmp_path / "echo.py").write_text(script)
    shell = f"mount -t tmpfs -o size=16m,mode=1777 tmpfs /dev/shm && {PY} {tmp_path / 'echo.py'}; rc=$?; {PY} -m monarch_nb allocator stop >/dev/null; exit $rc"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["MONARCH_NB_RUNTIME_DIR"] = rdir
    try:
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", shell], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        assert "same bytes back: True" in r.stdout, r.stdout + r.stderr
    finally:
        subprocess.run([PY, "-m", "monarch_nb", "allocator", "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(rdir, ignore_errors=True)


# ---------------------------------------------------------------- the direct path (item 11)


def test_direct_path_of_another_wire_version_is_refused_at_the_caller() -> None:
    """A direct socket that greets with another wire version: the sender raises, sends nothing."""
    import socket

    from monarch_nb._runtime.runtime import Runtime
    from monarch_nb._runtime.transport import Security
    from monarch_nb.config import Config
    from monarch_nb.errors import VersionMismatchError

    rdir = tempfile.mkdtemp(prefix="mnbv-", dir="/tmp")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(os.path.join(rdir, "mnb-other.fast"))
    lst.listen(4)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            conn.sendall(frames.MAGIC + bytes([frames.VERSION + 1]))
            conn.settimeout(2)
            try:
                got.append(conn.recv(100))
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    tx = Runtime(Config(), Security(), rdir, label="tx").start()
    try:
        with pytest.raises(VersionMismatchError, match=f"speaks wire version {frames.VERSION + 1}"):
            tx.send(f"ipc://{rdir}/mnb-other.sock", frames.encode(frames.PORT, (1, 0, frames.ITEM), b"hello"))
        t.join(10)
        assert got in ([], [b""])  # nothing of the message was written
    finally:
        tx.close()
        lst.close()
        shutil.rmtree(rdir, ignore_errors=True)


class Slow(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def length(self, b: bytes) -> int:
        return len(b)


def test_a_stopped_receiver_leaves_the_sender_free() -> None:
    import signal

    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="stopped")
    try:
        s = procs.spawn("slow", Slow)
        pid = s.pid.call_one().get(timeout=30)  # this thread now has a direct connection to it
        os.kill(pid, signal.SIGSTOP)
        try:
            big = b"x" * (4 << 20)  # more than a socket buffer, less than the shared-memory threshold
            t0 = time.monotonic()
            futs = [s.length.call_one(big) for _ in range(3)]
            assert time.monotonic() - t0 < 8, "the sending thread was held by a stopped receiver"
            with pytest.raises(TimeoutError):
                futs[0].get(timeout=2)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [f.get(timeout=30) for f in futs] == [4 << 20] * 3
        assert s.length.call_one(b"after").get(timeout=10) == 5
    finally:
        procs.stop().get(timeout=30)


# ---------------------------------------------------------------- the sidebar's REST API (item 11)


@pytest.fixture(scope="module")
def readonly_server():
    from _jupyter import JupyterServer

    s = JupyterServer(
        "server",
        extra_args=["--ServerApp.authorizer_class=_authz.ReadOnly"],
        extra_env={"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))},
    )
    yield s
    s.stop()


def test_a_read_only_authorizer_makes_a_read_only_sidebar(readonly_server) -> None:
    status, state = readonly_server.request("GET", "/monarch-nb/api/state")
    assert status == 200, state
    assert "allocators" in state
    for path in ("/monarch-nb/api/allocators", "/monarch-nb/api/meshes/demo/stop"):
        status, body = readonly_server.request("POST", path, {})
        assert status == 403, (path, status, body)


def test_the_sidebar_reads_logs_only_from_allocators_it_knows(readonly_server) -> None:
    status, body = readonly_server.request("GET", "/monarch-nb/api/meshes/demo/ranks/0/log?alloc=tcp://127.0.0.1:9")
    assert status == 400 and "not an allocator this server knows" in body["message"], (status, body)
    # and the server process never reached for that address
    server = psutil.Process(readonly_server.proc.pid)
    assert not [c for c in server.net_connections(kind="tcp") if c.raddr and c.raddr.port == 9]


@pytest.mark.parametrize("name", ["..", "../..", "a/../..", ".hidden"])
def test_a_log_request_cannot_leave_the_log_directory(name: str) -> None:
    from monarch_nb.actor import _context
    from monarch_nb.allocator import start_allocator
    from monarch_nb.config import runtime_dir

    addr = start_allocator()["addr"]
    # what a '..' would reach: a file shaped like a rank log, outside any mesh's log directory
    with open(os.path.join(runtime_dir(), "rank-0.jsonl"), "w") as f:
        f.write('{"line": "not yours"}\n')
    with pytest.raises(ValueError, match="bad mesh name"):
        _context.client().request(addr, "logs", name, 0, None).get(timeout=10)


# ---------------------------------------------------------------- a dead log subscriber (item 4)


class Chatty(Actor):
    @endpoint
    def flood_when(self, flag: str, mb: int) -> None:
        """Print ``mb`` MB on a thread of its own once the gate at ``flag`` opens."""

        def run() -> None:
            if not _gate.wait(flag, 120):  # the test's own timeout is shorter
                return
            line = "y" * 999
            for _ in range(mb * 1000):
                print(line)
            print("flood done", flush=True)

        threading.Thread(target=run, daemon=True).start()

    @endpoint
    def hello(self) -> str:
        print("hello from the chatty rank", flush=True)
        return "hi"


def test_a_killed_controllers_log_subscription_does_not_grow_the_allocator(tmp_path, gate) -> None:
    a = AllocatorProc(str(tmp_path), env=LIGHT)
    flag = gate()
    script = textwrap.dedent(
        f"""
        import threading
        from monarch_nb.actor import attach_to_workers
        from test_security import Chatty

        hosts = attach_to_workers(workers=[{a.addr!r}])
        procs = hosts.spawn_procs(per_host={{"gpus": 1}}, name="chatty", persist=True)
        c = procs.spawn("c", Chatty)
        c.hello.call_one().get(timeout=30)
        c.flood_when.call_one({flag.path!r}, 50).get(timeout=30)
        print("armed", flush=True)
        threading.Event().wait()  # until the test kills it
        """
    )
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=a.rdir, PYTHONPATH=os.path.dirname(__file__))
    env.pop("PYTHONUNBUFFERED", None)
    p = subprocess.Popen([PY, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = [p.stdout.readline() for _ in range(2)]  # type: ignore[union-attr]
        assert "hello from the chatty rank" in out[0] and out[1] == "armed\n", out
        p.kill()
        p.wait(10)
        wait_for(lambda: "exited; detaching it" in a.logtext(), 15, "the allocator to detach the killed controller")
        alloc = psutil.Process(a.proc.pid)
        before = alloc.memory_info().rss
        flag.open()
        log = next(iter(__import__("glob").glob(os.path.join(a.rdir, "mnb-logs-*", "chatty", "rank-0.jsonl"))))

        def done() -> bool:
            with open(log, "rb") as f:
                f.seek(max(0, os.path.getsize(log) - 4096))
                return b"flood done" in f.read()

        wait_for(done, 150, "the rank to print 50 MB")
        grown = alloc.memory_info().rss - before
        assert grown < 20 << 20, f"the allocator grew by {grown >> 20} MiB"
        assert os.path.getsize(log) > 50_000_000  # every line is on disk
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        a.stop()


# ---------------------------------------------------------------- the allocator's I/O thread (item 5)


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_a_log_tail_reads_the_end_of_a_huge_log_only(allocator) -> None:
    from monarch_nb.introspect import logs

    procs = allocator.hosts.spawn_procs(per_host={"gpus": 1}, name="biglog")
    try:
        procs.spawn("c", Chatty).hello.call_one().get(timeout=30)
        path = next(iter(__import__("glob").glob(os.path.join(allocator.rdir, "mnb-logs-*", "biglog", "rank-0.jsonl"))))
        wait_for(lambda: os.path.getsize(path) > 0, 10, "the rank's first line on disk")
        row = (json.dumps({"ts": 0.0, "rank": 0, "stream": "stdout", "call": "", "line": "z" * 200}) + "\n").encode()
        block = row * ((4 << 20) // len(row))
        with open(path, "ab") as f:
            for _ in range(50):  # 200 MB of old output
                f.write(block)
            f.write(row.replace(b"z" * 200, b"the last line"))
        peak = _peak_rss(allocator.proc.pid)
        got = logs("biglog", 0, tail=10, addr=allocator.addr, timeout=30)
        assert len(got) == 10 and got[-1]["line"] == "the last line"
        grown = _peak_rss(allocator.proc.pid) - peak
        assert grown < 32 << 20, f"reading a tail of 10 lines raised the allocator's peak memory by {grown >> 20} MiB"
    finally:
        procs.stop().get(timeout=30)


def test_a_stalled_sync_pull_leaves_the_allocator_answering(allocator, tmp_path) -> None:
    """The staging area hangs (a FIFO nobody writes, as a hung network mount would): the
    allocator keeps answering heartbeats and calls while the pull waits."""
    import hashlib

    from monarch_nb.actor import _context

    blob = b"print('synced')\n"
    digest = hashlib.sha256(blob).hexdigest()
    (tmp_path / "blobs").mkdir()
    fifo = tmp_path / "blobs" / digest
    os.mkfifo(fifo)
    procs = allocator.hosts.spawn_procs(per_host={"gpus": 1}, name="pulled")
    try:
        c = procs.spawn("c", Chatty)
        c.hello.call_one().get(timeout=30)
        pull = _context.client().request(allocator.addr, "sync_pull", f"file://{tmp_path}", [digest])
        deadline = time.monotonic() + 3 * float(os.environ.get("MONARCH_NB_HEARTBEAT_TIMEOUT", "2"))
        n = 0
        while time.monotonic() < deadline:  # several heartbeat timeouts of calls, all answered
            assert c.hello.call_one().get(timeout=10) == "hi"
            assert _context.client().request(allocator.addr, "status").get(timeout=5)["host"]
            n += 1
        assert not pull.done()
        with open(fifo, "wb") as f:  # the staging area answers at last (a FIFO is no file fsspec
            f.write(blob)  # can seek in: the pull may fail now; it only had to not block anything)
        wait_for(pull.done, 30, "the pull to end")
        assert n > 0
    finally:
        procs.stop().get(timeout=30)


# ---------------------------------------------------------------- log limits (item 10)


class Printer(Actor):
    @endpoint
    def print_bytes(self, n: int) -> int:
        line = "p" * 99
        for i in range(n // 100):
            print(line if i < n // 100 - 1 else "the very last line")
        return n


def test_a_rank_printing_twice_its_cap_keeps_at_most_the_cap(tmp_path) -> None:
    from monarch_nb.actor import attach_to_workers
    from monarch_nb.introspect import logs

    cap = 1 << 20
    a = AllocatorProc(str(tmp_path), env=dict(LIGHT, MONARCH_NB_LOG_MAX_RANK_BYTES=str(cap)))
    try:
        hosts = attach_to_workers(workers=[a.addr])
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="capped")
        try:
            p = procs.spawn("p", Printer)
            p.print_bytes.call_one(2 * cap).get(timeout=60)
            d = next(iter(__import__("glob").glob(os.path.join(a.rdir, "mnb-logs-*", "capped"))))

            def last_line_on_disk() -> list[dict]:
                got = logs("capped", 0, tail=3, addr=a.addr, timeout=30)
                return got if got and got[-1]["line"] == "the very last line" else []

            wait_for(last_line_on_disk, 30, "the last line in the log")
            on_disk = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
            assert cap // 2 < on_disk <= cap, on_disk
            assert sorted(os.listdir(d)) == ["rank-0.jsonl", "rank-0.jsonl.1"]
            # the whole log reads both files, oldest first, with no gap
            rows = logs("capped", 0, addr=a.addr, timeout=30)
            assert len(rows) > (cap // 2) // 200 and rows[-1]["line"] == "the very last line"
        finally:
            procs.stop().get(timeout=30)
    finally:
        a.stop()


def test_gc_removes_old_logs_of_stopped_allocators_and_meshes(tmp_path) -> None:
    rdir = tmp_path / "rt"
    rdir.mkdir(mode=0o700)
    old = time.time() - 30 * 86400

    def rank_log(path: str, when: float) -> None:
        p = rdir / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('{"line": "x"}\n')
        os.utime(p, (when, when))

    rank_log("mnb-logs-0123456789ab/train/rank-0.jsonl", old)  # an allocator long gone
    rank_log("mnb-logs-ba9876543210/train/rank-0.jsonl", time.time())  # gone, but recent
    # a detached allocator's own output, one file per process that started one: nothing removed them
    rank_log("allocator-start-4242.log", old)
    rank_log("allocator-start-4343.log", time.time())
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=str(rdir))
    r = subprocess.run([PY, "-m", "monarch_nb", "gc", "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "would remove" in r.stdout and "mnb-logs-0123456789ab" in r.stdout and "ba9876543210" not in r.stdout, r.stdout
    assert (rdir / "mnb-logs-0123456789ab").exists()  # a dry run removes nothing
    r = subprocess.run([PY, "-m", "monarch_nb", "gc"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not (rdir / "mnb-logs-0123456789ab").exists()
    assert (rdir / "mnb-logs-ba9876543210" / "train" / "rank-0.jsonl").exists()
    assert f"removed {rdir}/allocator-start-4242.log" in r.stdout and "4343" not in r.stdout, r.stdout
    assert not (rdir / "allocator-start-4242.log").exists() and (rdir / "allocator-start-4343.log").exists()
    # a running allocator's start log (its stdout) stays, whatever its age
    from monarch_nb._runtime.logfiles import plan

    os.utime(rdir / "allocator-start-4343.log", (old, old))
    held = {str(rdir / "allocator-start-4343.log")}
    assert [r.path for r in plan(str(rdir), set(), 0, 86400, held)] == []
    assert [r.path for r in plan(str(rdir), set(), 0, 86400)] == [str(rdir / "allocator-start-4343.log")]
    # over the total, the oldest go first even when young
    env["MONARCH_NB_LOG_MAX_TOTAL_BYTES"] = "1"
    r = subprocess.run([PY, "-m", "monarch_nb", "gc"], env=env, capture_output=True, text=True, timeout=60)
    assert not (rdir / "mnb-logs-ba9876543210").exists(), r.stdout


def test_gc_removes_old_synced_code_but_not_what_a_running_allocator_serves(tmp_path) -> None:
    import hashlib

    from monarch_nb._runtime.codecache import CodeCache
    from monarch_nb.actor import _context

    a = AllocatorProc(str(tmp_path), env=LIGHT)
    try:
        live, old = b"x = 1\n", b"y = 2\n"
        dl, do = hashlib.sha256(live).hexdigest(), hashlib.sha256(old).hexdigest()
        cl = _context.client()
        cl.connect(a.addr)
        cl.request(a.addr, "sync_put", {dl: live}).get(timeout=30)
        cl.request(a.addr, "sync_commit", "live", {"mod.py": (dl, len(live), 0o644)}).get(timeout=30)
        code = os.path.join(a.rdir, "mnb-code")
        # what an allocator that no longer runs synced
        earlier = CodeCache(code, owner="0123456789ab")
        earlier.put({do: old})
        earlier.commit("old", {"old.py": (do, len(old), 0o644)})
        month = time.time() - 30 * 86400
        for p in ("ws/old", "ws/live", f"blobs/{do[:2]}/{do}", f"blobs/{dl[:2]}/{dl}"):
            os.utime(os.path.join(code, p), (month, month))

        def gc(*args: str, **env: str) -> str:
            r = subprocess.run(
                [PY, "-m", "monarch_nb", "gc", *args], env=dict(a.env, **env), capture_output=True, text=True, timeout=60
            )
            assert r.returncode == 0, r.stderr
            return r.stdout

        out = gc("--dry-run")
        assert "would remove" in out and "ws/old" in out and do in out, out
        assert "ws/live" not in out and dl not in out, out  # a running allocator's procs import from it
        assert os.path.exists(os.path.join(code, "ws", "old", "old.py"))  # a dry run removes nothing
        gc()
        assert not os.path.exists(os.path.join(code, "ws", "old"))
        assert not os.path.exists(os.path.join(code, "blobs", do[:2], do))
        assert not os.path.exists(os.path.join(code, "in-use-0123456789ab"))
        assert os.path.exists(os.path.join(code, "ws", "live", "mod.py"))
        assert os.path.exists(os.path.join(code, "blobs", dl[:2], dl))
        # over the size limit, still nothing a running allocator serves
        gc(MONARCH_NB_CODE_MAX_TOTAL_BYTES="1")
        assert os.path.exists(os.path.join(code, "ws", "live", "mod.py"))
        a.stop()
        out = gc()  # its allocator gone, the month-old workspace goes too
        assert not os.path.exists(os.path.join(code, "ws", "live")), out
    finally:
        a.stop()


def test_logs_of_a_previous_allocator_of_this_host(tmp_path) -> None:
    a = AllocatorProc(str(tmp_path), env=LIGHT)
    env = {"MONARCH_NB_RUNTIME_DIR": a.rdir, "PYTHONPATH": os.path.dirname(__file__)}
    try:
        r = run_script(
            textwrap.dedent(
                f"""
                from monarch_nb.actor import attach_to_workers
                from test_security import Chatty

                procs = attach_to_workers(workers=[{a.addr!r}]).spawn_procs(per_host={{"gpus": 2}}, name="before")
                procs.spawn("c", Chatty).hello.call().get(timeout=60)
                procs.stop().get(timeout=60)
                """
            ),
            timeout=90,
            env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        a.proc.terminate()
        a.proc.wait(30)
        r = run_script(
            textwrap.dedent(
                """
                from monarch_nb import logs as L
                rows = L.logs("before", tail=5)
                print(sorted({(row["rank"], row["line"]) for row in rows}))
                """
            ),
            timeout=90,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        assert "[(0, 'hello from the chatty rank'), (1, 'hello from the chatty rank')]" in r.stdout, r.stdout
    finally:
        a.stop()


#: opens a connection N times as fast as it can, to a TCP ``HOST:PORT`` or an abstract unix socket
#: (the data plane's: its name is in /proc/net/unix for every user to read), each sent 10 bytes
_CONNECT_MANY = """
import socket, sys
where, n = sys.argv[1], int(sys.argv[2])
for _ in range(n):
    if where.startswith("@"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = "\\0" + where[1:]
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host, port = where.rsplit(":", 1)
        addr = (host, int(port))
    try:
        s.connect(addr)
        s.sendall(b"\\xff" + bytes(8) + b"\\x7f")
    except OSError:
        pass
    s.close()
"""


def connect_many_as_nobody(where: str, n: int) -> None:
    run_as_nobody(_CONNECT_MANY, where, str(n), timeout=60)


class _Holder(Actor):
    """Holds a buffer, so its proc serves the data plane, and names the socket it serves at."""

    def __init__(self) -> None:
        from monarch_nb.rdma import RDMABuffer

        self.raw = bytearray(b"abc" * 100)
        self.buf = RDMABuffer(memoryview(self.raw))

    @endpoint
    def data_plane_socket(self) -> str:
        from monarch_nb._runtime import _dataplane

        srv = _dataplane.local_server()
        assert srv is not None
        return "@" + srv.unix[1:]

    @endpoint
    def ping(self) -> int:
        return 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as uid 65534")
def test_a_stranger_opening_connections_writes_one_line_not_one_per_connection(tmp_path) -> None:
    """Any local user can open connections to a proc's data-plane socket as fast as it can; each
    is refused, and the rank said so once per connection: its output streams into the notebook,
    so a stranger filled the user's cell (and its log) without getting in. Once, then counted."""
    from monarch_nb.logs import logs

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        h = procs.spawn("h", _Holder)
        where = h.data_plane_socket.call_one().get(timeout=60)
        connect_many_as_nobody(where, 200)
        connect_many_as_nobody(where, 1)
        assert h.ping.call_one().get(timeout=30) == 1  # the proc serves on
        wait_for(lambda: any("refused a data-plane connection from uid" in r["line"] for r in logs(procs)), 10, "the refusal")
        lines = [r["line"] for r in logs(procs) if "refused" in r["line"]]
        assert len(lines) == 1, lines[:5]
        assert lines[0].startswith(f"refused a data-plane connection from uid {NOBODY}"), lines
        assert "logged at most once every 60 s" in lines[0]
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as uid 65534")
def test_a_stranger_opening_connections_to_a_tcp_port_writes_one_line(tmp_path) -> None:
    """The same on an allocator's TCP inbox (anyone on the network reaches it): one line that says
    further refusals are counted, not a line per connection in the allocator's log."""
    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    try:
        connect_many_as_nobody(a.info["tcp"][len("tcp://") :], 100)
        wait_for(lambda: "security handshake" in a.logtext(), 30, "the refusal")
        # a controller of the user still gets in (and its own ping flushes the allocator's log)
        r = run_script(
            "from monarch_nb.actor import attach_to_workers\n"
            f"h = attach_to_workers(workers=[{a.info['tcp']!r}])\n"
            "p = h.spawn_procs(per_host={'gpus': 1})\n"
            "p.stop().get(timeout=30)\n"
            "print('ok')\n",
            env=dict(a.env, MONARCH_NB_KEY_FILE=""),
        )
        assert r.stdout.strip() == "ok", r.stderr
        refused = [ln for ln in a.logtext().splitlines() if "refused a connection" in ln]
        assert len(refused) == 1, refused[:5]
        assert "logged at most once every 60 s" in refused[0]
        assert a.proc.poll() is None
    finally:
        a.stop()


_SILENT_FLOOD = """
import secrets, socket, threading, time
from monarch_nb._runtime import _dataplane as dp

KEY = secrets.token_bytes(32)
srv = dp.DataServer(lambda: KEY, lambda: "127.0.0.1")
raw = bytearray(b"z" * 64)
bid = srv.register(dp.Entry(memoryview(raw), raw))
ip, port = srv.address().tcp.rsplit(":", 1)
# a stranger's connections that never greet, each held by the server for its handshake's 10 s
silent = [socket.create_connection((ip, int(port)), timeout=10) for _ in range(300)]
# the most threads serving at once until all were accepted (within the handshakes' 10 s)
serving, deadline = 0, time.monotonic() + 5
while srv.refusals.count < 300 - CAP:
    # else the bound below would hold only because the flood had not been taken in yet
    assert time.monotonic() < deadline, f"{srv.refusals.count} of {300 - CAP} silent connections cut in 5 s"
    serving = max(serving, sum(t.name == "monarch_nb-dataplane" for t in threading.enumerate()))
    time.sleep(0.01)
# a reader with the key, during the flood
s = socket.create_connection((ip, int(port)), timeout=10)
ch = dp._client_handshake(s, KEY)
ch.send(dp._REQ.pack(dp.OP_READ, bid, 0, 8))
rsp = bytearray(dp._RSP.size)
ch.recv_into(memoryview(rsp))
status, n = dp._RSP.unpack(rsp)
got = bytearray(n)
ch.recv_into(memoryview(got))
print(serving, status, bytes(got))
"""


def test_silent_connections_to_a_data_plane_port_hold_a_bounded_number_of_threads() -> None:
    """A keyed data-plane port took a thread per connection for its 10 s handshake, with no bound:
    anyone who can reach it could start thousands of threads in a rank (its own code then finds
    none to start). The oldest handshakes past GREETING_MAX are cut, and a reader with the key
    arriving during the flood is still served."""
    from monarch_nb._runtime._dataplane import GREETING_MAX

    r = run_script(f"CAP = {GREETING_MAX}\n" + _SILENT_FLOOD)
    assert r.returncode == 0, r.stderr
    serving, status, got = r.stdout.split()
    # a cut handshake's thread ends a moment after its socket is shut: one, or on a loaded
    # machine a few (34 threads seen), are counted still unwinding; unbounded it is 300
    assert int(serving) <= GREETING_MAX + 8 and (status, got) == ("0", "b'zzzzzzzz'"), r.stdout + r.stderr


def test_loopback_tcp_across_runtime_directories_says_why_it_is_refused(tmp_path) -> None:
    from monarch_nb.actor import _context
    from monarch_nb.errors import AuthenticationError

    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    try:
        with pytest.raises(AuthenticationError, match="another MONARCH_NB_RUNTIME_DIR needs a shared key file") as ei:
            _context.client().connect(a.info["tcp"], timeout=10)
        # its reconnect was dropped too: it lives, and holds another key
        assert "the allocator there is running and holds a different cluster key" in str(ei.value)
    finally:
        a.stop()


@pytest.mark.timeout(120)
def test_an_allocator_that_dies_while_we_connect_is_not_called_a_key_mismatch(tmp_path) -> None:
    """An allocator killed while a controller's security handshake with it was under way was
    "the peer holds a different cluster key": the user went looking for a key problem. Its
    reconnect is refused, so it is gone, and the error says so and what to do (the wrong key, the
    test above, is still a key problem: its reconnect is dropped again)."""
    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    tcp = a.info["tcp"]
    port = int(tcp.rsplit(":", 1)[1])
    script = f"""
from monarch_nb.actor import attach_to_workers
try:
    attach_to_workers(workers=[{tcp!r}])
    print("attached")
except Exception as e:
    print(type(e).__name__ + ":", e)
"""
    os.kill(a.proc.pid, signal.SIGSTOP)  # the kernel accepts its connections; nothing answers them
    p = subprocess.Popen(
        [PY, "-c", script], env=dict(a.env, MONARCH_NB_KEY_FILE=""), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:

        def in_handshake() -> bool:
            conns = psutil.Process(p.pid).net_connections("tcp")
            return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in conns)

        wait_for(in_handshake, 60, "the controller's connection to the stopped allocator")
        os.kill(a.proc.pid, signal.SIGKILL)  # its connections are reset mid-handshake
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.proc.pid, signal.SIGCONT)
        a.stop()
    assert out.startswith(f"ConnectError: allocator at {tcp} closed our connection during the security handshake ("), out + err
    assert "and now refuses connections: it exited while we connected" in out, out
    assert "start it again" in out and "cluster key" not in out, out


# ---------------------------------------------------------------- bounded queues, detaching, sockets (item 4 and after)


def _controller(a: AllocatorProc, body: str, tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    """A controller script attached to ``a``; what the ranks print is not written anywhere (a
    frontend's log writer), what the script says goes to a file the test reads."""
    out = str(tmp_path / f"{name}.out")
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from monarch_nb.actor import _context, attach_to_workers
        from test_security import Chatty
        from _gate import wait as wait_gate

        _context.controller_client().log_writer = lambda mesh, lines: None
        hosts = attach_to_workers(workers=[{a.addr!r}])
        """
    ) + textwrap.dedent(body)
    env = dict(a.env, PYTHONPATH=os.path.dirname(__file__))
    with open(out, "w") as f:
        p = subprocess.Popen([PY, "-u", "-c", script], env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    return p, out


def _said(out: str, what: str) -> bool:
    with open(out, errors="replace") as f:
        return what in f.read()


def test_a_stopped_log_subscriber_costs_the_allocator_a_bounded_queue(tmp_path, gate) -> None:
    """A live controller that reads nothing (SIGSTOP) while its mesh prints 50 MB: the allocator
    drops that subscriber's log lines once its queue is full (counted, logged; every line is on
    disk) instead of growing, and the controller's calls work again once it reads again."""
    # heartbeats far longer than the test: only the full queue, not silence, may drop lines
    a = AllocatorProc(str(tmp_path), env=dict(LIGHT, MONARCH_NB_HEARTBEAT_TIMEOUT="120"))
    flag, resume = gate("go"), gate("resume")
    p, out = _controller(
        a,
        f"""
        procs = hosts.spawn_procs(per_host={{"gpus": 1}}, name="chatty", persist=True)
        c = procs.spawn("c", Chatty)
        c.hello.call_one().get(timeout=30)
        c.flood_when.call_one({flag.path!r}, 50).get(timeout=30)
        print("armed", flush=True)
        wait_gate({resume.path!r})
        print("after:", c.hello.call_one().get(timeout=60), flush=True)
        procs.stop().get(timeout=30)
        """,
        tmp_path,
        "slow",
    )
    try:
        wait_for(lambda: _said(out, "armed"), 60, "the controller to arm the flood")
        os.kill(p.pid, signal.SIGSTOP)
        alloc = psutil.Process(a.proc.pid)
        before = alloc.memory_info().rss
        flag.open()
        log = next(iter(__import__("glob").glob(os.path.join(a.rdir, "mnb-logs-*", "chatty", "rank-0.jsonl"))))

        def done() -> bool:
            with open(log, "rb") as f:
                f.seek(max(0, os.path.getsize(log) - 4096))
                return b"flood done" in f.read()

        peak = 0
        deadline = time.monotonic() + 150
        while not done():  # the allocator's memory all along the flood, not only at its end
            assert time.monotonic() < deadline, "the rank did not print 50 MB in 150 s"
            peak = max(peak, alloc.memory_info().rss - before)
            time.sleep(0.1)  # the sampling interval of the peak, not a wait for anything
        assert peak < 20 << 20, f"the allocator grew by {peak >> 20} MiB for a subscriber that reads nothing"
        assert os.path.getsize(log) > 50_000_000  # every line is on disk
        assert "reads too slowly (its queue is full): dropping its log lines" in a.logtext()
        from monarch_nb.actor import _context

        assert _context.client().request(a.addr, "status").get(timeout=10)["dropped_log_lines"] > 0
        os.kill(p.pid, signal.SIGCONT)
        resume.open()
        wait_for(lambda: _said(out, "after: hi"), 60, "the controller's call after it reads again")
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        a.stop()


def test_a_detached_controller_is_told_by_its_pongs(tmp_path, gate) -> None:
    """A controller silent long enough to be detached (suspended) learns it when it pings again:
    its calls fail with a SupervisionError that says so, instead of waiting for ever."""
    a = AllocatorProc(str(tmp_path), env=LIGHT)
    resume = gate("resume")
    p, out = _controller(
        a,
        f"""
        import monarch_nb.actor
        from monarch_nb.errors import SupervisionError
        # this script handles the failure itself (the default hook would end it with status 1)
        monarch_nb.actor.unhandled_fault_hook = lambda failure: None
        procs = hosts.spawn_procs(per_host={{"gpus": 1}}, name="held")
        c = procs.spawn("c", Chatty)
        c.hello.call_one().get(timeout=30)
        print("ready", flush=True)
        wait_gate({resume.path!r})
        try:
            c.hello.call_one().get(timeout=30)
            print("answered")
        except SupervisionError as e:
            print("failed:", e, flush=True)
        except TimeoutError:
            print("no answer", flush=True)
        os._exit(0)
        """,
        tmp_path,
        "detached",
    )
    try:
        wait_for(lambda: _said(out, "ready"), 60, "the controller to spawn")
        # the detach stops its mesh; a call reaching a proc before that stop ends is answered
        said = _stalled_until_detached(p, a, resume, out, then="mesh held stopped")
        assert "failed:" in said and "detached this controller" in said, said
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        a.stop()


def _stalled_until_detached(p, a, resume, out: str, then: str = "") -> str:  # type: ignore[no-untyped-def]
    """SIGSTOP controller ``p`` until allocator ``a`` detaches it (and logs ``then``, if given),
    resume it, and return what it printed by its exit (0)."""
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: "went silent; detaching it" in a.logtext(), 30, "the allocator to detach the stopped controller")
    if then:
        wait_for(lambda: then in a.logtext(), 30, repr(then))
    os.kill(p.pid, signal.SIGCONT)
    resume.open()
    rc = p.wait(45)
    with open(out) as f:
        said = f.read()
    assert rc == 0, (rc, said)
    return said


@pytest.mark.parametrize("how", ["stop", "shutdown"])
def test_a_detached_controller_still_stops_its_mesh_and_shuts_down_its_hosts(tmp_path, gate, how) -> None:
    """Detached after a stall of its own, a controller's ProcMesh.stop() of a persistent mesh
    (which the detach leaves running) and HostMesh.shutdown() still reach the allocator, which
    answers their hello: they are not failed as those of a host still silent are."""
    a = AllocatorProc(str(tmp_path), env=LIGHT)
    resume = gate("resume")
    ask = "procs.stop()" if how == "stop" else "hosts.shutdown()"
    p, out = _controller(
        a,
        f"""
        import threading
        import monarch_nb.actor
        # the mesh's failure, once this controller hears it was detached (its next pong)
        failed = threading.Event()
        monarch_nb.actor.unhandled_fault_hook = lambda failure: failed.set()
        procs = hosts.spawn_procs(per_host={{"gpus": 1}}, name="kept", persist=True)
        c = procs.spawn("c", Chatty)
        c.hello.call_one().get(timeout=30)
        print("ready", flush=True)
        wait_gate({resume.path!r})
        print("told" if failed.wait(30) else "never told", flush=True)
        try:
            {ask}.get(timeout=30)
            print("done", flush=True)
        except Exception as e:
            print("not done:", type(e).__name__, e, flush=True)
        os._exit(0)
        """,
        tmp_path,
        "detached-" + how,
    )
    try:
        wait_for(lambda: _said(out, "ready"), 60, "the controller to spawn")
        said = _stalled_until_detached(p, a, resume, out)
        assert "detached this controller" in said and "\ntold\n" in said, said
        assert "\ndone\n" in said and "not done:" not in said, said
        if how == "stop":
            wait_for(lambda: "mesh kept stopped" in a.logtext(), 30, "the allocator to stop the mesh")
        else:
            assert a.proc.wait(30) is not None
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()
        a.stop()


def test_short_lived_controllers_do_not_pile_up_sockets_in_the_allocator(tmp_path) -> None:
    """Controllers that come and go (each with its own address), and requests whose answers go
    to addresses nobody serves: the allocator closes those connections; its fds stay bounded."""
    import zmq

    from monarch_nb._runtime.runtime import Runtime
    from monarch_nb._runtime.transport import Security
    from monarch_nb.actor._client import Client
    from monarch_nb.config import get_config

    a = AllocatorProc(str(tmp_path), env=dict(LIGHT, MONARCH_NB_PEER_IDLE_CLOSE="1"))
    alloc = psutil.Process(a.proc.pid)
    ctx = zmq.Context()
    try:
        cfg = get_config()
        baseline = alloc.num_fds()
        for _ in range(25):  # short-lived controllers that say goodbye
            rt = Runtime(cfg, Security(), a.rdir, label="controller").start()
            cl = Client(rt)
            cl.connect(a.addr)
            assert cl.request(a.addr, "status").get(timeout=10)["pid"] == a.proc.pid
            cl.shutdown()
            rt.close()
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(a.addr)
        for i in range(40):  # answers to addresses nobody serves
            raw.send(_status_frame(f"ipc://{a.rdir}/nobody-{i}.sock"))
        wait_for(lambda: alloc.num_fds() > baseline + 20, 30, "the allocator to answer (and so connect to) each address")
        wait_for(lambda: alloc.num_fds() <= baseline + 8, 30, f"the allocator's fds to come back near {baseline}")
        raw.close()
    finally:
        ctx.destroy(linger=0)
        a.stop()


def _status_frame(reply: str) -> bytes:
    meta = ("__allocator__", "status", reply, 7, 0, ((), ()), "", "", 0)
    return frames.encode(frames.ACTOR, meta, pickle.dumps(((), {}), protocol=5))[0]


def test_a_full_queue_fails_a_send_with_an_error_and_drops_only_log_lines() -> None:
    """A peer that reads nothing: a request or reply to it waits for room up to send_timeout and
    then raises ConnectError (never lost silently); a droppable message (a log line) is refused
    at once."""
    import zmq

    from monarch_nb._runtime.runtime import Runtime
    from monarch_nb._runtime.transport import Security
    from monarch_nb.config import get_config
    from monarch_nb.errors import ConnectError

    rdir = tempfile.mkdtemp(prefix="mnbq-", dir="/tmp")
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)
    sink.rcvhwm = 1
    sink.setsockopt(zmq.RCVBUF, 4096)
    addr = f"ipc://{rdir}/sink.sock"
    sink.bind(addr)
    cfg = get_config().replace(send_hwm=10, send_timeout=1.0, direct_ipc=False)
    rt = Runtime(cfg, Security(), rdir, label="controller").start()
    try:
        body = b"x" * 65536
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="is not reading its messages"):
            for _ in range(100_000):
                rt.transport.send(addr, [body])
        assert time.monotonic() - t0 < 15
        assert rt.transport.send(addr, [body], droppable=True) is False
        t0 = time.monotonic()
        with pytest.raises(ConnectError):  # a peer that already made us wait fails at once
            rt.transport.send(addr, [body])
        assert time.monotonic() - t0 < 0.5
    finally:
        rt.close()
        sink.close(0)
        ctx.term()
        shutil.rmtree(rdir, ignore_errors=True)


def test_every_file_of_the_runtime_directory_is_private_whatever_the_umask() -> None:
    """docs/security.md: the runtime directory's files are the user's alone. The detached
    allocator's start log, each rank's log and the code cache's folder were made with the
    umask's mode (0644, 0755): private only while the directory above them stayed 0700."""
    rdir = tempfile.mkdtemp(prefix="mnbm-", dir="/tmp")
    os.chmod(rdir, 0o700)
    code = textwrap.dedent(
        """
        import os, stat
        os.umask(0o022)
        from monarch_nb.actor import Actor, endpoint, this_host
        from monarch_nb.allocator import stop_allocator

        class Talker(Actor):
            @endpoint
            def talk(self):
                print("a line for the rank's log")

        try:
            procs = this_host().spawn_procs(per_host={"gpus": 2}, name="private")
            procs.spawn("t", Talker).talk.call().get(timeout=60)
            rdir = os.environ["MONARCH_NB_RUNTIME_DIR"]
            for where, dirs, files in os.walk(rdir):
                for n in dirs + files:
                    st = os.lstat(os.path.join(where, n))
                    print(oct(stat.S_IMODE(st.st_mode)), os.path.relpath(os.path.join(where, n), rdir))
        finally:
            stop_allocator()
        """
    )
    try:
        r = run_script(code, timeout=120, env=dict(LIGHT, MONARCH_NB_RUNTIME_DIR=rdir))
        assert r.returncode == 0, r.stderr
        modes = dict(reversed(line.split(" ", 1)) for line in r.stdout.splitlines() if line.startswith("0o"))
        assert any(p.startswith("allocator-start-") for p in modes) and any(p.endswith("rank-1.jsonl") for p in modes), modes
        assert {p: m for p, m in modes.items() if int(m, 8) & 0o077} == {}
    finally:
        shutil.rmtree(rdir, ignore_errors=True)


def test_sweeping_a_dead_procs_shared_memory_leaves_another_users_files() -> None:
    """An allocator unlinks what a dead proc left in /dev/shm by its pid's names. The name says
    nothing of whose a file is (another user's process of that pid in another pid namespace,
    or one who made the name): run as root, or on a /dev/shm without the sticky bit, it
    unlinked another user's segments too."""
    from monarch_nb._runtime import shm

    pid = 4_000_000 + os.getpid() % 100_000  # above pid_max: no process of ours had it
    theirs = [f"mnb-{pid}-{'a' * 32}", f"mnb-{pid}-p{'b' * 32}.free", f"torch_{pid}_1"]
    ours = f"torch_{pid}_2"
    run_as_nobody(
        "import os, sys\nfor n in sys.argv[1:]: os.close(os.open('/dev/shm/' + n, os.O_CREAT | os.O_WRONLY, 0o600))",
        *theirs,
    )
    os.close(os.open(f"/dev/shm/{ours}", os.O_CREAT | os.O_WRONLY, 0o600))
    try:
        assert shm.sweep_dead(pid) == 1
        assert not os.path.exists(f"/dev/shm/{ours}")
        assert all(os.stat(f"/dev/shm/{n}").st_uid == NOBODY for n in theirs)
    finally:
        for n in [*theirs, ours]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{n}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as uid 65534")
def test_silent_connections_from_another_user_leave_the_allocator_up_for_its_user(tmp_path) -> None:
    """libzmq keeps a connection that never speaks until its handshake's deadline, and aborts its
    process when its IPC listener finds no descriptor to accept with. A stranger holding a few
    hundred silent connections to an allocator's TCP port (anyone on the network reaches one)
    took every descriptor of one that had 400, and the next controller to attach over ipc killed
    it (SIGABRT, every mesh lost). The oldest handshakes past PENDING_MAX are cut, said once."""
    from monarch_nb._runtime._preauth import PENDING_MAX

    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""), nofile=400)
    host, port = a.info["tcp"][len("tcp://") :].rsplit(":", 1)
    try:
        holder, opened = hold_silent_as_nobody(host, port, 600)
    except BaseException:
        a.stop()
        raise
    try:
        assert opened > 400  # more than the allocator has descriptors

        # the user attaches once the flood is held and cut back: while a stranger is still
        # opening connections faster than they are cut, the allocator can be out of descriptors
        # for a moment, and an attach then aborts it (docs/security.md, "not (yet) covered")
        # (the line, not only the count: a flood still in the listener's backlog leaves the
        # allocator few descriptors before it has accepted any of it)
        def cut_back() -> bool:
            if a.proc.poll() is not None:
                return True
            said = any("in its security handshake" in ln for ln in a.logtext().splitlines())
            return said and psutil.Process(a.proc.pid).num_fds() < 50 + PENDING_MAX

        try:
            wait_for(cut_back, timeout=20, what="the allocator to cut the flood back to its handshake limit")
        except BaseException:
            state = f"up with {psutil.Process(a.proc.pid).num_fds()} descriptors" if a.proc.poll() is None else "gone"
            raise AssertionError(f"{opened} opened; allocator {state}; its log:\n" + a.logtext()[-3000:]) from None
        assert a.proc.poll() is None, a.logtext()[-3000:]
        r = run_script(
            "from monarch_nb.actor import Actor, endpoint, attach_to_workers\n"
            "class _E(Actor):\n"
            "    @endpoint\n"
            "    def hi(self):\n"
            "        return 'hi'\n"
            f"h = attach_to_workers(workers=[{a.addr!r}])\n"
            "p = h.spawn_procs(per_host={'gpus': 1})\n"
            "print(p.spawn('e', _E).hi.call_one().get(timeout=30))\n"
            "p.stop().get(timeout=30)\n",
            env=dict(a.env, MONARCH_NB_KEY_FILE=""),
        )
        assert r.stdout.strip() == "hi", r.stderr[-3000:] + f"\nallocator (exit {a.proc.poll()}):\n" + a.logtext()[-3000:]
        assert a.proc.poll() is None, a.logtext()[-3000:]
        assert psutil.Process(a.proc.pid).num_fds() < 50 + PENDING_MAX
        log = a.logtext()
        cut = [ln for ln in log.splitlines() if "in its security handshake" in ln]
        assert len(cut) == 1 and f"more than {PENDING_MAX} connections were in their handshake at once" in cut[0], log[-3000:]
    finally:
        holder.kill()
        holder.wait()
        a.stop()


#: as uid 65534: two ZMTP 3 connections claiming CurveZMQ to HOST:PORT, one that announces a
#: 6 GiB command and streams it as fast as it can (up to 768 MiB), one that sends its greeting a
#: byte every half second; prints how much the first sent and how long the second lasted
_STREAM_AND_TRICKLE = """
import socket, struct, sys, threading, time
addr = (sys.argv[1], int(sys.argv[2]))
greeting = b"\\xff" + bytes(8) + b"\\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\\0") + bytes(32)
out = {}
def stream():
    s = socket.create_connection(addr, timeout=30)
    s.sendall(greeting)
    sent, chunk = 0, bytes(1 << 20)
    try:
        s.sendall(bytes([0x06]) + struct.pack(">Q", 6 << 30))
        while sent < 768 << 20:
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    out["sent"] = sent
def trickle():
    s = socket.create_connection(addr, timeout=30)
    t0 = time.monotonic()
    try:
        for b in greeting:
            s.sendall(bytes([b]))
            time.sleep(0.5)
            if time.monotonic() - t0 > 16:
                break
    except OSError:
        pass
    s.settimeout(1)
    try:
        while s.recv(4096):
            pass
    except OSError:
        pass
    out["lasted"] = time.monotonic() - t0
ts = [threading.Thread(target=f) for f in (stream, trickle)]
for t in ts: t.start()
for t in ts: t.join()
print(out["sent"], out["lasted"])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as uid 65534")
def test_a_strangers_handshake_may_be_neither_large_nor_slow(tmp_path) -> None:
    """libzmq reads a handshake command as any message, up to MAXMSGSIZE (8 GiB): a stranger
    announcing one on an allocator's TCP port made it hold everything it sent until the
    handshake's deadline (2.6 GB after 8 s on loopback), and one trickling its greeting a byte at
    a time kept its connection for libzmq's 30 s. A connection is cut once it has sent more than
    a handshake's bytes, or after HANDSHAKE_S, and the owner's log says why (once)."""
    from monarch_nb._runtime._preauth import HANDSHAKE_BYTES, HANDSHAKE_S

    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    try:
        host, port = a.info["tcp"][len("tcp://") :].rsplit(":", 1)
        sent, lasted = run_as_nobody(_STREAM_AND_TRICKLE, host, port, timeout=60).split()
        # what the kernels buffer, and what arrives while the cut is on its way (a look every 50 ms)
        assert int(sent) < 192 << 20, f"the stranger sent {int(sent) >> 20} MiB before its connection was cut"
        assert float(lasted) < HANDSHAKE_S + 3
        wait_for(lambda: f"sent more than {HANDSHAKE_BYTES >> 10} KiB before proving the key" in a.logtext(), 10, "the cut")
        assert a.proc.poll() is None
    finally:
        a.stop()


def test_hundreds_of_keyed_peers_connecting_at_once_all_get_in(tmp_path) -> None:
    """The cap on handshakes in flight must not cut honest ones: procs of other hosts replying to a
    controller connect in a burst, and libzmq answers their HELLOs one by one. 300 connecting at
    once lost 151 handshakes to a cap on the oldest without a grace period."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from monarch_nb._runtime.transport import local_key
    from monarch_nb._wire.keys import curve_keypair

    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", env=dict(LIGHT, MONARCH_NB_KEY_FILE=""))
    ctx = zmq.Context()
    try:
        public, secret = curve_keypair(local_key(a.rdir))
        socks = [ctx.socket(zmq.DEALER) for _ in range(300)]
        mons = []
        for s in socks:
            s.linger = 0
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = public, public, secret
            mons.append(s.get_monitor_socket())
        for s in socks:
            s.connect(a.info["tcp"])
        failed = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH}
        events: list[list[int]] = [[] for _ in mons]

        def settled() -> bool:
            for m, seen in zip(mons, events):
                while m.poll(0):
                    seen.append(recv_monitor_message(m)["event"])
            return all(zmq.EVENT_HANDSHAKE_SUCCEEDED in seen for seen in events)

        wait_for(settled, 30, "300 handshakes")
        assert not [seen for seen in events if failed & set(seen)][:3]
        assert "in its security handshake" not in a.logtext()
    finally:
        ctx.destroy(linger=0)
        a.stop()
