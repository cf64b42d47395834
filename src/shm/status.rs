//! A read-only view of a running job's segment, for `lockstep status` (`crate::status`): what each
//! rank already publishes for its peers (its control block: pid, state, published phase, the
//! collective it is in and since when, its call descriptors; its inline entries) read from
//! another process without joining, mapping or writing anything.
//!
//! The segment is read with `pread` on a descriptor opened read-only, never mapped: a segment
//! that is truncated or rewritten while it is read (a hostile or stale file) gives short reads or
//! nonsense values, which are checked, never a SIGBUS or an out-of-bounds access. No lock is
//! taken and nothing is written, so the job neither stops nor slows (the reads share its cache
//! lines for an instant, as a waiting peer's polls do). Every offset comes from the layout of a
//! header that passed the checks of [`read_segment`] (magic, version, world size, sizes that give
//! the recorded total, a file at least that long).
//!
//! Values are read twice, a few microseconds apart: a rank whose published phase or collective
//! number changed in between is "moving" (it makes progress), and its descriptor is taken from
//! the second read only when that read is consistent (its sequence number is the collective the
//! rank is in).

use std::fs::File;
use std::mem::offset_of;
use std::os::unix::fs::FileExt;

use super::sync::{
    Abort, Ctrl, Desc, Header, InlineHdr, Layout, CTRL_BYTES, HEADER_BYTES, INLINE_HDR, INVALID,
    MAGIC, STATE_JOINED, STATE_LEFT, VERSION,
};
use crate::comm::{CollKind, Dtype, ReduceOp};

/// Why a file could not be read as a live segment. The messages name the file's place (given by
/// the caller) and what to do.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// Reading failed (the process exited, the file shrank).
    #[error("cannot read {what}: {source}")]
    Io {
        /// The file, as the caller names it.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not a lockstep segment, or one this reader cannot trust.
    #[error("{what} is not a readable lockstep segment: {why}")]
    Invalid {
        /// The file, as the caller names it.
        what: String,
        /// What failed the check.
        why: String,
    },
}

/// The call a rank published for the collective it is in: from its descriptor (phased paths) or
/// its inline entry (the inline path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallView {
    pub kind: Option<CollKind>,
    pub dtype: Option<Dtype>,
    pub op: Option<ReduceOp>,
    pub root: u64,
    pub count: u64,
    /// The rank refused the call (invalid arguments).
    pub invalid: bool,
    /// Taken from the inline entry (no phase is published for it).
    pub inline: bool,
}

/// One rank's control block, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankView {
    pub pid: i32,
    /// Joined and not left.
    pub joined: bool,
    /// Left the communicator (dropped it).
    pub left: bool,
    /// Last published phase.
    pub progress: u64,
    /// Collectives entered (the number of the current or last one).
    pub seq: u64,
    /// The kind of collective `seq`.
    pub kind: Option<CollKind>,
    /// When the rank began waiting for its peers in collective `seq` (`CLOCK_MONOTONIC_COARSE`
    /// ns; 0: it has not waited beyond its first polls in that collective).
    pub wait_ns: u64,
    /// The arguments it published for collective `seq` (`None`: none yet: it entered the call
    /// but has not arrived at its first exchange).
    pub call: Option<CallView>,
    /// Its phase or collective number changed between the two reads.
    pub moving: bool,
}

/// A segment's header and every rank's control block.
#[derive(Debug, Clone)]
pub(crate) struct SegmentView {
    pub world: usize,
    pub joined: u32,
    pub creator_pid: i32,
    /// 1 + the rank that aborted the communicator (0: none).
    pub aborted_by: u32,
    pub ranks: Vec<RankView>,
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    b.get(off..off + 8)
        .map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
        .unwrap_or(0)
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
        .unwrap_or(0)
}

fn u8_at(b: &[u8], off: usize) -> u8 {
    b.get(off).copied().unwrap_or(0)
}

