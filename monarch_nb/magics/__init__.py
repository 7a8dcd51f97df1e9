"""``%load_ext monarch_nb``: the ``%mesh`` / ``%%mesh`` magics and rank output in the right cell.

Every subcommand is a thin layer over a public function (``monarch_nb.mesh``,
``monarch_nb.logs``), so a script can do what a magic does.
"""

from __future__ import annotations

from typing import Any

from ._magics import MeshMagics
from ._output import KernelOutput

__all__ = ["KernelOutput", "MeshMagics", "load_ipython_extension", "unload_ipython_extension"]

_output: KernelOutput | None = None


def load_ipython_extension(ip: Any) -> None:
    global _output
    from ..actor import controller_client

    ip.register_magics(MeshMagics)
    if _output is None and getattr(ip, "kernel", None) is not None:
        _output = KernelOutput(ip, controller_client())
        _output.install()


def unload_ipython_extension(ip: Any) -> None:
    global _output
    if _output is not None:
        _output.uninstall()
        _output = None


def output() -> KernelOutput | None:
    """The kernel's output router, when the extension is loaded in a kernel."""
    return _output
