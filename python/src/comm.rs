//! `lockstep.Communicator`: every collective of the Rust [`Communicator`] on buffer-protocol
//! objects, with the GIL released while the collective runs.
//!
//! Conventions of the Python API: `recv=None` means the in-place form where one exists (the
//! result lands in `send`); arguments a rank does not use (gather's `recv` off the root,
//! scatter's `send` off the root) may be `None`. Each method returns the buffer holding the
//! result (`None` on ranks that receive nothing).
//!
//! A call refused here (wrong type, non-contiguous, read-only, overlapping) is also reported to
//! the peers through [`Communicator::reject_call`], as the Rust API does for the checks it makes
//! itself, so they fail with a mismatch naming this rank instead of waiting for their timeout.

use std::sync::{Arc, Mutex};

use lockstep::comm::{Call, P2pOp, Splits, ANY_SOURCE};
use lockstep::cuda::{Context, ForeignStream};
use lockstep::types::MemSpace;
use lockstep::{CollKind, CommError, Communicator, Dtype, ReduceOp, SharedBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::buffer::{Loc, Mem, View};
use crate::errors::comm_err;

fn parse_op(op: &str) -> PyResult<ReduceOp> {
    op.parse::<ReduceOp>().map_err(PyValueError::new_err)
}

/// A group of ranks running collectives together: `lockstep.init_from_env()` under a launcher,
/// or `lockstep.comm()` inside `notebook_launcher`. Every rank must make the same sequence of
/// calls with the same counts, dtype, op and root; a disagreement raises `lockstep.CommError` on
/// every rank, naming the ranks, instead of hanging. Calls from several threads are serialised.
#[pyclass(frozen, name = "Communicator", module = "lockstep")]
pub struct PyComm {
    inner: Mutex<Option<Communicator>>,
    rank: usize,
    world: usize,
    backend: String,
    /// The CUDA context of a device communicator (NCCL, staged): its buffers are device memory
    /// of this device. None for host backends.
    ctx: Option<Arc<Context>>,
    /// The caller's CUDA stream that device calls are ordered on (`Communicator.stream`), by
    /// handle; None: each device call synchronises the device.
    stream: Mutex<Option<usize>>,
    /// The flight recorder, read without `inner`'s lock, which a running call holds (a
    /// SIGUSR1's dump reads the records of a rank stuck in a call). None when it is off.
    recorder: Option<lockstep::trace::TraceReader>,
}

fn cuda_err(e: lockstep::cuda::CudaError) -> CommError {
    CommError::Backend {
        backend: "cuda",
        message: e.to_string(),
    }
}

impl PyComm {
    /// Wrap a Rust communicator.
    pub fn new(c: Communicator) -> PyComm {
        PyComm {
            rank: c.rank(),
            world: c.world_size(),
            backend: c.backend_kind().to_string(),
            ctx: c.device_context(),
            recorder: c.trace_reader(),
            inner: Mutex::new(Some(c)),
            stream: Mutex::new(None),
        }
    }

    /// The memory space of this communicator's buffers.
    fn space(&self) -> MemSpace {
        self.ctx
            .as_ref()
            .map_or(MemSpace::Host, |c| MemSpace::Device(c.ordinal()))
    }

    /// Run `f` on the communicator with the GIL released.
    ///
    /// On a device communicator with a stream set (`Communicator.stream`), the call is ordered
    /// with that stream on the device: it waits for the work enqueued there so far, and the work
    /// enqueued there later waits for it; nothing blocks. Without one, the call is made
    /// synchronous with the caller's CUDA work, as the host backends' calls are: the device is
    /// synchronised first (the buffers were written by kernels on streams lockstep does not
    /// know; a context-wide synchronisation covers them all), and the call's own stream after.
    fn run<F>(&self, py: Python<'_>, f: F) -> PyResult<()>
    where
        F: FnOnce(&mut Communicator) -> Result<(), CommError> + Send,
    {
        let r = py.detach(|| {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let Some(c) = g.as_mut() else {
                return Err(CommError::Unsupported(format!(
                    "rank {}: this communicator was closed; make a new one",
                    self.rank
                )));
            };
            // Host communicators have no stream: their calls skip its lock.
            let stream = match &self.ctx {
                Some(_) => *self.stream.lock().unwrap_or_else(|p| p.into_inner()),
                None => None,
            };
            if let (Some(ctx), Some(handle)) = (&self.ctx, stream) {
                ctx.bind().map_err(cuda_err)?;
                // SAFETY: `Communicator.stream` requires a live stream of this device, set by the
                // caller (torch's current stream, for the torch backend).
                let caller = unsafe { ForeignStream::new(ctx, handle) };
                c.wait_stream(&caller)?;
                f(c)?;
                return c.signal_stream(&caller);
            }
            if let Some(ctx) = &self.ctx {
                ctx.bind()
                    .and_then(|_| ctx.synchronize())
                    .map_err(cuda_err)?;
            }
            f(c)?;
            if self.ctx.is_some() {
                c.synchronize()?;
            }
            Ok(())
        });
        crate::log::deliver(py);
        r.map_err(comm_err)
    }

    /// Run the out-of-place `kind` call on `send` and `recv` through the erased entry
    /// ([`Communicator::run`]); the count comes from the buffers, as in the typed methods.
    #[allow(clippy::too_many_arguments)]
    fn coll(
        &self,
        py: Python<'_>,
        kind: CollKind,
        dt: Dtype,
        op: ReduceOp,
        root: usize,
        send: Mem,
        recv: Mem,
    ) -> PyResult<()> {
        self.coll_v(py, kind, dt, op, root, send, recv, Splits::default())
    }

    /// [`coll`](Self::coll) with the per-peer counts of a v-variant.
    #[allow(clippy::too_many_arguments)]
    fn coll_v(
        &self,
        py: Python<'_>,
        kind: CollKind,
        dt: Dtype,
        op: ReduceOp,
        root: usize,
        send: Mem,
        recv: Mem,
        splits: Splits<'_>,
    ) -> PyResult<()> {
        self.run(py, move |c| {
            let call = Call {
                splits,
                ..c.call_on(kind, dt, op, root, send.raw(), recv.raw())
            };
            // SAFETY: see `Mem`: both come from views of `dt` elements that the calling method
            // holds until this returns; `recv` is writable and, out of place, does not share
            // memory with `send` (`pair`, `common_dtype`), and `run` refuses any overlap besides
            // the in-place forms.
            unsafe { c.run(&call) }
        })
    }

    /// Run the in-place `kind` call on `buf` through the erased entry.
    fn coll_in_place(
        &self,
        py: Python<'_>,
        kind: CollKind,
        dt: Dtype,
        op: ReduceOp,
        root: usize,
        buf: Mem,
    ) -> PyResult<()> {
        self.run(py, move |c| {
            let call = c.call_in_place(kind, dt, op, root, buf.raw())?;
            // SAFETY: see `Mem`: `buf` comes from a writable view of `dt` elements that the
            // calling method holds until this returns; the call's buffers are `buf` and a block
            // of it, NCCL's in-place form.
            unsafe { c.run(&call) }
        })
    }

    /// Run point-to-point operations on buffers of views the calling method holds; returns each
    /// operation's peer (the sender, for a receive from [`ANY_SOURCE`]).
    fn p2p(&self, py: Python<'_>, mut ops: Vec<P2pOp>) -> PyResult<Vec<usize>> {
        let posts = &mut ops;
        self.run(py, move |c| {
            // SAFETY: see `Mem`: each buffer comes from a view of its dtype that the calling method
            // holds until this returns, a receive's from a writable one.
            unsafe { c.run_p2p(posts) }
        })?;
        Ok(ops.iter().map(|o| o.peer).collect())
    }

    /// Check that `v` lives where this communicator's buffers must (host memory on a host
    /// backend, this device's memory on a device backend), and set the space it is passed in.
    fn place(&self, v: &mut View, what: &str) -> PyResult<()> {
        match (v.loc, &self.ctx) {
            (Loc::Host, None) => Ok(()),
            (Loc::Cuda(_), None) => Err(PyTypeError::new_err(format!(
                "{what} is CUDA device memory, but this communicator runs the {} backend on host memory: move it to the host \
(tensor.cpu()), or make a device communicator (comm.to_device(), or lockstep.init_from_env() with LOCKSTEP_BACKEND=nccl)",
                self.backend
            ))),
            // An empty buffer has no memory to speak of (numpy's zero-length arrays are host).
            (Loc::Host, Some(ctx)) if v.len == 0 => {
                v.space = MemSpace::Device(ctx.ordinal());
                Ok(())
            }
            (Loc::Host, Some(ctx)) => Err(PyTypeError::new_err(format!(
                "{what} is host memory, but this communicator runs the {} backend on CUDA device {}: pass device memory \
(tensor.cuda({})), or use a host communicator for host buffers",
                self.backend,
                ctx.ordinal(),
                ctx.ordinal()
            ))),
            (Loc::Cuda(dev), Some(ctx)) => {
                let dev = dev.unwrap_or(ctx.ordinal());
                if dev != ctx.ordinal() {
                    return Err(PyValueError::new_err(format!(
                        "{what} is on CUDA device {dev}, but this rank's communicator runs on device {}: move it there \
(tensor.to('cuda:{}'))",
                        ctx.ordinal(),
                        ctx.ordinal()
                    )));
                }
                v.space = MemSpace::Device(dev);
                Ok(())
            }
        }
    }

    /// Refuse a call locally: tell the peers, return `err` for the caller to raise.
    fn refuse(&self, kind: CollKind, dtype: Dtype, err: PyErr) -> PyErr {
        let detail = Python::attach(|py| err.value(py).to_string());
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = g.as_mut() {
            let reason = CommError::InvalidArgument {
                op: kind,
                rank: self.rank,
                detail,
            };
            c.reject_call(kind, dtype, &reason);
        }
        err
    }

    /// Export `obj` for `kind`, refusing the call (peers included) when that fails.
    fn view(&self, kind: CollKind, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
        let mut v = View::new(obj, what).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        self.place(&mut v, what)
            .map_err(|e| self.refuse(kind, v.dtype, e))?;
        Ok(v)
    }

    /// Export `obj` for writing.
    fn view_mut(
        &self,
        kind: CollKind,
        obj: &Bound<'_, PyAny>,
        what: &str,
    ) -> PyResult<(View, Mem)> {
        let v = self.view(kind, obj, what)?;
        let m = v.mem_mut(what).map_err(|e| self.refuse(kind, v.dtype, e))?;
        Ok((v, m))
    }

    /// Send and recv views of an out-of-place call: same dtype, no shared byte.
    fn pair(
        &self,
        kind: CollKind,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
    ) -> PyResult<(View, View, Mem)> {
        let s = self.view(kind, send, "send")?;
        let (r, rm) = self.view_mut(kind, recv, "recv")?;
        if s.dtype != r.dtype {
            return Err(self.refuse(
                kind,
                s.dtype,
                PyTypeError::new_err(format!(
                    "send holds {} but recv holds {}; they must have the same element type",
                    s.dtype, r.dtype
                )),
            ));
        }
        if s.overlaps(&r) {
            return Err(self.refuse(
                kind,
                s.dtype,
                PyValueError::new_err(format!(
                    "send and recv share memory; pass separate buffers, or use the in-place form ({kind} with recv=None)"
                )),
            ));
        }
        Ok((s, r, rm))
    }

    /// Optional view for an argument only some ranks use (None: empty).
    fn optional(
        &self,
        kind: CollKind,
        obj: Option<&Bound<'_, PyAny>>,
        what: &str,
        write: bool,
    ) -> PyResult<(Option<View>, Mem)> {
        match obj {
            None => Ok((None, Mem::empty(self.space()))),
            Some(o) if write => self.view_mut(kind, o, what).map(|(v, m)| (Some(v), m)),
            Some(o) => self.view(kind, o, what).map(|v| {
                let m = v.mem();
                (Some(v), m)
            }),
        }
    }

    /// The dtype of a call whose buffers are all optional on this rank: the first one present
    /// (both present: they must agree).
    fn common_dtype(&self, kind: CollKind, a: &Option<View>, b: &Option<View>) -> PyResult<Dtype> {
        match (a, b) {
            (Some(x), Some(y)) if x.dtype != y.dtype => Err(self.refuse(
                kind,
                x.dtype,
                PyTypeError::new_err(format!(
                    "send holds {} but recv holds {}; they must have the same element type",
                    x.dtype, y.dtype
                )),
            )),
            (Some(x), Some(y)) if x.overlaps(y) => Err(self.refuse(
                kind,
                x.dtype,
                PyValueError::new_err("send and recv share memory; pass separate buffers"),
            )),
            (Some(x), _) | (None, Some(x)) => Ok(x.dtype),
            (None, None) => Err(self.refuse(
                kind,
                Dtype::U8,
                PyValueError::new_err(format!(
                    "{kind} needs at least one of send and recv on this rank (rank {})",
                    self.rank
                )),
            )),
        }
    }
}

impl PyComm {
    /// In-place all-reduce with the op already parsed (shared by the Python method and
    /// [`TorchAllReduce`]).
    fn all_reduce_in_place_op(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        op: ReduceOp,
    ) -> PyResult<()> {
        let (v, m) = self.view_mut(CollKind::AllReduce, buf, "buf")?;
        let dt = v.dtype;
        self.coll_in_place(py, CollKind::AllReduce, dt, op, 0, m)
    }

    /// In-place all-reduce of a view of a torch CPU tensor, made by the caller
    /// ([`View::torch_cpu`]); a refusal here is reported to the peers.
    fn all_reduce_view(&self, py: Python<'_>, mut v: View, op: ReduceOp) -> PyResult<()> {
        let kind = CollKind::AllReduce;
        self.place(&mut v, "buf")
            .map_err(|e| self.refuse(kind, v.dtype, e))?;
        let m = v
            .mem_mut("buf")
            .map_err(|e| self.refuse(kind, v.dtype, e))?;
        let dt = v.dtype;
        self.coll_in_place(py, kind, dt, op, 0, m)
    }
}

/// `ProcessGroupLockstep.allreduce` (lockstep/torch.py), the call DDP and every
/// `dist.all_reduce` make, in Rust: set as an attribute of each process group, it takes torch's
/// `(tensors, opts)` and reduces each tensor in place. Written here rather than in Python because
/// at 8 bytes the Python method's own frame and attribute reads cost as much as the collective;
/// what remains is torch's wrapper.
#[pyclass(frozen, module = "lockstep._native")]
pub struct TorchAllReduce {
    comm: Py<PyComm>,
    /// `ReduceOp.SUM`, compared with `opts.reduceOp` where `op_hashes` is empty (torch's reduce
    /// ops are new objects on every read, so not comparable by identity).
    sum: Py<PyAny>,
    /// The ops lockstep has by the hash of torch's `ReduceOp` holding them, when the caller
    /// found that hash to be the op's own (the same for every object of one op, different
    /// between ops): one hash, cheaper than an equality test, names the op. Empty otherwise.
    op_hashes: Vec<(isize, ReduceOp)>,
    /// Python's `_op(reduce_op) -> str` for the other ops (and its error for unsupported ones).
    op_name: Py<PyAny>,
    /// Python's `_done(result) -> Work`, for callers that want a Work.
    done: Py<PyAny>,
    /// Python's `allreduce` for tensors that are not dense CPU tensors (CUDA: the group's
    /// device communicator; sparse CPU tensors), called as `device(tensors, opts)`.
    device: Py<PyAny>,
    /// The Work a blocking call returns: None for a ProcessGroup (torch's blocking wrappers take
    /// None); a completed Work for a c10d Backend, whose Flight Recorder hook (where attached)
    /// retires a call's entry only when a Work comes back.
    completed: Py<PyAny>,
    /// Called (no arguments) before a failure is raised: the c10d Backend dumps torch's Flight
    /// Recorder there. Nothing on the success path.
    on_error: Py<PyAny>,
}

impl TorchAllReduce {
    /// The reduction and whether the caller wants a Work, from torch's `opts` (sum and a Work
    /// without them). An op lockstep lacks fails here, and the peers are told, so they fail too.
    fn options(
        &self,
        py: Python<'_>,
        comm: &PyComm,
        opts: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(ReduceOp, bool)> {
        let Some(o) = opts else {
            return Ok((ReduceOp::Sum, true));
        };
        let rop = o.getattr(pyo3::intern!(py, "reduceOp"))?;
        let known = if self.op_hashes.is_empty() {
            rop.eq(self.sum.bind(py))?.then_some(ReduceOp::Sum)
        } else {
            let h = rop.hash()?;
            self.op_hashes
                .iter()
                .find(|(k, _)| *k == h)
                .map(|&(_, op)| op)
        };
        let op = match known {
            Some(op) => op,
            None => {
                let name = self
                    .op_name
                    .bind(py)
                    .call1((rop,))
                    .and_then(|n| n.extract::<String>());
                name.and_then(|n| parse_op(&n))
                    .map_err(|e| comm.refuse(CollKind::AllReduce, Dtype::U8, e))?
            }
        };
        let asynchronous = o.getattr(pyo3::intern!(py, "asyncOp"))?;
        Ok((op, !asynchronous.is(&*pyo3::types::PyBool::new(py, false))))
    }

    /// What a call that ran returns: a completed Work, or `completed` for a blocking caller; on
    /// failure, `on_error()` first.
    fn finish<'py>(
        &self,
        py: Python<'py>,
        ran: PyResult<()>,
        want_work: bool,
        tensors: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Err(e) = ran {
            if !self.on_error.is_none(py) {
                // The hook's own failure must not hide the collective's.
                let _ = self.on_error.bind(py).call0();
            }
            return Err(e);
        }
        if want_work {
            self.done.bind(py).call1((tensors,))
        } else {
            Ok(self.completed.bind(py).clone())
        }
    }
}

#[pymethods]
impl TorchAllReduce {
    // Python's constructor takes what torch's call needs, one argument each (keywords in Python).
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (comm, sum, op_name, done, device, completed=None, on_error=None, op_hashes=None))]
    fn new(
        py: Python<'_>,
        comm: Py<PyComm>,
        sum: Py<PyAny>,
        op_name: Py<PyAny>,
        done: Py<PyAny>,
        device: Py<PyAny>,
        completed: Option<Py<PyAny>>,
        on_error: Option<Py<PyAny>>,
        op_hashes: Option<Vec<(isize, String)>>,
    ) -> PyResult<TorchAllReduce> {
        let op_hashes = op_hashes
            .unwrap_or_default()
            .into_iter()
            .map(|(h, name)| parse_op(&name).map(|op| (h, op)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(TorchAllReduce {
            comm,
            sum,
            op_hashes,
            op_name,
            done,
            device,
            completed: completed.unwrap_or_else(|| py.None()),
            on_error: on_error.unwrap_or_else(|| py.None()),
        })
    }

    /// All-reduce each tensor of `tensors` in place with `opts.reduceOp` (sum without opts).
    /// Returns a completed Work, or `completed` when `opts.asyncOp` is False (None for a
    /// ProcessGroup: torch's blocking wrappers accept it).
    #[pyo3(signature = (tensors, opts=None))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        tensors: Bound<'py, PyAny>,
        opts: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let comm = self.comm.get();
        // One tensor (every dist.all_reduce, DDP's buckets): the fewest reads of torch's
        // objects. A tensor that is not a dense CPU one (CUDA, sparse) goes to `device`; its
        // `is_sparse` is read only when the dense view fails (a sparse tensor is not contiguous).
        if let Ok(list) = tensors.cast::<PyList>() {
            if list.len() == 1 {
                let t = list.get_item(0)?;
                if !t.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()? {
                    return self.device.bind(py).call1((tensors, opts));
                }
                if let Some(view) = View::torch_cpu(&t, "buf") {
                    let v = match view {
                        Ok(v) => v,
                        Err(_) if t.getattr(pyo3::intern!(py, "is_sparse"))?.is_truthy()? => {
                            return self.device.bind(py).call1((tensors, opts));
                        }
                        Err(e) => {
                            let e = comm.refuse(CollKind::AllReduce, Dtype::U8, e);
                            return self.finish(py, Err(e), false, &tensors);
                        }
                    };
                    let (op, want_work) = match self.options(py, comm, opts.as_ref()) {
                        Ok(o) => o,
                        Err(e) => return self.finish(py, Err(e), false, &tensors),
                    };
                    let ran = comm.all_reduce_view(py, v, op);
                    return self.finish(py, ran, want_work, &tensors);
                }
            }
        }
        // Any other list: torch passes tensors of one device per call (read without raising:
        // an exception costs more than the 8-byte collective).
        let first = match tensors.cast::<PyList>() {
            Ok(list) if list.is_empty() => None,
            Ok(list) => Some(list.get_item(0)?),
            Err(_) => tensors.get_item(0).ok(),
        };
        let on_cpu = match &first {
            Some(f) => {
                f.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()?
                    && !f.getattr(pyo3::intern!(py, "is_sparse"))?.is_truthy()?
            }
            None => true,
        };
        if !on_cpu {
            return self.device.bind(py).call1((tensors, opts));
        }
        let (op, want_work) = match self.options(py, comm, opts.as_ref()) {
            Ok(o) => o,
            Err(e) => return self.finish(py, Err(e), false, &tensors),
        };
        let ran = tensors.try_iter().and_then(|ts| {
            for t in ts {
                comm.all_reduce_in_place_op(py, &t?, op)?;
            }
            Ok(())
        });
        self.finish(py, ran, want_work, &tensors)
    }
}

/// `secs` as a duration: a finite number of seconds, at least 0 (`what` names it in the error).
pub(crate) fn seconds(secs: f64, what: &str) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(secs).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a finite number of seconds, at least 0; got {secs}"
        ))
    })
}

