"""How a grouped error lists its ranks' messages (the text a notebook shows for a 16-rank error)."""

from __future__ import annotations

import re

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


def test_numbers_after_a_hyphen_or_a_dot_merge_as_the_numbers_the_user_wrote() -> None:
    # a KeyError of f"shard-{rank}" on 16 ranks read as signed numbers: 'shard-15…-0'
    failures = {r: ("KeyError", f"'shard-{r}'", TB) for r in range(16)}
    text = str(ExecError(failures, 16, "train"))
    assert "  ranks 0-15: KeyError: 'shard-0…15'" in text, text
    failures = {r: ("KeyError", f"'layer.{r}.weight'", TB) for r in range(8)}
    text = str(ExecError(failures, 8, "train"))
    assert "  ranks 0-7: KeyError: 'layer.0…7.weight'" in text, text
    # a sign after "=" or a space is still a sign
    failures = {r: ("ValueError", f"loss=-{r}.5 is negative", TB) for r in range(8)}
    assert "  ranks 0-7: ValueError: loss=-7.5…-0.5 is negative" in str(ExecError(failures, 8)), str(ExecError(failures, 8))


def test_a_few_messages_keep_a_line_each() -> None:
    failures = {r: ("KeyError", f"'shard {r}'", TB) for r in (0, 4, 8)}
    lines = _errgroup.group_lines(_errgroup.group((r, *f) for r, f in failures.items()))
    assert [ln for ln in lines if ln.startswith("  rank")] == [
        "  rank 0: KeyError: 'shard 0'",
        "  rank 4: KeyError: 'shard 4'",
        "  rank 8: KeyError: 'shard 8'",
    ]


def test_an_spmd_script_error_says_the_ranks_left_running_wait_and_shows_its_syntax_error_once() -> None:
    """What a notebook shows for ``spmd.main.call(...)``: a rank that raised while the others wait
    for it in a collective says that their actors take no other call until then (a cell run again
    waited for gloo's 30 minutes without a word); a script's SyntaxError on every rank showed its
    last line twice, once from the traceback and once from ``str()`` ("(train.py, line 1)")."""
    from monarch_nb.errors import ActorError

    tb = 'Traceback (most recent call last):\n  File "train.py", line 16, in <module>\nRuntimeError: NaN loss\n'
    raised = ActorError(RuntimeError("NaN loss"), tb, rank=2)
    e = ActorError(RuntimeError("NaN loss"), tb, rank=2)._set_group("_SPMDActor.main", 4, {2: raised}, [0, 1, 3])
    assert (
        "ranks 0-1,3 (3 of 4) were still running when this was raised; their actors take their next "
        "calls once it returns (stopping the proc mesh ends it)"
    ) in e.grouped_text().splitlines(), e.grouped_text()

    tb = (
        'Traceback (most recent call last):\n  File "<frozen runpy>", line 259, in _get_code_from_file\n'
        '  File "/w/train.py", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax\n'
    )
    errs = {r: ActorError(SyntaxError("invalid syntax", ("/w/train.py", 1, 7, "def f(:\n")), tb, rank=r) for r in range(4)}
    text = ActorError(errs[0].exception, tb, rank=0)._set_group("_SPMDActor.main", 4, errs).grouped_text()
    assert "SyntaxError on 4 of 4 ranks: 0-3" in text, text
    assert text.count("SyntaxError: invalid syntax") == 1, text


