"""Actor log records carry Monarch's [actor=...] prefix, for a sync and an async actor; an empty
message is left alone; config.prefix_python_logs_with_actor=False (in the actor's process) turns
it off; the client's own records have no prefix."""

import logging
import sys

from monarch.actor import Actor, config, endpoint, this_host


def stdout_logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    log.propagate = False
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("actor says %(levelname)s %(message)s|"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


class Talker(Actor):
    def __init__(self) -> None:
        self.log = stdout_logger("talker")

    @endpoint
    def talk(self, tag: str) -> None:
        self.log.info("hello %s", tag)
        sys.stdout.flush()

    @endpoint
    def empty(self) -> None:
        self.log.info("")
        sys.stdout.flush()

    @endpoint
    def prefix(self, on: bool) -> None:
        config.prefix_python_logs_with_actor = on


class AsyncTalker(Actor):
    def __init__(self) -> None:
        self.log = stdout_logger("async_talker")

    @endpoint
    async def talk(self, tag: str) -> None:
        self.log.warning("async %s", tag)
        sys.stdout.flush()


procs = this_host().spawn_procs(per_host={"gpus": 2})
t = procs.spawn("talkers", Talker)
t.talk.call("A").get()
t.empty.call().get()
a = procs.spawn("async_talkers", AsyncTalker)
a.talk.call("B").get()
t.prefix.call(False).get()
t.talk.call("C").get()
a.talk.call("D").get()
t.prefix.call(True).get()
t.talk.call("E").get()
print("client prefix default:", config.prefix_python_logs_with_actor)
client_log = logging.getLogger("client")
client_log.propagate = False
h = logging.StreamHandler(sys.stdout)
h.setFormatter(logging.Formatter("client %(message)s"))
client_log.addHandler(h)
client_log.warning("a record of the client")
procs.stop().get()
print("done")
