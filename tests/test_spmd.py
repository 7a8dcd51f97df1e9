"""An SPMD torch.distributed (gloo) program wrapped in an actor, as the seeds' Titan wrapper does."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from monarch_nb.actor import Actor, current_rank, endpoint, this_host
from monarch_nb.spmd import setup_env_for_distributed

pytestmark = pytest.mark.timeout(120)


class Trainer(Actor):
    def __init__(self) -> None:
        self.rank = current_rank().rank

    @endpoint
    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    @endpoint
    def train(self, steps: int) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            torch.manual_seed(0)
            w = torch.zeros(4)
            for _ in range(steps):
                grad = torch.full((4,), float(dist.get_rank() + 1))
                dist.all_reduce(grad)
                w -= 0.1 * grad / dist.get_world_size()
            return float(w.sum())
        finally:
            dist.destroy_process_group()


def listening(pid: int, port: int) -> list[str]:
    """The addresses process ``pid`` listens on at ``port``."""
    import psutil

    conns = psutil.Process(pid).net_connections("tcp")
    return sorted(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def refused_from_elsewhere(port: int) -> dict[str, bool]:
    """Whether a connection to ``port`` at another address of this host than 127.0.0.1 is
    refused, by address: 127.0.0.2 (loopback too, a host always has it) and the host's others."""
    import socket

    import psutil

    others = ["127.0.0.2"] + [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    out = {}
    for ip in others:
        with socket.socket() as s:
            s.settimeout(5)
            try:
                s.connect((ip, port))
            except ConnectionRefusedError:
                out[ip] = True
            else:
                out[ip] = False
    return out


class StoreProbe(Actor):
    @endpoint
    def store_while_the_group_lives(self) -> dict | None:
        """On rank 0: MASTER_ADDR, where this proc's rendezvous store listens and which other
        addresses refuse it, while the group made by an unchanged ``init_process_group()`` lives."""
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            out = None
            if dist.get_rank() == 0:
                port = int(os.environ["MASTER_PORT"])
                out = {
                    "addr": os.environ["MASTER_ADDR"],
                    "listening": listening(os.getpid(), port),
                    "refused": refused_from_elsewhere(port),
                    "sum": t.item(),
                }
            dist.barrier()
            return out
        finally:
            dist.destroy_process_group()


def test_the_rendezvous_store_listens_on_loopback_alone_on_one_host():
    """torch's env:// store listened on every interface (``::``), even with MASTER_ADDR on
    loopback: anyone reaching the port read and wrote the group's keys. On one host the
    rendezvous is 127.0.0.1 and the store listens there alone; each init_process_group gets a
    fresh store (a kept one made a second group's gloo read the first one's gone addresses)."""
    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="spmd_store")
    try:
        setup_env_for_distributed(procs)
        probe = procs.spawn("probe", StoreProbe)
        for _ in range(3):
            out = probe.store_while_the_group_lives.call().get(timeout=60).values()
            assert out[1:] == [None, None]
            got = out[0]
            assert got["addr"] == "127.0.0.1" and got["sum"] == 3.0, got
            assert got["listening"] == ["127.0.0.1"], got
            assert got["refused"] and all(got["refused"].values()), got
    finally:
        procs.stop().get(timeout=30)


def test_a_rendezvous_address_rank_0_s_host_does_not_have_says_what_to_give():
    """Rank 0 binds the address it is given: one of another host (or none) is refused at once
    with what to do, where torch's store listened anyway and the other ranks waited for it."""
    import datetime

    from monarch_nb.spmd import _rendezvous_store

    t = datetime.timedelta(seconds=5)
    with pytest.raises(ValueError, match=r"rank 0 cannot host the rendezvous at '203.0.113.7' .*address of rank 0's host"):
        _rendezvous_store("203.0.113.7", 29500, 0, 2, t)
    with pytest.raises(ValueError, match=r"'no-such-host.invalid' \(MASTER_ADDR\) does not resolve .* give master_addr"):
        _rendezvous_store("no-such-host.invalid", 29500, 0, 2, t)


def test_gloo_all_reduce_across_a_proc_mesh():
    from IPython.core.formatters import DisplayFormatter

    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="spmd")
    try:
        done = setup_env_for_distributed(procs)
        # a notebook cell ending in the call (no await) shows nothing, not "<..._Awaitable at 0x…>"
        assert DisplayFormatter().format(done) == ({}, {})
        trainers = procs.spawn("trainer", Trainer)
        envs = trainers.env.call().get(timeout=30).values()
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["WORLD_SIZE"] for e in envs} == {"4"}
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        losses = trainers.train.call(3).get(timeout=60).values()
        # mean gradient (1+2+3+4)/4 = 2.5 per element, 3 steps of lr 0.1 over 4 elements
        assert losses == pytest.approx([-3.0] * 4)
    finally:
        procs.stop().get(timeout=30)


def test_setup_torch_elastic_env_with_an_explicit_master_address_and_port():
    """The address and port a user gives are where the ranks meet (every other test takes the
    defaults: docs/tensors.md listed this as not exercised by a rendezvous)."""
    import socket

    from monarch_nb.spmd import setup_torch_elastic_env

    with socket.socket() as s:  # a port free now; the rendezvous binds it at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = this_host().spawn_procs(per_host={"gpus": 3})
    try:
        setup_torch_elastic_env(procs, "127.0.0.1", port)
        trainers = procs.spawn("trainer", Trainer)
        envs = trainers.env.call().get(timeout=30).values()
        assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", str(port))}
        assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
        # mean gradient (1+2+3)/3 = 2 per element, 2 steps of lr 0.1 over 4 elements
        assert trainers.train.call(2).get(timeout=60).values() == pytest.approx([-1.6] * 3)
    finally:
        procs.stop().get(timeout=30)


