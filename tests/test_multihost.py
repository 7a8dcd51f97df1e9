"""Multi-host tests: allocators on simulated hosts, controllers on another one.

Each test builds a `NetnsCluster(2)` (tests/_netns.py): host 0 runs the
controller scripts, hosts 1 and 2 run allocator daemons bound to their own
cluster IP.  Every host has its own network namespace and its own /tmp, so
keys, runtime directories and ipc sockets are really per host, and traffic
between hosts really crosses (simulated) wires that can be cut.

Controllers are Python scripts written into host 0's /tmp.  They print one
JSON object per line (``{"step": ..., ...}``) that the tests wait for and
assert on; an uncaught exception is printed as step ``"error"``.  Nothing
sleeps to synchronise: tests wait on log lines, JSON steps and files, each
with a deadline.

These tests need root (namespaces) and are never skipped: on a machine that
cannot run them they fail, loudly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _netns import NetnsCluster
from conftest import wait_for

from monarch_nb._runtime import records

pytestmark = pytest.mark.multihost

# The interpreter of this test run (the project's venv); hosts see it because it
# does not live under /tmp or /dev/shm.
PY = sys.executable
PORT = 26600
KEY = "/tmp/key"  # every host's copy of the cluster key, inside its private /tmp
RUNTIME_DIR = "/tmp/mnb"
ALLOCATOR_START_TIMEOUT = 30.0


def host_env(**extra: str) -> dict[str, str]:
    """The environment of every process started on a host."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MONARCH_NB_RUNTIME_DIR": RUNTIME_DIR,
        "MONARCH_NB_HEARTBEAT_INTERVAL": "0.2",
        "MONARCH_NB_HEARTBEAT_TIMEOUT": "1.5",
        "MONARCH_NB_ZYGOTE_PRELOAD": "",  # no torch: procs start fast
    }
    if "PYTHONPATH" in os.environ:  # hosts run the code this test run imports (a worktree, say)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env.update(extra)
    return env


# -- processes on hosts ------------------------------------------------------


class Lines:
    """The lines of one pipe, collected by a thread; waitable with a deadline."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self.eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        try:
            for raw in iter(stream.readline, b""):
                with self._cond:
                    self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                    self._cond.notify_all()
        except (OSError, ValueError):  # the harness closed the pipe
            pass
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float) -> str | None:
        """The first line satisfying `pred`; None at EOF or after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                if self.eof or left <= 0:
                    return None
                self._cond.wait(left)

    def wait_eof(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.eof, timeout)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


class HostProc:
    """A process on one host, its stdout and stderr collected line by line."""

    def __init__(self, cluster: NetnsCluster, host: int, argv: list[str], env: dict[str, str]) -> None:
        self.cluster = cluster
        self.host = host
        self.popen = cluster.popen(host, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = Lines(self.popen.stdout)
        self.err = Lines(self.popen.stderr)

    def describe(self) -> str:
        return (
            f"host {self.host} pid {self.popen.pid} exit {self.popen.poll()}\n"
            f"--- stdout ---\n{self.out.text()}\n--- stderr ---\n{self.err.text()}"
        )


class Allocator(HostProc):
    """``monarch_nb allocator`` serving ``tcp://<host ip>:PORT`` with the cluster key."""

    def __init__(self, cluster: NetnsCluster, host: int, *extra: str) -> None:
        self.ip = cluster.ip(host)
        self.addr = f"tcp://{self.ip}:{PORT}"
        argv = [PY, "-m", "monarch_nb", "allocator", "--bind", self.addr, *extra]
        super().__init__(cluster, host, argv, host_env())
        self.pid = 0
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout: float = ALLOCATOR_START_TIMEOUT) -> Allocator:
        line = self.err.wait_for(lambda s: "serving at" in s, timeout)
        assert line is not None, f"allocator did not come up within {timeout} s\n{self.describe()}"
        assert self.addr in line, line
        files = list(self.cluster.path(self.host, RUNTIME_DIR).glob(f"{records.PREFIX}*{records.SUFFIX}"))
        assert len(files) == 1, files
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
        self.info = json.loads(files[0].read_text())
        assert self.info["tcp"] == self.addr, self.info
        self.pid = int(self.info["pid"])
        # nsenter execs the program (no pid namespace), so the pid we started is the daemon
        assert self.pid == self.popen.pid, (self.pid, self.popen.pid)
        return self


