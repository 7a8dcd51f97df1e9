"""Smaller points: an unobserved recv() consumes nothing; where a sync and an async actor's code
runs (thread, event loop); is_fake_in_process."""

import asyncio
import re
import threading

from monarch.actor import Actor, Channel, endpoint, this_host


def where() -> str:
    try:
        asyncio.get_running_loop()
        loop = "a running loop"
    except RuntimeError:
        loop = "no running loop"
    return f"thread {threading.current_thread().name!r}, {loop}"


class SyncActor(Actor):
    @endpoint
    def where(self) -> str:
        return where()

    @endpoint
    def threads_seen(self, n: int) -> int:
        return len({self.where_name() for _ in range(n)})

    def where_name(self) -> str:
        return threading.current_thread().name


class AsyncActor(Actor):
    @endpoint
    async def where(self) -> str:
        return where()


port, receiver = Channel.open()
unobserved = receiver.recv()  # never awaited nor read
port.send("first")
port.send("second")
print("recv after an unobserved recv():", receiver.recv().get(timeout=30))

procs = this_host().spawn_procs(per_host={"gpus": 1})
print("is_fake_in_process:", this_host().is_fake_in_process)
s = procs.spawn("sync_actor", SyncActor)
a = procs.spawn("async_actor", AsyncActor)
print("sync actor runs on:", s.where.call_one().get())
print("sync actor's calls on one thread:", [s.where.call_one().get() for _ in range(3)].count(s.where.call_one().get()) == 3)
print("async actor runs on:", re.sub(r"'.*'", "'...'", a.where.call_one().get()))
procs.stop().get()
print("done")
