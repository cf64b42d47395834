//! The GPU executor: one device allocation per arena, launches through the safe CUDA layer
//! (`cuda::Function::launch`, which checks every argument against the kernel's signature), and
//! one CUDA graph per step shape, captured on first use and replayed afterwards.
//!
//! No `unsafe` here: sub-tensors are passed as `DeviceView`s of the arenas
//! (`DeviceBuffer::split_views` proves the written ones disjoint), and the asynchronous loss
//! read-back goes through `HostReadback`, which owns its pinned memory.

use std::collections::HashMap;
use std::sync::Arc;

use half::{bf16, f16};

use super::error::DeviceError;
use super::exec::Exec;
use super::plan::{Arena, Arg, Op, Region};
use lockstep::comm::{Communicator, ReduceOp};
use lockstep::cuda::{Context, CudaError, DeviceBuffer, Function, Graph, HostReadback, Stream};

/// The device arenas (see `plan::Tensors` for what lives where).
struct Arenas {
    f32: DeviceBuffer<f32>,
    i32: DeviceBuffer<i32>,
    bf16: DeviceBuffer<bf16>,
    f16: DeviceBuffer<f16>,
    images: DeviceBuffer<u8>,
    labels: DeviceBuffer<u8>,
}

/// Runs plans on one GPU stream.
pub struct GpuExec {
    ctx: Arc<Context>,
    stream: Stream,
    a: Arenas,
    index_list: DeviceBuffer<i32>,
    funcs: HashMap<&'static str, Function>,
    graphs: HashMap<u64, Graph>,
    use_graphs: bool,
    sm_count: usize,
    readback: HostReadback<f32>,
    /// Host values summed over ranks go through this device buffer (NCCL needs device memory).
    scratch_f64: DeviceBuffer<f64>,
}

fn arena_index(a: Arena) -> usize {
    match a {
        Arena::F32 => 0,
        Arena::I32 => 1,
        Arena::Bf16 => 2,
        Arena::Images => 3,
        Arena::Labels => 4,
        Arena::F16 => 5,
    }
}

/// Look up (once) the entry point of every op.
fn prefetch(
    ctx: &Arc<Context>,
    funcs: &mut HashMap<&'static str, Function>,
    ops: &[Op],
) -> Result<(), CudaError> {
    for op in ops {
        if !funcs.contains_key(op.name) {
            funcs.insert(op.name, ctx.function(op.kernel.source(), op.name)?);
        }
    }
    Ok(())
}

/// Enqueue `op` on `stream`: views of the arenas in argument order, scalars as given.
fn launch(
    a: &mut Arenas,
    funcs: &HashMap<&'static str, Function>,
    op: &Op,
    stream: &Stream,
) -> Result<(), CudaError> {
    let f = funcs
        .get(op.name)
        .ok_or_else(|| CudaError::InvalidArgument {
            op: format!("launch {}", op.name),
            detail: "entry point not loaded (prefetch first)".into(),
        })?;
    let lens = [
        a.f32.len(),
        a.i32.len(),
        a.bf16.len(),
        a.images.len(),
        a.labels.len(),
        a.f16.len(),
    ];
    // Dataset arenas are indexed by sample id from the region's offset to the end.
    let span = |r: &Region| match r.arena {
        Arena::Images | Arena::Labels => r.off..lens[arena_index(r.arena)],
        _ => r.range(),
    };
    let mut reads: [Vec<std::ops::Range<usize>>; 6] = Default::default();
    let mut writes: [Vec<std::ops::Range<usize>>; 6] = Default::default();
    for arg in &op.args {
        match arg {
            Arg::In(r) => reads[arena_index(r.arena)].push(span(r)),
            Arg::Out(r) => writes[arena_index(r.arena)].push(span(r)),
            _ => {}
        }
    }
    if !writes[3].is_empty() || !writes[4].is_empty() {
        return Err(CudaError::InvalidArgument {
            op: format!("launch {}", op.name),
            detail: "the dataset arenas are read-only".into(),
        });
    }
    let (rf, mut wf) = a.f32.split_views(&reads[0], &writes[0])?;
    let (ri, mut wi) = a.i32.split_views(&reads[1], &writes[1])?;
    let (rb, mut wb) = a.bf16.split_views(&reads[2], &writes[2])?;
    let (rh, mut wh) = a.f16.split_views(&reads[5], &writes[5])?;
    let (rim, _) = a.images.split_views(&reads[3], &[])?;
    let (rlb, _) = a.labels.split_views(&reads[4], &[])?;
    let (mut rf, mut ri, mut rb, mut rh, mut rim, mut rlb) = (
        rf.iter(),
        ri.iter(),
        rb.iter(),
        rh.iter(),
        rim.iter(),
        rlb.iter(),
    );
    let (mut wf, mut wi, mut wb, mut wh) =
        (wf.iter_mut(), wi.iter_mut(), wb.iter_mut(), wh.iter_mut());
    let missing = || CudaError::InvalidArgument {
        op: format!("launch {}", op.name),
        detail: "argument views out of step with the arguments".into(),
    };
    let mut l = f.launch(op.cfg);
    for arg in &op.args {
        l = match arg {
            Arg::In(r) => match r.arena {
                Arena::F32 => l.arg(rf.next().ok_or_else(missing)?),
                Arena::I32 => l.arg(ri.next().ok_or_else(missing)?),
                Arena::Bf16 => l.arg(rb.next().ok_or_else(missing)?),
                Arena::F16 => l.arg(rh.next().ok_or_else(missing)?),
                Arena::Images => l.arg(rim.next().ok_or_else(missing)?),
                Arena::Labels => l.arg(rlb.next().ok_or_else(missing)?),
            },
            Arg::Out(r) => match r.arena {
                Arena::F32 => l.arg_mut(wf.next().ok_or_else(missing)?),
                Arena::I32 => l.arg_mut(wi.next().ok_or_else(missing)?),
                Arena::Bf16 => l.arg_mut(wb.next().ok_or_else(missing)?),
                Arena::F16 => l.arg_mut(wh.next().ok_or_else(missing)?),
                Arena::Images | Arena::Labels => return Err(missing()),
            },
            Arg::I32(x) => l.scalar(*x),
            Arg::F32(x) => l.scalar(*x),
            Arg::I64(x) => l.scalar(*x),
        };
    }
    l.run(stream)
}

