"""A rank whose process dies in the middle of a call to three ranks, through stream, Accumulator
and call, for a sync and an async actor: the live ranks' values, the dead rank's error, and the
hook's report, which names the actor mesh also when the mesh is stopped as soon as the call failed
(before session 28 the report could come after that stop and name the proc mesh)."""

import operator
import os
import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Accumulator, Actor, MeshFailure, current_rank, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


def heard() -> list[str]:
    """The actor meshes the hook heard of, once it heard of one (or 60 s went by): the report
    may come after the call failed, and after the stop."""
    deadline = time.monotonic() + 60
    while True:
        with lock:
            names = {re.sub(r"-\w+$", "", f.mesh_name) for f in failures if not f.mesh_name.startswith("logger")}
        if names or time.monotonic() > deadline:
            return sorted(names)
        time.sleep(0.05)


def lines(e: object) -> str:
    ls = [line.strip() for line in str(e).strip().splitlines()]
    return " | ".join(ls[:2])


class W(Actor):
    @endpoint
    def step(self) -> int:
        r = current_rank().rank
        if r == 1:
            time.sleep(0.3)
            os._exit(5)
        return r * 10


class AW(Actor):
    @endpoint
    async def step(self) -> int:
        r = current_rank().rank
        if r == 1:
            time.sleep(0.3)
            os._exit(5)
        return r * 10


for cls in (W, AW):
    for adverb in ("stream", "accumulate", "call"):
        procs = this_host().spawn_procs(per_host={"gpus": 3})
        m = procs.spawn("w", cls)
        if adverb == "stream":
            out = []
            for fut in m.step.stream():
                try:
                    out.append(f"value {fut.get(timeout=60)}")
                except Exception as e:
                    out.append(f"{type(e).__name__}: {lines(e)}")
            for o in sorted(out):
                print(f"{cls.__name__} stream:", o)
        else:
            try:
                if adverb == "accumulate":
                    r = Accumulator(m.step, 0, operator.add).accumulate().get(timeout=60)
                else:
                    r = m.step.call().get(timeout=60).values()
                print(f"{cls.__name__} {adverb}: returned {r}")
            except Exception as e:
                print(f"{cls.__name__} {adverb}: {type(e).__name__}: {lines(e)}")
        procs.stop().get()
        print("hook:", heard())
        with lock:
            failures.clear()
print("done")
