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