def test_a_script_s_error_names_the_ranks_that_failed_under_monarch_s_headline() -> None:
    """``str()`` of a call that failed on ranks 0-3 and 7 of 8 (what a plain script prints, uncaught
    or logged) showed rank 0's traceback alone: nothing said seven other ranks were called, nor
    which of them failed. The notebook's grouped view said it; the script's text now says it in
    the same words, under Monarch's unchanged first line, with the lowest rank's traceback."""
    from monarch_nb.errors import ActorError

    def tb(r: int) -> str:
        return f'Traceback (most recent call last):\n  File "train.py", line 9, in boom\nValueError: bad shard {r}\n'

    errs = {r: ActorError(ValueError(f"bad shard {r}"), tb(r), message="Actor call w.boom failed.") for r in (0, 1, 2, 3, 7)}
    e = ActorError(errs[0].exception, tb(0), rank=0, message="Actor call w.boom failed.")._set_group("w.boom", 8, errs, [5])
    lines = str(e).splitlines()
    assert lines[:4] == [
        "Actor call w.boom failed.",
        "ValueError on 5 of 8 ranks: 0-3,7",
        "rank 5 (1 of 8) was still running when this was raised; its actor takes its next calls once it returns"
        " (stopping the proc mesh ends it)",
        "the traceback below is rank 0's; .grouped_text() shows every rank's",
    ], str(e)
    assert lines[4] == " Traceback of where the remote call failed (most recent call last):", str(e)
    assert lines[-1] == "ValueError: bad shard 0", str(e)
    # the same words as the notebook's grouped view
    assert e.grouped_text().splitlines()[1:3] == lines[1:3]

    # one rank of one: Monarch's text, unchanged
    one = ActorError(errs[3].exception, tb(3), message="Actor call w.boom failed.")._set_group("w.boom", 1, {0: errs[3]})
    assert str(one).splitlines()[:2] == [
        "Actor call w.boom failed.",
        " Traceback of where the remote call failed (most recent call last):",
    ]


def test_a_16_rank_spmd_failure_shows_the_failed_rank_s_traceback_and_one_line_for_those_waiting_for_it() -> None:
    """Rank 1's script raised while the 15 others waited for it in DDP's backward: a notebook
    showed, under rank 1's traceback, the 15 survivors' ~25 lines of torch frames ending in gloo's
    "Connection closed by peer" and a list of 15 messages differing only in a port, and ``str()``
    counted them with rank 1 ("RuntimeError on 16 of 16 ranks"). Now they are one line, saying
    whom they waited for, and their tracebacks are one call away."""
    from monarch_nb.errors import PEER_GONE_MARK, ActorError

    head = 'Traceback (most recent call last):\n  File "/w/train.py", line 20, in <module>\n    main()\n'
    own_tb = head + '  File "/w/train.py", line 14, in main\n    raise RuntimeError("NaN loss")\nRuntimeError: NaN loss\n'
    torch_frames = "".join(
        f'  File "/venv/torch/nn/parallel/distributed.py", line {1700 + i}, in _pre_forward\n    step{i}()\n' for i in range(10)
    )

    def gloo(r: int) -> str:
        return (
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            f"[127.0.0.1]:{38000 + r}. This is typically caused by a remote worker crashing. GLHF!"
        )

    def survivor(r: int) -> ActorError:
        exc = RuntimeError(gloo(r))
        exc.__dict__[PEER_GONE_MARK] = True
        tb = f'{head}  File "/w/train.py", line 15, in main\n    loss.backward()\n{torch_frames}RuntimeError: {gloo(r)}\n'
        return ActorError(exc, tb, message="Actor call _SPMDActor.main failed.")

    errs = {r: survivor(r) for r in range(16) if r != 1}
    errs[1] = ActorError(RuntimeError("NaN loss"), own_tb, message="Actor call _SPMDActor.main failed.")
    e = errs[1]._set_group("_SPMDActor.main", 16, errs)
    one_line = "ranks 0,2-15 (15 of 16): RuntimeError: [gloo] Connection closed by peer … (waiting for rank 1 in a collective)"
    shown = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in e._render_traceback_()]
    assert shown[1:4] == [
        "RuntimeError on 1 of 16 ranks: 1",
        one_line,
        "print(sys.last_value.grouped_text()) shows their tracebacks too",
    ], shown
    assert "--- rank 1: RuntimeError" in shown and shown[-1] == "RuntimeError: NaN loss", shown
    assert not any("distributed.py" in ln or "pair.cc" in ln for ln in shown) and len(shown) < 20, shown
    # a script's text says it in the same words, with rank 1's traceback
    text = str(e)
    assert text.splitlines()[1:3] == shown[1:3] and text.rstrip().endswith("RuntimeError: NaN loss"), text
    # and the dashboard's line of the error
    assert e._rank_summary() == shown[1:3], e._rank_summary()
    # the whole: every rank's traceback
    whole = e.grouped_text()
    assert one_line in whole and "--- ranks 0,2-15: RuntimeError" in whole and whole.count("distributed.py") == 10, whole


