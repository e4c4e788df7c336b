"""gpt_train's GPT under torch's own pipelining (torch.distributed.pipelining), for
bench/pipeline_vs_torch.py: the same model, weights, rows, optimizer and learning-rate schedule as
`gpt_train --pp 2` (examples/gpt), on 2 ranks over Gloo, one thread each.

  python bench/torch_pipelining.py --schedule 1f1b --layers 4 --hidden 64 --heads 4 --steps 5

What is reproduced from examples/gpt, and where it is defined there:
- the weights (Note [Weights by name], model.cpp): every parameter drawn from an mt19937 CPU
  generator seeded with seed ^ fnv1a64(key), float32 normal_(0, std), std 0.02 (the c_proj weights
  0.02 / sqrt(2 x layers)), biases 0, LayerNorm weights 1; a split parameter (at t = 1 still split
  over a group of one) index by index along its split dimension, keyed "name[i]": c_attn and c_fc
  rows, attn.c_proj and mlp.c_proj columns, wte rows (the vocabulary padded to 128); a whole one
  keyed by its name (wpe);
- the rows (Note [Rows by number], corpus.cpp): row n is the seq + 1 bytes at splitmix64(splitmix64
  (seed) ^ n) mod (bytes - seq); micro-batch j of step s holds rows (s*M + j)*B + i;
- the step (train.cpp): loss = mean next-token cross entropy, each micro-batch's scaled by 1/M
  (torch's scale_grads); the tied wte's gradient summed over the first and the last stage; clipping
  at --max-grad-norm over the whole model with wte counted once (coefficient max / (norm + 1e-6),
  applied below 1); AdamW betas (0.9, 0.95), eps 1e-8, weight decay on parameters of dim >= 2 only;
  lr_at (options.cpp): linear warm-up, then linear decay to 0 at --steps.
Dropout is 0 on both sides (their streams differ).

Run without --rank it launches its 2 ranks (subprocesses over Gloo) and prints one JSON line per
step of rank 0's view: {"step", "loss", "grad_norm", "lr", "step_s"} and its phases ("data_s":
the rows, "schedule_s": schedule.step, "tail_s": the tied gradient, clipping, AdamW and the loss), then one "summary" line with
each rank's max RSS. --dump-weights DIR writes each rank's initial parameters (torch.save) for a
bitwise check against gpt_train's.
"""
import argparse
import json
import math
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

M64 = (1 << 64) - 1


def fnv1a64(s):
    h = 1469598103934665603
    for ch in s.encode():
        h = ((h ^ ch) * 1099511628211) & M64
    return h


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def padded_vocab(vocab, tp=1):
    multiple = 128 * tp
    return (vocab + multiple - 1) // multiple * multiple


# ---- data: Note [Rows by number] ----------------------------------------------------------------

def read_corpus(path):
    p = Path(path)
    if p.is_dir():
        # std::sort of std::filesystem::path compares element by element
        files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.parts)
    else:
        files = [p]
    return b"".join(f.read_bytes() for f in files)


def rows(corpus, seed, first, count, seq):
    starts = len(corpus) - seq
    ids, targets = [], []
    for n in range(first, first + count):
        at = splitmix64(splitmix64(seed) ^ n) % starts
        window = corpus[at:at + seq + 1]
        ids.append(list(window[:-1]))
        targets.append(list(window[1:]))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


# ---- model: examples/gpt/model.cpp at t = 1 ----------------------------------------------------

class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads, self.dh = heads, h // heads
        self.ln_1 = nn.LayerNorm(h)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(h, 3 * h)  # rows head by head: q, k, v of head 0, then 1...
        self.attn.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(h, 4 * h)
        self.mlp.c_proj = nn.Linear(4 * h, h)

    def attention(self, x):
        b, t, _ = x.shape
        qkv = self.attn.c_attn(x).view(b, t, self.heads, 3, self.dh).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dh)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, self.heads * self.dh)
        return self.attn.c_proj(y)

    def forward(self, x):
        h = x + self.attention(self.ln_1(x))
        return h + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(h)), approximate="tanh"))


