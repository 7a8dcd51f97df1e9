"""A process that exits with status 0 under its actor (os._exit(0) in an endpoint) stopped that
actor, it did not fail: the call in hand and later calls to it fail with Monarch's status words,
`Supervision event: actor <...> has status:` / `stopped: process exited cleanly`, the other rank
answers on, neither the fault hook nor an owner's __supervise__ hears of it, and stop() is quiet.
Sync and async actor, and an actor's child mesh."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

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

# a report to the hook or to __supervise__ has no event ordered after it: its absence is
# checked by waiting this long for one
REPORT_WINDOW_S = 1.5


def two_lines(e: object) -> str:
    return " | ".join(line.strip() for line in str(e).strip().splitlines()[:2])


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()}")
    except Exception as e:
        print(f"  {label}: {type(e).__name__}: {two_lines(e)}")


class W(Actor):
    @endpoint
    def ping(self) -> int:
        return current_rank().rank

    @endpoint
    def leave(self) -> None:
        os._exit(0)


class AsyncW(Actor):
    @endpoint
    async def ping(self) -> int:
        return current_rank().rank

    @endpoint
    async def leave(self) -> None:
        os._exit(0)


class Owner(Actor):
    """Spawns a child mesh on procs of its own; counts what its __supervise__ hears."""

    def __init__(self) -> None:
        self.supervised = 0
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.kids = self.procs.spawn("kids", W)

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.supervised += 1
        return True

    @endpoint
    def run(self) -> list[str]:
        out = []
        for label, fn in (
            ("the child's call that exits", lambda: self.kids.slice(gpus=1).leave.call_one().get(timeout=60)),
            ("the other child", lambda: self.kids.slice(gpus=0).ping.call_one().get(timeout=60)),
        ):
            try:
                out.append(f"{label}: returned {fn()}")
            except Exception as e:
                out.append(f"{label}: {type(e).__name__}: {two_lines(e)}")
        return out

    @endpoint
    def supervised_count(self) -> int:
        return self.supervised


for cls in (W, AsyncW):
    print(f"{cls.__name__}:")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("w", cls)
    attempt("the call that exits", lambda: m.slice(gpus=1).leave.call_one().get(timeout=60))
    attempt("a later call to it", lambda: m.slice(gpus=1).ping.call_one().get(timeout=60))
    attempt("the other rank", lambda: m.slice(gpus=0).ping.call_one().get(timeout=60))
    attempt("call", lambda: m.ping.call().get(timeout=60))
    time.sleep(REPORT_WINDOW_S)
    with lock:
        print("  hook calls:", len([f for f in failures if str(f.mesh_name).startswith("w")]))
        failures.clear()
    attempt("stop", lambda: procs.stop().get(timeout=60))
print("an owner's child:")
procs = this_host().spawn_procs(per_host={"gpus": 1})
owner = procs.spawn("owner", Owner)
for line in owner.run.call_one().get(timeout=60):
    print(f"  {line}")
time.sleep(REPORT_WINDOW_S)
attempt("__supervise__ calls", lambda: owner.supervised_count.call_one().get(timeout=60))
with lock:
    print("  hook calls:", len(failures))
attempt("stop", lambda: procs.stop().get(timeout=60))
print("done")