# Shared by every controller script.  `A` and `Sleeper` are defined in the
# script's __main__, so they travel to the procs by value.
PRELUDE = """
import json, os, socket, sys, threading, time, traceback
import monarch_nb.actor as monarch_actor
from monarch_nb.actor import Actor, ProcMesh, attach_to_workers, current_rank, endpoint
from monarch_nb.errors import AuthenticationError, ConfigError, ConnectError, SupervisionError

CONTROLLER_IP = {controller_ip!r}
WORKERS = {workers!r}


_emit_lock = threading.Lock()


def emit(step, **kw):
    # fault hooks run on another thread: one write per line, under a lock, keeps lines whole
    line = json.dumps(dict(step=step, **kw), default=str) + "\\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def describe(e):
    return dict(
        type=type(e).__name__, msg=str(e), mesh=getattr(e, "mesh", None), rank=getattr(e, "rank", None),
        host=getattr(e, "host", None), cause=getattr(e, "cause", None),
    )


def on_fault(failure):
    # the default hook exits a script on an unhandled mesh failure; we want to keep reporting
    emit("fault", mesh=failure.mesh_name, report=failure.report())


monarch_actor.unhandled_fault_hook = on_fault


def my_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((CONTROLLER_IP, 9))
        return s.getsockname()[0]


class A(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def where(self):
        return dict(rank=current_rank().rank, coords=dict(current_rank()), ip=my_ip(), pid=os.getpid())

    @endpoint
    def bump(self, k):
        self.n += k

    @endpoint
    def count(self):
        return self.n

    @endpoint
    def digest(self, x):
        import hashlib
        return hashlib.sha256(x).hexdigest()


class Sleeper(Actor):
    @endpoint
    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds


emit("start")
try:
{body}
except BaseException as e:
    emit("error", tb=traceback.format_exc(), **describe(e))
    sys.exit(1)
emit("exit")
"""


