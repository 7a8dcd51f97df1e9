"""Spans on every rank: recorded in the proc, kept by the allocator, queried, traced."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
import threading
import time
from typing import Any

import pandas as pd
import pytest
from conftest import PY, wait_for

from monarch_nb import telemetry
from monarch_nb._runtime import spans as ring
from monarch_nb._runtime.spanstore import PER_PROC
from monarch_nb.actor import Actor, context, endpoint, this_host

pytestmark = pytest.mark.timeout(120)


class Traced(Actor):
    @endpoint
    def step(self, n: int) -> int:
        with telemetry.span("inner", n=n):
            time.sleep(0.002)
        return n

    @endpoint
    def boom(self) -> None:
        raise KeyError("nope")

    @endpoint
    def slow_on(self, rank: int) -> None:
        time.sleep(0.08 if context().actor_instance.rank.rank == rank else 0.005)

    @endpoint
    def lag(self, rank: int) -> None:
        time.sleep(0.1 if context().actor_instance.rank.rank == rank else 0.002)

    @endpoint
    def many(self, n: int) -> int:
        for _ in range(n):
            with telemetry.span("tick"):
                pass
        return n

    @endpoint
    def count(self) -> None:
        m = telemetry.get_meter("test")
        m.create_counter("steps").add(2, {"phase": "train"})
        m.create_histogram("loss").record(0.5)
        m.create_gauge("lr").set(0.01)


class AsyncTraced(Actor):
    @endpoint
    async def step(self) -> str:
        with telemetry.span("async-inner"):
            return "done"


_PROCS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def traced():  # type: ignore[no-untyped-def]
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="spans")
    _PROCS["spans"] = pm
    try:
        yield pm.spawn("t", Traced)
    finally:
        pm.stop().get(timeout=30)


def test_calls_and_inner_spans_are_recorded_with_outcome(traced) -> None:  # type: ignore[no-untyped-def]
    t0 = time.time()
    assert traced.slice(gpus=0).step.call_one(7).get(timeout=30) == 7
    traced.step.call(3).get(timeout=30)
    with pytest.raises(Exception, match="nope"):
        traced.slice(gpus=1).boom.call_one().get(timeout=30)
    df = telemetry.query("spans", since=t0)
    assert isinstance(df, pd.DataFrame)
    calls = df[(df.kind == "call") & (df.name == "t.step")]
    # call_one on rank 0, then call on both ranks
    assert sorted(calls["rank"]) == [0, 0, 1] and (calls.outcome == "ok").all()
    assert (calls.actor == "t").all() and (calls.method == "step").all()
    err = df[df.name == "t.boom"]
    assert list(err["rank"]) == [1] and list(err.outcome) == ["error"]
    inner = df[df.name == "inner"]
    assert len(inner) == 3 and {a["n"] for a in inner["attributes"]} == {7, 3}
    # measured in the proc: each inner span lies within a call of its rank, and takes its sleep
    for _, s in inner.iterrows():
        outer = calls[
            (calls["rank"] == s["rank"]) & (calls.start <= s.start) & (calls.start + calls.duration >= s.start + s.duration)
        ]
        assert len(outer) >= 1 and s.duration >= 0.002
    assert (df.start >= t0 - 1).all() and (df.duration >= 0).all()
    # an async actor's calls are spans too
    am = _PROCS["spans"].spawn("a", AsyncTraced)
    t1 = time.time()
    am.step.call().get(timeout=30)
    df = telemetry.query("spans", since=t1)
    assert sorted(df[df.name == "a.step"]["rank"]) == [0, 1] and sorted(df[df.name == "async-inner"]["rank"]) == [0, 1]


def test_query_across_two_procs_and_trace_file(traced, tmp_path) -> None:  # type: ignore[no-untyped-def]
    t0 = time.time()
    traced.step.call(1).get(timeout=30)
    with telemetry.span("notebook-side", cell=1):
        pass
    df = telemetry.query(since=t0)
    mine = df[df.mesh == "spans"]
    assert set(mine["rank"]) == {0, 1} and len(set(mine["pid"])) == 2
    assert "notebook-side" in set(df[df.mesh == "(controller)"].name)
    assert list(df.columns) == telemetry._query.COLUMNS
    path = tmp_path / "trace.json"
    telemetry.chrome_trace(df, str(path))
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(df)
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 for e in xs)
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert any(n.startswith("rank 0") for n in names) and any(n.startswith("rank 1") for n in names)
    assert "clock_offsets_s" in trace["otherData"]


def test_stragglers_are_flagged(traced) -> None:  # type: ignore[no-untyped-def]
    t0 = time.time()
    for _ in range(3):
        traced.slow_on.call(1).get(timeout=30)
    rows = telemetry.query_records("spans", since=t0)
    slow = telemetry.stragglers(rows, factor=2.0)
    assert [(d["name"], d["rank"]) for d in slow] == [("t.slow_on", 1)]
    assert slow[0]["ratio"] > 2
    assert telemetry.stragglers(rows, factor=50.0) == []
    with pytest.raises(ValueError, match="factor"):
        telemetry.stragglers(rows, factor=0.5)
    trace = telemetry.chrome_trace(rows)
    flagged = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and "straggler" in str(e["args"].get("name"))]
    assert len(flagged) == 1 and flagged[0].startswith("rank 1")


def test_latency_summary_agrees_with_the_spans_it_reduces(traced) -> None:  # type: ignore[no-untyped-def]
    # the dashboard's query: reduced by the allocator, it says what the raw spans say
    t0 = time.time()
    for _ in range(3):
        traced.slow_on.call(1).get(timeout=30)
    with pytest.raises(Exception, match="nope"):
        traced.boom.call().get(timeout=30)
    rows = telemetry.query_records("spans", since=t0)
    got = telemetry.latency_summary("spans", since=t0, factor=2.0)
    assert [(d["name"], d["rank"]) for d in got["stragglers"]] == [(d["name"], d["rank"]) for d in telemetry.stragglers(rows)]
    assert got["unreachable"] == []
    for r in got["ranks"]:
        mine = sorted(x["duration"] for x in rows if x["kind"] == "call" and x["rank"] == r["rank"])
        assert r["calls"] == len(mine) == 4, (r, mine)
        assert min(mine) <= r["median"] <= r["p95"] <= max(mine)
    failed = [(x["rank"], x["name"]) for x in rows if x["outcome"] == "error"]
    assert sorted((e["rank"], e["name"]) for e in got["errors"]) == sorted(failed) == [(0, "t.boom"), (1, "t.boom")]
    assert all(e["start"] >= t0 - 1 and e["outcome"] == "error" for e in got["errors"])
    with pytest.raises(ValueError, match="factor"):
        telemetry.latency_summary("spans", factor=1.0)


def test_dashboard_shows_latency_per_rank_and_the_straggler(traced) -> None:  # type: ignore[no-untyped-def]
    from monarch_nb.widgets import Dashboard

    for _ in range(3):
        traced.lag.call(0).get(timeout=30)
    d = Dashboard(_PROCS["spans"], interval=60, straggler_factor=2.0, window="60s")
    try:
        assert d.refresh(timeout=60)  # the first one runs on the dashboard's thread
        html = d.latency_view.value
        assert "endpoint latency" in html and html.count("mnb-lat-row") == 2, html
        # (other endpoints of earlier tests may have stragglers of their own on a loaded machine)
        assert re.search(r"straggler: rank 0 \(\S+\) t\.lag median \d+\.\d\d ms over 3 calls, \d", html), html
        # rank 1 was slow at t.slow_on in earlier tests: a row is marked only while some rank is not
        marked = re.findall(r'<tr class="mnb-lat-row mnb-straggler"><td>rank (\d)</td>', html)
        assert marked in (["0"], []) and ("straggler in t.lag" in html) == (marked == ["0"]), html
    finally:
        d.close()


def test_memory_is_bounded(traced) -> None:  # type: ignore[no-untyped-def]
    # in the proc: a burst larger than the allocator keeps per proc
    traced.slice(gpus=0).many.call_one(PER_PROC + 1000).get(timeout=60)
    rows = wait_for(lambda: [r for r in telemetry.query_records("spans") if r["rank"] == 0], 10, "spans of rank 0")
    assert len(rows) <= PER_PROC and sum(r["name"] == "tick" for r in rows) >= PER_PROC // 2
    # in a process's own ring: what was overwritten before a drain is counted, not kept
    before = ring.drain(0)["last"]
    for _ in range(ring.RING + 10):
        ring.record_span("fill", "", 0, 0.0, 0.0, True, None)
    got = ring.drain(before)
    assert len(got["spans"]) <= ring.RING and got["dropped"] >= 10


def test_the_allocators_packed_drain_keeps_what_the_dicts_say() -> None:
    from monarch_nb._runtime.spanstore import _FIELDS, _Kept
    from monarch_nb._wire.serialize import dumps, loads

    t = time.perf_counter()
    before = ring.drain(0)["last"]
    kept = _Kept({})
    kept.cursor = before
    # two drains, as the allocator's once a second, as they went over the wire; the second
    # finds more than the allocator keeps, and sends only the newest
    for n in (300, PER_PROC + 200):
        for i in range(n):
            ring.record(ring.call_key("a#1", "step", 3, i % 7 != 0), t + i, t + i + 0.5)
        ring.record_span("user", "a#1", 3, t, t + 2.0, False, {"k": n})
        got = loads(*dumps(ring.drain_packed(kept.cursor, PER_PROC)))
        assert got["spans"] is None and got["dropped"] == 0
        kept.add_packed(got["cols"], got["off"], kept.cursor)
        kept.cursor = got["last"]
    want = ring.drain(before)["spans"][-PER_PROC:]
    assert len(kept) == PER_PROC and kept.cursor == want[-1]["seq"]
    rows = [dict(zip(_FIELDS, s)) for s in kept.spans]
    assert [r["seq"] for r in rows] == [w["seq"] for w in want]
    for r, w in zip(rows, want):
        assert r.pop("start") == pytest.approx(w.pop("start"), abs=1e-6)
        assert r.pop("attrs") == w.pop("attrs", None)
        assert r == w
    # a record numbered but not stored yet (its writer lost the GIL in between): the dicts
    # take over, and read up to it
    last = ring.drain(0)["last"]
    ring.record(ring.call_key("a#1", "step", 3, True), t, t)
    slot = (last + 1) & ring._MASK
    ring._nums[slot] = last + 1 - ring.RING
    try:
        got = ring.drain_packed(last - 5, PER_PROC)
    finally:
        ring._nums[slot] = last + 1  # as its writer would: this process's ring serves the other tests
    assert [s["seq"] for s in got["spans"]] == list(range(last - 4, last + 1)) and got["last"] == last


def test_metrics_from_every_rank(traced) -> None:  # type: ignore[no-untyped-def]
    traced.count.call().get(timeout=30)
    traced.count.call().get(timeout=30)
    m = telemetry.metrics("spans")
    steps = m[(m.meter == "test") & (m.name == "steps")]
    assert sorted(steps["rank"]) == [0, 1] and (steps["sum"] == 4).all() and (steps["count"] == 2).all()
    assert steps.iloc[0]["attrs"] == {"phase": "train"}
    lr = m[m.name == "lr"]
    assert len(lr) == 2 and (lr["last"] == 0.01).all() and (lr.kind == "gauge").all()
    with pytest.raises(ValueError, match="only goes up"):
        telemetry.get_meter("x").create_counter("c").add(-1)


def test_spans_outlive_the_controller_that_made_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a controller (as a kernel before its restart) spans on its procs, then exits; a new
    # controller reads them back from the allocator
    script = tmp_path / "before.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from test_telemetry_spans import Traced
            from monarch_nb.actor import this_host
            pm = this_host().spawn_procs(per_host={{"gpus": 2}}, name="before-restart")
            pm.spawn("t", Traced).step.call(42).get(timeout=30)
            pm.stop().get(timeout=30)
            """
        )
    )
    t0 = time.time()
    subprocess.run([PY, str(script)], check=True, timeout=90, env=os.environ.copy())
    df = telemetry.query("before-restart", since=t0)
    assert sorted(df[df.name == "t.step"]["rank"]) == [0, 1]
    assert sorted(df[df.name == "inner"]["rank"]) == [0, 1]


