"""This host's procs as processes: started, their output captured, their exits noticed.

:class:`Procs` forks a proc from the warm zygote (or execs a bootstrap command), captures its
stdout/stderr into its :class:`~.logcapture.ProcLog`, and when it exits records why, fails
a start still waiting for it, and tells its owner. What a proc means for a mesh, and who
hears about it, is the allocator's business: it gets each exit through ``on_exit``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import SpawnError
from . import shm, zygote
from .logcapture import LogItem, ProcLog, line_text
from .runtime import Runtime
from .transport import Security

logger = logging.getLogger(__name__)
#: one read of a proc's output pipe; a pipe that fills it is widened to _WIDE_PIPE
_PIPE_READ = 1 << 16
_WIDE_PIPE = 1 << 20


@dataclasses.dataclass
class ProcRec:
    token: str
    mesh: str
    rank: int
    local_rank: int
    state: str = "starting"
    pid: int = 0
    addr: str = ""
    #: where this allocator reaches the proc (its ipc inbox; ``addr`` may be its TCP one)
    local: str = ""
    cause: str = ""
    #: why its mesh was stopped, for its cause, where the stop's caller said (an actor that
    #: failed stops the meshes it spawned): what a call to it then fails with names that
    stop_because: str = ""
    log: ProcLog | None = None
    fds: dict[int, str] = dataclasses.field(default_factory=dict)
    #: output pipes widened to _WIDE_PIPE
    wide: set[int] = dataclasses.field(default_factory=set)
    popen: subprocess.Popen[bytes] | None = None
    ready: asyncio.Future[None] | None = None
    exited: asyncio.Future[None] | None = None
    #: done once the proc says its actors' ``__cleanup__`` has finished (it is exiting)
    cleaned: asyncio.Future[None] | None = None
    #: the host's count of OOM kills when its mesh started (:func:`_oom_kills`): more at a
    #: SIGKILL nobody here sent means the kernel's OOM killer most likely took it
    oom_kills: int | None = None
    started: float = dataclasses.field(default_factory=time.time)
    #: cpu, rss, activity, call and line rates (see telemetry.py)
    tele: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MeshRec:
    name: str
    owner: str
    persist: bool
    labels: list[str]
    sizes: list[int]
    rank_base: int
    procs: list[ProcRec]
    state: str = "starting"
    created: float = dataclasses.field(default_factory=time.time)
    actors: dict[str, bytes] = dataclasses.field(default_factory=dict)
    #: per actor mesh id: {owner, label, created}
    actor_info: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_subs: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    #: procs the last stop had to kill: {rank, pid, host, why}
    killed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the host's count of OOM kills when its procs started (read once for all of them)
    oom_kills: int | None = None


def _gpu_count() -> int:
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
    except OSError:
        return 0


class Procs:
    """The procs of one allocator, by pid, token and address; used on the I/O thread."""

    def __init__(
        self,
        rt: Runtime,
        cfg: Config,
        security: Security,
        runtime_dir: str,
        *,
        on_exit: Callable[[ProcRec], None],
        on_lines: Callable[[str, list[LogItem]], None],
        on_call_end: Callable[[str, int, list[str]], None] | None = None,
    ) -> None:
        self.rt = rt
        self.cfg = cfg
        self.security = security
        self.runtime_dir = runtime_dir
        self._on_exit = on_exit
        self._on_lines = on_lines
        self._on_call_end = on_call_end
        self.by_pid: dict[int, ProcRec] = {}
        self.by_token: dict[str, ProcRec] = {}
        self.by_addr: dict[str, ProcRec] = {}
        self.gpus = _gpu_count()
        self._zsock: socket.socket | None = None
        self._zreq: zygote.Requests | None = None
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_ready: asyncio.Future[Any] | None = None
        #: set when the allocator shuts down: the zygote's exit is expected then
        self.closing = False

    def start_zygote(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        preload = ",".join(p for p in (self.cfg.zygote_preload, "monarch_nb.actor._bootstrap") if p)
        # the zygote is started from the main thread of the daemon: PDEATHSIG fires when the
        # *thread* that forked it exits, and the main thread lives as long as the daemon
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "monarch_nb._runtime.zygote", str(child.fileno()), preload],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        parent.setblocking(False)
        self._zsock = parent
        self._zreq = zygote.Requests(parent)
        self._zygote_ready = self.rt.loop.create_future()
        self.rt.loop.add_reader(parent.fileno(), self._on_zygote)

    def _on_zygote(self) -> None:
        assert self._zsock is not None
        while True:
            try:
                data = self._zsock.recv(1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.rt.loop.remove_reader(self._zsock.fileno())
                if self.closing:
                    logger.info("zygote stopped")
                    if self._zygote_ready and not self._zygote_ready.done():
                        _fail(self._zygote_ready, SpawnError("the allocator's zygote exited while starting"))
                else:
                    self._zygote_died()
                return
            msg = pickle.loads(data)
            if msg[0] == "ready":
                _, loaded, failed, dt = msg
                logger.info("zygote ready in %.2fs with %s", dt, loaded)
                for f in failed:
                    logger.warning("zygote could not preload %s", f)
                if self._zygote_ready and not self._zygote_ready.done():
                    self._zygote_ready.set_result(loaded)
            elif msg[0] == "spawned":
                rec = self.by_token.get(msg[1])
                if rec is not None:
                    rec.pid = msg[2]
                    self.by_pid[rec.pid] = rec
            elif msg[0] == "exited":
                rec = self.by_pid.get(msg[1])
                if rec is not None:
                    self._proc_exited(rec, msg[2])

    def _zygote_died(self) -> None:
        """The zygote is gone (killed, the OOM killer): the procs it forked died with it (their
        PDEATHSIG), and nobody else can say so; they fail now, with the reason, and the next
        spawn starts a new zygote."""
        z, self._zygote = self._zygote, None
        assert z is not None  # started with the reader that saw it end
        if z.poll() is None:  # closed its end but lives on: it can fork nothing for us now
            z.kill()
        why = f"(pid {z.pid}) {_how(z.wait())}"
        if self._zsock is not None:
            self._zsock.close()
        self._zsock = self._zreq = None
        ready, self._zygote_ready = self._zygote_ready, None
        if ready is not None and not ready.done():
            _fail(ready, SpawnError(f"the allocator's zygote {why} while starting"))
        forked = [
            r
            for r in self.by_token.values()
            if r.popen is None and r.state not in ("stopped", "failed") and (r.exited is None or not r.exited.done())
        ]
        logger.error("the zygote %s; the %d procs forked from it died with it; the next spawn starts a new one", why, len(forked))
        # no kill of our own: their PDEATHSIG did it, and their pids, no longer ours to reap,
        # may be another process's by now
        for rec in forked:
            self._proc_exited(rec, cause=f"this host's zygote {why}, and the procs forked from it died with it")

    def _proc_exited(self, rec: ProcRec, status: int = 0, cause: str = "") -> None:
        """``rec`` is gone: its wait ``status``, or ``cause`` where there is none to have."""
        self.by_pid.pop(rec.pid, None)
        if rec.pid:
            shm.sweep_dead(rec.pid)  # shared-memory buffers it sent that nobody took
        for fd in list(rec.fds):
            self._drain(rec, fd, final=True)
        if not cause:
            code = os.waitstatus_to_exitcode(status)
            cause = f"process {rec.pid} {_how(code)}"
            if code == -signal.SIGKILL and rec.state != "stopping":
                cause += _oom_hint(rec.oom_kills)
        if rec.state == "stopping":
            rec.state = "stopped"
            cause = f"mesh stopped ({cause})" + (f" because {rec.stop_because}" if rec.stop_because else "")
        else:
            rec.state = "failed"
            if rec.log is not None:
                last = [t for ln in rec.log.tail if ln[1] == "stderr" and (t := line_text(ln[4])).strip()][-3:]
                if last:
                    cause += "; last output: " + " | ".join(last)
        rec.cause = cause
        if rec.ready is not None and not rec.ready.done():
            rec.ready.set_exception(SpawnError(f"proc rank {rec.rank} of mesh {rec.mesh!r} died while starting: {cause}"))
        if rec.exited is not None and not rec.exited.done():
            rec.exited.set_result(None)
        if rec.log is not None:
            rec.log.close()
        self._on_exit(rec)

    def _on_output(self, rec: ProcRec, fd: int) -> None:
        self._drain(rec, fd)

    def _call_ended(self, rec: ProcRec, mesh: str, ids: list[str]) -> None:
        """``rec``'s log read that calls ``ids`` (maybe none) that printed ended. The proc names
        a call's end on the last stream it wrote to, after its text on the other one is in that
        pipe: read that first, so its lines go out before the end does."""
        assert self._on_call_end is not None
        if ids:
            # (the stream being read is read on after this, by the _drain that read it)
            for fd in list(rec.fds):
                self._drain(rec, fd)
        self._on_call_end(mesh, rec.rank, ids)

    def _drain(self, rec: ProcRec, fd: int, final: bool = False) -> None:
        stream = rec.fds.get(fd)
        if stream is None:
            return
        # a bounded number of reads per wake-up: a flooding proc must not starve pings and spawns
        size = _WIDE_PIPE if fd in rec.wide else _PIPE_READ
        for _ in range(1 << 20 if final else 4):
            try:
                data = os.read(fd, size)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.rt.loop.remove_reader(fd)
                os.close(fd)
                del rec.fds[fd]
                return
            if rec.log is not None:
                rec.log.feed(stream, data)
                if fd not in rec.fds:
                    return  # read to its end while the log was fed (_call_ended)
            if len(data) == _PIPE_READ and size == _PIPE_READ:
                # a full read: the proc is writing faster than one pipe buffer per wake-up (a
                # flood, a 10 MiB line); a wider pipe lets it go on with 16x fewer wake-ups of
                # both sides (asked only then: pipe memory counts against the user's limit)
                rec.wide.add(fd)
                try:
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _WIDE_PIPE)
                except OSError:
                    pass
            if not final and len(data) < size:
                return

    async def start(self, mesh: MeshRec, rec: ProcRec, spec: dict[str, Any], log_dir: str, workspaces: Callable[[], Any]) -> None:
        """Start ``rec`` (a proc of ``mesh``) as ``spec`` says, logging to ``log_dir``;
        ``workspaces()``: the synced code it imports from."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            rec.fds[fd] = stream
            self.rt.loop.add_reader(fd, self._on_output, rec, fd)
        if rec.local_rank == 0:  # the mesh's first: /proc/vmstat once per spawn, not per proc
            mesh.oom_kills = _oom_kills()
        rec.oom_kills = mesh.oom_kills
        rec.log = ProcLog(
            os.path.join(log_dir, mesh.name, f"rank-{rec.rank}.jsonl"),
            rec.rank,
            functools.partial(self._on_lines, mesh.name),
            self.cfg.log_max_rank_bytes,
            functools.partial(self._call_ended, rec, mesh.name) if self._on_call_end is not None else None,
            max_line=self.cfg.log_max_line_bytes,
        )
        # the controller's environment when it sent one (its this_host()), else this host's
        env = dict(spec["env"]) if spec.get("env") is not None else dict(os.environ)
        coords = _coords(rec.local_rank, mesh.sizes)
        if self.gpus and "gpus" in mesh.labels:
            c = coords[mesh.labels.index("gpus")]
            # devices a scheduler gave this job (Slurm's CUDA_VISIBLE_DEVICES=4,5,6,7 on a shared
            # node) are the ones shared out, not the host's first: those may be another job's
            given = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            shared = given or [str(i) for i in range(self.gpus)]
            env["CUDA_VISIBLE_DEVICES"] = shared[c % len(shared)]
            # all of them, for torchrun's scripts (spmd.py): their LOCAL_RANK indexes this list
            env["MONARCH_NB_HOST_GPUS"] = ",".join(shared)
        proc_spec = {
            "workspaces": workspaces(),
            "token": rec.token,
            "alloc_addr": self.rt.ipc_addr,
            "alloc_tcp": self.rt.tcp_addr,
            "runtime_dir": self.runtime_dir,
            # procs bind where their allocator is bound (not where it is advertised)
            "tcp_ip": (self.rt.transport.bound_tcp or self.rt.tcp_addr).rsplit(":", 1)[0][len("tcp://") :]
            if self.rt.tcp_addr
            else None,
            "key": self.security.key,
            "trust_all": self.security.trust_all,
            "mesh": mesh.name,
            "rank": rec.rank,
            "extent": spec["extent"],
            "host": self.rt.hostname,
            "cfg": dataclasses.asdict(self.cfg),
            "bootstrap": spec.get("bootstrap"),
        }
        cmd = spec.get("bootstrap_command")
        try:
            if cmd:
                argv, cmd_env = cmd[0], cmd[1]
                if len(cmd) > 2 and not cmd[2]:
                    # inherit_env=False: an empty environment but for what a proc needs to start
                    env = {k: v for k, v in env.items() if k.startswith("MONARCH_NB_") or k in _PROC_ENV}
                for k, v in (cmd_env or {}).items():
                    if v is None:
                        env.pop(k, None)
                    else:
                        env[k] = v
                spec_r, spec_w = os.pipe()
                env["MONARCH_NB_PROC_SPEC_FD"] = str(spec_r)
                rec.popen = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=spec.get("cwd") if os.path.isdir(spec.get("cwd") or "") else None,
                    stdin=subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    pass_fds=(spec_r,),
                    preexec_fn=_die_with_allocator,
                )
                os.close(spec_r)
                with os.fdopen(spec_w, "wb") as f:
                    pickle.dump(proc_spec, f)
                rec.pid = rec.popen.pid
                self.by_pid[rec.pid] = rec
                pidfd = os.pidfd_open(rec.pid)
                self.rt.loop.add_reader(pidfd, self._on_exec_exit, rec, pidfd)
            else:
                if self._zygote is None and not self.closing:
                    self.start_zygote()  # the last one died (see _zygote_died)
                zreq, ready = self._zreq, self._zygote_ready
                if zreq is None or ready is None:
                    raise SpawnError("the allocator is shutting down")
                await ready
                req = {
                    "token": rec.token,
                    "env": env,
                    "sys_path": spec["sys_path"],
                    "cwd": spec.get("cwd", ""),
                    "entry": "monarch_nb.actor._bootstrap:main",
                    "spec": proc_spec,
                }
                try:
                    await zreq.send(pickle.dumps(req), [out_w, err_w])
                except TimeoutError as e:
                    raise SpawnError(str(e)) from None
                except OSError as e:  # it died as this request went to it
                    raise SpawnError(f"the allocator's zygote died while the spawn was sent to it ({e}); spawn again") from None
        finally:
            os.close(out_w)
            os.close(err_w)

    def _on_exec_exit(self, rec: ProcRec, pidfd: int) -> None:
        self.rt.loop.remove_reader(pidfd)
        os.close(pidfd)
        assert rec.popen is not None
        _, status = os.waitpid(rec.popen.pid, 0)
        rec.popen.returncode = 0
        self._proc_exited(rec, status)

    def drain_all(self) -> int:
        """Read whatever every proc has written (its log lines go out as usual); how many streams."""
        n = 0
        for rec in list(self.by_token.values()):
            for fd in list(rec.fds):
                self._drain(rec, fd, final=True)
                n += 1
        return n

    def close(self) -> None:
        """Kill every proc and the zygote."""
        for rec in list(self.by_pid.values()):
            kill(rec.pid)
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote.wait()


