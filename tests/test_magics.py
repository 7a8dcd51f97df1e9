"""The %mesh magics and rank output routing, through a real kernel (jupyter_client)."""

from __future__ import annotations

import itertools
import os
import re
import signal
import textwrap
import time
import warnings

import pytest
from _kernel import Kernel, poll


@pytest.fixture(scope="module")
def k():
    kern = Kernel()
    try:
        c = kern.run("%mesh connect")
        assert "connected to 1 host" in c.stream(), c.msgs
        if "; meshes: none" not in c.stream():
            # a named mesh left on the shared allocator (once in CI): conftest's
            # leaves_nothing_behind stops what each module leaves and names it, so this is only
            # a mesh that appeared since; this module's first test needs none: said, then stopped
            warnings.warn(f"test_magics found meshes left running by earlier tests: {c.stream().strip()}", stacklevel=1)
            kern.run("%mesh stop --all", timeout=60)
        yield kern
        kern.run("%mesh stop --all", timeout=60)
    finally:
        kern.close()


def _ok(c):
    assert c.error is None, "\n".join(c.error["traceback"]) if c.error else ""
    # a UsageError fails the cell with one line on stderr and no error message: the reply says so
    status = c.reply["content"]["status"] if c.reply else "ok"
    assert status == "ok", f"cell {status}: {c.stream('stderr')}"
    return c


def test_help_and_clear_usage_errors(k: Kernel, tmp_path) -> None:
    assert "%mesh spawn NAME" in _ok(k.run("%mesh help")).stream()
    assert "--per-host" in _ok(k.run("%mesh spawn --help")).stream()
    assert "--no-aggregate" in _ok(k.run("%mesh exec --help")).stream()
    # IPython shows a UsageError as one line on stderr and fails the cell
    mistakes = [
        ("%mesh frobnicate", "unknown subcommand 'frobnicate'"),
        ("%mesh spawn x --per-host gpus=two", "must be a positive integer, got 'two'"),
        ("%mesh spawn x --per-host gpus=-1", "must be a positive integer, got '-1'"),
        ("%mesh spawn x --per-host gpus=0", "must be a positive integer, got '0'"),
        ("%mesh exec", "cell magic"),
        ("%mesh logs nosuchmesh", "no mesh named 'nosuchmesh'"),
        # what a mesh lacks (a rank, a name) or a value no command takes, on meshes spawned below
        ("%mesh logs ue --rank 9", "has no rank 9 (ranks 0-1)"),
        ("%mesh logs ue --tail -1", "0 or more, not -1"),
        ("%mesh logs ue --follow --rank 5", "has no rank 5"),
        ("%mesh logs ue --follow --tail -2", "0 or more, not -2"),
        ("%mesh spawn 'two words' --per-host gpus=1", "must be a Python identifier"),
        ("%%mesh exec ue --ranks 9\n1", "rank 9 is out of range: the mesh has ranks 0-1"),
        ("%%mesh exec ue --ranks abc\n1", "cannot read rank set 'abc'"),
        # an empty rank set hung the cell
        ("%%mesh exec ue --ranks 1:0\n1", "rank set '1:0' selects no ranks"),
        ("%%mesh exec nosuch\n1", "no mesh named 'nosuch'"),
        ("%%mesh exec gone\n1", "`ProcMesh` has already been stopped: proc mesh 'gone'"),
        ("%mesh stacks ue --ranks 7", "rank 7 is out of range"),
        # the ranks 0 to 10^11 were built first: the kernel held for good, its memory filling
        ("%mesh stacks ue --ranks 0-99999999999", "%mesh stacks: rank 2 is out of range: the mesh has ranks 0-1"),
        ("%%mesh exec ue --ranks 0-99999999999\n1", "%%mesh exec: rank 2 is out of range: the mesh has ranks 0-1"),
        (f"%mesh sync {tmp_path}/missing", f"cannot sync {tmp_path}/missing: not a directory"),
        (f"%mesh sync --watch {tmp_path}/missing", f"cannot sync {tmp_path}/missing: not a directory"),
        ("%mesh connect 10.0.0.1:5555", "for a TCP address write tcp://10.0.0.1:5555"),
        ("%mesh env diff garbage", "cannot parse allocator address 'garbage'"),
        # the debugger's commands failed the cell too, not only printed "error: ..." (Run all went on)
        ("%mesh attach nosuch 0", "%mesh attach: no paused session for nosuch rank 0"),
        ("%mesh debug cast ue abc p x", "%mesh debug cast: "),
        # the last size won: a mesh of 2 procs, a shape the line did not say
        ("%mesh spawn x --per-host gpus=1,gpus=2", "--per-host names 'gpus' twice ('gpus=1,gpus=2')"),
        # bound to a variable no cell can name
        ("%mesh spawn def --per-host gpus=1", "mesh name 'def' must be a Python identifier, not a keyword"),
        # taken as they were: a dashboard refreshing without pause, a timeout that was none
        ("%mesh stacks ue --timeout 0", "argument --timeout: a number of seconds above 0, got '0'"),
        ("%mesh dashboard ue --interval -1", "argument --interval: a number of seconds above 0, got '-1'"),
        # a ValueError traceback from mesh.stop
        ("%mesh stop ue --all", "%mesh stop: name a mesh or pass --all, not both: `%mesh stop ue` stops only it"),
        # "connected", the key file never read: a wrong path went unnoticed
        ("%mesh connect --key-file nokey", "%mesh connect: --key-file is for the tcp:// allocators named with it"),
        # a FileNotFoundError traceback (the spans are still the allocators')
        (
            f"%mesh trace ue --out {tmp_path}/no/such/t.json",
            f"%mesh trace: --out '{tmp_path}/no/such/t.json': cannot write the trace file: No such file or directory",
        ),
        # the user's value replaced by the mesh, a builtin hidden (every print() then failed)
        (
            "%mesh spawn kept_list --per-host gpus=1",
            "%mesh spawn: the notebook variable 'kept_list' holds a list, which the mesh's variable would replace: "
            "choose another name or `del kept_list` first",
        ),
        ("%mesh spawn print --per-host gpus=1", "%mesh spawn: 'print' is a Python builtin, which the mesh's variable"),
        ("%mesh launch process kept_list", "%mesh launch: the notebook variable 'kept_list' holds a list"),
        # a TypeError and an IsADirectoryError traceback from the kubernetes client
        (
            f"%mesh launch k8s kj --kubeconfig {tmp_path}/word.yaml",
            f"%mesh launch: cannot load kubeconfig '{tmp_path}/word.yaml': not a kubeconfig (YAML with clusters",
        ),
        (f"%mesh launch k8s kj --kubeconfig {tmp_path}", f"%mesh launch: cannot load kubeconfig '{tmp_path}': Is a directory"),
        # it named --monarch-port and --python-exe, which are no options
        ("%mesh launch process pj --port 5", "%mesh launch process: --port does not apply to process"),
        ("%mesh launch ssh pj --hosts h1 --time 1:00", "%mesh launch ssh: --time does not apply to ssh"),
        # the default --hosts 1 for ssh: it waited for ssh to time out reaching a host named "1"
        ("%mesh launch ssh job1", "%mesh launch: an ssh job needs its hosts' names, comma-separated (--hosts h1,h2), got ''"),
        ("%mesh launch ssh job1 --hosts 2", "an ssh job needs its hosts' names, comma-separated (--hosts h1,h2), got '2'"),
    ]
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 10**8:
        # an OSError traceback, though its message said what to do (an unlimited kernel would try)
        mistakes.append(
            ("%mesh spawn huge --per-host gpus=99999999", "%mesh spawn: [Errno 24] spawning 99999999 procs ('huge') needs")
        )
    # no %mesh-named mesh yet (the module's first test): "0 are running (none)" read as if a mesh
    # of the Python API, which an unnamed exec cannot see, were gone
    c = k.run("%%mesh exec\n1")
    assert "no mesh named by %mesh spawn is running: name the mesh to use" in c.stream("stderr"), c.msgs
    _ok(k.run("%mesh spawn ue --per-host gpus=2\n%mesh spawn gone --per-host gpus=1\n%mesh stop gone"))
    _ok(k.run("%%mesh exec ue\n1"))  # spans for %mesh trace to write
    _ok(k.run("kept_list = [1, 2, 3]"))
    (tmp_path / "word.yaml").write_text("hostname\n")
    for code, text in mistakes:
        c = k.run(code)
        assert c.reply["content"]["status"] == "error", code
        assert text in c.stream("stderr") and c.error is None, (code, c.msgs)
    assert _ok(k.run("print(kept_list)")).stream() == "[1, 2, 3]\n"
    # %mesh connect binds the meshes it finds: not over a value the user put there since
    c = _ok(k.run("ue = 'mine'\n%mesh connect\nprint(ue)"))
    assert c.stream().endswith("\nmine\n"), c.stream()
    assert "not bound: the notebook variable 'ue' holds a str; ProcMesh.lookup('ue') gives the mesh\n" in c.stream("stderr")
    _ok(k.run("%mesh stop ue"))  # the kernel is the module's


