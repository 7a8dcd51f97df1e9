"""The dashboard tells the sidebar's story, through a real kernel (jupyter_client): one legend,
a mesh with a failed rank failed as a whole, the calls' errors, an aggregated log in order, a
stacks action, stop disabled once stopped, buttons whose actions never hold the kernel, and jobs
with a host the scheduler lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from html import unescape as html_unescape

import pytest
from _kernel import Kernel, poll
from conftest import wait_for

pytestmark = pytest.mark.timeout(180)

FAST = {"MONARCH_NB_ZYGOTE_PRELOAD": "", "MONARCH_NB_LEASE": "60"}
FAILED = "failed (healthy ranks still callable; new spawns refused)"

SETUP = """%load_ext monarch_nb
from monarch_nb.actor import Actor, endpoint, current_rank, this_host

class Steps(Actor):
    @endpoint
    def train(self, n):
        for s in range(n):
            print(f"step {s} loss={(n - s) * 0.1 + current_rank().rank * 0.01:.2f}", flush=True)

    @endpoint
    def lookup(self):
        if current_rank().rank == 1:
            raise KeyError("shard 1")
        return 0

# through the Python API, no %mesh connect: the dashboard finds it by name
pyapi = this_host().spawn_procs(per_host={"gpus": 4}, name="dashpy")
steps = pyapi.spawn("steps", Steps)
"""


def _ok(c):
    assert c.error is None, "\n".join(c.error["traceback"]) if c.error else ""
    return c


def _value(k: Kernel, expr: str) -> str:
    return _ok(k.run(f"print({expr})")).stream()


def test_dashboard_errors_log_stacks_failed_mesh_and_stop() -> None:
    from monarch_nb.server.manager import MeshManager

    k = Kernel(env=FAST)
    try:
        _ok(k.run(SETUP))
        _ok(k.run("d = %mesh dashboard dashpy"))
        # one legend, the sidebar's (served as /monarch-nb/api/state's "legend")
        legend = MeshManager().state()["legend"]
        html = _value(k, "d.children[2].value")
        assert re.findall(r'data-state="(\w+)"', html) == list(legend) == ["idle", "busy", "paused", "failed", "stopped"]
        for s, colour in legend.items():
            assert f'data-state="{s}"><b style="color:{colour}">' in html

        # a magic's error is one line, not a library traceback
        bad = k.run("%mesh dashboard nosuchmesh")
        assert bad.reply["content"]["status"] == "error", bad.msgs
        said = bad.stream("stderr")
        assert said.startswith("UsageError: %mesh dashboard: no mesh named 'nosuchmesh'") and "Traceback" not in said, bad.msgs

        # the log tail aggregated across ranks, never across a rank's own lines, in order
        _ok(k.run("steps.train.call(4).get()"))

        def steps_logged() -> list[str] | None:
            rows = [ln for ln in _value(k, "d.log_view.value").splitlines() if "step" in ln]
            return rows if len(rows) == 4 else None

        rows = wait_for(steps_logged, 15, "4 aggregated step lines in the dashboard's log")
        assert [r.split(" loss=")[0].split(">")[-1] for r in rows] == [f"[ranks 0-3 ×4] step {s}" for s in range(4)], rows

        # an endpoint error raised in a cell, and the rank's span, in the errors list
        failing = k.run("steps.lookup.call().get()")
        assert failing.error and failing.error["ename"] == "ActorError"
        _ok(k.run("d.refresh(timeout=60)"))
        errors = _value(k, "d.errors_view.value")
        assert re.search(r"In\[\d+\]: ActorError: Actor call steps.lookup failed", errors), errors
        assert re.search(r"rank 1 on \S+: endpoint steps.lookup raised", errors), errors
        # the ranks that failed and what the error said (the rank lines of str() since session 28)
        said = html_unescape(errors)
        assert "steps.lookup failed. KeyError on 1 of 4 ranks: 1 KeyError: 'shard 1'" in said, errors
        assert "Traceback" not in errors, errors

        # the stacks action: every rank's stack, merged (collected on a thread of its own)
        _ok(k.run("d.stacks_button.click()\n" + poll("'mnb-stacks' in d.stacks_view.value", 30, "the stacks")))
        stacks = _value(k, "d.stacks_view.value")
        assert "mnb-stacks" in stacks and 'data-ranks="0-3"' in stacks, stacks[:2000]

        # a %%mesh exec that raises on the ranks
        _ok(k.run("%mesh connect"))  # re-attaches dashpy by name, for %%mesh exec
        assert k.run("%%mesh exec dashpy\n1 / 0").error
        _ok(k.run("d.refresh(timeout=60)"))
        errors = _value(k, "d.errors_view.value")
        assert re.search(r"In\[\d+\]: ExecError: .*ZeroDivisionError on 4 of 4 ranks", errors), errors
        assert errors.count("endpoint steps.lookup raised") == 1, errors  # once, however often it is asked

        # a killed rank fails the mesh as a whole, in the sidebar's words, with what to do
        pid = int(_ok(k.run("pyapi._procs[2].pid")).result)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: FAILED in _value(k, "d.header.value"), 15, "the dashboard to say the mesh failed")
        header = _value(k, "d.header.value")
        assert 'data-state="failed"' in header and "%mesh stop dashpy" in header, header
        side = next(m for m in MeshManager().state()["meshes"] if m["name"] == "dashpy")
        assert (side["state"], side["label"]) == ("failed", FAILED)
        assert "rank 2 on" in _value(k, "d.errors_view.value")
        assert _value(k, "d.stop_button.disabled").strip() == "False"

        # stopping it from the dashboard disables its stop (and stacks) buttons, at once
        _ok(k.run("d.stop_button.click()"))
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "True True"
        wait_for(lambda: "stopped at" in _value(k, "d.stop_view.value"), 30, "the stop's result")
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "True True"
        # redrawn by the dashboard's own thread: the click does not hold the kernel for it
        wait_for(lambda: 'data-state="stopped"' in _value(k, "d.header.value"), 15, "the header to say stopped")
        # a spawn that fails joins the errors too
        assert k.run("pyapi.spawn('again', Steps)").error
        assert re.search(
            r"In\[\d+\]: MeshClosedError: `ProcMesh` has already been stopped: proc mesh &#x27;dashpy&#x27;",
            _value(k, "d.errors_view.value"),
        )
        _ok(k.run("d.close()"))
    finally:
        k.close("dashpy")


def test_dashboard_and_sidebar_list_jobs_and_a_lost_host() -> None:
    from monarch_nb.job import job_load, list_jobs
    from monarch_nb.job._named import named_job_path
    from monarch_nb.server.manager import MeshManager

    k = Kernel(env=FAST)
    try:
        _ok(k.run("%load_ext monarch_nb\n%mesh launch process dashjob --hosts 2"))
        _ok(k.run("procs = dashjob.spawn_procs(per_host={'gpus': 1}, name='dj')\nd = %mesh dashboard procs"))
        _ok(k.run("d._jobs_at = -1e9; d.refresh(timeout=60)"))
        jobs = _value(k, "d.jobs_view.value")
        assert re.search(r'data-job="dashjob" data-state="running"><td>dashjob</td><td>process</td><td>[0-9a-f]{8}</td>', jobs), (
            jobs
        )
        manager = MeshManager()
        row = next(j for j in manager.state()["jobs"] if j["name"] == "dashjob")
        assert (row["scheduler"], row["state"], row["hosts"], row["lost"]) == ("process", "running", 2, [])

        # the scheduler loses a host (its allocator dies): both say which
        hosts = job_load(named_job_path("dashjob"))._hosts
        slot, info = sorted(hosts.items())[1]
        os.kill(int(info["pid"]), signal.SIGKILL)
        _ok(k.run("d._jobs_at = -1e9; d.refresh(timeout=60)"))
        jobs = _value(k, "d.jobs_view.value")
        assert 'data-job="dashjob" data-state="lost"' in jobs and f"({slot} lost)" in jobs, jobs
        manager._jobs_at = -1e9
        manager._invalidate()
        row = next(j for j in manager.state()["jobs"] if j["name"] == "dashjob")
        assert (row["state"], row["lost"]) == ("lost", [slot]), row
        _ok(k.run("d.close()\n%mesh kill dashjob"))
    finally:
        k.close()
        if any(r["name"] == "dashjob" for r in list_jobs()):  # the test failed before %mesh kill
            subprocess.run([sys.executable, "-m", "monarch_nb", "job", "kill", "dashjob"], capture_output=True, timeout=60)


def test_dashboard_shows_a_failed_spawn_at_once_and_another_kernels_exec_error() -> None:
    k = Kernel(env=FAST)
    other = None
    try:
        _ok(
            k.run(
                "%load_ext monarch_nb\nfrom monarch_nb.actor import Actor, this_host\n"
                "class Bad(Actor):\n    def __init__(self):\n        raise ValueError('no shard for me')\n"
                "procs = this_host().spawn_procs(per_host={'gpus': 4}, name='dashfail')\n"
                "d = %mesh dashboard dashfail"
            )
        )
        # a failing __init__: in the errors when the spawning cell's notice is, before any call raises it
        spawned = k.run("bad = procs.spawn('bad', Bad)")
        assert spawned.error is None, spawned.msgs

        def failure_listed() -> str | None:
            errors = html_unescape(_value(k, "d.errors_view.value"))
            return errors if "actor bad failed on ranks 0-3" in errors else None

        # one line for the four ranks' events
        errors = wait_for(failure_listed, 30, "the failed spawn in the dashboard's errors")
        assert re.search(r"actor bad failed on ranks 0-3: ValueError: no shard for me", errors), errors
        assert "In[" not in errors, errors  # no cell raised it: the supervision event did

        # its __init__ span and, once its allocator has it, each rank's state say it again: still
        # listed once
        def ranks_failed() -> bool:
            _ok(k.run("d.refresh(timeout=60)"))
            return _value(k, "d.grid_view.value").count("mnb-state-failed") == 4

        wait_for(ranks_failed, 30, "the allocator to report the four ranks failed")
        assert html_unescape(_value(k, "d.errors_view.value")).count("no shard for me") == 1

        # a %%mesh exec that fails in another kernel reaches this kernel's dashboard (through the spans)
        other = Kernel(env=FAST)
        _ok(other.run("%load_ext monarch_nb\n%mesh connect"))
        assert other.run("%%mesh exec dashfail\nx = 1\n1 / 0").error

        def exec_listed() -> str | None:
            _ok(k.run("d.refresh(timeout=60)"))
            errors = html_unescape(_value(k, "d.errors_view.value"))
            return errors if "mesh exec raised" in errors else None

        errors = wait_for(exec_listed, 30, "the other kernel's exec error in the dashboard")
        # one line for the four ranks, with the error
        assert re.search(r"ranks 0-3 on \S+: mesh exec raised ZeroDivisionError: division by zero", errors), errors
        assert errors.count("mesh exec raised") == 1, errors

        # and a spawn that fails there: through its __init__ span. On procs whose actors have not
        # failed (dashfail's take no new actors, as Monarch's)
        _ok(k.run("procs2 = this_host().spawn_procs(per_host={'gpus': 4}, name='dashfail2')\nd2 = %mesh dashboard dashfail2"))
        _ok(other.run("%mesh connect"))  # re-attaches dashfail2
        spawned = other.run(
            "from monarch_nb.actor import Actor\nimport monarch_nb.mesh as M\n"
            "class Worse(Actor):\n    def __init__(self):\n        raise RuntimeError('elsewhere')\n"
            "w = M.get('dashfail2').spawn('worse', Worse)"
        )
        assert spawned.error is None, spawned.msgs

        def init_listed() -> str | None:
            _ok(k.run("d2.refresh(timeout=60)"))
            errors = html_unescape(_value(k, "d2.errors_view.value"))
            return errors if "elsewhere" in errors else None

        errors = wait_for(init_listed, 30, "the other kernel's failed spawn in the dashboard")
        assert re.search(r"ranks 0-3 on \S+: worse\S*\.__init__ raised RuntimeError: elsewhere", errors), errors
        _ok(k.run("d.close()\nd2.close()\nprocs.stop().get(timeout=60)\nprocs2.stop().get(timeout=60)"))
    finally:
        if other is not None:
            other.close()
        k.close("dashfail", "dashfail2")


def test_a_saved_dashboard_shows_the_mesh_where_the_widget_cannot_live(tmp_path) -> None:
    # saved and opened without its kernel (nbconvert, GitHub), the output showed ipywidgets' repr
    # of every child, CSS first: "Dashboard(children=(HTML(value='\n<style>\n.mnb-dash {…"
    import nbformat
    from nbconvert import HTMLExporter

    k = Kernel(env=FAST)
    try:
        _ok(k.run("%load_ext monarch_nb\n%mesh spawn saved --per-host gpus=2"))
        pid = int(re.findall(r"\d+", _ok(k.run("%%mesh exec saved --ranks 1\nimport os\nos.getpid()")).result)[-1])
        os.kill(pid, signal.SIGKILL)
        _ok(k.run("d = %mesh dashboard saved\n" + poll("'data-state=\"failed\"' in d.header.value", 30, "rank 1 to fail")))
        out = _ok(k.run("d"))
        [res] = [m["content"] for m in out.msgs if m["msg_type"] == "execute_result"]
        data = res["data"]
        # the live widget is still what JupyterLab shows while the kernel runs
        assert data["application/vnd.jupyter.widget-view+json"]["model_id"]
        text = data["text/plain"]
        assert text.startswith("Dashboard of mesh 'saved' {gpus: 2}: failed"), text
        assert "  idle: rank 0" in text or "  busy: rank 0" in text, text
        assert "  failed: rank 1\n" in text and re.search(r"rank 1 on \S+: .*SIGKILL", text), text
        assert "children=" not in text and "<style>" not in text, text

        # the notebook as JupyterLab saves it (no widget state): nbconvert shows the snapshot
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("%mesh dashboard saved", execution_count=1)
        cell.outputs = [nbformat.v4.new_output("execute_result", data=data, execution_count=1)]
        nb.cells.append(cell)
        page, _ = HTMLExporter().from_notebook_node(nb)
        assert 'class="mnb-rank mnb-state-failed" data-rank="1"' in page
        assert "a snapshot as of" in page and "Dashboard(children" not in page
        _ok(k.run("d.close()\n%mesh stop saved"))
    finally:
        k.close("saved")


@pytest.mark.timeout(30)
def test_a_cell_s_error_line_asks_the_error_for_its_ranks_not_its_str(monkeypatch) -> None:
    """The errors list named a cell's failing ranks by finding "on N of M ranks" in ``str(err)``:
    str() is worded as Monarch's, and a change of its words (it had no rank line before session
    28) left the dashboard's line without them. It asks the error (``_rank_summary``) now."""
    import threading
    from types import SimpleNamespace

    from monarch_nb.errors import ActorError, ExecError
    from monarch_nb.widgets._dashboard import Dashboard

    tb = "Traceback (most recent call last):\n  File \"train.py\", line 9, in lookup\nKeyError: 'shard 1'\n"
    raised = ActorError(KeyError("shard 1"), tb, message="Actor call steps.lookup failed.")
    err = ActorError(raised.exception, tb, rank=1, message="Actor call steps.lookup failed.")._set_group(
        "steps.lookup", 4, {1: raised}
    )
    # str() worded otherwise: no rank line in it
    monkeypatch.setattr(ActorError, "_plain_rank_lines", lambda self: "")
    monkeypatch.setattr(ExecError, "__str__", lambda self: "the cell failed\nZeroDivisionError: division by zero")
    cell_tb = 'Traceback (most recent call last):\n  File "<mesh exec In[3]>", line 1, in <module>\nZeroDivisionError: division by zero\n'
    failed = ExecError({r: ("ZeroDivisionError", "division by zero", cell_tb) for r in range(4)}, 4, "dashpy")

    view = SimpleNamespace(_lock=threading.Lock(), _errors=[], errors_view=SimpleNamespace(value=""))
    Dashboard._on_cell(view, SimpleNamespace(error_in_exec=err, execution_count=7))  # type: ignore[arg-type]
    Dashboard._on_cell(view, SimpleNamespace(error_in_exec=failed, execution_count=8))  # type: ignore[arg-type]
    assert view._errors[0].endswith(
        "In[7]: ActorError: Actor call steps.lookup failed. KeyError on 1 of 4 ranks: 1 KeyError: 'shard 1'"
    )
    assert view._errors[1].endswith(
        "In[8]: ExecError: the cell failed ZeroDivisionError on 4 of 4 ranks: 0-3 ZeroDivisionError: division by zero"
    ), view._errors
    assert "KeyError on 1 of 4 ranks: 1" in html_unescape(view.errors_view.value)


