"""Run code as another local user: uid and gid 65534 (``nobody``), no key, no groups, with the
system Python (what any local user can do to our sockets and files)."""

from __future__ import annotations

import shutil
import subprocess
import sys

NOBODY = 65534


def run_as_nobody(code: str, *args: str, timeout: float = 30) -> str:
    """Run ``python3 -c code args...`` as ``nobody``; its stdout (it must exit 0)."""
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    r = subprocess.run(
        [py, "-c", code, *args],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


#: open N connections to HOST:PORT, say how many, and hold them, silent, until killed
_HOLD_SILENT = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[3])):
    try:
        held.append(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5))
    except OSError:
        break  # the backlog is full: as many as the listener lets in
print(len(held), flush=True)
time.sleep(120)
"""


def hold_silent_as_nobody(host: str, port: str | int, n: int) -> tuple[subprocess.Popen[str], int]:
    """As ``nobody``, open ``n`` connections to ``host:port`` and hold them without a byte sent
    (a stranger's flood): the holding process (kill it to let go) and how many it opened."""
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    holder = subprocess.Popen(
        [py, "-c", _HOLD_SILENT, host, str(port), str(n)],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if not line.strip():
        holder.kill()
        holder.wait()
        raise AssertionError("the connections of nobody's flood could not be opened")
    return holder, int(line)
