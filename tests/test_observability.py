"""What a notebook shows of a cluster: grouped errors from many ranks, output in order,
print-only cells, displays shaped like the mesh. Through a real kernel (jupyter_client)."""

from __future__ import annotations

import os
import re

import _gate
import pytest
from conftest import wait_for

from tests._kernel import Kernel


@pytest.fixture(scope="module")
def k():  # type: ignore[no-untyped-def]
    kern = Kernel()
    try:
        c = kern.run("%mesh connect")
        assert "connected to 1 host" in c.stream(), c.msgs
        c = kern.run("%mesh spawn obs --per-host gpus=16", timeout=120)
        assert c.error is None, c.error
        yield kern
        kern.run("%mesh stop --all", timeout=60)
    finally:
        kern.close()


def _ok(c):  # type: ignore[no-untyped-def]
    assert c.error is None, "\n".join(c.error["traceback"]) if c.error else ""
    return c


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tb(c) -> str:  # type: ignore[no-untyped-def]
    assert c.error is not None, c.msgs
    return _ANSI.sub("", "\n".join(c.error["traceback"]))


ACTOR = """\
import os, select
from monarch_nb.actor import Actor, endpoint, current_rank

class Worker(Actor):
    @endpoint
    def lookup(self, slow=-1, flag=""):
        r = current_rank().rank
        if r == slow:
            # still running when the others have failed, until the test opens the gate at flag
            gate = os.open(flag, os.O_RDONLY | os.O_NONBLOCK)
            select.select([gate], [], [], 30)
            os.close(gate)
        if r % 4 == 0:
            raise KeyError(f"shard {r}")
        return r

    @endpoint
    def train(self, steps):
        r = current_rank().rank
        for s in range(steps):
            print(f"step {s} loss={(steps - s) * 0.02 + r * 0.001:.3f}")

    @endpoint
    def hello(self):
        print("hello from", current_rank().rank)
        return current_rank().rank * 10

workers = obs.spawn("workers", Worker)
"""


@pytest.fixture(scope="module")
def workers(k: Kernel) -> str:
    _ok(k.run(ACTOR, timeout=120))
    return "workers"


def test_an_error_on_4_of_16_ranks_is_grouped_under_monarch_s_headline(k: Kernel, workers: str, gate) -> None:  # type: ignore[no-untyped-def]
    flag = gate("release")
    c = k.run(f"workers.lookup.call(slow=5, flag={flag.path!r}).get()")
    tb = _tb(c)
    assert c.error["ename"] == "ActorError"
    lines = tb.splitlines()
    assert lines[0] == "ActorError: Actor call workers.lookup failed.", tb
    assert lines[1] == "KeyError on 4 of 16 ranks: 0,4,8,12", tb
    assert "rank 5 (1 of 16) was still running when this was raised" in tb
    # one traceback for the four ranks, their messages listed
    assert tb.count("Traceback of where the remote call failed") == 1, tb
    assert "--- ranks 0,4,8,12: KeyError" in tb
    for r in (0, 4, 8, 12):
        assert f"rank {r}: KeyError: 'shard {r}'" in tb
    # the frame in the notebook cell reads as IPython names cells, with its source line;
    # no runtime frame of monarch_nb, no /tmp/ipykernel_ file
    cell_no = re.search(r"Cell In\[(\d+)\], line 14, in lookup", tb)
    assert cell_no, tb
    assert 'raise KeyError(f"shard {r}")' in tb
    assert "monarch_nb" not in tb and "ipykernel_" not in tb and "_call_sync" not in tb, tb
    # rank 5 finishes its call: later calls need not wait behind it
    flag.open()
    # the value a program catches is still Monarch's: the lowest rank's ActorError
    c = _ok(
        k.run(
            "from monarch_nb.actor import ActorError\n"
            "try:\n    workers.lookup.call().get()\nexcept ActorError as e:\n    err = e\n"
            "(type(err.exception).__name__, str(err.exception), err.rank)"
        )
    )
    assert c.result == "('KeyError', \"'shard 0'\", 0)"


def test_runtime_frames_show_when_configured(k: Kernel, workers: str) -> None:
    c = k.run(
        "import monarch_nb.config as C\nwith C.configured(traceback_internal_frames=True):\n"
        "    try:\n        workers.lookup.call().get()\n    except Exception as e:\n        text = str(e)\n"
        "'monarch_nb/actor/' in text, 'Cell In[' in text"
    )
    assert _ok(c).result == "(True, True)"