EVIL = "<img src=x onerror=alert(1)>"


def test_names_in_the_dashboard_are_escaped_and_a_cell_s_code_is_named_by_its_cell(monkeypatch) -> None:
    """The debug sessions' labels put the user's file, function, actor and host names into HTML
    as they were (a function named in a notebook cell ran as markup), the header the mesh's
    name, an error and the extent's labels; and a cell's file read ``/tmp/ipykernel_…/….py:10``
    where the sessions table says ``Cell In[1], line 10``."""
    import threading
    from types import SimpleNamespace

    import monarch_nb._errgroup as eg
    from monarch_nb.actor import Extent
    from monarch_nb.widgets._dashboard import Dashboard

    monkeypatch.setattr(eg, "cell_number", lambda f: 1 if f == "/tmp/ipykernel_9/123.py" else None)
    session = {
        "sid": "s1", "actor": EVIL, "rank": 0, "host": '"\'><b>x</b>', "file": "/tmp/ipykernel_9/123.py",
        "line": 10, "function": EVIL, "post_mortem": f"ValueError: {EVIL}",
    }  # fmt: skip
    view = SimpleNamespace(_sids=(), debug_view=SimpleNamespace(children=[]), _attach=lambda a, r: None)
    Dashboard._render_debug(view, [session])  # type: ignore[arg-type]
    label = view.debug_view.children[1].children[1].value
    assert "<img" not in label and "<b>x" not in label, label
    assert html_unescape(label) == (
        f"<code>{EVIL}</code> rank 0 on \"'><b>x</b> · Cell In[1], line 10 in {EVIL} · post-mortem after ValueError: {EVIL}"
    ), label

    def fail() -> None:
        raise RuntimeError(EVIL)

    view = SimpleNamespace(snapshot=fail, mesh=SimpleNamespace(name=EVIL), header=SimpleNamespace(value=""))
    Dashboard._refresh_now(view)  # type: ignore[arg-type]
    assert "<img" not in view.header.value and html_unescape(view.header.value).count(EVIL) == 2, view.header.value

    # the extent's labels are the user's too
    mesh = SimpleNamespace(name="m", _view=SimpleNamespace(labels=[EVIL], sizes=[1]), _stopped=False, extent=Extent([EVIL], [1]))
    snap = {"ranks": [], "hosts": [], "time": 0.0, "debug": []}
    noop = lambda *a: None  # noqa: E731
    w = SimpleNamespace  # every view the refresh sets
    view = SimpleNamespace(
        snapshot=lambda: snap, mesh=mesh, header=w(value=""), stop_button=w(), stacks_button=w(), grid_view=w(),
        hosts_view=w(), errors_view=w(), _render_latency=noop, _render_debug=noop, _render_log=noop,
        _lock=threading.Lock(), _errors=[], _saved_views=lambda *a: ("", ""), _running=lambda what: None,
        _stop_error="",
    )  # fmt: skip
    Dashboard._refresh_now(view)  # type: ignore[arg-type]
    assert "<img" not in view.header.value and EVIL in html_unescape(view.header.value), view.header.value


