"""Aggregation of rank output and rank-set syntax (pure functions), and the allocator's
splitting of a proc's output into lines."""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import signal
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import wait_for

from monarch_nb._ranks import format_ranks, parse_ranks
from monarch_nb._runtime import logcapture
from monarch_nb._runtime.logcapture import (
    ProcLog,
    TaggedStream,
    _Flusher,
    ended_marker,
    expand,
    line_text,
    marker,
    read_log,
    set_call,
    split_run,
)
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


def test_monarch_actor_prefixes_collapse_with_their_point_read_as_the_rank_tag() -> None:
    # Monarch's [actor=...] log prefix names each rank's point; the rank tag says it already
    a = Aggregator()
    pre = "INFO:talker:[actor=<root>.<__main__.Talker talkers{{'hosts': {h}/2, 'gpus': {g}/2}}>] "
    a.add("m", _lines(*((2 * h + g, pre.format(h=h, g=g) + "step 3 loss=0.5") for h in (1, 0) for g in (1, 0))))
    a.add("m", _lines((1, "[actor=<root>.<__main__.P p{'gpus': 1/2}>.<__main__.C c{'gpus': 0/1}>] alone")))
    assert a.flush() == [
        ("stdout", "[ranks 0-3 ×4] INFO:talker:[actor=<root>.<__main__.Talker talkers>] step 3 loss=0.5"),
        ("stdout", "[1] [actor=<root>.<__main__.P p{'gpus': 1/2}>.<__main__.C c>] alone"),
    ]
    # a prefix with no point (a controller's <root>) and braces in the message are left alone
    a.add("m", _lines((0, "[actor=<root>] x {'a': 1}>]")))
    assert a.flush() == [("stdout", "[0] [actor=<root>] x {'a': 1}>]")]


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


def _into(got: list[tuple[int, str, float, str, str]]) -> Callable[[list[Any]], None]:
    """An emit that keeps lines (runs of lines split, as a controller's readers get them)."""
    return lambda items: got.extend(expand(items))


def _feed(log: ProcLog, data: bytes, piece: int = 1 << 16) -> None:
    for i in range(0, len(data), piece):  # as the allocator reads a pipe: 64 KiB at a time
        log.feed("stdout", data[i : i + piece])


def test_a_huge_line_is_split_in_linear_time_and_kept_whole(tmp_path) -> None:  # type: ignore[no-untyped-def]
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "rank-3.jsonl"), 3, _into(got))
    big = "y" * (20 << 20)
    t0 = time.perf_counter()
    _feed(log, marker("c1") + b"before\n" + big.encode() + b"\nafter\rstep 1\rstep 2")
    # joining the pieces at every read took 2.8 s for these 20 MiB (0.1 s now)
    assert time.perf_counter() - t0 < 1.0
    # the huge line stays the proc's bytes until it is shown
    assert [(r, c, ln) for r, _, _, c, ln in got] == [(3, "c1", "before"), (3, "c1", big.encode()), (3, "c1", "\rstep 2")]
    # the tail (for error messages) keeps the start of it, not 20 MiB
    assert [ln[4] for ln in log.tail] == ["before", big[:4096].encode(), "\rstep 2"]
    log.feed("stdout", b"\n")
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "rank-3.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == ["before", big, "\rstep 2", "step 2"]