def test_exec_errors_group_alike_ranks_and_name_the_cell(k: Kernel) -> None:
    c = k.run(
        "%%mesh exec obs\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank\nassert r % 2 == 0, f'odd rank {r}'"
    )
    tb = _tb(c)
    assert c.error["ename"] == "ExecError"
    assert "failed on 8 of 16 ranks" in tb and "AssertionError on 8 of 16 ranks: 1,3,5,7,9,11,13,15" in tb
    # eight messages that differ only in their number are one line, as rank output is
    assert tb.count("--- ranks") == 1 and "messages (8 distinct):" in tb, tb
    assert "  ranks 1,3,5,7,9,11,13,15: AssertionError: odd rank 1…15" in tb, tb
    count = c.reply["content"]["execution_count"]
    # line 4 of the cell (the magic is line 1)
    assert f"Cell In[{count}], line 4" in tb and "assert r % 2 == 0" in tb, tb
    assert "<mesh exec" not in tb


def test_training_output_keeps_its_order_aggregated_across_ranks(k: Kernel, workers: str) -> None:
    c = _ok(k.run("workers.train.call(8).get();"))
    lines = [ln for ln in c.stream().splitlines() if "step" in ln]
    assert len(lines) == 8, c.stream()
    for s, ln in enumerate(lines):
        lo, hi = (8 - s) * 0.02, (8 - s) * 0.02 + 0.015
        assert ln == f"[ranks 0-15 ×16] step {s} loss={lo:.3f}…{hi:.3f}", ln


def test_output_of_a_short_call_appears_above_its_value(k: Kernel, workers: str) -> None:
    c = _ok(k.run("workers.hello.call().get()"))
    kinds = [m["msg_type"] for m in c.msgs if m["msg_type"] in ("stream", "execute_result")]
    assert "execute_result" in kinds and "stream" in kinds, c.msgs
    assert kinds.index("stream") < kinds.index("execute_result"), kinds
    assert "[ranks 0-15 ×16] hello from 0…15" in c.stream()


def test_print_only_cells_show_no_value_mesh_of_nones(k: Kernel, workers: str) -> None:
    c = _ok(k.run("%%mesh exec obs\nprint('only printing')"))
    assert "only printing" in c.stream()
    assert not [m for m in c.msgs if m["msg_type"] == "execute_result"], c.msgs
    c = _ok(k.run("workers.train.call(1).get()"))
    assert not [m for m in c.msgs if m["msg_type"] == "execute_result"], c.msgs
    # the value is still a ValueMesh
    assert _ok(k.run("type(_).__name__, len(_.values()), set(_.values())")).result == "('ValueMesh', 16, {None})"


def test_a_failing_init_shows_the_user_s_error_and_its_traceback_once(k: Kernel) -> None:
    # spawn returns at once (as Monarch's); the first call fails with SupervisionError, whose
    # text carries the user's error and its remote traceback once. On procs of its own: a proc
    # where an actor failed takes no new actors (as Monarch's), and obs is shared
    _ok(k.run("from monarch_nb.actor import this_host\ninitbad = this_host().spawn_procs(per_host={'gpus': 1})"))
    code = (
        "from monarch_nb.actor import Actor, endpoint\n"
        "class Bad(Actor):\n"
        "    def __init__(self):\n"
        "        raise ValueError('no config file')\n"
        "    @endpoint\n"
        "    def ping(self):\n"
        "        return 1\n"
        "bad = initbad.spawn('bad', Bad)\n"
        "bad.ping.call().get(timeout=30)"
    )
    c = k.run(code)
    tb = _tb(c)
    assert c.error is not None and c.error["ename"] == "SupervisionError", c.error
    assert tb.count("ValueError: no config file") == 1 and tb.count("line 4, in __init__") == 1, tb
    # the frame reads as IPython names cells, with its source; no runtime frame
    count = c.reply["content"]["execution_count"]
    assert f"Cell In[{count}], line 4, in __init__" in tb and "raise ValueError('no config file')" in tb, tb
    assert "monarch_nb/" not in tb and "ipykernel_" not in tb, tb
    _ok(k.run("initbad.stop().get(timeout=30)"))


HANG = """\
from monarch_nb.actor import Actor, endpoint, current_rank
from monarch_nb.spmd import setup_env_for_distributed

class Hang(Actor):
    @endpoint
    def reduce(self):
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if current_rank().rank == 3:
            return "never joins"
        t = torch.ones(4)
        dist.all_reduce(t)
        return float(t.sum())

    @endpoint
    def hold_gil(self, seconds, told):
        import ctypes, os
        fd = os.open(told, os.O_WRONLY | os.O_NONBLOCK)  # the test's gate: it waits for this
        os.write(fd, b"g")
        os.close(fd)
        ctypes.PyDLL(None).sleep(seconds)  # a C call that keeps the GIL

setup_env_for_distributed(hung)
hangs = hung.spawn("hangs", Hang)
pending = hangs.reduce.call()
from monarch_nb import debug
import time
t = time.monotonic()
while time.monotonic() - t < 60:
    s = debug.stacks(hung, "0-2")
    if "all_reduce" in str(s) and len(s.root.children) > 0:
        break
    time.sleep(0.2)
"""


