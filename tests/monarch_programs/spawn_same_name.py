"""Each spawn is its own mesh: the same name spawned again by the client, and by an actor, on the
same procs gives distinct meshes, each with its own state; the actors keep the name they were given."""

from monarch.actor import Actor, context, endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def who(self) -> str:
        return repr(context().actor_instance)


class Spawner(Actor):
    @endpoint
    async def spawn_counter(self, procs, start: int) -> list[int]:
        mesh = procs.spawn("counter", Counter, start)
        return list((await mesh.incr.call()).values())


procs = this_host().spawn_procs(per_host={"gpus": 2})
first = procs.spawn("counter", Counter, 0)
print("first:", list(first.incr.call().get().values()))
second = procs.spawn("counter", Counter, 100)
print("second:", list(second.incr.call().get().values()))
print("first again:", list(first.incr.call().get().values()))
spawner = procs.spawn("spawner", Spawner)
print("by an actor:", spawner.slice(gpus=0).spawn_counter.call_one(procs, 1000).get())
print("first still:", list(first.incr.call().get().values()))
print("second still:", list(second.incr.call().get().values()))
print("names:", sorted(set(first.who.call().get().values())))
print("same name, other mesh:", sorted(set(second.who.call().get().values())))
procs.stop().get()
print("done")
