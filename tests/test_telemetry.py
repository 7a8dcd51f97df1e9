"""Telemetry through the public introspection API: what each proc is doing and what it costs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conftest import wait_for

import monarch_nb
from monarch_nb.actor import Actor, concurrent_endpoint, endpoint, this_host


class Worker(Actor):
    @endpoint
    def hold(self, gate: str) -> str:
        import _gate

        return "released" if _gate.wait(gate, 60) else "not released"

    @endpoint
    def chatter(self, n: int) -> None:
        for i in range(n):
            print("line", i, flush=True)


def _procs(name: str) -> list[dict]:
    for a in monarch_nb.status()["allocators"]:
        for m in a.get("meshes", []):
            if m["name"] == name:
                return m["procs"]
    return []


def test_status_reports_activity_resources_and_rates(gate) -> None:  # type: ignore[no-untyped-def]
    release = gate("release")
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="tele")
    try:
        w = pm.spawn("w", Worker)
        held = w.slice(gpus=0).hold.call_one(release.path)
        # each proc's activity is its last answer to the allocator's poll: rank 1's may come later
        procs = wait_for(
            lambda: (ps := _procs("tele")) and ps[0].get("activity") == "busy in w.hold" and "activity" in ps[1] and ps,
            10,
            "rank 0 busy, and rank 1 polled",
        )
        assert procs[1]["activity"] == "idle"
        assert all(p["rss"] > 1_000_000 and p["cpu_percent"] >= 0 for p in procs)
        w.slice(gpus=1).chatter.call_one(500).get(timeout=30)
        procs = wait_for(lambda: (ps := _procs("tele")) and ps[1].get("lines_per_s", 0) > 0 and ps, 10, "a line rate")
        assert procs[1]["lines"] >= 500
        release.open()
        assert held.get(timeout=10) == "released"
        procs = wait_for(lambda: (ps := _procs("tele")) and ps[0].get("calls") == 1 and ps, 10, "the call counted")
        assert procs[0]["activity"] == "idle" and procs[0]["mean_call_ms"] > 0
        stats = monarch_nb.status()["allocators"][0]["host_stats"]
        assert stats["mem_total"] > stats["mem_used"] > 0 and stats["cpus"] >= 1 and stats["gpus"] == []
    finally:
        pm.stop().get(timeout=30)


def test_status_counts_the_calls_queued_behind_a_running_one(gate) -> None:  # type: ignore[no-untyped-def]
    # a rank read "busy in w.hold" whatever waited behind it: a caller whose call hangs could not
    # tell it was in line
    release = gate("release")
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="tele-queued")
    try:
        w = pm.spawn("w", Worker)
        held = w.hold.call_one(release.path)
        queued = [w.chatter.call_one(0), w.chatter.call_one(0)]
        wait_for(lambda: _activity("tele-queued") == "busy in w.hold (2 queued)", 10, "the queued calls counted")
        assert _procs("tele-queued")[0]["queued"] == 2 and _procs("tele-queued")[0]["busy"] == ["w.hold"]
        release.open()
        assert held.get(timeout=10) == "released" and [f.get(timeout=10) for f in queued] == [None, None]
        wait_for(lambda: _activity("tele-queued") == "idle", 10, "idle")
        assert _procs("tele-queued")[0]["queued"] == 0
    finally:
        pm.stop().get(timeout=30)


class Overlapping(Actor):
    """An async actor whose calls overlap: each waits for its own event."""

    def __init__(self) -> None:
        self.evs: dict[str, asyncio.Event] = {}

    def _ev(self, name: str) -> asyncio.Event:
        return self.evs.setdefault(name, asyncio.Event())

    @concurrent_endpoint
    async def fetch(self, name: str) -> str:
        await self._ev(name).wait()
        return name

    @concurrent_endpoint
    async def train(self) -> str:
        await self._ev("train").wait()
        return "trained"

    @concurrent_endpoint
    async def release(self, name: str) -> None:
        self._ev(name).set()


def test_status_names_every_call_an_async_actor_runs_at_once() -> None:
    # one busy field per actor showed only the call begun last, and the first call to end made
    # the rank read idle while the others still ran
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="tele-overlap")
    try:
        o = pm.spawn("o", Overlapping)
        t = o.train.call_one()
        f1, f2 = o.fetch.call_one("a"), o.fetch.call_one("b")
        wait_for(lambda: _activity("tele-overlap") == "busy in o.train, o.fetch ×2", 10, "three calls shown")
        o.release.call_one("a").get(timeout=10)
        assert f1.get(timeout=10) == "a"
        wait_for(lambda: _activity("tele-overlap") == "busy in o.train, o.fetch", 10, "the two still running")
        o.release.call_one("train").get(timeout=10)
        assert t.get(timeout=10) == "trained"
        wait_for(lambda: _activity("tele-overlap") == "busy in o.fetch", 10, "the last one")
        o.release.call_one("b").get(timeout=10)
        assert f2.get(timeout=10) == "b"
        wait_for(lambda: _activity("tele-overlap") == "idle", 10, "idle")
    finally:
        pm.stop().get(timeout=30)


def _activity(name: str) -> str:
    procs = _procs(name)
    return procs[0].get("activity", "") if procs else ""


class Watched(Actor):
    """Notes when its proc's allocator asks the proc for its state, on the proc's clock."""

    def __init__(self) -> None:
        from monarch_nb.actor._context import runtime

        self.asked: list[float] = []
        sys_actor = runtime().system["__sys__"]
        state = sys_actor.sys_state

        def noted() -> Any:
            self.asked.append(time.monotonic())
            return state()

        sys_actor.sys_state = noted

    @endpoint
    def asks(self) -> tuple[float, list[float]]:
        return time.monotonic(), list(self.asked)

    @endpoint
    def hold(self, started: str, gate: str) -> float:
        import _gate

        t = time.monotonic()
        open(started, "w").close()
        assert _gate.wait(gate, 60)
        return t


def test_an_idle_proc_is_not_woken_each_second_for_its_state_and_a_look_sees_it_now(tmp_path, gate) -> None:  # type: ignore[no-untyped-def]
    # each ask wakes the proc and holds its GIL for the length of the wake-up: a call that comes
    # meanwhile is slow (a call_one p99). It is asked only while somebody looks or it works, and
    # a look after a quiet spell asks it at once rather than showing its state of seconds ago
    release = gate("release")
    started = tmp_path / "started"
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="tele-quiet")
    try:
        w = pm.spawn("w", Watched)
        t0, _ = w.asks.call_one().get(timeout=30)
        # a span of seconds measured, not waited on: nobody looks, and the proc does nothing
        time.sleep(9.5)
        held = w.hold.call_one(str(started), release.path)
        wait_for(started.exists, 10, "the call to start")
        assert _activity("tele-quiet") == "busy in w.hold"
        release.open()
        t1 = held.get(timeout=10)
        _, asked = w.asks.call_one().get(timeout=30)
        # from 5 s on: asked while its first call ran, and for a few seconds after another
        # test's look; an ask when its CPU time moved on a clock tick is allowed
        quiet = [t for t in asked if t0 + 5.0 <= t < t1]
        assert t1 - t0 >= 9.5 and len(quiet) <= 1, (t1 - t0, [round(t - t0, 2) for t in asked])
        assert any(t >= t1 for t in asked), "the look's ask was not noted"
    finally:
        pm.stop().get(timeout=30)


def test_host_memory_load_and_gpus_are_read_for_a_look_not_every_second(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # readings of the moment, shown only when somebody looks: read then, not each second for nobody
    import types

    import psutil

    from monarch_nb._runtime import telemetry

    reads = []
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reads.append(1) or real())
    tel = telemetry.Telemetry(types.SimpleNamespace(by_token={}, by_pid={}))  # type: ignore[arg-type]
    for _ in range(3):
        tel.sample()
    assert reads == [] and set(tel.host) == {"cpu_percent"}
    asyncio.run(tel.fresh())
    assert reads == [1] and tel.host["mem_total"] >= tel.host["mem_used"] > 0 and len(tel.host["load"]) == 3
    tel.sample()  # somebody looks: each tick reads them
    assert reads == [1, 1]
