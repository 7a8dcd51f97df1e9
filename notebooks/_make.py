"""Regenerates the example notebooks' sources (outputs come from executing them: `bash .ci/demo`).

Kept next to the notebooks so an edit to an example is an edit here, reviewed as Python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent
KERNEL = {"display_name": "Python 3 (monarch_nb)", "language": "python", "name": "monarch-nb"}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip())


def code(text: str, *tags: str) -> nbformat.NotebookNode:
    c = new_code_cell(text.strip())
    if tags:
        c.metadata["tags"] = list(tags)
    return c


NOTEBOOKS: dict[str, list[nbformat.NotebookNode]] = {}

NOTEBOOKS["01_quickstart.ipynb"] = [
    md("""
# monarch_nb quickstart

This notebook is the *single controller*: it spawns processes, puts actors in them and calls their
endpoints. The API is Monarch's (`monarch.actor`); only the import changes. Everything here runs on
this machine, on the local allocator that `this_host()` starts on first use. The kernel is
"Python 3 (monarch_nb)", which loads the `%mesh` magics and sends what ranks print to the cell
that called them.
"""),
    code("from monarch_nb.actor import Actor, ActorError, current_rank, endpoint, this_host"),
    md("""
## Spawn procs

`spawn_procs` starts a mesh of processes shaped like `{"gpus": 8}` on every host of the host mesh
(here one host). No GPU is needed: `gpus` is just the name of a dimension.
"""),
    code("""
training_procs = this_host().spawn_procs({"gpus": 8}, name="training")
training_procs
"""),
    md("""
## Spawn actors and call an endpoint

An actor is a class whose `@endpoint` methods can be called from the controller. `spawn` builds
one instance in every proc; `.call(...)` calls them all and returns a future whose `.get()` is a
`ValueMesh` of results, shaped like the mesh.
"""),
    code("""
class Trainer(Actor):
    @endpoint
    def train(self, step: int) -> str:
        return f"rank {current_rank().rank} trained step {step}"


trainers = training_procs.spawn("trainers", Trainer)
trainers.train.call(step=0).get()
"""),
    md("""
## Async endpoints and what ranks print

Endpoints may be `async def`, and their futures can be awaited in the notebook. What the actors
print is captured per rank by the allocator and shown in this cell; identical lines from many
ranks collapse into one line with the rank set and a count.
"""),
    code("""
class ToyActor(Actor):
    def __init__(self):
        self.rank = current_rank().rank

    @endpoint
    async def hello_world(self, msg: str) -> str:
        print(f"Identity: {self.rank}, {msg=}")
        print("hello from every rank")
        return f"rank {self.rank} said hello"


toy_actor = training_procs.spawn("toy_actor", ToyActor)
await toy_actor.hello_world.call("hey there, from the notebook")
"""),
    md("""
## Slicing

Meshes slice by dimension name: a slice calls only the actors in it. `call_one` is for a slice of
exactly one actor and returns its value directly.
"""),
    code("trainers.slice(gpus=slice(0, 2)).train.call(step=1).get()"),
    code("trainers.slice(gpus=0).train.call_one(step=2).get()"),
    md("""
## Errors

An exception raised in an endpoint comes back to the controller as an `ActorError` that carries
the remote exception and traceback; the actor lives on.
"""),
    code("""
class Flaky(Actor):
    @endpoint
    def divide(self, x: int) -> float:
        return 1 / x


flaky = training_procs.spawn("flaky", Flaky)
try:
    flaky.divide.call(0).get()
except ActorError as e:
    print("caught:", type(e.exception).__name__, e.exception)
flaky.divide.call(4).get().values()
"""),
    md("""
## Stop the procs

In a kernel, meshes outlive the kernel (re-attach after a restart with `%mesh connect` or
`ProcMesh.lookup(name)`) until stopped, or reaped by the allocator's lease. Stop them when done.
"""),
    code("training_procs.stop().get()"),
]

NOTEBOOKS["02_magics_tour.ipynb"] = [
    md("""
# A tour of the `%mesh` magics

The "Python 3 (monarch_nb)" kernel has the magics loaded (elsewhere: `%load_ext monarch_nb`). Every
magic is also a Python function in `monarch_nb.mesh` and `monarch_nb.logs`.
"""),
    code("%mesh help"),
    md(
        "`%mesh connect` attaches to allocators; with no address, to the embedded one on this machine. After a kernel restart it finds the named meshes again and binds them to variables."
    ),
    code("%mesh connect", "nbval-ignore-output"),
    md("`%mesh spawn NAME` starts a named proc mesh on every attached host and binds it to the variable `NAME`."),
    code("%mesh spawn workers --per-host gpus=4"),
    code("workers"),
    md("""
