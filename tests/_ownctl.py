"""A controller script with a runtime directory of its own: the allocator it starts is its own
child, and inherits what the test gave the script (resource limits, a small disk), as on a
user's machine. The allocator is stopped when the script ends, whatever happened."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
import textwrap
from collections.abc import Callable
from typing import Any

from conftest import PY, sweep

_HEAD = """
import errno, json, os, resource, sys, time
from monarch_nb.actor import Actor, endpoint, this_host
from monarch_nb.allocator import list_allocators, stop_allocator

def wait_until(pred, timeout):
    # the file a daemon writes has no event to wait on: poll it, against a deadline
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)

def report(obj):
    # to a file of the test's, not stdout: rank output still arriving would land inside a line
    path = os.environ["MNB_TEST_REPORT"]
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)

def error_of(fn):
    # what the call fn() makes raised, as "Type: text"; None if it raised nothing
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

def take_every_descriptor():
    # what a program that leaks files does to its process: the descriptors, to give back
    hog = []
    try:
        while True:
            hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return hog

def expect_faults():
    # this program makes its meshes fail: not an unhandled fault to print
    import monarch_nb.actor as api
    api.unhandled_fault_hook = lambda failure: None

def zygote():
    # the zygote of this host's allocator (psutil.Process), which forks its procs
    import psutil
    alloc = psutil.Process(int(list_allocators()[0]["pid"]))
    (z,) = [c for c in alloc.children() if "monarch_nb._runtime.zygote" in " ".join(c.cmdline())]
    return z

class E(Actor):
    @endpoint
    def soft_limit(self) -> int:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    @endpoint
    def say(self, text: str, n: int = 1) -> int:
        for i in range(n):
            print(text.format(i=i))
        return n

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def from_a_thread(self, port, n: int) -> int:
        # values sent by a thread of its own: its own connection to the port's owner
        import threading
        t = threading.Thread(target=lambda: [port.send(i) for i in range(n)])
        t.start()
        t.join()
        return n

    @endpoint
    def write(self, text: str, times: int) -> int:
        for _ in range(times):
            sys.stdout.write(text)  # no newline
            sys.stdout.flush()
        return times

try:
"""


def runtime_dir(base: Any) -> str:
    """A fresh runtime directory (0700, as a user's is) under the directory ``base``."""
    path = os.path.join(str(base), "rt")
    os.mkdir(path, 0o700)
    return path


def run(
    rdir: str,
    code: str,
    preexec: Callable[[], None] | None = None,
    timeout: float = 150,
    wrap: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``code`` (indented into a ``try`` whose ``finally`` stops the allocator; ``E`` is an
    actor with ``soft_limit``, ``say``, ``echo`` and ``write``; ``report``, ``wait_until``,
    ``error_of``, ``expect_faults`` and ``zygote`` are helpers) with ``MONARCH_NB_RUNTIME_DIR=rdir``,
    behind the command ``wrap`` if given (which runs the rest of its arguments), with ``env``
    added to the environment (the allocator it starts reads its configuration there); what it
    passed to ``report(obj)`` (a dict), and its whole stdout under ``"stdout"``."""
    fd, report = tempfile.mkstemp(prefix="mnb-report-", dir="/tmp")  # not in rdir: its disk may be full
    os.close(fd)
    os.unlink(report)
    extra = env or {}
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="", MNB_TEST_REPORT=report, **extra)
    # the script imports this module's helpers (fill) as the tests do
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH")) if p)
    env.pop("PYTHONUNBUFFERED", None)
    body = _HEAD + textwrap.indent(textwrap.dedent(code), "    ") + "\nfinally:\n    stop_allocator()\n"
    try:
        cp = subprocess.run(
            [*(wrap or []), PY, "-c", body], capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=preexec
        )
    finally:
        # a script that hung (or was killed) leaves its allocator, detached, under a runtime
        # directory the session's own sweep does not look at
        sweep(rdir)
    try:
        assert cp.returncode == 0, f"controller failed ({cp.returncode}):\n{cp.stdout[-2000:]}\n{cp.stderr[-6000:]}"
        assert os.path.exists(report), f"the controller reported nothing:\n{cp.stdout[-2000:]}\n{cp.stderr[-6000:]}"
        with open(report) as f:
            got = json.load(f)
    finally:
        for p in (report, report + ".tmp"):
            if os.path.exists(p):
                os.unlink(p)
    got["stdout"] = cp.stdout
    return dict(got)


def fill(path: str) -> None:
    """Write a file at ``path`` until its disk is full (ENOSPC)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