def test_a_line_that_never_ends_is_cut_at_the_limit_and_nothing_is_lost(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a rank writing bytes with no newline (binary data to stdout) held them all in the
    # allocator until a newline came, if ever: now a line is cut at log_max_line_bytes
    emitted: list[tuple[str, int]] = []

    def emit(lines: list[tuple[int, str, float, str, str]]) -> None:
        emitted.extend((line_text(item[4])[:12], len(line_text(item[4]))) for item in lines)

    log = ProcLog(str(tmp_path / "rank-0.jsonl"), 0, emit, max_line=1 << 20)
    log.feed("stdout", b"before\n")
    piece = b"0123456789abcdef" * 4096  # 64 KiB, no newline
    for _ in range(40):  # 2.5 MiB
        log.feed("stdout", piece)
        assert len(log._partial["stdout"]) + log._more_n["stdout"] < 1 << 20  # never more held than the limit
    log.feed("stdout", b"tail\nafter\n")
    log.close()
    heads = [h for h, _ in emitted]
    sizes = [n for _, n in emitted]
    assert heads[0] == "before" and heads[-1] == "after"
    cut = [i for i, h in enumerate(heads) if h.startswith("[monarch_nb:")]
    assert len(cut) == 2 and all(sizes[i - 1] == 1 << 20 and heads[i - 1] == "0123456789ab" for i in cut), emitted
    # every byte printed is in some line, in order: two cut lines of 1 MiB, then the rest
    assert sizes[cut[1] + 1] == 40 * len(piece) - 2 * (1 << 20) + len("tail")
    disk = [r["line"] for r in read_log(str(tmp_path / "rank-0.jsonl"))]
    assert disk[0] == "before" and disk[-1] == "after" and len(disk) == len(emitted)
    # the file's owner refuses a negative tail from any caller (it read it as "all but the first")
    with pytest.raises(ValueError, match="0 or more, not -1"):
        read_log(str(tmp_path / "rank-0.jsonl"), tail=-1)
    assert "".join(ln for ln in disk if not ln.startswith("[monarch_nb: "))[len("before") : -len("after")] == (
        (piece * 40).decode() + "tail"
    )


@pytest.mark.timeout(120)
def test_a_rank_writing_with_no_newline_reaches_the_notebook_in_cut_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # end to end, with the limit set where users set it (the allocator's environment)
    import _ownctl

    got = _ownctl.run(
        _ownctl.runtime_dir(tmp_path),
        """
        pm = this_host().spawn_procs(per_host={"gpus": 1})
        a = pm.spawn("e", E)
        a.write.call_one("z" * 65536, 48).get(timeout=60)  # 3 MiB with no newline
        a.say.call_one("").get(timeout=30)  # the newline that ends it
        a.say.call_one("end").get(timeout=30)
        pm.stop().get(timeout=60)
        report({})
        """,
        env={"MONARCH_NB_LOG_MAX_LINE_BYTES": str(1 << 20)},
    )
    lines = [ln for ln in got["stdout"].splitlines() if ln.startswith("[0] ")]
    zs = [ln[len("[0] ") :] for ln in lines if ln.startswith("[0] z")]
    notes = [ln for ln in lines if "the line above was cut at " in ln and "(log_max_line_bytes)" in ln]
    # cut once a line reached 1 MiB (after the read that took it there), the rest whole; the
    # last piece is cut too if it reached the limit before its newline came
    assert sum(map(len, zs)) == 3 << 20 and 1 <= len(notes) and len(zs) - 1 <= len(notes) <= len(zs), [ln[:60] for ln in lines]
    assert all(1 << 20 <= len(z) < 2 << 20 for z in zs[: len(notes)]), [len(z) for z in zs]
    assert lines[-1] == "[0] end"


def test_a_huge_line_reaches_subscribers_before_the_log_file_and_the_file_keeps_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "rank-0.jsonl"

    async def run() -> list[str]:
        on_disk_at_emit: list[tuple[str, int]] = []

        def emit(lines: list[tuple[int, str, float, str, str]]) -> None:
            on_disk_at_emit.append((line_text(lines[0][4][:7]), len(path.read_text().splitlines())))

        log = ProcLog(str(path), 0, emit)
        _feed(log, b"small 1\n" + b"z" * (2 << 20) + b"\nsmall 2\n")
        for i in range(3, 50):  # while the huge line is on its way to the file (another thread)
            log.feed("stdout", b"small %d\n" % i)
        _feed(log, b"y" * (2 << 20) + b"\nlast\n")
        # the huge line went out while only the line before it was on disk
        assert on_disk_at_emit[:2] == [("small 1", 1), ("zzzzzzz", 1)]
        # a reader of the log (the allocator's ``logs`` request) sees every line taken so far
        assert [r["line"][:8] for r in read_log(str(path))][-3:] == ["small 49", "yyyyyyyy", "last"]
        _feed(log, b"w" * (2 << 20) + b"\n")
        t0 = time.monotonic()
        log.close()  # on the loop, before the writer got the line: written here, not waited for
        assert time.monotonic() - t0 < 1.0
        return [json.loads(x)["line"][:8] for x in path.read_text().splitlines()]

    assert asyncio.run(run()) == ["small 1", "zzzzzzzz", *(f"small {i}" for i in range(2, 50)), "yyyyyyyy", "last", "wwwwwwww"]


def test_megabytes_at_once_split_as_small_reads_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = [
        marker("a") + b"one\n",
        b"two " + marker("b") + b"three\n",
        marker("c") + b"\n",
        b"\n",
        "d\u00e9j\u00e0 vu\n".encode(),
        b"bar\r50%\r100%\n",
        b"p" * (1 << 20) + b"\n",
        marker("") + b"tail\rpartial",
    ]
    data = b"".join(parts)
    small: list[tuple[int, str, float, str, str]] = []
    whole: list[tuple[int, str, float, str, str]] = []
    a = ProcLog(str(tmp_path / "a.jsonl"), 0, _into(small))
    for p in parts[:-2]:
        a.feed("stdout", p)  # below the size that takes the megabytes path
    _feed(a, parts[-2] + parts[-1], 1000)
    b = ProcLog(str(tmp_path / "b.jsonl"), 0, _into(whole))
    b.feed("stdout", data)
    assert [(c, ln) for _, _, _, c, ln in whole] == [(c, ln) for _, _, _, c, ln in small]
    assert whole[-1][3:] == ("", "\rpartial")


class _Pipe(io.RawIOBase):
    """A raw stream that records each write (as a proc's stdout pipe would get them)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def,override]
        self.writes.append(bytes(b))
        return len(b)


def _coalescing() -> tuple[_Pipe, TaggedStream]:
    pipe = _Pipe()
    s = TaggedStream(io.BufferedWriter(pipe), encoding="utf-8", line_buffering=False)
    s._mnb_coalesce = True
    s._mnb_flusher = _Flusher(s)
    return pipe, s


def test_a_burst_of_prints_is_coalesced_into_few_writes_and_a_lone_line_still_goes_out() -> None:
    pipe, s = _coalescing()
    set_call("c1")
    try:
        print("first", file=s)
        # the first line of a call is out at once (C-level output after it keeps the call's tag)
        assert b"".join(pipe.writes) == marker("c1") + b"first\n"
        for i in range(10_000):
            print(f"line {i}", file=s)
        s.flush()  # what the end of a call does
        text = b"".join(pipe.writes).decode()
        assert text == "\x1b]mnb;call=c1\x07first\n" + "".join(f"line {i}\n" for i in range(10_000))
        assert len(pipe.writes) < 2_000, f"{len(pipe.writes)} writes for 10,001 lines"
        # a line left in the buffer, with nothing printed after it, goes out within a few ms
        n = len(pipe.writes)
        print("lone", file=s)
        print("lone 2", file=s)
        wait_for(lambda: b"".join(pipe.writes[n:]).endswith(b"lone 2\n"), 2.0, "the buffered line to be flushed")
    finally:
        set_call("")


def test_a_call_that_changes_in_a_burst_gets_its_marker_and_a_calls_end_marks_the_burst_over() -> None:
    pipe, s = _coalescing()
    s._mnb_flushed = time.monotonic() + 3600  # as if it had just written: the lines below are a burst
    set_call("c1")
    try:
        for i in range(3):
            print(f"a {i}", file=s)
        set_call("c2")  # the next call, in the middle of the burst
        for i in range(3):
            print(f"b {i}", file=s)
        n = len(pipe.writes)
        s.end_call()
        # what was left and the marker of no call, in one write
        assert len(pipe.writes) == n + 1 and pipe.writes[-1].endswith(b"b 2\n" + marker(""))
        text = b"".join(pipe.writes)
        assert text == marker("c1") + b"a 0\na 1\na 2\n" + marker("c2") + b"b 0\nb 1\nb 2\n" + marker("")
        s.end_call()  # a call that printed nothing: no write
        assert len(pipe.writes) == n + 1
    finally:
        set_call("")


def test_the_allocator_learns_that_a_burst_ended_from_the_proc_s_marker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ends: list[int] = []
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got), on_call_end=lambda _ids: ends.append(len(got)))
    log.feed("stdout", marker("c1") + b"x\ny\n")
    assert ends == []
    log.feed("stdout", b"z\n" + marker(""))  # the end of a call after its last line
    assert ends == [3]
    log.feed("stdout", marker("c2") + b"w\n")
    log.feed("stdout", marker(""))  # on its own, after the text went out
    assert ends == [3, 4]
    log.close()
    assert [(c, ln) for _, _, _, c, ln in got] == [("c1", "x"), ("c1", "y"), ("c1", "z"), ("c2", "w")]


def test_the_allocator_learns_which_call_ended_after_the_lines_it_printed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a script's controller completes a call that printed once its end came: the end must
    # follow every line of the call, wherever the allocator's reads cut the proc's writes
    ends: list[tuple[list[str], int]] = []
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got), on_call_end=lambda ids: ends.append((ids, len(got))))
    end = ended_marker
    log.feed("stdout", marker("c1") + b"x\ny\n" + end("c1") + marker(""))  # the end, read with the text
    assert ends == [(["c1"], 2)]
    log.feed("stdout", marker("c2") + b"open" + end("c2") + marker(""))  # a line the call left open
    assert ends[-1] == (["c2"], 3)
    log.feed("stdout", marker("c3") + b"a\n")
    log.feed("stdout", end("c3") + marker(""))  # on its own, after the text went out
    assert ends[-1] == (["c3"], 4)
    # read together with the next call's text (a busy allocator)
    log.feed("stdout", marker("c4") + b"b\n" + end("c4") + marker("") + marker("c5") + b"c\n")
    assert ends[-1] == (["c4"], 6)
    # a progress bar the call left drawn: its last state goes out before the call's end
    log.feed("stdout", marker("c6") + b"\rbar 1\rbar 2" + end("c6") + marker(""))
    assert ends[-1] == (["c6"], 7)
    log.close()
    assert len(ends) == 5  # each end passed on once
    assert [(c, ln) for _, _, _, c, ln in got] == [
        ("c1", "x"), ("c1", "y"), ("c2", "open"), ("c3", "a"), ("c4", "b"), ("c5", "c"), ("c6", "\rbar 2"),
    ]  # fmt: skip


def test_a_call_that_printed_to_both_streams_is_named_on_the_last_one_it_ended() -> None:
    out_pipe, out = _coalescing()
    err_pipe = _Pipe()
    err = TaggedStream(io.BufferedWriter(err_pipe), encoding="utf-8", line_buffering=True)
    saved = list(logcapture._tagged)
    logcapture._tagged[:] = [out, err]
    set_call("c1")
    try:
        print("to out", file=out)
        print("to err", file=err)
        assert logcapture.end_call("c1") is True
        assert b"".join(out_pipe.writes).endswith(b"to out\n" + marker(""))
        assert b"".join(err_pipe.writes).endswith(b"to err\n" + ended_marker("c1") + marker(""))
        assert logcapture.end_call("c2") is False  # printed nothing: no write
    finally:
        logcapture._tagged[:] = saved
        set_call("")


def _tags(data: bytes, tmp_path: Any) -> list[tuple[str, str]]:
    """(call, line) of what a proc wrote, as its allocator splits it."""
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got))
    log.feed("stdout", data)
    log.close()
    return [(c, ln) for _, _, _, c, ln in got]


def _take_turns(script: list[tuple[str, Callable[[], Any]]]) -> dict[str, list[Any]]:
    """Run each ``(who, step)`` of ``script`` in order, each on ``who``'s own thread (a call of
    its own, as two actors of one proc run theirs): what each step returned, by thread."""
    turn = threading.Condition()
    at = [0]
    out: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def run(me: str) -> None:
        try:
            while True:
                with turn:
                    turn.wait_for(lambda: at[0] >= len(script) or script[at[0]][0] == me, 10)
                    if at[0] >= len(script):
                        return
                    assert script[at[0]][0] == me, f"{me} waited for its turn at step {at[0]}"
                    out.setdefault(me, []).append(script[at[0]][1]())
                    at[0] += 1
                    turn.notify_all()
        except BaseException as e:
            errors.append(e)
            with turn:
                at[0] = len(script)
                turn.notify_all()

    threads = [threading.Thread(target=run, args=(w,)) for w in sorted({w for w, _ in script})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def test_two_calls_printing_at_once_from_two_threads_each_get_their_own_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # two actors of one proc mesh, called from two cells: the earlier call's lines printed after
    # the later one began went to the later one, and once the earlier one ended the later one's
    # lines were tagged with no call and its reply said it had printed nothing
    pipe, s = _coalescing()
    saved = list(logcapture._tagged)
    logcapture._tagged[:] = [s]

    def say(*texts: str) -> Callable[[], None]:
        return lambda: [print(t, file=s) for t in texts] and None

    def burst_alone() -> bool:
        # lines printed in a burst while another call runs: the C fast path (no markers) stays off
        s._mnb_flushed = time.monotonic()
        for i in range(50):
            print(f"a burst {i}", file=s)
        return "write" in s.__dict__

    try:
        out = _take_turns(
            [
                ("a", lambda: logcapture.begin_call("A")),
                ("a", say("a 1")),
                ("b", lambda: logcapture.begin_call("B")),
                ("b", say("b 1")),
                ("a", say("a 2")),
                ("a", burst_alone),
                ("b", say("b 2")),
                ("a", lambda: logcapture.end_call("A")),
                ("b", say("b 3")),
                ("b", lambda: logcapture.end_call("B")),
                ("a", lambda: logcapture.end_call("none")),  # nothing runs here any more
            ]
        )
    finally:
        logcapture._tagged[:] = saved
    assert out["a"][3] is False, "the fast path was on while another call ran"
    assert out["a"][4] is True and out["b"][4] is True, "each call printed, and its reply must say so"
    assert out["a"][5] is False
    data = b"".join(pipe.writes)
    assert data.count(ended_marker("A")) == 1 and data.count(ended_marker("B")) == 1
    assert data.index(ended_marker("A")) < data.index(b"b 3\n") < data.index(ended_marker("B"))
    burst = [("A", f"a burst {i}") for i in range(50)]
    assert _tags(data, tmp_path) == [("A", "a 1"), ("B", "b 1"), ("A", "a 2"), *burst, ("B", "b 2"), ("B", "b 3")]


def test_two_concurrent_calls_of_an_async_actor_each_get_their_own_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pipe, s = _coalescing()
    saved = list(logcapture._tagged)
    logcapture._tagged[:] = [s]
    printed: dict[str, bool] = {}

    async def run() -> None:
        began, a_said, b_said, a_done = (asyncio.Event() for _ in range(4))

        async def call_a() -> None:  # each call is a task of its own, as concurrent endpoints are
            logcapture.begin_call("A")
            print("a 1", file=s)
            began.set()
            await b_said.wait()
            print("a 2", file=s)
            a_said.set()
            printed["A"] = logcapture.end_call("A")
            a_done.set()

        async def call_b() -> None:
            logcapture.begin_call("B")
            await began.wait()
            print("b 1", file=s)
            b_said.set()
            await a_said.wait()
            print("b 2", file=s)
            await a_done.wait()
            print("b 3 after a ended", file=s)
            printed["B"] = logcapture.end_call("B")

        await asyncio.wait_for(asyncio.gather(call_a(), call_b()), 30)

    try:
        asyncio.run(run())
    finally:
        logcapture._tagged[:] = saved
    assert printed == {"A": True, "B": True}
    assert _tags(b"".join(pipe.writes), tmp_path) == [
        ("A", "a 1"), ("B", "b 1"), ("A", "a 2"), ("B", "b 2"), ("B", "b 3 after a ended"),
    ]  # fmt: skip


_TWO_CALLS_ACTORS = """
import asyncio, sys, threading
from monarch_nb.actor import concurrent_endpoint

