"""Telemetry through the public introspection API: what each proc is doing and what it costs."""

from __future__ import annotations

import asyncio

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
