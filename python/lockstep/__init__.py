"""lockstep: collective communication (shared memory on one node, NCCL on GPUs) for Python.

* ``lockstep.notebook_launcher(function, args=(), num_processes=None, ...)`` forks ranks from a
  notebook kernel or a script; each runs ``function(*args)`` with ``lockstep.comm()`` ready, and
  the caller gets every rank's return value (Accelerate's signature).
* ``lockstep.init_from_env()`` joins a job started by ``lockstep launch``, torchrun, mpirun or
  srun (inside a ``notebook_launcher`` rank it returns that rank's communicator).
* ``lockstep.Communicator`` runs every collective on buffer-protocol objects (numpy arrays,
  bytearray, memoryview, array.array), torch tensors and DLPack objects, in place or out of
  place, with the GIL released while it runs. Host communicators take host memory;
  ``comm.to_device()`` makes a device communicator (NCCL, or staged through shared memory) for
  CUDA memory (torch CUDA tensors, ``__cuda_array_interface__`` objects, DLPack CUDA buffers).
  ``comm.alloc_shared(nbytes)`` gives memory in the shared segment (a :class:`SharedMemory`;
  ``numpy.asarray(mem)``) on which collectives are zero-copy.

``lockstep.context()`` gives the rank's :class:`RankContext`: Accelerate's helpers
(``is_main_process``, ``print``, ``save``, ``main_process_first``, ``wait_for_everyone``,
``set_seed``, ``reduce``, ``gather_for_metrics``) under the names Accelerate and the Rust crate use.

``import lockstep.torch`` registers the torch.distributed backend ``"lockstep"``.

Diagnostics (each communicator's init line, warnings) are records of Python's ``logging``, on the
``lockstep`` logger and its children (``lockstep.init``, ``lockstep.shm``, ...). ``LOCKSTEP_LOG``
filters them as in the ``lockstep`` command (``info``, ``warn,lockstep::shm=debug``) and, when the
``lockstep`` logger has no handler of its own, prints them on stderr.

Element types come from the buffer's format: float32/64, float16, int8/32/64, uint8/32/64;
bfloat16 has no buffer-protocol format and comes only through DLPack (a bf16 torch tensor).
"""

from ._native import CommError, Communicator, SharedMemory, __version__
from ._launcher import RankError, check_fork_safe, comm, init_from_env, notebook_launcher
from .helpers import RankContext, context


def status(job: "str | int | None" = None) -> dict:
    """A live look at this user's lockstep jobs on this machine, as ``lockstep status --json``
    prints it: with ``job`` None, ``{"jobs": [...], "unreadable": [...]}``; with a job id or the
    pid of any process of a job, ``{"job": {...}, "ranks": [...], "summary": [...], ...}``: per
    rank the collective it is in (``seq``, ``op``, ``count``, ``dtype``), how long it has waited
    there (``waited_ms``), which ranks it waits for (``waiting_for``) and whether it is ``behind``.
    Reads the jobs' shared segments without disturbing them. ``ValueError`` when no job matches."""
    import json

    from ._native import status_json

    return json.loads(status_json(None if job is None else str(job)))



def _stderr_when_asked() -> None:
    """``LOCKSTEP_LOG`` set: show lockstep's records on stderr (as the ``lockstep`` command does)
    unless the application configured the ``lockstep`` logger itself."""
    import logging
    import os

    if not os.environ.get("LOCKSTEP_LOG", "").strip():
        return
    logger = logging.getLogger("lockstep")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    stamp = "%(asctime)s " if os.environ.get("LOCKSTEP_LOG_TIME", "").strip().lower() in ("1", "true", "yes", "on") else ""
    handler.setFormatter(logging.Formatter(stamp + "lockstep %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(1)  # LOCKSTEP_LOG has already chosen which records exist
    logger.propagate = False


_stderr_when_asked()

__all__ = [
    "CommError",
    "Communicator",
    "RankContext",
    "RankError",
    "SharedMemory",
    "check_fork_safe",
    "comm",
    "context",
    "init_from_env",
    "notebook_launcher",
    "status",
    "__version__",
]
