"""get_or_spawn_controller's failure paths: a class that is not an Actor, or mixes sync and async
endpoints, or arguments its __init__ cannot take, fail the future with an ActorError around
spawn's ValueError or TypeError (the controller is spawned by an actor of Monarch's), from the
client and from an actor, and leave the name free for a class that works; a controller's
endpoint that raises fails that call alone, and the controller serves on, the same one to the
next request. (Left out, as they differ: a controller whose __init__ raises; see the
compatibility page in docs/.)"""

import re

import monarch.actor as actor_api
from monarch.actor import Actor, ActorError, MeshFailure, endpoint, get_or_spawn_controller, this_host

failures: list[MeshFailure] = []
actor_api.unhandled_fault_hook = failures.append


class NotAnActor:
    pass


class Mixed(Actor):
    @endpoint
    def sync_one(self) -> int:
        return 1

    @endpoint
    async def async_one(self) -> int:
        return 2


class Registry(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def add(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def fail(self) -> None:
        raise KeyError("no such entry")


class Asker(Actor):
    @endpoint
    def ask(self, name: str) -> str:
        get_or_spawn_controller(name, NotAnActor).get(timeout=60)
        return "spawned"


def describe(e: BaseException) -> str:
    kinds = []
    while isinstance(e, ActorError):
        kinds.append(type(e).__name__)
        e = e.exception
    # the Actor class is named by its module, which the port to another system changes
    words = re.sub(r"must subclass \S+ to spawn", "must subclass Actor to spawn", str(e))
    # and bind()'s words may follow the signature
    words = words.rsplit("): ", 1)[-1]
    return f"{' > '.join([*kinds, type(e).__name__])}: {(words.strip().splitlines() or [''])[0]}"


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"{label}: returned {fn()}")
    except ActorError as e:
        print(f"{label}: {describe(e)}")
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")


attempt("not an actor", lambda: get_or_spawn_controller("reg", NotAnActor).get(timeout=60))
attempt("mixed endpoints", lambda: get_or_spawn_controller("reg", Mixed).get(timeout=60))
attempt("arguments its __init__ cannot take", lambda: get_or_spawn_controller("reg", Registry, 5).get(timeout=60))
attempt("the name, then", lambda: get_or_spawn_controller("reg", Registry).get(timeout=60).add.call_one().get(timeout=60))
procs = this_host().spawn_procs(per_host={"gpus": 1})
asker = procs.spawn("asker", Asker)
attempt("not an actor, from an actor", lambda: asker.ask.call_one("reg2").get(timeout=60))
attempt("the name, then", lambda: get_or_spawn_controller("reg2", Registry).get(timeout=60).add.call_one().get(timeout=60))
reg = get_or_spawn_controller("reg", Registry).get(timeout=60)
attempt("an endpoint raising", lambda: reg.fail.call_one().get(timeout=60))
attempt("the next call", lambda: reg.add.call_one().get(timeout=60))
attempt("the same one again", lambda: get_or_spawn_controller("reg", Registry).get(timeout=60).add.call_one().get(timeout=60))
procs.stop().get(timeout=60)
print("hook calls:", len(failures))
print("done")
