//! Staging between typed memory and the owned byte buffers MPI messages travel in: a
//! [`Request`](super::Request) owns its bytes (so a timed-out message can be leaked, never freed
//! under MPI), hence every message is copied in and out of the caller's memory once.
//!
//! The copies take host memory that a [`Communicator`](crate::comm::Communicator) checked
//! (`RawMem` of a call: host memory, `len` elements, alive for the call), as the backends'
//! `run` does. Bounds are checked here again: a range outside the buffer is an error, never a
//! write past it.

use crate::types::{Element, MemSpace, RawMem};

/// `v`'s bytes, in place (native order, as every rank of a job runs the same architecture).
pub(crate) fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain numeric type (`Element` is sealed to them) without padding, so all
    // of `v`'s `size_of_val(v)` bytes are initialised; u8 needs no alignment, and the view
    // borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `v`'s bytes, copied into a buffer a message can own.
pub(crate) fn to_bytes<T: Element>(v: &[T]) -> Vec<u8> {
    bytes_of(v).to_vec()
}

/// The elements whose bytes are `b`, in place when `b` is aligned for `T` and whole elements
/// (a received buffer usually is: the allocator aligns large blocks), else copied.
pub(crate) fn elems<T: Element>(b: &[u8]) -> std::borrow::Cow<'_, [T]> {
    let sz = std::mem::size_of::<T>();
    if b.len().is_multiple_of(sz) && (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        // SAFETY: `b` is aligned for `T` and holds `b.len() / sz` whole elements (both checked
        // above); every bit pattern is a valid plain numeric element; the view borrows `b`.
        let v = unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / sz) };
        return std::borrow::Cow::Borrowed(v);
    }
    std::borrow::Cow::Owned(from_bytes(b))
}

/// `b` as elements of `T`, in place, when it is aligned for `T` and whole elements.
pub(crate) fn elems_mut<T: Element>(b: &mut [u8]) -> Option<&mut [T]> {
    let sz = std::mem::size_of::<T>();
    if !b.len().is_multiple_of(sz)
        || !(b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return None;
    }
    // SAFETY: as in `elems`; the view borrows `b` mutably, and every element written through it
    // leaves valid bytes.
    Some(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / sz) })
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
    let mut out = Vec::new();
    read_mem_into(mem, elem, at, len, &mut out)?;
    Ok(out)
}

/// [`read_mem`] into `out` (replacing its contents; its allocation is reused when large enough).
pub(crate) fn read_mem_into(
    mem: RawMem,
    elem: usize,
    at: usize,
    len: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let (addr, bytes) = range(mem, elem, at, len)?;
    out.clear();
    if bytes > 0 {
        // SAFETY: `mem` is host memory of at least `mem.len` elements that the communicator
        // checked and that lives for the call; the range lies within it (checked above), and
        // does not overlap `out`, which this module's callers own.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, bytes) };
        out.extend_from_slice(src);
    }
    Ok(())
}

/// `f` on host memory `mem` as its `mem.len` elements of `T`, to compute a result in place;
/// `None` (and `f` not called) unless `mem` is host memory aligned for `T`.
pub(crate) fn with_host_elems_mut<T: Element, R>(
    mem: RawMem,
    f: impl FnOnce(&mut [T]) -> R,
) -> Option<R> {
    if mem.space != MemSpace::Host
        || !mem.addr.is_multiple_of(std::mem::align_of::<T>())
        || (mem.addr == 0 && mem.len > 0)
    {
        return None;
    }
    if mem.len == 0 {
        return Some(f(&mut []));
    }
    // SAFETY: as in `write_mem`: `mem` is a receive buffer of at least `mem.len` elements that
    // the caller lends mutably for the call and the communicator checked; it is aligned for `T`
    // (checked above), every bit pattern is a valid numeric element, and the view lives only
    // for `f`, during which the caller holds no other view of it.
    let v = unsafe { std::slice::from_raw_parts_mut(mem.addr as *mut T, mem.len) };
    Some(f(v))
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
