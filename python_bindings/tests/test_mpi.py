"""Two ranks under mpirun (CTest python_mpi_np2): the MPI engine through init_from_env(), against
a single-process torch optimizer on the same global batch. Every test makes the same collectives
on both ranks and only asserts after agreeing with all_ranks_ok, so a failure never hangs the
other rank."""
import os

import pytest
import torch

import shardopt
from helpers import TOL, all_ranks_ok, make_model, parity_cases, train_shardopt

pytestmark = pytest.mark.skipif(
    os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE")) != "2",
    reason="run under mpirun -np 2 (CTest python_mpi_np2)")


@pytest.fixture(scope="module")
def comm():
    torch.set_num_threads(1)
    comm = shardopt.init_from_env(timeout=120)
    assert comm.backend == "mpi" and comm.size == 2
    return comm


def test_collectives(comm):
    r = comm.rank
    t = torch.tensor([1.0 + r, 10.0 * r])
    comm.all_reduce(t)
    avg = torch.tensor([1.0 + r, 10.0 * r])
    comm.all_reduce(avg, shardopt.ReduceOp.AVG)
    mx = torch.tensor([float(r), -float(r)])
    comm.all_reduce(mx, shardopt.ReduceOp.MAX)
    full = torch.arange(6.0) * (r + 1)             # reduce-scatter in place into rank r's third
    work = comm.reduce_scatter(full, full.narrow(0, 3 * r, 3), async_op=True)
    work.wait()
    gathered = torch.zeros(4)
    comm.all_gather(torch.full((2,), float(r)), gathered)
    b = torch.full((3,), float(r))
    comm.broadcast(b, root=1)
    comm.barrier()
    assert torch.equal(t, torch.tensor([3.0, 10.0]))
    assert torch.equal(avg, torch.tensor([1.5, 5.0]))
    assert torch.equal(mx, torch.tensor([1.0, 0.0]))
    assert torch.equal(full.narrow(0, 3 * r, 3), torch.arange(3.0 * r, 3.0 * r + 3) * 3)
    assert torch.equal(gathered, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert torch.equal(b, torch.ones(3))


def test_parity_stages_rules_groups_scheduler(comm):
    cases = [(rule, stage, False, False) for rule in ("adamw", "sgd", "sgd_momentum")
             for stage in (0, 1, 2)]
    cases += [("adamw", 2, True, True), ("sgd_momentum", 1, True, True), ("rmsprop", 2, False, False)]
    diffs = parity_cases(comm, cases)
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert all_ranks_ok(comm, not bad), f"rank {comm.rank}: {bad or 'the other rank failed'}"


def test_ranks_agree_and_memory_is_sharded(comm):
    model, opt = train_shardopt(comm, "adamw", stage=2, steps=3)
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    other = mine.clone()
    comm.broadcast(other, root=0)
    mem, psi = opt.memory(), opt.padded_numel
    assert all_ranks_ok(comm, torch.equal(mine, other))
    assert mem.param_bytes == 4 * psi
    assert mem.optimizer_state_bytes == 8 * psi // 2      # each rank: m and v of half
    assert mem.grad_bytes == 4 * psi // 2                 # stage 2: only the gradient shard
    assert opt.last_step().comm_elements == 2 * psi       # docs/design.md: 2Ψ per step, stages 0-2


def test_model_mismatch_raises_on_every_rank(comm):
    model = make_model(vocab=11 + comm.rank)  # rank 1 built a bigger embedding
    with pytest.raises(shardopt.MismatchError) as info:
        shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm)
    msg = str(info.value)
    assert "the model differs across ranks" in msg
    assert "rank 0: 8 trainable parameters, #6 is 'embed.weight' [11, 7] Float cpu" in msg
    assert "rank 1: 8 trainable parameters, #6 is 'embed.weight' [12, 7] Float cpu" in msg
    assert info.value.kind == "Mismatch" and info.value.rank == comm.rank


def test_factory_path_on_two_ranks(comm):
    """A torch optimizer without a native rule over each rank's shard equals it unsharded."""
    from helpers import global_batch, loss_fn, max_diff, rank_slice
    model, ref = make_model(), make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), torch.optim.Adamax, comm=comm,
                                        stage=2, bucket_bytes=256, lr=0.02)
    ref_opt = torch.optim.Adamax(ref.parameters(), lr=0.02)
    for step in range(5):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, rank_slice(ids, comm.rank, 2), rank_slice(labels, comm.rank, 2)))
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, ids, labels).backward()
        ref_opt.step()
    assert all_ranks_ok(comm, max_diff(model, ref) <= TOL)


