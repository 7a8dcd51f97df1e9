"""Argument types the two command lines share: ``monarch-nb`` (cli) and ``%mesh`` (magics)."""

from __future__ import annotations

import argparse


def positive_seconds(text: str) -> float:
    """A number of seconds above 0 (a timeout or an interval of 0 would never wait, or spin)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"a number of seconds above 0, got {text!r}")
    return v
