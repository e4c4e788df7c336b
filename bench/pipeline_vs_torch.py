"""shardopt's pipeline (gpt_train --pp 2) against torch's own (torch.distributed.pipelining,
bench/torch_pipelining.py) on the same GPT, rows, micro-batches, optimizer and 1 thread per rank,
p = 2, over MPI (shardopt) and Gloo (torch): parity first, then step time and peak memory.

  bench/pipeline_vs_torch.sh                       # parity (float64), then 3 timed rounds (float32)
  bench/pipeline_vs_torch.sh --parity-only --layers 4 --hidden 64 --steps 5

1. Parity, float64, dropout 0: each schedule (shardopt's 1f1b against Schedule1F1B, zb-h1 against
   ScheduleInterleavedZeroBubble with one stage per rank) for --parity-steps steps; the largest
   absolute difference of the per-step loss (and the relative one of the clipping norm) must be
   at most --tol (1e-6), else exit 1 before any timing.
2. Timing, float32, dropout 0: --rounds rounds, each running shardopt then torch for every
   schedule (interleaved); a run's step time is the median of its steps after --warmup; the table
   gives the median over rounds, the ratio shardopt / torch, and each side's max RSS per rank
   (ru_maxrss: each runtime's whole process, its libraries and allocator included).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ["1f1b", "zb-h1"]


def model_args(a, dtype, steps):
    return ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
            "--max-seq-length", str(a.seq), "--batch-size", str(a.batch_size),
            "--micro-batches", str(a.micro_batches), "--steps", str(steps),
            "--warmup-steps", str(a.warmup_steps), "--lr", str(a.lr), "--seed", str(a.seed),
            "--dtype", dtype, "--corpus", a.corpus]


def run_shardopt(a, schedule, dtype, steps, tmp):
    out = Path(tmp) / f"shardopt_{schedule}_{dtype}"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2",
           "/usr/bin/time", "-f", "maxrss_kb %M", a.trainer, "--pp", "2", "--schedule", schedule,
           "--preset", a.preset, "--dropout", "0", "--threads", "1", "--progress", "lines",
           "--out", str(out), *model_args(a, dtype, steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"pipeline_vs_torch: gpt_train failed ({p.returncode}):\n{' '.join(cmd)}\n"
                 f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    steps_ = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    rss = [int(l.split()[1]) / 1024.0 for l in p.stderr.splitlines() if l.startswith("maxrss_kb")]
    return {"steps": steps_, "max_rss_mb": rss, "log": p.stdout + p.stderr, "cmd": cmd}


def run_torch(a, schedule, dtype, steps, tmp):
    cmd = [a.python, str(ROOT / "bench/torch_pipelining.py"), "--schedule", schedule,
           "--n-ctx", str(a.n_ctx), "--tmp", tmp, *model_args(a, dtype, steps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"pipeline_vs_torch: torch_pipelining failed ({p.returncode}):\n"
                 f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    steps_ = [r for r in recs if not r.get("summary")]
    rss = [r["max_rss_mb"] for r in recs if r.get("summary")]
    return {"steps": steps_, "max_rss_mb": rss, "log": p.stdout + p.stderr, "cmd": cmd}


def parity(a, tmp, log):
    ok = True
    print(f"## Parity (float64, dropout 0, {a.parity_steps} steps): per-step loss, absolute; "
          f"clipping norm, relative\n")
    print("| schedule | step | shardopt loss | torch loss | abs diff | grad-norm rel diff |")
    print("|---|---|---|---|---|---|")
    for s in SCHEDULES:
        mine = run_shardopt(a, s, "float64", a.parity_steps, tmp)
        theirs = run_torch(a, s, "float64", a.parity_steps, tmp)
        log.write(f"### parity {s}\n$ {' '.join(mine['cmd'])}\n{mine['log']}\n"
                  f"$ {' '.join(theirs['cmd'])}\n{theirs['log']}\n")
        worst_loss = worst_norm = 0.0
        for x, y in zip(mine["steps"], theirs["steps"]):
            d = abs(x["loss"] - y["loss"])
            r = abs(x["grad_norm"] - y["grad_norm"]) / abs(y["grad_norm"])
            worst_loss, worst_norm = max(worst_loss, d), max(worst_norm, r)
            print(f"| {s} | {x['step']} | {x['loss']:.12f} | {y['loss']:.12f} | {d:.2e} | "
                  f"{r:.2e} |")
        good = (len(mine["steps"]) == len(theirs["steps"]) == a.parity_steps
                and worst_loss <= a.tol and worst_norm <= a.tol)
        ok = ok and good
        print(f"| {s} | worst | | | {worst_loss:.2e} | {worst_norm:.2e} "
              f"({'PASS' if good else 'FAIL'} at {a.tol:g}) |")
    print(flush=True)
    return ok


def median_step(run, warmup):
    times = [r["step_s"] for r in run["steps"][warmup:]]
    return statistics.median(times)


def timing(a, tmp, log):
    res = {s: {"shardopt": [], "torch": []} for s in SCHEDULES}
    for rnd in range(a.rounds):
        for s in SCHEDULES:
            for side, fn in (("shardopt", run_shardopt), ("torch", run_torch)):
                run = fn(a, s, "float32", a.steps, tmp)
                log.write(f"### round {rnd + 1} {s} {side}\n$ {' '.join(run['cmd'])}\n"
                          f"{run['log']}\n")
                log.flush()
                res[s][side].append(run)
                print(f"[pipeline_vs_torch] round {rnd + 1} {s} {side}: median step "
                      f"{median_step(run, a.warmup):.4f} s, max RSS per rank "
                      f"{', '.join(f'{m:.0f}' for m in run['max_rss_mb'])} MB", flush=True)
    print(f"\n## Step time (float32, median of steps {a.warmup + 1}-{a.steps} per run, median "
          f"over {a.rounds} rounds) and max RSS per rank\n")
    print("| schedule | shardopt step (s) | torch step (s) | shardopt / torch | per round | "
          "shardopt max RSS r0, r1 (MB) | torch max RSS r0, r1 (MB) |")
    print("|---|---|---|---|---|---|---|")
    for s in SCHEDULES:
        mine = statistics.median(median_step(r, a.warmup) for r in res[s]["shardopt"])
        theirs = statistics.median(median_step(r, a.warmup) for r in res[s]["torch"])

        def rss(side):
            return ", ".join(f"{max(r['max_rss_mb'][i] for r in res[s][side]):.0f}"
                             for i in range(2))
        rounds = ", ".join(f"{median_step(x, a.warmup) / median_step(y, a.warmup):.2f}"
                           for x, y in zip(res[s]["shardopt"], res[s]["torch"]))
        print(f"| {s} | {mine:.4f} | {theirs:.4f} | {mine / theirs:.3f}x | {rounds} | "
              f"{rss('shardopt')} | {rss('torch')} |")
    print(flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", default=str(ROOT / "build/examples/gpt_train"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--corpus", default=str(ROOT / "tests/assets/corpus"))
    p.add_argument("--preset", default="mini", help="gpt_train's preset (its positions)")
    p.add_argument("--n-ctx", type=int, default=256, help="the preset's positions")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--parity-steps", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=12, help="timed runs' steps")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parity-only", action="store_true")
    p.add_argument("--log", default="", help="raw output of every run (default: none kept)")
    a = p.parse_args()
    model = next((l.split(":", 1)[1].strip() for l in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if l.startswith("Model name")), "?")
    print(f"[pipeline_vs_torch] {model}, {os.cpu_count()} CPUs; load at start: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}\n"
          f"[pipeline_vs_torch] command: {' '.join(sys.argv)}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="pipeline_vs_torch_") as tmp, \
            open(a.log or os.devnull, "w") as log:
        if not parity(a, tmp, log):
            sys.exit("pipeline_vs_torch: parity FAILED: no timing")
        if not a.parity_only:
            timing(a, tmp, log)
    print(f"[pipeline_vs_torch] load at end: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
