"""spawn() returns at once: actors are constructed in the background; mesh.initialized is
the future to await; an __init__ that raises is reported through supervision and fails the
first call with SupervisionError (and __cleanup__ does not run); a slow __init__ blocks nobody."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import re
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


def key_lines(e: object) -> str:
    """The lines of an error or failure that say what failed and why (no traceback frames)."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    first = re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", lines[0])
    keep = [first] + [line for line in lines[1:] if re.search(r"failed|occurred|event was", line) or re.match(r"^\w+: ", line)]
    return " | ".join(keep)


class SlowSync(Actor):
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)
        self.ready = True

    @endpoint
    def ping(self) -> str:
        return "pong"


class SlowAsync(Actor):
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    async def ping(self) -> str:
        return "pong"


class BadSync(Actor):
    def __init__(self, why: str) -> None:
        raise ValueError(why)

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: Exception | None) -> None:
        print("actor says BadSync cleanup ran")


class BadAsync(Actor):
    def __init__(self, why: str) -> None:
        raise ValueError(why)

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: Exception | None) -> None:
        print("actor says BadAsync cleanup ran")


def hook_reports(name: str, n: int) -> list[str]:
    deadline = time.monotonic() + 60
    while True:
        with lock:
            mine = [f for f in failures if re.match(rf"{name}(-|$)", str(f.mesh_name))]
        if len(mine) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return sorted(f"hook: {key_lines(f)}" for f in mine)


def attempt(what: str, fn) -> None:
    try:
        print(f"  {what}: returned {fn()}")
    except Exception as e:
        # which failed rank the error names varies: say only why
        print(f"  {what}: {type(e).__name__}: ... {str(e).strip().splitlines()[-1].strip()}")


procs = this_host().spawn_procs(per_host={"gpus": 2})
for cls in (SlowSync, SlowAsync):
    t0 = time.monotonic()
    slow = procs.spawn(cls.__name__.lower(), cls, 3.0)
    print(f"{cls.__name__}: spawn returned before construction:", time.monotonic() - t0 < 2.0)
    print("  initialized:", slow.initialized.get(timeout=60))
    print("  waited for construction:", time.monotonic() - t0 >= 2.5)
    print("  call:", slow.ping.call().get(timeout=60).values())

# a slow __init__ on one mesh blocks neither the controller nor other meshes
slow = procs.spawn("very_slow", SlowSync, 5.0)
quick = procs.spawn("quick", SlowSync, 0.0)
t0 = time.monotonic()
print("quick call while another mesh constructs:", quick.ping.call().get(timeout=60).values(), time.monotonic() - t0 < 4.0)
print("slow mesh once constructed:", slow.ping.call().get(timeout=60).values())

for cls in (BadSync, BadAsync):
    bad_procs = this_host().spawn_procs(per_host={"gpus": 2})
    name = cls.__name__.lower()
    t0 = time.monotonic()
    try:
        bad = bad_procs.spawn(name, cls, f"{name} cannot start")
        print(f"{cls.__name__}: spawn returned", type(bad).__name__)
    except Exception as e:
        print(f"{cls.__name__}: spawn raised {type(e).__name__}")
        continue
    for line in hook_reports(name, 2):
        print(" ", line)
    attempt("initialized", lambda: bad.initialized.get(timeout=60))
    attempt("call", lambda: bad.ping.call().get(timeout=60))
    attempt("call_one", lambda: bad.slice(gpus=1).ping.call_one().get(timeout=60))
    bad_procs.stop().get()
procs.stop().get()
print("done")
