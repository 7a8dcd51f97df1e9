"""Actors that spawn actors, proc bootstrap, cleanup on stop, returns_future, as_endpoint, one-shot channels."""

import asyncio
import os

from monarch.actor import (
    Actor,
    Channel,
    Port,
    as_endpoint,
    context,
    current_rank,
    endpoint,
    returns_future,
    this_host,
    this_proc,
)


def prepare_proc() -> None:
    # runs in every new proc before any actor
    os.environ["PREPARED_BY"] = "bootstrap"


class Leaf(Actor):
    @endpoint
    def lineage(self) -> tuple[str, str, str, dict[str, int]]:
        me = context().actor_instance
        return repr(me), repr(me.creator), me.creator.name, dict(me.creator.rank)


class Branch(Actor):
    def __init__(self, report: Port[str]) -> None:
        self.report = report
        # an actor can spawn actors in its own proc
        self.leaf = this_proc().spawn("leaf", Leaf)

    @endpoint
    def leaf_lineage(self) -> tuple[str, str, str, dict[str, int]]:
        return self.leaf.lineage.call_one().get()

    @endpoint
    def environment(self) -> tuple[str | None, str, str]:
        return os.environ.get("PREPARED_BY"), type(this_host()).__name__, type(context().actor_instance.proc).__name__

    def offset(self, x: int) -> int:
        # not an endpoint: callable only through as_endpoint
        return x + 100 * current_rank().rank

    def __cleanup__(self, exc: Exception | None) -> None:
        self.report.send(f"cleanup of rank {context().actor_instance.rank.rank}, error: {exc}")


class Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def tick(self, port: Port[int]) -> None:
        self.n += 1
        port.send(self.n)


class OneShot(Actor):
    """Stops itself when its work is done."""

    def __init__(self, report: Port[str]) -> None:
        self.report = report

    @endpoint
    def work(self) -> str:
        context().actor_instance.stop()
        return "finishing"

    def __cleanup__(self, exc: Exception | None) -> None:
        self.report.send("one-shot cleaned up")


procs = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=prepare_proc)
cleanup_port, cleanups = Channel.open()
branches = procs.spawn("branch", Branch, cleanup_port)
for line in branches.leaf_lineage.call().get().values():
    print("lineage:", line)
print("environment:", branches.environment.call().get().values())
print("as_endpoint call:", as_endpoint(branches.offset).call(7).get().values())
print("as_endpoint call_one:", as_endpoint(branches.slice(gpus=1).offset).call_one(7).get())


@returns_future
async def count_leaves() -> int:
    lines = await branches.leaf_lineage.call()
    return len(lines)


print("returns_future get:", count_leaves().get())


async def main() -> int:
    return await count_leaves()


print("returns_future await:", asyncio.run(main()))

counter = procs.slice(gpus=0).spawn("counter", Counter)
once, first = Channel.open(once=True)
counter.tick.broadcast(once)
print("once:", first.recv().get())

# stopping an actor mesh runs __cleanup__ in each actor
branches.stop().get()
print("cleanups:", sorted(cleanups.recv().get(timeout=60) for _ in range(2)))
# an actor may stop itself; its __cleanup__ runs once the message in hand is done
done_port, done = Channel.open()
one_shot = procs.slice(gpus=1).spawn("one_shot", OneShot, done_port)
print("one-shot:", one_shot.work.call_one().get(), "->", done.recv().get(timeout=60))
print("client creator:", context().actor_instance.creator)
procs.stop().get()
print("done")