def test_an_attached_allocator_s_spans_are_found_and_a_mesh_object_names_its_mesh(allocator) -> None:  # type: ignore[no-untyped-def]
    """docs/telemetry.md: query() asks every attached allocator. One attached with
    attach_to_workers (another host, a job's) has no connection file in this runtime directory,
    and was never asked: %mesh trace of a cluster's mesh drew nothing. A ProcMesh or ActorMesh
    given as ``mesh`` matched no span at all."""
    pm = allocator.hosts.spawn_procs(per_host={"gpus": 2})
    try:
        am = pm.spawn("far", Traced)
        am.step.call(5).get(timeout=30)
        for mesh in (pm.name, pm, am, pm.slice(gpus=1)):
            rows = telemetry.query_records(mesh)
            assert sorted(r["rank"] for r in rows if r["name"] == "far.step") == [0, 1], mesh
        assert sorted(r["rank"] for r in telemetry.latency_summary(am)["ranks"]) == [0, 1]
        # attached, and named again in addresses: asked once, so no span is counted twice
        rows = telemetry.query_records(addresses=[allocator.addr])
        assert len([r for r in rows if r["mesh"] == pm.name and r["name"] == "far.step"]) == 2
    finally:
        pm.stop().get(timeout=30)


def test_a_name_no_proc_mesh_has_says_so_instead_of_finding_nothing(traced) -> None:  # type: ignore[no-untyped-def]
    """docs/telemetry.md's example queried "trainers", its actor mesh's name: an empty frame, no
    word of why. The actor mesh here is "t" on proc mesh "spans"."""
    import warnings

    traced.step.call(1).get(timeout=30)
    with pytest.warns(UserWarning, match=r"no proc mesh named 't' on the allocators asked \(proc meshes: [^)]*\bspans\b") as w:
        assert telemetry.query_records("t") == []
    assert "for an actor mesh, pass the ActorMesh itself" in str(w[0].message) and w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert telemetry.query_records("spans") and telemetry.query_records(traced)