def ev(name):
    # one proc's actors share it: two actors' threads take turns through these
    return sys.__dict__.setdefault("_test_evs", {}).setdefault(name, threading.Event())

class X(Actor):
    @endpoint
    def a(self):
        print("a 1")
        ev("a1").set()
        ev("b1").wait(60)
        print("a 2 after b began")
        ev("a2").set()
        ev("go").wait(60)
        print("a 3 after b ended")
        return "a"

class Y(Actor):
    @endpoint
    def b(self):
        ev("a1").wait(60)
        print("b 1")
        ev("b1").set()
        ev("a2").wait(60)
        print("b 2")
        return "b"

    @endpoint
    def go(self):
        ev("go").set()

class C(Actor):
    def __init__(self):
        self.evs = {}

    def ev(self, name):
        return self.evs.setdefault(name, asyncio.Event())

    @concurrent_endpoint
    async def first(self):
        print("f 1")
        self.ev("f1").set()
        await self.ev("s1").wait()
        print("f 2 after s began")
        self.ev("f2").set()
        await self.ev("go").wait()
        print("f 3 after s ended")
        return "f"

    @concurrent_endpoint
    async def second(self):
        await self.ev("f1").wait()
        print("s 1")
        self.ev("s1").set()
        await self.ev("f2").wait()
        print("s 2")
        return "s"

    @concurrent_endpoint
    async def go(self):
        self.ev("go").set()
