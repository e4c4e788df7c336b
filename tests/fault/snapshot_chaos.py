#!/usr/bin/env python3
"""Chaos campaign on in-memory snapshots: kill a rank, a whole emulated host or a rank inside a
snapshot, restart the job, and check that it continues from host memory bitwise.

The BERT-tiny job of tests/fault/bert_snapshot_test.sh (--ranks ranks, --ranks-per-host per
emulated host, a snapshot every --snapshot-every = K steps into RUN/shm/host-{host}; Note
[Snapshots in memory] in shardopt/snapshot.hpp). Each run draws from its own seed one failure
(--kinds):
  rank      SIGKILL of a random rank at a random moment of the run (chaos.py's moments: uniform
            over the failure-free run's wall time, start-up a fifth of them, anchored to progress);
  host      SIGKILL of every rank of a random emulated host at such a moment, and its snapshot
            directory removed before the restart (a replaced host's memory is gone);
  snapshot  a rank killed inside a snapshot's background exchange: half the runs by the trainer
            itself (BERT_TEST_FAULT=R:S:kill-in-snapshot, right after snapshot S started), half
            by SIGKILL a uniform 0 to --snapshot-window s after step S's metrics line (rank 0
            starts snapshot S right after writing it).
The driver then restarts the job as scripts/shardopt-run does, exporting SHARDOPT_RESTART=1 and
SHARDOPT_FAILED_AT = the moment the victim died (the kill, or for a test fault the moment the
driver saw the process die), so the printed recovery runs from the death itself.

Every run must: end its failed attempt within --job-deadline s of the kill and leave no process
behind (chaos.py's tags), both attempts (one that exits by itself within --linger s of mpirun's
return is counted as lingering and printed, not failed: after two ranks die, OpenMPI 4's mpirun
signals the others and returns without waiting for them); restart and finish; restore a snapshot whose records come
from every rank's own copy (rank, snapshot) or from the buddies of the lost host's ranks (host);
repeat at most K steps, counting as repeated the steps the failed attempt logged in metrics.jsonl
past the restored one (the step in progress at the death was never finished: not repeated; a
restart from scratch repeats every logged step); print its recovery and restore times; and hold in
metrics.jsonl the losses of the failure-free run without snapshots, every step, bitwise. The times
are collected, not judged (--max-recovery, --max-restore count the runs above them).

Usage: snapshot_chaos.py --exe bert_pretrain --corpus tests/assets/corpus [--mpiexec mpirun]
                         [--runs N] [--seed S] [--kinds rank,host,snapshot] [--work DIR]
                         [--summary FILE]
Exit status: 0 when every run passed, 1 otherwise."""
import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import (TAG, draw_moment, finish, job_env, keep_or_clean, kill_all, losses,  # noqa: E402
                   metrics_lines, prepare_data, reach, timeline)

KINDS = ("rank", "host", "snapshot")
RESTORED = re.compile(r"\[bert\] restored snapshot (\d+) \(step (\d+)\) from host memory in "
                      r"([0-9.]+) s \((.*)\)")
RECOVERED = re.compile(r"\[bert\] recovered: ([0-9.]+) s from the failure .*\(restore ([0-9.]+) s\)")


