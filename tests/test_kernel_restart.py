"""A real kernel restart (jupyter_client's restart_kernel): re-attaching brings back the
meshes, and what their ranks print reaches the cells of the new kernel."""

from __future__ import annotations

import os
import re

import pytest
from _kernel import Cell, Kernel, poll

pytestmark = pytest.mark.timeout(180)


def _ok(c: Cell) -> Cell:
    assert c.error is None, c.error
    return c


def test_rank_output_reaches_the_cell_after_a_kernel_restart() -> None:
    k = Kernel()
    try:
        _ok(k.run("%mesh connect"))
        _ok(k.run("%mesh spawn survivor --per-host gpus=2"))
        pids = _ok(k.run("%%mesh exec survivor\nimport os\nprint('before the restart', flush=True)\nos.getpid()"))
        assert "before the restart" in pids.stream()
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=60)
        _ok(k.run("%load_ext monarch_nb"))
        assert "survivor" in _ok(k.run("%mesh connect")).stream()
        c = _ok(k.run("%%mesh exec survivor\nprint('after the restart', flush=True)\nos.getpid()"))
        assert c.result == pids.result  # the same processes
        assert "after the restart" in c.stream(), c.stream()
        _ok(k.run("%mesh stop survivor"))
    finally:
        k.close("survivor")


