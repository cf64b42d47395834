//! Buffers a collective can read and write, wherever they live.
//!
//! A collective only needs to know *where* a buffer is (host memory, a backend's shared segment,
//! or a device) and how long it is. [`Buffer`] / [`BufferMut`] expose that as a [`Mem`] view, so
//! the same `Communicator` methods accept `Vec<T>`, slices, [`SharedBuffer`](crate::shm::SharedBuffer)s
//! and, with the CUDA backend, device buffers. Backends decide what they can handle: the shared-memory
//! backend works on host memory (and recognises its own shared segment for zero-copy), NCCL on device
//! memory.

use super::dtype::Element;

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemSpace {
    /// Ordinary host memory of this process (includes shared-segment buffers).
    Host,
    /// Device memory on the CUDA device with this ordinal.
    Device(i32),
}

/// A type-erased view of a buffer: address, length in elements and memory space.
#[derive(Clone, Copy, Debug)]
pub struct RawMem {
    /// Address of the first element (host pointer, or CUdeviceptr for device memory).
    pub addr: usize,
    /// Length in elements.
    pub len: usize,
    /// Memory space.
    pub space: MemSpace,
}

/// Read access to a buffer for a collective.
///
/// # Safety
/// `raw()` must describe memory valid for reads of `len` elements of `T` in the given space for as
/// long as the borrow of `self` lasts: backends read it directly.
pub unsafe trait Buffer<T: Element> {
    /// Address, length and memory space of the buffer.
    fn raw(&self) -> RawMem;
    /// Length in elements.
    fn len(&self) -> usize {
        self.raw().len
    }
    /// True if the buffer holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Write access to a buffer for a collective.
///
/// # Safety
/// `raw_mut()` must describe memory valid for writes of `len` elements of `T` while the `&mut`
/// borrow lasts, not aliased by anything else reachable during the call.
pub unsafe trait BufferMut<T: Element>: Buffer<T> {
    /// Address, length and memory space, for writing.
    fn raw_mut(&mut self) -> RawMem;
}

// Any contiguous host container is a buffer through `AsRef<[T]>`/`AsMut<[T]>`: `Vec<T>`, slices,
// arrays, `Box<[T]>`, and a user's own tensor type, with no `unsafe impl` on the user's side.

// SAFETY: `as_ref` returns a slice borrowed from `self`, so the memory it describes stays valid and
// unchanged for as long as the `&self` borrow that `raw` is called under lasts.
unsafe impl<T: Element, B: AsRef<[T]> + ?Sized> Buffer<T> for B {
    fn raw(&self) -> RawMem {
        let s = self.as_ref();
        RawMem {
            addr: s.as_ptr() as usize,
            len: s.len(),
            space: MemSpace::Host,
        }
    }
}

// SAFETY: `as_mut` returns a slice exclusively borrowed from `self`, valid for writes and not
// aliased for as long as the `&mut self` borrow lasts.
unsafe impl<T: Element, B: AsRef<[T]> + AsMut<[T]> + ?Sized> BufferMut<T> for B {
    fn raw_mut(&mut self) -> RawMem {
        let s = self.as_mut();
        RawMem {
            addr: s.as_mut_ptr() as usize,
            len: s.len(),
            space: MemSpace::Host,
        }
    }
}
