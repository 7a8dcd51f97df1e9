"""One time budget for several waits in turn (the replies of a fan-out): answers that never
come cost the budget once, not once per wait."""

from __future__ import annotations

import time
from collections.abc import Callable


def budget(seconds: float | None) -> Callable[[], float | None]:
    """A function giving the seconds left of ``seconds`` from now, never below 0 (``None``:
    no limit), to pass as each wait's timeout."""
    if seconds is None:
        return lambda: None
    end = time.monotonic() + seconds
    return lambda: max(0.0, end - time.monotonic())
