"""Python side of the checkpoint round trip (run by CTest with Debian's /usr/bin/python3).

Reads the state dict shardopt-consolidate wrote (model.pt, optim.pt) with plain torch.load(path)
(torch >= 2.6 defaults to weights_only=True) and with weights_only=True explicitly, and checks
names, shapes and every value against expected.json (written by the C++ fixture); then saves
every value + 1 (and an extra buffer) as from_python.pt for the C++ side to load back.
Usage: check_consolidated.py FIXTURE_DIR
"""
import json
import sys

import torch


def load_both_ways(path):
    """torch.load(path) as users type it, and with weights_only=True on every torch."""
    plain = torch.load(path)
    safe = torch.load(path, weights_only=True)
    assert type(plain) is type(safe) and sorted(plain) == sorted(safe), path
    return plain


def main(fixture):
    print(f"torch {torch.__version__}")
    sd = load_both_ways(f"{fixture}/model.pt")
    expected = json.load(open(f"{fixture}/expected.json"))
    assert isinstance(sd, dict), f"model.pt holds {type(sd).__name__}, not a dict"
    assert sorted(sd) == sorted(expected), f"names differ: {sorted(sd)} vs {sorted(expected)}"
    elements = 0
    for name, want in expected.items():
        t = sd[name]
        assert isinstance(t, torch.Tensor), f"{name} is {type(t).__name__}"
        assert t.dtype == torch.float32, f"{name} is {t.dtype}"
        assert list(t.shape) == want["shape"], f"{name}: shape {list(t.shape)} != {want['shape']}"
        got = t.flatten().double().tolist()
        assert got == want["values"], f"{name}: values differ"
        elements += t.numel()

    opt = load_both_ways(f"{fixture}/optim.pt")
    assert opt["format"] == "shardopt-optimizer-state", opt.get("format")
    assert opt["step"] == 2 and opt["rule"] == "adamw", (opt["step"], opt["rule"])
    assert sorted(opt["state"]) == sorted(expected)
    for name, buffers in opt["state"].items():
        assert sorted(buffers) == ["exp_avg", "exp_avg_sq"], sorted(buffers)
        assert list(buffers["exp_avg"].shape) == expected[name]["shape"]
    groups = json.loads(opt["param_groups"])
    assert [g["rule"] for g in groups] == ["adamw", "adamw"], groups

    # The reverse direction: a plain dict saved by Python, loaded into a sharded C++ run.
    plus_one = {name: t + 1 for name, t in sd.items()}
    plus_one["extra.buffer"] = torch.zeros(2)
    torch.save(plus_one, f"{fixture}/from_python.pt")
    print(f"ok: {len(sd)} parameters, {elements} elements read by torch.load; optimizer state at "
          f"step {opt['step']}; wrote from_python.pt")


if __name__ == "__main__":
    main(sys.argv[1])
