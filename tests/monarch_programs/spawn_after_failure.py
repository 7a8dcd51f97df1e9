"""Spawning on procs that had an actor failure: after a failure nobody handled (the client's
hook heard of it) the proc mesh refuses new spawns, a slice of it too; other procs still spawn.
After a failure the owning actor's __supervise__ handled, its procs accept new spawns."""

import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()
heard = threading.Event()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)
    heard.set()


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond those expected has no event ordered after it (the hook is called by
# the runtime's supervision on its own, not from any call's reply): its absence is checked by
# waiting this long for one
HOOK_WINDOW_S = 1.0


class W(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def maybe_fail(self, rank: int) -> None:
        if actor_api.current_rank().rank == rank:
            raise ValueError("rank gave up")


def first_line(e: BaseException) -> str:
    line = str(e).splitlines()[0] if str(e) else ""
    head, sep, statuses = line.partition("statuses: ")
    # Monarch lists the ranks' statuses in no fixed order
    return f"{type(e).__name__}: {head}{sep}{';'.join(sorted(statuses.split(';')))}"


class Owner(Actor):
    def __init__(self, events: Port[str]) -> None:
        self.events = events
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("children", W)

    @endpoint
    def fail_one(self) -> str:
        self.children.maybe_fail.broadcast(1)
        return "sent"

    @endpoint
    def spawn_again(self) -> str:
        try:
            again = self.procs.spawn("again", W)
            return "spawned: " + str(sorted(again.ping.call().get().values()))
        except Exception as e:
            return first_line(e)

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.events.send("owner handled a failure")
        return True


# the client's own procs: a failure nobody handles
procs = this_host().spawn_procs(per_host={"gpus": 2})
w = procs.spawn("w", W)
print("before:", sorted(w.ping.call().get().values()))
w.maybe_fail.broadcast(1)
print("hook heard:", heard.wait(60))
# no wait here: a failed actor's proc records the failure before its report leaves it
for what, mesh in (("procs", procs), ("slice without the failed rank", procs.slice(gpus=0))):
    try:
        procs_again = mesh.spawn("again", W)
        print(what, "spawned:", sorted(procs_again.ping.call().get().values()))
    except Exception as e:
        print(what, "refused:", first_line(e))
other = this_host().spawn_procs(per_host={"gpus": 1})
print("other procs:", other.spawn("fresh", W).ping.call_one().get())
other.stop().get()
procs.stop().get()

# procs an actor spawned: its __supervise__ handles the failure
owner_procs = this_host().spawn_procs(per_host={"gpus": 1})
port, events = Channel.open()
owner = owner_procs.spawn("owner", Owner, port)
print("owner:", owner.fail_one.call_one().get(timeout=60))
print("owner says:", events.recv().get(timeout=60))
print("owner spawn again:", owner.spawn_again.call_one().get(timeout=60))
time.sleep(HOOK_WINDOW_S)
with lock:
    print("hook calls:", len([f for f in failures if "crashed_ranks=[]" not in repr(f)]))
owner_procs.stop().get()
print("done")
