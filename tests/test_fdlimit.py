"""File descriptors (monarch_nb/_runtime/_fdlimit.py): a controller started with the usual soft
limit spawns more procs than that limit holds, and one whose hard limit is too low for a spawn
is told so before anything starts, instead of its kernel dying in libzmq (which aborts the
process when a listener runs out of descriptors)."""

from __future__ import annotations

import resource
from typing import Any

import _ownctl
import pytest

pytestmark = pytest.mark.timeout(180)

_HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _controller(tmp_path: Any, code: str, soft: int, hard: int) -> dict[str, Any]:
    """Run ``code`` as a controller whose descriptor limits are ``soft``/``hard``."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return _ownctl.run(_ownctl.runtime_dir(tmp_path), code, limit)


@pytest.mark.skipif(
    _HARD != resource.RLIM_INFINITY and _HARD < 2048, reason=f"the hard limit here ({_HARD}) leaves no room above 192"
)
def test_a_controller_started_with_a_low_soft_limit_spawns_past_it(tmp_path: Any) -> None:
    # 80 procs take the controller about 3 descriptors each: more than the 192 it started with
    got = _controller(
        tmp_path,
        """
            pm = this_host().spawn_procs(per_host={"gpus": 80})
            a = pm.spawn("e", E)
            limits = a.soft_limit.call().get(timeout=120).values()
            report({
                "controller": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "procs": sorted(set(limits)),
                "open": len(os.listdir("/proc/self/fd")),
            })
            pm.stop().get(timeout=60)
            """,
        192,
        _HARD,
    )
    raised = 65536 if _HARD == resource.RLIM_INFINITY else min(_HARD, 65536)
    assert got["controller"] == raised and got["procs"] == [raised], got
    assert got["open"] > 192, got  # the spawn needed more than the soft limit it started with


def test_a_spawn_the_hard_limit_cannot_hold_fails_first_and_says_what_to_do(tmp_path: Any) -> None:
    got = _controller(
        tmp_path,
        """
            try:
                this_host().spawn_procs(per_host={"gpus": 40})
                report({"error": None})
            except OSError as e:
                err = {"errno": e.errno, "text": str(e)}
                # nothing was started: a spawn that fits goes on as usual
                pm = this_host().spawn_procs(per_host={"gpus": 2})
                a = pm.spawn("e", E)
                after = a.soft_limit.call().get(timeout=60).values()
                # the program itself takes the rest: an actor is refused before its threads
                # connect here (a connection libzmq could not accept would abort this process)
                from monarch_nb._runtime import _fdlimit
                hog = []
                while _fdlimit.open_count() + _fdlimit.RESERVE + 1 < 160:
                    hog.append(open(os.devnull))
                try:
                    pm.spawn("f", E)
                    actor_err = None
                except OSError as e:
                    actor_err = str(e)
                for h in hog:
                    h.close()
                report({"error": err, "after": after, "actor": actor_err})
                pm.stop().get(timeout=60)
            """,
        160,
        160,
    )
    assert got["actor"] is not None and "spawning actor 'f' on 2 procs" in got["actor"] and "ulimit -n" in got["actor"], got
    err = got["error"]
    assert err is not None and err["errno"] == 24, got
    assert "spawning 40 procs" in err["text"] and "ulimit -n" in err["text"] and "of its 160 open" in err["text"], err
    assert got["after"] == [160, 160], got


def test_an_allocator_that_cannot_hold_a_spawn_refuses_it_whole(tmp_path: Any) -> None:
    # the controller has room, this host's allocator (started elsewhere, with a lower limit)
    # does not: the spawn fails at once with its limit named, and the allocator serves on
    got = _controller(
        tmp_path,
        """
            first = this_host().spawn_procs(per_host={"gpus": 1})  # starts this host's allocator
            (alloc,) = list_allocators()
            resource.prlimit(int(alloc["pid"]), resource.RLIMIT_NOFILE, (120, 120))
            err = error_of(lambda: this_host().spawn_procs(per_host={"gpus": 30}))
            pm = this_host().spawn_procs(per_host={"gpus": 2})
            a = pm.spawn("e", E)
            report({"error": err, "after": len(a.soft_limit.call().get(timeout=60).values())})
            pm.stop().get(timeout=60)
            first.stop().get(timeout=60)
            """,
        _HARD,
        _HARD,
    )
    err = got["error"]
    assert err is not None and "spawning 30 procs" in err and "of its 120 open" in err, got
    assert "this host's allocator" in err and "ulimit -n" in err, err
    assert got["after"] == 2, got


def test_calls_once_the_program_holds_every_descriptor_go_on_or_say_what_to_do(tmp_path: Any) -> None:
    # what needs no new descriptor goes on (a thread's first wait on one actor's reply among
    # it); a thread's first message to a peer needs one, and fails saying so
    got = _controller(
        tmp_path,
        """
            import threading
            pm = this_host().spawn_procs(per_host={"gpus": 2})
            a = pm.spawn("e", E)
            one = a.slice(gpus=0)
            a.echo.call(1).get(timeout=60)  # this thread's connections to both procs
            hog = take_every_descriptor()

            def in_thread(fn):
                out = []
                t = threading.Thread(target=lambda: out.append(error_of(fn)))
                t.start()
                t.join()
                return out[0]

            first_wait = error_of(lambda: one.echo.call_one("x").get(timeout=60))
            value = one.echo.call_one("y").get(timeout=60)
            thread_call = in_thread(lambda: a.echo.call(2).get(timeout=60))
            for fd in hog:
                os.close(fd)
            after = in_thread(lambda: a.echo.call(3).get(timeout=60))
            report({"first_wait": first_wait, "value": value, "thread_call": thread_call, "after": after})
            pm.stop().get(timeout=60)
            """,
        256,
        256,
    )
    assert got["first_wait"] is None and got["value"] == "y", got
    err = got["thread_call"]
    assert err is not None and err.startswith("OSError: [Errno 24] connecting to"), got
    assert "of its 256 open" in err and "ulimit -n" in err, err
    assert got["after"] is None, got


def test_a_controller_that_spawns_and_stops_meshes_keeps_no_descriptor_per_gone_actor(tmp_path: Any) -> None:
    # a notebook that spawns a mesh, calls it and stops it, again and again, kept its thread's
    # direct connection to every stopped proc open: one more descriptor per mesh, for good
    got = _controller(
        tmp_path,
        """
            from monarch_nb._runtime import transport
            transport.DIRECT_PRUNE_MIN = 4  # (64 by default) so that a few meshes show it
            def cycle():
                pm = this_host().spawn_procs(per_host={"gpus": 1})
                pm.spawn("e", E).echo.call_one(1).get(timeout=60)
                pm.stop().get(timeout=60)
            cycle()
            cycle()
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(16):
                cycle()
            report({"grown": len(os.listdir("/proc/self/fd")) - before})
            """,
        4096,
        _HARD,
    )
    assert got["grown"] <= 6, got  # without closing them: 16


def test_a_rank_connecting_while_the_controller_holds_every_descriptor_waits_for_room(tmp_path: Any) -> None:
    # a new thread of a rank opens a connection to the controller, which cannot accept it: the
    # controller lives on (libzmq, had the rank gone that way, would have aborted it) and the
    # thread's values arrive, in order, once the program gives descriptors back
    got = _controller(
        tmp_path,
        """
            from monarch_nb.actor import Channel
            pm = this_host().spawn_procs(per_host={"gpus": 1})
            a = pm.spawn("e", E)
            a.echo.call_one(0).get(timeout=60)  # the actor's own connection here
            port, rx = Channel.open()
            hog = take_every_descriptor()
            # the rank's thread waits out its greeting timeout, then queues its values
            sent = a.from_a_thread.call_one(port, 5).get(timeout=30)
            for fd in hog:
                os.close(fd)
            values = [rx.recv().get(timeout=30) for _ in range(5)]
            report({"sent": sent, "values": values, "after": a.echo.call_one(7).get(timeout=30)})
            pm.stop().get(timeout=60)
            """,
        256,
        256,
    )
    assert (got["sent"], got["values"], got["after"]) == (5, [0, 1, 2, 3, 4], 7), got


_DATA_PLANE_AT_THE_LIMIT = """
import os, resource, socket, threading, time
from monarch_nb._runtime import _dataplane as dp

