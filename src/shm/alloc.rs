//! Buffers inside the shared segment (`Communicator::alloc_shared`).
//!
//! Each rank owns a private heap region of the segment and allocates from it without talking to
//! its peers; peers learn a buffer's offset from the call descriptor of each collective, so a
//! collective whose buffers are all shared reads and writes them directly, skipping the staging
//! copies (the analog of NCCL's registered buffers).

use std::sync::{Arc, Mutex};

use super::segment::Segment;
use crate::comm::{CommError, SharedRegion};

/// First-fit allocator over one rank's heap region, with coalescing of freed ranges.
#[derive(Debug)]
pub(crate) struct Heap {
    /// Free ranges `(offset, len)` in segment offsets, sorted by offset.
    free: Vec<(usize, usize)>,
    start: usize,
    len: usize,
    /// Set once the communicator failed: freed memory is never reused (a peer may still write it).
    quarantined: bool,
}

impl Heap {
    pub(crate) fn new(start: usize, len: usize) -> Heap {
        Heap {
            free: vec![(start, len)],
            start,
            len,
            quarantined: false,
        }
    }

    pub(crate) fn quarantine(&mut self) {
        self.quarantined = true;
    }

    fn alloc(&mut self, bytes: usize, align: usize) -> Option<usize> {
        if bytes > self.len {
            return None;
        }
        let bytes = bytes.max(1).next_multiple_of(64);
        for i in 0..self.free.len() {
            let (off, len) = self.free[i];
            let aligned = off.next_multiple_of(align);
            let pad = aligned - off;
            if pad.checked_add(bytes).is_some_and(|need| len >= need) {
                // Split the range into [pad][allocation][rest].
                let rest = (aligned + bytes, len - pad - bytes);
                self.free.remove(i);
                let mut at = i;
                if pad > 0 {
                    self.free.insert(at, (off, pad));
                    at += 1;
                }
                if rest.1 > 0 {
                    self.free.insert(at, rest);
                }
                return Some(aligned);
            }
        }
        None
    }

    fn release(&mut self, off: usize, bytes: usize) {
        if self.quarantined {
            return;
        }
        let bytes = bytes.max(1).next_multiple_of(64);
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, bytes));
        // Coalesce with the next and the previous range.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    fn free_bytes(&self) -> usize {
        self.free.iter().map(|r| r.1).sum()
    }
}

/// An untyped allocation in a rank's shared heap; returned to the heap on drop.
#[derive(Debug)]
pub(crate) struct SharedAlloc {
    seg: Arc<Segment>,
    heap: Arc<Mutex<Heap>>,
    off: usize,
    bytes: usize,
}

impl SharedAlloc {
    pub(crate) fn new(
        seg: Arc<Segment>,
        heap: Arc<Mutex<Heap>>,
        bytes: usize,
    ) -> Result<SharedAlloc, CommError> {
        let align = if bytes >= 64 << 10 { 4096 } else { 64 };
        let off = {
            let mut h = heap.lock().unwrap_or_else(|e| e.into_inner());
            h.alloc(bytes, align).ok_or_else(|| {
                CommError::Unsupported(format!(
                    "alloc_shared: {bytes} bytes do not fit in this rank's shared heap ({} of {} bytes free); set LOCKSTEP_SHM_HEAP_BYTES higher before the communicator is created",
                    h.free_bytes(),
                    h.len
                ))
            })?
        };
        debug_assert!(off >= heap.lock().map(|h| h.start).unwrap_or(0));
        // The heap is sized generously and only reserved piece by piece: back this buffer now, so
        // a full /dev/shm is this error rather than a SIGBUS when the zeroing below touches it.
        if let Err(e) = seg.reserve(off, bytes) {
            heap.lock()
                .unwrap_or_else(|p| p.into_inner())
                .release(off, bytes);
            return Err(CommError::Unsupported(format!(
                "alloc_shared: {e}. Free other shared buffers or allocate less; make room there or set LOCKSTEP_SHM_DIR to a larger tmpfs (LOCKSTEP_SHM_HEAP_BYTES only bounds the address space, lowering it does not help)"
            )));
        }
        // SAFETY: [off, off+bytes) lies in this rank's heap region of the live mapping and was just
        // handed out exclusively to this allocation. Zeroing gives deterministic initial contents.
        unsafe { std::ptr::write_bytes(seg.base().add(off), 0, bytes) };
        Ok(SharedAlloc {
            seg,
            heap,
            off,
            bytes,
        })
    }
}

// SAFETY: the address is fixed for the allocation's life (the mapping outlives it through the
// `Arc<Segment>`), covers `bytes` bytes of this rank's heap region handed out exclusively to it,
// is aligned to at least 64, and was zeroed in `new`.
unsafe impl SharedRegion for SharedAlloc {
    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: off is inside the mapping (checked at allocation).
        unsafe { self.seg.base().add(self.off) }
    }

    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for SharedAlloc {
    fn drop(&mut self) {
        let mut h = self.heap.lock().unwrap_or_else(|e| e.into_inner());
        h.release(self.off, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::Heap;

    #[test]
    fn heap_first_fit_and_coalesce() {
        let mut h = Heap::new(4096, 1 << 20);
        let a = h.alloc(100, 64).unwrap();
        let b = h.alloc(70000, 4096).unwrap();
        let c = h.alloc(64, 64).unwrap();
        assert!(a < b && b.is_multiple_of(4096));
        assert!(c != a && c != b);
        h.release(b, 70000);
        h.release(a, 100);
        h.release(c, 64);
        assert_eq!(h.free, vec![(4096, 1 << 20)]);
        assert!(h.alloc(2 << 20, 64).is_none());
    }
}