`%%mesh exec` runs the cell in every proc. Each proc keeps its own namespace between cells, like
an engine; the cell's value is a `ValueMesh` of the last expression on each rank.
"""),
    code("""
%%mesh exec workers
import os
from monarch_nb.actor import current_rank

rank = current_rank().rank
print("ready")
rank * rank
"""),
    code("""
%%mesh exec workers
print(f"loss={0.5 + rank / 100:.2f}")
rank + 100
"""),
    md("`--ranks` runs on a subset; the value mesh is then one-dimensional."),
    code("""
%%mesh exec workers --ranks 0:2
rank
"""),
    md("`--no-aggregate` shows every line of every rank as it arrives (their order varies from run to run)."),
    code(
        """
%%mesh exec workers --no-aggregate
print("my rank is", rank)
""",
        "nbval-ignore-output",
    ),
    md("`%mesh status` shows allocators, meshes, procs and their states (the pids differ on every run)."),
    code("%mesh status", "nbval-ignore-output"),
    md("`%mesh logs` reads the full per-rank logs the allocator keeps, unaggregated, also for procs that have crashed."),
    code("%mesh logs workers --rank 3 --tail 2"),
    code("%mesh stop workers"),
]

NOTEBOOKS["03_errors_and_respawn.ipynb"] = [
    md("""
# Errors, failures and respawn

Fail fast, notebook style: an error shows in the cell with each failing rank's remote traceback; a
dead process marks its mesh failed with a clear message; the kernel survives and the next cell
can respawn.
"""),
    code("""
import os
import signal

from monarch_nb.actor import Actor, ActorError, SupervisionError, current_rank, endpoint
"""),
    code("%mesh spawn frail --per-host gpus=4"),
    md("An exception in an endpoint arrives as an `ActorError` naming the actor and rank, with the remote traceback."),
    code("""
class Worker(Actor):
    @endpoint
    def check(self, limit: int) -> int:
        rank = current_rank().rank
        if rank >= limit:
            raise ValueError(f"rank {rank} is over the limit {limit}")
        return rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()


workers = frail.spawn("workers", Worker)
try:
    workers.check.call(3).get()
except ActorError as e:
    print(f"{type(e.exception).__name__} on rank {e.rank}: {e.exception}")
"""),
    md("In `%%mesh exec`, every failing rank is reported, grouped by error:"),
    code(
        """
%%mesh exec frail
from monarch_nb.actor import current_rank
assert current_rank().rank % 2 == 0, f"odd rank {current_rank().rank}"
""",
        "raises-exception",
    ),
    md("The actors live on after their errors:"),
    code("workers.check.call(10).get()"),
    md(
        "Now a process dies (we kill rank 2 with SIGKILL). The call that was waiting on it fails at once with a `SupervisionError` naming the mesh, rank, host and cause; the mesh is marked failed; the kernel is fine."
    ),
    code(
        """
os.kill(workers.pid.call().get().item(gpus=2), signal.SIGKILL)
try:
    workers.check.call(10).get(timeout=30)
except SupervisionError as e:
    print("call failed:", e.cause)
""",
        "nbval-ignore-output",
    ),
    md("Spawning the mesh again replaces the failed one (its surviving procs are stopped first):"),
    code("%mesh spawn frail --per-host gpus=4", "nbval-ignore-output"),
    code("""
workers = frail.spawn("workers", Worker)
workers.check.call(10).get()
"""),
    code("%mesh stop frail"),
]

NOTEBOOKS["04_log_aggregation.ipynb"] = [
    md("""
# What every rank printed, without a wall of lines

Rank output streams into the cell that made the call. Within a window (1 s in a kernel),
output is aggregated across ranks, never across a rank's own successive lines: the k-th line of
every rank collapses to one line with the rank set and a count, and lines that differ only in
their numbers collapse with each number summarised as `min…max`, so every step of a training
loop stays its own line, in order. The allocators keep every line: `%mesh logs` shows them all.
"""),
    code("%mesh spawn logs8 --per-host gpus=8"),
    code("""
%%mesh exec logs8
from monarch_nb.actor import current_rank

