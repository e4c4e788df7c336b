"""Two ranks over a torch.distributed Gloo group (torch.multiprocessing, no mpirun): shardopt
reuses the script's own process group through from_process_group()/default_communicator()."""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

import shardopt

pytestmark = pytest.mark.skipif(not shardopt.has_c10d,
                                reason="built without the c10d adapter (SHARDOPT_WITH_C10D=OFF)")

WORLD = 2
DEADLINE_S = 240


def _worker(rank, store, results):
    import datetime

    import torch.distributed as dist

    from helpers import TOL, all_ranks_ok, make_model, parity_cases
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    comm = shardopt.default_communicator()  # picks torch.distributed's default group
    report = {"backend": comm.backend, "rank": comm.rank, "size": comm.size}

    diffs = parity_cases(comm, [("adamw", 1, False, False), ("adamw", 2, True, True),
                                ("sgd", 1, False, False), ("sgd", 2, False, False),
                                ("sgd_momentum", 2, False, False)])
    report["parity_ok"] = all_ranks_ok(comm, all(v <= TOL for v in diffs.values()))
    report["diffs"] = {str(k): v for k, v in diffs.items()}

    # torch.distributed and shardopt share the group: interleaved calls stay in order.
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    comm.all_reduce(t, shardopt.ReduceOp.MAX)
    report["interleaved"] = t.tolist()

    try:
        shardopt.DistributedOptimizer(make_model(vocab=11 + rank).named_parameters(), "adamw",
                                      comm=comm)
        report["mismatch"] = None
    except shardopt.MismatchError as e:
        report["mismatch"] = str(e)
    dist.destroy_process_group()
    results.put(report)


def _run_two_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(str(tmp_path / "store"), results), nprocs=WORLD,
                               join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not procs.join(timeout=1):
            assert time.monotonic() < deadline, f"2-rank Gloo run exceeded {DEADLINE_S} s"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    return sorted((results.get() for _ in range(WORLD)), key=lambda r: r["rank"])


def test_two_ranks_over_a_torch_gloo_group(tmp_path):
    reports = _run_two_ranks(tmp_path)
    for rank, r in enumerate(reports):
        assert (r["backend"], r["rank"], r["size"]) == ("gloo", rank, WORLD)
        assert r["parity_ok"], r["diffs"]
        assert r["interleaved"] == [3.0, 3.0, 3.0]
        assert r["mismatch"] is not None, "rank 1's bigger model went unnoticed"
        assert "the model differs across ranks" in r["mismatch"]
        assert f"shardopt[rank {rank}/2]" in r["mismatch"]
