#!/usr/bin/env python3
"""shardopt's BERT trainer vs the PyTorch peer baseline, side by side on this machine.

Runs, in one go and interleaved by round (the order rotates every round, after one untimed
warm-up run of every variant), the peer (/work/shared/peers/torch_zero_bert.py, its
README: DDP + AdamW and DDP + ZeroRedundancyOptimizer over Gloo) and `bert_pretrain --preset peer
--synthetic` for each requested ZeRO stage, with the same model (vocab 30522, hidden 256, 4 layers,
4 heads, intermediate 1024, MLM only with the decoder tied to the word embeddings), data (uniform
random tokens, 15% masked, seq 128), batch (8 per rank), AdamW (lr 1e-4, weight decay 0.01, no
clipping), one torch/BLAS thread per rank, the same ranks and the same number of warm-up + timed
steps. Then prints a markdown table: median step time (the slowest rank's median over the timed
steps, as the peer reports it), samples/s, ratio to the peers and to stage 0, CPU time per step
next to it (a row whose wall time exceeds its CPU time by more than 10% is flagged), system time
and page faults per run, per-rank peak RSS. Stage 0 always runs: it is what sharding costs against.

Variants of shardopt's model (--variants):
  all     MLM logits at every position, as the peer computes them (same work: the comparison).
  masked  MLM logits only at the masked positions (Google's gather_indexes, the example's
          default): the same loss and gradients, as the other positions' logits are ignored by
          the loss (ignore_index -100), but ~1/7 of the decoder's work.

A stage the library refuses (e.g. stage 3 before it lands) is reported as n/a with its reason.
Usually started through bench/compare_peers.sh.
"""
import argparse
import datetime
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

MB = 1e6  # the peer's unit


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001 - environment probing only
        return f"? ({e})"


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def machine(args):
    blas = sh("update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | sed -n 's/^Value: //p'")
    if not blas:
        blas = sh("readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": sh("lscpu | sed -n 's/^Model name: *//p'"),
        "cores": os.cpu_count(),
        "memory": sh("free -g | awk '/Mem:/ {print $2 \" GiB\"}'"),
        "blas": blas,
        "torch": sh(f"{args.python} -c 'import torch; print(torch.__version__)'"),
        "mpi": sh("mpirun --version 2>&1 | head -1"),
        "kernel": sh("uname -r"),
    }


def env():
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_btl="self,vader")
    return e


def mpirun(args, n):
    return ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n)]


