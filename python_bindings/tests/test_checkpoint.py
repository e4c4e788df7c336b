"""Checkpoint round trip through the Python API. Skipped until the bindings carry
shardopt/checkpoint.hpp (bound in shardopt_py.cpp as _C.save_checkpoint, _C.load_checkpoint,
_C.consolidate_checkpoint)."""
import pytest
import torch

import shardopt
from helpers import TOL, global_batch, loss_fn, make_model, max_diff

pytestmark = pytest.mark.skipif(not hasattr(shardopt._C, "save_checkpoint"),
                                reason="checkpoint bindings not in this build yet")


@pytest.fixture(scope="module")
def comm():
    return shardopt.make_single_communicator()


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        ids, labels = global_batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, ids, labels))
        opt.step()


@pytest.mark.parametrize("save_stage,load_stage", [(2, 2), (2, 1), (1, 0)])
def test_resume_equals_uninterrupted(comm, tmp_path, save_stage, load_stage):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01,
                                        stage=save_stage)
    _train(model, opt, 3)
    opt.save_checkpoint(tmp_path / "ckpt")
    _train(model, opt, 3, first=3)

    resumed = make_model(seed=1)  # other initial values: all of them must come from the file
    ropt = shardopt.DistributedOptimizer(resumed.named_parameters(), "adamw", comm=comm, lr=0.01,
                                         stage=load_stage)
    ropt.load_checkpoint(tmp_path / "ckpt")
    _train(resumed, ropt, 3, first=3)
    if save_stage == load_stage:
        assert max_diff(model, resumed) == 0.0
    else:
        assert max_diff(model, resumed) <= TOL


def test_consolidated_file_loads_in_torch(comm, tmp_path):
    model = make_model()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01)
    _train(model, opt, 2)
    opt.save_checkpoint(tmp_path / "ckpt")
    shardopt.consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt")
    expected = dict(model.named_parameters())
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor.detach()), name


def test_missing_checkpoint_is_a_checkpoint_error(comm, tmp_path):
    opt = shardopt.DistributedOptimizer(make_model().named_parameters(), comm=comm)
    with pytest.raises(shardopt.CheckpointError, match="nowhere"):
        opt.load_checkpoint(tmp_path / "nowhere")
