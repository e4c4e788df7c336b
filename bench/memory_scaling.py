#!/usr/bin/env python3
"""Memory scaling of ZeRO stages 0-3 with N ranks: measured vs docs/stages.md's formula.

For each model shape (BERT-base, BERT-large: the example's model), stage and N in --ranks, runs
`mpirun -np N memory_scaling --model M --stage S` (one optimizer step on one tiny batch) unless the
run would exceed --budget-gib across its ranks (printed as skipped, with the reason), then prints
a markdown table of per-rank bytes -- measured by shardopt's MemoryTracker (live tensor storage
after the step) and by DistributedOptimizer::memory() -- next to docs/stages.md's formula, the
documented bounded buffers and the estimator, checks that the measurement is within 5% of the
formula plus those buffers, and draws a PNG. Exit status 1 when a measured configuration misses
the 5% or fails. Stage 3 reports "pending" while the library refuses it.

Each row also gives the peak during construction (the model built, then the optimizer) and the
peak during the step, each next to its bound (Note [Peak bounds] in memory_scaling.cpp); a peak
over its bound is a MISS. With --cap-mb, every rank's tensor storage is capped by the tracker
(`auto`: halfway between stage 3's peak bound and stage 2's model state at that N); a run refused
for lack of memory is a row "refused (out of memory)" with the error, not a failure.

Usually started through bench/memory_scaling.sh.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

MB = 1e6


def env():
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
             OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader",
             OMPI_MCA_rmaps_base_oversubscribe="1")
    return e


def shape_args(args):
    extra = []
    for flag, value in (("--layers", args.layers), ("--vocab", args.vocab),
                        ("--bucket-mb", args.bucket_mb), ("--cap-mb", args.cap_mb)):
        if value:
            extra += [flag, str(value)]
    return extra


def plan(args, model):
    out = subprocess.run([args.binary, "--plan", "--model", model, "--ranks", args.ranks,
                          "--stages", args.stages, "--budget-gib", str(args.budget_gib)] +
                         shape_args(args),
                         capture_output=True, text=True, check=True, env=env())
    return json.loads(out.stdout)


def measure(args, cfg, outdir):
    m, s, n = cfg["model"], cfg["stage"], cfg["ranks"]
    path = os.path.join(outdir, f"{m}_s{s}_n{n}.json")
    log = os.path.join(outdir, f"{m}_s{s}_n{n}.log")
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n), args.binary,
           "--model", m, "--stage", str(s), "--json", path] + shape_args(args)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=args.timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired:
        out, rc = f"timed out after {args.timeout} s", 124
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + out)
    if os.path.exists(path):
        with open(path) as f:
            r = json.load(f)
        os.remove(path)
    else:
        r = {"status": "failed", "reason": f"exit {rc}, see {log}"}
    r.update(model=m, stage=s, ranks=n, seconds=time.time() - t0)
    if r["status"] == "oom":
        r["reason"] = f"rank {r['refused_rank']} during {r['phase']}: " + r["reason"]
    if r["status"] == "failed" and rc == 0:
        r["reason"] = r.get("reason", "") + f" (see {log})"
    return r


def mb(x):
    return f"{x / MB:,.1f}"


def table(results):
    lines = [
        "| model | stage | N | formula (MB) | + documented buffers (MB) | estimator (MB) | "
        "memory(): params / grads / state / buffers (MB) | tracker: live after step (MB) | "
        "vs formula + buffers | construction peak: tracker / bound / RSS rise (MB) | "
        "step peak: tracker / bound (MB) | peak RSS (MB) | verdict |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|---:|---|"]
    for r in results:
        head = f"| {r['model']} | {r['stage']} | {r['ranks']} |"
        if r["status"] == "skipped":
            lines.append(f"{head}" + " |" * 9 + f" skipped: {r['reason']} |")
            continue
        if r["status"] in ("pending", "failed", "oom"):
            reason = re.sub(r"^shardopt\[rank \d+/\d+\] ", "", r.get("reason", "").strip())
            reason = re.sub(r" \([\w./]+:\d+\)$", "", reason).replace("|", "/")
            label = {"pending": "pending", "oom": "refused (out of memory)"}.get(r["status"], "FAILED")
            formula = mb(r["formula"]["total"]) if "formula" in r else ""
            bounds = r.get("bounds", {})
            peaks = (f" - / {mb(bounds['construction'])} / - | - / {mb(bounds['step'])} |"
                     if bounds else " | |")
            lines.append(f"{head} {formula} |" + " |" * 5 + peaks + f" | {label}: {reason} |")
            continue
        f, b = r["formula"], r["documented_buffers"]
        worst = max(r["per_rank"], key=lambda p: p["tracker_live"])
        mem = worst["memory"]
        lines.append(
            f"{head} {mb(f['total'])} | {mb(b['optimizer'] + b['engine_scratch'])} | "
            f"{mb(r['estimator']['total'])} | {mb(mem['params'])} / {mb(mem['grads'])} / "
            f"{mb(mem['optimizer_state'])} / {mb(mem['buffers'])} | {mb(worst['tracker_live'])} | "
            f"{100 * r['deviation']:+.3f}% | {mb(r['construction_peak_max'])} / "
            f"{mb(r['bounds']['construction'])} / "
            f"{mb(max(p['rss_construction_peak'] for p in r['per_rank']))} | "
            f"{mb(r['step_peak_max'])} / {mb(r['bounds']['step'])} | "
            f"{mb(max(p['rss_peak'] for p in r['per_rank']))} | "
            f"{'ok (within 5%' if r['within_5pct'] else 'MISS (over 5%'}"
            f"{', peaks under bounds)' if r['peaks_within_bounds'] else '; PEAK OVER BOUND)'} |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in results}, key=lambda m: ["base", "large"].index(m)
                    if m in ("base", "large") else 9)
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    colors = {0: "tab:red", 1: "tab:orange", 2: "tab:blue", 3: "tab:green"}
    for ax, model in zip(axes[0], models):
        rs = [r for r in results if r["model"] == model]
        psi = next((r["psi"] for r in rs if "psi" in r), None)
        ns = sorted({r["ranks"] for r in rs})
        for s in sorted({r["stage"] for r in rs}):
            if psi:  # docs/stages.md's formula for every N, measured or not
                k = {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n,
                     3: lambda n: 16 / n}[s]
                ax.plot(ns, [k(n) * psi / MB for n in ns], "--", color=colors[s], lw=1, alpha=0.7)
            ok = [r for r in rs if r["stage"] == s and r["status"] == "ok"]
            if ok:
                ax.plot([r["ranks"] for r in ok],
                        [max(p["tracker_live"] for p in r["per_rank"]) / MB for r in ok],
                        "o-", color=colors[s], label=f"stage {s}")
            else:
                ax.plot([], [], "o-", color=colors[s], label=f"stage {s} (not measured)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("ranks N")
        ax.set_ylabel("per-rank model state (MB)")
        ax.set_title(f"BERT-{model} ({psi / 1e6:.0f}M params), fp32 AdamW" if psi else model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("points: measured (tracker: live tensor storage after one step, bounded buffers "
                 "included); dashed: docs/stages.md formula", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="the memory_scaling executable")
    ap.add_argument("--models", default="base,large")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--budget-gib", type=float, default=12.0,
                    help="GiB one run may use across all its ranks (the machine is shared)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--layers", type=int, default=0, help="encoder layers instead of the preset's")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary instead of the preset's")
    ap.add_argument("--bucket-mb", default="", help="bucket_bytes in MB")
    ap.add_argument("--cap-mb", default="",
                    help="per-rank cap on tensor storage in MB, or 'auto' (see memory_scaling.cpp)")
    ap.add_argument("--out", default="", help="directory for logs and results.json")
    ap.add_argument("--png", default="", help="the plot (default: OUT/memory_scaling.png)")
    args = ap.parse_args()
    if not os.access(args.binary, os.X_OK):
        sys.exit(f"[memory] {args.binary} is missing: build it with scripts/build.sh "
                 "--target memory_scaling (scripts/test.sh builds everything)")
    outdir = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.binary))),
                                      "memory_scaling",
                                      datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(outdir, exist_ok=True)
    t_start = time.time()
    print(f"[memory] {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}: "
          f"models {args.models}, stages {args.stages}, N {args.ranks}, budget "
          f"{args.budget_gib:g} GiB per run; logs in {outdir}")
    results = []
    for model in args.models.split(","):
        for cfg in plan(args, model):
            if not cfg["run"]:
                r = dict(cfg, status="skipped")
                print(f"[memory] BERT-{model} stage {cfg['stage']} N={cfg['ranks']}: skipped, "
                      f"{cfg['reason']}")
            else:
                r = measure(args, cfg, outdir)
                what = (f"{100 * r['deviation']:+.3f}% vs formula + buffers, "
                        f"{'ok' if r['within_5pct'] and r['peaks_within_bounds'] else 'MISS'}"
                        if r["status"] == "ok"
                        else f"{r['status']}: {r.get('reason', '')[:160]}")
                print(f"[memory] BERT-{model} stage {cfg['stage']} N={cfg['ranks']}: {what} "
                      f"({r['seconds']:.0f} s)")
            results.append(r)
            sys.stdout.flush()
    md = table(results)
    png = args.png or os.path.join(outdir, "memory_scaling.png")
    plot(results, png)
    measured = [r for r in results if r["status"] == "ok"]
    missed = [r for r in measured if not (r["within_5pct"] and r["peaks_within_bounds"])]
    refused = [r for r in results if r["status"] == "oom"]
    failed = [r for r in results if r["status"] == "failed"]
    pending = [r for r in results if r["status"] == "pending"]
    skipped = [r for r in results if r["status"] == "skipped"]
    print()
    print(md)
    print()
    print("formula = docs/stages.md's table with P = G = 4, K = 8 (fp32 AdamW) and Psi the model's "
          "parameters (tied decoder once); documented buffers = stages 2-3's two bucket buffers of "
          "the largest bucket (at most bucket_bytes: buckets split parameters; stage 3 keeps no unit "
          "gathered after a step) + the MPI engine's reduction scratch (one piece of the largest bucket "
          "shard, at most 64 MiB, N > 1); estimator = shardopt/estimate.hpp with the same "
          "alignment, buckets and largest parameter (no engine scratch); tracker = live tensor "
          "storage after the step minus before the model was built (worst rank); construction peak = the "
          "tracker's peak from before the model was built until the optimizer exists, its bound "
          "(one model + what is in flight, or the model state once built over the padded layout) and "
          "the rise of the "
          "resident set (VmHWM) over the same span; step peak = the tracker's peak during "
          "zero_grad/forward/backward/step and its bound (model state + buffers + backward's "
          "transient gradients or gathered units + activations), Note [Peak bounds] in "
          "memory_scaling.cpp; MB = 10^6 bytes.")
    # ZeRO's promise: each stage holds less model state (memory()'s parameters, gradients and
    # optimizer state; the bounded buffers aside) than the one before it (N >= 2), for every model,
    # among the stages measured at that N.
    def model_state(r):
        return max(m["memory"]["params"] + m["memory"]["grads"] + m["memory"]["optimizer_state"]
                   for m in r["per_rank"])
    disordered = []
    for model in args.models.split(","):
        for n in sorted({r["ranks"] for r in measured if r["model"] == model and r["ranks"] >= 2}):
            live = {r["stage"]: model_state(r) for r in measured
                    if r["model"] == model and r["ranks"] == n}
            stages = sorted(live)
            for lo, hi in zip(stages, stages[1:]):
                if not live[hi] < live[lo]:
                    disordered.append(f"BERT-{model} N={n}: stage {hi} {mb(live[hi])} MB >= "
                                      f"stage {lo} {mb(live[lo])} MB")
    for d in disordered:
        print(f"[memory] stage ordering violated: {d}")
    verdict = ("PASS" if not missed and not failed and not disordered else "FAIL")
    print(f"\n[memory] verdict: {verdict}: {len(measured) - len(missed)}/{len(measured)} measured "
          f"configurations within 5% of the formula plus the documented buffers with peaks under their "
          f"bounds; {len(failed)} "
          f"failed, {len(refused)} refused for lack of memory under the cap, {len(pending)} pending "
          f"(stage 3), {len(skipped)} skipped over the budget; "
          f"{time.time() - t_start:.0f} s in all")
    print(f"[memory] plot: {png}")
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "table": md, "verdict": verdict}, f,
                  indent=1)
    with open(os.path.join(outdir, "table.md"), "w") as f:
        f.write(md + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
