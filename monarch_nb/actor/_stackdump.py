"""Every thread's Python stack in this process, and its actors' running and queued calls, taken on the I/O thread.

The I/O thread answers while an actor thread is blocked in a collective or a C call that
released the GIL; one that holds the GIL stops this answer too, which the caller reports.

An async actor's calls are coroutines: suspended at an ``await``, they are on no thread's stack
(its loop thread just waits in ``select``), so each task's await chain is read here too, from
this thread: reading a suspended coroutine's frames needs the GIL only, never the loop (which
may be the thing that is stuck).
"""

from __future__ import annotations

import asyncio
import linecache
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Any

#: distinct task stacks kept per actor (tasks alike are counted, not repeated): a rank with
#: 10,000 tasks answers in kilobytes, and says how many it left out
MAX_GROUPS = 32
#: calls named per group (the oldest), frames per await chain, and tasks read (the rest are counted)
MAX_CALLS = 4
MAX_FRAMES = 64
MAX_TASKS = 20_000
#: queued calls named per actor (the first in line; the rest are counted)
MAX_QUEUED = 8

#: per actor slot, the queued calls an earlier dump saw and when, by their meta's id (the meta
#: kept, to tell a new call from one at a reused id): a mailbox keeps no arrival times (every call
#: would pay for them), so a later dump says how long a call has been queued at least
_seen_queued: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, float]]] = weakref.WeakKeyDictionary()


def collect(rt: Any) -> dict[str, Any]:
    """``{"pid", "host", "threads": [{"name", "ident", "collector", "frames": [(file, line, func, source)], "actor"?}],
    "actors": {name: {"async", "groups": [...], "left_out", "queued", "queued_calls"}}}``; a group is calls or tasks
    alike: ``{"method", "task", "count", "calls": [(call id, caller, seconds)], "frames", "awaiting", "running"}``;
    ``queued`` counts the calls in the actor's mailbox, ``queued_calls`` names the first in line:
    ``(method, call id, caller, seconds queued at least or None: first seen now)``."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    slots = list(getattr(rt, "actors", {}).items())
    # each actor's thread (an async one's runs its loop): a proc with two actors has two threads of one name
    owners = {getattr(getattr(s, "thread", None), "ident", None): n for n, s in slots}
    threads = []
    for ident, frame in sys._current_frames().items():
        stack: list[traceback.FrameSummary] = list(traceback.extract_stack(frame))
        if ident == me:
            # the collector's own frames say nothing about the process
            stack = stack[: next((i for i, fs in enumerate(stack) if fs.filename == __file__), len(stack))]
        t: dict[str, Any] = {
            "name": names.get(ident, f"thread-{ident}"),
            "ident": ident,
            "collector": ident == me,
            "frames": [(fs.filename, fs.lineno or 0, fs.name, (fs.line or "").strip()) for fs in stack],
        }
        if ident in owners:
            t["actor"] = owners[ident]
        threads.append(t)
    actors = {}
    for n, s in slots:
        try:
            actors[n] = _actor(s)
        except Exception as e:  # one actor's odd state must not cost the answer for the others
            actors[n] = {"async": False, "groups": [], "left_out": 0, "error": f"{type(e).__name__}: {e}"}
    return {"pid": os.getpid(), "host": getattr(rt, "hostname", ""), "threads": threads, "actors": actors}


def _actor(slot: Any) -> dict[str, Any]:
    now = time.perf_counter()  # the clock the slot's call starts are on
    # a copy is one C call under the GIL: the actor's thread may begin or end a call meanwhile
    running: dict[int, tuple[str, str, str, float]] = dict(getattr(slot, "running", {}).copy())
    groups: dict[Any, dict[str, Any]] = {}
    left_out = 0

    def add(key: Any, entry: dict[str, Any], call: tuple[str, str, float] | None) -> None:
        nonlocal left_out
        g = groups.get(key)
        if g is None:
            if len(groups) >= MAX_GROUPS:
                left_out += 1
                return
            g = groups[key] = entry
        g["count"] += 1
        if call is not None and len(g["calls"]) < MAX_CALLS:
            g["calls"].append(call)

    is_async = bool(getattr(slot, "is_async", False))
    loop = getattr(slot, "loop", None) if is_async else None
    if loop is not None and not loop.is_closed():
        from ._host import ActorSlot  # a proc has it loaded; a controller reading MAX_GROUPS need not

        call_code = ActorSlot._call_async.__code__
        tasks = _tasks(loop)
        left_out += max(0, len(tasks) - MAX_TASKS)
        for task in tasks[:MAX_TASKS]:
            frames, awaiting, on_cpu, tok = _chain(task, call_code)
            r = running.pop(tok, None) if tok is not None else None
            key = ("task", r[0] if r else None, _qualname(task), tuple(f[:3] for f in frames), awaiting, on_cpu)
            call = (r[1], r[2], max(0.0, now - r[3])) if r else None
            entry = {
                "method": r[0] if r else None,
                "task": _qualname(task),
                "count": 0,
                "calls": [],
                "frames": frames,
                "awaiting": awaiting,
                "running": on_cpu,
            }
            add(key, entry, call)
    # calls on no task: a sync actor's (its thread's stack shows where), or one just begun
    for method, call_id, caller, t0 in sorted(running.values(), key=lambda r: r[3]):
        entry = {"method": method, "task": None, "count": 0, "calls": [], "frames": [], "awaiting": "", "running": True}
        add(("call", method), entry, (call_id, caller, max(0.0, now - t0)))
    # the longest-running calls first, then tasks the actor started itself
    out = sorted(groups.values(), key=lambda g: (not g["calls"], -max((c[2] for c in g["calls"]), default=0.0)))
    try:
        n, first = _queued(slot)
    except Exception:  # the running calls are worth the answer without the queued ones
        n, first = 0, []
    return {"async": is_async, "groups": out, "left_out": left_out, "queued": n, "queued_calls": first}


def _queued(slot: Any) -> tuple[int, list[tuple[str, str, str, float | None]]]:
    """How many calls wait in ``slot``'s mailbox, and the first :data:`MAX_QUEUED` of them."""
    read = getattr(slot, "queued", None)
    if not callable(read):
        return 0, []
    calls = [i[1] for i in read() if i and i[0] == "call"]
    now = time.monotonic()
    try:
        seen = _seen_queued.setdefault(slot, {})
    except TypeError:  # not weakly referable (a stand-in slot): no ages
        seen = {}
    first = []
    kept: dict[int, tuple[Any, float]] = {}
    for meta in calls[:MAX_QUEUED]:
        was = seen.get(id(meta))
        since = was[1] if was is not None and was[0] is meta else now
        kept[id(meta)] = (meta, since)
        # an explicit response port's call has its caller's address too; a broadcast has none
        first.append((str(meta[1]), str(meta[6]), str(meta[2]), now - since if was is not None and was[0] is meta else None))
    seen.clear()
    seen.update(kept)
    return len(calls), first


