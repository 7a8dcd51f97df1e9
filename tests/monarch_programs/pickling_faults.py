"""What cannot be pickled, or unpickled, on the way to an actor and back: an argument that cannot
be pickled fails at the call itself (every adverb, send() and a port's send() in the client) with
pickle's TypeError, nothing sent; an argument that fails to unpickle in the actor fails the call
with an ActorError under Monarch's headline, and the actor lives on; a return value that fails to
unpickle in the client raises its unpickling error there; an actor's port.send() of a value that
cannot be pickled raises in the actor (uncaught, the call fails with an ActorError around the
TypeError), and the port, a once port too, takes another value; through an explicit response
port the endpoint raises it, which fails the actor (SupervisionError). Sync and async actor.
(Left out, as they differ; see the compatibility page in docs/: an exception that cannot be
pickled, its class or its arguments, which fails the actor on 0.7.0, and 0.7.0's fault hook
hearing that its client actor failed for each reply it could not unpickle.)"""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import operator
import threading

import monarch.actor as actor_api
from monarch.actor import Accumulator, Actor, ActorError, Channel, Port, endpoint, send, this_host

# 0.7.0 tells its hook that the client's own actor failed each time a reply could not be
# unpickled (see the docstring): nothing here is about the hook, so it ignores them
actor_api.unhandled_fault_hook = lambda failure: None


def rebuild() -> object:
    raise RuntimeError("cannot rebuild this")


class Unloadable:
    """Pickles; unpickling it raises."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (rebuild, ())


class W(Actor):
    @endpoint
    def echo(self, x: object) -> str:
        return f"got {type(x).__name__}"

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def unloadable(self) -> object:
        return Unloadable()

    @endpoint
    def send_lock(self, port: Port[object]) -> str:
        port.send(threading.Lock())
        return "sent"

    @endpoint
    def send_lock_then(self, port: Port[object]) -> str:
        try:
            port.send(threading.Lock())
        except TypeError:
            port.send("instead")
        return "sent"

    @endpoint(explicit_response_port=True)
    def answer_lock(self, port: Port[object]) -> None:
        port.send(threading.Lock())


class AsyncW(Actor):
    @endpoint
    async def echo(self, x: object) -> str:
        return f"got {type(x).__name__}"

    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def unloadable(self) -> object:
        return Unloadable()

    @endpoint
    async def send_lock(self, port: Port[object]) -> str:
        port.send(threading.Lock())
        return "sent"

    @endpoint
    async def send_lock_then(self, port: Port[object]) -> str:
        try:
            port.send(threading.Lock())
        except TypeError:
            port.send("instead")
        return "sent"

    @endpoint(explicit_response_port=True)
    async def answer_lock(self, port: Port[object]) -> None:
        port.send(threading.Lock())


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()}")
    except ActorError as e:
        lines = str(e).strip().splitlines()
        print(f"  {label}: ActorError {type(e.exception).__name__}: {e.exception}")
        print(f"    first line {lines[0]!r}, last {lines[-1].strip()!r}")
    except Exception as e:
        print(f"  {label}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")


def values(f):  # type: ignore[no-untyped-def]
    r = f.get(timeout=60)
    return sorted(r.values()) if hasattr(r, "values") else r


lock = threading.Lock()
for cls in (W, AsyncW):
    # procs of its own: the last case fails an actor, and a failed actor's procs take no new one
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    m = procs.spawn(cls.__name__.lower(), cls)
    one = m.slice(gpus=0)
    print(f"{cls.__name__}: an argument that cannot be pickled")
    attempt("call_one", lambda: one.echo.call_one(lock))
    attempt("call", lambda: m.echo.call(lock))
    attempt("broadcast", lambda: m.echo.broadcast(lock))
    attempt("stream", lambda: m.echo.stream(lock))
    attempt("choose", lambda: m.echo.choose(lock))
    port, receiver = Channel.open()
    attempt("send() with a port", lambda: send(m.echo, (lock,), {}, port=port))
    attempt("port.send() in the client", lambda: port.send(lock))
    port.send("sent after")
    attempt("the port's next value", lambda: receiver.recv().get(timeout=60))
    attempt("the next call", lambda: values(m.ping.call()))

    print(f"{cls.__name__}: an argument that fails to unpickle in the actor")
    attempt("call_one", lambda: values(one.echo.call_one(Unloadable())))
    attempt("call", lambda: values(m.echo.call(Unloadable())))
    attempt("accumulate", lambda: Accumulator(m.echo, "", operator.add).accumulate(Unloadable()).get(timeout=60))
    attempt("the next call", lambda: values(m.ping.call()))

    print(f"{cls.__name__}: a return value that fails to unpickle in the client")
    attempt("call_one", lambda: values(one.unloadable.call_one()))
    attempt("call", lambda: values(m.unloadable.call()))
    attempt("the next call", lambda: values(m.ping.call()))

    print(f"{cls.__name__}: an actor's port.send() of a value that cannot be pickled")
    port, receiver = Channel.open()
    attempt("call_one", lambda: values(one.send_lock.call_one(port)))
    attempt("caught, then another value", lambda: values(one.send_lock_then.call_one(port)))
    attempt("the port's value", lambda: receiver.recv().get(timeout=60))
    once, once_receiver = Channel.open(once=True)
    attempt("caught, then another value, once port", lambda: values(one.send_lock_then.call_one(once)))
    attempt("the once port's value", lambda: once_receiver.recv().get(timeout=60))
    attempt("the next call", lambda: values(m.ping.call()))
    # last: an endpoint with an explicit response port that raises fails its actor
    attempt("explicit response port", lambda: values(one.answer_lock.call_one()))
    attempt("the next call to it", lambda: values(one.ping.call_one()))
    procs.stop().get(timeout=60)
print("done")
