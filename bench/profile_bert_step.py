#!/usr/bin/env python3
"""One BERT step's forward and backward, phase by phase and op by op: the PyTorch peer
(bench/peers/baseline/torch_zero_bert.py, imported unchanged) against shardopt's example model
(bench/profile_bert_step, C++), same shapes (8 sequences x 128, all MLM logits), one process,
one thread each, no optimizer and no communication: the model's own work only.

Both sides run under torch's legacy CPU profiler. A forward op belongs to the innermost named
range around it ("phase::qkv", ...: the example's Note [Step phases]; for the peer, this script's
phased_forward, which repeats the peer's forward op for op inside the same ranges and is checked to
give bitwise its logits). A backward node belongs to the phase of the forward op that created it
(same sequence number). Times are per step in ms (the profiled steps' sum / their number), and
the unprofiled steps' median forward and backward in s.

    /usr/bin/python3 bench/profile_bert_step.py --cpp build/bench/profile_bert_step [--steps 5]
"""
import argparse
import collections
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

PHASES = ["embeddings", "qkv", "scores", "softmax", "context", "attention", "attn_out", "ffn", "layernorm",
          "head_transform", "decoder", "loss"]
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def load_peer(path):
    spec = importlib.util.spec_from_file_location("torch_zero_bert", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def phased_forward(m, ids):
    """The peer's BertMLM.forward (EncoderLayer, SelfAttention) op for op, inside phase ranges."""
    B, S = ids.shape
    with record_function("phase::embeddings"):
        pos = torch.arange(S).unsqueeze(0)
        e = m.word(ids) + m.pos(pos) + m.tok_type(torch.zeros_like(ids))
        with record_function("phase::layernorm"):
            e = m.ln(e)
        x = m.drop(e)
    for layer in m.layers:
        a = layer.attn

        def split(t):
            return t.view(B, S, a.heads, a.dh).transpose(1, 2)
        with record_function("phase::qkv"):
            q, k, v = split(a.q(x)), split(a.k(x)), split(a.v(x))
        with record_function("phase::scores"):
            att = (q @ k.transpose(-1, -2)) / math.sqrt(a.dh)
        with record_function("phase::softmax"):
            att = a.drop(att.softmax(dim=-1))
        with record_function("phase::context"):
            ctx = (att @ v).transpose(1, 2).reshape(B, S, a.h)
        with record_function("phase::attn_out"):
            y = x + layer.drop(a.o(ctx))
        with record_function("phase::layernorm"):
            x = layer.ln1(y)
        with record_function("phase::ffn"):
            y = x + layer.drop(layer.fc2(F.gelu(layer.fc1(x))))
        with record_function("phase::layernorm"):
            x = layer.ln2(y)
    with record_function("phase::head_transform"):
        x = F.gelu(m.head_dense(x))
    with record_function("phase::layernorm"):
        x = m.head_ln(x)
    with record_function("phase::decoder"):
        return F.linear(x, m.word.weight, m.head_bias)


def peer_events(a):
    peer = load_peer(a.peer)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = peer.BertMLM(a.vocab, 256, 4, 4, 1024, 512, 0.1)
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        mask = torch.rand(a.batch, a.seq, generator=g) < 0.15
        return torch.where(mask, 103, ids), torch.where(mask, ids, -100)

    m.eval()  # the mirror must be the peer's forward: bitwise the same logits without dropout
    ids, _ = batch()
    with torch.no_grad():
        if not torch.equal(phased_forward(m, ids), m(ids)):
            sys.exit("[profile] phased_forward no longer matches the peer's forward")
    m.train()
    fwd, bwd, events = [], [], []
    for s in range(a.warmup + 2 * a.steps):
        profiled = s >= a.warmup and (s - a.warmup) % 2 == 1
        ids, labels = batch()
        m.zero_grad(set_to_none=True)
        prof = torch.autograd.profiler.profile(use_kineto=False) if profiled else None
        if prof:
            prof.__enter__()
        t0 = time.perf_counter()
        with record_function("step::forward"):
            logits = phased_forward(m, ids)
            with record_function("phase::loss"):
                loss = F.cross_entropy(logits.view(-1, a.vocab), labels.view(-1), ignore_index=-100)
        t1 = time.perf_counter()
        with record_function("step::backward"):
            loss.backward()
        t2 = time.perf_counter()
        if prof:
            prof.__exit__(None, None, None)
            shift = s * 1e10  # us: each profile starts at 0; steps must not overlap
            events += [[e.name, e.sequence_nr, e.time_range.start + shift,
                        e.time_range.end + shift, e.thread] for e in prof.function_events]
        elif s >= a.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"fwd_s": sorted(fwd)[len(fwd) // 2], "bwd_s": sorted(bwd)[len(bwd) // 2],
            "events": events}


def cpp_events(a):
    os.makedirs(a.workdir, exist_ok=True)
    out = os.path.join(a.workdir, "profile_bert_step.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run([a.cpp, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
                    "--warmup", str(a.warmup), "--out", out], check=True, env=env)
    with open(out) as f:
        return json.load(f)


