"""``import lockstep.torch`` registers the torch.distributed backend ``"lockstep"`` (CPU and CUDA
tensors):

    import torch.distributed as dist
    import lockstep.torch  # noqa: F401
    dist.init_process_group("lockstep")  # under torchrun, `lockstep launch`, mpiexec, mpirun, srun, or any env://

Under an MPI launcher (MPICH's ``mpiexec``, Open MPI's ``mpirun``, ``srun``) without torchrun,
importing this module sets torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` from the launcher's variables where ``RANK`` and ``WORLD_SIZE`` are unset;
``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's host and a free port there) are the user's to export.
A group of every rank of such a job whose ranks run on several hosts (or any such group with
``LOCKSTEP_MPI=on``) joins through MPI: lockstep's ``hier`` backend, shared memory inside each
host and MPI between hosts, CPU tensors only (docs/mpi.md).

Inside a :func:`lockstep.notebook_launcher` rank of a caller that imported torch, the default
process group is already initialised on this backend (check ``dist.is_initialized()`` before
calling ``init_process_group``).

Every process group (the default one and each ``new_group``) gets its own shared-memory
communicator, joined under an id that the group's rank 0 publishes in torch's store, and, at its
first collective on CUDA tensors, a device communicator (NCCL when each rank has its own GPU,
otherwise staged through shared memory; see ``Communicator.to_device``). Collectives run
synchronously on the calling thread, with the GIL released (CUDA ones are enqueued in order with
torch's current stream, as ProcessGroupNCCL's: see ``Communicator.stream``); ``async_op=True`` gives a
``Work`` that has already completed (its future holds the result, as DDP's reducer expects). A
mismatch between ranks, a dead peer or a timeout raises ``RuntimeError`` (``lockstep.CommError``)
naming the ranks instead of hanging. The timeout is the group's (``init_process_group`` and
``new_group``'s ``timeout``, ``dist.set_timeout``; ``LOCKSTEP_TIMEOUT_S`` where the group was left
at torch's default and the variable is set); a timed-out ``barrier`` or ``monitored_barrier``
raises torch's own wording, as gloo does.

Tensors are handed to the Rust extension as they are (it reads ``data_ptr``, ``numel``,
``dtype``); ``allreduce``, the call DDP makes, is itself written in Rust
(``lockstep._native.TorchAllReduce``), so an 8-byte ``dist.all_reduce`` costs little more than
torch's own Python wrapper.

torch's Flight Recorder: lockstep records itself (``SELF_RECORDING``; see ``lockstep._flight``).
``"lockstep"`` joins torch's self-recording backends, so torch attaches no recording hook to the
groups, and torch's dumps of them (``TORCH_FR_DUMP_ON_TIMEOUT=1`` after a failed collective,
``dump_flight_recorder()``, torch's ``_dump_fr_trace*(backend="lockstep")``, ``SIGUSR1`` with
``LOCKSTEP_TRACE_DIR`` and ``TORCH_FR_DUMP_TEMP_FILE`` set) are written from
lockstep's own ring of each communicator's calls; ``torchfrtrace`` reads them.

``empty_shared(*size, dtype=...)`` makes CPU tensors in a group's shared segment: collectives on
them are zero-copy (the peers read and write them in place).

Implemented: all_reduce (and coalesced), broadcast, reduce, all_gather, all_gather_into_tensor
(and coalesced), reduce_scatter, reduce_scatter_tensor (and coalesced), gather, scatter,
all_to_all, all_to_all_single, send, recv (also from any source: ``dist.recv(t)`` returns the
sender, ``dist.irecv(t)``'s Work names it in ``_source_rank()``), barrier, new_group, split_group
(c10d Backend), all_reduce of sparse COO tensors (sum, as gloo). Not: bitwise and PREMUL_SUM
reductions.
"""

import logging
import os
import threading
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ReduceOp, _create_work_from_future
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from . import _flight, _native

BACKEND = "lockstep"

_log = logging.getLogger(__name__)

# Tensors go to the Rust extension as they are: it reads data_ptr/numel/dtype itself (much
# cheaper than DLPack or tensor.numpy() for small messages).
_native._register_torch()

_OPS = {
    ReduceOp.RedOpType.SUM: "sum",
    ReduceOp.RedOpType.PRODUCT: "prod",
    ReduceOp.RedOpType.MIN: "min",
    ReduceOp.RedOpType.MAX: "max",
    ReduceOp.RedOpType.AVG: "avg",
}


_SUM = ReduceOp.SUM


def _op_hashes():
    """[(hash, op name)] of the ops lockstep has, where the hash of torch's ``ReduceOp`` as a
    Backend reads it (``opts.reduceOp``) is the op's own: the same for two objects of one op alive
    together, different between ops, an op lockstep lacks included (torch 2.15 hashes the op's
    number). Then the Rust
    ``allreduce`` names the op by one hash instead of an equality test per call. None where the
    hash is not the op's (the equality test is kept)."""
    from torch._C._distributed_c10d import AllreduceOptions

    def read(kind):
        o = AllreduceOptions()
        o.reduceOp = ReduceOp(kind)
        return o.reduceOp

    try:
        a = [read(k) for k in _OPS]
        b = [read(k) for k in _OPS]
        hashes = [hash(x) for x in a]
        if len(set(hashes)) == len(hashes) and hashes == [hash(y) for y in b] and hash(read(ReduceOp.BAND)) not in hashes:
            return list(zip(hashes, _OPS.values()))
    except Exception:
        pass
    return None


