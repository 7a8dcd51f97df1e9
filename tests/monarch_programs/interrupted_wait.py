"""A wait interrupted by Ctrl-C (SIGINT in the controller), and an await that times out: the wait
ends at once, the endpoint runs on, and the actor's next call waits for it; the timed-out
future still gives its value. (Reading the Ctrl-C'd future again differs: 0.7.0 raises
ValueError "PythonTask already consumed", monarch_nb gives its value.)"""

import asyncio
import os
import signal
import tempfile
import threading
import time

from monarch.actor import Actor, endpoint, this_host


class Worker(Actor):
    def __init__(self) -> None:
        self.log: list[str] = []

    @endpoint
    def long(self, flag: str) -> str:
        self.log.append("long started")
        time.sleep(0.3)  # the controller is in get() by now
        open(flag, "w").close()
        time.sleep(1.0)
        self.log.append("long finished")
        return "long"

    @endpoint
    def slow(self) -> str:
        self.log.append("slow started")
        time.sleep(1.0)
        self.log.append("slow finished")
        return "slow"

    @endpoint
    def quick(self) -> list[str]:
        self.log.append("quick ran")
        return list(self.log)


def main() -> None:
    flag = os.path.join(tempfile.mkdtemp(), "started")
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)

    def interrupt_once_started() -> None:
        while not os.path.exists(flag):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    fut = w.long.call_one(flag)
    t0 = time.monotonic()
    try:
        fut.get()
        print("get() returned: not interrupted")
    except KeyboardInterrupt:
        print("KeyboardInterrupt in get(), before the endpoint ended:", time.monotonic() - t0 < 1.0)
    print("the next call sees:", w.quick.call_one().get())
    asyncio.run(timed_out_await(procs.spawn("w2", Worker)))
    procs.stop().get()
    print("done")


async def timed_out_await(w: Worker) -> None:
    fut = w.slow.call_one()

    async def wait() -> str:
        return await fut

    t0 = time.monotonic()
    try:
        await asyncio.wait_for(wait(), 0.2)
        print("await returned: not timed out")
    except TimeoutError:
        print("TimeoutError around the await, before the endpoint ended:", time.monotonic() - t0 < 1.0)
    print("the next call sees:", await w.quick.call_one())
    print("the timed-out future gives:", await fut)


main()
