"""Checkpoints through the Python API in one process: resume equals the uninterrupted run, the
consolidated file loads in torch (strictly, with the model's buffers, frozen layer and tied
decoder when saved with module=), and a missing checkpoint is a CheckpointError. The 2-rank
cases (client state, scheduler, stage 3) are in test_mpi.py."""
import pytest
import torch
import torch.nn as nn

import shardopt
from helpers import TOL, global_batch, loss_fn, make_model, max_diff


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


class NormNet(nn.Module):
    """A BatchNorm (buffers, an integer one among them), a frozen layer and a decoder tied to
    the embedding: what a plain parameter dump cannot load strictly."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(7)
        self.decoder = nn.Linear(7, 11)
        self.decoder.weight = self.embed.weight

    def forward(self, ids):
        return self.decoder(self.norm(torch.tanh(self.frozen(self.embed(ids).mean(dim=1)))))


def test_consolidated_model_loads_strictly_with_module_state(comm, tmp_path):
    torch.manual_seed(0)
    model = NormNet()
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, lr=0.01)
    _train(model, opt, 3)
    opt.save_checkpoint(tmp_path / "ckpt", module=model)
    shardopt.consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "model.pt")
    torch.manual_seed(1)
    fresh = NormNet()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    expected = model.state_dict()
    assert expected["norm.num_batches_tracked"].item() == 3
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # load_checkpoint(module=) restores the buffers and the frozen layer as well.
    torch.manual_seed(2)
    other = NormNet()
    other_opt = shardopt.DistributedOptimizer(other.named_parameters(), "adamw", comm=comm)
    other_opt.load_checkpoint(tmp_path / "ckpt", module=other)
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # The restore is C++'s LoadOptions::module_state: what the checkpoint does not store is a
    # MismatchError (a ValueError) before anything changes, as in C++.
    opt.save_checkpoint(tmp_path / "plain")
    torch.manual_seed(3)
    third = NormNet()
    before = {n: t.clone() for n, t in third.state_dict().items()}
    third_opt = shardopt.DistributedOptimizer(third.named_parameters(), "adamw", comm=comm)
    with pytest.raises(shardopt.MismatchError, match="stores no module tensor 'frozen.bias'"):
        third_opt.load_checkpoint(tmp_path / "plain", module=third)
    for name, tensor in third.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # Without module= the file holds the optimizer's parameters only.
    shardopt.consolidate_checkpoint(tmp_path / "plain", tmp_path / "plain.pt")
    assert sorted(torch.load(tmp_path / "plain.pt")) == sorted(
        n for n, p in model.named_parameters() if p.requires_grad)