/// A point-to-point operation on `mem` (a view's memory the caller holds).
fn post(kind: CollKind, dtype: Dtype, peer: usize, mem: Mem) -> P2pOp {
    P2pOp {
        kind,
        peer,
        dtype,
        mem: mem.raw(),
    }
}

fn counts_to_displs(counts: &[usize]) -> Vec<usize> {
    let mut at = 0usize;
    counts
        .iter()
        .map(|&c| {
            let d = at;
            at = at.saturating_add(c);
            d
        })
        .collect()
}

#[pymethods]
impl PyComm {
    /// This rank, in `0..world_size`.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// The backend running the collectives (`"shm"`, `"nccl"`, `"staged"`, `"hier"`).
    #[getter]
    fn backend(&self) -> &str {
        &self.backend
    }

    /// The CUDA device this communicator's buffers live on (a device communicator), or None
    /// (host backends).
    #[getter]
    fn device(&self) -> Option<i32> {
        self.ctx.as_ref().map(|c| c.ordinal())
    }

    /// The CUDA stream a device communicator's calls are ordered on, as its handle (an int:
    /// `torch.cuda.current_stream().cuda_stream`, CuPy's `Stream.ptr`; 0 is the default stream),
    /// or None, the default. With a stream, each call waits on the device for the work enqueued
    /// on that stream so far, and work enqueued there afterwards waits for the call: the call
    /// returns once enqueued and nothing synchronises the device, as NCCL's calls on a stream.
    /// The stream must belong to this communicator's device and stay alive while it is set.
    /// With None, each call synchronises the device before it starts and returns once complete.
    /// Host communicators take None only.
    #[getter]
    fn stream(&self) -> Option<usize> {
        *self.stream.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[setter]
    fn set_stream(&self, stream: Option<usize>) -> PyResult<()> {
        if stream.is_some() && self.ctx.is_none() {
            return Err(PyValueError::new_err(format!(
                "this communicator runs the {} backend on host memory, which has no CUDA stream to order: leave stream as None (set it on a device communicator, comm.to_device())",
                self.backend
            )));
        }
        *self.stream.lock().unwrap_or_else(|p| p.into_inner()) = stream;
        Ok(())
    }

    /// A device communicator made from this (host) communicator, for CUDA tensors (and any
    /// `__cuda_array_interface__` or DLPack CUDA buffer): NCCL when every rank of the node has its
    /// own GPU, otherwise staged through this communicator's shared memory. A collective: every
    /// rank calls it. The rank uses device `local_rank % device count` (`local_rank` defaults to
    /// `$LOCAL_RANK`, else this rank). CUDA is initialised here, in the rank. This communicator
    /// is taken over (closed here; the new one owns or uses it).
    #[pyo3(signature = (local_rank=None))]
    fn to_device(&self, py: Python<'_>, local_rank: Option<usize>) -> PyResult<PyComm> {
        let local_rank = match local_rank {
            Some(r) => r,
            None => match std::env::var("LOCAL_RANK") {
                Ok(v) if !v.is_empty() => v.trim().parse().map_err(|_| {
                    PyValueError::new_err(format!(
                        "LOCAL_RANK={v:?} is not a rank number; pass local_rank explicitly"
                    ))
                })?,
                _ => self.rank,
            },
        };
        if let Some(ctx) = &self.ctx {
            return Err(PyValueError::new_err(format!(
                "this communicator already runs the {} backend on CUDA device {}",
                self.backend,
                ctx.ordinal()
            )));
        }
        let host = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        let host = host.ok_or_else(|| {
            comm_err(CommError::Unsupported(format!(
                "rank {}: this communicator was closed; make a new one",
                self.rank
            )))
        })?;
        let (c, _ctx) = py
            .detach(|| lockstep::rendezvous::device_communicator(host, local_rank))
            .map_err(comm_err)?;
        Ok(PyComm::new(c))
    }

    /// `nbytes` of zeroed memory inside this communicator's shared segment, which the peers can
    /// read directly: a collective whose buffers are such memory on every rank skips the staging
    /// copies (zero-copy; for a 64 MiB all-reduce about half the memory traffic of ordinary
    /// buffers, and two synchronisations instead of two per MiB). Returns a
    /// [`SharedMemory`] that numpy views with `numpy.asarray(mem)` (uint8; `.view(dtype)` for
    /// another type) and torch with `torch.from_numpy(...)`; `lockstep.torch.empty_shared` does
    /// both. The memory returns to this rank's shared heap when the last view of it is gone.
    /// Host (shared-memory) communicators only.
    fn alloc_shared(&self, py: Python<'_>, nbytes: usize) -> PyResult<SharedMemory> {
        if self.ctx.is_some() {
            return Err(PyTypeError::new_err(format!(
                "alloc_shared: this communicator runs the {} backend on CUDA device memory; shared host memory comes from \
host (shared-memory) communicators",
                self.backend
            )));
        }
        let buf = py
            .detach(|| {
                let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                match g.as_mut() {
                    Some(c) => c.alloc_shared::<u8>(nbytes),
                    None => Err(CommError::Unsupported(format!(
                        "rank {}: this communicator was closed; make a new one",
                        self.rank
                    ))),
                }
            })
            .map_err(comm_err)?;
        Ok(SharedMemory { buf })
    }

    /// Number of collectives issued so far on this rank.
    #[getter]
    fn seq(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |c| c.seq())
    }