def by_phase(events, steps):
    """ms per step: {(part, phase): ms} and {(part, phase, op): self ms}, part forward/backward.

    Forward: a phase's time is its ranges' time less the phases nested in them. Backward: a node
    (evaluate_function range) takes the phase of the forward op that created it (sequence number;
    the last forward op recording a number is the one whose node got it), AccumulateGrad its own.
    Time outside every phase (or node) is "other"."""
    threads = collections.defaultdict(list)
    for name, seq, start, end, tid in events:
        threads[tid].append((start, -end, name, -1 if seq is None else seq))
    ranges = []  # [start, end, name, seq, parent index]
    for evs in threads.values():
        evs.sort()
        stack = []
        for start, neg_end, name, seq in evs:
            while stack and ranges[stack[-1]][1] <= start:
                stack.pop()
            ranges.append([start, -neg_end, name, seq, stack[-1] if stack else None])
            stack.append(len(ranges) - 1)
    part, phase, node = {}, {}, {}  # range index -> its step part, forward phase, backward node
    seq_phase = {}
    for i, (start, end, name, seq, up) in enumerate(ranges):  # parents come before children
        part[i] = name[len("step::"):] if name.startswith("step::") else part.get(up)
        phase[i] = name[len("phase::"):] if name.startswith("phase::") else phase.get(up)
        node[i] = i if name.startswith(BACKWARD_PREFIX) else node.get(up)
        if part[i] == "forward" and seq >= 0 and phase[i]:
            seq_phase[seq] = phase[i]
    node_seq = {}
    for i, (start, end, name, seq, up) in enumerate(ranges):
        if node[i] is not None and seq >= 0 and node[i] not in node_seq:
            node_seq[node[i]] = seq  # the node's own range, first inside the evaluate_function
    child = collections.Counter()
    for i, r in enumerate(ranges):
        if r[4] is not None:
            child[r[4]] += r[1] - r[0]
    times, ops = collections.Counter(), collections.Counter()
    for i, (start, end, name, seq, up) in enumerate(ranges):
        if part[i] not in ("forward", "backward"):
            continue
        if part[i] == "forward":
            where = phase[i] or "other"
        elif node[i] is None:
            where = "other"
        else:
            n = ranges[node[i]][2][len(BACKWARD_PREFIX):]
            where = ("accumulate_grad" if n.endswith("AccumulateGrad")
                     else seq_phase.get(node_seq.get(node[i]), "other"))
        own = end - start - child[i]
        times[(part[i], where)] += own
        if not name.startswith(("phase::", "step::", BACKWARD_PREFIX)):
            ops[(part[i], where, name)] += own
    scale = 1e-3 / steps  # us -> ms per step
    return ({k: v * scale for k, v in times.items()}, {k: v * scale for k, v in ops.items()})


