"""Aggregation of rank output and rank-set syntax (pure functions)."""

from __future__ import annotations

import pytest

from monarch_nb._ranks import format_ranks, parse_ranks
from monarch_nb.logs import Aggregator


def _lines(*items: tuple[int, str]) -> list[tuple[int, str, float, str, str]]:
    return [(r, "stdout", 0.0, "", text) for r, text in items]


def test_identical_lines_collapse_with_rank_set_and_count() -> None:
    a = Aggregator()
    a.add("m", _lines(*((r, "ready") for r in (3, 0, 2, 1, 7, 5, 6, 4))))
    assert a.flush() == [("stdout", "[ranks 0-7 ×8] ready")]
    assert a.flush() == []  # a flush empties the window


def test_lines_differing_in_numbers_collapse_with_ranges() -> None:
    a = Aggregator()
    a.add("m", _lines(*((r, f"step 3 loss={0.51 + r / 100:.2f} lr=1e-3") for r in range(8))))
    assert a.flush() == [("stdout", "[ranks 0-7 ×8] step 3 loss=0.51…0.58 lr=1e-3")]


def test_order_follows_the_lowest_rank_not_arrival() -> None:
    a = Aggregator()
    a.add("m", _lines((5, "second half"), (1, "first half"), (0, "start"), (0, "first half")))
    assert a.flush() == [("stdout", "[0] start"), ("stdout", "[ranks 0-1 ×2] first half"), ("stdout", "[5] second half")]


def test_streams_and_meshes_stay_apart() -> None:
    a = Aggregator()
    a.add("a", _lines((0, "x")))
    a.add("b", [(0, "stderr", 0.0, "", "x")])
    assert a.flush() == [("stdout", "[a 0] x"), ("stderr", "[b 0] x")]


def test_a_rank_s_successive_lines_are_never_merged() -> None:
    a = Aggregator()
    a.add("m", _lines((2, "tick"), (2, "tick"), (2, "tick")))
    assert a.flush() == [("stdout", "[2] tick")] * 3


def test_training_steps_keep_their_order_and_aggregate_across_ranks() -> None:
    # 8 steps on 16 ranks, arriving rank by rank in a scrambled order: 8 lines, step 0 to 7
    a = Aggregator()
    for r in (5, 0, 15, 3, 9, 1, 2, 4, 6, 7, 8, 10, 11, 12, 13, 14):
        a.add("m", _lines(*((r, f"step {s} loss={(8 - s) * 0.02 + r * 0.001:.3f}") for s in range(8))))
    out = a.flush()
    assert [t for _s, t in out] == [
        f"[ranks 0-15 ×16] step {s} loss={(8 - s) * 0.02:.3f}…{(8 - s) * 0.02 + 0.015:.3f}" for s in range(8)
    ]


def test_rank_sets() -> None:
    assert format_ranks([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert parse_ranks("0:4", 8) == [0, 1, 2, 3]
    assert parse_ranks("ranks(1:3)", 8) == [1, 2]
    assert parse_ranks("0-2,5", 8) == [0, 1, 2, 5]
    assert parse_ranks("*", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="out of range"):
        parse_ranks("9", 8)
    with pytest.raises(ValueError, match="cannot read rank set"):
        parse_ranks("a-b", 8)