"""


def _two_calls_in_a_script(
    tmp_path: Any, actors: str, names: tuple[str, str, str], third_goes: bool
) -> tuple[dict[str, list[str]], list[str]]:
    """A script: of three actors ``names`` of one proc (classes the upper-case names, from
    ``actors``), the first's ``a`` runs while the second's ``b`` runs and ends (the second's
    ``go`` lets ``a`` end); then the third's ``first`` while its ``second`` runs (and, if
    ``third_goes``, its ``go``). Returns the rank's lines by call (``%mesh logs``' records) and
    the script's output lines from the rank and its own ``got`` lines, in order."""
    import _ownctl

    x, y, z = names
    got = _ownctl.run(
        _ownctl.runtime_dir(tmp_path),
        actors
        + textwrap.dedent(
            f"""
        from monarch_nb.logs import logs
        pm = this_host().spawn_procs(per_host={{"gpus": 1}})
        {x}, {y}, {z} = pm.spawn("{x}", {x.upper()}), pm.spawn("{y}", {y.upper()}), pm.spawn("{z}", {z.upper()})
        fa = {x}.a.call_one()
        print("got", {y}.b.call_one().get(timeout=60), flush=True)
        {y}.go.call_one().get(timeout=30)
        print("got", fa.get(timeout=60), flush=True)
        ff = {z}.first.call_one()
        print("got", {z}.second.call_one().get(timeout=60), flush=True)
        {f"{z}.go.call_one().get(timeout=30)" if third_goes else ""}
        print("got", ff.get(timeout=60), flush=True)
        report({{"rows": [(r["call"], r["line"]) for r in logs(pm)]}})
        pm.stop().get(timeout=60)
        """
        ),
    )
    by_call: dict[str, list[str]] = {}
    for call, line in got["rows"]:
        by_call.setdefault(call, []).append(line)
    return by_call, [ln for ln in got["stdout"].splitlines() if ln.startswith(("[0] ", "got "))]


@pytest.mark.timeout(150)
def test_two_calls_running_at_once_in_one_proc_each_show_their_own_lines_in_a_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # two actors of one proc (two threads) and an async actor's two concurrent endpoints (two
    # tasks): each line goes with the call that printed it, also after the other call ended,
    # and each call's lines come before its value
    by_call, out = _two_calls_in_a_script(tmp_path, _TWO_CALLS_ACTORS, ("x", "y", "c"), third_goes=True)
    assert sorted(by_call.values()) == [
        ["a 1", "a 2 after b began", "a 3 after b ended"],
        ["b 1", "b 2"],
        ["f 1", "f 2 after s began", "f 3 after s ended"],
        ["s 1", "s 2"],
    ], by_call
    assert "" not in by_call
    assert out.index("[0] b 2") < out.index("got b") < out.index("[0] a 3 after b ended") < out.index("got a"), out
    assert out.index("[0] s 2") < out.index("got s") < out.index("[0] f 3 after s ended") < out.index("got f"), out


def _cell_text(k: Any, msg_id: str) -> str:
    """All a cell showed: its streams, and its displays as they ended up (late output)."""
    shown: dict[str, str] = {}
    text = ""
    for m in k.log:
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        c = m["content"]
        if m["msg_type"] == "stream":
            text += c["text"]
        elif m["msg_type"] in ("display_data", "update_display_data"):
            shown[c.get("transient", {}).get("display_id") or str(len(shown))] = c["data"].get("text/plain", "")
    return text + "\n".join(shown.values())


def _ok(k: Any, code: str) -> Any:
    """Run ``code`` in kernel ``k``; it must not raise."""
    c = k.run(code, timeout=90)
    assert c.error is None, "\n".join(c.error["traceback"])
    return c


def _three_cells(k: Any, actors: str, mesh: str, names: tuple[str, str], last: str) -> tuple[Any, Any, Any]:
    """In kernel ``k``: actors ``names`` (classes the upper-case names, from ``actors``) of one
    proc of mesh ``mesh``; a cell calls the first's ``a`` and ends while it runs on, a second
    calls the second's ``b``, a third lets both go on (the second's ``go``) and waits for ``a``.
    Returns the three cells, once the first cell's text ``last`` came."""

    x, y = names
    _ok(k, "from monarch_nb.actor import Actor, endpoint, this_host\n" + actors)
    spawn = f'{x}, {y} = pm.spawn("{x}", {x.upper()}), pm.spawn("{y}", {y.upper()})'
    _ok(k, f'pm = this_host().spawn_procs(per_host={{"gpus": 1}}, name="{mesh}")\n{spawn}')
    a = _ok(k, f"fa = {x}.a.call_one()")  # runs on after its cell ended
    b = _ok(k, f"{y}.b.call_one().get(timeout=60)")
    c = _ok(k, f"{y}.go.call_one().get(timeout=30)\nfa.get(timeout=60)")
    k.wait_msg(
        lambda m: m["parent_header"].get("msg_id") == a.msg_id and last in str(m["content"]),
        30,
        "the first cell's last line, in that cell",
    )
    return a, b, c


