//! Typed device memory ([`DeviceBuffer`]) and page-locked host memory ([`PinnedBuffer`]).
//!
//! Both implement `comm::Buffer`/`BufferMut`, so the same `Communicator` methods take them:
//! device buffers report `MemSpace::Device(ordinal)`, pinned buffers `MemSpace::Host`.
//! Synchronous copies enqueue on a stream and wait for it; the `_async` copies from or to host
//! memory are `unsafe` because the host buffer must outlive the copy.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::types::{Buffer, BufferMut, Element, MemSpace, RawMem};

use super::context::{Context, Stream};
use super::driver::{self, CUdeviceptr};
use super::error::CudaError;

fn bytes_of<T>(len: usize, op: &str) -> Result<usize, CudaError> {
    len.checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| CudaError::InvalidArgument {
            op: op.into(),
            detail: format!("{len} elements overflow usize bytes"),
        })
}

/// A typed allocation in device memory (freed on drop).
pub struct DeviceBuffer<T: Element> {
    ctx: Arc<Context>,
    ptr: CUdeviceptr,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: device memory is not tied to a thread; every method binds the context first.
unsafe impl<T: Element> Send for DeviceBuffer<T> {}
// SAFETY: shared references only read the handle.
unsafe impl<T: Element> Sync for DeviceBuffer<T> {}

impl<T: Element> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>(len={}, device={}, ptr={:#x})",
            T::DTYPE,
            self.len,
            self.ctx.ordinal(),
            self.ptr
        )
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// Allocate `len` elements with unspecified contents (every bit pattern is a valid `T`).
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<Self, CudaError> {
        ctx.check()?;
        ctx.bind()?;
        let bytes = bytes_of::<T>(len, "DeviceBuffer::alloc")?;
        // cuMemAlloc refuses 0 bytes; keep a valid one-byte allocation so the pointer is real.
        let ptr = driver::mem_alloc(bytes.max(1))?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// Allocate `len` zeroed elements (zeroed in `stream` order).
    pub fn zeros(stream: &Stream, len: usize) -> Result<Self, CudaError> {
        let mut b = Self::alloc(stream.context(), len)?;
        b.zero_async(stream)?;
        Ok(b)
    }

    /// Allocate and fill from host memory (waits for the copy).
    pub fn from_host(stream: &Stream, src: &[T]) -> Result<Self, CudaError> {
        let mut b = Self::alloc(stream.context(), src.len())?;
        b.copy_from_host(stream, src)?;
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal.
    pub fn device(&self) -> i32 {
        self.ctx.ordinal()
    }

    /// The raw device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    fn check_len(&self, other: usize, op: &str) -> Result<(), CudaError> {
        if other != self.len {
            return Err(CudaError::InvalidArgument {
                op: op.into(),
                detail: format!(
                    "lengths differ: device buffer has {} elements, the other side {other}",
                    self.len
                ),
            });
        }
        Ok(())
    }

    fn check_stream(&self, s: &Stream, op: &str) -> Result<(), CudaError> {
        if s.context().ordinal() != self.ctx.ordinal() {
            return Err(CudaError::InvalidArgument {
                op: op.into(),
                detail: format!(
                    "buffer is on device {}, stream on device {}",
                    self.ctx.ordinal(),
                    s.context().ordinal()
                ),
            });
        }
        self.ctx.bind()
    }

    /// Set every byte to 0, in stream order.
    pub fn zero_async(&mut self, stream: &Stream) -> Result<(), CudaError> {
        self.check_stream(stream, "DeviceBuffer::zero_async")?;
        // SAFETY: the allocation holds len*size_of::<T>() bytes and lives until its drop, which
        // frees with cuMemFree (that waits for pending work).
        unsafe {
            driver::memset_d8_async(
                self.ptr,
                0,
                self.len * std::mem::size_of::<T>(),
                stream.raw(),
            )
        }
    }

    /// Copy `src` to the device and wait.
    pub fn copy_from_host(&mut self, stream: &Stream, src: &[T]) -> Result<(), CudaError> {
        self.check_len(src.len(), "DeviceBuffer::copy_from_host")?;
        self.check_stream(stream, "DeviceBuffer::copy_from_host")?;
        // SAFETY: lengths match; `src` is borrowed until the synchronize below returns.
        unsafe {
            driver::memcpy_htod_async(
                self.ptr,
                src.as_ptr().cast(),
                std::mem::size_of_val(src),
                stream.raw(),
            )?
        };
        stream.synchronize()
    }

    /// Copy the device contents into `dst` and wait.
    pub fn copy_to_host(&self, stream: &Stream, dst: &mut [T]) -> Result<(), CudaError> {
        self.check_len(dst.len(), "DeviceBuffer::copy_to_host")?;
        self.check_stream(stream, "DeviceBuffer::copy_to_host")?;
        // SAFETY: lengths match; `dst` is borrowed mutably until the synchronize below returns.
        unsafe {
            driver::memcpy_dtoh_async(
                dst.as_mut_ptr().cast(),
                self.ptr,
                std::mem::size_of_val(dst),
                stream.raw(),
            )?
        };
        stream.synchronize()
    }

    /// Copy the device contents into a new `Vec` and wait.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>, CudaError> {
        let mut v = vec![T::default(); self.len];
        self.copy_to_host(stream, &mut v)?;
        Ok(v)
    }

    /// Device-to-device copy of `src` into `self`, in stream order (no wait).
    pub fn copy_from_device_async(
        &mut self,
        stream: &Stream,
        src: &DeviceBuffer<T>,
    ) -> Result<(), CudaError> {
        self.check_len(src.len, "DeviceBuffer::copy_from_device_async")?;
        self.check_stream(stream, "DeviceBuffer::copy_from_device_async")?;
        // SAFETY: both are live device allocations of the same length; both are freed with
        // cuMemFree, which waits for pending work.
        unsafe {
            driver::memcpy_dtod_async(
                self.ptr,
                src.ptr,
                self.len * std::mem::size_of::<T>(),
                stream.raw(),
            )
        }
    }

    /// Host-to-device copy from pinned memory, in stream order (no wait).
    ///
    /// # Safety
    /// `src` must not be dropped or written before the stream has reached the copy (synchronize
    /// the stream or an event recorded after it).
    pub unsafe fn copy_from_pinned_async(
        &mut self,
        stream: &Stream,
        src: &PinnedBuffer<T>,
    ) -> Result<(), CudaError> {
        self.check_len(src.len, "DeviceBuffer::copy_from_pinned_async")?;
        self.check_stream(stream, "DeviceBuffer::copy_from_pinned_async")?;
        driver::memcpy_htod_async(
            self.ptr,
            src.ptr.cast(),
            self.len * std::mem::size_of::<T>(),
            stream.raw(),
        )
    }

    /// Device-to-host copy into pinned memory, in stream order (no wait).
    ///
    /// # Safety
    /// `dst` must not be dropped, read or written before the stream has reached the copy.
    pub unsafe fn copy_to_pinned_async(
        &self,
        stream: &Stream,
        dst: &mut PinnedBuffer<T>,
    ) -> Result<(), CudaError> {
        self.check_len(dst.len, "DeviceBuffer::copy_to_pinned_async")?;
        self.check_stream(stream, "DeviceBuffer::copy_to_pinned_async")?;
        driver::memcpy_dtoh_async(
            dst.ptr.cast(),
            self.ptr,
            self.len * std::mem::size_of::<T>(),
            stream.raw(),
        )
    }
}

/// Untyped copies on a stream between a raw device range and host memory, for layers that handle
/// type-erased buffers (the staged backend). No wait: the caller synchronizes the stream.
impl Stream {
    /// Host-to-device copy of `bytes` bytes, in stream order.
    ///
    /// # Safety
    /// `dst` must be a live device range of at least `bytes` bytes in this stream's context, and
    /// `src` valid for reads of `bytes` bytes until the stream has reached the copy.
    pub unsafe fn memcpy_htod_raw(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), CudaError> {
        driver::memcpy_htod_async(dst as CUdeviceptr, src.cast(), bytes, self.raw())
    }