@pytest.mark.timeout(60)
def test_a_job_host_that_died_is_named_with_its_job_and_a_refresh_never_holds_the_kernel() -> None:
    # a job's allocator SIGKILLed: the refresh in the kernel (refresh(), the button, the first
    # one) waited ~2 s for the heartbeat to declare it lost, and then said "host vm unreachable:
    # ... allocator ipc://.../mnb-….sock lost", neither the job's host nor the job
    import time

    import monarch_nb.actor
    from monarch_nb.job import ProcessJob
    from monarch_nb.job._named import named_job_path
    from monarch_nb.widgets import Dashboard

    job = ProcessJob({"hosts": 2}, env=FAST)
    old_hook = monarch_nb.actor.unhandled_fault_hook
    monarch_nb.actor.unhandled_fault_hook = lambda failure: None  # the lost host's rank fails the mesh
    d = None
    try:
        procs = job.state(cached_path=named_job_path("deadjob")).hosts.spawn_procs(per_host={"gpus": 1}, name="deadmesh")
        d = Dashboard(procs, interval=60)
        assert d.refresh(timeout=60)
        slot, info = sorted(job._hosts.items())[1]
        os.kill(int(info["pid"]), signal.SIGKILL)
        held = []
        for _ in range(3):
            t = time.monotonic()
            d.refresh()
            held.append(time.monotonic() - t)
        assert max(held) < 0.5, held  # the rule is 100 ms; a loaded machine's scheduling aside

        def told() -> str | None:
            errors = html_unescape(d.errors_view.value) if d is not None else ""
            return errors if f"rank 1 on {slot} of job deadjob: its host was lost" in errors else None

        errors = wait_for(told, 20, "the dashboard to name the lost host and its job")
        assert "rank 1 of mesh 'deadmesh' is on no allocator that answered" in errors, errors
        assert "its procs died with it" in errors and "`monarch-nb job kill deadjob`" in errors, errors
        assert "unreachable: SupervisionError" not in errors, errors
        assert f"<b>{slot} of job deadjob</b>: unreachable (lost: its allocator does not answer)" in d.hosts_view.value
        assert "1 failed, 1 idle" in d._saved_text and f"rank 1 on {slot} of job deadjob: its host was lost" in d._saved_text
    finally:
        monarch_nb.actor.unhandled_fault_hook = old_hook
        if d is not None:
            d.close()
        if job.active:
            job.kill()


