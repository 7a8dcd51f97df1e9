"""An owner's __supervise__ gets one MeshFailure per failed rank: every rank of a 3-rank child
mesh fails (a broadcast nobody receives), the owner handles each, no more than once; a sync and
an async owner."""

import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

unhandled: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        unhandled.append(failure)


actor_api.unhandled_fault_hook = hook


class Child(Actor):
    @endpoint
    def die(self) -> None:
        raise ValueError("child gave up")


class AsyncChild(Actor):
    @endpoint
    async def die(self) -> None:
        raise ValueError("child gave up")


# a report to the hook has no event ordered after it (it comes from the runtime's supervision on
# its own, not from any call's reply): its absence is checked by waiting this long for one
HOOK_WINDOW_S = 1.0


def ranks_of(failure: MeshFailure) -> str:
    m = re.search(r"crashed_ranks=(\[[\d, ]*\])", repr(failure))
    return m.group(1) if m else "?"


class SyncOwner(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.procs = this_host().spawn_procs(per_host={"gpus": 3})
        self.children = self.procs.spawn("children", Child)

    @endpoint
    def fail_children(self) -> str:
        self.children.die.broadcast()
        return "sent"

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.events.send(f"sync owner saw {ranks_of(failure)}")
        return True

    def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("cleanup")


class AsyncOwner(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.procs = this_host().spawn_procs(per_host={"gpus": 3})
        self.children = self.procs.spawn("children", AsyncChild)

    @endpoint
    async def fail_children(self) -> str:
        self.children.die.broadcast()
        return "sent"

    async def __supervise__(self, failure: MeshFailure) -> bool:
        self.events.send(f"async owner saw {ranks_of(failure)}")
        return True

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("cleanup")


def until_cleanup(events) -> list[str]:  # type: ignore[no-untyped-def]
    """The owner's events up to its __cleanup__'s: every __supervise__ it ran came before that
    (one actor's sends to one port arrive in order), so none can come later."""
    out = []
    while (event := events.recv().get(timeout=60)) != "cleanup":
        out.append(event)
    return out


for cls in (SyncOwner, AsyncOwner):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    port, events = Channel.open()
    owner = procs.spawn("owner", cls, port)
    print(f"{cls.__name__}:", owner.fail_children.call_one().get(timeout=60))
    print("  supervised:", sorted(events.recv().get(timeout=60) for _ in range(3)))
    time.sleep(HOOK_WINDOW_S)
    with lock:
        hook_calls = len([f for f in unhandled if "crashed_ranks=[]" not in repr(f)])
    procs.stop().get()
    print("  more:", until_cleanup(events))
    print("  hook calls:", hook_calls)
    with lock:
        unhandled.clear()
print("done")
