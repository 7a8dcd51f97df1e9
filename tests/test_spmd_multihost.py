"""An unchanged torchrun script under SPMDActor across two simulated hosts (network namespaces,
each with its host name in every host's /etc/hosts, as on a real cluster): the script's
all_reduce spans both hosts, and rank 0's rendezvous store listens on the cluster-facing
address its host name resolves to, not on every interface. setup_torch_elastic_env's default
address is that one, or loopback when the mesh is on one host."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from _netns import NetnsCluster
from test_multihost import KEY, Allocator, Controller, keyed_cluster, keys  # noqa: F401 - fixtures

pytestmark = pytest.mark.multihost

SCRIPT = """
import json, os, socket, sys
import psutil, torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.full((1,), float(dist.get_rank() + 1))
dist.all_reduce(t)
if dist.get_rank() == 0:
    port = int(os.environ["MASTER_PORT"])
    conns = psutil.Process(os.getpid()).net_connections("tcp")
    with socket.socket() as s:  # the same port at this host's loopback address
        s.settimeout(5)
        loopback_refused = s.connect_ex(("127.0.0.1", port)) != 0
    out = {
        "master": os.environ["MASTER_ADDR"],
        "listening": sorted(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port),
        "loopback_refused": loopback_refused,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.barrier()
with open(sys.argv[1] + str(dist.get_rank()), "w") as f:
    f.write(str(t.item()))
"""


@pytest.fixture
def cluster(keys: dict[str, bytes]) -> Iterator[NetnsCluster]:  # noqa: F811
    """Controller host 0 ("ctl") and worker hosts 1, 2 ("h1", "h2") holding the cluster key."""
    yield from keyed_cluster(keys, ["ctl", "h1", "h2"])


@pytest.mark.timeout(180)
def test_spmd_script_across_two_hosts_meets_at_a_store_on_the_cluster_address_alone(cluster: NetnsCluster) -> None:
    for i in (1, 2):
        Allocator(cluster, i, "--key-file", KEY).wait_ready()
    for i in (1, 2):
        cluster.path(i, "/tmp/train.py").write_text(SCRIPT)
    ctl = Controller(
        cluster,
        """
        from monarch_nb.spmd import SPMDActor
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None).get(timeout=30)
        emit("rendezvous", addr=addr)
        ok = spmd.main.call(addr, port, ["/tmp/train.py", "/tmp/out"]).get(timeout=120).values()
        emit("ran", ok=ok)
        from monarch_nb.spmd import setup_env_for_distributed

        class Master(Actor):
            @endpoint
            def addr(self):
                return os.environ["MASTER_ADDR"]

        setup_env_for_distributed(procs)
        emit("two hosts", addrs=procs.spawn("m", Master).addr.call().get(timeout=30).values())
        one = hosts.slice(hosts=1).spawn_procs(per_host={"gpus": 2}, name="one")
        setup_env_for_distributed(one)
        emit("one host", addrs=one.spawn("m", Master).addr.call().get(timeout=30).values())
        one.stop().get(timeout=30)
        procs.stop().get(timeout=30)
        emit("stopped")
        """,
    )
    assert ctl.expect("rendezvous", timeout=60)["addr"] == "h1"
    assert ctl.expect("ran", timeout=150)["ok"] == [True] * 4
    got = json.loads(cluster.path(1, "/tmp/out").read_text())
    assert got == {"master": "h1", "listening": [cluster.ip(1)], "loopback_refused": True}, got
    # (1+2+3+4) on every rank, two on each host
    sums = [cluster.path(h, f"/tmp/out{r}").read_text() for h, r in ((1, 0), (1, 1), (2, 2), (2, 3))]
    assert sums == ["10.0"] * 4
    # setup_torch_elastic_env's default: the address the other hosts reach rank 0's at (its
    # name's), and loopback when every proc is on one host, though a remote one
    assert ctl.expect("two hosts")["addrs"] == [cluster.ip(1)] * 4
    assert ctl.expect("one host")["addrs"] == ["127.0.0.1"] * 2
    ctl.expect("stopped")
    ctl.finish()
