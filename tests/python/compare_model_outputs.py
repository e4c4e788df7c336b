"""--save-model and --export-hf from any layout against the (1, 1, 1) run's (issues 53 and 55; run
by tests/example/bert_pp_test.sh and bert_tp_test.sh with Debian's /usr/bin/python3).

  compare_model_outputs.py REF_OUT OUT... [--tol 1e-4]

Each OUT is a bert_pretrain --out folder of a run with --save-model (OUT/model.pt, OUT/hf): its
model.pt and its export (model.safetensors, or the k-of-n files and model.safetensors.index.json,
read here with the standard library and torch alone) hold the same keys as REF_OUT's, unsplit
shapes (no vocabulary padding); the export equals the run's own model.pt bitwise (the streamed
export of the live optimizer and the consolidation of its last checkpoint are two paths to the
same fp32 master values); and model.pt is within --tol of REF_OUT's (the same training at another
layout: fp32 rounding only). Prints the largest differences; exits non-zero with the reason.
"""
import argparse
import json
import os
import struct
import sys

import torch


def read_export(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    out = {}
    for f in files:
        raw = open(os.path.join(d, f), "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, v in header.items():
            if name == "__metadata__":
                continue
            assert v["dtype"] == "F32", (d, f, name, v["dtype"])
            a, b = v["data_offsets"]
            t = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]), dtype=torch.float32)
            assert name not in out, f"{d}: {name} in two files"
            out[name] = t.reshape(v["shape"]) if v["shape"] else t.reshape(())
    return out, files


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("outs", nargs="+")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    ref = torch.load(os.path.join(args.ref, "model.pt"))
    ref_export, _ = read_export(os.path.join(args.ref, "hf"))
    assert sorted(ref_export) == sorted(ref), "the reference's export and model.pt differ in keys"
    for out in args.outs:
        pt = torch.load(os.path.join(out, "model.pt"))
        export, files = read_export(os.path.join(out, "hf"))
        if sorted(pt) != sorted(ref):
            sys.exit(f"{out}/model.pt: keys differ from the reference's: only here "
                     f"{sorted(set(pt) - set(ref))}, only there {sorted(set(ref) - set(pt))}")
        if sorted(export) != sorted(ref):
            sys.exit(f"{out}/hf: keys differ from the reference's: only here "
                     f"{sorted(set(export) - set(ref))}, only there {sorted(set(ref) - set(export))}")
        worst, worst_name = 0.0, ""
        for name, want in ref.items():
            if pt[name].shape != want.shape or export[name].shape != want.shape:
                sys.exit(f"{out}: '{name}' has shape {list(pt[name].shape)} (model.pt), "
                         f"{list(export[name].shape)} (export), the reference {list(want.shape)}")
            if not torch.equal(pt[name], export[name]):
                d = (pt[name] - export[name]).abs().max().item()
                sys.exit(f"{out}: '{name}' differs between model.pt and the export by {d:.3g}")
            d = (pt[name] - want).abs().max().item()
            if d > worst:
                worst, worst_name = d, name
        print(f"{out}: {len(pt)} tensors; export ({len(files)} file(s)) == model.pt bitwise; "
              f"largest |model.pt - reference| {worst:.3g} ({worst_name}; tolerance {args.tol})")
        if worst > args.tol:
            sys.exit(f"{out}: model.pt differs from the reference's by {worst:.3g} in {worst_name}")
    print("compare_model_outputs: passed")


if __name__ == "__main__":
    main()
