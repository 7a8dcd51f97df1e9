"""A failure while another controller thread waits on a different actor of the same proc: an actor
that fails on its own leaves the other's call to finish; a process that exits fails it, and the
other actor's later calls. Sync and async waiting actor."""

# the waiter thread is joined inside its loop iteration
# ruff: noqa: B023

import os
import re
import tempfile
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond those expected has no event ordered after it (the hook is called by
# the runtime's supervision on its own, not from any call's reply): its absence is checked by
# waiting this long for one
HOOK_WINDOW_S = 1.0


def lines(e: object) -> str:
    ls = [line.strip() for line in str(e).strip().splitlines()]
    return " | ".join(ls[:2])


def hooked(n: int) -> list[str]:
    """The actor meshes the hook heard of, once ``n`` had come (or 60 s went by), and any that
    came within ``HOOK_WINDOW_S`` more."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with lock:
            if len({f.mesh_name for f in failures if not f.mesh_name.startswith("logger")}) >= n:
                break
        time.sleep(0.05)
    time.sleep(HOOK_WINDOW_S)
    with lock:
        heard = sorted({re.sub(r"-\w+$", "", f.mesh_name) for f in failures if not f.mesh_name.startswith("logger")})
        failures.clear()
    return heard


# the files the client makes for its actors to wait on; removed at exit
scratch = tempfile.TemporaryDirectory()


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class Slow(Actor):
    @endpoint
    def wait(self, started: Port[str], release: str) -> str:
        started.send("waiting")
        wait_for_file(release)  # made once the other actor's failure is known
        return "slow done"


class AsyncSlow(Actor):
    @endpoint
    async def wait(self, started: Port[str], release: str) -> str:
        started.send("waiting")
        wait_for_file(release)
        return "slow done"


class Bad(Actor):
    @endpoint
    def fail(self, how: str) -> None:
        if how == "exit":
            os._exit(9)
        raise SystemExit(4)


for slow_cls in (Slow, AsyncSlow):
    for how in ("actor", "exit"):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        slow = procs.spawn("slow", slow_cls)
        bad = procs.spawn("bad", Bad)
        result: list[str] = []
        port, started = Channel.open()
        release = os.path.join(scratch.name, f"release-{slow_cls.__name__}-{how}")

        def waiter() -> None:
            try:
                result.append(f"returned {slow.wait.call_one(port, release).get(timeout=60)}")
            except Exception as e:
                result.append(f"{type(e).__name__}: {lines(e)}")

        th = threading.Thread(target=waiter)
        th.start()
        started.recv().get(timeout=60)  # the other thread's call is in hand
        try:
            bad.fail.call_one(how).get(timeout=60)
        except Exception as e:
            print(f"{slow_cls.__name__} {how} failing call: {type(e).__name__}: {lines(e)}")
        open(release, "w").close()
        th.join()
        print(f"{slow_cls.__name__} {how} other thread: {' / '.join(result)}")
        try:
            print(f"{slow_cls.__name__} {how} slow again: {slow.wait.call_one(port, release).get(timeout=60)}")
        except Exception as e:
            print(f"{slow_cls.__name__} {how} slow again: {type(e).__name__}: {lines(e)}")
        # bad's failure, and slow's when its process went with it
        heard = hooked(1 + result[0].startswith("SupervisionError"))
        procs.stop().get()
        print("hook:", heard)
print("done")
