"""Remote pdb in procs: ``breakpoint()`` pauses one actor and hands its prompt to the allocator.

A proc installs :func:`breakpoint_hook` as ``sys.breakpointhook`` (and as ``pdb.set_trace``).
It runs a :class:`RemotePdb` on the actor's own thread, so only that actor stops: other actors
keep running, messages to this one queue in its mailbox, and the proc's I/O thread keeps
answering pings. The Pdb's stdin/stdout are a relay, never the captured fds 0/1:

* at its first prompt the session registers with this host's allocator (``debug_open``), so it
  is listed for any controller, also one that attaches after a restart;
* a command reaches ``__debug__.send`` on this proc's I/O thread (forwarded by the allocator),
  is queued for the Pdb, and its output goes back as the reply once the Pdb prompts again
  (or once the actor resumes, with state ``continued``).

Code defined in a notebook cell has no file on the proc's host; the Pdb asks the caller's
``__debug__.source`` for such files so ``l`` and the ``->`` lines show the real source.
"""

from __future__ import annotations

import bdb
import contextvars
import linecache
import os
import pdb
import queue
import secrets
import sys
import threading
import time
from types import FrameType
from typing import Any, cast

from .._runtime.runtime import NO_REPLY, Runtime, system_method
from .._wire import frames as wire
from .._wire.serialize import dumps
from ..errors import safe_str
from . import _context

#: commands after which the Pdb stops again soon (the session stays open)
_STEPS = frozenset({"s", "step", "n", "next", "r", "return", "unt", "until"})
#: pdb's prompt, stripped from the output we relay (clients draw their own)
_PROMPT = "(Pdb) "

_sessions: dict[str, RemotePdb] = {}
#: the session open on this thread, if any (``breakpoint()`` while stepping through it is a no-op)
_here = threading.local()
#: the call (its ``ActorSlot.running`` entry, compared by identity) whose rank a person resumed
#: from a breakpoint in this thread or task: if that call then raises, the rank stops again,
#: post-mortem (:func:`post_mortem`). A context variable, as Monarch's ``DebugContext``: an
#: async actor's concurrent calls each have their own
_debugged: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_nb_debugged", default=None)
#: the pdb command the debugger sends to a breakpoint nobody can attend (``debug_no_input``):
#: ``c``, except that the call is not counted as debugged, so its error does not stop it again
NO_INPUT_CONTINUE = "continue_unattended"


class _Relay:
    """The Pdb's stdin and stdout: lines in from the I/O thread, output out to whoever asked."""

    def __init__(self, owner: RemotePdb) -> None:
        self.owner = owner
        #: (command, where its answer goes: None for a command nobody waits on)
        self.lines: queue.SimpleQueue[tuple[str, tuple[str, int, int] | None]] = queue.SimpleQueue()
        self.out: list[str] = []
        self.reply: tuple[str, int, int] | None = None

    # stdout
    def write(self, s: str) -> int:
        self.out.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"

    def take(self) -> str:
        text, self.out = "".join(self.out), []
        return text[: -len(_PROMPT)] if text.endswith(_PROMPT) else text

    # stdin
    def readline(self) -> str:
        self.owner._on_prompt()
        line, self.reply = self.lines.get()
        return line + "\n"


