"""The analytic memory/communication model (include/shardopt/estimate.hpp) from Python."""
from . import _C

__all__ = ["estimate", "estimate_model", "bert_parameter_count"]

estimate = _C.estimate
bert_parameter_count = _C.bert_parameter_count


def estimate_model(model, world=1, stage=2, **kwargs):
    """``estimate()`` for a torch module's trainable parameters (tied ones counted once)."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _C.estimate(params, world=world, stage=stage, **kwargs)
