"""shardopt.MemorySnapshots from Python on thread-ranks (shardopt.run_ranks): a restore continues
the uninterrupted run bitwise (parameters, optimizer state, the scheduler's learning rate, the
trainer's JSON and tensors), also when a rank's own copy is gone and its buddy sends it; nothing
to restore is None with the reason; remove() gives the memory back. Each "restart" is a new
model (other initial values), optimizer and MemorySnapshots over the same directory."""
import os
import threading

import pytest
import torch

import shardopt
from helpers import global_batch, loss_fn, make_model, rank_slice

_draws = threading.Lock()  # the thread-ranks share torch's default generator
WORLD = 2


def _setup(comm, stage, seed):
    torch.set_num_threads(1)
    with _draws:
        model = make_model(seed=seed)
    groups = [{"params": [(n, p) for n, p in model.named_parameters() if "bias" not in n]},
              {"params": [(n, p) for n, p in model.named_parameters() if "bias" in n],
               "weight_decay": 0.0}]
    opt = shardopt.DistributedOptimizer(groups, "adamw", comm=comm, stage=stage, lr=0.01,
                                        weight_decay=0.05, bucket_bytes=256)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(comm, model, opt, sched, first, last):
    for step in range(first, last):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                             rank_slice(labels, comm.rank, comm.size)))
        opt.step()
        sched.step()


def _params(model, opt):
    opt.gather_full_parameters()  # stage 3 holds none between steps
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainer(rank, step, sched):
    return ({"step": step, "scheduler": sched.state_dict()},
            {"position": torch.tensor([step, rank]), "noise": torch.randn(3)})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_restore_continues_bitwise(tmp_path, stage):
    """Snapshot after 3 steps, 3 more; a restart restores and trains the same 3 steps: the same
    parameters bitwise, and the trainer state as it was given."""
    out = {}

    def first_run(comm):
        model, opt, sched = _setup(comm, stage, seed=0)
        snaps = shardopt.MemorySnapshots(opt, dir=tmp_path / "snaps", ranks_per_host=1)
        _train(comm, model, opt, sched, 0, 3)
        client, tensors = _trainer(comm.rank, 3, sched)
        snaps.snapshot(client, tensors)
        _train(comm, model, opt, sched, 3, 6)
        snaps.wait()
        out[comm.rank] = dict(params=_params(model, opt), client=client, tensors=tensors,
                              lr=[g["lr"] for g in opt.param_groups], buddy=snaps.buddy(),
                              host_bytes=snaps.host_bytes())

    def restart(comm):
        model, opt, sched = _setup(comm, stage, seed=1)  # nothing may come from these values
        snaps = shardopt.MemorySnapshots(opt, dir=tmp_path / "snaps", ranks_per_host=1)
        state, report = snaps.restore()
        assert state is not None, report.reason
        client, tensors = state
        sched.load_state_dict(client["scheduler"])
        first = client["step"]
        lr = [g["lr"] for g in opt.param_groups]
        _train(comm, model, opt, sched, first, 6)
        out[comm.rank].update(r_params=_params(model, opt), r_client=client, r_tensors=tensors,
                              report=report, r_lr=lr)

    shardopt.run_ranks(WORLD, first_run, timeout=120)
    shardopt.run_ranks(WORLD, restart, timeout=120)
    for rank, o in out.items():
        assert o["buddy"] == (rank + 1) % WORLD and o["host_bytes"] > 0
        rep = o["report"]
        assert rep.restored and bool(rep) and rep.number == 0 and rep.step == 3, rep
        assert rep.from_buddy == 0 and rep.reason == "", rep
        assert o["r_client"] == o["client"]
        assert sorted(o["r_tensors"]) == ["noise", "position"]
        for k in o["tensors"]:
            assert torch.equal(o["r_tensors"][k], o["tensors"][k]), k
        assert o["r_lr"] == [0.01 / 4, 0.01 / 4]  # LambdaLR after 3 steps: 1 / (1 + 3)
        for name, value in o["params"].items():
            assert torch.equal(o["r_params"][name], value), (rank, name)


def test_a_lost_copy_comes_from_the_buddy(tmp_path):
    """Rank 0's own slots gone (its host's memory lost): its buddy, rank 1, sends them."""
    out = {}

    def first_run(comm):
        model, opt, sched = _setup(comm, 2, seed=0)
        snaps = shardopt.MemorySnapshots(opt, dir=tmp_path, ranks_per_host=1)
        _train(comm, model, opt, sched, 0, 2)
        snaps.snapshot({"step": 2})
        _train(comm, model, opt, sched, 2, 4)
        snaps.wait()
        out[comm.rank] = _params(model, opt)

    def restart(comm):
        model, opt, sched = _setup(comm, 2, seed=1)
        snaps = shardopt.MemorySnapshots(opt, dir=tmp_path, ranks_per_host=1)
        state, report = snaps.restore()
        assert state is not None, report.reason
        sched.last_epoch = state[0]["step"]  # LambdaLR's own counter (lr came with the snapshot)
        _train(comm, model, opt, sched, state[0]["step"], 4)
        got = _params(model, opt)
        out[comm.rank] = (report, [k for k in got if not torch.equal(got[k], out[comm.rank][k])])

    shardopt.run_ranks(WORLD, first_run, timeout=120)
    lost = [f for f in os.listdir(tmp_path) if f.startswith("rank0.")]
    assert any(".slot" in f for f in lost), sorted(os.listdir(tmp_path))
    for name in lost:
        os.remove(tmp_path / name)
    shardopt.run_ranks(WORLD, restart, timeout=120)
    for rank, (report, differing) in out.items():
        assert report.restored and report.from_buddy == 1 and report.step == 2, report
        assert differing == [], (rank, differing)


