"""An actor fails on its own while its process lives on: a BaseException, an error nobody
receives (broadcast, an explicit port never answered), abort(). Its caller gets the error,
later calls get SupervisionError, queued messages are dropped, __cleanup__ runs, and the
client's unhandled_fault_hook hears of the failure."""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import os
import re
import tempfile
import threading
import time

import monarch.actor as actor_api
from monarch.actor import Actor, ActorError, MeshFailure, Port, context, endpoint, this_host

failures: list[MeshFailure] = []
lock = threading.Lock()


def hook(failure: MeshFailure) -> None:
    with lock:
        failures.append(failure)


actor_api.unhandled_fault_hook = hook


# the files the client makes for its actors to wait on; removed at exit
scratch = tempfile.TemporaryDirectory()


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class Custom(BaseException):
    pass


def raise_kind(kind: str) -> None:
    if kind == "SystemExit":
        raise SystemExit(3)
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt("interrupted")
    if kind == "Custom":
        raise Custom("a custom BaseException")
    if kind == "ValueError":
        raise ValueError("an ordinary error")
    if kind == "abort":
        context().actor_instance.abort("giving up")


class SyncWorker(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def fail(self, kind: str) -> str:
        raise_kind(kind)
        return "survived"

    @endpoint
    def slow_fail(self, kind: str, go: str) -> str:
        wait_for_file(go)  # made once the client sent the calls to queue behind this one
        raise_kind(kind)
        return "survived"

    @endpoint(explicit_response_port=True)
    def silent(self, port: Port[str], kind: str) -> None:
        raise_kind(kind)

    def __cleanup__(self, exc: Exception | None) -> None:
        print(f"actor says sync cleanup {type(exc).__name__} {last_line(exc)}")


class AsyncWorker(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def fail(self, kind: str) -> str:
        raise_kind(kind)
        return "survived"

    @endpoint
    async def slow_fail(self, kind: str, go: str) -> str:
        wait_for_file(go)  # made once the client sent the calls to queue behind this one
        raise_kind(kind)
        return "survived"

    @endpoint(explicit_response_port=True)
    async def silent(self, port: Port[str], kind: str) -> None:
        raise_kind(kind)

    async def __cleanup__(self, exc: Exception | None) -> None:
        print(f"actor says async cleanup {type(exc).__name__} {last_line(exc)}")


def last_line(e: object) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines()]
    # an actor id (random in Monarch) may lead the reason
    return re.sub(r"^serving \S+: ", "", lines[-1]) if lines else ""


def describe(e: BaseException, which: bool = True) -> str:
    if not which:
        # when both ranks failed, which one an error names varies
        return f"{type(e).__name__} ... {last_line(e)}"
    lines = str(e).strip().splitlines()
    return (
        f"{type(e).__name__} RuntimeError={isinstance(e, RuntimeError)} ActorError={isinstance(e, ActorError)}"
        f"\n    {lines[0]}\n    ... {last_line(e)}"
    )


def failure_lines(name: str, n: int) -> list[str]:
    """The hook's reports about mesh ``name``, once ``n`` of them arrived (Monarch also
    reports undeliverable messages to a failed actor there: those are left out)."""
    deadline = time.monotonic() + 60
    while True:
        with lock:
            mine = [f for f in failures if re.match(rf"{name}(-|$)", str(f.mesh_name))]
        if len(mine) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    for f in sorted(mine, key=repr):
        first = re.sub(r"mesh_name=(\w+?)-\w+,", r"mesh_name=\1,", repr(f).splitlines()[0])
        out.append(f"  hook: {first} ... {last_line(repr(f)[:-1])}")
    return out


def attempt(what: str, fn, which: bool = True) -> None:
    try:
        print(f"  {what}: returned {fn()}")
    except Exception as e:
        print(f"  {what}: {describe(e, which)}")


n = 0
for cls in (SyncWorker, AsyncWorker):
    for kind, adverb in [
        ("SystemExit", "call_one"),
        ("KeyboardInterrupt", "call_one"),
        ("Custom", "call"),
        ("Custom", "stream"),
        ("ValueError", "broadcast"),
        ("ValueError", "port"),
        ("abort", "call_one"),
        ("abort", "broadcast"),
    ]:
        n += 1
        name = f"w{n}"
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn(name, cls)
        rank0, rank1 = mesh.slice(gpus=0), mesh.slice(gpus=1)
        print(f"{cls.__name__} {kind} via {adverb}:")
        if adverb == "call_one":
            attempt("call_one", lambda: rank0.fail.call_one(kind).get(timeout=60))
        elif adverb == "call":
            attempt("call", lambda: mesh.fail.call(kind).get(timeout=60), which=False)
        elif adverb == "stream":
            attempt("stream", lambda: [f.get(timeout=60) for f in mesh.fail.stream(kind)], which=False)
        elif adverb == "broadcast":
            attempt("broadcast", lambda: rank0.fail.broadcast(kind))
        else:
            attempt("explicit port", lambda: rank0.silent.call_one(kind).get(timeout=60))
        for line in failure_lines(name, 2 if adverb in ("call", "stream") else 1):
            print(line)
        attempt("rank 0 after", lambda: rank0.ping.call_one().get(timeout=60), which=adverb not in ("call", "stream"))
        if adverb not in ("call", "stream"):
            attempt("rank 1 after", lambda: rank1.ping.call_one().get(timeout=60))
        procs.stop().get()

    # messages queued behind the failing one are dropped: their callers get SupervisionError
    n += 1
    name = f"w{n}"
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn(name, cls)
    print(f"{cls.__name__} queued behind a failure:")
    go = os.path.join(scratch.name, f"go-{name}")
    failing = mesh.slow_fail.call_one("Custom", go)
    queued = [mesh.ping.call_one() for _ in range(3)]
    # (sent, they may still be on their way when it fails: then they reach a failed actor, whose
    # callers get the same error)
    open(go, "w").close()
    attempt("failing", lambda: failing.get(timeout=60))
    for i, q in enumerate(queued):
        attempt(f"queued {i}", lambda: q.get(timeout=60))
    for line in failure_lines(name, 1):
        print(line)
    procs.stop().get()
print("done")
