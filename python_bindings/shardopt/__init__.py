"""shardopt: ZeRO-style sharded data parallelism (stages 0-3) for PyTorch, run by C++.

    import shardopt
    comm = shardopt.init_from_env()      # mpirun -> MPI; torchrun -> Gloo; else one process
    opt = shardopt.DistributedOptimizer(model.named_parameters(), "adamw", lr=1e-4,
                                        weight_decay=0.01, stage=2, comm=comm)
    for inputs, labels in loader:        # each rank: its slice of the global batch
        opt.zero_grad()
        loss = loss_fn(model(inputs), labels)
        opt.backward(loss)               # or loss.backward()
        opt.step()

    opt.save_checkpoint("ckpt", client_state={"step": step})   # sharded, atomic, collective
    opt.consolidate_state_dict(0)                               # or torch's format, on rank 0
    if comm.rank == 0: torch.save(opt.state_dict(), "optim.pt") # loads into torch.optim.AdamW

    snaps = shardopt.MemorySnapshots(opt, dir="/dev/shm/shardopt-myjob")  # in host memory
    state, report = snaps.restore()      # a restarted job: the newest committed snapshot
    snaps.snapshot({"step": step})       # every K steps (docs/recovery.md)

See DistributedOptimizer's docstring, estimate() for the memory model, and the exception types
(Error and its subclasses) for what C++ errors become.
"""
import torch  # noqa: F401  first: loads the libtorch _C links against, and torch's pybind types

from . import _C
from ._C import (CheckpointError, CommTimeoutError, CommunicationError, Error, InternalError,
                 InvalidArgumentError, MismatchError, NonFiniteError, OutOfMemoryError,
                 UnsupportedError)
from ._C import (Capabilities, Communicator, Estimate, LossScaleOptions, MemoryBreakdown,
                 MemoryReport, ParallelGroups, ReduceOp, StepStats, UnitPolicy, Units, Work,
                 ZeroOptions, make_parallel_groups, mark_pipeline_shared, mark_replicated,
                 mark_split, split_of)
from .comm import (default_communicator, from_process_group, init_from_env,
                   make_single_communicator, run_ranks)
from .estimate import bert_parameter_count, estimate, estimate_model
from .arguments import modules_of_type
from .checkpoint import consolidate_checkpoint, read_checkpoint_info, read_full_state
from .optimizer import DistributedOptimizer
from .snapshot import MemorySnapshots, RestoreReport, SnapshotTiming

if _C.has_gloo:
    from .comm import make_gloo_communicator  # noqa: F401

__version__ = _C.__version__
has_mpi, has_gloo, has_nccl, has_cuda = _C.has_mpi, _C.has_gloo, _C.has_nccl, _C.has_cuda
has_c10d = _C.has_c10d
