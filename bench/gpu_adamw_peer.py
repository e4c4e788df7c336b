#!/usr/bin/env python3
"""torch's AdamW on one GPU, the peer of bench/gpu_kernels_bench.cpp: fused=True (and foreach,
for reference) over one fp32 tensor of --numel parameters, plus torch's device-to-device copy,
timed with CUDA events (median of --reps after --warmup). Prints one JSON object; without a
device, {"skipped": ...}."""
import argparse
import json
import statistics

import torch


def median_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return
    n = a.numel
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "numel": n,
           "reps": a.reps}
    src = torch.full((n,), 0.01, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), a.warmup, a.reps)
    out["d2d_copy_ms"], out["d2d_copy_GBps"] = ms, 2 * 4 * n / (ms * 1e6)
    del dst
    for mode in ("fused", "foreach"):
        p = torch.nn.Parameter(torch.full((n,), 0.01, device="cuda"))
        p.grad = torch.full((n,), 0.001, device="cuda")
        try:
            opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, **{mode: True})
        except (TypeError, RuntimeError) as e:
            out[f"{mode}_adamw_error"] = str(e)
            continue
        ms = median_ms(opt.step, a.warmup, a.reps)
        out[f"{mode}_adamw_ms"], out[f"{mode}_adamw_GBps"] = ms, 28 * n / (ms * 1e6)
        del opt, p
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
