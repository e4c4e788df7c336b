#!/usr/bin/env python3
"""BERT (peer preset, synthetic batches) on emulated hosts (tests/multihost/emulated_hosts.sh):
flat vs hybrid sharding, stages 2 and 3, under a shaped inter-host link. Prints a markdown table:
median step time (slowest rank), bytes that crossed the inter-host link per step (the hosts'
veth counters, both directions, TCP/IP headers included), the same from the formula, and model
state per rank.

Bytes per step = (link bytes of a run with W+S steps - those of a run with W steps) / S, so the
launch, the initial broadcast and checkpoint-free set-up cancel out. Needs root (namespaces) and
the trainer built (scripts/build.sh --target bert_pretrain).

  bench/multihost_bench.py --rate 1gbit --steps 6 --warmup 2
  bench/multihost_bench.py --configs flat:2,hybrid:2 --rate 200mbit -- --mlm-positions masked
  bench/multihost_bench.py --table bench/results/raw/multihost_1gbit.json
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_trainer(args, layout, stage, steps, out_dir, rate):
    link = out_dir + ".link"
    cmd = [os.path.join(ROOT, "tests/multihost/emulated_hosts.sh"), "--hosts", str(args.hosts),
           "--per-host", str(args.per_host), "--timeout", str(args.timeout), "--link-bytes", link]
    if rate:
        cmd += ["--rate", rate]
    cmd += ["mpi", "--", args.trainer, "--preset", "peer", "--synthetic", "--stage", str(stage),
            "--steps", str(steps), "--timing-warmup", str(args.warmup),
            "--batch-size", str(args.batch), "--max-seq-length", "128", "--lr", "1e-4",
            "--warmup-steps", "0", "--max-grad-norm", "0", "--threads", "1", "--seed", "0",
            "--no-plot", "--progress", "lines", "--log-every", "1000", "--out", out_dir]
    if layout == "hybrid":
        cmd += ["--shard-group-size", str(args.per_host)]
    elif layout == "hybrid-bf16":
        cmd += ["--shard-group-size", str(args.per_host), "--reduce-dtype", "bf16"]
    elif layout == "flat-bf16":
        cmd += ["--reduce-dtype", "bf16"]
    cmd += args.trainer_args
    shutil.rmtree(out_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.time()
    with open(out_dir + ".log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        sys.exit(f"[multihost] {layout} stage {stage} failed (exit {rc}): see {out_dir}.log")
    tx = 0
    with open(link) as f:
        for line in f:
            tx += int(line.split()[1])  # each host's transmitted bytes: both directions in all
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    return tx, summary, time.time() - t0


def units_numel(layers=4, hidden=256, intermediate=1024):
    """Elements of the peer preset's stage-3 units: its encoder layers (examples/bert/model.cpp):
    Q, K, V, output projections with biases, the feed-forward pair, two LayerNorms."""
    attention = 4 * (hidden * hidden + hidden)
    ffn = hidden * intermediate + intermediate + intermediate * hidden + hidden
    return layers * (attention + ffn + 2 * 2 * hidden)


def formula_bytes(layout, stage, psi, hosts, per_host):
    """Inter-host bytes per step, all ranks together, of the direct model: a reduce-scatter or
    all-gather of n elements sends n/N to each other rank, N - L of which are on other hosts."""
    n = hosts * per_host
    grad_elem = 2 if layout.endswith("bf16") else 4
    if layout.startswith("flat"):
        # gradients reduce-scattered once, parameters all-gathered once; stage 3 gathers the
        # encoder layers (its units) again in backward, while the root unit (embeddings, heads)
        # stays gathered through forward and backward.
        gathered = psi + (units_numel() if stage == 3 else 0)
        per_rank = (psi * grad_elem + gathered * 4) * (n - per_host) / n
    else:
        # hybrid: only the all-reduce of this rank's shard (psi / L) among the H hosts crosses.
        per_rank = 2 * (psi / per_host) * (hosts - 1) / hosts * grad_elem
    return n * per_rank


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build/examples/bert_pretrain"))
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of every host's link")
    ap.add_argument("--configs", default="flat:2,hybrid:2,flat:3,hybrid:3",
                    help="layout:stage,... with layout flat, hybrid, flat-bf16 or hybrid-bf16")
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--timeout", type=int, default=580)
    ap.add_argument("--out", default=os.path.join(ROOT, "build/multihost_bench"))
    ap.add_argument("--table", help="print the table of a results.json again and exit")
    ap.add_argument("trainer_args", nargs="*")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            print_table(json.load(f))
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        layout, stage = config.split(":")
        stage = int(stage)
        name = f"{layout}_s{stage}"
        long_tx, summary, wall = run_trainer(args, layout, stage, args.warmup + args.steps,
                                             os.path.join(args.out, name), args.rate)
        short_tx, _, _ = run_trainer(args, layout, stage, args.warmup,
                                     os.path.join(args.out, name + "_short"), args.rate)
        psi = summary["parameters"]
        ms = summary.get("model_state_rank0", {})
        rows.append({
            "config": name, "layout": layout, "stage": stage,
            "step_s": summary["timing"]["median_step_s"],
            "link_bytes_per_step": (long_tx - short_tx) / args.steps,
            "formula_bytes_per_step": formula_bytes(layout, stage, psi, args.hosts, args.per_host),
            "model_state": sum(ms.get(k, 0) for k in ("params", "grads", "optimizer_state",
                                                      "buffers")),
            "peak_rss": max(summary["peak_rss_bytes"]), "parameters": psi,
            "loss_last": summary["last5_loss"], "wall_s": wall,
        })
        print(json.dumps(rows[-1]), flush=True)
    results = {"rate": args.rate, "hosts": args.hosts, "per_host": args.per_host,
               "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "rows": rows}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print_table(results)


def print_table(results):
    rows, hosts, per_host = results["rows"], results["hosts"], results["per_host"]
    for r in rows:  # the formula of this version of the script
        r["formula_bytes_per_step"] = formula_bytes(r["layout"], r["stage"], r["parameters"],
                                                    hosts, per_host)
    flat = {r["stage"]: r for r in rows if r["layout"] == "flat"}
    print(f"\n{hosts} hosts x {per_host} ranks, inter-host link {results['rate']} (tc tbf), "
          f"BERT peer preset ({rows[0]['parameters'] / 1e6:.2f} M parameters), "
          f"batch {results['batch']} per rank, {results['steps']} timed steps after "
          f"{results['warmup']}\n")
    print("| run | median step (s) | link MB/step (measured) | link MB/step (formula) | "
          "vs flat | model state MB/rank | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = flat.get(r["stage"])
        ratio = (f"{r['link_bytes_per_step'] / base['link_bytes_per_step']:.2f}x"
                 if base and base is not r else "1")
        print(f"| {r['config']} | {r['step_s']:.3f} | {r['link_bytes_per_step'] / 1e6:.1f} | "
              f"{r['formula_bytes_per_step'] / 1e6:.1f} | {ratio} | {r['model_state'] / 1e6:.1f} | "
              f"{r['peak_rss'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