def test_a_mesh_exec_cell_s_ranks_failing_only_waiting_for_the_failed_rank_are_one_line_each() -> None:
    """A cell pasted from a training script (``try: train() finally: dist.destroy_process_group()``)
    raised on rank 1 and closed its group, so ranks 0 and 3, waiting for it in DDP's forward,
    failed with gloo's "Connection closed by peer": their ~20 lines of torch frames came first
    (the larger group), rank 1's error that says why last, and all three counted alike."""
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:14504. This is typically caused by a remote worker crashing. GLHF!"
    )
    frames = "".join(
        f'  File "/venv/torch/nn/parallel/distributed.py", line {1700 + i}, in forward\n    f{i}()\n' for i in range(8)
    )
    waited = f'Traceback (most recent call last):\n  File "<mesh exec 2>", line 4, in <module>\n{frames}RuntimeError: {gloo}\n'
    own = 'Traceback (most recent call last):\n  File "<mesh exec 2>", line 3, in <module>\nRuntimeError: diverged\n'
    failures = {0: ("RuntimeError", gloo, waited), 1: ("RuntimeError", "diverged", own), 3: ("RuntimeError", gloo, waited)}
    e = ExecError(failures, 4, "train", running=[2])
    one_line = "ranks 0,3 (2 of 4): RuntimeError: [gloo] Connection closed by peer … (waiting for rank 1 in a collective)"
    shown = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in e._render_traceback_()]
    assert shown[1:4] == [
        "RuntimeError on 1 of 4 ranks: 1",
        one_line,
        "print(sys.last_value) shows their tracebacks too",
    ], shown
    assert "--- rank 1: RuntimeError" in shown and shown[-1] == "RuntimeError: diverged", shown
    assert not any("distributed.py" in ln or "pair.cc" in ln for ln in shown), shown
    # str(): the same lines, rank 1's traceback first, then theirs
    text = str(e)
    assert text.splitlines()[1:3] == shown[1:3], text
    assert e._rank_summary() == shown[1:3], e._rank_summary()
    assert text.index("--- rank 1: RuntimeError") < text.index("--- ranks 0,3: RuntimeError") and "distributed.py" in text, text
    # a cell failing with gloo's error alone (a rank whose process died) shows it as before
    alone = str(ExecError({r: ("RuntimeError", gloo, waited) for r in (0, 3)}, 4, "train"))
    assert "RuntimeError on 2 of 4 ranks: 0,3" in alone and "waiting for" not in alone, alone
    # nor a socket's error of the same words beside another rank's
    sock = {0: ("ConnectionResetError", "[Errno 104] Connection reset by peer", own), 1: ("RuntimeError", "diverged", own)}
    assert "waiting for" not in str(ExecError(sock, 2, "train")), str(ExecError(sock, 2, "train"))


def test_one_rule_tells_a_rank_that_failed_only_because_a_collective_peer_went_away() -> None:
    """SPMDActor (which has the exception) and ExecError (which has its type's name, all a cell's
    failure brings back) each had a copy of this rule; both ask errors.peer_gone now."""
    from monarch_nb.errors import peer_gone

    gloo = "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14504. This is typically caused by ..."

    class DistBackendError(RuntimeError):  # torch's, in later versions
        pass

    assert peer_gone(RuntimeError, gloo) and peer_gone(DistBackendError, gloo)
    assert peer_gone("RuntimeError", gloo) and peer_gone("torch.distributed.DistBackendError", gloo)
    # a socket's own error in the same words, and torch's error in others, are not
    sock = "[Errno 104] Connection reset by peer"
    assert not peer_gone(ConnectionResetError, sock) and not peer_gone("ConnectionResetError", sock)
    assert not peer_gone(RuntimeError, "diverged") and not peer_gone("RuntimeError", "diverged")


