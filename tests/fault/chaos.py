#!/usr/bin/env python3
"""Chaos campaign on the BERT trainer: SIGKILL a random rank at a random moment, then --resume.

Each run draws, from its own seed, the number of ranks (--ranks), the layout (--layouts: dp, the
ranks all data-parallel; tp2, --tp 2; pp2, --pp 2 at stage 1), whether checkpoints are written in
the background (--async: off, on = --async-checkpoints), the victim rank and a moment uniform over
the uninterrupted run's wall time (start-up gets a fifth of the moments). With
--async-checkpoints the moments fall inside the background's writes, syncs, agreements and commit
too, and with tp2/pp2 between one folder's completion and another's. The moment
is anchored to progress, not to the launch: it is replayed as "d seconds after step k's metrics
line" (or after the victim process appeared, k = 0), with k and d from the uninterrupted run's
timeline, so a failing seed replays the same place in training (`--seed S --runs 1`, printed on
failure).

Every run must: end within --job-deadline seconds of the kill with no process of the job left
(mpirun, daemons, ranks: found by a tag in their environment); keep the newest checkpoint whose
save rank 0 reported (a "lost checkpoint" otherwise); leave a checkpoint that verifies
(shardopt-consolidate reads every shard of every folder the commit names and checks its
CRC-32); resume from it with --resume
(from scratch when the kill came before the first save) and then hold, in metrics.jsonl, the
uninterrupted run's losses bitwise.

Usage: chaos.py --exe bert_pretrain --mpiexec mpirun --consolidate shardopt-consolidate
                --corpus tests/assets/corpus [--runs N] [--seed S] [--ranks 2,4] [--steps 10]
                [--layouts dp,tp2,pp2] [--async off,on] [--work DIR] [--summary FILE]
Exit status: 0 when every run passed, 1 otherwise."""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TAG = "SHARDOPT_FAULT_RUN"  # every process of a job inherits TAG=<its out dir>/


