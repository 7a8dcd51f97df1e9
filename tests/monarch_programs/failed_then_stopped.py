"""A mesh one of whose actors failed (its process killed, or the actor itself raised SystemExit),
then its proc mesh stopped: a call to the mesh still fails with that failure, a call to a slice of
its live rank says it was stopped (before session 28 both said "stopped by client", losing what
went wrong). A slice of the failed rank alone is left out: 0.7.0 says it was stopped, naming rank 0
(see the compatibility notes)."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import os
import signal
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, endpoint, this_host

failures: list[MeshFailure] = []
actor_api.unhandled_fault_hook = failures.append


def lines(e: object) -> str:
    ls = [line.strip() for line in str(e).strip().splitlines()]
    return " | ".join(ls[:2])


class W(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def bye(self) -> None:
        raise SystemExit(3)


class AW(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def bye(self) -> None:
        raise SystemExit(3)


def stream_errors(w) -> list[BaseException]:  # type: ignore[no-untyped-def]
    out = []
    for fut in w.ping.stream():
        try:
            fut.get(timeout=30)
        except Exception as e:
            out.append(e)
    return out


def attempt(label, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        r = fn()
        print(f"{label}: returned {r}")
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {lines(e)}")


for cls, how in [(W, "kill"), (W, "exit actor"), (AW, "kill"), (AW, "exit actor")]:
    how = f"{cls.__name__} {how}"
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", cls)
    if how.endswith("kill"):
        os.kill(w.slice(gpus=1).pid.call_one().get(), signal.SIGKILL)
    else:
        attempt("bye", lambda: w.slice(gpus=1).bye.call_one().get(timeout=30))
    deadline = time.monotonic() + 30
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    attempt(f"{how}: call before stop", lambda: w.ping.call().get(timeout=30).values())
    procs.stop().get()
    attempt(f"{how}: stream after stop", lambda: sorted(lines(e) for e in stream_errors(w)))
    attempt(f"{how}: call after stop", lambda: w.ping.call().get(timeout=30).values())
    attempt(f"{how}: call_one live rank after stop", lambda: w.slice(gpus=0).ping.call_one().get(timeout=30))
    failures.clear()
print("done")