def test_a_setting_that_is_wrong_fails_load_ext_in_one_line_and_load_ext_again_works(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # ten frames of monarch_nb ending in the ConfigError
    afile = tmp_path / "afile"
    afile.write_text("")
    kern = Kernel(env={"MONARCH_NB_RUNTIME_DIR": str(afile / "rt")}, load_ext=False)
    try:
        said = f"cannot make the runtime directory {afile}/rt: Not a directory ({afile}/rt); set MONARCH_NB_RUNTIME_DIR"
        for code, words in [("%load_ext monarch_nb", "UsageError: monarch_nb: "), ("%mesh status", "UsageError: %mesh status: ")]:
            c = kern.run(code)
            assert c.reply["content"]["status"] == "error" and c.error is None, (code, c.msgs)
            assert c.stream("stderr").startswith(words + said), (code, c.stream("stderr"))
        rdir = tmp_path / "rt"
        _ok(kern.run(f"import os\nos.environ['MONARCH_NB_RUNTIME_DIR'] = {str(rdir)!r}\n%load_ext monarch_nb"))
        assert "no allocators known" in _ok(kern.run("%mesh status")).result
    finally:
        kern.close()


def test_spawn_binds_variable_and_exec_keeps_a_namespace_per_proc(k: Kernel) -> None:
    c = _ok(k.run("%mesh spawn ns --per-host gpus=4"))
    assert "ns: 4 procs {gpus: 4}" in c.stream()
    assert "ProcMesh(name='ns'" in _ok(k.run("ns")).result
    _ok(k.run("%%mesh exec ns\nfrom monarch_nb.actor import current_rank\nimport os\nr = current_rank().rank\nmine = r * 10"))
    c = _ok(k.run("%%mesh exec ns\nmine + 1"))
    assert re.findall(r"(\d+)\)", c.result) == ["1", "11", "21", "31"], c.result
    c = _ok(k.run("%%mesh exec ns --ranks 1:3\nr"))
    assert "ValueMesh({ranks: 2})" in c.result and re.findall(r", (\d+)\)", c.result) == ["1", "2"]
    # the same Python value comes back through the public function too
    c = _ok(k.run("import monarch_nb.mesh as M\nM.exec_cell('ns', 'os.getpid()').values() == [p.pid for p in ns._procs]"))
    assert c.result == "True"
    # a rank list the mesh lacks, in the mesh's words (it named the hidden exec actor)
    c = k.run("M.exec_cell('ns', '1', ranks=[1, 7])")
    assert c.error and c.error["evalue"] == "rank 7 is out of range: the mesh has ranks 0-3", c.error


def test_errors_show_each_failing_rank_and_the_kernel_lives_on(k: Kernel) -> None:
    _ok(k.run("%mesh spawn errs --per-host gpus=4"))
    c = k.run(
        "%%mesh exec errs\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank\nassert r % 2 == 0, f'odd rank {r}'"
    )
    assert c.error and c.error["ename"] == "ExecError"
    tb = "\n".join(c.error["traceback"])
    assert "failed on 2 of 4 ranks" in tb
    # ranks 1 and 3 failed alike: one traceback, their messages listed
    assert "--- ranks 1,3: AssertionError" in tb and tb.count("--- ") == 1
    assert "rank 1: AssertionError: odd rank 1" in tb and "rank 3: AssertionError: odd rank 3" in tb
    assert "assert r % 2 == 0" in tb  # the remote source line
    assert _ok(k.run("%%mesh exec errs\nr")).result.count("),") == 3


def test_rank_output_lands_in_the_calling_cell_aggregated(k: Kernel) -> None:
    _ok(k.run("%mesh spawn agg --per-host gpus=8"))
    code = "%%mesh exec agg\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank\nprint('ready')\nprint(f'loss={0.51 + r / 100:.2f}')"
    c = _ok(k.run(code))
    out = c.stream()
    assert "[ranks 0-7 ×8] ready\n" in out, out
    assert "[ranks 0-7 ×8] loss=0.51…0.58\n" in out, out
    c = _ok(k.run("%%mesh exec agg --no-aggregate\nprint('each', r)"))
    lines = sorted(c.stream().splitlines())
    assert lines == sorted(f"[{r}] each {r}" for r in range(8)), lines


def test_a_cells_first_line_shows_at_once_then_joins_its_aggregated_group(k: Kernel, tmp_path) -> None:
    flag = tmp_path / "go"
    _ok(k.run("%mesh spawn first --per-host gpus=2"))
    _ok(k.run("%%mesh exec first\nimport os\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank"))
    cell = k.execute(f"%%mesh exec first\nprint('started', r)\n{poll(f'os.path.exists({str(flag)!r})', 60)}print('done', r)")

    def ours(m: dict, *types: str) -> bool:
        return m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] in types

    # while the ranks still run, before the 1 s aggregation window closes
    first = k.wait_msg(
        lambda m: ours(m, "display_data") and "started" in m["content"]["data"]["text/plain"], 15, "the first line"
    )
    assert re.fullmatch(r"\[[01]\] started [01] …", first["content"]["data"]["text/plain"]), first["content"]
    slot = first["content"]["transient"]["display_id"]
    cleared = k.wait_msg(
        lambda m: ours(m, "update_display_data") and m["content"]["transient"]["display_id"] == slot, 15, "the first line merged"
    )
    assert cleared["content"]["data"]["text/plain"] == ""
    group = k.wait_msg(lambda m: ours(m, "stream") and "started" in m["content"]["text"], 15, "the window's group")
    assert "[ranks 0-1 ×2] started 0…1\n" in group["content"]["text"]
    assert k.log.index(first) < k.log.index(cleared) < k.log.index(group), "provisional, then merged into its group"
    flag.touch()
    c = _ok(k.wait(cell))
    assert c.stream().count("started") == 1, c.stream()
    assert "[ranks 0-1 ×2] done 0…1\n" in c.stream(), c.stream()
    assert [d["data"]["text/plain"] for d in c.displays()].count(first["content"]["data"]["text/plain"]) == 1


def test_late_output_reaches_its_cell_after_another_cell_ran(k: Kernel, tmp_path) -> None:
    flag = tmp_path / "go"
    _ok(k.run("%mesh spawn late --per-host gpus=2"))
    _ok(k.run("%%mesh exec late\nimport os, time\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank"))
    # the call returns at once; the ranks print when the test lets them, after another cell ran
    flag2 = tmp_path / "again"
    a = _ok(
        k.run(
            f"%%mesh exec late --no-block\n{poll(f'os.path.exists({str(flag)!r})', 60)}print('late from', r, flush=True)\n"
            f"{poll(f'os.path.exists({str(flag2)!r})', 60)}print('later still', r)"
        )
    )
    # no placeholder: it would be saved in the notebook as an empty output
    assert a.displays() == [], a.displays()
    b = _ok(k.run("1 + 1"))
    assert b.result == "2"
    flag.touch()
    late = k.wait_msg(
        lambda m: m["msg_type"] == "display_data" and "late from" in m["content"]["data"]["text/plain"],
        15,
        "late output in a display",
    )
    # in the first cell (its request is its parent), in a display that more late output updates
    assert late["parent_header"]["msg_id"] == a.msg_id
    assert late["content"]["transient"]["display_id"]
    assert "[ranks 0-1 ×2] late from 0…1" in late["content"]["data"]["text/plain"]
    assert "late from" not in b.stream()
    flag2.touch()
    upd = k.wait_msg(
        lambda m: m["msg_type"] == "update_display_data" and "later still" in m["content"]["data"]["text/plain"],
        15,
        "more late output, updating that display",
    )
    assert upd["content"]["transient"]["display_id"] == late["content"]["transient"]["display_id"]
    assert upd["content"]["data"]["text/plain"].splitlines() == ["[ranks 0-1 ×2] late from 0…1", "[ranks 0-1 ×2] later still 0…1"]


def test_late_output_reaches_its_cell_after_a_later_cell_called_the_same_ranks(k: Kernel, tmp_path) -> None:
    # the cell's late output was aggregated but never shown once a later cell had called its
    # ranks: only the ranks' newest cell, the running one and the last one were flushed
    flag = tmp_path / "go"
    _ok(k.run("%mesh spawn later --per-host gpus=2"))
    _ok(k.run("%%mesh exec later\nimport os\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank"))
    a = _ok(k.run(f"%%mesh exec later --no-block\n{poll(f'os.path.exists({str(flag)!r})', 60)}print('first cell', r)"))
    b = _ok(k.run("%%mesh exec later --no-block\nprint('second cell', r)"))  # runs after the first, on the same ranks
    _ok(k.run("x = 'a third cell'"))
    flag.touch()
    upd = k.wait_msg(
        lambda m: (
            m["msg_type"] in ("display_data", "update_display_data")
            and m["parent_header"].get("msg_id") == a.msg_id
            and "first cell" in m["content"]["data"]["text/plain"]
        ),
        15,
        "the first cell's late output in its display",
    )
    assert "second cell" not in upd["content"]["data"]["text/plain"]
    k.wait_msg(
        lambda m: (
            m["msg_type"] in ("display_data", "update_display_data")
            and m["parent_header"].get("msg_id") == b.msg_id
            and "second cell" in m["content"]["data"]["text/plain"]
        ),
        15,
        "the second cell's output in its display",
    )


def test_output_outside_a_call_goes_to_the_cell_of_the_last_call(k: Kernel, tmp_path) -> None:
    flag = tmp_path / "tick"
    _ok(k.run("%mesh spawn bg --per-host gpus=1"))
    code = (
        "%%mesh exec bg\nimport os, threading, time\n"
        "def later():\n" + textwrap.indent(poll(f"os.path.exists({str(flag)!r})", 60), "    ") + "    print('background tick')\n"
        "threading.Thread(target=later).start()"
    )
    a = _ok(k.run(code))
    b = _ok(k.run("x = 'another cell'"))
    flag.touch()
    k.wait_msg(
        lambda m: (
            m["msg_type"] in ("display_data", "update_display_data")
            and m["parent_header"].get("msg_id") == a.msg_id
            and "background tick" in m["content"]["data"]["text/plain"]
        ),
        15,
        "background output in the cell of the last call",
    )
    assert "background tick" not in b.stream()


def test_progress_bars_render_as_one_line_per_rank(k: Kernel) -> None:
    _ok(k.run("%mesh spawn bars --per-host gpus=2"))
    code = (
        "%%mesh exec bars\nimport sys, time\nfrom monarch_nb.actor import current_rank\n"
        "for i in range(0, 101, 25):\n    sys.stdout.write(f'\\rstep {i}%'); sys.stdout.flush(); time.sleep(0.05)\n"
        "print()"
    )
    c = _ok(k.run(code))
    texts = [d["data"]["text/plain"] for d in c.displays()]
    assert any(re.search(r"\[\d\] step \d+%", t) for t in texts), texts
    # no progress state leaks into the stream as separate lines
    assert "step 0%" not in c.stream()


def test_a_line_printed_without_a_newline_shows_in_its_cell_when_the_call_ends(k: Kernel) -> None:
    # it waited in the allocator for the rank's next newline (maybe never), then went to a later cell
    _ok(k.run("%mesh spawn unended --per-host gpus=2"))
    c = _ok(
        k.run("%%mesh exec unended\nfrom monarch_nb.actor import current_rank\nprint('no newline', current_rank().rank, end='')")
    )
    assert "[ranks 0-1 ×2] no newline 0…1\n" in c.stream(), c.msgs
    c = _ok(k.run("%%mesh exec unended\nprint('next')"))
    assert c.stream() == "[ranks 0-1 ×2] next\n", c.stream()


def test_interrupt_stops_remote_code_and_keeps_the_procs(k: Kernel) -> None:
    _ok(k.run("%mesh spawn intr --per-host gpus=2"))
    pids = _ok(k.run("%%mesh exec intr\nimport os, time\nos.getpid()")).result
    cell = k.execute("%%mesh exec intr\nprint('sleeping', flush=True)\ntime.sleep(600)")
    k.wait_msg(lambda m: m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] == "stream", 20, "the ranks to start")
    k.interrupt()
    c = k.wait(cell, 20)
    assert c.error and c.error["ename"] == "KeyboardInterrupt"
    # the kernel's own traceback is the cell's wait: the user's cell line, none of the runtime's
    # frames (six, a screenful, before); then where the ranks were, grouped
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
    assert "monarch_nb/" not in tb and "_debugwait" not in tb, tb
    assert "run_cell_magic('mesh', 'exec intr'" in tb, tb
    assert "monarch_nb: the interrupt stopped the cell on the ranks too; where they were:" in tb, tb
    assert "KeyboardInterrupt on 2 of 2 ranks: 0-1" in tb and "--- ranks 0-1: KeyboardInterrupt" in tb, tb
    assert re.search(r"Cell In\[\d+\], line 3, in <module>\n    time\.sleep\(600\)", tb), tb
    assert _ok(k.run("%%mesh exec intr\nos.getpid()")).result == pids