class Torchrun(Actor):
    @endpoint
    def env(self) -> tuple[str, ...]:
        return tuple(os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"))


def test_torchruns_local_dimension_is_gpus_and_never_one_that_counts_hosts():
    """The local dimension is ``gpus`` (the devices the allocator shares out by its coordinate);
    one proc on each of two hosts (a ``gpus`` slice) is two nodes of one local rank each.
    Monarch 0.7.0 takes the last dimension whatever it counts: the same on ``replicas x gpus``
    (program ``spmd_actor``), two local ranks of one node on the slice (docs/monarch-compat.md, 14)."""
    from monarch_nb.spmd import setup_torch_elastic_env

    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="spmd-slice")
    grid = this_host().spawn_procs(per_host={"replicas": 2, "gpus": 2}, name="spmd-grid")
    try:
        part = procs.slice(gpus=1)
        setup_torch_elastic_env(part)
        got = part.spawn("env", Torchrun).env.call().get(timeout=30).values()
        assert got == [("0", "0", "1", "0", "2"), ("1", "0", "1", "1", "2")]
        setup_torch_elastic_env(grid)
        got = grid.spawn("env", Torchrun).env.call().get(timeout=30).values()
        # rank, the gpus coordinate of 2, the replica of 2
        assert got == [(str(r), str(r % 2), "2", str(r // 2), "2") for r in range(4)]
    finally:
        procs.stop().get(timeout=30)
        grid.stop().get(timeout=30)


class Devices(Actor):
    @endpoint
    def visible(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("given", "expected"), [(None, ["0", "1", "2", "3"]), ("1, 3", ["1", "3", "1", "3"])])
def test_gpus_coordinate_maps_to_cuda_visible_devices_on_a_gpu_host(tmp_path, given, expected):
    """The allocator counts a host's GPUs in /proc/driver/nvidia/gpus; this machine has none, so
    the allocator runs in a mount namespace of its own where that directory lists four. With
    ``CUDA_VISIBLE_DEVICES`` already set where it runs (a Slurm job given some of a node's
    GPUs), the procs share out those devices, not the host's first ones."""
    import subprocess
    import sys

    from conftest import wait_for

    from monarch_nb._runtime.records import read_connection_files
    from monarch_nb.actor import attach_to_workers
    from monarch_nb.spmd import SPMDActor, _free_port

    assert os.geteuid() == 0, "needs root for a private mount namespace"
    rdir = str(tmp_path / "rt")
    os.mkdir(rdir, 0o700)
    boot = (
        "mount -t tmpfs tmpfs /proc/driver && mkdir -p /proc/driver/nvidia/gpus/0000:0{0,1,2,3}:00.0 && "
        'exec "$0" -m monarch_nb allocator'
    )
    env = dict(os.environ, MONARCH_NB_RUNTIME_DIR=rdir, MONARCH_NB_ZYGOTE_PRELOAD="")
    if given is not None:
        env["CUDA_VISIBLE_DEVICES"] = given
    with open(tmp_path / "allocator.log", "wb") as log:
        daemon = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", boot, sys.executable], env=env, stdout=log, stderr=log
        )
    try:
        info = wait_for(lambda: next(iter(read_connection_files(rdir)), None), 30, "the allocator's connection file")
        hosts = attach_to_workers(workers=[info["addr"]], ca="trust_all_connections")
        procs = hosts.spawn_procs(per_host={"replicas": 2, "gpus": 4}, name="gpu-map")
        cpu = hosts.spawn_procs(per_host={"workers": 2}, name="no-gpus")
        try:
            seen = procs.spawn("dev", Devices).visible.call().get(timeout=30)
            assert [seen.item(hosts=0, replicas=r, gpus=g) for r in range(2) for g in range(4)] == expected * 2
            # a torchrun script's torch.cuda.set_device(LOCAL_RANK) picks, out of the devices its
            # run makes visible, the same one the allocator gave its proc (as under torchrun, which
            # shows every local rank all of them)
            shared = sorted(set(expected))
            per_host = hosts.spawn_procs(per_host={"gpus": len(shared)}, name="torchrun")
            try:
                own = per_host.spawn("dev", Devices).visible.call().get(timeout=30).values()
                assert own == shared
                script = tmp_path / "train.py"
                script.write_text(
                    "import os, sys\n"
                    "devices = os.environ['CUDA_VISIBLE_DEVICES'].split(',')\n"
                    "picked = devices[int(os.environ['LOCAL_RANK'])]  # torch.cuda.set_device(LOCAL_RANK)\n"
                    "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(picked)\n"
                )
                out = tmp_path / "picked"
                out.mkdir()
                spmd = per_host.spawn("spmd", SPMDActor)
                spmd.main.call("127.0.0.1", _free_port(), [str(script), str(out)]).get(timeout=60)
                assert [(out / f"rank{r}").read_text() for r in range(len(shared))] == own
                assert set(per_host.spawn("dev2", Devices).visible.call().get(timeout=30).values()) == {",".join(shared)}
            finally:
                per_host.stop().get(timeout=30)
            # a mesh without a gpus dimension leaves the variable as it was where the procs start
            mine = given if given is not None else os.environ.get("CUDA_VISIBLE_DEVICES", "")
            assert cpu.spawn("dev", Devices).visible.call().get(timeout=30).values() == [mine, mine]
        finally:
            procs.stop().get(timeout=30)
            cpu.stop().get(timeout=30)
    finally:
        daemon.terminate()
        daemon.wait(30)
    assert not os.listdir("/proc/driver"), "the fake GPUs leaked out of the allocator's mount namespace"


def test_spmd_actor_runs_a_script_that_exits_as_torchrun_scripts_do(tmp_path):
    """``sys.exit(0)`` at a script's end is success (torchrun's too); another code fails the actor,
    as a SystemExit in any endpoint does. (Programs `spmd_actor` compares the rest with Monarch.)"""
    from monarch_nb.errors import SupervisionError
    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(os.environ['LOCAL_RANK'])\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="spmd_exit")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        addr, port = spmd.slice(hosts=0, gpus=0).get_host_port.call_one(None).get(timeout=30)
        assert spmd.main.call(addr, port, [str(script), str(tmp_path), "0"]).get(timeout=60).values() == [True] * 4
        assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["0", "1", "0", "1"]
        # a slice's call still runs with the ranks of the whole mesh
        again = tmp_path / "again"
        again.mkdir()
        spmd.slice(hosts=1, gpus=1).main.call_one(addr, port, [str(script), str(again), "3"]).get(timeout=60)
    except SupervisionError as e:
        assert "SystemExit: 3" in str(e), e
        assert [p.name for p in again.iterdir()] == ["rank3"] and (again / "rank3").read_text() == "1"
    else:
        raise AssertionError("sys.exit(3) did not fail the actor")
    finally:
        procs.stop().get(timeout=30)


def test_a_mesh_exec_cell_that_raises_on_one_rank_fails_while_the_others_wait_in_all_reduce():
    """A researcher's cell: rank 2 raises, the other ranks wait for it in a gloo all_reduce (for
    the process group's 30 minutes). The cell fails at once, naming the failing rank and the ranks
    still running, and the mesh can be stopped and set up again."""
    from monarch_nb.errors import ExecError
    from monarch_nb.mesh import exec_cell

    init = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\ndist.get_rank()"
    step = "if dist.get_rank() == 2:\n    raise RuntimeError('NaN loss')\nt = torch.ones(3)\ndist.all_reduce(t)\n"
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="spmd_exec")
    try:
        setup_env_for_distributed(procs)
        assert exec_cell(procs, init, timeout=60).values() == [0, 1, 2, 3]
        with pytest.raises(ExecError) as info:
            exec_cell(procs, step, timeout=30)
        text = str(info.value)
        assert "the cell failed on 1 of 4 ranks of mesh 'spmd_exec'" in text, text
        assert "RuntimeError on 1 of 4 ranks: 2" in text, text
        assert "ranks 0-1,3 (3 of 4) were still running when this was raised" in text, text
        assert "%mesh stop spmd_exec ends them" in text and "RuntimeError: NaN loss" in text, text
        assert info.value.running == [0, 1, 3] and list(info.value.failures) == [2]
        assert "if they wait for rank 2 in a collective, destroying the process group frees them" in text, text
    finally:
        procs.stop().get(timeout=30)
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="spmd_exec2")
    try:
        setup_env_for_distributed(procs)
        assert exec_cell(procs, init, timeout=60).values() == [0, 1, 2, 3]
        # a subset of ranks: how many still run (the others were not called)
        with pytest.raises(ExecError) as info:
            exec_cell(
                procs, "if dist.get_rank() == 1:\n    raise KeyError('x')\nimport time\ntime.sleep(30)", ranks="0:2", timeout=30
            )
        assert "KeyError on 1 of 2 ranks: 1" in str(info.value) and info.value.running == 1, str(info.value)
        # the advice runs on the cell's ranks, not the mesh's (the others are in no collective with it)
        assert "in %%mesh exec spmd_exec2 --ranks 0-1 (every rank: rank 1 runs it at once" in str(info.value), str(info.value)
        from monarch_nb.actor import ProcsKilledWarning

        # rank 0 is still in its 30 s sleep: stop() kills it after stop_cleanup_timeout, and says so
        with pytest.warns(ProcsKilledWarning, match=r"killed 1 proc\(s\): rank 0 \(pid"):
            procs.stop().get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


