"""One torchft replica group (one process, group size 1) training BERT-tiny for pretraining.

Started by bench/torchft/compare.py, several at once, beside a torchft lighthouse; runs in the venv
of bench/torchft/venv.sh (torchft 0.2.0). The model has bert_pretrain --preset tiny's shape (2
layers, hidden 128, 2 heads, intermediate 512, post-LN, GELU, pooler and next-sentence head, MLM
logits at the masked positions only, decoder tied to the word embeddings, dropout 0.1) and trains
with its recipe (AdamW, weight decay 0.01 off bias and LayerNorm, global clipping at 1.0, linear
warm-up then linear decay to 0 at --steps). The batches are synthetic: replica r's batch at step s
depends on (seed, r, s) only, and so does its dropout, so a run is a function of which replicas
took part in each step, nothing else.

Fault tolerance is torchft's own (README, train_ddp.py): torchft.Manager with ProcessGroupGloo,
the gradients averaged over the replicas in the step's quorum by Manager.allreduce (see
average_gradients for why not torchft.DistributedDataParallel), the optimizer stepped only when
manager.should_commit(); a restarted replica heals from a live one (the Manager's default HTTP
checkpoint transport) at its first quorum.

Each committed step it took part in appends one JSON line to --log: step (the committed step
count, 1-based as bert_pretrain's metrics.jsonl), loss (this replica's local loss, repr),
participants, t (time.time()); at the end a line with the SHA-256 of its weights.
"""
import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from common import BertMLM  # noqa: E402  the peers' BERT encoder (bench/peers/common.py)

from torchft import Manager, ProcessGroupGloo  # noqa: E402

MASK_ID, FIRST_WORD = 4, 5  # [PAD] [UNK] [CLS] [SEP] [MASK] come first in bert_pretrain's vocab


class BertPretrain(BertMLM):
    """BertMLM plus BERT's pooler and next-sentence head; MLM logits at the masked positions."""

    def __init__(self, vocab, h, layers, heads, inter, max_pos, p):
        super().__init__(vocab, h, layers, heads, inter, max_pos, p)
        self.pooler, self.nsp = nn.Linear(h, h), nn.Linear(h, 2)
        for m in (self.pooler, self.nsp):
            self._init(m)

    def forward(self, ids, types, pos, labels, nsp_label):  # the loss, so DDP's hooks run
        s = ids.shape[1]
        x = self.word(ids) + self.pos(torch.arange(s).unsqueeze(0)) + self.tok_type(types)
        x = self.drop(self.ln(x))
        for layer in self.layers:
            x = layer(x)
        picked = x.gather(1, pos.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [b, predictions, h]
        y = self.head_ln(F.gelu(self.head_dense(picked)))
        logits = F.linear(y, self.word.weight, self.head_bias)
        mlm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        nsp = F.cross_entropy(self.nsp(torch.tanh(self.pooler(x[:, 0]))), nsp_label)
        return mlm + nsp


def batch(a, replica, step):
    """Replica `replica`'s sequences at step `step`: uniform words, two segments, 15% masked."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + replica * 100_003 + step)
    ids = torch.randint(FIRST_WORD, a.vocab, (a.batch, a.seq), generator=g)
    types = (torch.arange(a.seq) >= a.seq // 2).long().expand(a.batch, -1).contiguous()
    n = min(a.max_predictions, max(1, round(0.15 * a.seq)))
    pos = torch.stack([torch.randperm(a.seq, generator=g)[:n] for _ in range(a.batch)])
    labels = ids.gather(1, pos)
    ids = ids.scatter(1, pos, MASK_ID)
    nsp_label = torch.randint(0, 2, (a.batch,), generator=g)
    return ids, types, pos, labels, nsp_label


def lr_at(a, step):  # bert_pretrain's lr_at (examples/bert/options.cpp), linear schedule
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    rest = a.steps - a.warmup_steps
    return a.lr * max(0.0, (a.steps - step) / rest) if rest > 0 else a.lr


def param_groups(model, wd):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)  # biases and LayerNorm weights are 1-D
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def average_gradients(manager, model):
    """The gradients' mean over the quorum's replicas: Manager.allreduce on one flat buffer.

    Not torchft.DistributedDataParallel: in torchft 0.2.0 its comm hook fails on the survivors
    when a peer dies mid-step (`assert fut._fut`, torchft/ddp.py:76, AssertionError: the errored
    allreduce returns a work without that future), so every survivor died with the killed
    replica. Manager.allreduce records the error instead and should_commit() then says no."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True, help="replica groups in the job")
    ap.add_argument("--lighthouse", required=True, help="http://host:port")
    ap.add_argument("--log", required=True, help="JSON lines, one per committed step")
    ap.add_argument("--ready-dir", help="first start: wait here until every replica is up")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=2, help="sequences per replica")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--max-predictions", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-replicas", type=int, default=2, help="the Manager's min_replica_size")
    ap.add_argument("--timeout", type=float, default=30.0, help="Manager and Gloo timeout, s")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as bert_pretrain's ranks on this machine: one thread each

    torch.manual_seed(a.seed)  # the same initial weights on every replica
    model = BertPretrain(a.vocab, 128, 2, 2, 512, 512, 0.1)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    # Each replica group has its own store (torchft's requirement, torchelastic's in production).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.min_replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bert_{a.replica}", lighthouse_addr=a.lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)

    if a.ready_dir:  # all replicas heartbeating before the first quorum: it holds them all
        open(os.path.join(a.ready_dir, str(a.replica)), "w").close()
        while len(os.listdir(a.ready_dir)) < a.replicas:
            time.sleep(0.02)

    log = open(a.log, "a", buffering=1)
    while manager.current_step() < a.steps:
        opt.zero_grad(set_to_none=True)
        manager.start_quorum()  # asynchronous: a healer gets weights and step by should_commit()
        step = manager.current_step()
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        torch.manual_seed(a.seed * 1_000_003 + a.replica * 100_003 + step)  # dropout's
        loss = model(*batch(a, a.replica, step))
        loss.backward()
        average_gradients(manager, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if manager.should_commit():
            opt.step()
            # A healing replica read step 0 above (the asynchronous quorum had not yet told it
            # the step): its gradient is zeroed and it takes the step's weights, optimizer state
            # and learning rate from its source, so its loss here means nothing: not logged.
            if manager.is_participating():
                log.write(json.dumps({"step": manager.current_step(), "loss": repr(loss.item()),
                                      "participants": manager.num_participants(),
                                      "t": time.time()}) + "\n")
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    log.write(json.dumps({"final": h.hexdigest(), "step": manager.current_step(),
                          "t": time.time()}) + "\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
