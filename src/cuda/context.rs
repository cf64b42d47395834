//! Safe owners: [`Context`] (a device's primary context), [`Stream`] and [`Event`].
//!
//! Errors in `Drop` are recorded on the context (as cudarc's `record_err` does) and returned by
//! the next fallible call on it, never panicked.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::driver::{self, CUcontext, CUdevice, CUevent, CUstream};
use super::error::CudaError;
use super::init::ensure_init;

/// Number of visible devices (initialises CUDA through the guard). `CUDA_VISIBLE_DEVICES` is
/// applied by the driver itself.
pub fn device_count() -> Result<i32, CudaError> {
    ensure_init()?;
    driver::device_get_count()
}

/// The device ordinal for a local rank: `local_rank % device_count`. When ranks outnumber GPUs,
/// logs a notice (several ranks then share a GPU; see `nccl` docs for the limits).
pub fn device_for_local_rank(local_rank: usize) -> Result<i32, CudaError> {
    let n = device_count()?;
    if n <= 0 {
        return Err(CudaError::InvalidArgument {
            op: "device_for_local_rank".into(),
            detail: "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)".into(),
        });
    }
    let ord = (local_rank % n as usize) as i32;
    if local_rank >= n as usize {
        tracing::info!("local rank {local_rank} shares GPU {ord} ({n} visible): NCCL before 2.30 needs one GPU per rank, so device collectives stage through host memory");
    }
    Ok(ord)
}

/// Static facts about a device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Total memory in bytes.
    pub total_mem: usize,
}

/// Key of a loaded module in its context: the source's name and content hash.
pub(crate) type ModuleKey = (&'static str, u64);

/// The primary context of one device, shared by everything allocated on it.
pub struct Context {
    ordinal: i32,
    dev: CUdevice,
    raw: CUcontext,
    /// Loaded modules (`module.rs` owns the cache logic; stored type-erased so this file does not
    /// depend on it). Dropped before the context is released.
    modules: Mutex<HashMap<ModuleKey, Arc<dyn Any + Send + Sync>>>,
    deferred: Mutex<Vec<(String, CudaError)>>,
    /// The live streams made by [`stream`](Self::stream) (raw handles), so that a consumer can
    /// order itself after every producer (see [`Producers`]). A stream leaves the list, under
    /// this lock, before it is destroyed.
    streams: Mutex<Vec<usize>>,
}

// SAFETY: a primary context may be bound and used from any thread; the mutable state is behind
// mutexes.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl Context {
    /// Retain the primary context of device `ordinal` and bind it to this thread. Initialises
    /// CUDA through the single-init guard.
    pub fn new(ordinal: i32) -> Result<Arc<Context>, CudaError> {
        let n = device_count()?;
        if ordinal < 0 || ordinal >= n {
            return Err(CudaError::InvalidArgument {
                op: "Context::new".into(),
                detail: format!(
                    "device ordinal {ordinal} out of range: {n} device(s) visible (CUDA_VISIBLE_DEVICES={:?})",
                    std::env::var("CUDA_VISIBLE_DEVICES").ok()
                ),
            });
        }
        let dev = driver::device_get(ordinal)?;
        let raw = driver::primary_ctx_retain(dev)?;
        let ctx = Arc::new(Context {
            ordinal,
            dev,
            raw,
            modules: Mutex::new(HashMap::new()),
            deferred: Mutex::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
        });
        ctx.bind()?;
        Ok(ctx)
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub(crate) fn raw(&self) -> CUcontext {
        self.raw
    }

    /// Make this context current on the calling thread (cheap; done before every driver call).
    pub fn bind(&self) -> Result<(), CudaError> {
        driver::ctx_set_current(self.raw)
    }

    /// Record a failure from a `Drop`; reported by the next [`check`](Self::check).
    pub(crate) fn record_err(&self, what: String, e: CudaError) {
        self.deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((what, e));
    }

    /// Destroy a handle of this context from a `Drop`: bind the context, run `destroy`, and on
    /// failure [`record_err`](Self::record_err) it against `what` (built only then) instead of
    /// panicking, so the next [`check`](Self::check) reports it.
    pub(crate) fn release(
        &self,
        what: impl FnOnce() -> String,
        destroy: impl FnOnce() -> Result<(), CudaError>,
    ) {
        if let Err(e) = self.bind().and_then(|_| destroy()) {
            self.record_err(what(), e);
        }
    }

    /// Report (once) the first failure recorded while dropping objects of this context.
    pub fn check(&self) -> Result<(), CudaError> {
        let mut d = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
        if d.is_empty() {
            return Ok(());
        }
        let (what, e) = d.remove(0);
        Err(CudaError::Deferred {
            what,
            source: Box::new(e),
        })
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        Ok((
            driver::device_get_attribute(self.dev, driver::ATTR_CC_MAJOR)?,
            driver::device_get_attribute(self.dev, driver::ATTR_CC_MINOR)?,
        ))
    }

    /// Name, arch, SM count and memory of the device.
    pub fn info(&self) -> Result<DeviceInfo, CudaError> {
        Ok(DeviceInfo {
            ordinal: self.ordinal,
            name: driver::device_get_name(self.dev)?,
            compute_capability: self.compute_capability()?,
            sm_count: driver::device_get_attribute(self.dev, driver::ATTR_SM_COUNT)?,
            total_mem: driver::device_total_mem(self.dev)?,
        })
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        driver::mem_get_info()
    }

    /// Wait for all work on the device.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.check()?;
        self.bind()?;
        driver::ctx_synchronize()
    }

    /// Wait for the work queued so far on `stream`, a CUDA stream of this context that lockstep did
    /// not create (a `cudaStream_t` handed over by a C caller or a framework), given as its handle.
    ///
    /// # Safety
    /// `stream` is 0 (the legacy default stream) or a stream of this context that stays alive for
    /// the call: CUDA's behaviour on a destroyed or foreign handle is undefined.
    pub unsafe fn synchronize_foreign_stream(&self, stream: usize) -> Result<(), CudaError> {
        self.check()?;
        self.bind()?;
        driver::stream_synchronize(stream as driver::CUstream)
    }

    /// A new non-blocking stream.
    pub fn stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        self.check()?;
        self.bind()?;
        let raw = driver::stream_create(driver::STREAM_NON_BLOCKING)?;
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(raw as usize);
        Ok(Stream {
            ctx: self.clone(),
            raw,
        })
    }

    /// A new event without timing (cheaper to record and wait on), for ordering and completion.
    pub fn sync_event(self: &Arc<Self>) -> Result<Event, CudaError> {
        self.check()?;
        self.bind()?;
        let raw = driver::event_create(driver::EVENT_DISABLE_TIMING)?;
        Ok(Event {
            ctx: self.clone(),
            raw,
        })
    }

    /// A new event (timing enabled).
    pub fn event(self: &Arc<Self>) -> Result<Event, CudaError> {
        self.check()?;
        self.bind()?;
        let raw = driver::event_create(0)?;
        Ok(Event {
            ctx: self.clone(),
            raw,
        })
    }

    /// The loaded-module cache, locked (see `Context::module` in `module.rs`).
    pub(crate) fn module_cache(
        &self,
    ) -> MutexGuard<'_, HashMap<ModuleKey, Arc<dyn Any + Send + Sync>>> {
        self.modules.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Modules go first (they hold Arcs to us, so by now the map only holds our own entries;
        // it is empty unless a cycle exists).
        self.modules.get_mut().map(|m| m.clear()).ok();
        if let Err(e) = driver::primary_ctx_release(self.dev) {
            // Nobody is left to report to: the context is gone. Say it once on stderr.
            tracing::error!(
                "releasing the CUDA context of device {} failed: {e}",
                self.ordinal
            );
        }
    }
}

