"""Adafactor against torch.optim.Adafactor (torch >= 2.5) in float64: N = 1..4 thread-ranks at
stages 0-3 on the tied model with two parameter groups, within 1e-10; torch's state dict both ways
(row_var, col_var, variance and step, as torch keeps them)."""
import threading

import pytest
import torch

import shardopt
from helpers import global_batch, loss_fn, make_model, max_diff, param_groups, rank_slice

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"),
                                reason="torch.optim.Adafactor needs torch >= 2.5")

STEPS = 8
TOL = 1e-10
HYPER = dict(lr=0.03, beta2_decay=-0.6, eps=(None, 1e-3), d=1.2, weight_decay=0.05)
_draws = threading.Lock()  # thread-ranks share torch's default generator


def groups_for_torch(model):
    return [{**g, "params": [p for _, p in g["params"]]} for g in param_groups(model, True)]


def train_torch(steps=STEPS):
    model = make_model().double()
    opt = torch.optim.Adafactor(groups_for_torch(model), **HYPER)
    for step in range(steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        loss_fn(model, ids, labels).backward()
        opt.step()
    return model, opt


def train_shardopt(comm, stage, model, steps=STEPS, first=0, opt=None):
    opt = opt or shardopt.DistributedOptimizer(param_groups(model, True), "adafactor", comm=comm,
                                               stage=stage, bucket_bytes=256, **HYPER)
    for step in range(first, first + steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                             rank_slice(labels, comm.rank, comm.size)))
        opt.step()
    return opt


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_torch_adafactor(stage, world):
    with _draws:
        reference, _ = train_torch()
    diffs = {}

    def body(comm):
        torch.set_num_threads(1)
        with _draws:
            model = make_model().double()
        opt = train_shardopt(comm, stage, model)
        opt.gather_full_parameters()
        diffs[comm.rank] = max_diff(model, reference)

    shardopt.run_ranks(world, body, timeout=120)
    assert len(diffs) == world and max(diffs.values()) <= TOL, diffs
    with _draws:
        untrained = make_model().double()
    assert max_diff(reference, untrained) > 1e-3  # the run moved the parameters


def test_state_dict_both_ways_with_torch():
    # torch -> shardopt: torch's state after 4 steps continues in shardopt at two ranks, stage 2.
    with _draws:
        expected, _ = train_torch(8)
        half, torch_opt = train_torch(4)
    saved = torch_opt.state_dict()
    assert {"step", "row_var", "col_var"} <= set(saved["state"][0])  # embed.weight is a matrix
    start = {k: v.clone() for k, v in half.state_dict().items()}
    diffs, states = {}, {}

    def body(comm):
        torch.set_num_threads(1)
        model = make_model().double()
        model.load_state_dict(start)
        opt = shardopt.DistributedOptimizer(param_groups(model, True), "adafactor", comm=comm,
                                            stage=2, bucket_bytes=256, **HYPER)
        opt.load_state_dict(saved)
        train_shardopt(comm, 2, model, steps=4, first=4, opt=opt)
        diffs[comm.rank] = max_diff(model, expected)
        opt.consolidate_state_dict(0)
        if comm.rank == 0:
            states[0] = opt.state_dict()

    shardopt.run_ranks(2, body, timeout=120)
    assert max(diffs.values()) <= TOL, diffs
    # shardopt -> torch: the consolidated state equals torch's own after 8 steps.
    _, torch8 = train_torch(8)
    ours, theirs = states[0]["state"], torch8.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for pid, entry in theirs.items():
        assert ours[pid].keys() == entry.keys(), (pid, ours[pid].keys(), entry.keys())
        for key, value in entry.items():
            got = ours[pid][key]
            assert got.shape == value.shape, (pid, key)
            assert (got.double() - value.double()).abs().max().item() <= 1e-12, (pid, key)
    probe = torch.optim.Adafactor(groups_for_torch(make_model().double()), **HYPER)
    probe.load_state_dict(states[0])  # torch takes it as its own


def test_eps_none_round_trips_and_bad_values_are_refused():
    model = make_model().double()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adafactor",
                                        comm=shardopt.make_single_communicator())
    group = opt.param_groups[0]
    assert group["eps"] == (None, 1e-3) and group["beta2_decay"] == -0.8 and group["d"] == 1.0
    with pytest.raises(ValueError, match="beta2_decay"):
        shardopt.DistributedOptimizer(make_model().named_parameters(), "adafactor",
                                      comm=shardopt.make_single_communicator(), beta2_decay=0.5)
    with pytest.raises(ValueError, match="epsilon1"):
        shardopt.DistributedOptimizer(make_model().named_parameters(), "adafactor",
                                      comm=shardopt.make_single_communicator(), eps=(-1.0, 1e-3))