# a job of its own: its allocator stops a proc only once the message in hand is done (the
# session's allocator kills it after 2 s), so a stop lasts until the test lets it end
HOLDING = """from monarch_nb.actor import Actor, endpoint
from monarch_nb.job import ProcessJob
from monarch_nb.job._named import named_job_path
from monarch_nb.widgets import Dashboard

class Holder(Actor):
    @endpoint
    def hold(self, flag):
{wait}
job = ProcessJob({{"hosts": {hosts}}}, env={env!r})
procs = job.state(cached_path=named_job_path({job!r})).hosts.spawn_procs(per_host={{"gpus": 2}}, name={mesh!r})
holders = procs.spawn("holders", Holder)
d = Dashboard(procs, interval=60)
"""


def _holding(job: str, mesh: str, hosts: int, flag: str) -> str:
    import textwrap

    env = {**FAST, "MONARCH_NB_STOP_CLEANUP_TIMEOUT": "60"}
    wait = textwrap.indent(poll(f"os.path.exists({flag!r})", 60, "the test's flag"), "        ")
    return HOLDING.format(wait="        import os\n" + wait, hosts=hosts, env=env, job=job, mesh=mesh)


def _answered(k: Kernel, code: str, within: float = 1.5) -> str:
    """Run ``code``, failing unless the kernel answered within ``within`` seconds: the lag a
    user sees (the bound is loose for a loaded machine; the actions it guards take 5-60 s)."""
    import time

    t = time.monotonic()
    out = _ok(k.run(code, timeout=30)).stream()
    took = time.monotonic() - t
    assert took < within, f"the kernel took {took:.2f} s to answer {code!r}: {out}"
    return out