class Stage(nn.Module):
    """Layers [first, last); the first stage adds wte and wpe, the last ln_f and the head (its own
    copy of wte). Parameter names are the whole model's, as in gpt_train."""

    def __init__(self, a, first, last, first_stage, last_stage):
        super().__init__()
        self.first_stage, self.last_stage = first_stage, last_stage
        self.wte = nn.Embedding(padded_vocab(a.vocab), a.hidden)
        if first_stage:
            self.wpe = nn.Embedding(a.n_ctx, a.hidden)
        self.h = nn.Module()
        for i in range(first, last):
            self.h.add_module(str(i), Block(a.hidden, a.heads))
        if last_stage:
            self.ln_f = nn.LayerNorm(a.hidden)
        self.vocab = a.vocab

    def forward(self, x):
        if self.first_stage:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for block in self.h.children():
            x = block(x)
        if not self.last_stage:
            return x
        logits = F.linear(self.ln_f(x), self.wte.weight)
        if logits.size(-1) > self.vocab:  # the padding rows never enter the softmax
            logits = logits.masked_fill(torch.arange(logits.size(-1)) >= self.vocab, float("-inf"))
        return logits


# Split dimension of each split parameter at t = 1 (Note [Tensor-parallel GPT]).
def split_dim(name):
    if name == "wte.weight" or name.endswith(("c_attn.weight", "c_fc.weight")):
        return 0
    if name.endswith("c_proj.weight"):
        return 1
    return None


def init_weights(stage, seed, layers):
    residual_std = 0.02 / math.sqrt(2.0 * layers)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
                continue
            if name.startswith("ln_") or ".ln_" in name:
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith("c_proj.weight") else 0.02

            def draw(shape, key):
                g = torch.Generator().manual_seed(seed ^ fnv1a64(key))
                return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            dim = split_dim(name)
            if dim is None:
                p.copy_(draw(p.shape, name))
                continue
            for i in range(p.size(dim)):
                slot = p.select(dim, i)
                slot.copy_(draw(slot.shape, f"{name}[{i}]"))  # padding rows: none at vocab 256


def lr_at(a, step):
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    rest = a.steps - a.warmup_steps
    if rest <= 0:
        return a.lr
    return a.lr * max(0.0, (a.steps - step) / rest)


def max_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---- one rank ------------------------------------------------------------------------------------

def rank_main(a):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleavedZeroBubble)
    torch.set_num_threads(1)
    rank, world = a.rank, 2
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{a.port}")
    rss_runtime = max_rss_mb()
    dtype = torch.float64 if a.dtype == "float64" else torch.float32
    each = a.layers // world
    first_stage, last_stage = rank == 0, rank == world - 1
    model = Stage(a, rank * each, (rank + 1) * each, first_stage, last_stage)
    init_weights(model, a.seed, a.layers)
    model.to(dtype)
    if a.dump_weights:
        os.makedirs(a.dump_weights, exist_ok=True)
        torch.save(dict(model.named_parameters()), f"{a.dump_weights}/rank{rank}.pt")
    stage = PipelineStage(model, rank, world, torch.device("cpu"))

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    if a.schedule == "1f1b":
        schedule = Schedule1F1B(stage, a.micro_batches, loss_fn=loss_fn, scale_grads=True)
    else:  # ZB-H1: the zero-bubble schedule with one stage per rank
        schedule = ScheduleInterleavedZeroBubble([stage], a.micro_batches, loss_fn=loss_fn,
                                                 scale_grads=True)
    params = list(model.named_parameters())
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    wte = model.wte.weight
    # The clipping norm counts wte once: the first stage's copy.
    counted = [p for n, p in params if not (n == "wte.weight" and not first_stage)]
    corpus = read_corpus(a.corpus)
    out = open(a.out_json, "w") if a.out_json else None
    rows_per_step = a.micro_batches * a.batch_size
    for step in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        ids, targets = rows(corpus, a.seed, step * rows_per_step, rows_per_step,
                            a.max_seq_length)
        for group in opt.param_groups:
            group["lr"] = lr_at(a, step)
        opt.zero_grad(set_to_none=False)
        losses = []
        t1 = time.perf_counter()
        if first_stage:
            schedule.step(ids)
        else:
            schedule.step(target=targets, losses=losses)
        t2 = time.perf_counter()
        dist.all_reduce(wte.grad)  # the tied embedding: both copies' gradients summed
        sq = torch.zeros(1, dtype=torch.float64)
        for p in counted:
            sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        norm = math.sqrt(sq.item())
        if a.max_grad_norm > 0:
            coef = a.max_grad_norm / (norm + 1e-6)
            if coef < 1:
                for _, p in params:
                    p.grad.mul_(coef)
        opt.step()
        loss = torch.tensor([sum(l.item() for l in losses) / a.micro_batches if last_stage else 0.0],
                            dtype=torch.float64)
        dist.all_reduce(loss)
        seconds = time.perf_counter() - t0
        if out:
            out.write(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": norm,
                                  "lr": lr_at(a, step), "step_s": seconds,
                                  "data_s": t1 - t0, "schedule_s": t2 - t1,
                                  "tail_s": seconds - (t2 - t0)}) + "\n")
            out.flush()
    if out:
        out.write(json.dumps({"summary": True, "rank": rank, "max_rss_mb": max_rss_mb(),
                              "rss_after_init_mb": rss_runtime}) + "\n")
        out.close()
    dist.barrier()
    dist.destroy_process_group()


