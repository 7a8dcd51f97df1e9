"""``ProcessJob``: N allocator daemons on this machine, one per "host" (Monarch's ProcessJob).

Each allocator has a runtime directory of its own (its ipc sockets, logs), is started in its own
session with no tie to the applying process, so it outlives it (a kernel restart re-attaches),
and exits on ``kill()`` or once its lease passes with no controller attached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from .._runtime import records
from .._runtime._private import private
from ..actor import HostMesh
from ..config import get_config, runtime_dir
from ._common import forwarded_config, host_meshes, mesh_size, pid_is, stop_pids, wait_announced
from ._job import JobError, JobTrait, _children

#: seconds an allocator may take from start to announcing itself (it imports the runtime and
#: starts its zygote; on a loaded machine that is seconds)
START_TIMEOUT = 60.0


class ProcessJob(JobTrait):
    """Hosts that are local allocator processes: multi-host programs on one machine.

    job = ProcessJob({"trainers": 2, "dataloaders": 1})
    state = job.state()
    state.trainers      # HostMesh with 2 hosts
    """

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None) -> None:
        super().__init__()
        self._meshes = {name: mesh_size("ProcessJob", name, n) for name, n in meshes.items()}
        self._env = dict(env) if env else None
        self._dir = ""
        self._hosts: dict[str, dict[str, Any]] = {}

    _scheduler = "process"

    def _describe(self) -> dict[str, Any]:
        lost = sorted(s for s, h in self._hosts.items() if not pid_is(int(h["pid"]), self._dir))
        # the sidebar asks the live allocators only: a dead one would make every poll wait for it
        addrs = [h["addr"] for s, h in self._hosts.items() if s not in lost]
        return {
            "hosts": len(self._hosts),
            "state": f"lost: {', '.join(lost)}" if lost else "running",
            "lost": lost,
            "lost_addrs": {s: self._hosts[s]["addr"] for s in lost},
            "addrs": addrs,
        }

    def add_mesh(self, name: str, num_hosts: int) -> None:
        self._meshes[name] = mesh_size("ProcessJob", name, num_hosts)

    def _spec(self) -> dict[str, Any]:
        return {"meshes": dict(self._meshes), "env": self._env}

    def _runtime(self) -> dict[str, Any]:
        return {"dir": self._dir, "hosts": self._hosts}

    def _load_runtime(self, data: dict[str, Any]) -> None:
        self._dir = data.get("dir", "")
        self._hosts = dict(data.get("hosts") or {})

    def _host_addrs(self) -> list[str]:
        return [h["addr"] for h in self._hosts.values()]

    def _slots(self) -> list[tuple[str, str]]:
        return [(mesh, f"{mesh}_{i}") for mesh, n in self._meshes.items() for i in range(n)]

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise NotImplementedError(
                "ProcessJob.apply(client_script=...): run the script yourself; it attaches with job.state()"
            )
        # short: every host's ipc sockets live below it (the OS limits socket paths to ~107 bytes)
        self._dir = records.make_private_dir(os.path.join(runtime_dir(), f"j-{self._apply_id[:8]}"))  # type: ignore[index]
        announce_dir = os.path.join(self._dir, "a")
        env = dict(os.environ)
        env.update(forwarded_config())
        env.update(self._env or {})
        popens = {}
        try:
            for index, (_mesh, slot) in enumerate(self._slots()):
                hdir = records.make_private_dir(os.path.join(self._dir, str(index)))
                # 0600 whatever the umask, as every file of the runtime directory (docs/security.md)
                with open(os.path.join(hdir, "allocator.log"), "wb", opener=private) as log:
                    p = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "monarch_nb",
                            "allocator",
                            "--announce-dir",
                            announce_dir,
                            "--announce-name",
                            slot,
                            "--exit-on-lease",
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,  # not in the controller's process group: a ^C or a kernel restart leaves it
                        env=dict(env, MONARCH_NB_RUNTIME_DIR=hdir),
                        cwd=hdir,
                    )
                popens[slot] = (p, hdir)
                _children.append(p)

            def died() -> str | None:
                for slot, (p, hdir) in popens.items():
                    if p.poll() is not None:
                        with open(os.path.join(hdir, "allocator.log"), errors="replace") as f:
                            tail = f.read()[-2000:]
                        return f"the allocator of host {slot} exited with code {p.returncode} while starting:\n{tail}"
                return None

            got = wait_announced(announce_dir, set(popens), START_TIMEOUT, died)
        except BaseException:
            stop_pids([p.pid for p, _ in popens.values()], self._dir, timeout=5)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._hosts = {
            slot: {"pid": got[slot]["pid"], "addr": got[slot]["ipc"], "alloc_id": got[slot]["alloc_id"]} for slot in popens
        }

    def _state(self) -> dict[str, HostMesh]:
        dead = [s for s, h in self._hosts.items() if not pid_is(int(h["pid"]), self._dir)]
        if dead:
            raise JobError(
                f"host(s) {', '.join(dead)} of this ProcessJob are gone (killed, or their lease expired); "
                "kill() the job and apply it again"
            )
        by_mesh: dict[str, list[str]] = {}
        for mesh, slot in self._slots():
            by_mesh.setdefault(mesh, []).append(self._hosts[slot]["addr"])
        return host_meshes(by_mesh)

    def can_run(self, spec: JobTrait) -> bool:
        return (
            isinstance(spec, ProcessJob)
            and spec._meshes == self._meshes
            and spec._env == self._env
            and bool(self._hosts)
            and all(pid_is(int(h["pid"]), self._dir) for h in self._hosts.values())
        )

    def _kill(self) -> None:
        if not self._dir:
            return
        left = stop_pids([int(h["pid"]) for h in self._hosts.values()], self._dir, timeout=get_config().spawn_timeout / 4)
        shutil.rmtree(self._dir, ignore_errors=True)
        self._hosts = {}
        if left:
            raise JobError(f"allocator pid(s) {left} survived SIGKILL")
