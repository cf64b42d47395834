"""Type stub for ``lockstep._native``, the Rust half of the package (python/src/*.rs).

Keep in step with the ``#[pyfunction]``s, ``#[pyclass]``es and the ``#[pymodule] fn _native``
of python/src; tests/test_stubs.py compares this file with the built extension.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Literal, Sequence, final

# A collective buffer: anything exporting the buffer protocol (numpy arrays, bytearray,
# memoryview, array.array), a torch tensor, a DLPack object, or a `__cuda_array_interface__`
# object (device communicators). Checked at run time (contiguity, writability, alignment, element
# type), so it cannot be expressed statically. Stub-only: not an attribute of the module.
_Buffer = Any

__all__ = [
    "Communicator",
    "ShmJob",
    "TorchAllReduce",
    "SharedMemory",
    "CommError",
    "init_from_env",
    "cli_main",
    "_deliver_logs",
    "fork_refusal",
    "die_with_parent",
    "join_named",
    "join_mpi",
    "mpi_placement",
    "_register_torch",
    "_torch_fr_on_sigusr1",
    "status_json",
    "__version__",
]

__version__: str

class CommError(RuntimeError):
    # Set by the Rust side on every CommError it raises (absent on one made by hand).
    # One of "invalid_argument", "mismatch", "peer_lost", "aborted", "timeout", "excluded" (left
    # out by a shrink), "shrunk" (a communicator shrink replaced), "unsupported",
    # "setup", "os", "backend", "non_finite" (a NaN or infinity in a reduction's input under
    # LOCKSTEP_CHECK_FINITE=1), "other".
    kind: str
    # The global rank whose failure this error follows from (the lost peer, or the rank that
    # aborted the communicator); None otherwise.
    follows: int | None
    # For a timeout, the global ranks this rank was still waiting for; empty otherwise.
    missing: list[int]

# No constructor: made by init_from_env(), join_named(), join_mpi(), ShmJob.communicator() or
# to_device().
@final
class Communicator:
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    # "shm", "nccl", "staged" or "hier" (shared memory in each node, MPI between nodes).
    @property
    def backend(self) -> str: ...
    # The CUDA device of a device communicator; None for host backends.
    @property
    def device(self) -> int | None: ...
    # The CUDA stream (handle) device calls are ordered on; None: each call synchronises the device.
    @property
    def stream(self) -> int | None: ...
    @stream.setter
    def stream(self, stream: int | None) -> None: ...
    # Number of collectives issued so far on this rank (0 once closed).
    @property
    def seq(self) -> int: ...
    # The flight recorder's records, oldest first (the last LOCKSTEP_TRACE_BUFFER calls): dicts
    # with the keys of the trace files (id, seq, op, dtype, reduce, count, root, buffer, path,
    # start_ns, end_ns, state, and error or ops).
    def trace(self) -> list[dict[str, object]]: ...
    # Write this rank's records into `dir` now; returns the file's path.
    def dump_trace(self, dir: str | os.PathLike[str]) -> str: ...
    # Seconds a call waits for its peers before a "timeout" CommError (LOCKSTEP_TIMEOUT_S unless
    # set); None for NCCL. Settable on shm and staged communicators (local, not a collective).
    @property
    def timeout(self) -> float | None: ...
    @timeout.setter
    def timeout(self, value: float) -> None: ...
    # Whether reductions check their input for NaN and infinities (LOCKSTEP_CHECK_FINITE=1 unless
    # set): a "non_finite" CommError on every rank names the rank and the element. Settable
    # between calls on shm and staged communicators; every rank must set it alike.
    @property
    def check_finite(self) -> bool: ...
    @check_finite.setter
    def check_finite(self, on: bool) -> None: ...
    # A collective; takes this communicator over (it is closed, the new one owns or uses it).
    # local_rank defaults to $LOCAL_RANK, else this rank.
    def to_device(self, local_rank: int | None = None) -> Communicator: ...
    # Zeroed memory in the shared segment; host (shared-memory) communicators only.
    def alloc_shared(self, nbytes: int) -> SharedMemory: ...
    def __repr__(self) -> str: ...
    # op: "sum", "prod", "min", "max", "avg". recv=None (or recv is send): in place.
    # Each collective returns the buffer holding the result.
    def all_reduce(self, send: _Buffer, recv: _Buffer | None = None, op: str = "sum") -> _Buffer: ...
    def all_reduce_in_place(self, buf: _Buffer, op: str = "sum") -> _Buffer: ...
    def broadcast(self, send: _Buffer, recv: _Buffer | None = None, root: int = 0) -> _Buffer: ...
    def broadcast_in_place(self, buf: _Buffer, root: int = 0) -> _Buffer: ...
    # The result buffer on the root, None elsewhere.
    def reduce(self, send: _Buffer, recv: _Buffer | None = None, op: str = "sum", root: int = 0) -> _Buffer | None: ...
    def reduce_in_place(self, buf: _Buffer, op: str = "sum", root: int = 0) -> _Buffer | None: ...
    def all_gather(self, send: _Buffer, recv: _Buffer | None = None) -> _Buffer: ...
    def all_gather_in_place(self, buf: _Buffer) -> _Buffer: ...
    # recv may be None off the root; returns recv on the root, None elsewhere.
    def gather(self, send: _Buffer, recv: _Buffer | None = None, root: int = 0) -> _Buffer | None: ...
    def reduce_scatter(self, send: _Buffer, recv: _Buffer | None = None, op: str = "sum") -> _Buffer: ...
    def reduce_scatter_in_place(self, buf: _Buffer, op: str = "sum") -> _Buffer: ...
    def all_to_all(self, send: _Buffer, recv: _Buffer) -> _Buffer: ...
    # Displacements default to the packed prefix sums of the counts.
    def all_to_all_v(
        self,
        send: _Buffer,
        send_counts: Sequence[int],
        recv: _Buffer,
        recv_counts: Sequence[int],
        send_displs: Sequence[int] | None = None,
        recv_displs: Sequence[int] | None = None,
    ) -> _Buffer: ...
    # send is not read off the root and may be None there.
    def scatter(self, send: _Buffer | None, recv: _Buffer, root: int = 0) -> _Buffer: ...
    def all_gather_v(self, send: _Buffer, recv: _Buffer, recv_counts: Sequence[int]) -> _Buffer: ...
    # recv and recv_counts may be None off the root; returns recv on the root, None elsewhere.
    def gather_v(
        self,
        send: _Buffer,
        recv: _Buffer | None = None,
        recv_counts: Sequence[int] | None = None,
        root: int = 0,
    ) -> _Buffer | None: ...
    # Blocks until peer has posted the matching recv.
    def send(self, buf: _Buffer, peer: int) -> None: ...
    def recv(self, buf: _Buffer, peer: int) -> _Buffer: ...
    # The first message from any other rank; returns its sender.
    def recv_any(self, buf: _Buffer) -> int: ...
    # ops: ("send", buf, peer) and ("recv", buf, peer) tuples, posted together; a recv's peer may
    # be None (any source). Returns each op's peer, with the sender for those receives.
    def group(self, ops: Sequence[tuple[str, _Buffer, int | None]]) -> list[int]: ...
    # timeout: seconds this call waits instead of the communicator's timeout.
    def barrier(self, timeout: float | None = None) -> None: ...
    # After a failure: the communicator of the ranks that remain (shared memory only); wait:
    # seconds to wait for live ranks that have not called it (default 1).
    def shrink(self, exclude: Sequence[int] | None = None, wait: float | None = None) -> Communicator: ...
    # After a lost rank's replacement started (lockstep launch --restart-policy rank): the
    # whole world again, same ranks; wait: seconds for the replacement (default the join timeout).
    def grow(self, wait: float | None = None) -> Communicator: ...
    # Later calls raise; also done when the object is garbage-collected.
    def close(self) -> None: ...
    def __enter__(self) -> Communicator: ...
    # Closes the communicator; never suppresses the exception.
    def __exit__(self, _t: object, _v: object, _tb: object) -> Literal[False]: ...

# A shared segment for `world` ranks forked from this process; each forked rank calls
# communicator(rank) once, the parent close() once every rank is forked.
@final
class ShmJob:
    def __new__(cls, world: int) -> ShmJob: ...
    # Blocks (without the GIL) until every rank has joined.
    def communicator(self, rank: int) -> Communicator: ...
    def close(self) -> None: ...

# ProcessGroupLockstep.allreduce (lockstep/torch.py), in Rust.
@final
class TorchAllReduce:
    # sum: torch's ReduceOp.SUM; op_name(reduce_op) -> op name; done(tensors) -> Work;
    # device(tensors, opts): the all-reduce for tensors that are not dense CPU ones;
    # op_hashes: [(hash of torch's ReduceOp, op name)] where that hash names the op.
    def __new__(
        cls,
        comm: Communicator,
        sum: Any,
        op_name: Callable[[Any], str],
        done: Callable[[Any], Any],
        device: Callable[[Any, Any], Any],
        completed: Any | None = None,
        on_error: Callable[[], Any] | None = None,
        op_hashes: list[tuple[int, str]] | None = None,
    ) -> TorchAllReduce: ...
    # Reduces each tensor in place; returns done(tensors) (a completed Work), `completed` when
    # opts.asyncOp is False, or device(tensors, opts) for non-CPU tensors; on_error() runs
    # before a failure is raised.
    def __call__(self, tensors: Iterable[Any], opts: Any | None = None) -> Any: ...

# No constructor: made by Communicator.alloc_shared(). numpy.asarray(mem) views it (uint8).
@final
class SharedMemory:
    # Size in bytes.
    @property
    def nbytes(self) -> int: ...
    # numpy's array interface, version 3: shape, typestr "|u1", data (address, read-only flag).
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...
    def __repr__(self) -> str: ...

# Blocks (without the GIL) until every rank of the node has joined.
def init_from_env() -> Communicator: ...

# The `lockstep` command run in this process (argv: program name first); returns its exit
# status (0-255). Installs the stderr log subscriber: only for a process that is this command.
def cli_main(argv: Sequence[str]) -> int: ...

# Hand lockstep's queued diagnostics to Python's logging (those of lockstep's own threads wait
# for the next call into the extension otherwise).
def _deliver_logs() -> None: ...

# Why forking ranks from this process would fail (CUDA initialised here, a malformed
# LOCKSTEP_* variable), or None.
def fork_refusal() -> str | None: ...

# PR_SET_PDEATHSIG(SIGKILL) in a forked rank; False when parent_pid is no longer the parent
# (the rank should exit at once).
def die_with_parent(parent_pid: int) -> bool: ...

# Joins the named segment; rank 0 creates it. Settings from the LOCKSTEP_SHM_* variables;
# timeout (seconds), when given, instead of LOCKSTEP_TIMEOUT_S.
def join_named(job_id: str, rank: int, world: int, timeout: float | None = None) -> Communicator: ...

# Joins the job MPI started this process in through the hierarchical backend ("hier"), whatever
# LOCKSTEP_MPI says; every rank of MPI_COMM_WORLD at once, ranked as there. timeout as above.
def join_mpi(timeout: float | None = None) -> Communicator: ...

# (LOCKSTEP_MPI checked: "auto", "on" or "off"; this machine's host id, as init_from_env compares
# hosts.)
def mpi_placement() -> tuple[str, str]: ...

# What `lockstep status --json` prints: this user's jobs (job None) or one job's ranks.
# ValueError when no job matches.
def status_json(job: str | None = None) -> str: ...

# Builds the direct torch-tensor path once torch is imported; False while it is not.
def _register_torch() -> bool: ...

# Each SIGUSR1 that writes lockstep's trace files (LOCKSTEP_TRACE_DIR) also calls
# lockstep._flight.on_signal() (torch's Flight Recorder format).
def _torch_fr_on_sigusr1() -> None: ...
