"""Accelerate's rank helpers over a lockstep communicator, with the names the Rust
``RankContext`` and Hugging Face Accelerate's ``Accelerator`` use.

``lockstep.context()`` gives the :class:`RankContext` of the calling rank (inside a
:func:`lockstep.notebook_launcher` function, or in a process started by ``lockstep launch``,
torchrun, mpirun or srun)::

    ctx = lockstep.context()
    with ctx.main_process_first():
        dataset = download_once()
    ctx.set_seed(42)
    ...
    ctx.print(f"epoch {epoch} loss {ctx.reduce(loss, 'mean'):.4f}")
    preds = ctx.gather_for_metrics(local_preds, dataset_len=len(test_set))
    ctx.save(model.state_dict(), "model.pt")

Every collective helper (``main_process_first``, ``wait_for_everyone``, ``set_seed``,
``reduce``, ``gather_for_metrics``) must be called by every rank, as in Accelerate.
"""

import array
import builtins
import contextlib
import io
import os
import pickle
import random
import sys

from ._launcher import init_from_env

_OPS = {"sum": "sum", "mean": "avg", "avg": "avg", "min": "min", "max": "max", "prod": "prod"}


def context(comm=None, local_rank=None):
    """The :class:`RankContext` of this rank: over ``comm`` when given, else the rank's own
    communicator (:func:`lockstep.init_from_env`)."""
    return RankContext(comm if comm is not None else init_from_env(), local_rank)


def _local_rank_from_env(rank):
    v = os.environ.get("LOCAL_RANK")
    if v is None:
        return rank
    try:
        n = int(v, 10)
    except ValueError:
        n = -1
    if n < 0 or v.strip() != v:
        raise ValueError(f"LOCAL_RANK={v!r} is not a rank number; unset it or pass local_rank= explicitly")
    return n