    /// The flight recorder's records, oldest first: the last calls of this communicator
    /// (`LOCKSTEP_TRACE_BUFFER`, default 2000; none when 0), each a dict with the keys of the
    /// trace files: id, seq (collectives from 1; 0 for point-to-point), op, dtype, reduce, count,
    /// root (or peer), buffer, path, start_ns, end_ns (None while running), state ("ok",
    /// "error", "running"), and error (its message) or ops (a point-to-point group's size).
    /// Readable while a call runs on another thread, and after `close()`.
    fn trace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        // Through the reader, not the communicator: a call running on another thread (with the
        // GIL released) holds the communicator's lock until its peers arrive.
        let recs = self
            .recorder
            .as_ref()
            .map_or_else(Vec::new, |r| r.records());
        let lines: Vec<String> = recs.iter().map(|r| r.to_json()).collect();
        py.import("json")?
            .call_method1("loads", (format!("[{}]", lines.join(",")),))
    }

    /// Write this rank's records into the directory `dir` now (made when missing; one JSON-lines
    /// file, replaced atomically; `lockstep trace DIR` reads a directory of them) and return the
    /// file's path. Local: the other ranks write nothing unless asked too.
    fn dump_trace(&self, dir: std::path::PathBuf) -> PyResult<String> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let c = g.as_ref().ok_or_else(|| {
            comm_err(CommError::Unsupported(format!(
                "rank {}: this communicator was closed; make a new one",
                self.rank
            )))
        })?;
        c.dump_trace(&dir)
            .map(|p| p.display().to_string())
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))
    }

    fn __repr__(&self) -> String {
        format!(
            "<lockstep.Communicator rank {} of {} ({})>",
            self.rank, self.world, self.backend
        )
    }

    /// Element-wise reduction of every rank's `send` into `recv` (same length); `recv=None`
    /// reduces in place into `send`. `op`: "sum", "prod", "min", "max", "avg".
    #[pyo3(signature = (send, recv=None, op="sum"))]
    fn all_reduce<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        op: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = CollKind::AllReduce;
        let op = parse_op(op).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        let Some(recv) = recv.filter(|r| !r.is(&send)) else {
            return self.all_reduce_in_place(py, send, op.name());
        };
        let (s, _r, rm) = self.pair(kind, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, CollKind::AllReduce, dt, op, 0, sm, rm)?;
        Ok(recv)
    }

    /// In-place all-reduce: `buf` is both input and result.
    #[pyo3(signature = (buf, op="sum"))]
    fn all_reduce_in_place<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
        op: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let op = parse_op(op).map_err(|e| self.refuse(CollKind::AllReduce, Dtype::U8, e))?;
        self.all_reduce_in_place_op(py, &buf, op)?;
        Ok(buf)
    }

    /// Copy `send` of rank `root` into `recv` of every rank (`send` is read on the root only, and
    /// must have recv's length everywhere); `recv=None` broadcasts in place into `send`.
    #[pyo3(signature = (send, recv=None, root=0))]
    fn broadcast<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        root: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(recv) = recv.filter(|r| !r.is(&send)) else {
            return self.broadcast_in_place(py, send, root);
        };
        let (s, _r, rm) = self.pair(CollKind::Broadcast, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, CollKind::Broadcast, dt, ReduceOp::Sum, root, sm, rm)?;
        Ok(recv)
    }

    /// In-place broadcast: `buf` of rank `root` is copied into `buf` of every rank.
    #[pyo3(signature = (buf, root=0))]
    fn broadcast_in_place<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
        root: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (v, m) = self.view_mut(CollKind::Broadcast, &buf, "buf")?;
        let dt = v.dtype;
        self.coll_in_place(py, CollKind::Broadcast, dt, ReduceOp::Sum, root, m)?;
        Ok(buf)
    }

    /// Reduce every rank's `send` into `recv` on `root` (`recv` is not used elsewhere and may be
    /// None there); `recv=None` on the root reduces in place into `send`. Returns the result
    /// buffer on the root, None elsewhere.
    #[pyo3(signature = (send, recv=None, op="sum", root=0))]
    fn reduce<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        op: &str,
        root: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let kind = CollKind::Reduce;
        let op = parse_op(op).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        let Some(recv) = recv.filter(|r| !r.is(&send)) else {
            return self.reduce_in_place(py, send, op.name(), root);
        };
        let (s, _r, rm) = self.pair(kind, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, kind, dt, op, root, sm, rm)?;
        Ok((self.rank == root).then_some(recv))
    }

    /// In-place reduce: on `root`, `buf` receives the result; elsewhere it is left unchanged.
    #[pyo3(signature = (buf, op="sum", root=0))]
    fn reduce_in_place<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
        op: &str,
        root: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let kind = CollKind::Reduce;
        let op = parse_op(op).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        let (v, m) = self.view_mut(kind, &buf, "buf")?;
        let dt = v.dtype;
        self.coll_in_place(py, kind, dt, op, root, m)?;
        Ok((self.rank == root).then_some(buf))
    }

    /// Concatenate every rank's `send` in rank order into every rank's `recv`
    /// (`len(recv) == len(send) * world_size`); `recv=None` gathers in place: `send` is then the
    /// whole result buffer, with this rank's block already at `[rank*c:(rank+1)*c]`.
    #[pyo3(signature = (send, recv=None))]
    fn all_gather<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(recv) = recv else {
            return self.all_gather_in_place(py, send);
        };
        let (s, _r, rm) = self.pair(CollKind::AllGather, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, CollKind::AllGather, dt, ReduceOp::Sum, 0, sm, rm)?;
        Ok(recv)
    }

    /// In-place all-gather: this rank's contribution is already at `buf[rank*c:(rank+1)*c]`
    /// with `c = len(buf) // world_size`.
    fn all_gather_in_place<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (v, m) = self.view_mut(CollKind::AllGather, &buf, "buf")?;
        let dt = v.dtype;
        self.coll_in_place(py, CollKind::AllGather, dt, ReduceOp::Sum, 0, m)?;
        Ok(buf)
    }

    /// Concatenate every rank's `send` into `recv` on `root` (`len(send) * world_size`
    /// elements; `recv` may be None off the root). Returns `recv` on the root, None elsewhere.
    #[pyo3(signature = (send, recv=None, root=0))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        root: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let kind = CollKind::Gather;
        let s = self.view(kind, &send, "send")?;
        let sm = s.mem();
        let (r, rm) = self.optional(kind, recv.as_ref(), "recv", true)?;
        let s = Some(s);
        let dt = self.common_dtype(kind, &s, &r)?;
        self.coll(py, kind, dt, ReduceOp::Sum, root, sm, rm)?;
        Ok(recv.filter(|_| self.rank == root))
    }

    /// Reduce every rank's `send` (`len(recv) * world_size` elements) and leave block `rank` of
    /// the result in `recv`; `recv=None` works in place: the block lands at
    /// `send[rank*c:(rank+1)*c]`, `c = len(send) // world_size`.
    #[pyo3(signature = (send, recv=None, op="sum"))]
    fn reduce_scatter<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        op: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = CollKind::ReduceScatter;
        let Some(recv) = recv else {
            return self.reduce_scatter_in_place(py, send, op);
        };
        let op = parse_op(op).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        let (s, _r, rm) = self.pair(kind, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, kind, dt, op, 0, sm, rm)?;
        Ok(recv)
    }

    /// In-place reduce-scatter: the result block lands at `buf[rank*c:(rank+1)*c]`.
    #[pyo3(signature = (buf, op="sum"))]
    fn reduce_scatter_in_place<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
        op: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = CollKind::ReduceScatter;
        let op = parse_op(op).map_err(|e| self.refuse(kind, Dtype::U8, e))?;
        let (v, m) = self.view_mut(kind, &buf, "buf")?;
        let dt = v.dtype;
        self.coll_in_place(py, kind, dt, op, 0, m)?;
        Ok(buf)
    }

    /// Personalised exchange with equal blocks: block `j` of `send` goes to rank `j`, block `i`
    /// of `recv` comes from rank `i` (`len(send) == len(recv)`, a multiple of the world size).
    fn all_to_all<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (s, _r, rm) = self.pair(CollKind::AllToAll, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll(py, CollKind::AllToAll, dt, ReduceOp::Sum, 0, sm, rm)?;
        Ok(recv)
    }

    /// Personalised exchange with per-peer counts (`MPI_Alltoallv`): `send_counts[j]` elements
    /// from `send_displs[j]` go to rank `j`, rank `i`'s block lands at `recv_displs[i]`
    /// (`recv_counts[i]` elements). Displacements default to the packed prefix sums of the counts.
    #[pyo3(signature = (send, send_counts, recv, recv_counts, send_displs=None, recv_displs=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        send_counts: Vec<usize>,
        recv: Bound<'py, PyAny>,
        recv_counts: Vec<usize>,
        send_displs: Option<Vec<usize>>,
        recv_displs: Option<Vec<usize>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (s, _r, rm) = self.pair(CollKind::AllToAllV, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        let sd = send_displs.unwrap_or_else(|| counts_to_displs(&send_counts));
        let rd = recv_displs.unwrap_or_else(|| counts_to_displs(&recv_counts));
        let splits = Splits {
            send_counts: &send_counts,
            send_displs: &sd,
            recv_counts: &recv_counts,
            recv_displs: &rd,
        };
        self.coll_v(
            py,
            CollKind::AllToAllV,
            dt,
            ReduceOp::Sum,
            0,
            sm,
            rm,
            splits,
        )?;
        Ok(recv)
    }

    /// Hand block `j` of the root's `send` (`world_size * len(recv)` elements) to rank `j`'s
    /// `recv`; `send` is not read off the root and may be None there.
    #[pyo3(signature = (send, recv, root=0))]
    fn scatter<'py>(
        &self,
        py: Python<'py>,
        send: Option<Bound<'py, PyAny>>,
        recv: Bound<'py, PyAny>,
        root: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = CollKind::Scatter;
        let (s, sm) = self.optional(kind, send.as_ref(), "send", false)?;
        let (r, rm) = self.view_mut(kind, &recv, "recv")?;
        let dt = self.common_dtype(kind, &s, &Some(r))?;
        self.coll(py, kind, dt, ReduceOp::Sum, root, sm, rm)?;
        Ok(recv)
    }

    /// Concatenate every rank's `send` (of per-rank lengths `recv_counts`, the same list on every
    /// rank) in rank order into every rank's `recv` (`sum(recv_counts)` elements).
    fn all_gather_v<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Bound<'py, PyAny>,
        recv_counts: Vec<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (s, _r, rm) = self.pair(CollKind::AllGatherV, &send, &recv)?;
        let (dt, sm) = (s.dtype, s.mem());
        self.coll_v(
            py,
            CollKind::AllGatherV,
            dt,
            ReduceOp::Sum,
            0,
            sm,
            rm,
            Splits {
                recv_counts: &recv_counts,
                ..Splits::default()
            },
        )?;
        Ok(recv)
    }

    /// Concatenate every rank's `send` (of per-rank lengths) into `recv` on `root`, where
    /// `recv_counts[i]` is rank `i`'s length; `recv` and `recv_counts` may be None off the root.
    #[pyo3(signature = (send, recv=None, recv_counts=None, root=0))]
    fn gather_v<'py>(
        &self,
        py: Python<'py>,
        send: Bound<'py, PyAny>,
        recv: Option<Bound<'py, PyAny>>,
        recv_counts: Option<Vec<usize>>,
        root: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let kind = CollKind::GatherV;
        let s = self.view(kind, &send, "send")?;
        let sm = s.mem();
        let (r, rm) = self.optional(kind, recv.as_ref(), "recv", true)?;
        let s = Some(s);
        let dt = self.common_dtype(kind, &s, &r)?;
        let counts = recv_counts.unwrap_or_default();
        self.coll_v(
            py,
            kind,
            dt,
            ReduceOp::Sum,
            root,
            sm,
            rm,
            Splits {
                recv_counts: &counts,
                ..Splits::default()
            },
        )?;
        Ok(recv.filter(|_| self.rank == root))
    }

    /// Send `buf` to rank `peer` (blocking until `peer` has posted the matching `recv`). Two ranks
    /// that send to each other first need `group`.
    fn send(&self, py: Python<'_>, buf: Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        let v = self.view(CollKind::Send, &buf, "buf")?;
        self.p2p(py, vec![post(CollKind::Send, v.dtype, peer, v.mem())])?;
        Ok(())
    }

    /// Receive into `buf` the next message rank `peer` sends to this rank (same count and dtype).
    fn recv<'py>(
        &self,
        py: Python<'py>,
        buf: Bound<'py, PyAny>,
        peer: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (v, m) = self.view_mut(CollKind::Recv, &buf, "buf")?;
        self.p2p(py, vec![post(CollKind::Recv, v.dtype, peer, m)])?;
        Ok(buf)
    }

    /// Receive into `buf` the first message any other rank sends to this rank (same count and
    /// dtype), and return that rank. Messages from one rank arrive in the order sent; a rank that
    /// is gone stops being waited for, and once no other rank is left (or at the timeout) it
    /// raises, naming them.
    fn recv_any(&self, py: Python<'_>, buf: Bound<'_, PyAny>) -> PyResult<usize> {
        let (v, m) = self.view_mut(CollKind::Recv, &buf, "buf")?;
        let peers = self.p2p(py, vec![post(CollKind::Recv, v.dtype, ANY_SOURCE, m)])?;
        Ok(peers[0])
    }

    /// Post several sends and receives together so that none waits on another (a ring exchange,
    /// all pairs): `ops` is a list of `("send", buf, peer)` and `("recv", buf, peer)` tuples; a
    /// recv whose peer is None takes the first message from any other rank (see `recv_any`).
    /// Returns each op's peer, with the sender for those receives.
    fn group(
        &self,
        py: Python<'_>,
        ops: Vec<(String, Bound<'_, PyAny>, Option<usize>)>,
    ) -> PyResult<Vec<usize>> {
        let mut views = Vec::with_capacity(ops.len());
        let mut posts: Vec<(bool, Dtype, Option<usize>, Mem)> = Vec::with_capacity(ops.len());
        for (i, (what, obj, peer)) in ops.iter().enumerate() {
            let send = match (what.as_str(), peer) {
                ("send", Some(_)) => true,
                ("recv", _) => false,
                (other, _) => {
                    return Err(self.refuse(
                        CollKind::Send,
                        Dtype::U8,
                        PyValueError::new_err(format!("group: ops[{i}] is ({other:?}, buffer, {peer:?}); each op is (\"send\", buffer, peer) or (\"recv\", buffer, peer or None for any source)")),
                    ))
                }
            };
            let kind = if send { CollKind::Send } else { CollKind::Recv };
            let name = format!("ops[{i}] buffer");
            let v = self.view(kind, obj, &name)?;
            let m = if send {
                v.mem()
            } else {
                v.mem_mut(&name)
                    .map_err(|e| self.refuse(kind, v.dtype, e))?
            };
            posts.push((send, v.dtype, *peer, m));
            views.push(v);
        }
        let posts = posts
            .into_iter()
            .map(|(send, dt, peer, m)| {
                let kind = if send { CollKind::Send } else { CollKind::Recv };
                post(kind, dt, peer.unwrap_or(ANY_SOURCE), m)
            })
            .collect();
        let peers = self.p2p(py, posts)?;
        drop(views);
        Ok(peers)
    }

    /// Wait until every rank has reached this call. `timeout` (seconds): the longest this rank
    /// waits in this call instead of the communicator's [`timeout`](Self::timeout); when it runs
    /// out the call fails with a `CommError` of kind "timeout" whose `missing` lists the ranks
    /// that had not arrived, and the peers' calls fail too (the communicator is aborted).
    #[pyo3(signature = (timeout=None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let Some(t) = timeout else {
            return self.run(py, |c| c.barrier());
        };
        let t = seconds(t, "barrier: timeout")?;
        self.run(py, |c| {
            let Some(before) = c.timeout() else {
                return Err(CommError::Unsupported(format!(
                    "barrier(timeout=...): the {} backend has no timeout of its own to change",
                    c.backend_kind()
                )));
            };
            c.set_timeout(t)?;
            let r = c.barrier();
            // Restoring what set_timeout accepted a moment ago cannot fail.
            let _ = c.set_timeout(before);
            r
        })
    }

    /// The longest a call waits for its peers before it fails with a `CommError` of kind
    /// "timeout", in seconds (`LOCKSTEP_TIMEOUT_S`, default 600, unless set here); None for a
    /// backend without a timeout of its own (NCCL reads LOCKSTEP_TIMEOUT_S when it is made).
    /// Settable on host (shared-memory) and staged communicators; a local setting, not a
    /// collective.
    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|c| c.timeout())
            .map(|d| d.as_secs_f64())
    }

    #[setter]
    fn set_timeout(&self, value: f64) -> PyResult<()> {
        let t = seconds(value, "timeout")?;
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let c = g.as_mut().ok_or_else(|| {
            comm_err(CommError::Unsupported(format!(
                "rank {}: this communicator was closed; make a new one",
                self.rank
            )))
        })?;
        c.set_timeout(t).map_err(comm_err)
    }

    /// Whether this rank's reductions check their input for NaN and infinities
    /// (`LOCKSTEP_CHECK_FINITE=1`, unless set here). With the check on, an all-reduce, reduce or
    /// reduce-scatter whose input holds one raises a `CommError` of kind "non_finite" on every
    /// rank, naming the rank, the element and the call ("rank 1 contributed NaN at element 17
    /// of all_reduce #41 (f32, 262144 elements)"), and the communicator goes on. Settable
    /// between calls, for the stretch of a run worth checking; a local setting, but every rank
    /// must set it alike before the same call (ranks that differ raise kind "mismatch").
    /// Shared-memory and staged communicators; others raise kind "unsupported" when it is
    /// turned on.
    #[getter]
    fn check_finite(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|c| c.check_finite())
    }

    #[setter]
    fn set_check_finite(&self, on: bool) -> PyResult<()> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let c = g.as_mut().ok_or_else(|| {
            comm_err(CommError::Unsupported(format!(
                "rank {}: this communicator was closed; make a new one",
                self.rank
            )))
        })?;
        c.set_check_finite(on).map_err(comm_err)
    }

    /// After a failure (a `CommError` of kind "peer_lost", "aborted" or "timeout"), the
    /// communicator of the ranks that remain, as `ncclCommShrink`: every surviving rank calls it
    /// and gets a new `Communicator` of the survivors, ranked 0.. in their order here. The
    /// members are agreed through the shared segment: ranks in `exclude`, ranks whose process
    /// is gone, and ranks still running that do not call it within `wait` seconds (default 1)
    /// are left out; one left out gets a `CommError` of kind "excluded" from its next call.
    /// Afterwards this communicator's calls raise (kind "shrunk"). Shared-memory communicators,
    /// and device communicators of one node (NCCL, staged); others raise kind "unsupported".
    #[pyo3(signature = (exclude=None, wait=None))]
    fn shrink(
        &self,
        py: Python<'_>,
        exclude: Option<Vec<usize>>,
        wait: Option<f64>,
    ) -> PyResult<PyComm> {
        let exclude = exclude.unwrap_or_default();
        let wait = match wait {
            Some(w) => seconds(w, "shrink: wait")?,
            None => Communicator::SHRINK_WAIT,
        };
        let new = py.detach(|| {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            match g.as_mut() {
                Some(c) => c.shrink_excluding(&exclude, wait),
                None => Err(CommError::Unsupported(format!(
                    "rank {}: this communicator was closed; make a new one",
                    self.rank
                ))),
            }
        });
        new.map(PyComm::new).map_err(comm_err)
    }

    /// After a peer was lost and `lockstep launch --restart-policy rank` started its
    /// replacement, the communicator of the whole world again, every rank with its number from
    /// before, as `ncclCommGrow`: every survivor calls it (it shrinks first), and the
    /// replacement joins through its normal entry (`lockstep.comm()`, `init_from_env()`).
    /// `wait`: seconds to wait for the replacement (default `LOCKSTEP_JOIN_TIMEOUT_S`, 60);
    /// one that does not come raises naming its rank. Afterwards this communicator's calls
    /// raise (kind "shrunk"). Shared-memory communicators, and device communicators of one node
    /// (NCCL, staged); others raise "unsupported".
    #[pyo3(signature = (wait=None))]
    fn grow(&self, py: Python<'_>, wait: Option<f64>) -> PyResult<PyComm> {
        let wait = wait.map(|w| seconds(w, "grow: wait")).transpose()?;
        let new = py.detach(|| {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            match (g.as_mut(), wait) {
                (Some(c), Some(w)) => c.grow_within(w),
                (Some(c), None) => c.grow(),
                (None, _) => Err(CommError::Unsupported(format!(
                    "rank {}: this communicator was closed; make a new one",
                    self.rank
                ))),
            }
        });
        new.map(PyComm::new).map_err(comm_err)
    }

    /// Leave the communicator (peers still waiting on this rank get an error instead of a
    /// hang). Later calls raise. Also done when the object is garbage-collected.
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(self.inner.lock().unwrap_or_else(|p| p.into_inner()).take()));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> bool {
        self.close(py);
        false
    }
}

/// Memory in a communicator's shared segment (`Communicator.alloc_shared`): exposes
/// `__array_interface__` (uint8, writable), so `numpy.asarray(mem)` views it and keeps this object
/// (and so the memory) alive as the array's base.
#[pyclass(frozen, module = "lockstep")]
pub struct SharedMemory {
    buf: SharedBuffer<u8>,
}

impl SharedMemory {
    /// The address, taken without forming a Rust reference to bytes numpy may be writing.
    fn addr(&self) -> usize {
        lockstep::Buffer::<u8>::raw(&self.buf).addr
    }

    /// The size in bytes (same remark).
    fn size(&self) -> usize {
        lockstep::Buffer::<u8>::raw(&self.buf).len
    }
}

#[pymethods]
impl SharedMemory {
    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.size()
    }

    /// numpy's array interface (version 3): a one-dimensional uint8 array over the memory.
    #[getter]
    fn __array_interface__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("shape", (self.size(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.addr(), false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.size()
    }

    fn __repr__(&self) -> String {
        format!(
            "<lockstep.SharedMemory {} bytes at {:#x}>",
            self.size(),
            self.addr()
        )
    }
}
