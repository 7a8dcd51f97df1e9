"""An endpoint that ends its own process (os._exit, SIGKILL) while other calls to that actor are
queued behind it, sync and async actor: every queued caller gets the dead process's
SupervisionError (how soon is left out: 0.7.0 took over 10 s on a loaded machine); the other
rank answers on; the hook hears of it once, and its report()."""

import os
import re
import signal
import tempfile
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, current_rank, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


def heard() -> list[str]:
    """The actor meshes the hook heard of, once it heard of one (or 60 s went by): the report
    may come after the call failed, and after the stop."""
    deadline = time.monotonic() + 60
    while True:
        with lock:
            names = {re.sub(r"-\w+$", "", f.mesh_name) for f in failures if not f.mesh_name.startswith("logger")}
        if names or time.monotonic() > deadline:
            return sorted(names)
        time.sleep(0.05)


def lines(e: object) -> str:
    ls = [line.strip() for line in str(e).strip().splitlines()]
    return " | ".join(ls[:2])


# the files the client makes for its actors to wait on; removed at exit
scratch = tempfile.TemporaryDirectory()


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class W(Actor):
    @endpoint
    def die(self, how: str, go: str) -> None:
        wait_for_file(go)  # made once the client sent the calls to queue behind this one
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)

    @endpoint
    def val(self) -> int:
        return current_rank().rank


class AW(Actor):
    @endpoint
    async def die(self, how: str, go: str) -> None:
        wait_for_file(go)  # made once the client sent the calls to queue behind this one
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)

    @endpoint
    async def val(self) -> int:
        return current_rank().rank


for cls, how in [(W, "exit"), (AW, "kill")]:
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("w", cls)
    m.val.call().get()
    go = os.path.join(scratch.name, f"go-{how}")
    dying = m.slice(gpus=1).die.call_one(how, go)
    queued = [m.slice(gpus=1).val.call_one() for _ in range(3)]
    queued_all = m.val.call()
    # (sent, they may still be on their way when it dies: then they reach a dead process, whose
    # callers get the same error)
    open(go, "w").close()
    for label, fut in [("dying", dying)] + [(f"queued {i}", f) for i, f in enumerate(queued)] + [("queued call", queued_all)]:
        try:
            print(f"{cls.__name__} {how} {label}: returned {fut.get(timeout=60)}")
        except Exception as e:
            print(f"{cls.__name__} {how} {label}: {type(e).__name__}: {lines(e)}")
    print(f"{cls.__name__} {how} rank 0 still answers:", m.slice(gpus=0).val.call_one().get(timeout=30))
    procs.stop().get()
    print("hook:", heard())
    with lock:
        for f in failures:
            if not f.mesh_name.startswith("logger"):
                # Monarch's two lines (ours adds a third: host, proc mesh, pid)
                print("its report:", " | ".join(line.strip() for line in f.report().splitlines()[:2]))
        failures.clear()
print("done")
