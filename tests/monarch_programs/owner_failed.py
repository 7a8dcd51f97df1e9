"""An actor that spawned a mesh fails (an endpoint raises SystemExit; then one raises in a
broadcast): its caller gets the SupervisionError, the hook one report, and the meshes it spawned
are stopped, their __cleanup__ run ("... and all its descendants have failed"). Sync and async
owner. (Calls to such a child mesh afterwards differ: on 0.7.0 they never return, here they fail
saying its procs were stopped; see the compatibility page in docs/.)"""

import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, current_rank, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    # Monarch also reports its internal logger mesh; only the actor mesh counts here
    if not failure.mesh_name.startswith("logger"):
        with lock:
            failures.append(failure)


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond the one expected has no event ordered after it (the hook is called
# by the runtime's supervision on its own, not from any call's reply): its absence is checked by
# waiting this long for one
HOOK_WINDOW_S = 1.0


def first_line(e: object) -> str:
    return re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", (str(e).strip().splitlines() or [""])[0])


class Kid(Actor):
    @endpoint
    def ping(self) -> int:
        return current_rank().rank

    def __cleanup__(self, exc: Exception | None) -> None:
        # (no rank here: 0.7.0's current_rank() in __cleanup__ is 0 on every rank)
        print(f"actor says kid cleanup, exc={exc!r}", flush=True)


class Owner(Actor):
    @endpoint
    def start(self) -> list[int]:
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.kids = self.procs.spawn("kids", Kid)
        return sorted(self.kids.ping.call().get().values())

    @endpoint
    def exit(self) -> None:
        raise SystemExit(5)

    @endpoint
    def boom(self) -> None:
        raise ValueError("nobody hears this")


class AsyncOwner(Actor):
    @endpoint
    async def start(self) -> list[int]:
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.kids = self.procs.spawn("kids", Kid)
        return sorted((await self.kids.ping.call()).values())

    @endpoint
    async def exit(self) -> None:
        raise SystemExit(5)

    @endpoint
    async def boom(self) -> None:
        raise ValueError("nobody hears this")


def wait_for_hook() -> None:
    deadline = time.monotonic() + 30
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(HOOK_WINDOW_S)


for cls in (Owner, AsyncOwner):
    for how in ("exit", "boom"):
        print(f"{cls.__name__}, {how}:")
        home = this_host().spawn_procs(per_host={"gpus": 1})
        owner = home.spawn(cls.__name__.lower(), cls)
        print("  the kids answer:", owner.start.call_one().get(timeout=60))
        if how == "exit":
            try:
                owner.exit.call_one().get(timeout=60)
                print("  exit: returned")
            except Exception as e:
                print(f"  exit: {type(e).__name__}: {first_line(e)}")
        else:
            owner.boom.broadcast()
        wait_for_hook()
        with lock:
            print("  hook:", [first_line(f) for f in failures])
            failures.clear()
        # the kids' cleanup lines come before the stop returns: their procs end with the owner's
        home.stop().get(timeout=60)
print("done")