def test_nothing_to_restore_is_none_with_a_reason(tmp_path):
    out = {}

    def body(comm):
        _, opt, _ = _setup(comm, 2, seed=0)
        snaps = shardopt.MemorySnapshots(opt, dir=tmp_path / "fresh", ranks_per_host=1)
        out[comm.rank] = snaps.restore()

    shardopt.run_ranks(WORLD, body, timeout=120)
    for state, report in out.values():
        assert state is None
        assert not report.restored and report.number == -1, report
        assert report.reason.startswith("no snapshot"), report.reason


def test_remove_gives_the_memory_back(tmp_path):
    """After remove() the directory is gone and a new job finds nothing; the same object's next
    snapshot starts afresh."""
    out = {}
    where = tmp_path / "snaps"

    def body(comm):
        model, opt, sched = _setup(comm, 1, seed=0)
        snaps = shardopt.MemorySnapshots(opt, dir=where, ranks_per_host=1)
        _train(comm, model, opt, sched, 0, 1)
        snaps.snapshot({"step": 1})
        snaps.wait()
        timing = snaps.last_timing()
        snaps.remove()
        comm.barrier()
        gone = not where.exists()
        comm.barrier()
        again = shardopt.MemorySnapshots(opt, dir=where, ranks_per_host=1)
        state, report = again.restore()
        again.remove()
        out[comm.rank] = (timing, gone, state, report)

    shardopt.run_ranks(WORLD, body, timeout=120)
    for timing, gone, state, report in out.values():
        assert timing.blocking_s >= 0 and timing.background_s >= 0
        assert gone
        assert state is None and report.reason.startswith("no snapshot"), report


def test_refused_arguments(tmp_path):
    comm = shardopt.make_single_communicator()
    opt = shardopt.DistributedOptimizer(make_model().named_parameters(), "adamw", comm=comm)
    with pytest.raises(ValueError, match="ranks_per_host 2 does not divide"):
        shardopt.MemorySnapshots(opt, dir=tmp_path, ranks_per_host=2)
    with pytest.raises(ValueError, match="dir is empty"):
        shardopt.MemorySnapshots(opt, dir="")
    factory = shardopt.DistributedOptimizer(make_model().named_parameters(),
                                            lambda shard: torch.optim.SGD(shard, lr=0.1),
                                            comm=comm)
    with pytest.raises(shardopt.UnsupportedError, match="native rules only"):
        shardopt.MemorySnapshots(factory, dir=tmp_path)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        shardopt.MemorySnapshots(torch.optim.SGD(make_model().parameters(), lr=0.1), dir=tmp_path)
    snaps = shardopt.MemorySnapshots(opt, dir=tmp_path / "one")  # one rank: no buddy
    assert snaps.buddy() == -1 and snaps.host_bytes() == 0
    snaps.remove()


def _gloo_worker(rank, store, snap_dir, results):
    """One rank over a torch.distributed Gloo group: the snapshots' private communicators are
    split through torch.distributed.new_group (from_process_group's splitter), the buddy copy
    travels over them, and a second optimizer in the same process restores bitwise."""
    import datetime
    import gc

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    comm = shardopt.from_process_group()
    report = {"rank": rank}
    sub = comm.split(0, rank)
    report["split"] = (sub.backend, sub.rank, sub.size)
    del sub

    model, opt, sched = _setup(comm, 2, seed=0)
    snaps = shardopt.MemorySnapshots(opt, dir=snap_dir, ranks_per_host=1)
    _train(comm, model, opt, sched, 0, 2)
    snaps.snapshot({"step": 2}, {"rng": torch.get_rng_state()})
    _train(comm, model, opt, sched, 2, 4)
    snaps.wait()
    expected = _params(model, opt)
    report["buddy"] = snaps.buddy()
    del snaps

    model, opt, sched = _setup(comm, 2, seed=1)
    snaps = shardopt.MemorySnapshots(opt, dir=snap_dir, ranks_per_host=1)
    state, restored = snaps.restore()
    report["restored"] = (restored.restored, restored.step, state[0] if state else None)
    sched.last_epoch = 2
    _train(comm, model, opt, sched, 2, 4)
    got = _params(model, opt)
    report["differing"] = [k for k in got if not torch.equal(got[k], expected[k])]
    snaps.remove()
    del snaps, opt
    gc.collect()
    dist.destroy_process_group()
    results.put(report)


@pytest.mark.skipif(not shardopt.has_c10d, reason="built without the c10d adapter")
def test_snapshots_over_a_torch_gloo_group(tmp_path):
    import time

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_gloo_worker, args=(str(tmp_path / "store"),
                                                   str(tmp_path / "snaps"), results),
                               nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not procs.join(timeout=1):
            assert time.monotonic() < deadline, "2-rank Gloo run exceeded 240 s"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    reports = sorted((results.get() for _ in range(WORLD)), key=lambda r: r["rank"])
    for rank, r in enumerate(reports):
        assert r["split"] == ("gloo", rank, WORLD), r
        assert r["buddy"] == (rank + 1) % WORLD, r
        assert r["restored"] == (True, 2, {"step": 2}), r
        assert r["differing"] == [], r
