"""The single-process communicator and the analytic estimator from Python."""
import datetime

import pytest
import torch

import shardopt
from helpers import make_model


def test_single_communicator():
    comm = shardopt.make_single_communicator()
    assert (comm.rank, comm.size, comm.backend) == (0, 1, "single")
    assert comm.capabilities.native_avg
    t = torch.arange(4.0)
    assert comm.all_reduce(t, shardopt.ReduceOp.AVG) is None  # synchronous: nothing to wait on
    assert torch.equal(t, torch.arange(4.0))
    out = torch.zeros(4)
    work = comm.all_gather(t, out, async_op=True)
    work.wait(timeout=5)
    assert work.is_completed() and "all_gather" in work.description
    assert torch.equal(out, t)
    shard = torch.zeros(4)
    comm.reduce_scatter(t, shard)
    assert torch.equal(shard, t)
    comm.barrier()
    comm.timeout = 12.5
    assert comm.timeout == datetime.timedelta(seconds=12.5)


def test_init_from_env_single(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID", "RANK",
                "SHARDOPT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    comm = shardopt.init_from_env(timeout=datetime.timedelta(seconds=7))
    assert comm.backend == "single" and comm.size == 1
    assert comm.timeout == datetime.timedelta(seconds=7)


@pytest.mark.parametrize("stage,per_param", [(0, 16.0), (1, 8 + 8 / 4), (2, 4 + 12 / 4),
                                             (3, 16 / 4)])
def test_estimate_matches_the_memory_model(stage, per_param):
    # docs/stages.md: fp32 AdamW, P = G = 4, K = 8; N = 4.
    psi = 1_000_000
    e = shardopt.estimate(psi, world=4, stage=stage)
    assert e.device.model_state == per_param * psi
    assert e.host.total == 0
    assert e.comm_elements == (3 if stage == 3 else 2) * psi
    assert (e.p, e.g, e.k) == (4, 4, 8)


def test_estimate_offload_and_precision():
    e = shardopt.estimate(1_000_000, world=2, stage=2, precision="bf16", offload="cpu")
    assert e.k == 12 and e.p == 2
    assert e.device.optimizer_state == 0 and e.host.optimizer_state == 12 * 500_000


def test_bert_counts_and_model_estimate():
    assert shardopt.bert_parameter_count("base") == 110_106_428
    model = make_model()
    e = shardopt.estimate_model(model, world=2, stage=1)
    psi = sum(p.numel() for p in model.parameters())
    assert e.device.params == 4 * psi
    assert e.device.optimizer_state == 8 * ((psi + 1) // 2)