def _kill_job(k: Kernel, name: str) -> None:
    from monarch_nb.job import list_jobs

    k.close()
    if any(r["name"] == name for r in list_jobs()):
        subprocess.run([sys.executable, "-m", "monarch_nb", "job", "kill", name], capture_output=True, timeout=60)


@pytest.mark.timeout(150)
def test_the_stacks_and_stop_buttons_leave_the_kernel_free_while_they_run(tmp_path) -> None:
    # ipywidgets runs a click's callback in the kernel's shell handler: stacks on a mesh with a
    # stopped rank held the kernel 5 s a click (two clicks, 10 s), and stop mesh until the rank's
    # message in hand was done (stop_cleanup_timeout, up to 60 s here): no cell ran meanwhile
    import time

    flag = tmp_path / "go"
    k = Kernel(env=FAST)
    stopped_pid = 0
    try:
        _ok(k.run(_holding("btnjob", "btnmesh", 1, str(flag)), timeout=120))
        _ok(k.run("d.refresh(timeout=60)"))
        stopped_pid = int(_value(k, "procs._procs[1].pid"))
        os.kill(stopped_pid, signal.SIGSTOP)  # rank 1 answers nothing: stacks waits out its 5 s

        said = _answered(k, "d.stacks_button.click()\nd.stacks_button.click()\nprint(d.stacks_view.value)")
        assert said.startswith("<i>collecting the stacks of every rank… (since "), said
        assert "already running: the stacks show here when it ends" in said, said
        # a cell runs while the stacks are collected
        said = _answered(k, "print(d.stacks_view.value)")
        assert "collecting the stacks" in said, said

        def stacks() -> str | None:
            got = html_unescape(_value(k, "d.stacks_view.value"))
            return got if "mnb-stacks" in got else None

        got = wait_for(stacks, 30, "the stacks in the view")
        assert "no answer within 5 s" in got and "the process is stopped" in got, got[:3000]
        # a dashboard closed while its stacks are collected: close() does not wait for them, and
        # what they find later is dropped (its views are gone)
        _answered(k, "d2 = Dashboard(procs, interval=60)\nd2.stacks_button.click()\nd2.close()")
        _ok(k.run(poll("d2._running('stacks') is None", 30, "d2's stacks to end")))
        assert "collecting the stacks" in _value(k, "d2.stacks_view.value")
        os.kill(stopped_pid, signal.SIGCONT)
        stopped_pid = 0

        # the stop waits for rank 0's call (its message in hand) to end: until the flag
        _ok(k.run("held = holders.slice(gpus=0).hold.call_one(" + repr(str(flag)) + ")"))
        clicked = time.monotonic()
        said = _answered(
            k,
            "d.stop_button.click()\nd.stop_button.click()\nprint(d.stop_view.value)\nprint(d.stop_button.disabled, d.stacks_button.disabled)",
        )
        view, buttons = said.strip().splitlines()
        assert re.fullmatch(r"<i>stopping mesh btnmesh… \(since \d\d:\d\d:\d\d\)</i> · already running", view), said
        assert buttons == "True True", said
        for _ in range(3):  # the kernel answers cells while the stop runs, and the view still says so
            said = _answered(k, "print(d.stop_view.value, d.stop_button.disabled, d.stacks_button.disabled)")
            assert said.startswith("<i>stopping mesh btnmesh…") and said.strip().endswith("True True"), said
        # a refresh meanwhile leaves them disabled
        _ok(k.run("d.refresh(timeout=60)"))
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "True True"
        held_for = time.monotonic() - clicked
        flag.touch()

        def stopped() -> str | None:
            got = _value(k, "d.stop_view.value")
            return got if "stopped at" in got else None

        got = wait_for(stopped, 30, "the stop's result in the view")
        assert re.fullmatch(r"mesh btnmesh stopped at \d\d:\d\d:\d\d \(took \d+\.\d s\)\n", got), got
        assert float(re.findall(r"took (\S+) s", got)[0]) >= held_for - 0.1, (got, held_for)  # it waited for the flag
        wait_for(lambda: 'data-state="stopped"' in _value(k, "d.header.value"), 15, "the header to say stopped")
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "True True"
        assert "stop failed" not in _value(k, "d.errors_view.value")
        _ok(k.run("d.close()\njob.kill()"))
    finally:
        if stopped_pid:
            os.kill(stopped_pid, signal.SIGCONT)
        flag.touch()
        _kill_job(k, "btnjob")


