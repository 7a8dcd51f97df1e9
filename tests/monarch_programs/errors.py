"""What a program sees when things go wrong: remote exceptions, bad calls, timeouts."""

import asyncio

from monarch.actor import Actor, ActorError, Future, concurrent_endpoint, current_rank, endpoint, this_host


class Flaky(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    def check(self, x: int, limit: int = 10) -> int:
        self.calls += 1
        if x > limit:
            raise ValueError(f"{x} is over {limit} on rank {current_rank().rank}")
        return x * 2

    @endpoint
    def fail_on(self, rank: int) -> str:
        if current_rank().rank == rank:
            raise KeyError("missing")
        return "fine"

    @endpoint
    def calls_so_far(self) -> int:
        return self.calls

    def helper(self) -> int:
        return 1


class Gate(Actor):
    def __init__(self) -> None:
        self.opened = asyncio.Event()

    @concurrent_endpoint
    async def wait(self) -> str:
        await self.opened.wait()
        return "released"

    @concurrent_endpoint
    async def open(self) -> None:
        self.opened.set()


class MixedUp(Actor):
    @endpoint
    def a(self) -> None:
        pass

    @endpoint
    async def b(self) -> None:
        pass


def describe(e: BaseException) -> str:
    inner = getattr(e, "exception", None)
    return f"{type(e).__name__}({type(inner).__name__}: {inner})" if inner is not None else type(e).__name__


procs = this_host().spawn_procs(per_host={"gpus": 2})
flaky = procs.spawn("flaky", Flaky)

try:
    flaky.check.call(11).get()
except ActorError as e:
    print("call:", describe(e), isinstance(e, Exception))
try:
    flaky.slice(gpus=1).check.call_one(50, limit=20).get()
except ActorError as e:
    print("call_one:", describe(e))
    lines = e.exception_formatted.strip().splitlines()
    print("remote traceback:", lines[0], "...", lines[-1])
try:
    flaky.fail_on.call(1).get()
except ActorError as e:
    print("one rank fails:", describe(e))
print("stream:", sorted(describe(f.exception()) if f.exception() else f.get() for f in flaky.fail_on.stream(0)))
fut = flaky.slice(gpus=0).check.call_one(99)
print("exception():", describe(fut.exception()))
ok = flaky.slice(gpus=0).check.call_one(4)
print("exception() when fine:", ok.exception(), ok.get())
print("actors live on:", flaky.check.call(1).get().values(), flaky.calls_so_far.call().get().values())


async def awaited() -> None:
    try:
        await flaky.slice(gpus=0).fail_on.call_one(0)
    except ActorError as e:
        print("await:", describe(e))


asyncio.run(awaited())

# mistakes caught before anything is sent
for label, attempt in [
    ("too many arguments", lambda: flaky.check.call(1, 2, 3)),
    ("unknown keyword", lambda: flaky.check.call(1, lim=3)),
    ("missing argument", lambda: flaky.check.call()),
    ("call_one on two actors", lambda: flaky.check.call_one(1)),
    ("endpoint called directly", lambda: flaky.check(1)),
    ("method without @endpoint", lambda: flaky.helper()),
    ("no such attribute", lambda: flaky.nothing_here),
    ("mixed sync and async endpoints", lambda: procs.spawn("mixed", MixedUp)),
    ("constructing a Future", lambda: Future()),
]:
    try:
        attempt()
        print(label, "-> no error")
    except Exception as e:
        print(label, "->", type(e).__name__)

# a timeout leaves the future usable
gate = procs.slice(gpus=1).spawn("gate", Gate)
waiting = gate.wait.call_one()
try:
    waiting.get(timeout=0.1)
except TimeoutError as e:
    print("timeout:", type(e).__name__)
gate.open.broadcast()
print("after timeout:", waiting.get(timeout=60))

procs.stop().get()
print("done")
