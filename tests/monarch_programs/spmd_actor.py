"""torchrun in an actor: SPMDActor as its docstring uses it (a rendezvous address from the first
rank, then a script, or a module with -m, on every rank), the variables each rank gets, a
script that raises, no script at all; and setup_torch_elastic_env for code that starts
torch.distributed itself, on a mesh of gpus alone and on one of replicas x gpus."""

import json
import os
import shutil
import sys
import tempfile

from monarch.actor import Actor, endpoint, this_host
from monarch.spmd import SPMDActor, setup_torch_elastic_env

KEYS = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
]  # fmt: skip

SCRIPT = """
import json, os, sys
KEYS = KEYS_HERE
out = {k: os.environ.get(k) for k in KEYS}
out["master"] = os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]
out["argv"] = sys.argv[1:]
out["name"] = __name__
if "fail" in sys.argv:
    raise RuntimeError("the script failed on rank " + os.environ["RANK"])
with open(os.path.join(sys.argv[1], sys.argv[2] + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(out, f)
""".replace("KEYS_HERE", repr(KEYS))


class Helper(Actor):
    @endpoint
    def add_path(self, d: str) -> None:
        sys.path.insert(0, d)

    @endpoint
    def env(self) -> list:
        return [os.environ.get(k) for k in KEYS]


def show(d: str, prefix: str, master: str) -> None:
    for f in sorted(x for x in os.listdir(d) if x.startswith(prefix) and x.endswith(".json")):
        with open(os.path.join(d, f)) as fh:
            out = json.load(fh)
        print(f"  {f}: {[out[k] for k in KEYS]} argv={out['argv'][1:]} name={out['name']} master={out['master'] == master}")


def last_words(e: Exception) -> str:
    last = str(e).strip().splitlines()[-1]
    return ": ".join(last.split(": ")[:2])


d = tempfile.mkdtemp()
with open(os.path.join(d, "train.py"), "w") as f:
    f.write(SCRIPT)
with open(os.path.join(d, "spmd_mod.py"), "w") as f:
    f.write(SCRIPT)
procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
procs.spawn("helper", Helper).add_path.call(d).get(timeout=60)
spmd = procs.spawn("_SPMDActor", SPMDActor)
addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None).get(timeout=60)
print("host and port:", type(addr).__name__, type(port).__name__, 0 < port < 65536)
master = f"{addr}:{port}"
print("script:", spmd.main.call(addr, port, [os.path.join(d, "train.py"), d, "s", "--lr", "0.1"]).get(timeout=60).values())
show(d, "s", master)
print("module:", spmd.main.call(addr, port, ["-m", "spmd_mod", d, "m"]).get(timeout=60).values())
show(d, "m", master)
try:
    spmd.slice(hosts=1, gpus=0).main.call_one(addr, port, [os.path.join(d, "train.py"), d, "f", "fail"]).get(timeout=60)
except Exception as e:
    print("a failing script:", type(e).__name__, "/", last_words(e))
try:
    spmd.slice(hosts=0, gpus=1).main.call_one(addr, port, []).get(timeout=60)
except Exception as e:
    print("no script:", type(e).__name__, "/", last_words(e))
print("it runs on:", spmd.main.call(addr, port, [os.path.join(d, "train.py"), d, "t"]).get(timeout=60).values())
procs.stop().get(timeout=60)

procs = this_host().spawn_procs(per_host={"gpus": 3})
setup_torch_elastic_env(procs)
for env in procs.spawn("helper", Helper).env.call().get(timeout=60).values():
    print("setup_torch_elastic_env:", env)
procs.stop().get(timeout=60)

# a mesh with a dimension besides gpus on one host: gpus is the local one
procs = this_host().spawn_procs(per_host={"replicas": 2, "gpus": 3})
setup_torch_elastic_env(procs)
for env in procs.spawn("helper", Helper).env.call().get(timeout=60).values():
    print("replicas x gpus:", env)
procs.stop().get(timeout=60)
shutil.rmtree(d)
print("done")