/// Read a whole segment's state from `file` (opened read-only), named `what` in errors.
pub(crate) fn read_segment(file: &File, what: &str) -> Result<SegmentView, SegmentError> {
    let io = |source| SegmentError::Io {
        what: what.to_string(),
        source,
    };
    let invalid = |why: String| SegmentError::Invalid {
        what: what.to_string(),
        why,
    };
    let len = file.metadata().map_err(io)?.len();
    if len < HEADER_BYTES as u64 {
        return Err(invalid(format!(
            "{len} bytes, shorter than a header ({HEADER_BYTES})"
        )));
    }
    let mut h = vec![0u8; HEADER_BYTES];
    file.read_exact_at(&mut h, 0).map_err(io)?;
    let magic = u64_at(&h, offset_of!(Header, magic));
    if magic != MAGIC {
        return Err(invalid(
            "no lockstep magic number (not a lockstep file, or its creator has not finished it)"
                .into(),
        ));
    }
    let version = u32_at(&h, offset_of!(Header, version));
    if version != VERSION {
        return Err(invalid(format!(
            "layout v{version}, this lockstep reads v{VERSION}: use the lockstep version that runs the job"
        )));
    }
    let world = u32_at(&h, offset_of!(Header, world)) as usize;
    if world == 0 || world > 1024 {
        return Err(invalid(format!(
            "world size {world} is out of range 1..=1024"
        )));
    }
    let (slot, heap, total) = (
        u64_at(&h, offset_of!(Header, slot_bytes)),
        u64_at(&h, offset_of!(Header, heap_bytes)),
        u64_at(&h, offset_of!(Header, total_bytes)),
    );
    let layout = usize::try_from(slot)
        .ok()
        .zip(usize::try_from(heap).ok())
        .and_then(|(s, hp)| Layout::new(world, s, hp).ok())
        .filter(|l| l.total as u64 == total)
        .ok_or_else(|| {
            invalid(format!(
                "inconsistent sizes (world {world}, slots {slot}, heaps {heap}, total {total})"
            ))
        })?;
    if len < total {
        return Err(invalid(format!(
            "{len} bytes, shorter than the {total} its header records"
        )));
    }
    let ctrls = world * CTRL_BYTES;
    let mut a = vec![0u8; ctrls];
    let mut b = vec![0u8; ctrls];
    file.read_exact_at(&mut a, layout.ctrl_off(0) as u64)
        .map_err(io)?;
    file.read_exact_at(&mut b, layout.ctrl_off(0) as u64)
        .map_err(io)?;
    let mut ranks = Vec::with_capacity(world);
    for r in 0..world {
        let (first, c) = (
            &a[r * CTRL_BYTES..][..CTRL_BYTES],
            &b[r * CTRL_BYTES..][..CTRL_BYTES],
        );
        let pos = |c: &[u8]| {
            (
                u64_at(c, offset_of!(Ctrl, progress)),
                u64_at(c, offset_of!(Ctrl, coll_seq)),
            )
        };
        let (progress, seq) = pos(c);
        let kind = match u32_at(c, offset_of!(Ctrl, coll_kind)) {
            0 => None,
            k => u8::try_from(k - 1).ok().and_then(CollKind::from_u8),
        };
        let state = u32_at(c, offset_of!(Ctrl, state));
        let call = if seq == 0 {
            None
        } else {
            desc_call(c, seq).or_else(|| inline_call(file, &layout, r, seq))
        };
        ranks.push(RankView {
            pid: u32_at(c, offset_of!(Ctrl, pid)) as i32,
            joined: state == STATE_JOINED,
            left: state == STATE_LEFT,
            progress,
            seq,
            kind,
            wait_ns: if u64_at(c, offset_of!(Ctrl, wait_seq)) == seq {
                u64_at(c, offset_of!(Ctrl, wait_start))
            } else {
                0
            },
            call,
            moving: pos(first) != (progress, seq),
        });
    }
    Ok(SegmentView {
        world,
        joined: u32_at(&h, offset_of!(Header, joined)),
        creator_pid: u32_at(&h, offset_of!(Header, creator_pid)) as i32,
        aborted_by: u32_at(&h, offset_of!(Header, abort) + offset_of!(Abort, by)),
        ranks,
    })
}

