"""choose() on a mesh where one actor failed: its process died, or the actor failed while its
process lives on. Every choose fails with that actor's SupervisionError (calls sent at once
and one by one alike); a slice without it chooses among the rest. An endpoint that merely
raises on one rank fails only the calls that land there: the actor lives on."""

import os
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, current_rank, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


class W(Actor):
    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def fail_on(self, rank: int) -> int:
        if current_rank().rank == rank:
            raise ValueError(f"rank {rank} says no")
        return current_rank().rank

    @endpoint
    def fail(self) -> None:
        raise ValueError("nobody hears this")

    @endpoint
    def exit(self) -> None:
        os._exit(3)


def heard(n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with lock:
            if len(failures) >= n:
                return
        time.sleep(0.05)
    print("  the hook heard nothing")


def outcome(fut) -> str:
    try:
        return f"returned {fut.get(timeout=60)}"
    except Exception as e:
        lines = str(e).splitlines()
        return f"{type(e).__name__}: {lines[0]}"


def summary(outcomes: list[str]) -> str:
    return "; ".join(f"{o} x{outcomes.count(o)}" for o in sorted(set(outcomes)))


print("an endpoint raising on rank 2:")
procs = this_host().spawn_procs(per_host={"gpus": 4})
w = procs.spawn("w", W)
w.rank.call().get(timeout=60)
# Monarch chooses at random, we by load: 40 calls land on rank 2 and elsewhere both
got = [outcome(w.fail_on.choose(2)) for _ in range(40)]
print(
    "  some failed:", any(o.startswith("ActorError") for o in got), "some returned:", any(o.startswith("returned") for o in got)
)
print("  the actor lives on:", w.slice(gpus=2).rank.call_one().get(timeout=60) == 0)

for how in ("actor failed", "process exited"):
    print(f"rank 2's {how}:")
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    w = procs.spawn("w", W)
    w.rank.call().get(timeout=60)
    before = len(failures)
    if how == "actor failed":
        w.slice(gpus=2).fail.broadcast()
    else:
        w.slice(gpus=2).exit.broadcast()
    heard(before + 1)
    print("  call:", outcome(w.rank.call()))
    print("  one by one:", summary([outcome(w.rank.choose()) for _ in range(8)]))
    print("  at once:", summary([outcome(f) for f in [w.rank.choose() for _ in range(8)]]))
    rest = w.slice(gpus=slice(0, 2))
    print("  a slice without it:", sorted({outcome(rest.rank.choose()) for _ in range(8)}))
    procs.stop().get(timeout=60)
print("done")
