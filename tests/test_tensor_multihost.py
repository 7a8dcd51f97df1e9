"""Mesh tensors across two simulated hosts (network namespaces): the process group spans both
hosts' procs, and every oracle op, redistribute, notebook 09's 50-step training (loss curve and
no bytes back), FSDP2 and large shards (the data plane) run across them."""

from __future__ import annotations

from pathlib import Path

import pytest
from _netns import NetnsCluster
from test_multihost import Allocator, Controller, cluster, keys, workers  # noqa: F401 - fixtures
from test_tensor import OPS

pytestmark = pytest.mark.multihost


@pytest.mark.timeout(240)
def test_mesh_tensors_across_two_hosts(cluster: NetnsCluster, workers: list[Allocator]) -> None:  # noqa: F811
    ctl = Controller(
        cluster,
        """
        import torch
        import torch.nn.functional as F
        import monarch_nb.tensor as mt
        from monarch_nb.tensor import Replicate, Shard

        torch.set_default_dtype(torch.float64)
        hosts = attach_to_workers(workers=WORKERS, ca="/tmp/key")
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        emit("backend", backend=mt.setup(procs))
        g = torch.Generator().manual_seed(0)
        X, W = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
        x = mt.distribute(X, procs, [Shard(0), Replicate()])
        w = mt.distribute(W, procs, [Replicate(), Shard(1)]).requires_grad_()
        y = torch.relu(x @ w)
        ok = torch.allclose(mt.inspect(y), torch.relu(X @ W))
        r = mt.inspect(x.redistribute(placements=[Replicate(), Shard(1)]))
        loss = F.log_softmax(y, dim=1).sum()
        loss.backward()
        wl = W.clone().requires_grad_()
        F.log_softmax(torch.relu(X @ wl), dim=1).sum().backward()
        emit("values", ok=ok, redistributed=torch.equal(r, X), grad=torch.allclose(mt.inspect(w.grad), wl.grad))
        # every op of the oracle in tests/test_tensor.py, on each placement of the first input
        import os, sys
        sys.path.insert(0, os.environ["MNB_TESTS_DIR"])
        from test_tensor import OPS, PLACEMENTS, fit, gen
        wrong, runs = [], 0
        for name, (fn, shapes) in sorted(OPS.items()):
            for pl, placements in PLACEMENTS[2].items():
                local = [gen(*s, seed=i) for i, s in enumerate(shapes)]
                out = fn(*[mt.distribute(t, procs, fit(placements, t.ndim)) for t in local])
                runs += 1
                if not torch.allclose(mt.inspect(out), fn(*local)):
                    wrong.append(f"{name}/{pl}")
        emit("ops", wrong=wrong, runs=runs)
        # notebook 09's training, across the hosts: data parallel over hosts, tensor parallel
        # over gpus, 50 SGD steps in float64 against single-process training; nothing comes back
        g9 = torch.Generator().manual_seed(0)
        X9, Y9 = torch.randn(32, 8, generator=g9), torch.randint(0, 4, (32,), generator=g9)
        W1, W2 = 0.3 * torch.randn(8, 16, generator=g9), 0.3 * torch.randn(16, 4, generator=g9)
        x9 = mt.distribute(X9, procs, [Shard(0), Replicate()])
        y9 = mt.distribute(Y9, procs, [Shard(0), Replicate()])
        w1 = mt.distribute(W1, procs, [Replicate(), Shard(1)]).requires_grad_()
        w2 = mt.distribute(W2, procs, [Replicate(), Shard(0)]).requires_grad_()
        opt9 = mt.Optimizer(torch.optim.SGD, [w1, w2], lr=0.5)
        before, mesh_losses = mt.stats(procs)["bytes_received"], []
        for _ in range(50):
            opt9.zero_grad()
            l9 = F.cross_entropy(F.gelu(x9 @ w1) @ w2, y9)
            l9.backward()
            opt9.step()
            mesh_losses.append(l9)
        quiet = mt.stats(procs)["bytes_received"] == before
        mesh_curve = torch.stack([mt.inspect(v) for v in mesh_losses])
        w1l, w2l = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        opt_l = torch.optim.SGD([w1l, w2l], lr=0.5)
        local_curve = []
        for _ in range(50):
            opt_l.zero_grad()
            v = F.cross_entropy(F.gelu(X9 @ w1l) @ w2l, Y9)
            v.backward()
            opt_l.step()
            local_curve.append(v.detach())
        same = torch.allclose(mesh_curve, torch.stack(local_curve), rtol=1e-10, atol=0)
        emit("notebook09", same=same, quiet=quiet, fell=bool(mesh_curve[-1] < mesh_curve[0]))
        # over 1 MiB a piece: the data plane, a stream from the controller to each rank, from
        # each rank to the controller, and from rank to rank across the hosts
        # FSDP2 as HSDP across the hosts: one Adam step, then the loss, against one process
        import copy
        from torch import nn
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        local = copy.deepcopy(net)
        m = mt.fully_shard(net, procs)
        T = torch.randint(0, 3, (8,), generator=g)
        xb, tb = mt.distribute(X, procs, [Shard(0), Shard(0)]), mt.distribute(T, procs, [Shard(0), Shard(0)])
        opt = mt.Optimizer(torch.optim.Adam, m.parameters(), lr=0.01)
        opt_l = torch.optim.Adam(local.parameters(), lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            loss = F.cross_entropy(m(xb), tb)
            loss.backward()
            opt.step()
            opt_l.zero_grad()
            want = F.cross_entropy(local(X), T)
            want.backward()
            opt_l.step()
        emit("fsdp", same=torch.allclose(mt.inspect(loss), want.detach(), rtol=1e-10, atol=0))
        mt._engine.DISTRIBUTE_DATA_PLANE_BYTES = 1 << 20  # by default from 32 MiB pieces
        B = torch.randn(1024, 520, generator=g)
        b = mt.distribute(B, procs, [Shard(0), Replicate()])
        back = b.full_tensor()
        other = hosts.spawn_procs(per_host={"gpus": 2}, name="other")
        moved = (b * 2).to_mesh(other)
        far = mt.fetch_shard(b, hosts=1, gpus=1).get(timeout=60)  # 2 MiB: lent, read across hosts
        emit(
            "large",
            distributed=torch.equal(back, B),
            moved=torch.equal(moved.full_tensor(), B * 2),
            shard=torch.equal(far, B[512:]),
        )
        other.stop().get(timeout=30)
        procs.stop().get(timeout=30)
        emit("stopped")
        """,
        MNB_TESTS_DIR=str(Path(__file__).parent),
    )
    assert ctl.expect("backend", timeout=120)["backend"] == "gloo"
    assert ctl.expect("values", timeout=120) | {"step": "values"} == {
        "step": "values",
        "ok": True,
        "redistributed": True,
        "grad": True,
    }
    assert ctl.expect("ops", timeout=120) | {"step": "ops"} == {"step": "ops", "wrong": [], "runs": 4 * len(OPS)}
    assert ctl.expect("notebook09", timeout=120) | {"step": "n"} == {"step": "n", "same": True, "quiet": True, "fell": True}
    assert ctl.expect("fsdp", timeout=120)["same"] is True
    assert ctl.expect("large", timeout=120) | {"step": "large"} == {
        "step": "large",
        "distributed": True,
        "moved": True,
        "shard": True,
    }
    ctl.expect("stopped")
    ctl.finish()
