"""Configuration: frozen defaults < ``MONARCH_NB_<FIELD>`` environment < ``configure(**kw)``.

Durations are float seconds. Runtime objects take a :class:`Config`; only the public facade
reads the process-wide one via :func:`get_config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import _errgroup
from .errors import ConfigError

__all__ = ["Config", "configure", "configured", "get_config", "runtime_dir"]


@dataclasses.dataclass(frozen=True)
class Config:
    #: how often controllers ping allocators and allocators ping back
    heartbeat_interval: float = 0.5
    #: silence after which a peer counts as lost (issue target: detected < 3 s)
    heartbeat_timeout: float = 2.0
    #: waiting for procs to start and actors to be constructed
    spawn_timeout: float = 120.0
    #: waiting for a first answer from an address
    connect_timeout: float = 10.0
    #: stopping procs: a proc still running this long after its actors' ``__cleanup__`` has
    #: finished (a non-daemon thread, a slow atexit handler) is killed, and ``stop()`` says so
    stop_grace: float = 3.0
    #: stopping procs: how long their actors may take to finish the message in hand and
    #: ``__cleanup__`` before the proc is killed (and ``stop()`` says so); a proc mesh's stop
    #: must not wait on an actor stuck in a long call
    stop_cleanup_timeout: float = 2.0
    #: an allocator reaps persistent meshes after this long with no controller attached
    lease: float = 3600.0
    #: frames larger than this are refused at the sender and dropped at the receiver
    max_message_bytes: int = 8 << 30
    #: where connection files and ipc sockets live; empty means Jupyter's runtime dir
    runtime_dir: str = ""
    #: modules the allocator's zygote imports before forking procs
    zygote_preload: str = "torch"
    #: how long the allocator batches log lines before forwarding them
    log_flush_interval: float = 0.005
    #: messages queued to one peer (per sending thread) before a send waits for room: a peer
    #: that does not read (stopped, dead, slow network) costs a bounded amount of memory
    send_hwm: int = 1000
    #: how long a send to a peer whose queue is full waits for room before it fails (a log
    #: line for a slow subscriber is dropped at once instead, counted; it stays on disk)
    send_timeout: float = 10.0
    #: a connection to a peer unused this long is closed (an allocator answers many short-lived
    #: controllers: their sockets must not pile up); it reconnects on the next message
    peer_idle_close: float = 120.0
    #: a rank's log on disk is kept under this size, in two files (``rank-N.jsonl`` and the
    #: previous ``rank-N.jsonl.1``): the oldest half goes when the newest half is full; 0: no limit
    log_max_rank_bytes: int = 256 << 20
    #: a rank's line longer than this is cut there, and a note says so: the allocator holds a
    #: line in memory until it ends, and a rank writing bytes with no newline for ever (binary
    #: data to stdout) must not take the host's allocator down with it
    log_max_line_bytes: int = 64 << 20
    #: ``monarch-nb gc`` removes the oldest logs of stopped meshes and allocators beyond this total
    log_max_total_bytes: int = 4 << 30
    #: ``monarch-nb gc`` removes logs of stopped meshes and allocators older than this (seconds)
    log_max_age: float = 14 * 86400.0
    #: ``monarch-nb gc`` removes synced workspaces (code cache) not synced for this long (seconds),
    #: unless a running allocator's procs import from them
    code_max_age: float = 14 * 86400.0
    #: ``monarch-nb gc`` removes the least recently synced workspaces beyond this total
    code_max_total_bytes: int = 2 << 30
    #: a breakpoint hit while the caller waits with no way to ask for input (nbval, nbconvert,
    #: a script without a TTY): "continue" it after debug_no_input_timeout, "raise" DebugError
    #: from a wait on the call that stopped (after continuing it), or "wait" for an attach from a terminal (monarch-nb debug)
    debug_no_input: str = "continue"
    #: seconds a breakpoint with no input waits for an attach from elsewhere before "continue"/"raise"
    debug_no_input_timeout: float = 0.0
    #: out-of-band buffers at least this large go to a peer on this host through shared
    #: memory (/dev/shm, 0600, unguessable names); 0 turns it off
    shm_min_bytes: int = 8 << 20
    #: processes of one host talk over a direct AF_UNIX socket beside their zmq ipc inbox
    #: (fewer thread hops per message); off: zmq only
    direct_ipc: bool = True
    #: a message for this many or more procs of another host goes to that host's allocator
    #: once, which relays it to each; 0 sends every message straight to its proc
    fanout_min: int = 2
    #: relay through this host's allocator too (off: a thread reaches this host's procs faster
    #: over the direct path than a relay does, measured in bench/)
    fanout_local: bool = False
    #: a call to several actors in which one endpoint failed waits this long for the others'
    #: answers, then raises the lowest rank's failure (ranks failing alike answer within it)
    call_error_window: float = 0.5
    #: how long a message that overtook an earlier one from its sender waits for it before
    #: being delivered anyway (the earlier one was lost, e.g. with a failed relay)
    order_gap_timeout: float = 10.0
    #: show monarch_nb's own frames in remote tracebacks (hidden by default, as IPython hides its own)
    traceback_internal_frames: bool = False
    #: connections one RDMABuffer transfer across hosts is split over (each carries a byte
    #: range, each authenticated and encrypted); 0 chooses by size (see docs/rdma.md)
    rdma_streams: int = 0

    def replace(self, **kw: Any) -> Config:
        return dataclasses.replace(self, **kw)


_lock = threading.Lock()
_overrides: dict[str, Any] = {}


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _kind(field: dataclasses.Field[Any]) -> type:
    return field.type if isinstance(field.type, type) else {"float": float, "int": int, "str": str, "bool": bool}[str(field.type)]


def _coerce(field: dataclasses.Field[Any], raw: str, source: str = "") -> Any:
    kind = _kind(field)
    source = source or f"MONARCH_NB_{field.name.upper()}"
    if kind is bool:
        try:
            return _BOOLS[raw.strip().lower()]
        except KeyError:
            raise ConfigError(f"{source}={raw!r} is not a valid bool (1/0, true/false, yes/no, on/off)") from None
    try:
        return kind(raw)
    except ValueError as e:
        raise ConfigError(f"{source}={raw!r} is not a valid {kind.__name__}") from e


def _typed(field: dataclasses.Field[Any], value: Any, source: str) -> Any:
    """A configure() value as its field's type: configure(fanout_local="no") stored the string,
    which is true, and configure(heartbeat_timeout="2") failed later, deep in the runtime."""
    kind = _kind(field)
    if isinstance(value, str) and kind is not str:
        return _coerce(field, value, source)
    if kind is bool and (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        return bool(value)
    if kind is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{source}={value!r}: {field.name} is a whole number")
        return kind(value)
    words = {bool: "True or False", int: "a whole number", float: "a number of seconds", str: "a string"}
    raise ConfigError(f"{source}={value!r}: {field.name} is {words[kind]}, not {type(value).__name__}")


#: settings that take one of a few words: any other is refused where it is set, not found out
#: at the first breakpoint hit with no input, hours into a run
_CHOICES = {"debug_no_input": ("continue", "raise", "wait")}


def _check(name: str, value: Any, source: str) -> Any:
    """Every number here is a duration, a size or a count: a negative one (or NaN) means nothing,
    and a heartbeat timeout of -1 would declare every peer lost at once."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= 0:
        raise ConfigError(f"{source}={value!r}: {name} is seconds, bytes or a count, 0 or more")
    choices = _CHOICES.get(name)
    if choices is not None and value not in choices:
        words = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ConfigError(f"{source}={value!r}: {name} is {words}")
    return value