def logged_step(out):
    """The step of the last complete line of out/metrics.jsonl (0 when none)."""
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
            lines = f.read().split(b"\n")[:-1]  # the last element: a line being written, or b""
    except OSError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def dead(pid):
    """Whether process pid has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")


class SnapshotCampaign:
    def __init__(self, a):
        self.a = a
        self.work = a.work or tempfile.mkdtemp(prefix="shardopt-snapchaos.")
        os.makedirs(self.work, exist_ok=True)
        self.env = job_env()
        for name in ("SHARDOPT_RESTART", "SHARDOPT_FAILED_AT"):
            self.env.pop(name, None)
        self.current = None
        self.hosts = a.ranks // a.ranks_per_host

    def launch(self, out, log, snapshots=True, **env):
        """Starts one attempt of the job in the background, its output into file `log`."""
        env = dict(self.env, **{TAG: out + "/"}, **env)
        cmd = [self.a.mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(self.a.ranks), self.a.exe, "--preset", "tiny", "--stage",
               str(self.a.stage), "--steps", str(self.a.steps), "--warmup-steps", "2", "--lr",
               "2e-3", "--batch-size", "2", "--max-seq-length", "64", "--vocab", self.vocab,
               "--data", self.data, "--no-plot", "--progress", "lines", "--log-every", "1",
               "--timeout", str(self.a.timeout), "--out", out]
        if snapshots:
            cmd += ["--snapshot-every", str(self.a.snapshot_every), "--snapshot-dir",
                    os.path.join(out, "shm", "host-{host}"), "--ranks-per-host",
                    str(self.a.ranks_per_host)]
        with open(log, "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def prepare(self):
        self.vocab, self.data = prepare_data(self.a.exe, self.a.corpus, self.work)
        # The losses to reach: a failure-free run without snapshots.
        out = os.path.join(self.work, "whole")
        rc, _ = finish(self.launch(out, out + ".log", snapshots=False), out + "/", 600)
        if rc != 0 or metrics_lines(out) != self.a.steps:
            sys.exit("[snapchaos] the uninterrupted run failed:\n" + open(out + ".log").read())
        self.reference = losses(out)
        # The timeline the moments are drawn from: a failure-free run with snapshots, which must
        # reach the same losses.
        out = os.path.join(self.work, "timeline")
        t0 = time.monotonic()
        proc = self.launch(out, out + ".log")
        self.events = timeline(proc, out, t0)
        self.wall = time.monotonic() - t0
        if proc.returncode != 0 or losses(out) != self.reference:
            sys.exit("[snapchaos] the failure-free run with snapshots failed or left the "
                     "uninterrupted run's losses:\n" + open(out + ".log").read())
        print(f"[snapchaos] failure-free run: {self.a.steps} steps in {self.wall:.1f} s, losses "
              "equal to the run without snapshots", flush=True)

    def draw(self, seed):
        """The failure of run `seed`: a dict with kind, victims, and either a test fault or a
        moment (anchor, delay)."""
        rng = random.Random(seed)
        a = self.a
        kind = rng.choice(a.kinds)
        plan = {"kind": kind, "fault": None, "anchor": 0, "delay": 0.0, "host": None}
        if kind == "snapshot":
            step = rng.randrange(a.snapshot_every, a.steps, a.snapshot_every)  # one snapshot taken
            rank = rng.randrange(a.ranks)
            plan.update(victims=[rank], snapshot_step=step)
            if rng.random() < 0.5:
                plan["fault"] = f"{rank}:{step}:kill-in-snapshot"
            else:
                plan.update(anchor=step, delay=rng.uniform(0, a.snapshot_window))
            return plan
        if kind == "host":
            host = rng.randrange(self.hosts)
            plan.update(host=host, victims=list(range(host * a.ranks_per_host,
                                                      (host + 1) * a.ranks_per_host)))
        else:
            plan["victims"] = [rng.randrange(a.ranks)]
        plan["anchor"], plan["delay"] = draw_moment(rng, self.events, self.wall)
        return plan

    @staticmethod
    def describe(plan):
        who = (f"host {plan['host']} (ranks {', '.join(map(str, plan['victims']))})"
               if plan["kind"] == "host" else f"rank {plan['victims'][0]}")
        if plan["fault"]:
            return f"{who} kills itself in snapshot of step {plan['snapshot_step']} (BERT_TEST_FAULT)"
        return f"SIGKILL {who} {plan['delay']:.3f} s after " + (
            f"step {plan['anchor']}'s line" if plan["anchor"] else "it started")

    def fail_attempt(self, out, log, plan):
        """The first attempt, killed as planned: (exit status, strays, wall time of the death or
        None when the job ended first, seconds from the death to mpirun's exit)."""
        proc = self.launch(out, log, **({"BERT_TEST_FAULT": plan["fault"]} if plan["fault"] else {}))
        pids = reach(proc, out, plan["anchor"], plan["victims"])
        died = None
        if pids is not None and plan["fault"]:  # the trainer kills itself: watch it die
            pid = pids[plan["victims"][0]]
            while proc.poll() is None and not dead(pid):
                time.sleep(0.001)
            died = time.time() if dead(pid) else None
        elif pids is not None:
            time.sleep(plan["delay"])
            hit = 0
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit += 1
                except ProcessLookupError:
                    pass
            died = time.time() if hit else None
        rc, strays = finish(proc, out + "/", self.a.job_deadline, self.a.linger)
        return rc, strays, died, (time.time() - died) if died else None

    def judge_strays(self, attempt, strays, failures, fig):
        """A process alive when mpirun returned fails the run, unless it exited by itself within
        --linger: after two ranks die, OpenMPI 4's mpirun signals the others and returns without
        reaping them, so a large rank may still be dying (counted as lingering, and printed)."""
        gone = {p: v for p, v in strays.items() if v[-1].startswith("exited by itself")}
        if gone:
            fig["lingered"] += len(gone)
            print(f"[snapchaos]   {attempt}: still exiting when mpirun returned: {gone}", flush=True)
        if len(gone) < len(strays):
            failures.append(f"{attempt} left processes behind: "
                            f"{ {p: v for p, v in strays.items() if p not in gone} }")

    def chaos_run(self, seed):
        """One run; returns (failures, figures)."""
        a = self.a
        plan = self.draw(seed)
        out = os.path.join(self.work, f"run-{seed}")
        self.current = out
        shutil.rmtree(out, ignore_errors=True)
        log, rlog = out + ".log", out + ".restart.log"
        fig = {"kind": plan["kind"], "fault": bool(plan["fault"]), "missed": False,
               "restored": None, "logged": 0, "repeated": None, "recovery_s": None,
               "restore_s": None, "exit_s": None, "in_flight_lost": False, "lingered": 0}
        failures = []
        rc, strays, died, fig["exit_s"] = self.fail_attempt(out, log, plan)
        if rc is None:
            failures.append(f"the failed attempt did not end within {a.job_deadline} s of the kill")
        self.judge_strays("the failed attempt", strays, failures, fig)
        fig["logged"] = logged_step(out)
        if rc == 0 and metrics_lines(out) == a.steps:
            # The job had finished before the moment came (a SIGKILL that found the victim
            # exited but not yet reaped "hit" a zombie).
            fig["missed"] = True
            print(f"[snapchaos] ok seed {seed}, {plan['kind']}: {self.describe(plan)}: missed "
                  "(the job had ended)", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            os.remove(log)
            return failures, fig
        if rc == 0:
            failures.append("the job reported success after losing a rank")
        if died is None:
            failures.append("the victim did not die (the test fault did not fire?)")
            died = time.time()
        if plan["kind"] == "host":  # the replaced host's memory is gone
            shutil.rmtree(os.path.join(out, "shm", f"host-{plan['host']}"), ignore_errors=True)
        proc = self.launch(out, rlog, SHARDOPT_RESTART="1", SHARDOPT_FAILED_AT=f"{died:.6f}")
        rrc, rstrays = finish(proc, out + "/", a.restart_deadline, a.linger)
        text = open(rlog).read()
        if rrc != 0:
            failures.append(f"the restarted job exited with {rrc}")
        self.judge_strays("the restarted job", rstrays, failures, fig)
        restored, recovered = RESTORED.search(text), RECOVERED.search(text)
        step = int(restored.group(2)) if restored else 0
        fig["restored"] = step if restored else None
        fig["repeated"] = fig["logged"] - step
        if restored:
            source = restored.group(4)
            want = (f"{a.ranks_per_host} ranks' copies sent by their buddies"
                    if plan["kind"] == "host" else "every rank's own copy")
            if source != want:
                failures.append(f"restored from '{source}', expected '{want}'")
            if not recovered:
                failures.append("no recovery time printed")
            else:
                fig["recovery_s"], fig["restore_s"] = float(recovered.group(1)), float(recovered.group(2))
            if plan["kind"] == "snapshot":
                fig["in_flight_lost"] = step < plan["snapshot_step"]
        if fig["repeated"] < 0:
            failures.append(f"restored step {step}, past the last logged step {fig['logged']}")
        elif fig["repeated"] > a.snapshot_every:
            failures.append(f"{fig['repeated']} steps repeated (logged {fig['logged']}, restored "
                            f"{'step %d' % step if restored else 'nothing: from scratch'}), more "
                            f"than K = {a.snapshot_every}")
        try:
            same = losses(out) == self.reference
        except (OSError, ValueError, KeyError) as e:
            same = False
            failures.append(f"metrics.jsonl unreadable: {e}")
        if not same:
            failures.append("the restarted run's losses differ from the uninterrupted run's")
        print(f"[snapchaos] {'FAIL' if failures else 'ok'} seed {seed}, {plan['kind']}: "
              f"{self.describe(plan)}: mpirun exited {rc} "
              + (f"{fig['exit_s']:.1f} s after the death" if fig["exit_s"] is not None else "")
              + f", {fig['logged']} steps logged, "
              + (f"restored step {step} ({fig['repeated']} repeated), recovery "
                 f"{fig['recovery_s']} s (restore {fig['restore_s']} s)" if restored else
                 "no snapshot yet: from scratch")
              + (", losses bitwise equal" if same else ""), flush=True)
        keep_or_clean("snapchaos", failures, out, (log, rlog), self.replay(seed))
        return failures, fig

    def replay(self, seed):
        a = self.a
        return (f"{sys.argv[0]} --exe {a.exe} --mpiexec {a.mpiexec} --corpus {a.corpus} "
                f"--ranks {a.ranks} --ranks-per-host {a.ranks_per_host} --steps {a.steps} "
                f"--snapshot-every {a.snapshot_every} --stage {a.stage} --timeout {a.timeout} "
                f"--kinds {','.join(a.kinds)} --seed {seed} --runs 1")


def spread(values):
    """'median / max' of the values, or '-'."""
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.3f} / {max(values):.3f}" if values else "-"


def summarize(figs, failed, a, wall):
    """The table (Markdown) and the JSON summary of the runs done."""
    rows = ["| kind | runs | missed | from scratch | restored | repeated steps (0/1/2+) | "
            "in-flight snapshot lost | failures | recovery s (median / max) | restore s "
            "(median / max) | of which death to mpirun's exit s | of which the new job's start to "
            "its first step's end s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = [(k, [f for f in figs if f["kind"] == k]) for k in a.kinds] + [("all", figs)]
    for kind, fs in groups:
        hit = [f for f in fs if not f["missed"]]
        rep = [f["repeated"] for f in hit if f["repeated"] is not None]
        rows.append(
            f"| {kind} | {len(fs)} | {sum(f['missed'] for f in fs)} | "
            f"{sum(f['restored'] is None for f in hit)} | {sum(f['restored'] is not None for f in hit)} | "
            f"{sum(r <= 0 for r in rep)}/{sum(r == 1 for r in rep)}/{sum(r >= 2 for r in rep)} | "
            + (f"{sum(f['in_flight_lost'] for f in hit)}" if kind == "snapshot" else "-")
            + f" | {sum(f['failed'] for f in fs)} | {spread(f['recovery_s'] for f in hit)} | "
            f"{spread(f['restore_s'] for f in hit)} | "
            f"{spread(f['exit_s'] for f in hit if f['recovery_s'] is not None)} | "
            f"{spread(f['recovery_s'] - f['exit_s'] for f in hit if f['recovery_s'] is not None)} |")
    recov = [f["recovery_s"] for f in figs if f["recovery_s"] is not None]
    rest = [f["restore_s"] for f in figs if f["restore_s"] is not None]
    summary = {
        "runs": len(figs), "failures": len(failed), "failed_seeds": failed,
        "failures_injected": sum(not f["missed"] for f in figs),
        "by_kind": {k: sum(f["kind"] == k and not f["missed"] for f in figs) for k in a.kinds},
        "test_fault_runs": sum(f["fault"] for f in figs),
        "missed": sum(f["missed"] for f in figs),
        "lingering_processes": sum(f["lingered"] for f in figs),
        "from_scratch": sum(f["restored"] is None and not f["missed"] for f in figs),
        "max_repeated": max((f["repeated"] for f in figs if f["repeated"] is not None), default=None),
        "recovery_s": {"median": statistics.median(recov), "max": max(recov),
                       f"over_{a.max_recovery:g}": sum(r > a.max_recovery for r in recov)} if recov else None,
        "restore_s": {"median": statistics.median(rest), "max": max(rest),
                      f"over_{a.max_restore:g}": sum(r > a.max_restore for r in rest)} if rest else None,
        "seeds": [a.seed, a.seed + len(figs) - 1], "ranks": a.ranks,
        "ranks_per_host": a.ranks_per_host, "steps": a.steps, "snapshot_every": a.snapshot_every,
        "wall_s": round(wall, 1)}
    return "\n".join(rows), summary


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exe", required=True)
    p.add_argument("--mpiexec", default="mpirun")
    p.add_argument("--corpus", required=True)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=1, help="run i uses seed S + i")
    p.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                   help="failures drawn from: rank, host, snapshot")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--snapshot-every", type=int, default=1, help="K")
    p.add_argument("--snapshot-window", type=float, default=0.05,
                   help="seconds after a step's line an external 'snapshot' kill may land")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--timeout", type=int, default=20, help="the trainer's collective --timeout")
    p.add_argument("--job-deadline", type=float, default=60,
                   help="seconds a failed attempt may take to end after the kill")
    p.add_argument("--restart-deadline", type=float, default=300)
    p.add_argument("--max-recovery", type=float, default=5, help="counted, not failed")
    p.add_argument("--max-restore", type=float, default=1, help="counted, not failed")
    p.add_argument("--linger", type=float, default=2.0,
                   help="seconds a process left behind by mpirun may take to exit by itself (it "
                        "fails the run either way; the report says which)")
    p.add_argument("--work", help="working directory (default: a new temporary one)")
    p.add_argument("--summary", help="append the campaign's figures to this JSON-lines file")
    a = p.parse_args()
    bad = [k for k in a.kinds if k not in KINDS]
    if bad:
        p.error(f"unknown --kinds: {bad}")
    if a.ranks % a.ranks_per_host or a.ranks_per_host >= a.ranks:
        p.error("--ranks-per-host must divide --ranks into at least two hosts")
    if a.snapshot_every >= a.steps:
        p.error("--snapshot-every must be below --steps")
    c = SnapshotCampaign(a)
    t0 = time.monotonic()
    figs, failed = [], []
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        c.prepare()
        for i in range(a.runs):
            failures, fig = c.chaos_run(a.seed + i)
            fig["failed"] = bool(failures)
            figs.append(fig)
            if failures:
                failed.append(a.seed + i)
    except KeyboardInterrupt:
        print(f"[snapchaos] stopped after {len(figs)} of {a.runs} runs", flush=True)
    finally:  # nothing of ours survives the campaign, whatever happened
        for tag in (os.path.join(c.work, "whole"), os.path.join(c.work, "timeline"), c.current):
            if tag:
                kill_all(tag + "/")
    table, summary = summarize(figs, failed, a, time.monotonic() - t0)
    print(table, flush=True)
    print("[snapchaos] summary: " + json.dumps(summary), flush=True)
    if a.summary:
        with open(a.summary, "a") as f:
            f.write(json.dumps(summary) + "\n")
    ok = not failed and len(figs) == a.runs
    if ok and not a.work:
        shutil.rmtree(c.work, ignore_errors=True)
    print("[snapchaos] PASS" if ok else f"[snapchaos] FAIL: seeds {failed}" if failed else
          "[snapchaos] INCOMPLETE", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
