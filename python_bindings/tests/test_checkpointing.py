"""torch.utils.checkpoint (reentrant and not) over encoder layers with shardopt: a model whose
nn.TransformerEncoderLayer blocks (dropout 0.1) are checkpointed trains to the same parameters as
the same model run plainly, through DistributedOptimizer at stages 2 and 3 (stage 3: the layers
are the units). CTest runs this file in one process (entry `python`) and under mpirun -np 2
(python_checkpointing_np2)."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shardopt
from helpers import all_ranks_ok, train_sharded_steps, world_or_single

VOCAB, WIDTH, STEPS = 11, 8, 5


class Encoder(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode  # "plain", "reentrant" or "non_reentrant"
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.1,
                                       batch_first=True) for _ in range(3)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            if self.mode == "plain":
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.mode == "reentrant")
        return self.head(x.mean(dim=1))


@pytest.fixture(scope="module")
def comm():
    return world_or_single()


def train(comm, stage, mode):
    torch.manual_seed(0)
    model = Encoder(mode)
    units = dict(units=list(model.layers)) if stage == 3 else {}
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm, stage=stage,
                                        bucket_bytes=512, lr=0.01, **units)
    torch.manual_seed(100 + comm.rank)  # each rank its own dropout masks
    train_sharded_steps(model, opt, comm, STEPS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_matches_plain_run(comm, stage, mode):
    plain = train(comm, stage, "plain")
    checkpointed = train(comm, stage, mode)
    torch.manual_seed(0)
    initial = Encoder("plain").state_dict()
    different = [k for k in plain if not torch.equal(plain[k], checkpointed[k])]
    moved = any(not torch.equal(plain[k], initial[k]) for k in plain)
    assert all_ranks_ok(comm, not different and moved), (
        f"rank {comm.rank}/{comm.size}: parameters differ from the plain run: {different[:4]}, "
        f"training moved them: {moved}")