def write_atomic(path, data, mode=0o644):
    """Write ``data`` (bytes) at ``path`` so that readers see the old file or the whole new one:
    a temporary file created with ``O_EXCL|O_NOFOLLOW`` beside it, fsync, rename over ``path``,
    fsync of the directory. A symlink planted at the temporary name is refused, never followed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    if not base:
        raise ValueError(f"save: {path!r} names a directory, not a file")
    tmp = os.path.join(directory, f".{base}.tmp-{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _serialise(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    torch = sys.modules.get("torch")
    if torch is not None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class RankContext:
    """This rank's place in the job and Accelerate's helpers (``is_main_process``, ``print``,
    ``save``, ``main_process_first``, ``local_main_process_first``, ``wait_for_everyone``,
    ``set_seed``, ``reduce``, ``gather_for_metrics``), over a :class:`lockstep.Communicator`."""

    def __init__(self, comm, local_rank=None):
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.local_rank = _local_rank_from_env(self.rank) if local_rank is None else int(local_rank)

    def __repr__(self):
        return f"RankContext(rank={self.rank}, local_rank={self.local_rank}, world_size={self.world_size})"

    @property
    def is_main_process(self):
        """Global rank 0: the one that prints, saves and downloads."""
        return self.rank == 0

    @property
    def is_local_main_process(self):
        """Local rank 0: the one that prepares node-local files."""
        return self.local_rank == 0

    def print(self, *args, **kwargs):
        """``print`` on the main process only (Accelerate's ``accelerator.print``)."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def save(self, obj, path):
        """Save ``obj`` at ``path`` from the main process only, atomically (Accelerate's
        ``accelerator.save``). Bytes are written as they are; other objects with ``torch.save``
        when torch is imported, else with pickle. Returns True on the main process once the file
        is complete and durable, False elsewhere. Not collective: call
        :meth:`wait_for_everyone` before other ranks read the file."""
        if not self.is_main_process:
            return False
        write_atomic(path, _serialise(obj))
        return True

    def _goes_first(self, first):
        @contextlib.contextmanager
        def cm():
            if not first:
                self.comm.barrier()
            try:
                yield
            finally:
                # An exception in the block still meets the others at both barriers (they then
                # take their turn), so a failure on one rank never hangs the job.
                if first:
                    self.comm.barrier()
                self.comm.barrier()

        return cm()

    def main_process_first(self):
        """A context manager: the main process runs the block first, the others after it; when
        it exits on any rank, every rank has run the block. Collective."""
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self):
        """:meth:`main_process_first` per node: local rank 0 first. Collective over the job."""
        return self._goes_first(self.is_local_main_process)

    def wait_for_everyone(self):
        """A barrier (Accelerate's ``wait_for_everyone``)."""
        self.comm.barrier()

    def set_seed(self, seed):
        """Seed Python's ``random``, numpy's global generator and torch (when imported) with
        ``seed`` on every rank (Accelerate's ``set_seed``). Collective: a rank that passed a
        different seed makes every rank raise ValueError naming the seeds, instead of silently
        training with different data orders."""
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"set_seed: {seed!r} is not an integer in [0, 2**63)")
        seeds = array.array("q", [0] * self.world_size)
        self.comm.all_gather(array.array("q", [seed]), seeds)
        if len(set(seeds)) != 1:
            raise ValueError(f"set_seed: the ranks passed different seeds {list(seeds)}; pass the same seed on every rank")
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(seed % 2**32)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.manual_seed(seed)

    def reduce(self, value, reduction="sum"):
        """Reduce a metric over all ranks; every rank gets the result (Accelerate's ``reduce``):
        ``reduction`` is sum, mean, min, max or prod. A Python int or float gives the same type
        back; a numpy array or torch tensor gives a new one of its dtype. Collective."""
        op = _OPS.get(reduction)
        if op is None:
            raise ValueError(f"reduce: unknown reduction {reduction!r}; use one of {', '.join(_OPS)}")
        if isinstance(value, bool):
            raise TypeError("reduce: a bool is not a metric; pass an int or a float")
        if isinstance(value, int):
            buf = array.array("q", [value])
            self.comm.all_reduce(buf, op=op)
            return int(buf[0])
        if isinstance(value, float):
            buf = array.array("d", [value])
            self.comm.all_reduce(buf, op=op)
            return float(buf[0])
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            out = value.detach().clone().contiguous()
        else:
            import numpy as np

            out = np.array(value, copy=True, order="C")
        self.comm.all_reduce(out, op=op)
        return out

    def gather_for_metrics(self, local, dataset_len, first=0):
        """Gather a per-sample metric array from every rank for the whole evaluation set,
        dropping the distributed sampler's padding (Accelerate's ``gather_for_metrics``).
        Collective.

        The data must be sharded as torch's ``DistributedSampler`` (and lockstep's) does: the
        ``dataset_len`` positions are padded by wrapping to a multiple of the world size, and
        rank ``r`` takes positions ``r, r + world, ...``. ``local`` (a numpy array or CPU torch
        tensor, first axis = samples) holds this rank's shard positions ``first, first + 1,
        ...``. The result (numpy, or torch when given torch) has every real sample exactly once,
        in epoch order; every rank gets the same."""
        import numpy as np

        torch = sys.modules.get("torch")
        was_torch = torch is not None and isinstance(local, torch.Tensor)
        arr = np.ascontiguousarray(local.detach().cpu().numpy() if was_torch else np.asarray(local))
        if arr.ndim == 0:
            raise ValueError("gather_for_metrics: a scalar has no samples; pass one value per sample (shape (n, ...))")
        world = self.world_size
        per_rank = -(-dataset_len // world) if dataset_len > 0 else 0
        m = arr.shape[0]
        if first < 0 or first + m > per_rank:
            raise ValueError(
                f"gather_for_metrics: samples {first}..{first + m} of this rank's shard do not exist: "
                f"a dataset of {dataset_len} on {world} ranks gives each rank {per_rank}"
            )
        item = int(np.prod(arr.shape[1:], dtype=np.int64))

        def real(r):
            total = -(-(dataset_len - r) // world) if dataset_len > r else 0
            return max(0, min(total - first, m))

        counts = [real(r) * item for r in range(world)]
        flat = arr.reshape(-1)
        allv = np.empty(sum(counts), dtype=arr.dtype)
        self.comm.all_gather_v(flat[: counts[self.rank]], allv, counts)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        rows = []
        for i in range(m):
            for r in range(world):
                if i < real(r):
                    s = int(displs[r]) + i * item
                    rows.append(allv[s : s + item])
        out = np.concatenate(rows) if rows else np.empty(0, dtype=arr.dtype)
        out = out.reshape((-1,) + arr.shape[1:])
        return torch.from_numpy(out) if was_torch else out