rank = current_rank().rank
print("starting epoch 1")
for step in range(3):
    print(f"step {step} loss={0.9 - 0.1 * step + rank / 100:.2f}")
"""),
    md("Lines that only some ranks print keep their own rank sets:"),
    code("""
%%mesh exec logs8
if rank < 4:
    print("first half")
else:
    print("second half")
"""),
    md(
        "`ProcMesh.logging_option` (as in Monarch) changes the window of a mesh; 0 turns aggregation off (every line, in arrival order)."
    ),
    code("await logs8.logging_option(stream_to_client=True, aggregate_window_sec=0)"),
    code("""
%%mesh exec logs8 --ranks 0:1
print("unaggregated")
"""),
    code("await logs8.logging_option(stream_to_client=True, aggregate_window_sec=1)"),
    md("A progress bar redrawn with `\\r` becomes one updating line per rank (its intermediate states vary by run):"),
    code(
        """
%%mesh exec logs8 --ranks 0:2
import sys, time
for pct in range(0, 101, 20):
    sys.stdout.write(f"\\rdownloading {pct}%")
    sys.stdout.flush()
    time.sleep(0.02)
print()
""",
        "nbval-ignore-output",
    ),
    md("Every line is kept by the allocator, per rank:"),
    code("%mesh logs logs8 --rank 7 --tail 4"),
    code("%mesh stop logs8"),
]

NOTEBOOKS["05_spmd_training.ipynb"] = [
    md("""
# An SPMD training loop in an actor

As the Titan trainer wrapper in the Monarch articles does: an ordinary `torch.distributed` (gloo)
program runs inside an actor on every rank; `setup_env_for_distributed` gives each proc its
`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`.
"""),
    code("""
from monarch_nb.actor import Actor, endpoint, this_host
from monarch_nb.spmd import setup_env_for_distributed

proc_mesh = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="spmd")
await setup_env_for_distributed(proc_mesh)
"""),
    code("""
