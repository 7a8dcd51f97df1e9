"""Allocator records and the runtime directory: who may write them, and one allocator per host."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import tempfile

import pytest
from _nobody import run_as_nobody
from conftest import PY

from monarch_nb._runtime import records
from monarch_nb.config import Config, runtime_dir
from monarch_nb.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534


@pytest.fixture
def rdir():
    # short: ipc socket paths in it must stay under 108 bytes
    d = tempfile.mkdtemp(prefix="mnbr-", dir="/tmp")
    yield d
    subprocess.run([PY, "-m", "monarch_nb", "allocator", "stop"], env=dict(os.environ, MONARCH_NB_RUNTIME_DIR=d), timeout=60)
    subprocess.run(["rm", "-rf", d], check=False)


def test_our_runtime_dir_open_to_others_is_made_private_with_a_warning(rdir: str) -> None:
    os.chmod(rdir, 0o755)
    with pytest.warns(RuntimeWarning, match="was mode 755, open to other users; made it 0700"):
        assert runtime_dir(Config(runtime_dir=rdir)) == rdir
    assert os.stat(rdir).st_mode & 0o777 == 0o700


def test_a_directory_others_use_is_never_closed_to_them(rdir: str) -> None:
    """MONARCH_NB_RUNTIME_DIR=/ (or a home, or /run), run as root, made / mode 700."""
    os.chmod(rdir, 0o755)
    with open(os.path.join(rdir, "notes.txt"), "w"):
        pass
    with pytest.raises(ConfigError, match=r"open to other users \(mode 755\) and holds files that are not monarch_nb's"):
        runtime_dir(Config(runtime_dir=rdir))
    assert os.stat(rdir).st_mode & 0o777 == 0o755
    # one monarch_nb already used (its lock is there) is ours, and made private as before
    with open(os.path.join(rdir, "allocator.lock"), "w"):
        pass
    with pytest.warns(RuntimeWarning, match="made it 0700"):
        runtime_dir(Config(runtime_dir=rdir))
    assert os.stat(rdir).st_mode & 0o777 == 0o700


def _allocator_start_refused(rdir: str, words: str) -> None:
    """``monarch-nb allocator start`` with runtime dir ``rdir`` fails, saying ``words``."""
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir)
    r = subprocess.run([PY, "-m", "monarch_nb", "allocator", "start"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and words in r.stderr, r.stderr


def test_a_runtime_dir_of_another_user_is_refused(rdir: str) -> None:
    assert os.geteuid() == 0, "needs root to give a directory to another user"
    os.chown(rdir, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to you.*MONARCH_NB_RUNTIME_DIR"):
        runtime_dir(Config(runtime_dir=rdir))
    _allocator_start_refused(rdir, f"belongs to uid {NOBODY}")
    assert records.read_connection_files(rdir) == [] and not any(n.startswith("allocator-start") for n in os.listdir(rdir))


def test_a_runtime_dir_another_user_could_swap_is_refused(rdir: str) -> None:
    """MONARCH_NB_RUNTIME_DIR=/tmp/rt: another user planted /tmp/rt as a link to the user's own
    private directory, passing every check, to point it at theirs once our processes use it."""
    assert os.geteuid() == 0, "needs root to give a link or directory to another user"
    shared = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    try:
        os.chmod(shared, 0o1777)
        link = os.path.join(shared, "rt")
        os.symlink(rdir, link)
        os.lchown(link, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match=f"goes through {link}, a symbolic link of uid {NOBODY}"):
            runtime_dir(Config(runtime_dir=link))
        _allocator_start_refused(link, f"a symbolic link of uid {NOBODY}")
        assert os.listdir(rdir) == []
        # a link of the user's own is followed, as before
        os.lchown(link, 0, 0)
        assert runtime_dir(Config(runtime_dir=link)) == link

        # a directory of the user's inside one another user owns: they can rename it away
        theirs = os.path.join(shared, "theirs")
        os.mkdir(theirs)
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(ConfigError, match=f"is inside {theirs}, which belongs to uid {NOBODY}"):
            runtime_dir(Config(runtime_dir=os.path.join(theirs, "rt")))
        open_dir = os.path.join(shared, "open")
        os.mkdir(open_dir)
        os.chmod(open_dir, 0o777)
        with pytest.raises(ConfigError, match=r"which anyone may write \(mode 777\)"):
            runtime_dir(Config(runtime_dir=os.path.join(open_dir, "rt")))
    finally:
        subprocess.run(["rm", "-rf", shared], check=False)


def test_the_directories_made_above_a_runtime_dir_are_not_others_to_write_whatever_the_umask(rdir: str) -> None:
    """MONARCH_NB_RUNTIME_DIR=/data/me/new/rt under ``umask 000``: the checks passed (nothing
    above rt existed yet), then makedirs made ``new`` 0777, and any other user could rename rt
    away and put a directory of theirs in its place while our processes used it; every later start
    was refused for a directory monarch_nb itself had made."""
    assert os.geteuid() == 0, "needs root to act as another user"
    os.chmod(rdir, 0o755)
    path = os.path.join(rdir, "new", "deeper", "rt")
    old = os.umask(0)
    try:
        assert runtime_dir(Config(runtime_dir=path)) == path
    finally:
        os.umask(old)
    moved = run_as_nobody(
        "import os, sys\ntry:\n    os.rename(sys.argv[1], sys.argv[1] + '.theirs')\n    print('moved')\n"
        "except PermissionError:\n    print('refused')",
        path,
    )
    assert moved.strip() == "refused"
    assert [stat.S_IMODE(os.stat(os.path.join(rdir, *p)).st_mode) for p in (["new"], ["new", "deeper"])] == [0o755, 0o755]
    assert runtime_dir(Config(runtime_dir=path)) == path  # and the next start takes it


def test_a_shared_sticky_dir_is_never_taken_over(rdir: str) -> None:
    os.chmod(rdir, 0o1777)
    with pytest.raises(ConfigError, match="shared directory"):
        runtime_dir(Config(runtime_dir=rdir))
    assert os.stat(rdir).st_mode & 0o7777 == 0o1777


def test_connection_files_others_could_have_written_are_ignored(rdir: str) -> None:
    """A decoy naming a live pid and an existing socket is believed only when it is ours and 0600."""
    sock_path = os.path.join(rdir, "decoy.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    try:
        info = {"alloc_id": "decoy", "pid": os.getpid(), "host": socket.gethostname(), "addr": f"ipc://{sock_path}"}
        path = records.write_connection_file(rdir, "decoy", info)
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert records.find_local_allocator(rdir)["addr"] == info["addr"]  # type: ignore[index]

        os.chmod(path, 0o666)
        assert records.read_connection_files(rdir) == [] and records.find_local_allocator(rdir) is None

        assert os.geteuid() == 0, "needs root to give a file to another user"
        os.chmod(path, 0o600)
        os.chown(path, NOBODY, NOBODY)
        assert records.read_connection_files(rdir) == [] and records.find_local_allocator(rdir) is None
        env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir)
        r = subprocess.run([PY, "-m", "monarch_nb", "allocator", "status"], env=env, capture_output=True, text=True, timeout=60)
        assert "decoy" not in r.stdout and f"owned by uid {NOBODY}" in r.stderr, (r.stdout, r.stderr)
    finally:
        listener.close()


def test_a_symlinked_connection_file_is_ignored(rdir: str) -> None:
    other = tempfile.mkdtemp(prefix="mnbr-", dir="/tmp")
    try:
        target = records.write_connection_file(other, "elsewhere", {"alloc_id": "elsewhere", "pid": os.getpid()})
        os.symlink(target, records.path_for(rdir, "elsewhere"))
        assert records.read_connection_files(rdir) == []
        assert [i["alloc_id"] for i in records.read_connection_files(other)] == ["elsewhere"]
    finally:
        subprocess.run(["rm", "-rf", other], check=False)


def test_a_connection_file_another_user_wrote_is_refused_when_named(rdir: str) -> None:
    """`%mesh connect FILE` believed any file: one another user wrote (in /tmp, a shared folder)
    named their socket, and the controller connected to it, sent its hello and would have
    unpickled their answer. Now refused as :func:`records.read_connection_files` ignores it,
    with what to do; the user's own 0600 file (a symlink to it too) is read as before."""
    from _nobody import run_as_nobody

    from monarch_nb import mesh
    from monarch_nb.config import configured
    from monarch_nb.errors import ConnectError

    theirs = tempfile.mkdtemp(prefix="mnbr-", dir="/tmp")
    os.chown(theirs, NOBODY, NOBODY)
    sock_path = os.path.join(theirs, "a.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen()
    listener.setblocking(False)
    info = {"alloc_id": "decoy", "pid": os.getpid(), "host": socket.gethostname(), "addr": f"ipc://{sock_path}"}
    planted = os.path.join(theirs, "conn.json")
    try:
        run_as_nobody("import sys; open(sys.argv[1], 'w').write(sys.argv[2])", planted, json.dumps(info))
        with configured(connect_timeout=2), pytest.raises(ConnectError, match=f"owned by uid {NOBODY}.*chmod 600"):
            mesh.connect(planted)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the controller never connected to their socket

        mine = os.path.join(rdir, "copied.json")
        with open(mine, "w") as f:
            json.dump(info, f)
        os.chmod(mine, 0o664)
        with pytest.raises(ConnectError, match="other users may write it"):
            records.read_connection_file(mine)
        os.chmod(mine, 0o600)
        os.symlink(mine, os.path.join(rdir, "link.json"))
        assert records.read_connection_file(os.path.join(rdir, "link.json"))["addr"] == info["addr"]
    finally:
        listener.close()
        subprocess.run(["rm", "-rf", theirs], check=False)


_RACER = """
import json, sys
from _gate import wait
if not wait(sys.argv[1], 60):  # all racers released at once
    sys.exit("never released")
from monarch_nb.actor import this_host
host = this_host()
pm = host.spawn_procs(per_host={"procs": 1})
print(json.dumps({"alloc": host._refs()[0].alloc, "procs": len(pm._procs)}), flush=True)
pm.stop().get(timeout=30)
"""


def _allocator_pids(rdir: str) -> list[int]:
    """Allocator daemons (not their zygotes) whose runtime dir is ``rdir``."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.cmdline()[1:4] == ["-m", "monarch_nb", "allocator"] and p.environ().get("MONARCH_NB_RUNTIME_DIR") == rdir:
                out.append(p.pid)
        except (psutil.Error, OSError, IndexError):
            pass
    return out


def _first_line(proc: subprocess.Popen[str], timeout: float, what: str) -> str:
    """The first line ``proc`` prints, or an assertion error naming ``what`` it waited for."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=timeout), f"no line from the script within {timeout} s: {what}"
    return proc.stdout.readline().strip()


def test_concurrent_controllers_on_a_fresh_runtime_dir_share_one_allocator(rdir: str, gate) -> None:  # type: ignore[no-untyped-def]
    go = gate()
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))  # for _gate
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="", PYTHONPATH=path)
    racers = [
        subprocess.Popen([PY, "-c", _RACER, go.path], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    try:
        go.open()
        outs = [r.communicate(timeout=100) for r in racers]
    finally:
        for r in racers:
            r.kill()
    assert all(r.returncode == 0 for r in racers), [err[-2000:] for _, err in outs]
    files = records.read_connection_files(rdir)
    assert len(files) == 1, files
    assert _allocator_pids(rdir) == [files[0]["pid"]]
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert seen == [{"alloc": files[0]["addr"], "procs": 1}] * 8


def test_an_allocator_that_died_unreaped_is_not_taken_for_the_running_one(rdir: str) -> None:
    # a kernel that started the host's allocator never waits for it: if the allocator dies,
    # its pid stays a zombie and its socket file stays, and every later controller waited for
    # heartbeats from it (1.5 s each, every spawn of a CI run failing); this process is the
    # parent here and does not reap it until the end
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    log = open(os.path.join(rdir, "dead.log"), "wb")
    dead = subprocess.Popen([PY, "-m", "monarch_nb", "allocator"], env=env, stdout=log, stderr=log)
    try:
        from conftest import wait_for

        info = wait_for(lambda: records.find_local_allocator(rdir), 60, "the allocator's connection file")
        assert info["pid"] == dead.pid
        os.kill(dead.pid, 9)
        wait_for(lambda: os.waitid(os.P_PID, dead.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG), 10, "its death")
        addr = info["addr"][len("ipc://") :]
        assert os.path.exists(addr) and os.path.exists(info["file"])  # what it left looks alive
        assert records.find_local_allocator(rdir) is None
        fresh = records.local_allocator(rdir, timeout=60)
        assert fresh["pid"] != dead.pid
    finally:
        dead.kill()
        dead.wait(10)
        log.close()


_SCRIPT_PRELUDE = r"""
import json, sys, threading, time
import monarch_nb.actor as public
from monarch_nb.actor import Actor, endpoint, this_host, _context
from monarch_nb.allocator import list_allocators, stop_allocator

failures = []
reported = threading.Event()  # the hook runs on a thread of its own

def _hook(f):
    failures.append(f.report())
    reported.set()

public.unhandled_fault_hook = _hook

class Slow(Actor):
    @endpoint
    def wait(self) -> int:
        threading.Event().wait(120)  # answers only if nothing stops it
        return 1

    @endpoint
    def ping(self) -> int:
        return 2

def start_waiting():
    return this_host().spawn_procs(per_host={"gpus": 1}).spawn("slow", Slow).wait.call_one()

def error_of(fut, timeout=60):
    try:
        fut.get(timeout=timeout)
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
"""

_STOP_FROM_ITS_OWN_CONTROLLER = (
    _SCRIPT_PRELUDE
    + r"""
pending = start_waiting()
(alloc,) = list_allocators()
t0 = time.monotonic()
stopped = stop_allocator(timeout=60)
took = time.monotonic() - t0
err = error_of(pending, 30)
print(json.dumps({"stopped": stopped, "pid": int(alloc["pid"]), "took": took, "err": err,
                  "alive": [a["pid"] for a in list_allocators() if a["alive"]]}), flush=True)
"""
)


def test_stop_allocator_from_the_controller_that_started_it_returns_at_once_without_an_alarm(rdir: str) -> None:
    # the allocator a script starts is the script's child: once it exited it stayed a zombie, and
    # stop_allocator waited its whole timeout for it, then "killed" it; the script's client then
    # raised "allocator lost: no heartbeat" and spent 2 s more on a goodbye at exit
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    r = subprocess.run([PY, "-c", _STOP_FROM_ITS_OWN_CONTROLLER], env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stopped"] == [out["pid"]] and out["alive"] == []
    assert out["took"] < 30, out  # not the 60 s timeout
    # the call pending on it fails, saying who stopped the allocator
    assert "stopped by stop_allocator()" in out["err"], out
    assert "no heartbeat" not in r.stderr, r.stderr[-3000:]
    assert not _allocator_pids(rdir)


_STOP_WHILE_PROCS_CALL_PROCS = (
    _SCRIPT_PRELUDE
    + r"""
import asyncio

class Relay(Actor):
    @endpoint
    async def slow(self) -> int:
        await asyncio.sleep(120)  # answers only if nothing stops it
        return 1

    @endpoint
    async def call_a_peer(self, other) -> int:
        return sum((await other.ping.call()).values())

pm = this_host().spawn_procs(per_host={"gpus": 2}, name="relaying")
a, b = pm.spawn("a", Relay), pm.spawn("b", Slow)
# each rank of `a` called `b`: each proc watches its allocator now (and hears it shut down)
a.call_a_peer.call(b).get(timeout=60)
pending = a.slow.call()
stopped = stop_allocator(timeout=60)
print(json.dumps({"stopped": stopped, "err": error_of(pending, 30)}), flush=True)
"""
)


def test_stop_allocator_while_procs_call_procs_prints_no_traceback_from_the_procs(rdir: str) -> None:
    # each proc that called a peer watched its allocator: it logged "[0] allocator ... was shut
    # down" on hearing the shutdown it is part of, then its bootstrap's goodbye to that
    # allocator raised, "[0] Traceback ... SupervisionError ... was shut down", on every rank
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    r = subprocess.run([PY, "-c", _STOP_WHILE_PROCS_CALL_PROCS], env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "stopped by stop_allocator()" in out["err"], out  # the controller hears why, in the call's error
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert "] allocator " not in r.stderr + r.stdout, r.stderr[-3000:]
    # and the ranks' logs, as the allocator kept them, hold neither
    logs = subprocess.run([PY, "-m", "monarch_nb", "logs", "relaying"], env=env, capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0, logs.stderr
    assert "Traceback" not in logs.stderr + logs.stdout and "was shut down" not in logs.stderr + logs.stdout, logs


_HELD_WHILE_STOPPED = (
    _SCRIPT_PRELUDE
    + r"""
pending = start_waiting()
print("ready", flush=True)
err = error_of(pending)
lost = [str(w.lost) for w in _context.client().rt.supervision.watches.values()]
reported.wait(30)
# the kernel goes on: a new spawn starts a new allocator
again = this_host().spawn_procs(per_host={"gpus": 1}).spawn("again", Slow).ping.call_one().get(timeout=60)
print(json.dumps({"err": err, "lost": lost, "again": again, "failures": failures}), flush=True)
"""
)


def test_an_allocator_stopped_from_outside_tells_its_controllers_why(rdir: str) -> None:
    # `monarch-nb allocator stop` from a terminal while a script (a kernel) waits on a call:
    # the call used to fail with "mesh stopped (process ... killed by SIGKILL)", which does
    # not say who stopped it, and a heartbeat alarm ("allocator lost ... host down") followed
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    ctl = subprocess.Popen([PY, "-c", _HELD_WHILE_STOPPED], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _first_line(ctl, 60, "its mesh up") == "ready"
        stop = subprocess.run([PY, "-m", "monarch_nb", "allocator", "stop"], env=env, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        out, err = ctl.communicate(timeout=90)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(10)
    assert ctl.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert "was shut down (SIGTERM" in res["err"] and "monarch-nb allocator stop" in res["err"], res
    # for this controller its mesh failed (it did not stop it), as Monarch reports a killed host,
    # with the same cause; the allocator counts as gone: no heartbeat check is left to alarm
    assert res["failures"] and "was shut down (SIGTERM" in res["failures"][0], res
    assert any("was shut down (SIGTERM" in c for c in res["lost"]), res
    assert "no heartbeat" not in err, err[-3000:]
    assert res["again"] == 2


_SPAWN_AFTER_KILL = (
    _SCRIPT_PRELUDE
    + r"""
this_host().spawn_procs(per_host={"gpus": 1}).spawn("first", Slow).ping.call_one().get(timeout=60)
print(json.dumps({"pid": int(list_allocators()[0]["pid"])}), flush=True)
sys.stdin.readline()  # the test killed that allocator
try:
    got = this_host().spawn_procs(per_host={"gpus": 1}).spawn("again", Slow).ping.call_one().get(timeout=60)
except Exception as e:
    got = f"{type(e).__name__}: {e}"
print(json.dumps({"got": got, "pid": [int(a["pid"]) for a in list_allocators() if a["alive"]]}), flush=True)
"""
)


def test_a_spawn_right_after_the_local_allocator_was_killed_starts_a_new_one(rdir: str) -> None:
    # this_host() kept the dead allocator until a heartbeat timed out: a spawn in that window
    # failed with "allocator ... lost: no heartbeat" although this host could start a new one
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="", MONARCH_NB_HEARTBEAT_TIMEOUT="30")
    ctl = subprocess.Popen(
        [PY, "-c", _SPAWN_AFTER_KILL], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        from conftest import wait_for

        first = json.loads(_first_line(ctl, 60, "its mesh up"))
        assert ctl.stdin is not None
        os.kill(first["pid"], 9)
        wait_for(lambda: not records.find_local_allocator(rdir), 10, "the killed allocator to be gone")
        ctl.stdin.write("go\n")
        ctl.stdin.flush()
        out, err = ctl.communicate(timeout=90)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(10)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["got"] == 2, (res, err[-3000:])
    assert len(res["pid"]) == 1 and res["pid"][0] != first["pid"]


_SHUTDOWN_OWN_HOSTS = (
    _SCRIPT_PRELUDE
    + r"""
pending = start_waiting()
this_host().shutdown().get(timeout=30)
err = error_of(pending)
print(json.dumps({"err": err, "failures": failures}), flush=True)
"""
)


def test_shutting_down_its_own_hosts_stops_a_controllers_meshes_without_a_failure(rdir: str) -> None:
    # HostMesh.shutdown() (Monarch's) asked by this controller: its meshes there are stopped,
    # not failed (a script is not ended by the unhandled-failure hook), and what waited on
    # them fails saying why
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    r = subprocess.run([PY, "-c", _SHUTDOWN_OWN_HOSTS], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # "(mesh stopped)": the cause the client reports no mesh failure for (no report thread starts)
    assert "HostMesh.shutdown()" in res["err"] and res["err"].endswith("(mesh stopped)"), res
    assert res["failures"] == [], res
    assert "no heartbeat" not in r.stderr, r.stderr[-3000:]
    from conftest import wait_for

    # it stops its procs first (the busy one gets its __cleanup__ time), then exits
    wait_for(lambda: not _allocator_pids(rdir), 30, "the allocator to exit")


def test_terminate_reaps_a_child_that_exits_and_kills_one_that_ignores_sigterm() -> None:
    from monarch_nb._runtime._pids import terminate

    polite = subprocess.Popen([PY, "-c", "import signal; signal.pause()"])  # until a signal ends it
    stubborn = subprocess.Popen(
        [
            PY,
            "-c",
            "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); signal.pause()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _first_line(stubborn, 30, "its SIGTERM ignored") == "ready"
        left = terminate([polite.pid, stubborn.pid], timeout=1.0)
        # the one that ignored SIGTERM was SIGKILLed; the one that exited was reaped, not left a zombie
        assert left == [stubborn.pid]
        # reaped: no child of ours by that pid any more (its /proc entry may be a new process's
        # already: pids are reused within the suite on a machine with a small pid_max)
        with pytest.raises(ChildProcessError):
            os.waitpid(polite.pid, os.WNOHANG)
        assert stubborn.wait(10) == -9
    finally:
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_killed_allocator_is_listed_with_what_to_do_and_stop_removes_what_it_left(rdir: str) -> None:
    """kill -9 leaves the connection file and socket files: `allocator status` said only
    "dead", and `allocator stop` claimed it had "stopped" it and left the socket files."""
    import signal

    from conftest import wait_for

    from monarch_nb._runtime._pids import pid_alive

    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")

    def cli(*argv: str) -> str:
        r = subprocess.run([PY, "-m", "monarch_nb", "allocator", *argv], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r
        return r.stdout

    cli("start")
    (info,) = records.read_connection_files(rdir)
    pid = int(info["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 30, "the allocator to die")
    line = cli("status").rstrip("\n")
    assert line.startswith(f"{pid:>8} dead ") and line.endswith(
        f"(its process is gone: killed, or the host restarted; its meshes' procs went with it. "
        f"`monarch-nb allocator stop --pid {pid}` removes this record)"
    ), line
    assert cli("stop", "--pid", str(pid)) == f"removed the record of 1 allocator(s) whose process had already exited: [{pid}]\n"
    assert cli("status") == "no allocators registered\n"
    assert [n for n in os.listdir(rdir) if n.endswith((".sock", ".fast", ".json"))] == []
