"""An endpoint that raises on some ranks of a 2-D mesh and of its slices: call() raises the
ActorError of the lowest failed rank, stream() gives each rank's value or error, a slice's ranks
(current_rank(), the value mesh's items()) count within the slice, call_one() on a one-rank slice
and its refusal on a larger one; the actors serve on. Then a raise in a broadcast, which no caller
receives: the hook gets that rank's failure and the mesh's next call fails with it, while a slice
without it answers."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, ActorError, MeshFailure, current_rank, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    # Monarch also reports its internal logger mesh, and tells the hook of each call that reached
    # the failed actor besides its caller ("undeliverable message", a difference the
    # compatibility page lists): only the actor mesh's failure counts here
    if not failure.mesh_name.startswith("logger") and "undeliverable message" not in str(failure):
        with lock:
            failures.append(failure)


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond the one expected has no event ordered after it (the hook is called
# by the runtime's supervision on its own, not from any call's reply): its absence is checked by
# waiting this long for one
HOOK_WINDOW_S = 1.0


class W(Actor):
    @endpoint
    def f(self, bad: list[int]) -> tuple[int, dict[str, int]]:
        r = current_rank()
        if r.rank in bad:
            raise ValueError(f"rank {r.rank} {dict(r)} refuses")
        return (r.rank, dict(r))


class AsyncW(Actor):
    @endpoint
    async def f(self, bad: list[int]) -> tuple[int, dict[str, int]]:
        r = current_rank()
        if r.rank in bad:
            raise ValueError(f"rank {r.rank} {dict(r)} refuses")
        return (r.rank, dict(r))


def first_line(e: object) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()}")
    except ActorError as e:
        print(f"  {label}: ActorError {type(e.exception).__name__}: {e.exception} ({first_line(e)!r})")
    except Exception as e:
        print(f"  {label}: {type(e).__name__}: {first_line(e)}")


def streamed(it) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    for fut in it:
        try:
            out.append(f"{fut.get(timeout=60)}")
        except ActorError as e:
            out.append(f"ActorError {e.exception}")
    return sorted(out)


def wait_until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while not pred():
        if time.monotonic() > deadline:
            print("timed out waiting for", what)
            return
        time.sleep(0.05)


for cls in (W, AsyncW):
    print(cls.__name__)
    procs = this_host().spawn_procs(per_host={"replicas": 2, "gpus": 3})
    m = procs.spawn(cls.__name__.lower(), cls)
    attempt("call, rank 4 raises", lambda: m.f.call([4]).get(timeout=60))
    attempt("call, ranks 2 and 4 raise", lambda: m.f.call([4, 2]).get(timeout=60))
    attempt("stream, ranks 1 and 4 raise", lambda: streamed(m.f.stream([1, 4])))
    row = m.slice(replicas=1)
    attempt("slice replicas=1, items", lambda: list(row.f.call([]).get(timeout=60).items()))
    attempt("slice replicas=1, its rank 1 raises", lambda: row.f.call([1]).get(timeout=60))
    attempt("slice replicas=1, rank 4 of the mesh named", lambda: sorted(row.f.call([4]).get(timeout=60).values()))
    cols = m.slice(gpus=slice(1, 3))
    attempt("slice gpus=1:3, items", lambda: list(cols.f.call([]).get(timeout=60).items()))
    attempt("slice gpus=1:3, its rank 3 raises", lambda: cols.f.call([3]).get(timeout=60))
    attempt("slice gpus=1:3, stream, its rank 1 raises", lambda: streamed(cols.f.stream([1])))
    attempt("one-rank slice, call_one", lambda: m.slice(replicas=1, gpus=2).f.call_one([5]).get(timeout=60))
    attempt("one-rank slice, call_one raises", lambda: m.slice(replicas=1, gpus=2).f.call_one([0]).get(timeout=60))
    attempt("two-rank slice, call_one", lambda: cols.slice(replicas=0).f.call_one([]).get(timeout=60))
    attempt("the actors serve on", lambda: sorted(m.f.call([]).get(timeout=60).values()))
    attempt("broadcast, rank 4 raises", lambda: m.f.broadcast([4]))
    wait_until(lambda: failures, "the hook")
    time.sleep(HOOK_WINDOW_S)
    with lock:
        print("  hook:", [(f.mesh_name.split("-")[0], first_line(f).split("event=")[-1]) for f in failures])
        failures.clear()
    attempt("call after", lambda: m.f.call([]).get(timeout=60))
    attempt("slice replicas=0 after", lambda: sorted(m.slice(replicas=0).f.call([]).get(timeout=60).values()))
    procs.stop().get(timeout=60)
print("done")
