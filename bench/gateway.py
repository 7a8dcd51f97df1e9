"""One stream through the Kubernetes gateway's two ends, on this host's loopback.

    python -m bench.gateway [--baseline REV] [--rounds 5]

The gateway server (with a TCP echo behind it) runs in a child process, the controller's end
(GatewayClient, its SOCKS5 end) here, as across a port-forward without the port-forward. Two
workloads, each over a fresh tunnel: 2,000 64-byte ping-pongs per round, and a 64 MiB push
acknowledged by the far end. The floor is the same on a plain loopback TCP connection (no
gateway). ``--baseline REV`` runs the same in the same run with monarch_nb as at git revision
REV. Prints JSON: medians over rounds, ratios to the floor and to the baseline.

Not measured here: a real port-forward (the API server's websocket), whose own cost is far
larger than either end's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

KEY = b"k" * 32
PINGS = 2000
PUSH = 64 << 20


def _serve(through_gateway: bool) -> None:
    """The far end: an echo (ping-pong) or a sink that acknowledges each 64 MiB (push)."""
    echo = socket.create_server(("127.0.0.1", 0))
    port = 0
    if through_gateway:
        from monarch_nb._runtime.gateway import GatewayServer

        port = GatewayServer(("127.0.0.1", 0), "127.0.0.1", KEY).addr[1]
    print(port, echo.getsockname()[1], flush=True)
    while True:
        c, _ = echo.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 20)
        if c.recv(1) == b"p":
            while n := c.recv_into(buf, 64):
                c.sendall(buf[:n])
        else:
            total = 0
            while n := c.recv_into(buf):
                total += n
                if total >= PUSH:
                    c.sendall(b"k")
                    total = 0
        c.close()


def _connect(gw: Any, port: int) -> socket.socket:
    if gw is None:
        return socket.create_connection(("127.0.0.1", port))
    h, p = gw.proxy.rsplit(":", 1)
    s = socket.create_connection((h, int(p)))
    s.sendall(b"\x05\x01\x02")
    s.recv(2)
    s.sendall(bytes([1, len(gw.username)]) + gw.username.encode() + bytes([len(gw.password)]) + gw.password.encode())
    s.recv(2)
    s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port))
    if s.recv(10)[1] != 0:
        raise RuntimeError("the gateway refused the stream")
    return s


def _measure(through_gateway: bool, rounds: int) -> dict[str, float]:
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.gateway", "--serve", str(int(through_gateway))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        gport, eport = map(int, child.stdout.readline().split())
        out: dict[str, float] = {}
        for mode in ("p", "t"):
            gw = None
            if through_gateway:
                from monarch_nb._runtime.gateway import GatewayClient

                gw = GatewayClient(lambda: socket.create_connection(("127.0.0.1", gport)), KEY, ["127.0.0.1"], lambda: "")
            s = _connect(gw, eport)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(mode.encode())
            samples = []
            if mode == "p":
                msg, buf = b"x" * 64, bytearray(64)
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    for _ in range(PINGS):
                        s.sendall(msg)
                        got = 0
                        while got < 64:
                            got += s.recv_into(memoryview(buf)[got:])
                    samples.append((time.perf_counter() - t0) / PINGS * 1e6)
                out["pingpong_us"] = round(statistics.median(samples), 1)
            else:
                blob = b"y" * PUSH
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    s.sendall(blob)
                    if s.recv(1) != b"k":
                        raise RuntimeError("the push was not acknowledged")
                    samples.append(time.perf_counter() - t0)
                out["push_64MiB_ms"] = round(statistics.median(samples) * 1e3, 1)
            s.close()
            if gw is not None:
                gw.close()
        return out
    finally:
        child.kill()
        child.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="also measure monarch_nb as at this git revision")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve is not None:
        _serve(a.serve == "1")
        return
    if a.one is not None:
        print(json.dumps(_measure(a.one == "1", a.rounds)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(gateway: bool, tree: str | None = None) -> dict[str, float]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, here) if p))
        cp = subprocess.run(
            [sys.executable, "-m", "bench.gateway", "--one", str(int(gateway)), "--rounds", str(a.rounds)],
            env=env, capture_output=True, text=True, check=True, timeout=600,
        )  # fmt: skip
        return dict(json.loads(cp.stdout.strip().splitlines()[-1]))

    res: dict[str, Any] = {"floor": run(False), "monarch_nb": run(True)}
    if a.baseline:
        with tempfile.TemporaryDirectory() as tree:
            subprocess.run(f"git -C {here} archive {a.baseline} monarch_nb | tar -x -C {tree}", shell=True, check=True)
            res["baseline"] = run(True, tree)
    for k in ("pingpong_us", "push_64MiB_ms"):
        res.setdefault("x_floor", {})[k] = round(res["monarch_nb"][k] / res["floor"][k], 2)
        if "baseline" in res:
            res.setdefault("x_baseline", {})[k] = round(res["monarch_nb"][k] / res["baseline"][k], 2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
