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

// SAFETY: the view covers exactly the borrowed elements.
unsafe impl<T: Element> Buffer<T> for [T] {
    fn raw(&self) -> RawMem {
        RawMem { addr: self.as_ptr() as usize, len: <[T]>::len(self), space: MemSpace::Host }
    }
}

// SAFETY: the view covers exactly the mutably borrowed elements.
unsafe impl<T: Element> BufferMut<T> for [T] {
    fn raw_mut(&mut self) -> RawMem {
        RawMem { addr: self.as_mut_ptr() as usize, len: <[T]>::len(self), space: MemSpace::Host }
    }
}

// SAFETY: the view covers exactly the borrowed elements.
unsafe impl<T: Element> Buffer<T> for Vec<T> {
    fn raw(&self) -> RawMem {
        self.as_slice().raw()
    }
}

// SAFETY: the view covers exactly the mutably borrowed elements.
unsafe impl<T: Element> BufferMut<T> for Vec<T> {
    fn raw_mut(&mut self) -> RawMem {
        self.as_mut_slice().raw_mut()
    }
}

// SAFETY: the view covers exactly the borrowed elements.
unsafe impl<T: Element, const N: usize> Buffer<T> for [T; N] {
    fn raw(&self) -> RawMem {
        self.as_slice().raw()
    }
}

// SAFETY: the view covers exactly the mutably borrowed elements.
unsafe impl<T: Element, const N: usize> BufferMut<T> for [T; N] {
    fn raw_mut(&mut self) -> RawMem {
        self.as_mut_slice().raw_mut()
    }
}
