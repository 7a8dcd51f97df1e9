"""An async program: awaited futures, async actors, concurrent endpoints, stream and Accumulator."""

import asyncio
import operator

from monarch.actor import Accumulator, Actor, concurrent_endpoint, current_rank, endpoint, this_host


class Shard(Actor):
    def __init__(self, base: int) -> None:
        self.base = base
        self.items: list[int] = []
        self.gate = asyncio.Event()

    @endpoint
    async def load(self, n: int) -> int:
        await asyncio.sleep(0)
        self.items = [self.base + current_rank().rank * 10 + i for i in range(n)]
        return len(self.items)

    @endpoint
    async def total(self) -> int:
        return sum(self.items)

    @endpoint
    async def rank(self) -> int:
        return current_rank().rank

    @concurrent_endpoint
    async def wait_for_gate(self) -> str:
        # only a concurrent endpoint can wait here while open_gate runs
        await self.gate.wait()
        return f"passed {current_rank().rank}"

    @concurrent_endpoint
    async def open_gate(self) -> str:
        self.gate.set()
        return "opened"


async def main() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    shards = procs.spawn("shards", Shard, 1000)

    sizes = await shards.load.call(3)
    print("loaded:", sizes.values())
    totals = await shards.total.call()
    print("totals:", list(totals.values()))
    print("one:", await shards.slice(gpus=2).total.call_one())
    print("stream:", sorted([await f for f in shards.total.stream()]))
    print("sum:", await Accumulator(shards.total, 0, operator.add).accumulate())
    print("max:", await Accumulator(shards.rank, -1, max).accumulate())

    # several calls in flight at once
    futs = [shards.slice(gpus=i).rank.call_one() for i in range(4)]
    print("gather:", await asyncio.gather(*futs))

    # a waiting concurrent call does not block the actor
    waiting = shards.wait_for_gate.call()
    print("open:", (await shards.open_gate.call()).values())
    print("waited:", (await waiting).values())

    # .get() still works from plain functions called by async code
    def blocking_total() -> int:
        return shards.slice(gpus=0).total.call_one().get()

    print("blocking:", blocking_total())
    asf = shards.slice(gpus=3).rank.call_one().as_asyncio()
    print("as_asyncio:", await asf)
    await procs.stop()
    print("done")


asyncio.run(main())
