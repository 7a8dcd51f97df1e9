"""``SSHJob``: allocators started over ssh on a list of hosts (Monarch's private SSHJob, exported).

Over each ssh connection: the cluster key goes through stdin into a 0600 file (never on a command
line or in an environment), the allocator is started detached (it survives the ssh client: kill
that and the job runs on), binds the address the controller reached the host at (sshd's
``SSH_CONNECTION``, not a guess from the host name), and its announcement comes back over the
same connection. ``kill()`` stops the recorded allocator PIDs on every host over ssh, which also
ends their procs, and removes the job's directory there.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._runtime import records
from .._wire.keys import read_key_file, write_key_file
from ..actor import HostMesh
from ..config import runtime_dir
from ._common import (
    answering,
    command_args,
    forwarded_config,
    held_key,
    host_meshes,
    listening,
    mesh_hosts,
    port_number,
    python_path,
)
from ._job import JobError, JobTrait

#: ssh connect timeout, and how long a remote allocator may take to announce itself
CONNECT_TIMEOUT = 10
START_TIMEOUT = 60

# $1 job id, $2 port, $3 python, then NAME=VALUE settings; the key arrives on stdin
_START = r"""
set -e
umask 077
job=$1; port=$2; py=$3; shift 3
d="${TMPDIR:-/tmp}/mnb-job-$job"
# /tmp is every user's: a name another user made first (a link to one of ours, a folder of
# theirs) must not receive the key, nor be the allocator's runtime directory
if ! mkdir -m 700 "$d" 2>/dev/null; then
    if [ -L "$d" ] || [ ! -d "$d" ] || [ ! -O "$d" ]; then
        echo "monarch_nb: $d exists and is not this user's own directory: refusing to put the cluster key there" >&2; exit 5
    fi
    # job ids are new at each apply: another of the job's host names reached this same machine
    # (a name and its address, two aliases), whose allocator and announcement this would clobber
    echo "monarch_nb: same machine: $(uname -n)" >&2; exit 6
fi
cat > "$d/key"
for kv in "$@"; do export "$kv"; done
conn="${SSH_CONNECTION:-}"
[ -n "$conn" ] || { echo "monarch_nb: SSH_CONNECTION is not set: cannot tell which address the controller reached this host at" >&2; rm -rf "$d"; exit 4; }
set -- $conn
ip=$3
case $ip in *:*) ip="[$ip]";; esac
MONARCH_NB_RUNTIME_DIR="$d/rt" setsid nohup "$py" -m monarch_nb allocator --bind "tcp://$ip:$port" \
    --key-file "$d/key" --announce-dir "$d" --announce-name host --exit-on-lease </dev/null >"$d/allocator.log" 2>&1 &
