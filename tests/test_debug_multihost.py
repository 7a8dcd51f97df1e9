"""The debugger across hosts: ranks on two simulated hosts stop at ``breakpoint()``; the
controller on a third lists, casts to and attaches them, and ``monarch-nb debug`` on the
controller's host reaches them with the cluster key. The actor is defined in the controller's
script, which the worker hosts cannot read (private /tmp): pdb's ``l`` shows its source anyway.
"""

from __future__ import annotations

import pytest
from test_multihost import KEY, PY, Controller, HostProc, NetnsCluster, cluster, host_env, keys, workers  # noqa: F401

pytestmark = pytest.mark.multihost


@pytest.mark.timeout(150)
def test_breakpoints_on_two_hosts(cluster: NetnsCluster, workers: list) -> None:  # noqa: F811
    ctl = Controller(
        cluster,
        """
        from monarch_nb import debug
        from monarch_nb.config import configure

        configure(debug_no_input="wait")  # this script has no TTY: leave the ranks to us

        class Bp(Actor):
            @endpoint
            def go(self):
                secret = current_rank().rank * 7
                breakpoint()
                return secret

        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        m = procs.spawn("bp", Bp)
        fut = m.go.call()
        deadline = time.monotonic() + 30
        while len(debug.sessions("bp")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        emit("sessions", rows=[dict(rank=s.rank, alloc=s.alloc, function=s.function, state=s.state) for s in debug.sessions("bp")])
        sys.stdin.readline()  # the test runs `monarch-nb debug` meanwhile
        emit("cast", out=debug.cast("bp", "*", "p secret"))
        c = debug.attach("bp", 1)
        emit("attached", header=c.header, listing=c.send("l", timeout=30), cont=c.send("c", timeout=30), ended=c.ended)
        emit("continued", out=debug.continue_all("bp"))
        emit("values", values=fut.get(timeout=30).values())
        procs.stop().get(timeout=30)
        """,
    )
    rows = ctl.expect("sessions", timeout=90)["rows"]
    assert [(r["rank"], r["function"], r["state"]) for r in rows] == [(0, "go", "paused"), (1, "go", "paused")]
    assert [r["alloc"] for r in rows] == [w.addr for w in workers]

    argv = [PY, "-m", "monarch_nb", "debug", "--key-file", KEY, "-c", "list", "-c", "cast bp ranks(0:2) p secret"]
    for w in workers:
        argv[4:4] = ["--addr", w.addr]
    cli = HostProc(cluster, 0, argv, host_env())
    assert cli.out.wait_eof(60), cli.describe()
    assert cli.popen.wait(10) == 0, cli.describe()
    text = cli.out.text()
    assert text.count(" paused") == 2, text
    assert "[0] 0" in text and "[1] 7" in text, text

    ctl.send("go\n")
    assert ctl.expect("cast")["out"] == {"0": "0\n", "1": "7\n"}
    att = ctl.expect("attached")
    assert "-> return secret" in att["header"]
    assert "breakpoint()" in att["listing"], att  # the source came from the controller's host
    assert att["ended"] is True
    assert ctl.expect("continued")["out"] == {"0": ""}
    assert ctl.expect("values")["values"] == [0, 7]
    ctl.finish()
