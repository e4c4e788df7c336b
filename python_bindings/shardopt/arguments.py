"""DistributedOptimizer's argument handling: what torch.optim accepts as parameters (tensors,
named pairs, group dicts, modules), the optimizer spec (a name, a spec dict, a torch.optim class or
a factory), ZeroOptions from keywords, and stage-3 units from modules or a policy. Pure Python
over the extension's types; nothing here is collective."""
import warnings

import torch

from . import _C

__all__ = ["modules_of_type"]

# torch >= 2.0 can call a forward hook even when forward raises (the unit is released then).
_HOOK_ALWAYS_CALL = "always_call" in torch.nn.Module.register_forward_hook.__code__.co_varnames

# torch.optim classes shardopt runs natively over its shard (same formulas, tested against them):
# those named like a native rule (torch.optim.AdamW -> "adamw"; torch has no LAMB).
_NATIVE_CLASSES = {cls: cls.__name__.lower() for cls in vars(torch.optim).values()
                   if isinstance(cls, type) and cls.__name__.lower() in _C._rule_names()}
_TORCH_CLASSES = {name: cls for cls, name in _NATIVE_CLASSES.items()}


def _fields(cls):
    """The fields a bound options class declares (its properties), in declaration order: the one
    list the keywords, options= copies and repr are derived from."""
    return tuple(k for k, v in vars(cls).items() if isinstance(v, property))


# Every ZeroOptions field; `units` is set through DistributedOptimizer's own units= (modules).
_OPTION_FIELDS = _fields(_C.ZeroOptions)
_OPTION_KEYWORDS = tuple(f for f in _OPTION_FIELDS if f != "units")
_GROUP_KEYS = ("params", "param_names")
# torch.optim group keys that choose an implementation, not the maths: shardopt has its own.
_TORCH_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _options_repr(self):
    return "{}({})".format(type(self).__name__, ", ".join(
        f"{f}={getattr(self, f)!r}" for f in _fields(type(self))))


_C.ZeroOptions.__repr__ = _options_repr
_C.LossScaleOptions.__repr__ = _options_repr


def _zero_options(options, overrides):
    """A fresh ZeroOptions from `options` (ZeroOptions, dict or None) and non-None overrides."""
    if options is None:
        values = {}
    elif isinstance(options, _C.ZeroOptions):
        values = {f: getattr(options, f) for f in _OPTION_FIELDS}
    elif isinstance(options, dict):
        values = dict(options)
    else:
        raise TypeError("options must be a shardopt.ZeroOptions or a dict, got "
                        + type(options).__name__)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("loss_scale"), _C.LossScaleOptions):  # a copy, not the caller's
        values["loss_scale"] = _C.LossScaleOptions(**{
            f: getattr(values["loss_scale"], f) for f in _fields(_C.LossScaleOptions)})
    return _C.ZeroOptions(**values)


