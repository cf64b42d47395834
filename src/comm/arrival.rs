//! [`Arrival`]: the flight recorder's note of a call's start, taken by the backend when this rank
//! arrives at the call.
//!
//! Why the backend: a small collective on one node is mostly this rank waiting for its peers'
//! lines to cross between cores. The recorder's few stores, issued while that read is in flight,
//! cost next to nothing; issued before the call, they lengthen it by their whole cost. The
//! shared-memory backend notes the arrival right after publishing its part, before it looks at
//! the peers' ([`Backend::run_noting`]); other backends note it as they start, and the
//! communicator notes it after a call the backend never took (one refused before it). The start
//! is always recorded before a call can wait long, so a hang shows the call running.

use std::cell::Cell;

use super::call::Call;
use crate::trace::{BufferKind, CallInfo, CallPath, Tracer};
use crate::types::MemSpace;

/// The flight recorder's note of one call, handed to a backend by
/// [`Backend::run_noting`](super::Backend::run_noting): the backend calls [`note`](Self::note)
/// once this rank has arrived at the call (published its part, where peers wait for it); noting
/// again does nothing.
pub struct Arrival<'a> {
    tracer: &'a Tracer,
    call: &'a Call<'a>,
    /// The call's record id once noted, 0 before.
    id: Cell<u64>,
    /// The path the backend said the call takes, when it said so on arrival.
    path: Cell<Option<CallPath>>,
    /// Whether the recorder said a success may end with [`end_quick`](Self::end_quick).
    quick: Cell<bool>,
}

impl std::fmt::Debug for Arrival<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arrival")
            .field("kind", &self.call.kind)
            .field("id", &self.id.get())
            .finish()
    }
}

impl<'a> Arrival<'a> {
    pub(crate) fn new(tracer: &'a Tracer, call: &'a Call<'a>) -> Arrival<'a> {
        Arrival {
            tracer,
            call,
            id: Cell::new(0),
            path: Cell::new(None),
            quick: Cell::new(false),
        }
    }

    /// Record the call's start, unless it was recorded already.
    #[inline]
    pub fn note(&self) {
        if self.id.get() == 0 {
            self.id.set(self.tracer.start(&info(self.call)));
        }
    }

    /// [`note`](Self::note), by a backend that knows on arrival which path the call takes: its
    /// [`last_path`](super::Backend::last_path) is then not asked after the call.
    #[inline]
    pub fn note_path(&self, path: CallPath) {
        if self.id.get() == 0 {
            let (id, quick) = self.tracer.start_on(&info(self.call), path);
            self.path.set(Some(path));
            self.id.set(id);
            self.quick.set(quick);
        }
    }

    /// After the call succeeded: record its end if that takes nothing but marking it ended (an
    /// untimed call whose path came with its start); `false` if it takes more (`noted` and the
    /// recorder's `end` then).
    #[inline]
    pub(crate) fn end_quick(&self) -> bool {
        let quick = self.quick.get();
        if quick {
            self.tracer.end_quick(self.id.get());
        }
        quick
    }

    /// The call's record id, noting its start now if the backend did not, and the path it took
    /// if the backend said so on arrival.
    #[inline]
    pub(crate) fn noted(&self) -> (u64, Option<CallPath>) {
        self.note();
        (self.id.get(), self.path.get())
    }
}

/// What the recorder takes down of a collective.
#[inline]
fn info(call: &Call) -> CallInfo {
    CallInfo {
        kind: call.kind,
        dtype: call.dtype,
        op: call.op,
        count: call.count as u64,
        root: call.kind.has_root().then_some(call.root as u64),
        ops: 0,
        buffer: buffer_kind(&[call.send.space, call.recv.space]),
    }
}

/// Device if any of the buffers is, else host (registered is the backend's to say, by its path).
pub(crate) fn buffer_kind(spaces: &[MemSpace]) -> BufferKind {
    if spaces.iter().any(|s| matches!(s, MemSpace::Device(_))) {
        BufferKind::Device
    } else {
        BufferKind::Host
    }
}
