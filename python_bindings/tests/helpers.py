"""Shared by the pytest files: a small model with uneven parameter sizes and a tied weight, a
deterministic global batch, and training runs of shardopt and of a single-process torch optimizer
over the same global batch (the contract: after each step every rank holds what that process
holds)."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardopt

STEPS = 10
TOL = 1e-6


class TiedNet(nn.Module):
    """Embedding -> two layers -> decoder tied to the embedding (as BERT's MLM head). Sizes are
    odd so shards split tensors; the bias of `mid` is frozen when `frozen=True`."""

    def __init__(self, vocab=11, hidden=7, frozen=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mid = nn.Linear(hidden, 13)
        self.out = nn.Linear(13, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        if frozen:
            self.mid.bias.requires_grad_(False)

    def forward(self, ids):
        x = self.embed(ids).mean(dim=1)
        x = self.norm(self.out(torch.tanh(self.mid(x))))
        return F.linear(x, self.embed.weight, self.decoder_bias)


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TiedNet(**kwargs)


def global_batch(step, size=12, vocab=11):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (size, 5), generator=g),
            torch.randint(0, vocab, (size,), generator=g))


def loss_fn(model, ids, labels):
    return F.cross_entropy(model(ids), labels)


def rank_slice(tensor, rank, world):
    n = tensor.shape[0] // world
    return tensor[rank * n:(rank + 1) * n]


def param_groups(model, split):
    """One group, or (decay, no-decay) groups with a different lr, as BERT trainers split them."""
    named = list(model.named_parameters())
    if not split:
        return named
    no_decay = [(n, p) for n, p in named if "bias" in n or "norm" in n]
    decay = [(n, p) for n, p in named if not ("bias" in n or "norm" in n)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}]


def torch_groups(model, split):
    groups = param_groups(model, split)
    if not split:
        return [p for _, p in groups]
    return [{**g, "params": [p for _, p in g["params"]]} for g in groups]


# (name for ids, shardopt spec, torch class, hyper-parameters)
RULES = {
    "adamw": ("adamw", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
    "adam_amsgrad": ("adam", torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True)),
    "sgd": ("sgd", torch.optim.SGD, dict(lr=0.5)),
    "sgd_momentum": ("sgd", torch.optim.SGD,
                     dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adagrad": ("adagrad", torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
    "rmsprop": ("rmsprop", torch.optim.RMSprop,
                dict(lr=0.01, momentum=0.5, centered=True, weight_decay=0.01)),
}


def lr_lambda(step):
    return 1.0 / (1 + step)


def train_shardopt(comm, rule, stage, split=False, scheduler=False, steps=STEPS, model=None,
                   **options):
    spec, _, hyper = RULES[rule]
    model = model or make_model()
    opt = shardopt.DistributedOptimizer(param_groups(model, split), spec, comm=comm, stage=stage,
                                        bucket_bytes=256, **options, **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if scheduler else None
    for step in range(steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        loss = loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                       rank_slice(labels, comm.rank, comm.size))
        opt.backward(loss)
        opt.step()
        if sched:
            sched.step()
    return model, opt


def train_torch(rule, split=False, scheduler=False, steps=STEPS):
    _, cls, hyper = RULES[rule]
    model = make_model()
    opt = cls(torch_groups(model, split), **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if scheduler else None
    for step in range(steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        loss_fn(model, ids, labels).backward()
        opt.step()
        if sched:
            sched.step()
    return model


def max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def parity_cases(comm, cases):
    """Runs every (rule, stage, split, scheduler) case; returns {case: max |diff|} without
    asserting, so that all ranks finish the same collectives before anyone fails."""
    out = {}
    for rule, stage, split, scheduler in cases:
        model, _ = train_shardopt(comm, rule, stage, split=split, scheduler=scheduler)
        out[(rule, stage, split, scheduler)] = max_diff(
            model, train_torch(rule, split=split, scheduler=scheduler))
    return out


def all_ranks_ok(comm, ok):
    """True when `ok` holds on every rank (a MIN all-reduce), so failures are reported
    everywhere and nobody is left waiting in a collective."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    comm.all_reduce(flag, shardopt.ReduceOp.MIN)
    return bool(flag.item())


def world_or_single():
    """The mpirun world when launched by mpirun, else a single process (one thread per rank)."""
    torch.set_num_threads(1)
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return shardopt.init_from_env(timeout=120)
    return shardopt.make_single_communicator()


def train_sharded_steps(model, opt, comm, steps):
    """`steps` steps of cross-entropy on this rank's slice of the global batch, then the
    parameters gathered (stage 3 keeps none between steps)."""
    for step in range(steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        out = model(rank_slice(ids, comm.rank, comm.size))
        opt.backward(F.cross_entropy(out, rank_slice(labels, comm.rank, comm.size)))
        opt.step()
    opt.gather_full_parameters()
