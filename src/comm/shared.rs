//! Buffers in memory that the peers of a communicator can read directly
//! ([`Communicator::alloc_shared`](super::Communicator::alloc_shared)).
//!
//! A backend hands out a [`SharedRegion`]; [`SharedBuffer`] types it. When every rank passes
//! such buffers to a collective, the backend may skip its staging copies (the analog of NCCL's
//! registered buffers). The trait keeps the backend's own allocation type out of this layer.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use crate::types::{Buffer, BufferMut, Element, MemSpace, RawMem};

/// An untyped allocation that peers can address, owned by a backend; freed on drop.
///
/// # Safety
/// `as_ptr()` must return the same address for the life of the value, valid for reads and writes
/// of `bytes()` bytes in this process, aligned to at least 64 bytes, zero-initialised when handed
/// out, and not used by anything else in this process while the value lives (peers touch it only
/// inside collectives that borrow the buffer).
pub unsafe trait SharedRegion: Send + Sync + fmt::Debug {
    /// Address of the allocation in this process.
    fn as_ptr(&self) -> *mut u8;
    /// Size in bytes.
    fn bytes(&self) -> usize;
}

/// A typed buffer living in memory the communicator's peers can reach. Dereferences to `[T]`;
/// pass it to collectives like a `Vec<T>`. If every rank passes shared buffers, the collective is
/// zero-copy.
#[derive(Debug)]
pub struct SharedBuffer<T: Element> {
    region: Box<dyn SharedRegion>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> SharedBuffer<T> {
    /// Type `region` as `len` elements; the caller checked `len * size_of::<T>() <= bytes()`.
    pub(crate) fn new(region: Box<dyn SharedRegion>, len: usize) -> SharedBuffer<T> {
        debug_assert!(len * std::mem::size_of::<T>() <= region.bytes());
        SharedBuffer {
            region,
            len,
            _t: PhantomData,
        }
    }
}

impl<T: Element> Deref for SharedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the region holds at least len*size_of::<T>() zero-initialised bytes, aligned to
        // at least 64 (the `SharedRegion` contract), and every Element type is valid for any bit
        // pattern (numbers only). Peers only touch it inside collectives, which borrow `self`.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr() as *const T, self.len) }
    }
}

impl<T: Element> DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; &mut self guarantees exclusive access in this process.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr() as *mut T, self.len) }
    }
}

// SAFETY: the view covers exactly the region's typed prefix, which lives as long as `self`.
unsafe impl<T: Element> Buffer<T> for SharedBuffer<T> {
    fn raw(&self) -> RawMem {
        RawMem {
            addr: self.region.as_ptr() as usize,
            len: self.len,
            space: MemSpace::Host,
        }
    }
}

// SAFETY: as for `Buffer`; `&mut self` gives exclusive access in this process.
unsafe impl<T: Element> BufferMut<T> for SharedBuffer<T> {
    fn raw_mut(&mut self) -> RawMem {
        self.raw()
    }
}