impl GpuExec {
    /// Arenas of `arena_len` = (f32, i32, bf16, f16) elements on `ctx`; `use_graphs` captures each
    /// step shape once and replays it (off: plain launches, for debugging).
    pub fn new(
        ctx: &Arc<Context>,
        arena_len: (usize, usize, usize, usize),
        use_graphs: bool,
    ) -> Result<GpuExec, CudaError> {
        let stream = ctx.stream()?;
        let a = Arenas {
            f32: DeviceBuffer::zeros(&stream, arena_len.0)?,
            i32: DeviceBuffer::zeros(&stream, arena_len.1)?,
            bf16: DeviceBuffer::zeros(&stream, arena_len.2)?,
            f16: DeviceBuffer::zeros(&stream, arena_len.3)?,
            images: DeviceBuffer::zeros(&stream, 0)?,
            labels: DeviceBuffer::zeros(&stream, 0)?,
        };
        let sm_count = ctx.info()?.sm_count.max(1) as usize;
        Ok(GpuExec {
            ctx: ctx.clone(),
            index_list: DeviceBuffer::zeros(&stream, 0)?,
            funcs: HashMap::new(),
            graphs: HashMap::new(),
            use_graphs,
            sm_count,
            readback: HostReadback::new(ctx, 1)?,
            scratch_f64: DeviceBuffer::zeros(&stream, 2)?,
            a,
            stream,
        })
    }

    /// Replace the f32, i32 and bf16 arenas' contents (lengths must match; tests fill them with
    /// random values). The f16 arena has [`GpuExec::load_f16`].
    pub fn load_arenas(&mut self, f: &[f32], i: &[i32], b: &[bf16]) -> Result<(), CudaError> {
        self.a.f32.copy_from_host(&self.stream, f)?;
        self.a.i32.copy_from_host(&self.stream, i)?;
        self.a.bf16.copy_from_host(&self.stream, b)
    }

    /// Copies of the f32, i32 and bf16 arenas (waits for queued work).
    #[allow(clippy::type_complexity)]
    pub fn dump_arenas(&self) -> Result<(Vec<f32>, Vec<i32>, Vec<bf16>), CudaError> {
        Ok((
            self.a.f32.to_vec(&self.stream)?,
            self.a.i32.to_vec(&self.stream)?,
            self.a.bf16.to_vec(&self.stream)?,
        ))
    }

    /// Replace the f16 arena's contents (length must match).
    pub fn load_f16(&mut self, h: &[f16]) -> Result<(), CudaError> {
        self.a.f16.copy_from_host(&self.stream, h)
    }

    /// A copy of the f16 arena (waits for queued work).
    pub fn dump_f16(&self) -> Result<Vec<f16>, CudaError> {
        self.a.f16.to_vec(&self.stream)
    }

    /// The stream everything runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Number of captured graphs (one per distinct step shape).
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    fn tmp_from(&self, r: Region) -> Result<DeviceBuffer<f32>, CudaError> {
        let mut t = DeviceBuffer::<f32>::alloc(&self.ctx, r.len)?;
        t.copy_region_async(&self.stream, 0, &self.a.f32, r.off, r.len)?;
        Ok(t)
    }
}

