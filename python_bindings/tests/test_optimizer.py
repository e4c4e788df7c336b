"""shardopt.DistributedOptimizer in one process (the 'single' engine) against torch.optim: every
rule and stage, parameter groups, LR schedulers, hyper-parameter changes, the factory path,
gradient accumulation, clipping, memory reports, GIL handling around autograd, and every
ZeroOptions field reaching C++."""
import datetime

import pytest
import torch

import shardopt
from helpers import (RULES, STEPS, TOL, global_batch, loss_fn, make_model, max_diff,
                     parity_cases, train_shardopt, train_torch)


@pytest.fixture(scope="module")
def comm():
    return shardopt.make_single_communicator()


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_parity_with_torch(comm, rule, stage):
    diffs = parity_cases(comm, [(rule, stage, False, False)])
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("rule", ["adamw", "sgd_momentum"])
def test_parity_with_groups_and_scheduler(comm, rule):
    diffs = parity_cases(comm, [(rule, 2, True, True), (rule, 1, True, False)])
    assert max(diffs.values()) <= TOL, diffs


def test_tied_and_frozen_parameters(comm):
    model = make_model(frozen=True)
    frozen_before = model.mid.bias.detach().clone()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01)
    # The decoder shares the embedding: counted once. The frozen bias is not the optimizer's.
    expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert opt.numel == expected
    assert opt.padded_numel >= expected
    embed_before = model.embed.weight.detach().clone()
    ids, labels = global_batch(0)
    opt.zero_grad()
    opt.backward(loss_fn(model, ids, labels))
    opt.step()
    assert torch.equal(model.mid.bias, frozen_before)
    assert not torch.equal(model.embed.weight, embed_before)


def test_plain_backward_and_closure(comm):
    """loss.backward() (torch releases the GIL itself) and step(closure) match opt.backward."""
    a, b = make_model(), make_model()
    opt_a = shardopt.DistributedOptimizer(a.named_parameters(), "sgd", comm=comm, lr=0.3)
    opt_b = shardopt.DistributedOptimizer(b.named_parameters(), "sgd", comm=comm, lr=0.3)
    for step in range(4):
        ids, labels = global_batch(step)
        opt_a.zero_grad()
        opt_a.backward(loss_fn(a, ids, labels))
        opt_a.step()

        def closure():
            opt_b.zero_grad()
            loss = loss_fn(b, ids, labels)
            loss.backward()
            return loss

        loss = opt_b.step(closure)
        assert loss.requires_grad and loss.item() > 0
    assert max_diff(a, b) == 0.0


def test_python_autograd_hooks_run_inside_backward(comm):
    """opt.backward releases the GIL (the autograd engine refuses to start while it is held), so
    Python tensor hooks of the model still run inside it, before shardopt's C++ hooks."""
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "sgd", comm=comm, lr=0.2,
                                        stage=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    calls = []
    for m in (model, ref):
        m.out.weight.register_hook(lambda g: (calls.append(1), g * 3.0)[1])
    for step in range(3):
        ids, labels = global_batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.backward(loss_fn(model, ids, labels))
        opt.step()
        loss_fn(ref, ids, labels).backward()
        ref_opt.step()
    assert len(calls) == 6
    assert max_diff(model, ref) <= TOL


def test_lr_changes_reach_the_step(comm):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01,
                                        weight_decay=0.1)
    ids, labels = global_batch(0)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    opt.backward(loss_fn(model, ids, labels))
    opt.step()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "lr=0 must not move parameters"
    opt.param_groups[0]["lr"] = 0.01
    opt.zero_grad()
    opt.backward(loss_fn(model, ids, labels))
    opt.step()
    assert not torch.equal(before["mid.weight"], model.state_dict()["mid.weight"])


def test_weight_decay_and_betas_changes_match_torch(comm):
    """Changing weight_decay and betas mid-run in param_groups acts like it does in torch."""
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        if step == 4:
            for o in (opt, ref_opt):
                o.param_groups[0]["weight_decay"] = 0.3
                o.param_groups[0]["betas"] = (0.8, 0.99)
        ids, labels = global_batch(step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, ids, labels).backward()
            o.step()
    assert max_diff(model, ref) <= TOL


