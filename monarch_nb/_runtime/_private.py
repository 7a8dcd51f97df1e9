"""Files of the runtime directory are their user's alone (docs/security.md): an ``opener`` for
``open()`` that creates a file 0600 whatever the umask, where ``open()`` alone gives 0644 and
the file would be private only as long as the directory above it is."""

from __future__ import annotations

import os


def private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)