def test_a_mesh_exec_cell_s_advice_frees_the_rank_waiting_for_the_failed_one_and_keeps_its_state():
    """Rank 1 raises while rank 0 waits for it in an all_reduce. The error said only that
    stopping the mesh ends rank 0, losing every proc's state (the model); it now says how to free
    it instead, and the advice works: a DDP model kept the destroyed group alive through torch's
    own default arguments (torch.distributed.nn.functional's ``group=group.WORLD``), so rank 0
    stayed blocked even after ``del model`` and ``dist.destroy_process_group()`` on rank 1."""
    from monarch_nb.errors import ExecError
    from monarch_nb.mesh import CellEndedWarning, exec_cell

    init = (
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\ndist.get_rank()"
    )
    step = "t = torch.ones(3)\nif dist.get_rank() == 1:\n    raise RuntimeError('NaN loss')\ndist.all_reduce(t)\n"
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_exec_free")
    try:
        setup_env_for_distributed(procs)
        assert exec_cell(procs, init, timeout=60).values() == [0, 1]
        with pytest.raises(ExecError) as info:
            exec_cell(procs, step, timeout=30)
        text = str(info.value)
        assert "rank 0 (1 of 2) was still running when this was raised" in text, text
        advice = (
            "if they wait for rank 1 in a collective, destroying the process group frees them and keeps every proc's "
            "other state: in %%mesh exec spmd_exec_free (every rank: rank 1 runs it at once and frees the ranks "
            "waiting for it, they those waiting for them), drop what holds the group (a DDP model: model = "
            "model.module keeps the module and its weights; a DeviceMesh, a new_group(): del it), then "
            "dist.destroy_process_group()"
        )
        assert advice in text, text
        with pytest.warns(CellEndedWarning, match="rank 0 .* then raised RuntimeError: .*Connection closed by peer"):
            exec_cell(procs, "del model\ndist.destroy_process_group()", ranks="1", timeout=30)
        # rank 0's all_reduce failed, so it takes this cell; what both defined is still there
        assert exec_cell(procs, "dist.is_initialized(), type(t).__name__", timeout=20).values() == [
            (True, "Tensor"),
            (False, "Tensor"),
        ]
    finally:
        procs.stop().get(timeout=30)