@pytest.mark.timeout(150)
def test_a_stop_that_fails_on_a_lost_host_says_why_and_leaves_the_buttons_enabled() -> None:
    # a job's host SIGKILLed: stop waited in the kernel until the heartbeat declared it lost
    # (heartbeat_timeout, 5 s here), then said "stop failed: allocator ipc://... lost"
    k = Kernel(env={**FAST, "MONARCH_NB_HEARTBEAT_TIMEOUT": "5"})
    try:
        _ok(k.run(_holding("btnlost", "btnlostm", 2, "/nonexistent"), timeout=120))
        _ok(k.run("d.refresh(timeout=60)\nslot, info = sorted(job._hosts.items())[1]"))
        slot = _value(k, "slot").strip()
        os.kill(int(_value(k, "info['pid']")), signal.SIGKILL)
        said = _answered(
            k, "d.stop_button.click()\nprint(d.stop_view.value)\nprint(d.stop_button.disabled, d.stacks_button.disabled)"
        )
        assert said.startswith("<i>stopping mesh btnlostm… (since ") and said.strip().endswith("True True"), said
        said = _answered(k, "print(d.stop_view.value)")
        assert said.startswith("<i>stopping mesh btnlostm…"), said

        def failed() -> str | None:
            got = html_unescape(_value(k, "d.stop_view.value"))
            return got if "stop failed" in got else None

        got = wait_for(failed, 30, "the failed stop in the view")
        # in %mesh stop's words: what was stopped, the host and its job
        assert "stop failed: 2 procs of mesh 'btnlostm' stopped on the allocators that answered" in got, got
        assert re.search(rf"could not be reached: {slot} \(\S+, job btnlost\): lost", got), got
        assert "ranks 2-3 of mesh 'btnlostm' are on no allocator that answered" in got, got
        assert "`monarch-nb job kill btnlost`" in got, got
        assert "stop failed: 2 procs of mesh" in html_unescape(_value(k, "d.errors_view.value"))
        # the mesh may be stopped again: both buttons are enabled, and a refresh leaves them so
        _ok(k.run(poll("not d.stop_button.disabled", 15, "the stop button enabled again")))
        _ok(k.run("d.refresh(timeout=60)"))
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "False False"
        assert 'data-state="stopped"' not in _value(k, "d.header.value")
        _ok(k.run("d.close()\njob.kill()"))
    finally:
        _kill_job(k, "btnlost")


