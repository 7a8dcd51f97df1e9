"""A Jupyter Authorizer that lets every authenticated user read and nobody change anything
(loaded by a jupyter_server the tests start, with ``--ServerApp.authorizer_class``)."""

from __future__ import annotations

from typing import Any

from jupyter_server.auth import Authorizer


class ReadOnly(Authorizer):
    def is_authorized(self, handler: Any, user: Any, action: str, resource: str) -> bool:
        return action == "read"
