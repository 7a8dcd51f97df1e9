"""The allocator's debug-session registry and command relay.

Procs register a session when an actor stops at ``breakpoint()``; the registry lives in the
allocator, so it outlives any controller (a restarted kernel lists the same paused ranks).
Controllers never talk to the paused proc's Pdb directly: ``debug_send`` forwards one command
to the proc's ``__debug__`` actor and answers with its output, and a proc that dies while
paused fails its pending commands and stays listed as ``gone`` until its mesh is stopped.
Every change is published to subscribers as ``("debug", kind, record)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .._wire import frames as wire
from .._wire.serialize import dumps, loads
from ..errors import DebugError

logger = logging.getLogger(__name__)

#: fields of a record that a command's answer updates
_LOCATION = ("function", "file", "line", "header")


class DebugRegistry:
    """Mixed into the Allocator: ``sys_debug_*`` methods and the hooks it calls."""

    rt: Any
    by_token: dict[str, Any]
    _publish: Any  # the Allocator's: send an event to every subscriber

    def _debug_init(self) -> None:
        self.debug_sessions: dict[str, dict[str, Any]] = {}
        self._debug_waits: dict[str, set[asyncio.Future[Any]]] = {}

    def _debug_event(self, kind: str, rec: dict[str, Any]) -> None:
        self._publish(("debug", kind, dict(rec)))

    # ------------------------------------------------------------ from procs
    def sys_debug_open(self, rec: dict[str, Any]) -> None:
        rec = dict(rec)
        rec["alloc"] = self.rt.tcp_addr or self.rt.ipc_addr
        rec["alloc_ipc"] = self.rt.ipc_addr
        proc = self.by_token.get(rec.get("token", ""))
        if proc is None or proc.state not in ("starting", "running"):
            # not a proc of ours (or a late message from one already gone): nothing to relay to
            logger.warning("ignored a debug session from an unknown or exited proc (pid %s)", rec.get("pid"))
            return
        # where commands go and whose death ends the session: the allocator's own record, not the claim
        rec["addr"], rec["pid"], rec["mesh"] = proc.addr or rec["addr"], proc.pid or rec["pid"], proc.mesh
        rec.setdefault("state", "paused")
        rec.setdefault("cause", "")
        self.debug_sessions[rec["sid"]] = rec
        self._debug_event("open", rec)

    def sys_debug_close(self, sid: str) -> None:
        rec = self.debug_sessions.pop(sid, None)
        if rec is not None:
            rec["state"] = "continued"
            self._debug_event("closed", rec)

    # ------------------------------------------------------------ from controllers
    def sys_debug_list(self) -> list[dict[str, Any]]:
        now = time.time()
        return [{**r, "waiting_s": now - r["since"]} for r in self.debug_sessions.values()]

    async def sys_debug_send(self, sid: str, line: str) -> dict[str, Any]:
        """Run one pdb command in session ``sid``; returns ``{"output", "state", location...}``."""
        rec = self.debug_sessions.get(sid)
        if rec is None:
            raise DebugError(f"no debug session {sid!r} on host {self.rt.hostname}: it continued, or was never opened")
        if rec["state"] == "gone":
            raise DebugError(_gone_message(rec))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def on_reply(index: int, status: int, body: Any, bufs: list[Any]) -> None:
            if not fut.done():
                fut.set_result((status, bytes(body), [bytes(b) for b in bufs]))

        port = self.rt.open_port(on_reply)
        waits = self._debug_waits.setdefault(sid, set())
        waits.add(fut)
        try:
            body, bufs = dumps(((sid, line), {}))
            self.rt.send_actor(rec["addr"], "__debug__", "send", body, bufs, reply=(self.rt.addr_for(rec["addr"]), port))
            if rec["state"] == "paused":
                rec["state"] = "running"
                self._debug_event("update", rec)
            status, body, bufs = await fut
        finally:
            self.rt.close_port(port)
            waits.discard(fut)
        if status == wire.ERROR:
            raise loads(body, bufs)
        res: dict[str, Any] = loads(body, bufs)
        if res.get("state") == "paused":
            if self.debug_sessions.get(sid) is rec:
                rec.update({k: res[k] for k in _LOCATION if k in res}, state="paused")
                self._debug_event("update", rec)
        elif res.get("state") == "continued":
            self.sys_debug_close(sid)
        return res

    # ------------------------------------------------------------ hooks from the Allocator
    def _debug_proc_exited(self, token: str, cause: str) -> None:
        for sid, rec in list(self.debug_sessions.items()):
            if rec.get("token") != token:
                continue
            rec["state"], rec["cause"] = "gone", cause
            err = DebugError(_gone_message(rec))
            for fut in self._debug_waits.pop(sid, set()):
                if not fut.done():
                    fut.set_exception(err)
            self._debug_event("gone", rec)

    def _debug_mesh_stopped(self, mesh: str) -> None:
        for sid, rec in list(self.debug_sessions.items()):
            if rec.get("mesh") == mesh:
                del self.debug_sessions[sid]
                rec["state"] = "gone"
                rec["cause"] = rec.get("cause") or "its mesh was stopped"
                self._debug_event("closed", rec)

    def _debug_replay(self, addr: str, port: int) -> None:
        """A new subscriber learns of the sessions already open (e.g. after a kernel restart)."""
        for rec in self.debug_sessions.values():
            self.rt.send_port(addr, port, 0, wire.ITEM, ("debug", "gone" if rec["state"] == "gone" else "open", dict(rec)))


def _gone_message(rec: dict[str, Any]) -> str:
    return f"rank {rec.get('rank')} of {rec.get('actor') or 'proc'} (pid {rec.get('pid')}) is gone: {rec.get('cause')}"