class TrainerWrapper(Actor):
    def __init__(self, lr: float):
        self.lr = lr

    @endpoint
    def init(self) -> str:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        # the same initial weights everywhere, as DDP would broadcast them
        for p in self.model.parameters():
            dist.broadcast(p.data, src=0)
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"

    @endpoint
    def train(self, steps: int) -> float:
        import torch
        import torch.distributed as dist

        opt = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            x = torch.randn(8, 4, generator=g)
            loss = ((self.model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
        if dist.get_rank() == 0:
            print(f"{steps} steps, last loss {loss.item():.3f}")
        return round(self.model.weight.detach().sum().item(), 4)


trainer = proc_mesh.spawn("trainer", TrainerWrapper, 0.05)
trainer.init.call().get()
"""),
    md("Every rank holds the same weights after training, because the gradients were all-reduced:"),
    md("Training takes a few seconds; a call that long shows how many ranks have replied while it runs."),
    code("weights = trainer.train.call(30).get()", "nbval-ignore-output"),
    code("len(set(weights.values())) == 1"),
    code("proc_mesh.stop().get()"),
]

NOTEBOOKS["06_debugging.ipynb"] = [
    md(
        '# Debugging any rank from the notebook\n\n`breakpoint()` (or `pdb.set_trace()`) in an endpoint pauses **that actor on that rank**: other actors and ranks keep running, messages to the paused actor wait in its mailbox, and its process stays alive. The session is registered with the host\'s allocator, so any controller can list it and attach: this notebook, a restarted kernel, or `monarch-nb debug` in a terminal.\n\n**The blocked cell is the debugger.** When a cell waits on a call (`.get()` or `await`) and ranks of that call stop, the cell prints the session table and asks for commands in its own input box: `list`, `attach ACTOR RANK` (then any pdb command: `p`, `n`, `s`, `l`, `w`, `up`, `c`…, and `detach`), `cast ACTOR RANKS CMD`, `continue`, `help`.\n\nWhen nobody can answer (this notebook run by `nbconvert --execute` or nbval, a script without a terminal) the breakpoint never hangs the run: the rank continues and the cell says `breakpoint at FILE:LINE on rank R skipped (no input)`. `monarch_nb.configure(debug_no_input="raise" | "wait", debug_no_input_timeout=…)` changes that.'
    ),
    code(
        'from monarch_nb import debug\nfrom monarch_nb.actor import Actor, ActorError, current_rank, endpoint, this_host\n\n\ndef _bad_rank():\n    raise ValueError("bad rank")\n\n\ndef _debugee_actor_internal(rank):\n    if rank % 4 == 0:\n        breakpoint()\n        rank += 1\n        return rank\n    elif rank % 4 == 1:\n        breakpoint()\n        rank += 2\n        return rank\n    elif rank % 4 == 2:\n        breakpoint()\n        rank += 3\n        _bad_rank()\n    elif rank % 4 == 3:\n        breakpoint()\n        rank += 4\n        return rank\n\n\nclass DebugeeActor(Actor):\n    @endpoint\n    async def to_debug(self):\n        rank = current_rank().rank\n        return _debugee_actor_internal(rank)\n\n\nprocess_mesh = this_host().spawn_procs(per_host={"host": 2, "gpu": 2}, name="debugging")\ndebugee_mesh = process_mesh.spawn("debugee", DebugeeActor)'
    ),
    md("""
## The blocked cell

Run this cell in JupyterLab: it stops, shows the four paused ranks and an input box. Try
`attach debugee 2`, `n`, `s`, `l`, `c`, then `continue`. Rank 2 raises, so the cell ends with that
rank's `ActorError` (caught here so the notebook runs to the end). Run without input (nbval,
`nbconvert --execute`), each breakpoint is skipped with a note, in the order the ranks reach it.
"""),
    code(
        """
try:
    print(debugee_mesh.to_debug.call().get())
except ActorError as e:
    print(f"rank {e.rank} failed: {e.message}")
""",
        "nbval-ignore-output",
    ),
    md("""
## The same with magics, and from code

(Run without input, ranks of the first call that had not reached their breakpoint when rank 2's
error ended the wait are skipped later, so their notes can show up in the cells below; the
outputs of these cells are not compared by the test suite.)

Here the call is not waited on, so the ranks stay paused while we look at them. `%mesh debug`
lists the sessions (the pids and waiting times differ on every run).
"""),
    code(
        """
import time

fut = debugee_mesh.to_debug.call()
deadline = time.monotonic() + 60
while len(debug.sessions("debugee")) < 4 and time.monotonic() < deadline:
    time.sleep(0.05)
len(debug.sessions("debugee"))
""",
        "nbval-ignore-output",
    ),
    code("%mesh debug", "nbval-ignore-output"),
    code("%mesh debug cast debugee 0-1 p rank", "nbval-ignore-output"),
    md("`debug.attach` is the programmatic attach (`%mesh attach debugee 3` does the same through the cell's input box):"),
    code(
        """
s = debug.attach("debugee", 3)
print(s.send("p rank"))
print(s.send("n"))
print(s.send("c").strip() or "(continued)", "ended:", s.ended)
""",
        "nbval-ignore-output",
    ),
    code("%mesh debug continue", "nbval-ignore-output"),
    code(
        """
err = fut.exception()
print(type(err).__name__, "on rank", err.rank, "-", err.message)
""",
        "nbval-ignore-output",
    ),
    md(
        "From a terminal, `monarch-nb debug` opens the same console (it also accepts Monarch's `attach debugee 13` and `cast debugee ranks(0:4) p x`)."
    ),
    code("process_mesh.stop().get()", "nbval-ignore-output"),
]

NOTEBOOKS["08_data_plane.ipynb"] = [
    md("""
# The data plane: a parameter server and trainers

Messages carry small things; bulk bytes go another way. An actor wraps a tensor in an
`RDMABuffer` (Monarch's `monarch.rdma` API) and hands out the buffer: a small handle. Whoever
holds it calls `read_into` or `write_from`, and the bytes move straight between the two
processes, never through this notebook or an allocator: out of the owner's shared memory on one
host, over a direct encrypted stream from the owner's process across hosts.
"""),
    code("""
import torch

from monarch_nb.actor import Actor, endpoint, this_host
from monarch_nb.rdma import RDMABuffer, bytes_moved, get_rdma_backend

get_rdma_backend()
"""),
    md("""
## A parameter server

It owns the weights (4 MB here) and publishes them once as a buffer. `step()` updates them in
place: the buffer aliases the tensor, so the next read sees the new values without a new handle.
"""),
    code("""
class ParameterServer(Actor):
    def __init__(self):
        self.weights = torch.zeros(1_000_000)
        self.buffer = RDMABuffer(self.weights.view(torch.uint8))
        self.version = 0

    @endpoint
    def get_weights(self) -> RDMABuffer:
        return self.buffer  # a small message: just a reference

    @endpoint
    def step(self) -> int:
        self.weights += 1.0  # in place
        self.version += 1
        return self.version


class Trainer(Actor):
    def __init__(self):
        self.weights = torch.empty(1_000_000)

    @endpoint
    def pull(self, weights: RDMABuffer) -> float:
        weights.read_into(self.weights.view(torch.uint8)).get()
        return self.weights.mean().item()

    @endpoint
    def moved(self) -> dict:
        return bytes_moved()
"""),
    md("""
One proc for the server, four trainers over a virtual two-host mesh (all on this machine):
"""),
    code(
        """
ps_procs = this_host().spawn_procs(per_host={"gpus": 1}, name="ps")
server = ps_procs.spawn("server", ParameterServer)
trainer_procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="trainers")
trainers = trainer_procs.spawn("trainer", Trainer)
weights = server.get_weights.call_one().get()
""",
        "nbval-ignore-output",
    ),
    code('print(weights.size(), "bytes owned by", weights.owner.split("@")[0])'),
    md("""
## Training steps

Each step the server updates its weights, and every trainer pulls them with `read_into`. The
handle goes to the trainers in the call's message; the 4 MB do not.
"""),
    code("""
for _ in range(3):
    version = server.step.call_one().get()
    means = trainers.pull.call(weights).get()
    print(f"version {version}: trainers see mean {sorted(set(means.values()))}")
"""),
    md("""
## Bytes moved, per proc

`bytes_moved()` counts what a process read and wrote through buffers, and by which path. Every
trainer read 3 × 4 MB, all through shared memory (`shm`): on one host no byte went through a socket.
"""),
    code("""
for point, moved in trainers.moved.call().get().items():
    print(dict(point), moved["read"], "bytes read,", moved["shm"], "through shared memory")
"""),
    md("""
## Writing back

`write_from` changes the owner's tensor in place, e.g. a trainer pushing a result:
"""),
    code("""
weights.write_from(torch.full((1_000_000,), 7.0).view(torch.uint8)).get()
print(trainers.pull.call(weights).get().values())
"""),
    code("""
weights.drop().get()
trainer_procs.stop().get()
ps_procs.stop().get()
"""),
]


NOTEBOOKS["07_cluster.ipynb"] = [
    md("""
# Jobs: get hosts from a scheduler, re-attach from any kernel

`monarch_nb.job` is Monarch's `monarch.job`: a *job* is a spec (how many hosts, which scheduler
options) plus, once applied, its state. `job.state()` applies the job the first time and
re-attaches every time after, from this kernel, a restarted one or another notebook: the state
is cached in a 0600 JSON file under the runtime directory.

