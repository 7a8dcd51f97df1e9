"""Actors and how a process hosts them.

A sync actor (every endpoint a ``def``) gets its own thread and no event loop; an actor
with ``async def`` endpoints gets its own thread running its own loop. Either way messages
reach it through a mailbox fed by the runtime's I/O thread and run one at a time, in
arrival order (``concurrent_endpoint`` methods may overlap at their awaits).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import sys
import threading
import time
from functools import cached_property
from typing import Any

from .._runtime import _dataplane, spans
from .._runtime.logcapture import set_call
from .._runtime.runtime import NO_REPLY, Runtime, system_method
from .._wire import frames as wire
from .._wire.serialize import loads
from ..errors import ActorError, _safe_exc, format_exception, safe_str
from . import _context
from ._endpoint import EndpointProperty, _NotAnEndpointMethod
from ._shape import Extent, Point

logger = logging.getLogger(__name__)


class Actor:
    """Base class of actors. Decorate methods with ``@endpoint`` to make them callable on a mesh."""

    @cached_property
    def logger(self) -> logging.Logger:
        # as Monarch's: named after the class and passing DEBUG records, so that a program's
        # logging configuration (formats with %(name)s, levels) treats it the same
        lgr = logging.getLogger(type(self).__name__)
        lgr.setLevel(logging.DEBUG)
        return lgr

    def __supervise__(self, failure: Any) -> Any:
        """Called when a mesh this actor owns fails; return True when handled."""
        return None

    def _handle_undeliverable_message(self, message: Any) -> bool:
        return False


def endpoints_of(cls: type) -> dict[str, EndpointProperty]:
    out: dict[str, EndpointProperty] = {}
    for klass in reversed(cls.__mro__):
        for name, v in vars(klass).items():
            if isinstance(v, EndpointProperty):
                out[name] = v
    return out


def is_async_actor(cls: type) -> bool:
    """True for actors whose endpoints are ``async def``; ValueError when a class mixes both."""
    eps = endpoints_of(cls)
    kinds = {name: ep.is_async for name, ep in eps.items()}
    if kinds and len(set(kinds.values())) > 1:
        sync = sorted(n for n, a in kinds.items() if not a)
        asyn = sorted(n for n, a in kinds.items() if a)
        raise ValueError(
            f"actor class {cls.__qualname__} mixes sync endpoints {sync} and async endpoints {asyn}; "
            "make them all `def` (the actor runs on its own thread) or all `async def` (it runs on its own loop)"
        )
    return any(kinds.values())


class Instance:
    """What an actor knows about itself (``context().actor_instance``)."""

    def __init__(
        self,
        name: str,
        cls: type,
        rank: Point,
        proc_mesh: Any,
        creator: str,
        parent: _context.CreatorInstance | None = None,
        controllers: Any = None,
    ) -> None:
        self.name = name
        self.class_name = f"{cls.__module__}.{cls.__qualname__}"
        self.rank = rank
        self.proc_mesh = proc_mesh
        #: who spawned this actor, as Monarch's ``Instance.creator`` (``<root>`` for the controller)
        self.creator = parent if parent is not None else _context.ROOT
        #: the spawning client's uid: a breakpoint in ``__init__`` belongs to its spawn call
        self._creator_uid = creator
        #: the root controller's proc, where get_or_spawn_controller keeps the job's controllers
        self._controllers = controllers
        rt = _context.runtime()
        self.proc_id = f"{rt.label}@{rt.hostname}:{rt.pid}"
        self.actor_id = f"{name}{rank!r}@{self.proc_id}"
        self._slot: ActorSlot | None = None

    @property
    def proc(self) -> Any:
        from ._mesh import this_proc

        return this_proc()

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor once the messages already delivered to it are handled (Monarch's
        ``Instance.stop``); later calls to it fail instead of waiting on a dead mailbox."""
        slot = self._slot
        if slot is not None:
            # on the I/O thread, which delivers messages: once the proc no longer lists the
            # actor nothing more reaches its mailbox, and the stop queues after all that did
            slot.rt.call_soon(slot.retire)

    def __repr__(self) -> str:
        # Monarch's qualified name: <root>.<__main__.Trainer trainers{'gpus': 0/2}>
        return _context.qualified_name(self)