def test_bad_input_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="30s"):
        telemetry.query(since="yesterday")
    with pytest.raises(TypeError, match="give a proc mesh's name, a ProcMesh or an ActorMesh"):
        telemetry.query_records(3)
    with pytest.raises(ValueError, match="non-empty name"):
        with telemetry.span(""):
            pass


def test_traced_decorator_records_sync_and_async() -> None:
    import asyncio

    @telemetry.traced
    def f(x: int) -> int:
        return x + 1

    @telemetry.traced("named", kind="a")
    async def g() -> int:
        return 2

    before = ring.drain(0)["last"]
    assert f(1) == 2 and asyncio.run(g()) == 2
    got = [s for s in ring.drain(before)["spans"] if s["kind"] == "span"]
    assert [s["name"] for s in got][-2:] == ["f", "named"]
    assert got[-1]["attrs"] == {"kind": "a"}
    # Monarch's names in monarch_nb.actor are these recording ones; its get_meter() takes no name
    import monarch_nb.actor as api

    assert (api.span, api.traced, api.get_meter) == (telemetry.span, telemetry.traced, telemetry.get_meter)
    assert api.get_meter().name == "monarch"


def test_mesh_trace_magic_writes_a_trace_and_draws_the_timeline_also_after_a_kernel_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from _kernel import Kernel

    kern = Kernel()
    try:
        assert "connected" in kern.run("%mesh connect").stream()
        c = kern.run("%mesh spawn tr --per-host gpus=2", timeout=90)
        assert c.error is None, c.msgs
        cell = (
            "%%mesh exec tr\n"
            "import time\nfrom monarch_nb import telemetry\nfrom monarch_nb.actor import current_rank\n"
            "with telemetry.span('work'):\n    time.sleep(0.1 if current_rank().rank == 1 else 0.002)"
        )
        # a straggler needs 3 calls of its endpoint (telemetry.MIN_CALLS): one slow cell is not one
        for _ in range(3):
            assert kern.run(cell).error is None
        out = tmp_path / "tr.json"
        c = kern.run(f"%mesh trace tr --last 60s --out {out} --factor 3")
        assert c.error is None, c.msgs
        trace = json.loads(out.read_text())
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert {e["args"]["rank"] for e in xs} == {0, 1} and any(e["name"] == "work" for e in xs)
        res = c._of("execute_result")[0]["content"]["data"]
        assert str(out) in res["text/plain"]
        assert re.search(r"straggler: tr rank 1 .* \d+\.\dx the other ranks'", res["text/plain"]), res["text/plain"]
        svg = res["text/html"]
        assert "<svg" in svg and svg.count("class='mnb-span'") == len(xs) and "tr r1 (slow)" in svg
        bad = kern.run("%mesh trace tr --last soon")
        assert bad.reply["content"]["status"] == "error" and "--last 'soon'" in bad.stream("stderr") + str(bad.error)
        # a mistyped name is said to be one, and leaves no empty trace behind
        none = tmp_path / "none.json"
        bad = kern.run(f"%mesh trace tx --out {none}")
        said = bad.stream("stderr") + str(bad.error)
        assert bad.reply["content"]["status"] == "error" and "no spans of a mesh named 'tx' in the last 30s" in said, said
        assert re.search(r"no such mesh runs on the attached allocators \(meshes: [^)]*\btr\b", said), said
        assert "UserWarning" not in said, said  # said once, in the magic's words
        assert not none.exists()
        # a restarted kernel reads the spans of before the restart back from the allocator
        kern.km.restart_kernel(now=True)
        kern.kc.wait_for_ready(timeout=60)
        assert kern.run("%load_ext monarch_nb").error is None
        out2 = tmp_path / "after.json"
        c = kern.run(f"%mesh trace tr --last 5m --out {out2}")
        assert c.error is None, c.msgs
        after = [e for e in json.loads(out2.read_text())["traceEvents"] if e["ph"] == "X" and e["name"] == "work"]
        assert sorted(e["args"]["rank"] for e in after) == [0, 0, 0, 1, 1, 1]
    finally:
        # not `%mesh stop tr`: the restarted kernel never connected, knew no 'tr' and left it running
        kern.close("tr")