srv = dp.DataServer(lambda: None, lambda: "")
raw = bytearray(b"z" * 64)
bid = srv.register(dp.Entry(memoryview(raw), raw))


def read(timeout):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(srv.unix)
    s.sendall(dp._REQ.pack(dp.OP_READ, bid, 0, 8))
    status, n = dp._RSP.unpack(s.recv(dp._RSP.size))
    got = s.recv(n)
    s.close()
    return status, got


assert read(10) == (dp.ST_OK, b"z" * 8)
# the server closes its end of that connection when it sees ours go: then every descriptor is counted
deadline = time.monotonic() + 10
while any(t.name == "monarch_nb-dataplane" for t in threading.enumerate()):
    assert time.monotonic() < deadline, "the server still served a closed connection after 10 s"
    time.sleep(0.01)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 4, hard))
held = []
try:
    while True:
        held.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
except OSError:
    pass
# a reader connects while the server has no descriptor to accept it with
held.pop().close()
held.pop().close()
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
held.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
c.connect(srv.unix)
deadline = time.monotonic() + 5  # until the server's accept has met EMFILE (it logs and counts it)
while srv.refusals.count == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
for s in held:
    s.close()
c.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
assert srv.refusals.count, "the server's accept did not meet EMFILE within 5 s: nothing was tested"
print("after", read(10))
"""


def test_the_data_plane_serves_again_after_running_out_of_descriptors() -> None:
    """A process that ran out of descriptors for a moment (its own code, or connections a stranger
    holds open on the data plane's TCP port) still serves its buffers once it has room again.
    Its accept thread used to end at the first EMFILE: every later read of the process's
    RDMABuffers waited for its timeout."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _DATA_PLANE_AT_THE_LIMIT], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "after (0, b'zzzzzzzz')", r.stdout + r.stderr


_GATEWAY_AT_THE_LIMIT = """
import os, resource, secrets, socket, struct, time
from monarch_nb._runtime.gateway import GatewayClient, GatewayServer

KEY = secrets.token_bytes(32)
srv = GatewayServer(("127.0.0.1", 0), "127.0.0.1", KEY)
echo = socket.create_server(("127.0.0.1", 0))
port = echo.getsockname()[1]


def tunnel():
    return socket.create_connection(srv.addr[:2], timeout=10)


gw = GatewayClient(tunnel, KEY, ["127.0.0.1"], lambda: "")


opened = []  # kept open: a stream that closes frees descriptors in the gateway's threads, late


def socks():
    h, p = gw.proxy.rsplit(":", 1)
    s = socket.create_connection((h, int(p)), timeout=10)
    s.sendall(b"\\x05\\x01\\x02")
    s.recv(2)
    s.sendall(bytes([1, 16]) + gw.username.encode() + bytes([32]) + gw.password.encode())
    s.recv(2)
    s.sendall(b"\\x05\\x01\\x00\\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port))
    code = s.recv(10)[1]
    opened.extend([s, echo.accept()[0]])
    return code


assert socks() == 0
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 4, hard))
held = []
try:
    while True:
        held.append(socket.socket())
except OSError:
    pass
for _ in range(3):
    held.pop().close()
c1, c2 = socket.socket(), socket.socket()


def take_every_descriptor():
    try:
        while True:
            held.append(socket.socket())
    except OSError:
        pass


take_every_descriptor()
# the controller's SOCKS5 end and the gateway are each connected to with no descriptor to accept with
c1.connect(("127.0.0.1", int(gw.proxy.rsplit(":", 1)[1])))
c2.connect(srv.addr[:2])
deadline = time.monotonic() + 5  # until both accepts met EMFILE (each logs and counts it)
while not all(getattr(getattr(o, "refusals", None), "count", 0) for o in (gw, srv)) and time.monotonic() < deadline:
    take_every_descriptor()
    time.sleep(0.01)
for s in held + [c1, c2]:
    s.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
for o in (gw, srv):  # else the test below would pass without either accept having met EMFILE
    assert o.refusals.count, f"{type(o).__name__}'s accept did not meet EMFILE within 5 s"
print("socks", socks())
GatewayClient(tunnel, KEY, ["127.0.0.1"], lambda: "").close()
print("tunnels", srv.tunnels)
"""


def test_the_gateway_serves_again_after_running_out_of_descriptors() -> None:
    """The same for both ends of the gateway: the controller's SOCKS5 end (every connection zmq
    makes to the cluster goes through it) and the gateway's tunnel port. Their accept threads
    ended at the first EMFILE: the notebook never reached the cluster again."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _GATEWAY_AT_THE_LIMIT], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["socks", "0", "tunnels", "2"], r.stdout + r.stderr
