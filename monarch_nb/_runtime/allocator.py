"""The allocator daemon's service: one per host, it keeps the host's meshes and outlives any controller.

It answers controllers (hello, spawn, lookup, stop, status, logs), knows which controller
owns which mesh, streams the meshes' output and proc exits to subscribers, and reaps meshes
nobody holds: a script's meshes when its controller goes away, and everything once no
controller has been attached for the lease. The processes themselves (zygote, exec, output
capture, exits) are :mod:`.procs`'s; the host's interpreter and synced code :mod:`.hostenv`'s;
paused debug sessions :mod:`.debugreg`'s.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import operator
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

from .._newest import Newest
from .._numtext import plural
from .._version import __version__
from .._wire import frames as wire
from .._wire.serialize import dumps
from ..config import Config
from ..errors import MeshError, MeshNotFoundError, SpawnError
from . import _fdlimit, records, shm
from ._pids import SilentPeer
from .codecache import CodeCache
from .debugreg import DebugRegistry
from .hostenv import HostEnv
from .logcapture import ENDED, ENDS_CALLS, LOGS, LogItem, count_lines, line_text, rank_log_path, read_log, split_run
from .procs import MeshRec, ProcRec, Procs, kill
from .runtime import NO_REPLY, Runtime, pid_alive, sleep_to_tick, system_method
from .telemetry import Telemetry
from .transport import Security

logger = logging.getLogger(__name__)


def unlink_ipc(addr: str, inside: str | None = None) -> None:
    """Remove the socket files of an ipc inbox (``…/x.sock``) and its direct socket (``…/x.fast``);
    with ``inside``, only if they are in that folder (a runtime directory's own, nobody else's)."""
    if not addr.startswith("ipc://"):
        return
    if inside is not None and os.path.realpath(os.path.dirname(addr[len("ipc://") :])) != os.path.realpath(inside):
        return
    from .fastpath import path_for

    for path in (addr[len("ipc://") :], path_for(addr)):
        try:
            os.unlink(path)
        except OSError:
            pass


#: names of meshes stopped on the allocator's own account that a lookup can still explain
REAPED_KEPT = 256
#: controllers detached without a bye whose later pings are still told why
DETACHED_KEPT = 1024


class Allocator(DebugRegistry):
    def __init__(
        self, cfg: Config, security: Security, runtime_dir: str, *, tcp_ip: str | None = None, tcp_port: int = 0
    ) -> None:
        self.cfg = cfg
        self.rt = Runtime(cfg, security, runtime_dir, tcp_ip=tcp_ip, tcp_port=tcp_port, label="allocator")
        self.security = security
        self.runtime_dir = runtime_dir
        self.meshes: dict[str, MeshRec] = {}
        self.procs = Procs(
            self.rt, cfg, security, runtime_dir, on_exit=self._proc_exited, on_lines=self._emit_logs, on_call_end=self._logs_now
        )
        # the procs' indexes, shared (the debug registry and telemetry read them too)
        self.by_pid, self.by_token, self.by_addr = self.procs.by_pid, self.procs.by_token, self.procs.by_addr
        self.env = HostEnv(runtime_dir)
        self.controllers: dict[str, dict[str, Any]] = {}  # reply addr -> info
        self.subscribers: dict[tuple[str, int], float] = {}
        #: controllers detached without a bye (silent, exited), by address: why, for their next pings
        self.detached: Newest[str, str] = Newest(DETACHED_KEPT, refresh=False)
        #: meshes this allocator stopped on its own (their controller went away, the lease), by
        #: name: why and when, so that a lookup of one says so, not "no mesh named" alone (a
        #: script re-attaching to what its last run spawned without persist=True); the newest kept
        self.reaped: Newest[str, tuple[str, str, float]] = Newest(REAPED_KEPT, refresh=True)
        self.idle_since = time.monotonic()
        self.log_dir = ""
        self.connection_file = ""
        self._pending_logs: dict[tuple[tuple[str, int], str], list[Any]] = {}
        #: (rank, call id) of calls that printed and ended, sent behind the pending lines
        self._pending_ends: dict[tuple[tuple[str, int], str], list[tuple[int, str]]] = {}
        self._flush_timer: asyncio.Handle | None = None
        self._last_log_flush = 0.0
        #: log lines not sent to a subscriber that went silent (still on disk), by its address
        self.dropped_log_lines: dict[str, int] = {}
        #: all log lines dropped so far (``status()["dropped_log_lines"]``)
        self.dropped_log_total = 0
        self._anon = 0
        self.stopped = asyncio.Event()
        self.gpus = self.procs.gpus
        self.telemetry = Telemetry(self)
        #: a job's allocator leaves with its lease: nothing outlives a job nobody controls
        self.exit_on_lease = False
        #: why this allocator is shutting down, told to its controllers (see :meth:`stop`)
        self.shutdown_why = ""
        self.shutdown_by = ""
        self._debug_init()

    # ------------------------------------------------------------ lifecycle
    def start(self, key_file: str = "") -> None:
        self.rt.start()
        self.id = self.rt.uid
        self.env.owner = self.id
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
        self.connection_file = records.write_connection_file(self.runtime_dir, self.id, info)
        logger.info("allocator %s serving at %s %s", self.id, self.rt.ipc_addr, self.rt.tcp_addr)

    async def _start_async(self) -> None:
        self.procs.start_zygote()
        # pools of controllers that exited without a word after their allocator had stopped
        self.rt.loop.run_in_executor(None, shm.sweep_stale)
        self.rt._spawn(self._reaper())
        self.rt._spawn(self.telemetry.run())

    def serve_forever(self) -> None:
        try:
            self.rt.submit(self.stopped.wait()).result()
        except KeyboardInterrupt:
            self.shutdown_why = self.shutdown_why or "interrupted"
        finally:
            self.close()

    def stop(self, why: str, by: str = "") -> None:
        """Shut down (on the loop's thread); ``why`` is what the controllers are told, ``by`` the
        cid of the controller that asked (its meshes here are stopped, not failed)."""
        if not self.shutdown_why:
            self.shutdown_why, self.shutdown_by = why, by
        self.stopped.set()

    def close(self) -> None:
        self.procs.closing = True  # the zygote's exit is expected now, not an error
        why = self.shutdown_why or "closed"
        logger.info("shutting down: %s", why)
        if self.connection_file:
            # first: stopping the meshes takes seconds (their __cleanup__), and a controller told
            # of this shutdown that spawns again meanwhile must start a new allocator, not find
            # this one (which refuses spawns now)
            try:
                os.unlink(self.connection_file)
            except OSError:
                pass
        try:
            self.rt.submit(self._shut_down(why)).result(timeout=15)
        except Exception:
            logger.exception("stopping procs failed")
        self.procs.close()
        self.rt.close()

    # ------------------------------------------------------------ procs and their output
    def _proc_exited(self, rec: ProcRec) -> None:
        """What a proc's exit means beyond the process: its debug sessions, subscribers, mesh."""
        self._debug_proc_exited(rec.token, rec.cause)
        self._publish(("proc_exited", rec.addr, rec.mesh, rec.rank, self.rt.hostname, rec.cause))
        self._publish(("state", rec.mesh, rec.rank, rec.state, rec.cause))
        mesh = self.meshes.get(rec.mesh)
        if mesh is not None and rec.state == "failed" and mesh.state != "stopping":
            mesh.state = "failed"

    def _emit_logs(self, mesh_name: str, lines: list[LogItem]) -> None:
        mesh = self.meshes.get(mesh_name)
        if mesh is None or not mesh.log_subs:
            return
        for sub in mesh.log_subs:
            self._pending_logs.setdefault((sub, mesh_name), []).extend(lines)
        if self._flush_timer is None:
            # the first lines after a quiet spell go at once; a flood is sent in batches
            wait = self._last_log_flush + self.cfg.log_flush_interval - time.monotonic()
            if wait <= 0:
                self._flush_timer = self.rt.loop.call_soon(self._flush_logs)
            else:
                self._flush_timer = self.rt.loop.call_later(wait, self._flush_logs)

    def _logs_now(self, mesh_name: str, rank: int, ids: list[str]) -> None:
        """A proc's call that printed ended: the end of its burst waits for no batch. ``ids``:
        the calls that ended, for the subscribers to know that their lines are all there (a
        script's controller shows them before the call's value)."""
        queued = False
        mesh = self.meshes.get(mesh_name) if ids else None
        if mesh is not None and mesh.log_subs:
            ends = [(rank, i) for i in ids]
            for sub in mesh.log_subs:
                self._pending_ends.setdefault((sub, mesh_name), []).extend(ends)
            queued = True
        t = self._flush_timer
        # a batch's later flush (a TimerHandle) comes now; none scheduled: now if ends wait
        if isinstance(t, asyncio.TimerHandle) or (t is None and queued):
            if t is not None:
                t.cancel()
            self._flush_timer = self.rt.loop.call_soon(self._flush_logs)

    def _flush_logs(self) -> None:
        t, self._flush_timer = self._flush_timer, None
        if t is not None:
            t.cancel()  # called directly (flush_logs): the one scheduled has nothing left to do
        self._last_log_flush = time.monotonic()
        pending, self._pending_logs = self._pending_logs, {}
        for ((addr, port), mesh), lines in pending.items():
            self._send_logs(addr, port, mesh, lines)
        if self._pending_ends:
            ends, self._pending_ends = self._pending_ends, {}
            for ((addr, port), mesh), calls in ends.items():
                # behind the lines on the same link; like them, dropped for a silent or full subscriber
                try:
                    self._to_subscriber(addr, port, (ENDED, calls, mesh, self.id))
                except Exception as e:
                    logger.debug("ends of calls for %s not sent: %s", addr, e)

    def _send_logs(self, addr: str, port: int, mesh: str, lines: list[Any]) -> None:
        """Only log lines are ever dropped, counted and logged (they stay in the rank's log
        file): for a controller that has not pinged for as long as it takes to detach it (a
        dead or stopped subscriber), and for one whose queue is full (a live but slow one).
        Lines go in chunks of at most ``LOG_CHUNK_CHARS``, so that a full queue
        (``send_hwm`` messages) holds a bounded amount of output."""
        c = self.controllers.get(addr)
        if c is not None and time.monotonic() - c["last_seen"] > max(5.0, 3 * self.cfg.heartbeat_timeout):
            self._drop_logs(addr, count_lines(lines), "is not answering")
            return
        if any(len(it) == 6 and len(it[4]) > LOG_CHUNK_CHARS for it in lines):
            # a flood's run of lines (one string) is cut at line ends like a batch of lines
            lines = [p for it in lines for p in (split_run(it, LOG_CHUNK_CHARS) if len(it) == 6 else (it,))]
        # where each line ends in the batch's text, counted in C (a flood is thousands of lines)
        ends = list(itertools.accumulate(map(len, map(_LINE_TEXT, lines))))
        i, n, base = 0, len(lines), 0
        while i < n:
            # the lines up to LOG_CHUNK_CHARS from here, at least one
            j = max(i + 1, bisect.bisect_right(ends, base + LOG_CHUNK_CHARS, i))
            base = ends[j - 1]
            chunk = lines[i:j] if i or j < n else lines
            try:
                sent = self._to_subscriber(addr, port, (LOGS, chunk, mesh, self.id))
            except Exception as e:  # an address that cannot be reached at all
                logger.debug("log lines for %s not sent: %s", addr, e)
                sent = False
            if not sent:
                self._drop_logs(addr, count_lines(lines[i:]), "reads too slowly (its queue is full)")
                return
            i = j
        dropped = self.dropped_log_lines.pop(addr, 0)
        if dropped:
            logger.warning("controller %s keeps up again; %d log lines were not sent to it (see the logs on disk)", addr, dropped)

    def _to_subscriber(self, addr: str, port: int, item: tuple[Any, ...]) -> bool:
        """One item on a log subscriber's port (False: its queue is full, the item dropped)."""
        body, bufs = dumps(item)
        return bool(
            self.rt.transport.send(addr, self.rt.sender.encode(addr, wire.PORT, (port, 0, wire.ITEM), body, bufs), droppable=True)
        )

    def _drop_logs(self, addr: str, n: int, why: str) -> None:
        before = self.dropped_log_lines.get(addr, 0)
        if before == 0:
            logger.warning("controller %s %s: dropping its log lines (they stay in the logs on disk)", addr, why)
        self.dropped_log_lines[addr] = before + n
        self.dropped_log_total += n

    def _forget_subscriber(self, addr: str) -> None:
        """A detached controller gets no more log lines or events."""
        for m in self.meshes.values():
            m.log_subs = {s for s in m.log_subs if s[0] != addr}
        for sub in [s for s in self.subscribers if s[0] == addr]:
            del self.subscribers[sub]
        self.dropped_log_lines.pop(addr, None)

    def _publish(self, event: tuple[Any, ...]) -> None:
        for addr, port in list(self.subscribers):
            self.rt.send_port(addr, port, 0, wire.ITEM, event)

    # ------------------------------------------------------------ system methods
    def sys_hello(self, info: dict[str, Any]) -> dict[str, Any]:
        if info.get("role", "controller") == "controller":
            self.controllers[info["addr"]] = {**info, "last_seen": time.monotonic()}
            self.detached.pop(info["addr"], None)
        return {
            "alloc_id": self.id,
            "version": __version__,
            "host": self.rt.hostname,
            "pid": os.getpid(),
            "addr": self.rt.ipc_addr,
            "tcp": self.rt.tcp_addr,
            "gpus": self.gpus,
            "versions": self.env.versions,
            ENDS_CALLS: True,
        }

    # ------------------------------------------------------------ the host's environment
    def sys_env(self) -> Coroutine[Any, Any, dict[str, Any]]:
        return self.env.describe()

    def sys_env_pip(self, spec: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """``pip install spec`` into this allocator's interpreter (fails fast without an index)."""
        return self.env.pip_install(spec)

    async def sys_native_stack(self, pid: int, timeout: float = 10.0) -> dict[str, Any]:
        """``py-spy dump --native`` of one of this allocator's procs (its ancestor may ptrace it
        where the controller, on another host or not an ancestor, may not)."""
        if not any(r.pid == pid and r.state == "running" for m in self.meshes.values() for r in m.procs):
            raise ValueError(f"pid {pid} is not a running proc of this allocator")
        exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
        exe = exe if os.path.exists(exe) else shutil.which("py-spy") or ""
        if not exe:
            return {"text": "", "error": f"py-spy is not installed on {self.rt.hostname} (pip install 'monarch_nb[stacks]')"}
        proc = await asyncio.create_subprocess_exec(
            exe, "dump", "--pid", str(pid), "--native", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return {"text": "", "error": f"py-spy dump gave no answer within {timeout:.0f} s"}
        text = out.decode(errors="replace")
        return {"text": text, "error": "" if proc.returncode == 0 else err.decode(errors="replace").strip()[-2000:]}

    async def sys_env_install_files(self, name: str, files: dict[str, str], remove: str = "") -> int:
        # file writes: off the I/O thread, which answers heartbeats
        return await asyncio.to_thread(self._env_install_files, name, files, remove)

    def _env_install_files(self, name: str, files: dict[str, str], remove: str = "") -> int:
        """Install a distribution from synced blobs into this interpreter's site-packages."""
        return self.env.install_files(name, files, remove)

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
        why = self.detached.get(addr) if c is None else None
        if why is not None:
            # it still thinks it is attached: say so, or its calls wait for events that never come
            self.rt.send_port(addr, port, 0, wire.ITEM, ("pong", "detached", why))
            return NO_REPLY
        # a pong waits behind what the queue already holds; none is sent to a subscriber too
        # slow to take it (its queue is full of proof of life already)
        frames = self.rt.sender.encode(addr, wire.PORT, (port, 0, wire.ITEM), *_PONG)
        self.rt.transport.send(addr, frames, droppable=True)
        return NO_REPLY

    def _detach(self, addr: str, why: str) -> None:
        """Forget a controller that went silent or exited; its later pings are answered with ``why``."""
        c = self.controllers.pop(addr, None)
        self._forget_subscriber(addr)
        self.detached[addr] = why
        if c is not None:
            self._orphan(c["cid"])
        # its connection: closed once the last messages had a moment to leave
        self.rt.loop.call_later(1.0, self.rt.transport.forget_peer, addr, 1.0)

    def sys_bye(self, addr: str) -> int:
        c = self.controllers.pop(addr, None)
        if c is None:
            return 0
        self._forget_subscriber(addr)
        # its connection: closed once the answer to this bye had a moment to leave
        self.rt.loop.call_later(1.0, self.rt.transport.forget_peer, addr, 1.0)
        return self._orphan(c["cid"])

    async def sys_spawn(self, spec: dict[str, Any]) -> dict[str, Any]:
        name = spec.get("name") or ""
        if not name or name == "anon":
            self._anon += 1
            name = f"anon-{self.id[:4]}-{self._anon}"
        if self.stopped.is_set():
            # stopping its meshes takes seconds (their __cleanup__): procs forked now would be
            # dropped with the daemon, and their spawner would hear only "no heartbeat" later
            raise SpawnError(
                f"the allocator of host {self.rt.hostname} is shutting down ({self.shutdown_why or 'closed'}): "
                "it starts no new procs"
            )
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
        # this daemon holds descriptors per proc it runs (its pipes, its connections): one
        # spawn too many for its limit is refused here, whole, before any proc starts
        _fdlimit.ensure_room(
            n * _fdlimit.PER_PROC,
            f"spawning {plural(n, 'proc')} ({name!r}) on host {self.rt.hostname}",
            "this host's allocator (monarch-nb allocator)",
        )
        mesh = MeshRec(name, spec["owner"], bool(spec.get("persist")), labels, sizes, spec.get("rank_base", 0), [])
        self.reaped.pop(name, None)  # what a lookup says of the name now is this mesh
        # (a controller that predates mesh ids: one of this host's own)
        mesh.info = {
            "extent": spec["extent"],
            "host_index": spec.get("host_index", 0),
            "mesh_id": spec.get("mesh_id") or secrets.token_hex(6),
        }
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
            mesh.log_subs.add(tuple(spec["stream_logs_to"]))
        if spec.get("progress_to"):
            self._tell_procs_up(mesh, tuple(spec["progress_to"]), spec.get("host_index", 0))
        try:
            async with asyncio.timeout(self.cfg.spawn_timeout):
                for rec in mesh.procs:
                    await self.procs.start(mesh, rec, spec, self.log_dir, self.code.workspaces)
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
                    tail = "\n".join(line_text(ln[4]) for ln in rec.log.tail[-20:])
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
            "mesh_id": mesh.info["mesh_id"],
        }

    def _tell_procs_up(self, mesh: MeshRec, to: tuple[str, int], host_index: int) -> None:
        """Tell the spawning controller how many of this host's procs are up, as each comes up
        (its cell shows a progress bar while a large mesh starts)."""
        n = len(mesh.procs)
        up = 0

        def one_up(f: asyncio.Future[None]) -> None:
            nonlocal up
            if f.cancelled() or f.exception() is not None:
                return
            up += 1
            try:
                self.rt.send_port(to[0], to[1], 0, wire.ITEM, ("procs_up", host_index, up, n))
            except Exception:  # a controller gone mid-spawn: the spawn's own reply tells the rest
                logger.debug("procs_up to %s failed", to[0], exc_info=True)

        for rec in mesh.procs:
            if rec.ready is not None:
                rec.ready.add_done_callback(one_up)

    def _rotate_logs(self, name: str) -> None:
        """A new mesh with an old mesh's name starts a fresh log; the old one is kept beside it."""
        d = os.path.join(self.log_dir, name)
        if os.path.isdir(d):
            os.rename(d, f"{d}~{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")

    def sys_proc_cleaned(self, token: str) -> Any:
        # a stopping proc's actors are cleaned up: from now on it has stop_grace to exit
        rec = self.by_token.get(token)
        if rec is not None and rec.cleaned is not None and not rec.cleaned.done():
            rec.cleaned.set_result(None)
        return NO_REPLY

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
        n = self.procs.drain_all()
        self._flush_logs()
        return n

    # ------------------------------------------------------------ synced code
    @property
    def code(self) -> CodeCache:
        return self.env.code

    def sys_sync_missing(self, digests: list[str]) -> list[str]:
        """Which of these blobs this host lacks (so only those cross the network)."""
        return self.code.missing(digests)

    async def sys_sync_put(self, blobs: dict[str, Any]) -> int:
        # hashing and writing a large file takes seconds: off the I/O thread, which answers
        # heartbeats (a remote host silent for heartbeat_timeout is lost, and its meshes fail)
        return await asyncio.to_thread(self.code.put, blobs)

    async def sys_sync_put_part(self, digest: str, token: str, offset: int, data: Any, size: int) -> int:
        return await asyncio.to_thread(self.code.put_part, digest, token, offset, data, size)

    async def sys_sync_pull(self, url: str, digests: list[str]) -> int:
        # network and disk: off the I/O thread, which answers heartbeats
        return await asyncio.to_thread(self._sync_pull, url, digests)

    def _sync_pull(self, url: str, digests: list[str]) -> int:
        """Fetch blobs from a staging area (any fsspec URL this host can reach)."""
        return self.env.sync_pull(url, digests)

    async def sys_sync_commit(self, ws: str, manifest: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
        # a large tree (or one an earlier allocator left, hashed here) is as slow as a put
        return await asyncio.to_thread(self.code.commit, ws, manifest)

    def sys_note_actor(self, mesh: str, actor: str, cls_blob: bytes, owner: str = "", label: str = "") -> None:
        """Actor mesh ``actor`` (a spawn's id) was spawned on ``mesh`` as ``label`` by controller
        ``owner``: kept for re-attaching (``ProcMesh.actor_mesh``), which names the candidates
        when several spawns share a label."""
        m = self.meshes.get(mesh)
        if m is not None:
            m.actors[actor] = cls_blob
            m.actor_info[actor] = {"owner": owner, "label": label or actor, "created": time.time()}

    @system_method(wants_reply=True)
    def sys_stream_logs(self, mesh: str, on: bool = True, *, _reply: tuple[str, int, int]) -> Any:
        m = self.meshes.get(mesh)
        if m is None:
            raise MeshNotFoundError(f"no mesh named {mesh!r} on host {self.rt.hostname}", mesh)
        sub = (_reply[0], _reply[1])
        if on:
            m.log_subs.add(sub)
        else:
            m.log_subs.discard(sub)
        return NO_REPLY

    async def sys_stop_mesh(
        self,
        name: str,
        cid: str = "",
        force: bool = False,
        reason: str = "stopped by client",
        detail: bool = False,
        because: str = "",
    ) -> int | dict[str, Any]:
        """Stop mesh ``name``: the number of procs stopped, or with ``detail`` also the ones that
        had to be killed (``{"stopped": n, "killed": [{rank, pid, host, why}]}``). ``because``:
        the cause of its procs' ends says it ("mesh stopped (process N exited with code 0)
        because the actor ... that spawned it failed: ...")."""
        m = self.meshes.get(name)
        if m is None:
            raise MeshNotFoundError(f"no mesh named {name!r} on host {self.rt.hostname}", name)
        self._detach_dead_local()
        owner_attached = any(c.get("cid") == m.owner for c in self.controllers.values())
        # an owner that is gone (kernel restarted, script exited) hands its meshes to whoever re-attached
        if cid and m.owner != cid and owner_attached and not force:
            raise PermissionError(f"mesh {name!r} is owned by another controller ({m.owner}); pass force=True to stop it anyway")
        n = await self._stop_mesh(m, reason, because)
        self.meshes.pop(name, None)
        if detail:
            return {"stopped": n, "killed": m.killed}
        return n

    def sys_adopt(self, name: str, cid: str, seen_owner: str) -> str:
        """Controller ``cid`` re-attached mesh ``name`` (a restarted kernel's ``connect()``),
        which it saw owned by ``seen_owner``: if that owner is gone, ``cid`` owns it now, so that
        ``monarch-nb stop --all`` ("whose controller is gone") leaves it alone and every status
        names the live kernel. A mesh whose owner is still attached (a second kernel re-attaching
        what another runs) keeps its owner. Returns the owner it has after."""
        m = self.meshes.get(name)
        if m is None:
            raise MeshNotFoundError(f"no mesh named {name!r} on host {self.rt.hostname}", name)
        # a kernel restarted on this host: its old process is gone now, not after its heartbeats
        self._detach_dead_local()
        me = next((c for c in self.controllers.values() if c.get("cid") == cid), None)
        for addr, c in list(self.controllers.items()):
            # a kernel restarted on another host: its old process, still attached until its
            # heartbeats time out, is the same Jupyter kernel (one process at a time)
            if (
                me is not None
                and c is not me
                and c.get("cid") == seen_owner
                and me.get("session")
                and (c.get("session"), c.get("host")) == (me.get("session"), me.get("host"))
            ):
                logger.info("controller %s (pid %s) was restarted as %s; detaching it", c["cid"], c.get("pid"), cid)
                self._detach(addr, f"this kernel was restarted (its new process is controller {cid})")
        attached = {c.get("cid") for c in self.controllers.values()}
        # seen_owner: the lookup's owner; one that changed since (another controller re-attached
        # it first) is not taken from it
        if m.owner == seen_owner and m.owner != cid and m.owner not in attached and cid in attached:
            logger.info("mesh %s: re-attached by controller %s, its owner now (was %s, gone)", name, cid, m.owner)
            m.info["reattached_from"] = m.owner
            m.owner = cid
        return m.owner

    def sys_lookup(self, name: str) -> dict[str, Any]:
        m = self.meshes.get(name)
        if m is None:
            why = ""
            if name in self.reaped:
                reason, advice, when = self.reaped[name]
                why = f"; a mesh {name!r} was stopped here {time.monotonic() - when:.0f} s ago as {reason}: {advice}"
            raise MeshNotFoundError(
                f"no mesh named {name!r} on host {self.rt.hostname}; known: {sorted(self.meshes) or 'none'}{why}", name
            )
        return {
            "name": m.name,
            "mesh_id": m.info.get("mesh_id", ""),
            "owner": m.owner,
            "created": m.created,
            "persist": m.persist,
            "labels": m.labels,
            "sizes": m.sizes,
            "extent": m.info.get("extent"),
            "state": m.state,
            "procs": [(r.addr, r.pid, r.rank, r.state) for r in m.procs],
            "actors": dict(m.actors),
            "actor_info": dict(m.actor_info),
            "host": self.rt.hostname,
        }

    async def sys_status(self) -> dict[str, Any]:
        # somebody looks: the procs' states are sampled from now on, fresh ones first
        try:
            await self.telemetry.fresh()
        except Exception:  # the status itself matters more: its last readings are shown
            logger.exception("telemetry refresh failed")
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
            # log lines not sent to a silent or too slow subscriber (every one is in the logs on disk)
            "dropped_log_lines": self.dropped_log_total,
            "controllers": [
                {
                    "cid": c["cid"],
                    "kind": c.get("kind"),
                    "pid": c.get("pid"),
                    "host": c.get("host"),
                    "idle_s": now - c["last_seen"],
                    # the caller of a running call, as a proc's stacks name it
                    "addr": addr,
                }
                for addr, c in self.controllers.items()
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
                    # one spawn's id on every host: a later mesh of the same name is another mesh
                    "mesh_id": m.info.get("mesh_id", ""),
                    # the gone controller whose mesh the owner re-attached (a restarted kernel's)
                    "reattached_from": m.info.get("reattached_from", ""),
                    "actors": sorted({m.actor_info.get(a, {}).get("label", a) for a in m.actors}),
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

    async def sys_logs(self, mesh: str, rank: int, tail: int | None = None, start: int = 0) -> list[dict[str, Any]]:
        path = rank_log_path(self.log_dir, mesh, rank)
        if not os.path.exists(path):
            raise MeshNotFoundError(f"no log for mesh {mesh!r} rank {rank} on host {self.rt.hostname}", mesh)
        return await asyncio.to_thread(read_log, path, tail, start)

    async def sys_spans(self, mesh: str | None = None, since: float | None = None) -> dict[str, Any]:
        """Spans and metrics of this allocator's procs (``telemetry.query``), drained first."""
        received = time.time()  # with the reply's time, gives the caller this host's clock offset
        return {**await self.telemetry.spans.collect(mesh, since), "received": received}

    async def sys_span_summary(
        self, mesh: str | None = None, since: float | None = None, sent: float | None = None
    ) -> dict[str, Any]:
        """Per-proc latency summaries and the failed spans of this allocator's procs (a dashboard's
        refresh), drained first. ``since`` is on the caller's clock, which read ``sent`` as it asked:
        moved onto ours by that difference (the one-way delay is the error; the caller cannot trim
        a summary as it trims spans)."""
        received = time.time()
        if since is not None and sent is not None:
            since += received - sent
        return {**await self.telemetry.spans.summarize(mesh, since), "received": received}

    def sys_shutdown(self, cid: str = "") -> str:
        self.rt.loop.call_later(0.05, self.stop, "a controller asked it to: HostMesh.shutdown()", cid)
        return "shutting down"

    # ------------------------------------------------------------ stopping and reaping
    async def _stop_mesh(self, m: MeshRec, reason: str, because: str = "") -> int:
        t0 = time.monotonic()
        m.state = "stopping"
        live = [r for r in m.procs if r.state in ("starting", "running")]
        # their last spans first: a proc may exit before its answer to a drain sent just ahead
        # of the shutdown leaves it (answered by its I/O thread: a busy actor does not delay it)
        drains = [f for r in live if (f := self.telemetry.spans.poll(r)) is not None]
        if drains:
            await asyncio.wait(drains, timeout=1.0)
        loop = self.rt.loop
        for r in live:
            r.state = "stopping"
            r.stop_because = because
            r.cleaned = loop.create_future()
            if r.addr:
                try:
                    self.rt.send_actor(r.addr, "__sys__", "shutdown", *_EMPTY_ARGS)
                except Exception:
                    r.cleaned.set_result(None)
            else:
                # not up yet: it has no actors to clean up
                r.cleaned.set_result(None)
                if r.pid:
                    kill(r.pid, signal.SIGTERM)
        m.killed = await self._reap_stopping([r for r in live if r.pid and r.exited is not None])
        for r in m.procs:
            self.by_token.pop(r.token, None)
            if self.by_addr.get(r.addr) is r:
                del self.by_addr[r.addr]
            unlink_ipc(r.local or r.addr)  # procs end with os._exit: their socket files stay behind
        self._debug_mesh_stopped(m.name)
        m.state = "stopped"
        logger.info("mesh %s stopped (%d procs) in %.2f s: %s", m.name, len(live), time.monotonic() - t0, reason)
        self._publish(("mesh", m.name, "stopped", reason))
        return len(live)

    async def _reap_stopping(self, live: list[ProcRec]) -> list[dict[str, Any]]:
        """Wait for stopping procs to exit as Monarch's do: each gets ``stop_cleanup_timeout``
        for its actors' ``__cleanup__``, then ``stop_grace`` to exit (non-daemon threads,
        atexit); one still running then is killed. Returns what was killed, and why."""
        killed: list[dict[str, Any]] = []

        async def one(r: ProcRec) -> None:
            assert r.exited is not None and r.cleaned is not None
            exited = r.exited
            why = ""
            await asyncio.wait([exited, r.cleaned], timeout=self.cfg.stop_cleanup_timeout, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                if not r.cleaned.done():
                    # the message in hand comes first, then __cleanup__: either may be what ran on
                    why = (
                        f"its actors had not finished the message in hand and __cleanup__ after "
                        f"{self.cfg.stop_cleanup_timeout:g} s (stop_cleanup_timeout)"
                    )
                else:
                    await asyncio.wait([exited], timeout=self.cfg.stop_grace)
                    why = f"still running {self.cfg.stop_grace:g} s after its actors' __cleanup__ (a non-daemon thread?)"
            if not exited.done():
                kill(r.pid)
                killed.append({"rank": r.rank, "pid": r.pid, "host": self.rt.hostname, "why": why})
                await asyncio.wait([exited], timeout=_KILLED_EXIT_WAIT_S)
                if not exited.done():
                    # the stop goes on without it; said, since this wait held the stop and its caller that long
                    logger.warning(
                        "proc rank %d (pid %d) of mesh %s: no exit seen %g s after SIGKILL; its stop answers without it",
                        r.rank,
                        r.pid,
                        r.mesh,
                        _KILLED_EXIT_WAIT_S,
                    )

        await asyncio.gather(*(one(r) for r in live))
        killed.sort(key=lambda k: k["rank"])
        return killed

    async def _shut_down(self, why: str) -> None:
        # controllers hear why before their procs go: what they wait for fails saying so, and
        # the silence that follows raises no "allocator lost ... no heartbeat" alarm. For them it
        # is still a failure of their meshes (as Monarch's when a host's processes are killed):
        # they did not stop them
        cause = f"allocator {self.rt.hostname}:{os.getpid()} was shut down ({why}); its procs are gone"
        self._publish(("shutdown", cause, self.shutdown_by))
        await self._stop_all(f"allocator shutting down ({why})")

    async def _stop_all(self, reason: str) -> None:
        for m in list(self.meshes.values()):
            await self._stop_mesh(m, reason)
            if reason == "lease expired":
                self._reaped(
                    m.name,
                    f"its lease ({self.cfg.lease:.0f} s, MONARCH_NB_LEASE) passed with no controller attached",
                    "spawn it again (a longer MONARCH_NB_LEASE for the allocator keeps persistent meshes longer)",
                )
        self.meshes.clear()

    def _reaped(self, name: str, why: str, advice: str) -> None:
        self.reaped[name] = (why, advice, time.monotonic())

    def _detach_dead_local(self) -> None:
        """A controller on this host (it reached us over ipc) whose process is gone has detached,
        without waiting for its heartbeats to time out: a restarted kernel re-attaches at once."""
        for addr, c in list(self.controllers.items()):
            if addr.startswith("ipc://") and not pid_alive(int(c.get("pid") or 0)):
                logger.info("controller %s (pid %s) exited; detaching it", c["cid"], c.get("pid"))
                self._detach(addr, "its process exited")
                if c.get("pid"):
                    shm.sweep_dead(int(c["pid"]))  # its pooled and in-flight shared memory
                # a kernel killed (a restart, kill -9, the OOM killer) could not remove its socket
                # files as a controller that exits does; nobody serves them now
                unlink_ipc(addr, inside=self.runtime_dir)

    def _controller_at_work(self, addr: str, c: dict[str, Any], silent: float, detach_after: float) -> bool:
        """Whether a silent controller of this host (it reached us over ipc) is still at work
        (:class:`~._pids.SilentPeer`): a kernel whose main thread holds the GIL in a long C
        call, or one starved of CPU, pings late but is not gone. Up to ``SLOW_FACTOR`` detach
        times; stopped (SIGSTOP), gone or asleep with no CPU spent, it is detached as before."""
        pid = int(c.get("pid") or 0)
        if not addr.startswith("ipc://") or not pid:
            return False
        local = c.get("local") or c.setdefault("local", SilentPeer(pid))
        if not local.excused(c["last_seen"], silent, detach_after):
            return False
        if local.first_late(silent, detach_after):
            logger.info("controller %s (pid %d) has not pinged for %.1f s but is running: not detached", c["cid"], pid, silent)
        return True

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
            self._reaped(
                m.name,
                f"{reason} and it was not persistent",
                "only a mesh spawned with persist=True (spawn_procs(..., persist=True), the default in a Jupyter "
                "kernel) outlives its controller; spawn it again",
            )

    async def _reaper(self) -> None:
        detach_after = max(5.0, 3 * self.cfg.heartbeat_timeout)
        while True:
            await sleep_to_tick(self.rt.loop, min(self.cfg.heartbeat_interval, self.cfg.lease / 4 or 0.1))
            now = time.monotonic()
            self._detach_dead_local()
            for addr, c in list(self.controllers.items()):
                silent = now - c["last_seen"]
                if silent <= detach_after / 2:
                    continue
                # looked at from half the time on: "CPU spent since" needs a look before
                if not self._controller_at_work(addr, c, silent, detach_after) and silent > detach_after:
                    logger.info("controller %s (pid %s) went silent; detaching it", c["cid"], c.get("pid"))
                    self._detach(
                        addr,
                        f"allocator {self.rt.hostname}:{os.getpid()} heard no ping from this controller for "
                        f"{silent:.1f} s (over {detach_after:.0f} s: a suspended or stalled process) and "
                        "detached it: its meshes that were not persistent are being stopped",
                    )
            for sub, seen in list(self.subscribers.items()):
                if now - seen > detach_after and sub[0] not in self.controllers:
                    del self.subscribers[sub]
            if self.controllers:
                self.idle_since = now
            elif (self.meshes or self.exit_on_lease) and now - self.idle_since > self.cfg.lease:
                logger.info("lease of %.0f s expired with no controller attached; stopping all meshes", self.cfg.lease)
                await self._stop_all("lease expired")
                self.idle_since = now
                if self.exit_on_lease:
                    logger.info("started by a job with exit-on-lease: exiting")
                    self.stop(f"its lease of {self.cfg.lease:.0f} s expired with no controller attached")


_MESH_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_PONG = dumps(("pong",))
#: how long a stop waits for a proc it killed to be reported gone (its zygote reaps it)
_KILLED_EXIT_WAIT_S = 5.0
#: characters of log lines in one message to a subscriber (see ``_send_logs``)
LOG_CHUNK_CHARS = 8 << 10
_LINE_TEXT = operator.itemgetter(4)
_EMPTY_ARGS: tuple[bytes, list[Any]] = pickle.dumps(((), {}), protocol=5), []