_DDP_INIT = (
    "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
    "dist.init_process_group('gloo')\ntorch.manual_seed(dist.get_rank())\nmodel = DDP(torch.nn.Linear(2, 2))\n"
    "steps = 0\ndef step():\n    global steps\n    model(torch.ones(1, 2)).sum().backward()\n    steps += 1\n"
    "step()\ndist.get_rank()"
)
#: the DDP step that fails on rank 1, the others waiting for it in the gradients' all_reduce
_DDP_FAIL = "if dist.get_rank() == 1:\n    raise RuntimeError('NaN loss')\nstep()"
#: what the error's advice says to run to free them
_FREE = "model = model.module\ndist.destroy_process_group()"


def test_a_ddp_step_failing_on_one_rank_in_mesh_exec_tells_what_the_freed_rank_raised_and_regroups_as_advised():
    """Rank 1 raises in a DDP step while rank 0 waits for it in the gradients' all_reduce. Once
    the advice freed rank 0, what its collective raised ("Connection closed by peer") came back
    to no one, and its process group stayed initialized but broken, with no word on how to set
    one up again. Now the cell that frees it says how the failed cell ended there, after the
    failed rank's own error, and the advice to set the group up again works on the same procs,
    their state kept."""
    import warnings

    from monarch_nb.errors import ExecError
    from monarch_nb.mesh import CellEndedWarning, exec_cell
    from monarch_nb.spmd import setup_torch_elastic_env

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_regroup")
    try:
        setup_torch_elastic_env(procs)
        assert exec_cell(procs, _DDP_INIT, timeout=60, label="In[1]").values() == [0, 1]
        with pytest.raises(ExecError) as info:
            exec_cell(procs, _DDP_FAIL, timeout=30, label="In[2]")
        regroup = (
            "to use a process group again after: monarch_nb.spmd.setup_torch_elastic_env(spmd_regroup) (a new "
            "rendezvous), then on every rank dist.init_process_group() and model = DDP(model)"
        )
        assert "in %%mesh exec spmd_regroup (every rank: " in str(info.value) and regroup in str(info.value), str(info.value)
        # the advice, on every rank: rank 1 frees rank 0, whose collective fails, and this cell says so
        with pytest.warns(CellEndedWarning) as told:
            assert exec_cell(procs, _FREE + "\ndist.is_initialized(), steps", timeout=30).values() == [(False, 1)] * 2
        lines = str(told[0].message).splitlines()
        assert lines[:2] == [
            "cell In[2] on mesh 'spmd_regroup' has now ended on the other ranks:",
            "  rank 1 (1 of 2) raised RuntimeError: NaN loss (the cell's error)",
        ], lines
        assert re.match(r"  rank 0 \(1 of 2\) then raised RuntimeError: .*Connection closed by peer", lines[2]), lines
        assert len(lines) == 3, lines
        # said once: the next cell has nothing to add
        with warnings.catch_warnings():
            warnings.simplefilter("error", CellEndedWarning)
            assert exec_cell(procs, "type(model).__name__", timeout=20).values() == ["Linear"] * 2
        setup_torch_elastic_env(procs)
        again = "dist.init_process_group()\nmodel = DDP(model)\nstep()\nsteps, [p.grad.sum().item() for p in model.parameters()]"
        got = exec_cell(procs, again, timeout=60).values()
        # the state kept: each rank's step count, and its gradients summed over both steps
        assert got[0] == got[1] and got[0][0] == 2, got
        # DDP broadcast rank 0's weights: both ranks hold the same model again
        same = "w = model.module.weight.detach().clone()\ndist.all_reduce(w)\n(w / 2 - model.module.weight).abs().max().item()"
        assert exec_cell(procs, same, timeout=30).values() == [0.0, 0.0]
    finally:
        procs.stop().get(timeout=30)


def test_freeing_only_the_failed_rank_of_four_says_which_still_wait_and_for_whom():
    """gloo on 4 ranks: destroying the failed rank 1's group frees the two ranks it exchanges with,
    whose groups stay open, so the fourth waits on for them. The advice said to run the cell on
    rank 1 alone, and that rank stayed blocked for the group's 30 minutes; it now says every rank
    (each freed rank frees the next), and a cell on rank 1 alone says which rank still waits and
    what frees it."""
    from monarch_nb.errors import ExecError
    from monarch_nb.mesh import CellEndedWarning, exec_cell
    from monarch_nb.spmd import setup_torch_elastic_env

    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="spmd_ring")
    try:
        setup_torch_elastic_env(procs)
        assert exec_cell(procs, _DDP_INIT, timeout=60).values() == [0, 1, 2, 3]
        with pytest.raises(ExecError, match=r"in %%mesh exec spmd_ring \(every rank: rank 1 runs it at once"):
            exec_cell(procs, _DDP_FAIL, timeout=30, label="In[2]")
        with pytest.warns(CellEndedWarning) as told:
            exec_cell(procs, _FREE, ranks="1", timeout=30)
        lines = str(told[0].message).splitlines()
        assert lines[0] == "cell In[2] on mesh 'spmd_ring' has now ended on some of the other ranks:"
        # which two ranks are rank 1's neighbours is gloo's choice (the ring's order, the algorithm)
        freed = re.match(r"  ranks (\d),(\d) \(2 of 4\) then raised RuntimeError: .*Connection closed by peer", lines[2])
        assert freed and len(lines) == 4, lines
        a, b = freed.groups()
        (last,) = {"0", "2", "3"} - {a, b}
        assert lines[3] == (
            f"  rank {last} (1 of 4) still runs it: waiting, perhaps, for ranks {a},{b} in a collective, whose process "
            f"group is broken there but open: dropping it on ranks {a},{b} (model = model.module, "
            "dist.destroy_process_group()) frees it"
        ), lines
        with pytest.warns(CellEndedWarning, match=rf"\n  rank {last} \(1 of 4\) then raised RuntimeError: .*Connection closed"):
            exec_cell(procs, _FREE, ranks=f"{a},{b}", timeout=30)
        exec_cell(procs, _FREE, ranks=last, timeout=30)
        setup_torch_elastic_env(procs)
        # a working group again on the same procs, each rank's step count kept
        again = exec_cell(procs, "dist.init_process_group()\nmodel = DDP(model)\nstep()\nsteps", timeout=60)
        assert again.values() == [2] * 4
    finally:
        procs.stop().get(timeout=30)


