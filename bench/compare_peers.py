#!/usr/bin/env python3
"""shardopt's BERT trainer vs the systems users would pick instead, side by side on this machine.

The peers (bench/peers/, run in the pip platform's venv: torch 2.15, DeepSpeed, over Gloo):
  level 0  torch DDP + AdamW
  level 1  torch DDP + ZeroRedundancyOptimizer; DeepSpeed ZeRO-1 (torch AdamW / DeepSpeedCPUAdam)
  level 2  DeepSpeed ZeRO-2 (both optimizers); FSDP2 with reshard_after_forward=False
  level 3  DeepSpeed ZeRO-3 (both optimizers); FSDP2 with reshard_after_forward=True
and shardopt's own rows: `bert_pretrain --preset peer --synthetic --stage S` for each requested
stage (the level), and shardopt through its Python bindings in the same harness as the peers
(bench/peers/shardopt_py.py, stages 0-3 over MPI; needs <build>/python, target shardopt_python).
All train the same model (vocab 30522, hidden 256, 4 layers, 4 heads, intermediate 1024, MLM logits
at every position, the decoder tied to the word embeddings), on uniform random tokens (15% masked,
seq 128), 8 sequences per rank, AdamW (lr 1e-4, weight decay 0.01, no clipping), dropout 0.1, one
torch/BLAS thread per rank, the same ranks, warm-up and timed steps.

First each peer runs once for parity: --parity-steps steps with dropout off, then rank 0 trains
the same model on the same global batches with single-process torch.optim.AdamW and reports the
largest parameter difference and the largest difference of step 1's averaged gradient; the run
also counts the bytes each rank hands to torch.distributed's collectives. A peer that is not
exact keeps its row, marked (shardopt's Python rows too; they count their bytes themselves,
StepStats.comm_elements: its MPI traffic never passes torch.distributed). Then every variant runs
once per round, timed, the order rotating every round (after one untimed run of each C++ stage).
The table: parity, median step time (the slowest rank's median), CPU s/step, peak RSS per rank,
model state per rank (each system's own accounting of parameters, gradients and optimizer state;
persistent communication buffers beside it: Note [Model state, as ZeRO defines it]) and live tensor bytes (one method for every
Python peer), bytes communicated, and the ratio to the fastest exact peer at the same level;
then the issue's goals per stage (for shardopt's C++ and Python rows).

--variants masked adds shardopt rows with MLM logits only at the masked positions (the same loss,
~1/7 of the decoder's work): not the peers' work, so not a comparison. A stage the library
refuses is reported as n/a with its reason. Usually started through bench/compare_peers.sh.
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
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import gemm_probe  # noqa: E402  (Note [Compute fraction]: FLOPs per step and the GEMM probe)


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


# ---- the Python peers (bench/peers/) -------------------------------------------------------------

PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
# key -> (script, variant, row name, sharding level it competes at)
PEERS = {
    "torch:ddp": ("torch_ddp.py", "ddp", "torch DDP + AdamW", 0),
    "torch:zero": ("torch_ddp.py", "zero", "torch DDP + ZeroRedundancyOptimizer", 1),
    **{f"deepspeed:zero{s}{o}": ("deepspeed_zero.py", f"zero{s}{o}",
                                 f"DeepSpeed ZeRO-{s} ({'DeepSpeedCPUAdam' if o else 'torch AdamW'})", s)
       for s in (1, 2, 3) for o in ("", "-cpuadam")},
    "fsdp2:noreshard": ("fsdp2.py", "noreshard", "FSDP2 reshard_after_forward=False", 2),
    "fsdp2:reshard": ("fsdp2.py", "reshard", "FSDP2 reshard_after_forward=True", 3),
    **{f"shardopt:s{s}": ("shardopt_py.py", f"s{s}", f"shardopt stage {s} (Python bindings)", s)
       for s in range(4)},
}
# Rows of PEERS that are shardopt itself: beside the C++ rows in the table, measured against the
# peers in the goals, never a peer that a ratio is taken against.
OURS = {k for k, v in PEERS.items() if v[0] == "shardopt_py.py"}


def ours(key):
    return key[0] == "shardopt" or key[1] in OURS


def free_port():
    """A TCP port nobody listens on now (a fixed one can be taken by another run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_result(out):
    for line in out.splitlines():
        if line.startswith("[peer-result] "):
            return json.loads(line[len("[peer-result] "):])
    return None


def run_peer(args, key, outdir, rnd, parity=False):
    script, variant, _, _ = PEERS[key]
    cmd = mpirun(args, args.ranks) + [
        args.python, os.path.join(PEERS_DIR, script), "--variant", variant,
        "--batch", str(args.batch), "--threads", "1", "--port", str(free_port())]
    cmd += ["--parity", "--steps", str(args.parity_steps)] if parity else [
        "--steps", str(args.steps), "--warmup", str(args.warmup)]
    log = os.path.join(outdir, f"{key.replace(':', '_')}_{'parity' if parity else rnd}.log")
    rc, out, load, wall, usage = run(cmd, log, args.timeout, done_marker="[peer-result] ")
    res = parse_result(out) if rc == 0 else None
    if not res:
        m = re.findall(r"(\w*Error: .*)", out)
        reason = (m[-1][:160] + "; " if m else "") + f"exit {rc}, see {log}"
        return {"status": "failed", "reason": reason, "load": load}
    rows = res["ranks"]
    r0 = rows[0]
    if parity:
        return {"status": "ok", "load": load, "param_diff": r0["param_diff"],
                "grad1_diff": r0.get("grad1_diff", float("nan")),
                "grad1_max": r0.get("grad1_max", float("nan")),
                "comm": r0.get("comm_bytes_per_step", float("nan"))}
    slow = max(rows, key=lambda r: r["step_s"])
    own = r0["own_state"]
    return {
        "status": "ok", "load": load, "wall_s": wall, "log": log, **per_rank(args, usage),
        "step_s": slow["step_s"], "cpu_s": max(r["cpu_s"] for r in rows),
        "fwdbwd_s": slow["fwdbwd_s"], "opt_s": slow["opt_s"],
        "rss": [float(r["peak_rss"]) for r in rows],
        "model_state": model_state(own) if own else float("nan"),
        "buffers": float(own.get("buffers", 0)) if own else float("nan"),
        "live": float(r0["live_bytes"]),
        "loss_first": r0["loss_first"], "loss_last": r0["loss_last"],
    }


# Note [Model state, as ZeRO defines it]
# The ZeRO paper's model states are parameters, gradients and optimizer state (fp32 master copies
# included); communication buffers are residual states beside activations. The goals compare
# model states so defined, for every system alike: a system's persistent buffers (shardopt's
# bucket pool, DeepSpeed's ipg bucket) are reported in their own column, never hidden. Buffers a
# system allocates per collective and frees (FSDP2's) are not counted by its own accounting at all;
# the peak RSS column is where every byte, buffers and activations included, shows.
def model_state(own):
    return float(sum(v for k, v in own.items() if k != "buffers"))


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
        "model_state": model_state(ms), "buffers": float(ms.get("buffers", 0)),
        "loss_first": s["first5_loss"], "loss_last": s["last5_loss"],
        "parameters": s["parameters"],
    }


