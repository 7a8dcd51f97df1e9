"""Newest: the dict that keeps only the last N entries (ended calls, stop reasons, connections
in their handshake ...), whichever way an entry is put in."""

from __future__ import annotations

import copy
import pickle

import pytest

from monarch_nb._newest import Newest

pytestmark = pytest.mark.timeout(10)


def test_past_its_bound_the_oldest_entries_are_forgotten_first() -> None:
    d: Newest[str, int] = Newest(3, refresh=False)
    for i, k in enumerate("abcde"):
        d[k] = i
    assert list(d.items()) == [("c", 2), ("d", 3), ("e", 4)]
    assert "a" not in d and d.get("b") is None


def test_without_refresh_a_key_set_again_keeps_the_place_of_its_first_write() -> None:
    d: Newest[str, int] = Newest(3, refresh=False)
    d["a"], d["b"], d["c"] = 1, 2, 3
    d["a"] = 10  # the value changes, its age does not
    d["x"] = 4
    assert list(d.items()) == [("b", 2), ("c", 3), ("x", 4)]


def test_with_refresh_a_key_set_again_is_the_newest() -> None:
    d: Newest[str, int] = Newest(3, refresh=True)
    d["a"], d["b"], d["c"] = 1, 2, 3
    d["a"] = 10
    d["x"] = 4
    assert list(d.items()) == [("c", 3), ("a", 10), ("x", 4)]
    assert d.push("c", 30) == []  # made the newest, so not the one forgotten
    assert d.push("y", 5) == [("a", 10)]
    assert list(d.items()) == [("x", 4), ("c", 30), ("y", 5)]


def test_setdefault_and_update_keep_the_bound_too() -> None:
    d: Newest[int, str] = Newest(2, refresh=False)
    assert d.setdefault(1, "one") == "one"
    assert d.setdefault(1, "uno") == "one"
    d.setdefault(2, "two")
    d.setdefault(3, "three")
    assert list(d) == [2, 3]
    d.update({4: "four", 5: "five"})
    assert list(d) == [4, 5]
    d.update([(6, "six")])
    d |= {7: "seven"}
    assert list(d) == [6, 7]


def test_push_says_what_it_forgot_so_its_owner_can_act_on_it() -> None:
    d: Newest[str, None] = Newest(2, refresh=False)
    assert d.push("a", None) == []
    assert d.push("b", None) == []
    assert d.push("c", None) == [("a", None)]
    assert d.push("c", None) == []  # held already: nothing is forgotten
    assert list(d) == ["b", "c"]


def test_an_entry_taken_out_makes_room_for_the_next() -> None:
    d: Newest[str, int] = Newest(2, refresh=False)
    d["a"], d["b"] = 1, 2
    assert d.pop("a") == 1
    d["c"] = 3
    assert list(d) == ["b", "c"]
    d.move_to_end("b")  # an owner that refreshes on read (an LRU) does so itself
    d["d"] = 4
    assert list(d) == ["b", "d"]


@pytest.mark.parametrize("how", ["copy", "copy.copy", "copy.deepcopy", "pickle"])
def test_a_copy_keeps_the_bound_and_the_order(how: str) -> None:
    d: Newest[str, int] = Newest(3, refresh=True)
    d["a"], d["b"], d["c"] = 1, 2, 3
    d["a"] = 1
    c = {
        "copy": d.copy,
        "copy.copy": lambda: copy.copy(d),
        "copy.deepcopy": lambda: copy.deepcopy(d),
        "pickle": lambda: pickle.loads(pickle.dumps(d)),
    }[how]()
    assert isinstance(c, Newest) and (c.most, c.refresh) == (3, True)
    assert list(c.items()) == [("b", 2), ("c", 3), ("a", 1)]
    c["x"] = 0
    assert list(c) == ["c", "a", "x"]
    assert list(d) == ["b", "c", "a"]  # the original is its own


@pytest.mark.parametrize("most", [0, -1])
def test_a_bound_below_one_is_refused_saying_so(most: int) -> None:
    with pytest.raises(ValueError, match="keeps at least one entry"):
        Newest(most, refresh=False)


def test_a_bound_lowered_later_holds_from_the_next_insert() -> None:
    d: Newest[int, int] = Newest(4, refresh=False)
    for i in range(4):
        d[i] = i
    d.most = 2
    assert len(d) == 4  # nothing is forgotten until something is put in
    d[9] = 9
    assert list(d) == [3, 9]
