"""Test harness: one private runtime directory per session, fast heartbeats, and no
allocator left behind."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

# must happen before monarch_nb is imported anywhere: the runtime reads these once. Procs,
# scripts and kernels the session starts import this module too (with a test module whose
# actor classes they unpickle): they inherit the session's settings and make no directory.
_RDIR = os.environ.get("MONARCH_NB_TEST_SESSION_DIR", "")
if not _RDIR:
    _RDIR = tempfile.mkdtemp(prefix="mnbt-", dir="/tmp")
    os.chmod(_RDIR, 0o700)
    os.environ["MONARCH_NB_TEST_SESSION_DIR"] = _RDIR
    os.environ["MONARCH_NB_RUNTIME_DIR"] = _RDIR
    os.environ.setdefault("MONARCH_NB_HEARTBEAT_INTERVAL", "0.2")
    os.environ.setdefault("MONARCH_NB_HEARTBEAT_TIMEOUT", "1.5")
    # a process of the suite that crashes (SIGSEGV, abort) prints every thread's Python stack
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# A suite started in the background of a script (`bash .ci/run &` in a non-interactive shell)
# inherits SIGINT ignored; Python then leaves it ignored (no KeyboardInterrupt, and
# `_thread.interrupt_main()` does nothing), and so does every kernel, program and controller the
# tests start: each test of an interrupt failed in session 31's two CI runs started so. A handler
# here is reset to the default in the children at exec, where Python installs its own again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

PY = sys.executable


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    """Poll ``pred`` until it returns a truthy value (returned) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class AllocatorProc:
    """A dedicated allocator daemon with its own runtime dir (for tests that kill it)."""

    def __init__(self, tmp: str, *args: str, env: dict[str, str] | None = None, nofile: int = 0) -> None:
        """``nofile``: the daemon's hard ``RLIMIT_NOFILE`` (0: this process's)."""
        self.rdir = tempfile.mkdtemp(prefix="mnba-", dir="/tmp")
        self.env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=self.rdir, **(env or {}))
        self.log = os.path.join(self.rdir, "allocator.log")

        def limit() -> None:
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [PY, "-m", "monarch_nb", "allocator", *args], env=self.env, stdout=f, stderr=f, preexec_fn=limit
            )
        from monarch_nb._runtime.records import read_connection_files

        try:
            self.info = wait_for(lambda: next(iter(read_connection_files(self.rdir)), None), 30, "allocator connection file")
        except AssertionError as e:
            log = self.logtext()
            self.stop()  # a daemon that never got ready would outlive the test
            raise AssertionError(f"{e}; its log:\n{log}") from None
        except BaseException:
            self.stop()
            raise
        self.addr = self.info["addr"]

    def logtext(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.rdir, ignore_errors=True)


@pytest.fixture
def gate(tmp_path):
    """``gate(name)``: a :class:`_gate.Gate` at ``tmp_path/name`` that ranks or scripts wait on
    (``_gate.wait(path)``) until the test opens it. What an opening let through stays for waiters
    that come later, until the test ends; then every gate closes, letting go any still waiting."""
    import _gate

    made: list[_gate.Gate] = []

    def make(name: str = "go") -> _gate.Gate:
        made.append(_gate.Gate(str(tmp_path / name)))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs of its own (0700), unmounted afterwards: a disk that fills up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(disk)]
    if subprocess.run(cmd, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def memcg():
    """``memcg(limit_bytes)``: a memory cgroup of that limit (no swap), v1 or v2, whose
    ``cgroup.procs`` path it returns; removed afterwards (skips where none can be made)."""
    import secrets

    made: list[str] = []

    def make(limit: int) -> str:
        v1 = os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if v1:
            root, knob, swap_knob, swap = "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", limit
        else:
            root, knob, swap_knob, swap = "/sys/fs/cgroup", "memory.max", "memory.swap.max", 0
        path = os.path.join(root, f"mnb-test-{secrets.token_hex(4)}")

        def write(name: str, value: int) -> None:
            with open(os.path.join(path, name), "w") as f:
                f.write(str(value))

        try:
            os.mkdir(path)
            made.append(path)
            write(knob, limit)
            # v1's memory+swap limit exists only where swap accounting is on
            if not v1 or os.path.exists(os.path.join(path, swap_knob)):
                write(swap_knob, swap)
        except OSError as e:
            pytest.skip(f"cannot make a memory cgroup here: {e}")
        return os.path.join(path, "cgroup.procs")

    yield make
    for path in made:
        deadline = time.monotonic() + 10
        while True:  # empty once the killed process is reaped
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)


@pytest.fixture
def allocator(tmp_path):
    """A private allocator; yields it with ``.hosts`` a HostMesh attached to it."""
    from monarch_nb.actor import attach_to_workers

    a = AllocatorProc(str(tmp_path))
    try:
        a.hosts = attach_to_workers(workers=[a.addr], ca="trust_all_connections")
        yield a
    finally:
        a.stop()


