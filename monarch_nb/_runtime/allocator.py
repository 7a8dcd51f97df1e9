"""The allocator daemon: one per host, outlives any controller.

It spawns procs (forked from the warm zygote, or exec'd from a bootstrap command), owns them
(they die with it), captures their output into per-proc logs, tells subscribers when procs
exit, and reaps meshes nobody holds: a script's meshes when its controller goes away, and
everything once no controller has been attached for the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import json
import logging
import math
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from .. import __version__
from .._wire import frames as wire
from ..config import Config
from ..errors import MeshError, ProtocolError, SpawnError
from . import shm
from .codecache import CodeCache
from .debugreg import DebugRegistry
from .logcapture import LogLine, ProcLog, read_log
from .runtime import NO_REPLY, Runtime, pid_alive, system_method
from .telemetry import Telemetry
from .transport import Security

logger = logging.getLogger(__name__)

CONNECTION_PREFIX = "allocator-"


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
    log: ProcLog | None = None
    fds: dict[int, str] = dataclasses.field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    ready: asyncio.Future[None] | None = None
    exited: asyncio.Future[None] | None = None
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
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_subs: set[tuple[str, int]] = dataclasses.field(default_factory=set)


def _gpu_count() -> int:
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
    except OSError:
        return 0


class Allocator(DebugRegistry):
    def __init__(
        self, cfg: Config, security: Security, runtime_dir: str, *, tcp_ip: str | None = None, tcp_port: int = 0
    ) -> None:
        self.cfg = cfg
        self.rt = Runtime(cfg, security, runtime_dir, tcp_ip=tcp_ip, tcp_port=tcp_port, label="allocator")
        self.security = security
        self.runtime_dir = runtime_dir
        self.meshes: dict[str, MeshRec] = {}
        self.by_pid: dict[int, ProcRec] = {}
        self.by_token: dict[str, ProcRec] = {}
        self.by_addr: dict[str, ProcRec] = {}
        self.controllers: dict[str, dict[str, Any]] = {}  # reply addr -> info
        self.subscribers: dict[tuple[str, int], float] = {}
        self.idle_since = time.monotonic()
        self.log_dir = ""
        self.connection_file = ""
        self._zsock: socket.socket | None = None
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_ready: asyncio.Future[Any] | None = None
        self._pending_logs: dict[tuple[tuple[str, int], str], list[Any]] = {}
        self._flush_scheduled = False
        self._last_log_flush = 0.0
        self._anon = 0
        self.stopped = asyncio.Event()
        self.gpus = _gpu_count()
        self.telemetry = Telemetry(self)
        self._code: CodeCache | None = None
        self._debug_init()

    # ------------------------------------------------------------ lifecycle
    def start(self, key_file: str = "") -> None:
        self.rt.start()
        self.id = self.rt.uid
        self.log_dir = os.path.join(self.runtime_dir, f"mnb-logs-{self.id}")
        os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
        self.rt.system["__allocator__"] = self
        self.rt.resolve_proc = self._local_addr
        self.rt.submit(self._start_async()).result(timeout=30)
        info = {
            "alloc_id": self.id,
            "pid": os.getpid(),
            "host": self.rt.hostname,
            "addr": self.rt.ipc_addr,
            "tcp": self.rt.tcp_addr,
            "key_file": key_file,
            "version": __version__,
            "started": time.time(),
            "log_dir": self.log_dir,
        }
        path = os.path.join(self.runtime_dir, f"{CONNECTION_PREFIX}{self.id}.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)
        self.connection_file = path
        logger.info("allocator %s serving at %s %s", self.id, self.rt.ipc_addr, self.rt.tcp_addr)

    async def _start_async(self) -> None:
        self._start_zygote()
        self.rt._spawn(self._reaper())
        self.rt._spawn(self.telemetry.run())

    def _start_zygote(self) -> None:
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
        self._zygote_ready = self.rt.loop.create_future()
        self.rt.loop.add_reader(parent.fileno(), self._on_zygote)

    def serve_forever(self) -> None:
        try:
            self.rt.submit(self.stopped.wait()).result()
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        try:
            self.rt.submit(self._stop_all("allocator shutting down")).result(timeout=15)
        except Exception:
            logger.exception("stopping procs failed")
        for rec in list(self.by_pid.values()):
            _kill(rec.pid)
        if self._zygote is not None:
            self._zygote.kill()
            self._zygote.wait()
        if self.connection_file:
            try:
                os.unlink(self.connection_file)
            except OSError:
                pass
        self.rt.close()

    # ------------------------------------------------------------ zygote and procs
    def _on_zygote(self) -> None:
        assert self._zsock is not None
        while True:
            try:
                data = self._zsock.recv(1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.rt.loop.remove_reader(self._zsock.fileno())
                logger.error("zygote exited; procs can no longer be forked")
                if self._zygote_ready and not self._zygote_ready.done():
                    self._zygote_ready.set_exception(SpawnError("the allocator's zygote exited while starting"))
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

    def _proc_exited(self, rec: ProcRec, status: int) -> None:
        self.by_pid.pop(rec.pid, None)
        shm.sweep_dead(rec.pid)  # shared-memory buffers it sent that nobody took
        for fd in list(rec.fds):
            self._drain(rec, fd, final=True)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = str(sig)
            cause = f"process {rec.pid} was killed by {name}"
        else:
            cause = f"process {rec.pid} exited with code {os.WEXITSTATUS(status)}"
        if rec.state == "stopping":
            rec.state = "stopped"
            cause = f"mesh stopped ({cause})"
        else:
            rec.state = "failed"
            if rec.log is not None:
                last = [ln[4] for ln in rec.log.tail if ln[1] == "stderr" and ln[4].strip()][-3:]
                if last:
                    cause += "; last output: " + " | ".join(last)
        rec.cause = cause
        if rec.ready is not None and not rec.ready.done():
            rec.ready.set_exception(SpawnError(f"proc rank {rec.rank} of mesh {rec.mesh!r} died while starting: {cause}"))
        if rec.exited is not None and not rec.exited.done():
            rec.exited.set_result(None)
        if rec.log is not None:
            rec.log.close()
        self._debug_proc_exited(rec.token, cause)
        self._publish(("proc_exited", rec.addr, rec.mesh, rec.rank, self.rt.hostname, cause))
        self._publish(("state", rec.mesh, rec.rank, rec.state, cause))
        mesh = self.meshes.get(rec.mesh)
        if mesh is not None and rec.state == "failed" and mesh.state != "stopping":
            mesh.state = "failed"

    def _on_output(self, rec: ProcRec, fd: int) -> None:
        self._drain(rec, fd)

    def _drain(self, rec: ProcRec, fd: int, final: bool = False) -> None:
        stream = rec.fds.get(fd)
        if stream is None:
            return
        # a bounded number of reads per wake-up: a flooding proc must not starve pings and spawns
        for _ in range(1 << 20 if final else 4):
            try:
                data = os.read(fd, 1 << 16)
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
            if not final and len(data) < (1 << 16):
                return

    def _emit_logs(self, mesh_name: str, lines: list[LogLine]) -> None:
        mesh = self.meshes.get(mesh_name)
        if mesh is None or not mesh.log_subs:
            return
        for sub in mesh.log_subs:
            self._pending_logs.setdefault((sub, mesh_name), []).extend(lines)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # the first lines after a quiet spell go at once; a flood is sent in batches
            wait = self._last_log_flush + self.cfg.log_flush_interval - time.monotonic()
            if wait <= 0:
                self.rt.loop.call_soon(self._flush_logs)
            else:
                self.rt.loop.call_later(wait, self._flush_logs)

    def _flush_logs(self) -> None:
        self._flush_scheduled = False
        self._last_log_flush = time.monotonic()
        pending, self._pending_logs = self._pending_logs, {}
        for ((addr, port), mesh), lines in pending.items():
            self.rt.send_port(addr, port, 0, wire.ITEM, ("logs", lines, mesh, self.id))

    def _publish(self, event: tuple[Any, ...]) -> None:
        for addr, port in list(self.subscribers):
            self.rt.send_port(addr, port, 0, wire.ITEM, event)

    async def _start_proc(self, mesh: MeshRec, rec: ProcRec, spec: dict[str, Any]) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            rec.fds[fd] = stream
            self.rt.loop.add_reader(fd, self._on_output, rec, fd)
        rec.log = ProcLog(
            os.path.join(self.log_dir, mesh.name, f"rank-{rec.rank}.jsonl"),
            rec.rank,
            lambda lines, m=mesh.name: self._emit_logs(m, lines),
        )
        env = dict(spec["env"])
        coords = _coords(rec.local_rank, mesh.sizes)
        if self.gpus and "gpus" in mesh.labels:
            env["CUDA_VISIBLE_DEVICES"] = str(coords[mesh.labels.index("gpus")] % self.gpus)
        proc_spec = {
            "workspaces": self.code.workspaces(),
            "token": rec.token,
            "alloc_addr": self.rt.ipc_addr,
            "alloc_tcp": self.rt.tcp_addr,
            "runtime_dir": self.runtime_dir,
            "tcp_ip": self.rt.tcp_addr.rsplit(":", 1)[0][len("tcp://") :] if self.rt.tcp_addr else None,
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
                assert self._zygote_ready is not None and self._zsock is not None
                await self._zygote_ready
                req = {
                    "token": rec.token,
                    "env": env,
                    "sys_path": spec["sys_path"],
                    "cwd": spec.get("cwd", ""),
                    "entry": "monarch_nb.actor._bootstrap:main",
                    "spec": proc_spec,
                }
                socket.send_fds(self._zsock, [pickle.dumps(req)], [out_w, err_w])
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

    # ------------------------------------------------------------ system methods
    def sys_hello(self, info: dict[str, Any]) -> dict[str, Any]:
        if info.get("role", "controller") == "controller":
            self.controllers[info["addr"]] = {**info, "last_seen": time.monotonic()}
        return {
            "alloc_id": self.id,
            "version": __version__,
            "host": self.rt.hostname,
            "pid": os.getpid(),
            "addr": self.rt.ipc_addr,
            "tcp": self.rt.tcp_addr,
            "gpus": self.gpus,
            "versions": self._versions,
        }

    @functools.cached_property
    def _versions(self) -> dict[str, str]:
        from .._pyenv import critical_versions

        return critical_versions()

    # ------------------------------------------------------------ the host's environment
    async def sys_env(self) -> dict[str, Any]:
        from .._pyenv import describe

        return await asyncio.to_thread(describe)

    async def sys_env_pip(self, spec: str) -> dict[str, Any]:
        """``pip install spec`` into this allocator's interpreter (fails fast without an index)."""
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--timeout",
            "5",
            "--retries",
            "0",
            spec,
        ]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return {"ok": proc.returncode == 0, "output": out.decode(errors="replace")[-4000:]}

    def sys_env_install_files(self, name: str, files: dict[str, str], remove: str = "") -> int:
        """Install a distribution from synced blobs into this interpreter's site-packages."""
        import sysconfig
        from importlib import metadata

        site = sysconfig.get_paths()["purelib"]
        if remove:
            try:
                old = metadata.distribution(remove)
                for f in old.files or []:
                    p = os.path.normpath(os.path.join(site, str(f)))
                    if p.startswith(site + os.sep) and os.path.isfile(p):
                        os.unlink(p)
            except metadata.PackageNotFoundError:
                pass
        n = 0
        for rel, digest in files.items():
            dest = os.path.normpath(os.path.join(site, rel))
            if not dest.startswith(site + os.sep):
                raise ProtocolError(f"{name}: file {rel!r} would land outside site-packages")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(self.code._blob(digest), dest)
            n += 1
        importlib.invalidate_caches()
        return n

    @system_method(wants_reply=True)
    def sys_subscribe(self, *, _reply: tuple[str, int, int]) -> Any:
        addr, port, _ = _reply
        self.subscribers[(addr, port)] = time.monotonic()
        for mesh in self.meshes.values():
            for rec in mesh.procs:
                if rec.state in ("failed", "stopped"):
                    self.rt.send_port(
                        addr, port, 0, wire.ITEM, ("proc_exited", rec.addr, rec.mesh, rec.rank, self.rt.hostname, rec.cause)
                    )
        self._debug_replay(addr, port)
        return NO_REPLY

    @system_method(wants_reply=True)
    def sys_ping(self, *, _reply: tuple[str, int, int]) -> Any:
        addr, port, _ = _reply
        now = time.monotonic()
        if (addr, port) in self.subscribers:
            self.subscribers[(addr, port)] = now
        c = self.controllers.get(addr)
        if c is not None:
            c["last_seen"] = now
        self.rt.send_port(addr, port, 0, wire.ITEM, ("pong",))
        return NO_REPLY

    def sys_bye(self, addr: str) -> int:
        c = self.controllers.pop(addr, None)
        if c is None:
            return 0
        return self._orphan(c["cid"])

    async def sys_spawn(self, spec: dict[str, Any]) -> dict[str, Any]:
        name = spec.get("name") or ""
        if not name or name == "anon":
            self._anon += 1
            name = f"anon-{self.id[:4]}-{self._anon}"
        if not _MESH_NAME.fullmatch(name):
            raise MeshError(f"bad mesh name {name[:80]!r}: use letters, digits, '_', '-' and '.', not starting with '.'")
        if name in self.meshes:
            m = self.meshes[name]
            raise MeshError(
                f"a mesh named {name!r} already exists on host {self.rt.hostname} "
                f"(state {m.state}, owner {m.owner}); stop it first or choose another name"
            )
        labels, sizes = list(spec["labels"]), list(spec["sizes"])
        n = math.prod(sizes)
        mesh = MeshRec(name, spec["owner"], bool(spec.get("persist")), labels, sizes, spec.get("rank_base", 0), [])
        mesh.info = {"extent": spec["extent"], "host_index": spec.get("host_index", 0)}
        self.meshes[name] = mesh
        self._rotate_logs(name)
        loop = self.rt.loop
        for i in range(n):
            rec = ProcRec(secrets.token_hex(8), name, mesh.rank_base + i, i)
            rec.ready = loop.create_future()
            rec.exited = loop.create_future()
            mesh.procs.append(rec)
            self.by_token[rec.token] = rec
        if spec.get("stream_logs_to"):
            mesh.log_subs.add(tuple(spec["stream_logs_to"]))  # type: ignore[arg-type]
        try:
            async with asyncio.timeout(self.cfg.spawn_timeout):
                for rec in mesh.procs:
                    await self._start_proc(mesh, rec, spec)
                await asyncio.gather(*(r.ready for r in mesh.procs if r.ready is not None))
        except BaseException as e:
            await self._stop_mesh(mesh, "spawn failed")
            self.meshes.pop(name, None)
            if isinstance(e, TimeoutError):
                raise SpawnError(
                    f"procs of mesh {name!r} did not start within {self.cfg.spawn_timeout} s on host {self.rt.hostname}"
                ) from None
            tail = ""
            for rec in mesh.procs:
                if rec.log is not None and rec.state == "failed":
                    tail = "\n".join(ln[4] for ln in rec.log.tail[-20:])
                    break
            if isinstance(e, SpawnError):
                raise SpawnError(str(e), tail) from None
            raise
        mesh.state = "running"
        self._publish(("mesh", name, "running"))
        return {
            "name": name,
            "procs": [(r.addr, r.pid, r.rank) for r in mesh.procs],
            "host": self.rt.hostname,
        }

    def _rotate_logs(self, name: str) -> None:
        """A new mesh with an old mesh's name starts a fresh log; the old one is kept beside it."""
        d = os.path.join(self.log_dir, name)
        if os.path.isdir(d):
            os.rename(d, f"{d}~{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")

    def sys_proc_ready(self, token: str, addr: str, pid: int, local: str = "") -> Any:
        rec = self.by_token.get(token)
        if rec is None:
            return NO_REPLY
        rec.addr = addr
        rec.local = local or addr
        self.by_addr[addr] = rec
        rec.pid = pid
        self.by_pid[pid] = rec
        rec.state = "running"
        if rec.ready is not None and not rec.ready.done():
            rec.ready.set_result(None)
        return NO_REPLY

    def _local_addr(self, addr: str) -> str | None:
        """Relay (fan-out) destinations: only this allocator's live procs, never other addresses."""
        rec = self.by_addr.get(addr)
        return rec.local if rec is not None and rec.state == "running" else None

    def sys_flush_logs(self) -> int:
        """Read whatever procs have written and send it now (answered after the logs, on the same link)."""
        n = 0
        for rec in list(self.by_token.values()):
            for fd in list(rec.fds):
                self._drain(rec, fd, final=True)
                n += 1
        self._flush_logs()
        return n

    # ------------------------------------------------------------ synced code
    @property
    def code(self) -> CodeCache:
        if self._code is None:
            self._code = CodeCache(os.path.join(self.runtime_dir, "mnb-code"))
        return self._code

    def sys_sync_missing(self, digests: list[str]) -> list[str]:
        """Which of these blobs this host lacks (so only those cross the network)."""
        return self.code.missing(digests)

    def sys_sync_put(self, blobs: dict[str, Any]) -> int:
        return self.code.put(blobs)

    def sys_sync_pull(self, url: str, digests: list[str]) -> int:
        """Fetch blobs from a staging area (any fsspec URL this host can reach)."""
        import fsspec

        fs, base = fsspec.core.url_to_fs(url)
        n = 0
        for d in self.code.missing(digests):
            n += self.code.put({d: fs.cat_file(f"{base.rstrip('/')}/blobs/{d}")})
        return n

    def sys_sync_commit(self, ws: str, manifest: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
        return self.code.commit(ws, manifest)

    def sys_note_actor(self, mesh: str, actor: str, cls_blob: bytes) -> None:
        m = self.meshes.get(mesh)
        if m is not None:
            m.actors[actor] = cls_blob

    @system_method(wants_reply=True)
    def sys_stream_logs(self, mesh: str, on: bool = True, *, _reply: tuple[str, int, int]) -> Any:
        m = self.meshes.get(mesh)
        if m is None:
            raise MeshError(f"no mesh named {mesh!r} on host {self.rt.hostname}")
        sub = (_reply[0], _reply[1])
        if on:
            m.log_subs.add(sub)
        else:
            m.log_subs.discard(sub)
        return NO_REPLY

    async def sys_stop_mesh(self, name: str, cid: str = "", force: bool = False, reason: str = "stopped by client") -> int:
        m = self.meshes.get(name)
        if m is None:
            raise MeshError(f"no mesh named {name!r} on host {self.rt.hostname}")
        self._detach_dead_local()
        owner_attached = any(c.get("cid") == m.owner for c in self.controllers.values())
        # an owner that is gone (kernel restarted, script exited) hands its meshes to whoever re-attached
        if cid and m.owner != cid and owner_attached and not force:
            raise PermissionError(f"mesh {name!r} is owned by another controller ({m.owner}); pass force=True to stop it anyway")
        n = await self._stop_mesh(m, reason)
        self.meshes.pop(name, None)
        return n

    def sys_lookup(self, name: str) -> dict[str, Any]:
        m = self.meshes.get(name)
        if m is None:
            raise MeshError(f"no mesh named {name!r} on host {self.rt.hostname}; known: {sorted(self.meshes) or 'none'}")
        return {
            "name": m.name,
            "owner": m.owner,
            "persist": m.persist,
            "labels": m.labels,
            "sizes": m.sizes,
            "extent": m.info.get("extent"),
            "state": m.state,
            "procs": [(r.addr, r.pid, r.rank, r.state) for r in m.procs],
            "actors": dict(m.actors),
            "host": self.rt.hostname,
        }

    def sys_status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "alloc_id": self.id,
            "host": self.rt.hostname,
            "pid": os.getpid(),
            "addr": self.rt.ipc_addr,
            "tcp": self.rt.tcp_addr,
            "version": __version__,
            # fan-out: messages for several of our procs received once and relayed to each
            "relayed": {"messages": self.rt.relayed[0], "deliveries": self.rt.relayed[1]},
            "controllers": [
                {
                    "cid": c["cid"],
                    "kind": c.get("kind"),
                    "pid": c.get("pid"),
                    "host": c.get("host"),
                    "idle_s": now - c["last_seen"],
                }
                for c in self.controllers.values()
            ],
            "meshes": [
                {
                    "name": m.name,
                    "owner": m.owner,
                    "persist": m.persist,
                    "state": m.state,
                    "labels": m.labels,
                    "sizes": m.sizes,
                    "extent": m.info.get("extent"),
                    "actors": sorted(m.actors),
                    "procs": [
                        {
                            "rank": r.rank,
                            "pid": r.pid,
                            "state": r.state,
                            "addr": r.addr,
                            "cause": r.cause,
                            "log": r.log.path if r.log else "",
                            "lines": r.log.nlines if r.log else 0,
                            **r.tele,
                        }
                        for r in m.procs
                    ],
                }
                for m in self.meshes.values()
            ],
            "debug_sessions": self.sys_debug_list(),
            "lease_s": self.cfg.lease,
            "idle_s": now - self.idle_since if not self.controllers else 0.0,
            "host_stats": self.telemetry.host,
        }

    def sys_logs(self, mesh: str, rank: int, tail: int | None = None, start: int = 0) -> list[dict[str, Any]]:
        path = os.path.join(self.log_dir, mesh, f"rank-{rank}.jsonl")
        if not os.path.exists(path):
            raise MeshError(f"no log for mesh {mesh!r} rank {rank} on host {self.rt.hostname}")
        return read_log(path, tail, start)

    def sys_shutdown(self) -> str:
        self.rt.loop.call_later(0.05, self.stopped.set)
        return "shutting down"

    # ------------------------------------------------------------ stopping and reaping
    async def _stop_mesh(self, m: MeshRec, reason: str) -> int:
        m.state = "stopping"
        live = [r for r in m.procs if r.state in ("starting", "running")]
        for r in live:
            r.state = "stopping"
            if r.addr:
                try:
                    self.rt.send_actor(r.addr, "__sys__", "shutdown", *_EMPTY_ARGS)
                except Exception:
                    pass
            elif r.pid:
                _kill(r.pid, signal.SIGTERM)
        waits = [r.exited for r in live if r.exited is not None and r.pid]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=2.0)
            for r in live:
                if r.exited is not None and not r.exited.done() and r.pid:
                    _kill(r.pid)
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for r in m.procs:
            self.by_token.pop(r.token, None)
            if self.by_addr.get(r.addr) is r:
                del self.by_addr[r.addr]
        self._debug_mesh_stopped(m.name)
        m.state = "stopped"
        self._publish(("mesh", m.name, "stopped", reason))
        return len(live)

    async def _stop_all(self, reason: str) -> None:
        for m in list(self.meshes.values()):
            await self._stop_mesh(m, reason)
        self.meshes.clear()

    def _detach_dead_local(self) -> None:
        """A controller on this host (it reached us over ipc) whose process is gone has detached,
        without waiting for its heartbeats to time out: a restarted kernel re-attaches at once."""
        for addr, c in list(self.controllers.items()):
            if addr.startswith("ipc://") and not pid_alive(int(c.get("pid") or 0)):
                logger.info("controller %s (pid %s) exited; detaching it", c["cid"], c.get("pid"))
                del self.controllers[addr]
                if c.get("pid"):
                    shm.sweep_dead(int(c["pid"]))  # its pooled and in-flight shared memory
                self._orphan(c["cid"])

    def _orphan(self, cid: str) -> int:
        n = 0
        for m in list(self.meshes.values()):
            if m.owner == cid and not m.persist and m.state in ("running", "failed"):
                n += 1
                self.rt._spawn(self._stop_then_forget(m, "its controller went away"))
        return n

    async def _stop_then_forget(self, m: MeshRec, reason: str) -> None:
        await self._stop_mesh(m, reason)
        if self.meshes.get(m.name) is m:
            del self.meshes[m.name]

    async def _reaper(self) -> None:
        detach_after = max(5.0, 3 * self.cfg.heartbeat_timeout)
        while True:
            await asyncio.sleep(min(self.cfg.heartbeat_interval, self.cfg.lease / 4 or 0.1))
            now = time.monotonic()
            self._detach_dead_local()
            for addr, c in list(self.controllers.items()):
                if now - c["last_seen"] > detach_after:
                    logger.info("controller %s (pid %s) went silent; detaching it", c["cid"], c.get("pid"))
                    del self.controllers[addr]
                    self._orphan(c["cid"])
            for sub, seen in list(self.subscribers.items()):
                if now - seen > detach_after and sub[0] not in self.controllers:
                    del self.subscribers[sub]
            if self.controllers:
                self.idle_since = now
            elif self.meshes and now - self.idle_since > self.cfg.lease:
                logger.info("lease of %.0f s expired with no controller attached; stopping all meshes", self.cfg.lease)
                await self._stop_all("lease expired")
                self.idle_since = now


_MESH_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_EMPTY_ARGS = pickle.dumps(((), {}), protocol=5), []

#: what a proc started with inherit_env=False still gets (Monarch's launch variables are always set)
_PROC_ENV = frozenset({"PYTHONPATH", "CUDA_VISIBLE_DEVICES"})


def _coords(index: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(index % s)
        index //= s
    return out[::-1]


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_allocator() -> None:
    from ._prctl import die_with_parent

    die_with_parent()