def test_freeing_a_communicator_after_async_collectives_does_not_deadlock(comm):
    """Issue 15: a communicator used to be destroyed with the GIL held while its worker, finishing
    a collective, dropped the last reference to a Python tensor and waited for the GIL. Rank 0
    frees its communicator while the collective still waits for rank 1 (which arrives late), so
    the worker finishes during the destructor; the optimizer is freed the same way. A regression
    hangs here until CTest's timeout."""
    import time
    for round_ in range(8):
        c = shardopt.init_from_env(timeout=60)
        model = make_model()
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=c, stage=2)
        if c.rank == 1:
            time.sleep(0.3)  # rank 0 is in the destructors by now
        t = torch.full((4096,), float(c.rank + round_))
        kept = c.all_reduce(t, async_op=True)            # a handle kept, waited after the free
        c.all_reduce(t * 2, async_op=True)               # a handle dropped: the worker holds
        del t, opt, model, c                             # the last reference to its tensor
        kept.wait()
    assert all_ranks_ok(comm, True)


# ---- the torch optimizer contract at N = 2 ------------------------------------------------------

def _units(model, stage):
    return {"units": [model.mid, model.out]} if stage == 3 else {}


def _train(model, opt, comm, first, last):
    from helpers import global_batch, loss_fn, rank_slice
    for step in range(first, last):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                             rank_slice(labels, comm.rank, comm.size)))
        opt.step()


def _train_torch(model, opt, first, last):
    from helpers import global_batch, loss_fn
    for step in range(first, last):
        ids, labels = global_batch(step)
        opt.zero_grad()
        loss_fn(model, ids, labels).backward()
        opt.step()


def _from_rank0(comm, value):
    t = torch.tensor([value], dtype=torch.float64)
    comm.broadcast(t, root=0)
    return t.item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_continues_in_torch_adamw(comm, stage):
    """3 shardopt steps, consolidate onto rank 0, its state_dict() into torch.optim.AdamW over a
    copy of the model: 3 more torch steps equal 3 more shardopt steps."""
    from helpers import max_diff
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, stage=stage,
                                        bucket_bytes=256, lr=0.01, weight_decay=0.05,
                                        **_units(model, stage))
    _train(model, opt, comm, 0, 3)
    opt.consolidate_state_dict(0)
    sd, message = None, ""
    try:  # rank 0 holds it; rank 1 is told to consolidate (no assert before the collectives)
        sd = opt.state_dict()
    except shardopt.UnsupportedError as e:
        message = str(e)
    ok = sd is not None if comm.rank == 0 else "consolidate_state_dict" in message
    opt.gather_full_parameters()
    ref = make_model(seed=1)
    ref.load_state_dict(model.state_dict())
    _train(model, opt, comm, 3, 6)
    opt.gather_full_parameters()
    diff = -1.0
    if comm.rank == 0 and sd is not None:
        # Exactly torch's layout: the same group keys, per-parameter keys and step type.
        probe = make_model()
        probe_opt = torch.optim.AdamW(probe.parameters(), lr=0.01, weight_decay=0.05)
        _train_torch(probe, probe_opt, 0, 1)
        expected = probe_opt.state_dict()
        ok = ok and sorted(sd["param_groups"][0]) == sorted(expected["param_groups"][0])
        ok = ok and sorted(sd["state"]) == sorted(expected["state"])
        for pid, entry in expected["state"].items():
            ok = ok and sorted(sd["state"][pid]) == sorted(entry)
            ok = ok and sd["state"][pid]["step"].shape == entry["step"].shape
            ok = ok and float(sd["state"][pid]["step"]) == 3.0
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.5)  # lr and decay come from sd
        ref_opt.load_state_dict(sd)
        _train_torch(ref, ref_opt, 3, 6)
        diff = max_diff(model, ref)
    diff = _from_rank0(comm, diff)
    assert all_ranks_ok(comm, ok and 0.0 <= diff <= TOL), f"stage {stage}: ok={ok} diff={diff}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_adamw_state_dict_continues_in_shardopt(comm, stage):
    """The reverse: 3 steps of torch.optim.AdamW (every rank alike), its state_dict() loaded into
    shardopt at N = 2, 3 more steps each."""
    import copy
    from helpers import max_diff
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.05)
    _train_torch(ref, ref_opt, 0, 3)
    sd = copy.deepcopy(ref_opt.state_dict())
    model = make_model(seed=1)
    model.load_state_dict(ref.state_dict())
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, stage=stage,
                                        bucket_bytes=256, lr=0.5, **_units(model, stage))
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.05
    _train_torch(ref, ref_opt, 3, 6)
    _train(model, opt, comm, 3, 6)
    opt.gather_full_parameters()
    diff = max_diff(model, ref)
    assert all_ranks_ok(comm, diff <= TOL), f"stage {stage}: {diff}"


