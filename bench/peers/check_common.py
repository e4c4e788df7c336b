#!/usr/bin/env python3
"""Checks that bench/peers/common.py's BERT and data are those of the original peer script
(bench/peers/baseline/torch_zero_bert.py, or the path given): the same parameter names, shapes and
initial values for one seed, and the same batches for each rank.

    python bench/peers/check_common.py [path/to/torch_zero_bert.py]
"""
import argparse
import importlib.util
import os
import sys

import torch

import common

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    default = os.path.join(HERE, "baseline", "torch_zero_bert.py")
    path = sys.argv[1] if len(sys.argv) > 1 else default
    if not os.path.isfile(path):
        sys.exit(f"[check] {path} does not exist: pass the original peer script's path")
    spec = importlib.util.spec_from_file_location("torch_zero_bert", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    a = common.finish_args(argparse.Namespace(shape="peer", seed=0, dropout=0.1, parity=False,
                                              batch=8, steps=3, warmup=2))
    ours = common.build_model(a)
    torch.manual_seed(a.seed)
    theirs = peer.BertMLM(a.vocab, a.hidden, a.layers, a.heads, a.intermediate, a.max_pos, a.dropout)
    o, t = dict(ours.named_parameters()), dict(theirs.named_parameters())
    if list(o) != list(t):
        sys.exit(f"[check] parameter names differ: {sorted(set(o) ^ set(t))[:6]}")
    for n in o:
        if o[n].shape != t[n].shape or not torch.equal(o[n], t[n]):
            sys.exit(f"[check] parameter {n} differs: {tuple(o[n].shape)} vs {tuple(t[n].shape)}")
    for rank in range(2):
        mine, orig = common.make_batches(a, rank), peer.make_batches(a, rank)
        if not all(torch.equal(x, y) for b, c in zip(mine, orig) for x, y in zip(b, c)):
            sys.exit(f"[check] rank {rank}'s batches differ")
    n = sum(p.numel() for p in ours.parameters())
    print(f"[check] same model ({len(o)} tensors, {n} parameters, equal at seed 0) and batches "
          f"as {path}")


if __name__ == "__main__":
    main()