def tagged(tag):
    """{pid: (rank or None, executable name)} of the live processes whose environment holds tag."""
    found = {}
    needle = f"{TAG}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if needle not in env or stat[stat.rindex(b")") + 2:][:1] == b"Z":  # zombies are gone
            continue
        rank = next((int(v.split(b"=", 1)[1]) for v in env
                     if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        found[int(entry)] = (rank, stat[stat.index(b"(") + 1:stat.rindex(b")")].decode())
    return found


def kill_all(tag):
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def metrics_lines(out):
    """Complete lines of out/metrics.jsonl (a line being written has no newline yet)."""
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(j["step"], repr(j["loss"])) for j in map(json.loads, f)]


def checkpoint_step(out):
    try:
        base = os.path.join(out, "checkpoint")  # the committed save (Note [One commit for a grid])
        with open(os.path.join(base, "commit.json")) as f:
            commit = json.load(f)
        with open(os.path.join(base, commit["path"], commit["folders"][0]["path"], "manifest.json")) as f:
            return json.load(f)["trainer"]["step"]
    except OSError:
        return None


def committed_folders(out):
    """Every (pipeline, tensor) folder of the committed save, each verified on its own."""
    base = os.path.join(out, "checkpoint")
    with open(os.path.join(base, "commit.json")) as f:
        commit = json.load(f)
    return [os.path.join(base, commit["path"], folder["path"]) for folder in commit["folders"]]


def reported_saves(log):
    """Steps whose checkpoint rank 0 reported committed: "[bert] checkpoint: step N -> DIR (s)"
    (a synchronous save) or "[bert] checkpoint: step N committed" (an asynchronous one, joined;
    its "-> DIR (... writing in the background)" line comes before the commit)."""
    steps = []
    for line in log.splitlines():
        at = line.find("[bert] checkpoint: step ")
        if at < 0:
            continue
        rest = line[at:]
        if (" -> " in rest and "in the background" not in rest) or " committed" in rest:
            steps.append(int(rest.split()[3]))
    return steps


def job_env():
    """The environment of every job: one thread per rank, OpenMPI as root, no test fault."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl", "self,vader")
    env.pop("BERT_TEST_FAULT", None)
    return env


def run_quiet(cmd, what):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"[chaos] {what} failed ({p.returncode}):\n{p.stdout}")


def prepare_data(exe, corpus, work):
    """The tiny vocabulary and data set of every run: (vocab, data) in work."""
    vocab, data = os.path.join(work, "vocab.txt"), os.path.join(work, "data.bin")
    run_quiet([exe, "build-vocab", "--corpus", corpus, "--vocab-size", "2000", "-o", vocab],
              "build-vocab")
    run_quiet([exe, "create-data", "--corpus", corpus, "--vocab", vocab, "--max-seq-length", "64",
               "--dupe-factor", "2", "-o", data], "create-data")
    return vocab, data


def finish(proc, tag, deadline_s, linger_s=0.0):
    """Waits for a job; returns (exit status or None when it hung, stray processes). With
    linger_s, a stray is given that long to exit by itself before it is killed, and its entry
    says which it did (a process still exiting, or one that would have stayed)."""
    try:
        rc = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        kill_all(tag)
        proc.wait()
        return None, {}
    # mpirun has returned; a process still carrying the tag was left behind, or is still dying
    # (after two deaths OpenMPI 4's mpirun signals the other ranks and returns without reaping).
    strays = tagged(tag)
    if strays and linger_s > 0:
        t0, gone = time.monotonic(), {}
        while len(gone) < len(strays) and time.monotonic() - t0 < linger_s:
            time.sleep(0.005)
            alive = tagged(tag)
            gone.update({p: time.monotonic() - t0 for p in strays if p not in alive and p not in gone})
        strays = {p: v + ((f"exited by itself {gone[p]:.3f} s after mpirun",) if p in gone else
                          (f"still alive {linger_s:g} s after mpirun: killed",))
                  for p, v in strays.items()}
    kill_all(tag)
    return rc, strays


def timeline(proc, out, t0):
    """Follows a job to its end: [(event, seconds since t0)], event 0 when the first rank process
    appeared, k when step k's metrics line did."""
    events, seen = [], 0
    while proc.poll() is None:
        if not events and any(r is not None for r, _ in tagged(out + "/").values()):
            events.append((0, time.monotonic() - t0))
        n = metrics_lines(out)
        while seen < n:
            seen += 1
            events.append((seen, time.monotonic() - t0))
        time.sleep(0.002)
    return events


def draw_moment(rng, events, wall):
    """A moment uniform over a run's wall time, start-up (MPI, data, model: half the wall time of a
    short run) getting a fifth of the moments, the steps the rest; returned anchored to progress:
    (step k, d seconds after its metrics line), k = 0 for the start of the rank processes."""
    start, first = events[0][1], events[1][1]
    u = rng.uniform(start, first) if rng.random() < 0.2 else rng.uniform(first, wall)
    anchor, at = max((e for e in events if e[1] <= u), key=lambda e: e[1])
    return anchor, u - at


def reach(proc, out, anchor, ranks):
    """Waits until the job has logged `anchor` steps and every rank of `ranks` runs; returns
    {rank: pid}, or None when the job ended first."""
    while proc.poll() is None:
        if metrics_lines(out) >= anchor:
            pids = {r: p for p, (r, name) in tagged(out + "/").items()
                    if r in ranks and name.startswith("bert_pretrain")}
            if len(pids) == len(ranks):
                return pids
        time.sleep(0.002)
    return None


# The trainer's arguments of each layout (pipelines at stage 1, as tests/example/bert_pp_test.sh).
LAYOUTS = {"dp": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2", "--micro-batches", "2"]}


def keep_or_clean(tag, failures, out, logs, replay):
    """A failed run: prints its failures, the directory and logs kept, and the replay command; a
    passed one: removes them."""
    if failures:
        for f in failures:
            print(f"[{tag}]   {f}", flush=True)
        print(f"[{tag}]   kept {out} ({', '.join(logs)}); replay: {replay}", flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)
        for p in logs:
            os.remove(p)


class Campaign:
    def __init__(self, a):
        self.a = a
        self.work = a.work or tempfile.mkdtemp(prefix="shardopt-chaos.")
        os.makedirs(self.work, exist_ok=True)
        self.current = None  # the out dir of the run under way
        # (ranks, layout, async) -> (losses, [(event, seconds since launch)], wall seconds)
        self.reference = {}
        self.env = job_env()

    def prepare(self):
        self.vocab, self.data = prepare_data(self.a.exe, self.a.corpus, self.work)

    def launch(self, out, config, log, *extra):
        """Starts the job of config (ranks, layout, async) in the background, its output into
        file `log`; returns the Popen."""
        ranks, layout, background = config
        env = dict(self.env, **{TAG: out + "/"})
        stage = 1 if layout == "pp2" else self.a.stage
        extra = LAYOUTS[layout] + (["--async-checkpoints"] if background else []) + list(extra)
        cmd = [self.a.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(ranks), self.a.exe, "--preset", "tiny", "--stage", str(stage),
               "--steps", str(self.a.steps), "--warmup-steps", "2", "--lr", "2e-3",
               "--batch-size", "4", "--max-seq-length", "64", "--vocab", self.vocab,
               "--data", self.data, "--no-plot", "--progress", "lines", "--log-every", "1",
               "--checkpoint-every", "2", "--timeout", str(self.a.timeout), "--out", out, *extra]
        with open(log, "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    @staticmethod
    def name(config):
        ranks, layout, background = config
        return f"np{ranks}-{layout}" + ("-async" if background else "")

    def uninterrupted(self, config):
        """The reference run: its losses and the timeline the moments are drawn from."""
        out = os.path.join(self.work, "whole-" + self.name(config))
        t0 = time.monotonic()
        log = out + ".log"
        proc = self.launch(out, config, log)
        events = timeline(proc, out, t0)
        wall = time.monotonic() - t0
        if proc.returncode != 0 or metrics_lines(out) != self.a.steps:
            sys.exit(f"[chaos] the uninterrupted run {self.name(config)} failed:\n" + open(log).read())
        self.reference[config] = (losses(out), events, wall)
        print(f"[chaos] uninterrupted run {self.name(config)}: {self.a.steps} steps in {wall:.1f} s",
              flush=True)

    def draw(self, seed):
        rng = random.Random(seed)
        ranks = rng.choice(self.a.ranks)
        layouts = [l for l in self.a.layouts if l == "dp" or ranks % 2 == 0]
        config = (ranks, rng.choice(layouts), rng.choice(self.a.background))
        if config not in self.reference:
            self.uninterrupted(config)
        victim = rng.randrange(ranks)
        _, events, wall = self.reference[config]
        return (config, victim) + draw_moment(rng, events, wall)

    def chaos_run(self, seed):
        """One run; returns (list of failures, figures for the summary)."""
        config, victim, anchor, delay = self.draw(seed)
        ranks = config[0]
        out = os.path.join(self.work, f"run-{seed}")
        self.current = out
        shutil.rmtree(out, ignore_errors=True)
        what = f"seed {seed}, {self.name(config)}: SIGKILL rank {victim} {delay:.3f} s after " + (
            f"step {anchor}'s line" if anchor else "it started")
        failures, fig = [], {"ranks": ranks, "layout": config[1], "async": config[2],
                             "missed": False, "hung": False, "lost": False, "strays": 0,
                             "from_scratch": False}
        log, rlog = out + ".log", out + ".resume.log"
        proc = self.launch(out, config, log)
        pid = (reach(proc, out, anchor, [victim]) or {}).get(victim)
        if pid is not None:
            time.sleep(delay)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pid = None
        killed_at = time.monotonic()
        rc, strays = finish(proc, out + "/", self.a.job_deadline)
        ended = time.monotonic() - killed_at
        text = open(log).read()
        if rc is None:
            fig["hung"] = True
            failures.append(f"the job did not end within {self.a.job_deadline} s of the kill")
        if strays:
            fig["strays"] = len(strays)
            failures.append(f"processes left behind: {strays}")
        if rc == 0 and metrics_lines(out) == self.a.steps:
            fig["missed"] = True  # the job had finished before the moment came
        elif rc == 0:
            failures.append("the job reported success after losing a rank")
        saved = checkpoint_step(out)
        reported = reported_saves(text)
        if reported and (saved is None or saved < reported[-1]):
            fig["lost"] = True
            failures.append(f"the checkpoint of step {reported[-1]} was reported written but the "
                            f"checkpoint holds step {saved}")
        for folder in committed_folders(out) if saved is not None else []:
            v = subprocess.run([self.a.consolidate, folder, os.path.join(out, "verify.pt"),
                                "--optimizer-state", os.path.join(out, "verify-optim.pt")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if v.returncode != 0:
                failures.append(f"the checkpoint of step {saved} does not verify: {v.stdout}")
        fig["from_scratch"] = saved is None
        proc = self.launch(out, config, rlog, *(["--resume"] if saved is not None else []))
        rrc, rstrays = finish(proc, out + "/", self.a.resume_deadline)
        if rrc != 0:
            failures.append(f"the resumed job exited with {rrc} (log {rlog}):\n" + open(rlog).read())
        if rstrays:
            failures.append(f"the resumed job left processes behind: {rstrays}")
        try:
            same = losses(out) == self.reference[config][0]
        except (OSError, ValueError, KeyError) as e:
            same, text = False, f"{text}\nmetrics.jsonl unreadable: {e}"
        if not same:
            failures.append("the resumed losses differ from the uninterrupted run's")
        status = "FAIL" if failures else "ok"
        print(f"[chaos] {status} {what}: "
              + ("missed (the job had ended)" if fig["missed"] else
                 f"mpirun exited {rc} {ended:.1f} s after the kill")
              + f", checkpoint step {saved} (last reported {reported[-1] if reported else None}), "
              + ("trained from scratch" if saved is None else "resumed")
              + (", losses bitwise equal" if same else ""), flush=True)
        keep_or_clean("chaos", failures, out, (log, rlog), self.replay(seed))
        return failures, fig

    def replay(self, seed):
        a = self.a
        return (f"{sys.argv[0]} --exe {a.exe} --mpiexec {a.mpiexec} --consolidate {a.consolidate} "
                f"--corpus {a.corpus} --ranks {','.join(map(str, a.ranks))} "
                f"--layouts {','.join(a.layouts)} --async {','.join(a.async_)} --steps {a.steps} "
                f"--stage {a.stage} --timeout {a.timeout} --seed {seed} --runs 1")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exe", required=True)
    p.add_argument("--mpiexec", default="mpirun")
    p.add_argument("--consolidate", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=1, help="run i uses seed S + i")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["dp", "tp2", "pp2"],
                   help="drawn from: dp, tp2, pp2 (tp2 and pp2 at an even number of ranks)")
    p.add_argument("--async", dest="async_", type=lambda s: s.split(","), default=["off", "on"],
                   help="drawn from: off (synchronous saves), on (--async-checkpoints)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--timeout", type=int, default=10, help="the trainer's collective --timeout")
    p.add_argument("--job-deadline", type=float, default=30,
                   help="seconds a job may take to end after the kill")
    p.add_argument("--resume-deadline", type=float, default=300)
    p.add_argument("--work", help="working directory (default: a new temporary one)")
    p.add_argument("--summary", help="append the campaign's figures to this JSON-lines file")
    a = p.parse_args()
    bad = [l for l in a.layouts if l not in LAYOUTS] + [m for m in a.async_ if m not in ("off", "on")]
    if bad:
        p.error(f"unknown --layouts/--async values: {bad}")
    a.background = [m == "on" for m in a.async_]
    c = Campaign(a)
    t0 = time.monotonic()
    figs, failed = [], []
    # SIGTERM (or ^C) ends a long campaign early with the figures of the runs it completed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        c.prepare()
        for i in range(a.runs):
            failures, fig = c.chaos_run(a.seed + i)
            figs.append(fig)
            if failures:
                failed.append(a.seed + i)
    except KeyboardInterrupt:
        print(f"[chaos] stopped after {len(figs)} of {a.runs} runs", flush=True)
    finally:  # nothing of ours survives the campaign, whatever happened
        for tag in [os.path.join(c.work, "whole-" + c.name(k)) for k in c.reference] + [c.current]:
            if tag:
                kill_all(tag + "/")
    wall = time.monotonic() - t0
    summary = {"runs": len(figs), "failures": len(failed), "failed_seeds": failed,
               "lost_checkpoints": sum(f["lost"] for f in figs),
               "hung_jobs": sum(f["hung"] for f in figs),
               "stray_processes": sum(f["strays"] for f in figs),
               "missed_kills": sum(f["missed"] for f in figs),
               "from_scratch": sum(f["from_scratch"] for f in figs),
               "runs_by_ranks": {str(r): sum(f["ranks"] == r for f in figs) for r in a.ranks},
               "runs_by_layout": {l: sum(f["layout"] == l for f in figs) for l in a.layouts},
               "async_runs": sum(f["async"] for f in figs),
               "seeds": [a.seed, a.seed + len(figs) - 1], "steps": a.steps, "stage": a.stage,
               "wall_s": round(wall, 1)}
    print("[chaos] summary: " + json.dumps(summary), flush=True)
    if a.summary:
        with open(a.summary, "a") as f:
            f.write(json.dumps(summary) + "\n")
    if not failed and not a.work and len(figs) == a.runs:
        shutil.rmtree(c.work, ignore_errors=True)
    ok = not failed and len(figs) == a.runs
    print("[chaos] PASS" if ok else f"[chaos] FAIL: seeds {failed}" if failed else
          "[chaos] INCOMPLETE", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
