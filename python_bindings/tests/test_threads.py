"""shardopt.run_ranks from Python: N ranks as threads of this process (the thread engine), their
collectives, an error on one rank ending every rank, and DistributedOptimizer at stages 0-3 on
thread-ranks against torch.optim on the whole batch."""
import threading

import pytest
import torch

import shardopt
from helpers import RULES, TOL, make_model, max_diff, train_shardopt, train_torch

# The thread-ranks share torch's default generator: a model made from a seed is made under this.
_draws = threading.Lock()


def test_collectives_on_thread_ranks():
    seen = {}

    def body(comm):
        t = torch.full((4,), float(comm.rank))
        comm.all_reduce(t)
        shard = torch.empty(2)
        comm.reduce_scatter(torch.arange(2.0 * comm.size), shard)
        seen[comm.rank] = (comm.backend, comm.size, t.tolist(), shard.tolist())

    shardopt.run_ranks(3, body)
    assert seen == {r: ("threads", 3, [3.0] * 4, [6.0 * r, 6.0 * r + 3]) for r in range(3)}


def test_an_error_on_one_rank_ends_every_rank():
    errors = {}

    def body(comm):
        if comm.rank == 1:
            raise ValueError("rank one's own error")
        try:
            comm.barrier()
        except shardopt.CommunicationError as e:
            errors[comm.rank] = str(e)

    with pytest.raises(ValueError, match="rank one's own error"):
        shardopt.run_ranks(2, body, timeout=60)
    assert "rank 1 failed" in errors[0] and "rank one's own error" in errors[0], errors


@pytest.mark.parametrize("rule", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_on_thread_ranks_matches_torch(rule, stage):
    assert rule in RULES
    diffs = {}

    def body(comm):
        torch.set_num_threads(1)
        with _draws:
            model = make_model()
        trained, _ = train_shardopt(comm, rule, stage, model=model)
        diffs[comm.rank] = max_diff(trained, reference)

    with _draws:
        reference = train_torch(rule)
    shardopt.run_ranks(3, body, timeout=120)
    assert len(diffs) == 3 and max(diffs.values()) <= TOL, diffs