def test_a_name_spawned_again_after_a_stop_means_its_newest_mesh(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stopped mesh's spans are kept; spawned again under its name, a query of the name (and
    `%mesh trace`) drew both meshes on one timeline, and the old mesh's slow rank was named a
    straggler of the new one."""
    t0 = time.time()
    old = this_host().spawn_procs(per_host={"gpus": 2}, name="reborn")
    try:
        for _ in range(3):
            old.spawn("t", Traced).slow_on.call(1).get(timeout=30)
    finally:
        old.stop().get(timeout=30)
    new = this_host().spawn_procs(per_host={"gpus": 2}, name="reborn")
    try:
        am = new.spawn("t", Traced)
        for _ in range(3):
            am.slow_on.call(-1).get(timeout=30)
        old_pids, new_pids = {p.pid for p in old._procs}, {p.pid for p in new._procs}
        rows = telemetry.query_records("reborn", since=t0)
        assert {r["pid"] for r in rows} == new_pids and len({r["mesh_id"] for r in rows}) == 1, rows
        assert telemetry.stragglers(rows) == [] and telemetry.latency_summary("reborn", since=t0)["stragglers"] == []
        assert sorted(r["rank"] for r in telemetry.latency_summary("reborn", since=t0)["ranks"]) == [0, 1]
        # the mesh object means its own incarnation, also the stopped one
        assert {r["pid"] for r in telemetry.query_records(old, since=t0)} == old_pids
        assert {r["pid"] for r in telemetry.query_records(am, since=t0)} == new_pids
        # every incarnation on request, told apart by mesh id; one by its id
        both = telemetry.query("reborn", since=t0, incarnation="all")
        assert set(both["pid"]) == old_pids | new_pids and both["mesh_id"].nunique() == 2
        old_id = next(iter(set(both["mesh_id"]) - {rows[0]["mesh_id"]}))
        assert {r["pid"] for r in telemetry.query_records("reborn", incarnation=old_id)} == old_pids
        slow = telemetry.stragglers(both)
        assert [(d["rank"], d["mesh_id"]) for d in slow] == [(1, old_id)], slow
        trace = telemetry.chrome_trace(both)
        procs = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name")
        assert procs == sorted(f"mesh reborn (mesh id {i})" for i in set(both["mesh_id"])), procs
        with pytest.raises(ValueError, match=r"incarnation='nope': no mesh with that id \(incarnations kept: .*reborn "):
            telemetry.query_records("reborn", incarnation="nope")
    finally:
        new.stop().get(timeout=30)


def _row(rank: int, duration: float, outcome: str = "ok", name: str = "t.step") -> dict[str, Any]:
    return {
        "mesh": "m",
        "mesh_id": "a",
        "rank": rank,
        "host": "h",
        "kind": "call",
        "name": name,
        "duration": duration,
        "outcome": outcome,
    }


def test_a_straggler_needs_enough_completed_calls() -> None:
    # one slow call (a first call's import) is no straggler; three are
    one = [_row(0, 0.001), _row(1, 0.1)]
    assert telemetry.stragglers(one) == []
    three = one * 3
    assert [(d["rank"], d["calls"]) for d in telemetry.stragglers(three)] == [(1, 3)]
    assert [d["rank"] for d in telemetry.stragglers(one, min_calls=1)] == [1]
    # a call that raised is an error, not a latency: the rank that raised is no straggler
    raised = [_row(0, 0.001), _row(1, 0.001)] * 3 + [_row(1, 0.5, "error")] * 3
    assert telemetry.stragglers(raised) == []
    # ranks without enough calls neither are flagged nor set the bar
    few = [_row(0, 0.001), _row(1, 0.001), _row(2, 0.1)] * 3 + [_row(3, 0.0001)]
    assert [d["rank"] for d in telemetry.stragglers(few)] == [2]
    with pytest.raises(ValueError, match="min_calls"):
        telemetry.stragglers(one, min_calls=0)


def test_the_latency_table_never_marks_every_rank() -> None:
    from monarch_nb.widgets import _render

    ranks = [{"rank": r, "calls": 9, "median": 0.01, "p95": 0.02} for r in (0, 1)]
    slow0 = {"rank": 0, "host": "h", "name": "t.a", "calls": 3, "median_s": 0.1, "ratio": 10.0}
    one = _render.latency_html(ranks, [slow0], 2.0, "30s")
    assert re.findall(r'mnb-straggler"><td>rank (\d)', one) == ["0"] and "straggler in t.a" in one, one
    # each rank slower than the other at another endpoint: no rank is behind, the notes say where
    both = _render.latency_html(ranks, [slow0, dict(slow0, rank=1, name="t.b")], 2.0, "30s")
    assert "mnb-straggler" not in both and "straggler: rank 0 (h) t.a" in both and "straggler: rank 1 (h) t.b" in both


def test_a_mesh_exec_cell_shows_as_such_and_one_failed_cell_makes_no_straggler(traced) -> None:  # type: ignore[no-untyped-def]
    from monarch_nb import mesh as M
    from monarch_nb.errors import ExecError
    from monarch_nb.widgets import _render

    pm = _PROCS["spans"]
    t0 = time.time()
    M.exec_cell(pm, "x = 1")
    with pytest.raises(ExecError):
        M.exec_cell(
            pm, "import time\nfrom monarch_nb.actor import current_rank\nif current_rank().rank == 1:\n    time.sleep(0.05); 1/0"
        )
    rows = telemetry.query_records(pm, since=t0)
    assert {(r["name"], r["kind"]) for r in rows} == {("%%mesh exec", "call"), ("mesh exec", "span")}, rows
    got = telemetry.latency_summary(pm, since=t0)
    html = _render.latency_html(got["ranks"], got["stragglers"], 2.0, "30s")
    assert got["stragglers"] == [] and "mnb_exec" not in html and "mnb-straggler" not in html, html
    assert "straggler:" not in html.split("</table>")[1], html


class Asked(Actor):
    """Counts what its proc's allocator asks of it: state samples and span drains."""

    def __init__(self) -> None:
        from monarch_nb.actor._context import runtime

        self.asked = {"state": 0, "drain": 0}
        self.cond = threading.Condition()
        rt = runtime()
        for name, obj, method in (("state", rt.system["__sys__"], "sys_state"), ("drain", rt.system["__spans__"], "sys_drain")):

            def counted(*a: Any, _fn: Any = getattr(obj, method), _name: str = name, **k: Any) -> Any:
                with self.cond:
                    self.asked[_name] += 1
                    self.cond.notify_all()
                return _fn(*a, **k)

            setattr(obj, method, counted)

    @endpoint
    def over(self, states: int) -> int:
        """The drains asked for while ``states`` state samples came (no span is recorded meanwhile)."""
        with self.cond:
            s0, d0 = self.asked["state"], self.asked["drain"]
            assert self.cond.wait_for(lambda: self.asked["state"] >= s0 + states, timeout=30)
            return self.asked["drain"] - d0

    @endpoint
    def work(self) -> None:
        with telemetry.span("work"):
            pass


