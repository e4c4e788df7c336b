"""Communicators: which processes shardopt reduces and gathers across.

``init_from_env()`` picks the engine the launcher implies (mpirun/srun -> MPI, torchrun -> its
own Gloo group, else one process); ``from_process_group()`` reuses a ``torch.distributed`` group
(Gloo), so a script that already called ``init_process_group`` shares its ranks and rendezvous.
Builds against pip's torch have the adapter but no Gloo engine of their own (``has_gloo`` False,
``has_c10d`` True): under torchrun they use ``from_process_group()``.
"""
import torch

from . import _C

__all__ = ["init_from_env", "from_process_group", "make_single_communicator",
           "default_communicator"]

_default = None


def _unsupported(message):
    error = _C.UnsupportedError("shardopt " + message)
    error.kind, error.rank = "Unsupported", -1
    return error


def init_from_env(backend="", device="cpu", timeout=None):
    """The communicator this process was launched for.

    backend: "" (pick from the environment: mpirun/srun variables -> "mpi"; torchrun's RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT -> "gloo" with its own store on MASTER_PORT; otherwise
    "single"), or "mpi", "gloo", "single". SHARDOPT_BACKEND in the environment also picks.
    timeout: deadline of every collective (datetime.timedelta or seconds).
    """
    return _C.init_from_env(backend, device, timeout)


def make_single_communicator():
    """Rank 0 of 1: collectives are copies."""
    return _C.make_single_communicator()


def run_ranks(n, fn, timeout=None):
    """Runs ``fn(comm)`` on ``n`` ranks as threads of this process (the thread engine, backend
    "threads"), rank r on thread r, and returns when every rank has returned. For tests and for
    several ranks sharing one GPU; not a replacement for NCCL across devices.

    An exception on one rank ends every rank: their pending and later collectives raise
    CommunicationError naming it, and that first rank's exception is raised here.
    timeout: deadline of every collective (datetime.timedelta or seconds).
    """
    _C._run_ranks(n, fn, timeout)


def from_process_group(group=None):
    """A communicator over a ``torch.distributed`` process group (default: the default group,
    so call ``torch.distributed.init_process_group("gloo", ...)`` first). Collectives run on
    that group, so every rank of it must take part."""
    import torch.distributed as dist
    if not _C.has_c10d:
        raise _unsupported("was built without the c10d adapter (SHARDOPT_WITH_C10D=OFF); use "
                           "init_from_env() instead")
    if group is None:
        if not dist.is_initialized():
            raise ValueError("from_process_group: torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first or pass a group")
        group = dist.distributed_c10d._get_default_group()
    # The default group splits through torch.distributed.new_group (which every rank of the
    # default group must call); builds without Gloo's headers cannot make Gloo groups in C++.
    splitter = _new_group_splitter() if group is dist.distributed_c10d._get_default_group() \
        else None
    return _C._make_process_group_communicator(group, splitter)


def _new_group_splitter():
    """split(color, key) over the default group: every rank learns every rank's (color, key),
    then all make every color's Gloo group in the same order (new_group's contract) and each
    keeps its own. Called by C++ on every rank alike (split() is collective)."""
    import torch.distributed as dist

    def split(color, key):
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (color, key, dist.get_rank()))
        mine = None
        for c in sorted({c for c, _, _ in pairs if c >= 0}):
            members = [r for _, r in sorted((k, r) for cc, k, r in pairs if cc == c)]
            if members != sorted(members):  # new_group ranks its members by global rank
                raise _unsupported(f"split: keys that reorder ranks ({members}) are not "
                                   "supported over torch.distributed.new_group")
            group = dist.new_group(ranks=members, backend="gloo")
            if c == color:
                mine = group
        return mine

    return split


def default_communicator():
    """One communicator per process, made on first use: over torch.distributed's default group
    when it is initialised, else ``init_from_env()``."""
    global _default
    if _default is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and _C.has_c10d:
            _default = from_process_group()
        else:
            _default = init_from_env()
    return _default


if _C.has_gloo:
    make_gloo_communicator = _C.make_gloo_communicator
    __all__.append("make_gloo_communicator")