def _shared_dir(comm):
    """A fresh directory both ranks see (rank 0 makes it)."""
    import tempfile
    path = tempfile.mkdtemp(prefix="shardopt-pytest-") if comm.rank == 0 else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
    comm.broadcast(buf, root=0)
    return bytes(buf[buf != 0].tolist()).decode()


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resume_with_client_state_and_scheduler(comm, stage):
    """save_checkpoint(dir, client_state, tensors) at N = 2; a new optimizer (another lr) and
    scheduler resume from it: param_groups take the saved hyper-parameters, and the run equals
    the uninterrupted one."""
    import shutil
    from helpers import max_diff

    def build(lr):
        model = make_model(seed=int(lr * 10))
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm,
                                            stage=stage, bucket_bytes=256, lr=lr,
                                            **_units(model, stage))
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8 ** s)

    def run(model, opt, sched, first, last):
        for step in range(first, last):
            _train(model, opt, comm, step, step + 1)
            sched.step()

    directory = _shared_dir(comm)
    model, opt, sched = build(0.01)
    run(model, opt, sched, 0, 3)
    rng = torch.full((3,), float(comm.rank))
    opt.save_checkpoint(directory, client_state={"step": 3, "scheduler": sched.state_dict()},
                        tensors={"rng": rng})
    run(model, opt, sched, 3, 6)
    opt.gather_full_parameters()

    resumed, ropt, rsched = build(0.5)
    client, tensors = ropt.load_checkpoint(directory, with_tensors=True)
    rsched.load_state_dict(client["scheduler"])
    ok = (client["step"] == 3 and torch.equal(tensors["rng"], rng)
          and ropt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.8 ** 3))
    info = shardopt.read_checkpoint_info(directory)
    ok = ok and info["world_size"] == 2 and info["stage"] == stage and info["step"] == 3
    ok = ok and info["client_state"]["step"] == 3
    run(resumed, ropt, rsched, 3, 6)
    ropt.gather_full_parameters()
    diff = max_diff(model, resumed)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert all_ranks_ok(comm, ok and diff <= TOL), f"stage {stage}: ok={ok} diff={diff}"


def test_load_checkpoint_module_takes_rank0s_buffers(comm):
    """load_checkpoint(module=) at N = 2 (C++'s LoadOptions::module_state): each rank's buffers
    differ when saved and when loaded; after the load every rank holds what rank 0 saved."""
    import shutil

    def build(fill):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        model[1].running_mean.fill_(fill)
        model[1].num_batches_tracked.fill_(int(fill))
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm,
                                            stage=2, lr=0.01)
        return model, opt

    directory = _shared_dir(comm)
    model, opt = build(1.0 + comm.rank)
    opt.save_checkpoint(directory, module=model)
    resumed, ropt = build(10.0 + comm.rank)
    ropt.load_checkpoint(directory, module=resumed)
    bn = resumed[1]
    ok = (torch.equal(bn.running_mean, torch.full((4,), 1.0))
          and bn.num_batches_tracked.item() == 1 and torch.equal(bn.running_var, torch.ones(4)))
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert all_ranks_ok(comm, ok), f"rank {comm.rank}: {bn.running_mean} {bn.num_batches_tracked}"