def test_an_idle_proc_is_not_drained_every_second_and_a_busy_one_is() -> None:
    # a drain that finds nothing costs the proc a wake-up and its GIL every second (16 procs a
    # host); its state, sampled each second anyway, says whether there is anything to drain
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="asked")
    try:
        am = pm.spawn("a", Asked)
        am.over.call_one(1).get(timeout=30)  # what the spawn recorded is drained
        assert am.over.call_one(3).get(timeout=30) <= 1  # the last call's span, at most
        am.work.call_one().get(timeout=30)
        assert am.over.call_one(2).get(timeout=30) >= 1  # drained with no query asking
        spans = telemetry.query(mesh="asked")
        assert "work" in set(spans["name"])
    finally:
        pm.stop().get(timeout=30)


@pytest.mark.timeout(30)
def test_a_span_reads_as_now_after_the_wall_clock_was_stepped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The wall clock stepped (NTP, or a VM resumed: its monotonic clock stood still, the wall
    clock did not) after this process started: a span recorded now reads as now, so
    ``query(since=...)`` still finds it. The conversion used a base read once, when the zygote
    imported the ring, and a whole CI run's spans fell before their test's start."""
    import types

    before = ring.drain(0)["last"]
    # the ring's clocks alone (the process's other threads keep the real ones)
    stepped = types.SimpleNamespace(time=lambda: time.time() + 3600.0, perf_counter=time.perf_counter)
    monkeypatch.setattr(ring, "time", stepped)  # a step of an hour forward
    t = time.perf_counter()
    ring.record_span("after-step", "", 0, t, t + 0.001, True, None)
    got = [s for s in ring.drain(before)["spans"] if s["name"] == "after-step"]
    assert len(got) == 1 and abs(got[0]["start"] - stepped.time()) < 5, (got, stepped.time())