def _html(c) -> str:  # type: ignore[no-untyped-def]
    for m in c.msgs:
        if m["msg_type"] in ("execute_result", "display_data") and "text/html" in m["content"]["data"]:
            return m["content"]["data"]["text/html"]
    raise AssertionError(f"no HTML output: {c.msgs}")


def test_stacks_of_a_hung_collective_merge_the_waiting_ranks(k: Kernel, gate) -> None:  # type: ignore[no-untyped-def]
    _ok(k.run("%mesh spawn hung --per-host gpus=4", timeout=120))
    try:
        _ok(k.run(HANG, timeout=90))
        c = _ok(k.run("%mesh stacks hung --timeout 10", timeout=60))
        text = c.result
        # three ranks blocked in the all-reduce: one stack, their rank set; the fourth returned
        m = re.search(r"\[ranks 0-2 \(3\)\]\n((?:      .*\n)+)", text + "\n")
        assert m, text
        block = m.group(1)
        assert "reduce (Cell In[" in block and "dist.all_reduce(t)" in block and "all_reduce (" in block, block
        assert re.search(r"\[rank 3\]\n\s+\(only monarch_nb frames: waiting for work\)", text), text
        assert "_actor.py" not in text and "no answer" not in text
        html = _html(c)
        assert '<details open class="mnb-stack-node" data-ranks="0-2">' in html and "all_reduce" in html
        # --ranks picks some; --native adds py-spy's native frames (the wait inside gloo)
        c = _ok(k.run("%mesh stacks hung --ranks 0-1 --native --timeout 10", timeout=60))
        assert "[ranks 0-1 (2)]" in c.result and "rank 2" not in c.result.split("thread")[0]
        assert "native stack of ranks 0-1 (2) (py-spy)" in c.result and "c10d::Work::wait" in c.result, c.result
        # a rank whose I/O thread cannot get the GIL is shown as such, within the deadline
        holding = gate("holding")
        _ok(k.run(f"held = hangs.slice(gpus=3).hold_gil.call_one(4, {holding.path!r})"))
        assert _gate.wait(holding.path, 30), "rank 3 never started to hold the GIL"
        c = _ok(k.run("%mesh stacks hung --ranks 3 --native --timeout 1", timeout=30))
        assert "rank 3 (" in c.result and "no answer within 1 s: its I/O thread could not get the GIL" in c.result
        assert "native stack of rank 3 (py-spy)" in c.result and "hold_gil" in c.result, c.result
        _ok(k.run("held.get(timeout=30)"))
        # a variable holding a mesh spawned through the Python API works too
        c = _ok(k.run("%mesh stacks hangs --ranks 0-2 --timeout 10", timeout=60))
        assert "[ranks 0-2 (3)] thread monarch-actor-driver" in c.result, c.result
        # a list of ranks the mesh lacks is refused by name (it was an IndexError)
        c = k.run("from monarch_nb import debug\ndebug.stacks(hangs, [1, 9])")
        assert c.error and c.error["evalue"] == "rank 9 is out of range: the mesh has ranks 0-3", c.error
    finally:
        k.run("%mesh stop hung", timeout=60)


def test_a_blocked_cell_s_console_returns_when_the_ranks_are_resumed_elsewhere(k: Kernel) -> None:
    from monarch_nb import debug

    _ok(k.run("%mesh spawn bp2 --per-host gpus=2", timeout=120))
    try:
        _ok(
            k.run(
                "from monarch_nb.actor import Actor, endpoint, current_rank\n"
                "class Halt(Actor):\n"
                "    @endpoint\n"
                "    def halt(self):\n"
                "        mine = current_rank().rank * 7\n"
                "        breakpoint()\n"
                "        return mine\n"
                "halts = bp2.spawn('halts_elsewhere', Halt)"
            )
        )
        cell = k.execute("halts.halt.call().get().values()", allow_stdin=True)
        prompt = k.kc.get_stdin_msg(timeout=60)
        assert prompt["msg_type"] == "input_request" and "monarch_dbg>" in prompt["content"]["prompt"]
        # another controller (a terminal, here this test) continues the ranks; nobody answers the box
        wait_for(lambda: len(debug.sessions("halts_elsewhere")) == 2, 20, "both ranks paused")
        debug.continue_all("halts_elsewhere", timeout=10)
        c = _ok(k.wait(cell, timeout=60))
        assert c.result == "[0, 7]" and "resumed elsewhere" in c.stream(), c.msgs
    finally:
        k.run("%mesh stop bp2", timeout=60)