@pytest.mark.timeout(180)
def test_two_cells_calling_two_actors_of_one_proc_at_once_each_show_their_own_lines() -> None:
    from _kernel import Kernel

    k = Kernel()
    try:
        a, b, c = _three_cells(k, _TWO_CALLS_ACTORS, "twocells", ("x", "y"), "a 3 after b ended")
        first, second, third = (_cell_text(k, cell.msg_id) for cell in (a, b, c))
        assert all(t in first for t in ("a 1", "a 2 after b began", "a 3 after b ended")), first
        assert "b 1" in second and "b 2" in second and "a 2" not in second, second
        assert "b 1" not in first and "b 2" not in first and "a 3" not in third, (first, third)
        _ok(k, "pm.stop().get(timeout=60)")
    finally:
        k.close("twocells")


def test_a_line_a_call_left_open_ends_with_the_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # print(x, end="") at the end of a call was held until the rank's next newline
    ends: list[int] = []
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got), on_call_end=lambda _ids: ends.append(len(got)))
    log.feed("stdout", marker("c1") + b"no newline" + marker(""))  # what end_call writes after it
    assert [(c, ln) for _, _, _, c, ln in got] == [("c1", "no newline")] and ends == [1]
    log.feed("stdout", marker("c2") + b"done\nleft")
    log.feed("stdout", b" open")
    log.feed("stdout", marker(""))  # the text was flushed before the call ended
    assert [(c, ln) for _, _, _, c, ln in got[1:]] == [("c2", "done"), ("c2", "left open")] and ends == [1, 3]
    # a progress bar stays open (the next call redraws it), and a call that ends its line adds none
    log.feed("stdout", marker("c3") + b"\rbar 1\rbar 2" + marker(""))
    log.feed("stdout", marker("c4") + b"whole\n" + marker(""))
    log.close()
    rest = [ln for _, _, _, _, ln in got[3:]]
    assert len(rest) == 2 and rest[0].startswith("\r") and rest[0].endswith("bar 2") and rest[1] == "whole", rest


def test_a_call_that_ends_leaves_the_line_another_call_has_open_whole(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # two calls at once (an async actor's concurrent endpoints): B's print(x, end="") was cut in
    # two rows when A ended, A's end closing the open line that was B's
    ends: list[tuple[list[str], int]] = []
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got), on_call_end=lambda ids: ends.append((ids, len(got))))
    log.feed("stdout", marker("A") + b"a\n" + marker("B") + b"b partial")
    log.feed("stdout", ended_marker("A") + marker(""))  # A ends (it wrote here before B)
    assert ends == [(["A"], 1)]  # its end is passed on at once, not when B's line ends
    log.feed("stdout", marker("B") + b" rest\n")  # B goes on: its stream marks it anew
    # the same, A's end read together with what B writes next
    log.feed("stdout", marker("B") + b"c partial")
    log.feed("stdout", ended_marker("A2") + marker("") + marker("B") + b" rest\n")
    # C's own text ends with C; B's stays open (here until the proc ends)
    log.feed("stdout", marker("B") + b"b" + marker("C") + b"c open")
    log.feed("stdout", ended_marker("C") + marker(""))
    log.close()
    assert [(c, ln) for _, _, _, c, ln in got] == [
        ("A", "a"), ("B", "b partial rest"), ("B", "c partial rest"), ("C", "c open"), ("B", "b"),
    ]  # fmt: skip
    assert [ids for ids, _ in ends] == [["A"], ["A2"], ["C"]]


def test_two_calls_leaving_lines_open_at_once_each_get_their_own_whole_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # two actors of one proc (two threads), each printing a line in pieces
    # (print("step 3 ...", end="")), the other's text in between: each line was cut in two rows
    # (and a notebook showed "step 3 ..." and "done" as two lines), or glued to the other's
    pipe, s = _coalescing()
    saved = list(logcapture._tagged)
    logcapture._tagged[:] = [s]

    def say(text: str, end: str = "\n") -> Callable[[], None]:
        return lambda: print(text, end=end, file=s)

    try:
        _take_turns(
            [
                ("a", lambda: logcapture.begin_call("A")),
                ("a", say("a step 3 ...", end="")),
                ("b", lambda: logcapture.begin_call("B")),
                ("b", say("b partial", end="")),
                ("a", say("done")),
                ("b", say(" rest")),
                ("a", say("a open at its end", end="")),
                ("b", say("b open", end="")),
                ("a", lambda: logcapture.end_call("A")),
                ("b", say(" at its end", end="")),
                ("b", lambda: logcapture.end_call("B")),
            ]
        )
    finally:
        logcapture._tagged[:] = saved
    data = b"".join(pipe.writes)
    want = [("A", "a step 3 ...done"), ("B", "b partial rest"), ("A", "a open at its end"), ("B", "b open at its end")]
    for piece in (len(data), 7, 1):  # however the allocator's reads cut the pipe
        got: list[tuple[int, str, float, str, str]] = []
        path = tmp_path / f"r{piece}.jsonl"
        log = ProcLog(str(path), 0, _into(got))
        _feed(log, data, piece)
        log.close()
        assert [(c, ln) for _, _, _, c, ln in got] == want, piece
        assert [(r["call"], r["line"]) for r in read_log(str(path))] == want, piece  # %mesh logs


def test_a_line_left_open_on_a_stream_the_call_did_not_end_on_ends_with_the_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a call's end is named on the last stream it wrote to: its line left open on the other
    # stream, with another call's text after it, ends there too, whichever stream is read first
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got))
    log.feed("stdout", marker("A") + b"a out" + marker("B") + b"b")
    log.feed("stderr", marker("A") + b"a err\n" + ended_marker("A") + marker(""))
    log.feed("stderr", marker("C") + b"c err\n" + ended_marker("C") + marker(""))
    # C's text read after its end (the allocator read stderr first): whole, with that read
    log.feed("stdout", marker("C") + b"c out" + marker("B") + b" rest\n" + marker("C") + b" more" + marker("B") + b"b2\n")
    assert [(s, c, ln) for _, s, _, c, ln in got] == [
        ("stderr", "A", "a err"), ("stdout", "A", "a out"), ("stderr", "C", "c err"),
        ("stdout", "B", "b rest"), ("stdout", "B", "b2"), ("stdout", "C", "c out more"),
    ]  # fmt: skip
    log.close()


