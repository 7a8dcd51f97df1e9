"""`async with` a proc mesh stops it at the end of the block; a stopped one is refused."""

import asyncio

from monarch.actor import Actor, endpoint, this_host


class Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    async def incr(self) -> int:
        self.n += 1
        return self.n


async def main() -> None:
    async with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        c = procs.spawn("c", Counter)
        print("inside:", list((await c.incr.call()).values()))
        kept = procs
    try:
        await c.incr.call()
        print("call after the block: returned")
    except Exception as e:
        print("call after the block:", type(e).__name__)
    try:
        async with kept:
            print("entered a stopped mesh")
    except Exception as e:
        print("entering a stopped mesh:", isinstance(e, RuntimeError), str(e)[:35])
    try:
        kept.spawn("d", Counter)
        print("spawn after the block: returned")
    except Exception as e:
        print("spawn after the block:", isinstance(e, RuntimeError), str(e)[:35])
    # the block ends with an error: the mesh still stops, the error goes on
    try:
        async with this_host().spawn_procs(per_host={"gpus": 1}) as p2:
            c2 = p2.spawn("c2", Counter)
            await c2.incr.call_one()
            raise ValueError("inside the block")
    except ValueError as e:
        print("raised out of the block:", e)
    try:
        await c2.incr.call_one()
        print("call after a failed block: returned")
    except Exception as e:
        print("call after a failed block:", type(e).__name__)
    # nested blocks stop once
    async with this_host().spawn_procs(per_host={"gpus": 1}) as p3:
        async with p3:
            c3 = p3.spawn("c3", Counter)
            print("nested:", await c3.incr.call_one())
    print("nested blocks done")


asyncio.run(main())
print("done")
