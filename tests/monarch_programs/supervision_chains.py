"""Supervision of actor failures: the owner's __supervise__ gets a MeshFailure per failed rank;
returning falsy or raising fails the owner, and the failure goes up to the client's
unhandled_fault_hook, once per failure. Slices of a failed mesh, spawns on its procs."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, Channel, MeshFailure, Port, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook

# a second report of a failure to the hook, or one of a handled failure, has no event ordered
# after it (the hook is called by the runtime's supervision on its own, not from any call's
# reply): its absence is checked by waiting this long for one
HOOK_WINDOW_S = 1.0


class Custom(BaseException):
    pass


def last_line(e: object) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines()]
    return re.sub(r"^serving \S+: ", "", lines[-1]) if lines else ""


def first_line(e: object) -> str:
    return re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", str(e).strip().splitlines()[0])


def key_lines(e: object) -> str:
    """The lines of an error or failure that say what failed and why (no traceback frames)."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    keep = [first_line(e)] + [
        line for line in lines[1:] if re.search(r"failed|occurred|event was", line) or re.match(r"^\w+: ", line)
    ]
    return " | ".join(keep)


class Worker(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def die(self) -> None:
        raise Custom("worker gave up")


class AsyncWorker(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def die(self) -> None:
        raise Custom("worker gave up")


def try_call(fn) -> str:
    try:
        return f"returned {fn()}"
    except Exception as e:
        return f"{type(e).__name__}: {key_lines(e)}"


class SyncOwner(Actor):
    def __init__(self, mode: str, report: Port[str]) -> None:
        self.mode = mode
        self.report = report
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("children", Worker)

    @endpoint
    def fail_child(self) -> str:
        self.children.slice(gpus=1).die.broadcast()
        return "sent"

    @endpoint
    def after(self) -> list[str]:
        # (a message to the failed rank would fail this actor too in Monarch: undeliverable)
        return [
            "survivor " + try_call(lambda: self.children.slice(gpus=0).ping.call_one().get(timeout=60)),
            "spawn again " + try_call(lambda: type(self.procs.spawn("again", Worker)).__name__),
        ]

    @endpoint
    def ping(self) -> str:
        return "owner pong"

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.report.send(f"{self.mode}: sync owner saw {key_lines(failure)}")
        if self.mode == "raises":
            raise RuntimeError("supervisor is confused")
        return self.mode == "handles"


class AsyncOwner(Actor):
    def __init__(self, mode: str, report: Port[str]) -> None:
        self.mode = mode
        self.report = report
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.children = self.procs.spawn("children", AsyncWorker)

    @endpoint
    async def fail_child(self) -> str:
        self.children.slice(gpus=1).die.broadcast()
        return "sent"

    @endpoint
    async def after(self) -> list[str]:
        out = [f"survivor returned {await self.children.slice(gpus=0).ping.call_one()}"]
        out.append("spawn again " + try_call(lambda: type(self.procs.spawn("again", AsyncWorker)).__name__))
        return out

    @endpoint
    async def ping(self) -> str:
        return "owner pong"

    async def __supervise__(self, failure: MeshFailure) -> bool:
        self.report.send(f"{self.mode}: async owner saw {key_lines(failure)}")
        if self.mode == "raises":
            raise RuntimeError("supervisor is confused")
        return self.mode == "handles"


def hook_reports(n: int) -> list[str]:
    deadline = time.monotonic() + 60
    while True:
        with lock:
            mine = [f for f in failures if "crashed_ranks=[]" not in repr(f)]
        if len(mine) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(HOOK_WINDOW_S)
    with lock:
        mine = [f for f in failures if "crashed_ranks=[]" not in repr(f)]
        failures.clear()
    return [f"hook: {key_lines(f)}" for f in mine]


for cls in (SyncOwner, AsyncOwner):
    for mode in ("handles", "returns False", "raises"):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        port, reports = Channel.open()
        owner = procs.spawn("owner", cls, mode, port)
        print(f"{cls.__name__} that {mode}:")
        print("  fail_child:", owner.fail_child.call_one().get(timeout=60))
        print("  supervise:", reports.recv().get(timeout=60))
        if mode == "handles":
            for line in owner.after.call_one().get(timeout=120):
                print("  ", line)
            print("  owner:", try_call(lambda: owner.ping.call_one().get(timeout=60)))
            print("  hook calls:", len(hook_reports(0)))
        else:
            for line in hook_reports(1):
                print("  ", line)
            print("  owner:", try_call(lambda: owner.ping.call_one().get(timeout=60)))
        procs.stop().get()
print("done")
