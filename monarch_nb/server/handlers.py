"""Thin REST handlers over :class:`~monarch_nb.server.manager.MeshManager`.

Every handler is an ``APIHandler`` with ``@tornado.web.authenticated``: Jupyter's own token /
cookie authentication (and its XSRF check on POST) guards them, as it does the kernels; and
``@authorized`` asks the server's ``Authorizer`` (resource ``monarch_nb``; GET is "read", POST
is "write"), so a deployment can give some users a read-only sidebar. The manager's calls
block on allocator round trips, so they run on a worker thread.

An error's status says whose move it is: 404 no mesh (or rank) of that name, 400 a request to
fix, 409 a mesh whose state refuses it (stopped, a name taken), 504 an allocator that did not
answer in time, 502 one that answered with a failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from ..errors import ConnectError, MeshError, MeshNotFoundError, MonarchNBError, SpawnError
from .manager import MeshManager


class _Base(APIHandler):
    manager: MeshManager
    auth_resource = "monarch_nb"

    def initialize(self, manager: MeshManager) -> None:
        self.manager = manager

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as e:
            status = _error_status(e)
            if status is None:
                raise  # a bug here: tornado's 500, with the traceback in the server's log
            return self._fail(status, _reason(e))
        self.finish(json.dumps(result, default=str))

    def _fail(self, status: int, message: str) -> None:
        # the same JSON shape as APIHandler's errors ({"message": ...}), without tornado's
        # %-formatting of HTTPError messages (a mesh name may hold a '%')
        self.log.warning("monarch_nb sidebar API: %d %s", status, message)
        self.set_status(status)
        self.finish(json.dumps({"message": message}))

    def _body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError as e:
            raise _BadRequest(f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        return body


class _BadRequest(Exception):
    pass


def _error_status(e: BaseException) -> int | None:
    """The HTTP status of an error a manager call raised (None: not one it means to raise)."""
    if isinstance(e, MeshNotFoundError):
        return 404
    if isinstance(e, (ValueError, TypeError, PermissionError)):
        return 400
    # a lost host, a busy or stopped (SIGSTOP) allocator: the mesh may well be there
    if isinstance(e, (ConnectError, TimeoutError)):
        return 504
    # the allocator tried and could not: its procs did not start, it is shutting down
    if isinstance(e, SpawnError):
        return 502
    # stopped, a name already taken, a name several meshes answer to: the mesh is there, in a
    # state that refuses the request
    if isinstance(e, MeshError):
        return 409
    if isinstance(e, MonarchNBError):
        return 502
    return None


def _reason(e: BaseException) -> str:
    # shown to the user as the error message: one line, bounded
    return " ".join(f"{type(e).__name__}: {e}".split())[:400]


class StateHandler(_Base):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        await self._call(self.manager.state)


class AllocatorsHandler(_Base):
    @tornado.web.authenticated
    @authorized
    async def post(self) -> None:
        await self._call(self.manager.start_allocator)


class StopMeshHandler(_Base):
    @tornado.web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        try:
            alloc = self._body().get("alloc")
            if alloc is not None and not isinstance(alloc, str):
                raise _BadRequest("alloc must be an allocator address string")
        except _BadRequest as e:
            return self._fail(400, str(e))
        await self._call(self.manager.stop_mesh, name, alloc)


class RankLogHandler(_Base):
    @tornado.web.authenticated
    @authorized
    async def get(self, name: str, rank: str) -> None:
        raw = self.get_argument("tail", "500")
        try:
            tail = None if raw in ("", "all") else int(raw)
        except ValueError:
            return self._fail(400, f"tail must be an integer or 'all', got {raw!r}")
        await self._call(self.manager.rank_log, name, int(rank), tail, self.get_argument("alloc", "") or None)


def setup_handlers(web_app: Any, manager: MeshManager) -> None:
    base = url_path_join(web_app.settings.get("base_url", "/"), "monarch-nb", "api")
    kw = {"manager": manager}
    # mesh names are URL path segments: anything but a slash
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "state"), StateHandler, kw),
            (url_path_join(base, "allocators"), AllocatorsHandler, kw),
            (url_path_join(base, "meshes", r"([^/]+)", "stop"), StopMeshHandler, kw),
            (url_path_join(base, "meshes", r"([^/]+)", "ranks", r"(\d+)", "log"), RankLogHandler, kw),
        ],
    )
