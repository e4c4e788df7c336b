#!/usr/bin/env python3
"""Runs the peer baseline script unchanged, and also reports its process CPU time per step.

    python3 bench/peer_cpu_clock.py WARMUP PEER_SCRIPT [peer arguments...]

The peer times each iteration with exactly three time.perf_counter() calls (before zero_grad,
after backward, after step). This wrapper keeps perf_counter's value (wall time, so the peer's
own report is untouched) and records time.process_time() (CPU seconds of every thread of the
process) at the same three points; at exit it prints the median CPU seconds per iteration after
WARMUP iterations as "[peer-cpu] rank R cpu_step_s X iterations N". On a shared machine CPU time
per step is far steadier than wall time.
"""
import atexit
import os
import runpy
import statistics
import sys
import time

_wall = time.perf_counter
_cpu = []


def _clock():
    _cpu.append(time.process_time())
    return _wall()


def _report():
    warmup = int(sys_warmup)
    iters = len(_cpu) // 3
    steps = [_cpu[3 * i + 2] - _cpu[3 * i] for i in range(iters)][warmup:]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))
    if steps:
        print(f"[peer-cpu] rank {rank} cpu_step_s {statistics.median(steps):.6f} iterations {len(steps)}",
              flush=True)


if __name__ == "__main__":
    sys_warmup, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    time.perf_counter = _clock
    atexit.register(_report)
    runpy.run_path(script, run_name="__main__")