_OPEN_LINE_ACTORS = """
import asyncio, sys, threading
from monarch_nb.actor import concurrent_endpoint

def ev(name):
    return sys.__dict__.setdefault("_test_evs", {}).setdefault(name, threading.Event())

class P(Actor):
    @endpoint
    def a(self):
        print("a step 3 ...", end="", flush=True)
        ev("a1").set()
        ev("b1").wait(60)
        print("done")
        ev("a2").set()
        ev("go").wait(60)
        print("a left open", end="")
        return "a"

class Q(Actor):
    @endpoint
    def b(self):
        ev("a1").wait(60)
        print("b partial", end="", flush=True)
        ev("b1").set()
        ev("a2").wait(60)
        print(" b rest")
        return "b"

    @endpoint
    def go(self):
        ev("go").set()

class R(Actor):
    def __init__(self):
        self.evs = {}

    def ev(self, name):
        return self.evs.setdefault(name, asyncio.Event())

    @concurrent_endpoint
    async def first(self):
        print("f loading ...", end="", flush=True)
        self.ev("f1").set()
        await self.ev("s1").wait()
        print(" ok")
        return "f"

    @concurrent_endpoint
    async def second(self):
        await self.ev("f1").wait()
        print("s line")
        self.ev("s1").set()
        return "s"

class Bar(Actor):
    @endpoint
    def draw(self, stream, own_lines, tag):
        out = getattr(sys, stream)
        for i in range(3):
            out.write(f"\\rA {i}")
            out.flush()
            if own_lines:
                print(f"own {i}", flush=True)
            ev(f"{tag}bar{i}").set()
            ev(f"{tag}line{i}").wait(60)
        ev(f"{tag}go").wait(60)
        out.write("\\rA done\\n")
        return "bar"

class Lines(Actor):
    @endpoint
    def say(self, lines, tag):
        for i in range(3):
            ev(f"{tag}bar{i}").wait(60)
            if lines:
                print(f"line {i}", flush=True)
            ev(f"{tag}line{i}").set()

    @endpoint
    def go(self, tag):
        ev(f"{tag}go").set()
"""


@pytest.mark.timeout(150)
def test_lines_two_calls_in_one_proc_print_in_pieces_at_once_stay_whole_in_a_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # print("step 3 ...", end="") then "done" later, another call of the proc printing in
    # between (two actors' threads, an async actor's two tasks): each line was cut in two
    by_call, out = _two_calls_in_a_script(tmp_path, _OPEN_LINE_ACTORS, ("p", "q", "r"), third_goes=False)
    assert sorted(by_call.values()) == [
        ["a step 3 ...done", "a left open"], ["b partial b rest"], ["f loading ... ok"], ["s line"],
    ], by_call  # fmt: skip
    for line in ("[0] a step 3 ...done", "[0] b partial b rest", "[0] f loading ... ok", "[0] s line"):
        assert line in out, out
    assert out.index("[0] a left open") < out.index("got a"), out


@pytest.mark.timeout(180)
def test_lines_two_cells_print_in_pieces_at_once_stay_whole_in_their_cells_and_in_mesh_logs() -> None:
    from _kernel import Kernel

    k = Kernel()
    try:
        a, b, c = _three_cells(k, _OPEN_LINE_ACTORS, "openlines", ("p", "q"), "a left open")
        first, second, third = (_cell_text(k, cell.msg_id).splitlines() for cell in (a, b, c))
        assert "[0] a step 3 ...done" in first and "[0] a left open" in first, first
        assert "[0] b partial b rest" in second, second
        assert not any("b partial" in t for t in first + third) and not any("done" in t for t in second + third)
        shown = _ok(k, "%mesh logs openlines").stream().splitlines()
        for line in ("[0] a step 3 ...done", "[0] b partial b rest", "[0] a left open"):
            assert line in shown, shown
        _ok(k, "pm.stop().get(timeout=60)")
    finally:
        k.close("openlines")


def test_a_progress_bar_another_call_s_text_follows_in_the_same_read_still_shows_its_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # an actor drawing a bar while another actor of its proc prints: a state the other call's
    # text followed in one read was not passed on (the bar froze), and one read with a marker
    # cut in two showed the marker's first bytes
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got))
    log.feed("stdout", marker("A") + b"\rA 1" + marker("B") + b"line 1\n" + marker("A") + b"\rA 2" + marker("B") + b"li")
    log.feed("stdout", b"ne 2\n" + marker("A") + b"\rA 3" + marker("B")[:7])
    log.feed("stdout", marker("B")[7:] + b"line 3\n" + marker("A") + b"\rA 4\n")
    log.close()
    assert [(c, ln) for _, _, _, c, ln in got] == [
        ("A", "\rA 1"), ("B", "line 1"), ("A", "\rA 2"), ("B", "line 2"), ("A", "\rA 3"), ("B", "line 3"), ("A", "A 4"),
    ]  # fmt: skip


def _display_states(k: Any, msg_id: str) -> dict[str, list[str]]:
    """Each display of a cell (by id): the texts it showed, in order."""
    out: dict[str, list[str]] = {}
    for m in k.log:
        if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] in ("display_data", "update_display_data"):
            c = m["content"]
            out.setdefault(c.get("transient", {}).get("display_id", ""), []).append(c["data"].get("text/plain", ""))
    return out