def test_tensor_parallel_grid_clipping(comm):
    """make_parallel_groups(tp=2), ZeroOptions.grid and mark_split: rank r holds
    rows [3r, 3r+3) of W (split) and all of v (replicated); the loss is the unsplit model's (the
    other rank's rows enter as constants), so each rank's gradients are its slice of the unsplit
    ones. The clipping norm must span both ranks and count v once: SGD with max_grad_norm then
    follows torch's clip_grad_norm_ on the unsplit model."""
    g = shardopt.make_parallel_groups(comm, tp=2)
    assert (g.tp.size, g.dp.size, g.tp_rank, g.layout) == (2, 1, comm.rank, "tp=2 x dp=1 x pp=1")
    torch.manual_seed(0)
    w_full, v_full = torch.randn(6, 4), torch.randn(4)
    r = g.tp_rank
    w = torch.nn.Parameter(w_full[3 * r:3 * r + 3].clone())
    v = torch.nn.Parameter(v_full.clone())
    ref_w, ref_v = torch.nn.Parameter(w_full.clone()), torch.nn.Parameter(v_full.clone())
    shardopt.mark_split(w, g.tp, 0, 6, 6)  # v, unmarked, is held whole
    assert shardopt.split_of(w) == (0, 6, 6) and shardopt.split_of(v) is None
    opt = shardopt.DistributedOptimizer([("w", w), ("v", v)], "sgd", comm=g.dp, lr=0.1,
                                        max_grad_norm=0.5, grid=g)
    ref_opt = torch.optim.SGD([ref_w, ref_v], lr=0.1)
    ok = True
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        rows = torch.zeros(6 * 4)
        g.tp.all_gather(w.detach().reshape(-1).contiguous(), rows)
        parts = list(rows.view(6, 4).split(3))
        parts[r] = w                                  # this rank's rows carry the gradient
        opt.zero_grad()
        opt.backward(((x * v) @ torch.cat(parts).t()).pow(2).sum())
        opt.step()
        ref_opt.zero_grad()
        ((x * ref_v) @ ref_w.t()).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_([ref_w, ref_v], 0.5)
        ref_opt.step()
        ok &= abs(opt.last_step().grad_norm - norm.item()) <= 1e-5 * norm.item()
    ok &= torch.allclose(w.detach(), ref_w.detach()[3 * r:3 * r + 3], atol=1e-6)
    ok &= torch.allclose(v.detach(), ref_v.detach(), atol=1e-6)
    assert all_ranks_ok(comm, bool(ok))


def test_pipeline_shared_embedding_and_grid_clipping(comm):
    """make_parallel_groups(pp=2), ZeroOptions.grid and mark_pipeline_shared: both stages
    hold a copy of the tied matrix E (the last stage's starts wrong: the optimizer copies the
    first's), stage 1 also w. Each stage's loss uses its own copy; the whole model's loss is their
    sum, so E's gradient is the sum of the two, which the optimizers add before the update; the
    clipping norm spans both stages and counts E once: SGD then follows torch on the whole model."""
    g = shardopt.make_parallel_groups(comm, pp=2)
    assert (g.pp.size, g.dp.size, g.pp_rank, g.embedding.size) == (2, 1, comm.rank, 2)
    torch.manual_seed(0)
    e_full, w_full = torch.randn(4, 3), torch.randn(3, 3)
    e = torch.nn.Parameter(e_full.clone() if g.pp_rank == 0 else torch.zeros(4, 3))
    shardopt.mark_pipeline_shared(e)
    named = [("embedding", e)]
    w = torch.nn.Parameter(w_full.clone())
    if g.pp_rank == 1:
        named.append(("w", w))
    opt = shardopt.DistributedOptimizer(named, "sgd", comm=g.dp, lr=0.1, max_grad_norm=0.5,
                                        grid=g)
    ok = torch.equal(e.detach(), e_full)
    ref_e, ref_w = torch.nn.Parameter(e_full.clone()), torch.nn.Parameter(w_full.clone())
    ref_opt = torch.optim.SGD([ref_e, ref_w], lr=0.1)
    loss0 = lambda x, e_: (x @ e_).pow(2).sum()                       # noqa: E731
    loss1 = lambda x, e_, w_: ((x @ e_) @ w_).tanh().sum()            # noqa: E731
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        opt.backward(loss0(x, e) if g.pp_rank == 0 else loss1(x, e, w))
        opt.step()
        ref_opt.zero_grad()
        (loss0(x, ref_e) + loss1(x, ref_e, ref_w)).backward()
        norm = torch.nn.utils.clip_grad_norm_([ref_e, ref_w], 0.5)
        ref_opt.step()
        ok &= abs(opt.last_step().grad_norm - norm.item()) <= 1e-5 * norm.item()
    ok &= torch.allclose(e.detach(), ref_e.detach(), atol=1e-6)
    if g.pp_rank == 1:
        ok &= torch.allclose(w.detach(), ref_w.detach(), atol=1e-6)
    assert all_ranks_ok(comm, bool(ok))