def env_int(name: str, default: int, lo: int, hi: int | None = None) -> int:
    """An integer read from the environment apart from :class:`Config` (a module's size, fixed
    at import): a value that is not an integer in ``[lo, hi]`` is a ConfigError naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if value < lo or (hi is not None and value > hi):
        bounds = f"from {lo} to {hi}" if hi is not None else f"{lo} or more"
        raise ConfigError(f"{name}={raw!r}: an integer {bounds} (default {default})")
    return value


def get_config() -> Config:
    """The configuration in force for this process."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        raw = os.environ.get(f"MONARCH_NB_{f.name.upper()}")
        if raw is not None:
            values[f.name] = _check(f.name, _coerce(f, raw), f"MONARCH_NB_{f.name.upper()}")
    with _lock:
        values.update(_overrides)
    return Config(**values)


def configure(**kw: Any) -> None:
    """Set configuration values for this process (they win over the environment)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    unknown = set(kw) - set(fields)
    if unknown:
        raise ConfigError(f"unknown configuration field(s) {sorted(unknown)}; known: {sorted(fields)}")
    kw = {
        name: _check(name, _typed(fields[name], value, f"configure({name})"), f"configure({name})") for name, value in kw.items()
    }
    with _lock:
        _overrides.update(kw)


@contextlib.contextmanager
def configured(**kw: Any) -> Iterator[Config]:
    """Temporarily override configuration values, e.g. in tests."""
    with _lock:
        saved = dict(_overrides)
    configure(**kw)
    try:
        yield get_config()
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)


def runtime_dir(cfg: Config | None = None) -> str:
    """The directory holding connection files and ipc sockets (created 0700).

    An existing one must be ours and private: another user's is refused (its sockets and
    connection files would decide where our code goes), and ours with a looser mode is made
    0700 with a warning.
    """
    cfg = cfg or get_config()
    path = cfg.runtime_dir or os.environ.get("MONARCH_NB_RUNTIME_DIR", "")
    chosen = bool(path)
    if not path:
        try:
            from jupyter_core.paths import jupyter_runtime_dir

            path = jupyter_runtime_dir()
        except ImportError:
            base = os.environ.get("JUPYTER_RUNTIME_DIR") or os.path.join(
                os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "jupyter", "runtime"
            )
            path = base
    try:
        check_path_to(path)
        _make_dirs(os.path.abspath(path), 0o700)
    except OSError as e:
        # a file on the path, a read-only or pseudo file system: every command and magic reads
        # this first, and an OSError's traceback named neither the setting nor the way out
        why = f"{e.filename} is a file" if isinstance(e, FileExistsError) else f"{e.strerror} ({e.filename or path})"
        raise ConfigError(
            f"cannot make the runtime directory {path}: {why}; set MONARCH_NB_RUNTIME_DIR to a directory you can write"
        ) from None
    _check_private_dir(path, chosen)
    return path


def _make_dirs(path: str, mode: int) -> None:
    """``os.makedirs(path, mode, exist_ok=True)``, except that each directory it makes above
    ``path`` is ``0755`` at most. makedirs gives those ``0777`` less the umask: under ``umask 000``
    anyone could rename the runtime directory away and put one of theirs in its place (its
    checks passed before the directories above it existed), and every later start was refused
    for a directory that monarch_nb had made."""
    above = os.path.dirname(path)
    if above != path and not os.path.isdir(above):
        _make_dirs(above, 0o755)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def check_path_to(
    path: str,
    what: str = "the runtime directory",
    fix: str = "set MONARCH_NB_RUNTIME_DIR to a directory of your own",
    trusted: str = "",
) -> None:
    """Refuse a directory another user can swap for one of theirs after it was checked.

    Every later bind, connect and open resolves the path again: a symbolic link on it that
    another user owns (``MONARCH_NB_RUNTIME_DIR=/tmp/rt``, planted before the user made it),
    or a directory above it that another user owns or anyone may write (not sticky), lets them
    point it at their own directory once the checks passed, with sockets of the names
    ``/proc/net/unix`` shows: our processes would connect to theirs and unpickle what they send.
    ``what`` and ``fix`` name the directory and the way out in the error; the directories above
    are checked up to ``trusted`` (not included; default: all of them, ``/`` too), the folder
    the user chose for it (a job's ``log_dir``).
    """
    uid = os.getuid()
    here = "/"
    for part in os.path.abspath(path).split("/"):
        if not part:
            continue
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (uid, 0):
            raise ConfigError(
                f"{what} {path} goes through {here}, a symbolic link of uid {st.st_uid}, not yours "
                f"(uid {uid}): they can point it elsewhere; {fix}"
            )
    real = os.path.realpath(path)
    above = os.path.dirname(real)
    stop = os.path.realpath(trusted) if trusted else None
    while above != stop:
        try:
            st = os.stat(above)
        except FileNotFoundError:  # made below, by us
            above = os.path.dirname(above)
            continue
        if st.st_uid not in (uid, 0) or (st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX):
            why = (
                f"belongs to uid {st.st_uid}"
                if st.st_uid not in (uid, 0)
                else f"anyone may write (mode {stat.S_IMODE(st.st_mode):o})"
            )
            raise ConfigError(
                f"{what} {path} is inside {above}, which {why}: they can replace it with a directory of theirs; {fix}"
            )
        if above == "/":
            break
        above = os.path.dirname(above)


def _holds_only_ours(path: str) -> bool:
    """Empty, or already a runtime directory of monarch_nb's (its lock, sockets, logs)."""
    names = os.listdir(path)
    return not names or any(n == "allocator.lock" or n.startswith("mnb-") for n in names)


def _check_private_dir(path: str, chosen: bool = True) -> None:
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"the runtime directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "set MONARCH_NB_RUNTIME_DIR to a directory of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        if mode & stat.S_ISVTX:  # a shared directory like /tmp: never take it over
            raise ConfigError(
                f"the runtime directory {path} is a shared directory (mode {mode:o}); "
                "set MONARCH_NB_RUNTIME_DIR to a private directory of your own"
            )
        if chosen and not _holds_only_ours(path):
            # a directory others use (/, a home, /run: run as root, they are "ours" too) must
            # never be closed to them; Jupyter's own runtime directory is meant to be private
            raise ConfigError(
                f"the runtime directory {path} is open to other users (mode {mode:o}) and holds files that are not "
                "monarch_nb's; set MONARCH_NB_RUNTIME_DIR to a private directory of your own (mkdir -m 700 DIR), "
                "or chmod 700 this one yourself if nobody else needs it"
            )
        os.chmod(path, 0o700)
        warnings.warn(
            f"the runtime directory {path} was mode {mode:o}, open to other users; made it 0700",
            RuntimeWarning,
            stacklevel=3,
        )


_errgroup.internal_frames_setting = lambda: get_config().traceback_internal_frames