@pytest.mark.timeout(180)
def test_a_progress_bar_stays_drawn_while_another_call_or_stream_of_its_rank_prints() -> None:
    # a line another call of the proc printed (or the rank printed on its other stream: tqdm on
    # stderr, a loss on stdout) was taken for the bar's end: the bar blanked at every such line
    from _kernel import Kernel

    k = Kernel()
    try:

        def ok(code: str) -> Any:
            c = k.run(code, timeout=90)
            assert c.error is None, "\n".join(c.error["traceback"])
            return c

        ok("from monarch_nb.actor import Actor, endpoint, this_host\n" + _OPEN_LINE_ACTORS)
        ok('pm = this_host().spawn_procs(per_host={"gpus": 1}, name="barlines")\nb, w = pm.spawn("b", Bar), pm.spawn("w", Lines)')
        # the other call's lines on the bar's stream; the bar's own call's lines on its other stream
        for stream, own_lines, tag in (("stdout", False, "calls"), ("stderr", True, "streams")):
            c = ok(
                f"fb = b.draw.call_one({stream!r}, {own_lines}, {tag!r})\nw.say.call_one({not own_lines}, {tag!r}).get(timeout=60)"
            )
            shown = "line" if not own_lines else "own"
            assert all(f"[0] {shown} {i}" in c.stream() for i in range(3)), c.stream()
            states = _display_states(k, c.msg_id)
            (bar,) = [texts for texts in states.values() if any(t.startswith("[0] A ") and not t.endswith(" …") for t in texts)]
            assert bar[-1] == "[0] A 2" and "" not in bar, (bar, states)
            ok(f"w.go.call_one({tag!r}).get(timeout=30)\nfb.get(timeout=60)")
            k.wait_msg(
                lambda m, c=c: m["parent_header"].get("msg_id") == c.msg_id and "[0] A done" in str(m["content"]),
                30,
                "the bar's last line, in its cell",
            )
        ok("pm.stop().get(timeout=60)")
    finally:
        k.close("barlines")


def test_an_empty_line_a_call_prints_first_is_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # print() as a call's first output (a separator, a blank line before a table) was dropped:
    # a line holding only the call's marker was taken for no line at all
    pipe, s = _coalescing()
    saved = list(logcapture._tagged)
    logcapture._tagged[:] = [s]
    try:
        logcapture.begin_call("c1")
        print(file=s)
        print("table", file=s)
        logcapture.end_call("c1")
        logcapture.begin_call("c2")
        print("\n", end="", file=s)
        logcapture.end_call("c2")
    finally:
        logcapture._tagged[:] = saved
        set_call("")
    got = _tags(b"".join(pipe.writes), tmp_path)
    assert got == [("c1", ""), ("c1", "table"), ("c2", "")], got


def test_a_forked_child_of_a_proc_still_gets_its_lines_flushed() -> None:
    r, w = os.pipe()
    s = TaggedStream(open(w, "wb", closefd=False), encoding="utf-8", line_buffering=False)
    s._mnb_coalesce = True
    s._mnb_flusher = _Flusher(s)
    pid = os.fork()
    if pid == 0:  # as a data loader's worker would: print, then keep working
        try:
            s._mnb_flushed = time.monotonic() + 3600  # as if it had just written: these lines wait in the buffer
            print("child 1", file=s)
            print("child 2", file=s)
            signal.pause()  # until the test kills it
        finally:
            os._exit(0)
    try:
        got = b""

        def both() -> bool:
            nonlocal got
            if select.select([r], [], [], 0.05)[0]:
                got += os.read(r, 4096)
            return got.endswith(b"child 2\n")

        wait_for(both, 5.0, "the child's buffered line")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def _record(ts: float, rank: int, stream: str, call: str, line: str) -> str:
    # the log file's format as every version wrote it, one line at a time
    enc = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
    return f'{{"ts": {ts!r}, "rank": {rank}, "stream": "{stream}", "call": {enc(call)}, "line": {enc(line)}}}\n'


def test_the_log_file_keeps_its_format_whatever_the_lines_hold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    texts = [
        "plain",
        "",
        'quo"te',
        "back\\slash then n: \\n",
        "tab\there, bell \x07, del \x7f",
        "d\u00e9j\u00e0 vu \u2603 \U0001f600",
        "bad utf-8: \udcff",
    ]
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "rank-2.jsonl"), 2, _into(got))
    # a flood's chunk with no backslash, one with, a progress bar, and huge lines JSON keeps
    # as they are and does not
    log.feed("stdout", marker("c9") + b"".join(t.encode("utf-8", "surrogateescape") + b"\n" for t in texts[:3]))
    log.feed("stdout", b"".join(t.encode("utf-8", "surrogateescape") + b"\n" for t in texts))
    log.feed("stdout", b"one\ntwo\nbar 10%\rbar 20%\n" + marker("") + b"x\rpartial")
    log.feed("stderr", b"y" * (3 << 20) + b"\n" + b'z"' * (1 << 19) + b"\n")
    log.feed("stderr", b"a" * (70 << 10) + b"\nb\n")
    # megabytes with one byte JSON escapes (a colour code, DEL, a control character at the end)
    log.feed("stderr", b"c" * (2 << 20) + b"\x1b[0m\n" + b"\x7f" + b"d" * (2 << 20) + b"\n" + b"e" * (2 << 20) + b"\x01\n")
    log.close()
    want = "".join(_record(ts, rank, stream, call, line_text(line)) for rank, stream, ts, call, line in got)
    assert (tmp_path / "rank-2.jsonl").read_bytes() == want.encode("ascii")
    assert [row[4] for row in got][:3] == texts[:3]
    assert [row[4] for row in got][3 : 3 + len(texts)] == [t.replace("\udcff", "\ufffd") for t in texts]
    assert {row[3] for row in got[:3]} == {"c9"}


def test_a_progress_bar_read_without_a_newline_is_its_current_state_not_a_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    got: list[tuple[int, str, float, str, str]] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 0, _into(got))
    log.feed("stdout", b"bar 10%\rbar 20%")
    log.feed("stdout", b"\rbar 30%\n")
    log.close()
    assert [ln for _, _, _, _, ln in got] == ["\rbar 20%", "bar 30%"]


def test_a_script_shows_a_batch_of_one_rank_as_it_shows_its_lines_one_by_one() -> None:
    from monarch_nb.actor._client import _one_rank_text

    lines = [(3, "stdout", 1.0, "c", t) for t in ["a", "", "d\u00e9j\u00e0", "x" * 5000, *map(str, range(20))]]
    assert _one_rank_text(lines) == "".join(f"[3] {t}\n" for *_, t in lines)
    # anything else takes the line-by-line way
    assert _one_rank_text([*lines, (4, "stdout", 1.0, "c", "other rank")]) is None
    assert _one_rank_text([*lines, (3, "stderr", 1.0, "c", "other stream")]) is None
    assert _one_rank_text([*lines, (3, "stdout", 1.0, "c", "\rprogress")]) is None
    assert _one_rank_text([*lines, (3, "stdout", 1.0, "c", b"huge")]) is None


