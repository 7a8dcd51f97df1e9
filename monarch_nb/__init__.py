"""monarch_nb: a notebook-native single controller for a cluster of machines.

The actor API lives in :mod:`monarch_nb.actor`; :func:`status` is the read-only
introspection every frontend uses. Nothing heavy is imported here.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__ as __version__


def status(**kwargs: Any) -> dict[str, Any]:
    """A snapshot of allocators, hosts, meshes and procs: this machine's and its jobs' (see
    :func:`monarch_nb.introspect.known_status`); with ``key_file`` or ``local``, only those of
    :func:`monarch_nb.introspect.status`."""
    from .introspect import known_status
    from .introspect import status as _status

    if "key_file" in kwargs or "local" in kwargs:
        return _status(**kwargs)
    # a job's allocators keep their records in the job's directory: a notebook's status that read
    # this runtime directory alone listed none of the meshes `monarch-nb status` lists under the job
    return known_status(addresses=kwargs.pop("addresses", None), **kwargs)


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext monarch_nb``: the ``%mesh`` magics, and rank output routed to the calling cell."""
    from .magics import load_ipython_extension as _load

    _load(ip)


def unload_ipython_extension(ip: Any) -> None:
    from .magics import unload_ipython_extension as _unload

    _unload(ip)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where ``jupyter labextension develop`` finds the prebuilt sidebar (see package.json)."""
    return [{"src": "_labextension", "dest": "monarch-nb"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "monarch_nb"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """jupyter_server entry point: the sidebar's REST API (imported only here, never on ``import monarch_nb``)."""
    from .server import load

    load(server_app)


#: what ``monarch_nb.X`` imports on first use, as ``import monarch_nb.X`` would
_SUBMODULES = frozenset(
    ("actor", "allocator", "config", "debug", "env", "errors", "introspect", "job", "logs", "mesh", "rdma", "server",
     "spmd", "sync", "telemetry", "tensor", "widgets")
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "configure":
        # the documented spelling (docs/debugging.md, the notebooks): monarch_nb.configure(debug_no_input="wait")
        from .config import configure

        return configure
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
