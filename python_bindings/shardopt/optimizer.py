"""shardopt.DistributedOptimizer: the C++ ZeRO optimizer as a torch.optim.Optimizer.

The C++ object owns the flat buffers, the gradient hooks and the sharded update; this class keeps
torch's param_groups (so LR schedulers, ``group["lr"] = ...`` and per-group hyper-parameters
work) and pushes every group's hyper-parameters into C++ right before each step.
"""
import json
import os
import warnings

import torch

from . import _C
from .comm import default_communicator

__all__ = ["DistributedOptimizer", "consolidate_checkpoint", "modules_of_type",
           "read_checkpoint_info", "read_full_state"]

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


class DistributedOptimizer(torch.optim.Optimizer):
    r"""ZeRO-sharded data-parallel optimizer (stages 0-3) with torch.optim's interface.

    Example::

        comm = shardopt.init_from_env()        # or shardopt.from_process_group()
        opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", lr=1e-4,
                                            weight_decay=0.01, stage=2, comm=comm)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        for inputs, labels in loader:           # each rank: its own slice of the global batch
            opt.zero_grad()
            loss = loss_fn(model(inputs), labels)
            opt.backward(loss)                  # or loss.backward(); (loss / k).backward()
                                                # with grad_accumulation_steps=k
            opt.step()
            sched.step()

    After ``step()`` every rank holds the parameters that one process training on the whole
    global batch with the same torch optimizer would hold (gradients are averaged as DDP does).
    Construction, ``backward()`` and ``step()`` are collective: call them on all ranks in the
    same order.

    Args:
        params: ``model.named_parameters()`` (preferred: names appear in errors and checkpoints),
            a module, tensors, or a list of parameter-group dicts ``{"params": ..., "lr": ...}``.
            Parameters become views into shardopt's flat buffers; frozen ones are left alone.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"adagrad"``, ``"rmsprop"``, ``"lamb"``;
            a spec dict ``{"name": "sgd", "momentum": 0.9}``; a ``torch.optim`` class (the five
            above run natively, any other runs over this rank's shard, like
            ``ZeroRedundancyOptimizer``'s ``optimizer_class``); or a factory
            ``f(list_of_shard_tensors) -> torch.optim.Optimizer``.
        comm: a :class:`shardopt.Communicator`; default :func:`shardopt.default_communicator`.
        options: a :class:`shardopt.ZeroOptions` (or dict) to start from. Every field of
            ``ZeroOptions`` is also a keyword argument overriding it: ``stage``,
            ``bucket_bytes``, ``overlap_comm``, ``grad_accumulation_steps``, ``max_grad_norm``,
            ``precision``, ``reduce_in_fp32``, ``loss_scale`` (a ``LossScaleOptions`` or a dict),
            ``fused_update``, ``offload``, ``broadcast_initial_params``, ``align_bytes``,
            ``shard_group_size``, ``reduce_dtype``, ``prefetch``, ``reuse_distance``, ``timeout`` (a
            ``datetime.timedelta`` or seconds) and ``max_nonfinite_steps``.
        units: stage 3: the modules whose parameters are gathered together, usually one per
            layer: a list of modules (or ``(name, module)`` pairs, or a dict), or a policy applied
            to the model given as ``params``: a module class, a tuple of classes, or a callable
            ``module -> bool`` (see :func:`modules_of_type`). Forward pre-hooks and hooks are
            installed on them, so the model's code does not change. A parameter two units share
            (a decoder tied to the embedding) is gathered whenever either runs; parameters in no
            unit from ``zero_grad()`` (or the first unit) until ``step()``. Nothing stays
            gathered between steps: call :meth:`gather_full_parameters` before reading them.
            Without ``units=``, stage 3 derives units from the parameters' names (every element
            of a ``ModuleList``/``Sequential`` and every other top-level child; groups under
            ``unit_policy.persist_below`` elements stay gathered) and gathers them on first use,
            with no hooks and no change to the model. ``unit_policy=`` takes a
            :class:`shardopt.UnitPolicy` or a dict ``{"patterns": [regex], "persist_below": n}``.
        **hyperparameters: torch's names: ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad``, ``momentum``, ``dampening``, ``nesterov``, ... (defaults are torch's).

    The torch optimizer contract holds as for ``ZeroRedundancyOptimizer``:
    ``consolidate_state_dict(to)`` (collective), then ``state_dict()`` on rank ``to`` is exactly
    what the same ``torch.optim`` optimizer's would be; ``load_state_dict(sd)`` on every rank
    takes such a state dict (from shardopt or from plain torch). ``save_checkpoint`` writes
    sharded, atomic checkpoints that never gather the state on one rank.

    Errors from C++ are :class:`shardopt.Error` subclasses carrying the C++ message:
    :class:`shardopt.InvalidArgumentError` (a ``ValueError``) for bad arguments,
    :class:`shardopt.MismatchError` when ranks built different models, ...
    """

    def __init__(self, params, optimizer="adamw", *, comm=None, options=None, units=None,
                 **kwargs):
        unit_modules = _unit_modules(units, params) if units is not None else []
        overrides = {k: kwargs.pop(k) for k in _OPTION_KEYWORDS if k in kwargs}
        if isinstance(overrides.get("unit_policy"), dict):
            overrides["unit_policy"] = _C.UnitPolicy(**overrides["unit_policy"])
        hyperparameters = kwargs
        zero = _zero_options(options, overrides)
        zero.validate()
        name, hyper, factory = _resolve(optimizer, hyperparameters)
        groups = _named_groups(params)
        if factory is None:
            defaults = _C._rule_defaults(name, hyper)
            self._rule_keys = tuple(defaults)
        else:
            defaults = dict(hyper)
            self._rule_keys = ()
            for g, group in enumerate(groups):
                extra = sorted(set(group) - set(_GROUP_KEYS))
                if extra:
                    raise ValueError(
                        f"group {g} sets {extra}, but a factory-built optimizer runs one set of "
                        "hyper-parameters over the whole shard; give them to the optimizer itself")
        self._frozen = False
        self._inner = None
        super().__init__(groups, defaults)  # torch's checks: leaves, duplicates, required values
        if factory is None:
            for group in self.param_groups:  # per-group overrides: known names, valid values
                _C._rule_defaults(name, {k: v for k, v in group.items() if k not in _GROUP_KEYS})
        self._frozen = True
        self._name = name
        if comm is None:
            comm = default_communicator()
        self._unit_hooks = []
        if unit_modules:
            zero.units = _C.Units()
            for unit_name, module in unit_modules:
                zero.units.add(unit_name, list(module.parameters()))
        specs = [(group["param_names"], group["params"]) for group in self.param_groups]
        if factory is None:
            self._core = _C._Optimizer(specs, name, hyper, comm, zero)
            self._push_hyperparameters()
        else:
            def make(shard):
                self._inner = factory(shard)
                if not isinstance(self._inner, torch.optim.Optimizer):
                    raise TypeError("the optimizer factory must return a torch.optim.Optimizer, "
                                    f"got {type(self._inner).__name__}")
                return self._inner
            self._core = _C._Optimizer(specs, make, comm, zero)
            for group in self.param_groups:  # what schedulers read: the inner optimizer's values
                for k, v in self._inner.defaults.items():
                    group.setdefault(k, v)
        if unit_modules:
            self._install_unit_hooks(zero.units, unit_modules)

    # ---- torch.optim.Optimizer ---------------------------------------------------------------

    def add_param_group(self, param_group):
        if self._frozen:
            raise _C.InvalidArgumentError(
                "shardopt: add_param_group after construction is not supported: parameter "
                "groups decide the flat layout all ranks share; pass every group to the "
                "DistributedOptimizer constructor (or build a new one)")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=None):
        """Discards the gradients: every ``.grad`` becomes None (whatever ``set_to_none`` says)
        and the next backward's first gradient overwrites shardopt's buffers; ``step()`` does
        the same, so calling this between steps is optional."""
        self._core.zero_grad()

    def step(self, closure=None):
        """Finishes the gradient reduction, clips, updates this rank's shard and gathers the
        parameters. Returns the closure's loss when one is given (called under grad mode)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_hyperparameters()
        self._core.step()
        return loss

    def consolidate_state_dict(self, to=0):
        """Gathers the full optimizer state onto rank ``to``, whose :meth:`state_dict` then
        returns it (``ZeroRedundancyOptimizer``'s convention). Collective: call on all ranks."""
        self._core.consolidate_state_dict(to)

    def state_dict(self):
        """On the rank :meth:`consolidate_state_dict` gathered onto (and until the next step):
        exactly what the ``torch.optim`` optimizer of the same rule would return, integer ids in
        parameter order, so ``torch.optim.AdamW(...).load_state_dict(opt.state_dict())`` continues
        the run. Elsewhere raises :class:`shardopt.UnsupportedError` saying to consolidate first
        (or to use :meth:`save_checkpoint`)."""
        step, groups = self._core.state_dict()
        group_template, step_template = self._torch_template()
        state, param_groups, index = {}, [], 0
        for group, saved in zip(self.param_groups, groups):
            ids = []
            for _, buffers in saved:
                if buffers:
                    entry = {}
                    if step_template is not None:
                        entry["step"] = (step_template.new_tensor(float(step))
                                         if isinstance(step_template, torch.Tensor) else step)
                    entry.update(buffers)
                    state[index] = entry
                ids.append(index)
                index += 1
            packed = dict(group_template)
            packed.update({k: v for k, v in group.items() if k not in _GROUP_KEYS})
            packed["params"] = ids
            param_groups.append(packed)
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict):
        """Loads a full torch-format state dict (from :meth:`state_dict` or from a plain
        ``torch.optim`` optimizer of the same rule over the same parameters) on every rank; each
        keeps its shard, at any stage. Hyper-parameters are taken from it, as torch does.
        Collective: call on all ranks with the same state dict."""
        saved_groups, state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the "
                             f"optimizer {len(self.param_groups)}")
        buffers, steps = [], set()
        for g, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"loaded state dict's group {g} has {len(saved['params'])} "
                                 f"parameters, the optimizer's {len(mine['params'])}")
            if saved.get("maximize"):
                raise _C.UnsupportedError("shardopt: the state dict's optimizer maximizes "
                                          "(maximize=True); shardopt minimizes")
            group = []
            for pid in saved["params"]:
                entry = dict(state.get(pid, {}))
                if "step" in entry:
                    steps.add(float(entry.pop("step")))
                group.append({k: v for k, v in entry.items() if v is not None})
            buffers.append(group)
        if len(steps) > 1:
            raise _C.UnsupportedError(f"shardopt: parameters were saved at different steps "
                                      f"{sorted(steps)}; shardopt keeps one step for all of them")
        self._core.load_state_dict(int(steps.pop()) if steps else 0, buffers)
        for mine, saved in zip(self.param_groups, saved_groups):
            mine.update({k: v for k, v in saved.items()
                         if k not in _GROUP_KEYS and k not in _TORCH_IMPL_KEYS
                         and k != "maximize"})
        self._push_hyperparameters()

    def __repr__(self):
        lines = [f"shardopt.DistributedOptimizer({self._name or type(self._inner).__name__}, "
                 f"stage={self.options.stage}, backend={self.comm.backend}, "
                 f"rank={self.comm.rank}/{self.comm.size}, numel={self.numel}) ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i} ({len(group['params'])} params)")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k not in _GROUP_KEYS]
        return "\n".join(lines + [")"])

    # ---- shardopt ----------------------------------------------------------------------------

    def backward(self, loss):
        """``loss.backward()`` with the loss scaled by 1/``grad_accumulation_steps`` (and by the
        loss scale where enabled). Gradients are summed over micro-steps, so this and torch's own
        ``(loss / k).backward()`` both give the gradient of the big batch's average loss."""
        self._core.backward(loss)

    def last_step(self):
        """:class:`shardopt.StepStats` of the last step (grad norm, clipping, timings, ...)."""
        return self._core.last_step()

    def memory(self):
        """:class:`shardopt.MemoryReport`: bytes this rank holds for params, grads, state."""
        return self._core.memory()

    @property
    def options(self):
        return self._core.options

    @property
    def comm(self):
        return self._core.communicator

    @property
    def numel(self):
        """Trainable parameters (tied ones once)."""
        return self._core.numel

    @property
    def padded_numel(self):
        return self._core.padded_numel

    def save_checkpoint(self, directory, client_state=None, tensors=None, module=None):
        """Writes a sharded checkpoint into ``directory``, atomically: this rank's shard of the
        parameters and optimizer state, and (rank 0) the manifest. ``client_state``: the
        trainer's own JSON-serializable state (step, scheduler, data position), stored once;
        ``tensors``: this rank's ``{name: tensor}`` (e.g. ``torch.get_rng_state()``);
        ``module``: the model, whose buffers, frozen parameters and tied aliases are stored too
        (rank 0's), so that ``consolidate_checkpoint``'s file loads into it with
        ``load_state_dict(strict=True)``. Collective."""
        text = json.dumps({} if client_state is None else client_state)
        self._push_hyperparameters()  # what a scheduler wrote since the last step() is saved
        module_state, aliases = self._module_extras(module) if module is not None else ({}, {})
        _C.save_checkpoint(self._core, os.fspath(directory), text, dict(tensors or {}),
                           module_state, aliases)

    def load_checkpoint(self, directory, restore_hyperparameters=True, with_tensors=False,
                        module=None):
        """Loads a checkpoint written at any world size and stage and returns its
        ``client_state`` (``(client_state, tensors)`` with ``with_tensors=True``: the tensors
        this rank number saved). The groups' hyper-parameters are restored into
        ``param_groups`` unless ``restore_hyperparameters=False``; with ``module``, its buffers
        and frozen parameters from the checkpoint (saved with ``module=``). Collective."""
        text, tensors = _C.load_checkpoint(self._core, os.fspath(directory),
                                           restore_hyperparameters)
        if self._inner is None:
            for g, group in enumerate(self.param_groups):
                group.update(self._core.group_hyperparameters(g))
        saved = {k[len("module/"):]: v for k, v in tensors.items() if k.startswith("module/")}
        tensors = {k: v for k, v in tensors.items() if not k.startswith("module/")}
        if module is not None:
            self._restore_module_extras(module, saved)
        client_state = json.loads(text)
        return (client_state, tensors) if with_tensors else client_state

    def load_full_state_dict(self, state_dict):
        """Starts from a full model state: ``{name: tensor}`` (``model.state_dict()``, or
        ``torch.load`` of a consolidated file). Every trainable parameter must be there with its
        shape; the names of other entries (buffers, frozen parameters) are returned. The
        optimizer state is left as it is. Collective."""
        return _C.load_full_state_dict(self._core, list(state_dict.items()))

    def gather_full_parameters(self):
        """Stage 3: gathers every unit now, e.g. to read or save the whole model (each is freed
        again when the next forward leaves it, or by the next step). Collective."""
        self._core.gather_full_parameters()

    def remove_unit_hooks(self):
        """Removes the forward hooks ``units=`` installed (the model then runs unsharded code
        paths only with another optimizer's units)."""
        for handle in self._unit_hooks:
            handle.remove()
        self._unit_hooks = []

    # ---- internals ---------------------------------------------------------------------------

    def _install_unit_hooks(self, units, unit_modules):
        # Note [Stage 3 from Python]: the C++ Units::run(i, fn) split into two module hooks. The
        # pre-hook gathers unit i (prefetching the next), the hook marks the outputs (a gradient
        # hook on each gathers the unit again when backward reaches it) and frees the unit.
        # Parameters shared by two units are gathered while either runs; parameters in no unit
        # from zero_grad() (or the first unit) until step() (Note [Stage 3 units], C++).
        kwargs = {"always_call": True} if _HOOK_ALWAYS_CALL else {}
        for index, (_, module) in enumerate(unit_modules):
            def pre_hook(mod, args, index=index):
                units.begin(index)

            def post_hook(mod, args, output, index=index):
                units.end(index, _output_tensors(output))

            self._unit_hooks.append(module.register_forward_pre_hook(pre_hook))
            self._unit_hooks.append(module.register_forward_hook(post_hook, **kwargs))

    def _module_extras(self, module):
        """({name: tensor} of what the optimizer does not hold: buffers and frozen parameters,
        {alias: name} of tied parameters' second names), by ``module.state_dict()``'s names."""
        mine = {id(p): n for group in self.param_groups
                for n, p in zip(group["param_names"], group["params"]) if p.requires_grad}
        state, aliases = {}, {}
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in mine:
                if mine[id(t)] != name:
                    aliases[name] = mine[id(t)]
            elif t is not None:
                state[name] = t.detach()
        return state, aliases

    def _restore_module_extras(self, module, saved):
        """Rank 0 read the module state; every rank takes its values."""
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                if t is None or t.requires_grad:
                    continue
                value = saved.get(name) if self.comm.rank == 0 else None
                buf = t.detach().contiguous() if value is None else value.to(t.dtype).contiguous()
                self.comm.broadcast(buf, root=0)
                t.copy_(buf)

    def _torch_template(self):
        """(the group keys torch.optim adds for this rule, with their defaults; the value its
        per-parameter "step" takes, or None) from one step of that torch optimizer over a
        one-element tensor: whatever torch version runs."""
        if getattr(self, "_template", None) is None:
            cls = _TORCH_CLASSES.get(self._name)
            if cls is None:  # LAMB: no torch counterpart
                self._template = ({}, torch.tensor(0.0))
            else:
                p = torch.zeros(1, requires_grad=True)
                p.grad = torch.zeros(1)
                hyper = {k: v for k, v in self.param_groups[0].items() if k in self._rule_keys}
                probe = cls([p], **hyper)
                probe.step()
                packed = probe.state_dict()
                group = {k: v for k, v in packed["param_groups"][0].items()
                         if k not in self._rule_keys and k != "params"}
                self._template = (group, packed["state"].get(0, {}).get("step"))
        return self._template

    def _push_hyperparameters(self):
        # What LR schedulers and users wrote into param_groups is what the next step uses.
        if self._inner is None:
            for g, group in enumerate(self.param_groups):
                self._core.set_group_hyperparameters(
                    g, {k: group[k] for k in self._rule_keys if k in group})
            return
        keys = [k for k in self.param_groups[0] if k in self._inner.defaults]
        for k in keys:
            values = {repr(group.get(k)) for group in self.param_groups}
            if len(values) > 1:
                raise ValueError(f"parameter groups disagree on '{k}' ({sorted(values)}), but a "
                                 "factory-built optimizer has one value for the whole shard")
            for inner_group in self._inner.param_groups:
                inner_group[k] = self.param_groups[0][k]


def consolidate_checkpoint(directory, out, optimizer_out=None):
    """Writes the full fp32 model state of a sharded checkpoint as one file ``torch.load`` reads
    as ``{name: tensor}`` (and, with ``optimizer_out``, the full optimizer state keyed by
    parameter name). Not collective."""
    _C.consolidate_checkpoint(os.fspath(directory), os.fspath(out),
                              os.fspath(optimizer_out) if optimizer_out else "")


def read_checkpoint_info(directory):
    """What a checkpoint's manifest says: world size, stage, step, rule, parameters, the
    client state (``client_state``, decoded). Not collective."""
    info = _C.read_checkpoint_info(os.fspath(directory))
    info["client_state"] = json.loads(info.pop("trainer_json"))
    return info


def read_full_state(directory, with_optimizer_state=False):
    """The full fp32 parameters ``{name: tensor}`` of a checkpoint under ``"params"`` (and the
    full optimizer state ``{state name: {name: tensor}}`` under ``"optimizer_state"``), assembled
    from every shard with checksums verified. Not collective."""
    return _C.read_full_state(os.fspath(directory), with_optimizer_state)
