#!/usr/bin/env python3
"""Runs the peer baseline script unchanged, and also reports its process CPU time per step.

    python3 bench/peer_cpu_clock.py WARMUP ITERATIONS PEER_SCRIPT [peer arguments...]

The peer times each iteration with exactly three time.perf_counter() calls (before zero_grad,
after backward, after step). This wrapper keeps perf_counter's value (wall time, so the peer's
own report is untouched) and records time.process_time() (CPU seconds of every thread of the
process) at the same three points; after the last of ITERATIONS iterations it prints the median
CPU seconds per iteration after WARMUP as "[peer-cpu] rank R cpu_step_s X iterations N" (at once:
the peer's teardown may hang, see compare_peers.py). On a shared machine CPU time per step is far
steadier than wall time.
"""
import os
import runpy
import statistics
import sys
import time

_wall = time.perf_counter
_cpu = []


def _clock():
    _cpu.append(time.process_time())
    now = _wall()
    if len(_cpu) == 3 * _iterations:
        _report()
    return now


def _report():
    warmup = _warmup
    iters = len(_cpu) // 3
    steps = [_cpu[3 * i + 2] - _cpu[3 * i] for i in range(iters)][warmup:]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))
    if steps:
        print(f"[peer-cpu] rank {rank} cpu_step_s {statistics.median(steps):.6f} iterations {len(steps)}",
              flush=True)


if __name__ == "__main__":
    _warmup, _iterations, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sys.argv = sys.argv[3:]
    time.perf_counter = _clock
    runpy.run_path(script, run_name="__main__")
