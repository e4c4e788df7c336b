"""CPU AdamW implementations side by side (issue 39), each against a bandwidth probe measured in
the same process: shardopt's fused AdamW (the Python bindings, one rank, stage 0), DeepSpeed's
DeepSpeedCPUAdam (adamw_mode, JIT-built on first use into TORCH_EXTENSIONS_DIR),
torch.optim.AdamW(fused=True) on CPU and torch.optim.AdamW(foreach=True); and the 8-bit AdamWs
(issue 56): shardopt's "adamw8bit", torchao's AdamW8bit and bitsandbytes' AdamW8bit (both from
bench/eightbit/site.sh), with the optimizer state each keeps per parameter.

Every optimizer steps one fp32 parameter of NUMEL elements in a training loop (zero_grad(),
backward through loss = dot(p, g), step(): Note [What each row times]); with --model bert-base,
BERT-base's 199 parameter tensors (109.5M elements; --sizes is then ignored), loss = sum of dot(p_i, g_i); a step moves at least
28 B per parameter (read p, g, m, v; write p, m, v), so the bound is 28 B over
the bandwidth of a STREAM-style triad (a = b + s*c, 12 B per element, torch.add on the same
threads) of the same size. Each (size, threads) runs in a fresh process with OMP_NUM_THREADS set.

Usage (pip platform: the venv's Python, the bindings built in build-pip/):
  PYTHONPATH=build-pip/python OMP_NUM_THREADS=1 <venv>/bin/python bench/optimizer_kernels.py \
      [--sizes 21e6,110e6] [--threads 1,2] [--reps 5] [--json OUT.json]
  8-bit: PYTHONPATH=build-pip/python:$(bench/eightbit/site.sh) ... --impls \
      torch_fused,shardopt_fused,shardopt_adamw8bit,torchao_adamw8bit,bnb_adamw8bit
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ADAM_BYTES = 28
# 8-bit AdamW: read p, g, the two moments' codes; write p and the codes (4+4+4+1+1+1+1 B), the
# block maxima (4 B per 256) aside.
ADAM8_BYTES = 16
TRIAD_BYTES = 12
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def median_of(fn, reps, warmup=2):
    """Median seconds of `fn` (which returns the seconds it timed) over `reps` calls after
    `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(reps))


def timed(fn, reps, warmup=2):
    def once():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return median_of(once, reps, warmup)


# BERT-base's parameter tensors (embeddings, 12 layers, pooler), elements each.
def bert_base_sizes():
    h, f = 768, 3072
    layer = [h * h, h] * 4 + [h, h] + [f * h, f, h * f, h] + [h, h]
    return [30522 * h, 512 * h, 2 * h, h, h] + layer * 12 + [h * h, h]


MODEL = "flat"  # --model


def model_sizes(numel):
    return bert_base_sizes() if MODEL == "bert-base" else [numel]


def make_params(torch, numel):
    return [torch.nn.Parameter(torch.randn(n) * 0.02) for n in model_sizes(numel)]


# Note [What each row times]
# A training loop calls zero_grad(), backward and step(). Every implementation gets its gradient
# from the same graph, loss = dot(p, g) with g fixed, whose backward makes p's gradient (a fresh
# tensor, g itself by value) as a real model's does:
# - "step()": step() alone, after an untimed zero_grad() + backward; what a user sees per step.
#   shardopt checks the gradients for NaN/Inf during backward (Note [The non-finite check during
#   backward] in src/engine/local_update.cpp), so its step() is the update;
# - "zero_grad + backward + step": the three timed together, so work an implementation moves
#   into backward (shardopt's copy of the gradient into its flat buffer and its check) is
#   counted; "backward alone" is the graph with no optimizer attached (p.grad reset each time),
#   the part every implementation shares.
# Repeating step() without a backward would time something else for shardopt: step() consumes
# the gradients (Note [step() consumes the gradients] in src/engine/engine.cpp), so every later
# step() zeroes them and checks the zeros (what the first version of this bench measured).
def loss_of(torch, ps, gs):
    return sum(torch.dot(p, g) for p, g in zip(ps, gs))


def loop_timer(torch, numel, opt, ps):
    gs = [torch.randn(p.numel()) * 1e-3 for p in ps]

    def step_only():
        opt.zero_grad()
        loss_of(torch, ps, gs).backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    def whole():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_of(torch, ps, gs).backward()
        opt.step()
        return time.perf_counter() - t0
    return step_only, whole


def state_bytes(torch, opt):
    """Bytes of the optimizer state a torch-style optimizer keeps: every tensor in opt.state,
    tensor subclasses (torchao's OptimState8bit) by their inner tensors (codes, scales, map)."""
    total = 0

    def add(v):
        nonlocal total
        if not isinstance(v, torch.Tensor):
            return
        if hasattr(v, "__tensor_flatten__") and type(v) is not torch.Tensor:
            names, _ = v.__tensor_flatten__()
            for n in names:
                add(getattr(v, n))
        else:
            total += v.numel() * v.element_size()
    for st in opt.state.values():
        for v in st.values():
            add(v)
    return total


def run_shardopt8(torch, numel, memory):
    import shardopt
    p = make_params(torch, numel)
    opt = shardopt.DistributedOptimizer([(f"p{i}", t) for i, t in enumerate(p)], "adamw8bit",
                                        comm=shardopt.make_single_communicator(), stage=0, **HYPER)
    memory["shardopt_adamw8bit"] = lambda: opt.memory().optimizer_state_bytes
    return loop_timer(torch, numel, opt, p)


def run_torchao8(torch, numel, memory):
    from torchao.optim import AdamW8bit
    p = make_params(torch, numel)
    opt = AdamW8bit(p, **HYPER)  # block_size 256, as shardopt's
    memory["torchao_adamw8bit"] = lambda: state_bytes(torch, opt)
    return loop_timer(torch, numel, opt, p)


def run_bnb8(torch, numel, memory):
    import bitsandbytes as bnb
    p = make_params(torch, numel)
    opt = bnb.optim.AdamW8bit(p, **HYPER)  # blockwise, 256 per block
    memory["bnb_adamw8bit"] = lambda: state_bytes(torch, opt)
    return loop_timer(torch, numel, opt, p)


def run_shardopt(torch, numel, phases):
    """`update` is the fused kernel alone; `check` the non-finite check's time in step(), `check
    in backward` its time during backward (one read of the gradients, 4 B/param)."""
    import shardopt
    p = make_params(torch, numel)
    opt = shardopt.DistributedOptimizer([(f"p{i}", t) for i, t in enumerate(p)], "adamw",
                                        comm=shardopt.make_single_communicator(),
                                        stage=0, **HYPER)
    step_only, whole = loop_timer(torch, numel, opt, p)

    def step_recorded():
        t = step_only()
        s = opt.last_step()
        phases.append((s.update_s, s.check_s, s.check_backward_s))
        return t
    return step_recorded, whole


def run_deepspeed(torch, numel):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    p = make_params(torch, numel)
    return loop_timer(torch, numel, DeepSpeedCPUAdam(p, adamw_mode=True, **HYPER), p)


def run_torch(torch, numel, memory=None, **flags):
    p = make_params(torch, numel)
    opt = torch.optim.AdamW(p, **HYPER, **flags)
    if memory is not None:
        memory["torch_fused"] = lambda: state_bytes(torch, opt)
    return loop_timer(torch, numel, opt, p)


def backward_alone(torch, numel):
    ps = make_params(torch, numel)
    gs = [torch.randn(p.numel()) * 1e-3 for p in ps]

    def once():
        for p in ps:
            p.grad = None
        t0 = time.perf_counter()
        loss_of(torch, ps, gs).backward()
        return time.perf_counter() - t0
    return once


def child(numel, threads, reps, which):
    import torch
    torch.set_num_threads(threads)
    a, b, c = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    triad_s = timed(lambda: torch.add(b, c, alpha=0.5, out=a), reps)
    del a, b, c
    bandwidth = TRIAD_BYTES * numel / triad_s
    rows = [dict(impl="triad", numel=numel, threads=threads, seconds=triad_s, gbs=bandwidth / 1e9)]

    def row(impl, seconds, nbytes=ADAM_BYTES):
        return dict(impl=impl, numel=numel, threads=threads, seconds=seconds,
                    gbs=nbytes * numel / seconds / 1e9,
                    of_bound=(nbytes * numel / bandwidth) / seconds)
    rows.append(dict(row("backward alone (dot graph)", median_of(backward_alone(torch, numel), reps)),
                     gbs=None, of_bound=None))
    phases, memory = [], {}
    impls = {"shardopt_fused": lambda: run_shardopt(torch, numel, phases),
             "deepspeed_cpu_adam": lambda: run_deepspeed(torch, numel),
             "torch_fused": lambda: run_torch(torch, numel, memory, fused=True),
             "torch_foreach": lambda: run_torch(torch, numel, foreach=True),
             "shardopt_adamw8bit": lambda: run_shardopt8(torch, numel, memory),
             "torchao_adamw8bit": lambda: run_torchao8(torch, numel, memory),
             "bnb_adamw8bit": lambda: run_bnb8(torch, numel, memory)}
    # Note [Interleaved rounds]: every implementation is built first, then each round times one
    # step of each in an order rotated by one per round, so a drift of this shared machine's
    # bandwidth (other tenants, frequency) lands on every row alike instead of on whichever ran
    # during it.
    built, failed = {}, []
    for name in which:
        try:
            built[name] = impls[name]()
        except Exception as e:  # a peer that does not run is reported, not dropped
            failed.append(dict(impl=name, numel=numel, threads=threads,
                               error=f"{type(e).__name__}: {e}"))
    names = list(built)
    times = {name: ([], []) for name in names}
    for r in range(2 + reps):  # two untimed warm-up rounds
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for kind in (0, 1):  # step() alone, then the whole loop
            for name in order:
                t = built[name][kind]()
                if r >= 2:
                    times[name][kind].append(t)
    for name in names:
        step_times, whole_times = times[name]
        nbytes = ADAM8_BYTES if name.endswith("8bit") else ADAM_BYTES
        rows.append(row(f"{name} step()", statistics.median(step_times), nbytes))
        if name in memory:  # after the steps: every state exists
            rows[-1]["state_bpp"] = memory[name]() / numel
        if name == "shardopt_fused":  # the timed steps' phases (the last `reps`)
            for i, (phase, nbytes) in enumerate((("update phase (the kernel)", ADAM_BYTES),
                                                 ("check in step()", 4),
                                                 ("check in backward", 4))):
                t = statistics.median(x[i] for x in phases[-reps:])
                # Under a millisecond: bookkeeping, no pass over the gradients to rate.
                rows.append(row(f"shardopt {phase}", t, nbytes) if t > 1e-3 else
                            dict(impl=f"shardopt {phase}", numel=numel, threads=threads,
                                 seconds=t, gbs=None, of_bound=None))
        rows.append(dict(row(f"{name} zero_grad + backward + step",
                             statistics.median(whole_times)), gbs=None, of_bound=None))
    rows += failed
    print(json.dumps(rows))


def table(rows):
    lines = ["| impl | params | threads | median step (ms) | GB/s at 28 B/param (8-bit: 16) "
             "| bound / time | state B/param |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['numel'] / 1e6:.0f}M | {r['threads']} | error: {r['error'][:80]} | | |")
        elif r["impl"] == "triad":
            lines.append(f"| triad (12 B/elem) | {r['numel'] / 1e6:.0f}M | {r['threads']} | "
                         f"{r['seconds'] * 1e3:.1f} | {r['gbs']:.2f} (probe) | 1 |")
        elif r["gbs"] is None:  # a time with no byte count of its own
            lines.append(f"| {r['impl']} | {r['numel'] / 1e6:.0f}M | {r['threads']} | "
                         f"{r['seconds'] * 1e3:.1f} | | |")
        else:
            bpp = f"{r['state_bpp']:.3f}" if "state_bpp" in r else ""
            lines.append(f"| {r['impl']} | {r['numel'] / 1e6:.0f}M | {r['threads']} | "
                         f"{r['seconds'] * 1e3:.1f} | {r['gbs']:.2f} | {r['of_bound']:.2f} | {bpp} |")
    return "\n".join(lines)


# Note [Isolated rounds]
# Interleaving implementations in one process (Note [Interleaved rounds]) shares one heap: an
# optimizer whose gradients are alive while another's backward runs makes that backward map fresh
# pages, and which one pays depends on when each frees its gradients (torch's at zero_grad(),
# shardopt's at the end of step()); with BERT-base's 199 tensors the one measured second took ~3x
# the page faults of the same loop alone. --isolate R runs each implementation alone in its own
# process, R rounds in rotated order, and reports each row's median over the rounds.
def isolated_rounds(run_child, which, size, threads, rounds):
    per_round = []
    for r in range(rounds):
        order = which[r % len(which):] + which[:r % len(which)]
        for impl in order:
            got = run_child(impl, size, threads)
            if got is None:
                return None
            per_round.append(got)
    merged = {}
    for got in per_round:
        for row in got:
            merged.setdefault(row["impl"], []).append(row)
    rows = []
    for impl, same in merged.items():
        row = dict(same[0])
        if "seconds" in row:
            row["seconds"] = statistics.median(x["seconds"] for x in same)
            scale = same[0]["seconds"] / row["seconds"] if row["seconds"] else 1
            for key in ("gbs", "of_bound"):
                if row.get(key) is not None:
                    row[key] = row[key] * scale
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="21e6,110e6")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impls", default="shardopt_fused,deepspeed_cpu_adam,torch_fused,torch_foreach")
    ap.add_argument("--json")
    ap.add_argument("--model", choices=("flat", "bert-base"), default="flat",
                    help="one tensor of each --sizes, or BERT-base's tensors")
    ap.add_argument("--isolate", type=int, default=0, metavar="ROUNDS",
                    help="each implementation in a process of its own, ROUNDS rounds of one "
                         "process per implementation in rotated order: Note [Isolated rounds]")
    ap.add_argument("--child", nargs=3, metavar=("NUMEL", "THREADS", "REPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    which = args.impls.split(",")
    global MODEL
    MODEL = args.model
    if args.model == "bert-base":
        args.sizes = str(sum(bert_base_sizes()))
    if args.child:
        child(int(args.child[0]), int(args.child[1]), int(args.child[2]), which)
        return 0
    rows = []
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    def run_child(impls, size, threads):
        env = dict(os.environ, OMP_NUM_THREADS=threads, DS_ACCELERATOR="cpu")
        out = subprocess.run([sys.executable, __file__, "--impls", impls, "--model", args.model,
                              "--child", str(int(float(size))), threads, str(args.reps)],
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return None
        return json.loads(out.stdout.strip().splitlines()[-1])

    for size in args.sizes.split(","):
        for threads in args.threads.split(","):
            got = isolated_rounds(run_child, which, size, threads, args.isolate) \
                if args.isolate else run_child(args.impls, size, threads)
            if got is None:
                return 1
            rows += got
            print(table([r for r in rows if r["numel"] == int(float(size))
                         and r["threads"] == int(threads)]).split("\n", 2)[2], flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(f"\nload average before {' '.join(load_before)}, after {' '.join(load_after)} "
          f"({os.cpu_count()} CPUs)\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, load_before=load_before, load_after=load_after), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