def test_a_reattached_mesh_is_owned_by_the_restarted_kernel_in_every_status_and_survives_stop_all() -> None:
    """The allocator kept the old kernel's id as the owner of a mesh the restarted kernel had
    re-attached: `monarch-nb stop --all` ("every mesh whose controller is gone") stopped it under
    the kernel using it, and `monarch-nb status` and the sidebar named the dead kernel."""
    import subprocess

    from conftest import PY

    def shell(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "monarch_nb", *argv], capture_output=True, text=True, timeout=60)

    cid = "from monarch_nb.actor._context import controller_client; controller_client().cid"
    k = Kernel()
    try:
        _ok(k.run("%mesh connect"))
        _ok(k.run("%mesh spawn kept --per-host gpus=1"))
        old = _ok(k.run(cid)).result.strip("'")
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=60)
        _ok(k.run("%load_ext monarch_nb"))
        _ok(k.run("%mesh connect"))
        new = _ok(k.run(cid)).result.strip("'")
        assert new != old
        # re-attached once `%mesh connect` returns: no wait for the allocator to notice the restart
        st = shell("status")
        assert st.returncode == 0, st.stderr
        (line,) = [ln for ln in st.stdout.splitlines() if " mesh kept " in ln]
        assert f"owner={new} " in line and old not in st.stdout, st.stdout
        r = shell("stop", "--all")
        assert r.returncode == 0, r.stderr
        assert f"left mesh 'kept' is owned by controller {new}, which is running" in r.stdout, r.stdout
        sidebar = subprocess.run(
            [
                PY,
                "-c",
                "from monarch_nb.server.manager import MeshManager\n"
                "print([m['owner'] for m in MeshManager().state()['meshes'] if m['name'] == 'kept'])",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sidebar.stdout.strip() == repr([new]), (sidebar.stdout, sidebar.stderr)
        rows = _ok(
            k.run(
                "[r['owner'] for r in get_ipython().run_line_magic('mesh', 'status').rows if r.get('mesh') == 'kept (persistent)']"
            )
        )
        assert rows.result == "['this kernel (re-attached)']", rows.result
        assert "stopped: kept" in _ok(k.run("%mesh stop kept")).stream()
    finally:
        k.close("kept")


def test_a_kernel_restarted_on_another_host_than_its_allocator_owns_what_it_reattached(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Over TCP (the allocator on another host) the old kernel's process is not known gone until
    its heartbeats time out: the re-attach left the mesh to it, and once it was detached
    `monarch-nb stop --all` stopped the mesh under the kernel using it. The allocator now knows
    the new process is the same Jupyter kernel restarted (its connection file)."""
    import subprocess

    from conftest import PY, AllocatorProc

    from monarch_nb._wire.keys import write_key_file

    key = str(tmp_path / "cluster.key")
    write_key_file(key)
    a = AllocatorProc(str(tmp_path), "--bind", "tcp://127.0.0.1:0", "--key-file", key)
    tcp = a.info["tcp"]
    connect = f"from monarch_nb import mesh\nmesh.connect({tcp!r}, key_file={key!r})\n"
    cid = "from monarch_nb.actor._context import controller_client; controller_client().cid"
    k = Kernel()
    try:
        _ok(k.run(connect + "mesh.spawn('far', per_host={'gpus': 1})"))
        old = _ok(k.run(cid)).result.strip("'")
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=60)
        _ok(k.run(connect + "sorted(mesh.meshes())"))
        new = _ok(k.run(cid)).result.strip("'")
        st = subprocess.run(
            [PY, "-m", "monarch_nb", "status"],
            env=dict(os.environ, MONARCH_NB_RUNTIME_DIR=a.rdir),
            capture_output=True,
            text=True,
            timeout=60,
        )
        (line,) = [ln for ln in st.stdout.splitlines() if " mesh far " in ln]
        assert f"owner={new} " in line and old not in st.stdout, st.stdout
    finally:
        k.close()
        a.stop()  # and its procs with it


def test_a_second_kernel_does_not_take_a_running_kernels_meshes() -> None:
    """Re-attaching is not taking: a second kernel's `%mesh connect` finds the first kernel's
    persistent mesh, and the first kernel stays its owner (`monarch-nb stop` still refuses it)."""
    import subprocess

    from conftest import PY

    cid = "from monarch_nb.actor._context import controller_client; controller_client().cid"
    first = Kernel()
    second = None
    try:
        _ok(first.run("%mesh connect"))
        _ok(first.run("%mesh spawn mine --per-host gpus=1"))
        owner = _ok(first.run(cid)).result.strip("'")
        second = Kernel()
        assert "mine" in _ok(second.run("%mesh connect")).stream()
        st = subprocess.run([PY, "-m", "monarch_nb", "status"], capture_output=True, text=True, timeout=60)
        (line,) = [ln for ln in st.stdout.splitlines() if " mesh mine " in ln]
        assert f"owner={owner} " in line, st.stdout
        r = subprocess.run([PY, "-m", "monarch_nb", "stop", "--all"], capture_output=True, text=True, timeout=60)
        assert f"left mesh 'mine' is owned by controller {owner}, which is running" in r.stdout, r.stdout
    finally:
        if second is not None:
            second.close()
        first.close("mine")


def test_a_restarted_kernel_leaves_no_socket_files_behind() -> None:
    """A restart kills the kernel (SIGKILL): it cannot remove its socket files as a controller
    that exits does, and each restart left two more in the runtime directory."""
    k = Kernel()
    try:
        _ok(k.run("%mesh connect"))
        c = _ok(k.run("from monarch_nb.actor import controller_client\nprint(controller_client().rt.ipc_addr)"))
        sock = c.stream().strip().removeprefix("ipc://")
        fast = sock.removesuffix(".sock") + ".fast"
        assert os.path.exists(sock) and os.path.exists(fast), (sock, fast)
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=60)
        _ok(k.run("%load_ext monarch_nb"))
        _ok(k.run("%mesh connect"))
        # the allocator notices the old kernel's process is gone within a heartbeat
        gone = f"not os.path.exists({sock!r}) and not os.path.exists({fast!r})"
        _ok(k.run("import os\n" + poll(gone, 20, "the killed kernel's socket files to be removed")))
    finally:
        k.close()


def test_mesh_spawn_after_the_local_allocator_was_stopped_starts_another() -> None:
    """`this_host()` replaces a local allocator that was stopped or killed, but `%mesh spawn`
    kept the one `%mesh connect` found: "no allocator listening at ipc://…: the socket file
    does not exist", until the user thought of connecting again."""
    import shutil
    import subprocess
    import sys
    import tempfile

    rdir = tempfile.mkdtemp(prefix="mnb", dir="/tmp")  # short: ipc socket paths are limited
    env = {"MONARCH_NB_RUNTIME_DIR": rdir}
    k = Kernel(env=env)
    try:
        _ok(k.run("%mesh connect"))
        _ok(k.run("%mesh spawn before --per-host gpus=1"))
        stop = subprocess.run(
            [sys.executable, "-m", "monarch_nb", "allocator", "stop"],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0 and "stopped 1 allocator(s)" in stop.stdout, stop
        c = _ok(k.run("%mesh spawn after --per-host gpus=1"))
        assert "after: 1 proc {gpus: 1} on 1 host(s)" in c.stream(), c.stream()
        assert "42)" in _ok(k.run("%%mesh exec after\n6 * 7")).result
    finally:
        k.close()
        subprocess.run(
            [sys.executable, "-m", "monarch_nb", "allocator", "stop"],
            env=dict(os.environ, **env),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(rdir, ignore_errors=True)


def test_an_interrupted_connect_shows_the_cell_and_says_what_it_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An interrupt in `%mesh connect` to an allocator that does not answer (stopped) landed in
    pyzmq's poll: a screenful of its frames ("Could not get source") and nothing on what the
    cell waited for. The kernel interrupts itself once its main thread is in that poll."""
    import signal

    from conftest import AllocatorProc

    a = AllocatorProc(str(tmp_path))
    k = Kernel()
    try:
        os.kill(a.proc.pid, signal.SIGSTOP)
        _ok(
            k.run(
                "import os, signal, sys, threading, time\n"
                "def _interrupt_in_the_poll(main=threading.main_thread().ident):\n"
                "    while True:\n"
                "        f, names = sys._current_frames().get(main), set()\n"
                "        while f is not None:\n"
                "            names.add(f.f_code.co_name)\n"
                "            f = f.f_back\n"
                "        if {'connect', 'poll'} <= names:\n"
                "            return os.kill(os.getpid(), signal.SIGINT)\n"
                "        time.sleep(0.01)\n"
                "threading.Thread(target=_interrupt_in_the_poll, daemon=True).start()"
            )
        )
        c = k.run(f"%mesh connect {a.addr}", 60)
        assert c.error is not None and c.error["ename"] == "KeyboardInterrupt", c.msgs
        tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
        assert "zmq" not in tb and "Could not get source" not in tb, tb
        assert f"interrupted while connecting to the allocator at {a.addr}: " in tb, tb
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
        k.close()
        a.stop()
