"""The client side of allocators: connect (with clear errors), system requests, log streaming,
mesh ownership and failure reporting. Every process has one; a controller's is the root."""

from __future__ import annotations

import atexit
import fcntl
import logging
import operator
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .._deadline import budget
from .._newest import Newest
from .._runtime._pids import pid_is
from .._runtime.logcapture import ENDED, ENDS_CALLS, LOGS, expand, line_text
from .._runtime.runtime import ReplyPort, Runtime
from .._runtime.transport import check_form
from .._version import __version__
from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from ..errors import (
    ActorError,
    AuthenticationError,
    ConnectError,
    MonarchNBError,
    SupervisionError,
    VersionMismatchError,
)
from . import _future
from ._future import Future
from ._refs import ProcRef

logger = logging.getLogger(__name__)


def _decode_sys_error(raw: Any) -> Any:
    err = loads(*raw)
    # our own daemons' errors are clearer as themselves than wrapped as a remote actor failure;
    # a user actor's (get_or_spawn_controller's __init__) stays an ActorError, as any actor's
    if (
        isinstance(err, ActorError)
        and not err.actor
        and isinstance(err.exception, (MonarchNBError, PermissionError, ValueError, TypeError))
    ):
        raise err.exception
    raise err


class Client:
    def __init__(self, rt: Runtime) -> None:
        from ._context import in_ipython_kernel, kernel_session, proc_spec

        self.rt = rt
        self.cid = rt.uid
        self.kind = "proc" if proc_spec is not None else ("ipython" if in_ipython_kernel() else "script")
        #: which Jupyter kernel this is, across its restarts (see ``sys_adopt``)
        self.session = kernel_session() if self.kind == "ipython" else ""
        self.hellos: dict[str, dict[str, Any]] = {}
        #: when a request last tried to revive an allocator declared lost, by address
        self._revive_tried: dict[str, float] = {}
        self._alloc_addr: dict[str, str] = {}  # allocator id -> the address we reach it at
        self._lock = threading.Lock()
        #: proc addr -> mesh name, for meshes this process owns
        self.owned: dict[str, Any] = {}
        self.stopped_meshes: set[str] = set()
        #: proc mesh name -> why an allocator of ours stopped it (its "mesh stopped" event), the
        #: latest few: a later stop here of a mesh stopped from elsewhere says by whom (mesh.stop)
        self.stop_reasons: Newest[str, str] = Newest(STOP_REASONS_KEPT, refresh=True)
        #: (actor mesh name, address of its first proc) of actor meshes this process stopped
        self.stopped_actor_meshes: set[tuple[str, str]] = set()
        self.log_port = rt.open_port(self._on_logs)
        self.log_enabled = True
        #: names of the proc meshes whose output this process asked to be sent (their allocators
        #: tell it where a call's output ends); a call to another one prints nothing here
        self.log_meshes: set[str] = set()
        #: (call id, rank) of the latest calls whose output ended here before their reply came
        self._ended: Newest[tuple[str, int], None] = Newest(_ENDED_KEEP, refresh=False)
        #: call id -> what waits for the end of its output (after_output); both under _ends_lock
        self._waits: dict[str, _OutputWait] = {}
        self._ends_lock = threading.Lock()
        self.log_level = logging.INFO
        #: proc mesh name -> aggregation window (s) chosen with ProcMesh.logging_option
        self.log_windows: dict[str, float] = {}
        #: replaces the default log printer: called on the I/O thread with (proc mesh name, lines)
        self.log_writer: Callable[[str, list[tuple[int, str, float, str, str]]], None] | None = None
        #: extra readers of every log batch (a dashboard's live tail), called like log_writer
        self.log_taps: list[Callable[[str, list[tuple[int, str, float, str, str]]], None]] = []
        #: told of every endpoint call this process sends: (call id, [(proc mesh, rank), ...]);
        #: a frontend uses it to send a call's output to the place the call came from
        self.on_call: Callable[[str, list[tuple[str, int]]], None] | None = None
        #: shows a runtime notice (an unhandled mesh failure) to the user: (text, mesh, rank)
        self.notice: Callable[[str, str, int | None], None] | None = None
        #: told of every mesh failure this process learns of (a MeshFailure), handled or not, as
        #: soon as it is known: a dashboard lists a failed spawn before any call raises it
        self.failure_taps: list[Callable[[Any], None]] = []
        rt.peer_failure_callbacks.append(self._on_peer_failed)
        self._anon = 0
        if self.kind != "proc":
            atexit.register(self._at_exit)
            # breakpoints in calls we make can wake our blocked main thread; we serve their cell sources
            from . import _debugwait, _pdb

            _pdb.install(rt)
            _debugwait.enable(rt.uid)
            rt.event_callbacks.append(_debugwait.on_event)
            rt.event_callbacks.append(self._on_alloc_event)

    def _on_alloc_event(self, ev: tuple[Any, ...]) -> None:
        """An allocator event (I/O thread): keep why meshes were stopped."""
        if len(ev) == 4 and ev[0] == "mesh" and ev[2] == "stopped":
            self.stop_reasons[ev[1]] = str(ev[3])

    @property
    def on_raise(self) -> Callable[[BaseException], None] | None:
        """Told of every error a future raises into the code reading it (``get``, ``await``), in
        that code's thread: a frontend learns which failures the user's code saw (and may have
        caught). Only failures pay for it."""
        return _future.raised_hook

    @on_raise.setter
    def on_raise(self, fn: Callable[[BaseException], None] | None) -> None:
        _future.raised_hook = fn

    def forget_allocators(self, addrs: list[str], cause: str) -> None:
        """Stop watching allocators about to be stopped on purpose (a job's kill, ``stop_allocator``):
        what is still pending on them fails at once with ``cause``, no "allocator lost" alarm
        follows, and this process says no goodbye to them at exit. ``cause`` should say "mesh
        stopped": the client then reports no mesh failure for it. Returns once that is recorded:
        call it before stopping them."""
        if not addrs:
            return
        for a in addrs:
            self.hellos.pop(a, None)
        sup = self.rt.supervision
        dropped = threading.Event()

        def drop() -> None:
            try:
                for a in addrs:
                    sup.lose(a, cause.format(addr=a))
            finally:
                dropped.set()

        if threading.get_ident() == self.rt.transport.io_ident:
            drop()
            return
        self.rt.loop.call_soon_threadsafe(drop)
        # the caller stops them next: their own "shutdown" event, read by the I/O thread in the
        # same turn as this callback (uvloop runs I/O before queued callbacks), must find them
        # lost already, or what is pending fails with that event's cause instead of ``cause``
        if not dropped.wait(_DROP_WAIT_S):
            logger.debug("the I/O thread took over %.0f s to drop %s", _DROP_WAIT_S, addrs)

    # ------------------------------------------------------------ requests
    def request(
        self, addr: str, method: str, *args: Any, _actor: str = "__allocator__", _revive: bool = True, **kwargs: Any
    ) -> Future[Any]:
        """Call ``method`` of the allocator at ``addr``. One declared lost gets a quick hello
        first (see :meth:`_try_revive`), which blocks the caller up to ``heartbeat_timeout`` when
        it stays silent; ``_revive=False``: no hello, the request fails at once with its loss."""
        rt = self.rt
        if _revive and rt.supervision.is_lost(addr):
            self._try_revive(addr)
        fut: Future[Any] = Future._create(f"{method} on {addr}")
        body, bufs = dumps((args, kwargs))

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            replies.close()
            raw = (bytes(body), [bytes(b) for b in bufs])
            if status == wire.ERROR:
                fut._set_raw(raw, _decode_sys_error)
            else:
                fut._set_raw(raw, lambda r: loads(*r))

        def on_fail(err: BaseException) -> None:
            replies.close()
            fut._set_exception(err)

        replies = ReplyPort(rt, on_reply)
        replies.owe(0, addr, on_fail)
        try:
            rt.send_actor(addr, _actor, method, body, bufs, reply=(rt.addr_for(addr), replies.port))
        except BaseException as e:
            replies.close()
            fut._set_exception(e)
        return fut

    def tell(self, addr: str, method: str, *args: Any, _actor: str = "__allocator__", **kwargs: Any) -> None:
        body, bufs = dumps((args, kwargs))
        self.rt.send_actor(addr, _actor, method, body, bufs)

    # ------------------------------------------------------------ connecting
    def connect(self, addr: str, timeout: float | None = None) -> dict[str, Any]:
        """Say hello to the allocator at ``addr``; raise a precise error if we cannot."""
        sup = self.rt.supervision
        info = self.hellos.get(addr)
        if info is not None:
            if not sup.is_lost(addr):
                return info
            # declared lost (silent past the heartbeat timeout, or it detached us): a new hello
            # says whether it is back, as after a stall of its host, or a restart at this address
            del self.hellos[addr]
        # one known gone (its "shutdown" heard, its heartbeat lost, a job's kill) whose address now
        # refuses connections is not back: say so at once, not after the whole timeout. One
        # that accepts, or does not answer yet (a stalled host), gets the whole timeout as before
        w = sup.watches.get(addr)
        lost = w.lost if w is not None else None
        timeout = self.rt.cfg.connect_timeout if timeout is None else timeout
        try:
            check_form(addr)
        except ValueError:
            raise ConnectError(f"cannot parse allocator address {addr!r}: expected tcp://HOST:PORT or ipc://PATH") from None
        if addr.startswith("ipc://") and not os.path.exists(addr[len("ipc://") :]):
            raise ConnectError(f"no allocator listening at {addr}: the socket file does not exist")
        self.rt.sockets.security.check_address(addr)
        me = self.rt.addr_for(addr)
        # a probe socket with a monitor tells refused, unreachable and wrong-key apart
        probe = self.rt.ctx.socket(zmq.DEALER)
        probe.linger = 0
        mon = probe.get_monitor_socket()
        self.rt.sockets.secure_client(probe, addr)
        probe.connect(addr)
        fut: Future[Any] = Future._create(f"hello from allocator {addr}")

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            raw = (bytes(body), [bytes(b) for b in bufs])
            if status == wire.ERROR:
                fut._set_raw(raw, _decode_sys_error)
            else:
                fut._set_raw(raw, lambda r: loads(*r))

        port = self.rt.open_port(on_reply)
        hello = {
            "cid": self.cid,
            "kind": self.kind,
            "session": self.session,
            "pid": os.getpid(),
            "host": self.rt.hostname,
            "addr": me,
            "version": __version__,
        }
        body, bufs = dumps(((hello,), {}))
        probe.send_multipart(wire.encode(wire.ACTOR, ("__allocator__", "hello", me, port, 0, ((), ()), "", "", 0), body, bufs))
        deadline = time.monotonic() + timeout
        connected = False
        last = "no answer"
        # A peer that drops our handshake holds another key, or died while we connected: libzmq
        # says the same of both (the connection closed, "no detail"). Its reconnect, a moment
        # later, tells them apart: accepted and dropped again, or refused.
        dropped = ""
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if probe.poll(0):
                    reason = wire.refusal_reason(probe.recv())
                    if reason is not None:
                        raise VersionMismatchError(f"allocator at {addr} refused our hello: {reason}")
                if mon.poll(min(left, 0.05) * 1000):
                    ev = recv_monitor_message(mon)
                    e = ev["event"]
                    if e in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                        connected = True
                    elif e == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                        raise AuthenticationError(
                            f"allocator at {addr} refused our key: controller and allocator must use the same cluster key file"
                            + self._local_key_hint()
                        )
                    elif e == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL or (e == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and dropped):
                        raise AuthenticationError(
                            f"security handshake with {addr} failed: the allocator there is running and holds a different "
                            "cluster key, or is not a monarch_nb allocator; connect with the key file it was started with "
                            "(its --key-file; attach_to_workers(..., ca=KEY_FILE) or MONARCH_NB_KEY_FILE here)"
                            + self._local_key_hint()
                        )
                    elif e == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                        dropped = os.strerror(int(ev["value"])) if ev["value"] else "closed"
                        connected = False
                    elif e == zmq.EVENT_CLOSED and dropped:
                        raise ConnectError(
                            f"allocator at {addr} closed our connection during the security handshake ({dropped}) and now "
                            "refuses connections: it exited while we connected (crashed, killed or shut down), which is not "
                            "a key problem; see its log on its host, start it again (`monarch-nb allocator start`, or a "
                            "job's state()) and connect again"
                            + (f"; it was lost before: {lost.cause}" if lost is not None else "")
                        )
                    elif e == zmq.EVENT_CONNECT_RETRIED and not dropped:
                        last = "connection refused or host unreachable"
                        if lost is not None and not connected:
                            raise ConnectError(f"could not reach allocator at {addr}: {last}; it was lost before: {lost.cause}")
            if not fut.done():
                if connected:
                    hint = "it accepted the connection but did not answer (not a monarch_nb allocator, or another wire version)"
                elif dropped:
                    hint = (
                        f"it closed our connection during the security handshake ({dropped}) and has not answered since: "
                        "it may have exited, or its host be gone"
                    )
                else:
                    hint = last
                raise ConnectError(f"could not reach allocator at {addr} within {timeout:.1f} s: {hint}")
            info = fut.get()
        except KeyboardInterrupt as e:
            waited = timeout - (deadline - time.monotonic())
            why = "it accepted the connection but had not answered" if connected else last
            e.add_note(f"monarch_nb: interrupted while connecting to the allocator at {addr}: {why} after {waited:.1f} s")
            raise
        finally:
            self.rt.close_port(port)
            probe.disable_monitor()
            mon.close(0)
            probe.close(0)
        self.hellos[addr] = info
        self._alloc_addr[info.get("alloc_id", "")] = addr
        self.rt.supervision.revive(addr)
        # heartbeats from now on: a controller silent until its first proc is detached
        # one on this host (a socket file) is judged by its process too when it goes silent
        pid = int(info.get("pid") or 0) if addr.startswith("ipc://") else 0
        if pid and not pid_is(pid, "monarch"):
            pid = 0  # another pid namespace: its number names some other process here
        self.rt.supervision.watch_allocator(addr, str(info.get("host", "")), pid)
        self._check_versions(addr, info)
        return info

    def _try_revive(self, addr: str) -> None:
        """Before a request to an allocator declared lost: a quick hello, which revives it if it
        answers (a stall, not a death); if not, the request fails with the loss, as before. Not
        on the I/O thread, which the hello's reply needs."""
        if threading.get_ident() == self.rt.transport.io_ident:
            return
        # a host that is really gone costs a caller the hello's wait once in a while, not on
        # every request (a dashboard refreshing the status of a job with a dead node)
        now = time.monotonic()
        if now - self._revive_tried.get(addr, -REVIVE_EVERY_S) < REVIVE_EVERY_S:
            return
        self._revive_tried[addr] = now
        try:
            self.connect(addr, timeout=self.rt.cfg.heartbeat_timeout)
        except Exception as e:
            logger.debug("allocator %s, lost, did not answer a new hello: %s", addr, e)

    def revive_lost(self, addrs: Iterable[str], timeout: float | None = None) -> None:
        """Before requests to many allocators: the hellos to those declared lost (see
        :meth:`_try_revive`) all at once, rather than one request after another, each holding
        the caller up to ``heartbeat_timeout``. Waits for them ``timeout`` at most (default:
        ``heartbeat_timeout``); one still silent then stays lost, and a request to it fails at
        once (its hello, already tried, is not tried again for a while)."""
        sup = self.rt.supervision
        lost = [a for a in dict.fromkeys(addrs) if a and sup.is_lost(a)]
        if not lost or threading.get_ident() == self.rt.transport.io_ident:
            return
        hellos = [threading.Thread(target=self._try_revive, args=(a,), name="monarch-nb-revive", daemon=True) for a in lost]
        for t in hellos:
            t.start()
        left = budget(self.rt.cfg.heartbeat_timeout if timeout is None else timeout)
        for t in hellos:
            t.join(left())

    def _local_key_hint(self) -> str:
        if self.rt.sockets.security.key is not None:
            return ""
        return (
            f" (with no cluster key, loopback TCP uses the key of this runtime directory, {self.rt.runtime_dir}: an "
            "allocator started with another MONARCH_NB_RUNTIME_DIR needs a shared key file, see `monarch-nb keygen`)"
        )

    def _check_versions(self, addr: str, info: dict[str, Any]) -> None:
        """Before the first call: differences that would make pickles fail to load, with the fix."""
        from .._pyenv import critical_mismatches, critical_versions

        problems = critical_mismatches(critical_versions(), info.get("versions") or {})
        if problems:
            import warnings

            warnings.warn(
                f"the environment of allocator {addr} ({info.get('host')}) differs in ways that break calls: "
                + "; ".join(problems),
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------ logs
    def _on_logs(self, index: int, status: int, body: Any, bufs: list[Any]) -> None:
        if status != wire.ITEM or not self.log_enabled:
            return
        kind, lines, mesh, alloc_id = loads(body, bufs)
        if kind != LOGS:
            if kind == ENDED:
                self._output_ended(lines)
            return
        addr = self._alloc_addr.get(alloc_id)
        if addr is not None:
            self.rt.heard_from(addr)  # a flood of output is proof of life too
        if self.log_taps or self.log_writer is not None:
            # readers get lines (a flood's run of lines comes as one string: split here)
            lines = expand(lines)
            if any(type(ln[4]) is bytes for ln in lines):
                lines = [(r, st, ts, c, line_text(ln)) for r, st, ts, c, ln in lines]  # a huge line, shown as text
        for tap in self.log_taps:
            try:
                tap(mesh, lines)
            except Exception:
                logger.exception("log tap failed")
        if self.log_writer is not None:
            self.log_writer(mesh, lines)
            return
        text = _one_rank_text(lines)
        if text is not None:
            try:
                if lines[0][1] == "stderr":
                    _write_lines(sys.stderr, sys.__stderr__, [text])
                else:
                    _write_lines(sys.stdout, sys.__stdout__, [text])
            except Exception:
                pass
            return
        out, err, big = _plain_parts(lines)
        try:
            if out:
                _write_lines(sys.stdout, sys.__stdout__, out, big)
            if err:
                _write_lines(sys.stderr, sys.__stderr__, err, big)
        except Exception:
            pass

    # ------------------------------------------------------------ ownership and failures
    def own(self, procs: list[ProcRef], mesh: Any) -> None:
        with self._lock:
            for p in procs:
                self.owned[p.addr] = mesh

    def _on_peer_failed(self, addr: str, err: SupervisionError) -> None:
        if self._waits:
            # an allocator lost sends no more ends: calls waiting on its procs' output wait no longer
            with self._ends_lock:
                hit = [(c, w) for c, w in self._waits.items() if addr in w.ranks.values()]
                for _c, w in hit:
                    w.ranks = {r: a for r, a in w.ranks.items() if a != addr}
            for c, w in hit:
                self._output_shown(c, w, 1)
        mesh = self.owned.get(addr)
        if mesh is None or mesh._name in self.stopped_meshes or "mesh stopped" in err.cause:
            return
        # what it is reported as is decided now, before the callers waiting on the proc hear
        # of it: one that stops the mesh at once must not turn its actor meshes' failures into
        # the proc mesh's (Monarch's names the actor mesh); the hooks run on a thread of their own
        failures = mesh._failures_for(err)
        threading.Thread(target=mesh._report_failure, args=(err, failures), daemon=True).start()

    def flush_logs(self, timeout: float = 2.0) -> None:
        """Make output the procs already wrote reach this client before returning."""
        # one declared lost has nothing to flush here, and asking would cost a hello's wait each
        _wait_all([self.request(a, "flush_logs") for a in list(self.hellos) if not self.rt.supervision.is_lost(a)], timeout)

    def after_output(self, done: Callable[[], object], call_id: str, printed: list[ProcRef], failed: set[str]) -> bool:
        """(Call ``call_id``, whose procs ``printed`` printed, and whose procs of allocators
        ``failed`` raised.) Call ``done`` once what they printed is shown (on the I/O thread; at
        the latest after :data:`AFTER_OUTPUT_WAIT_S`), so a script prints a call's output
        before its value, as Monarch's procs, writing to its stdout, do. A proc's allocator
        sends the end of a call's output behind its lines (:data:`ENDED`, maybe before the
        reply came); an error's reply does not say whether its call printed, and an allocator
        of an earlier version sends no ends: those allocators are asked to send what their
        procs wrote so far (one round trip). False: nothing to wait for here (a frontend shows
        rank output in its own place, or output is off): call ``done`` now."""
        if self.log_writer is not None or not self.log_enabled or self.kind == "proc":
            return False
        lost = self.rt.supervision.is_lost
        hellos = self.hellos
        flush = {a for a in failed if a in hellos and not lost(a)}
        ranks: dict[int, str] = {}
        for p in printed:
            info = hellos.get(p.alloc)
            if info is None or lost(p.alloc) or p.mesh not in self.log_meshes:
                continue  # its output does not come here
            if info.get(ENDS_CALLS) and call_id:
                ranks[p.rank] = p.alloc
            else:
                flush.add(p.alloc)
        with self._ends_lock:
            for r in list(ranks):
                if self._ended.pop((call_id, r), 0) is None:  # its end came before its reply
                    del ranks[r]
            if not ranks and not flush:
                return False
            w = _OutputWait(ranks, len(flush), done)
            if ranks:
                self._waits[call_id] = w
        try:
            self.rt.loop.call_soon_threadsafe(self.rt.loop.call_later, AFTER_OUTPUT_WAIT_S, self._output_shown, call_id, w, -1)
        except RuntimeError:  # the runtime is closing: nothing to wait for
            self._output_shown(call_id, w, -1)
            return True
        for a in flush:
            # answered after the logs, on the same link (allocator.sys_flush_logs)
            # no hello to one lost since the check above: this may run on the I/O thread
            self.request(a, "flush_logs", _revive=False).add_done_callback(lambda _f: self._output_shown(call_id, w, 0))
        return True

    def _output_ended(self, calls: list[tuple[int, str]]) -> None:
        """(On the I/O thread, after the lines before them were shown.) The output of these
        calls, (rank, call id), ended."""
        ready = []
        with self._ends_lock:
            for rank, call_id in calls:
                w = self._waits.get(call_id)
                if w is not None and w.ranks.pop(rank, None) is not None:
                    if w.over():
                        del self._waits[call_id]
                        ready.append(w.done)
                    continue
                # past _ENDED_KEEP the oldest goes: its reply came long ago, or never will
                self._ended[(call_id, rank)] = None
        for done in ready:
            done()

    def _output_shown(self, call_id: str, w: _OutputWait, what: int) -> None:
        """A flush answered (``what`` 0), the wait's time is up (-1), or an allocator was lost
        (1, its ranks taken out of ``w`` already): ``w.done`` if nothing is left to wait for."""
        with self._ends_lock:
            if w.finished:
                return
            if what == 0:
                w.flushes -= 1
            if what >= 0 and not w.over():
                return
            w.finished = True
            if self._waits.get(call_id) is w:
                del self._waits[call_id]
        w.done()

    def _at_exit(self) -> None:
        self.shutdown()
        # nobody can reach this process once it exits: its socket files would only be litter
        from .._runtime.fastpath import path_for

        addr = self.rt.ipc_addr
        if addr.startswith("ipc://"):
            for path in (addr[len("ipc://") :], path_for(addr)):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        # the runtime's I/O thread is halted by runtime._halt_all, which runs after this hook

    def shutdown(self) -> None:
        """Detach from every allocator (a script's meshes stop; persistent ones stay)."""
        from . import _debugwait

        with _debugwait.quiet():  # at exit nobody is there to debug paused ranks
            self.flush_logs()
            byes = []
            for addr in list(self.hellos):
                if self.rt.supervision.is_lost(addr):
                    continue  # gone: no one to say goodbye to (its lease ends our meshes there)
                try:
                    byes.append(self.request(addr, "bye", self.rt.addr_for(addr)))
                except Exception:
                    pass
            _wait_all(byes, 2.0)
        self.hellos.clear()
        self.rt.release_shm()


def _wait_all(futs: list[Future[Any]], timeout: float) -> None:
    """Wait for every future, ``timeout`` in all; their errors are the caller's to ignore."""
    left = budget(timeout)
    for f in futs:
        try:
            f.get(timeout=left())
        except Exception:
            pass


#: how long a script's call that printed waits at most for its output to be shown before its value
AFTER_OUTPUT_WAIT_S = 1.0

#: stop reasons a client keeps (a long-lived kernel's many spawns and stops)
STOP_REASONS_KEPT = 256

#: how many ends of calls' output, come before their replies, a client keeps (a reply comes
#: within moments of its end, or, as for other controllers' calls, never)
_ENDED_KEEP = 4096


class _OutputWait:
    """A call's wait for its output (:meth:`Client.after_output`), under the client's _ends_lock."""

    __slots__ = ("ranks", "flushes", "done", "finished")

    def __init__(self, ranks: dict[int, str], flushes: int, done: Callable[[], object]) -> None:
        #: rank -> its allocator, of the ranks whose end is still to come
        self.ranks = ranks
        #: flush_logs requests not yet answered
        self.flushes = flushes
        self.done = done
        self.finished = False

    def over(self) -> bool:
        if self.ranks or self.flushes > 0:
            return False
        self.finished = True
        return True


#: how often a request to an allocator declared lost tries a new hello first (a spawn always does)
REVIVE_EVERY_S = 10.0
#: how long a stop or a shutdown waits for the hellos to allocators declared lost: one whose host
#: recovered answers in milliseconds; one still silent fails its part (not waited on for its
#: heartbeat_timeout)
QUICK_HELLO_S = 0.5

#: how long ``forget_allocators`` waits for the I/O thread to record the loss (it is never busy long)
_DROP_WAIT_S = 5.0

#: a line this long is written on its own, not joined with the others (one copy fewer of it)
_BIG_LINE = 1 << 16


_LINE = operator.itemgetter(4)
_RANK = operator.itemgetter(0)
_STREAM = operator.itemgetter(1)


def _plain_parts(items: list[Any]) -> tuple[list[str | bytes], list[str | bytes], bool]:
    """What a plain stdout and stderr show of a batch (lines and runs of lines), and whether a
    part is big (written on its own)."""
    out: list[str | bytes]
    err: list[str | bytes]
    out, err = [], []
    big = False
    for item in items:
        if len(item) == 6:  # a run of lines, one string
            rank, stream, _ts, _call, line, _n = item
            prefix = f"[{rank}] "
            (err if stream == "stderr" else out).append(prefix + line.replace("\n", "\n" + prefix) + "\n")
            continue
        rank, stream, _ts, _call, line = item
        dest = err if stream == "stderr" else out
        if type(line) is bytes:
            # a huge line as the proc wrote it: ASCII goes to the fd as it came
            big = True
            dest.extend((f"[{rank}] ", line if line.isascii() else line_text(line), "\n"))
            continue
        if line.startswith("\r"):
            continue  # a progress bar's intermediate state; a plain stream shows only finished lines
        if len(line) < _BIG_LINE:
            dest.append(f"[{rank}] {line}\n")
        else:
            big = True
            dest.extend((f"[{rank}] ", line, "\n"))  # a 10 MiB line is not copied to prefix it
    return out, err, big


def _one_rank_text(lines: list[Any]) -> str | None:
    """What a plain stream shows of a batch of one rank's lines (or runs of lines) of one
    stream, built in C (a batch can be hundreds of lines); None for any other batch (several ranks or streams,
    a progress bar's state, a huge line)."""
    if len(lines) < 8:
        return None
    try:
        joined = "\n".join(map(_LINE, lines))
    except TypeError:  # a huge line, still bytes
        return None
    if len(joined) >= _BIG_LINE * 4 or "\r" in joined:
        return None
    ranks = set(map(_RANK, lines))
    if len(ranks) != 1 or len(set(map(_STREAM, lines))) != 1:
        return None
    prefix = f"[{ranks.pop()}] "
    return prefix + joined.replace("\n", "\n" + prefix) + "\n"


def _write_lines(stream: Any, original: Any, parts: list[str | bytes], big: bool = False) -> None:
    """Write rank output (whole lines) to this process's stdout or stderr.

    To the file descriptor itself when the stream is still the process's own, as Monarch's
    procs do by sharing it: the program's buffered text is not flushed, so a line the program
    is printing (``print("result", x)`` writes piece by piece) is never split by rank output.
    Through the stream when it was replaced (captured, redirected). A ``bytes`` part is a huge
    ASCII line, written as it is where the encoding keeps ASCII as it is.
    """
    if stream is original and stream is not None:
        try:
            fd = stream.fileno()
            enc = stream.encoding or "utf-8"
            same = "a".encode(enc, "replace") == b"a"
            if big:
                _widen_pipe(fd)
            for text in _runs(parts, big):
                if isinstance(text, str):
                    data = memoryview(text.encode(enc, "replace"))
                elif same:
                    data = memoryview(text)
                else:
                    data = memoryview(text.decode("ascii").encode(enc, "replace"))
                while data:
                    data = data[os.write(fd, data) :]
            return
        except (OSError, ValueError, AttributeError):
            pass
    for text in _runs(parts, big):
        stream.write(text if isinstance(text, str) else text.decode("ascii"))
    stream.flush()


#: a pipe this process writes a big line to is made this wide (Linux's default
#: ``/proc/sys/fs/pipe-max-size``, allowed to any user)
_WIDE_PIPE = 1 << 20


def _widen_pipe(fd: int) -> None:
    """Before a big line (one that fills a default pipe by itself) goes to ``fd``: if that is
    a pipe narrower than a megabyte, make it one. A 10 MiB line through the default 64 KiB pipe
    takes 160 turns between this process and its reader, each a wake-up of both: 3 ms on an
    idle machine, 20-50 ms under load, most of the line's way from the rank to the reader. The
    allocator does the same with a proc's pipe, and likewise only then: pipe memory counts
    against the user's limit, so a program that never prints a big line keeps the pipe it was
    given. Checked every time (two syscalls beside a write of 64 KiB or more): fd 1 may have
    been pointed elsewhere since."""
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, _F_GETPIPE_SZ) < _WIDE_PIPE:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, _WIDE_PIPE)
    except OSError:
        pass  # over the user's pipe memory limit, or not Linux: the pipe stays as it is


_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


def _runs(parts: list[str | bytes], big: bool) -> Iterator[str | bytes]:
    """``parts`` joined, except that a big part stays one of its own."""
    if not big:
        yield "".join(parts)  # type: ignore[arg-type]
        return
    small: list[str] = []
    for p in parts:
        if len(p) < _BIG_LINE and isinstance(p, str):
            small.append(p)
            continue
        if small:
            yield "".join(small)
            small = []
        yield p
    if small:
        yield "".join(small)
