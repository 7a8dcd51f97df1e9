"""Real sshd servers on network-namespace hosts, for tests (TOOLCHAIN-cluster.md, 1 and 5).

`SshCluster(n)` builds ``n + 1`` hosts named ``ctl, s1..sN`` (an /etc/hosts in every host
resolves them): ``ctl`` is where the test's controller scripts run, each ``sI`` runs Debian's
sshd (by absolute path) with a generated host key, accepting root with the client key in
`client_key` (on `shared`, which every host sees). `ssh_args` are the client options a test passes
to SSHJob.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _netns import NetnsCluster

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
START_TIMEOUT = 30.0

_CONFIG = """\
Port 22
ListenAddress {ip}
HostKey /tmp/sshd/ssh_host_ed25519_key
PidFile /tmp/sshd/sshd.pid
AuthorizedKeysFile {shared}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
"""


def _root_locked() -> str:
    try:
        for line in open("/etc/shadow"):
            name, pw = line.split(":")[:2]
            if name == "root":
                return pw if pw.startswith("!") else ""
    except OSError:
        pass
    return ""


class SshCluster:
    """sshd on hosts 1..n; the controller is host 0."""

    def __init__(self, n_hosts: int = 3) -> None:
        for tool in (SSHD, SSH_KEYGEN, "/usr/bin/ssh"):
            if not os.path.exists(tool):
                raise RuntimeError(f"{tool} is missing; run .ci/setup (apt-get install openssh-server openssh-client)")
        locked = _root_locked()
        if locked:
            raise RuntimeError(
                f"root's password field in /etc/shadow is {locked!r} (locked): sshd without PAM refuses even key "
                "logins to a locked account; unlock it for key logins with `usermod -p '*' root`"
            )
        self.n_hosts = n_hosts
        self.names = [f"s{i}" for i in range(1, n_hosts + 1)]
        self.shared = tempfile.mkdtemp(prefix="mnb-ssh-", dir="/var/tmp")
        os.chmod(self.shared, 0o755)
        self.net: NetnsCluster | None = None
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def client_key(self) -> str:
        return os.path.join(self.shared, "id_ed25519")

    def ssh_args(self, key: str | None = None) -> list[str]:
        return [
            "-F",
            "/dev/null",
            "-i",
            key or self.client_key,
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
        ]

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.update(extra)
        return env

    def _start(self) -> None:
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "mnb-test-client", "-f", self.client_key], check=True)
        shutil.copy(self.client_key + ".pub", os.path.join(self.shared, "authorized_keys"))
        self.net = net = NetnsCluster(self.n_hosts, hostnames=["ctl", *self.names], private_dirs=("/tmp", "/dev/shm", "/run"))
        for i, name in enumerate(self.names, start=1):
            conf = _CONFIG.format(ip=net.ip(i), shared=self.shared)
            net.run(
                i,
                [
                    "sh",
                    "-c",
                    'mkdir -p /tmp/sshd && "$1" -q -t ed25519 -N "" -f /tmp/sshd/ssh_host_ed25519_key && '
                    'cat > /tmp/sshd/sshd_config && "$2" -t -f /tmp/sshd/sshd_config',
                    "sh",
                    SSH_KEYGEN,
                    SSHD,
                ],
                input=conf.encode(),
                check=True,
            )
            self.daemons[name] = net.popen(
                i,
                [SSHD, "-D", "-e", "-f", "/tmp/sshd/sshd_config"],
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.shared, f"sshd-{name}.log"), "wb"),
            )
        deadline = time.monotonic() + START_TIMEOUT
        for i, name in enumerate(self.names, start=1):
            while not Path(net.path(i, "/tmp/sshd/sshd.pid")).exists():
                if self.daemons[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {name} did not start:\n{self.logs()}")
                time.sleep(0.02)  # sshd writes its pid file once listening

    def ssh(self, host: str, command: str, timeout: float = 30.0, key: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on ``host`` over ssh, from the controller host."""
        assert self.net is not None
        return self.net.run(
            0,
            ["ssh", *self.ssh_args(key), "-o", "BatchMode=yes", f"root@{host}", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )

    def dead_daemons(self) -> list[str]:
        return [n for n, p in self.daemons.items() if p.poll() is not None]

    def assert_alive(self) -> None:
        dead = self.dead_daemons()
        assert not dead, f"sshd died on {dead}:\n{self.logs()}"

    def host_pids(self, i: int) -> list[tuple[int, str]]:
        """(pid, command line) of every process on host i but its anchor and sshd listener."""
        assert self.net is not None
        key = os.stat(f"/run/netns/{self.net.netns(i)}")
        out = []
        skip = {self.net._anchors[i].pid}
        if i > 0:
            skip.add(self.daemons[self.names[i - 1]].pid)
        for e in os.listdir("/proc"):
            if not e.isdigit() or int(e) in skip:
                continue
            try:
                st = os.stat(f"/proc/{e}/ns/net")
                if (st.st_dev, st.st_ino) != (key.st_dev, key.st_ino):
                    continue
                cmd = Path(f"/proc/{e}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                state = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and cmd:
                out.append((int(e), cmd))
        return out

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(Path(self.shared).glob("*.log")))

    def close(self) -> None:
        for p in self.daemons.values():
            if p.poll() is None:
                p.terminate()
        for p in self.daemons.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.shared, ignore_errors=True)