def _named_groups(params):
    """[{"params": [tensors], "param_names": [names], **overrides}] from what torch.optim accepts
    (tensors, dicts) plus named_parameters() pairs and modules. Unnamed tensors get "param<i>"."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params should be an iterable of tensors, (name, tensor) pairs or dicts, "
                        "got a single Tensor")
    if isinstance(params, torch.nn.Module):
        params = params.named_parameters()
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out, index, owner = [], 0, {}
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError("params mixes parameter groups (dicts) with other items")
        group = dict(group)
        entries = group.pop("params")
        if isinstance(entries, torch.Tensor):
            entries = [entries]
        elif isinstance(entries, torch.nn.Module):
            entries = entries.named_parameters()
        elif isinstance(entries, set):
            raise TypeError("optimizer parameters need to be in an ordered collection, not a set")
        entries = list(entries)
        given = group.pop("param_names", None)
        if given is not None and len(given) != len(entries):
            raise ValueError(f"group {g}: {len(given)} param_names for {len(entries)} params")
        names, tensors = [], []
        for i, entry in enumerate(entries):
            if (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
                name, tensor = entry
            elif isinstance(entry, torch.Tensor):
                name, tensor = (given[i] if given is not None else f"param{index}"), entry
            else:
                raise TypeError("optimizer can only optimize Tensors or (name, Tensor) pairs, "
                                f"group {g} has a {type(entry).__name__}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"parameter '{name}' is a {type(tensor).__name__}, not a Tensor")
            # Checkpoints and error messages name parameters: a name means one tensor.
            if owner.setdefault(name, tensor) is not tensor:
                raise ValueError(f"two different tensors are both named '{name}'")
            names.append(name)
            tensors.append(tensor)
            index += 1
        group.update({"params": tensors, "param_names": names})
        out.append(group)
    return out


def modules_of_type(model, *classes):
    """Stage-3 unit policy: ``[(name, module)]`` for each submodule of ``model`` that is an
    instance of one of ``classes`` (outermost matches only; a match inside a match is part of
    it), e.g. ``units=shardopt.modules_of_type(model, torch.nn.TransformerEncoderLayer)``."""
    if not classes or not all(isinstance(c, type) for c in classes):
        raise TypeError("modules_of_type(model, *classes) needs at least one module class")
    out, taken = [], []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, classes):
            out.append((name or type(module).__name__, module))
            taken.append(name)
    if not out:
        raise ValueError("modules_of_type: no submodule of the model is a "
                         + " or ".join(c.__name__ for c in classes))
    return out


def _unit_modules(units, params):
    """[(name, module)] from ``units=``: modules, (name, module) pairs, a {name: module} dict, or
    a policy (a module class or tuple of classes, or a callable module -> bool) applied to the
    model when ``params`` is the model itself."""
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)) or (
            callable(units) and not isinstance(units, torch.nn.Module)):
        if not isinstance(params, torch.nn.Module):
            raise TypeError("units= as a policy (module classes or a callable) needs the model "
                            "itself as params; otherwise pass the modules, e.g. "
                            "units=shardopt.modules_of_type(model, Block)")
        if callable(units) and not isinstance(units, type):
            picked = [(n or "root", m) for n, m in params.named_modules() if units(m)]
            if not picked:
                raise ValueError("units=: the policy selected no submodule of the model")
            return picked
        classes = units if isinstance(units, tuple) else (units,)
        return modules_of_type(params, *classes)
    if isinstance(units, torch.nn.Module):
        raise TypeError("units= takes a list of modules (one unit each), not a single module")
    items = list(units.items()) if isinstance(units, dict) else list(units)
    if not items:
        raise ValueError("units= is empty; give the modules to gather together (e.g. the layers)")
    names = {}
    if isinstance(params, torch.nn.Module):
        names = {id(m): n for n, m in params.named_modules()}
    out = []
    for i, item in enumerate(items):
        name, module = item if isinstance(item, tuple) else (names.get(id(item), f"unit{i}"), item)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"units[{i}] is a {type(module).__name__}, not a torch.nn.Module")
        out.append((name, module))
    return out


def _output_tensors(out, found=None):
    """Every tensor in a forward's output (tensors, tuples, lists, dicts, nested)."""
    found = [] if found is None else found
    if isinstance(out, torch.Tensor):
        found.append(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _output_tensors(o, found)
    elif isinstance(out, dict):
        for o in out.values():
            _output_tensors(o, found)
    return found


def _resolve(optimizer, hyperparameters):
    """(native rule name or None, hyper-parameters, factory or None) for the optimizer spec."""
    hyper = dict(hyperparameters)
    if isinstance(optimizer, dict):
        spec = dict(optimizer)
        if "name" not in spec:
            raise ValueError("an optimizer spec dict needs a 'name', e.g. {'name': 'sgd', "
                             "'lr': 0.1, 'momentum': 0.9}")
        optimizer = spec.pop("name")
        clash = set(spec) & set(hyper)
        if clash:
            raise ValueError(f"hyper-parameter(s) {sorted(clash)} given both in the optimizer spec "
                             "and as keyword arguments")
        hyper = {**spec, **hyper}
    if isinstance(optimizer, str):
        return optimizer.lower(), hyper, None
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = _NATIVE_CLASSES.get(optimizer)
        if name is not None:
            known = set(_C._rule_defaults(name, {"lr": 1e-3}))  # (SGD has no default lr)
            if set(hyper) <= known:
                return name, hyper, None
            warnings.warn(
                f"shardopt: torch.optim.{optimizer.__name__} with {sorted(set(hyper) - known)} "
                "runs as that torch optimizer over each rank's shard, not as shardopt's native "
                f"'{name}' (no fused kernels, no state_dict() or save_checkpoint()); drop "
                f"{sorted(set(hyper) - known)} to run it natively", stacklevel=3)
        # Anything else runs as that torch optimizer over this rank's shard (ZeroRedundancy-
        # Optimizer's optimizer_class).
        cls = optimizer
        return None, hyper, lambda shard: cls(shard, **hyper)
    if callable(optimizer):
        if hyper:
            raise ValueError("hyper-parameters go to the optimizer factory itself, not to "
                             f"DistributedOptimizer (got {sorted(hyper)})")
        return None, hyper, optimizer
    raise TypeError("optimizer must be a name ('adamw', 'sgd', ...), a spec dict, a "
                    "torch.optim.Optimizer class or a factory, got " + type(optimizer).__name__)