This notebook uses `ProcessJob`, which runs one allocator daemon per "host" on this machine, so it
runs anywhere. On a cluster, only the job changes (see the end, and docs/clusters.md).
"""),
    code("""
from monarch_nb.actor import Actor, ProcMesh, endpoint
from monarch_nb.job import ProcessJob

job = ProcessJob({"trainers": 2})
state = job.state()
state.trainers.extent
"""),
    md("""
## Train on the job's hosts

`state.trainers` is a `HostMesh`; procs and actors are spawned on it as on `this_host()`. In a
notebook, proc meshes persist: they outlive this kernel, to be found again by name.
"""),
    code(
        """
class Trainer(Actor):
    \"\"\"Fits y = 3x + 1 by gradient descent; the weights live in the actor between calls.\"\"\"

    def __init__(self):
        self.w, self.b = 0.0, 0.0

    @endpoint
    def train(self, steps: int) -> float:
        data = [(x / 10, 3 * x / 10 + 1) for x in range(10)]
        for _ in range(steps):
            gw = sum(2 * (self.w * x + self.b - y) * x for x, y in data) / len(data)
            gb = sum(2 * (self.w * x + self.b - y) for x, y in data) / len(data)
            self.w, self.b = self.w - 0.5 * gw, self.b - 0.5 * gb
        return round(sum((self.w * x + self.b - y) ** 2 for x, y in data) / len(data), 6)


procs = state.trainers.spawn_procs(per_host={"gpus": 2}, name="training")
trainers = procs.spawn("trainer", Trainer)
losses = trainers.train.call(steps=20).get()
""",
        "nbval-ignore-output",
    ),
    code("losses"),
    md("""
## Re-attach