@pytest.mark.timeout(60)
def test_an_interrupt_that_leaves_ranks_blocked_in_a_collective_says_so(k: Kernel) -> None:
    # rank 1 sleeps (Python: the interrupt ends it), rank 0 waits for it in a gloo all_reduce (a C
    # call the interrupt does not end): the KeyboardInterrupt says rank 0 runs on, and what ends it
    _ok(k.run("%mesh spawn intcoll --per-host gpus=2"))
    _ok(k.run("from monarch_nb.spmd import setup_torch_elastic_env\nsetup_torch_elastic_env(intcoll)"))
    _ok(k.run("%%mesh exec intcoll\nimport time, torch, torch.distributed as dist\ndist.init_process_group('gloo')"))
    cell = k.execute(
        "%%mesh exec intcoll\nprint('in', flush=True)\nif dist.get_rank() == 1:\n    time.sleep(600)\n"
        "dist.all_reduce(torch.ones(1))"
    )
    k.wait_msg(lambda m: m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] == "stream", 20, "the ranks to start")
    k.interrupt()
    c = k.wait(cell, 20)
    assert c.error and c.error["ename"] == "KeyboardInterrupt", c.error
    text = "\n".join(c.error["traceback"])
    assert "1 of 2 ranks had not stopped 1 s after the interrupt" in text, text
    assert "%mesh stop intcoll ends them" in text, text
    _ok(k.run("%mesh stop intcoll"))


@pytest.mark.timeout(60)
def test_a_second_interrupt_while_the_ranks_stop_still_says_which_run_on(k: Kernel, tmp_path) -> None:
    # an impatient user interrupts again while the cell waits for its ranks to stop (rank 3 is in
    # a C call, SIGINT held off as by one): that interrupt showed our waits' frames chained to the
    # first, and lost the note on which rank still runs the cell and what ends it
    _ok(k.run("%mesh spawn twice --per-host gpus=4\nimport monarch_nb.mesh as _M\n_M.INTERRUPT_GRACE = 60"))
    try:
        cell = k.execute(
            "%%mesh exec twice\nimport os, signal, time\nfrom monarch_nb.actor import current_rank\n"
            "if current_rank().rank == 3:\n    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
            "print('in', flush=True)\ntry:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n"
            f"    open(os.path.join({str(tmp_path)!r}, str(current_rank().rank)), 'w').close()\n    raise"
        )
        k.wait_msg(
            lambda m: m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] == "stream", 20, "the ranks to start"
        )
        k.interrupt()
        # ranks 0-2 stopped: the cell now waits (60 s) for rank 3 to
        deadline = time.monotonic() + 20
        while len(os.listdir(tmp_path)) < 3:
            assert time.monotonic() < deadline, f"ranks stopped: {os.listdir(tmp_path)}"
            time.sleep(0.05)
        k.interrupt()
        c = k.wait(cell, 20)
        assert c.error and c.error["ename"] == "KeyboardInterrupt", c.error
        tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
        assert "1 of 4 ranks had not stopped when you interrupted again" in tb, tb
        assert "%mesh stop twice ends them" in tb, tb
        assert "During handling" not in tb and "monarch_nb/" not in tb, tb
    finally:
        _ok(k.run("_M.INTERRUPT_GRACE = 1.0"))
        _ok(k.run("%mesh stop twice"))


@pytest.mark.timeout(60)
def test_an_interrupt_while_the_interrupted_cell_is_shown_keeps_the_short_view(k: Kernel, tmp_path) -> None:
    # the user interrupts again while IPython formats the first interrupt's traceback (seconds on
    # a busy machine): IPython dropped our handler ("Custom TB Handler failed, unregistering"),
    # printed its own formatting frames, and every later interrupt showed the runtime's frames.
    # The second interrupt here is the kernel's own SIGINT, sent when the formatting starts
    _ok(
        k.run(
            "import os, signal\n_tb = get_ipython().InteractiveTB\n_fmt = _tb.structured_traceback\n_fired = []\n"
            # once, for the cell's interrupt (not any other traceback IPython formats meanwhile)
            "def _again(etype, *a, **kw):\n"
            "    if etype is KeyboardInterrupt and not _fired:\n"
            "        _fired.append(1)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return _fmt(etype, *a, **kw)\n"
            "_tb.structured_traceback = _again"
        )
    )
    try:
        # the cell is in its sleep once the file exists (a print's flush could take the interrupt)
        flag = tmp_path / "in"
        cell = k.execute(f"import pathlib, time\npathlib.Path({str(flag)!r}).touch()\ntime.sleep(600)")
        deadline = time.monotonic() + 20
        while not flag.exists():
            assert time.monotonic() < deadline, "the cell did not start within 20 s"
            time.sleep(0.05)
        k.interrupt()
        c = k.wait(cell, 20)
        assert "Custom TB Handler failed" not in c.stream("stderr") + c.stream(), c.msgs
        assert c.error and c.error["ename"] == "KeyboardInterrupt", c.msgs
        tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
        assert "time.sleep(600)" in tb and "stack_data" not in tb and "iostream" not in tb, tb
    finally:
        _ok(k.run("del _tb.structured_traceback"))
    assert _ok(k.run("_fired")).result == "[1]"
    assert _ok(k.run("get_ipython().custom_exceptions")).result == "(KeyboardInterrupt, asyncio.exceptions.CancelledError)"


@pytest.mark.timeout(60)
def test_an_interrupted_stop_says_it_goes_on_and_the_mesh_reads_as_stopped(k: Kernel, tmp_path) -> None:
    # the impatient user interrupts `%mesh stop` of a mesh whose rank will not end by itself: the
    # note offered ".get() or await" on a future the user never had, and a next `%%mesh exec` on
    # the name said "actor mesh '__mnb_exec__' was stopped; spawn it again"
    _ok(k.run("%mesh spawn halting --per-host gpus=1"))
    cell = k.execute(
        "%%mesh exec halting\nimport signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "print('in', flush=True)\ntime.sleep(600)"
    )
    k.wait_msg(lambda m: m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] == "stream", 20, "the rank to start")
    k.interrupt()
    assert k.wait(cell, 20).error is not None
    # the stop waits 2 s for the rank's cleanup, then kills it: the interrupt comes in that wait
    cell = k.execute(f"import pathlib\npathlib.Path({str(tmp_path / 'stopping')!r}).touch()\n%mesh stop halting")
    deadline = time.monotonic() + 20
    while not (tmp_path / "stopping").exists():
        assert time.monotonic() < deadline, "the stop did not start within 20 s"
        time.sleep(0.05)
    k.interrupt()
    c = k.wait(cell, 20)
    assert c.error and c.error["ename"] == "KeyboardInterrupt", c.msgs
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
    assert "only the wait stopped: the stop of mesh 'halting' goes on" in tb and ".get() or await" not in tb, tb
    c = k.run("%%mesh exec halting\n1")
    assert "`ProcMesh` has already been stopped: proc mesh 'halting'" in c.stream("stderr"), c.msgs
    _ok(k.run(poll("'halting' not in str(get_ipython().run_line_magic('mesh', 'status'))", 20, "the stop to finish")))


@pytest.mark.timeout(60)
def test_notes_on_our_errors_show_in_the_notebook(k: Kernel) -> None:
    # IPython shows only what _render_traceback_ returns: the notes we add (what still runs,
    # what to do) must be in it, after the message, as Python prints them
    made = {  # what to raise: what its message says
        "ActorError(ValueError('boom'), 'Traceback (most recent call last):\\nValueError: boom\\n', rank=0)": "boom",
        "ActorError(ValueError('boom'), rank=1)._set_group('A.f', 2, {1: ActorError(ValueError('boom'), rank=1)})": (
            "--- rank 1: ValueError"
        ),
        "SupervisionError('process 7 was killed by SIGKILL', mesh='m', rank=1)": "killed by SIGKILL",
        "ExecError({0: ('ValueError', 'boom', 'ValueError: boom')}, 2, mesh='m', running=[1])": "failed on 1 of 2 ranks",
        "SpawnError('actor __init__ raised', 'Traceback (most recent call last):\\nValueError: boom\\n')": "init__ raised",
    }
    _ok(k.run("from monarch_nb.errors import ActorError, ExecError, SpawnError, SupervisionError"))
    for expr, says in made.items():
        c = k.run(f"e = {expr}\ne.add_note('first note\\nsecond line')\ne.add_note('last note')\nraise e")
        assert c.error and expr.startswith(c.error["ename"]), (expr, c.error)
        tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"])).splitlines()
        assert tb[-3:] == ["first note", "second line", "last note"], (expr, tb)
        assert says in "\n".join(tb[:-3]), (expr, tb)


@pytest.mark.timeout(60)
def test_an_spmd_script_failing_on_one_rank_shows_its_traceback_and_one_line_for_the_ranks_waiting_for_it(
    k: Kernel, tmp_path
) -> None:
    # rank 1's script raises while rank 0 waits for it in DDP's next forward: the cell showed
    # rank 0's ~25 lines of torch frames ending in gloo's "Connection closed by peer" under rank
    # 1's error; they are one line now, and print(sys.last_value.grouped_text()) shows them
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "def main():\n"
        "    dist.init_process_group('gloo')\n"
        "    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    if dist.get_rank() == 1:\n"
        "        raise RuntimeError('diverged at step 0')\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "main()\n"
    )
    _ok(k.run("%mesh spawn spmdtb --per-host gpus=2"))
    _ok(k.run("from monarch_nb.spmd import SPMDActor\nspmd = spmdtb.spawn('_SPMDActor', SPMDActor)"))
    c = k.run(
        "addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get(timeout=30)\n"
        f"spmd.main.call(addr, port, [{str(script)!r}]).get(timeout=60)",
        timeout=90,
    )
    assert c.error and c.error["ename"] == "ActorError", c.error
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"])).splitlines()
    assert tb[1:4] == [
        "RuntimeError on 1 of 2 ranks: 1",
        "rank 0 (1 of 2): RuntimeError: [gloo] Connection closed by peer … (waiting for rank 1 in a collective)",
        "print(sys.last_value.grouped_text()) shows their tracebacks too",
    ], tb
    assert "--- rank 1: RuntimeError" in tb and tb[-1] == "RuntimeError: diverged at step 0", tb
    assert not any("distributed.py" in ln for ln in tb), tb
    whole = _ok(k.run("import sys\nprint(sys.last_value.grouped_text())")).stream()
    assert "--- rank 0: RuntimeError" in whole and "distributed.py" in whole, whole
    _ok(k.run("%mesh stop spmdtb"))


