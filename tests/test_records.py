"""Allocator records and the runtime directory: who may write them, and one allocator per host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile

import pytest
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


def test_a_runtime_dir_of_another_user_is_refused(rdir: str) -> None:
    assert os.geteuid() == 0, "needs root to give a directory to another user"
    os.chown(rdir, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to you.*MONARCH_NB_RUNTIME_DIR"):
        runtime_dir(Config(runtime_dir=rdir))
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir)
    r = subprocess.run([PY, "-m", "monarch_nb", "allocator", "start"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"belongs to uid {NOBODY}" in r.stderr, r.stderr
    assert records.read_connection_files(rdir) == [] and not any(n.startswith("allocator-start") for n in os.listdir(rdir))


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


_RACER = """
import json, os, sys, time
go = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(go):  # all racers released at once
    if time.monotonic() > deadline:
        sys.exit("never released")
    time.sleep(0.002)
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


def test_concurrent_controllers_on_a_fresh_runtime_dir_share_one_allocator(rdir: str) -> None:
    go = os.path.join(rdir, "go")
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    racers = [
        subprocess.Popen([PY, "-c", _RACER, go], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    try:
        open(go, "w").close()
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
