"""shardopt.DistributedOptimizer: the C++ ZeRO optimizer as a torch.optim.Optimizer.

The C++ object owns the flat buffers, the gradient hooks and the sharded update; this class keeps
torch's param_groups (so LR schedulers, ``group["lr"] = ...`` and per-group hyper-parameters
work) and pushes every group's hyper-parameters into C++ right before each step. Its arguments
are read in arguments.py, its checkpoints live in checkpoint.py.
"""
import inspect

import torch

from . import _C
from .arguments import (_GROUP_KEYS, _HOOK_ALWAYS_CALL, _OPTION_KEYWORDS, _TORCH_CLASSES,
                        _TORCH_IMPL_KEYS, _named_groups, _output_tensors, _resolve,
                        _unit_modules, _zero_options, modules_of_type)
from .checkpoint import (CheckpointMethods, consolidate_checkpoint, read_checkpoint_info,
                         read_full_state)
from .comm import default_communicator

__all__ = ["DistributedOptimizer", "consolidate_checkpoint", "modules_of_type",
           "read_checkpoint_info", "read_full_state"]


class DistributedOptimizer(CheckpointMethods, torch.optim.Optimizer):
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
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"adagrad"``, ``"rmsprop"``, ``"lamb"``,
            ``"adafactor"``, ``"adamw8bit"`` (blockwise 8-bit moments), ``"muon"``
            (``torch.optim.Muon`` on 2-D parameters, AdamW on the rest and on groups with
            ``"use_muon": False``); a spec dict ``{"name": "sgd", "momentum": 0.9}``; a ``torch.optim``
            class (those of the rules above run natively, any other runs over this rank's shard, like
            ``ZeroRedundancyOptimizer``'s ``optimizer_class``); or a factory
            ``f(list_of_shard_tensors) -> torch.optim.Optimizer``.
        comm: a :class:`shardopt.Communicator`; default :func:`shardopt.default_communicator`.
        options: a :class:`shardopt.ZeroOptions` (or dict) to start from. Every field of
            ``ZeroOptions`` is also a keyword argument overriding it: ``stage``,
            ``bucket_bytes``, ``overlap_comm``, ``grad_accumulation_steps``, ``defer_reduction``,
            ``max_grad_norm``, ``precision``, ``reduce_in_fp32``, ``loss_scale`` (a
            ``LossScaleOptions`` or a dict),
            ``fused_update``, ``offload``, ``broadcast_initial_params``, ``align_bytes``,
            ``shard_group_size``, ``reduce_dtype``, ``prefetch``, ``reuse_distance``, ``timeout`` (a
            ``datetime.timedelta`` or seconds), ``max_nonfinite_steps``, and for model parallelism ``grid``
            (``make_parallel_groups(world, tp=t, pp=p)``; pass ``comm=`` its ``.dp``): the
            parameters split over ``grid.tp`` are those marked with ``shardopt.mark_split``, the
            others held whole; those marked with ``shardopt.mark_pipeline_shared`` (a tied
            embedding) are held by the first and the last stage, which sum their gradients.
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
            ``unit_policy.persist_below`` elements stay gathered for good, smallest first, within
            ``unit_policy.persist_share`` of the model) and gathers them on first use, with no
            hooks and no change to the model. ``unit_policy=`` takes a :class:`shardopt.UnitPolicy`
            or a dict ``{"patterns": [regex], "persist_below": n, "persist_share": s}``.
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
                    template = step_template
                    if template is None and group.get("use_muon") is False:
                        # Muon's AdamW groups: torch keeps them in torch.optim.AdamW, whose
                        # "step" (a 0-d tensor) their bias correction needs on resume.
                        template = torch.tensor(0.0)
                    if template is not None:
                        entry["step"] = (template.new_tensor(float(step))
                                         if isinstance(template, torch.Tensor) else step)
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
            if saved.get("maximize") and "maximize" not in self._rule_keys:
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
                         and (k != "maximize" or k in self._rule_keys)})
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

    def _torch_template(self):
        """(the group keys torch.optim adds for this rule, with their defaults; the value its
        per-parameter "step" takes, or None) from one step of that torch optimizer over a
        one-element tensor: whatever torch version runs."""
        if getattr(self, "_template", None) is None:
            cls = _TORCH_CLASSES.get(self._name)
            if cls is None:  # LAMB: no torch counterpart
                self._template = ({}, torch.tensor(0.0))
            else:
                # 1x1: a matrix, since torch.optim.Muon takes nothing else.
                p = torch.zeros(1, 1, requires_grad=True)
                p.grad = torch.zeros(1, 1)
                # Only what this torch's constructor takes: torch.optim.Muon has no ns_dtype.
                accepted = inspect.signature(cls.__init__).parameters
                hyper = {k: v for k, v in self.param_groups[0].items()
                         if k in self._rule_keys and k in accepted}
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