def test_stop_of_a_mesh_stopped_from_a_shell_says_by_whom(k: Kernel) -> None:
    # before: "could not stop shstop: no mesh named 'shstop' on host ...", an error, at every try
    _ok(k.run("%mesh spawn shstop --per-host gpus=1"))
    c = _ok(
        k.run(
            "import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-m', 'monarch_nb', 'stop', '--force', 'shstop'], "
            "capture_output=True, text=True, timeout=60)\n"
            "print(r.returncode, r.stdout, r.stderr)"
        )
    )
    assert "0 stopped mesh 'shstop' (1 proc)" in c.stream(), c.msgs
    for _ in range(2):
        c = _ok(k.run("%mesh stop shstop"))
        assert (
            c.reply["content"]["status"] == "ok"
            and c.stream() == "mesh 'shstop' was already stopped (by `monarch-nb stop` on the command line)\n"
        ), c.msgs
    c = k.run("%%mesh exec shstop\n1")
    assert c.reply["content"]["status"] == "error" and "has already been stopped" in c.stream("stderr"), c.msgs


def test_status_logs_of_a_crashed_proc_and_stop(k: Kernel) -> None:
    _ok(k.run("%mesh spawn lg --per-host gpus=2"))
    _ok(k.run("%%mesh exec lg\nimport os\nprint('before the crash', os.getpid())"))
    html = next(m for m in _ok(k.run("%mesh status")).msgs if m["msg_type"] == "execute_result")["content"]["data"]["text/html"]
    assert "lg (persistent)" in html and re.search(r"mnb-state-(idle|busy)", html)
    pid = int(_ok(k.run("lg._procs[1].pid")).result)
    os.kill(pid, signal.SIGKILL)
    # %mesh status and the sidebar tell one story: the mesh as a whole is failed, rank 1 failed, 0 idle
    from conftest import wait_for

    from monarch_nb.server.manager import MeshManager

    failed = "failed (healthy ranks still callable; new spawns refused)"

    def status_says_failed() -> str | None:
        # this mesh's row: another mesh on the shared allocator may be failed as well
        t = _ok(k.run("%mesh status")).result
        return t if re.search(r"lg \(persistent\)\s+this kernel\s+0-1\s+" + re.escape(failed), t) else None

    text = wait_for(status_says_failed, 15, "%mesh status to say failed")
    assert re.search(r"lg \(persistent\)\s+this kernel\s+1\s+failed\s+\d+\s+process \d+ was killed by SIGKILL", text), text
    assert "%mesh stop lg" in text, text
    side = next(m for m in MeshManager().state()["meshes"] if m["name"] == "lg")
    assert side["label"] == failed and [p["state"] for p in side["procs"]] == ["idle", "failed"]
    assert re.search(r"lg \(persistent\)\s+this kernel\s+0\s+idle", text), text
    c = _ok(k.run("%mesh logs lg --rank 1"))
    assert f"[1] before the crash {pid}" in c.stream()
    c = _ok(k.run("%mesh stop lg"))
    assert "stopped: lg" in c.stream()
    c = k.run("%%mesh exec lg\n1")
    assert c.reply["content"]["status"] == "error" and "has already been stopped" in c.stream("stderr"), c.msgs


def test_logs_follow_prints_new_lines_until_interrupted(k: Kernel, tmp_path) -> None:
    flag = tmp_path / "go"
    _ok(k.run("%mesh spawn fo --per-host gpus=2"))
    _ok(
        k.run(
            "%%mesh exec fo\n"
            "import os, threading, time\n"
            "print('old line', flush=True)\n"
            "def later():\n"
            + textwrap.indent(poll(f"os.path.exists({str(flag)!r})", 60), "    ")
            + "    print('new line', flush=True)\n"
            "threading.Thread(target=later, daemon=True).start()"
        )
    )
    cell = k.execute("%mesh logs fo --follow --tail 5")

    def printed(text: str):
        return lambda m: m["parent_header"].get("msg_id") == cell.msg_id and text in m["content"].get("text", "")

    k.wait_msg(printed("[1] old line"), 20, "the old lines")
    flag.write_text("")
    k.wait_msg(printed("[0] new line"), 20, "a line written after --follow started")
    k.interrupt()
    c = k.wait(cell, 20)
    assert c.error is None, c.error  # the interrupt ends the follow, not the cell with an error
    _ok(k.run("%mesh stop fo"))


@pytest.mark.timeout(60)
def test_logs_follow_of_a_stopped_mesh_prints_its_last_lines_and_ends(k: Kernel) -> None:
    # it waited for lines a stopped mesh never writes: the kernel held until interrupted
    _ok(k.run("%mesh spawn fstop --per-host gpus=1"))
    _ok(k.run("%%mesh exec fstop\nprint('last words', flush=True)"))
    _ok(k.run("%mesh stop fstop"))
    c = _ok(k.run("%mesh logs fstop --follow", timeout=30))
    assert c.stream() == "[0] last words\n(mesh fstop is stopped: no more lines will come)\n", c.stream()


def test_logging_option_sets_the_window_of_a_mesh(k: Kernel) -> None:
    _ok(k.run("%mesh spawn lo --per-host gpus=3"))
    _ok(k.run("await lo.logging_option(stream_to_client=True, aggregate_window_sec=0)"))
    c = _ok(k.run("%%mesh exec lo\nfrom monarch_nb.actor import current_rank\nprint('one by one')"))
    assert c.stream().count("] one by one\n") == 3, c.stream()
    _ok(k.run("await lo.logging_option(stream_to_client=True, aggregate_window_sec=1)"))
    assert "[ranks 0-2 ×3] together" in _ok(k.run("%%mesh exec lo\nprint('together')")).stream()


def test_a_dead_proc_fails_the_mesh_loudly_and_the_next_cell_respawns(k: Kernel) -> None:
    from conftest import wait_for

    _ok(k.run("%mesh spawn frail --per-host gpus=2"))
    _ok(k.run("%%mesh exec frail\n1"))
    pid = int(_ok(k.run("frail._procs[1].pid")).result)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "True" in k.run("bool(frail._failed)").result, 10, "the mesh to be marked failed")
    c = k.run("%%mesh exec frail\n1")
    assert c.error, "a call to a failed mesh fails"
    text = c.error["evalue"] + "\n".join(c.error["traceback"])
    assert "frail" in text and "rank 1" in text and "SIGKILL" in text, text
    c = _ok(k.run("%mesh spawn frail --per-host gpus=2"))
    assert "frail: 2 procs" in c.stream()
    assert _ok(k.run("%%mesh exec frail\n7")).result.count("7") == 2


def test_a_mesh_whose_allocator_stopped_names_no_rank_as_live_and_stops() -> None:
    """Every proc went with its allocator (`monarch-nb allocator stop`): the next cell said
    "rank 1 (1 of 2) was still running" and to go on with `--ranks 1`, which failed alike; and
    `%mesh stop` of that mesh failed, saying its procs were gone."""
    import shutil
    import subprocess
    import tempfile

    from conftest import PY

    rdir = tempfile.mkdtemp(prefix="mnbx-", dir="/tmp")
    os.chmod(rdir, 0o700)
    env = {"MONARCH_NB_RUNTIME_DIR": rdir, "MONARCH_NB_ZYGOTE_PRELOAD": ""}
    kern = Kernel(env=env)
    try:
        _ok(kern.run("%mesh spawn lost --per-host gpus=2"))
        _ok(kern.run("%%mesh exec lost\n1"))
        stop = subprocess.run(
            [PY, "-m", "monarch_nb", "allocator", "stop"], env=dict(os.environ, **env), capture_output=True, text=True, timeout=60
        )
        assert stop.returncode == 0 and stop.stdout.startswith("stopped 1 allocator"), (stop.stdout, stop.stderr)
        dead = "all(p.addr in controller_client().rt.supervision.dead for p in lost._procs)"
        _ok(kern.run("from monarch_nb.actor import controller_client\n" + poll(dead, 30, "both procs known dead")))
        c = kern.run("%%mesh exec lost\n1")
        assert c.error is not None, c.msgs
        text = c.error["evalue"]
        assert "had died before it ran" in text and "still running" not in text and "--ranks" not in text, text
        assert "every rank of this mesh had died (0-1): %mesh stop lost ends the mesh; spawn a new one to go on" in text, text
        # as advised: it failed the cell with "could not stop lost: ... its procs are gone", at every try
        for _ in range(2):
            said = _ok(kern.run("%mesh stop lost")).stream()
            assert said.startswith("mesh 'lost' was already stopped (allocator ") and said.endswith("its procs are gone)\n"), said
    finally:
        kern.close()
        subprocess.run(
            [PY, "-m", "monarch_nb", "allocator", "stop"], env=dict(os.environ, **env), capture_output=True, timeout=60
        )
        shutil.rmtree(rdir, ignore_errors=True)


# counts the failures the kernel's unhandled_fault_hook was given, after it showed them: a cell
# can wait for the notice to have been issued (while it still runs) instead of sleeping
COUNT_FAULTS = """\
import monarch_nb.actor as _api
if not hasattr(_api.unhandled_fault_hook, "seen"):
    _shown = _api.unhandled_fault_hook
    def _counting(failure):
        _shown(failure)
        _counting.seen.append(failure.mesh_name)
    _counting.seen = []
    _api.unhandled_fault_hook = _counting
faults = _api.unhandled_fault_hook.seen
"""


def _text(m: dict) -> str:  # type: ignore[type-arg]
    c = m["content"]
    return str(c.get("text") or c.get("data", {}).get("text/plain", "") or "\n".join(c.get("traceback", [])))


def _of(k: Kernel, cell) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    """Every iopub message of ``cell`` seen so far, also late ones (after it went idle)."""
    return [m for m in k.log if m["parent_header"].get("msg_id") == cell.msg_id]


def test_a_broadcast_failing_with_different_errors_shows_each_kind_once(k: Kernel) -> None:
    # nobody receives a broadcast's errors: the notice is all the user sees of them. It showed
    # the first failure and "3 more failures …, as above": the KeyError and the CUDA error unseen
    _ok(k.run("%mesh spawn bmix --per-host gpus=4"))
    _ok(k.run(COUNT_FAULTS))
    cell = k.execute(
        "from monarch_nb.actor import Actor, endpoint, current_rank\n"
        "class Mixed(Actor):\n"
        "    @endpoint\n"
        "    def step(self) -> None:\n"
        "        r = current_rank().rank\n"
        "        if r % 2 == 0:\n"
        "            raise ValueError(f'bad shape for shard {r}')\n"
        "        if r == 1:\n"
        "            raise KeyError('layer.1.weight')\n"
        "        raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "mixed = bmix.spawn('mixed', Mixed)\n"
        "mixed.step.broadcast()\n" + poll("faults.count('mixed') == 4", 30, "the four ranks' failures")
    )
    _ok(k.wait(cell))
    notices = "".join(_text(m) for m in _of(k, cell) if "mesh 'mixed'" in _text(m))
    assert notices.count("unhandled mesh failure: mesh 'mixed'") == 3, notices
    assert "KeyError: 'layer.1.weight'" in notices, notices
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in notices, notices
    # the two ValueErrors differ only in their numbers: one is shown, the other counted
    assert notices.count("ValueError: bad shape for shard") == 1, notices
    assert re.search(r"1 more failure of mesh 'mixed' \(rank [02]\), as above", notices), notices
    _ok(k.run("%mesh stop bmix"))