def test_a_flood_s_chunk_is_one_run_of_lines_and_cuts_at_line_ends(tmp_path) -> None:  # type: ignore[no-untyped-def]
    items: list[Any] = []
    log = ProcLog(str(tmp_path / "r.jsonl"), 4, items.extend)
    log.feed("stdout", marker("c1") + b"first\n")
    texts = [f"line {i} d\u00e9j\u00e0" for i in range(3000)] + ["", "bar 1\rbar 2"]
    log.feed("stdout", "".join(t + "\n" for t in texts).encode())
    # one item for the whole chunk, not a tuple a line
    assert len(items) == 2 and items[1][:2] == (4, "stdout") and items[1][3] == "c1" and items[1][5] == len(texts)
    want = [*texts[:-1], "bar 2"]
    assert [ln for *_, ln in expand(items)][1:] == want
    assert log.nlines == 1 + len(texts) and [ln[4] for ln in log.tail] == want[-50:]
    # cut for the wire at line ends, nothing lost or reordered
    parts = split_run(items[1], 1000)
    assert all(len(p[4]) <= 1000 for p in parts) and len(parts) > 30
    assert [ln for *_, ln in expand(parts)] == want and sum(p[5] for p in parts) == len(texts)
    long = (0, "stdout", 1.0, "c", "a\n" + "b" * 3000 + "\nc", 3)
    assert [p[4] for p in split_run(long, 1000)] == ["a", "b" * 3000, "c"]
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == ["first", *want] and {r["call"] for r in rows} == {"c1"}


def test_a_script_shows_a_run_of_lines_as_it_shows_its_lines_one_by_one() -> None:
    from monarch_nb.actor._client import _one_rank_text, _plain_parts

    texts = ["a", "", "d\u00e9j\u00e0", "x" * 5000]
    items = [(3, "stdout", 1.0, "c", "one"), (3, "stdout", 1.0, "c", "\n".join(texts), 4), (3, "stderr", 1.0, "c", "e\nf", 2)]
    out, err, big = _plain_parts(items)
    assert "".join(map(str, out)) == "".join(f"[3] {t}\n" for t in ["one", *texts]) and err == ["[3] e\n[3] f\n"]
    assert not big
    runs = [(3, "stdout", 1.0, "c", "\n".join(texts), 4)] * 8
    assert _one_rank_text(runs) == "".join(f"[3] {t}\n" for t in texts * 8)


@pytest.mark.timeout(180)
def test_a_full_disk_loses_no_line_on_its_way_to_the_controller_and_the_log_notes_its_gap(small_disk: Any) -> None:
    # the runtime directory (rank logs included) on a disk that fills up: the lines a rank
    # prints meanwhile still reach the controller, and once there is room again the rank's log
    # says how many it misses before the lines that follow. Before, the allocator's failed write
    # dropped the rest of each batch on the way to the controller too (15,127 of 40,000 arrived)
    import _ownctl

    got = _ownctl.run(
        str(small_disk),
        """
        import glob
        from _ownctl import fill
        from monarch_nb._runtime.logcapture import read_log
        rdir = os.environ["MONARCH_NB_RUNTIME_DIR"]

        import threading

        class Seen:  # the rank lines this controller printed (it writes them through sys.stdout)
            def __init__(self, out):
                self.out, self.n, self.cond = out, 0, threading.Condition()

            def write(self, text):
                with self.cond:
                    self.n += text.count("] flooded ")
                    self.cond.notify_all()
                return self.out.write(text)

            def __getattr__(self, name):
                return getattr(self.out, name)

        sys.stdout = seen = Seen(sys.stdout)
        pm = this_host().spawn_procs(per_host={"gpus": 1}, name="full")
        a = pm.spawn("e", E)
        a.say.call_one("before").get(timeout=30)
        (path,) = glob.glob(os.path.join(rdir, "mnb-logs-*", "full", "rank-0.jsonl"))

        def on_disk(line):
            return any(r["line"] == line for r in read_log(path))

        wait_until(lambda: on_disk("before"), 20)  # on its way to the file still, maybe
        fill(os.path.join(rdir, "filler"))
        a.say.call_one("flooded {i:05d} " + "y" * 100, 20000).get(timeout=60)
        os.unlink(os.path.join(rdir, "filler"))
        a.say.call_one("after the gap").get(timeout=30)
        wait_until(lambda: on_disk("after the gap"), 20)
        with seen.cond:  # lines on their way to this controller still come
            seen.cond.wait_for(lambda: seen.n >= 20000, 30)
        report({"disk": [r["line"] for r in read_log(path)], "arrived": seen.n})
        pm.stop().get(timeout=60)
        """,
    )
    assert got["arrived"] == 20000, got["arrived"]  # every line, at the controller
    disk_lines = got["disk"]
    notes = [
        i
        for i, ln in enumerate(disk_lines)
        if ln.startswith("[monarch_nb: up to ") and "lines of this rank are missing here" in ln
    ]
    assert len(notes) == 1 and "No space left on device" in disk_lines[notes[0]], disk_lines[-5:]
    missing = int(disk_lines[notes[0]].split()[3])  # "[monarch_nb: up to N lines ..."
    flooded = [ln for ln in disk_lines if ln.startswith("flooded ")]
    # each line on disk once and in order, none made up; the note counts at least what is not
    written = [int(ln.split()[1]) for ln in flooded]
    assert written == sorted(set(written)) and all(ln == f"flooded {i:05d} " + "y" * 100 for i, ln in zip(written, flooded))
    assert 0 < missing and 20000 - missing <= len(written) < 20000, (missing, len(written))
    assert disk_lines[0] == "before" and disk_lines[-1] == "after the gap" and notes[0] < len(disk_lines) - 1


def test_a_tail_skips_a_record_a_full_disk_cut_short(tmp_path: Any) -> None:
    # ENOSPC leaves the rank's last record cut in half until there is room again: `logs(tail=1)`
    # (`%mesh logs --tail 1`, `monarch-nb logs --tail 1`) showed nothing though 3 lines were whole
    path = tmp_path / "rank-0.jsonl"
    rows = [json.dumps({"ts": 1.0, "rank": 0, "stream": "stdout", "call": "", "line": f"line {i}"}) for i in range(3)]
    path.write_text("".join(r + "\n" for r in rows) + rows[0][:20])
    assert [r["line"] for r in read_log(str(path), tail=1)] == ["line 2"]
    assert [r["line"] for r in read_log(str(path), tail=2)] == ["line 1", "line 2"]
    assert read_log(str(path), tail=0) == []
    # the writer goes on after a "\n" once it can: the cut record stays one bad row mid-file
    with open(path, "a") as f:
        f.write("\n" + rows[0].replace("line 0", "after") + "\n")
    assert [r["line"] for r in read_log(str(path), tail=2)] == ["line 2", "after"]