/// A CUDA stream (non-blocking with respect to the legacy default stream).
pub struct Stream {
    ctx: Arc<Context>,
    raw: CUstream,
}

// SAFETY: a stream may be used from any thread once its context is bound there (every method
// binds it first).
unsafe impl Send for Stream {}
// SAFETY: stream handles are thread-safe in the driver API.
unsafe impl Sync for Stream {}

impl Stream {
    /// The owning context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> CUstream {
        self.raw
    }

    /// Wait for all work enqueued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.check()?;
        self.ctx.bind()?;
        driver::stream_synchronize(self.raw)
    }

    /// True when all enqueued work has completed (errors of that work are reported here).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.ctx.bind()?;
        driver::stream_query(self.raw)
    }

    /// Make later work on this stream wait for `e`.
    pub fn wait_event(&self, e: &Event) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::stream_wait_event(self.raw, e.raw)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Leave the context's list first, and destroy under its lock, so that `Producers` never
        // records on a destroyed stream.
        let mut streams = self.ctx.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.retain(|s| *s != self.raw as usize);
        // SAFETY: we own the stream; nothing uses it after drop. cuStreamDestroy lets pending
        // work finish.
        let r = self
            .ctx
            .bind()
            .and_then(|_| unsafe { driver::stream_destroy(self.raw) });
        drop(streams);
        if let Err(e) = r {
            self.ctx.record_err("a stream".into(), e);
        }
    }
}

/// Orders a consumer stream after the work already enqueued on every other stream of its context:
/// what a collective does before it reads buffers that another stream may still be writing, so
/// that callers need not synchronise first. One reusable event per producer stream (an event may
/// be recorded again as soon as a wait on it has been enqueued).
pub struct Producers {
    ctx: Arc<Context>,
    events: HashMap<usize, Event>,
}