class ActorSlot:
    """One actor in this process: its object, mailbox and thread (and loop, if async)."""

    def __init__(self, rt: Runtime, name: str, cls: type, info: Instance) -> None:
        """``name`` keys the actor in this proc; ``info`` is what it knows about itself."""
        self.rt = rt
        self.name = name
        self.cls = cls
        self.is_async = is_async_actor(cls)
        self.instance_info = info
        info._slot = self
        self.endpoints = endpoints_of(cls)
        self.obj: Any = None
        self.init_error: ActorError | None = None
        #: the constructor's arguments, kept for `%mesh sync --recreate`
        self.init_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.markers = _context.proc_spec is not None
        self.busy = ""
        #: calls served and seconds spent in them (telemetry)
        self.calls = 0
        self.busy_s = 0.0
        #: the call being run and who waits for it (a breakpoint's debug session names them)
        self.call_id = ""
        self.caller = ""
        self._stopped = False
        self._points: dict[Any, Point] = {}
        if self.is_async:
            self.loop = asyncio.new_event_loop()
            self._aq: asyncio.Queue[Any] | None = None
            ready = threading.Event()
            self.thread = threading.Thread(target=self._run_async, args=(ready,), name=f"actor-{name}", daemon=True)
            self.thread.start()
            ready.wait()
        else:
            self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self.thread = threading.Thread(target=self._run_sync, name=f"actor-{name}", daemon=True)
            self.thread.start()

    # -- mailbox (called on the I/O thread)
    def deliver(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        self._put(("call", meta, body, buffers))

    def _put(self, item: Any) -> None:
        if self.is_async:
            assert self._aq is not None
            self.loop.call_soon_threadsafe(self._aq.put_nowait, item)
        else:
            self._q.put(item)

    def stop(self) -> None:
        self._put(("stop",))

    def retire(self) -> None:
        """Unlist this actor from its proc, then stop it (on the I/O thread)."""
        if self.rt.actors.get(self.name) is self:
            del self.rt.actors[self.name]
        self.stop()

    def supervise(self, failure: Any) -> Any:
        """Run ``__supervise__(failure)`` as Monarch does: on the actor's own thread between
        messages (a sync actor) or as a task on its loop (an async one, whose override may be
        ``async def``); never alongside its endpoints on another thread. Returns its result."""
        done = threading.Event()
        box: list[Any] = [None, None]
        self._put(("supervise", failure, box, done))
        while not done.wait(1.0):
            if not self.thread.is_alive():
                return None  # stopped before it got to it: not handled
        if box[1] is not None:
            raise box[1]
        return box[0]

    def _supervise_sync(self, failure: Any, box: list[Any], done: threading.Event) -> None:
        try:
            box[0] = self.obj.__supervise__(failure)
        except BaseException as e:
            box[1] = e
        finally:
            done.set()

    async def _supervise_async(self, failure: Any, box: list[Any], done: threading.Event) -> None:
        try:
            r = self.obj.__supervise__(failure)
            box[0] = await r if inspect.isawaitable(r) else r
        except BaseException as e:
            box[1] = e
        finally:
            done.set()

    # -- threads
    def _run_sync(self) -> None:
        _context._instance.set(self.instance_info)
        while True:
            item = self._q.get()
            if item[0] == "stop":
                self._cleanup_sync()
                return
            if item[0] == "init":
                self._init(*item[1:])
            elif item[0] == "supervise":
                self._supervise_sync(*item[1:])
            else:
                self._call_sync(*item[1:])

    def _run_async(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        _context._instance.set(self.instance_info)
        self._aq = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        ready.set()
        self.loop.run_until_complete(self._async_main())

    async def _async_main(self) -> None:
        assert self._aq is not None
        while True:
            item = await self._aq.get()
            if item[0] == "stop":
                await self._cleanup_async()
                return
            if item[0] == "init":
                self._init(*item[1:])
                continue
            if item[0] == "supervise":
                # a task, as in Monarch: it may await while the actor goes on with messages
                t = asyncio.ensure_future(self._supervise_async(*item[1:]))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
                continue
            meta = item[1]
            ep = self.endpoints.get(meta[1])
            if ep is not None and ep.concurrent:
                t = asyncio.ensure_future(self._call_async(*item[1:]))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            else:
                await self._call_async(*item[1:])

    # -- work
    def _error(self, e: BaseException, what: str) -> ActorError:
        return ActorError(
            _safe_exc(e),
            format_exception(e),
            actor=self.name,
            rank=self.instance_info.rank.rank,
            host=self.rt.hostname,
            message=f"{what} failed: {type(e).__name__}: {safe_str(e)}",
        )

    def _init(self, args: tuple[Any, ...], kwargs: dict[str, Any], reply: tuple[str, int, int]) -> None:
        tok = _context._message_rank.set(self.instance_info.rank)
        # a breakpoint in __init__ belongs to the creator's spawn call (its call ids start with its uid)
        self.busy, self.call_id, self.caller = "__init__", f"{self.instance_info._creator_uid}.spawn", reply[0]
        try:
            obj = self.cls.__new__(self.cls)
            obj.__init__(*args, **kwargs)
            self.obj = obj
            self.init_args = (args, kwargs)
            status, value = wire.OK, None
        except BaseException as e:
            self.init_error = self._error(e, f"{self.cls.__qualname__}.__init__ on rank {self.instance_info.rank.rank}")
            status, value = wire.ERROR, self.init_error
        finally:
            _context._message_rank.reset(tok)
            self.busy = ""
        self.rt.send_port(reply[0], reply[1], reply[2], status, value)

    def _prepare(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> tuple[Any, ...] | None:
        _, method, raddr, rport, index, ext, call_id = meta[:7]
        if self.init_error is not None:
            self._reply(raddr, rport, index, wire.ERROR, self.init_error)
            return None
        try:
            args, kwargs = loads(body, buffers)
        except BaseException as e:
            self._reply(raddr, rport, index, wire.ERROR, self._error(e, f"unpickling the arguments of {self.name}.{method}"))
            return None
        ep = self.endpoints.get(method)
        if ep is not None:
            fn = ep.fn
            if ep.explicit_response_port:
                from ._port import Port

                args = (Port(raddr, rport, index), *args)
                raddr = ""
        else:
            fn = getattr(self.cls, method, None)
            if not callable(fn) or method.startswith("__"):
                self._reply(
                    raddr,
                    rport,
                    index,
                    wire.ERROR,
                    self._error(AttributeError(f"{self.cls.__qualname__} has no endpoint {method!r}"), f"{self.name}.{method}"),
                )
                return None
            if isinstance(fn, _NotAnEndpointMethod):
                fn = fn.fn
        return (
            fn,
            args,
            kwargs,
            raddr,
            rport,
            index,
            self._point(index, ext),
            call_id,
            method,
        )

    def _point(self, index: int, ext: Any) -> Point:
        # the message rank of a call; the same few recur, and building one costs microseconds
        key = (index, ext)
        p = self._points.get(key)
        if p is None:
            if len(self._points) > 1024:
                self._points.clear()
            p = self._points[key] = Point(index, Extent(*ext)) if ext[0] or ext[1] else Point(0, Extent([], []))
        return p

    def _reply(self, raddr: str, rport: int, index: int, status: int, value: Any) -> None:
        if raddr:
            self.rt.send_port(raddr, rport, index, status, value)
        elif status == wire.ERROR:
            # nobody is waiting: leave the failure in this proc's log where %mesh logs finds it
            print(f"monarch_nb: unobserved error in {self.name}: {value}", file=sys.stderr, flush=True)

    def _mark(self, call_id: str) -> None:
        if self.markers:
            if not call_id:
                # what the call printed leaves the proc before its reply does
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
            set_call(call_id)

    def _call_sync(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        prep = self._prepare(meta, body, buffers)
        if prep is None:
            return
        fn, args, kwargs, raddr, rport, index, mrank, call_id, method = prep
        tok = _context._message_rank.set(mrank)
        self.busy, self.call_id, self.caller = method, call_id, raddr
        self._mark(call_id)
        t0 = time.perf_counter()
        try:
            result = fn(self.obj, *args, **kwargs)
            status = wire.OK
        except BaseException as e:
            result, status = self._error(e, f"{self.name}.{method}"), wire.ERROR
        finally:
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            self.calls += 1
            spans.record_call(self.instance_info.name, method, self.instance_info.rank.rank, t0, t1, status == wire.OK)
            self._mark("")
            self.busy = ""
            _context._message_rank.reset(tok)
        self._reply(raddr, rport, index, status, result)

    async def _call_async(self, meta: tuple[Any, ...], body: Any, buffers: list[Any]) -> None:
        prep = self._prepare(meta, body, buffers)
        if prep is None:
            return
        fn, args, kwargs, raddr, rport, index, mrank, call_id, method = prep
        tok = _context._message_rank.set(mrank)
        self.busy, self.call_id, self.caller = method, call_id, raddr
        self._mark(call_id)
        t0 = time.perf_counter()
        try:
            result = fn(self.obj, *args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            status = wire.OK
        except BaseException as e:
            result, status = self._error(e, f"{self.name}.{method}"), wire.ERROR
        finally:
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            self.calls += 1
            spans.record_call(self.instance_info.name, method, self.instance_info.rank.rank, t0, t1, status == wire.OK)
            self._mark("")
            self.busy = ""
            _context._message_rank.reset(tok)
        self._reply(raddr, rport, index, status, result)

    def _cleanup_sync(self) -> None:
        fn = getattr(self.obj, "__cleanup__", None)
        if fn is not None:
            try:
                fn(None)
            except Exception:
                logger.exception("__cleanup__ of %s raised", self.name)

    async def _cleanup_async(self) -> None:
        fn = getattr(self.obj, "__cleanup__", None)
        if fn is not None:
            try:
                r = fn(None)
                if inspect.isawaitable(r):
                    await r
            except Exception:
                logger.exception("__cleanup__ of %s raised", self.name)


class ActorHost:
    """The ``__sys__`` system actor every process runs: spawns and stops actors, answers pings."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.shutdown_requested = threading.Event()
        # work that must run on the proc's main thread (``%%mesh exec`` cells), so that an
        # interrupt is a real SIGINT: it breaks blocking calls such as time.sleep, as in a kernel
        self._main_jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._main_busy = False
        #: get_or_spawn_controller's singletons (in the root controller): name -> waiters, result
        self._controllers: dict[str, dict[str, Any]] = {}

    def run_on_main(self, fn: Any) -> Any:
        """Run ``fn()`` on this proc's main thread and return its result (raises what it raises)."""
        done = threading.Event()
        box: list[Any] = [None, None]
        self._main_jobs.put((fn, box, done))
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def main_loop(self) -> None:
        """The proc's main thread: run main-thread jobs until shutdown."""
        import signal

        def on_sigint(signum: int, frame: Any) -> None:
            # only interrupt user code; a stray SIGINT must not kill an idle proc
            if self._main_busy:
                raise KeyboardInterrupt

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_sigint)
        while True:
            try:
                job = self._main_jobs.get()
            except KeyboardInterrupt:  # a late interrupt after the job it was meant for
                continue
            if job is None:
                return
            fn, box, done = job
            try:
                self._main_busy = True
                try:
                    box[0] = fn()
                finally:
                    self._main_busy = False
            except BaseException as e:
                box[1] = e
            done.set()

    def sys_interrupt(self) -> bool:
        """Interrupt code running on the main thread (a kernel interrupt reaching ``%%mesh exec``)."""
        import signal

        if not self._main_busy:
            return False
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return True

    @system_method(wants_reply=True)
    def sys_spawn_actor(
        self,
        name: str,
        cls: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extent: tuple[list[str], list[int]],
        proc_mesh: Any,
        creator: str,
        *,
        parent: _context.CreatorInstance | None = None,
        controllers: Any = None,
        label: str | None = None,
        _reply: tuple[str, int, int],
    ) -> Any:
        rank = _reply[2]  # one message serves every proc; each one's index in the mesh is its rank
        if name in self.rt.actors:
            raise ValueError(f"an actor named {name!r} already exists in this proc; pick another name")
        info = Instance(name, cls, Point(rank, Extent(*extent)), proc_mesh, creator, parent, controllers)
        if label is not None:
            # the name the program gave (``name`` may carry a suffix: ProcMesh._unique_actor_name)
            info.name = label
        slot = ActorSlot(self.rt, name, cls, info)
        self.rt.actors[name] = slot
        slot._put(("init", args, kwargs, _reply))
        return NO_REPLY

    @system_method(wants_reply=True)
    def sys_get_or_spawn_controller(
        self, name: str, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], creator: str, *, _reply: tuple[str, int, int]
    ) -> Any:
        """The job's singleton actor ``name`` in this (the root controller's) process: spawned by
        the first request, every request answered once it is constructed (or failed to be).

        Runs on the I/O thread and never blocks it: the constructor runs on the new actor's
        thread and its reply comes back to a port here, which answers everyone waiting.
        """
        entry = self._controllers.get(name)
        if entry is None:
            if name in self.rt.actors:
                raise ValueError(f"an actor named {name!r} already exists in this proc; pick another controller name")
            entry = self._controllers[name] = {"waiters": [_reply], "result": None}
            pid = 0

            def constructed(index: int, status: int, body: Any, bufs: list[Any]) -> None:
                self.rt.close_port(pid)
                entry["result"] = (status, loads(body, bufs))
                for w in entry["waiters"]:
                    self.rt.send_port(w[0], w[1], w[2], *entry["result"])
                entry["waiters"] = []

            pid = self.rt.open_port(constructed)
            from ._mesh import this_proc

            me = _context.controllers_proc()
            info = Instance(name, cls, Point(0, Extent([], [])), this_proc(), creator, _context.ROOT, me)
            slot = ActorSlot(self.rt, name, cls, info)
            self.rt.actors[name] = slot
            slot._put(("init", args, kwargs, (self.rt.ipc_addr, pid, 0)))
        elif entry["result"] is None:
            entry["waiters"].append(_reply)
        else:
            self.rt.send_port(_reply[0], _reply[1], _reply[2], *entry["result"])
        return NO_REPLY

    def sys_stop_actor(self, name: str) -> bool:
        slot = self.rt.actors.pop(name, None)
        if slot is None:
            return False
        slot.stop()  # type: ignore[attr-defined]
        return True

    def sys_ping(self) -> str:
        return "pong"

    def sys_set_log_level(self, level: int) -> None:
        """``ProcMesh.logging_option(level=)``: this process's root logger level."""
        import logging

        root = logging.getLogger()
        if not root.handlers:
            # without a handler only warnings and worse would show (logging's last resort)
            logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
        root.setLevel(level)

    @system_method(wants_reply=True)
    def sys_reload(self, root: str, changed: list[str], mode: str = "inplace", *, _reply: tuple[str, int, int]) -> Any:
        """Reload synced modules that changed (on a thread of its own: imports may be slow)."""

        def run() -> None:
            from ._reload import reload_changed

            try:
                value, status = reload_changed(self.rt, root, changed, mode), wire.OK
            except BaseException as e:
                value, status = ActorError(_safe_exc(e), format_exception(e), message=f"reload failed: {safe_str(e)}"), wire.ERROR
            self.rt.send_port(_reply[0], _reply[1], _reply[2], status, value)

        threading.Thread(target=run, name="monarch_nb-reload", daemon=True).start()
        return NO_REPLY

    def sys_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            n: {
                "busy": getattr(s, "busy", ""),
                "async": getattr(s, "is_async", False),
                "calls": getattr(s, "calls", 0),
                "busy_s": getattr(s, "busy_s", 0.0),
            }
            for n, s in self.rt.actors.items()
        }
        moved = _dataplane.counters()
        if moved is not None:  # bytes moved through RDMABuffers, for the dashboard
            out["__dataplane__"] = moved
        return out

    def sys_shutdown(self) -> Any:
        self.shutdown_requested.set()
        self._main_jobs.put(None)
        return NO_REPLY

    def cleanup_all(self, timeout: float = 5.0) -> None:
        slots = list(self.rt.actors.values())
        for s in slots:
            s.stop()  # type: ignore[attr-defined]
        for s in slots:
            s.thread.join(timeout)  # type: ignore[attr-defined]


def ensure_actor_host(rt: Runtime) -> ActorHost:
    host = rt.system.get("__sys__")
    if host is None:
        host = rt.system["__sys__"] = ActorHost(rt)
    return host  # type: ignore[no-any-return]
