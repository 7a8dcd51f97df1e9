"""Using a stopped mesh: a stopped proc mesh refuses to be sliced, flattened, split, renamed or
spawned on (a RuntimeError); calls and streams to an actor mesh whose procs were stopped, or
which was stopped itself, fail with SupervisionError naming the endpoint, and the procs of a
stopped actor mesh take another.
Not here, as we differ by design (see the compatibility page in docs/): a spawn on a slice taken before its
proc mesh stopped (Monarch returns a mesh; we refuse it as the stopped mesh's own spawn), and
Monarch's fault hook hearing of each call to a stopped actor mesh ("undeliverable message"):
ours tells the caller only."""

import re

import monarch.actor as actor_api
from monarch.actor import Actor, endpoint, this_host

# Monarch's hook hears of each call to a stopped actor mesh (see the docstring); its default
# would end the program there. Nothing here is about the hook, so it ignores them
actor_api.unhandled_fault_hook = lambda failure: None


class P(Actor):
    @endpoint
    def ping(self) -> int:
        return 1


def words(e: BaseException) -> str:
    """The type, whether it is a RuntimeError, and the message's leading words: the first line
    with the actor's name (Monarch's is an internal id when an actor mesh was stopped) left out,
    and the second line's status."""
    lines = str(e).splitlines() or [""]
    head = re.sub(r" actor .* has status:$", " actor ... has status:", lines[0]).split(": ")[0]
    status = lines[1].split(":")[0].strip() if len(lines) > 1 else ""
    kind = type(e).__name__ if type(e).__name__ == "SupervisionError" else f"RuntimeError={isinstance(e, RuntimeError)}"
    return f"{kind}: {head}" + (f" / {status}" if status else "")


def attempt(what: str, fn) -> None:
    try:
        print(f"  {what}: returned {fn()!r}")
    except Exception as e:
        print(f"  {what}: {words(e)}")


print("a proc mesh stopped:")
procs = this_host().spawn_procs(per_host={"gpus": 2})
mesh = procs.spawn("p", P)
print("  before:", mesh.ping.call().get(timeout=60).values())
procs.stop().get(timeout=60)
attempt("slice", lambda: procs.slice(gpus=0))
attempt("slice keeping the dimension", lambda: procs.slice(gpus=slice(0, 1)))
attempt("flatten", lambda: procs.flatten("x"))
attempt("rename", lambda: procs.rename(gpus="g"))
attempt("split", lambda: procs.split(gpus=("a", "b"), a=1))
attempt("spawn", lambda: procs.spawn("q", P))
attempt("sizes", lambda: procs.sizes)
attempt("stop again", lambda: procs.stop().get(timeout=60))
attempt("call", lambda: mesh.ping.call().get(timeout=60))
attempt("call_one to a slice", lambda: mesh.slice(gpus=1).ping.call_one().get(timeout=60))
attempt("stream", lambda: [f.get(timeout=60) for f in mesh.ping.stream()])

print("an actor mesh stopped:")
procs = this_host().spawn_procs(per_host={"gpus": 1})
mesh = procs.spawn("q", P)
print("  before:", mesh.ping.call_one().get(timeout=60))
mesh.stop().get(timeout=60)
attempt("call_one", lambda: mesh.ping.call_one().get(timeout=60))
attempt("call", lambda: mesh.ping.call().get(timeout=60))
again = procs.spawn("r", P)
print("  another actor mesh on its procs:", again.ping.call_one().get(timeout=60))
procs.stop().get(timeout=60)
print("done")
