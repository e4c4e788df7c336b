"""Hugging Face transformers' BertForPreTraining, unchanged, trained through shardopt at stages 1, 2
and 3 (stage 3 without units: the optimizer derives them from the parameter names), equals
single-process torch.optim.AdamW on the global batch within 1e-6 after 10 steps (float32, dropout
off). The model ties cls.predictions.decoder.weight to the word embeddings and
cls.predictions.decoder.bias to cls.predictions.bias: each is one parameter to shardopt.
CTest runs it under mpirun -np 2 as python_hf_bert_np2 where transformers is installed (the pip
platform), and names the entry skipped elsewhere; the one-process `python` entry leaves it out."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shardopt  # noqa: E402
from helpers import STEPS, TOL, all_ranks_ok, rank_slice, world_or_single  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ROWS, SEQ, MASKED_PER_ROW = 8, 16, 3
# eps 1e-6, not AdamW's 1e-8: the gradient of each attention key bias is zero in exact arithmetic
# (adding the same q.b to every score of a softmax row changes nothing), so what it holds is
# rounding noise, ~1e-10, which depends on how the batch is split over ranks (as under DDP).
# Adam divides it by its own root mean square: with eps 1e-8 that noise moves those biases by
# ~1e-6 after 10 steps whatever the sharding (measured: 1.05e-6 at layer 1's key.bias, the same at
# stages 1, 2 and 3; every other tensor at most 2.4e-7); eps 1e-6 keeps it below the tolerance
# (9e-9 there, 7.8e-8 at most elsewhere).
HYPER = dict(lr=2e-3, weight_decay=0.01, eps=1e-6)


def make_model():
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(transformers.BertConfig(**CONFIG))
    model.train()  # dropout is 0: train mode is deterministic
    return model


def global_batch(step):
    """MASKED_PER_ROW masked tokens in every row, so each rank's mean loss weighs its rows as the
    global mean does (the gradients are averaged over ranks)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(5, CONFIG["vocab_size"], (ROWS, SEQ), generator=g)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(ROWS, SEQ).clone()
    lengths = torch.randint(SEQ // 2 + 2, SEQ + 1, (ROWS,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.full((ROWS, SEQ), -100)
    for r in range(ROWS):
        pos = torch.randperm(int(lengths[r]) - 1, generator=g)[:MASKED_PER_ROW] + 1
        labels[r, pos] = ids[r, pos]
        ids[r, pos] = 4  # a [MASK]-like id
    nsp = torch.randint(0, 2, (ROWS,), generator=g)
    return dict(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels,
                next_sentence_label=nsp)


def loss_of(model, batch):
    return model(**batch).loss


def train_shardopt(comm, stage):
    model = make_model()
    if stage == 3:  # no units=: automatic units from the names, nothing persistent
        opt = shardopt.DistributedOptimizer(params=model, optimizer="adamw", comm=comm, stage=3,
                                            bucket_bytes=16384, unit_policy={"persist_below": 0},
                                            **HYPER)
    else:
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", comm=comm,
                                            stage=stage, bucket_bytes=16384, **HYPER)
    for step in range(STEPS):
        batch = {k: rank_slice(v, comm.rank, comm.size) for k, v in global_batch(step).items()}
        opt.zero_grad()
        opt.backward(loss_of(model, batch))
        opt.step()
    if stage == 3:
        opt.gather_full_parameters()
    return model, opt


def train_torch():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, global_batch(step)).backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def comm():
    return world_or_single()


@pytest.fixture(scope="module")
def reference():
    return train_torch()


def test_the_model_ties_its_decoder():
    """What this file relies on: transformers ties both decoder tensors, so named_parameters()
    lists each once."""
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    assert "cls.predictions.decoder.weight" not in names and "cls.predictions.decoder.bias" not in names


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hf_bert_matches_torch_adamw(comm, reference, stage):
    model, opt = train_shardopt(comm, stage)
    want = reference.state_dict()
    got = model.state_dict()
    keys_ok = got.keys() == want.keys()
    diffs = {k: (got[k].double() - want[k].double()).abs().max().item() for k in want if k in got}
    worst = max(diffs, key=diffs.get)
    moved = max((want[k].double() - make_model().state_dict()[k].double()).abs().max().item()
                for k in want)
    tied = (model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
            and model.cls.predictions.decoder.bias is model.cls.predictions.bias)
    sharded = comm.size == 1 or stage < 3 or opt.memory().param_bytes < 4 * opt.padded_numel
    ok = keys_ok and diffs[worst] <= TOL and tied and sharded and moved > 1e-3
    assert all_ranks_ok(comm, ok), (
        f"rank {comm.rank}/{comm.size} stage {stage}: max |diff| {diffs[worst]:.3g} at {worst} "
        f"(tolerance {TOL}); keys equal {keys_ok}, tied {tied}, sharded {sharded}, "
        f"training moved the parameters by {moved:.3g}")
