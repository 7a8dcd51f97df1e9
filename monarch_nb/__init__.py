"""monarch_nb: a notebook-native single controller for a cluster of machines.

The actor API lives in :mod:`monarch_nb.actor`; :func:`status` is the read-only
introspection every frontend uses. Nothing heavy is imported here.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def status(**kwargs: Any) -> dict[str, Any]:
    """A snapshot of allocators, hosts, meshes and procs (see :func:`monarch_nb.introspect.status`)."""
    from .introspect import status as _status

    return _status(**kwargs)


def __getattr__(name: str) -> Any:
    if name in ("actor", "spmd", "introspect", "allocator", "config", "errors", "debug"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