After a kernel restart (or from another notebook), the same two lines find the running job, and
`ProcMesh.lookup` finds the procs on it, with their actors and everything they hold: the loss
goes on falling from where it was, in the same processes.
"""),
    code(
        """
again = ProcessJob({"trainers": 2})
state2 = again.state()
procs2 = ProcMesh.lookup("training", state2.trainers)
losses2 = procs2.actor_mesh("trainer").train.call(steps=20).get()
""",
        "nbval-ignore-output",
    ),
    code("""
print("same job:", again.apply_id == job.apply_id)
print("same processes:", sorted(p.pid for p in procs2._procs) == sorted(p.pid for p in procs._procs))
losses2
"""),
    md("""
## The same on Slurm

```python
from monarch_nb.job import SlurmJob
job = SlurmJob(meshes={"trainers": 4}, gpus_per_node=8, time_limit="4:00:00",
               partition="gpu", log_dir="/shared/runs", python_exe="/shared/venv/bin/python")
state = job.state()        # sbatch once; the queue reason shows here while it waits
```
or `%mesh launch slurm trainers --hosts 4 --time 4:00:00 --partition gpu`, then `%mesh jobs`.

## Clean up

`kill()` stops every allocator and proc of the job (on Slurm: `scancel`) and forgets its cache.
"""),
    code("""
job.kill()
job.active
"""),
]

NOTEBOOKS["09_distributed_tensors.ipynb"] = [
    md("""
# Distributed tensors that feel local

`monarch_nb.tensor` keeps torch's own DTensors on the ranks of a proc mesh and gives the notebook
a handle to each. Torch ops on handles run on every rank (gloo here, NCCL on GPUs); their shape
and placements are known in the notebook at once; values come back only when asked for
(`inspect`, `fetch_shard`, `full_tensor`, `reduce`). This machine has no GPU: `hosts` and `gpus`
are just the names of the mesh's dimensions. Everything runs in float64 so that the mesh's
training can be compared with the notebook's own, number for number.
"""),
    code(
        """
import torch
import torch.nn.functional as F

import monarch_nb.tensor as mt
from monarch_nb.actor import this_host
from monarch_nb.tensor import Replicate, Shard

torch.set_default_dtype(torch.float64)
procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="tensors")
mt.setup(procs)  # the process group and device mesh (else the first op sets them up)
""",
        "nbval-ignore-output",
    ),
    md("""
## Shard a weight matrix

`distribute` sends each rank its own shard, once. Placements are DTensor's, one per mesh
dimension: here the columns are split over `gpus` and replicated over `hosts`. The display shows
each rank's local shape and its first values.
"""),
    code(
        """
W = torch.arange(24.0).reshape(4, 6)
w = mt.distribute(W, procs, [Replicate(), Shard(1)])
w
""",
        "nbval-ignore-output",
    ),
    md("An op on handles returns a handle at once; `mt.inspect` brings the global value back."),
    code("""
y = torch.relu(w.T @ w - 100)
print(y.shape, y.placements)
assert torch.equal(mt.inspect(y), torch.relu(W.T @ W - 100))
mt.fetch_shard(w, hosts=1, gpus=1).get()
"""),
    md("""
Inside `with procs.activate():` torch's factories make mesh tensors, replicated on every
dimension (random ones seeded alike, so every rank holds the same values), as in Monarch.
`mt.reduce` combines the ranks' local tensors across named dimensions.
"""),
    code("""
with procs.activate():
    r = torch.ones(2, 3)
    s = r * 2 + 1
print(s.placements)
mt.inspect(mt.reduce(s, "gpus", "sum"))
"""),
    md("""
## A small MLP, trained on the mesh

Data parallel over `hosts` (the batch is split by rows), tensor parallel over `gpus` (the first
layer's weight by columns, the second's by rows). `loss.backward()` runs autograd on the ranks,
`w1.grad` is a handle, and the optimizer lives on the ranks: `step()` is one message. The same
model is trained in the notebook with plain tensors to compare.
"""),
    code("""
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
W1, W2 = 0.3 * torch.randn(8, 16, generator=g), 0.3 * torch.randn(16, 4, generator=g)


def model(x, w1, w2):
    return F.cross_entropy(F.gelu(x @ w1) @ w2, Y if isinstance(x, torch.Tensor) else y)


