"""shardopt.DistributedOptimizer: the C++ ZeRO optimizer as a torch.optim.Optimizer.

The C++ object owns the flat buffers, the gradient hooks and the sharded update; this class keeps
torch's param_groups (so LR schedulers, ``group["lr"] = ...`` and per-group hyper-parameters
work) and pushes every group's hyper-parameters into C++ right before each step.
"""
import os

import torch

from . import _C
from .comm import _unsupported, default_communicator

__all__ = ["DistributedOptimizer", "consolidate_checkpoint", "modules_of_type"]

# torch >= 2.0 can call a forward hook even when forward raises (the unit is released then).
_HOOK_ALWAYS_CALL = "always_call" in torch.nn.Module.register_forward_hook.__code__.co_varnames

# torch.optim classes shardopt runs natively over its shard (same formulas, tested against them):
# those named like a native rule (torch.optim.AdamW -> "adamw"; torch has no LAMB).
_NATIVE_CLASSES = {cls: cls.__name__.lower() for cls in vars(torch.optim).values()
                   if isinstance(cls, type) and cls.__name__.lower() in _C._rule_names()}
_OPTION_FIELDS = ("stage", "bucket_bytes", "overlap_comm", "grad_accumulation_steps",
                  "max_grad_norm", "precision", "offload", "broadcast_initial_params",
                  "align_bytes", "prefetch", "timeout", "shard_group_size", "reduce_dtype", "unit_policy")
_GROUP_KEYS = ("params", "param_names")


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
        options: a :class:`shardopt.ZeroOptions` (or dict) to start from; the keyword arguments
            ``stage``, ``bucket_bytes``, ``overlap_comm``, ``grad_accumulation_steps``,
            ``max_grad_norm``, ``precision``, ``offload``, ``broadcast_initial_params``,
            ``align_bytes``, ``prefetch`` and ``timeout`` (a ``datetime.timedelta`` or seconds)
            override its fields.
        units: stage 3: the modules whose parameters are gathered together, usually one per
            layer: a list of modules (or ``(name, module)`` pairs, or a dict), or a policy applied
            to the model given as ``params``: a module class, a tuple of classes, or a callable
            ``module -> bool`` (see :func:`modules_of_type`). Forward pre-hooks and hooks are
            installed on them, so the model's code does not change. Parameters in no unit or in
            two (a decoder tied to the embedding) stay gathered. Between steps the units'
            parameters hold no storage: call :meth:`gather_full_parameters` before reading them.
            Without ``units=``, stage 3 derives units from the parameters' names (every element
            of a ``ModuleList``/``Sequential`` and every other top-level child; groups under
            ``unit_policy.persist_below`` elements stay gathered) and gathers them on first use,
            with no hooks and no change to the model.
        unit_policy: stage 3 without ``units=``: a :class:`shardopt.UnitPolicy` or a dict
            ``{"patterns": [regex, ...], "persist_below": elements}``.
        **hyperparameters: torch's names: ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad``, ``momentum``, ``dampening``, ``nesterov``, ... (defaults are torch's).

    Errors from C++ are :class:`shardopt.Error` subclasses carrying the C++ message:
    :class:`shardopt.InvalidArgumentError` (a ``ValueError``) for bad arguments,
    :class:`shardopt.MismatchError` when ranks built different models, ...
    """

    def __init__(self, params, optimizer="adamw", *, comm=None, options=None, stage=None,
                 bucket_bytes=None, overlap_comm=None, grad_accumulation_steps=None,
                 max_grad_norm=None, precision=None, offload=None, broadcast_initial_params=None,
                 align_bytes=None, prefetch=None, timeout=None, units=None, unit_policy=None,
                 **hyperparameters):
        unit_modules = _unit_modules(units, params) if units is not None else []
        zero = _zero_options(options, dict(
            stage=stage, bucket_bytes=bucket_bytes, overlap_comm=overlap_comm,
            grad_accumulation_steps=grad_accumulation_steps, max_grad_norm=max_grad_norm,
            precision=precision, offload=offload,
            broadcast_initial_params=broadcast_initial_params, align_bytes=align_bytes,
            prefetch=prefetch, timeout=timeout,
            unit_policy=_C.UnitPolicy(**unit_policy) if isinstance(unit_policy, dict)
            else unit_policy))
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
            raise ValueError("shardopt: parameter groups are fixed at construction (they decide "
                             "the flat layout all ranks share); build a new DistributedOptimizer")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=None):
        """Clears gradients. Stages 0-1 keep ``.grad`` as views into the flat gradient buffer
        (zeroed in place) and stage 2 frees them, whatever ``set_to_none`` says."""
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

    def state_dict(self):
        raise NotImplementedError(
            "shardopt: the optimizer state is sharded across ranks; save it with "
            "opt.save_checkpoint(directory) and restore it with opt.load_checkpoint(directory)")

    def load_state_dict(self, state_dict):
        self.state_dict()

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

    def save_checkpoint(self, directory):
        """Writes this rank's shard and (rank 0) the manifest into `directory`, atomically."""
        fn = getattr(_C, "save_checkpoint", None)
        if fn is None:
            raise _unsupported("checkpoints are not in this build of shardopt yet")
        fn(self._core, os.fspath(directory))

    def load_checkpoint(self, directory):
        """Loads a checkpoint written at any world size and stage."""
        fn = getattr(_C, "load_checkpoint", None)
        if fn is None:
            raise _unsupported("checkpoints are not in this build of shardopt yet")
        fn(self._core, os.fspath(directory))

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


def consolidate_checkpoint(directory, out):
    """Writes the full fp32 model state of a sharded checkpoint as one file ``torch.load`` reads
    as ``{name: tensor}``. Not collective."""
    fn = getattr(_C, "consolidate_checkpoint", None)
    if fn is None:
        raise _unsupported("checkpoints are not in this build of shardopt yet")
    fn(os.fspath(directory), os.fspath(out))
