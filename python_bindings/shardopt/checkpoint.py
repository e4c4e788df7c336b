"""Sharded checkpoints from Python: DistributedOptimizer's save/load methods (with the model's
buffers, frozen parameters and tied aliases) and the non-collective readers of a checkpoint
directory. The files themselves are written and read by C++ (src/checkpoint/)."""
import json
import os

from . import _C

__all__ = ["CheckpointMethods", "consolidate_checkpoint", "read_checkpoint_info",
           "read_full_state"]


class CheckpointMethods:
    """DistributedOptimizer's checkpoint methods (a mixin: it uses the optimizer's ``_core``,
    ``_inner``, ``param_groups``, ``comm`` and ``_push_hyperparameters``)."""

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
        and frozen parameters are overwritten in place with the checkpoint's (saved with
        ``module=``; rank 0's values on every rank), by C++'s ``LoadOptions::module_state``: a
        name the checkpoint does not store, or another shape or dtype, raises ValueError on every
        rank before anything changes. Collective."""
        module_state = self._module_extras(module)[0] if module is not None else {}
        text, tensors = _C.load_checkpoint(self._core, os.fspath(directory),
                                           restore_hyperparameters, module_state)
        if self._inner is None:
            for g, group in enumerate(self.param_groups):
                group.update(self._core.group_hyperparameters(g))
        tensors = {k: v for k, v in tensors.items() if not k.startswith("module/")}
        client_state = json.loads(text)
        return (client_state, tensors) if with_tensors else client_state

    def load_full_state_dict(self, state_dict):
        """Starts from a full model state: ``{name: tensor}`` (``model.state_dict()``, or
        ``torch.load`` of a consolidated file). Every trainable parameter must be there with its
        shape; the names of other entries (buffers, frozen parameters) are returned. The
        optimizer state is left as it is. Collective."""
        return _C.load_full_state_dict(self._core, list(state_dict.items()))

    # ---- internals ---------------------------------------------------------------------------

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
