"""A once channel (Channel.open(once=True)) carries one value: a second send raises
RuntimeError, in an actor and in the client; a second recv raises ValueError; a plain
channel takes both."""

from monarch.actor import Actor, Channel, Port, endpoint, this_host


class Sender(Actor):
    @endpoint
    def send_twice(self, port: Port[int]) -> str:
        port.send(1)
        try:
            port.send(2)
            return "second send: sent"
        except Exception as e:
            return f"second send: {type(e).__name__}: {e}"


def outcome(fn) -> str:
    try:
        return f"returned {fn()!r}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


procs = this_host().spawn_procs(per_host={"gpus": 1})
s = procs.spawn("s", Sender)

print("once, from an actor:")
port, rx = Channel.open(once=True)
print("  actor:", s.send_twice.call_one(port).get(timeout=60))
print("  recv:", outcome(lambda: rx.recv().get(timeout=60)))
print("  recv again:", outcome(lambda: rx.recv().get(timeout=5)))

print("once, from the client:")
port, rx = Channel.open(once=True)
print("  send:", outcome(lambda: port.send(5)))
print("  send again:", outcome(lambda: port.send(6)))
print("  recv:", outcome(lambda: rx.recv().get(timeout=60)))

print("plain, from an actor:")
port, rx = Channel.open()
print("  actor:", s.send_twice.call_one(port).get(timeout=60))
print("  recv twice:", outcome(lambda: [rx.recv().get(timeout=60), rx.recv().get(timeout=60)]))

procs.stop().get(timeout=60)
print("done")
