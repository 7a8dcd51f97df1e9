"""A failure while another controller thread waits on a different actor of the same proc: an actor
that fails on its own leaves the other's call to finish; a process that exits fails it, and the
other actor's later calls. Sync and async waiting actor."""

# the waiter thread is joined inside its loop iteration
# ruff: noqa: B023

import os
import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


def lines(e: object) -> str:
    ls = [line.strip() for line in str(e).strip().splitlines()]
    return " | ".join(ls[:2])


class Slow(Actor):
    @endpoint
    def wait(self, s: float) -> str:
        time.sleep(s)
        return "slow done"


class AsyncSlow(Actor):
    @endpoint
    async def wait(self, s: float) -> str:
        time.sleep(s)
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

        def waiter() -> None:
            try:
                result.append(f"returned {slow.wait.call_one(3.0).get(timeout=60)}")
            except Exception as e:
                result.append(f"{type(e).__name__}: {lines(e)}")

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.5)
        try:
            bad.fail.call_one(how).get(timeout=60)
        except Exception as e:
            print(f"{slow_cls.__name__} {how} failing call: {type(e).__name__}: {lines(e)}")
        th.join()
        print(f"{slow_cls.__name__} {how} other thread: {' / '.join(result)}")
        try:
            print(f"{slow_cls.__name__} {how} slow again: {slow.wait.call_one(0.0).get(timeout=60)}")
        except Exception as e:
            print(f"{slow_cls.__name__} {how} slow again: {type(e).__name__}: {lines(e)}")
        procs.stop().get()
        with lock:
            print("hook:", sorted({re.sub(r"-\w+$", "", f.mesh_name) for f in failures if not f.mesh_name.startswith("logger")}))
            failures.clear()
print("done")
