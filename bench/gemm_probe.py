#!/usr/bin/env python3
"""How much of the machine's compute a BERT training step uses: the model's FLOPs per step, and the
rate this torch reaches on the step's own matrix products (a probe), for bench/compare_peers.py.

  gemm_probe.py [--preset peer] [--batch 8] [--positions all|masked] [--threads 1] [--reps 5]

prints one JSON line: {"flops_per_step": ..., "gflops": ..., "torch": ..., "blas": ...}.

Note [Compute fraction]
The model's FLOPs are its matrix products, forward and backward (3x the forward's: each product
C = A B has the two backward products dA = dC B^T and dB = A^T dC): per layer the four attention
projections and the two MLP matrices (2 T h (4 h + 2 I) for T tokens), the attention's two batched
products (4 b s^2 h), then the MLM head's transform (2 T h^2) and the tied decoder (2 T' h V, T' the
positions that get logits: every one, or the masked 15%). LayerNorm, softmax, GELU and the optimizer
are left out: on this CPU the products are nearly all of the step's arithmetic. The probe times
exactly those products (every forward and backward shape, at one thread, as each rank runs) with
the same torch, warmed up, best of --reps rounds; its rate is what the machine gives this model's
arithmetic, and a step's fraction is (FLOPs per step / step time) / that rate.
"""
import argparse
import json
import time

SHAPES = {  # the peers' models (bench/peers/common.py)
    "peer": dict(vocab=30522, hidden=256, layers=4, heads=4, intermediate=1024, seq=128),
    "tiny": dict(vocab=512, hidden=32, layers=2, heads=2, intermediate=64, seq=16),
}
MASK_PROB = 0.15


def products(shape, batch, positions):
    """Every matrix product of one forward pass: (count, batch dims, m, k, n)."""
    h, inter, s, v, heads = (shape["hidden"], shape["intermediate"], shape["seq"], shape["vocab"],
                             shape["heads"])
    t = batch * s
    logits = t if positions == "all" else max(1, round(t * MASK_PROB))
    layers = shape["layers"]
    return [
        (4 * layers, 1, t, h, h),          # q, k, v, o
        (layers, 1, t, h, inter),          # fc1
        (layers, 1, t, inter, h),          # fc2
        (layers, batch * heads, s, h // heads, s),  # q k^T
        (layers, batch * heads, s, s, h // heads),  # att v
        (1, 1, t, h, h),                   # the head's transform
        (1, 1, logits, h, v),              # the tied decoder
    ]


def flops_per_step(shape, batch, positions):
    """Training FLOPs of one rank's step: 3x the forward products (Note [Compute fraction])."""
    return 3 * sum(2 * c * bd * m * k * n for c, bd, m, k, n in products(shape, batch, positions))


def probe(shape, batch, positions, reps):
    """Seconds for one step's products (forward and backward shapes) at this torch's rate."""
    import torch
    ops = []
    for c, bd, m, k, n in products(shape, batch, positions):
        for (mm, kk, nn) in ((m, k, n), (m, n, k), (k, m, n)):  # C = A B, dA = dC B^T, dB = A^T dC
            a = torch.randn(bd, mm, kk) if bd > 1 else torch.randn(mm, kk)
            b = torch.randn(bd, kk, nn) if bd > 1 else torch.randn(kk, nn)
            ops.append((c, a, b))
    best = float("inf")
    for _ in range(reps + 1):  # the first round warms caches and BLAS
        start = time.perf_counter()
        for c, a, b in ops:
            for _ in range(c):
                torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def blas():
    import torch
    try:
        cfg = torch.__config__.show()
    except Exception:  # noqa: BLE001 - informational only
        return "?"
    for key in ("BLAS_INFO", "LAPACK_INFO"):
        for part in cfg.replace(",", "\n").splitlines():
            if key in part:
                return part.split("=", 1)[-1].strip()
    return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="peer", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--positions", default="all", choices=("all", "masked"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    shape = SHAPES[a.preset]
    flops = flops_per_step(shape, a.batch, a.positions)
    seconds = probe(shape, a.batch, a.positions, a.reps)
    print(json.dumps({"flops_per_step": flops, "probe_s": seconds, "gflops": flops / seconds / 1e9,
                      "torch": torch.__version__, "blas": blas(), "threads": a.threads}))


if __name__ == "__main__":
    main()
