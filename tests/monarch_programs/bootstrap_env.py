"""Bootstrap commands and environments: default_bootstrap_cmd().with_env(...) where None removes a
variable, inherit_env=False, and HostMesh.with_python_executable."""

import os
import sys

from monarch.actor import Actor, default_bootstrap_cmd, endpoint, this_host

os.environ["REMOVED_VAR"] = "present"
os.environ["KEPT_VAR"] = "kept"

NAMES = ["ADDED", "REMOVED_VAR", "KEPT_VAR", "ONLY"]


class Env(Actor):
    @endpoint
    def get(self) -> dict[str, str | None]:
        return {n: os.environ.get(n) for n in NAMES}

    @endpoint
    def python(self) -> bool:
        return os.path.realpath(sys.executable) == os.path.realpath(os.environ["EXPECTED_PYTHON"])


cmd = default_bootstrap_cmd()
print("default command:", type(cmd).__name__, "inherit_env", cmd.inherit_env)
added = cmd.with_env({"ADDED": "yes", "REMOVED_VAR": None})
print("with_env keeps the original:", "ADDED" not in cmd.env, added.env.get("ADDED"))
procs = this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=added)
print("with_env:", procs.spawn("env", Env).get.call_one().get(timeout=60))
procs.stop().get()

empty = default_bootstrap_cmd().with_env({"ONLY": "1"})
empty.inherit_env = False
procs = this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command=empty)
print("inherit_env=False:", procs.spawn("env", Env).get.call_one().get(timeout=60))
procs.stop().get()

os.environ["EXPECTED_PYTHON"] = sys.executable
procs = this_host().with_python_executable(sys.executable).spawn_procs(per_host={"gpus": 1})
print("with_python_executable:", procs.spawn("env", Env).python.call_one().get(timeout=60))
procs.stop().get()
print("done")
