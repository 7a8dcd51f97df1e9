"""Constructor arguments an actor's __init__ cannot take (too many, an unknown keyword, a missing
one) raise TypeError at spawn(), nothing sent: no actor fails, the hook hears nothing, and the
same procs then spawn the class with arguments it takes (procs where an actor had failed would
refuse). Sync and async actor."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, endpoint, this_host

failures: list[MeshFailure] = []
actor_api.unhandled_fault_hook = failures.append


class W(Actor):
    def __init__(self, x: int, y: int = 0) -> None:
        self.total = x + y

    @endpoint
    def total_of(self) -> int:
        return self.total


class AsyncW(Actor):
    def __init__(self, x: int, y: int = 0) -> None:
        self.total = x + y

    @endpoint
    async def total_of(self) -> int:
        return self.total


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()}")
    except Exception as e:
        # what bind() said, without the signature a system may put before it
        print(f"  {label}: {type(e).__name__}: {str(e).rsplit('): ', 1)[-1]}")


for cls in (W, AsyncW):
    print(f"{cls.__name__}:")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    attempt("too many", lambda: procs.spawn("w", cls, 1, 2, 3).total_of.call().get(timeout=60).values())
    attempt("an unknown keyword", lambda: procs.spawn("w", cls, 1, z=2).total_of.call().get(timeout=60).values())
    attempt("one missing", lambda: procs.spawn("w", cls).total_of.call().get(timeout=60).values())
    attempt("then arguments it takes", lambda: procs.spawn("w", cls, 1, y=2).total_of.call().get(timeout=60).values())
    procs.stop().get(timeout=60)
print("hook calls:", len(failures))
print("done")
