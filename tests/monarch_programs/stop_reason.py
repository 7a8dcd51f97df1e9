"""A stop's reason: calls to the actors of a proc mesh stopped with ``stop("why")`` fail with a
SupervisionError whose status line gives that reason (``stopped: why``); the default reason is
``stopped by client``."""

from monarch.actor import Actor, endpoint, this_host


class P(Actor):
    @endpoint
    def ping(self) -> int:
        return 1


for reason in ("the run is over", None):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn("p", P)
    print("ping:", mesh.ping.call_one().get(timeout=60))
    (procs.stop(reason) if reason is not None else procs.stop()).get(timeout=60)
    try:
        mesh.ping.call_one().get(timeout=60)
    except Exception as e:
        print(f"stop({reason!r}), then a call: {type(e).__name__}: {str(e).splitlines()[1].strip()}")
print("done")
