"""Telemetry through the public introspection API: what each proc is doing and what it costs."""

from __future__ import annotations

from conftest import wait_for

import monarch_nb
from monarch_nb.actor import Actor, endpoint, this_host


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
