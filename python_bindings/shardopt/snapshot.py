"""Snapshots in host memory that outlive the process (C++ ``shardopt::MemorySnapshots``, Note
[Snapshots in memory] in shardopt/snapshot.hpp): every K steps each rank copies its state into a
shared-memory file on its own host and into the memory of a buddy rank on another host; a job
restarted by its launcher (``torchrun --max-restarts``, ``scripts/shardopt-run``) continues from
the newest snapshot the whole job committed, bitwise. See docs/recovery.md."""
import json
import os

from . import _C

__all__ = ["MemorySnapshots", "RestoreReport", "SnapshotTiming"]

RestoreReport = _C.RestoreReport
SnapshotTiming = _C.SnapshotTiming


class MemorySnapshots:
    """A job's snapshots in host memory, for one :class:`shardopt.DistributedOptimizer`.

    Example::

        snaps = shardopt.MemorySnapshots(opt, dir="/dev/shm/shardopt-myjob")   # collective
        state, report = snaps.restore()          # on start, collective
        if state is not None:
            client_state, tensors = state        # what snapshot() was given, this rank's
            first = client_state["step"]
            torch.set_rng_state(tensors["rng"])
        for step in range(first, steps):
            ...; opt.step()
            snaps.snapshot({"step": step + 1}, {"rng": torch.get_rng_state()})   # every K steps
        snaps.wait()                             # a background failure raises here
        snaps.remove()                           # a finished job gives the memory back

    A snapshot holds what a checkpoint holds: this rank's shard of the parameters and optimizer
    state, the step count, every group's hyper-parameters (what a scheduler wrote into
    ``param_groups``) and the loss scaler, plus the trainer's ``client_state`` (JSON) and
    ``tensors`` (data position, generators). Not the model's buffers: a model whose buffers change
    in training passes them in ``tensors``. Nor a scheduler's own counters: keep its
    ``state_dict()`` in ``client_state``.

    Args:
        optimizer: a :class:`shardopt.DistributedOptimizer` of a native rule (not a
            factory-built torch optimizer, not ``adamw8bit``: UnsupportedError).
        dir: this host's directory for the slots, in memory that outlives the process (tmpfs:
            ``/dev/shm/...``); made when missing. Ranks of one host may share it; one job per
            directory.
        ranks_per_host: ranks per host, so that rank r's buddy, (r + ranks_per_host) mod world,
            is on the next host. 0: counted from the host names. When it equals the world's
            size there is no other host and no buddy copy: the snapshot survives the death of
            processes, not the loss of the host.
        comm: the job's whole world (also in a tensor- or pipeline-parallel grid); default: the
            optimizer's communicator.

    Construction, :meth:`snapshot`, :meth:`wait`, :meth:`restore` and :meth:`remove` are
    collective: call them on every rank in the same order. Errors are :class:`shardopt.Error`
    subclasses (ValueError for bad arguments, CheckpointError for a directory that cannot be made
    or a committed snapshot that cannot be read, MismatchError for a snapshot of another model).
    """

    def __init__(self, optimizer, dir, ranks_per_host=0, comm=None):
        if not hasattr(optimizer, "_core"):
            raise TypeError("MemorySnapshots: optimizer must be a shardopt.DistributedOptimizer, "
                            f"got {type(optimizer).__name__}")
        self._optimizer = optimizer
        world = comm if comm is not None else optimizer.comm
        self._core = _C._MemorySnapshots(optimizer._core, world, os.fspath(dir), ranks_per_host)

    def snapshot(self, client_state=None, tensors=None):
        """Joins the previous snapshot (raising its failure), copies this rank's state, the
        JSON-serializable ``client_state`` and this rank's ``{name: tensor}`` into the next slot,
        and returns while a background thread checksums, sends the copy to the buddy and commits
        once every rank holds both copies. The step waits for the copy only. Collective."""
        text = json.dumps({} if client_state is None else client_state)
        self._optimizer._push_hyperparameters()  # what a scheduler wrote since the last step
        self._core.snapshot(text, dict(tensors or {}))

    def wait(self):
        """Joins the snapshot in flight, if any; raises its failure (the same on every rank)."""
        self._core.wait()

    def restore(self):
        """Restores the newest snapshot the job committed into the optimizer and returns
        ``(state, report)``: ``state`` is ``(client_state, tensors)`` as this rank gave them to
        :meth:`snapshot`, or None on every rank alike when there is nothing this job can take,
        ``report`` a :class:`shardopt.RestoreReport` (``number``, ``step``, ``seconds``,
        ``from_buddy``; ``reason`` when nothing was restored: "no snapshot ...", or a snapshot of
        another world size, for which load the newest checkpoint on disk, which reshards).
        ``param_groups`` take the snapshot's hyper-parameters. Collective; nothing changes on any
        rank unless every rank can restore."""
        state, report = self._core.restore()
        if state is None:
            return None, report
        opt = self._optimizer
        for g, group in enumerate(opt.param_groups):
            group.update(opt._core.group_hyperparameters(g))
        text, tensors = state
        return (json.loads(text), dict(tensors)), report

    def remove(self):
        """Removes this rank's slots, the copies it holds for another rank, its commit marker and
        the directory once empty: at the end of a job that finished, so that tmpfs gives the
        memory back (a crashed job's slots stay for its restart). Joins the snapshot in flight
        first. Collective."""
        self._core.remove()

    def last_timing(self):
        """:class:`shardopt.SnapshotTiming` of the last snapshot: ``blocking_s`` (inside
        :meth:`snapshot`) and ``background_s`` (once joined)."""
        return self._core.last_timing()

    def host_bytes(self):
        """Host memory this rank's slots take: its two slots and the two it holds for another
        rank (0 before the first snapshot and restore)."""
        return self._core.host_bytes()

    def buddy(self):
        """The rank holding this rank's copies, or -1 when there is none (one host)."""
        return self._core.buddy()

    def __repr__(self):
        return (f"shardopt.MemorySnapshots(buddy={self.buddy()}, "
                f"host_bytes={self.host_bytes()})")
