"""Simulated multi-host clusters on one Linux machine, for tests.

`NetnsCluster(n)` builds ``n + 1`` "hosts" (host 0 is the controller, hosts
1..n are workers).  Each host is a network namespace with one interface,
``eth0``, plugged into a Linux bridge that lives in a dedicated "switch"
namespace, so nothing is added to the root namespace and no address of the
cluster is routable from it (nor is any other address routable from a host:
hosts have only their /24, no default route).

Every host also has a mount namespace of its own in which ``/tmp`` and
``/dev/shm`` are fresh tmpfs mounts.  It is created once per host and held by
a tiny "anchor" process (``cat`` reading a pipe that this process owns, so it
also dies with us); every process started on the host joins it with
``nsenter``.  Processes on the same host therefore share ``/tmp``, as on a
real machine, while hosts see neither each other's files nor the root
namespace's ``/tmp``.  Consequence: a program or file that lives under the
real ``/tmp`` or ``/dev/shm`` (a virtualenv, pytest's ``tmp_path``) is not
visible inside a host.  Use `NetnsCluster.path` to reach a host's files from
the test process.

Requires root, iproute2 (``ip``, ``bridge``) and util-linux (``unshare``,
``nsenter``).  Standard library only.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "DEFAULT_PREFIX_PATTERN",
    "MAX_HOSTS",
    "NetnsCluster",
    "NetnsError",
    "cleanup_stale",
    "netns_available",
]

StrPath = str | os.PathLike[str]

NETNS_DIR = Path("/run/netns")
MAX_NAME_LEN = 15
# Default prefixes are "nh" + owner pid (6 hex digits; pid_max <= 2**22) +
# 2 random hex digits, which lets cleanup_stale() tell live runs from dead ones.
DEFAULT_PREFIX_PATTERN = r"nh[0-9a-f]{8}"
_OWNER_RE = re.compile(r"nh(?P<pid>[0-9a-f]{6})[0-9a-f]{2}")
# Hosts 0..MAX_HOSTS get .1 .. .250 of the /24 and names up to "<prefix>-h249".
MAX_HOSTS = 249
PRIVATE_DIRS = ("/tmp", "/dev/shm")
BRIDGE = "br0"
HOST_IFACE = "eth0"

_SETUP_TIMEOUT = 15.0
_KILL_GRACE = 2.0
_REAP_TIMEOUT = 10.0

# Run by each host's anchor: mount the private tmpfs dirs, report, then idle
# until our end of its stdin closes.
# A ``keep`` path that lives under a private dir (a checkout in /tmp) stays visible: it is bound
# aside on /mnt first, then moved back onto the fresh tmpfs.
_ANCHOR_SCRIPT = (
    'set -e; tag=$1; keep=$2; name=$3; hosts=$4; shift 4; if [ -n "$keep" ]; then mount --bind "$keep" /mnt; fi; '
    'for d in "$@"; do mount -t tmpfs -o mode=1777 "$tag" "$d"; done; '
    'if [ -n "$keep" ]; then mkdir -p "$keep"; mount --move /mnt "$keep"; fi; '
    # a private /run: sshd's privilege separation directory (G5 of TOOLCHAIN-cluster.md)
    'for d in "$@"; do if [ "$d" = /run ]; then chmod 755 /run; mkdir -m 755 /run/sshd; fi; done; '
    'if [ -n "$name" ]; then hostname "$name"; fi; '
    'if [ -n "$hosts" ]; then printf "%s" "$hosts" > /dev/shm/.netns-hosts 2>/dev/null || printf "%s" "$hosts" > /tmp/.netns-hosts; '
    "  f=/dev/shm/.netns-hosts; [ -f $f ] || f=/tmp/.netns-hosts; mount --bind $f /etc/hosts; fi; "
    "echo ready; exec cat >/dev/null"
)
#: the project checkout, kept visible in every host when it lives under a private dir
_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NetnsError(RuntimeError):
    """Setting up, driving or tearing down a cluster failed."""


def netns_available() -> bool:
    """Whether this process can build clusters: Linux, root, and the tools."""
    return (
        sys.platform.startswith("linux")
        and os.geteuid() == 0
        and all(shutil.which(tool) for tool in ("ip", "bridge", "unshare", "nsenter"))
    )


def cleanup_stale(prefix_pattern: str = DEFAULT_PREFIX_PATTERN) -> list[str]:
    """Delete namespaces left behind by crashed runs; return their names.

    A namespace is a candidate when its name is ``<prefix>-sw`` or
    ``<prefix>-h<N>`` with ``<prefix>`` fully matching `prefix_pattern` (a
    regular expression).  Prefixes in the default scheme embed the owner's pid
    and are skipped while that process is alive, so this is safe to call while
    other runs (e.g. pytest-xdist workers) are active (a dead run whose pid
    was reused by a live process is left alone too).  Custom prefixes carry
    no owner: every match is removed.  Processes still inside a candidate
    namespace are killed first.
    """
    name_re = re.compile(rf"(?P<prefix>{prefix_pattern})-(?:sw|h\d+)")
    removed: list[str] = []
    errors: list[str] = []
    for ns in _list_netns():
        m = name_re.fullmatch(ns)
        if m is None:
            continue
        owner = _owner_pid(m["prefix"])
        if owner is not None and _pid_alive(owner):
            continue
        survivors = _kill_netns_processes(ns, time.monotonic() + _REAP_TIMEOUT)
        if survivors:
            errors.append(f"{ns}: processes survived SIGKILL: {survivors}")
        cp = _ip("netns", "del", ns, check=False)
        if cp.returncode == 0:
            removed.append(ns)
        else:
            errors.append(f"{ns}: {cp.stderr.strip()}")
    if errors:
        raise NetnsError("cleanup_stale: " + "; ".join(errors))
    return removed


class NetnsCluster:
    """``n_hosts + 1`` simulated hosts on one bridge; see the module docstring.

    Use as a context manager, or call `close` (also registered with atexit).
    Not thread-safe.
    """

    def __init__(
        self,
        n_hosts: int,
        prefix: str | None = None,
        *,
        static_neighbors: bool = True,
        private_dirs: Sequence[str] = PRIVATE_DIRS,
        hostnames: Sequence[str] | None = None,
    ) -> None:
        """Build the cluster; on failure, tear down what was built and raise.

        static_neighbors: install permanent ARP entries for every peer on every
            host.  Without them, a connect to a host whose link is down fails
            with EHOSTUNREACH after ~3 s of failed ARP (if its entry has
            expired) instead of timing out silently as behind a real switch.
        private_dirs: directories that get a fresh per-host tmpfs; "/run" among them also gets
            the ``/run/sshd`` directory sshd needs.
        hostnames: one name per host (0..n_hosts): each host then gets a UTS namespace with
            that hostname and an /etc/hosts naming every host (so a Slurm node is named by its
            hostname, and ``ssh h2`` resolves). Such hosts are entered with ``nsenter --net``
            rather than ``ip netns exec``, which would mount a fresh /sys and hide
            /sys/fs/cgroup from slurmd (G1 of TOOLCHAIN-cluster.md); /sys/class/net then lists
            the root namespace's devices (``ip`` is right).
        """
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{MAX_HOSTS}, got {n_hosts}")
        if prefix is not None:
            _check_prefix(prefix, n_hosts)
        self.n_hosts = n_hosts
        self.static_neighbors = static_neighbors
        self.private_dirs = tuple(private_dirs)
        if hostnames is not None and len(hostnames) != n_hosts + 1:
            raise ValueError(f"hostnames needs {n_hosts + 1} names (hosts 0..{n_hosts}), got {len(hostnames)}")
        self.hostnames = list(hostnames) if hostnames is not None else None
        self._user_prefix = prefix
        self.prefix = prefix or _new_prefix()
        self._created: list[str] = []  # namespaces this object created
        self._anchors: dict[int, subprocess.Popen[bytes]] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._down: set[int] = set()
        self._partitioned: set[int] = set()
        self._closed = False
        atexit.register(self._atexit_close)
        try:
            self._setup()
        except BaseException as exc:
            try:
                self.close()
            except Exception as cleanup_exc:  # keep the original error primary
                exc.add_note(f"cleanup after failed setup also failed: {cleanup_exc}")
            raise

    # -- topology ---------------------------------------------------------

    @property
    def hosts(self) -> range:
        """All host indices: 0 (controller) .. n_hosts."""
        return range(self.n_hosts + 1)

    @property
    def switch_netns(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def subnet(self) -> str:
        return f"10.213.{self._subnet_octet}.0/24"

    def netns(self, i: int) -> str:
        """Name of host i's network namespace (usable with ``ip -n``)."""
        self._check_host(i)
        return f"{self.prefix}-h{i}"

    def ip(self, i: int) -> str:
        """Host i's IPv4 address on the cluster network."""
        self._check_host(i)
        return f"10.213.{self._subnet_octet}.{i + 1}"

    def path(self, i: int, path: StrPath) -> Path:
        """`path` as seen by host i, reachable from this process (root only).

        E.g. ``cluster.path(1, "/tmp/x").read_text()`` reads host 1's /tmp/x.
        """
        return Path(f"/proc/{self._anchor(i).pid}/root") / os.fspath(path).lstrip("/")

    # -- processes --------------------------------------------------------

    def wrap(self, i: int, argv: Sequence[StrPath], cwd: StrPath | None = None) -> list[str]:
        """The command line that runs `argv` on host i.

        For launchers that spawn processes themselves.  Such processes are not
        tracked individually, but close() still kills everything left in the
        host's network namespace.
        """
        self._check_open()
        if cwd is None:
            cwd = os.getcwd()
            if _is_under(cwd, self.private_dirs):
                cwd = "/"  # the host would not see it
        return [
            _tool("nsenter"),
            f"--target={self._anchor(i).pid}",
            "--net",
            "--mount",
            *(["--uts"] if self.hostnames else []),
            f"--wd={os.fspath(cwd)}",
            "--",
            *(os.fspath(arg) for arg in argv),
        ]

    def popen(
        self,
        i: int,
        argv: Sequence[StrPath],
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` on host i in a new session (its own process group).

        Keyword arguments go to `subprocess.Popen`; ``cwd`` is interpreted
        inside the host, where the real /tmp and /dev/shm are not visible.
        """
        if not kw.pop("start_new_session", True):
            raise ValueError("processes on a host always get their own session")
        argv = self.wrap(i, argv, cwd=kw.pop("cwd", None))
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def run(
        self,
        i: int,
        argv: Sequence[StrPath],
        *,
        timeout: float | None = 60.0,
        input: str | bytes | None = None,
        capture_output: bool = False,
        check: bool = False,
        **kw: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Like `subprocess.run`, on host i; kills the whole group on timeout."""
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        if capture_output:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        proc = self.popen(i, argv, **kw)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0, out, err) from None
        except BaseException:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    # -- faults -----------------------------------------------------------

    def link_down(self, i: int) -> None:
        """Pull host i's cable: silently drop everything to and from it.

        Done on the switch side (the bridge port), which is what a cable pull
        looks like: host i keeps its interface administratively up, its
        address and its routes, and only sees NO-CARRIER; its sends are
        dropped by the veth.  Taking the host side down instead would delete
        its connected route, so host i's own sends would fail at once with
        ENETUNREACH, which a real cable pull does not do.  No RST or ICMP is
        generated anywhere, so peers see timeouts.  Effective as soon as this
        returns.
        """
        self._check_host(i)
        self._ip_sw("link", "set", _port(i), "down")
        self._down.add(i)

    def link_up(self, i: int) -> None:
        """Plug host i's cable back in; returns once traffic flows again."""
        self._check_host(i)
        self._ip_sw("link", "set", _port(i), "up")
        self._down.discard(i)
        if i in self._partitioned:
            self._set_port_state(i, "disabled")
        self._wait_port(i)

    def partition(self, i: int) -> None:
        """Black-hole host i at the switch while every link stays up.

        The bridge port is put in the "disabled" STP state, so the bridge
        drops all frames to and from it, but neither side loses carrier (the
        host's neighbour cache and routes are untouched).  Undo with `heal`.
        """
        self._check_host(i)
        self._partitioned.add(i)
        if i not in self._down:
            self._set_port_state(i, "disabled")

    def heal(self, i: int) -> None:
        """Undo `partition` (a downed link stays down until `link_up`)."""
        self._check_host(i)
        self._partitioned.discard(i)
        if i not in self._down:
            self._set_port_state(i, "forwarding")

    # -- teardown ---------------------------------------------------------

    def close(self) -> None:
        """Kill all processes, delete all namespaces and devices, verify.

        Also closes the pipes of every process started with `popen`: read
        their output before closing.  Idempotent.  Raises NetnsError listing
        whatever could not be removed, after having tried everything.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit_close)
        errors: list[str] = []

        self._stop_tracked(errors)

        deadline = time.monotonic() + _REAP_TIMEOUT
        for ns in self._created:
            survivors = _kill_netns_processes(ns, deadline, reap=self._reap_anchors)
            if survivors:
                errors.append(f"{ns}: processes survived SIGKILL: {survivors}")
        for i, anchor in self._anchors.items():
            try:
                anchor.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"anchor of host {i} (pid {anchor.pid}) did not exit")
        for proc in [*self._anchors.values(), *self._procs]:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:  # e.g. BrokenPipeError flushing stdin
                        pass

        if self.switch_netns in self._created:
            # The veths and the bridge would die with the switch namespace
            # anyway; deleting them explicitly lets us check that nothing is left.
            cmds = [f"link del {_port(i)}" for i in self.hosts] + [f"link del {BRIDGE}"]
            _ip("-n", self.switch_netns, "-force", "-batch", "-", input="\n".join(cmds), check=False)
            cp = _ip("-n", self.switch_netns, "-o", "link", "show", check=False)
            leftovers = [line.split(":")[1].strip().split("@")[0] for line in cp.stdout.splitlines() if line.strip()]
            leftovers = [name for name in leftovers if name != "lo"]
            if cp.returncode or leftovers:
                errors.append(f"devices left in {self.switch_netns}: {leftovers or cp.stderr.strip()}")

        # Hosts first: the switch namespace is what their veths are plugged into.
        for ns in sorted(self._created, key=lambda name: name == self.switch_netns):
            cp = _ip("netns", "del", ns, check=False)
            if cp.returncode and (NETNS_DIR / ns).exists():
                errors.append(f"ip netns del {ns}: {cp.stderr.strip()}")
        remaining = sorted(set(self._created) & set(_list_netns()))
        if remaining:
            errors.append(f"namespaces still listed by `ip netns list`: {remaining}")
        if errors:
            raise NetnsError(f"cluster {self.prefix}: " + "; ".join(errors))

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<NetnsCluster {self.prefix} hosts=0..{self.n_hosts} {self.subnet} {state}>"

    # -- internals --------------------------------------------------------

    @property
    def _subnet_octet(self) -> int:
        return zlib.crc32(self.prefix.encode()) & 0xFF

    def _setup(self) -> None:
        for attempt in range(8):
            cp = _ip("netns", "add", self.switch_netns, check=False)
            if cp.returncode == 0:
                self._created.append(self.switch_netns)
                break
            if self._user_prefix is not None or "exists" not in cp.stderr or attempt == 7:
                raise NetnsError(f"ip netns add {self.switch_netns}: {cp.stderr.strip()}")
            self.prefix = _new_prefix()
        for i in self.hosts:
            _ip("netns", "add", self.netns(i))
            self._created.append(self.netns(i))

        sw_cmds = [
            f"link add {BRIDGE} type bridge stp_state 0 forward_delay 0",
            f"link set {BRIDGE} up",
        ]
        for i in self.hosts:
            sw_cmds += [
                f"link add {_port(i)} address {_mac(1, i)} type veth"
                f" peer name {HOST_IFACE} address {_mac(0, i)} netns {self.netns(i)}",
                f"link set {_port(i)} master {BRIDGE} up",
            ]
        _ip("-n", self.switch_netns, "-batch", "-", input="\n".join(sw_cmds))

        for i in self.hosts:
            cmds = [
                "link set lo up",
                f"addr add {self.ip(i)}/24 dev {HOST_IFACE}",
                f"link set {HOST_IFACE} up",
            ]
            if self.static_neighbors:
                cmds += [
                    f"neigh replace {self.ip(j)} lladdr {_mac(0, j)} dev {HOST_IFACE} nud permanent" for j in self.hosts if j != i
                ]
            _ip("-n", self.netns(i), "-batch", "-", input="\n".join(cmds))

        # Start all anchors first so that their startup overlaps.
        etc_hosts = ""
        if self.hostnames:
            etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{self.ip(j)} {self.hostnames[j]}\n" for j in self.hosts)
        for i in self.hosts:
            if self.hostnames:
                enter_netns = [_tool("nsenter"), f"--net={NETNS_DIR / self.netns(i)}"]
                new_mountns = [_tool("unshare"), "--uts", "--mount", "--propagation", "slave"]
            else:
                enter_netns = [_tool("ip"), "netns", "exec", self.netns(i)]
                new_mountns = [_tool("unshare"), "--mount", "--propagation", "slave"]
            keep = _PROJECT if any(_PROJECT.startswith(d.rstrip("/") + "/") for d in self.private_dirs) else ""
            name = self.hostnames[i] if self.hostnames else ""
            script = ["sh", "-c", _ANCHOR_SCRIPT, "sh", self.netns(i), keep, name, etc_hosts, *self.private_dirs]
            self._anchors[i] = subprocess.Popen(
                enter_netns + new_mountns + script,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        deadline = time.monotonic() + _SETUP_TIMEOUT
        for i, anchor in self._anchors.items():
            assert anchor.stdout is not None and anchor.stderr is not None
            line = _read_line(anchor.stdout.fileno(), deadline)
            if line != b"ready\n":
                err = b""
                if anchor.poll() is not None:
                    err = anchor.stderr.read()
                raise NetnsError(
                    f"host {i}: mount namespace setup failed"
                    f" (output {line!r}, exit {anchor.returncode}): {err.decode(errors='replace').strip()}"
                )
            anchor.stdout.close()
            anchor.stderr.close()
        for i in self.hosts:
            self._wait_port(i)

    def _stop_tracked(self, errors: list[str]) -> None:
        """SIGTERM every live tracked group, wait a little, SIGKILL, reap.

        Leaders are not reaped until after the SIGKILL, so their pids (hence
        the group ids) cannot have been reused by unrelated processes.
        """
        live = [p for p in self._procs if p.returncode is None]
        for proc in live:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _KILL_GRACE
        for proc in live:
            _wait_exit_no_reap(proc.pid, deadline)
        for proc in live:
            _signal_group(proc, signal.SIGKILL)
        for proc in live:
            try:
                proc.wait(timeout=_REAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {proc.pid} ({proc.args!r}) did not die")

    def _reap_anchors(self) -> None:
        for anchor in self._anchors.values():
            anchor.poll()

    def _anchor(self, i: int) -> subprocess.Popen[bytes]:
        self._check_host(i)
        try:
            return self._anchors[i]
        except KeyError:
            raise NetnsError(f"host {i} is not set up") from None

    def _ip_sw(self, *args: str) -> None:
        self._check_open()
        _ip("-n", self.switch_netns, *args)

    def _set_port_state(self, i: int, state: str) -> None:
        self._check_open()
        _run([_tool("bridge"), "-n", self.switch_netns, "link", "set", "dev", _port(i), "state", state])

    def _wait_port(self, i: int) -> None:
        """Wait until host i's link carries traffic (or is partitioned as asked)."""
        want = "disabled" if i in self._partitioned else "forwarding"
        deadline = time.monotonic() + _SETUP_TIMEOUT
        # woken by the link events of both ends; a monitor that subscribes only after the check
        # below has run misses an event, so the state is looked at again every quarter second too
        monitors = [
            subprocess.Popen([_tool("ip"), "-n", ns, "monitor", "link"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            for ns in (self.switch_netns, self.netns(i))
        ]
        outs = [m.stdout for m in monitors]
        try:
            while True:
                port = json.loads(_ip("-n", self.switch_netns, "-j", "-d", "link", "show", _port(i)).stdout)[0]
                host = json.loads(_ip("-n", self.netns(i), "-j", "link", "show", HOST_IFACE).stdout)[0]
                port_state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
                if port_state == want and "LOWER_UP" in host["flags"]:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NetnsError(f"host {i}: link not ready (port {port_state}, host flags {host['flags']})")
                ready, _, _ = select.select(outs, [], [], min(remaining, 0.25))
                for out in ready:
                    if not os.read(out.fileno(), 65536):
                        outs.remove(out)  # that monitor ended: the quarter-second look remains
        finally:
            for m in monitors:
                m.kill()
                m.wait()
                m.stdout.close()  # type: ignore[union-attr]

    def _check_host(self, i: int) -> None:
        if not (isinstance(i, int) and 0 <= i <= self.n_hosts):
            raise IndexError(f"host index {i!r} not in 0..{self.n_hosts}")

    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError(f"cluster {self.prefix} is closed")

    def _atexit_close(self) -> None:
        try:
            self.close()
        except Exception as exc:
            print(f"_netns: atexit cleanup of {self.prefix} failed: {exc}", file=sys.stderr)


# -- helpers ----------------------------------------------------------------


def _tool(name: str) -> str:
    return shutil.which(name) or name


def _run(argv: Sequence[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60)
    if check and cp.returncode:
        raise NetnsError(f"{' '.join(argv)} failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp


def _ip(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run([_tool("ip"), *args], input=input, check=check)


def _list_netns() -> list[str]:
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _new_prefix() -> str:
    return f"nh{os.getpid():06x}{secrets.randbelow(256):02x}"


def _owner_pid(prefix: str) -> int | None:
    m = _OWNER_RE.fullmatch(prefix)
    return int(m["pid"], 16) if m else None


def _check_prefix(prefix: str, n_hosts: int) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_]+", prefix):
        raise ValueError(f"prefix {prefix!r} must be alphanumeric")
    longest = max(len(f"{prefix}-h{n_hosts}"), len(f"{prefix}-sw"))
    if longest > MAX_NAME_LEN:
        raise ValueError(f"prefix {prefix!r} too long: names would have {longest} > {MAX_NAME_LEN} chars")


def _port(i: int) -> str:
    return f"p{i}"


def _mac(side: int, i: int) -> str:
    # Locally administered; only needs to be unique within one cluster's bridge.
    return f"02:00:00:00:{side:02x}:{i + 1:02x}"


def _is_under(path: StrPath, dirs: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d.rstrip("/") + "/") for d in map(os.path.realpath, dirs))


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _netns_key(ns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _pid_netns_key(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")  # fails for zombies and the dead
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _netns_pids(key: tuple[int, int]) -> list[int]:
    """Pids of live processes in the namespace `key` (as `ip netns pids`)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _pid_netns_key(int(e)) == key]


def _kill_netns_processes(ns: str, deadline: float, reap: Callable[[], None] | None = None) -> list[int]:
    """SIGKILL everything in `ns` until it is empty; return survivors."""
    key = _netns_key(ns)
    if key is None:
        return []
    while True:
        pids = _netns_pids(key)
        if not pids:
            return []
        pidfds = []  # those killed, to wait on
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone already
            try:
                # Re-check after pinning the process, so a recycled pid is never hit.
                if _pid_netns_key(pid) == key:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    pidfds.append(pidfd)
                    continue
            except OSError:
                pass
            os.close(pidfd)
        try:
            _wait_pidfds(pidfds, deadline)
        finally:
            for pidfd in pidfds:
                os.close(pidfd)
        if reap is not None:
            reap()
        if time.monotonic() > deadline:
            return _netns_pids(key)
        # a process may have forked into the namespace meanwhile: look again


def _wait_pidfds(pidfds: list[int], deadline: float) -> None:
    """Until every process behind ``pidfds`` has exited (a pidfd is readable from then on, reaped
    or not) or the deadline passes."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    left = len(pidfds)
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        for fd, _ in poller.poll(remaining * 1000):
            poller.unregister(fd)
            left -= 1


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    # Only while Popen has not reaped the leader: until then the pid, and so
    # the process group id, cannot belong to anyone else.
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_exit_no_reap(pid: int, deadline: float) -> None:
    """Until child ``pid`` has exited or the deadline passes, leaving it to be reaped by its Popen."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # reaped already
    try:
        _wait_pidfds([pidfd], deadline)
    finally:
        os.close(pidfd)


def _read_line(fd: int, deadline: float) -> bytes:
    """Read up to a newline, EOF or the deadline, without blocking past it."""
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1)
            if not chunk:
                break
            buf += chunk
    return buf