impl Exec for GpuExec {
    fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn upload_dataset(&mut self, images: &[u8], labels: &[u8]) -> Result<(), DeviceError> {
        self.a.images = DeviceBuffer::from_host(&self.stream, images)?;
        self.a.labels = DeviceBuffer::from_host(&self.stream, labels)?;
        // Graphs hold the old dataset addresses.
        self.graphs.clear();
        Ok(())
    }

    fn write_f32(&mut self, r: Region, data: &[f32]) -> Result<(), DeviceError> {
        let t = DeviceBuffer::from_host(&self.stream, data)?;
        self.a
            .f32
            .copy_region_async(&self.stream, r.off, &t, 0, r.len)?;
        // `t` is freed at the end of this scope; cuMemFree waits for the copy.
        self.stream.synchronize()?;
        Ok(())
    }

    fn read_f32(&mut self, r: Region) -> Result<Vec<f32>, DeviceError> {
        Ok(self.tmp_from(r)?.to_vec(&self.stream)?)
    }

    fn read_i32(&mut self, r: Region) -> Result<Vec<i32>, DeviceError> {
        let mut t = DeviceBuffer::<i32>::alloc(&self.ctx, r.len)?;
        t.copy_region_async(&self.stream, 0, &self.a.i32, r.off, r.len)?;
        Ok(t.to_vec(&self.stream)?)
    }

    fn load_index_list(&mut self, idx: &[i32]) -> Result<(), DeviceError> {
        if self.index_list.len() == idx.len() {
            self.index_list.copy_from_host(&self.stream, idx)?;
        } else {
            self.index_list = DeviceBuffer::from_host(&self.stream, idx)?;
        }
        Ok(())
    }

    fn select_indices(&mut self, dst: Region, start: usize) -> Result<(), DeviceError> {
        self.a
            .i32
            .copy_region_async(&self.stream, dst.off, &self.index_list, start, dst.len)?;
        Ok(())
    }

    fn run(&mut self, op: &Op) -> Result<(), DeviceError> {
        prefetch(&self.ctx, &mut self.funcs, std::slice::from_ref(op))?;
        launch(&mut self.a, &self.funcs, op, &self.stream)?;
        Ok(())
    }

    fn run_step(&mut self, key: u64, ops: &[Op]) -> Result<(), DeviceError> {
        // Modules load (NVRTC, cuModuleLoadData) before any capture: neither is capturable.
        prefetch(&self.ctx, &mut self.funcs, ops)?;
        if !self.use_graphs {
            for op in ops {
                launch(&mut self.a, &self.funcs, op, &self.stream)?;
            }
            return Ok(());
        }
        if !self.graphs.contains_key(&key) {
            let (a, funcs) = (&mut self.a, &self.funcs);
            let g = Graph::capture(&self.stream, |s| {
                ops.iter().try_for_each(|op| launch(a, funcs, op, s))
            })?;
            self.graphs.insert(key, g);
        }
        self.graphs[&key].replay(&self.stream)?;
        Ok(())
    }

    fn all_reduce_mean(&mut self, comm: &mut Communicator, r: Region) -> Result<(), DeviceError> {
        // The collective runs on the communicator's stream: the gradients must be complete first.
        self.stream.synchronize()?;
        let (_, mut w) = self.a.f32.split_views(&[], &[r.range()])?;
        comm.all_reduce_in_place(&mut w[0], ReduceOp::Avg)?;
        comm.synchronize()?;
        Ok(())
    }

    fn broadcast(
        &mut self,
        comm: &mut Communicator,
        r: Region,
        root: usize,
    ) -> Result<(), DeviceError> {
        self.stream.synchronize()?;
        let (_, mut w) = self.a.f32.split_views(&[], &[r.range()])?;
        comm.broadcast_in_place(&mut w[0], root)?;
        comm.synchronize()?;
        Ok(())
    }

    fn all_reduce_sum_host(
        &mut self,
        comm: &mut Communicator,
        v: &mut [f64],
    ) -> Result<(), DeviceError> {
        if self.scratch_f64.len() != v.len() {
            self.scratch_f64 = DeviceBuffer::zeros(&self.stream, v.len())?;
        }
        self.scratch_f64.copy_from_host(&self.stream, v)?;
        comm.all_reduce_in_place(&mut self.scratch_f64, ReduceOp::Sum)?;
        comm.synchronize()?;
        self.scratch_f64.copy_to_host(&self.stream, v)?;
        Ok(())
    }

    fn start_read(&mut self, r: Region) -> Result<(), DeviceError> {
        let v = self.a.f32.view(r.range())?;
        self.readback.start(&self.stream, &v)?;
        Ok(())
    }

    fn finish_read(&mut self) -> Result<Vec<f32>, DeviceError> {
        Ok(self.readback.wait()?.to_vec())
    }
}
