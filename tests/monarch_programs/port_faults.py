"""Ports used wrongly: port.exception() given a BaseException (recv() raises it, a
KeyboardInterrupt too), from the client and from an actor; an actor sending to a port whose
receiver the client dropped (the send returns, the actor serves on). Sync and async actor.
(Given something that is not an exception, 0.7.0 sends it and the receiver's recv() raises
TypeError; monarch_nb raises in the sender: a deliberate difference, tested in test_actor_api.py.)"""

# every lambda here is called at once, inside its loop iteration
# ruff: noqa: B023

import gc

from monarch.actor import Actor, Channel, Port, endpoint, this_host


class W(Actor):
    @endpoint
    def send_to(self, port: Port[str], v: str) -> str:
        port.send(v)
        return "sent"

    @endpoint
    def fail_to(self, port: Port[str], v: BaseException) -> str:
        port.exception(v)  # type: ignore[arg-type]
        return "sent"

    @endpoint
    def ping(self) -> str:
        return "pong"


class AsyncW(Actor):
    @endpoint
    async def send_to(self, port: Port[str], v: str) -> str:
        port.send(v)
        return "sent"

    @endpoint
    async def fail_to(self, port: Port[str], v: BaseException) -> str:
        port.exception(v)  # type: ignore[arg-type]
        return "sent"

    @endpoint
    async def ping(self) -> str:
        return "pong"


def attempt(label: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"  {label}: returned {fn()!r}")
    except BaseException as e:  # a KeyboardInterrupt sent through a port is raised by recv()
        print(f"  {label}: {type(e).__name__}: {e}")


procs = this_host().spawn_procs(per_host={"gpus": 1})
print("the client:")
port, receiver = Channel.open()
attempt("port.exception(KeyboardInterrupt('stop'))", lambda: port.exception(KeyboardInterrupt("stop")))  # type: ignore[arg-type]
attempt("recv()", lambda: receiver.recv().get(timeout=60))
port.send("next")
attempt("recv() again", lambda: receiver.recv().get(timeout=60))
for cls in (W, AsyncW):
    print(f"{cls.__name__}:")
    w = procs.spawn(cls.__name__.lower(), cls)
    for v in (KeyboardInterrupt("stop"), SystemExit(3)):
        port, receiver = Channel.open()
        attempt(f"port.exception({v!r})", lambda: w.fail_to.call_one(port, v).get(timeout=60))
        attempt("recv()", lambda: receiver.recv().get(timeout=60))
    port, dropped = Channel.open()
    del dropped
    gc.collect()
    attempt("a send to a port whose receiver was dropped", lambda: w.send_to.call_one(port, "x").get(timeout=60))
    attempt("the next call", lambda: w.ping.call_one().get(timeout=60))
procs.stop().get(timeout=60)
print("done")
