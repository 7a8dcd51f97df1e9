"""stop() of an owner busy supervising two failures: the sync owner's __supervise__ in hand
finishes, the async owner's is cancelled, the second failure's supervision (queued before the
stop) is dropped, and nothing reaches unhandled_fault_hook."""

import asyncio
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

unhandled: list[MeshFailure] = []
actor_api.unhandled_fault_hook = unhandled.append

# a report to the hook has no event ordered after it (it comes from the runtime's supervision on
# its own, not from any call's reply): its absence is checked by waiting this long for one
HOOK_WINDOW_S = 1.0


class Custom(BaseException):
    pass


class Child(Actor):
    @endpoint
    def die(self) -> None:
        raise Custom("child gave up")


class SyncOwner(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("children", Child)

    @endpoint
    def fail_children(self) -> str:
        self.children.slice(gpus=1).die.broadcast()
        self.children.slice(gpus=0).die.broadcast()
        return "sent"

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.events.send("supervising")
        time.sleep(1)  # the handler in hand: stop() waits for it (as for an endpoint)
        self.events.send("supervise finished")
        return True

    def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("cleanup")


class AsyncOwner(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("children", Child)

    @endpoint
    async def fail_children(self) -> str:
        self.children.slice(gpus=1).die.broadcast()
        self.children.slice(gpus=0).die.broadcast()
        return "sent"

    async def __supervise__(self, failure: MeshFailure) -> bool:
        self.events.send("supervising")
        await asyncio.sleep(3)  # cancelled by stop()
        self.events.send("supervise finished")
        return True

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("cleanup")


def until_cleanup(events) -> list[str]:  # type: ignore[no-untyped-def]
    """The owner's events up to its __cleanup__'s: a __supervise__ that ran at all came before
    that (one actor's sends to one port arrive in order), so none can come later."""
    out = []
    while (event := events.recv().get(timeout=60)) != "cleanup":
        out.append(event)
    return out


for cls in (SyncOwner, AsyncOwner):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    port, events = Channel.open()
    owner = procs.spawn("owner", cls, port)
    print(f"{cls.__name__}:", owner.fail_children.call_one().get(timeout=60))
    first = events.recv().get(timeout=20)
    print("  first event:", first)
    procs.stop().get(timeout=60)
    print("  stopped")
    print("  events after stop:", until_cleanup(events))
    time.sleep(HOOK_WINDOW_S)
    print("  hook calls:", len([f for f in unhandled if "crashed_ranks=[]" not in repr(f)]))
    unhandled.clear()
print("done")