def test_a_rank_dying_in_a_ddp_step_says_what_the_live_ranks_collective_raised():
    """Rank 1's process dies in a DDP step: its connections close, and rank 0's all_reduce fails
    with gloo's "Connection reset by peer". That error came back to no one: most often it
    arrived before the death was known, and the cell's error, rebuilt in the cell's words, lost
    the note that named it (which read "raised monarch_nb._exec.CellFailed: ('RuntimeError',
    …)"); else rank 0 was still running, and the cell failed without waiting for it."""
    import warnings

    from monarch_nb.errors import SupervisionError
    from monarch_nb.mesh import CellEndedWarning, exec_cell
    from monarch_nb.spmd import setup_torch_elastic_env

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_ddp_dies")
    try:
        setup_torch_elastic_env(procs)
        assert exec_cell(procs, _DDP_INIT, timeout=60).values() == [0, 1]
        with pytest.raises(SupervisionError, match="the process of rank 1 died") as info:
            exec_cell(procs, "import os\nif dist.get_rank() == 1:\n    os._exit(1)\nstep()", timeout=30, label="In[2]")
        (note,) = info.value.__notes__
        lines = note.splitlines()
        assert lines[0] == "cell In[2] on mesh 'spmd_ddp_dies' has now ended on the other ranks:", lines
        assert re.match(r"  rank 1 \(1 of 2\)'s process died \(host .*\): process \d+ exited with code 1$", lines[1]), lines
        assert re.match(r"  rank 0 \(1 of 2\) then raised RuntimeError: .*Connection (reset|closed) by peer", lines[2]), lines
        assert len(lines) == 3 and "CellFailed" not in note, lines
        # told once: the cell on the live ranks the error points to has nothing to add
        with warnings.catch_warnings():
            warnings.simplefilter("error", CellEndedWarning)
            assert exec_cell(procs, "steps", ranks="0", timeout=30).values() == [1]
    finally:
        procs.stop().get(timeout=30)


def test_mesh_exec_on_a_mesh_spawned_again_under_the_name_of_one_stopped_by_its_stop():
    from monarch_nb.mesh import exec_cell

    for _ in range(2):
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_again")
        try:
            assert exec_cell(procs, "import os\nos.getpid()", timeout=60).values() == [p.pid for p in procs._procs]
        finally:
            procs.stop().get(timeout=30)


def test_a_mesh_exec_cell_whose_rank_dies_names_it_and_the_ranks_left_waiting_in_the_collective():
    """A rank's process dies in the cell (os._exit, as the OOM killer or a segfault would end it)
    while the others wait for it in a store barrier, which no process group timeout ends. The
    cell fails at once in the cell's words (not those of the hidden exec actor), naming the dead
    rank and the ranks left waiting; stop() ends them and the name can be set up again."""
    from monarch_nb.actor import ProcsKilledWarning
    from monarch_nb.errors import SupervisionError
    from monarch_nb.mesh import exec_cell

    init = "import os, torch, torch.distributed as dist\ndist.init_process_group('gloo')\ndist.get_rank()"
    step = (
        "t = torch.ones(3)\ndist.all_reduce(t)\nif dist.get_rank() == 2:\n    os._exit(1)\n"
        "dist.distributed_c10d._get_default_store().wait(['never'])\n"
    )
    for again in range(2):
        procs = this_host().spawn_procs(per_host={"gpus": 4}, name="spmd_die")
        try:
            setup_env_for_distributed(procs)
            assert exec_cell(procs, init, timeout=60).values() == [0, 1, 2, 3]
            if again:
                break
            with pytest.raises(SupervisionError) as info:
                exec_cell(procs, step, timeout=30)
            text = str(info.value)
            assert text.startswith("the cell failed on mesh 'spmd_die': the process of rank 2 died (host "), text
            assert "process " in text and "exited with code 1" in text, text
            assert "ranks 0-1,3 (3 of 4) were still running when this was raised" in text, text
            assert "%mesh stop spmd_die ends them" in text and "__mnb_exec__" not in text, text
            assert info.value.rank == 2 and info.value.mesh == "spmd_die"
            with pytest.warns(ProcsKilledWarning, match=r"killed 3 proc\(s\): ranks 0-1,3 \(pids"):
                procs.stop().get(timeout=30)
        finally:
            procs.stop().get(timeout=30)


def test_a_mesh_exec_cell_after_a_rank_died_says_it_died_before_and_how_to_go_on():
    """The cell after the one in which a rank died fails with that same death: it says the rank
    had died before it ran (not that this cell killed it) and how to run on the live ranks."""
    from monarch_nb.errors import SupervisionError
    from monarch_nb.mesh import exec_cell

    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="exec_dead")
    try:
        kill = "import os, signal\nfrom monarch_nb.actor import current_rank\nif current_rank().rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)"
        with pytest.raises(SupervisionError) as first:
            exec_cell(procs, kill, timeout=30)
        assert str(first.value).startswith("the cell failed on mesh 'exec_dead': the process of rank 1 died ("), first.value
        assert "before it ran" not in str(first.value) and "--ranks" not in str(first.value)
        with pytest.raises(SupervisionError) as later:
            exec_cell(procs, "1", timeout=30)
        text = str(later.value)
        assert text.startswith("the cell failed on mesh 'exec_dead': the process of rank 1 had died before it ran ("), text
        assert "was killed by SIGKILL" in text, text
        assert "%%mesh exec exec_dead --ranks 0,2 runs one on the live ranks; %mesh stop exec_dead ends the mesh" in text, text
        # and the advice works
        assert exec_cell(procs, "2", ranks="0,2", timeout=30).values() == [2, 2]
    finally:
        procs.stop().get(timeout=30)


