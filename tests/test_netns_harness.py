"""Tests for the network-namespace cluster harness in tests/_netns.py."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _netns import NetnsCluster, NetnsError, cleanup_stale, netns_available

pytestmark = pytest.mark.skipif(not netns_available(), reason="needs root, iproute2 and util-linux")

# A venv's python may live under /tmp, which hosts cannot see; its base
# interpreter is enough for these stdlib-only one-liners.
PY = os.path.realpath(sys.executable)

# Echo server: prints its port once listening, then answers every chunk
# with "<peer ip> <chunk>".
SERVER = """
import socket, threading
def serve(conn, addr):
    with conn:
        while data := conn.recv(64):
            conn.sendall(addr[0].encode() + b" " + data)
srv = socket.create_server(("0.0.0.0", 0))
print(srv.getsockname()[1], flush=True)
while True:
    threading.Thread(target=serve, args=srv.accept(), daemon=True).start()
"""

# One fresh connection attempt; prints how it ended.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("error", e.errno)
"""

# One long-lived connection; each stdin line "<word> <seconds>" sends the word
# and prints "ok" once its echo is back, or "timeout".
SESSION = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
received = b""
for line in sys.stdin:
    word, wait = line.split()
    sock.settimeout(float(wait))
    sock.sendall(word.encode())
    try:
        while word.encode() not in received:
            chunk = sock.recv(64)
            if not chunk:
                sys.exit("eof")
            received += chunk
        print("ok", flush=True)
    except TimeoutError:
        print("timeout", flush=True)
"""


@pytest.fixture
def cluster() -> Iterator[NetnsCluster]:
    with NetnsCluster(2) as c:
        yield c


def start_server(c: NetnsCluster, host: int) -> int:
    server = c.popen(host, [PY, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    return int(server.stdout.readline())


def probe(c: NetnsCluster, src: int, dst: int, port: int, timeout: float = 1.0) -> str:
    argv = [PY, "-c", PROBE, c.ip(dst), str(port), str(timeout)]
    return str(c.run(src, argv, capture_output=True, text=True, timeout=30, check=True).stdout).strip()


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(60)
def test_tcp_across_hosts_and_private_tmp(cluster: NetnsCluster) -> None:
    c = cluster
    port = start_server(c, 1)
    for client in (0, 2):
        reply = c.run(
            client,
            [PY, "-c", SESSION, c.ip(1), str(port)],
            input="hello 10\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert reply.stdout == "ok\n"
    # The server saw each client's own address.
    echo = c.run(
        2,
        [
            PY,
            "-c",
            "import socket,sys; s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=10);"
            "s.sendall(b'x'); print(s.recv(64).decode())",
            c.ip(1),
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert echo.stdout.strip() == f"{c.ip(2)} x"

    name = f"netns-harness-{secrets.token_hex(4)}"
    c.run(1, ["sh", "-c", f"echo hello > /tmp/{name} && echo shm > /dev/shm/{name}"], timeout=30, check=True)
    # Shared by processes of the same host ...
    same = c.run(1, ["cat", f"/tmp/{name}", f"/dev/shm/{name}"], capture_output=True, text=True, timeout=30)
    assert same.stdout == "hello\nshm\n"
    assert c.path(1, f"/tmp/{name}").read_text() == "hello\n"
    # ... but not by other hosts nor the root namespace.
    for d in ("/tmp", "/dev/shm"):
        assert c.run(2, ["test", "-e", f"{d}/{name}"], timeout=30).returncode == 1
        assert c.run(0, ["test", "-e", f"{d}/{name}"], timeout=30).returncode == 1
        assert not os.path.exists(f"{d}/{name}")


@pytest.mark.timeout(60)
def test_link_down_and_partition_drop_silently(cluster: NetnsCluster) -> None:
    c = cluster
    port = start_server(c, 1)
    session = c.popen(
        0,
        [PY, "-c", SESSION, c.ip(1), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    to_session, from_session = session.stdin, session.stdout
    assert to_session is not None and from_session is not None

    def say(line: str) -> str:
        to_session.write(line + "\n")
        return str(from_session.readline()).strip()

    def carrier(i: int) -> str:
        out = c.run(i, ["cat", "/sys/class/net/eth0/carrier"], capture_output=True, text=True, timeout=30)
        return str(out.stdout).strip()

    assert say("alpha 10") == "ok"
    assert probe(c, 0, 1, port) == "connected"

    c.link_down(1)
    assert carrier(1) == "0"  # host 1 sees the cable pulled ...
    assert carrier(0) == "1"  # ... host 0 does not
    assert say("bravo 1") == "timeout"  # established connection: no reset
    assert probe(c, 0, 1, port) == "timeout"  # new connection: not refused
    assert probe(c, 1, 0, port) == "timeout"  # host 1's own sends vanish too
    assert probe(c, 2, 0, port) == "refused"  # the rest of the cluster is unaffected

    c.link_up(1)
    assert say("charlie 10") == "ok"  # bravo is retransmitted, the connection survives
    assert probe(c, 0, 1, port) == "connected"

    c.partition(1)
    assert carrier(1) == "1"
    assert probe(c, 0, 1, port) == "timeout"
    c.heal(1)
    assert probe(c, 0, 1, port) == "connected"

    to_session.close()
    assert session.wait(timeout=30) == 0


@pytest.mark.timeout(60)
def test_teardown_leaves_nothing() -> None:
    c = NetnsCluster(1)
    names = {c.switch_netns, *(c.netns(i) for i in c.hosts)}
    assert names <= netns_names()
    stubborn = c.popen(
        1,
        [
            PY,
            "-c",
            "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN);print('ready', flush=True); signal.pause()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    # Escapes its process group and is not tracked: only the netns sweep finds it.
    daemon = subprocess.run(
        c.wrap(1, ["sh", "-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    daemon_pid = int(daemon.stdout)
    assert alive(daemon_pid)

    c.close()
    assert stubborn.returncode == -signal.SIGKILL
    assert not alive(daemon_pid)
    assert not names & netns_names()
    c.close()  # idempotent
    with pytest.raises(NetnsError):
        c.popen(0, ["true"])

    # Setup failing halfway (here: at the mount namespaces) cleans up too.
    prefix = f"nt{secrets.token_hex(3)}"
    with pytest.raises(NetnsError, match="mount namespace setup failed"):
        NetnsCluster(2, prefix=prefix, private_dirs=["/nonexistent-netns-harness"])
    assert not {n for n in netns_names() if n.startswith(prefix + "-")}

    # A run that dies without cleaning up is swept by cleanup_stale.
    crashed = subprocess.run(
        [
            PY,
            "-c",
            "import os, sys; sys.path.insert(0, sys.argv[1]); import _netns;"
            "print(_netns.NetnsCluster(1).prefix, flush=True); os._exit(1)",
            str(Path(__file__).parent),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    prefix = crashed.stdout.strip()
    left = {n for n in netns_names() if n.startswith(prefix + "-")}
    assert len(left) == 3, crashed.stderr
    assert set(cleanup_stale(re.escape(prefix))) == left
    assert not left & netns_names()