x = mt.distribute(X, procs, [Shard(0), Replicate()])
y = mt.distribute(Y, procs, [Shard(0), Replicate()])
w1 = mt.distribute(W1, procs, [Replicate(), Shard(1)]).requires_grad_()
w2 = mt.distribute(W2, procs, [Replicate(), Shard(0)]).requires_grad_()
opt = mt.Optimizer(torch.optim.SGD, [w1, w2], lr=0.5)

loss = model(x, w1, w2)
loss.backward()
print("loss", loss.shape, loss.placements, "grad of w1", w1.grad.shape, w1.grad.placements)
opt.zero_grad()
"""),
    code(
        """
mesh_losses = []
for _ in range(50):
    opt.zero_grad()
    loss = model(x, w1, w2)
    loss.backward()
    opt.step()
    mesh_losses.append(loss)  # handles: nothing comes back while training
mesh_curve = torch.stack([mt.inspect(l) for l in mesh_losses])

w1l, w2l = W1.clone().requires_grad_(), W2.clone().requires_grad_()
opt_l = torch.optim.SGD([w1l, w2l], lr=0.5)
local_curve = []
for _ in range(50):
    opt_l.zero_grad()
    l = model(X, w1l, w2l)
    l.backward()
    opt_l.step()
    local_curve.append(l.detach())
local_curve = torch.stack(local_curve)
""",
        "nbval-ignore-output",
    ),
    code("""
torch.testing.assert_close(mesh_curve, local_curve, rtol=1e-10, atol=0)
print(f"loss {mesh_curve[0]:.4f} -> {mesh_curve[-1]:.4f} over 50 steps; the same curve as single-process training")
"""),
    md("""
## FSDP2 on the ranks

`mt.fully_shard` applies torch's FSDP2 `fully_shard` on every rank; on this 2-D mesh it is HSDP:
each parameter replicated over `hosts` and its rows sharded over `gpus`. The model runs on each
rank's part of the batch (`Shard(0)` on both dimensions), the loss is taken on the whole batch
as before, and Adam steps on the ranks with one message.
"""),
    code("""
import copy

from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
local_net = copy.deepcopy(net)
fsdp = mt.fully_shard(net, procs)
p0 = fsdp.parameters()[0]
print(tuple(p0.shape), p0.placements, "rank (hosts=0, gpus=1) holds", tuple(mt.fetch_shard(p0, gpus=1).get().shape))
"""),
    code(
        """
# torch warns (once per process, on the ranks too) that the loss's Partial() on both dimensions
# takes two all-reduces: its output is not compared
xb = x.redistribute(placements=[Shard(0), Shard(0)])
yb = y.redistribute(placements=[Shard(0), Shard(0)])
opt_f = mt.Optimizer(torch.optim.Adam, fsdp.parameters(), lr=0.01)
opt_lf = torch.optim.Adam(local_net.parameters(), lr=0.01)
fsdp_losses, local_losses = [], []
for _ in range(10):
    opt_f.zero_grad()
    loss = F.cross_entropy(fsdp(xb), yb)
    loss.backward()
    opt_f.step()
    fsdp_losses.append(loss)
    opt_lf.zero_grad()
    l = F.cross_entropy(local_net(X), Y)
    l.backward()
    opt_lf.step()
    local_losses.append(l.detach())
fsdp_curve = torch.stack([mt.inspect(l) for l in fsdp_losses])
""",
        "nbval-ignore-output",
    ),
    code("""
torch.testing.assert_close(fsdp_curve, torch.stack(local_losses), rtol=1e-10, atol=0)
print("FSDP2 on the mesh: the same 10 losses as single-process Adam")
"""),
    code("mt.stats(procs)", "nbval-ignore-output"),
    code("procs.stop().get()"),
]

NOTEBOOKS["10_observability.ipynb"] = [
    md("""
# Seeing what the cluster does: telemetry, a trace timeline, stacks, the dashboard

