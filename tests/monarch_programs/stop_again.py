"""Stopping again: a proc mesh or an actor mesh stopped twice stops quietly the second time;
a slice of a proc mesh or of an actor mesh is not stopped on its own (ValueError,
NotImplementedError), and its procs and actors live on.
Failing again: each call to a dead actor raises an error whose traceback is its own raise's
(not every earlier call's frames as well), in the client and in an actor that calls it."""

import os
import threading
import time
import traceback

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


class Victim(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    def die(self) -> None:
        os._exit(9)


class Caller(Actor):
    def __init__(self, other: Victim) -> None:
        self.other = other

    @endpoint
    def relay(self, x: int) -> int:
        return self.other.echo.call_one(x).get(timeout=60)

    @endpoint
    def relay_again(self, x: int) -> int:
        return self.other.echo.call_one(x).get(timeout=60)


def outcome(fn, done: str = "") -> str:
    # ``done``: what to print instead of the value (a stop's: Monarch's actor mesh stop gives ())
    try:
        value = fn()
        return done or f"returned {value}"
    except Exception as e:
        return type(e).__name__


def stopped(fn) -> str:
    return outcome(fn, "stopped")


def heard_of_victim() -> bool:
    with lock:
        return any(str(f.mesh_name).startswith("victim") for f in failures)


def own_frames(e: BaseException) -> list[str]:
    # the functions of this file the error passed through on its way here
    return [f.name for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]


def remote_frames(e: BaseException) -> list[str]:
    # the endpoints the remote traceback names (its "in NAME" lines)
    return [
        line.rsplit(" in ", 1)[1]
        for line in str(e).splitlines()
        if line.strip().startswith("File ") and " in " in line and "relay" in line
    ]


print("proc mesh:")
procs = this_host().spawn_procs(per_host={"gpus": 1})
print("  stop:", stopped(lambda: procs.stop().get(timeout=60)))
print("  stop again:", stopped(lambda: procs.stop().get(timeout=60)))

print("a slice of a proc mesh:")
procs = this_host().spawn_procs(per_host={"gpus": 2})
v = procs.spawn("v", Victim)
print("  stop a slice:", stopped(lambda: procs.slice(gpus=1).stop().get(timeout=60)))
print("  both still answer:", outcome(lambda: list(v.echo.call(2).get(timeout=60).values())))
print("  stop a slice of the actor mesh:", stopped(lambda: v.slice(gpus=1).stop().get(timeout=60)))
print("  both still answer:", outcome(lambda: list(v.echo.call(3).get(timeout=60).values())))
print("  stop:", stopped(lambda: procs.stop().get(timeout=60)))

print("actor mesh:")
procs = this_host().spawn_procs(per_host={"gpus": 1})
v = procs.spawn("v", Victim)
print("  echo:", outcome(lambda: v.echo.call_one(1).get(timeout=60)))
print("  stop:", stopped(lambda: v.stop().get(timeout=60)))
print("  stop again:", stopped(lambda: v.stop().get(timeout=60)))
procs.stop().get(timeout=60)

print("a dead actor, called again:")
vprocs = this_host().spawn_procs(per_host={"gpus": 1})
cprocs = this_host().spawn_procs(per_host={"gpus": 1})
v = vprocs.spawn("victim", Victim)
c = cprocs.spawn("caller", Caller, v)
print("  relay:", outcome(lambda: c.relay.call_one(5).get(timeout=60)))
v.die.broadcast()
deadline = time.monotonic() + 60
while not heard_of_victim() and time.monotonic() < deadline:
    time.sleep(0.05)  # the hook's report has no event to wait on here: poll it, with a deadline
print("  hook heard of it:", heard_of_victim())


def first() -> None:
    v.echo.call_one(1).get(timeout=60)


def second() -> None:
    v.echo.call_one(2).get(timeout=60)


for fn in (first, second, second):
    try:
        fn()
        print(f"  client {fn.__name__}: returned")
    except Exception as e:
        print(f"  client {fn.__name__}: {type(e).__name__} through {own_frames(e)}")

for name, ep in (("relay", c.relay), ("relay_again", c.relay_again), ("relay_again", c.relay_again)):
    try:
        ep.call_one(1).get(timeout=60)
        print(f"  actor {name}: returned")
    except Exception as e:
        print(f"  actor {name}: {type(e).__name__} through {remote_frames(e)}")
for pm in (vprocs, cprocs):
    try:
        pm.stop().get(timeout=60)
    except Exception as e:
        print(f"  stop: {type(e).__name__}")
print("done")
