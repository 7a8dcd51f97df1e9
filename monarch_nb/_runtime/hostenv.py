"""The host's Python environment and the code synced to it, as its allocator serves them.

Controllers ask an allocator what its interpreter has (``env``), to install into it (a pip
spec, or a distribution's files from synced blobs), and to take code: content-addressed
blobs (sent, or pulled from a staging area) committed as a workspace its procs import from.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import shutil
import sys
from typing import Any

from ..errors import ProtocolError
from .codecache import CodeCache


class HostEnv:
    """This host's interpreter and code cache (the cache is made on first use)."""

    def __init__(self, runtime_dir: str) -> None:
        self.runtime_dir = runtime_dir
        #: the allocator serving this environment (its workspaces are in use while it runs)
        self.owner = ""
        self._code: CodeCache | None = None

    @property
    def code(self) -> CodeCache:
        if self._code is None:
            self._code = CodeCache(os.path.join(self.runtime_dir, "mnb-code"), self.owner)
        return self._code

    @functools.cached_property
    def versions(self) -> dict[str, str]:
        from .._pyenv import critical_versions

        return critical_versions()

    async def describe(self) -> dict[str, Any]:
        from .._pyenv import describe

        return await asyncio.to_thread(describe)

    async def pip_install(self, spec: str) -> dict[str, Any]:
        """``pip install spec`` into this interpreter (fails fast without an index)."""
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--timeout",
            "5",
            "--retries",
            "0",
            spec,
        ]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return {"ok": proc.returncode == 0, "output": out.decode(errors="replace")[-4000:]}

    def install_files(self, name: str, files: dict[str, str], remove: str = "") -> int:
        """Install a distribution from synced blobs into this interpreter's site-packages."""
        import sysconfig
        from importlib import metadata

        site = sysconfig.get_paths()["purelib"]
        if remove:
            try:
                old = metadata.distribution(remove)
                for f in old.files or []:
                    p = os.path.normpath(os.path.join(site, str(f)))
                    if p.startswith(site + os.sep) and os.path.isfile(p):
                        os.unlink(p)
            except metadata.PackageNotFoundError:
                pass
        n = 0
        for rel, digest in files.items():
            dest = os.path.normpath(os.path.join(site, rel))
            if not dest.startswith(site + os.sep):
                raise ProtocolError(f"{name}: file {rel!r} would land outside site-packages")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(self.code._blob(digest), dest)
            n += 1
        importlib.invalidate_caches()
        return n

    def sync_pull(self, url: str, digests: list[str]) -> int:
        """Fetch blobs from a staging area (any fsspec URL this host can reach)."""
        import fsspec

        fs, base = fsspec.core.url_to_fs(url)
        n = 0
        for d in self.code.missing(digests):
            n += self.code.put({d: fs.cat_file(f"{base.rstrip('/')}/blobs/{d}")})
        return n
