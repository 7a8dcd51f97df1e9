"""The test harness cleans up what it started when starting fails (tests/_kernel.py)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from _kernel import Kernel

pytestmark = pytest.mark.timeout(120)


def test_a_kernel_that_fails_to_load_the_extension_is_shut_down(tmp_path: Path) -> None:
    # the caller never gets a Kernel whose start failed, so nothing else would ever close it
    fake = tmp_path / "monarch_nb"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not this one')\n")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with pytest.raises(AssertionError, match="not this one"):
        Kernel(env={"PYTHONPATH": str(tmp_path)})

    def alive(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    left = [p for p in me.children(recursive=True) if p.pid not in before and alive(p)]
    try:
        assert left == [], f"the kernel outlived its failed start: {[' '.join(p.cmdline()) for p in left]}"
    finally:
        for p in left:
            p.kill()
