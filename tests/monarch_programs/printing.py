"""Actors print while the client prints: every line arrives whole.

Lines actors print start with "actor says"; monarch_nb tags them with the rank ("[3] actor
says ...") where Monarch's procs write to the shared stdout, and they may come in any order,
so the test compares them as a sorted list without the tag, and the client's own lines exactly.
"""

import asyncio

from monarch.actor import Actor, current_rank, endpoint, this_host


class Chatty(Actor):
    @endpoint
    def hello(self, i: int) -> int:
        print(f"actor says hello {i} from rank {current_rank().rank}", flush=True)
        return current_rank().rank


class Shouty(Actor):
    @endpoint
    async def shout(self, word: str) -> str:
        print(f"actor says {word.upper()} from rank {current_rank().rank}", flush=True)
        return word


procs = this_host().spawn_procs(per_host={"gpus": 3})
chatty = procs.spawn("chatty", Chatty)
shouty = procs.spawn("shouty", Shouty)
for i in range(20):
    # print() writes its arguments one by one: rank output must not land between them
    print("result", i, chatty.hello.call(i).get().values(), "end")


async def main() -> None:
    for word in ("one", "two"):
        print("shouted", await shouty.slice(gpus=1).shout.call_one(word))


asyncio.run(main())
procs.stop().get()
print("done")