def read_checkpoint(folder):
    """Every parameter of a gpt_train checkpoint (each manifest.json under `folder`, one per
    pipeline rank): {name: [tensor, ...]} (wte twice at p = 2)."""
    import numpy as np
    out = {}
    for manifest in sorted(Path(folder).rglob("manifest.json")):
        m = json.loads(manifest.read_text())
        files = {f["rank"]: f for f in m["files"]}
        for p in m["parameters"]:
            flat = np.empty(int(np.prod(p["shape"])), dtype=p["dtype"])
            for rank, shard_begin, param_begin, numel in p["pieces"]:
                f = files[rank]
                sec = next(s for s in f["sections"] if s["name"] == "param")
                item = np.dtype(sec["dtype"]).itemsize
                with open(manifest.parent / f["path"], "rb") as fh:
                    fh.seek(sec["offset"] + shard_begin * item)
                    flat[param_begin:param_begin + numel] = np.frombuffer(
                        fh.read(numel * item), dtype=sec["dtype"])
            out.setdefault(p["name"], []).append(torch.from_numpy(flat).view(p["shape"]))
    return out


def check_weights(a):
    """Bitwise: gpt_train's weights (a checkpoint after one step at --lr 0) against this init."""
    saved = read_checkpoint(a.check_weights)
    each, mine = a.layers // 2, {}
    for rank in range(2):  # wte is drawn alike on both stages
        model = Stage(a, rank * each, (rank + 1) * each, rank == 0, rank == 1)
        init_weights(model, a.seed, a.layers)
        mine.update((n, p.detach()) for n, p in model.named_parameters())
    count = sum(len(ts) for ts in saved.values())
    bad = [f"{n} (max diff {(t - mine[n]).abs().max().item():.3e})"
           for n, ts in saved.items() for t in ts if n in mine and not torch.equal(t, mine[n])]
    bad += [f"{n}: not in this model" for n in saved if n not in mine]
    bad += [f"{n}: not in the checkpoint" for n in mine if n not in saved]
    print(f"check-weights: {count} tensors compared ({len(mine)} parameters, wte on both "
          f"stages), {len(bad)} differ" + "".join(f"\n  {b}" for b in bad))
    return 0 if not bad else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, argv):
    """Both ranks as subprocesses; prints rank 0's step lines and both ranks' summaries."""
    port = free_port()
    tmp = Path(a.tmp or "/tmp") / f"torch_pipelining_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(r), "--port",
                               str(port), "--out-json", str(tmp / f"rank{r}.jsonl")], env=env)
             for r in range(2)]
    rcs = [p.wait() for p in procs]
    if any(rcs):
        sys.exit(f"torch_pipelining: a rank failed (exit codes {rcs})")
    for r in range(2):
        for line in (tmp / f"rank{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if r == 0 or rec.get("summary"):
                print(line, flush=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=str(Path(__file__).resolve().parent.parent
                                           / "tests/assets/corpus"))
    p.add_argument("--schedule", choices=["1f1b", "zb-h1"], default="1f1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=128, help="positions (the preset's)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--dump-weights", default="")
    p.add_argument("--tmp", default="")
    p.add_argument("--check-weights", default="", metavar="CHECKPOINT",
                   help="compare gpt_train's weights (after one step at --lr 0) bitwise and exit")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out-json", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    if args.layers % 2:
        sys.exit(f"torch_pipelining: --layers {args.layers} must be even (2 stages)")
    if args.check_weights:
        sys.exit(check_weights(args))
    if args.rank < 0:
        launch(args, sys.argv[1:])
    else:
        rank_main(args)