def test_torch_optim_schedulers(comm):
    """StepLR and OneCycleLR (which cycles Adam's betas too) drive shardopt as they drive torch."""
    for make in (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
                 lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05,
                                                               total_steps=STEPS)):
        model, ref = make_model(), make_model()
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adam", comm=comm, lr=0.01)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        scheds = [make(opt), make(ref_opt)]
        for step in range(STEPS):
            ids, labels = global_batch(step)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss_fn(m, ids, labels).backward()
                o.step()
            for s in scheds:
                s.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert max_diff(model, ref) <= TOL


def test_torch_class_and_spec_dict_run_natively(comm):
    a, b, ref = make_model(), make_model(), make_model()
    opt_a = shardopt.DistributedOptimizer(a.named_parameters(), torch.optim.SGD, comm=comm,
                                          lr=0.1, momentum=0.9)
    opt_b = shardopt.DistributedOptimizer(b.named_parameters(),
                                          {"name": "sgd", "lr": 0.1, "momentum": 0.9}, comm=comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert opt_a._inner is None and opt_b._inner is None  # no Python in the step
    for step in range(STEPS):
        ids, labels = global_batch(step)
        for m, o in ((a, opt_a), (b, opt_b), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, ids, labels).backward()
            o.step()
    assert max_diff(a, ref) <= TOL
    assert max_diff(b, ref) <= TOL


@pytest.mark.parametrize("stage", [1, 2])
def test_any_torch_optimizer_over_the_shard(comm, stage):
    """A torch.optim class shardopt has no native rule for runs over the rank's shard (the
    factory path); LR scheduler changes reach it."""
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), torch.optim.Adamax, comm=comm,
                                        stage=stage, lr=0.02, weight_decay=0.01)
    ref_opt = torch.optim.Adamax(ref.parameters(), lr=0.02, weight_decay=0.01)
    assert isinstance(opt._inner, torch.optim.Adamax)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s) for o in (opt, ref_opt)]
    for step in range(STEPS):
        ids, labels = global_batch(step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, ids, labels).backward()
            o.step()
        for s in scheds:
            s.step()
    # The inner optimizer holds the lr of the last step; the scheduler has moved on since.
    assert opt._inner.param_groups[0]["lr"] == pytest.approx(0.02 * 0.9 ** (STEPS - 1))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.9 ** STEPS)
    assert max_diff(model, ref) <= TOL


def test_gradient_accumulation(comm):
    """Two micro-batches of 6 accumulate to one step on the batch of 12 (loss averaged)."""
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "sgd", comm=comm, lr=0.5,
                                        stage=2, grad_accumulation_steps=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        ids, labels = global_batch(step)
        opt.zero_grad()
        for half in (slice(0, 6), slice(6, 12)):
            opt.backward(loss_fn(model, ids[half], labels[half]))
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, ids, labels).backward()
        ref_opt.step()
    assert max_diff(model, ref) <= TOL


def test_gradient_accumulation_torch_style(comm):
    """(loss / k).backward(), torch's and FSDP's convention, gives the same big-batch gradient as
    opt.backward(loss): SGD (which, unlike Adam, would show a gradient k times off)."""
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "sgd", comm=comm, lr=0.5,
                                        stage=2, grad_accumulation_steps=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        ids, labels = global_batch(step)
        opt.zero_grad()
        for third in (slice(0, 4), slice(4, 8), slice(8, 12)):
            (loss_fn(model, ids[third], labels[third]) / 3).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, ids, labels).backward()
        ref_opt.step()
    assert max_diff(model, ref) <= TOL


