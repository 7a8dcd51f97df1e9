"""Ports and channels: values pushed to the client, explicit response ports, send(), ranked receivers."""

import asyncio

from monarch.actor import Actor, Channel, Port, current_rank, endpoint, send, this_host


class Producer(Actor):
    @endpoint
    def produce(self, port: Port[tuple[int, int]], n: int) -> None:
        for i in range(n):
            port.send((current_rank().rank, i))

    @endpoint(explicit_response_port=True)
    def square(self, port: Port[int], x: int) -> None:
        port.send(x * x + current_rank().rank)

    @endpoint(explicit_response_port=True)
    def checked_sqrt(self, port: Port[float], x: float) -> None:
        if x < 0:
            port.exception(ValueError(f"negative: {x}"))
        else:
            port.send(x**0.5)

    @endpoint
    def fail_through(self, port: Port[int]) -> None:
        port.exception(KeyError("nothing to send"))


class Boss(Actor):
    """Opens channels of its own, and hands on ports it was given."""

    @endpoint
    def delegate(self, workers: Producer, n: int) -> list[tuple[int, int]]:
        port, receiver = Channel.open()
        workers.produce.broadcast(port, n)
        return sorted(receiver.recv().get() for _ in range(n * len(workers)))

    @endpoint
    def relay(self, workers: Producer, port: Port[tuple[int, int]]) -> None:
        workers.produce.broadcast(port, 1)


class AsyncBoss(Actor):
    @endpoint
    async def delegate(self, workers: Producer, n: int) -> list[tuple[int, int]]:
        port, receiver = Channel.open()
        workers.produce.broadcast(port, n)
        return sorted([await receiver.recv() for _ in range(n * len(workers))])


procs = this_host().spawn_procs(per_host={"gpus": 3})
producers = procs.spawn("producers", Producer)

# values from many actors through one port; each sender's values stay in order
port, receiver = Channel.open()
producers.produce.broadcast(port, 4)
got = [receiver.recv().get() for _ in range(12)]
print("count:", len(got))
for rank in range(3):
    print("rank", rank, [i for r, i in got if r == rank])

# an explicit response port answers call() and call_one() like a return value
print("square call:", producers.square.call(5).get().values())
print("square call_one:", producers.slice(gpus=2).square.call_one(6).get())
print("sqrt:", producers.slice(gpus=0).checked_sqrt.call_one(16.0).get())
try:
    producers.slice(gpus=0).checked_sqrt.call_one(-4.0).get()
except Exception as e:
    print("sqrt of negative:", type(e).__name__, e)

# send() with a port: replies go to the port instead of a future
p2, r2 = Channel.open()
send(producers.square, (3,), {}, port=p2)
print("send all:", sorted(r2.recv().get() for _ in range(3)))

# a ranked receiver tells which actor answered
p3, r3 = Channel.open_ranked()
send(producers.square, (2,), {}, port=p3)
print("ranked:", sorted(r3.recv().get() for _ in range(3)))

# ranked() reads the same channel as (rank, value) pairs
p6, r6 = Channel.open()
send(producers.square, (1,), {}, port=p6)
print("ranked():", sorted(r6.ranked().recv().get() for _ in range(3)))

# an exception sent through a port is raised by recv()
p4, r4 = Channel.open()
producers.slice(gpus=1).fail_through.broadcast(p4)
try:
    r4.recv().get()
except Exception as e:
    print("port exception:", type(e).__name__, e)

# the client can send to its own port too
p5, r5 = Channel.open()
p5.send("from the client")
print("local:", r5.recv().get())


async def consume() -> list[tuple[int, int]]:
    p, r = Channel.open()
    producers.slice(gpus=1).produce.broadcast(p, 3)
    return [await r.recv() for _ in range(3)]


print("async recv:", asyncio.run(consume()))

# channels inside actors, and a client port passed through an actor
boss = procs.slice(gpus=0).spawn("boss", Boss)
print("boss:", boss.delegate.call_one(producers, 2).get())
print("async boss:", procs.slice(gpus=1).spawn("aboss", AsyncBoss).delegate.call_one(producers, 1).get())
p7, r7 = Channel.open()
boss.relay.call_one(producers, p7).get()
print("relayed:", sorted(r7.recv().get() for _ in range(3)))
procs.stop().get()
print("done")
