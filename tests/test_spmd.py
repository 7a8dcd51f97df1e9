"""An SPMD torch.distributed (gloo) program wrapped in an actor, as the seeds' Titan wrapper does."""

from __future__ import annotations

import os

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


def test_gloo_all_reduce_across_a_proc_mesh():
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}, name="spmd")
    try:
        setup_env_for_distributed(procs)
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