# ---- how close to the machine's compute (Note [Compute fraction] in bench/gemm_probe.py) ---------

def run_probe(python, args, outdir, tag):
    """The GEMM probe of the model's own shapes with `python`'s torch at one thread; None if it
    cannot run there."""
    cmd = [python, os.path.join(BENCH_DIR, "gemm_probe.py"), "--batch", str(args.batch),
           "--threads", "1", "--reps", "5"]
    rc, out, load, _, _ = run(cmd, os.path.join(outdir, f"gemm_probe_{tag}.log"), 600)
    for line in reversed(out.splitlines()):
        if rc == 0 and line.startswith("{"):
            r = json.loads(line)
            r["load"] = load
            return r
    return None


def trainer_python(args):
    """The Python whose torch the C++ trainer links: the venv's when the trainer links its
    libtorch (the pip platform's build), else Debian's /usr/bin/python3 (python3-torch)."""
    venv_torch = sh(f"{args.python} -c 'import torch, os; print(os.path.dirname(torch.__file__))'")
    linked = sh(f"ldd {args.trainer} | grep libtorch_cpu")
    return args.python if venv_torch and venv_torch in linked else "/usr/bin/python3"


def compute_used(key, r, probes, args):
    """(fraction of the probe's rate, GFLOP/s) of a row's median step."""
    positions = key[1][1] if key[0] == "shardopt" else "all"
    probe = probes.get("trainer" if key[0] == "shardopt" else "peers")
    if not probe or r.get("status") != "ok":
        return None
    flops = gemm_probe.flops_per_step(gemm_probe.SHAPES["peer"], args.batch, positions)
    rate = flops / r["step_s"]
    return rate / (probe["gflops"] * 1e9), rate / 1e9


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


