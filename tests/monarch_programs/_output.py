"""How a program's output is compared: the client's lines exactly, what actors print as a multiset.

Actors' lines contain "actor says". Monarch's procs write them straight to the shared stdout,
so two procs' lines can even merge into one; monarch_nb tags each with its rank ("[3] ").
Neither order nor tag is part of a program's meaning, so actor text is cut out of every line,
untagged and sorted; what remains of the lines (blank ones dropped) must match exactly.

    python _output.py A B    exit 0 when outputs A and B compare equal (prints a diff if not)
"""

from __future__ import annotations

import difflib
import re
import sys

_TAG = re.compile(r"^\[\d+\] ")
# a rank's tag goes with its text: rank output written straight to the fd may land inside a
# client line whose buffered text was flushed in two pieces
_ACTOR = re.compile(r"(?:\[\d+\] )?actor says .*?(?=(?:\[\d+\] )?actor says |$)")


def normalize(text: str) -> tuple[list[str], list[str]]:
    """(the client's lines, the sorted actor texts) of a program's stdout."""
    client: list[str] = []
    actors: list[str] = []
    for line in text.splitlines():
        line = _TAG.sub("", line)
        actors.extend(_TAG.sub("", m.group(0)).rstrip() for m in _ACTOR.finditer(line))
        rest = _ACTOR.sub("", line)
        if rest.strip():
            client.append(rest)
    return client, sorted(actors)


def render(text: str) -> list[str]:
    client, actors = normalize(text)
    return [*client, "--- printed by actors (sorted) ---", *actors]


if __name__ == "__main__":
    a, b = (render(open(p).read()) for p in sys.argv[1:3])
    if a != b:
        sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(a, b, sys.argv[1], sys.argv[2], lineterm=""))
        sys.exit(1)