class Controller(HostProc):
    """A controller script on host 0 (see PRELUDE); talk to it through its JSON steps."""

    _count = 0

    def __init__(self, cluster: NetnsCluster, body: str, workers: list[str] | None = None, **env: str) -> None:
        Controller._count += 1
        if workers is None:
            workers = [f"tcp://{cluster.ip(i)}:{PORT}" for i in (1, 2)]
        script = PRELUDE.format(
            controller_ip=cluster.ip(0),
            workers=workers,
            body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
        )
        path = f"/tmp/ctl{Controller._count}.py"
        cluster.path(0, path).write_text(script)
        super().__init__(cluster, 0, [PY, path], host_env(**env))

    def expect(self, step: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for the JSON line of `step`; fail at once on step "error" or exit."""

        def match(line: str) -> bool:
            s = _step(line)
            return s == step or s == "error"

        line = self.out.wait_for(match, timeout)
        if line is None:
            pytest.fail(f"controller printed no step {step!r} within {timeout} s\n{self.describe()}")
        msg = json.loads(line)
        if msg["step"] == "error" and step != "error":
            pytest.fail(f"controller failed before step {step!r}\n{self.describe()}")
        return msg

    def send(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text.encode())
        self.popen.stdin.flush()

    def finish(self, timeout: float = 30.0) -> int:
        """Wait for a clean exit (step "exit", then rc 0) and return the exit code."""
        self.expect("exit", timeout)
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"controller did not exit within {timeout} s after its last step\n{self.describe()}")
        assert rc == 0, self.describe()
        return rc


def _step(line: str) -> str | None:
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg.get("step") if isinstance(msg, dict) else None


def monarch_processes(cluster: NetnsCluster, host: int) -> list[str]:
    """Command lines of the live monarch_nb processes in `host`'s network namespace."""
    cp = subprocess.run(["ip", "netns", "pids", cluster.netns(host)], capture_output=True, text=True, check=True)
    cmds = []
    for pid in cp.stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if "monarch_nb" in cmd:
            cmds.append(f"{pid}: {cmd.strip()}")
    return cmds


def zygote_processes(cluster: NetnsCluster, host: int) -> list[str]:
    """The zygote and the procs it forked (they keep its command line)."""
    return [c for c in monarch_processes(cluster, host) if "monarch_nb._runtime.zygote" in c]


def plant_key(cluster: NetnsCluster, host: int, key: bytes, path: str = KEY) -> None:
    fd = os.open(cluster.path(host, path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)


# -- fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Two cluster keys made by ``monarch_nb keygen``: "good" and "other"."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("good", "other"):
        path = d / name
        subprocess.run([PY, "-m", "monarch_nb", "keygen", str(path)], check=True, capture_output=True, timeout=60)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        out[name] = path.read_bytes()
    assert out["good"] != out["other"]
    return out


def keyed_cluster(keys: dict[str, bytes], hostnames: list[str] | None = None) -> Iterator[NetnsCluster]:
    """Controller host 0 and worker hosts 1, 2, each holding the cluster key at /tmp/key
    (``hostnames``: a UTS name each, in every host's /etc/hosts)."""
    assert os.geteuid() == 0, "multi-host tests need root (network and mount namespaces)"
    project = str(Path(__file__).resolve().parent.parent)
    # the harness keeps the checkout (and its .venv) visible in every host, also under /tmp
    assert not PY.startswith(("/tmp/", "/dev/shm/")) or PY.startswith(project + "/"), f"{PY} would be invisible inside the hosts"
    c = NetnsCluster(2, hostnames=hostnames) if hostnames else NetnsCluster(2)
    try:
        for i in c.hosts:
            plant_key(c, i, keys["good"])
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(keys: dict[str, bytes]) -> Iterator[NetnsCluster]:
    yield from keyed_cluster(keys)


@pytest.fixture
def workers(cluster: NetnsCluster) -> list[Allocator]:
    """Allocators on hosts 1 and 2, serving on their cluster IPs, ready."""
    allocs = [Allocator(cluster, i, "--key-file", KEY) for i in (1, 2)]
    return [a.wait_ready() for a in allocs]


# -- tests -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_mesh_spans_two_hosts(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(
        cluster,
        """
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        emit("attached", extent=dict(hosts.extent))
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        emit("procs", extent=dict(procs.extent))
        actors = procs.spawn("a", A)
        vm = actors.where.call().get(timeout=30)
        emit("where", extent=dict(vm.extent), items=[[dict(p), v] for p, v in vm.items()])
        actors.bump.broadcast(5)
        actors.bump.broadcast(2)
        emit("counts", values=actors.count.call().get(timeout=30).values())
        procs.stop().get(timeout=30)
        emit("stopped")
        """,
    )
    assert ctl.expect("attached")["extent"] == {"hosts": 2}
    assert ctl.expect("procs")["extent"] == {"hosts": 2, "gpus": 2}
    where = ctl.expect("where")
    assert where["extent"] == {"hosts": 2, "gpus": 2}
    items = where["items"]
    assert len(items) == 4
    for point, v in items:
        h, g = point["hosts"], point["gpus"]
        assert v["coords"] == point
        assert v["rank"] == 2 * h + g
        # hosts=0 is the first worker address (host 1), hosts=1 the second (host 2)
        assert v["ip"] == cluster.ip(h + 1), (point, v)
    assert len({v["pid"] for _, v in items}) == 4
    # broadcast crossed both hosts: a later call sees both increments on every actor
    assert ctl.expect("counts")["values"] == [7, 7, 7, 7]
    ctl.expect("stopped")
    ctl.finish()
    # stop() really ended the procs on both hosts (allocator + zygote remain)
    for i in (1, 2):
        wait_for(lambda i=i: len(zygote_processes(cluster, i)) == 1, 10, f"procs on host {i} to exit")


# One message to a mesh over three hosts: the controller sends it once per host, each
# allocator relays it to its procs; single-proc sends go straight. Every actor must see the
# messages meant for it in the order they were sent.
THREE_HOST_BODY = """
from monarch_nb import introspect


class Log(Actor):
    def __init__(self):
        self.seen = []

    @endpoint
    def add(self, i):
        self.seen.append(i)

    @endpoint
    def seen_by(self):
        return dict(current_rank()), self.seen


def relayed():
    by_tcp = {a.get("tcp"): a for a in introspect.status(WORKERS)["allocators"]}
    return [by_tcp[w]["relayed"] for w in WORKERS]


hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
procs = hosts.spawn_procs(per_host={"gpus": 4})
log = procs.spawn("log", Log)
before = relayed()
for i in range(N):
    kind, h, g = i % 4, (i // 4) % 3, (i // 12) % 4
    if kind == 0:
        log.add.broadcast(i)  # all 12 procs: one message per host
    elif kind == 1:
        log.slice(hosts=h).add.broadcast(i)  # the 4 procs of one host: one message to it
    else:
        log.slice(hosts=h, gpus=g).add.call_one(i).get(timeout=30) if kind == 2 else log.slice(hosts=h, gpus=g).add.broadcast(i)
seen = log.seen_by.call().get(timeout=30)
after = relayed()
emit("seen", items=[list(v) for v in seen.values()], relayed=[[a["messages"] - b["messages"], a["deliveries"] - b["deliveries"]] for a, b in zip(after, before)])
procs.stop().get(timeout=30)
"""


@pytest.mark.timeout(180)
def test_a_large_argument_to_two_hosts_arrives_intact_on_every_proc(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    # across hosts a message for many procs goes once to each host's allocator, which hands
    # a large buffer to its procs through shared memory, written once for all of them
    ctl = Controller(
        cluster,
        """
        import hashlib
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 3})
        actors = procs.spawn("a", A)
        x = os.urandom(1 << 20) * 9
        got = actors.digest.call(x).get(timeout=60).values()
        emit("digests", ok=got == [hashlib.sha256(x).hexdigest()] * 6)
        procs.stop().get(timeout=30)
        emit("stopped")
        """,
    )
    assert ctl.expect("digests", timeout=120)["ok"]
    ctl.expect("stopped")
    ctl.finish()


def test_three_hosts_fan_out_through_their_allocators_in_order(keys: dict[str, bytes]) -> None:
    n = 240
    with NetnsCluster(3) as c:
        for i in c.hosts:
            plant_key(c, i, keys["good"])
        allocs = [Allocator(c, i, "--key-file", KEY) for i in (1, 2, 3)]
        for a in allocs:
            a.wait_ready()
        ctl = Controller(c, f"N = {n}\n" + THREE_HOST_BODY, workers=[a.addr for a in allocs])
        out = ctl.expect("seen", timeout=120)
        ctl.finish()

    def meant_for(h: int, g: int) -> list[int]:
        want = []
        for i in range(n):
            kind, hh, gg = i % 4, (i // 4) % 3, (i // 12) % 4
            if kind == 0 or (kind == 1 and hh == h) or (kind >= 2 and (hh, gg) == (h, g)):
                want.append(i)
        return want

    items = out["items"]
    assert len(items) == 12
    for point, seen in items:
        assert seen == meant_for(point["hosts"], point["gpus"]), point
    # per host: the full broadcasts, that host's own broadcasts, and the final gather,
    # each received once and relayed to its 4 procs
    for h, (messages, deliveries) in enumerate(out["relayed"]):
        want = sum(1 for i in range(n) if i % 4 == 0 or (i % 4 == 1 and (i // 4) % 3 == h)) + 1
        assert (messages, deliveries) == (want, 4 * want), (h, out["relayed"])


@pytest.mark.timeout(120)
def test_wrong_key_is_refused(cluster: NetnsCluster, keys: dict[str, bytes], workers: list[Allocator]) -> None:
    plant_key(cluster, 0, keys["other"], "/tmp/other-key")
    target = workers[0]
    bad = Controller(
        cluster,
        """
        t0 = time.monotonic()
        try:
            attach_to_workers(workers=WORKERS[:1], ca="/tmp/other-key")
            emit("attached")
        except AuthenticationError as e:
            emit("refused", elapsed=time.monotonic() - t0, **describe(e))
        """,
    )
    refused = bad.expect("refused", timeout=30)
    assert refused["elapsed"] < 10, refused
    assert target.addr in refused["msg"], refused
    bad.finish()

    line = target.err.wait_for(lambda s: "refused a connection" in s, 10)
    assert line is not None, target.describe()
    assert target.popen.poll() is None, target.describe()

    good = Controller(
        cluster,
        """
        hosts = attach_to_workers(workers=WORKERS[:1], ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        emit("where", values=procs.spawn("a", A).where.call().get(timeout=30).values())
        """,
    )
    values = good.expect("where")["values"]
    assert [v["ip"] for v in values] == [cluster.ip(1)] * 2
    good.finish()


@pytest.mark.timeout(60)
def test_trust_all_refused_off_loopback(cluster: NetnsCluster) -> None:
    # at the caller: no connection is even attempted
    ctl = Controller(
        cluster,
        """
        t0 = time.monotonic()
        try:
            attach_to_workers(workers=WORKERS[:1], ca="trust_all_connections")
            emit("attached")
        except ConfigError as e:
            emit("refused", elapsed=time.monotonic() - t0, **describe(e))
        """,
    )
    refused = ctl.expect("refused", timeout=30)
    assert refused["elapsed"] < 2, refused
    assert f"tcp://{cluster.ip(1)}:{PORT}" in refused["msg"], refused
    ctl.finish()

    # and an allocator will not serve plain TCP on a cluster address either
    cp = cluster.run(
        1,
        [PY, "-m", "monarch_nb", "allocator", "--bind", f"tcp://{cluster.ip(1)}:{PORT}", "--trust-all"],
        env=host_env(),
        capture_output=True,
        timeout=30,
    )
    assert cp.returncode != 0, cp
    assert b"refusing unauthenticated TCP" in cp.stderr, cp.stderr.decode(errors="replace")
    assert not list(cluster.path(1, RUNTIME_DIR).glob(f"{records.PREFIX}*{records.SUFFIX}"))


@pytest.mark.timeout(60)
def test_unreachable_address(cluster: NetnsCluster) -> None:
    closed_port = f"tcp://{cluster.ip(1)}:26999"  # host 1 is up; nothing listens there
    net = cluster.subnet.rsplit(".", 1)[0]
    no_host = f"tcp://{net}.200:{PORT}"  # in the cluster subnet, but no such host
    ctl = Controller(
        cluster,
        """
        for addr in WORKERS:
            t0 = time.monotonic()
            try:
                attach_to_workers(workers=[addr], ca="/tmp/key")
                emit("attached", addr=addr)
            except ConnectError as e:
                emit("unreachable", addr=addr, elapsed=time.monotonic() - t0, **describe(e))
        """,
        workers=[closed_port, no_host],
        MONARCH_NB_CONNECT_TIMEOUT="3",
    )
    seen = []
    for _ in range(2):
        line = ctl.out.wait_for(lambda s: _step(s) in ("unreachable", "attached", "error") and s not in seen, 20)
        assert line is not None, ctl.describe()
        seen.append(line)
        msg = json.loads(line)
        assert msg["step"] == "unreachable", ctl.describe()
        assert msg["addr"] in msg["msg"], msg
        assert msg["elapsed"] < 3 + 1.5, msg
    assert [json.loads(s)["addr"] for s in seen] == [closed_port, no_host]
    ctl.finish()


# A mesh over both workers with two actor meshes on the same procs: "a" answers
# at once, "s" sleeps 30 s in every proc.  The controller announces the long
# call, waits for the test's "go" (sent right after the fault is injected), and
# measures from there until `.get()` raises.  Then it checks that host 1 still
# answers.
FAULT_BODY = """
hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
procs = hosts.spawn_procs(per_host={"gpus": 2}, name="m5")
actors = procs.spawn("a", A)
sleepers = procs.spawn("s", Sleeper)
emit("ready", where=actors.where.call().get(timeout=30).values())
fut = sleepers.sleep.call(30)
emit("calling")
sys.stdin.readline()
t0 = time.monotonic()
try:
    fut.get(timeout=25)
    emit("returned")
except SupervisionError as e:
    emit("failed", elapsed=time.monotonic() - t0, **describe(e))
vm = actors.slice(hosts=0).where.call().get(timeout=10)
emit("survivors", values=vm.values())
"""


def _check_host_failure(cluster: NetnsCluster, ctl: Controller, alloc: Allocator) -> None:
    failed = ctl.expect("failed", timeout=20)
    assert failed["type"] == "SupervisionError", failed
    assert failed["elapsed"] < 3, failed
    assert failed["mesh"] == "m5" and "'m5'" in failed["msg"], failed
    assert failed["rank"] in (2, 3), failed  # host 2's ranks
    # the host is named by its hostname, the same in every namespace here, and its allocator address
    assert failed["host"] == socket.gethostname(), failed
    assert f"host {failed['host']}" in failed["msg"], failed
    assert alloc.addr in failed["msg"], failed
    # as Monarch's: the hook hears of each actor mesh on the dead procs ("a" spawned first)
    fault = ctl.expect("fault", timeout=10)
    assert fault["mesh"] == "a" and "'m5'" in fault["report"], fault
    survivors = ctl.expect("survivors", timeout=15)["values"]
    assert [v["ip"] for v in survivors] == [cluster.ip(1)] * 2
    assert [v["coords"] for v in survivors] == [{"gpus": 0}, {"gpus": 1}]


@pytest.mark.timeout(120)
def test_allocator_killed_mid_call(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    victim = workers[1]
    ctl = Controller(cluster, FAULT_BODY)
    ctl.expect("ready")
    # allocator, zygote and the two procs of this mesh
    assert len(monarch_processes(cluster, 2)) == 4, monarch_processes(cluster, 2)
    ctl.expect("calling")
    os.kill(victim.pid, signal.SIGKILL)
    ctl.send("go\n")
    _check_host_failure(cluster, ctl, victim)
    # the zygote and the procs die with their allocator
    wait_for(lambda: not monarch_processes(cluster, 2), 10, "every monarch_nb process of host 2 to exit")
    assert len(monarch_processes(cluster, 1)) == 4, monarch_processes(cluster, 1)
    ctl.finish()


@pytest.mark.timeout(120)
def test_link_down_mid_call(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(cluster, FAULT_BODY)
    ctl.expect("ready")
    ctl.expect("calling")
    assert len(zygote_processes(cluster, 2)) == 3
    cluster.link_down(2)
    ctl.send("go\n")
    _check_host_failure(cluster, ctl, workers[1])
    ctl.finish()
    # cut off from its controller, host 2's allocator reaps the script's mesh on its own
    wait_for(lambda: len(zygote_processes(cluster, 2)) == 1, 20, "host 2 to reap the orphaned procs")
    assert workers[1].popen.poll() is None, workers[1].describe()


# Stops a mesh and says how long `stop()` itself took to return its future ("returned") and how
# long until that future failed or resolved ("elapsed").
# "killed": the ProcsKilledWarnings that reading it showed.
TIMED_STOP = """
import warnings
t0 = time.monotonic()
fut = procs.stop()
returned = time.monotonic() - t0
with warnings.catch_warnings(record=True) as shown:
    warnings.simplefilter("always")
    try:
        fut.get(timeout=20)
        outcome = dict(ok=True)
    except Exception as e:
        outcome = dict(ok=False, **describe(e))
killed = [str(w.message) for w in shown if w.category is monarch_actor.ProcsKilledWarning]
emit("stop", returned=returned, elapsed=time.monotonic() - t0, killed=killed, **outcome)
"""


@pytest.mark.timeout(120)
def test_stop_after_host_loss(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(cluster, FAULT_BODY + TIMED_STOP)
    ctl.expect("calling")
    cluster.link_down(2)
    ctl.send("go\n")
    ctl.expect("survivors", timeout=20)
    result = ctl.expect("stop", timeout=30)
    ctl.finish()
    # stopping does not wait on the lost host: `stop()` returns at once (a hello to the lost
    # allocator first held it for the whole heartbeat timeout, 1.5 s here) and host 2's part
    # fails at once, naming it
    assert result["returned"] < 1.0, result
    assert result["type"] == "SupervisionError" and workers[1].addr in result["msg"], result
    # what it waits for is host 1: its Sleeper, still in its 30 s call, gets stop_cleanup_timeout
    # (2 s) to finish it and is then killed (its allocator's log says what took longer)
    assert result["elapsed"] < 5, f"{result}\n{workers[0].describe()}"
    # and the user is told so, next to host 2's failure (the failure alone hid it)
    assert len(result["killed"]) == 1 and "killed 2 proc(s)" in result["killed"][0], result
    wait_for(lambda: len(zygote_processes(cluster, 1)) == 1, 10, "procs on host 1 to exit")


# Idle procs on hosts 1 and 2; after "go", a call to host 2's waits for its loss ("lost").
IDLE_BODY = """
hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
procs = hosts.spawn_procs(per_host={"gpus": 2}, name="m6")
actors = procs.spawn("a", A)
emit("ready", where=actors.where.call().get(timeout=30).values())
sys.stdin.readline()
try:
    actors.slice(hosts=1).where.call().get(timeout=30)
    raise AssertionError("host 2 answered with its link down")
except SupervisionError as e:
    emit("lost", **describe(e))
"""


@pytest.mark.timeout(120)
def test_stop_of_idle_procs_after_host_loss_is_quick(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    # the controller gives up on a silent host after 4 s here, which a stop that waited on the
    # lost host (a hello to it, for that long) could not hide behind host 1's quick stop
    ctl = Controller(cluster, IDLE_BODY + TIMED_STOP, MONARCH_NB_HEARTBEAT_TIMEOUT="4")
    ctl.expect("ready")
    cluster.link_down(2)
    ctl.send("go\n")
    lost = ctl.expect("lost", timeout=30)
    assert workers[1].addr in lost["msg"], lost
    result = ctl.expect("stop", timeout=30)
    ctl.finish()
    assert result["returned"] < 1.0, result
    # host 1's idle procs stop in a moment, and the stop says host 2's part failed
    assert result["elapsed"] < 2.5, result
    assert result["type"] == "SupervisionError" and workers[1].addr in result["msg"], result
    wait_for(lambda: len(zygote_processes(cluster, 1)) == 1, 10, "procs on host 1 to exit")


@pytest.mark.timeout(120)
def test_shutdown_of_hosts_after_host_loss_is_quick(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    # HostMesh.shutdown() after host 2 is lost, with a 4 s heartbeat timeout: a hello to the
    # lost allocator first held it that long (each lost host in turn)
    timed_shutdown = """
        t0 = time.monotonic()
        fut = hosts.shutdown()
        returned = time.monotonic() - t0
        try:
            fut.get(timeout=20)
            emit("shutdown", ok=True, returned=returned, elapsed=time.monotonic() - t0)
        except Exception as e:
            emit("shutdown", ok=False, returned=returned, elapsed=time.monotonic() - t0, **describe(e))
        """
    ctl = Controller(cluster, IDLE_BODY + textwrap.dedent(timed_shutdown), MONARCH_NB_HEARTBEAT_TIMEOUT="4")
    ctl.expect("ready")
    cluster.link_down(2)
    ctl.send("go\n")
    assert workers[1].addr in ctl.expect("lost", timeout=30)["msg"]
    result = ctl.expect("shutdown", timeout=30)
    ctl.finish()
    assert result["returned"] < 1.0, result
    # host 1 is shut down in a moment, and the shutdown says host 2's part failed, naming it,
    # and what became of its allocator
    assert result["elapsed"] < 2.5, result
    assert result["type"] == "SupervisionError" and workers[1].addr in result["msg"], result
    assert "no heartbeat" in result["msg"] and "not asked to shut down" in result["msg"], result
    try:
        workers[0].popen.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host 1's allocator did not exit after the shutdown\n{workers[0].describe()}")
    assert workers[1].popen.poll() is None  # host 2's, cut off, never heard it


@pytest.mark.timeout(120)
def test_spawn_failing_after_another_host_is_lost_fails_at_once(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    # host 2's proc is up, host 1's waits in its bootstrap; host 2 is lost (a 4 s heartbeat
    # timeout), then host 1's bootstrap fails: the spawn's cleanup of host 2's part sent it a
    # hello first, which held the SpawnError that long
    body = """
        def boot():
            if os.path.exists("/tmp/hold"):  # host 1 only: each host has its own /tmp
                deadline = time.monotonic() + 60
                while not os.path.exists("/tmp/fail") and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("bootstrap failed on purpose")

        from monarch_nb.actor import _context

        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        # the test cuts host 2 once its spawn's answer is here: only then does the failed
        # spawn have host 2's part to clean up (the path under test)
        client = _context.client()
        request = client.request

        def told(alloc, kind, *args, **kwargs):
            fut = request(alloc, kind, *args, **kwargs)
            if kind == "spawn" and alloc == WORKERS[1]:
                fut.add_done_callback(lambda f: emit("host 2 spawned", ok=f.exception(timeout=0) is None))
            return fut

        client.request = told
        emit("spawning")
        try:
            hosts.spawn_procs(per_host={"gpus": 1}, bootstrap=boot, name="m7")
            emit("spawned")
        except Exception as e:
            emit("spawn", t=time.time(), **describe(e))
        """
    cluster.path(1, "/tmp/hold").write_text("")
    ctl = Controller(cluster, body, MONARCH_NB_HEARTBEAT_TIMEOUT="4")
    ctl.expect("spawning")
    assert ctl.expect("host 2 spawned", timeout=30)["ok"], ctl.describe()
    cluster.link_down(2)
    lost = ctl.err.wait_for(lambda s: f"allocator {workers[1].addr} lost: no heartbeat" in s, 30)
    assert lost is not None, ctl.describe()
    released = time.time()
    cluster.path(1, "/tmp/fail").write_text("")
    result = ctl.expect("spawn", timeout=30)
    ctl.finish()
    assert result["type"] == "SpawnError" and "bootstrap failed on purpose" in result["msg"], result
    assert result["t"] - released < 2.5, result
    wait_for(lambda: len(zygote_processes(cluster, 1)) == 1, 10, "procs on host 1 to exit")


@pytest.mark.timeout(120)
def test_status_of_hosts_all_lost_takes_its_timeout_not_a_hello_each(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    # both hosts lost (a 4 s heartbeat timeout): introspect.status() gave each a hello first,
    # one after another (8 s, past its own 2 s timeout); now together, within that timeout
    body = """
        import monarch_nb.introspect
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="m8")
        actors = procs.spawn("a", A)
        emit("ready", where=actors.where.call().get(timeout=30).values())
        sys.stdin.readline()
        for h in (0, 1):
            try:
                actors.slice(hosts=h).where.call().get(timeout=30)
                raise AssertionError(f"host {h + 1} answered with its link down")
            except SupervisionError:
                pass
        emit("lost")
        t0 = time.monotonic()
        st = monarch_nb.introspect.status(addresses=WORKERS, timeout=2, local=False)
        emit("status", elapsed=time.monotonic() - t0, errors={a["addr"]: a.get("error") for a in st["allocators"]})
        """
    ctl = Controller(cluster, body, MONARCH_NB_HEARTBEAT_TIMEOUT="4")
    ctl.expect("ready")
    cluster.link_down(1)
    cluster.link_down(2)
    ctl.send("go\n")
    ctl.expect("lost", timeout=30)
    result = ctl.expect("status", timeout=30)
    ctl.finish()
    assert result["elapsed"] < 4, result
    # each says it is lost, and why
    assert sorted(result["errors"]) == sorted(w.addr for w in workers), result
    for w in workers:
        assert f"allocator {w.addr} lost: no heartbeat" in result["errors"][w.addr], result


@pytest.mark.timeout(120)
def test_second_controller_reattaches(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    first = Controller(
        cluster,
        """
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2}, name="keep", persist=True)
        actors = procs.spawn("a", A)
        actors.bump.broadcast(3)
        emit("spawned", where=actors.where.call().get(timeout=30).values(),
             counts=actors.count.call().get(timeout=30).values())
        """,
    )
    spawned = first.expect("spawned")
    assert spawned["counts"] == [3] * 4
    first.finish()

    second = Controller(
        cluster,
        """
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        pm = ProcMesh.lookup("keep", hosts=hosts)
        emit("found", extent=dict(pm.extent))
        am = pm.actor_mesh("a")
        emit("where", values=am.where.call().get(timeout=30).values())
        am.bump.broadcast(1)
        emit("counts", values=am.count.call().get(timeout=30).values())
        pm.stop().get(timeout=30)
        emit("stopped")
        """,
    )
    assert second.expect("found")["extent"] == {"hosts": 2, "gpus": 2}
    # the very same actors (same processes, same state) on the same hosts
    assert second.expect("where")["values"] == spawned["where"]
    assert second.expect("counts")["values"] == [4] * 4
    second.expect("stopped")
    second.finish()
    for i in (1, 2):
        wait_for(lambda i=i: len(zygote_processes(cluster, i)) == 1, 10, f"procs on host {i} to exit")


@pytest.mark.timeout(120)
def test_reattached_controller_stops_orphaned_mesh(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    first = Controller(
        cluster,
        """
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        hosts.spawn_procs(per_host={"gpus": 2}, name="keep", persist=True)
        emit("spawned")
        """,
    )
    first.expect("spawned")
    first.finish()  # its client said bye to both allocators: the mesh has no attached owner now
    second = Controller(
        cluster,
        """
        pm = ProcMesh.lookup("keep", hosts=attach_to_workers(workers=WORKERS, ca="/tmp/key"))
        try:
            pm.stop().get(timeout=30)
            emit("stop", ok=True)
        except Exception as e:
            emit("stop", ok=False, **describe(e))
        """,
    )
    result = second.expect("stop")
    second.finish()
    assert result["ok"], result
    for i in (1, 2):
        wait_for(lambda i=i: len(zygote_processes(cluster, i)) == 1, 10, f"procs on host {i} to exit")


SYNC_MODULE = """
from monarch_nb.actor import Actor, endpoint


class Worker(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def hello(self):
        import os
        self.calls += 1
        return ("{version}", self.calls, os.getpid(), __file__)
"""


@pytest.mark.timeout(180)
def test_sync_to_hosts_that_cannot_see_the_controllers_files(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(
        cluster,
        f"""
        import monarch_nb.mesh as M, monarch_nb.sync as S
        SRC = {SYNC_MODULE!r}
        os.makedirs("/tmp/ws", exist_ok=True)
        open("/tmp/ws/mymod.py", "w").write(SRC.format(version="v1"))
        open("/tmp/ws/notes.txt", "w").write("x" * 5000)
        sys.path.insert(0, "/tmp/ws")
        M.connect(*WORKERS, key_file="/tmp/key")
        pm = M.spawn("syncd", {{"gpus": 2}})
        r = S.sync("/tmp/ws", meshes=pm)[0]
        emit("synced", hosts=[(h.allocator, h.bytes_sent, sorted(h.added), h.path) for h in r.hosts])
        import mymod
        w = pm.spawn("w", mymod.Worker)
        emit("v1", vals=w.hello.call().get(timeout=30).values())
        open("/tmp/ws/mymod.py", "w").write(SRC.format(version="v2"))
        r = S.sync("/tmp/ws", meshes=pm)[0]
        emit("resynced", size=os.path.getsize("/tmp/ws/mymod.py"),
             hosts=[(h.allocator, h.bytes_sent, h.changed, h.added) for h in r.hosts],
             reload_pids=sorted(x["pid"] for x in r.reloads))
        emit("v2", vals=w.hello.call().get(timeout=30).values())
        M.stop("syncd")
        """,
    )
    synced = ctl.expect("synced", 90)["hosts"]
    assert sorted(a for a, *_ in synced) == sorted(w.addr for w in workers)
    for _addr, sent, added, _path in synced:
        assert added == ["mymod.py", "notes.txt"] and sent == 5000 + len(SYNC_MODULE.format(version="v1"))
    v1 = ctl.expect("v1")["vals"]
    assert [v[:2] for v in v1] == [["v1", 1]] * 4
    for i, (_version, _calls, _pid, file) in enumerate(v1):
        host = 1 + i // 2
        # the module came from that host's own cache; the controller's copy is invisible there
        assert file.startswith("/tmp/mnb/mnb-code/ws/") and cluster.path(host, file).exists(), file
        assert not cluster.path(host, "/tmp/ws/mymod.py").exists()
    re_ = ctl.expect("resynced")
    for _addr, sent, changed, added in re_["hosts"]:
        assert changed == ["mymod.py"] and added == [] and sent == re_["size"]  # only the changed file's bytes
    assert re_["reload_pids"] == sorted(v[2] for v in v1)
    v2 = ctl.expect("v2")["vals"]
    assert [v[:2] for v in v2] == [["v2", 2]] * 4  # new endpoint code on the same actors, no respawn
    assert [v[2] for v in v2] == [v[2] for v in v1]
    ctl.finish()


@pytest.mark.timeout(120)
def test_stacks_of_ranks_on_other_hosts(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(
        cluster,
        """
        from monarch_nb import debug
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        sleepers = procs.spawn("s", Sleeper)
        pending = sleepers.sleep.call(5)
        deadline = time.monotonic() + 20
        while True:  # until every rank is in its sleep
            st = debug.stacks(procs, native=True, timeout=10)
            if "[ranks 0-3 (4)] call s.sleep" in str(st) or time.monotonic() > deadline:
                break
        emit(
            "stacks",
            answered=[r.rank for r in st.ranks if r.threads is not None],
            native=[r.rank for r in st.ranks if "Sleeper.sleep" in r.native or "sleep (" in r.native],
            text=str(st),
        )
        pending.get(timeout=30)
        procs.stop().get(timeout=30)
        """,
    )
    got = ctl.expect("stacks", timeout=60)
    assert got["answered"] == [0, 1, 2, 3], got["text"]
    # every rank in the sleep, merged into one stack; py-spy ran by each rank's own allocator
    assert "[ranks 0-3 (4)] thread monarch-actor-driver" in got["text"] and "time.sleep(seconds)" in got["text"], got["text"]
    assert got["native"] == [0, 1, 2, 3], got["text"]
    ctl.finish()


def test_telemetry_gathers_spans_of_every_host_on_one_timeline(cluster: NetnsCluster, workers: list[Allocator]) -> None:
    ctl = Controller(
        cluster,
        """
        from monarch_nb import telemetry
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        t0 = time.time()
        procs.spawn("a", A).where.call().get(timeout=30)
        rows = [r for r in telemetry.query_records(since=t0, addresses=WORKERS) if r["name"] == "a.where"]
        trace = telemetry.chrome_trace(rows)
        summary = telemetry.latency_summary(since=t0, addresses=WORKERS)
        emit(
            "spans",
            summary=(sorted((r["rank"], r["calls"]) for r in summary["ranks"]), summary["unreachable"]),
            ranks=sorted(r["rank"] for r in rows),
            pids=len({r["pid"] for r in rows}),
            offsets=sorted({round(r["clock_offset"], 6) for r in rows}),
            starts_ok=all(t0 - 1 <= r["start"] <= time.time() for r in rows),
            events=sum(e["ph"] == "X" for e in trace["traceEvents"]),
        )
        procs.stop().get(timeout=30)
        """,
    )
    got = ctl.expect("spans", timeout=60)
    # the four ranks' calls, measured in four procs on two hosts, each host's offset applied
    assert got["ranks"] == [0, 1, 2, 3] and got["pids"] == 4 and got["events"] == 4, got
    # the dashboard's summary of the same calls, reduced by each host's allocator
    assert got["summary"] == [[[0, 1], [1, 1], [2, 1], [3, 1]], []], got
    assert len(got["offsets"]) == 2 and all(abs(o) < 0.5 for o in got["offsets"]), got
    assert got["starts_ok"], got
    ctl.finish()