def exact(par):
    """A peer is exact when its parameters after the parity run and its step-1 averaged gradient
    both match single-process AdamW to 1e-6 (the gradient relative to its largest entry): Adam's
    update hardly depends on the gradient's scale, so the gradient check is what sees a sum
    taken for an average."""
    return (par and par["status"] == "ok" and par["param_diff"] <= 1e-6
            and not par["grad1_diff"] > 1e-6 * max(1.0, par["grad1_max"]))


def parity_text(par):
    if par is None:
        return "not run here (C++: the test suite checks stages vs AdamW to 1e-6)"
    if par["status"] != "ok":
        return f"failed: {par['reason']}"
    return (f"{par['param_diff']:.1e} / {par['grad1_diff']:.1e}"
            + ("" if exact(par) else " **not exact**"))


def row_name(key):
    if key[0] == "peer":
        return PEERS[key[1]][2], PEERS[key[1]][3]
    stage, variant = key[1]
    return f"shardopt stage {stage} (C++ trainer{', masked logits' if variant == 'masked' else ''})", stage


def fastest_exact_peer(runs, parities, level):
    best = None
    for key, r in runs.items():
        if not ours(key) and PEERS[key[1]][3] == level and r["status"] == "ok" \
                and exact(parities.get(key[1])):
            if best is None or r["step_s"] < best[1]["step_s"]:
                best = (key, r)
    return best


