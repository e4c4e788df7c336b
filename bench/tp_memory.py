#!/usr/bin/env python3
"""Memory per rank of bert_pretrain under tensor parallelism (issue 40), against the formula.

Runs the trainer (synthetic batches, AdamW fp32, ZeRO stage 3 by default) on the BERT-base shape at
(t, d) = (1, 4), (2, 2) and (4, 1), with and without --sequence-parallel, a few steps each, and
prints per rank:
  - model state (the optimizer's memory(): parameters, gradients, Adam's two moments) against the
    formula 16 B x (P_split / t + P_replicated) / d at stage 3 (4 B each of the fp32 parameter,
    its gradient and the two moments; the split parameters hold 1/t of the padded vocabulary's
    embedding and decoder bias, a/t heads and f/t intermediate features of every layer);
  - activations: the run's peak of live tensor storage (the trainer's memory tracker) minus the
    optimizer's whole memory() (model state and its buffers), against the (1, d) run at the same
    micro-batch per rank. Rank 0's figures (the ranks are alike within a layout).
The formula is computed here from the shapes, independently of the trainer.

  bench/tp_memory.sh [--preset base] [--stage 3] [--batch-size 8] [--seq 128] [--steps 3]
"""
import argparse
import json
import os
import subprocess
import sys

SHAPES = {  # hidden, layers, heads, intermediate (shardopt::estimate::bert_preset)
    "tiny": (128, 2, 2, 512), "mini": (256, 4, 4, 1024), "small": (512, 4, 8, 2048),
    "base": (768, 12, 12, 3072), "large": (1024, 24, 16, 4096),
}
VOCAB, POSITIONS, TYPES = 30522, 512, 2


def padded(vocab, t):
    m = 128 * t
    return (vocab + m - 1) // m * m


def parameters(preset, t):
    """(split elements this rank holds, replicated elements) of the trainer's --synthetic model
    (no NSP head: no pooler, no seq_relationship)."""
    h, layers, _, f = SHAPES[preset]
    v = padded(VOCAB, t) if t > 1 else VOCAB
    split = v * h + v  # word embeddings (also the tied decoder) and the decoder bias
    split += layers * (3 * (h * h + h) + h * f + f + f * h + h * h)  # qkv, ffn in, ffn out, attn out
    replicated = POSITIONS * h + TYPES * h + 2 * h  # position, token type, LayerNorm
    replicated += layers * (h + h + 4 * h)  # attn-out and ffn-out biases, two LayerNorms
    replicated += h * h + h + 2 * h  # head transform and its LayerNorm
    return split // t, replicated


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", required=True)
    p.add_argument("--mpiexec", default="mpirun")
    p.add_argument("--preset", default="base", choices=sorted(SHAPES))
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", default="/tmp/shardopt-tp-memory")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    runs = []
    for t in (1, 2, 4):
        if a.ranks % t:
            continue
        for sp in ((False, True) if t > 1 else (False,)):
            name = f"t{t}d{a.ranks // t}" + ("_sp" if sp else "")
            out = os.path.join(a.out, name)
            cmd = [a.mpiexec, "--oversubscribe", "--bind-to", "none", "-np", str(a.ranks), a.binary,
                   "--synthetic", "--preset", a.preset, "--stage", str(a.stage), "--steps", str(a.steps),
                   "--batch-size", str(a.batch_size), "--max-seq-length", str(a.seq), "--tp", str(t),
                   "--dropout", "0.1", "--no-plot", "--progress", "lines", "--timing-warmup", "0",
                   "--block-cache-mb", "0", "--out", out]
            if sp:
                cmd.append("--sequence-parallel")
            print(f"[tp-memory] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            last = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][-1]
            summary = json.load(open(os.path.join(out, "summary.json")))
            m0 = last["memory_rank0"]
            runs.append((name, t, a.ranks // t, sp, m0["params"] + m0["grads"] + m0["optimizer_state"],
                         m0["buffers"], last["memory_bytes"][0], summary["peak_tensor_bytes"][0]))
    print(f"\n{a.preset}, stage {a.stage}, {a.ranks} ranks, micro-batch {a.batch_size} x {a.seq} per rank, "
          "AdamW fp32; rank 0, MiB\n")
    print("| (t, d) | SP | model state | formula | state / formula | optimizer buffers | peak tensors | "
          "activations (peak - state - buffers) | activations / (1, d) |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 1 / 2**20
    base_act = None
    for name, t, d, sp, state, buffers, total, peak in runs:
        split, repl = parameters(a.preset, t)
        formula = 16 * (split + repl) / d if a.stage == 3 else None
        act = peak - total
        if t == 1:
            base_act = act
        ratio = f"{act / base_act:.2f}" if base_act else "-"
        f_text = f"{formula * mib:.1f}" if formula else "-"
        r_text = f"{state / formula:.4f}" if formula else "-"
        print(f"| ({t}, {d}) | {'yes' if sp else 'no'} | {state * mib:.1f} | {f_text} | {r_text} | "
              f"{buffers * mib:.1f} | {peak * mib:.1f} | {act * mib:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