def run_script(code: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a separate controller process (its own ``__main__``), buffered as a
    user's program is (.ci/run sets PYTHONUNBUFFERED: then print() writes its pieces one by one
    and rank output, written whole by another thread, may land between them)."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=timeout, env=dict(base, **(env or {})))


def pytest_sessionfinish(session, exitstatus):
    from monarch_nb.allocator import stop_allocator

    stop_allocator()
    sweep(_RDIR)
    if exitstatus not in (0, 5):
        _report_daemon_logs(_RDIR)
    shutil.rmtree(_RDIR, ignore_errors=True)


def _report_daemon_logs(rdir: str, lines: int = 40) -> None:
    """The end of each allocator log of the session (a crash's stacks, a stall's warnings): the
    directory goes away with the session, and a failed CI run has nothing else to show of them."""
    import glob

    for path in sorted(glob.glob(os.path.join(rdir, "allocator*.log"))):
        with open(path, errors="replace") as f:
            # routine INFO records (a controller attached, detached) say nothing of a failure
            tail = [ln for ln in f.read().splitlines() if " INFO " not in ln][-lines:]
        if not tail:
            continue
        sys.stderr.write(f"conftest: the end of {os.path.basename(path)} (INFO records left out):\n")
        sys.stderr.writelines(f"  {line[:300]}\n" for line in tail)


def sweep(rdir: str) -> None:
    """Kill what still carries the runtime dir ``rdir`` (say so: a test leaked it)."""
    import psutil

    me = os.getpid()
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != me and p.environ().get("MONARCH_NB_RUNTIME_DIR") == rdir:
                left.append(p)
        except (psutil.Error, OSError):
            pass
    if left:
        sys.stderr.write(f"conftest: killing {len(left)} process(es) left behind: {[p.cmdline()[-2:] for p in left]}\n")
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request):
    """After each test module: the meshes it left on the session's allocator, which a later
    module's ``%mesh connect`` re-attaches (test_magics' first cell then ran on one), and the
    processes of the session it left running (kernels, servers, allocators of its own); named in
    a warning, then stopped, so that the next module starts clean and the warning names the
    module that leaked, not the one that tripped over it."""
    yield
    where = request.node.nodeid
    meshes = _left_meshes(_RDIR)
    if meshes:
        warnings.warn(f"{where} left meshes running on the session's allocator (stopped now): {', '.join(meshes)}", stacklevel=1)
        for name in meshes:
            _cli("stop", "--force", name)
    strays = _strays(_RDIR)
    if strays:
        warnings.warn(f"{where} left processes running (killed now): {strays}", stacklevel=1)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    # a process of its own: a client in pytest's process would attach it to the allocator from
    # then on, which tests of an unattached pytest process do not expect
    return subprocess.run([PY, "-m", "monarch_nb", *args], capture_output=True, text=True, timeout=90)


def _live_allocators(rdir: str) -> list[int]:
    from monarch_nb._runtime._pids import pid_alive
    from monarch_nb._runtime.records import read_connection_files

    pids = []
    for info in read_connection_files(rdir):
        try:
            if pid_alive(int(info["pid"])):
                pids.append(int(info["pid"]))
        except (KeyError, ValueError):
            pass
    return pids


def _left_meshes(rdir: str) -> list[str]:
    """The running meshes of ``rdir``'s allocators that ``%mesh connect`` would re-attach: named
    ones, and unnamed ones whose controller is gone."""
    import json

    if not _live_allocators(rdir):
        return []
    r = _cli("status", "--json")
    try:
        allocators = json.loads(r.stdout)["allocators"]
    except (ValueError, KeyError):
        return [f"(status failed: {r.stderr.strip()[-300:]})"]
    left = []
    for a in allocators:
        attached = {c.get("cid") for c in a.get("controllers", [])}
        for m in a.get("meshes", []):
            if m.get("state") == "running" and (not m["name"].startswith("anon-") or m.get("owner") not in attached):
                left.append(m["name"])
    return sorted(set(left))


def _strays(rdir: str) -> list[str]:
    """Processes of this session other than pytest and its allocator's tree, killed (after a grace
    period for those on their way out); their command lines."""
    import psutil

    me = os.getpid()
    keep = {me}
    for pid in _live_allocators(rdir):
        try:
            keep.update([pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))])
        except psutil.Error:
            pass
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid not in keep and p.environ().get("MONARCH_NB_TEST_SESSION_DIR") == rdir:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    if not found:
        return []
    _, alive = psutil.wait_procs(found, timeout=5)
    out = []
    for p in alive:
        try:
            out.append(" ".join(p.cmdline())[:120])
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    return out


@pytest.fixture(autouse=True)
def fault_hook():
    """Tests kill procs on purpose: record unhandled failures instead of exiting pytest."""
    import monarch_nb.actor as api

    seen: list = []
    saved = api.unhandled_fault_hook
    api.unhandled_fault_hook = seen.append
    yield seen
    api.unhandled_fault_hook = saved
