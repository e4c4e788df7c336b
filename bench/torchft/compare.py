#!/usr/bin/env python3
"""Surviving failures: shardopt's in-memory snapshots against torchft, side by side.

Both train BERT-tiny for pretraining on 4 workers at the same global batch (4 x 2 sequences of
64 tokens) for --steps steps; in a failing run this script SIGKILLs one worker each time the job
commits a multiple of --fail-every steps (ranks 1, 2, 3, 0, 1, ... in turn), from outside, the
same way for both:

  shardopt  scripts/shardopt-run --max-restarts 1000 -- mpirun -np 4 bert_pretrain --preset tiny
            --snapshot-every 1 --snapshot-dir OUT/shm/host-{host} --ranks-per-host 2 (two
            emulated hosts): mpirun ends the job, the launcher starts it again, and it restores the
            newest committed snapshot from host memory (Note [Snapshots in memory]).
  torchft   4 replica groups of one process each (bench/torchft/replica.py) and a lighthouse: the
            survivors go on without the killed one; this script starts it again at once (what
            torchelastic or a scheduler would do) and it heals from a live replica.

Measured per run, from this script's own clock (it polls each job's per-step log every 10 ms):
committed steps per minute (steps / wall time from the launch to the last step), the recovery time
of each failure (from the kill to the first step beyond the last one committed before it), for
torchft also the time until the killed replica commits again, and whether the losses equal those
of the same system's failure-free run (shardopt: metrics.jsonl, bitwise; torchft: every replica's
loss at every step, and the final weights' SHA-256). Runs are interleaved: per repeat, shardopt
without failures, torchft without, shardopt with, torchft with.

  bench/torchft/compare.py --exe build/examples/bert_pretrain \
      --python "$(bench/torchft/venv.sh)/bin/python" --steps 300 --fail-every 50 --repeats 2
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANKS = 4
POLL = 0.01


def read_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by a kill
    except FileNotFoundError:
        pass
    return out


def env_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Failures:
    """Kills worker (1, 2, 3, 0, ...)[k] when the job first commits step (k + 1) * every."""

    def __init__(self, a, failing):
        self.every, self.steps = a.fail_every, a.steps
        self.failing = failing
        self.events = []  # {"at_step", "rank", "t_kill", "t_recovered", "t_rejoined"}

    def due(self, step):
        k = len(self.events)
        return (self.failing and step >= (k + 1) * self.every and (k + 1) * self.every < self.steps)

    def next_rank(self):
        return (len(self.events) + 1) % RANKS


def run_shardopt(a, name, failing):
    out = os.path.join(a.out, name)
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader", SHARDOPT_BENCH_RUN=out)
    for k in ("BERT_TEST_FAULT", "SHARDOPT_RESTART", "SHARDOPT_FAILED_AT"):
        env.pop(k, None)
    cmd = [os.path.join(ROOT, "scripts", "shardopt-run"), "--max-restarts", "1000", "--",
           "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(RANKS),
           a.exe, "--preset", "tiny", "--stage", "2", "--steps", str(a.steps), "--warmup-steps",
           str(a.warmup_steps), "--lr", str(a.lr), "--batch-size", "2", "--max-seq-length", "64",
           "--vocab", a.vocab_file, "--data", a.data_file, "--no-plot", "--progress", "lines",
           "--log-every", "1", "--timeout", "30", "--threads", "1", "--out", os.path.join(out, "out")]
    if a.snapshot_every > 0:
        cmd += ["--snapshot-every", str(a.snapshot_every), "--snapshot-dir",
                os.path.join(out, "shm", "host-{host}"), "--ranks-per-host", "2"]
    metrics = os.path.join(out, "out", "metrics.jsonl")
    fails = Failures(a, failing)
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(out, "log"), "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    last, t_last = 0, t0
    while p.poll() is None and time.time() - t0 < a.run_timeout:
        time.sleep(POLL)
        step = max([j.get("step", 0) for j in read_jsonl(metrics)] + [0])
        now = time.time()
        if step > last:
            last, t_last = step, now
            for e in fails.events:
                if e["t_recovered"] is None and step > e["lost_at"]:
                    e["t_recovered"] = now
        if fails.due(step):
            rank = fails.next_rank()
            pids = [pid for pid in os.listdir("/proc") if pid.isdigit()
                    and env_of(pid).get(b"SHARDOPT_BENCH_RUN") == out.encode()
                    and env_of(pid).get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode()]
            if not pids:
                continue  # the job is between attempts: try at the next poll
            t_kill = time.time()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            lost_at = max([j.get("step", 0) for j in read_jsonl(metrics)] + [0])
            fails.events.append({"at_step": step, "rank": rank, "t_kill": t_kill,
                                 "lost_at": lost_at, "t_recovered": None, "t_rejoined": None})
    if p.poll() is None:
        kill_group(p)
    p.wait()
    log = open(os.path.join(out, "log")).read()
    lines = [line for line in log.splitlines() if "recovered: " in line]
    reported = [float(line.split("recovered: ")[1].split(" s")[0]) for line in lines]
    restore = [float(line.split("(restore ")[1].split(" s")[0]) for line in lines
               if "(restore " in line]
    return {"system": "shardopt", "name": name, "failing": failing, "rc": p.returncode,
            "t0": t0, "t_last": t_last, "last_step": last, **shardopt_losses(out),
            "events": fails.events, "self_reported_recovery_s": reported, "restore_s": restore}


def run_torchft(a, name, failing):
    out = os.path.join(a.out, name)
    os.makedirs(os.path.join(out, "ready"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = free_port()
    lighthouse = subprocess.Popen(
        [os.path.join(os.path.dirname(a.python), "torchft_lighthouse"), "--min_replicas", str(a.min_replicas),
         "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000",
         "--quorum_tick_ms", "100"], stdout=open(os.path.join(out, "lighthouse.log"), "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    logs = [os.path.join(out, f"replica{r}.jsonl") for r in range(RANKS)]

    def start(r, first):
        cmd = [a.python, os.path.join(HERE, "replica.py"), "--replica", str(r), "--replicas",
               str(RANKS), "--lighthouse", f"http://127.0.0.1:{port}", "--log", logs[r],
               "--steps", str(a.steps), "--warmup-steps", str(a.warmup_steps), "--lr", str(a.lr),
               "--vocab", str(a.vocab), "--min-replicas", str(a.min_replicas)]
        if first:
            cmd += ["--ready-dir", os.path.join(out, "ready")]
        return subprocess.Popen(cmd, env=env, stdout=open(os.path.join(out, f"replica{r}.out"), "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    fails = Failures(a, failing)
    t0 = time.time()
    procs = [start(r, True) for r in range(RANKS)]
    last, t_last, t_final = 0, t0, None
    while time.time() - t0 < a.run_timeout:
        time.sleep(POLL)
        per = [read_jsonl(path) for path in logs]
        now = time.time()
        step = max([j["step"] for js in per for j in js if "loss" in j] + [0])
        if step > last:
            last, t_last = step, now
            for e in fails.events:
                if e["t_recovered"] is None and step > e["lost_at"]:
                    e["t_recovered"] = now
        for e in fails.events:  # the restarted replica's first committed step
            if e["t_rejoined"] is None and len(per[e["rank"]]) > e["lines_before"]:
                e["t_rejoined"] = now
        if fails.due(step):
            rank = fails.next_rank()
            t_kill = time.time()
            kill_group(procs[rank])
            procs[rank].wait()
            lost_at = max([j["step"] for path in logs for j in read_jsonl(path) if "loss" in j] + [0])
            fails.events.append({"at_step": step, "rank": rank, "t_kill": t_kill, "lost_at": lost_at,
                                 "t_recovered": None, "t_rejoined": None,
                                 "lines_before": len(read_jsonl(logs[rank]))})
            procs[rank] = start(rank, False)
        if all(p.poll() is not None for p in procs):
            break
        if any("final" in j for js in per for j in js):
            t_final = t_final or now  # the others finish the same step or are healing: let them
            if now - t_final > 5:
                break
    for p in procs + [lighthouse]:
        if p.poll() is None:
            kill_group(p)
        p.wait()
    return dict(torchft_losses(out), system="torchft", name=name, failing=failing,
                rc=[p.returncode for p in procs], t0=t0, t_last=t_last, last_step=last,
                events=fails.events)


def torchft_losses(out):
    """Per step, each replica's loss (the steps it took part in); the final weights' hashes."""
    per = [read_jsonl(os.path.join(out, f"replica{r}.jsonl")) for r in range(RANKS)]
    losses, participants = {}, {}
    for r, js in enumerate(per):
        for j in js:
            if "loss" in j:
                losses.setdefault(j["step"], {})[str(r)] = j["loss"]
                participants[j["step"]] = j["participants"]
    finals = {str(r): j["final"] for r, js in enumerate(per) for j in js if "final" in j}
    return {"losses": losses, "finals": finals, "participants": participants}


def shardopt_losses(out):
    return {"losses": {j["step"]: repr(j["loss"])
                       for j in read_jsonl(os.path.join(out, "out", "metrics.jsonl"))}}


def same_losses(system, run, free):
    """The failure-free run's steps whose losses the run repeats. torchft: every replica's loss
    that both runs logged at that step (a replica killed after the commit and before its log
    line leaves a step with fewer entries, not with other values), and the participants."""
    out = []
    for st in sorted(free["losses"]):
        a, b = run["losses"].get(st), free["losses"][st]
        if system == "torchft":
            both = set(a or {}) & set(b)
            ok = (bool(both) and all(a[r] == b[r] for r in both)
                  and run["participants"].get(st) == free["participants"].get(st))
        else:
            ok = a == b
        if ok:
            out.append(st)
    return out


def summarize(run, free):
    wall = run["t_last"] - run["t0"]
    s = {"system": run["system"], "name": run["name"], "failing": run["failing"],
         "steps": run["last_step"], "wall_s": round(wall, 2),
         "steps_per_min": round(60 * run["last_step"] / wall, 1) if wall > 0 else None,
         "failures": len(run["events"])}
    rec = [e["t_recovered"] - e["t_kill"] for e in run["events"] if e["t_recovered"]]
    s["recovery_s"] = [round(x, 2) for x in rec]
    s["recovery_median_s"] = round(statistics.median(rec), 2) if rec else None
    rej = [e["t_rejoined"] - e["t_kill"] for e in run["events"] if e.get("t_rejoined")]
    s["rejoin_s"] = [round(x, 2) for x in rej]
    s["steps_lost"] = [e["lost_at"] for e in run["events"]]
    if run["system"] == "shardopt":
        s["self_reported_recovery_s"] = run["self_reported_recovery_s"]
        s["restore_s"] = run["restore_s"]
    else:
        s["steps_with_fewer_replicas"] = sum(1 for n in run["participants"].values() if n < RANKS)
    if free is not None:
        steps = sorted(free["losses"])
        equal = same_losses(run["system"], run, free)
        s["losses_equal"] = f"{len(equal)} of {len(steps)}"
        differ = [st for st in steps if st not in equal]
        s["first_differing_step"] = differ[0] if differ else None
        if run["system"] == "torchft":
            s["final_weights_equal"] = (bool(run["finals"]) and bool(free["finals"]) and
                                        set(run["finals"].values()) == set(free["finals"].values()))
    return s


def table(results):
    """The markdown table of bench/README.md: one row per run, interleaved as run."""
    rows = ["| run | steps/min | wall s | failures | recovery s (kill -> next new step) | "
            "killed replica back s | steps with < 4 workers | losses = failure-free run's |",
            "|---|---|---|---|---|---|---|---|"]
    for s in results:
        rec = ", ".join(f"{x:.2f}" for x in s["recovery_s"]) or "-"
        rej = ", ".join(f"{x:.1f}" for x in s["rejoin_s"]) or "-"
        if s["system"] == "shardopt":
            rej = "(all restarted)" if s["failing"] else "-"
            if s["self_reported_recovery_s"]:  # bert_pretrain's own: from the launcher's restart
                rec += " (own: " + ", ".join(f"{x:.2f}" for x in s["self_reported_recovery_s"])
                if s.get("restore_s"):
                    rec += "; restore " + ", ".join(f"{x:.3f}" for x in s["restore_s"])
                rec += ")"
        fewer = s.get("steps_with_fewer_replicas", 0 if s["system"] == "shardopt" else "-")
        eq = s.get("losses_equal", "(reference)")
        if s.get("final_weights_equal") is not None:
            eq += f"; final weights {'equal' if s['final_weights_equal'] else 'differ'}"
        rows.append(f"| {s['name']} | {s['steps_per_min']} | {s['wall_s']} | {s['failures']} | "
                    f"{rec} | {rej} | {fewer} | {eq} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--exe", default=os.path.join(ROOT, "build", "examples", "bert_pretrain"))
    ap.add_argument("--python", help="the torchft venv's python (venv.sh; required to run)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fail-every", type=int, default=50, help="0: the failure-free runs only")
    ap.add_argument("--snapshot-every", type=int, default=1,
                    help="bert_pretrain's K (0: none, for the cost of the snapshots; no failures)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--min-replicas", type=int, default=2,
                    help="torchft's quorum minimum (lighthouse and Manager): 2 goes on with the "
                         "survivors; 4 waits for the killed replica to come back")
    ap.add_argument("--systems", default="shardopt,torchft")
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--table", metavar="RESULTS_JSON", help="print the table of a finished run")
    ap.add_argument("--rescore", metavar="OUT", help="recompute a finished run's loss columns")
    a = ap.parse_args()
    if a.table:
        print(table(json.load(open(a.table))))
        return
    if a.rescore:  # the loss columns again from a finished run's logs (results.json rewritten)
        path = os.path.join(a.rescore, "results.json")
        results = json.load(open(path))
        load = {"shardopt": shardopt_losses, "torchft": torchft_losses}
        for s in results:
            if s["failing"]:
                run = load[s["system"]](os.path.join(a.rescore, s["name"]))
                free = load[s["system"]](os.path.join(a.rescore, s["name"].replace("-fail-", "-free-")))
                for d in (run, free):  # JSON's keys are strings
                    d["losses"] = {int(k): v for k, v in d["losses"].items()}
                    if "participants" in d:
                        d["participants"] = {int(k): v for k, v in d["participants"].items()}
                equal = same_losses(s["system"], run, free)
                differ = [st for st in sorted(free["losses"]) if st not in equal]
                s["losses_equal"] = f"{len(equal)} of {len(free['losses'])}"
                s["first_differing_step"] = differ[0] if differ else None
        json.dump(results, open(path, "w"), indent=1)
        print(table(results))
        return
    if not a.python:
        ap.error("--python is required: the torchft venv's python, $(bench/torchft/venv.sh)/bin/python")
    a.out = a.out or subprocess.check_output(["mktemp", "-d", "/tmp/shardopt-torchft.XXXXXX"],
                                             text=True).strip()
    os.makedirs(a.out, exist_ok=True)
    corpus = os.path.join(ROOT, "tests", "assets", "corpus")
    a.vocab_file, a.data_file = os.path.join(a.out, "vocab.txt"), os.path.join(a.out, "data.bin")
    subprocess.run([a.exe, "build-vocab", "--corpus", corpus, "--vocab-size", "2000", "-o",
                    a.vocab_file], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([a.exe, "create-data", "--corpus", corpus, "--vocab", a.vocab_file,
                    "--max-seq-length", "64", "--dupe-factor", "2", "-o", a.data_file], check=True,
                   stdout=subprocess.DEVNULL)
    a.vocab = sum(1 for _ in open(a.vocab_file))  # the torchft model's vocabulary: the same size
    systems = a.systems.split(",")
    results = []
    for rep in range(a.repeats):
        free = {}
        for failing in ((False, True) if a.fail_every > 0 else (False,)):
            for system in systems:
                name = f"{system}-{'fail' if failing else 'free'}-{rep}"
                print(f"[compare] {name} ...", file=sys.stderr, flush=True)
                run = (run_shardopt if system == "shardopt" else run_torchft)(a, name, failing)
                if not failing:
                    free[system] = run
                s = summarize(run, free.get(system) if failing else None)
                s["load_1min_after"] = os.getloadavg()[0]
                print(json.dumps(s), flush=True)
                results.append(s)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"[compare] results: {os.path.join(a.out, 'results.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