def test_an_exception_class_a_mesh_exec_cell_defines_reads_as_a_notebook_cell_s():
    # "__mnb_exec__.ShardError: bad shard 0" was the last line of the grouped traceback
    from monarch_nb.errors import ExecError
    from monarch_nb.mesh import exec_cell

    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="exec_cls")
    try:
        cell = "from monarch_nb.actor import current_rank\nclass ShardError(Exception):\n    pass\nraise ShardError(f'bad shard {current_rank().rank}')"
        with pytest.raises(ExecError) as info:
            exec_cell(procs, cell, timeout=30)
        text = str(info.value)
        assert "ShardError on 2 of 2 ranks: 0-1" in text, text
        assert "\nShardError: bad shard 0\n" in text and "__mnb_exec__" not in text, text
    finally:
        procs.stop().get(timeout=30)


class Stuck(Actor):
    @endpoint
    def init(self) -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank()

    @endpoint
    def total(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.ones(2)
        dist.all_reduce(t)
        return float(t.sum())

    @endpoint
    def step(self) -> None:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(2))
        if dist.get_rank() == 2:
            os._exit(1)
        # a barrier no process group timeout ends: the survivors wait for rank 2 for good
        dist.distributed_c10d._get_default_store().wait(["never"])


def test_stopping_an_actor_mesh_whose_ranks_wait_for_a_dead_one_in_a_collective_returns_and_says_so():
    """Rank 2 dies while the other ranks wait for it: the call fails at once, naming the ranks
    left waiting. The actor mesh's stop() cannot end their
    calls (a thread blocked in C), and waited for them for good; now it returns after
    stop_cleanup_timeout with Monarch's error for the dead rank and a warning naming the ranks left running,
    and the proc mesh's stop() ends them. The same name is then set up and runs again; a call
    that hangs there (no rank died) times out saying how many ranks replied."""
    import time

    from monarch_nb.errors import SupervisionError

    for again in range(2):
        procs = this_host().spawn_procs(per_host={"gpus": 4}, name="spmd_stuck")
        try:
            setup_env_for_distributed(procs)
            stuck = procs.spawn("stuck", Stuck)
            assert stuck.init.call().get(timeout=60).values() == [0, 1, 2, 3]
            if again:
                assert stuck.total.call().get(timeout=60).values() == [8.0] * 4
                # three ranks enter an all_reduce the fourth never joins: the timeout says none
                # of them replied, and where to look
                with pytest.raises(TimeoutError) as hung:
                    stuck.slice(gpus=slice(0, 3)).total.call().get(timeout=1)
                assert str(hung.value).startswith("stuck.total.call() not ready after 1 s: 0 of 3 ranks replied, 3 still running")
                assert "monarch_nb.debug.stacks(mesh)" in str(hung.value), hung.value
                break
            with pytest.raises(SupervisionError, match="rank 2") as info:
                stuck.step.call().get(timeout=30)
            # the ranks left waiting are named, in a script's traceback and a notebook's alike
            running = "ranks 0-1,3 (3 of 4) were still running when this was raised (waiting for the dead rank"
            assert any(n.startswith(running) for n in info.value.__notes__), info.value.__notes__
            assert any(line.startswith(running) for line in info.value._render_traceback_())
            start = time.monotonic()
            with pytest.warns(RuntimeWarning, match=r"actors on ranks 0-1,3 had not finished the message in hand"):
                # Monarch's error for a mesh with a dead proc, its words then ours
                with pytest.raises(ValueError, match=r"(?s)^error stopping actor mesh: statuses: Running=0..2,3..4;Failed") as e:
                    stuck.stop().get(timeout=30)
                assert re.search(r"rank 2: process \d+ exited with code 1\)=2..3$", str(e.value)), e.value
            assert time.monotonic() - start < 10
        finally:
            procs.stop().get(timeout=30)


def test_a_named_mesh_whose_rank_died_is_spawned_again_as_soon_as_the_call_fails():
    """A script's retry loop: the call fails on a dead rank and the mesh is spawned again under
    its name at once. The mesh is marked failed only once the failure's report (the fault hook,
    held here) has run; the respawn did not wait for that and said "already running"."""
    import threading

    import monarch_nb.actor as api
    from monarch_nb.errors import SupervisionError
    from monarch_nb.mesh import exec_cell, spawn

    gate = threading.Event()
    api.unhandled_fault_hook = lambda failure: gate.wait(30)
    pm = spawn("spmd_redo", {"gpus": 2})
    try:
        with pytest.raises(SupervisionError, match="the process of rank 1 died"):
            exec_cell(pm, "import os\nos._exit(1)", ranks="1", timeout=30)
        pm = spawn("spmd_redo", {"gpus": 2})
        gate.set()
        assert exec_cell(pm, "import os\nos.getpid()", timeout=30).values() == [p.pid for p in pm._procs]
    finally:
        gate.set()
        pm.stop().get(timeout=30)


def test_spmd_actor_runs_a_script_again_after_it_failed_as_torchrun_would(tmp_path):
    """torchrun runs a script in a fresh process, with its folder on sys.path; SPMDActor's procs
    outlive it. A script that imports a module next to it ran into ModuleNotFoundError, and one
    that failed (or never destroyed its process group) could not run again on the same mesh:
    "trying to initialize the default process group twice!". A number in the command line reached
    the script as an int, and a bare string ran "/" (its first character) as the script. An edit to
    the module next to the script did not reach its next run, as it would under torchrun."""
    from monarch_nb.actor import ActorError
    from monarch_nb.spmd import SPMDActor

    (tmp_path / "model.py").write_text("SCALE = 10.0\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from model import SCALE\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.full((1,), SCALE * float(sys.argv[3].strip()))\n"
        "dist.all_reduce(t)\n"
        "if sys.argv[1] == 'fail':\n"
        "    raise RuntimeError('diverged at step 1')\n"
        "open(sys.argv[2] + str(dist.get_rank()), 'w').write(str(t.item()))\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_rerun")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        for mode in ("fail", "ok", "ok"):
            if mode == "ok":
                # an edit to the module next to the script is what its next run imports
                (tmp_path / "model.py").write_text("SCALE = 20.0\n")
            addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get(timeout=30)
            args = [str(script), mode, str(tmp_path / f"{mode}-"), 2]
            if mode == "fail":
                with pytest.raises(ActorError, match="diverged at step 1"):
                    spmd.main.call(addr, port, args).get(timeout=60)
            else:
                assert spmd.main.call(addr, port, args).get(timeout=60).values() == [True, True]
        assert [(tmp_path / f"ok-{r}").read_text() for r in range(2)] == ["80.0", "80.0"]
        with pytest.raises(ActorError, match=r"script_args is a list of command-line words, not str 'train.py'"):
            spmd.main.call(addr, port, "train.py").get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


