"""A process dies under an actor mesh: killed by SIGKILL, or exiting with a non-zero code.
A call to the mesh, or to the dead rank, raises SupervisionError in Monarch's words, naming
the actor and what happened to its process; the live rank keeps answering; the client's
unhandled_fault_hook hears of the failure."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import os
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


def hooked() -> bool:
    """Whether the hook heard of the failure (within a minute). Which meshes it names differs:
    Monarch's names each actor mesh on the proc and its own logger mesh, monarch_nb's the
    proc mesh (the compatibility notes, "Gaps found")."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with lock:
            if failures:
                failures.clear()
                return True
        time.sleep(0.05)
    return False


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
    print(f"  hook called: {hooked()}")
    attempt("call", lambda: mesh.pid.call().get(timeout=60))
    attempt("stream", lambda: [f.get(timeout=60) for f in mesh.pid.stream()])
    attempt("call_one rank 1", lambda: rank1.pid.call_one().get(timeout=60))
    attempt("rank 0", lambda: rank0.pid.call_one().get(timeout=60) == pids.item(gpus=0))
    try:
        procs.stop().get(timeout=60)
    except Exception as e:
        print(f"  stop: {type(e).__name__}")
print("done")
