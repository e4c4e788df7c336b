"""Stage 3 from Python: DistributedOptimizer(..., stage=3, units=...) installs forward hooks on the
unit modules, so an unchanged PyTorch model trains sharded. Parity with torch.optim on the global
batch (<= 1e-6 after 10 steps) for AdamW and SGD with an embedding tied to the decoder. CTest runs
this file in one process (entry `python`) and under mpirun -np 2 and 3 (python_stage3_np2/3)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardopt
from helpers import train_sharded_steps, world_or_single, STEPS, TOL, all_ranks_ok, global_batch, rank_slice

VOCAB, HIDDEN = 11, 7


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 13)
        self.down = nn.Linear(13, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class TiedBlocks(nn.Module):
    """Embedding -> two blocks -> a decoder module whose weight *is* the embedding's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.decoder = nn.Linear(HIDDEN, VOCAB)
        self.decoder.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return self.decoder(x)


def make_model():
    torch.manual_seed(0)
    return TiedBlocks()


RULES = {"adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
         "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}

# How the units are named: the modules, a class policy over the model, or every module including
# the embedding and the decoder (which share their weight: gathered while either runs).
UNITS = {
    "modules": lambda m: dict(params=m.named_parameters(), units=list(m.blocks)),
    "class_policy": lambda m: dict(params=m, units=Block),
    "tied_units": lambda m: dict(params=m.named_parameters(),
                                 units=[m.embed, *m.blocks, m.decoder]),
    # No units=: units from the names (embed, blocks.0, blocks.1, decoder), gathered on first use
    # through the dispatcher; this model is tiny, so nothing may persist.
    "automatic": lambda m: dict(params=m, unit_policy={"persist_below": 0}),
    # The same with the small groups persistent (the blocks' 216 elements are not: 100 is the
    # per-group bound), within half of the model.
    "automatic_persistent": lambda m: dict(
        params=m, unit_policy=shardopt.UnitPolicy(persist_below=100, persist_share=0.5)),
}


@pytest.fixture(scope="module")
def comm():
    return world_or_single()


def train_stage3(comm, rule, units):
    cls, hyper = RULES[rule]
    model = make_model()
    opt = shardopt.DistributedOptimizer(optimizer=cls, comm=comm, stage=3, bucket_bytes=256,
                                        **UNITS[units](model), **hyper)
    train_sharded_steps(model, opt, comm, STEPS)
    return model, opt


def train_torch(rule):
    cls, hyper = RULES[rule]
    model = make_model()
    opt = cls(model.parameters(), **hyper)
    for step in range(STEPS):
        ids, labels = global_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(ids), labels).backward()
        opt.step()
    return model


def max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


@pytest.mark.parametrize("units", sorted(UNITS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_stage3_matches_torch_optim(comm, rule, units):
    model, opt = train_stage3(comm, rule, units)
    diff = max_diff(model, train_torch(rule))
    assert model.decoder.weight is model.embed.weight
    sharded = comm.size == 1 or opt.memory().param_bytes < 4 * opt.padded_numel
    assert all_ranks_ok(comm, diff <= TOL and sharded), (
        f"rank {comm.rank}/{comm.size}: max |diff| {diff:.3g} (tolerance {TOL}), "
        f"param bytes {opt.memory().param_bytes} of {4 * opt.padded_numel}")


def test_units_are_released_between_steps(comm):
    model, opt = train_stage3(comm, "sgd", "modules")
    ids, labels = global_batch(0)
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(rank_slice(ids, comm.rank, comm.size)),
                                 rank_slice(labels, comm.rank, comm.size)))
    opt.step()
    # After a step nothing stays gathered: the blocks' full storage is gone, and the parameters in
    # no unit (the tied embedding) are released too; reading one is an error that names it.
    def storage_bytes(p):
        return (p.untyped_storage() if hasattr(p, "untyped_storage") else p.storage()).nbytes()
    params = list(model.blocks.parameters())
    held = sum(p.numel() for p in params if storage_bytes(p) > 0)
    total = sum(p.numel() for p in params)
    try:
        model.embed.weight.sum()
        named = False
    except RuntimeError as e:
        named = "parameter 'embed.weight'" in str(e) and "is released" in str(e)
    ok = held == 0 and named
    assert all_ranks_ok(comm, ok), f"rank {comm.rank}: {held} of {total} block elements held"


def test_policies_are_checked():
    model = make_model()
    comm = shardopt.make_single_communicator()
    with pytest.raises(TypeError, match="needs the model itself"):
        shardopt.DistributedOptimizer(model.named_parameters(), "sgd", lr=0.1, comm=comm,
                                      stage=3, units=Block)
    with pytest.raises(ValueError, match="no submodule of the model is a"):
        shardopt.modules_of_type(model, nn.Conv1d)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        shardopt.DistributedOptimizer(model.named_parameters(), "sgd", lr=0.1, comm=comm,
                                      stage=3, units=[model.blocks[0], "decoder"])
    assert [n for n, _ in shardopt.modules_of_type(model, Block)] == ["blocks.0", "blocks.1"]


def test_persistent_groups_are_reported(comm):
    """persist_share reaches C++, and memory() says what persists: nothing with persist_below=0."""
    _, none = train_stage3(comm, "sgd", "automatic")
    _, some = train_stage3(comm, "sgd", "automatic_persistent")
    policy = some.options.unit_policy
    persistent = some.memory().persistent_param_bytes
    ok = (none.memory().persistent_param_bytes == 0 and 0 < persistent <= 4 * some.numel // 2
          and policy.persist_share == 0.5 and "persist_share=0.5" in repr(policy)
          and "persistent_param_bytes" in repr(some.memory()))
    assert all_ranks_ok(comm, ok), f"rank {comm.rank}: persistent bytes {persistent}, {policy}"


def test_automatic_units_hold_only_shards_between_steps(comm):
    """Without units=, after a step no unit holds storage, and reading a parameter gathers it
    (every rank reads it, as a collective)."""
    model, opt = train_stage3(comm, "sgd", "automatic")
    opt.zero_grad()
    ids, labels = global_batch(0)
    opt.backward(F.cross_entropy(model(rank_slice(ids, comm.rank, comm.size)),
                                 rank_slice(labels, comm.rank, comm.size)))
    opt.step()
    def storage_bytes(p):
        return (p.untyped_storage() if hasattr(p, "untyped_storage") else p.storage()).nbytes()
    held = sum(p.numel() for p in model.parameters() if storage_bytes(p) > 0)
    total_before = model.embed.weight.sum().item()  # gathered on use: same value on every rank
    with torch.no_grad():  # evaluation forward on every rank
        out = model(ids)
    finite = bool(torch.isfinite(out).all()) and total_before == total_before
    sharded = comm.size == 1 or opt.memory().param_bytes < 4 * opt.padded_numel
    assert all_ranks_ok(comm, held == 0 and finite and sharded), (
        f"rank {comm.rank}: {held} elements held after step(), finite {finite}")
