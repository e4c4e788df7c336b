#!/usr/bin/env python3
"""The reference's plots (bench/README.md), made from the benchmarks' own console outputs in
bench/results/ and written as small SVGs into bench/plots/. Rerun after replacing an output:

  /usr/bin/python3 bench/plots.py [--results bench/results] [--out bench/plots]

  memory_per_stage.svg   BERT-base bytes per rank against N, per stage, measured and formula
                         (memory_scaling_issue38_default.txt, bench/memory_scaling.sh)
  peers_step_time.svg    median step time per ZeRO level: every peer, shardopt's C++ trainer and
                         Python rows (compare_peers_all_np2_quiet_r2.txt, bench/compare_peers.sh)
  kernels_bandwidth.svg  the optimizer step's GB/s (28 B/param) against the triad probe, per run
                         and thread count (optimizer_kernels_prefetch_r*.txt, optimizer_kernels.py)
  pipeline_bubbles.svg   measured bubble against the formula per schedule, p = 2
                         (pipeline_bubble.txt, bench/pipeline_bubble.sh)
Needs matplotlib (Debian's python3-matplotlib, which scripts/setup.sh installs).
"""
import argparse
import glob
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "shardopt", "font.size": 9,
                     "figure.dpi": 100})


def table_rows(path, header_start):
    """Rows (lists of cells) of the first Markdown table whose header starts with header_start."""
    rows, inside = [], False
    for line in open(path, encoding="utf-8"):
        if line.startswith(header_start):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                if rows:
                    break
                continue
            if line.startswith("|---"):
                continue
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def number(text):
    return float(text.replace(",", "").split()[0])


def memory_per_stage(results, out):
    rows = table_rows(os.path.join(results, "memory_scaling_issue38_default.txt"), "| model | stage | N |")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for stage, color in zip("0123", ["C0", "C1", "C2", "C3"]):
        pts = [(int(r[2]), number(r[3]), number(r[7])) for r in rows
               if r[0] == "base" and r[1] == stage and r[3]]
        if not pts:
            continue
        n = [p[0] for p in pts]
        ax.plot(n, [p[2] for p in pts], "o-", color=color, label=f"stage {stage} measured")
        ax.plot(n, [p[1] for p in pts], "--", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MB per rank (10^6 B)")
    ax.set_title("BERT-base, fp32 AdamW: measured (tracker) and formula (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory_per_stage.svg"), metadata={"Date": None})


def peers_step_time(results, out):
    rows = table_rows(os.path.join(results, "compare_peers_all_np2_quiet_r2.txt"), "| run | level |")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    by_level = {}
    for r in rows:
        by_level.setdefault(int(r[1]), []).append((r[0], number(r[3])))
    x = 0
    ticks = []
    for level in sorted(by_level):
        start = x
        for name, step in by_level[level]:
            color = "C2" if "C++" in name else "C1" if "Python" in name else "C7"
            ax.bar(x, step, color=color, width=0.8)
            short = (name.replace("shardopt ", "").replace("(C++ trainer)", "C++")
                     .replace("(Python bindings)", "Python").replace("reshard_after_forward=", "reshard ")
                     .replace("ZeroRedundancyOptimizer", "ZeRO-Opt").replace("DeepSpeedCPUAdam", "DSCPUAdam")
                     .replace("torch AdamW", "AdamW").replace("torch ", ""))
            ax.text(x, step + 0.01, short, rotation=90, ha="center", va="bottom", fontsize=6)
            x += 1
        ticks.append(((start + x - 1) / 2, f"level {level}"))
        x += 1
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks])
    ax.set_ylabel("median s/step")
    ax.set_ylim(0, 1.9)
    ax.set_title("Peer BERT, 2 ranks: peers (grey), shardopt C++ (green) and Python (orange)", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "peers_step_time.svg"), metadata={"Date": None})


def kernels_bandwidth(results, out):
    files = sorted(glob.glob(os.path.join(results, "optimizer_kernels_prefetch_r*.txt")))
    impls = [("shardopt_fused step()", "shardopt", "C2"), ("deepspeed_cpu_adam step()", "DeepSpeedCPUAdam", "C0"),
             ("torch_fused step()", "torch fused", "C1")]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x, ticks = 0, []
    for i, f in enumerate(files):
        rows = table_rows(f, "| impl | params | threads |")
        for threads in ("1", "2"):
            sel = {r[0]: r for r in rows if r[1] == "110M" and r[2] == threads}
            if "triad (12 B/elem)" not in sel:
                continue
            probe = number(sel["triad (12 B/elem)"][4])
            for k, (impl, label, color) in enumerate(impls):
                if impl in sel and sel[impl][4]:
                    ax.bar(x + k * 0.27, number(sel[impl][4]), width=0.27, color=color,
                           label=label if x == 0 else None)
            ax.plot([x - 0.2, x + 0.74], [probe, probe], "k-", lw=1.5,
                    label="triad probe" if x == 0 else None)
            ticks.append((x + 0.27, f"run {i + 1}\n{threads} thr"))
            x += 1.2
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
    ax.set_ylabel("GB/s at 28 B/param")
    ax.set_title("AdamW step on 110M parameters: GB/s moved, against the triad probe")
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.set_ylim(0, 135)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kernels_bandwidth.svg"), metadata={"Date": None})


def pipeline_bubbles(results, out):
    pat = re.compile(r"^(gpipe|1f1b|interleaved|zb-h1)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+([\d.]+)\s+\[.*?\]\s+\S+\s+\|\s+[\d.]+\s+\|\s+[\d.]+\s+([\d.]+)")
    data = {}
    for line in open(os.path.join(results, "pipeline_bubble.txt"), encoding="utf-8"):
        m = pat.match(line)
        if m and m.group(2) == "2":
            data.setdefault(m.group(1), []).append((int(m.group(3)), float(m.group(5)), float(m.group(6))))
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x, ticks = 0, []
    for sched in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        for m_, measured, formula in data.get(sched, []):
            ax.bar(x, measured, width=0.7, color="C0", label="measured" if x == 0 else None)
            ax.plot([x - 0.35, x + 0.35], [formula, formula], "r-", lw=2, label="formula" if x == 0 else None)
            ticks.append((x, f"{sched}\nm={m_}"))
            x += 1
        x += 0.5
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
    ax.set_ylabel("bubble (idle / compute)")
    ax.set_title("Pipeline bubbles at p = 2 (a core per rank): measured and formula")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pipeline_bubbles.svg"), metadata={"Date": None})


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(here, "results"))
    ap.add_argument("--out", default=os.path.join(here, "plots"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for make in (memory_per_stage, peers_step_time, kernels_bandwidth, pipeline_bubbles):
        make(a.results, a.out)
        print(f"plots.py: {make.__name__}.svg")


if __name__ == "__main__":
    main()