def test_spmd_script_s_rendezvous_store_listens_only_on_the_address_it_was_given(tmp_path):
    """An unchanged torchrun script under SPMDActor.main: rank 0's store listens on the
    address get_host_port gave (the host name's) alone, not on every interface, run after run."""
    import json
    import socket

    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    script.write_text(
        inspect.getsource(listening)
        + inspect.getsource(refused_from_elsewhere)
        + "import json, os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "if dist.get_rank() == 0:\n"
        "    port = int(os.environ['MASTER_PORT'])\n"
        "    out = {'listening': listening(os.getpid(), port), 'refused': refused_from_elsewhere(port), 'sum': t.item()}\n"
        "    open(sys.argv[1], 'w').write(json.dumps(out))\n"
        "dist.barrier()\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_store_main")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get(timeout=30)
        ip = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]
        for run in range(2):
            out = tmp_path / f"out{run}"
            assert spmd.main.call(addr, port, [str(script), str(out)]).get(timeout=60).values() == [True, True]
            got = json.loads(out.read_text())
            assert got["sum"] == 2.0 and got["listening"] == [ip], (ip, got)
            assert all(v for k, v in got["refused"].items() if k != ip), got
    finally:
        procs.stop().get(timeout=30)


def _run(spmd, script, *args):
    """One run of ``script`` by the SPMDActor mesh ``spmd``, with rank 0 of its first slice as the
    rendezvous, as torchrun's ``--rdzv-endpoint``."""
    addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get(timeout=30)
    return spmd.main.call(addr, port, [str(script), *args]).get(timeout=60)


def test_spmd_script_failing_on_one_rank_shows_that_rank_s_error_not_the_survivors_closed_connection(tmp_path):
    """Rank 1's script raises while ranks 0 and 2 wait for it in an all_reduce: its process group,
    destroyed as the script ends, closes its connections, and the others fail at once with gloo's
    "Connection closed by peer". The error raised was rank 0's (the lowest), so the cause stood
    one group below; now the rank whose own script failed is the one raised and shown first."""
    from monarch_nb.actor import ActorError
    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(2)\n"
        "dist.all_reduce(t)\n"
        "if dist.get_rank() == 1:\n"
        "    raise RuntimeError('diverged at step 1')\n"
        "dist.all_reduce(t)\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="spmd_cause")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        with pytest.raises(ActorError) as info:
            _run(spmd, script)
        text = str(info.value)
        assert "the traceback below is rank 1's" in text and text.rstrip().endswith("RuntimeError: diverged at step 1"), text
        grouped = info.value.grouped_text()
        assert grouped.index("--- rank 1: RuntimeError") < grouped.index("--- ranks 0,2: RuntimeError"), grouped
        # the notebook: rank 1's traceback, one line for the ranks that waited for it
        shown = "\n".join(info.value._render_traceback_())
        waited = "ranks 0,2 (2 of 3): RuntimeError: [gloo] Connection closed by peer … (waiting for rank 1 in a collective)"
        assert waited in shown and waited in text and "pair.cc" not in shown, shown
        assert "another rank's script failed first" in grouped, grouped
        # the survivors are free: the mesh runs the script again at once
        script.write_text(script.read_text().replace("get_rank() == 1", "get_rank() == 9"))
        assert _run(spmd, script).values() == [True] * 3
    finally:
        procs.stop().get(timeout=30)


def test_spmd_script_whose_device_mesh_holds_the_group_frees_the_ranks_waiting_for_it_when_it_fails(tmp_path):
    """A DeviceMesh (FSDP2's, DTensor's) in the failed script's globals, kept by its traceback,
    held the gloo group, so destroying it closed nothing: ranks 0 and 2 stayed in their
    all_reduce until the proc mesh stopped, and the mesh took no other call. Now they fail at
    once and the mesh runs again."""
    from monarch_nb.actor import ActorError
    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (3,), mesh_dim_names=('dp',))\n"
        "for step in range(2):\n"
        "    dist.all_reduce(torch.ones(2), group=mesh.get_group('dp'))\n"
        "    if sys.argv[1] == 'fail' and dist.get_rank() == 1:\n"
        "        raise RuntimeError('diverged at step 0')\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="spmd_dmesh")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        with pytest.raises(ActorError, match="diverged at step 0"):
            _run(spmd, script, "fail")
        # rank 0 takes the next call: it is out of its all_reduce
        assert _run(spmd, script, "ok").values() == [True] * 3
    finally:
        procs.stop().get(timeout=30)


