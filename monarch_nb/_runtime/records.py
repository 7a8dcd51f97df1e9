"""Allocator and job records: the small files that say where allocators are and what a job is.

The one owner of the connection files allocators leave in the runtime directory (their name
``allocator-<id>.json``, format, 0600 writer, readers, and the owner and mode checks that decide
which of them to trust), and of the launchers' job records (a job's cached state and the
allocators' announcements in its directory, below). A daemon writes its file once it serves;
controllers, the CLI, the debugger and the launchers read them to find allocators. Starting
this host's allocator goes through a lock file here, so concurrent controllers on a fresh
runtime directory share one daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError, ConnectError
from ._pids import pid_alive
from ._private import private

__all__ = [
    "PREFIX",
    "find_local_allocator",
    "local_allocator",
    "path_for",
    "read_connection_file",
    "read_connection_files",
    "start_local_allocator",
    "write_connection_file",
]

logger = logging.getLogger(__name__)

#: connection files are ``PREFIX + allocator id + SUFFIX``
PREFIX = "allocator-"
SUFFIX = ".json"
#: held (flock) by the process starting this host's allocator
_START_LOCK = "allocator.lock"

#: files already warned about (listing allocators reads them all, often)
_warned: set[str] = set()


def path_for(rdir: str, alloc_id: str) -> str:
    return os.path.join(rdir, f"{PREFIX}{alloc_id}{SUFFIX}")


def write_connection_file(rdir: str, alloc_id: str, info: dict[str, Any]) -> str:
    """Publish ``info`` as the connection file of ``alloc_id``: 0600 from creation, replaced atomically."""
    path = path_for(rdir, alloc_id)
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a crashed start, maybe with another mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return path


def _untrusted(path: str, st: os.stat_result) -> str:
    """Why a connection file must not be believed ("" if it may)."""
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write it (mode {stat.S_IMODE(st.st_mode):o})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    return ""


def read_connection_files(rdir: str) -> list[dict[str, Any]]:
    """Every trusted connection file in ``rdir`` (sorted by name), each with its path as ``file``.

    A file another user owns or may write is ignored, with a warning once: whoever wrote it
    chooses the address this process would send its code to.
    """
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(rdir))
    except OSError:
        return out
    for n in names:
        if not (n.startswith(PREFIX) and n.endswith(SUFFIX)):
            continue
        path = os.path.join(rdir, n)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or a symlink
        with os.fdopen(fd) as f:
            why = _untrusted(path, os.fstat(fd))
            if why:
                if path not in _warned:
                    _warned.add(path)
                    logger.warning("ignoring allocator connection file %s: %s", path, why)
                continue
            try:
                info = json.load(f)
            except (OSError, ValueError):
                continue
        if isinstance(info, dict):
            info["file"] = path
            out.append(info)
    return out


def read_connection_file(path: str) -> dict[str, Any]:
    """The connection info in the file at ``path`` (one a user names, say, copied from another host).

    Refused, as :func:`read_connection_files` ignores it, when another user owns it or may
    write it: they would choose the address, and over ipc the controller connects to their
    socket, sends its hello and unpickles what comes back. A link is followed (the checks are
    on the file opened).
    """
    try:
        # O_NONBLOCK: a FIFO at the path would block the open until someone writes to it
        with open(path, opener=lambda p, fl: os.open(p, fl | os.O_NONBLOCK)) as f:
            why = _untrusted(path, os.fstat(f.fileno()))
            if why:
                raise ConnectError(
                    f"refusing connection file {path}: {why}, so it may name anyone's allocator; "
                    "use one your allocator wrote, or copy it yourself (cp, then chmod 600) if you trust what it says"
                )
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ConnectError(f"cannot read connection file {path}: {e}") from None
    if not isinstance(info, dict):
        raise ConnectError(f"connection file {path} holds no allocator record")
    return info


def find_local_allocator(rdir: str) -> dict[str, Any] | None:
    """The connection info of a live allocator of this host in ``rdir``, if there is one."""
    host = socket.gethostname()
    for info in read_connection_files(rdir):
        addr = str(info.get("addr", ""))
        try:
            pid = int(info.get("pid", 0))
        except (TypeError, ValueError):
            continue
        if info.get("host") == host and pid_alive(pid) and addr.startswith("ipc://") and os.path.exists(addr[len("ipc://") :]):
            return info
    return None


@contextlib.contextmanager
def _start_lock(rdir: str, timeout: float) -> Iterator[None]:
    """Exclusive right to start this host's allocator in ``rdir`` (released if the holder dies)."""
    fd = os.open(os.path.join(rdir, _START_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConnectError(
                        f"another process has been starting the allocator in {rdir} for over {timeout:.0f} s; "
                        f"see the allocator-start-*.log files there"
                    ) from None
                time.sleep(0.02)  # flock has no timed wait; the holder is starting a daemon (seconds)
        yield
    finally:
        os.close(fd)


def local_allocator(rdir: str, timeout: float = 60.0, extra_args: list[str] | None = None) -> dict[str, Any]:
    """This host's allocator in ``rdir``: the running one, else one started now.

    Race-free: concurrent callers (kernels, scripts) serialize on a lock in ``rdir``; the first
    starts the daemon and the others find it.
    """
    info = find_local_allocator(rdir)
    if info is not None:
        return info
    with _start_lock(rdir, timeout):
        return find_local_allocator(rdir) or start_local_allocator(rdir, timeout, extra_args)


def _full_disk(rdir: str) -> str:
    """A sentence saying that ``rdir`` is on a (nearly) full disk, or ""."""
    try:
        st = os.statvfs(rdir)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= 1 << 20:
        return ""
    return (
        f" its runtime directory {rdir} is on a full disk ({free} bytes free): free space there, or set "
        "MONARCH_NB_RUNTIME_DIR to a directory on a disk with room"
    )


def start_local_allocator(rdir: str, timeout: float = 60.0, extra_args: list[str] | None = None) -> dict[str, Any]:
    """Start a detached allocator daemon on this host and wait for its connection file.

    Always starts a new one; :func:`local_allocator` is the way to get "the" allocator.
    """
    before = {i["file"] for i in read_connection_files(rdir)}
    log = open(os.path.join(rdir, f"allocator-start-{os.getpid()}.log"), "ab", opener=private)
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir)
    p = subprocess.Popen(
        [sys.executable, "-m", "monarch_nb", "allocator", *(extra_args or [])],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
        env=env,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for info in read_connection_files(rdir):
            if info["file"] not in before and info.get("pid") == p.pid:
                # the daemon outlives this process on purpose; while this one runs, a thread
                # reaps it when it ends (no zombie), and keeps the Popen from being collected
                # while it runs, which warned "subprocess N is still running" at a script's exit
                threading.Thread(target=p.wait, name="mnb-allocator-reaper", daemon=True).start()
                return info
        if p.poll() is not None:
            with open(log.name, errors="replace") as f:
                tail = f.read()[-2000:]
            # on a full disk its log is empty too: the one thing left to say is where the disk is full
            raise ConnectError(f"the local allocator exited with code {p.returncode} while starting:{_full_disk(rdir)}\n{tail}")
        time.sleep(0.02)  # polling a file the daemon writes; there is no event to wait on
    p.kill()
    raise ConnectError(f"the local allocator did not write its connection file within {timeout} s")


# ------------------------------------------------------------ job records
# Two more kinds of small files, both 0600 JSON written atomically (write a temporary, rename):
# a job's cached state (``job.dump()``, ``job.state(cached_path=...)``), JSON and never pickle,
# so a file in a shared or writable place cannot run code in the kernel that reads it (one owned
# by another user, or writable by others, is refused before it is parsed); and an allocator's
# announcement in its job's directory (``monarch-nb allocator --announce-dir``): the addresses it
# serves at, written by the allocator itself once it serves, so a launcher never guesses a node's
# address from a hostname or scrapes it from scheduler output.

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


def write_private(path: str, data: bytes, fsync: bool = True) -> None:
    """Atomically write ``data`` to ``path`` with mode 0600 (never readable by others, even briefly).

    ``fsync=False``: for what can be written again (content-addressed blobs), not records.
    """
    # a fresh name nobody can guess, O_EXCL: ``path`` may be in a directory others write (a
    # cached_path a user chose), where a name of our pid could be pre-created by another user,
    # and O_TRUNC would write the record into their file and rename it into place as theirs
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
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
    # O_NONBLOCK: a FIFO another user made at the path would block the open until they write
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"refusing job record {path!r}: it is not a regular file")
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


@contextlib.contextmanager
def job_lock(path: str) -> Iterator[None]:
    """Exclusive right to read, apply and write the job record at ``path`` (released if the
    holder dies): two kernels applying the same job at once would each submit one, and the
    record would keep only the second, leaving the first running unseen.

    The lock file goes when its holder is done (nothing is left beside the records): a waiter
    that then holds the lock of a file no longer at the path takes the path's new one."""
    lock = os.path.realpath(path) + ".lock"
    os.makedirs(os.path.dirname(lock), mode=DIR_MODE, exist_ok=True)
    told = False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    # the holder may wait for hours in a queue: say who, and that this cell waits for it
                    print(
                        f"process {holder} (another kernel or script) is applying the job cached at {path}; "
                        "waiting for it, then re-attaching to its job (interrupt to stop waiting)",
                        file=sys.stderr,
                        flush=True,
                    )
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)  # interruptible: Ctrl-C raises KeyboardInterrupt here
            try:
                same = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # its holder removed it on release: lock the one at the path now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.unlink(lock)  # while still holding it: a waiter on it then finds it gone
        except FileNotFoundError:
            pass
        os.close(fd)


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
