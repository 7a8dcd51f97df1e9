"""A wait interrupted by Ctrl-C (SIGINT in the controller), and an await that times out: the wait
ends at once, the endpoint runs on, and the actor's next call waits for it; the timed-out
future still gives its value; Ctrl-C in Future.exception() raises KeyboardInterrupt. (Reading
the Ctrl-C'd future again differs: 0.7.0 raises ValueError "PythonTask already consumed",
monarch_nb gives its value.)"""

import asyncio
import os
import signal
import sys
import tempfile
import threading
import time

from monarch.actor import Actor, endpoint, this_host

# the files the client and its actors wait on; removed at exit
scratch = tempfile.TemporaryDirectory()


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class Worker(Actor):
    def __init__(self) -> None:
        self.log: list[str] = []

    @endpoint
    def long(self, d: str) -> str:
        self.log.append("long started")
        open(os.path.join(d, "started"), "w").close()
        wait_for_file(os.path.join(d, "caught"))  # ends once the controller's wait has ended
        self.log.append("long finished")
        open(os.path.join(d, "ended"), "w").close()
        return "long"

    @endpoint
    def slow(self, d: str) -> str:
        self.log.append("slow started")
        wait_for_file(os.path.join(d, "caught"))
        self.log.append("slow finished")
        open(os.path.join(d, "ended"), "w").close()
        return "slow"

    @endpoint
    def quick(self) -> list[str]:
        self.log.append("quick ran")
        return list(self.log)


def main() -> None:
    d = tempfile.mkdtemp(dir=scratch.name)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    main_thread = threading.get_ident()

    def in_get() -> bool:
        frame = sys._current_frames().get(main_thread)
        while frame is not None and frame.f_code.co_name != "get":
            frame = frame.f_back
        return frame is not None

    def interrupt_once_started(d: str) -> None:
        # the endpoint runs and the main thread waits in get(): a SIGINT sooner would land elsewhere
        deadline = time.monotonic() + 60
        while not (os.path.exists(os.path.join(d, "started")) and in_get()) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, args=(d,), daemon=True).start()
    fut = w.long.call_one(d)
    try:
        fut.get()
        print("get() returned: not interrupted")
    except KeyboardInterrupt:
        ended = os.path.exists(os.path.join(d, "ended"))
        print("KeyboardInterrupt in get(), before the endpoint ended:", not ended)
    open(os.path.join(d, "caught"), "w").close()
    print("the next call sees:", w.quick.call_one().get())
    asyncio.run(timed_out_await(procs.spawn("w2", Worker), tempfile.mkdtemp(dir=scratch.name)))

    # Future.exception() waits as get() does (it reads the future through get()): Ctrl-C ends
    # that wait too, with KeyboardInterrupt, which is not the call's exception
    d = tempfile.mkdtemp(dir=scratch.name)
    threading.Thread(target=interrupt_once_started, args=(d,), daemon=True).start()
    w3 = procs.spawn("w3", Worker)
    fut = w3.long.call_one(d)
    try:
        print("exception() returned:", type(fut.exception()).__name__)
    except KeyboardInterrupt:
        print("KeyboardInterrupt in exception()")
    open(os.path.join(d, "caught"), "w").close()
    print("the next call sees:", w3.quick.call_one().get())
    procs.stop().get()
    print("done")


async def timed_out_await(w: Worker, d: str) -> None:
    fut = w.slow.call_one(d)

    async def wait() -> str:
        return await fut

    try:
        await asyncio.wait_for(wait(), 0.2)
        print("await returned: not timed out")
    except TimeoutError:
        ended = os.path.exists(os.path.join(d, "ended"))
        print("TimeoutError around the await, before the endpoint ended:", not ended)
    open(os.path.join(d, "caught"), "w").close()
    print("the next call sees:", await w.quick.call_one())
    print("the timed-out future gives:", await fut)


main()
