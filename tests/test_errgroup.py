"""How a grouped error lists its ranks' messages (the text a notebook shows for a 16-rank error)."""

from __future__ import annotations

import pytest

from monarch_nb import _errgroup
from monarch_nb.errors import ExecError

pytestmark = pytest.mark.timeout(30)

TB = 'Traceback (most recent call last):\n  File "<mesh exec 3>", line 2, in <module>\nValueError: x\n'


def test_messages_that_differ_only_in_numbers_are_one_line_past_a_few() -> None:
    failures = {r: ("ValueError", f"shard {r} of 16 is empty", TB) for r in range(16)}
    failures[5] = ("ValueError", "no data on this host", TB)
    text = str(ExecError(failures, 16, "train"))
    assert "messages (16 distinct):" in text, text
    # ranks 0-4 and 6-15 differ only in their shard number: one line with the range
    assert "  ranks 0-4,6-15: ValueError: shard 0…15 of 16 is empty" in text, text
    assert "  rank 5: ValueError: no data on this host" in text, text
    assert text.count("ValueError: shard") == 1, text


def test_a_few_messages_keep_a_line_each() -> None:
    failures = {r: ("KeyError", f"'shard {r}'", TB) for r in (0, 4, 8)}
    lines = _errgroup.group_lines(_errgroup.group((r, *f) for r, f in failures.items()))
    assert [ln for ln in lines if ln.startswith("  rank")] == [
        "  rank 0: KeyError: 'shard 0'",
        "  rank 4: KeyError: 'shard 4'",
        "  rank 8: KeyError: 'shard 8'",
    ]