def test_a_failing_init_shows_a_notice_in_the_cell_that_spawned(k: Kernel) -> None:
    # spawn returns at once (as Monarch's); the failure comes through supervision, and the
    # kernel's default unhandled_fault_hook shows it in the running cell
    _ok(k.run("%mesh spawn initfail --per-host gpus=2"))
    _ok(k.run(COUNT_FAULTS))
    # the user's cell is still running when construction fails on both ranks
    cell = k.execute(
        "from monarch_nb.actor import Actor, endpoint\n"
        "class Bad(Actor):\n"
        "    def __init__(self) -> None:\n"
        "        raise ValueError('cannot construct this')\n"
        "    @endpoint\n"
        "    def ping(self) -> int:\n"
        "        return 1\n"
        "bad = initfail.spawn('bad', Bad)\n" + poll("faults.count('bad') == 2", 30, "both ranks' failures") + "type(bad).__name__"
    )
    assert _ok(k.wait(cell)).result == "'ActorMesh'"
    count = cell.reply["content"]["execution_count"]  # type: ignore[index]
    notices = "".join(_text(m) for m in _of(k, cell) if "unhandled mesh failure" in _text(m))
    # one notice for the mesh, the remote traceback once, its frame named as IPython names cells
    assert notices.count("unhandled mesh failure") == 1, notices
    assert notices.count("ValueError: cannot construct this") == 1, notices
    assert f"Cell In[{count}], line 4, in __init__" in notices and "raise ValueError(" in notices, notices
    assert "monarch_nb/" not in notices and "ipykernel_" not in notices, notices
    assert "1 more failure of mesh 'bad'" in notices, notices
    c = k.run("bad.ping.call().get(timeout=20)")
    assert c.error and c.error["ename"] == "SupervisionError", c.error
    tb = "\n".join(c.error["traceback"])
    assert tb.count("ValueError: cannot construct this") == 1 and f"Cell In[{count}], line 4, in __init__" in tb, tb
    assert "monarch_nb/" not in tb and "ipykernel_" not in tb, tb
    assert "unhandled mesh failure" not in "".join(_text(m) for m in c.msgs), "told of once, when spawned"
    assert _ok(k.run("1 + 1")).result == "2", "the kernel lives on"


KILL = """\
import os, signal
from monarch_nb.actor import Actor, endpoint, SupervisionError
class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()
{var} = {mesh}.spawn("{var}", Pid)
_pids = {var}.pid.call().get()
for r in {ranks}:
    os.kill(_pids.item(gpus=r), signal.SIGKILL)
"""


def test_a_failure_the_cell_caught_shows_no_unhandled_notice(k: Kernel) -> None:
    _ok(k.run("%mesh spawn caught --per-host gpus=2"))
    _ok(k.run(COUNT_FAULTS))
    cell = k.execute(
        KILL.format(var="pids", mesh="caught", ranks="[1]")
        + "try:\n    pids.pid.call().get(timeout=30)\nexcept SupervisionError as e:\n    print('caught:', e.cause)\n"
        # the failure is reported while the cell still runs
        + poll("faults.count('pids') == 1", 30, "the failure's report")
    )
    c = _ok(k.wait(cell))
    assert "caught: process" in c.stream() and "SIGKILL" in c.stream(), c.msgs
    # nothing "unhandled" in the cell, then or later: the next cell runs after it
    _ok(k.run("1"))
    assert not [m for m in _of(k, cell) if "unhandled" in _text(m)], _of(k, cell)


def test_a_failure_an_async_cell_caught_by_awaiting_shows_no_unhandled_notice(k: Kernel) -> None:
    # the error reaches the cell through ``await`` (an async cell), not ``.get()``: the kernel is
    # told of it all the same, so the failure it names needs no "unhandled" notice
    _ok(k.run("%mesh spawn acaught --per-host gpus=2"))
    _ok(k.run(COUNT_FAULTS))
    cell = k.execute(
        KILL.format(var="pids4", mesh="acaught", ranks="[1]")
        + "try:\n    await pids4.pid.call()\nexcept SupervisionError as e:\n    print('caught:', e.cause)\n"
        + poll("faults.count('pids4') == 1", 30, "the failure's report")
    )
    c = _ok(k.wait(cell))
    assert "caught: process" in c.stream() and "SIGKILL" in c.stream(), c.msgs
    _ok(k.run("1"))
    assert not [m for m in _of(k, cell) if "unhandled" in _text(m)], _of(k, cell)


def test_a_failure_the_cell_raised_and_did_not_catch_is_not_told_again(k: Kernel) -> None:
    # issue 14: the kernel's default hook prints nothing for a failure already raised into user
    # code in the same cell; the cell's own error is where the user reads it
    _ok(k.run("%mesh spawn uncaught --per-host gpus=3"))
    _ok(k.run(COUNT_FAULTS))
    cell = k.execute(
        KILL.format(var="pids2", mesh="uncaught", ranks="[1, 2]")
        + "try:\n    pids2.pid.call().get(timeout=30)\nfinally:\n"
        + textwrap.indent(poll("faults.count('pids2') == 2", 30, "both failures' reports"), "    ")
    )
    c = k.wait(cell)
    assert c.error and c.error["ename"] == "SupervisionError", c.msgs
    assert "SIGKILL" in "".join(c.error["traceback"]), c.error
    _ok(k.run("1"))
    texts = [_text(m) for m in _of(k, cell)]
    assert not [t for t in texts if "unhandled mesh failure" in t], texts