def gemm_floor(a, rounds=3):
    """CPU seconds of one step's matrix products alone (the peer's shapes, fwd + bwd), through
    the same torch and BLAS both sides use: what no trainer that does the same work can go below.
    Process CPU time, the median of `rounds`, so that a shared machine inflates it less."""
    torch.set_num_threads(1)
    n, h, inter, v, heads, t = a.batch * a.seq, 256, 1024, a.vocab, 4, a.seq
    bh, d = a.batch * heads, h // heads
    r = torch.randn
    x, xi, w, wi, wo, W = r(n, h), r(n, inter), r(h, h), r(inter, h), r(h, inter), r(v, h)
    q, kt, p, vv = r(bh, t, d), r(bh, d, t), r(bh, t, t), r(bh, t, d)

    def linear(xin, weight):  # y = x W^T + b, then dx = dy W and dW = dy^T x (dy: y's shape)
        y = torch.addmm(torch.zeros(weight.shape[0]), xin, weight.t())
        return y, y @ weight, y.t() @ xin

    def bmm(A, B):  # C = A B, then dA = dC B^T and dB = A^T dC
        c = A @ B
        return c, c @ B.transpose(1, 2), A.transpose(1, 2) @ c

    def encoder():  # per layer: q, k, v, output, FFN in and out, scores, context; + the head's
        for _ in range(4):
            for _ in range(4):
                linear(x, w)
            linear(x, wi), linear(xi, wo), bmm(q, kt), bmm(p, vv)
        linear(x, w)
    parts = {"encoder + head transform": encoder, "decoder (logits, dX, dW)": lambda: linear(x, W)}
    out = {}
    for name, fn in parts.items():
        fn()
        ts = []
        for _ in range(rounds):
            c0 = time.process_time()
            fn()
            ts.append(time.process_time() - c0)
        out[name] = sorted(ts)[len(ts) // 2]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--cpp", default=os.path.join(here, "..", "build", "bench", "profile_bert_step"))
    ap.add_argument("--peer", default=os.path.join(here, "peers", "baseline", "torch_zero_bert.py"))
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="profiled steps (and as many timed ones)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=30, help="ops listed by self time")
    ap.add_argument("--reuse", action="store_true", help="summarise the last run's events again")
    ap.add_argument("--gemm-floor", action="store_true",
                    help="only the CPU seconds of one step's matrix products (see gemm_floor)")
    a = ap.parse_args()
    if a.gemm_floor:
        f = gemm_floor(a)
        for k, v in f.items():
            print(f"{k}: {v:.3f} CPU s")
        print(f"matrix products of one step: {sum(f.values()):.3f} CPU s")
        return

    saved = os.path.join(a.workdir, "profile_bert_events.json")
    if a.reuse:
        with open(saved) as f:
            sides = json.load(f)
    else:
        sides = {"peer": peer_events(a), "shardopt": cpp_events(a)}
        with open(saved, "w") as f:
            json.dump(sides, f)
    res = {k: by_phase(v["events"], a.steps) for k, v in sides.items()}
    print(f"\nforward / backward medians unprofiled (s): peer {sides['peer']['fwd_s']:.3f} / "
          f"{sides['peer']['bwd_s']:.3f}, shardopt {sides['shardopt']['fwd_s']:.3f} / "
          f"{sides['shardopt']['bwd_s']:.3f}")
    print("\nms per step, profiled:\n")
    print("| phase | peer fwd | shardopt fwd | diff | peer bwd | shardopt bwd | diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = collections.Counter()
    for ph in PHASES + ["accumulate_grad", "other"]:
        cells = []
        for part in ("forward", "backward"):
            p, o = (res[k][0].get((part, ph), 0.0) for k in ("peer", "shardopt"))
            total[(part, "peer")] += p
            total[(part, "shardopt")] += o
            cells.append(f"{p:.1f} | {o:.1f} | {o - p:+.1f}")
        print(f"| {ph} | {' | '.join(cells)} |")
    cells = [f"{total[(q, 'peer')]:.1f} | {total[(q, 'shardopt')]:.1f} | "
             f"{total[(q, 'shardopt')] - total[(q, 'peer')]:+.1f}" for q in ("forward", "backward")]
    print(f"| **total** | {' | '.join(cells)} |")
    print(f"\nself time by op and phase (ms per step), the {a.top} largest on either side:\n")
    print("| part | phase | op | peer | shardopt | diff |")
    print("|---|---|---|---:|---:|---:|")
    keys = set(k for r in res.values() for k in r[1])
    for k in sorted(keys, key=lambda k: -max(r[1].get(k, 0) for r in res.values()))[:a.top]:
        p, o = res["peer"][1].get(k, 0.0), res["shardopt"][1].get(k, 0.0)
        print(f"| {k[0]} | {k[1]} | {k[2]} | {p:.1f} | {o:.1f} | {o - p:+.1f} |")


if __name__ == "__main__":
    main()
