"""Spawning, calling and reading results: procs, actors, adverbs, ValueMesh, Point, Extent, slicing."""

from monarch.actor import Actor, current_rank, current_size, endpoint, this_host


class Trainer(Actor):
    def __init__(self, lr: float, *, tag: str = "t") -> None:
        self.lr = lr
        self.tag = tag
        self.steps = 0

    @endpoint
    def train(self, step: int) -> str:
        self.steps += 1
        r = current_rank()
        return f"{self.tag} rank={r.rank} at={dict(r)} step={step} lr={self.lr}"

    @endpoint
    def where(self) -> tuple[int, dict[str, int], dict[str, int]]:
        return current_rank().rank, dict(current_rank()), current_size()

    @endpoint
    def bump(self, by: int = 1) -> None:
        self.steps += by

    @endpoint
    def count(self) -> int:
        return self.steps


procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 3})
print("proc extent:", procs.extent, procs.sizes, len(procs), procs.size(), procs.size("gpus"))
trainers = procs.spawn("trainers", Trainer, 0.5, tag="tr")
print("actor extent:", trainers.extent, len(trainers), trainers.size(["hosts", "gpus"]))

results = trainers.train.call(step=0).get()
print(results)
print("len:", len(results))
for point, text in results.items():
    print(point.rank, dict(point), repr(point), text)
print("values:", list(results.values()))
print("item:", results.item(hosts=1, gpus=2))
print("iter:", [(p.rank, v.split()[1]) for p, v in results])

# a slice keeps the dimensions given a range and drops the ones given an int
row = trainers.slice(hosts=1)
print("row:", row.extent, row.train.call(step=1).get().values())
col = trainers.slice(gpus=slice(1, 3))
print("col:", col.extent, sorted(col.where.call().get().values()))
one = trainers.slice(hosts=0, gpus=1)
print("one:", one.extent, one.train.call_one(step=2).get())
print("one where:", one.where.call_one().get())

# results of a slice are a ValueMesh of the slice's shape
vm = col.train.call(3).get()
print(vm.extent, vm.item(hosts=0, gpus=1))
print("vm slice:", vm.slice(hosts=1).values(), vm.slice(hosts=1, gpus=0).item())
flat = results.flatten("rank")
print("flat:", flat.extent, flat.slice(rank=4).item(), [p.rank for p, _ in flat.items()])

# broadcast is fire-and-forget; a later call from the same client sees its effect
trainers.bump.broadcast(10)
trainers.slice(hosts=0).bump.broadcast(by=100)
print("counts:", trainers.count.call().get().values())

# shape operations on actor meshes
print("split:", trainers.split(gpus=("a", "b"), b=1).sizes)
print("rename:", trainers.rename(hosts="nodes").sizes)
print("flatten:", trainers.flatten("r").sizes)
print("renamed call:", trainers.rename(hosts="nodes").slice(nodes=1, gpus=0).count.call_one().get())
try:
    trainers.slice(racks=0)
except Exception as e:
    print("bad dimension:", type(e).__name__)
try:
    trainers.slice(gpus=3)
except Exception as e:
    print("out of range:", type(e).__name__)
try:
    trainers.slice(gpus=slice(2, 2))
except Exception as e:
    print("empty range:", type(e).__name__)
print("negative bounds:", trainers.slice(gpus=slice(-2, None)).extent)
try:
    results.item(hosts=0)
except Exception as e:
    print("item without every dimension:", type(e).__name__)

# spawning a name again makes a second mesh; the first one lives on
again = procs.spawn("trainers", Trainer, 0.25, tag="again")
print("spawned again:", again.slice(hosts=0, gpus=0).train.call_one(9).get())
print("first still there:", trainers.count.call().get().values())

print("stop:", procs.stop().get())
print("done")
