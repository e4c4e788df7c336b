#!/usr/bin/env python3
"""Markdown for scripts/gpu-check.sh from the JSON its benchmarks wrote into a folder: the fused
AdamW against device-to-device copy bandwidth, every GPU test with its result (the thread-rank
ones at N = 2 and 4 among them), and torch's fused AdamW, the BERT-base step against
PyTorch DDP + fused AdamW, each with issue 18's goal and whether it is met."""
import json
import os
import sys


def load(folder, name):
    try:
        with open(os.path.join(folder, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verdict(ok):
    return "met" if ok else "**not met**"


def main():
    folder = sys.argv[1]
    tests = load(folder, "gpu_tests")
    if tests:
        cases = [(s["name"], c) for s in tests.get("testsuites", []) for c in s.get("testsuite", [])]
        skipped = [f"{n}.{c['name']}" for n, c in cases if c.get("result") == "SKIPPED"]
        print(f"GPU tests: {tests.get('tests', '?')} run, {tests.get('failures', '?')} failed, "
              f"{len(skipped)} skipped{': ' + ', '.join(skipped) if skipped else ''}.")
        print("| test | result | s |")
        print("|---|---|---|")
        for name, c in cases:
            result = "FAILED" if c.get("failures") else c.get("result", "?")
            print(f"| {name}.{c['name']} | {result} | {c.get('time', '?')} |")
        print()
        for suite in tests.get("testsuites", []):
            for case in suite.get("testsuite", []):
                if case.get("failures"):
                    msg = case["failures"][0].get("failure", "").splitlines()[:2]
                    print(f"- FAILED {suite['name']}.{case['name']}: {' / '.join(msg)}")
        print()
    k, t = load(folder, "kernels"), load(folder, "kernels_torch")
    if k and "fused_adamw_ms" in k:
        print(f"### Fused AdamW on {k['numel']:.0e} parameters ({k['device']})\n")
        print("| what | ms | GB/s (28 B/param; copy: 2x bytes) |")
        print("|---|---|---|")
        print(f"| device-to-device copy (cudaMemcpy) | {k['d2d_copy_ms']:.3f} | {k['d2d_copy_GBps']:.0f} |")
        print(f"| shardopt fused AdamW | {k['fused_adamw_ms']:.3f} | {k['fused_adamw_GBps']:.0f} |")
        print(f"| shardopt fused AdamW + bf16 copy | {k['fused_adamw_bf16_copy_ms']:.3f} | "
              f"{k['fused_adamw_bf16_copy_GBps']:.0f} (30 B/param) |")
        if t and "fused_adamw_ms" in t:
            print(f"| torch {t['torch']} AdamW(fused=True) | {t['fused_adamw_ms']:.3f} | {t['fused_adamw_GBps']:.0f} |")
        if t and "foreach_adamw_ms" in t:
            print(f"| torch AdamW(foreach=True) | {t['foreach_adamw_ms']:.3f} | {t['foreach_adamw_GBps']:.0f} |")
        print()
        frac = k["fused_adamw_GBps"] / k["d2d_copy_GBps"]
        print(f"- goal >= 80% of copy bandwidth: {frac:.0%}, {verdict(frac >= 0.8)}")
        if t and "fused_adamw_ms" in t:
            speed = t["fused_adamw_ms"] / k["fused_adamw_ms"]
            print(f"- goal >= 1.0x torch's fused AdamW: {speed:.2f}x, {verdict(speed >= 1.0)}")
        print()
    names = ("bert_stage2", "bert_stage3", "bert_stage3_auto", "bert_torch")
    rows = [(n, load(folder, n)) for n in names]
    rows = [(n, r) for n, r in rows if r and "samples_per_s" in r]
    if rows:
        print("### BERT-base step (seq 128, batch 32, bf16, one GPU)\n")
        print("| run | median step ms | samples/s | peak allocated MiB |")
        print("|---|---|---|---|")
        for n, r in rows:
            peak = r["peak_allocated_bytes"] / 2**20 if r["peak_allocated_bytes"] >= 0 else float("nan")
            print(f"| {r['what']} | {r['median_step_ms']:.1f} | {r['samples_per_s']:.1f} | {peak:.0f} |")
        print()
        got = dict(rows)
        if "bert_stage2" in got and "bert_torch" in got:
            ratio = got["bert_stage2"]["samples_per_s"] / got["bert_torch"]["samples_per_s"]
            print(f"- goal stage 2 within 5% of PyTorch: {ratio:.3f}x, {verdict(ratio >= 0.95)}")
        for s3 in ("bert_stage3", "bert_stage3_auto"):
            if s3 in got and "bert_torch" in got:
                a, b = got[s3]["peak_allocated_bytes"], got["bert_torch"]["peak_allocated_bytes"]
                print(f"- goal {got[s3]['what']} peak memory below PyTorch's: {a / 2**20:.0f} vs "
                      f"{b / 2**20:.0f} MiB, {verdict(0 <= a < b)}")
    for name in ("kernels", "kernels_torch", "bert_stage2", "bert_stage3", "bert_stage3_auto",
                 "bert_torch"):
        r = load(folder, name)
        if r and "skipped" in r:
            print(f"- {name}: skipped: {r['skipped']}")


if __name__ == "__main__":
    main()