def descendants(root):
    """PIDs of every process below root (from /proc), children first listed after parents."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def run(cmd, log_path, timeout, done_marker=None, grace=60):
    """Runs cmd in its own process group; returns (rc, output, load, seconds).

    Note [Peer teardown hang]: torch 1.13's DDP over Gloo sometimes never exits: ~Reducer joins a
    Gloo thread that waits for the GIL the joining thread holds (seen here once in ~10 runs, after
    the report was printed). When done_marker has appeared in the output and the run is still
    alive `grace` seconds later, its process tree is killed and the run counts as complete
    (rc 0); the log says so.
    """
    t0 = time.time()
    load = loadavg()
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path + ".out", "w") as sink:
        p = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env(),
                             start_new_session=True)
        marker_at, note = None, ""
        while p.poll() is None:
            time.sleep(1)
            if done_marker and marker_at is None:
                with open(log_path + ".out") as f:
                    if done_marker in f.read():
                        marker_at = time.time()
            if marker_at is not None and time.time() - marker_at > grace:
                note = (f"\n[compare] finished its report but still running {grace} s later "
                        "(Note [Peer teardown hang]): process tree killed, results kept")
                break
            if time.time() - t0 > timeout:
                note = f"\n[compare] timed out after {timeout} s: process tree killed"
                break
        if p.poll() is None:
            # mpirun gives each rank its own process group: end the run's whole process tree.
            for pid in [p.pid] + descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            rc = 0 if marker_at is not None else 124
        else:
            rc = p.returncode
    usage = rusage_delta(usage0, resource.getrusage(resource.RUSAGE_CHILDREN))
    with open(log_path + ".out") as f:
        out = f.read() + note
    os.remove(log_path + ".out")
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + out)
    return rc, out, load, time.time() - t0, usage


def rusage_delta(before, after):
    """What the run's processes (mpirun and the ranks it waited for) used: user and system CPU
    seconds and page faults, summed over all of them (a rank killed by the teardown note is
    counted once mpirun has reaped it)."""
    return {"user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "minflt": after.ru_minflt - before.ru_minflt, "majflt": after.ru_majflt - before.ru_majflt}


def per_rank(args, usage):
    """System CPU seconds and page faults (thousands) of a whole run, per rank."""
    n = float(args.ranks)
    return {"sys_s": usage["sys_s"] / n, "minflt_k": usage["minflt"] / n / 1e3,
            "majflt": usage["majflt"] / n}


# ---- the peer ------------------------------------------------------------------------------------

def free_port():
    """A TCP port nobody listens on now (the peer's fixed default can be taken by another run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def parse_peer(out):
    """Per-rank rows of the peer's report table, keyed by its column names."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.split()[:2] == ["rank", "med_step_s"]:
            cols = line.split()
            rows = []
            for row in lines[i + 1:]:
                parts = row.split()
                if len(parts) != len(cols) or not parts[0].isdigit():
                    break
                rows.append({c: float(v) for c, v in zip(cols, parts)})
            return rows
    return None


def run_peer(args, mode, outdir, rnd):
    clock = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_cpu_clock.py")
    cmd = mpirun(args, args.ranks) + [
        args.python, clock, str(args.warmup), str(args.warmup + args.steps), args.peer,
        "--launcher", "mpi", "--mode", mode, "--batch", str(args.batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", "128",
        "--lr", "1e-4", "--threads", "1", "--port", str(free_port())]
    log = os.path.join(outdir, f"peer_{mode}_r{rnd}.log")
    rc, out, load, wall, usage = run(cmd, log, args.timeout, done_marker="global samples/s")
    rows = parse_peer(out) if rc == 0 else None
    if not rows:
        return {"status": "failed", "reason": f"exit {rc}, see {log}", "load": load}
    cpu = [float(x) for x in re.findall(r"\[peer-cpu\] rank \d+ cpu_step_s ([0-9.]+)", out)]
    return {
        "status": "ok", "load": load, "wall_s": wall, "log": log, **per_rank(args, usage),
        "step_s": max(r["med_step_s"] for r in rows),
        "cpu_s": max(cpu) if cpu else float("nan"),
        "fwdbwd_s": statistics.median(r["fwdbwd_s"] for r in rows),
        "opt_s": statistics.median(r["optstep_s"] for r in rows),
        "rss": [r["peakRSS_MB"] * MB for r in rows],
        "model_state": rows[0]["modelState_MB"] * MB,
        "loss_first": rows[0]["loss0"], "loss_last": rows[0]["lossN"],
    }


# ---- shardopt ------------------------------------------------------------------------------------

def run_ours(args, stage, variant, outdir, rnd):
    out_dir = os.path.join(outdir, f"shardopt_s{stage}_{variant}_r{rnd}")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = mpirun(args, args.ranks) + [
        args.trainer, "--preset", "peer", "--synthetic", "--mlm-positions", variant,
        "--stage", str(stage), "--steps", str(args.warmup + args.steps),
        "--timing-warmup", str(args.warmup), "--batch-size", str(args.batch),
        "--max-seq-length", "128", "--masked-lm-prob", "0.15", "--lr", "1e-4",
        "--warmup-steps", "0", "--weight-decay", "0.01", "--max-grad-norm", "0",
        "--threads", "1", "--seed", "0", "--no-plot", "--progress", "lines",
        "--log-every", "1000", "--out", out_dir] + args.trainer_args
    log = out_dir + ".log"
    rc, out, load, wall, usage = run(cmd, log, args.timeout)
    if rc != 0:
        m = re.search(r"error: (.*)", out)
        reason = m.group(1).strip() if m else f"exit {rc}"
        reason = re.sub(r"^shardopt\[rank \d+/\d+\] ", "", reason)
        reason = re.sub(r" \([\w./]+:\d+\)$", "", reason)
        refused = re.search(r"not available|Unsupported|unsupported", out) and "stage" in out
        return {"status": "n/a" if refused else "failed",
                "reason": reason if refused else reason + f" (see {log})", "load": load}
    with open(os.path.join(out_dir, "summary.json")) as f:
        s = json.load(f)
    t = s["timing"]
    slow = max(t["per_rank_median"], key=lambda r: r["step_s"])
    ms = s.get("model_state_rank0", {})
    return {
        "status": "ok", "load": load, "wall_s": wall, "log": log, **per_rank(args, usage),
        "step_s": t["median_step_s"],
        "cpu_s": max(r["cpu_s"] for r in t["per_rank_median"]),
        "fwd_s": slow["fwd_s"], "bwd_s": slow["bwd_s"], "opt_s": slow["opt_s"],
        "comm_wait_s": slow["comm_wait_s"], "update_s": slow["update_s"], "gather_s": slow["gather_s"],
        "rss": s["peak_rss_bytes"], "tensor_peak": s["peak_tensor_bytes"],
        "model_state": sum(ms.get(k, 0) for k in ("params", "grads", "optimizer_state", "buffers")),
        "loss_first": s["first5_loss"], "loss_last": s["last5_loss"],
    }


# ---- report --------------------------------------------------------------------------------------

def combine(results):
    """Median over rounds of the per-round numbers; n/a or failed when no round succeeded."""
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return results[0]
    c = dict(ok[0])
    for k, v in ok[0].items():
        if isinstance(v, float) and k != "load":
            c[k] = statistics.median(r[k] for r in ok)
        elif isinstance(v, list):
            c[k] = [statistics.median(r[k][i] for r in ok) for i in range(len(v))]
    c["load"] = statistics.median(r["load"] for r in results)
    c["rounds"] = len(ok)
    return c


def fmt_rss(rss):
    return " / ".join(f"{b / MB:.0f}" for b in rss)


def table(args, runs):
    ddp, zero = runs.get(("peer", "ddp")), runs.get(("peer", "zero"))
    head = ("| run | MLM logits | median step (s) | samples/s | vs DDP+ZeRO | vs DDP | "
            "vs stage 0 | CPU s/step | wall / CPU | CPU vs DDP+ZeRO | sys s per run | "
            "page faults per run (k minor / major) | peak RSS per rank (MB) | "
            "model state r0 (MB) | breakdown (s) | load |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    gb = args.ranks * args.batch

    def ratio(r, base, key="step_s"):
        if not base or base["status"] != "ok" or not base[key] > 0:
            return "?"
        return f"{r[key] / base[key]:.2f}x"

    for key, r in runs.items():
        kind, what = key
        if kind == "peer":
            name = "torch DDP + AdamW" if what == "ddp" else "torch DDP + ZeroRedundancyOptimizer"
            logits = "all"
        else:
            stage, variant = what
            name, logits = f"shardopt stage {stage}", variant
        if r["status"] != "ok":
            lines.append(f"| {name} | {logits} | {r['status']} | | | | | | | | | | | | "
                         f"{r['reason']} | {r['load']:.1f} |")
            continue
        stage0 = runs.get(("shardopt", (0, logits))) if kind == "shardopt" else None
        if kind == "peer":
            bd = f"fwd+bwd {r['fwdbwd_s']:.3f}, step {r['opt_s']:.3f}"
        else:
            bd = (f"fwd {r['fwd_s']:.3f}, bwd {r['bwd_s']:.3f}, step {r['opt_s']:.3f} (comm wait "
                  f"{r['comm_wait_s']:.3f}, update {r['update_s']:.3f}, gather {r['gather_s']:.3f})")
        wall_cpu = r["step_s"] / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
        # Note [Wall beyond CPU]: a rank that waits (for another rank, for the page allocator, for
        # a core another job holds) shows wall time its CPU time lacks; such a row measures the
        # machine more than the code.
        flag = " **wall > 1.1x CPU**" if wall_cpu > 1.1 else ""
        lines.append(f"| {name} | {logits} | {r['step_s']:.3f} | {gb / r['step_s']:.2f} | "
                     f"{ratio(r, zero)} | {ratio(r, ddp)} | {ratio(r, stage0) if stage0 else ''} | "
                     f"{r['cpu_s']:.3f} | {wall_cpu:.2f}{flag} | {ratio(r, zero, 'cpu_s')} | "
                     f"{r['sys_s']:.1f} | {r['minflt_k']:.0f} / {r['majflt']:.0f} | "
                     f"{fmt_rss(r['rss'])} | {r['model_state'] / MB:.1f} | {bd} | "
                     f"{r['load']:.1f} |")
    return "\n".join(lines)


def verdicts(args, runs):
    zero = runs.get(("peer", "zero"))
    out = []
    if not zero or zero["status"] != "ok":
        return ["no DDP+ZeRO baseline: no verdict"]
    zrss = max(zero["rss"])
    for key, r in runs.items():
        if key[0] != "shardopt" or r["status"] != "ok":
            continue
        stage, variant = key[1]
        q = r["step_s"] / zero["step_s"]
        speed = ("meets the <= 0.85x goal" if q <= 0.85 else
                 "at least as fast, short of the 0.85x goal" if q <= 1.0 else "SLOWER")
        line = (f"stage {stage} ({variant} positions): {q:.2f}x DDP+ZeRO's step time ({speed}), "
                f"{r['cpu_s'] / zero['cpu_s']:.2f}x its CPU time per step")
        if stage == 2:
            mine = max(r["rss"])
            line += (f"; peak RSS {mine / MB:.0f} MB vs {zrss / MB:.0f} MB: "
                     + ("below" if mine < zrss else "NOT below"))
        out.append(line)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", required=True, help="bert_pretrain binary")
    ap.add_argument("--peer", required=True, help="torch_zero_bert.py")
    ap.add_argument("--python", default="/usr/bin/python3", help="Python with torch for the peer")
    ap.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--variants", default="all,masked", help="shardopt MLM variants: all, masked")
    ap.add_argument("--peers", default="ddp,zero", help="peer modes to run: ddp, zero")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, report medians")
    ap.add_argument("--warmup-runs", type=int, default=1, choices=(0, 1),
                    help="one untimed run of every variant before the rounds (1) or none (0)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--out", default="", help="logs and results.json (default: a fresh dir under "
                    "the trainer's build dir)")
    ap.add_argument("trainer_args", nargs="*", help="extra bert_pretrain arguments (after --)")
    args = ap.parse_args()

    if not os.path.isfile(args.peer):
        sys.exit(f"[compare] the peer script {args.peer} does not exist; point PEER (or --peer) at "
                 "torch_zero_bert.py (expected at ../shared/peers/ next to the repository)")
    if not os.access(args.trainer, os.X_OK):
        sys.exit(f"[compare] the trainer {args.trainer} is missing: build it with "
                 "scripts/build.sh --target bert_pretrain")
    probe = subprocess.run([args.python, "-c", "import torch, torch.distributed"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        sys.exit(f"[compare] {args.python} cannot import torch (the peer needs Debian's "
                 f"python3-torch): {probe.stderr.strip().splitlines()[-1:]}")
    if shutil.which("mpirun") is None:
        sys.exit("[compare] mpirun is not on PATH")
    stages = [int(s) for s in args.stages.split(",") if s != ""]
    if 0 not in stages:  # the cost of sharding is measured against stage 0
        stages.insert(0, 0)
    variants = [v for v in args.variants.split(",") if v]
    peers = [p for p in args.peers.split(",") if p]
    for v in variants:
        if v not in ("all", "masked"):
            sys.exit(f"[compare] unknown variant {v}; expected all or masked")
    outdir = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(args.trainer))), "compare_peers",
        datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(outdir, exist_ok=True)

    info = machine(args)
    print(f"[compare] {info['date']} | {info['cpu']}, {info['cores']} cores, {info['memory']} | "
          f"BLAS {info['blas']} | torch {info['torch']} | {info['mpi']}")
    print(f"[compare] {args.ranks} ranks x {args.batch} sequences of 128, {args.warmup} warm-up + "
          f"{args.steps} timed steps, 1 thread per rank, {args.rounds} round(s); logs in {outdir}")
    sys.stdout.flush()

    keys = [("peer", m) for m in peers] + [("shardopt", (s, v)) for v in variants for s in stages]
    results = {k: [] for k in keys}

    def one(key, rnd):
        if key[0] == "peer":
            return run_peer(args, key[1], outdir, rnd), f"peer {key[1]}"
        return (run_ours(args, key[1][0], key[1][1], outdir, rnd),
                f"shardopt stage {key[1][0]} ({key[1][1]})")

    # Note [Untimed warm-up run]: the first run of a binary after other jobs pays for page cache
    # misses and for memory the kernel must reclaim first (three times the system time of a
    # repeat, measured); one untimed run of every variant comes before the rounds.
    for key in keys if args.warmup_runs else []:
        r, label = one(key, "warm")
        print(f"[compare] warm-up {label}: {r['status']} (untimed, load {r['load']:.1f})")
        sys.stdout.flush()
    for rnd in range(args.rounds):
        # The order rotates every round, so no variant always runs first or right after another.
        shift = rnd % len(keys)
        for key in keys[shift:] + keys[:shift]:
            r, label = one(key, rnd)
            results[key].append(r)
            state = f"{r['step_s']:.3f} s/step" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            print(f"[compare] round {rnd + 1}/{args.rounds} {label}: {state} (load {r['load']:.1f})")
            sys.stdout.flush()

    runs = {k: combine(v) for k, v in results.items()}
    md = table(args, runs)
    notes = verdicts(args, runs)
    print()
    print(md)
    print()
    for n in notes:
        print("- " + n)
    print(f"\nmedian step = the slowest rank's median over {args.steps} timed steps (median over "
          f"{args.rounds} round(s)); samples/s = {args.ranks * args.batch} / median step; CPU "
          "s/step = the largest per-rank median of the process's CPU time per step (all threads; "
          "steadier than wall time on a shared machine); wall / CPU = median step / CPU s/step, "
          "flagged above 1.1 (the rank waited for something other than its own work); sys s and "
          "page faults per run = the whole run's (start-up, warm-up and timed steps) system CPU "
          "seconds and page faults per rank, from getrusage of the finished processes; vs stage 0 "
          "= the cost of sharding; MB = 10^6 bytes; load = 1-minute load average when the run "
          "started (2 cores: above ~2 means other work shared them).")
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(args),
                   "runs": [{"key": list(map(str, k)), "rounds": v} for k, v in results.items()],
                   "table": md, "verdicts": notes}, f, indent=1)
    with open(os.path.join(outdir, "table.md"), "w") as f:
        f.write(md + "\n\n" + "\n".join("- " + n for n in notes) + "\n")
    failed = [k for k, v in runs.items() if v["status"] == "failed"]
    if failed:
        print(f"[compare] failed runs: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
