"""Failures: a proc that dies, unhandled_fault_hook, __supervise__ in the owning actor, stopped meshes."""

import os
import threading

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

unhandled: list[MeshFailure] = []
got_unhandled = threading.Event()


def record_failure(failure: MeshFailure) -> None:
    # returning (not raising) marks the failure handled: the program goes on
    unhandled.append(failure)
    got_unhandled.set()


actor_api.unhandled_fault_hook = record_failure


class Worker(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def crash(self) -> None:
        os._exit(7)


class SyncSupervisor(Actor):
    def __init__(self, report: Port[str]) -> None:
        self.report = report
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.workers = self.procs.spawn("sync_children", Worker)

    @endpoint
    def crash_child(self) -> str:
        self.workers.slice(gpus=0).crash.broadcast()
        return "crash sent"

    @endpoint
    def ping_survivor(self) -> str:
        return self.workers.slice(gpus=1).ping.call_one().get()

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.report.send(f"sync supervisor saw {type(failure).__name__}")
        return True


class AsyncSupervisor(Actor):
    def __init__(self, report: Port[str]) -> None:
        self.report = report
        self.procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.workers = self.procs.spawn("async_children", Worker)

    @endpoint
    async def crash_child(self) -> str:
        self.workers.crash.broadcast()
        return "crash sent"

    async def __supervise__(self, failure: MeshFailure) -> bool:
        self.report.send(f"async supervisor saw {type(failure).__name__}")
        return True


class Careless(Actor):
    """Owns a mesh but does not supervise it: a failure there fails this actor too."""

    def __init__(self) -> None:
        self.procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.workers = self.procs.spawn("careless_children", Worker)

    @endpoint
    def crash_child(self) -> str:
        self.workers.crash.broadcast()
        return "crash sent"

    @endpoint
    def ping(self) -> str:
        return "pong"


procs = this_host().spawn_procs(per_host={"gpus": 2})
workers = procs.spawn("workers", Worker)
print("ping:", workers.ping.call().get().values())

# a proc dies: calls to it fail, the other proc keeps working, the failure reaches the hook
workers.slice(gpus=1).crash.broadcast()
try:
    workers.slice(gpus=1).ping.call_one().get(timeout=60)
    print("dead rank answered")
except Exception as e:
    print("dead rank:", type(e).__name__)
print("live rank:", workers.slice(gpus=0).ping.call_one().get(timeout=60))
print("hook called:", got_unhandled.wait(60), all(isinstance(f, MeshFailure) for f in unhandled))

# failures of meshes an actor owns go to that actor's __supervise__
port, reports = Channel.open()
sync_sup = procs.slice(gpus=0).spawn("sync_sup", SyncSupervisor, port)
print("sync:", sync_sup.crash_child.call_one().get())
print("sync:", reports.recv().get(timeout=60))
# the child mesh is still usable through the ranks that did not fail
print("sync survivor:", sync_sup.ping_survivor.call_one().get(timeout=60))
port, reports = Channel.open()
async_sup = procs.slice(gpus=0).spawn("async_sup", AsyncSupervisor, port)
print("async:", async_sup.crash_child.call_one().get())
print("async:", reports.recv().get(timeout=60))

# an unsupervised failure goes up the tree: the owner fails, and the client's hook hears of it
unhandled.clear()
got_unhandled.clear()
careless_procs = this_host().spawn_procs(per_host={"gpus": 1})
careless = careless_procs.spawn("careless", Careless)
print("careless:", careless.crash_child.call_one().get())
print("careless: hook called:", got_unhandled.wait(60))
try:
    careless.ping.call_one().get(timeout=60)
    print("careless: still answers")
except Exception as e:
    print("careless:", type(e).__name__)

# stopping
extra = procs.slice(gpus=0).spawn("extra", Worker)
print("extra:", extra.ping.call_one().get())
extra.stop().get()
try:
    extra.ping.call_one().get(timeout=60)
    print("stopped actor answered")
except Exception as e:
    print("stopped actor:", type(e).__name__)
procs.stop().get()
try:
    procs.spawn("late", Worker)
    print("spawned on a stopped mesh")
except RuntimeError:
    print("spawn on stopped mesh: RuntimeError")
print("done")