pid=$!
echo "dir $d"
echo "pid $pid"
i=0
while [ ! -f "$d/host.json" ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "monarch_nb: the allocator exited while starting; its log:" >&2; tail -n 30 "$d/allocator.log" >&2
        rm -rf "$d"; exit 3  # nothing runs here: leave no key behind
    fi
    i=$((i+1))
    if [ $i -gt $((START_TIMEOUT*10)) ]; then
        echo "monarch_nb: the allocator did not announce itself within ${START_TIMEOUT} s; its log:" >&2
        tail -n 30 "$d/allocator.log" >&2; kill "$pid"; rm -rf "$d"; exit 3
    fi
    sleep 0.1
done
echo "announce $(cat "$d/host.json")"
"""

# $1 the job's directory, $2 the allocator's pid
_STOP = r"""
d=$1; pid=$2
if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$d"; then
    kill -TERM "$pid" 2>/dev/null || true
    i=0
    while [ $i -lt 150 ]; do
        s=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
        if [ -z "$s" ] || [ "$s" = Z ]; then break; fi
        i=$((i+1)); sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
fi
case "$d" in */mnb-job-*) rm -rf "$d";; esac
echo stopped
"""


class _SameMachine(JobError):
    """The start script found the job already started on that machine, under another name."""

    def __init__(self, host: str, machine: str) -> None:
        super().__init__(f"{host} is a machine ({machine}) this job already starts on under another name")
        self.machine = machine


class SSHJob(JobTrait):
    """Start an allocator on each host over ssh.

    python_exe: the interpreter on the hosts (with monarch_nb installed).
    ssh_args: extra ssh arguments (``-i key``, ``-p 2222``, ``-o ...``).
    monarch_port: the TCP port allocators listen on (0: any free port; each host reports its own).
    transport: "tcp" (CurveZMQ with the job's cluster key).
    key_file: use this cluster key instead of generating one for the job.
    """

    def __init__(
        self,
        python_exe: str = "python",
        ssh_args: Sequence[str] = (),
        monarch_port: int = 22222,
        transport: str = "tcp",
        *,
        key_file: str | None = None,
        meshes: dict[str, list[str]] | None = None,
    ) -> None:
        if transport != "tcp":
            if transport in ("metatls", "metatls-hostname"):
                raise NotImplementedError(
                    f"SSHJob(transport={transport!r}): only 'tcp' is implemented (every byte is CurveZMQ with the job's key)"
                )
            raise ValueError(f"SSHJob supports transport='tcp', got {transport!r}")
        super().__init__()
        # Monarch's SSHJob takes the hosts only from add_mesh: a dict first is the meshes misplaced
        hint = ": hosts go in meshes={'name': ['host', ...]} or add_mesh(name, hosts)" if isinstance(python_exe, dict) else ""
        self._python_exe = python_path("SSHJob", python_exe, hint)
        self._ssh_args = command_args("SSHJob", "ssh_args", ssh_args)
        self._port = port_number("SSHJob", "monarch_port", monarch_port)
        self._transport = transport
        self._key_file_arg = key_file
        self._meshes: dict[str, list[str]] = {k: mesh_hosts("SSHJob", k, v) for k, v in (meshes or {}).items()}
        self._dir = ""
        self._key_file = ""
        self._hosts: dict[str, dict[str, Any]] = {}

    _scheduler = "ssh"

    def _key_path(self) -> str:
        return self._key_file

    def _describe(self) -> dict[str, Any]:
        live = answering([info["tcp"] for info in self._hosts.values()], self._key_file)
        lost = sorted(h for h, info in self._hosts.items() if info["tcp"] not in live)
        # the sidebar asks the live allocators only: a dead one would make every poll wait for it
        addrs = [info["tcp"] for h, info in self._hosts.items() if h not in lost and info.get("tcp")]
        return {
            "hosts": len(self._hosts),
            "state": f"lost: {', '.join(lost)}" if lost else "running",
            "lost": lost,
            "lost_addrs": {h: self._hosts[h]["tcp"] for h in lost if self._hosts[h].get("tcp")},
            "addrs": addrs,
        }

    def add_mesh(self, name: str, hosts: list[str]) -> None:
        self._meshes[name] = mesh_hosts("SSHJob", name, hosts)

    def _spec(self) -> dict[str, Any]:
        return {
            "python_exe": self._python_exe,
            "ssh_args": list(self._ssh_args),
            "monarch_port": self._port,
            "transport": self._transport,
            "key_file": self._key_file_arg,
            "meshes": self._meshes,
        }

    def _runtime(self) -> dict[str, Any]:
        return {"dir": self._dir, "key_file": self._key_file, "hosts": self._hosts}

    def _load_runtime(self, data: dict[str, Any]) -> None:
        self._dir = data.get("dir", "")
        self._key_file = data.get("key_file", "")
        self._hosts = dict(data.get("hosts") or {})

    def _host_addrs(self) -> list[str]:
        return [h["tcp"] for h in self._hosts.values() if h.get("tcp")]

    # ------------------------------------------------------------ ssh
    def ssh_command(self, host: str, script: str, *args: str) -> list[str]:
        """The ssh command line that runs ``script`` with ``args`` on ``host`` (no secret in it)."""
        remote = "sh -c " + shlex.quote(script) + " sh " + " ".join(shlex.quote(a) for a in args)
        return [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={CONNECT_TIMEOUT}",
            *self._ssh_args,
            host,
            remote,
        ]

    def _run(self, host: str, argv: list[str], stdin: bytes, timeout: float) -> str:
        try:
            cp = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise JobError(f"ssh to {host} did not finish within {timeout:.0f} s") from None
        except FileNotFoundError:
            raise JobError("ssh is not installed on this machine (the 'ssh' command was not found)") from None
        out = cp.stdout.decode(errors="replace")
        err = cp.stderr.decode(errors="replace").strip()
        if cp.returncode == 255:
            if "Permission denied" in err:
                raise JobError(f"ssh to {host} was refused (the host does not accept our ssh key): {err}")
            raise JobError(f"ssh could not reach {host}: {err or 'connection failed'}")
        said = err.splitlines()[-1] if err else ""
        if cp.returncode == 6 and said.startswith("monarch_nb: same machine: "):
            raise _SameMachine(host, said.rpartition(": ")[2])
        if cp.returncode != 0:
            raise JobError(f"starting on {host} failed (exit {cp.returncode}): {err}")
        return out

    def start_command(self, host: str) -> list[str]:
        """The ssh command that starts ``host``'s allocator (the key goes to its stdin, not here)."""
        settings = [f"{k}={v}" for k, v in sorted(forwarded_config().items())]
        script = _START.replace("${START_TIMEOUT}", str(START_TIMEOUT)).replace("$((START_TIMEOUT*10))", str(START_TIMEOUT * 10))
        return self.ssh_command(host, script, self._apply_id or "<job id>", str(self._port), self._python_exe, *settings)

    def _start_host(self, host: str, key: bytes) -> dict[str, Any]:
        argv = self.start_command(host)
        out = self._run(host, argv, key.hex().encode() + b"\n", CONNECT_TIMEOUT + START_TIMEOUT + 10)
        info: dict[str, Any] = {}
        for line in out.splitlines():
            word, _, rest = line.partition(" ")
            if word == "dir":
                info["dir"] = rest
            elif word == "pid":
                info["pid"] = int(rest)
            elif word == "announce":
                import json

                ann = json.loads(rest)
                info["tcp"] = ann["tcp"]
                info["hostname"] = ann["hostname"]
        if "tcp" not in info:
            raise JobError(f"the allocator on {host} did not report its address; ssh printed: {out[-500:]!r}")
        return info

    # ------------------------------------------------------------ the job
    def _all_hosts(self) -> list[str]:
        seen: dict[str, None] = {}
        for hosts in self._meshes.values():
            for h in hosts:
                seen.setdefault(h)
        return list(seen)

    def _create(self, client_script: str | None) -> None:
        if client_script is not None:
            raise NotImplementedError("SSHJob.apply(client_script=...): run the script yourself; it attaches with job.state()")
        hosts = self._all_hosts()
        if not hosts:
            raise ValueError("SSHJob has no hosts: call add_mesh(name, hosts) first")
        self._dir = records.make_private_dir(os.path.join(runtime_dir(), "jobs", f"ssh-{self._apply_id[:8]}"))  # type: ignore[index]
        if self._key_file_arg:
            self._key_file = self._key_file_arg
            key = read_key_file(self._key_file)
        else:
            self._key_file = os.path.join(self._dir, "key")
            key = write_key_file(self._key_file, held_key())
        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            futs = {h: pool.submit(self._start_host, h, key) for h in hosts}
        errors = []
        same: dict[str, str] = {}
        for h, f in futs.items():
            try:
                self._hosts[h] = f.result()
            except _SameMachine as e:
                same[h] = e.machine
            except Exception as e:
                errors.append(str(e))
        for h, machine in same.items():
            # named by the host entry that did start there (it announced the machine's name)
            first = [o for o, info in self._hosts.items() if info.get("hostname") == machine]
            which = f"{first[0]!r} and {h!r} are" if first else f"{h!r} is"
            errors.append(
                f"{which} the same machine ({machine}) under two names: a job runs one allocator per host, so "
                "name each host once, and by one name (meshes that share a host give the same name)"
            )
        if errors:
            try:
                self._kill()
            finally:
                raise JobError("SSHJob could not start: " + "; ".join(errors))

    def _state(self) -> dict[str, HostMesh]:
        if self._key_file and not os.path.exists(self._key_file):
            # kill() from another process (another kernel, `%mesh kill`) removed the job's key
            # with its allocators; "cannot read cluster key file" would not say so
            raise JobError(
                f"SSHJob {(self._apply_id or '')[:8]} was stopped elsewhere (its key {self._key_file} is gone, as a "
                "kill() from another process leaves it): its allocators are gone; kill() it and apply it again"
            )
        return host_meshes({name: [self._hosts[h]["tcp"] for h in hosts] for name, hosts in self._meshes.items()}, self._key_file)

    def can_run(self, spec: JobTrait) -> bool:
        return (
            isinstance(spec, SSHJob)
            and spec._python_exe == self._python_exe
            and spec._port == self._port
            and spec._ssh_args == self._ssh_args
            and spec._transport == self._transport
            and spec._meshes == self._meshes
            and bool(self._hosts)
            and all(listening(h["tcp"]) for h in self._hosts.values())
        )

    def _kill(self) -> None:
        errors: dict[str, str] = {}
        started = {h: info for h, info in self._hosts.items() if info.get("pid")}
        if started:
            with ThreadPoolExecutor(max_workers=min(32, len(started))) as pool:
                futs = {
                    h: pool.submit(
                        self._run, h, self.ssh_command(h, _STOP, info["dir"], str(info["pid"])), b"", CONNECT_TIMEOUT + 30
                    )
                    for h, info in started.items()
                }
            for h, f in futs.items():
                try:
                    f.result()
                except Exception as e:
                    errors[h] = f"{h}: {e}"
        if errors:
            # keep what could not be stopped (and the key that reaches it): kill() again stops it
            # once the host answers; forgetting it would leave it running until its lease
            self._hosts = {h: info for h, info in self._hosts.items() if h in errors}
            raise JobError(
                "kill() could not stop the allocators on: "
                + "; ".join(errors.values())
                + ". Call kill() again once they are reachable (they also exit by themselves after the lease, "
                "MONARCH_NB_LEASE, with no controller)"
            )
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._hosts = {}