#: what a proc started with inherit_env=False still gets (Monarch's launch variables are always set)
_PROC_ENV = frozenset({"PYTHONPATH", "CUDA_VISIBLE_DEVICES"})


def _oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this host since boot (a cgroup's
    limit included), or None where the kernel does not say (``/proc/vmstat``'s ``oom_kill``)."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _oom_hint(before: int | None) -> str:
    """What to add to a SIGKILL nobody here sent: the OOM killer, if it ran since ``before``."""
    now = _oom_kills()
    if before is None or now is None or now <= before:
        return ""
    return (
        f" (the kernel's OOM killer killed {now - before} process(es) on this host since it started: most likely "
        "it ran out of memory, its own or its cgroup's limit; `dmesg` says which)"
    )


def _fail(ready: asyncio.Future[Any], e: BaseException) -> None:
    """Fail the zygote's readiness with ``e``, marked as seen: a spawn waiting on it raises it,
    and with none waiting (the allocator stopping before its zygote was ready) asyncio no longer
    logs "Future exception was never retrieved" with a traceback at the allocator's exit."""
    ready.set_exception(e)
    ready.exception()


def _how(code: int) -> str:
    """How a process ended, from its exit code as ``subprocess`` gives it (-N: signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"was killed by {name}"


def _coords(index: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(index % s)
        index //= s
    return out[::-1]


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_allocator() -> None:
    from ._prctl import die_with_parent

    die_with_parent()