def test_a_value_mesh_displays_as_a_table_shaped_like_its_mesh(k: Kernel, workers: str) -> None:
    c = _ok(k.run('workers.rename(gpus="all").split(all=("hosts", "gpus"), gpus=8).hello.call().get()'))
    html = _html(c)
    tables = re.findall(r'<table class="mnb-table">(.*?)</table>', html, re.S)
    assert len(tables) == 1, html
    rows = re.findall(r"<tbody>(.*)</tbody>", tables[0], re.S)[0].split("</tr>")[:-1]
    assert len(rows) == 2 and all(r.count("<td ") == 8 for r in rows), tables[0]
    assert "hosts \\ gpus" in tables[0] and '<td data-rank="9"><code>90</code></td>' in rows[1]
    assert c.result.startswith("ValueMesh({hosts: 2, gpus: 8}):")
    # three dimensions: one table per value of the outer one
    c = _ok(k.run('workers.split(gpus=("a", "b", "c"), b=2, c=4).hello.call().get()'))
    assert _html(c).count('<table class="mnb-table">') == 2 and "<caption>a=1</caption>" in _html(c)


def test_large_value_meshes_group_values_clip_long_ones_and_keep_the_text_short(k: Kernel) -> None:
    code = (
        "from monarch_nb.actor import ValueMesh\nfrom monarch_nb.actor._shape import Extent\n"
        "big = ValueMesh(Extent(['hosts', 'gpus'], [8, 16]), ['ok'] * 120 + ['x' * 500] * 8)\nbig"
    )
    c = _ok(k.run(code))
    html = _html(c)
    assert '<table class="mnb-grouped">' in html
    assert '<td class="mnb-ranks">0-119</td><td>120</td>' in html and '<td class="mnb-ranks">120-127</td>' in html
    assert '<details class="mnb-clip">' in html and "x" * 500 in html  # the full value one click away
    assert len(c.result.splitlines()) < 40 and "96 more" in c.result


def test_proc_and_actor_meshes_display_as_rank_grids_coloured_by_state(k: Kernel, workers: str) -> None:
    for expr in ("obs", "workers"):
        html = _html(_ok(k.run(expr)))
        tiles = re.findall(r'<div class="mnb-tile mnb-state-(\w+)" data-rank="(\d+)"[^>]*title="([^"]*)"', html)
        assert [int(r) for _s, r, _t in tiles] == list(range(16)), html
        assert {s for s, _r, _t in tiles} <= {"idle", "busy"}, tiles
        assert all(re.search(r"host \S+ · pid \d+", t) for _s, _r, t in tiles), tiles
    hosts = _html(_ok(k.run("import monarch_nb.mesh as M\nM.hosts()")))
    assert hosts.count('class="mnb-tile ') == 1 and "HostMesh" in hosts
    _ok(k.run("import os, signal\nos.kill(obs._procs[5].pid, signal.SIGKILL)"))
    # the killed rank turns failed (the allocator notices within its heartbeat)
    c = _ok(
        k.run(
            "import time\nt = time.monotonic()\n"
            'while \'mnb-state-failed" data-rank="5"\' not in obs._repr_html_() and time.monotonic() - t < 10:\n'
            "    time.sleep(0.1)\nobs"
        )
    )
    assert 'mnb-state-failed" data-rank="5"' in _html(c) and "healthy ranks still callable" in _html(c)


def test_stopping_the_allocator_logs_no_error_and_leaves_no_socket_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import AllocatorProc, run_script

    a = AllocatorProc(str(tmp_path), "run", env={"MONARCH_NB_ZYGOTE_PRELOAD": ""})
    try:
        code = (
            "from monarch_nb.actor import this_host\n"
            "pm = this_host().spawn_procs(per_host={'gpus': 2}, name='kept', persist=True)\nprint(len(pm))"
        )
        r = run_script(code, env={"MONARCH_NB_RUNTIME_DIR": a.rdir})
        assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
        # the script exited: its own socket files went with it; the persistent mesh's stay in use
        socks = sorted(f for f in os.listdir(a.rdir) if f.endswith((".sock", ".fast")))
        assert len(socks) == 2 * 3, socks  # the allocator and two procs, an inbox and a direct socket each
        a.proc.terminate()
        a.proc.wait(15)
        assert [f for f in os.listdir(a.rdir) if f.endswith((".sock", ".fast"))] == []
        assert " ERROR " not in a.logtext(), a.logtext()
    finally:
        a.stop()
