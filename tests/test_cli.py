"""The command line's answers to bad input: one line naming what is wrong, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from conftest import PY

pytestmark = pytest.mark.timeout(120)


def _cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "monarch_nb", *argv], env=dict(os.environ, **env), capture_output=True, text=True, timeout=60
    )


def _refused(r: subprocess.CompletedProcess[str], words: str) -> None:
    assert r.returncode == 1 and r.stderr.startswith(words) and "Traceback" not in r.stderr, (r.args, r.stdout, r.stderr)


def test_debug_says_an_address_does_not_answer_instead_of_listing_no_sessions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # it printed "no debug sessions" and exited 0: a typo in --addr looked like an idle cluster
    _refused(_cli("debug", "--addr", "garbage", "-c", "list"), "monarch-nb debug: cannot parse allocator address 'garbage'")
    _refused(
        _cli("debug", "--addr", f"ipc://{tmp_path}/nosuch.sock", "-c", "list"),
        f"monarch-nb debug: no allocator listening at ipc://{tmp_path}/nosuch.sock: the socket file does not exist",
    )
    _refused(
        _cli("debug", "--addr", "tcp://127.0.0.1:1", "-c", "list", MONARCH_NB_CONNECT_TIMEOUT="1"),
        "monarch-nb debug: could not reach allocator at tcp://127.0.0.1:1 within 1.0 s: connection refused",
    )
    # "error: ConfigError: ..." as a command's output, exit 0
    _refused(_cli("debug", "--key-file", str(tmp_path / "nokey"), "-c", "list"), "monarch-nb debug: cannot read cluster key file")


def test_debug_commands_that_fail_make_a_non_zero_exit() -> None:
    r = _cli("debug", "-c", "list")
    assert r.returncode == 0 and "no debug sessions" in r.stdout, r
    for cmd, words in [("attach debugee 13", "error: no paused session for debugee rank 13"), ("frob", "unknown command 'frob'")]:
        r = _cli("debug", "-c", cmd)
        assert r.returncode == 1 and words in r.stdout and "Traceback" not in r.stderr, (cmd, r)


def test_kernelspec_install_refusals_are_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = str(tmp_path / "prefix")
    _refused(
        _cli("kernelspec", "install", "--python", str(tmp_path / "nopython"), "--prefix", prefix),
        f"monarch-nb kernelspec install: no executable interpreter at {tmp_path}/nopython",
    )
    _refused(
        _cli("kernelspec", "install", "--user", "--prefix", prefix),
        "monarch-nb kernelspec install: Can't specify both user and prefix",
    )
    assert not os.path.exists(prefix)


def test_a_bad_setting_in_the_environment_is_named_by_every_command() -> None:
    for argv in (["status"], ["gc", "--dry-run"], ["logs", "m"], ["job", "status"], ["debug", "-c", "list"]):
        _refused(
            _cli(*argv, MONARCH_NB_HEARTBEAT_TIMEOUT="abc"),
            f"monarch-nb {argv[0]}: MONARCH_NB_HEARTBEAT_TIMEOUT='abc' is not a valid float",
        )
    # read apart from Config, at import: a ValueError traceback naming only the literal
    _refused(
        _cli("status", MONARCH_NB_SPAN_RING_BITS="x"),
        "monarch-nb status: MONARCH_NB_SPAN_RING_BITS='x': an integer from 1 to 24 (default 13)",
    )
    _refused(_cli("status", MONARCH_NB_RUNTIME_DIR="/tmp"), "monarch-nb status: the runtime directory /tmp is a shared directory")


def test_a_runtime_directory_that_cannot_be_made_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # an OSError traceback from config.runtime_dir, naming neither the setting nor the way out
    afile = tmp_path / "afile"
    afile.write_text("")
    _refused(
        _cli("status", MONARCH_NB_RUNTIME_DIR=str(afile)),
        f"monarch-nb status: cannot make the runtime directory {afile}: {afile} is a file; "
        "set MONARCH_NB_RUNTIME_DIR to a directory you can write",
    )
    _refused(
        _cli("allocator", "start", MONARCH_NB_RUNTIME_DIR=f"{afile}/rt"),
        f"monarch-nb allocator start: cannot make the runtime directory {afile}/rt: Not a directory ({afile}/rt); ",
    )
    _refused(_cli("logs", "m", MONARCH_NB_RUNTIME_DIR="/proc/nosuch"), "monarch-nb logs: cannot make the runtime directory")


def test_keygen_with_an_empty_path_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `monarch-nb keygen "$KEYFILE"` with the variable unset: a FileNotFoundError traceback
    r = subprocess.run([PY, "-m", "monarch_nb", "keygen", ""], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    _refused(r, "monarch-nb keygen: no path given; give keygen the path of the key file to write")
    assert os.listdir(tmp_path) == []  # nor its temporary file


def test_keygen_keeps_a_working_key_unless_forced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a second `keygen` on the same path replaced the key in silence: every host holding the old
    # one then refused this user's controllers and allocators
    key = str(tmp_path / "cluster.key")
    assert _cli("keygen", key).returncode == 0
    with open(key) as f:
        first = f.read()
    _refused(_cli("keygen", key), f"monarch-nb keygen: {key} already holds a cluster key")
    with open(key) as f:
        assert f.read() == first
    r = _cli("keygen", key, "--force")
    assert r.returncode == 0 and "wrote a new cluster key" in r.stdout, r.stderr
    with open(key) as f:
        assert f.read() != first


def test_job_kill_with_no_name_and_no_current_job_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # "no job named '(current)'": a job nobody had called so
    rdir = tmp_path / "rt"
    rdir.mkdir(mode=0o700)
    _refused(
        _cli("job", "kill", MONARCH_NB_RUNTIME_DIR=str(rdir)),
        f"monarch-nb job kill: no current job (none applied with `monarch-nb job apply`: no {rdir}/jobs/job_state.json); "
        "name one to kill (known: none)",
    )


def test_a_reader_that_closed_the_pipe_gets_no_traceback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `monarch-nb logs NAME | head`: a BrokenPipeError traceback, and Python's second complaint at exit
    rdir = tmp_path / "rt"
    rdir.mkdir(mode=0o700)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails with EPIPE
    try:
        r = subprocess.run(
            [PY, "-m", "monarch_nb", "status"],
            env=dict(os.environ, MONARCH_NB_RUNTIME_DIR=str(rdir)),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (128 + signal.SIGPIPE, ""), r


def test_allocator_start_refuses_a_port_past_65535_and_a_gateway_it_cannot_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """zmq took tcp://127.0.0.1:99999 as port 34463 and the allocator advertised 99999; a
    --gateway that was no 127.0.0.1:PORT killed the allocator after `allocator start` had said
    it ran (exit 0), its record left behind as a dead allocator."""
    import shutil
    import tempfile

    rdir = tempfile.mkdtemp(prefix="mnbp-", dir="/tmp")
    os.chmod(rdir, 0o700)
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_ZYGOTE_PRELOAD": ""}
    key = str(tmp_path / "key")
    try:
        assert _cli("keygen", key).returncode == 0
        starting = "monarch-nb allocator start: the local allocator exited with code 1 while starting:\n"
        for bind in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:99999@tcp://127.0.0.1:0"):
            r = _cli("allocator", "start", "--bind", bind, **env)
            _refused(r, starting)
            assert "monarch-nb allocator run: 'tcp://127.0.0.1:99999' is not an address: port 99999 is over 65535" in r.stderr
        for gateway in ("garbage", "10.0.0.1:5000", "127.0.0.1:70000"):
            r = _cli("allocator", "start", "--key-file", key, "--bind", "tcp://127.0.0.1:0", "--gateway", gateway, **env)
            _refused(r, starting)
            assert f"monarch-nb allocator run: --gateway {gateway!r}: expected 127.0.0.1:PORT" in r.stderr, r.stderr
        assert _cli("allocator", "status", **env).stdout == "no allocators registered\n"
    finally:
        _cli("allocator", "stop", **env)
        shutil.rmtree(rdir, ignore_errors=True)


def test_every_command_and_option_is_in_the_docs() -> None:
    """The README's "Command line" block lists each command (it lacked `job`), and every option
    a command takes is written down somewhere a user reads (the README or docs/)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```", 2)[1]
    docs = readme + "".join(p.read_text() for p in (root / "docs").glob("*.md"))
    top = _cli("--help").stdout
    commands = re.search(r"\{([a-z,]+)\}", top).group(1).split(",")  # type: ignore[union-attr]
    missing = []
    for cmd in commands:
        if f"monarch-nb {cmd}" not in block:
            missing.append(f"monarch-nb {cmd} (README's block)")
        for opt in set(re.findall(r"(--[a-z][a-z-]+)", _cli(cmd, "--help").stdout)) - {"--help"}:
            if not re.search(re.escape(opt) + r"\b", docs):
                missing.append(f"monarch-nb {cmd} {opt}")
    assert missing == []


def test_status_shows_a_mesh_shape_and_an_owner_that_is_gone() -> None:
    # it printed the extent's repr, "mesh kept (['gpus'], [2]) running owner=…", and no word
    # that the controller owning the mesh had exited (%mesh status says "gone")
    script = (
        "from monarch_nb.actor import this_host\n"
        "this_host().spawn_procs(per_host={'gpus': 2}, name='kept', persist=True)\n"
        "from monarch_nb.actor import controller_client\n"
        "print(controller_client().cid)\n"
    )
    spawned = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert spawned.returncode == 0, spawned.stderr
    cid = spawned.stdout.split()[-1]
    try:
        r = _cli("status")
        assert r.returncode == 0, r.stderr
        assert f"  mesh kept {{gpus: 2}} running owner={cid} (gone) procs={{'running': 2}}" in r.stdout, r.stdout
    finally:
        stop = "from monarch_nb.allocator import stop_mesh\nprint(stop_mesh('kept'))"
        assert subprocess.run([PY, "-c", stop], capture_output=True, text=True, timeout=60).stdout.strip() == "2"


def test_stop_a_mesh_by_name_as_mesh_stop_does() -> None:
    """A persistent mesh whose kernel is gone could be stopped from a terminal only with
    `allocator stop` (every mesh) or Python. `monarch-nb stop` follows %mesh stop's rule: a
    running controller's mesh only with --force."""
    import shutil
    import tempfile

    rdir = tempfile.mkdtemp(prefix="mnbc-", dir="/tmp")
    os.chmod(rdir, 0o700)
    # heartbeats that outlast the allocator's stop below: it and its controllers keep each other
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_HEARTBEAT_TIMEOUT": "30"}
    spawn = (
        "from monarch_nb.actor import this_host\nthis_host().spawn_procs(per_host={{'gpus': {n}}}, name={name!r}, persist=True)\n"
    )
    # the owner of 'held' runs until its stdin closes
    owner = subprocess.Popen(
        [PY, "-c", spawn.format(n=1, name="held") + "print('ready', flush=True)\ninput()\n"],
        env=dict(os.environ, **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "ready\n"
        gone = subprocess.run([PY, "-c", spawn.format(n=2, name="orphan")], env=dict(os.environ, **env), timeout=60)
        assert gone.returncode == 0
        _refused(_cli("stop", "nosuch", **env), "monarch-nb stop: no mesh named 'nosuch' on this host's allocators")
        _refused(_cli("stop", "held", **env), "monarch-nb stop: mesh 'held' is owned by controller ")
        _refused(_cli("stop", **env), "monarch-nb stop: name a mesh")
        _refused(_cli("stop", "orphan", "--all", **env), "monarch-nb stop: name a mesh or pass --all, not both: ")
        # an allocator too busy to list its meshes in time is named, not read as having none
        from monarch_nb._runtime.records import read_connection_files

        (info,) = read_connection_files(rdir)
        os.kill(int(info["pid"]), signal.SIGSTOP)
        try:
            busy = _cli("stop", "orphan", **env)
        finally:
            os.kill(int(info["pid"]), signal.SIGCONT)
        assert busy.returncode == 1 and busy.stderr.startswith("monarch-nb stop: no mesh named 'orphan'"), busy.stderr
        assert f"meshes: none; {info['addr']} did not answer: no answer within 2 s" in busy.stderr, busy.stderr
        r = _cli("stop", "--all", **env)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("left mesh 'held' is owned by controller ") and lines[0].endswith("--force stops it anyway")
        assert lines[1:] == ["stopped mesh 'orphan' (2 procs)"], r.stdout
        r = _cli("stop", "held", "--force", **env)
        assert (r.returncode, r.stdout) == (0, "stopped mesh 'held' (1 proc)\n"), r.stderr
        assert "mesh " not in _cli("status", **env).stdout
    finally:
        owner.kill()
        owner.wait(timeout=30)
        _cli("allocator", "stop", **env)
        shutil.rmtree(rdir, ignore_errors=True)


def test_mesh_stop_of_a_mesh_stopped_from_a_shell_says_so_and_drops_the_handle() -> None:
    """The kernel that spawned a mesh someone then stopped with `monarch-nb stop --force` said
    "could not stop held: no mesh named 'held' on host ..." at `%mesh stop held`, and kept saying
    it: a failure for what had been done, by someone it did not name."""
    import shutil
    import tempfile

    rdir = tempfile.mkdtemp(prefix="mnbc-", dir="/tmp")
    os.chmod(rdir, 0o700)
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_ZYGOTE_PRELOAD": ""}
    # the kernel: it spawns 'held', and once told (a line on stdin) stops it as %mesh stop does
    kernel = subprocess.Popen(
        [
            PY,
            "-c",
            "import json\n"
            "from monarch_nb import mesh\n"
            "mesh.spawn('held', per_host={'gpus': 1})\n"
            "print('ready', flush=True)\n"
            "input()\n"
            "print(json.dumps(mesh.stop('held')), flush=True)\n"
            "print(json.dumps(mesh.stop('held')), flush=True)\n"
            "print(json.dumps([mesh.get('held')._stopped, mesh.status()['allocators'][0]['meshes']]), flush=True)\n",
        ],
        env=dict(os.environ, **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert kernel.stdout is not None and kernel.stdout.readline() == "ready\n"
        r = _cli("stop", "held", "--force", **env)
        assert (r.returncode, r.stdout) == (0, "stopped mesh 'held' (1 proc)\n"), r.stderr
        out, err = kernel.communicate("\n", timeout=60)
        said = "mesh 'held' was already stopped (by `monarch-nb stop` on the command line)"
        # not an error, and again if asked again; the kernel's handle is a stopped mesh's
        assert out.splitlines() == [said, "[]", said, "[]", "[true, []]"], (out, err)
        assert kernel.returncode == 0, err
    finally:
        kernel.kill()
        kernel.wait(timeout=30)
        _cli("allocator", "stop", **env)
        shutil.rmtree(rdir, ignore_errors=True)


def test_stacks_of_a_mesh_whose_kernel_is_stuck_from_a_terminal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A kernel stuck in a cell cannot run %mesh stacks: `monarch-nb stacks MESH` shows its
    ranks' stacks from a terminal, as %mesh stacks renders them, and leaves the owner's mesh and
    its calls as they are."""
    import shutil
    import tempfile

    rdir = tempfile.mkdtemp(prefix="mnbs-", dir="/tmp")
    os.chmod(rdir, 0o700)
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_ZYGOTE_PRELOAD": ""}
    go = tmp_path / "go"
    # the owner: its main thread waits in a call whose ranks wait until the file `go` exists
    owner_code = (
        "import os, sys, time\n"
        "from monarch_nb.actor import Actor, controller_client, endpoint, this_host\n"
        "class Stuck(Actor):\n"
        "    @endpoint\n"
        "    def wait_here_for_go(self, go):\n"
        "        while not os.path.exists(go):\n"
        "            time.sleep(0.05)\n"
        "        return 'done'\n"
        "m = this_host().spawn_procs(per_host={'gpus': 2}, name='hung').spawn('stuck', Stuck)\n"
        "fut = m.wait_here_for_go.call(sys.argv[1])\n"
        "print('ready', controller_client().cid, flush=True)\n"
        "print(sorted(fut.get(timeout=60).values()), flush=True)\n"
    )
    script = tmp_path / "owner.py"
    script.write_text(owner_code)
    owner = subprocess.Popen([PY, str(script), str(go)], env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        ready, cid = owner.stdout.readline().split()
        assert ready == "ready"
        r = _cli("stacks", "hung", **env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
        assert r.stdout.startswith("stacks of mesh 'hung': 2 ranks\n"), r.stdout
        # both ranks' stack in the endpoint, merged, with its source line, and whose call it is
        assert "[ranks 0-1 (2)] thread monarch-actor-driver (stuck)\n" in r.stdout, r.stdout
        assert f"wait_here_for_go ({script}:7)\n" in r.stdout and "time.sleep(0.05)" in r.stdout, r.stdout
        assert "[ranks 0-1 (2)] call stuck.wait_here_for_go · running for " in r.stdout, r.stdout
        assert f"called by controller {cid} (pid {owner.pid})" in r.stdout, r.stdout
        r = _cli("stacks", "hung", "--ranks", "1", **env)
        assert r.returncode == 0 and r.stdout.startswith("stacks of mesh 'hung': 1 rank\n"), (r.stdout, r.stderr)
        assert "[rank 1] call stuck.wait_here_for_go" in r.stdout, r.stdout
        _refused(_cli("stacks", "nosuch", **env), "monarch-nb stacks: no mesh named 'nosuch' on this host's allocators")
        # built the ranks 0 to 10^11 before looking at any
        _refused(_cli("stacks", "hung", "--ranks", "0-99999999999", **env), "monarch-nb stacks: rank 2 is out of range")
        # the owner's call goes on, and its mesh is still its own
        go.touch()
        assert owner.stdout.readline() == "['done', 'done']\n"
        assert owner.wait(timeout=60) == 0
    finally:
        owner.kill()
        owner.wait(timeout=30)
        _cli("allocator", "stop", **env)
        shutil.rmtree(rdir, ignore_errors=True)