KILLING = """import os, threading
from monarch_nb.actor import Actor, endpoint, this_host
from monarch_nb.widgets import Dashboard

class Holder(Actor):
    @endpoint
    def hold(self, flag):
        open(flag, "w").close()
        threading.Event().wait()  # past the stop's stop_cleanup_timeout (2 s): it kills the proc

def holding(name, flag):
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name=name)
    held = procs.spawn("holders", Holder).slice(gpus=0).hold.call_one(flag)
    return procs, held
"""


@pytest.mark.timeout(150)
def test_what_a_dashboard_stop_killed_is_said_in_its_result_and_a_cell_s_stop_warns(tmp_path) -> None:
    # the dashboard stops on a thread of its own since session 31: its ProcsKilledWarning printed
    # in whatever cell ran then (or after it), and the stop's result did not say it
    k = Kernel(env=FAST)
    try:
        _ok(k.run(KILLING))
        for name in ("killdash", "killcell"):
            flag = str(tmp_path / name)
            _ok(
                k.run(
                    f"{name}, held_{name} = holding({name!r}, {flag!r})\n"
                    + poll(f"os.path.exists({flag!r})", 60, "rank 0 in its call")
                )
            )
        _ok(k.run("d = Dashboard(killdash, interval=60)\nd.refresh(timeout=60)"))
        _answered(k, "d.stop_button.click()")

        def stopped() -> str | None:
            got = html_unescape(_value(k, "d.stop_view.value"))
            return got if "stopped at" in got else None

        got = wait_for(stopped, 60, "the stop's result in the view")
        assert re.fullmatch(
            r"mesh killdash stopped at \d\d:\d\d:\d\d \(took \d+\.\d s\)<br><span class=\"mnb-errors\">stopping proc mesh "
            r"'killdash' killed 1 proc\(s\): rank 0 \(pid \d+ on \S+\): its actors had not finished the message in hand "
            r"and __cleanup__ after 2 s \(stop_cleanup_timeout\)</span>\n",
            got,
        ), got
        # a cell's own stop still warns, in that cell
        cell = _ok(k.run("killcell.stop().get(timeout=60)"))
        assert "ProcsKilledWarning: stopping proc mesh 'killcell' killed 1 proc(s): rank 0 (pid" in cell.stream("stderr")
        _ok(k.run("d.close()"))
        # and the dashboard's warned nowhere: no cell, not even one run after its stop, has it
        warned = "".join(m["content"]["text"] for m in k.log if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
        assert "killdash" not in warned, warned
    finally:
        k.close()


@pytest.mark.timeout(150)
def test_a_dashboard_whose_stop_failed_shows_the_mesh_stopped_once_a_cell_stopped_it(tmp_path) -> None:
    # before, it drew the mesh running (its ranks as they were) until stop was clicked again
    flag = tmp_path / "go"
    k = Kernel(env=FAST)
    try:
        _ok(k.run(_holding("failjob", "failmesh", 1, str(flag)), timeout=120))
        _ok(k.run("held = holders.slice(gpus=0).hold.call_one(" + repr(str(flag)) + ")\nd.refresh(timeout=60)"))
        # a stop that fails: the rank holds its call past the time this controller waits for it
        _ok(
            k.run(
                "import dataclasses\nfrom monarch_nb.actor import controller_client\n"
                "rt = controller_client().rt\nsaved = rt.cfg\nrt.cfg = dataclasses.replace(saved, spawn_timeout=0.5)\n"
                "d.stop_button.click()\n"
                + poll("d._running('stop') is None", 30, "the dashboard's stop to end")
                + "rt.cfg = saved\n"
            )
        )
        assert "stop failed" in _value(k, "d.stop_view.value")
        flag.touch()
        _ok(k.run("procs.stop().get(timeout=60)"))
        _ok(k.run("d.refresh(timeout=60)"))
        assert 'data-state="stopped"' in _value(k, "d.header.value")
        assert re.fullmatch(r"mesh failmesh stopped \(seen at \d\d:\d\d:\d\d\)\n", _value(k, "d.stop_view.value"))
        assert _value(k, "d.stop_button.disabled, d.stacks_button.disabled").strip() == "True True"
        _ok(k.run("d.close()\njob.kill()"))
    finally:
        flag.touch()
        _kill_job(k, "failjob")