impl Producers {
    /// Fences for consumers on `ctx`'s streams.
    pub fn new(ctx: &Arc<Context>) -> Producers {
        Producers {
            ctx: ctx.clone(),
            events: HashMap::new(),
        }
    }

    /// Make later work on `consumer` wait for everything enqueued so far on the context's other
    /// streams (one event record and one stream wait per producer stream; nothing blocks).
    pub fn order(&mut self, consumer: &Stream) -> Result<(), CudaError> {
        self.ctx.bind()?;
        let streams = self.ctx.streams.lock().unwrap_or_else(|p| p.into_inner());
        self.events.retain(|s, _| streams.contains(s));
        for &s in streams.iter().filter(|s| **s != consumer.raw as usize) {
            let ev = match self.events.entry(s) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let raw = driver::event_create(driver::EVENT_DISABLE_TIMING)?;
                    v.insert(Event {
                        ctx: self.ctx.clone(),
                        raw,
                    })
                }
            };
            // The stream is live: it is in the list, whose lock its `Drop` needs.
            driver::event_record(ev.raw, s as CUstream)?;
            driver::stream_wait_event(consumer.raw, ev.raw)?;
        }
        Ok(())
    }
}

/// A CUDA stream lockstep did not create (a framework's current stream, a C caller's
/// `cudaStream_t`), borrowed by its handle, so that lockstep's own streams can be ordered with it
/// through events, never by blocking the host.
pub struct ForeignStream {
    ctx: Arc<Context>,
    raw: CUstream,
}

impl ForeignStream {
    /// Borrow the stream with handle `handle` on `ctx`'s device. 0 and the driver's special
    /// handles (1: the legacy default stream, 2: the per-thread default stream) name the default
    /// streams.
    ///
    /// # Safety
    /// `handle` is one of those, or a stream of `ctx`'s device that stays alive while this value
    /// is used: CUDA's behaviour on a destroyed or foreign handle is undefined.
    pub unsafe fn new(ctx: &Arc<Context>, handle: usize) -> ForeignStream {
        ForeignStream {
            ctx: ctx.clone(),
            raw: handle as CUstream,
        }
    }

    /// The stream's handle.
    pub fn handle(&self) -> usize {
        self.raw as usize
    }

    /// Record `e` on this stream: it happens once the work enqueued here so far has completed.
    pub fn record(&self, e: &Event) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::event_record(e.raw, self.raw)
    }

    /// Make later work on this stream wait for `e`.
    pub fn wait_event(&self, e: &Event) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::stream_wait_event(self.raw, e.raw)
    }
}

/// The two events that order a communicator's stream with a foreign one: `enter` (the
/// communicator waits for the caller's stream) and `leave` (the caller's stream waits for the
/// communicator). An event may be recorded again as soon as the wait on its last record has been
/// enqueued, so two serve every call.
pub(crate) struct StreamFence {
    enter: Event,
    leave: Event,
}

impl StreamFence {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<StreamFence, CudaError> {
        Ok(StreamFence {
            enter: ctx.sync_event()?,
            leave: ctx.sync_event()?,
        })
    }

    /// Later work on `own` waits for the work enqueued so far on `caller`.
    pub(crate) fn enter(&self, caller: &ForeignStream, own: &Stream) -> Result<(), CudaError> {
        caller.record(&self.enter)?;
        own.wait_event(&self.enter)
    }

    /// Later work on `caller` waits for the work enqueued so far on `own`.
    pub(crate) fn leave(&self, own: &Stream, caller: &ForeignStream) -> Result<(), CudaError> {
        self.leave.record(own)?;
        caller.wait_event(&self.leave)
    }
}

/// A CUDA event, for ordering and timing.
pub struct Event {
    ctx: Arc<Context>,
    raw: CUevent,
}

// SAFETY: as for `Stream`.
unsafe impl Send for Event {}

impl Event {
    /// Record the event on `s`.
    pub fn record(&self, s: &Stream) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::event_record(self.raw, s.raw)
    }

    /// Whether the work before the event's last record has completed (errors of that work are
    /// reported here).
    pub fn query(&self) -> Result<bool, CudaError> {
        self.ctx.bind()?;
        driver::event_query(self.raw)
    }

    /// Wait until the event has happened.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::event_synchronize(self.raw)
    }

    /// Milliseconds between `self` (earlier) and `end` (later); both must have completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, CudaError> {
        self.ctx.bind()?;
        end.synchronize()?;
        driver::event_elapsed_ms(self.raw, end.raw)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event; nothing uses it after drop.
        let destroy = || unsafe { driver::event_destroy(self.raw) };
        self.ctx.release(|| "an event".into(), destroy);
    }
}
