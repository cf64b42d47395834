//! Staging between typed memory and the owned byte buffers MPI messages travel in: a
//! [`Request`](super::Request) owns its bytes (so a timed-out message can be leaked, never freed
//! under MPI), hence every message is copied in and out of the caller's memory once.
//!
//! The copies take host memory that a [`Communicator`](crate::comm::Communicator) checked
//! (`RawMem` of a call: host memory, `len` elements, alive for the call), as the backends'
//! `run` does. Bounds are checked here again: a range outside the buffer is an error, never a
//! write past it.

use crate::types::{Element, MemSpace, RawMem};

/// `v`'s bytes (native order, as every rank of a job runs the same architecture).
pub(crate) fn to_bytes<T: Element>(v: &[T]) -> Vec<u8> {
    let bytes = std::mem::size_of_val(v);
    let mut out = vec![0u8; bytes];
    // SAFETY: `T` is a plain numeric type (`Element` is sealed to them), so its bytes are
    // initialised; `out` holds `bytes` bytes and does not overlap `v`.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), out.as_mut_ptr(), bytes) };
    out
}

/// The elements whose bytes are `b` (a trailing partial element is dropped).
pub(crate) fn from_bytes<T: Element>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    let mut out = vec![T::default(); n];
    // SAFETY: `out` holds `n` elements, `n * size_of::<T>() <= b.len()` bytes; every bit pattern
    // is a valid numeric element; the buffers do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            b.as_ptr(),
            out.as_mut_ptr().cast::<u8>(),
            n * std::mem::size_of::<T>(),
        )
    };
    out
}

/// The byte range of elements `at..at + len` of `mem` (elements of `elem` bytes), when it lies
/// within host memory `mem`.
fn range(mem: RawMem, elem: usize, at: usize, len: usize) -> Result<(usize, usize), String> {
    let end = at.checked_add(len);
    if mem.space != MemSpace::Host || end.is_none_or(|e| e > mem.len) {
        return Err(format!(
            "elements {at}..{at}+{len} of a {:?} buffer of {} elements (a lockstep bug: report it)",
            mem.space, mem.len
        ));
    }
    Ok((mem.addr + at * elem, len * elem))
}

/// A copy of elements `at..at + len` of host memory `mem` (elements of `elem` bytes).
pub(crate) fn read_mem(mem: RawMem, elem: usize, at: usize, len: usize) -> Result<Vec<u8>, String> {
    let (addr, bytes) = range(mem, elem, at, len)?;
    let mut out = vec![0u8; bytes];
    if bytes > 0 {
        // SAFETY: `mem` is host memory of at least `mem.len` elements that the communicator
        // checked and that lives for the call; the range lies within it (checked above); `out`
        // is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), bytes) };
    }
    Ok(out)
}

/// Write `bytes` over elements `at..` of host memory `mem` (elements of `elem` bytes).
pub(crate) fn write_mem(mem: RawMem, elem: usize, at: usize, bytes: &[u8]) -> Result<(), String> {
    let (addr, n) = range(mem, elem, at, bytes.len() / elem.max(1))?;
    if n != bytes.len() {
        return Err(format!(
            "{} bytes are not whole elements of {elem} bytes (a lockstep bug: report it)",
            bytes.len()
        ));
    }
    if n > 0 {
        // SAFETY: as in `read_mem`, for a receive buffer, which the caller lends mutably for the
        // call; `bytes` is an owned buffer that does not overlap it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, n) };
    }
    Ok(())
}
