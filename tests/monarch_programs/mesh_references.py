"""Meshes handed to actors, actors calling actors, controllers, this_proc and context()."""

from monarch.actor import (
    Actor,
    ProcMesh,
    context,
    current_rank,
    endpoint,
    get_or_spawn_controller,
    this_host,
    this_proc,
)


class Registry(Actor):
    """A singleton: every get_or_spawn_controller("registry", ...) reaches this one."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.entries: list[tuple[str, int]] = []

    @endpoint
    async def register(self, who: str, rank: int) -> int:
        self.entries.append((who, rank))
        return len(self.entries)

    @endpoint
    async def entries_sorted(self) -> tuple[str, list[tuple[str, int]]]:
        return self.label, sorted(self.entries)


class DataLoader(Actor):
    def __init__(self) -> None:
        self.served = 0

    @endpoint
    def batch(self) -> str:
        self.served += 1
        return f"batch {self.served} from loader {current_rank().rank}"


class Trainer(Actor):
    def __init__(self, loaders: DataLoader) -> None:
        me = context().actor_instance
        # the loader at the same coordinates as this trainer
        self.loader = loaders.slice(**me.rank)
        self.registry = get_or_spawn_controller("registry", Registry, "first").get()
        self.registry.register.call_one("trainer", me.rank.rank).get()

    @endpoint
    def step(self) -> str:
        return f"trainer {current_rank().rank} got {self.loader.batch.call_one().get()}"

    @endpoint
    def survey(self, loaders: DataLoader) -> list[str]:
        return sorted(loaders.batch.call().get().values())

    @endpoint
    def ranks(self) -> tuple[dict[str, int], dict[str, int], str, str]:
        me = context().actor_instance
        return dict(context().message_rank), dict(me.rank), me.name, me.class_name


class Aggregator(Actor):
    @endpoint
    async def gather(self, trainers: Trainer) -> list[str]:
        return sorted([await f for f in trainers.step.stream()])


procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
loaders = procs.spawn("loaders", DataLoader)
trainers = procs.spawn("trainers", Trainer, loaders)
for line in trainers.step.call().get().values():
    print(line)

# the controller the trainers registered with is the one the client gets
registry = get_or_spawn_controller("registry", Registry, "second").get()
print("registered:", registry.register.call_one("client", -1).get())
print("entries:", registry.entries_sorted.call_one().get())

# a mesh passed as an argument, called from inside another actor
print("survey:", trainers.slice(hosts=1, gpus=1).survey.call_one(loaders).get())
agg = this_proc().spawn("aggregator", Aggregator)
for line in agg.gather.call_one(trainers).get():
    print("gathered:", line)

# message rank is the position in the slice that was called; actor rank is fixed at spawn
print("ranks:", trainers.slice(gpus=1).ranks.call().get().values())

# the client is an actor too
me = context().actor_instance
print("client:", repr(me), dict(me.rank), dict(current_rank()))
print("proc types:", isinstance(procs, ProcMesh), isinstance(this_proc(), ProcMesh), this_proc().extent)

procs.stop().get()
print("done")
