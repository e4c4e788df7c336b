"""What every peer in bench/peers/ shares: the peer BERT, its data, the launch, the timed loop,
the parity check against single-process torch.optim.AdamW, and the one-line JSON report.

The model and data are those of baseline/torch_zero_bert.py (same module tree, same
initialisation order, so one seed gives the same weights; bench/peers/check_common.py verifies it
when that file is present). Each peer supplies a `Peer` (how to build it, one forward+backward, one
optimizer step, its full parameters and its model-state accounting); `main()` does the rest.
"""
import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {  # vocab, hidden, layers, heads, intermediate, seq
    "peer": dict(vocab=30522, hidden=256, layers=4, heads=4, intermediate=1024, seq=128),
    "tiny": dict(vocab=512, hidden=32, layers=2, heads=2, intermediate=64, seq=16),
}


# ---- model: the peer BERT (post-LN encoder, MLM head tied to the word embeddings) --------------

class SelfAttention(nn.Module):
    def __init__(self, h, heads, p):
        super().__init__()
        self.h, self.heads, self.dh = h, heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h),
                                          nn.Linear(h, h))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, self.dh).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = self.drop(((q @ k.transpose(-1, -2)) / math.sqrt(self.dh)).softmax(dim=-1))
        return self.o((att @ v).transpose(1, 2).reshape(b, s, h))