    /// Device-to-host copy of `bytes` bytes, in stream order.
    ///
    /// # Safety
    /// `src` must be a live device range of at least `bytes` bytes in this stream's context, and
    /// `dst` valid for writes of `bytes` bytes, untouched until the stream has reached the copy.
    pub unsafe fn memcpy_dtoh_raw(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        driver::memcpy_dtoh_async(dst.cast(), src as CUdeviceptr, bytes, self.raw())
    }
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: we own the allocation; cuMemFree waits for work that still uses it.
        let destroy = || unsafe { driver::mem_free(self.ptr) };
        let what = || format!("a device buffer of {} {} elements", self.len, T::DTYPE);
        self.ctx.release(what, destroy);
    }
}

// SAFETY: the view covers exactly the allocation, which lives as long as `self`.
unsafe impl<T: Element> Buffer<T> for DeviceBuffer<T> {
    fn raw(&self) -> RawMem {
        RawMem {
            addr: self.ptr as usize,
            len: self.len,
            space: MemSpace::Device(self.ctx.ordinal()),
        }
    }
}

// SAFETY: as for `Buffer`; `&mut self` gives exclusive access in this process.
unsafe impl<T: Element> BufferMut<T> for DeviceBuffer<T> {
    fn raw_mut(&mut self) -> RawMem {
        self.raw()
    }
}

