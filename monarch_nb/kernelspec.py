"""The "Python 3 (monarch_nb)" kernel: ipykernel with ``%load_ext monarch_nb`` already done."""

from __future__ import annotations

import json
import os
import sys
import tempfile

DISPLAY_NAME = "Python 3 (monarch_nb)"


def spec(python: str | None = None) -> dict[str, object]:
    """The kernel.json for ``python`` (default: this interpreter)."""
    return {
        "argv": [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext", "monarch_nb"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "metadata": {"debugger": True},
    }


def install(python: str | None = None, name: str = "monarch-nb", user: bool = False, prefix: str | None = None) -> str:
    """Install the kernel spec for ``python``; returns the directory it went to.

    Without ``user`` or ``prefix`` it goes into this environment (``sys.prefix``), where a
    JupyterLab started from the same environment finds it.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if python and not os.access(python, os.X_OK):
        raise FileNotFoundError(f"no executable interpreter at {python}")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "kernel.json"), "w") as f:
            json.dump(spec(python), f, indent=1)
        if not user and prefix is None:
            prefix = sys.prefix
        return str(KernelSpecManager().install_kernel_spec(d, name, user=user, prefix=prefix))
