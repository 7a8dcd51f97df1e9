"""Text that differs only in its numbers: one template, the numbers summarised as ``lo…hi``.

Rank output (``[ranks 0-7 ×8] loss=0.51…0.58``) and the messages of a grouped error (``ranks
0-15: ValueError: shard 0…15 is empty``) collapse the same way. Stdlib only.
"""

from __future__ import annotations

import re

#: a number as it is written in text: integers, decimals, exponents, a sign. A sign or a
#: leading dot right after a word is punctuation, not part of the number (``shard-3``,
#: ``layer.3.weight``: read as signed or decimal, ranks 0-15's ``shard-0``…``shard-15`` became
#: ``shard-15…-0``), and so is a trailing dot (``layer.1.`` would keep it in the slot)
NUM = re.compile(r"(?:(?<![\w.])[-+])?(?:\d+\.\d+|(?<![\w.])\.\d+|\d+)(?:[eE][-+]?\d+)?")


def summarise(values: list[str]) -> str:
    """One number slot's values: the value if all are equal, else ``lo…hi`` (as written)."""
    first = values[0]
    if all(v == first for v in values):
        return first
    lo = min(values, key=float)
    hi = max(values, key=float)
    return f"{lo}…{hi}"


def merge(texts: list[str]) -> str:
    """``texts`` of one template (the same text between their numbers) as one: each number slot
    summarised, ``"rank 0 broke"``, ``"rank 7 broke"`` -> ``"rank 0…7 broke"``."""
    parts = NUM.split(texts[0])
    slots = [NUM.findall(t) for t in texts]
    out = [parts[0]]
    for i, part in enumerate(parts[1:]):
        out.append(summarise([s[i] for s in slots]))
        out.append(part)
    return "".join(out)


def template(text: str) -> str:
    """``text`` with each number replaced by a NUL: texts that differ only in numbers share it."""
    return NUM.sub("\0", text)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``plural(1, "rank")`` is ``"1 rank"``, ``plural(2,
    "rank")`` ``"2 ranks"`` (``nouns``: an irregular plural, ``plural(n, "mesh", "meshes")``)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"
