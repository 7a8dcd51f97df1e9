"""A wait that times out: get(timeout=...) on the future of every adverb (call_one, call, stream,
choose, an Accumulator) raises TimeoutError once the timeout has passed, again when read again,
and gives the value once the endpoint returns; stream() hands out its futures at once, so a
rank that hangs does not hold up the loop over them; the actor takes its next call. A receiver's
recv() that timed out takes the next value sent; one whose await was cancelled by
asyncio.wait_for takes it too, so the value is lost to the next recv(). A negative, infinite or
NaN timeout is refused (ValueError), a non-number too (TypeError). Sync and async actor.
(Left out, as they differ; see the compatibility page in docs/: a timed-out Accumulator future
raises TimeoutError for good on 0.7.0 and gives its value here; Future.exception(timeout=...)
returns the TimeoutError there and raises it here, as concurrent.futures does; monarch_nb's
TimeoutError says what was not ready, 0.7.0's says nothing.)"""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import asyncio
import operator
import os
import tempfile
import time

from monarch.actor import Accumulator, Actor, Channel, current_rank, endpoint, this_host

# the files the actors wait on before they return; removed at exit
scratch = tempfile.TemporaryDirectory()
TIMEOUT_S = 0.3


class Held(Actor):
    @endpoint
    def hold(self, d: str) -> int:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return current_rank().rank

    @endpoint
    def ping(self) -> str:
        return "pong"


class AsyncHeld(Actor):
    @endpoint
    async def hold(self, d: str) -> int:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return current_rank().rank

    @endpoint
    async def ping(self) -> str:
        return "pong"


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()}")
    except Exception as e:
        print(f"  {label}: {type(e).__name__} (a TimeoutError: {isinstance(e, TimeoutError)})")


procs = this_host().spawn_procs(per_host={"gpus": 2})
for cls in (Held, AsyncHeld):
    m = procs.spawn(cls.__name__.lower(), cls)
    for adverb in ("call_one", "call", "stream", "choose", "accumulate"):
        print(f"{cls.__name__} {adverb}:")
        d = tempfile.mkdtemp(dir=scratch.name)
        if adverb == "call_one":
            futs = [m.slice(gpus=0).hold.call_one(d)]
        elif adverb == "call":
            futs = [m.hold.call(d)]
        elif adverb == "stream":
            # the iterator blocks on nothing: both futures are had while both ranks still hold
            futs = list(m.hold.stream(d))
            print("  stream gave its futures while the ranks hold:", not os.path.exists(os.path.join(d, "go")), len(futs))
        elif adverb == "choose":
            futs = [m.hold.choose(d)]
        else:
            futs = [Accumulator(m.hold, 10, operator.add).accumulate(d)]
        t0 = time.monotonic()
        attempt(f"get(timeout={TIMEOUT_S})", lambda: futs[0].get(timeout=TIMEOUT_S))
        print("  after the timeout had passed:", time.monotonic() - t0 >= TIMEOUT_S - 0.05)
        attempt("get(timeout=0) again", lambda: futs[0].get(timeout=0))
        open(os.path.join(d, "go"), "w").close()

        def value(f):  # type: ignore[no-untyped-def]
            r = f.get(timeout=60)
            return sorted(r.values()) if hasattr(r, "values") else r

        if adverb == "accumulate":
            # 0.7.0's Accumulator future raises the TimeoutError again at once when read after
            # a timeout, for good; here it gives the sum (see the compatibility page in docs/)
            pass
        elif adverb == "choose":
            attempt("get() once the endpoint returned", lambda: value(futs[0]) in (0, 1))
        else:
            attempt(
                "get() once the endpoint returned", lambda: sorted(value(f) for f in futs) if len(futs) > 1 else value(futs[0])
            )
        if adverb != "accumulate":
            attempt("get() again", lambda: value(futs[0]) in (0, 1, [0, 1]))
        attempt("the next call", lambda: m.ping.call().get(timeout=60).values())

print("a receiver:")
port, receiver = Channel.open()
first = receiver.recv()
attempt(f"recv().get(timeout={TIMEOUT_S})", lambda: first.get(timeout=TIMEOUT_S))
port.send("one")
port.send("two")
attempt("the timed-out recv() once a value was sent", lambda: first.get(timeout=60))
attempt("a new recv()", lambda: receiver.recv().get(timeout=60))


async def cancelled_recv() -> None:
    port, receiver = Channel.open()
    try:
        await asyncio.wait_for(receiver.recv(), TIMEOUT_S)
        print("  await recv(): returned")
    except TimeoutError:
        print("  await recv() in asyncio.wait_for: TimeoutError")
    port.send("three")
    port.send("four")
    print("  the next await recv():", await asyncio.wait_for(receiver.recv(), 60))


asyncio.run(cancelled_recv())

print("a timeout that is not a number of seconds to wait:")
m = procs.spawn("plain", Held)
for bad in (-1, float("nan"), float("inf"), "1"):
    try:
        m.ping.call().get(timeout=bad)  # type: ignore[arg-type]
        print(f"  {bad!r}: returned")
    except (TypeError, ValueError) as e:
        # (the words for a value that is not a number differ: Python's in each)
        print(f"  {bad!r}: {type(e).__name__}" + (f": {e}" if isinstance(e, ValueError) else ""))
procs.stop().get(timeout=60)
print("done")
