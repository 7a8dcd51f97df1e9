"""Helpers of the launcher tests: controller scripts on a cluster's host 0, and a watch on every
process's command line and environment for a secret."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

#: the interpreter of this test run; hosts see it (it is not under a private directory)
PY = os.path.abspath(sys.executable)


def run_controller(net: Any, shared: str, code: str, env: dict[str, str], timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``code`` as a controller script on host 0 and return the JSON objects it printed."""
    path = os.path.join(shared, f"ctl-{uuid.uuid4().hex[:8]}.py")
    # a script that hangs prints every thread's stack before it is killed: where it stopped
    dump = f"import faulthandler\nfaulthandler.dump_traceback_later({max(timeout - 10, timeout * 0.9):.0f}, exit=False)\n"
    head, rest = "", code
    if code.lstrip().startswith("from __future__"):  # it must stay the script's first statement
        first, _, rest = code.lstrip().partition("\n")
        head = first + "\n"
    Path(path).write_text(head + dump + rest)
    try:
        cp = net.run(0, [PY, path], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # what it printed says how far it got
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(f"controller script ran past {timeout} s:\n{out[-2000:]}\n{err[-12000:]}") from None
    out = [json.loads(line) for line in cp.stdout.splitlines() if line.startswith("{")]
    if cp.returncode != 0:
        raise AssertionError(f"controller script failed ({cp.returncode}):\n{cp.stdout[-2000:]}\n{cp.stderr[-4000:]}")
    return out


def secret_forms(key: bytes) -> dict[str, bytes]:
    return {
        "raw": key,
        "hex": key.hex().encode(),
        "HEX": key.hex().upper().encode(),
        "base64": base64.b64encode(key).rstrip(b"="),
        "base64url": base64.urlsafe_b64encode(key).rstrip(b"="),
    }


class KeyWatch:
    """Snapshots every process's /proc/PID/cmdline and environ, many times a second, until stopped;
    `leaks(key)` then names the processes where the key showed (raw, hex or base64)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.seen: dict[bytes, str] = {}
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> KeyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        me = str(os.getpid())
        while not self._stop.is_set():
            for e in os.listdir("/proc"):
                if not e.isdigit() or e == me:
                    continue
                for what in ("cmdline", "environ"):
                    try:
                        blob = Path(f"/proc/{e}/{what}").read_bytes()
                    except OSError:
                        continue
                    if blob and blob not in self.seen:
                        self.seen[blob] = f"pid {e} {what}: {blob[:80]!r}"
            self.scans += 1
            self._stop.wait(self.interval)

    def leaks(self, key: bytes) -> list[str]:
        forms = secret_forms(key)
        return [f"{name} in {where}" for blob, where in self.seen.items() for name, f in forms.items() if f in blob]