_OP_HASHES = _op_hashes()


def _op(reduce_op):
    kind = reduce_op.op if isinstance(reduce_op, ReduceOp) else reduce_op
    try:
        return _OPS[kind]
    except KeyError:
        raise ValueError(f"the lockstep backend does not support reduce op {kind}; it has SUM, PRODUCT, MIN, MAX and AVG") from None


def _done(result, opts=None):
    """The Work of a call that has completed. torch's blocking wrappers (``async_op=False``) say
    so in ``opts.asyncOp`` and accept None, which saves making a future on the hot path."""
    if opts is not None and getattr(opts, "asyncOp", True) is False:
        return None
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _flat(tensors, dtype):
    """One contiguous tensor holding `tensors` back to back (they are copied)."""
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _into(out, write):
    """Call ``write(dst)`` with a contiguous tensor that lands in `out`: `out` itself when it is
    contiguous, else a temporary copied into it afterwards (the native calls write whole
    buffers)."""
    if out.is_contiguous():
        write(out)
    else:
        tmp = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        write(tmp)
        out.copy_(tmp.view(out.shape))


def _split_out(flat, outs):
    at = 0
    for o in outs:
        n = o.numel()
        o.copy_(flat[at : at + n].view(o.shape))
        at += n


def _seconds(timeout):
    """A torch timeout (timedelta; negative: torch's "unset") in seconds, or None when unset."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return None if secs < 0 else secs


def _ms(secs):
    return int(round(secs * 1000))


def _ranks(ranks):
    return ", ".join(str(r) for r in ranks)


def _reworded(e, text):
    """`e` (a ``lockstep.CommError``) with the message torch's callers expect; its ``kind``,
    ``follows`` and ``missing`` kept."""
    err = _native.CommError(text)
    err.kind, err.follows, err.missing = e.kind, e.follows, list(getattr(e, "missing", []))
    return err


def _group_timeout(timeout):
    """The timeout, in seconds, of the communicator of a group made with torch's `timeout`:
    torch's, except that where the program left torch's default and ``LOCKSTEP_TIMEOUT_S`` is
    set, that variable (None: the communicator reads it)."""
    from torch.distributed.constants import default_pg_timeout

    if timeout is None or (timeout == default_pg_timeout and os.environ.get("LOCKSTEP_TIMEOUT_S", "").strip()):
        return None
    return _seconds(timeout)


class _Ops:
    """The collectives, shared by the two shapes the backend takes: a c10d ``Backend`` where torch
    dispatches Python Backend subclasses (2.15 and later), a ``ProcessGroup`` before. The shell
    calls ``_setup``: ``done(result, opts)`` makes the Work of a call, and ``completed`` is the one
    a blocking all-reduce returns (None for a ProcessGroup)."""

    def _setup(self, comm, rank, world_size, job_id, done, completed=None, timeout_s=None):
        self._comm = comm
        self._job_id = job_id
        # The group's timeout in seconds (None: LOCKSTEP_TIMEOUT_S), for the device communicator
        # made later.
        self._timeout_s = timeout_s
        self._device_comm = None
        self._rank = rank
        self._world_size = world_size
        self._done = done
        # An instance attribute wins over the base class's method, both for Python callers
        # (dist.all_reduce) and for C++ ones (DDP's reducer, through pybind's override lookup).
        self.allreduce = _native.TorchAllReduce(comm, _SUM, _op, done, self._allreduce_device, completed, self._failed, _OP_HASHES)

    @property
    def comm(self):
        """The underlying :class:`lockstep.Communicator` (CPU tensors)."""
        return self._comm

    def _on(self, t):
        """The communicator for tensor `t`: the shared-memory one for CPU tensors, the device one
        for CUDA tensors (made on first use)."""
        # Tensors neither on the CPU nor CUDA go to the host communicator, which refuses them
        # with a TypeError and tells the peers (they fail instead of waiting).
        if not t.is_cuda:
            return self._comm
        dev = self._device(t)
        # Ordered with the caller's current stream on the device, as ProcessGroupNCCL's calls:
        # the collective waits for the kernels that produced `t`, later kernels wait for it, and
        # nothing synchronises the device.
        dev.stream = torch.cuda.current_stream(t.device).cuda_stream
        return dev

    def _device(self, t):
        """The group's device communicator, made by the first collective on CUDA tensors (every
        rank makes it at the same call, since torch's collectives are called with tensors on the
        same kind of device everywhere): NCCL when each rank has its own GPU, else staged through
        a second shared segment. Its device is the tensor's."""
        if self._device_comm is None:
            if self._job_id is None and self._comm.backend == "hier":
                raise RuntimeError(
                    "this process group spans nodes through MPI (lockstep's hier backend), which carries CPU tensors only: "
                    "move the tensors to the CPU, or use the NCCL backend for CUDA tensors across nodes"
                )
            if self._job_id is None:
                raise RuntimeError("this process group was made without a job id, so it cannot make a device communicator")
            host = _native.join_named(f"{self._job_id}-cuda", self._rank, self._world_size, self._timeout_s)
            self._device_comm = host.to_device(t.get_device())
        return self._device_comm

    def _allreduce_device(self, tensors, opts=None):
        """allreduce on the tensors TorchAllReduce does not take: CUDA and sparse ones."""
        op = _op(opts.reduceOp) if opts is not None else "sum"
        for t in tensors:
            if t.is_sparse:
                self._allreduce_sparse(t, op)
            else:
                self._on(t).all_reduce_in_place(t, op)
        return self._done(tensors, opts)

    def _allreduce_sparse(self, t, op):
        """All-reduce of a sparse COO tensor in place, as gloo's: the sum of every rank's
        tensor (coalesced). Each rank's indices and values are gathered (padded to the largest
        count of entries) and summed in rank order, so every rank gets the same result."""
        if op != "sum":
            raise ValueError(f"the lockstep backend reduces sparse tensors with SUM only, as gloo does; got {op}")
        c = t.coalesce()
        idx = c.indices().t().contiguous()
        val = c.values().contiguous()
        comm, n = self._on(t), self._world_size
        counts = torch.empty(n, dtype=torch.int64, device=t.device)
        comm.all_gather(torch.tensor([idx.shape[0]], dtype=torch.int64, device=t.device), counts)
        counts = counts.tolist()
        most = max(counts)
        if most == 0:
            return
        pad_idx = idx.new_zeros((most,) + tuple(idx.shape[1:]))
        pad_idx[: idx.shape[0]] = idx
        pad_val = val.new_zeros((most,) + tuple(val.shape[1:]))
        pad_val[: val.shape[0]] = val
        all_idx = idx.new_empty((n * most,) + tuple(idx.shape[1:]))
        all_val = val.new_empty((n * most,) + tuple(val.shape[1:]))
        comm.all_gather(pad_idx, all_idx)
        comm.all_gather(pad_val, all_val)
        keep = torch.cat([torch.arange(r * most, r * most + k, device=t.device) for r, k in enumerate(counts)])
        total = torch.sparse_coo_tensor(all_idx[keep].t(), all_val[keep], t.shape).coalesce()
        t.copy_(total)

    def getBackendName(self):
        return BACKEND

    def size(self):
        return self._world_size

    def rank(self):
        return self._rank

    def __repr__(self):
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size})"

    def _get_sequence_number_for_group(self):
        """How many collectives this rank has made on the group (CPU and CUDA tensors together):
        the same on every rank between two collectives. torch reads it for
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s consistency checks and its Flight Recorder.
        Point-to-point calls are not counted (a sender and its receiver need not agree)."""
        n = self._comm.seq
        if self._device_comm is not None:
            n += self._device_comm.seq
        return n

    def set_timeout(self, timeout):
        """``dist.set_timeout``: the group's calls that follow wait at most `timeout` for their
        peers, on the CPU and (where it is staged through shared memory) the CUDA communicator.
        An NCCL communicator keeps ``LOCKSTEP_TIMEOUT_S``."""
        secs = _seconds(timeout)
        if secs is None:
            raise ValueError(f"set_timeout needs a timeout of at least 0; got {timeout}")
        self._timeout_s = secs
        self._comm.timeout = secs
        if self._device_comm is not None:
            if self._device_comm.timeout is None:
                _log.warning(
                    "dist.set_timeout: the group's %s communicator for CUDA tensors keeps its timeout "
                    "(LOCKSTEP_TIMEOUT_S when it was made); the CPU one now waits %.3f s",
                    self._device_comm.backend,
                    secs,
                )
            else:
                self._device_comm.timeout = secs

    def _failed(self):
        """A collective failed (mismatch, dead peer, timeout): nothing to do for a ProcessGroup."""

    def _close(self):
        """Leave both communicators: peers still waiting on this rank get an error, not a hang."""
        for c in (self._device_comm, self._comm):
            if c is not None:
                c.close()

    # Reductions -----------------------------------------------------------------------------

    # allreduce(tensors, opts=None) is an attribute set in __init__: lockstep._native's
    # TorchAllReduce, the hot path of DDP and of every small all_reduce written in Rust.

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        for t in tensors:
            self._on(t).reduce(t, None, op, opts.rootRank)
        return self._done(tensors, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        op = _op(opts.reduceOp)
        for out, ins in zip(outputs, input_lists):
            if len(ins) != self._world_size:
                raise ValueError(f"reduce_scatter needs one input tensor per rank ({self._world_size}), got {len(ins)}")
            flat = _flat(ins, out.dtype)
            _into(out, lambda dst: self._on(out).reduce_scatter(flat, dst, op))
        return self._done(outputs, opts)

    def reduce_scatter_single(self, output, input, opts):
        self._on(input).reduce_scatter(input, output, _op(opts.reduceOp))
        return self._done(output, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return self._done(outputs, opts)

    # Data movement --------------------------------------------------------------------------

    def _for_every_rank(self, t):
        """An uninitialised flat tensor of `t`'s dtype and device with room for every rank's `t`."""
        return torch.empty(t.numel() * self._world_size, dtype=t.dtype, device=t.device)

    def broadcast(self, tensors, opts):
        for t in tensors:
            self._on(t).broadcast(t, None, opts.rootRank)
        return self._done(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        for outs, inp in zip(output_lists, inputs):
            flat = self._for_every_rank(inp)
            self._on(inp).all_gather(inp, flat)
            _split_out(flat, outs)
        return self._done(output_lists, opts)

    def all_gather_single(self, output, input, opts=None):
        self._on(input).all_gather(input, output)
        return self._done(output, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._on(i).all_gather(i, o)
        return self._done(outputs, opts)

    def gather(self, output_lists, inputs, opts):
        root = opts.rootRank
        for i, inp in enumerate(inputs):
            if self._rank == root:
                flat = self._for_every_rank(inp)
                self._on(inp).gather(inp, flat, root)
                _split_out(flat, output_lists[i])
            else:
                self._on(inp).gather(inp, None, root)
        return self._done(output_lists, opts)

    def scatter(self, outputs, input_lists, opts):
        root = opts.rootRank
        for i, out in enumerate(outputs):
            send = _flat(input_lists[i], out.dtype) if self._rank == root else None
            _into(out, lambda dst: self._on(out).scatter(send, dst, root))
        return self._done(outputs, opts)

    def alltoall(self, outputs, inputs, opts=None):
        send = _flat(inputs, inputs[0].dtype if inputs else torch.float32)
        recv = torch.empty(sum(o.numel() for o in outputs), dtype=send.dtype, device=send.device)
        self._on(send).all_to_all_v(send, [t.numel() for t in inputs], recv, [o.numel() for o in outputs])
        _split_out(recv, outputs)
        return self._done(outputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if not output_split_sizes and not input_split_sizes:
            self._on(input).all_to_all(input, output)
            return self._done(output, opts)
        n = self._world_size

        def counts(t, splits):
            rows = t.shape[0] if t.dim() > 0 else 1
            per_row = t.numel() // rows if rows else 0
            if not splits:
                if rows % n:
                    raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {n} ranks; pass split sizes")
                splits = [rows // n] * n
            return [s * per_row for s in splits]

        self._on(input).all_to_all_v(input, counts(input, input_split_sizes), output, counts(output, output_split_sizes))
        return self._done(output, opts)

    # Point to point and barrier --------------------------------------------------------------

    def _p2p(self, kind, tensors, peer):
        """Each tensor's send or receive (`kind`: the communicator's method and the group op's
        name) with `peer`: now, or inside ``batch_isend_irecv`` collected for ``end_coalescing``."""
        if getattr(self, "_batch", None) is not None:
            self._batch.extend((kind, t, peer) for t in tensors)
        else:
            for t in tensors:
                getattr(self._on(t), kind)(t, peer)
        return self._done(tensors)

    def send(self, tensors, dst, tag=0):
        return self._p2p("send", tensors, dst)

    def recv(self, tensors, src, tag=0):
        return self._p2p("recv", tensors, src)

    def start_coalescing(self):
        """torch's coalescing manager (``batch_isend_irecv``): sends and receives are collected
        until ``end_coalescing`` posts them together."""
        self._batch = []

    def end_coalescing(self):
        ops, self._batch = self._batch or [], None
        if ops:
            self._on(ops[0][1]).group(ops)
        return self._done(None)

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv(t)`` / ``dist.irecv(t)`` without a source: the first message from any other
        rank of the group (``Communicator.recv_any``). The Work names the sender."""
        if getattr(self, "_batch", None) is not None:
            # The batch never runs: later sends must not be collected for it.
            self._batch = None
            raise RuntimeError("the lockstep backend cannot receive from any source inside batch_isend_irecv (the batch's Work cannot name the sender): name the peer there, or call dist.irecv(t) outside the batch")
        if len(tensors) != 1:
            raise ValueError(f"a receive from any source takes one tensor, got {len(tensors)}")
        t = tensors[0]
        src = self._on(t).recv_any(t)
        return self._done_from(tensors, src)

    def _done_from(self, tensors, src):
        """The Work of a completed receive from `src` (a ProcessGroup's: torch hands it over as
        it is)."""
        return _HeldWork(result=tensors, src=src)

    def barrier(self, opts=None):
        """``dist.barrier``: waits the group's timeout, or ``barrier(timeout=...)``'s. A rank whose
        wait runs out raises torch's "Timed out waiting <ms>ms" naming the ranks that had not
        arrived, and the peers' barriers fail too (the group's communicator is aborted)."""
        timeout = _seconds(getattr(opts, "timeout", None))
        try:
            self._comm.barrier(timeout)
        except _native.CommError as e:
            if e.kind != "timeout":
                raise
            waited = timeout if timeout is not None else self._comm.timeout
            raise _reworded(
                e,
                f"lockstep barrier on rank {self._rank}: Timed out waiting {_ms(waited)}ms for rank(s) "
                f"{_ranks(e.missing)}; if this is expected, pass a larger timeout to init_process_group, "
                f"new_group, dist.set_timeout or barrier. {e}",
            ) from e
        return self._done(None, opts)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """``dist.monitored_barrier``, as gloo reports it: rank 0 waits ``timeout`` and raises
        "Rank <r> failed to pass monitoredBarrier in <ms> ms" naming the first rank that did
        not arrive (with ``wait_all_ranks``, "Ranks <r>, <s> failed ..." naming all of them);
        the other ranks wait at least the group's timeout, so that rank 0 is the one that
        reports, and then raise "Rank <r> successfully reached monitoredBarrier, but received
        errors while waiting for send/recv from rank 0". A dead peer fails it at once on every
        rank. The group's communicator is aborted by a failed monitored barrier."""
        timeout = _seconds(getattr(opts, "timeout", None))
        if timeout is None:
            timeout = self._comm.timeout
        if self._rank != 0:
            try:
                self._comm.barrier(max(timeout, self._comm.timeout))
            except _native.CommError as e:
                raise _reworded(
                    e,
                    f"Rank {self._rank} successfully reached monitoredBarrier, but received errors while waiting "
                    f"for send/recv from rank 0. Please check rank 0 logs for faulty rank. Lockstep's error: {e}",
                ) from e
            return
        try:
            self._comm.barrier(timeout)
        except _native.CommError as e:
            if e.kind != "timeout" or not e.missing:
                raise
            missing = e.missing if wait_all_ranks else e.missing[:1]
            who = f"Ranks {_ranks(missing)}" if len(missing) > 1 else f"Rank {missing[0]}"
            text = f"{who} failed to pass monitoredBarrier in {_ms(timeout)} ms"
            if _ms(timeout) == 0:
                # gloo's wording when the time is gone before rank 0 waits for anyone.
                text = f"Rank 0 timed out in monitoredBarrier after 0 ms; {text}"
            raise _reworded(e, f"{text}. Lockstep's error: {e}") from e

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
        for i, inp in enumerate(inputs):
            flat = self._for_every_rank(inp)
            self._on(inp).all_gather(inp.contiguous(), flat)
            _split_out(flat, [output_lists[r][i] for r in range(self._world_size)])
        return self._done(output_lists, opts)


class _HeldWork(dist.Work):
    """The Work of a call of this backend, which has completed (calls complete before they
    return): ``is_completed()`` is True, and for a receive from any source ``_source_rank()``
    (what ``dist.recv`` returns) names the sender, a rank of the group. `inner`: torch's Work for
    the same call, waited on through this one (see ``_holding``); `result`: the call's tensors,
    where there is no `inner`."""

    def __init__(self, inner=None, result=None, src=None):
        super().__init__()
        self._inner = inner
        self._result = result
        self._src = src

    def wait(self, timeout=None):
        return self._inner.wait() if self._inner is not None else True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self.get_future().value() if self._inner is not None else self._result

    def get_future(self):
        if self._inner is not None:
            return self._inner.get_future()
        fut = Future()
        fut.set_result(self._result)
        return fut

    def _source_rank(self):
        if self._src is None:
            raise ValueError("this Work is not a receive from any source, so it has no source rank")
        return self._src

    def source_rank(self):
        return self._source_rank()


# What the Backend's last call on this thread that returns its Work to the caller (an async
# collective, a send or receive) left for torch's wrapper of the call (``_holding``) to read:
# the key "src" (None, or the sender of a receive from any source). Calls run on the caller's
# thread and complete before returning, so the wrapper reads it right after the call.
_HELD = threading.local()


def _report_failures(cls):
    """Wrap every collective of `cls` so that a failure first calls ``self._failed()`` (the c10d
    Backend dumps torch's Flight Recorder there), then propagates unchanged."""
    import functools

    def wrap(f):
        @functools.wraps(f)
        def call(self, *args, **kwargs):
            try:
                return f(self, *args, **kwargs)
            except Exception:
                self._failed()
                raise

        return call

    for name in _COLLECTIVES:
        setattr(cls, name, wrap(getattr(cls, name)))
    return cls


_COLLECTIVES = (
    "reduce reduce_scatter reduce_scatter_single reduce_scatter_single_coalesced broadcast allgather "
    "all_gather_single all_gather_single_coalesced allgather_coalesced gather scatter alltoall "
    "all_to_all_single send recv recv_anysource barrier monitored_barrier end_coalescing"
).split()
_report_failures(_Ops)


class ProcessGroupLockstep(_Ops, dist.ProcessGroup):
    """The backend as a torch.distributed ``ProcessGroup`` (torch before 2.15, which dispatches no
    Python ``Backend`` subclass)."""

    def __init__(self, comm, rank, world_size, job_id=None, timeout_s=None):
        dist.ProcessGroup.__init__(self, rank, world_size)
        self._setup(comm, rank, world_size, job_id, _done, timeout_s=timeout_s)

    # Names used by torch releases before 2.9 for the same operations.
    _allgather_base = _Ops.all_gather_single
    allgather_into_tensor_coalesced = _Ops.all_gather_single_coalesced
    _reduce_scatter_base = _Ops.reduce_scatter_single
    reduce_scatter_tensor_coalesced = _Ops.reduce_scatter_single_coalesced
    alltoall_base = _Ops.all_to_all_single


def _py_backend_supported():
    """Whether torch dispatches a Python subclass of c10d's ``Backend`` (its PyBackend trampoline,
    torch 2.15): a probe calls the C++ ``name()``, which reaches the Python ``getBackendName``
    only through the trampoline. A feature test, not a version test."""
    try:
        from torch._C._distributed_c10d import Backend

        class _Probe(Backend):
            def getBackendName(self):
                return "lockstep-probe"

        return _Probe(0, 1).name() == "lockstep-probe"
    except Exception:
        return False


PY_BACKEND = _py_backend_supported()

if PY_BACKEND:
    from torch._C._distributed_c10d import Backend as _C10dBackend

    # The Work of every blocking call (torch needs one, also for those: a missing Work leaves
    # the Flight Recorder's entry open, as if the call hung). It has completed; nothing reads it.
    _COMPLETED = _done(None)

    def _done_work(result, opts=None):
        if opts is not None and getattr(opts, "asyncOp", True) is False:
            return _COMPLETED
        _HELD.src = None
        return _done(result)

    class BackendLockstep(_Ops, _C10dBackend):
        """The backend as a c10d ``Backend`` (torch 2.15 and later): one object serves the group's
        CPU and CUDA tensors, torch's Flight Recorder dumps hold its collectives (from lockstep's
        own recorder where ``SELF_RECORDING``, else through torch's hook), and
        ``monitored_barrier`` and ``all_gather_coalesced`` reach it."""

        # Read by torch (batch_isend_irecv, split_group, new_group): as plain class attributes,
        # since reading the base class's properties through a Python subclass recurses in torch
        # 2.15. Coalescing is offered: the sends and receives of a batch_isend_irecv are posted
        # together (one lockstep group), so two ranks that both send first do not wait on each
        # other. Splitting too (``split``), with ``_split_group`` keeping the ranks left out away
        # from torch's trampoline, which crashes when a Python ``split`` returns None.
        supports_coalescing = True
        supports_splitting = True

        def __init__(self, comm, rank, world_size, job_id, timeout):
            _C10dBackend.__init__(self, rank, world_size)
            self._options = _C10dBackend.Options(BACKEND, timeout)
            # How many splits of this group this rank took part in, and the last one made
            # here: (torch's name for the new group, its backend).
            self._splits = 0
            self._last_split = (None, None)
            self._setup(comm, rank, world_size, job_id, _done_work, _COMPLETED, _group_timeout(timeout))

        @property
        def options(self):
            return self._options

        def set_timeout(self, timeout):
            _Ops.set_timeout(self, timeout)
            self._options = _C10dBackend.Options(BACKEND, timeout)

        def _failed(self):
            """With ``TORCH_FR_DUMP_ON_TIMEOUT=1`` (torch's switch for NCCL), write torch's Flight
            Recorder of this process (``TORCH_FR_DUMP_TEMP_FILE`` + global rank, default
            ``~/.cache/torch/comm_lib_trace_rank_<rank>``) when a collective fails, so that
            ``torchfrtrace`` can name the rank and the call where the ranks parted: lockstep's
            own recorder where it records itself (``SELF_RECORDING``), else torch's."""
            if os.environ.get("TORCH_FR_DUMP_ON_TIMEOUT", "").strip().lower() not in ("1", "true", "yes", "on"):
                return
            try:
                # Through the module: `_flight.install` routes "lockstep" to lockstep's recorder.
                import torch._C._distributed_c10d as c

                c._dump_fr_trace_file(dist.get_rank(), backend=BACKEND)
            except Exception:  # the collective's own error is what the caller must see
                _log.warning("could not write the Flight Recorder dump after a failed collective", exc_info=True)

        def split(self, store, ranks, opts=None):
            """``dist.split_group`` on a member of the new group: a new communicator for the
            group's `ranks` (ranks of this group, in the new group's order), joined under an id
            published in `store` (torch's store for the new group). Non-members take no part
            (``_split_group`` returns before this is called for them)."""
            ranks = list(ranks)
            name = getattr(opts, "group_name", None)
            if name and self._last_split[0] == name:
                # torch splits the group once per device type, and this one object serves
                # both CPU and CUDA tensors: the second device gets the same new backend.
                return self._last_split[1]
            self._splits += 1
            if self._rank not in ranks:
                raise RuntimeError(
                    f"rank {self._rank} is not in the split {ranks}; lockstep's split_group must not reach "
                    "the backend on a rank outside the new group (a group mixing lockstep with another backend "
                    "cannot be split by such a rank): call dist.split_group on a group whose backends are all lockstep"
                )
            timeout = opts._timeout if opts is not None else self._options._timeout
            child = _join(store, ranks.index(self._rank), len(ranks), timeout, ranks)
            self._last_split = (name, child)
            return child

        def perform_nocolor_split(self, device=None):
            """A rank outside a new group made by splitting (``new_group`` on a default group
            bound to a device): nothing to do, since a lockstep communicator is joined by its
            members only. Counted, as NCCL counts it."""
            self._splits += 1

        def comm_split_count(self):
            """How many splits this group's backend has taken part in (torch names the new
            groups after it)."""
            return self._splits

        def _done_from(self, tensors, src):
            _HELD.src = src
            return _done(tensors)

        def shutdown(self):
            self._close()

        def abort(self):
            self._close()

    def _holding(torch_call):
        """`torch_call` (a ``ProcessGroup`` method that returns a call's Work), returning for
        this backend's calls a Work that answers as the call did. torch 2.15 hands a Python
        Backend's Work back wrapped in a holder that forwards only ``wait`` and ``get_future``:
        ``is_completed()`` on it stays False after the call completed, and ``_source_rank()``
        raises, so ``dist.recv(t)`` could not name the sender. The call still goes through torch
        (dispatcher, Flight Recorder); when it reached this backend, which noted so on this
        thread (``_HELD``), the Work returned is a ``_HeldWork`` waiting through torch's.
        Other backends' calls get torch's Work unchanged."""
        import functools

        held = _HELD.__dict__

        @functools.wraps(torch_call)
        def call(pg, *args, **kwargs):
            # A note left by a call that came from C++ (DDP's reducer) is not this call's.
            held.pop("src", None)
            work = torch_call(pg, *args, **kwargs)
            if "src" not in held or work is None:
                return work
            return _HeldWork(work, src=held.pop("src"))

        return call

    for _name in (
        "allreduce allreduce_coalesced broadcast reduce allgather allgather_coalesced all_gather_single "
        "all_gather_single_coalesced _allgather_base allgather_into_tensor_coalesced gather scatter "
        "reduce_scatter reduce_scatter_single reduce_scatter_single_coalesced _reduce_scatter_base "
        "reduce_scatter_tensor_coalesced alltoall all_to_all_single alltoall_base barrier send recv "
        "recv_anysource _end_coalescing"
    ).split():
        if hasattr(dist.ProcessGroup, _name):
            setattr(dist.ProcessGroup, _name, _holding(getattr(dist.ProcessGroup, _name)))

    def _split_group(pg, ranks, *args, _torch=dist.ProcessGroup.split_group, **kwargs):
        """``ProcessGroup.split_group`` (``dist.split_group``): on a rank left out of the new
        group whose backends are all lockstep, None at once (torch's answer for a rank left out)
        without reaching the backends: lockstep's communicators are joined by their members
        only, and torch's trampoline crashes when a Python Backend's ``split`` returns None."""
        if pg.rank() not in ranks:
            backends = {id(b): b for b in (pg._get_backend(d) for d in pg._device_types)}.values()
            if backends and all(isinstance(b, BackendLockstep) for b in backends):
                for b in backends:
                    b.perform_nocolor_split()
                return None
        return _torch(pg, ranks, *args, **kwargs)

    dist.ProcessGroup.split_group = _split_group


def empty_shared(*size, dtype=torch.float32, group=None):
    """A CPU tensor of `size` (zeroed) whose memory lives in the shared segment of `group`'s
    lockstep communicator (the default group when None): collectives of that group on such
    tensors, on every rank, read and write them in place instead of staging copies (zero-copy).
    The tensor is ordinary otherwise (views, in-place ops, autograd all work); its memory goes
    back to the segment's heap when the last view of it is freed. Needs numpy (the memory is
    handed to torch through ``torch.from_numpy``)."""
    import numpy as np

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, _Ops):
        try:
            pg = pg._get_backend(torch.device("cpu"))
        except Exception:
            pass
    if not isinstance(pg, _Ops):
        raise TypeError(f"empty_shared needs a process group of the lockstep backend; got {type(pg).__name__}")
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    numel = 1
    for n in size:
        numel *= int(n)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    mem = pg.comm.alloc_shared(max(numel * itemsize, 1))
    # numpy keeps `mem` as the array's base, torch keeps the array: the memory lives as long as
    # any tensor viewing it.
    raw = torch.from_numpy(np.asarray(mem))
    return raw[: numel * itemsize].view(dtype).view(size)


_KEY = "lockstep/job_id"


def _create(opts, backend_options=None):
    """torch's creator (extended API): one lockstep communicator per process group. The group's
    rank 0 names the shared segment; the others read the name from the group's store. A group
    that torch makes by splitting (``new_group`` on a default group bound to a device) is joined
    the same way, by its members only; the split is counted on the parent, as on the ranks left
    out (``perform_nocolor_split``), so that every rank names the next split alike."""
    parent = getattr(opts, "split_from", None)
    if PY_BACKEND and isinstance(parent, BackendLockstep):
        parent._splits += 1
    return _join(opts.store, opts.group_rank, opts.group_size, opts.timeout, getattr(opts, "global_ranks_in_group", None))


def _join(store, rank, size, timeout, ranks=None):
    """This rank's backend of a group of `size` ranks (`ranks`: their ranks in the job, in group
    order; empty or None: the whole job). One node: a shared segment named by the group's rank 0
    in `store`. Across nodes, under an MPI launcher: the job's hierarchical communicator."""
    timeout_s = _group_timeout(timeout)
    if _through_mpi(store, rank, size, ranks):
        comm = _native.join_mpi(timeout_s)
        if comm.rank != rank:
            raise RuntimeError(
                f"torch gave this process rank {rank} but MPI ranks it {comm.rank}: under an MPI launcher leave RANK and "
                "WORLD_SIZE unset (lockstep.torch takes them from the launcher), or set them to MPI's ranks"
            )
        job_id = None
    else:
        if rank == 0:
            store.set(_KEY, f"torch-{uuid.uuid4().hex[:16]}")
        job_id = store.get(_KEY).decode()
        comm = _native.join_named(job_id, rank, size, timeout_s)
    if PY_BACKEND:
        return BackendLockstep(comm, rank, size, job_id, timeout)
    return ProcessGroupLockstep(comm, rank, size, job_id, timeout_s)


# The MPI launchers, in lockstep.init_from_env's order of precedence: their variables for the
# rank, the world size, the local rank and the local world size (None: not given).
_MPI_LAUNCHERS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi_launch(env=os.environ):
    """The variables of the MPI launcher (Open MPI's mpirun, srun, MPICH's mpiexec) that started
    this process, as (rank, world size, local rank, local world size) names, or None."""
    for names in _MPI_LAUNCHERS:
        if env.get(names[0], "").strip() and env.get(names[1], "").strip():
            return names
    return None


def _torch_vars_from_mpi(env=os.environ):
    """Under an MPI launcher and not under torchrun (``RANK`` and ``WORLD_SIZE`` both unset): set
    torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the
    launcher's, so that ``dist.init_process_group("lockstep")`` (env://) runs under mpiexec,
    mpirun or srun as under torchrun. ``MASTER_ADDR`` and ``MASTER_PORT`` (where rank 0 hosts
    torch's store) remain the user's to give."""
    names = _mpi_launch(env)
    if names is None or env.get("RANK", "").strip() or env.get("WORLD_SIZE", "").strip():
        return
    for torch_name, name in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), names):
        if name is not None and env.get(name, "").strip() and not env.get(torch_name, "").strip():
            env[torch_name] = env[name].strip()


_torch_vars_from_mpi()


def _through_mpi(store, rank, size, ranks):
    """Whether a group of `size` ranks joins through MPI (lockstep's hier backend) rather than a
    shared segment: under an MPI launcher, for a group of every rank of the job in order (MPI
    ranks the communicator as ``MPI_COMM_WORLD``), with ``LOCKSTEP_MPI=on``, or with ``auto``
    (the default) when its ranks run on several hosts, as ``lockstep.init_from_env`` decides.
    With ``auto`` the ranks compare their hosts through the group's `store`; a group that spans
    hosts without being the whole job is refused (a shared segment cannot span them)."""
    names = _mpi_launch()
    if names is None or size < 2:
        return False
    mode, host = _native.mpi_placement()
    if mode == "off":
        return False
    world = int(os.environ[names[1]])
    whole = size == world and list(ranks or range(size)) == list(range(size))
    if mode == "on":
        return whole
    store.set(f"lockstep/host/{rank}", host)
    elsewhere = [r for r in range(size) if store.get(f"lockstep/host/{r}").decode() != host]
    if elsewhere and not whole:
        raise RuntimeError(
            f"this lockstep process group of {size} ranks spans hosts (rank {rank} and rank {elsewhere[0]} of the group run "
            f"on different hosts), but only a group of all {world} ranks of the job can join across hosts (through MPI): "
            "make groups of ranks on one host, or use the whole job's group"
        )
    return bool(elsewhere)


def _recorder_on():
    """Whether lockstep's communicators keep a flight recorder (``LOCKSTEP_TRACE_BUFFER`` is not
    0); an unreadable value keeps the default, as the communicators do."""
    try:
        return int(os.environ.get("LOCKSTEP_TRACE_BUFFER", "").strip() or "1") != 0
    except ValueError:
        return True


def _self_recording_set():
    """torch's set of backends that record themselves into its Flight Recorder (torch 2.15 has
    it; None before), for which it attaches no recording hook to a group."""
    return getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)


def _self_recording():
    return SELF_RECORDING


# Whether torch's Flight Recorder dumps of the lockstep groups come from lockstep's own recorder
# (lockstep._flight) instead of the hook torch attaches around each call: on a c10d Backend, where
# torch has the set of self-recording backends, while lockstep's recorder is on. Otherwise torch's
# hook records the groups as it does any backend.
SELF_RECORDING = PY_BACKEND and _self_recording_set() is not None and _recorder_on()


def dump_flight_recorder(rank=None):
    """Write this process's Flight Recorder of the lockstep groups, in torch's format, where
    torch writes its own (``TORCH_FR_DUMP_TEMP_FILE`` + `rank`, the global rank by default), and
    return the path; ``torchfrtrace`` reads a directory of the ranks' files. Local: the other
    ranks write nothing unless they are asked too. Where torch's hook records the groups
    (``SELF_RECORDING`` False), torch writes it."""
    if rank is None:
        rank = dist.get_rank()
    if SELF_RECORDING:
        return _flight.write(rank)
    from torch._C._distributed_c10d import _dump_fr_trace_file

    _dump_fr_trace_file(rank, backend=BACKEND)
    return _flight.dump_path(rank)


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    if SELF_RECORDING:
        _self_recording_set().add(BACKEND)
        _flight.install(_self_recording)
        _native._torch_fr_on_sigusr1()


_register()


def _ddp_logging_data(ddp, _torch=DistributedDataParallel._get_ddp_logging_data):
    """``DistributedDataParallel._get_ddp_logging_data``: its "backend_name" names this
    backend. torch's C++ ``ProcessGroup`` names every plugin backend "custom" (DDP's logger reads
    that); gloo's and NCCL's groups name theirs, and so does ``dist.get_backend``."""
    data = _torch(ddp)
    group = getattr(ddp, "process_group", None)
    if data.get("backend_name") == "custom" and group is not None and dist.get_backend(group) == BACKEND:
        data["backend_name"] = BACKEND
    return data


DistributedDataParallel._get_ddp_logging_data = _ddp_logging_data
