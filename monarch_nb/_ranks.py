"""Rank sets as people write them: ``0-3,5,7-8``."""

from __future__ import annotations

from collections.abc import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` → ``"0-3,5,7-8"``."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranks(text: str, n: int) -> list[int]:
    """``"0:4"``, ``"1,3"``, ``"0-2,5"``, ``"*"`` or ``"ranks(0:4)"`` → sorted ranks below ``n``."""
    t = text.strip()
    if t.startswith("ranks(") and t.endswith(")"):
        t = t[6:-1]
    if t in ("*", "all", ""):
        return list(range(n))
    out: set[int] = set()
    for part in t.split(","):
        part = part.strip()
        try:
            if ":" in part:
                a, _, b = part.partition(":")
                out.update(range(*slice(int(a) if a else None, int(b) if b else None).indices(n)))
            elif "-" in part[1:]:
                a, _, b = part.partition("-")
                lo, hi = int(a), int(b)
                # past the mesh, only its first rank out of range is kept (refused below): 0-99999999999
                # built 10^11 ranks first, and held the kernel until it was killed
                out.update(range(lo, min(hi, max(lo, n)) + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"cannot read rank set {text!r}: use forms like 0:4, 0-3, 1,3 or *") from None
    if not out:
        # "3:1" or "3-1": a typo, not a wish to run nowhere
        raise ValueError(f"rank set {text!r} selects no ranks: the mesh has ranks 0-{n - 1}")
    return _in_range(out, n)


def select_ranks(ranks: str | Iterable[int], n: int) -> list[int]:
    """The sorted ranks below ``n`` that ``ranks`` names: a rank-set text (see
    :func:`parse_ranks`) or the ranks themselves; one out of range is a ValueError."""
    return parse_ranks(ranks, n) if isinstance(ranks, str) else _in_range(ranks, n)


def _in_range(ranks: Iterable[int], n: int) -> list[int]:
    out = sorted(ranks)
    bad = [r for r in out if not 0 <= r < n]
    if bad:
        raise ValueError(f"rank {bad[0]} is out of range: the mesh has ranks 0-{n - 1}")
    return out