def test_clipping_matches_clip_grad_norm(comm):
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "sgd", comm=comm, lr=0.5,
                                        max_grad_norm=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, ids, labels))
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, ids, labels).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        stats = opt.last_step()
        assert stats.step == step + 1
        assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        assert stats.clipped == (norm.item() > 0.05)
    assert max_diff(model, ref) <= TOL


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_report(comm, stage):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm,
                                        stage=stage)
    mem = opt.memory()
    psi = opt.padded_numel
    assert mem.param_bytes == 4 * psi
    assert mem.optimizer_state_bytes == 8 * psi  # m and v; one rank owns everything
    assert mem.grad_bytes == 4 * psi
    assert mem.total == (mem.param_bytes + mem.grad_bytes + mem.optimizer_state_bytes
                         + mem.buffer_bytes)
    sgd = shardopt.DistributedOptimizer(make_model().named_parameters(), "sgd", comm=comm,
                                        lr=0.1, stage=stage)
    assert sgd.memory().optimizer_state_bytes == 0


def test_param_groups_look_like_torch(comm):
    model = make_model()
    groups = [{"params": [model.mid.weight, model.out.weight]},
              {"params": [p for n, p in model.named_parameters()
                          if n not in ("mid.weight", "out.weight")], "lr": 0.5}]
    opt = shardopt.DistributedOptimizer(groups, "sgd", comm=comm, lr=0.1, momentum=0.9,
                                        timeout=30, options=shardopt.ZeroOptions(stage=1))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.options.stage == 1 and opt.options.timeout.total_seconds() == 30
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert opt.param_groups[0]["momentum"] == 0.9
    assert opt.param_groups[0]["param_names"] == ["param0", "param1"]
    assert opt.defaults == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                            "nesterov": False}
    assert opt.comm.backend == "single"
    assert "Parameter Group 1" in repr(opt)


# A non-default value for every ZeroOptions field (a field missing here fails the test below).
NON_DEFAULT = dict(stage=1, bucket_bytes=4096, overlap_comm=False, grad_accumulation_steps=2,
                   defer_reduction=True, max_grad_norm=2.5, precision="bf16", reduce_in_fp32=False,
                   reduce_dtype="bf16", shard_group_size=1, fused_update=False, offload="cpu",
                   broadcast_initial_params=False, align_bytes=128, prefetch=3, reuse_distance=7,
                   reshard_between_uses=False,
                   timeout=datetime.timedelta(seconds=42), max_nonfinite_steps=0,
                   unit_policy=shardopt.UnitPolicy(patterns=["layers"], persist_below=5,
                                                   persist_share=0.25))
LOSS_SCALE = dict(dynamic=False, initial_scale=1024.0, growth_factor=3.0, growth_interval=7,
                  backoff_factor=0.25, hysteresis=4, min_scale=2.0)


def test_every_zero_options_field_reaches_cpp(comm):
    """Each field set as a keyword, and through options=, is what the C++ optimizer sees."""
    # The grid: this process's communicator cut as one tensor rank by one stage, the model's
    # parameters unmarked, so held whole by every tensor rank.
    non_default = dict(NON_DEFAULT, grid=shardopt.make_parallel_groups(comm))
    fields = [f for f in shardopt.arguments._OPTION_FIELDS if f not in ("units", "loss_scale")]
    assert sorted(fields) == sorted(non_default)
    default = shardopt.ZeroOptions()
    for f, v in non_default.items():
        assert getattr(default, f) != v, f
    via_options = shardopt.ZeroOptions(**non_default, loss_scale=LOSS_SCALE)
    for how in ({**non_default, "loss_scale": LOSS_SCALE}, {"options": via_options}):
        opt = shardopt.DistributedOptimizer(make_model().named_parameters(), "adamw", comm=comm,
                                            **how)
        seen = opt.options  # the C++ optimizer's own copy
        for f, v in non_default.items():
            assert getattr(seen, f) == v, f
        for f, v in LOSS_SCALE.items():
            assert getattr(seen.loss_scale, f) == v, f
    text = repr(via_options)
    for f in shardopt.arguments._OPTION_FIELDS:
        assert f"{f}=" in text, f
    assert "initial_scale=1024.0" in text and "reduce_in_fp32=False" in text
    # options= is copied: changing it later changes no optimizer.
    via_options.loss_scale.initial_scale = 8.0
    assert opt.options.loss_scale.initial_scale == 1024.0

