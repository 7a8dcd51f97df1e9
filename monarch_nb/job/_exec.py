"""``exec_command``: run a command on every host (or one rank, or one point) of a host mesh,
as Monarch's ``monarch.job.exec_command`` does."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from typing import Any

from ..actor import Actor, Future, HostMesh, current_rank, endpoint


class _CommandActor(Actor):
    """Runs one command in its proc's host, with the rank in the environment."""

    @endpoint
    def run(
        self, cmd: list[str], env: dict[str, str] | None, workdir: str | None, client_cwd: str, output_dir: str | None
    ) -> dict[str, Any]:
        point = current_rank()
        rank_env = {f"MONARCH_RANK_{k}": str(v) for k, v in dict(point).items()}
        rank_env.update({f"MONARCH_SIZE_{k}": str(point.size(k)) for k in dict(point)})
        full_env = {**os.environ, **rank_env, **(env or {})}
        cwd = workdir or (client_cwd if os.path.isdir(client_cwd) else None)
        if cmd[0].endswith(".py") or cmd[0] == "-m":
            argv = [sys.executable, *cmd]
        else:
            argv = list(cmd)
        if output_dir is not None:
            subdir = "_".join(f"{k}_{v}" for k, v in dict(point).items())
            out_dir = output_dir.replace("$SUBDIR", subdir)
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "stdout.txt"), "w") as out, open(os.path.join(out_dir, "stderr.txt"), "w") as err:
                rc = subprocess.run(argv, stdout=out, stderr=err, env=full_env, cwd=cwd).returncode
            return {"returncode": rc, "stdout": "", "stderr": ""}
        cp = subprocess.run(argv, capture_output=True, text=True, env=full_env, cwd=cwd)
        return {"returncode": cp.returncode, "stdout": cp.stdout, "stderr": cp.stderr}


def exec_command(
    host_mesh: HostMesh,
    cmd: list[str],
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    output_dir: str | None = None,
    rank: int | None = None,
    point: dict[str, int] | None = None,
    per_host: dict[str, int] | None = None,
) -> Future[int]:
    """Run ``cmd`` on ``host_mesh`` (all of it, the flat ``rank``, or the ``point``); the Future
    holds the largest exit code. Output is printed here unless ``output_dir`` (on each host;
    ``$SUBDIR`` becomes the rank's coordinates) takes it. ``cmd`` starting with a ``.py`` file or
    ``-m`` runs with the hosts' Python."""
    if not cmd:
        raise ValueError("exec_command needs a command")
    if rank is not None and point is not None:
        raise ValueError("exec_command takes rank or point, not both")
    if point is not None:
        hosts = host_mesh.slice(**point)
    elif rank is not None:
        hosts = host_mesh.flatten("rank").slice(rank=rank)
    else:
        hosts = host_mesh
    fut: Future[int] = Future._create(f"exec_command {shlex.join(cmd)}")

    def run() -> None:
        procs = None
        try:
            procs = hosts.spawn_procs(per_host=per_host)
            results = procs.spawn("exec_command", _CommandActor).run.call(cmd, env, workdir, os.getcwd(), output_dir).get()
            worst = 0
            for _point, r in results.items():
                worst = max(worst, int(r["returncode"]))
                if r["stdout"]:
                    print(r["stdout"], end="")
                if r["stderr"]:
                    print(r["stderr"], end="", file=sys.stderr)
            fut._set_result(worst)
        except BaseException as e:
            fut._set_exception(e)
        finally:
            if procs is not None:
                try:
                    procs.stop().get(timeout=30)
                except Exception:
                    pass

    threading.Thread(target=run, name="monarch_nb-exec_command", daemon=True).start()
    return fut