/// Page-locked host memory: fast, truly asynchronous copies to and from the device.
pub struct PinnedBuffer<T: Element> {
    ctx: Arc<Context>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: the memory is plain host memory owned by this value.
unsafe impl<T: Element> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: Element> Sync for PinnedBuffer<T> {}

impl<T: Element> PinnedBuffer<T> {
    /// Allocate `len` zeroed elements of page-locked memory.
    pub fn zeros(ctx: &Arc<Context>, len: usize) -> Result<Self, CudaError> {
        ctx.check()?;
        ctx.bind()?;
        let bytes = bytes_of::<T>(len, "PinnedBuffer::zeros")?.max(1);
        let p = driver::mem_host_alloc(bytes)?;
        // SAFETY: `p` points to `bytes` writable bytes; zero is a valid value of every Element.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer {
            ctx: ctx.clone(),
            ptr: p.cast(),
            len,
        })
    }
}

impl<T: Element> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements, aligned by cuMemHostAlloc (page-aligned).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Element> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Element> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: we own the allocation.
        let destroy = || unsafe { driver::mem_free_host(self.ptr.cast()) };
        self.ctx.release(|| "a pinned host buffer".into(), destroy);
    }
}

// SAFETY: the view covers exactly the allocation, which lives as long as `self`.
unsafe impl<T: Element> Buffer<T> for PinnedBuffer<T> {
    fn raw(&self) -> RawMem {
        (**self).raw()
    }
}

// SAFETY: as for `Buffer`; `&mut self` gives exclusive access in this process.
unsafe impl<T: Element> BufferMut<T> for PinnedBuffer<T> {
    fn raw_mut(&mut self) -> RawMem {
        (**self).raw_mut()
    }
}

// ------------------------------------------------------------------------------------------------
// views: sub-ranges of one allocation as kernel arguments

/// A read-only view of `len` elements of a [`DeviceBuffer`], borrowed from it. Lets a kernel take
/// one tensor of a flat arena (parameters, activations) as its argument.
pub struct DeviceView<'a, T: Element> {
    raw: RawMem,
    _b: PhantomData<&'a DeviceBuffer<T>>,
}

/// A writable view of a sub-range of a [`DeviceBuffer`]; [`DeviceBuffer::split_views`] hands out
/// several at once only when they are disjoint from each other and from every read view.
pub struct DeviceViewMut<'a, T: Element> {
    raw: RawMem,
    _b: PhantomData<&'a mut DeviceBuffer<T>>,
}

// SAFETY: the view lies inside the allocation (checked when created) and borrows the buffer, so
// the allocation outlives it.
unsafe impl<T: Element> Buffer<T> for DeviceView<'_, T> {
    fn raw(&self) -> RawMem {
        self.raw
    }
}

// SAFETY: as for `DeviceView`.
unsafe impl<T: Element> Buffer<T> for DeviceViewMut<'_, T> {
    fn raw(&self) -> RawMem {
        self.raw
    }
}

// SAFETY: `split_views` guarantees no other live view of the same buffer overlaps a writable one,
// and the `&mut` borrow of the buffer excludes every other access for the views' lifetime.
unsafe impl<T: Element> BufferMut<T> for DeviceViewMut<'_, T> {
    fn raw_mut(&mut self) -> RawMem {
        self.raw
    }
}

impl<T: Element> DeviceBuffer<T> {
    fn range_raw(&self, r: &std::ops::Range<usize>, op: &str) -> Result<RawMem, CudaError> {
        if r.start > r.end || r.end > self.len {
            return Err(CudaError::InvalidArgument {
                op: op.into(),
                detail: format!(
                    "range {r:?} is outside the buffer of {} {} elements; fix the caller's offsets",
                    self.len,
                    T::DTYPE
                ),
            });
        }
        let addr = self.ptr as usize + r.start * std::mem::size_of::<T>();
        Ok(RawMem {
            addr,
            len: r.len(),
            space: MemSpace::Device(self.ctx.ordinal()),
        })
    }

