"""The jupyter_server extension behind the JupyterLab sidebar.

:mod:`.manager` gathers state and acts through monarch_nb's public API only (no tornado, no
kernels); :mod:`.handlers` are thin authenticated REST handlers over it under
``<base_url>/monarch-nb/api/``. This module imports neither, so importing it stays cheap.
"""

from __future__ import annotations

from typing import Any


def load(server_app: Any) -> None:
    """Register the REST handlers on a running jupyter_server ``ServerApp``."""
    from .handlers import setup_handlers
    from .manager import MeshManager

    setup_handlers(server_app.web_app, MeshManager())
    server_app.log.info("monarch_nb: sidebar API at %smonarch-nb/api/", server_app.web_app.settings.get("base_url", "/"))
