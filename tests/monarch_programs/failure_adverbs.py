"""The failure kinds through the adverbs failure_kinds leaves out: BaseExceptions (SystemExit,
KeyboardInterrupt, a custom one) and abort() through call, stream, broadcast and an explicit
port, a failing __init__ through stream, broadcast and an explicit port; for a sync and an async
actor. The caller (if any) gets the
error, later calls get SupervisionError, the hook hears of each failure once."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import re
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, MeshFailure, Port, context, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


class Custom(BaseException):
    pass


def raise_kind(kind: str) -> None:
    if kind == "SystemExit":
        raise SystemExit(3)
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt("interrupted")
    if kind == "Custom":
        raise Custom("a custom BaseException")
    if kind == "abort":
        context().actor_instance.abort("giving up")


class SyncWorker(Actor):
    def __init__(self, init_fails: bool) -> None:
        if init_fails:
            raise ValueError("cannot start")

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def fail(self, kind: str) -> str:
        raise_kind(kind)
        return "survived"

    @endpoint(explicit_response_port=True)
    def silent(self, port: Port[str], kind: str) -> None:
        raise_kind(kind)


class AsyncWorker(Actor):
    def __init__(self, init_fails: bool) -> None:
        if init_fails:
            raise ValueError("cannot start")

    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def fail(self, kind: str) -> str:
        raise_kind(kind)
        return "survived"

    @endpoint(explicit_response_port=True)
    async def silent(self, port: Port[str], kind: str) -> None:
        raise_kind(kind)


def last_line(e: object) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines()]
    return re.sub(r"^serving \S+: ", "", lines[-1]) if lines else ""


def first_line(e: object) -> str:
    return re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", str(e).strip().splitlines()[0])


def hook_lines(name: str, n: int) -> list[str]:
    deadline = time.monotonic() + 60
    while True:
        with lock:
            mine = [f for f in failures if re.match(rf"{name}(-|$)", str(f.mesh_name))]
        if len(mine) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return sorted(f"  hook: {first_line(f)} ... {last_line(repr(f)[:-1])}" for f in mine)


def attempt(what: str, fn) -> None:
    try:
        print(f"  {what}: returned {fn()}")
    except Exception as e:
        print(f"  {what}: {type(e).__name__}: {first_line(e)} ... {last_line(e)}")


CASES = [
    ("SystemExit", "call"),
    ("SystemExit", "stream"),
    ("SystemExit", "broadcast"),
    ("SystemExit", "port"),
    ("KeyboardInterrupt", "call"),
    ("KeyboardInterrupt", "stream"),
    ("KeyboardInterrupt", "broadcast"),
    ("KeyboardInterrupt", "port"),
    ("Custom", "broadcast"),
    ("Custom", "port"),
    ("abort", "call"),
    ("abort", "stream"),
    ("abort", "port"),
    ("init", "stream"),
    ("init", "broadcast"),
    ("init", "port"),
]

for cls in (SyncWorker, AsyncWorker):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    names = [f"{cls.__name__[0].lower()}{i}" for i in range(len(CASES))]
    # every mesh is spawned before any fails (Monarch refuses spawns on a proc mesh with failures);
    # a failing __init__ may fail before the next spawn reaches its proc: those get procs of their own
    own = [this_host().spawn_procs(per_host={"gpus": 1}) for kind, _ in CASES if kind == "init"]
    spare = iter(own)
    meshes = [
        (next(spare) if kind == "init" else procs).spawn(name, cls, kind == "init") for name, (kind, _) in zip(names, CASES)
    ]
    for name, mesh, (kind, adverb) in zip(names, meshes, CASES):
        print(f"{cls.__name__} {kind} via {adverb}:")
        arg = "SystemExit" if kind == "init" else kind
        if adverb == "call":
            attempt("call", lambda: mesh.fail.call(arg).get(timeout=60).values())
        elif adverb == "stream":
            attempt("stream", lambda: [f.get(timeout=60) for f in mesh.fail.stream(arg)])
        elif adverb == "broadcast":
            attempt("broadcast", lambda: mesh.fail.broadcast(arg))
        else:
            attempt("explicit port", lambda: mesh.silent.call_one(arg).get(timeout=60))
        for line in hook_lines(name, 1):
            print(line)
        attempt("after", lambda: mesh.ping.call_one().get(timeout=60))
    procs.stop().get()
    for p in own:
        p.stop().get()
print("done")
