"""Muon (+ AdamW for the other parameters) through the Python API in float64, Newton-Schulz in
float64 on both sides: N = 1..4 thread-ranks at stages 0-3 against torch.optim.Muon +
torch.optim.AdamW (torch >= 2.9; before, a port of torch's _muon.py below), within 1e-10; the
hyper-parameters as torch spells them (ns_coefficients, adjust_lr_fn) and a group with
use_muon=False."""
import inspect
import math
import threading

import pytest
import torch

import shardopt
from helpers import global_batch, loss_fn, make_model, max_diff, rank_slice

STEPS = 8
TOL = 1e-10
MUON = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=True,
            ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
            adjust_lr_fn="match_rms_adamw")
ADAMW = dict(betas=(0.9, 0.98), eps=1e-8)
_draws = threading.Lock()  # thread-ranks share torch's default generator


def _ns_float64():
    """torch's _zeropower_via_newtonschulz with its bfloat16 cast patched to float64."""
    import torch.optim._muon as module
    source = inspect.getsource(module._zeropower_via_newtonschulz)
    scope = dict(vars(module))
    exec(source.replace("torch.bfloat16", "torch.float64"), scope)
    return scope["_zeropower_via_newtonschulz"]


def _port_muon_step(params, state, lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
                    ns_steps, adjust_lr_fn):
    """torch/optim/_muon.py's _single_tensor_muon, Newton-Schulz in float64 (torch < 2.9)."""
    a, b, c = ns_coefficients
    for p in params:
        buf = state.setdefault(p, torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum) if nesterov else buf
        x = update.to(torch.float64, copy=True)
        tall = x.size(0) > x.size(1)
        if tall:
            x = x.T
        x.div_(torch.linalg.vector_norm(x).clamp(min=eps))
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if tall:
            x = x.T
        rows, cols = p.shape[:2]
        ratio = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" \
            else math.sqrt(max(1, rows / cols))
        p.mul_(1 - lr * weight_decay)
        p.add_(x, alpha=-lr * ratio)


def groups(model):
    """The hidden matrices run Muon; the tied embedding and the vectors run AdamW (group 1, its
    own rate, as torch's docs recommend for embeddings, heads, biases and norms)."""
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and not n.startswith("embed")]
    rest = [(n, p) for n, p in named if not (p.ndim == 2 and not n.startswith("embed"))]
    return [{"params": hidden}, {"params": rest, "use_muon": False, "lr": 0.01,
                                 "weight_decay": 0.0}]


def train_torch(steps=STEPS):
    model = make_model().double()
    g = groups(model)
    hidden = [p for _, p in g[0]["params"]]
    rest = [p for _, p in g[1]["params"]]
    adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.0, **ADAMW)
    if hasattr(torch.optim, "Muon"):
        import torch.optim._muon as module
        original = module._zeropower_via_newtonschulz
        module._zeropower_via_newtonschulz = _ns_float64()
        muon, state = torch.optim.Muon(hidden, **MUON), None
    else:
        muon, state = None, {}
    try:
        for step in range(steps):
            ids, labels = global_batch(step)
            for p in model.parameters():
                p.grad = None
            loss_fn(model, ids, labels).backward()
            with torch.no_grad():
                if muon is not None:
                    muon.step()
                else:
                    _port_muon_step(hidden, state, **MUON)
            adamw.step()
    finally:
        if muon is not None:
            module._zeropower_via_newtonschulz = original
    return model


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_torch_muon(stage, world):
    with _draws:
        reference = train_torch()
    diffs, counts = {}, {}

    def body(comm):
        torch.set_num_threads(1)
        with _draws:
            model = make_model().double()
        opt = shardopt.DistributedOptimizer(
            groups(model), "muon", comm=comm, stage=stage, bucket_bytes=256, ns_dtype="float64",
            adamw_beta1=ADAMW["betas"][0], adamw_beta2=ADAMW["betas"][1], adamw_eps=ADAMW["eps"],
            **MUON)
        ortho = 0
        for step in range(STEPS):
            ids, labels = global_batch(step)
            opt.zero_grad()
            opt.backward(loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                                 rank_slice(labels, comm.rank, comm.size)))
            opt.step()
            ortho += opt.last_step().orthogonalized
        opt.gather_full_parameters()
        diffs[comm.rank] = max_diff(model, reference)
        counts[comm.rank] = ortho

    shardopt.run_ranks(world, body, timeout=120)
    assert len(diffs) == world and max(diffs.values()) <= TOL, diffs
    assert sum(counts.values()) == 2 * STEPS, counts  # mid.weight, out.weight: once a step
    with _draws:
        untrained = make_model().double()
    assert max_diff(reference, untrained) > 1e-3  # the run moved the parameters


