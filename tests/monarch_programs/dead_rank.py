"""A mesh with a dead rank (its process killed): every adverb, and send() to a port, on it and
on its slices, a spawn on the live procs, stopping its actor mesh, stop; and an actor whose child mesh loses a proc: its
__supervise__ handles it, the child's live rank answers, its dead one fails, current_rank() and
context() in the child."""

import operator
import os
import re
import signal
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Accumulator, Actor, Channel, MeshFailure, context, current_rank, endpoint, send, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook

# a report to the hook beyond those expected has no event ordered after it (the hook is called by
# the runtime's supervision on its own, not from any call's reply): its absence is checked by
# waiting this long for one
HOOK_WINDOW_S = 1.0


def first_line(e: object) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"{label}: returned {fn()}")
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {first_line(e)}")


def wait_until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while not pred():
        if time.monotonic() > deadline:
            print("timed out waiting for", what)
            return
        time.sleep(0.05)


class W(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def val(self) -> int:
        return current_rank().rank * 10

    @endpoint
    def where(self) -> tuple[int, dict[str, int], int]:
        return current_rank().rank, dict(current_rank()), context().actor_instance.rank.rank


class Parent(Actor):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def __supervise__(self, failure: MeshFailure) -> bool:
        # Monarch also reports its internal logger mesh; only the actor mesh counts here
        name = re.sub(r"-\w+$", "", failure.mesh_name)
        if not name.startswith("logger"):
            self.seen.append(name)
        return True

    @endpoint
    def start(self) -> list[tuple[int, dict[str, int], int]]:
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.kids = self.procs.spawn("kids", W)
        return sorted(self.kids.where.call().get().values())

    @endpoint
    def kill_one(self) -> str:
        os.kill(self.kids.slice(gpus=1).pid.call_one().get(), signal.SIGKILL)
        return "killed"

    @endpoint
    def seen_so_far(self) -> list[str]:
        return self.seen

    @endpoint
    def ask(self, gpus: int) -> str:
        try:
            return f"returned {self.kids.slice(gpus=gpus).where.call_one().get(timeout=30)}"
        except Exception as e:
            return f"{type(e).__name__}: {first_line(e)}"

    @endpoint
    def broadcast_to_kids(self) -> str:
        self.kids.val.broadcast()
        return "sent"


procs = this_host().spawn_procs(per_host={"gpus": 3})
w = procs.spawn("w", W)
print("values:", w.val.call().get().values())
os.kill(w.slice(gpus=1).pid.call_one().get(), signal.SIGKILL)
wait_until(lambda: failures, "the failure")
attempt("broadcast", lambda: w.val.broadcast())
attempt("broadcast to the dead rank", lambda: w.slice(gpus=1).val.broadcast())
attempt("broadcast to a live rank", lambda: w.slice(gpus=2).val.broadcast())
port, receiver = Channel.open()
attempt("send to a port", lambda: send(w.val, (), {}, port=port))
print("the live ranks answered the port:", sorted(receiver.recv().get(timeout=30) for _ in range(2)))
attempt("call", lambda: w.val.call().get(timeout=30).values())
attempt("call_one rank 0", lambda: w.slice(gpus=0).val.call_one().get(timeout=30))
attempt("call_one rank 1", lambda: w.slice(gpus=1).val.call_one().get(timeout=30))
attempt("call_one rank 2", lambda: w.slice(gpus=2).val.call_one().get(timeout=30))
attempt("call on a slice without it", lambda: w.slice(gpus=slice(2, 3)).val.call().get(timeout=30).values())
attempt("accumulate", lambda: Accumulator(w.val, 0, operator.add).accumulate().get(timeout=30))
attempt("accumulate a slice without it", lambda: Accumulator(w.slice(gpus=0).val, 1, operator.add).accumulate().get(timeout=30))
attempt("choose", lambda: w.val.choose().get(timeout=30))
attempt("choose in a slice without it", lambda: w.slice(gpus=2).val.choose().get(timeout=30))
attempt("spawn on a live proc", lambda: procs.slice(gpus=0).spawn("again", W).where.call().get(timeout=30).values())
try:
    w.stop().get(timeout=60)
    print("stop the actor mesh: returned")
except Exception as e:
    # the statuses that follow are listed in no fixed order
    print(f"stop the actor mesh: {type(e).__name__}: {first_line(e).split(' statuses:')[0]}")
attempt("stop", lambda: procs.stop().get(timeout=60))
attempt("stop again", lambda: procs.stop().get(timeout=60))

print("hook saw:", sorted({re.sub(r"-\w+$", "", f.mesh_name) for f in failures if not f.mesh_name.startswith("logger")}))
failures.clear()

home = this_host().spawn_procs(per_host={"gpus": 1})
parent = home.spawn("parent", Parent)
print("children:", parent.start.call_one().get())
print(parent.kill_one.call_one().get())
wait_until(lambda: parent.seen_so_far.call_one().get(), "__supervise__")
print("parent saw:", parent.seen_so_far.call_one().get())
print("live child:", parent.ask.call_one(0).get())
print("dead child:", parent.ask.call_one(1).get())
print("broadcast to children:", parent.broadcast_to_kids.call_one().get())
print("parent saw:", parent.seen_so_far.call_one().get())
home.stop().get()
time.sleep(HOOK_WINDOW_S)
print("hook calls:", len(failures))
print("done")