def test_a_long_cell_hears_of_a_failure_its_code_did_not_see(k: Kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "seen"
    _ok(k.run("%mesh spawn unseen --per-host gpus=2"))
    # the hold before telling a running cell, shortened for the test (5 s by default)
    _ok(k.run("import sys\n_O = sys.modules['monarch_nb.magics._output']\n_hold, _O.NOTICE_HOLD = _O.NOTICE_HOLD, 0.5"))
    try:
        # the cell goes on with other work (not waiting on a call) until the test saw the notice
        cell = k.execute(
            KILL.format(var="pids3", mesh="unseen", ranks="[1]") + poll(f"os.path.exists({str(flag)!r})", 60, "the test")
        )
        # as Monarch's, the failure is the actor mesh's; our words name the proc mesh too
        notice = k.wait_msg(
            lambda m: m["parent_header"].get("msg_id") == cell.msg_id and "unhandled mesh failure: mesh 'pids3'" in _text(m),
            30,
            "the notice while the cell still runs",
        )
        assert "proc mesh 'unseen' rank 1" in _text(notice) and "SIGKILL" in _text(notice), _text(notice)
        flag.touch()
        _ok(k.wait(cell))
        assert sum("unhandled mesh failure" in _text(m) for m in _of(k, cell)) == 1
    finally:
        _ok(k.run("_O.NOTICE_HOLD = _hold"))


def test_long_calls_show_ranks_replied(k: Kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "go"
    _ok(k.run("%mesh spawn slow --per-host gpus=2"))
    # rank 0 replies at once; rank 1 only once the test has seen the progress line
    cell = k.execute(
        "%%mesh exec slow\nimport os\nfrom monarch_nb.actor import current_rank\n"
        + "if current_rank().rank == 1:\n"
        + textwrap.indent(poll(f"os.path.exists({str(flag)!r})", 60), "    ")
    )
    m = k.wait_msg(
        lambda m: (
            m["parent_header"].get("msg_id") == cell.msg_id
            and m["msg_type"] in ("display_data", "update_display_data")
            and "1/2 ranks replied" in m["content"]["data"].get("text/plain", "")
        ),
        20,
        "a progress line",
    )
    # plain text that needs no emoji font
    assert m["content"]["data"]["text/plain"].startswith("waiting on %%mesh exec on slow: 1/2 ranks replied")
    assert m["content"]["data"]["text/plain"].isascii()
    flag.touch()
    _ok(k.wait(cell))


def test_spawning_a_large_mesh_shows_procs_up_as_a_progress_bar(k: Kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "go"
    # half the procs come up at once; the other half wait in their bootstrap for the test's flag
    cell = k.execute(
        "import os\nfrom monarch_nb.actor import this_host, current_rank\n"
        "def half_waits():\n"
        "    if current_rank().rank >= 8:\n"
        + textwrap.indent(poll(f"os.path.exists({str(flag)!r})", 60), "        ")
        + "big = this_host().spawn_procs(per_host={'gpus': 16}, name='big', bootstrap=half_waits)\nlen(big)"
    )

    def bar(m: dict, what: str) -> bool:  # type: ignore[type-arg]
        return (
            m["parent_header"].get("msg_id") == cell.msg_id
            and m["msg_type"] in ("display_data", "update_display_data")
            and what in m["content"]["data"].get("text/plain", "")
        )

    m = k.wait_msg(lambda m: bar(m, "8/16 procs up"), 60, "a progress bar at 8 of 16 procs up")
    text = m["content"]["data"]["text/plain"]
    # plain ASCII that needs no emoji font, and the browser's own bar where HTML shows
    assert text.startswith("waiting on spawn of 16 procs 'big': 8/16 procs up [##########..........] ("), text
    assert text.isascii()
    assert '<progress value="8" max="16"' in m["content"]["data"]["text/html"], m["content"]
    flag.touch()
    c = _ok(k.wait(cell, timeout=60))
    assert c.result == "16"
    # the bar goes once the spawn returned
    display_id = m["content"]["transient"]["display_id"]
    last = [x for x in c.msgs if x["msg_type"] == "update_display_data" and x["content"]["transient"]["display_id"] == display_id]
    assert last and last[-1]["content"]["data"]["text/plain"] == "", last[-1:]
    _ok(k.run("big.stop().get()"))


def test_a_flood_is_thinned_and_the_kernel_stays_responsive(k: Kernel) -> None:
    _ok(k.run("%mesh spawn flood --per-host gpus=16"))
    flood = _ok(k.run("%%mesh exec flood --no-aggregate --no-block\nfor i in range(6250): print('flood line', i)"))
    # trivial cells keep answering while 100,000 lines arrive
    for i in range(3):
        assert _ok(k.run(f"{i} + 1", timeout=10)).result == str(i + 1)
    done = "len(L.logs(flood, tail=1)) == 16 and all(r['line'] == 'flood line 6249' for r in L.logs(flood, tail=1))"
    _ok(k.run("import monarch_nb.logs as L\n" + poll(done, 60, "every rank's last flood line in the logs"), timeout=90))
    marker = k.wait_msg(
        lambda m: (
            m["parent_header"].get("msg_id") == flood.msg_id
            and "lines suppressed — %mesh logs flood"
            in (m["content"].get("text") or m["content"].get("data", {}).get("text/plain", ""))
        ),
        20,
        "the suppression marker",
    )
    assert marker
    c = _ok(k.run("sum(len(L.logs(flood, rank=r)) for r in range(16))"))
    assert int(c.result) == 100_000  # nothing lost from the logs


def test_unaggregated_lines_go_out_at_once_then_at_most_five_times_a_second(k: Kernel) -> None:
    # a stream message per arrival (two dozen in the first 0.4 s of a flood) made JupyterLab
    # render the cell's whole output again each time: the page answered after 2-3 s
    _ok(k.run("%mesh spawn burst --per-host gpus=4"))
    # about a second of output (the ranks' own pace), so that several batches go out
    code = "%%mesh exec burst --no-aggregate\nimport time\nfor i in range(3000):\n    print('burst line', i)\n"
    c = _ok(k.run(code + "    if i % 300 == 299: time.sleep(0.1)", timeout=90))
    sent = [m["header"]["date"].timestamp() for m in c.msgs if m["msg_type"] == "stream" and "burst line" in m["content"]["text"]]
    assert len(sent) >= 3, f"{len(sent)} stream messages for a second of output"
    # the last is the cell's end, which sends what is held at once
    gaps = [b - a for a, b in itertools.pairwise(sent[:-1])]
    assert min(gaps) >= 0.1, f"{len(sent)} stream messages, {min(gaps) * 1000:.0f} ms apart at the least"
    assert c.stream().count("burst line") >= 3000  # none lost to the spacing (the budget is 10,000)
    _ok(k.run("%mesh stop burst"))


def test_a_flood_of_one_rank_leaves_the_other_ranks_lines_in_the_cell(k: Kernel) -> None:
    # the line budget went to the flooding rank: the other ranks' lines, and every rank's
    # stderr at the end, were all counted as suppressed
    _ok(k.run("%mesh spawn noisy --per-host gpus=3"))
    code = (
        "%%mesh exec noisy\nimport sys\nfrom monarch_nb.actor import current_rank\nr = current_rank().rank\n"
        "if r == 0:\n    for i in range(30_000): print('noise', i)\nelse:\n    print('quiet rank', r)\n"
        "print('finished on rank', r, file=sys.stderr)"
    )
    c = _ok(k.run(code, timeout=90))
    out, err = c.stream(), c.stream("stderr")
    assert "[ranks 1-2 ×2] quiet rank 1…2\n" in out, out[-2000:]
    assert re.search(r"\[(ranks 0-2 ×3|0)\] finished on rank", err), err
    assert "lines suppressed — %mesh logs noisy" in err, err
    noise = [int(m) for m in re.findall(r"^\[0\] noise (\d+)$", out, re.M)]
    assert 10_000 <= len(noise) < 30_000 and noise == sorted(noise), len(noise)  # thinned, in order


def test_connect_after_a_kernel_restart_finds_meshes_and_namespaces() -> None:
    a = Kernel()
    try:
        _ok(a.run("%mesh connect"))
        _ok(a.run("%mesh spawn keep --per-host gpus=2"))
        pids = _ok(a.run("%%mesh exec keep\nimport os\nanswer = 42\nos.getpid()")).result
        # procs of the Python API persist too, with no %mesh name to find them by
        anon = _ok(
            a.run("from monarch_nb.actor import this_host\nunnamed = this_host().spawn_procs(per_host={'gpus': 1})\nunnamed.name")
        ).result.strip("'")
        anon_pid = _ok(a.run("unnamed._procs[0].pid")).result
    finally:
        a.close()
    b = Kernel()
    try:
        # before a connect, the status table says whose they were: a controller that left
        table = _ok(b.run("%mesh status")).result
        assert re.search(rf"{anon} \(persistent\)\s+gone \([0-9a-f]{{8}}\)\s", table), table
        c = _ok(b.run("%mesh connect"))
        assert "keep {gpus: 2}" in c.stream()
        # they held their host (and its GPUs) with nothing to say so: %mesh stop --all left them,
        # and the allocator's lease does not run out while a controller is attached
        assert (
            f"found {anon} {{gpus: 1}}: procs an earlier kernel spawned with no %mesh name; `%mesh stop {anon}` frees them"
            in c.stream()
        ), c.stream()
        assert _ok(b.run("%%mesh exec keep\nos.getpid()")).result == pids
        assert _ok(b.run("%%mesh exec keep\nanswer")).result.count("42") == 2
        assert f", {anon_pid})" in _ok(b.run(f"%%mesh exec {anon}\nimport os\nos.getpid()")).result
        _ok(b.run(f"%mesh stop {anon}"))
        _ok(b.run("%mesh stop keep"))
        assert anon not in _ok(b.run("%mesh status")).result
    finally:
        b.close()


def test_kernelspec_install_gives_a_kernel_with_the_magics_loaded(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "monarch_nb", "kernelspec", "install", "--prefix", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    kern = Kernel(load_ext=False, kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    try:
        assert "%mesh connect" in _ok(kern.run("%mesh help")).stream()
    finally:
        kern.close()


def _widget_values(k: Kernel) -> list[str]:
    return [
        str(m["content"]["data"].get("state", {}).get("value", "")) for m in k.log if m["msg_type"] in ("comm_open", "comm_msg")
    ]


def test_dashboard_shows_every_rank_and_turns_a_killed_one_red(k: Kernel) -> None:
    import time

    _ok(k.run("%mesh spawn dash --per-host gpus=4"))
    c = _ok(k.run("dash_view = %mesh dashboard dash\ndash_view"))
    assert (
        "application/vnd.jupyter.widget-view+json"
        in next(m for m in c.msgs if m["msg_type"] == "execute_result")["content"]["data"]
    )
    # drawn by the dashboard's own thread: the cell does not wait for its first refresh
    k.wait_msg(lambda m: 'class="mnb-grid"' in str(m["content"].get("data", {})), 15, "the grid drawn")
    grid = next(v for v in reversed(_widget_values(k)) if 'class="mnb-grid"' in v)
    assert len(re.findall(r'class="mnb-rank mnb-state-(?:idle|busy|starting)"', grid)) == 4, re.findall(r'title="([^"]*)"', grid)
    pid = int(_ok(k.run("dash._procs[2].pid")).result)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    # the update comes from the dashboard's own thread, with no cell running
    k.wait_msg(
        lambda m: m["msg_type"] == "comm_msg" and 'mnb-state-failed" data-rank="2"' in str(m["content"]["data"].get("state", {})),
        3,
        "rank 2 drawn as failed",
    )
    assert time.monotonic() - t0 < 3
    _ok(k.run("dash_view.close()"))


def test_dashboard_lists_paused_ranks_and_its_console_drives_pdb(k: Kernel) -> None:
    _ok(k.run("%mesh spawn dbgdash --per-host gpus=2"))
    code = (
        "from monarch_nb.actor import Actor, endpoint, current_rank\n"
        "class Stopper(Actor):\n"
        "    @endpoint\n"
        "    def stop_here(self):\n"
        "        secret = 40 + current_rank().rank\n"
        "        breakpoint()\n"
        "        return secret\n"
        "stoppers = dbgdash.spawn('stoppers', Stopper)\n"
        "pending = stoppers.slice(gpus=1).stop_here.call_one()\n"
        "view = %mesh dashboard dbgdash\n"
        "view"
    )
    _ok(k.run(code))
    k.wait_msg(
        lambda m: m["msg_type"] == "comm_msg" and 'mnb-state-paused" data-rank="1"' in str(m["content"]["data"].get("state", {})),
        15,
        "rank 1 drawn as paused",
    )
    _ok(k.run(poll("view._sids", 15, "the dashboard to list the paused session")))
    # what the attach button and the console's send button do (each on a thread of its own: the
    # kernel runs cells meanwhile; the console says when the rank answered)
    answered = poll("view._running('pdb') is None", 30, "the rank to answer")
    _ok(k.run("view._attach('stoppers', 1)\n" + answered))
    c = _ok(k.run("view.console_in.value = 'p secret'\nview._console_send()\n" + answered + "view.console_out.value"))
    # (current_rank() is the rank within the called slice, as in Monarch: 0 here)
    assert "(Pdb) p secret\\n40" in c.result, c.result
    c = _ok(
        k.run("view.console_in.value = 'c'\nview._console_send()\n" + answered + "print(pending.get(timeout=30))\nview.close()")
    )
    assert c.stream().strip() == "40"


def test_a_pdb_command_sent_from_the_dashboard_leaves_the_kernel_free(k: Kernel, tmp_path) -> None:
    # the console's send ran pdb's command in the click's callback: an "n" over a line that
    # takes long held the kernel (no cell, no interrupt) until the rank stopped again, up to 60 s
    flag = tmp_path / "go"
    code = (
        "import os\nfrom monarch_nb.actor import Actor, endpoint\n"
        "def wait_for_flag(flag):\n" + textwrap.indent(poll("os.path.exists(flag)", 60, "the test's flag"), "    ") + "\n"
        "class Stepper(Actor):\n"
        "    @endpoint\n"
        "    def go(self, flag):\n"
        "        breakpoint()\n"
        "        wait_for_flag(flag)\n"
        "        return 'went on'\n"
        "%mesh spawn dbgslow --per-host gpus=1\n"
        "steppers = dbgslow.spawn('steppers', Stepper)\n"
        f"pending = steppers.go.call_one({str(flag)!r})\n"
        "slow_view = %mesh dashboard dbgslow\n"
    )
    _ok(k.run(code))
    try:
        _ok(k.run(poll("slow_view._sids", 15, "the dashboard to list the paused session")))
        answered = poll("slow_view._running('pdb') is None", 30, "the rank to answer")
        _ok(k.run("slow_view._attach('steppers', 0)\n" + answered))
        t = time.monotonic()
        c = _ok(
            k.run(
                "slow_view.console_in.value = 'n'\nslow_view._console_send()\n"
                # a second command while the first runs: refused, and left typed
                "slow_view.console_in.value = 'p flag'\nslow_view._console_send()\n"
                "print(slow_view.console_out.value)\nprint(repr(slow_view.console_in.value))",
                timeout=30,
            )
        )
        assert time.monotonic() - t < 1.5, time.monotonic() - t
        out = c.stream()
        assert (
            "(Pdb) n\n… (the rank runs it; since " in out
            and "(the rank has not answered yet, asked at " in out
            and "one command at a time" in out
        ), out
        assert out.strip().endswith("'p flag'"), out
        # a cell runs meanwhile, and the console still waits for the rank
        t = time.monotonic()
        c = _ok(k.run("print(slow_view.console_out.value)", timeout=30))
        assert time.monotonic() - t < 1.5 and "(the rank runs it; since " in c.stream(), c.stream()
        flag.touch()
        c = _ok(k.run(answered + "print(slow_view.console_out.value)"))
        assert "(Pdb) n\n" in c.stream() and "-&gt; return &#x27;went on&#x27;" in c.stream(), c.stream()
        assert "the rank runs it" not in c.stream(), c.stream()
        c = _ok(k.run("slow_view._console_send()\n" + answered + "print(slow_view.console_out.value)"))
        assert "(Pdb) p flag\n" in c.stream() and str(flag) in c.stream(), c.stream()
        c = _ok(
            k.run("slow_view.console_in.value = 'c'\nslow_view._console_send()\n" + answered + "print(pending.get(timeout=30))")
        )
        assert c.stream().strip().endswith("went on"), c.stream()
    finally:
        flag.touch()
        _ok(k.run("slow_view.close()\n%mesh stop dbgslow"))


def test_the_dashboard_shows_a_rank_stopped_post_mortem_and_its_console_lets_the_error_go_on(k: Kernel) -> None:
    """A rank resumed from its breakpoint whose endpoint then raises stops again, post-mortem:
    the dashboard lists it as such, and its console inspects the frame that raised and ends it."""
    _ok(k.run("%mesh spawn dbgpm --per-host gpus=1"))
    code = (
        "from monarch_nb.actor import Actor, endpoint\n"
        "class Raiser(Actor):\n"
        "    @endpoint\n"
        "    def go(self):\n"
        "        n = 7\n"
        "        breakpoint()\n"
        "        raise ValueError(f'n is {n}')\n"
        "raisers = dbgpm.spawn('raisers', Raiser)\n"
        "pending = raisers.go.call_one()\n"
        "pm_view = %mesh dashboard dbgpm\n"
        "pm_view"
    )
    _ok(k.run(code))
    _ok(k.run(poll("pm_view._sids", 15, "the dashboard to list the paused session")))
    answered = poll("pm_view._running('pdb') is None", 30, "the rank to answer")
    _ok(
        k.run(
            "pm_view._attach('raisers', 0)\n" + answered + "pm_view.console_in.value = 'c'\npm_view._console_send()\n" + answered
        )
    )
    # the dashboard's own thread redraws the list (a cell's wait would skip the session: no stdin)
    labels = "[getattr(w, 'value', '') for row in pm_view.debug_view.children for w in getattr(row, 'children', ())]"
    _ok(k.run(poll(f"any('post-mortem after ValueError: n is 7' in t for t in {labels})", 15, "the post-mortem listed")))
    c = _ok(
        k.run(
            "pm_view._attach('raisers', 0)\n"
            + answered
            + "pm_view.console_in.value = 'p n'\npm_view._console_send()\n"
            + answered
            + "pm_view.console_out.value"
        )
    )
    assert "post-mortem: the call raised ValueError: n is 7" in c.result and "(Pdb) p n\\n7" in c.result, c.result
    c = _ok(
        k.run(
            "pm_view.console_in.value = 'c'\npm_view._console_send()\n" + answered + "print(pm_view.console_out.value)\n"
            "try:\n    pending.get(timeout=30)\nexcept Exception as e:\n    print('RAISED', type(e).__name__, e)\n"
            "pm_view.close()"
        )
    )
    out = c.stream()
    assert "(the rank left post-mortem: its call fails with ValueError: n is 7)" in out, out
    assert "RAISED ActorError" in out and "n is 7" in out, out


def test_synced_code_survives_a_kernel_restart(tmp_path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "kmod.py").write_text("WHO = 'synced'\n")
    a = Kernel()
    try:
        _ok(a.run("%mesh connect"))
        _ok(a.run("%mesh spawn persisted --per-host gpus=2"))
        c = _ok(a.run(f"%mesh sync {proj}"))
        assert "kmod.py" in c.result
        pids = _ok(a.run("%%mesh exec persisted\nimport os\nos.getpid()")).result
    finally:
        a.close()
    b = Kernel()
    try:
        assert "persisted" in _ok(b.run("%mesh connect")).stream()
        c = _ok(b.run("%%mesh exec persisted\nimport kmod\n(kmod.WHO, os.getpid(), '/mnb-code/ws/' in kmod.__file__)"))
        assert c.result.count("('synced',") == 2 and c.result.count("True)") == 2
        assert [p for p in re.findall(r"\d{3,}", c.result)] == re.findall(r"\d{3,}", pids)
        _ok(b.run("%mesh stop persisted"))
    finally:
        b.close()


def test_breakpoint_in_an_exec_cell_without_stdin_is_skipped_not_hung(k: Kernel) -> None:
    _ok(k.run("%mesh spawn bpx --per-host gpus=2"))
    c = _ok(k.run("%%mesh exec bpx\nx = 5\nbreakpoint()\nx + 1"))  # the harness sends allow_stdin=False
    assert c.result.count("6)") == 2
    # where it stopped reads as the debugger's table and tracebacks name a cell, not by the
    # name the cell was compiled under (`<mesh exec In[7]>:3`, `/tmp/ipykernel_…/….py:5`)
    said = c.stream("stderr") + c.stream()
    assert re.search(r"breakpoint at Cell In\[\d+\], line 3 on rank 0 skipped \(no input\)", said), said
    code = (
        "from monarch_nb.actor import Actor, endpoint\n"
        "class Stop(Actor):\n"
        "    @endpoint\n"
        "    def here(self):\n"
        "        breakpoint()\n"
        "        return 1\n"
        "bpx.spawn('stops', Stop).here.call().get(timeout=60).values()"
    )
    c = _ok(k.run(code))
    said = c.stream("stderr") + c.stream()
    assert c.result == "[1, 1]" and re.search(r"breakpoint at Cell In\[\d+\], line 5 on rank 1 skipped", said), said
    assert "ipykernel_" not in said, said


@pytest.mark.timeout(90)
def test_stacks_of_a_mesh_the_notebook_does_not_hold_leaves_it_to_its_owner(k: Kernel) -> None:
    # another controller's mesh (this test process's): %mesh stacks looks at it as `monarch-nb
    # stacks` does, without adopting its procs into the kernel or taking their output
    from monarch_nb.actor import this_host

    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="notmine")
    try:
        st = _ok(k.run("%mesh stacks notmine")).result
        assert st.startswith("stacks of mesh 'notmine': 2 ranks"), st
        assert "thread MainThread" in st, st
        held = _ok(
            k.run(
                "from monarch_nb.actor import _context\n_c = _context.client()\n"
                "print('notmine' in _c.log_meshes, sorted({getattr(m, 'name', '') for m in _c.owned.values()}))"
            )
        ).stream()
        assert held.startswith("False ") and "'notmine'" not in held, held
        c = k.run("%mesh stacks nosuch")
        assert c.reply["content"]["status"] == "error", c.msgs
        assert "%mesh stacks: no mesh named 'nosuch' on this host's allocators" in c.stream("stderr"), c.msgs
    finally:
        pm.stop().get(timeout=30)


def test_debug_magics_list_cast_and_continue(k: Kernel) -> None:
    # a mesh spawned through the Python API under a name: its stacks by that name, as the
    # dashboard finds it (before any rank pauses: a wait then would open the debugger)
    _ok(k.run("from monarch_nb.actor import this_host\napi_held = this_host().spawn_procs(per_host={'gpus': 1}, name='apistk')"))
    st = _ok(k.run("%mesh stacks apistk")).result
    assert "thread MainThread" in st, st
    # monarch_nb's own threads waiting in the standard library are its internals, as its frames
    # are: shown only with them
    assert "mnb-" not in st and "threading.py" not in st, st
    st = _ok(k.run("from monarch_nb import debug\nprint(debug.stacks(api_held, internal=True))")).stream()
    assert "thread mnb-stdout-flush" in st, st
    _ok(k.run("api_held.stop().get(timeout=30)"))
    _ok(k.run("%mesh spawn dbgm --per-host gpus=2"))
    code = (
        "from monarch_nb.actor import Actor, endpoint, current_rank\n"
        "class Halt(Actor):\n"
        "    @endpoint\n"
        "    def halt(self):\n"
        "        mine = current_rank().rank * 7\n"
        "        breakpoint()\n"
        "        return mine\n"
        "halts = dbgm.spawn('halts', Halt)\n"
        "pending = halts.halt.call()\n"
        "from monarch_nb import debug\n" + poll("len(debug.sessions('halts')) == 2", 20)
    )
    _ok(k.run(code))
    table = _ok(k.run("%mesh debug")).stream()
    assert table.count("halts") == 2 and "paused" in table
    # where they stopped reads as IPython names the cell that defined the class
    assert re.search(r"Cell In\[\d+\], line 7", table) and "ipykernel_" not in table, table
    # ranks paused in pdb still answer for their stacks (the I/O thread does)
    st = _ok(k.run("%mesh stacks dbgm")).result
    assert re.search(r"\[ranks 0-1 \(2\)\] thread monarch-actor-driver \(halts\)\n\s+halt \(Cell In\[\d+\], line 7\)", st), st
    assert "no answer" not in st
    out = _ok(k.run("%mesh debug cast halts 0-1 p mine")).stream()
    assert "[0] 0" in out and "[1] 7" in out
    _ok(k.run("%mesh debug continue"))
    assert _ok(k.run("pending.get(timeout=30).values()")).result == "[0, 7]"


def test_the_default_fault_hook_stays_quiet_about_a_failure_the_cell_already_raised(k: Kernel) -> None:
    # an actor that fails on its own fails its caller's call; the same failure then reaches
    # the kernel's default unhandled_fault_hook, which must not show it a second time
    start = len(k.log)
    _ok(k.run("%mesh spawn quiet --per-host gpus=2"))
    _ok(
        k.run(
            "from monarch_nb.actor import Actor, endpoint\n"
            "import monarch_nb.actor._supervision as _sup\n"
            "class Quits(Actor):\n"
            "    @endpoint\n"
            "    def quit(self) -> None:\n"
            "        raise SystemExit(3)\n"
            "hooked = _sup._hook_calls\n"
            "q = quiet.spawn('q', Quits)"
        )
    )
    c = k.run("q.slice(gpus=1).quit.call_one().get(timeout=30)")
    assert c.error and c.error["ename"] == "SupervisionError", c.error
    _ok(k.run(poll("_sup._hook_calls == hooked + 1", 20, "the default hook to see the failure")))
    # a failure nobody raised into a cell is still shown; notices go out in order, so once it
    # is here one for the first failure would be too
    _ok(k.run("q.slice(gpus=0).quit.broadcast()"))

    def notice(m: dict, point: str) -> bool:  # type: ignore[type-arg]
        text = str(m["content"].get("text") or m["content"].get("data", {}).get("text/plain", ""))
        return "unhandled mesh failure" in text and f"Quits q{{'gpus': {point}}}" in text

    k.wait_msg(lambda m: notice(m, "0/2"), 30, "the notice of the failure nobody saw")
    assert not [m for m in k.log[start:] if notice(m, "1/2")]
    # its procs take no new actors (as Monarch's), and say what to do; `%mesh spawn` replaces them
    c = k.run("quiet.spawn('q2', Quits).quit.call().get(timeout=30)")
    assert c.error and c.error["ename"] == "RuntimeError", c.error
    assert c.error["evalue"].startswith("error spawning actor mesh: statuses: Failed(") and "spawn new procs" in c.error["evalue"]
    _ok(k.run("%mesh spawn quiet --per-host gpus=2"))
    _ok(k.run("class Pings(Actor):\n    @endpoint\n    def ping(self) -> int:\n        return 1"))
    assert _ok(k.run("quiet.spawn('p', Pings).ping.call().get(timeout=30).values()")).result == "[1, 1]"
    _ok(k.run("quiet.stop().get(timeout=30)"))


def test_an_interrupted_wait_says_the_call_runs_on_and_the_future_still_works(k: Kernel, tmp_path) -> None:
    # a kernel interrupt stops the wait, not the endpoint (as in Monarch); the user is told so, and
    # why a next call to those actors waits. An async cell's await is interrupted at once too:
    # ipykernel alone acts on it only once the awaited call returns (never, here)
    go = tmp_path / "go"
    _ok(
        k.run(
            "from monarch_nb.actor import Actor, endpoint, this_host\n"
            "import os, time\n"
            "class Gated(Actor):\n"
            "    @endpoint\n"
            "    def run(self, flag):\n"
            "        while not os.path.exists(flag):\n"
            "            time.sleep(0.02)\n"
            "        return 'finished'\n"
            "gated_procs = this_host().spawn_procs(per_host={'gpus': 2})\n"
            "gated = gated_procs.spawn('gated', Gated)\n"
            f"fut = gated.run.call({str(go)!r})\n"
            f"one = gated.slice(gpus=0).run.call_one({str(go)!r})"
        )
    )
    for code, error, what, ranks in (
        ("fut.get()", "KeyboardInterrupt", "gated.run.call()", 2),
        ("await fut", "CancelledError", "gated.run.call()", 2),
        ("await one", "CancelledError", "gated.run.call_one()", 1),
    ):
        cell = k.execute(code)
        # the wait's progress bar (after 2 s; an await shows it as a get() does) says the kernel
        # is waiting: a print before would tell only that the print went out, and the interrupt
        # could land in its flush
        k.wait_msg(
            lambda m, cell=cell, what=what, ranks=ranks: (
                m["parent_header"].get("msg_id") == cell.msg_id  # type: ignore[misc]
                and m["msg_type"] in ("display_data", "update_display_data")
                and f"{what}: 0/{ranks} ranks replied" in m["content"]["data"].get("text/plain", "")
            ),
            20,
            f"{code!r} to show its wait",
        )
        k.interrupt()
        c = k.wait(cell, 20)
        assert c.error and c.error["ename"] == error, (code, c.msgs)
        tb = "\n".join(c.error["traceback"])
        assert f"only the wait stopped: {what} still runs on {ranks} of {ranks} ranks" in tb, (code, tb)
        # the cell's line, not the runtime's lock the interrupt landed in
        plain = re.sub(r"\x1b\[[0-9;]*m", "", tb)
        assert f"----> 1 {code}" in plain and "monarch_nb/" not in plain and "_debugwait" not in plain, plain
        # and %tb / %debug still find it (IPython records it only on its own display path)
        assert _ok(k.run("import sys as _sys\ntype(_sys.last_value).__name__")).result == repr(error)
    go.touch()
    assert _ok(k.run("[v for _, v in fut.get(timeout=20).items()], one.get(timeout=20)")).result == (
        "(['finished', 'finished'], 'finished')"
    )
    _ok(k.run("gated_procs.stop().get()"))


def test_an_interrupted_stream_says_the_call_runs_on(k: Kernel, tmp_path) -> None:
    # a loop over stream() interrupted while rank 1 still runs: a bare KeyboardInterrupt, where an
    # interrupted get() says the call goes on and why a next call to those actors waits. Since
    # stream() hands out its futures at once (as Monarch's), the wait is the item's get(), and the
    # item can be waited on again
    go = tmp_path / "go"
    _ok(
        k.run(
            "from monarch_nb.actor import Actor, current_rank, endpoint, this_host\n"
            "import os, time\n"
            "class Streams(Actor):\n"
            "    @endpoint\n"
            "    def run(self, flag):\n"
            "        while current_rank().rank and not os.path.exists(flag):\n"
            "            time.sleep(0.02)\n"
            "        return current_rank().rank\n"
            "streams_procs = this_host().spawn_procs(per_host={'gpus': 2})\n"
            "streams = streams_procs.spawn('streams', Streams)"
        )
    )
    # no flush: the print is out (ipykernel's output thread sends it) while the loop waits
    cell = k.execute(f"for f in streams.run.stream({str(go)!r}):\n    print('got', f.get())")
    k.wait_msg(lambda m: m["parent_header"].get("msg_id") == cell.msg_id and m["msg_type"] == "stream", 20, "the first item")
    k.interrupt()
    c = k.wait(cell, 20)
    assert c.error and c.error["ename"] == "KeyboardInterrupt", c.msgs
    tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c.error["traceback"]))
    assert "only the wait stopped: streams.run.stream() item goes on" in tb and "monarch_nb/" not in tb, tb
    go.touch()
    # the interrupted call ends, and the actors take the next
    assert _ok(k.run(f"sorted(streams.run.call({str(go)!r}).get(timeout=20).values())")).result == "[0, 1]"
    _ok(k.run("streams_procs.stop().get()"))


def test_the_subcommands_take_a_variable_holding_a_mesh_of_the_python_api(k: Kernel, tmp_path) -> None:
    # procs = this_host().spawn_procs(...) (the README's and Monarch's way) has no %mesh name:
    # `%%mesh exec procs` said "no mesh named 'procs'"
    _ok(
        k.run(
            "from monarch_nb.actor import Actor, endpoint, this_host\n"
            "api_procs = this_host().spawn_procs(per_host={'gpus': 2})\n"
            "class Noop(Actor):\n"
            "    @endpoint\n"
            "    def ok(self) -> int:\n"
            "        return 1\n"
            "api_actors = api_procs.spawn('noop', Noop)"
        )
    )
    _ok(k.run("%%mesh exec api_procs\nimport os\nprint('hello from exec', flush=True)\nos.getpid()"))
    assert _ok(k.run("sorted(_.values()) == sorted(p.pid for p in api_procs._procs)")).result == "True"
    # an actor mesh's variable: its procs
    _ok(k.run("%%mesh exec api_actors\nos.getpid()"))
    assert _ok(k.run("sorted(_.values()) == sorted(p.pid for p in api_procs._procs)")).result == "True"
    logs = _ok(k.run("%mesh logs api_procs --tail 1")).stream()
    assert sorted(logs.splitlines()) == ["[0] hello from exec", "[1] hello from exec"], logs
    (tmp_path / "synced_mod.py").write_text("X = 5\n")
    _ok(k.run(f"%mesh sync {tmp_path} --mesh api_procs"))
    _ok(k.run("%%mesh exec api_procs\nimport synced_mod\nsynced_mod.X"))
    assert _ok(k.run("list(_.values())")).result == "[5, 5]"
    # an actor mesh's variable stops its actors, not the procs under them
    assert _ok(k.run("%mesh stop api_actors")).stream() == "stopped: api_actors (actors 'noop'; their procs run on)\n"
    assert _ok(k.run("api_actors._closed(), api_procs._stopped")).result == "(True, False)"
    c = _ok(k.run("%mesh stop api_procs"))
    assert c.stream().startswith("stopped: api_procs (anon-"), c.stream()
    assert _ok(k.run("api_procs._stopped")).result == "True"


def test_stop_by_name_and_stop_all_reach_meshes_of_the_python_api() -> None:
    """`%mesh status` lists meshes spawned with `this_host().spawn_procs()` as this kernel's, but
    `%mesh stop train` said "no mesh named 'train'" and `%mesh stop --all` "stopped: nothing (no
    running mesh of yours)": their persistent procs held the host until the lease."""
    kern = Kernel()
    try:
        _ok(
            kern.run(
                "from monarch_nb.actor import this_host\n"
                "procs = this_host().spawn_procs(per_host={'gpus': 1}, name='train')\n"
                "more = this_host().spawn_procs(per_host={'gpus': 2})\n"
                "held = this_host().spawn_procs(per_host={'gpus': 1}, name='held')"
            )
        )
        assert _ok(kern.run("%mesh stop train")).stream() == "stopped: train\n"
        c = _ok(kern.run("%mesh stop --all"))
        assert sorted(c.stream().removeprefix("stopped: ").strip().split(", ")) == sorted(
            [_ok(kern.run("print(more.name)")).stream().strip(), "held"]
        ), c.stream()
        assert _ok(kern.run("procs._stopped, more._stopped, held._stopped")).result == "(True, True, True)"
        assert "this kernel" not in _ok(kern.run("%mesh status")).result
    finally:
        kern.close()


def test_an_interrupted_spawn_says_how_to_reach_its_procs_and_stop_all_stops_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An interrupt during spawn_procs stops only the wait; the note said ".get() or await waits
    for it again" with no future to call it on, and the procs, once up, were no mesh of this
    kernel's: `%mesh stop --all` left them running."""
    flag, waiting = tmp_path / "go", tmp_path / "waiting"
    kern = Kernel()
    try:
        cell = kern.execute(
            "import os\nfrom monarch_nb.actor import this_host\n"
            "def waits():\n"
            f"    open({str(waiting)!r}, 'w').close()\n"
            + textwrap.indent(poll(f"os.path.exists({str(flag)!r})", 60), "    ")
            + "cut = this_host().spawn_procs(per_host={'gpus': 2}, name='cut', bootstrap=waits)"
        )
        # the spawn is under way: a proc runs its bootstrap, and the cell waits for it
        deadline = time.monotonic() + 60
        while not waiting.exists():
            assert time.monotonic() < deadline, "no proc of the spawn started within 60 s"
            time.sleep(0.05)
        kern.interrupt()
        err = kern.wait(cell, 30).error
        assert err is not None and err["ename"] == "KeyboardInterrupt", err
        tb = "\n".join(err["traceback"])
        assert "only the wait stopped: the spawn of 2 procs 'cut' goes on" in tb, tb
        assert "ProcMesh.lookup('cut') returns them, `%mesh stop cut` stops them" in tb, tb
        assert ".get() or await" not in tb, tb
        flag.touch()
        stopped = "import monarch_nb.mesh as M\nstopped = []\n" + poll(
            "(stopped.extend(M.stop(all=True)) or 'cut' in stopped)", 30
        )
        _ok(kern.run(stopped))
        assert "cut (persistent)" not in _ok(kern.run("%mesh status")).result
    finally:
        kern.close()


@pytest.mark.timeout(120)
def test_status_lists_this_kernels_meshes_under_an_allocator_that_does_not_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An allocator that does not answer (stopped, busy, its host cut off) was one "unreachable"
    row: the meshes this kernel holds there dropped out of the table, read as gone."""
    from conftest import AllocatorProc

    a = AllocatorProc(str(tmp_path), env={"MONARCH_NB_ZYGOTE_PRELOAD": ""})
    k = Kernel(env={"MONARCH_NB_RUNTIME_DIR": a.rdir})
    try:
        _ok(k.run("%mesh spawn held --per-host gpus=2"))
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            table = _ok(k.run("t = %mesh status\nprint(repr(t))", timeout=60)).stream()
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        rows = [ln.split() for ln in table.splitlines()]
        assert any("unreachable" in r and "held" not in r for r in rows), table  # the allocator's own row
        mine = [r for r in rows if "held" in r]
        assert len(mine) == 1 and {"this", "kernel", "0-1", "unreachable"} <= set(mine[0]), table
        assert "state unknown: its allocator did not answer" in table, table
        _ok(k.run("%mesh stop held", timeout=60))
    finally:
        k.close()
        a.stop()
