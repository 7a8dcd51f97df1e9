"""Errors in Monarch's words: ActorError's message and text, and the programming errors
caught before anything is sent, for a sync and an async actor; a return value that cannot be
pickled, and a spawn of a class that is not an Actor."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import threading

from monarch.actor import Actor, ActorError, as_endpoint, endpoint, this_host


class SyncActor(Actor):
    @endpoint
    def boom(self, x: int) -> int:
        raise ValueError(f"bad value {x}")

    def helper(self) -> int:
        return 1

    async def async_helper(self) -> int:
        return 2


class AsyncActor(Actor):
    @endpoint
    async def boom(self, x: int) -> int:
        raise ValueError(f"bad value {x}")

    def helper(self) -> int:
        return 1


class Returns(Actor):
    @endpoint
    def lock(self) -> object:
        return threading.Lock()


class Mixed(Actor):
    @endpoint
    def a(self) -> None:
        pass

    @endpoint
    async def b(self) -> None:
        pass


def show(label: str, fn) -> None:
    try:
        r = fn()
        print(f"{label}: returned {type(r).__name__}")
    except ActorError as e:
        lines = str(e).splitlines()
        # the headline, the remote traceback's first line and its last (the lines between the
        # headline and the traceback, naming the ranks that failed, are ours: a documented addition)
        header = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("Traceback")), lines[1].strip())
        print(f"{label}: ActorError message={e.message!r}")
        print(f"  exception: {type(e.exception).__name__}: {e.exception}")
        print(f"  str: {lines[0]!r} / {header!r} ... {lines[-1]!r}")
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {e}")


procs = this_host().spawn_procs(per_host={"gpus": 2})
for cls in (SyncActor, AsyncActor):
    name = cls.__name__.lower()
    mesh = procs.spawn(name, cls)
    print(f"-- {cls.__name__}")
    show("call_one", lambda: mesh.slice(gpus=0).boom.call_one(1).get())
    show("call", lambda: mesh.boom.call(2).get())
    show("stream", lambda: [f.get() for f in mesh.boom.stream(3)])
    try:
        mesh.boom(4)
    except Exception as e:
        # (Monarch's message names its Rust endpoint class)
        print(f"endpoint called directly: {type(e).__name__}")
    show("method without @endpoint", lambda: mesh.helper())
    show("as_endpoint of a plain method", lambda: as_endpoint(mesh.helper).call().get().values())
    show("as_endpoint of a non-method", lambda: as_endpoint(print))
    show("no such attribute", lambda: mesh.nothing)
show(
    "as_endpoint of an async method on a sync actor", lambda: as_endpoint(procs.spawn("s2", SyncActor).async_helper).call().get()
)
show("mixed sync and async endpoints", lambda: procs.spawn("mixed", Mixed))
try:
    procs.spawn("returns", Returns).slice(gpus=0).lock.call_one().get()
except ActorError as e:
    lines = str(e).strip().splitlines()
    print(f"unpicklable return: ActorError exception={type(e.exception).__name__} first={lines[0]!r} last={lines[-1]!r}")
try:
    procs.spawn("notactor", int)
except Exception as e:
    # (the message names the module Actor comes from)
    print(f"spawn of a class that is not an Actor: {type(e).__name__}, says 'must subclass': {'must subclass' in str(e)}")
procs.stop().get()
print("done")