/// The call in control block `c`'s descriptor cell for collective `seq`, if either cell holds it.
fn desc_call(c: &[u8], seq: u64) -> Option<CallView> {
    (0..2).find_map(|i| {
        let d = offset_of!(Ctrl, desc) + i * std::mem::size_of::<Desc>();
        (u64_at(c, d + offset_of!(Desc, seq)) == seq).then(|| CallView {
            kind: CollKind::from_u8(u8_at(c, d + offset_of!(Desc, kind))),
            dtype: Dtype::from_u8(u8_at(c, d + offset_of!(Desc, dtype))),
            op: ReduceOp::from_u8(u8_at(c, d + offset_of!(Desc, op))),
            root: u64_at(c, d + offset_of!(Desc, root)),
            count: u64_at(c, d + offset_of!(Desc, count)),
            invalid: u8_at(c, d + offset_of!(Desc, flags)) & INVALID != 0,
            inline: false,
        })
    })
}

/// The call in rank `r`'s inline entry for collective `seq`, if the entry holds it.
fn inline_call(file: &File, layout: &Layout, r: usize, seq: u64) -> Option<CallView> {
    let mut e = [0u8; INLINE_HDR];
    file.read_exact_at(&mut e, layout.inline_entry_off(r, seq) as u64)
        .ok()?;
    (u64_at(&e, offset_of!(InlineHdr, seq)) == seq).then(|| CallView {
        kind: CollKind::from_u8(u8_at(&e, offset_of!(InlineHdr, kind))),
        dtype: Dtype::from_u8(u8_at(&e, offset_of!(InlineHdr, dtype))),
        op: ReduceOp::from_u8(u8_at(&e, offset_of!(InlineHdr, op))),
        root: u64::from(u32_at(&e, offset_of!(InlineHdr, root))),
        count: u64_at(&e, offset_of!(InlineHdr, count)),
        invalid: false,
        inline: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{ShmConfig, ShmJob};
    use std::io::Write;

    fn scratch_file(bytes: &[u8]) -> File {
        let path = std::env::temp_dir().join(format!(
            "lockstep-status-unit-{}-{}",
            std::process::id(),
            bytes.len()
        ));
        let mut f = File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        let f = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    /// Garbage, a short file, a wrong version and lying sizes are errors that say why, never a
    /// crash.
    #[test]
    fn hostile_headers_are_refused() {
        let e = read_segment(&scratch_file(&[7u8; 100]), "f").unwrap_err();
        assert!(e.to_string().contains("shorter than a header"), "{e}");
        let e = read_segment(&scratch_file(&[0xffu8; 8192]), "f").unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let mut h = vec![0u8; 8192];
        h[..8].copy_from_slice(&MAGIC.to_le_bytes());
        h[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        let e = read_segment(&scratch_file(&h), "f").unwrap_err();
        assert!(e.to_string().contains("layout v"), "{e}");
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&5000u32.to_le_bytes());
        let e = read_segment(&scratch_file(&h), "f").unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        h[12..16].copy_from_slice(&2u32.to_le_bytes());
        for (i, v) in [(16, 1u64 << 20), (24, 1 << 20), (32, u64::MAX)] {
            h[i..i + 8].copy_from_slice(&v.to_le_bytes());
        }
        let e = read_segment(&scratch_file(&h), "f").unwrap_err();
        assert!(e.to_string().contains("inconsistent sizes"), "{e}");
        let l = Layout::new(2, 1 << 20, 1 << 20).unwrap();
        h[32..40].copy_from_slice(&(l.total as u64).to_le_bytes());
        let e = read_segment(&scratch_file(&h), "f").unwrap_err();
        assert!(e.to_string().contains("shorter than the"), "{e}");
    }

    /// A real segment reads back: world, pids and the collective each rank is in.
    #[test]
    fn a_live_segment_reads_back() {
        let job = ShmJob::with_config(1, ShmConfig::default()).unwrap();
        let mut c = job.communicator(0).unwrap();
        let mut x = vec![1f32; 8];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let fd = job.segment_file().unwrap();
        let v = read_segment(&fd, "memfd").unwrap();
        assert_eq!(v.world, 1);
        let r = &v.ranks[0];
        assert_eq!(r.pid, std::process::id() as i32);
        assert!(r.joined && !r.left && !r.moving);
        assert_eq!((r.seq, r.kind), (2, Some(CollKind::Barrier)));
    }
}