def test_a_long_message_of_many_lines_is_shown_once_shortened_with_where_the_whole_is() -> None:
    """A 10 KB message spanning many lines (a config dump, a tensor's repr) was shown twice in the
    cell, all of it each time: its traceback ends with the message's last line only, which did not
    match the exception's text, so the view added "ValueError: <message>" again below it."""
    from monarch_nb.errors import ActorError

    msg = "bad config:\n" + "".join(f"  key{i} = {'v' * 40}\n" for i in range(200)) + "end of config"
    tb = f'Traceback (most recent call last):\n  File "train.py", line 9, in boom\nValueError: {msg}\n'

    def err(total: int) -> ActorError:
        errs = {r: ActorError(ValueError(msg), tb, message="Actor call w.boom failed.") for r in range(total)}
        return ActorError(errs[0].exception, tb, rank=0, message="Actor call w.boom failed.")._set_group("w.boom", total, errs)

    for total in (1, 4):
        e = err(total)
        shown = "\n".join(e._render_traceback_())
        assert shown.count("bad config:") == 1 and shown.count("key0 =") == 1, shown
        assert "end of config" not in shown and len(shown) < 3000, shown  # shortened, with where the rest is
        assert (
            f"… (the message is {len(msg):,} characters, 202 lines; print(sys.last_value.grouped_text()) shows all of it)"
            in shown
        )
        # the text keeps all of it, once
        whole = e.grouped_text()
        assert whole.count("bad config:") == 1 and whole.count("end of config") == 1, whole
        assert str(e).count("end of config") == 1, str(e)

    # a single line of 10 KB: its head, then how long it was
    tb = 'Traceback (most recent call last):\n  File "train.py", line 9, in boom\nValueError: ' + "x" * 10_000 + "\n"
    shown = "\n".join(ActorError(ValueError("x" * 10_000), tb)._render_traceback_())
    assert "x" * _errgroup.SHOWN_CHARS in shown and "x" * 3000 not in shown, len(shown)
    assert "(the message is 10,000 characters; print(sys.last_value) shows all of it)" in shown, shown[-300:]
    assert len(shown.splitlines()[0]) < 400, shown  # the headline: only its start (the traceback ends with it)

    # a notebook cell's frame (as clean_traceback names it) ends the frames as a file's does
    cell = "Traceback (most recent call last):\n  Cell In[5], line 3, in boom\n    raise ValueError(s)\nValueError: " + "x" * 3000
    assert _errgroup.shorten_message(cell, "hint").endswith("\n… (the message is 3,000 characters; hint)")

    # %%mesh exec: shortened in the cell, whole in str()
    failures = {r: ("ValueError", msg, tb) for r in range(2)}
    shown = "\n".join(ExecError(failures, 2, "train")._render_traceback_())
    assert "print(sys.last_value) shows all of it" in shown and len(shown) < 3000, shown
    assert "x" * 10_000 in str(ExecError(failures, 2, "train"))


def test_a_long_supervision_error_and_unhandled_notice_are_shortened_in_a_notebook(monkeypatch) -> None:
    """An actor whose ``__init__`` or broadcast endpoint raised a 10 KB message: the cell's
    SupervisionError and the "unhandled mesh failure" notice printed all 10 KB (their traceback
    is indented inside the message, which shorten_message did not look into). They are shortened
    as an ActorError is, and say where the whole text is."""
    from types import SimpleNamespace

    from monarch_nb.actor import _context, _supervision, unhandled_failures
    from monarch_nb.actor._supervision import MeshFailure
    from monarch_nb.errors import SupervisionError

    event = (
        "Supervision event: actor <root>.<__main__.B b{'gpus': 0/1}> failed:\n"
        "  actor explicitly aborted due to: Traceback (most recent call last):\n"
        '    File "train.py", line 8, in __init__\n'
        '      raise ValueError("y" * 10000)\n'
        "  ValueError: " + "y" * 10_000
    )
    e = SupervisionError(event, message=f"Endpoint call b.f() failed, {event}")
    shown = "\n".join(e._render_traceback_())
    assert 'raise ValueError("y" * 10000)' in shown and "y" * _errgroup.SHOWN_CHARS in shown, shown
    assert "y" * 3000 not in shown and shown.rstrip().endswith(
        "… (the message is 10,000 characters; print(sys.last_value) shows all of it)"
    ), shown[-300:]
    assert "y" * 10_000 in str(e)  # str() keeps all of it

    notices: list[str] = []
    client = SimpleNamespace(notice=lambda text, mesh, rank: notices.append(text))
    monkeypatch.setattr(_context, "_client", client)
    monkeypatch.setattr(_context, "client", lambda: client)
    monkeypatch.setattr(_context, "in_ipython_kernel", lambda: True)
    _supervision.unhandled_fault_hook(MeshFailure("b", None, e, crashed_ranks=[0], event=event))
    (notice,) = notices
    n = _supervision._hook_calls
    assert notice.startswith("monarch_nb: unhandled mesh failure: mesh 'b' failed:") and len(notice) < 3000, notice
    assert notice.endswith(
        f"… (the message is 10,000 characters; print(monarch_nb.actor.unhandled_failures[{n}]) shows all of it)"
    ), notice[-300:]
    assert "y" * 10_000 in unhandled_failures[n]