def test_spmd_script_with_a_ddp_model_frees_the_rank_waiting_for_it_when_it_fails(tmp_path):
    """DDP's constructor imports torch.distributed.nn, whose collectives read ``group.WORLD``
    into their default arguments then: they kept the script's gloo group after it was destroyed,
    and so did the locals of main() in the failed script's traceback, so rank 0, waiting for the
    failed rank 1 in an all_reduce, stayed there until the proc mesh stopped, and the mesh took
    no other call. Now it fails at once and the mesh runs the script again."""
    from monarch_nb.actor import ActorError
    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    # the shape of most training scripts: the model is a local of main(), which the failed
    # script's traceback kept as well
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "def main():\n"
        "    dist.init_process_group('gloo')\n"
        "    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    if sys.argv[1] == 'fail' and dist.get_rank() == 1:\n"
        "        raise RuntimeError('diverged at step 0')\n"
        "    dist.all_reduce(torch.ones(2))\n"
        "main()\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_ddp")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        with pytest.raises(ActorError) as info:
            _run(spmd, script, "fail")
        text = str(info.value)
        assert "RuntimeError on 1 of 2 ranks: 1" in text and "still running" not in text, text
        assert "rank 0 (1 of 2): RuntimeError: [gloo] Connection closed by peer … (waiting for rank 1" in text, text
        assert text.rstrip().endswith("RuntimeError: diverged at step 0"), text
        # the notebook shows rank 1's traceback, not rank 0's ~25 lines of DDP's frames
        shown = "\n".join(info.value._render_traceback_())
        assert "distributed.py" not in shown and shown.rstrip().endswith("RuntimeError: diverged at step 0"), shown
        # rank 0 takes the next call: it is out of its all_reduce
        assert _run(spmd, script, "ok").values() == [True] * 2
    finally:
        procs.stop().get(timeout=30)


def test_spmd_script_exiting_on_one_rank_says_in_one_line_that_the_others_failed_waiting_for_it(tmp_path):
    """Rank 1's script calls ``sys.exit(3)`` while rank 0 waits for it in DDP's forward: the call
    fails with rank 1's actor failure, and its note of what rank 0 raised was gloo's 400
    characters (a build path, a port, "GLHF!") "perhaps because of this failure"; now one line
    saying rank 0 failed waiting for it."""
    from monarch_nb.config import configured
    from monarch_nb.errors import SupervisionError
    from monarch_nb.spmd import SPMDActor

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "def main():\n"
        "    dist.init_process_group('gloo')\n"
        "    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    if dist.get_rank() == 1:\n"
        "        sys.exit(3)\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "main()\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="spmd_exit3")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        # a long window: the call raises once rank 0 has answered too, whichever comes first
        with configured(call_error_window=30), pytest.raises(SupervisionError, match="SystemExit: 3") as info:
            _run(spmd, script)
        notes = getattr(info.value, "__notes__", [])
        said = r"in the same call rank 0 \(1 of 2\) raised RuntimeError: \[gloo\] Connection (closed|reset) by peer … \(waiting for it in a collective\)"
        assert len(notes) == 1 and re.fullmatch(said, notes[0]), notes
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.cuda
@pytest.mark.timeout(150)
def test_spmd_script_s_nccl_group_is_destroyed_within_its_bound_so_the_script_runs_again(tmp_path):
    """The NCCL path of destroying the process group a script left (bounded by _DESTROY_WAIT):
    a script that fails after an NCCL all_reduce, then runs again on the same proc (one rank:
    NCCL refuses two ranks on one GPU, and bench/gpu_check.sh's machine has one)."""
    import time

    import torch
    import torch.distributed as dist

    from monarch_nb.actor import ActorError
    from monarch_nb.spmd import _DESTROY_WAIT, SPMDActor

    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        pytest.skip("needs CUDA and a torch built with NCCL (runs in bench/gpu_check.sh)")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))  # as torchrun scripts do\n"
        "dist.init_process_group('nccl', device_id=torch.device('cuda', int(os.environ['LOCAL_RANK'])))\n"
        "t = torch.ones(4, device='cuda')\n"
        "dist.all_reduce(t)\n"
        "torch.cuda.synchronize()\n"
        "if sys.argv[1] == 'fail':\n"
        "    raise RuntimeError('diverged at step 1')\n"
        "assert dist.get_backend() == 'nccl'\n"
    )
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="spmd_nccl")
    try:
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        for mode in ("fail", "ok", "ok"):
            addr, port = spmd.get_host_port.call_one(None).get(timeout=30)
            start = time.monotonic()
            if mode == "fail":
                with pytest.raises(ActorError, match="diverged at step 1"):
                    spmd.main.call_one(addr, port, [str(script), mode]).get(timeout=60)
            else:
                # "initialize the default process group twice" if the failed run's group stayed
                assert spmd.main.call_one(addr, port, [str(script), mode]).get(timeout=60) is True
            assert time.monotonic() - start < _DESTROY_WAIT + 30
    finally:
        procs.stop().get(timeout=30)


class CudaFirst(Actor):
    @endpoint
    def devices_for_a_script(self) -> tuple[str, list[str]]:
        """What SPMDActor.main would widen CUDA_VISIBLE_DEVICES to once this proc has used
        CUDA, and what it warns."""
        import warnings

        import torch

        from monarch_nb.spmd import _torchrun_devices

        torch.zeros(1, device="cuda")  # CUDA starts here, seeing the proc's one device
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            widened = _torchrun_devices(current_rank().rank, script=True)
        return widened.get("CUDA_VISIBLE_DEVICES", ""), [str(w.message) for w in seen]


@pytest.mark.cuda
@pytest.mark.timeout(150)
def test_a_script_s_local_rank_that_cuda_already_cannot_see_is_warned_about():
    """Where CUDA has started in a proc (an earlier actor used it), the devices it sees are
    fixed: a torchrun script's set_device(LOCAL_RANK) would fail on local ranks past them, and
    SPMDActor says why and what to do rather than leave 'invalid device ordinal' alone."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs in bench/gpu_check.sh)")
    n = torch.cuda.device_count() + 1  # one local rank more than the host's GPUs
    procs = this_host().spawn_procs(per_host={"gpus": n}, name="cuda_first")
    try:
        got = procs.spawn("first", CudaFirst).devices_for_a_script.call().get(timeout=120).values()
        assert [widened for widened, _ in got] == [""] * n, got
        assert not got[0][1], got
        warned = got[-1][1]
        assert len(warned) == 1 and "torch.cuda.set_device(0)" in warned[0] and f"LOCAL_RANK={n - 1}" in warned[0], got
    finally:
        procs.stop().get(timeout=30)
