"""A __cleanup__ that raises SystemExit (a BaseException, not an Exception) as its actor stops
is a failure of the actor, as a ValueError is (program cleanup_raises): at a proc mesh's stop the
fault hook gets one MeshFailure per rank (``cleanup error: SystemExit: 5``), stop() itself
returns, and later calls fail with it; an actor that stops itself is reported the same way. At an
actor mesh's own stop the hook hears nothing, and another actor on the same procs answers on.
A sync actor: an async actor's differs on purpose (0.7.0's __cleanup__ then runs into its stop
deadline, `cleanup error: deadline has elapsed`; see the compatibility page in docs/)."""

import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, context, endpoint, this_host

reports: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        reports.append(failure)


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond those expected (or any, at an actor mesh's own stop) has no event
# ordered after it: the hook is called by the runtime's supervision on its own, not from stop()'s
# or any call's reply. Its absence is checked by waiting this long for one
HOOK_WINDOW_S = 1.0


class SyncActor(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def leave(self) -> str:
        context().actor_instance.stop()
        return "leaving"

    def __cleanup__(self, exc: Exception | None) -> None:
        raise SystemExit(5)


def taken(n: int) -> list[MeshFailure]:
    """The hook's reports once ``n`` have come (or 30 s went by), and any that came within
    ``HOOK_WINDOW_S`` more."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with lock:
            if len(reports) >= n:
                break
        time.sleep(0.05)
    time.sleep(HOOK_WINDOW_S)
    with lock:
        got = list(reports)
        reports.clear()
    return sorted(got, key=lambda f: f.report())


def show(failures: list[MeshFailure]) -> None:
    print("  hook calls:", len(failures))
    for f in failures:
        print("   ", f.report().replace("\n", " |"))


def outcome(fut, value: bool = True) -> str:
    try:
        got = fut.get(timeout=60)
        return f"returned {got!r}" if value else "returned"
    except Exception as e:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: ... {lines[-1].strip() if lines else ''}"


for cls in (SyncActor,):
    print(f"{cls.__name__}, its proc mesh stopped:")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    c = procs.spawn("c", cls)
    print("  ping:", c.ping.call().get(timeout=60).item(gpus=1))
    print("  stop:", outcome(procs.stop(), value=False))
    show(taken(2))
    print("  call after:", outcome(c.ping.call()))
    print("  stop again:", outcome(procs.stop(), value=False))

    print(f"{cls.__name__}, its actor mesh stopped:")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    c = procs.spawn("c", cls)
    other = procs.spawn("other", cls)
    print("  ping:", c.ping.call().get(timeout=60).item(gpus=0))
    print("  stop:", outcome(c.stop(), value=False))
    show(taken(0))
    print("  another actor on its procs:", outcome(other.slice(gpus=1).ping.call_one()))
    procs.stop().get(timeout=60)
    show(taken(0))

    print(f"{cls.__name__}, the actor stops itself:")
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    c = procs.spawn("c", cls)
    print("  leave:", outcome(c.leave.call_one()))
    show(taken(1))
    procs.stop().get(timeout=60)
    show(taken(0))
print("done")