def _tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    # all_tasks copies a WeakSet another thread may change, and retries if it did
    try:
        tasks = asyncio.all_tasks(loop)
    except RuntimeError:
        return []
    return sorted(tasks, key=id)


def _qualname(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return str(getattr(coro, "__qualname__", None) or type(coro).__name__)


def _chain(task: asyncio.Task[Any], call_code: Any) -> tuple[list[tuple[str, int, str, str]], str, bool, int | None]:
    """The task's await chain, outermost first: its frames, what the innermost awaits, whether
    it is running now (on its loop's thread) and the key of the actor call it runs, if any."""
    frames: list[tuple[str, int, str, str]] = []
    tok = None
    on_cpu = False
    obj: Any = task.get_coro()
    while obj is not None and len(frames) < MAX_FRAMES:
        f = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if f is None:
            break
        on_cpu = on_cpu or bool(getattr(obj, "cr_running", False) or getattr(obj, "gi_running", False))
        code = f.f_code
        frames.append(
            (code.co_filename, f.f_lineno or 0, code.co_name, linecache.getline(code.co_filename, f.f_lineno or 0).strip())
        )
        if code is call_code and tok is None:
            # the slot keys a running call by its context token, a local of _call_async
            t = f.f_locals.get("tok")
            tok = id(t) if t is not None else None
        obj = getattr(obj, "cr_await", None) if hasattr(obj, "cr_await") else getattr(obj, "gi_yieldfrom", None)
    awaiting = "" if on_cpu else _describe(getattr(task, "_fut_waiter", None))
    return frames, awaiting, on_cpu, tok


def _describe(fut: Any) -> str:
    """What a suspended task waits on, in words alike across ranks (no ids, no addresses)."""
    if fut is None:
        return ""
    if isinstance(fut, asyncio.Task):
        return f"awaiting task {_qualname(fut)}"
    if type(fut).__name__ == "_GatheringFuture":
        return "awaiting gather()"
    return f"awaiting a {type(fut).__name__}"