Every endpoint call is recorded as a span on the rank that ran it (actor, method, rank, start,
duration, outcome), timed in the proc and kept by the allocators. `span()` and `@traced` add
spans of your own and `get_meter()` gives counters and histograms (Monarch's names, the
OpenTelemetry API's shapes). `monarch_nb.telemetry.query()` returns the spans as a pandas
DataFrame; `%mesh trace` writes them as a Chrome/Perfetto trace and draws a timeline in the cell,
naming the stragglers. `%mesh stacks` shows what every rank is doing right now, and
`%mesh dashboard` is a live view of a mesh.
"""),
    code("""
import itertools
import os
import tempfile
import time

from monarch_nb import debug, telemetry
from monarch_nb.actor import Actor, current_rank, endpoint
"""),
    md("""
A mesh of four procs. (Spawning a large mesh shows a progress bar in the cell while it starts:
procs up of the total.)
"""),
    code("%mesh spawn observe --per-host gpus=4"),
    md("""
## Spans on every rank

`step` loads a batch and computes on it, each in a span of its own; rank 3 is slow on purpose
(a straggler), and a counter counts the batches.
"""),
    code("""
batches = telemetry.get_meter("training").create_counter("batches")


class Trainer(Actor):
    @endpoint
    def step(self, n: int) -> int:
        rank = current_rank().rank
        with telemetry.span("load"):
            time.sleep(0.001)
        with telemetry.span("compute"):
            time.sleep(0.05 if rank == 3 else 0.002)
        batches.add(1)
        return n


trainers = observe.spawn("trainers", Trainer)
started = time.time()
for n in range(5):
    trainers.step.call(n).get()
"""),
    md("""
The allocators drain each proc's spans about once a second; `query()` gathers them from every
attached allocator (each host's clock offset applied):
"""),
    code(
        """
deadline = time.monotonic() + 30
while True:
    spans = telemetry.query("observe", since=started)
    calls = spans[(spans["kind"] == "call") & (spans["method"] == "step")]
    if len(calls) == 20 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
spans[["rank", "kind", "name", "duration", "outcome"]].head(8)
""",
        "nbval-ignore-output",
    ),
    code("""
print(calls.groupby("rank").size().to_dict())
print(sorted(spans["name"].unique()))
"""),
    md("A rank whose median duration is more than twice the others' is a straggler:"),
    code("""
[(d["rank"], d["name"]) for d in telemetry.stragglers(spans, factor=2.0)]
"""),
    md("""
## A trace timeline

`%mesh trace` writes every rank's spans of the last while as a Chrome/Perfetto trace (open it in
ui.perfetto.dev) and draws them in the cell: a row per rank, calls as bars, your spans inside
them, stragglers in red.
"""),
    code(
        """
trace_dir = tempfile.mkdtemp(prefix="trace-")
since_started = f"{time.time() - started + 1:.0f}s"  # this run's spans, not an earlier run's
%mesh trace observe --last {since_started} --out {trace_dir}/observe.json
""",
        "nbval-ignore-output",
    ),
    code("""
import json

with open(f"{trace_dir}/observe.json") as f:
    events = json.load(f)["traceEvents"]
sorted({e["name"] for e in events if e.get("ph") == "X"})
"""),
    md("""
## What every rank is doing now

`%mesh stacks` asks each proc's I/O thread for the stack of every thread, so ranks blocked in a
collective or a C call answer too; identical stacks are merged with their rank sets. Here three
ranks wait for a file that only appears later, and rank 0 returns at once:
"""),
    code("""
flag = os.path.join(tempfile.mkdtemp(prefix="go-"), "go")


class Waiter(Actor):
    @endpoint
    def wait_for_go(self, path: str) -> int:
        deadline = time.monotonic() + 60
        if current_rank().rank > 0:
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.2)
        return current_rank().rank


waiters = observe.spawn("waiters", Waiter)
pending = waiters.wait_for_go.call(flag)
deadline = time.monotonic() + 30
while "wait_for_go" not in str(debug.stacks(observe, "1-3")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""),
    code("%mesh stacks observe", "nbval-ignore-output"),
    code("""
lines = str(debug.stacks(observe)).splitlines()
for above, line in itertools.pairwise(lines):
    if line.strip().startswith("wait_for_go"):  # its frame, not the call's line
        print(above.strip(), line.split(" (")[0].strip())
"""),
    code("""
open(flag, "w").close()
pending.get().values()
"""),
    md("""
## The dashboard

`%mesh dashboard observe` is a live view of the mesh (ipywidgets): ranks coloured by state,
host resources, per-rank latency with stragglers flagged, recent logs and errors. It updates
while you work in other cells.
"""),
    code("%mesh dashboard observe", "nbval-ignore-output"),
    code("observe.stop().get()"),
]


def main() -> None:
    names = sys.argv[1:] or list(NOTEBOOKS)
    for name in names:
        nb = new_notebook(cells=NOTEBOOKS[name], metadata={"kernelspec": KERNEL, "language_info": {"name": "python"}})
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
