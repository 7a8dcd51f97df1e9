"""Procs exit normally when stopped: an actor's __del__ and the proc's atexit handlers run,
for a sync and an async actor."""

import atexit

from monarch.actor import Actor, endpoint, this_host


class SyncFinal(Actor):
    def __init__(self) -> None:
        atexit.register(print, "actor says sync atexit ran")

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __del__(self) -> None:
        print("actor says sync __del__ ran", flush=True)


class AsyncFinal(Actor):
    def __init__(self) -> None:
        atexit.register(print, "actor says async atexit ran")

    @endpoint
    async def ping(self) -> str:
        return "pong"

    def __del__(self) -> None:
        print("actor says async __del__ ran", flush=True)


for cls in (SyncFinal, AsyncFinal):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    m = procs.spawn(cls.__name__.lower(), cls)
    print(f"{cls.__name__}:", m.ping.call_one().get(timeout=60))
    procs.stop().get()
    print(f"{cls.__name__} stopped")
print("done")