    /// A read-only view of elements `r`.
    pub fn view(&self, r: std::ops::Range<usize>) -> Result<DeviceView<'_, T>, CudaError> {
        Ok(DeviceView {
            raw: self.range_raw(&r, "DeviceBuffer::view")?,
            _b: PhantomData,
        })
    }

    /// Read views of `reads` and writable views of `writes`, all at once. Every write range must
    /// be disjoint from every other range (empty ranges excepted); read ranges may overlap each other.
    #[allow(clippy::type_complexity)]
    pub fn split_views(
        &mut self,
        reads: &[std::ops::Range<usize>],
        writes: &[std::ops::Range<usize>],
    ) -> Result<(Vec<DeviceView<'_, T>>, Vec<DeviceViewMut<'_, T>>), CudaError> {
        let overlap = |a: &std::ops::Range<usize>, b: &std::ops::Range<usize>| {
            !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
        };
        for (i, w) in writes.iter().enumerate() {
            let clash = writes
                .iter()
                .enumerate()
                .find(|(j, o)| *j != i && overlap(w, o))
                .map(|(_, o)| o)
                .or_else(|| reads.iter().find(|r| overlap(w, r)));
            if let Some(o) = clash {
                return Err(CudaError::InvalidArgument {
                    op: "DeviceBuffer::split_views".into(),
                    detail: format!(
                        "written range {w:?} overlaps {o:?}; give the kernel separate tensors"
                    ),
                });
            }
        }
        let r = reads
            .iter()
            .map(|r| {
                Ok(DeviceView {
                    raw: self.range_raw(r, "DeviceBuffer::split_views")?,
                    _b: PhantomData,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let w = writes
            .iter()
            .map(|r| {
                Ok(DeviceViewMut {
                    raw: self.range_raw(r, "DeviceBuffer::split_views")?,
                    _b: PhantomData,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok((r, w))
    }

    /// Device-to-device copy of `len` elements from `src[src_off..]` into `self[dst_off..]`, in
    /// stream order (no wait). Graph-capturable.
    pub fn copy_region_async(
        &mut self,
        stream: &Stream,
        dst_off: usize,
        src: &DeviceBuffer<T>,
        src_off: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let d = self.range_raw(
            &(dst_off..dst_off.saturating_add(len)),
            "DeviceBuffer::copy_region_async",
        )?;
        let s = src.range_raw(
            &(src_off..src_off.saturating_add(len)),
            "DeviceBuffer::copy_region_async",
        )?;
        self.check_stream(stream, "DeviceBuffer::copy_region_async")?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges were checked to lie inside live device allocations (`self` is
        // borrowed mutably, so the destination is not aliased by another Rust view); cuMemFree
        // waits for pending work before releasing either.
        unsafe {
            driver::memcpy_dtod_async(
                d.addr as CUdeviceptr,
                s.addr as CUdeviceptr,
                len * std::mem::size_of::<T>(),
                stream.raw(),
            )
        }
    }
}

// ------------------------------------------------------------------------------------------------
// asynchronous read-back

/// Page-locked landing zone for reading a few device values back without stalling the stream:
/// [`start`](Self::start) enqueues the copy and records an event; [`wait`](Self::wait), called a
/// few steps later, finds it long finished. The host memory is owned here and only handed out once the copy
/// has finished, and `Drop` waits for an in-flight copy, so the unsafety of pinned async copies
/// stays inside this type.
pub struct HostReadback<T: Element> {
    host: PinnedBuffer<T>,
    done: super::context::Event,
    in_flight: bool,
}

impl<T: Element> HostReadback<T> {
    /// A read-back area of `len` elements on `ctx`.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self, CudaError> {
        Ok(HostReadback {
            host: PinnedBuffer::zeros(ctx, len)?,
            done: ctx.event()?,
            in_flight: false,
        })
    }

    /// Enqueue a copy of `src` (exactly `len` elements) on `stream`. Waits first if a previous
    /// copy is still in flight.
    pub fn start<B: Buffer<T> + ?Sized>(
        &mut self,
        stream: &Stream,
        src: &B,
    ) -> Result<(), CudaError> {
        if self.in_flight {
            self.done.synchronize()?;
            self.in_flight = false;
        }
        let r = src.raw();
        if r.len != self.host.len || r.space != MemSpace::Device(stream.context().ordinal()) {
            return Err(CudaError::InvalidArgument {
                op: "HostReadback::start".into(),
                detail: format!(
                    "source holds {} elements in {:?}, the read-back area {} on Device({})",
                    r.len,
                    r.space,
                    self.host.len,
                    stream.context().ordinal()
                ),
            });
        }
        stream.context().bind()?;
        // SAFETY: the destination is our own pinned allocation of the same length, not handed out
        // until the event recorded below has completed (`wait`/`ready`), and `Drop` waits for it.
        unsafe {
            driver::memcpy_dtoh_async(
                self.host.ptr.cast(),
                r.addr as CUdeviceptr,
                r.len * std::mem::size_of::<T>(),
                stream.raw(),
            )?
        };
        self.done.record(stream)?;
        self.in_flight = true;
        Ok(())
    }

    /// Whether a copy was started and has not been collected yet.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Block until the last copy has completed and return the values.
    pub fn wait(&mut self) -> Result<&[T], CudaError> {
        if self.in_flight {
            self.done.synchronize()?;
            self.in_flight = false;
        }
        Ok(&self.host)
    }
}

impl<T: Element> Drop for HostReadback<T> {
    fn drop(&mut self) {
        if self.in_flight {
            // The pinned memory must not be freed under a running copy.
            if let Err(e) = self.done.synchronize() {
                self.host
                    .ctx
                    .record_err("waiting for a read-back copy".into(), e);
            }
        }
    }
}