class RemotePdb(pdb.Pdb):
    """A Pdb whose console is the allocator relay; one per ``breakpoint()`` call."""

    def __init__(self, rt: Runtime, frame: Any = None, post_mortem: BaseException | None = None) -> None:
        self.relay = _Relay(self)
        super().__init__(stdin=self.relay, stdout=self.relay, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = _PROMPT
        self.rt = rt
        self.sid = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.open = False
        self.last = ""
        #: resumed by the debugger without a person (``debug_no_input``): the call was not debugged
        self.unattended = False
        #: "Type: message" of the exception a post-mortem session inspects ("" at a breakpoint)
        self.post_mortem = "" if post_mortem is None else _exc_line(post_mortem)
        self._no_source: set[str] = set()
        spec = _context.proc_spec or {}
        inst = _context.current_instance()
        slot = getattr(inst, "_slot", None)
        point = inst.rank if inst is not None else _context.proc_point()
        self.alloc = spec.get("alloc_addr", "")
        # the call of this thread or task: another may run at once (an async actor's concurrent endpoints)
        call = slot.this_call() if slot is not None else None
        self.call = call
        method, call_id, caller = call[:3] if call is not None else ("", "", "")
        self.caller: str = caller
        self.info: dict[str, Any] = {
            "sid": self.sid,
            "token": spec.get("token", ""),
            "addr": rt.tcp_addr or rt.ipc_addr,
            "pid": os.getpid(),
            "host": rt.hostname,
            "mesh": spec.get("mesh", ""),
            "actor": inst.name if inst is not None else "",
            "actor_id": getattr(slot, "name", "") if inst is not None else "",
            "rank": point.rank,
            "coords": dict(point.items()),
            "call_id": call_id,
            "method": method,
            "caller": self.caller,
            # where breakpoint() was called (pdb stops on the line after it)
            "bp_file": frame.f_code.co_filename if frame is not None else "",
            "bp_line": frame.f_lineno if frame is not None else 0,
            "post_mortem": self.post_mortem,
        }

    # -- the relay's view of the prompt loop
    def _location(self) -> dict[str, Any]:
        frame = cast("FrameType", self.curframe)  # the prompt loop runs at a frame
        entry = self.stack[self.curindex] if self.stack else (frame, frame.f_lineno)
        header = "> " + self.format_stack_entry(entry, "\n-> ")
        if self.post_mortem:
            # pdb's own post-mortem prints no exception: say which one, and that it goes on to the caller
            header = f"post-mortem: the call raised {self.post_mortem} ('c' lets it reach the caller)\n{header}"
        return {
            "function": frame.f_code.co_name,
            "file": frame.f_code.co_filename,
            "line": entry[1],
            "header": header,
        }

    def _on_prompt(self) -> None:
        """The Pdb waits for a command: answer the last one, or open the session."""
        out = self.relay.take()
        loc = self._location()
        if not self.open:
            self.open = True
            _sessions[self.sid] = self
            _here.pdb = self
            rec = {**self.info, **loc, "banner": out, "since": time.time(), "state": "paused"}
            self._tell("debug_open", rec)
        if self.relay.reply is not None:
            self._answer({"output": out, "state": "paused", **loc})

    def _answer(self, value: dict[str, Any]) -> None:
        reply, self.relay.reply = self.relay.reply, None
        if reply is not None:
            self.rt.send_port(reply[0], reply[1], reply[2], wire.OK, value)

    def _tell(self, method: str, *args: Any) -> None:
        if not self.alloc:
            return
        body, bufs = dumps((args, {}))
        try:
            self.rt.send_actor(self.alloc, "__allocator__", method, body, bufs)
        except Exception as e:  # the allocator is gone: nobody can attach, so resume
            print(f"monarch_nb: cannot register a debug session ({e}); continuing", file=sys.stderr)

    def _end(self, aborted: bool = False) -> None:
        """The actor resumes: answer the command that resumed it and close the session.

        ``quit`` in the answer: the endpoint does not go on but raises (pdb's ``q`` raises
        BdbQuit into it, as in Monarch; ``restart`` raises too), so its call fails; the
        client says so rather than "continued"."""
        if not self.open:
            return
        self.open = False
        _sessions.pop(self.sid, None)
        _here.pdb = None
        if not self.unattended and self.call is not None and not self.post_mortem:
            _debugged.set(self.call)
        # ``q`` in a post-mortem only ends it: the call fails with its own error either way
        quits = not self.post_mortem and (aborted or bool(self.quitting))
        self._answer({"output": self.relay.take(), "state": "continued", "quit": quits, "post_mortem": self.post_mortem})
        while True:  # commands queued behind the one that resumed us
            try:
                _, reply = self.relay.lines.get_nowait()
            except queue.Empty:
                break
            if reply is None:
                continue
            self.rt.send_port(reply[0], reply[1], reply[2], wire.OK, {"output": "", "state": "continued"})
        self._tell("debug_close", self.sid)

    # -- pdb hooks
    def precmd(self, line: str) -> str:
        self.last = (line.strip() or self.lastcmd or "").split(" ", 1)[0].split(";", 1)[0]
        return super().precmd(line)

    def do_continue_unattended(self, arg: str) -> Any:
        """``c`` sent by the debugger for a breakpoint nobody can attend (``debug_no_input``)."""
        self.unattended = True
        return self.do_continue(arg)

    def interaction(self, frame: Any, traceback: Any) -> None:
        self._fetch_sources(frame if frame is not None or traceback is None else _innermost(traceback))
        try:
            super().interaction(frame, traceback)
        except BaseException:  # e.g. pdb's `restart` raises into the endpoint: the session is over
            self._end(aborted=True)
            raise
        # a post-mortem has nothing to step through: any command that leaves the prompt ends it
        if self.last not in _STEPS or self.post_mortem:
            self._end()

    def trace_dispatch(self, frame: Any, event: str, arg: Any) -> Any:
        # stepping out of the endpoint lands in the actor's dispatch loop: that is "continue",
        # not a reason to stop inside monarch_nb (or in the next message's endpoint)
        if self.open and event == "line" and frame.f_code in _framework_codes():
            self.set_continue()
            self._end()
            return None
        return super().trace_dispatch(frame, event, arg)

    def _fetch_sources(self, frame: Any) -> None:
        if not self.caller:
            return
        while frame is not None:
            fn = frame.f_code.co_filename
            if fn not in self._no_source and not linecache.getlines(fn, frame.f_globals) and not fn.startswith("<frozen"):
                self._no_source.add(fn)
                try:
                    lines = _context.client().request(self.caller, "source", fn, _actor="__debug__").get(timeout=2)
                except Exception:
                    lines = []
                if lines:
                    # mtime None: linecache.checkcache keeps the entry (there is no file to compare with)
                    linecache.cache[fn] = (sum(map(len, lines)), None, list(lines), fn)
            frame = frame.f_back


def _exc_line(e: BaseException) -> str:
    msg = safe_str(e)
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= 200 else text[:200] + "…"


def _innermost(tb: Any) -> Any:
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def post_mortem(call: Any, exc: BaseException) -> None:
    """(The thread or task of ``call``, which raised ``exc``.) If a person resumed this call from
    a ``breakpoint()``, stop its rank again in pdb at the frame that raised, as Monarch 0.7.0
    does, before the error goes to the caller. Only such a call: a rank that never stopped does
    not wait for a debugger nobody runs; nor one resumed for nobody (``debug_no_input``), nor
    pdb's ``q`` (its BdbQuit is the person asking to leave)."""
    if call is None or _debugged.get() is not call:
        return
    _debugged.set(None)
    rt = _context._runtime
    tb = exc.__traceback__
    if rt is None or tb is None or isinstance(exc, bdb.BdbQuit) or rt.in_io_thread():
        return
    # the first entry is the actor's dispatch frame that caught it: the stack starts at the endpoint
    tb = tb.tb_next or tb
    p = RemotePdb(rt, _innermost(tb), post_mortem=exc)
    p.reset()
    try:
        p.interaction(None, tb)
    except Exception:  # pdb's `restart` raises: the call still fails with its own error, as without it
        pass


_codes: frozenset[Any] | None = None


def _framework_codes() -> frozenset[Any]:
    global _codes
    if _codes is None:
        from ._host import ActorSlot

        names = ("_call_sync", "_call_async", "_run_sync", "_async_main", "_init")
        _codes = frozenset(getattr(ActorSlot, n).__code__ for n in names)
    return _codes


def breakpoint_hook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` in procs: pause this actor in a relayed pdb."""
    rt = _context._runtime
    if rt is None or rt.in_io_thread():
        # the I/O thread carries the debugger's own messages; stopping it would deadlock
        print("monarch_nb: breakpoint() on the I/O thread ignored", file=sys.stderr)
        return
    active = getattr(_here, "pdb", None)
    if active is not None and active.open:
        return  # stepped onto another breakpoint() in the session already open here: keep stepping
    frame = sys._getframe(1)
    RemotePdb(rt, frame).set_trace(frame)


def quit_sessions() -> None:
    """The proc is stopping: each actor paused here at a breakpoint quits it (pdb's ``q``, which
    raises BdbQuit into its endpoint), so it ends its message and runs ``__cleanup__``. Nobody
    can type ``c`` into a stopping proc: waiting for it only wasted ``stop_cleanup_timeout``
    before the proc was killed."""
    for s in list(_sessions.values()):
        s.relay.lines.put(("q", None))


class DebugService:
    """The ``__debug__`` system actor: commands for paused actors (procs), sources (controllers)."""

    @system_method(wants_reply=True)
    def sys_send(self, sid: str, line: str, *, _reply: tuple[str, int, int]) -> Any:
        s = _sessions.get(sid)
        if s is None:
            return {"output": "", "state": "continued"}
        s.relay.lines.put((line, _reply))
        return NO_REPLY

    def sys_stacks(self) -> dict[str, Any]:
        """Every thread's Python stack (``monarch_nb.debug.stacks``), answered on the I/O thread."""
        from ._stackdump import collect

        return collect(_context.runtime())

    def sys_source(self, filename: str) -> list[str]:
        """Source a paused rank needs but cannot read: a notebook cell, or a module this process
        runs (a script's ``__main__``). Never any other file: peers may not browse our disk."""
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and entry[1] is None:  # in-memory source (IPython cells)
            return list(entry[2])
        if filename in {getattr(m, "__file__", None) for m in list(sys.modules.values())}:
            return linecache.getlines(filename)
        return []


def install(rt: Runtime) -> None:
    """Serve ``__debug__`` on ``rt``; in a proc, also route ``breakpoint()``/``pdb.set_trace()`` here."""
    rt.system.setdefault("__debug__", DebugService())
    if _context.proc_spec is not None and os.environ.get("PYTHONBREAKPOINT") != "0":
        sys.breakpointhook = breakpoint_hook
        pdb.set_trace = breakpoint_hook


__all__ = ["NO_INPUT_CONTINUE", "DebugService", "RemotePdb", "breakpoint_hook", "install", "post_mortem", "quit_sessions"]
