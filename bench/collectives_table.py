#!/usr/bin/env python3
"""Markdown table from collectives_bench's JSON (--benchmark_out=FILE --benchmark_out_format=json).

    python3 bench/collectives_table.py bench/results/raw/collectives_np2.json

Uses the median aggregate when the run had --benchmark_repetitions, else the single run.
ratio = shardopt busbw / raw MPI busbw.
"""
import json
import sys


def main(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    has_median = any(b.get("aggregate_name") == "median" for b in data["benchmarks"])
    for b in data["benchmarks"]:
        if has_median and b.get("aggregate_name") != "median":
            continue
        # e.g. "reduce_scatter/shardopt/1048576_median" or "all_gather/raw_mpi/1048576"
        op, impl, size = b["run_name"].split("/")[:3]
        rows.setdefault((int(size), op), {})[impl] = (b["algbw_GBps"], b["busbw_GBps"], b["real_time"])
    ctx = data["context"]
    how = "median over repetitions" if has_median else "single run"
    print(f"ranks: {ctx.get('mpi_ranks', '?')}, {how}, date {ctx['date']}\n")
    print("| size | op | shardopt algbw | shardopt busbw | raw MPI algbw | raw MPI busbw | ratio (busbw) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    order = {"reduce_scatter": 0, "all_gather": 1, "all_reduce": 2}
    for (size, op) in sorted(rows, key=lambda k: (k[0], order.get(k[1], 9))):
        r = rows[(size, op)]
        s, m = r.get("shardopt"), r.get("raw_mpi")
        if not s or not m:
            continue
        print(f"| {size >> 20} MiB | {op} | {s[0]:.2f} | {s[1]:.2f} | {m[0]:.2f} | {m[1]:.2f} | {s[1] / m[1]:.2f}x |")
    print("\nGB/s = 10^9 bytes/s; bytes = the full buffer (reduce-scatter input, all-gather output).")


if __name__ == "__main__":
    main(sys.argv[1])
