"""A process dies under an actor mesh: killed by SIGKILL, or exiting with a non-zero code.
A call to the mesh, or to the dead rank, raises SupervisionError in Monarch's words, naming
the actor and what happened to its process; the live rank keeps answering; the client's
unhandled_fault_hook hears of the actor mesh's failure."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import os
import re
import signal
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


class P(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit(self, code: int) -> None:
        os._exit(code)


def words(e: BaseException) -> str:
    # Monarch's first two lines; anything after them (our host, pid, signal name) is extra detail
    lines = str(e).splitlines()
    return f"{type(e).__name__} RuntimeError={isinstance(e, RuntimeError)}\n    " + "\n    ".join(lines[:2])


def attempt(what: str, fn) -> None:
    try:
        print(f"  {what}: returned {fn()}")
    except Exception as e:
        print(f"  {what}: {words(e)}")


def hooked(name: str) -> list[str]:
    """The hook's reports about actor mesh ``name`` (Monarch also reports its own logger mesh
    on the dead proc: left out), once one arrived: the event's first two lines."""
    deadline = time.monotonic() + 60
    while True:
        with lock:
            mine = [f for f in failures if re.match(rf"{name}(-|$)", str(f.mesh_name))]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    for f in mine:
        lines = [line.strip() for line in repr(f)[:-1].splitlines()]
        out.append("  hook: " + re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", lines[0]) + " ... " + lines[1])
    return out


for how in ("SIGKILL", "exit 3"):
    name = "victim" if how == "SIGKILL" else "quitter"
    print(f"rank 1 {how}:")
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn(name, P)
    pids = mesh.pid.call().get(timeout=60)
    rank0, rank1 = mesh.slice(gpus=0), mesh.slice(gpus=1)
    if how == "SIGKILL":
        os.kill(pids.item(gpus=1), signal.SIGKILL)
    else:
        rank1.exit.broadcast(3)
    for line in hooked(name):
        print(line)
    attempt("call", lambda: mesh.pid.call().get(timeout=60))
    attempt("stream", lambda: [f.get(timeout=60) for f in mesh.pid.stream()])
    attempt("call_one rank 1", lambda: rank1.pid.call_one().get(timeout=60))
    attempt("rank 0", lambda: rank0.pid.call_one().get(timeout=60) == pids.item(gpus=0))
    try:
        procs.stop().get(timeout=60)
    except Exception as e:
        print(f"  stop: {type(e).__name__}")
print("done")