def test_hyperparameters_as_torch_spells_them():
    model = make_model()
    opt = shardopt.DistributedOptimizer(groups(model), "muon", lr=0.02,
                                        ns_coefficients=(3.0, -3.2, 1.2),
                                        adjust_lr_fn="spectral_unclamped")
    group = opt.param_groups[0]
    assert group["ns_coefficients"] == (3.0, -3.2, 1.2)
    assert group["adjust_lr_fn"] == "spectral_unclamped"
    assert group["ns_steps"] == 5 and isinstance(group["ns_steps"], int)
    assert group["ns_dtype"] == "bfloat16" and group["use_muon"] is True
    assert opt.param_groups[1]["use_muon"] is False
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        shardopt.DistributedOptimizer(groups(make_model()), "muon", adjust_lr_fn="cubic")
    with pytest.raises(ValueError, match="ns_coefficients"):
        shardopt.DistributedOptimizer(groups(make_model()), "muon", ns_coefficients=(1.0, 2.0))


def test_state_dict_in_torch_layout_round_trip():
    """The consolidated state holds torch.optim.Muon's momentum_buffer for the matrices and
    torch.optim.AdamW's exp_avg, exp_avg_sq for the rest; loaded into a fresh optimizer at
    another stage it continues the run as if uninterrupted."""
    hyper = dict(ns_dtype="float64", adamw_beta1=0.9, adamw_beta2=0.98, **MUON)
    results = {}

    def run(comm, model, opt, first, steps):
        for step in range(first, first + steps):
            ids, labels = global_batch(step)
            opt.zero_grad()
            opt.backward(loss_fn(model, rank_slice(ids, comm.rank, comm.size),
                                 rank_slice(labels, comm.rank, comm.size)))
            opt.step()
        opt.gather_full_parameters()

    def make(comm, model, stage):
        return shardopt.DistributedOptimizer(groups(model), "muon", comm=comm, stage=stage,
                                             bucket_bytes=256, **hyper)

    def body(comm):
        torch.set_num_threads(1)
        with _draws:
            straight, half, resumed = (make_model().double() for _ in range(3))
        run(comm, straight, make(comm, straight, 1), 0, STEPS)
        first = make(comm, half, 1)
        run(comm, half, first, 0, STEPS // 2)
        first.consolidate_state_dict(0)
        if comm.rank == 0:
            results["saved"] = first.state_dict()
        comm.barrier()
        with torch.no_grad():
            for p, q in zip(resumed.parameters(), half.parameters()):
                p.copy_(q)
        second = make(comm, resumed, 3)
        second.load_state_dict(results["saved"])
        run(comm, resumed, second, STEPS // 2, STEPS - STEPS // 2)
        results[comm.rank] = max_diff(resumed, straight)

    shardopt.run_ranks(2, body, timeout=120)
    # Ids in group order: group 0 holds the Muon matrices mid.weight and out.weight, group 1 the
    # six AdamW parameters.
    keys = [sorted(k for k in s if k != "step") for _, s in sorted(results["saved"]["state"].items())]
    assert len(keys) == 8
    assert all(k == (["momentum_buffer"] if i < 2 else ["exp_avg", "exp_avg_sq"])
               for i, k in enumerate(keys)), keys
    # AdamW's bias correction needs the step back on resume; torch.optim.Muon keeps none.
    saved = results["saved"]["state"]
    assert all(float(saved[i]["step"]) == STEPS // 2 for i in range(2, 8)), saved
    assert max(results[0], results[1]) <= TOL, results
