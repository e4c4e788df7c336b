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
    assert opt.last_step().comm_elements == 2 * psi       # DESIGN.md: 2Ψ per step, stages 0-2


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
