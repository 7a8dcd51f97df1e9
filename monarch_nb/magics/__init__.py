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
    from IPython.core.error import UsageError

    from ..actor import controller_client
    from ..errors import ConfigError

    ip.register_magics(MeshMagics)
    if _output is None and getattr(ip, "kernel", None) is not None:
        try:
            client = controller_client()
        except ConfigError as e:
            # a MONARCH_NB_* setting that is wrong (a runtime directory that cannot be made): one
            # line, as each %mesh then says it, not ten frames of monarch_nb; %load_ext again
            # once it is fixed
            raise UsageError(f"monarch_nb: {e}") from None
        _output = KernelOutput(ip, client)
        _output.install()


def unload_ipython_extension(ip: Any) -> None:
    global _output
    if _output is not None:
        _output.uninstall()
        _output = None


def output() -> KernelOutput | None:
    """The kernel's output router, when the extension is loaded in a kernel."""
    return _output
