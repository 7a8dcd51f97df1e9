"""stop() finishes the job: it completes after the message in hand and __cleanup__ have
finished; queued messages are dropped; in-flight concurrent endpoint tasks are cancelled before
__cleanup__; stopping an actor stops the meshes it spawned; procs exit normally (atexit)."""

import asyncio
import atexit
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, concurrent_endpoint, endpoint, this_host, this_proc

unhandled: list[MeshFailure] = []
# (Monarch reports a message to a stopped actor there)
actor_api.unhandled_fault_hook = unhandled.append


class SyncWorker(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        atexit.register(print, "actor says atexit handler ran")

    @endpoint
    def work(self, seconds: float) -> str:
        self.events.send("work started")
        time.sleep(seconds)
        self.events.send("work finished")
        return "work result"

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send(f"cleanup ({exc})")


class AsyncWorker(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.never = asyncio.Event()

    @endpoint
    async def work(self, seconds: float) -> str:
        self.events.send("work started")
        await asyncio.sleep(seconds)
        self.events.send("work finished")
        return "work result"

    @concurrent_endpoint
    async def wait_forever(self) -> str:
        self.events.send("task started")
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.events.send("task cancelled")
            raise
        return "never"

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send(f"cleanup ({exc})")


class Child(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events

    @endpoint
    def ping(self) -> str:
        return "child pong"

    def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("child cleanup")


class Parent(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.child = this_proc().spawn("child", Child, events)

    @endpoint
    def ping_child(self) -> str:
        return self.child.ping.call_one().get()

    def __cleanup__(self, exc: Exception | None) -> None:
        self.events.send("parent cleanup")


def drain(receiver, n: int) -> list[str]:
    """The ``n`` events expected, or those that came within a few seconds each."""
    out = []
    for _ in range(n):
        try:
            out.append(receiver.recv().get(timeout=5))
        except TimeoutError:
            out.append("(nothing more)")
            break
    return out


def outcome(fut) -> str:
    try:
        return f"returned {fut.get(timeout=60)!r}"
    except Exception as e:
        return type(e).__name__


procs = this_host().spawn_procs(per_host={"gpus": 1})
for cls in (SyncWorker, AsyncWorker):
    port, events = Channel.open()
    w = procs.spawn(cls.__name__.lower(), cls, port)
    print(f"{cls.__name__}:", w.ping.call_one().get(timeout=60))
    work = w.work.call_one(1.0)
    print("  first event:", events.recv().get(timeout=60))
    queued = w.ping.call_one()
    t0 = time.monotonic()
    w.stop().get(timeout=60)
    print("  stop waited for the handler:", time.monotonic() - t0 > 0.5)
    print("  events by then:", drain(events, 2))
    print("  in-flight call:", outcome(work))
    print("  queued call:", outcome(queued))
    print("  call after stop:", outcome(w.ping.call_one()))

port, events = Channel.open()
w = procs.spawn("concurrent", AsyncWorker, port)
task = w.wait_forever.call_one()
print("concurrent:", events.recv().get(timeout=60))
w.stop().get(timeout=60)
print("  events by then:", drain(events, 2))
print("  in-flight task call:", outcome(task))

port, events = Channel.open()
parent = procs.spawn("parent", Parent, port)
print("parent:", parent.ping_child.call_one().get(timeout=60))
parent.stop().get(timeout=60)
print("  events by then:", sorted(drain(events, 2)))

procs.stop().get()
print("done")