def table(args, runs, parities, psi, probes):
    head = ("| run | level | parity: max abs param diff after "
            f"{args.parity_steps} steps / step-1 grad diff | median step (s) | samples/s | "
            "vs fastest exact peer at its level | compute used: of the GEMM probe (GFLOP/s) | "
            "CPU s/step | wall / CPU | sys s per run | "
            "peak RSS per rank (MB) | model state r0 (MB) | buffers r0 (MB) | live tensors r0 (MB) | "
            "comm per step r0 (MB) | breakdown (s) | load |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    gb = args.ranks * args.batch
    for key, r in runs.items():
        name, level = row_name(key)
        par = parities.get(key[1]) if key[0] == "peer" else None
        if r["status"] != "ok":
            lines.append(f"| {name} | {level} | {parity_text(par)} | {r['status']} | | | | | | | "
                         f"| | | | | {r['reason']} | {r['load']:.1f} |")
            continue
        best = fastest_exact_peer(runs, parities, level)
        vs = f"{r['step_s'] / best[1]['step_s']:.2f}x" if best else "no exact peer"
        if key[0] == "peer":
            bd = f"fwd+bwd {r['fwdbwd_s']:.3f}, step {r['opt_s']:.3f}"
            comm = f"{par['comm'] / MB:.1f}" if par and par["status"] == "ok" else "?"
            # shardopt's buffers and state live in C++, out of gc's reach: its own count only
            live = "n/a" if ours(key) else f"{r['live'] / MB:.1f}"
            comm += " (StepStats)" if ours(key) and par and par["status"] == "ok" else ""
        else:
            bd = (f"fwd {r['fwd_s']:.3f}, bwd {r['bwd_s']:.3f}, step {r['opt_s']:.3f} (comm wait "
                  f"{r['comm_wait_s']:.3f}, update {r['update_s']:.3f}, gather {r['gather_s']:.3f})")
            # not counted by the trainer: docs/design.md's volume (2 Psi fp32, stage 3 <= 3 Psi)
            comm = f"{(3 if level == 3 else 2) * 4 * psi / MB:.1f} (design{', at most' if level == 3 else ''})"
            live = "n/a"
        wall_cpu = r["step_s"] / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
        # Note [Wall beyond CPU]: a rank that waits (for another rank, for the page allocator, for
        # a core another job holds) shows wall time its CPU time lacks; such a row measures the
        # machine more than the code.
        flag = " **wall > 1.1x CPU**" if wall_cpu > 1.1 else ""
        used = compute_used(key, r, probes, args)
        used = f"{used[0]:.2f} ({used[1]:.0f})" if used else "no probe"
        lines.append(f"| {name} | {level} | {parity_text(par)} | {r['step_s']:.3f} | "
                     f"{gb / r['step_s']:.2f} | {vs} | {used} | {r['cpu_s']:.3f} | {wall_cpu:.2f}{flag} | "
                     f"{r['sys_s']:.1f} | {fmt_rss(r['rss'])} | {r['model_state'] / MB:.1f} | "
                     f"{r['buffers'] / MB:.1f} | "
                     f"{live} | {comm} | {bd} | {r['load']:.1f} |")
    return "\n".join(lines)


def verdicts(args, runs, parities):
    """The issue's goals: at each level, step time <= 0.8x the fastest exact peer and model state
    no more than that peer's."""
    out = []
    for key, r in runs.items():
        if not ours(key) or r["status"] != "ok":
            continue
        stage = row_name(key)[1]
        label = f"stage {stage}" + ("" if key[0] == "shardopt" else " (Python bindings)")
        best = fastest_exact_peer(runs, parities, stage)
        if not best:
            out.append(f"{label}: no exact peer ran at this level")
            continue
        b = best[1]
        q, c = r["step_s"] / b["step_s"], r["cpu_s"] / b["cpu_s"]
        m = r["model_state"] / b["model_state"] if b["model_state"] > 0 else float("nan")
        out.append(f"{label} vs {row_name(best[0])[0]}: step time {q:.2f}x "
                   f"({'meets' if q <= 0.8 else 'MISSES'} the 0.8x goal), CPU time {c:.2f}x, "
                   f"model state {m:.2f}x ({'meets' if m <= 1 else 'MISSES'} the <= 1x goal)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", required=True, help="bert_pretrain binary")
    ap.add_argument("--python", required=True,
                    help="Python with torch, DeepSpeed and ninja for the peers (the pip venv)")
    ap.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--variants", default="all", help="shardopt MLM variants: all, masked")
    ap.add_argument("--peers", default="all",
                    help="comma-separated peers, or all (shardopt's Python rows then only at "
                         "--stages): " + ", ".join(PEERS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--parity-steps", type=int, default=10,
                    help="steps of each peer's parity run (dropout off) before the rounds")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, report medians")
    ap.add_argument("--warmup-runs", type=int, default=1, choices=(0, 1),
                    help="one untimed run of every shardopt stage before the rounds (1) or none "
                         "(0); the peers' parity runs are theirs")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--out", default="", help="logs and results.json (default: a fresh dir under "
                    "the trainer's build dir)")
    ap.add_argument("trainer_args", nargs="*", help="extra bert_pretrain arguments (after --)")
    args = ap.parse_args()

    if not os.access(args.trainer, os.X_OK):
        sys.exit(f"[compare] the trainer {args.trainer} is missing: build it with "
                 "scripts/build.sh --target bert_pretrain")
    stages = [int(s) for s in args.stages.split(",") if s != ""]
    peers = ([p for p in PEERS if p not in OURS or PEERS[p][3] in stages] if args.peers == "all"
             else [p for p in args.peers.split(",") if p])
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        sys.exit(f"[compare] unknown peers {unknown}; expected some of: {', '.join(PEERS)}")
    # shardopt's Python rows import the bindings built beside the trainer (<build>/python)
    build_python = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.trainer))),
                                "python")
    if any(p in OURS for p in peers) and os.path.isdir(os.path.join(build_python, "shardopt")):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [build_python] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    need = "torch, torch.distributed" + (", deepspeed" if any(
        p.startswith("deepspeed") for p in peers) else "") + (", shardopt" if any(
        p in OURS for p in peers) else "")
    probe = subprocess.run([args.python, "-c", f"import {need}"], capture_output=True, text=True)
    if probe.returncode != 0:
        sys.exit(f"[compare] {args.python} cannot import {need} (the peers run in the pip "
                 f"platform's venv: scripts/pip-venv.sh prints it; shardopt from {build_python}, "
                 f"target shardopt_python): "
                 f"{probe.stderr.strip().splitlines()[-1:]}")
    if shutil.which("mpirun") is None:
        sys.exit("[compare] mpirun is not on PATH")
    variants = [v for v in args.variants.split(",") if v]
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

    # Note [Compute fraction] (bench/gemm_probe.py): the model's products timed alone at one thread
    # with the peers' torch and with the trainer's, before the runs (the machine as the runs find it).
    probes = {"peers": run_probe(args.python, args, outdir, "peers")}
    tp = trainer_python(args)
    probes["trainer"] = probes["peers"] if tp == args.python else run_probe(tp, args, outdir, "trainer")
    for tag, p in probes.items():
        whose = "the peers' torch" if tag == "peers" else "the C++ trainer's torch"
        print(f"[compare] GEMM probe, {whose}: " + (
            f"{p['gflops']:.1f} GFLOP/s at 1 thread on the model's products "
            f"({p['flops_per_step'] / 1e9:.1f} GFLOP per rank and step; torch {p['torch']}, "
            f"load {p['load']:.1f})" if p else "did not run (see gemm_probe_*.log)"))
    sys.stdout.flush()

    # shardopt's Python rows come right after its C++ rows
    keys = ([("peer", p) for p in peers if p not in OURS]
            + [("shardopt", (s, v)) for v in variants for s in stages]
            + [("peer", p) for p in peers if p in OURS])
    results = {k: [] for k in keys}

    def one(key, rnd):
        if key[0] == "peer":
            return run_peer(args, key[1], outdir, rnd), PEERS[key[1]][2]
        return (run_ours(args, key[1][0], key[1][1], outdir, rnd),
                f"shardopt stage {key[1][0]} ({key[1][1]})")

    # Each peer's parity run (dropout off, single-process AdamW on rank 0 afterwards) also warms
    # its page cache and JIT-built extensions before the timed rounds.
    parities = {}
    for p in peers:
        parities[p] = run_peer(args, p, outdir, "parity", parity=True)
        print(f"[compare] parity {PEERS[p][2]}: {parity_text(parities[p])} "
              f"(load {parities[p]['load']:.1f})")
        sys.stdout.flush()
    # Note [Untimed warm-up run]: the first run of a binary after other jobs pays for page cache
    # misses and for memory the kernel must reclaim first (three times the system time of a
    # repeat, measured); one untimed run of every variant comes before the rounds.
    for key in keys if args.warmup_runs else []:
        if key[0] == "shardopt":
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
    psi = next((r["parameters"] for r in runs.values() if r.get("parameters")), 0)
    md = table(args, runs, parities, psi, probes)
    notes = verdicts(args, runs, parities)
    print()
    print(md)
    print()
    for n in notes:
        print("- " + n)
    print(f"\nmedian step = the slowest rank's median over {args.steps} timed steps (median over "
          f"{args.rounds} round(s)); CPU s/step = the largest per-rank median of the process's CPU "
          "time per step (all threads; steadier than wall time on a shared machine); parity = from "
          f"one run of {args.parity_steps} steps with dropout off against single-process "
          "torch.optim.AdamW on the same global batches (exact: both <= 1e-6); level = the ZeRO "
          "stage a row competes at; model state r0 = each system's own accounting of parameters, "
          "gradients and optimizer state (ZeRO's model states) on rank 0 after a step (shardopt: "
          "opt.memory()); buffers r0 = its persistent communication buffers by the same "
          "accounting (shardopt's bucket pool, DeepSpeed's ipg bucket; FSDP2 frees its own per "
          "collective); live tensors r0 = every tensor storage Python reaches after a step, less "
          "the batches (the same method for every Python peer; DDP's C++ buckets added; n/a for "
          "shardopt, whose buffers and state live in C++); comm per "
          "step = bytes handed to torch.distributed collectives in the parity run (all-reduce "
          "counted twice; shardopt's Python rows: StepStats.comm_elements x 4 bytes, its own count "
          "of what it sent over MPI); sys s per run = the run's system CPU seconds per rank; MB = "
          "10^6 bytes; load = 1-minute load average when the run started (2 cores: above ~2 means other work "
          "shared them); compute used = the model's matrix-product FLOPs per rank and step over the "
          "median step time, as a fraction of the GEMM probe's rate on the same products at one "
          "thread with the row's torch (Note [Compute fraction], bench/gemm_probe.py; probes: "
          + "; ".join(f"{t} {p['gflops']:.1f} GFLOP/s, torch {p['torch']}" for t, p in probes.items() if p)
          + ").")
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump({"machine": info, "args": vars(args), "parity": parities, "probes": probes,
                   "runs": [{"key": list(map(str, k)), "rounds": v} for k, v in results.items()],
                   "table": md, "verdicts": notes}, f, indent=1)
    with open(os.path.join(outdir, "table.md"), "w") as f:
        f.write(md + "\n\n" + "\n".join("- " + n for n in notes) + "\n")
    failed = [k for k, v in runs.items() if v["status"] == "failed"]
    failed += [p for p, v in parities.items() if v["status"] != "ok"]
    if failed:
        print(f"[compare] failed runs: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