class EncoderLayer(nn.Module):
    def __init__(self, h, heads, inter, p):
        super().__init__()
        self.attn = SelfAttention(h, heads, p)
        self.ln1 = nn.LayerNorm(h, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(h, inter), nn.Linear(inter, h)
        self.ln2 = nn.LayerNorm(h, eps=1e-12)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = self.ln1(x + self.drop(self.attn(x)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class BertMLM(nn.Module):
    def __init__(self, vocab, h, layers, heads, inter, max_pos, p):
        super().__init__()
        self.word = nn.Embedding(vocab, h)
        self.pos = nn.Embedding(max_pos, h)
        self.tok_type = nn.Embedding(2, h)
        self.ln = nn.LayerNorm(h, eps=1e-12)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList([EncoderLayer(h, heads, inter, p) for _ in range(layers)])
        self.head_dense = nn.Linear(h, h)
        self.head_ln = nn.LayerNorm(h, eps=1e-12)
        self.head_bias = nn.Parameter(torch.zeros(vocab))  # the decoder's weight is self.word's
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.drop(self.ln(self.word(ids) + self.pos(pos) + self.tok_type(torch.zeros_like(ids))))
        for layer in self.layers:
            x = layer(x)
        x = self.head_ln(F.gelu(self.head_dense(x)))
        return F.linear(x, self.word.weight, self.head_bias)  # logits at every position


def build_model(a):
    torch.manual_seed(a.seed)  # the same weights on every rank and in the reference
    return BertMLM(a.vocab, a.hidden, a.layers, a.heads, a.intermediate, a.max_pos, a.dropout)


def mlm_loss(model, batch):
    inp, labels = batch
    logits = model(inp)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def make_batches(a, rank):
    """Rank `rank`'s batches, as torch_zero_bert.py makes them (uniform tokens, 15% masked)."""
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)
    out = []
    for _ in range(a.warmup + a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        mask = torch.rand(a.batch, a.seq, generator=g) < a.mask_prob
        out.append((torch.where(mask, torch.full_like(ids, a.mask_id), ids),
                    torch.where(mask, ids, torch.full_like(ids, -100))))
    return out


# ---- launch ---------------------------------------------------------------------------------

def init_env(a):
    """torch.distributed's variables from mpirun's (or torchrun's, left as they are)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
        os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    if "RANK" not in os.environ:
        sys.exit("[peer] no rank: start under mpirun or torchrun (RANK/WORLD_SIZE unset)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(a.port)
    torch.set_num_threads(a.threads)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def arg_parser(doc, variants):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True, choices=variants)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="peer")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--parity", action="store_true",
                    help="dropout off, no warm-up: after --steps steps compare every parameter (and "
                         "step 1's averaged gradient) with single-process torch.optim.AdamW on the "
                         "same global batches; also counts bytes handed to collectives")
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="with --parity: exit 1 when a difference exceeds this (0: report only)")
    return ap


def finish_args(a):
    for k, v in SHAPES[a.shape].items():
        setattr(a, k, v)
    a.max_pos, a.mask_prob, a.mask_id = 512, 0.15, 103 % a.vocab
    if a.parity:
        a.dropout, a.warmup = 0.0, 0
    return a


# ---- measurement ----------------------------------------------------------------------------

class CommCounter:
    """Bytes each rank hands to torch.distributed's collectives, by wrapping the module's functions
    (peers look them up at call time). All-reduce counts twice its size (reduce-scatter +
    all-gather, the docs/design.md convention: stages 0-2 move 2 Psi), reduce-scatter its input,
    all-gather its output. Collectives issued from C++ (DDP's reducer) are not seen."""

    NAMES = {"all_reduce": 2, "reduce_scatter_tensor": 1, "_reduce_scatter_base": 1,
             "reduce_scatter_single": 1, "all_gather_single": 1,  # FSDP2's, torch >= 2.10
             "reduce_scatter": 1, "all_gather_into_tensor": 1, "_all_gather_base": 1,
             "all_gather": 1, "broadcast": 1, "reduce": 1, "all_to_all_single": 1}

    def __init__(self):
        self.bytes = 0
        self.by_op = {}
        for name, factor in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn, factor))

    def _wrap(self, name, fn, factor):
        def counted(*args, **kwargs):
            # reduce-scatter and all-gather(_into_tensor) take (output, input): count the larger
            ts = [t for t in list(args[:2]) + list(kwargs.values()) if torch.is_tensor(t)]
            lists = [x for x in args[:2] if isinstance(x, (list, tuple))]
            n = max([t.numel() * t.element_size() for t in ts] + [0])
            if name in ("all_gather", "reduce_scatter") and lists:
                n = sum(t.numel() * t.element_size() for t in lists[0])
            self.bytes += factor * n
            self.by_op[name] = self.by_op.get(name, 0) + factor * n
            return fn(*args, **kwargs)
        return counted


def live_tensor_bytes(exclude):
    """Bytes of every distinct tensor storage Python can reach (gc), less `exclude` (the batches):
    one method for every Python peer's model state, taken after a step."""
    skip = {t.untyped_storage().data_ptr() for b in exclude for t in b}
    seen, total = set(), 0
    with warnings.catch_warnings():  # deprecated torch objects warn when inspected
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if torch.is_tensor(o)]
    for o in objects:
        try:
            if o.is_meta:
                continue
            s = o.untyped_storage()
            ptr = s.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # wrapper subclasses (DTensor) own no storage: their local tensor is counted
        if ptr == 0 or ptr in skip or ptr in seen:
            continue
        seen.add(ptr)
        total += s.nbytes()
    return total


def reference_params(a, world):
    """Single-process torch.optim.AdamW on the global batches; the loss is the mean of the ranks'
    losses, as data parallelism averages gradients. Returns (params by name, step-1 grads)."""
    model = build_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    per_rank = [make_batches(a, r) for r in range(world)]
    grads1 = None
    for i in range(a.steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(mlm_loss(model, per_rank[r][i]) for r in range(world)) / world
        loss.backward()
        if grads1 is None:
            grads1 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads1


def max_diff(mine, ref):
    missing = sorted(set(ref) - set(mine))
    if missing:
        raise RuntimeError(f"the peer did not return parameters {missing[:4]} (of {len(missing)})")
    worst = max(ref, key=lambda n: (mine[n].float() - ref[n]).abs().max().item())
    return (mine[worst].float() - ref[worst]).abs().max().item(), worst


class Peer:
    """What one peer implements. build() returns nothing; the rest are called by run()."""
    name = "?"

    def build(self, a, model, rank, world):
        raise NotImplementedError

    def forward_backward(self, batch):  # returns the loss (a tensor)
        raise NotImplementedError

    def step(self):
        raise NotImplementedError

    def zero_grad(self):
        pass

    def full_params(self):  # name -> full tensor, every rank calls it (it may gather)
        raise NotImplementedError

    def full_grads(self):  # name -> full averaged gradient after backward, or None if not reachable
        return None

    def first_step_grads(self):  # where full_grads() is None: step 1's averaged gradient as read
        return None              # after step 1 (every rank calls it; rank 0's answer is checked)

    def sent_bytes(self):  # bytes this rank sent into collectives so far by the peer's own count,
        return None        # or None: counted at torch.distributed's calls (CommCounter)

    def model_state(self):  # {category: bytes} by the peer's own accounting, or {} for none
        return {}

    def extra_state_bytes(self):  # tensors outside Python's reach (DDP's C++ gradient buckets)
        return 0


def run(peer, a):
    rank, world = init_env(a)
    counter = CommCounter() if a.parity else None
    model = build_model(a)
    n_params = sum(p.numel() for p in model.parameters())
    peer.build(a, model, rank, world)
    batches = make_batches(a, rank)
    step_t, cpu_t, fb_t, opt_t, losses, grads1 = [], [], [], [], [], None
    comm_before = 0

    def sent():
        own = peer.sent_bytes()
        return counter.bytes if own is None else own
    for i, batch in enumerate(batches):
        if counter is not None and i == 1:
            comm_before = sent()  # step 0 also holds set-up collectives
        c0, t0 = time.process_time(), time.perf_counter()
        peer.zero_grad()
        loss = peer.forward_backward(batch)
        t1 = time.perf_counter()
        if a.parity and i == 0:
            grads1 = peer.full_grads()
        t1b = time.perf_counter()
        peer.step()
        t2, c2 = time.perf_counter(), time.process_time()
        if a.parity and i == 0 and grads1 is None:
            grads1 = peer.first_step_grads()
        losses.append(loss.item())
        if i >= a.warmup:
            step_t.append(t2 - t0 - (t1b - t1)); fb_t.append(t1 - t0); opt_t.append(t2 - t1b)
            cpu_t.append(c2 - c0)
    res = dict(rank=rank, step_s=statistics.median(step_t), cpu_s=statistics.median(cpu_t),
               fwdbwd_s=statistics.median(fb_t), opt_s=statistics.median(opt_t),
               loss_first=losses[0], loss_last=losses[-1])
    if not a.parity:
        # Note [Model state point]: one more, untimed step, measured after its backward and after
        # its optimizer step; the larger total counts (peers free gradients at different points:
        # DeepSpeed after the step, torch at the next zero_grad).
        peer.zero_grad()
        peer.forward_backward(batches[0])
        points = [(peer.model_state(), live_tensor_bytes(batches))]
        peer.step()
        points.append((peer.model_state(), live_tensor_bytes(batches)))
        res["own_state"] = max((p[0] for p in points), key=lambda d: sum(d.values()))
        res["live_bytes"] = max(p[1] for p in points) + peer.extra_state_bytes()
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if counter is not None and a.steps > 1:
        res["comm_bytes_per_step"] = (sent() - comm_before) / (a.steps - 1)
        res["comm_by_op"] = counter.by_op
        res["comm_counted"] = "torch.distributed" if peer.sent_bytes() is None else "own"
    if a.parity:
        full = peer.full_params()
        if rank == 0:
            ref, ref_g1 = reference_params(a, world)
            res["param_diff"], res["param_worst"] = max_diff(full, ref)
            if grads1 is not None:
                res["grad1_diff"], res["grad1_worst"] = max_diff(grads1, ref_g1)
                res["grad1_max"] = max(g.abs().max().item() for g in ref_g1.values())
    rows = [None] * world
    dist.all_gather_object(rows, res)
    ok = True
    if rank == 0:
        out = dict(peer=peer.name, variant=a.variant, world=world, n_params=n_params,
                   shape=a.shape, batch=a.batch, steps=a.steps, warmup=a.warmup,
                   parity=a.parity, ranks=rows)
        print("[peer-result] " + json.dumps(out), flush=True)
        if a.parity and a.tolerance > 0:
            worst = max(rows[0]["param_diff"], rows[0].get("grad1_diff", 0.0))
            ok = worst <= a.tolerance
            print(f"[peer] {peer.name} {a.variant}: parity {'ok' if ok else 'FAILED'}: max |param - "
                  f"reference| {rows[0]['param_diff']:.3g} ({rows[0]['param_worst']}), step-1 "
                  f"gradient {rows[0].get('grad1_diff', float('nan')):.3g}, tolerance "
                  f"{a.tolerance:g}", flush=True)
    flag = torch.tensor([1 if ok else 0])
    dist.broadcast(flag, 0)
    dist.barrier()
    return 0 if flag.item() else 1


def exit_now(rc):
    """Ends the process once the report is out, without interpreter teardown. Note [Peer
    teardown]: torch's Gloo threads sometimes abort (FSDP2: "terminate called without an active
    exception") or hang (DDP, see bench/compare_peers.py) while Python tears down; every rank has
    passed the final barrier, so nothing is lost by skipping it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
