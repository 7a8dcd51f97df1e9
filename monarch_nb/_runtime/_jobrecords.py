"""Records of launched jobs: cached job state and the allocators' announcements.

Two kinds of small files, both 0600 JSON written atomically (write a temporary, rename):

- a job's cached state (``job.dump()``, ``job.state(cached_path=...)``): what a new kernel needs
  to re-attach. JSON, never pickle: a file in a shared or writable place must not be able to
  run code in the kernel that reads it. A file owned by another user, or readable by others,
  is refused before it is parsed.
- an allocator's announcement in its job's directory (``monarch-nb allocator --announce-dir``):
  the addresses it serves at, written by the allocator itself once it serves, so a launcher
  never guesses a node's address from a hostname or scrapes it from scheduler output.

The integrator folds this module into the runtime's one records module (allocator connection
files live in ``actor/_client.py`` today).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from ..errors import ConfigError

#: how a job's private directory is made: only this user can list or enter it
DIR_MODE = 0o700
FILE_MODE = 0o600
ANNOUNCE_SUFFIX = ".json"


def make_private_dir(path: str) -> str:
    """Create ``path`` (and parents) 0700, or check an existing one is ours and private."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"job directory {path!r} belongs to uid {st.st_uid}, not to us; refusing to use it")
    if st.st_mode & 0o077:
        os.chmod(path, DIR_MODE)
    return path


def write_private(path: str, data: bytes) -> None:
    """Atomically write ``data`` to ``path`` with mode 0600 (never readable by others, even briefly)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_private(path: str) -> bytes:
    """The bytes of a file we own and nobody else can read or write; refuse anything else.

    Raises FileNotFoundError when it is missing (callers treat that as "no record").
    """
    # a symlink is followed (Monarch's contexts link job_state to a file); the checks below are
    # on the file actually opened
    fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"refusing job record {path!r}: it belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); "
                "someone else wrote it, so it cannot be trusted"
            )
        if st.st_mode & 0o022:
            raise PermissionError(
                f"refusing job record {path!r}: others can write it (mode {st.st_mode & 0o777:o}); "
                "delete it and apply the job again"
            )
        return f.read()


def write_json(path: str, obj: Any) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
    write_private(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: str) -> Any:
    raw = read_private(path)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"job record {path!r} is not valid JSON ({e}); delete it and apply the job again") from e


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------ allocator announcements


def announce(directory: str, name: str, alloc: Any) -> str:
    """Write a serving allocator's addresses to ``directory/<name>.json``; returns the path.

    Called by the allocator itself (``--announce-dir``). The scheduler's own identifiers for
    this node (Slurm's node id) come along, so the launcher can order hosts as the scheduler did.
    """
    name = name or socket.gethostname()
    if "/" in name or name.startswith("."):
        raise ConfigError(f"announce name {name!r} must be a plain file name")
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    info = {
        "name": name,
        "hostname": socket.gethostname(),
        "alloc_id": alloc.id,
        "pid": os.getpid(),
        "ipc": alloc.rt.ipc_addr,
        "tcp": alloc.rt.tcp_addr,
        "connection_file": alloc.connection_file,
        "started": time.time(),
        "scheduler": {k: v for k, v in os.environ.items() if k in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURMD_NODENAME")},
    }
    path = os.path.join(directory, name + ANNOUNCE_SUFFIX)
    write_private(path, json.dumps(info).encode())
    return path


def read_announcements(directory: str) -> dict[str, dict[str, Any]]:
    """Announcements in ``directory`` by name (files not ours, or half-written, are skipped)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for n in names:
        if not n.endswith(ANNOUNCE_SUFFIX) or n.startswith("."):
            continue
        try:
            info = json.loads(read_private(os.path.join(directory, n)))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("name") == n[: -len(ANNOUNCE_SUFFIX)]:
            out[info["name"]] = info
    return out
