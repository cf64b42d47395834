//! [`HierBackend`]: one communicator over the nodes of a job, shared memory inside each node and
//! MPI point-to-point messages between nodes. MPI only moves bytes; every addition is lockstep's,
//! in the node-major order of [`Layout`] (see the module docs of `hier`).

use std::time::Duration;

use super::fold;
use super::layout::{slices, Layout};
use super::wire::{check_headers, Failure, Header, HEADER_BYTES, STATUS_BYTES, UNREACHABLE};
use crate::comm::{Backend, BackendKind, Call, CommError, Communicator, P2pOp, Splits, ANY_SOURCE};
use crate::mpi::{
    bytes_of, elems, elems_mut, from_bytes, read_mem, read_mem_into, to_bytes, with_host_elems_mut,
    write_mem, MpiComm, MpiError, Request, Waited,
};
use crate::reference::Arith;
use crate::shm::reduce_slices;
use crate::types::{CollKind, Dtype, Element, MemSpace, RawMem, ReduceOp};

/// MPI tags, one per kind of message: messages of one kind between two ranks match in order.
const TAG_HEADER: u16 = 1;
const TAG_ACC: u16 = 2;
const TAG_RESULT: u16 = 3;
const TAG_NOTICE: u16 = 4;
const TAG_DATA: u16 = 5;
const TAG_P2P: u16 = 6;

/// Bytes of each running-value message of the chain between nodes: small enough that the nodes
/// work on different chunks at once (a pipeline), large enough to amortise a message.
const CHUNK_BYTES: usize = 1 << 20;

/// Reductions up to this size go through the node leaders (one exchange between nodes); larger
/// ones through every rail (each local rank reduces its slice along the chain of nodes).
const SMALL_BYTES: usize = 16 << 10;

/// Message buffers of at least this many bytes are kept for later calls (`spare`): a fresh
/// large allocation costs a page fault per page as it is first written, more than copying it.
const SPARE_MIN: usize = 64 << 10;
/// At most this many spare buffers are kept, each of at most `SPARE_MAX` bytes.
const SPARE_COUNT: usize = 4;
const SPARE_MAX: usize = 64 << 20;

/// Bytes of the header of a point-to-point message between nodes: dtype and count.
const P2P_HEADER: usize = 16;

/// Where a reduction's result goes.
#[derive(Clone, Copy)]
enum Output {
    /// All of it, into this buffer.
    Full(RawMem),
    /// Elements `at..at + mem.len` of it, into `mem` (reduce-scatter).
    Block(RawMem, usize),
    /// Nowhere (reduce, on a rank other than the root).
    Nothing,
}

/// What is left to deliver once the result went straight into a [`Output::Full`] buffer.
fn out_of_scratch(out: Output) -> Output {
    match out {
        Output::Full(_) => Output::Nothing,
        other => other,
    }
}

/// The reduction of every input the leaders exchanged into `out`: `blocks` holds each node's
/// inputs in node order (each `out.len()` elements, in local order), so the inputs come in
/// global rank order (node-major). The shared-memory backend's kernel adds them in that order
/// with the canonical rounding, the same bits as [`fold`]'s steps and `reference::reduce`.
fn fold_blocks<T: Element>(op: ReduceOp, blocks: &[Vec<u8>], out: &mut [T]) {
    let n = out.len();
    let views: Vec<_> = blocks.iter().map(|b| elems::<T>(b)).collect();
    let inputs: Vec<&[T]> = views.iter().flat_map(|v| v.chunks_exact(n)).collect();
    reduce_slices(op, &inputs, out);
}

/// `f` on `bytes` as elements of `A`: in place when they are aligned for `A` (a message buffer
/// usually is), else on a copy that is written back.
fn on_elems<A: Element>(bytes: &mut [u8], f: impl FnOnce(&mut [A])) {
    match elems_mut::<A>(bytes) {
        Some(v) => f(v),
        None => {
            let mut v = from_bytes::<A>(bytes);
            f(&mut v);
            bytes.copy_from_slice(bytes_of(&v));
        }
    }
}

/// The hierarchical communicator's backend.
pub(crate) struct HierBackend {
    rank: usize,
    world: usize,
    layout: Layout,
    /// This rank's node and local rank.
    node_index: usize,
    local: usize,
    /// The shared-memory communicator of this node (its ranks are the local ranks).
    node: Communicator,
    /// A private duplicate of `MPI_COMM_WORLD`: its ranks are the global ranks.
    mpi: MpiComm,
    /// Process id of every rank (named when a rank is lost).
    pids: Vec<i32>,
    /// A posted receive of a failure notice from every rank of the other nodes: a wait on MPI
    /// ends early when one arrives.
    watch: Vec<Request>,
    /// Failure notices this rank sent, kept until MPI is done with them.
    notices: Vec<Request>,
    seq: u64,
    timeout: Duration,
    /// The failure that ended this communicator: later calls report it.
    failed: Option<(usize, String)>,
    /// Whether the failure being reported was passed on by another rank (a status or a notice),
    /// which told the other nodes itself.
    heard: bool,
    /// Large message buffers of earlier calls, for their allocations (see `SPARE_MIN`).
    spare: Vec<Vec<u8>>,
}

/// A host buffer of this process as the memory of a call.
fn host<T: Element>(v: &[T]) -> RawMem {
    RawMem {
        addr: v.as_ptr() as usize,
        len: v.len(),
        space: MemSpace::Host,
    }
}

/// A host buffer of this process that a call writes.
fn host_mut<T: Element>(v: &mut [T]) -> RawMem {
    RawMem {
        addr: v.as_mut_ptr() as usize,
        len: v.len(),
        space: MemSpace::Host,
    }
}

/// A call of the node's communicator that moves elements of `T` from `send` (root 0, no op;
/// `count` is the send count, as for the v-variants).
fn moving<'a, T: Element>(
    kind: CollKind,
    send: RawMem,
    recv: RawMem,
    splits: Splits<'a>,
) -> Call<'a> {
    Call {
        kind,
        dtype: T::DTYPE,
        op: ReduceOp::Sum,
        root: 0,
        count: send.len,
        send,
        recv,
        splits,
    }
}

fn bug(what: String) -> CommError {
    CommError::Backend {
        backend: "hier",
        message: format!("{what} (a lockstep bug: report it)"),
    }
}

fn mpi_err(e: MpiError) -> CommError {
    CommError::from(e)
}

/// Run `$f::<T>` for the element type of `$dtype`.
macro_rules! by_dtype {
    ($self:ident, $dtype:expr, $f:ident ( $($a:expr),* )) => {
        match $dtype {
            Dtype::F32 => $self.$f::<f32>($($a),*),
            Dtype::F64 => $self.$f::<f64>($($a),*),
            Dtype::F16 => $self.$f::<half::f16>($($a),*),
            Dtype::BF16 => $self.$f::<half::bf16>($($a),*),
            Dtype::I32 => $self.$f::<i32>($($a),*),
            Dtype::I64 => $self.$f::<i64>($($a),*),
            Dtype::U8 => $self.$f::<u8>($($a),*),
            Dtype::I8 => $self.$f::<i8>($($a),*),
            Dtype::U32 => $self.$f::<u32>($($a),*),
            Dtype::U64 => $self.$f::<u64>($($a),*),
        }
    };
}

impl HierBackend {
    /// The backend of global rank `mpi.rank()`, whose node's shared-memory communicator is
    /// `node`; posts the receives of failure notices.
    pub(crate) fn new(
        mpi: MpiComm,
        layout: Layout,
        node: Communicator,
        pids: Vec<i32>,
    ) -> Result<HierBackend, CommError> {
        let rank = mpi.rank();
        let (node_index, local) = layout.place[rank];
        let timeout = node.timeout().unwrap_or(Duration::from_secs(300));
        let mut watch = Vec::new();
        for g in 0..mpi.size() {
            if layout.place[g].0 != node_index {
                watch.push(mpi.irecv(g, TAG_NOTICE, STATUS_BYTES).map_err(mpi_err)?);
            }
        }
        Ok(HierBackend {
            rank,
            world: mpi.size(),
            layout,
            node_index,
            local,
            node,
            mpi,
            pids,
            watch,
            notices: Vec::new(),
            seq: 0,
            timeout,
            failed: None,
            heard: false,
            spare: Vec::new(),
        })
    }

    /// An empty buffer for a message of `len` bytes: a spare one's allocation when it is large.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut b = if len >= SPARE_MIN {
            self.spare.pop().unwrap_or_default()
        } else {
            Vec::new()
        };
        b.clear();
        b
    }

    /// A buffer of `len` bytes that is about to be overwritten whole (a receive, a result): a
    /// spare one when large, keeping its bytes, so that it is not zeroed again first.
    fn overwritten(&mut self, len: usize) -> Vec<u8> {
        let mut b = if len >= SPARE_MIN {
            self.spare.pop().unwrap_or_default()
        } else {
            Vec::new()
        };
        if b.len() >= len {
            b.truncate(len);
        } else {
            b.resize(len, 0);
        }
        b
    }

    /// Keep `b`'s allocation for a later message (within `SPARE_COUNT` and `SPARE_MAX`).
    fn recycle(&mut self, b: Vec<u8>) {
        if b.capacity() >= SPARE_MIN && b.capacity() <= SPARE_MAX && self.spare.len() < SPARE_COUNT
        {
            self.spare.push(b);
        }
    }

    /// How much longer a rank waits for a step that depends on another node's waits: a rank that
    /// waits directly on a stuck rank times out first, and the ranks that wait on it learn its
    /// report (naming the stuck rank) instead of timing out themselves.
    fn margin(&self) -> Duration {
        (self.timeout / 5).clamp(Duration::from_millis(500), Duration::from_secs(10))
    }

    /// The timeout of a step `level` removed from the ranks' arrival.
    fn wait(&self, level: u32) -> Duration {
        self.timeout + self.margin() * level
    }

    fn node_size(&self) -> usize {
        self.layout.nodes[self.node_index].len()
    }

    fn leader(&self) -> bool {
        self.local == 0
    }

    /// An error of the node's shared-memory communicator, told in this communicator's terms: its
    /// global ranks, and the user's call `op` #`seq` (the node's own calls are internal steps).
    fn node_error(&self, e: CommError, op: CollKind) -> CommError {
        let seq = self.seq;
        let members = &self.layout.nodes[self.node_index];
        let g = |l: usize| members.get(l).copied().unwrap_or(l);
        match e {
            CommError::PeerLost {
                lost_rank, pid, how, ..
            } => CommError::PeerLost {
                rank: self.rank,
                lost_rank: g(lost_rank),
                pid,
                how,
                op,
                seq,
                group: String::new(),
            },
            CommError::Timeout { secs, missing, .. } => {
                let missing: Vec<usize> = missing.iter().map(|&l| g(l)).collect();
                let names: Vec<String> = missing
                    .iter()
                    .map(|m| format!("rank {m} (node {}) did not arrive", self.node_index))
                    .collect();
                CommError::Timeout {
                    rank: self.rank,
                    op,
                    seq,
                    secs,
                    detail: names.join(", "),
                    missing,
                }
            }
            CommError::Aborted { by, reason } => CommError::Aborted {
                by: g(by),
                reason: format!(
                    "{reason} (ranks in this reason are local ranks of node {}, global ranks {members:?})",
                    self.node_index
                ),
            },
            CommError::Mismatch { detail, .. } => CommError::Mismatch { seq, detail },
            other => other,
        }
    }

    /// Run `call` on the node's communicator, `level` steps removed from the ranks' arrival.
    fn on_node(&mut self, call: &Call, level: u32, op: CollKind) -> Result<(), CommError> {
        self.node.set_timeout(self.wait(level))?;
        self.node
            .run_checked(call)
            .map_err(|e| self.node_error(e, op))
    }

    /// Wait for MPI requests, `level` steps removed from the ranks' arrival; a failure notice
    /// from another node ends the wait with that failure.
    fn mpi_wait(
        &mut self,
        what: &str,
        reqs: &mut [Request],
        level: u32,
        op: CollKind,
    ) -> Result<(), CommError> {
        let limit = self.wait(level);
        match self.mpi.poll(what, reqs, &mut self.watch, limit) {
            Waited::Done => Ok(()),
            Waited::Watched(i) => {
                let notice = self.watch.swap_remove(i);
                let from = notice.peer();
                self.heard = true;
                match Failure::decode(&notice.into_data()) {
                    Some(f) => Err(f.to_error(self.rank, op, self.seq)),
                    None => Err(CommError::Aborted {
                        by: from,
                        reason: "an empty failure notice".into(),
                    }),
                }
            }
            Waited::Failed { index, error } => {
                let peer = reqs[index].peer();
                if let MpiError::Call { class: 15, .. } = error {
                    return Err(CommError::Mismatch {
                        seq: self.seq,
                        detail: format!(
                            "rank {peer} sent a longer message than rank {} expected in {what}: {error}",
                            self.rank
                        ),
                    });
                }
                tracing::warn!(rank = self.rank, peer, "{what}: {error}");
                Err(CommError::PeerLost {
                    rank: self.rank,
                    lost_rank: peer,
                    pid: self.pids.get(peer).copied().unwrap_or(0),
                    how: UNREACHABLE,
                    op,
                    seq: self.seq,
                    group: String::new(),
                })
            }
            Waited::TimedOut { secs } => {
                let mut missing: Vec<usize> = reqs
                    .iter()
                    .filter(|r| !r.is_done())
                    .map(Request::peer)
                    .collect();
                missing.sort_unstable();
                missing.dedup();
                let names: Vec<String> = missing
                    .iter()
                    .map(|&m| format!("rank {m} (node {})", self.layout.place[m].0))
                    .collect();
                Err(CommError::Timeout {
                    rank: self.rank,
                    op,
                    seq: self.seq,
                    secs,
                    detail: format!(
                        "{what}: no message from or to {} (stuck, or on a node that stopped answering)",
                        names.join(", ")
                    ),
                    missing,
                })
            }
        }
    }

    /// The error for a failure another rank passed on (it told the other nodes itself).
    fn heard(&mut self, f: &Failure, op: CollKind) -> CommError {
        self.heard = true;
        f.to_error(self.rank, op, self.seq)
    }

    /// End this communicator after `e`: later calls fail, the other nodes are told at once (their
    /// waits end with `e` instead of a timeout), and MPI is not finalised (it could wait for a
    /// lost peer).
    fn fail(&mut self, e: &CommError) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some((self.rank, e.to_string()));
        // Every rank sees a mismatch itself, and every rank is alive.
        if matches!(e, CommError::Mismatch { .. }) {
            return;
        }
        self.mpi.abandon();
        // A failure passed on (or an abort of the node's shared memory by another rank) was
        // announced by the rank that saw it first.
        if self.heard || matches!(e, CommError::Aborted { .. }) {
            return;
        }
        let notice = Failure::encode(Some(&Failure::from_error(e, self.rank)));
        for g in 0..self.world {
            if self.layout.place[g].0 != self.node_index {
                match self.mpi.isend(g, TAG_NOTICE, notice.clone()) {
                    Ok(r) => self.notices.push(r),
                    Err(err) => tracing::debug!("failure notice to rank {g}: {err}"),
                }
            }
        }
    }

    /// Check that every rank of the job is in the same call (the header phase): the node's
    /// ranks gather their headers, the leaders exchange their nodes', and each leader hands
    /// every header (or the failure it saw) to its node. No rank leaves it before every rank has
    /// entered it, so it is also the barrier.
    fn begin(&mut self, mut hdr: Header) -> Result<(), CommError> {
        if let Some((by, reason)) = &self.failed {
            return Err(CommError::Aborted {
                by: *by,
                reason: format!("this communicator failed earlier ({reason}); the job cannot continue: restart it"),
            });
        }
        self.seq += 1;
        hdr.seq = self.seq;
        let headers = match self.headers(hdr) {
            Ok(h) => h,
            Err(e) => {
                self.fail(&e);
                return Err(e);
            }
        };
        // Every rank compares the same headers, so a mismatch is found by all of them at the
        // same call, after the phase and before any data moved: the ranks are still in step,
        // and the communicator stays usable (as on one node).
        check_headers(&headers, self.seq)
    }

    /// Every rank's header of this call, in global rank order, on every rank.
    fn headers(&mut self, header: Header) -> Result<Vec<Header>, CommError> {
        let op = CollKind::from_u8(header.kind).unwrap_or(CollKind::Barrier);
        let hdr = header.encode();
        let mut local = vec![0u8; self.node_size() * HEADER_BYTES];
        self.node.set_timeout(self.wait(0))?;
        self.node
            .all_gather(&hdr[..], &mut local[..])
            .map_err(|e| self.node_error(e, op))?;
        let buf = self.world_blocks(local, HEADER_BYTES, TAG_HEADER, op)?;
        Ok((0..self.world)
            .map(|g| Header::decode(&buf[STATUS_BYTES + g * HEADER_BYTES..]))
            .collect())
    }

    /// Every rank's block of `b` bytes (this node's `local`, in local order), on every rank of the
    /// node after a status: gathered in each node already, exchanged between the leaders, placed
    /// in global rank order by the leader and handed to its node.
    fn world_blocks(
        &mut self,
        local: Vec<u8>,
        b: usize,
        tag: u16,
        op: CollKind,
    ) -> Result<Vec<u8>, CommError> {
        let mut buf = vec![0u8; STATUS_BYTES + self.world * b];
        let mut outcome = Ok(());
        if self.leader() {
            let sizes: Vec<usize> = self.layout.nodes.iter().map(|m| m.len() * b).collect();
            outcome = self.leaders_exchange(local, tag, &sizes, op).map(|blocks| {
                for (k, block) in blocks.iter().enumerate() {
                    for (l, &g) in self.layout.nodes[k].iter().enumerate() {
                        let at = STATUS_BYTES + g * b;
                        buf[at..at + b].copy_from_slice(&block[l * b..(l + 1) * b]);
                    }
                }
            });
        }
        self.hand_out(&mut buf, outcome, op)?;
        Ok(buf)
    }

    /// Hand the leader's `buf` (a status, then data) to every rank of the node, the leader's
    /// `outcome` in the status: the node's ranks all return the leader's failure, or all go on.
    fn hand_out(
        &mut self,
        buf: &mut [u8],
        outcome: Result<(), CommError>,
        op: CollKind,
    ) -> Result<(), CommError> {
        if let Err(e) = &outcome {
            let f = Failure::from_error(e, self.rank);
            buf[..STATUS_BYTES].copy_from_slice(&Failure::encode(Some(&f)));
        }
        self.node.set_timeout(self.wait(2))?;
        self.node
            .broadcast_in_place(buf, 0)
            .map_err(|e| self.node_error(e, op))?;
        match Failure::decode(&buf[..STATUS_BYTES]) {
            Some(f) => Err(self.heard(&f, op)),
            None => Ok(()),
        }
    }

    /// Leaders only: send this node's `mine` to every other leader and receive theirs
    /// (`sizes[k]` bytes from node `k`); the blocks in node order, this node's included.
    fn leaders_exchange(
        &mut self,
        mine: Vec<u8>,
        tag: u16,
        sizes: &[usize],
        op: CollKind,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let nodes = self.layout.nodes.len();
        let others: Vec<usize> = (0..nodes).filter(|&k| k != self.node_index).collect();
        let mut reqs = Vec::with_capacity(2 * others.len());
        for &k in &others {
            let leader = self.layout.global(k, 0);
            let b = self.overwritten(sizes[k]);
            reqs.push(
                self.mpi
                    .irecv_into(leader, tag, sizes[k], b)
                    .map_err(mpi_err)?,
            );
        }
        let leaders: Vec<usize> = others.iter().map(|&k| self.layout.global(k, 0)).collect();
        let mine = self.send_to_all(&leaders, tag, mine, &mut reqs)?;
        self.mpi_wait("the exchange between node leaders", &mut reqs, 1, op)?;
        let mut blocks = vec![Vec::new(); nodes];
        let mut reqs = reqs.into_iter();
        // `others` first: a zip polls its first iterator once more at the end, which would
        // drop the send whose buffer is `mine`.
        for (&k, req) in others.iter().zip(reqs.by_ref()) {
            let b = req.into_data();
            if b.len() != sizes[k] {
                return Err(bug(format!(
                    "node {k}'s leader sent {} bytes, {} expected",
                    b.len(),
                    sizes[k]
                )));
            }
            blocks[k] = b;
        }
        blocks[self.node_index] = match mine {
            Some(m) => m,
            None => reqs.last().map(Request::into_data).unwrap_or_default(),
        };
        Ok(blocks)
    }

    /// Start sending `data` to every rank of `to`, pushing the requests onto `reqs` in that
    /// order: copies for all but the last, which takes `data` itself (its request's
    /// [`Request::into_data`] gives it back once done). `data` comes back at once when `to` is
    /// empty.
    fn send_to_all(
        &self,
        to: &[usize],
        tag: u16,
        data: Vec<u8>,
        reqs: &mut Vec<Request>,
    ) -> Result<Option<Vec<u8>>, CommError> {
        let mut data = Some(data);
        for (i, &g) in to.iter().enumerate() {
            let d = if i + 1 == to.len() {
                data.take()
            } else {
                data.clone()
            };
            reqs.push(
                self.mpi
                    .isend(g, tag, d.unwrap_or_default())
                    .map_err(mpi_err)?,
            );
        }
        Ok(data)
    }

    /// After a step where some ranks of the node talked MPI: every rank of the node learns
    /// whether any failed. A rank reports its own failure, the others the first of the node's.
    fn settle(&mut self, mine: Result<(), CommError>, op: CollKind) -> Result<(), CommError> {
        let st = Failure::encode(
            mine.as_ref()
                .err()
                .map(|e| Failure::from_error(e, self.rank))
                .as_ref(),
        );
        let mut all = vec![0u8; self.node_size() * STATUS_BYTES];
        self.node.set_timeout(self.wait(2))?;
        if let Err(e) = self.node.all_gather(&st[..], &mut all[..]) {
            let e = self.node_error(e, op);
            return Err(mine.err().unwrap_or(e));
        }
        mine?;
        for l in 0..self.node_size() {
            if let Some(f) = Failure::decode(&all[l * STATUS_BYTES..(l + 1) * STATUS_BYTES]) {
                return Err(self.heard(&f, op));
            }
        }
        Ok(())
    }

    /// One collective: the header phase, then the data.
    fn collective(&mut self, call: &Call) -> Result<(), CommError> {
        self.begin(Header::of(call, 0))?;
        let r = match call.kind {
            CollKind::Barrier => Ok(()),
            CollKind::AllReduce => {
                by_dtype!(self, call.dtype, reduce_t(call, Output::Full(call.recv)))
            }
            CollKind::Reduce => {
                let out = if self.rank == call.root {
                    Output::Full(call.recv)
                } else {
                    Output::Nothing
                };
                by_dtype!(self, call.dtype, reduce_t(call, out))
            }
            CollKind::ReduceScatter => {
                let whole = Call {
                    count: call.count * self.world,
                    ..*call
                };
                let out = Output::Block(call.recv, self.rank * call.count);
                by_dtype!(self, call.dtype, reduce_t(&whole, out))
            }
            CollKind::Broadcast => self.broadcast(call),
            CollKind::AllGather => by_dtype!(self, call.dtype, all_gather_t(call)),
            other => Err(bug(format!("{other} reached the hierarchical backend"))),
        };
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }

    /// Write a reduction's `result` where `out` says.
    fn deliver<T: Element>(&self, out: Output, result: &[T]) -> Result<(), CommError> {
        let sz = std::mem::size_of::<T>();
        let w = match out {
            Output::Full(mem) => write_mem(mem, sz, 0, bytes_of(result)),
            Output::Block(mem, at) => match result.get(at..at + mem.len) {
                Some(b) => write_mem(mem, sz, 0, bytes_of(b)),
                None => Err(format!("block {at}+{} of {}", mem.len, result.len())),
            },
            Output::Nothing => Ok(()),
        };
        w.map_err(bug)
    }

    /// A reduction of `call.count` elements, in node-major order.
    fn reduce_t<T: Element + Arith>(&mut self, call: &Call, out: Output) -> Result<(), CommError>
    where
        T::Acc: Element,
    {
        if call.count == 0 {
            return Ok(());
        }
        if call.count * std::mem::size_of::<T>() <= SMALL_BYTES || self.layout.rails() == 1 {
            self.reduce_by_leaders::<T>(call, out)
        } else {
            self.reduce_by_rails::<T>(call, out)
        }
    }

    /// Small reductions: the node's inputs gathered on its leader, the leaders exchange them,
    /// each leader reduces all of them in node-major order (the same operations on the same
    /// inputs, so the same bits everywhere) and hands the result to its node.
    fn reduce_by_leaders<T: Element + Arith>(
        &mut self,
        call: &Call,
        mut out: Output,
    ) -> Result<(), CommError>
    where
        T::Acc: Element,
    {
        let (n, op, kind) = (call.count, call.op, call.kind);
        let sz = std::mem::size_of::<T>();
        let nl = self.node_size();
        let send = RawMem {
            len: n,
            ..call.send
        };
        // The node's inputs on its leader, as the message to the other leaders: the caller's
        // buffer itself when the node is this rank alone, else gathered in shared memory.
        let mut mine = self.buffer(nl * n * sz);
        if nl == 1 {
            read_mem_into(send, sz, 0, n, &mut mine).map_err(bug)?;
        } else {
            let mut gathered: Vec<T> = vec![T::default(); if self.leader() { nl * n } else { 0 }];
            let recv = host_mut(&mut gathered);
            let gather = moving::<T>(CollKind::Gather, send, recv, Splits::default());
            self.on_node(&gather, 2, kind)?;
            mine.extend_from_slice(bytes_of(&gathered));
        }
        // The leader's result goes to its own output directly; the status, and for the node's
        // other ranks the result, travel in `buf`.
        let mut buf = vec![0u8; STATUS_BYTES + if nl > 1 { n * sz } else { 0 }];
        let mut result: Option<Vec<u8>> = None;
        let mut outcome = Ok(());
        if self.leader() {
            let sizes: Vec<usize> = self.layout.nodes.iter().map(|m| m.len() * n * sz).collect();
            match self.leaders_exchange(mine, TAG_DATA, &sizes, kind) {
                Ok(blocks) => {
                    // A node of one rank folds straight into the caller's buffer (the inputs
                    // are the messages and this rank's copy of its own, so none aliases it).
                    let direct = match out {
                        Output::Full(mem) if nl == 1 && mem.len >= n => {
                            with_host_elems_mut::<T, _>(RawMem { len: n, ..mem }, |o| {
                                fold_blocks(op, &blocks, o)
                            })
                            .is_some()
                        }
                        _ => false,
                    };
                    if direct {
                        out = Output::Nothing;
                    } else {
                        let mut res = self.overwritten(n * sz);
                        match elems_mut::<T>(&mut res) {
                            Some(o) => fold_blocks(op, &blocks, o),
                            None => {
                                let mut o = vec![T::default(); n];
                                fold_blocks(op, &blocks, &mut o);
                                res.copy_from_slice(bytes_of(&o));
                            }
                        }
                        if nl > 1 {
                            buf[STATUS_BYTES..].copy_from_slice(&res);
                        }
                        result = Some(res);
                    }
                    for b in blocks {
                        self.recycle(b);
                    }
                }
                Err(e) => outcome = Err(e),
            }
        } else {
            self.recycle(mine);
        }
        self.hand_out(&mut buf, outcome, kind)?;
        let delivered = match &result {
            Some(r) => self.deliver(out, &elems::<T>(r)),
            None => self.deliver(out, &elems::<T>(&buf[STATUS_BYTES..])),
        };
        if let Some(r) = result {
            self.recycle(r);
        }
        delivered
    }

    /// Large reductions, on every rail at once: (1) in shared memory each local rank `j` of the
    /// first `rails` collects slice `j` of every local input; (2) along the chain of nodes
    /// 0, 1, …, each rail folds its node's inputs onto the running value the previous node sent,
    /// chunk by chunk (a pipeline), and the last node sends the finished slice back to the
    /// others; (3) in shared memory the slices are gathered into the result.
    fn reduce_by_rails<T: Element + Arith>(
        &mut self,
        call: &Call,
        out: Output,
    ) -> Result<(), CommError>
    where
        T::Acc: Element,
    {
        let (n, kind) = (call.count, call.kind);
        let rails = self.layout.rails();
        let nl = self.node_size();
        let sl = slices(n, rails);
        let part = |p: usize| if p < rails { sl[p] } else { (n, 0) };
        let mine = part(self.local).1;
        let mut gathered: Vec<T> = vec![T::default(); nl * mine];
        let recv = host_mut(&mut gathered);
        let send_counts: Vec<usize> = (0..nl).map(|p| part(p).1).collect();
        let send_displs: Vec<usize> = (0..nl).map(|p| part(p).0.min(n)).collect();
        let recv_counts = vec![mine; nl];
        let recv_displs: Vec<usize> = (0..nl).map(|p| p * mine).collect();
        let send = RawMem {
            len: n,
            ..call.send
        };
        let splits = Splits {
            send_counts: &send_counts,
            send_displs: &send_displs,
            recv_counts: &recv_counts,
            recv_displs: &recv_displs,
        };
        let scatter = moving::<T>(CollKind::AllToAllV, send, recv, splits);
        self.on_node(&scatter, 2, kind)?;
        let chained = if mine > 0 {
            self.chain::<T>(call.op, &gathered, nl, mine, kind)
        } else {
            Ok(Vec::new())
        };
        drop(gathered);
        let (slice, status) = match chained {
            Ok(v) => (v, Ok(())),
            Err(e) => (Vec::new(), Err(e)),
        };
        self.settle(status, kind)?;
        let mut scratch: Vec<T> = Vec::new();
        let target = match out {
            Output::Full(mem) => RawMem { len: n, ..mem },
            _ => {
                scratch = vec![T::default(); n];
                host_mut(&mut scratch)
            }
        };
        let recv_displs: Vec<usize> = (0..nl).map(|p| part(p).0.min(n)).collect();
        let splits = Splits {
            recv_counts: &send_counts,
            recv_displs: &recv_displs,
            ..Splits::default()
        };
        let slice_elems = elems::<T>(&slice);
        let gather = moving::<T>(CollKind::AllGatherV, host(&slice_elems), target, splits);
        let gathered = self.on_node(&gather, 2, kind);
        drop(slice_elems);
        self.recycle(slice);
        gathered?;
        self.deliver(out_of_scratch(out), &scratch)
    }

    /// Step (2) of [`reduce_by_rails`](Self::reduce_by_rails) on rail `local`: `gathered` holds
    /// the node's `inputs` inputs of this rail's slice (`len` elements each, in local order).
    /// Returns the slice's result, as bytes of `len` elements of `T`.
    ///
    /// The running value lives in the bytes of the message that carries it: a chunk received
    /// from the previous node is folded into in place and sent on as it is, and the last node's
    /// result goes to the others without a copy for the last of them.
    fn chain<T: Element + Arith>(
        &mut self,
        op: ReduceOp,
        gathered: &[T],
        inputs: usize,
        len: usize,
        kind: CollKind,
    ) -> Result<Vec<u8>, CommError>
    where
        T::Acc: Element,
    {
        let (k, nodes, j) = (self.node_index, self.layout.nodes.len(), self.local);
        let prev = (k > 0).then(|| self.layout.global(k - 1, j));
        let next = (k + 1 < nodes).then(|| self.layout.global(k + 1, j));
        let last = self.layout.global(nodes - 1, j);
        let (asz, tsz) = (std::mem::size_of::<T::Acc>(), std::mem::size_of::<T>());
        let step = (CHUNK_BYTES / asz).max(1);
        let chunks: Vec<(usize, usize)> = (0..len)
            .step_by(step)
            .map(|a| (a, (a + step).min(len)))
            .collect();
        let mut incoming: Vec<Option<Request>> = Vec::new();
        if let Some(p) = prev {
            for &(a, b) in &chunks {
                let buf = self.overwritten((b - a) * asz);
                incoming.push(Some(
                    self.mpi
                        .irecv_into(p, TAG_ACC, (b - a) * asz, buf)
                        .map_err(mpi_err)?,
                ));
            }
        }
        let mut sends = Vec::new();
        let mut out = if next.is_none() {
            self.overwritten(len * tsz)
        } else {
            Vec::new()
        };
        for (c, &(a, b)) in chunks.iter().enumerate() {
            let x = |l: usize| &gathered[l * len + a..l * len + b];
            let (mut acc, first) = match incoming.get_mut(c).and_then(Option::take) {
                Some(req) => {
                    let mut one = [req];
                    self.mpi_wait(
                        "the running value from the previous node",
                        &mut one,
                        1,
                        kind,
                    )?;
                    let [req] = one;
                    (req.into_data(), 0)
                }
                None => {
                    let mut acc = self.overwritten((b - a) * asz);
                    on_elems::<T::Acc>(&mut acc, |v| fold::start(x(0), v));
                    (acc, 1)
                }
            };
            if acc.len() != (b - a) * asz {
                return Err(bug(format!(
                    "a chunk of {} bytes, {} expected",
                    acc.len(),
                    (b - a) * asz
                )));
            }
            on_elems::<T::Acc>(&mut acc, |v| {
                for l in first..inputs {
                    fold::add(op, v, x(l));
                }
            });
            match next {
                Some(nx) => sends.push(self.mpi.isend(nx, TAG_ACC, acc).map_err(mpi_err)?),
                None => {
                    let world = self.world;
                    let acc_elems = elems::<T::Acc>(&acc);
                    on_elems::<T>(&mut out[a * tsz..b * tsz], |o| {
                        fold::finish(op, &acc_elems, world, o)
                    });
                    drop(acc_elems);
                    self.recycle(acc);
                }
            }
        }
        if next.is_none() {
            let others: Vec<usize> = (0..nodes - 1).map(|k2| self.layout.global(k2, j)).collect();
            let result = self.send_to_all(&others, TAG_RESULT, out, &mut sends)?;
            self.mpi_wait("sending to the other nodes", &mut sends, 1, kind)?;
            out = match result {
                Some(r) => r,
                None => sends.pop().map(Request::into_data).unwrap_or_default(),
            };
        } else {
            let buf = self.overwritten(len * tsz);
            let mut one = [self
                .mpi
                .irecv_into(last, TAG_RESULT, len * tsz, buf)
                .map_err(mpi_err)?];
            self.mpi_wait("the result from the last node", &mut one, 1, kind)?;
            let [req] = one;
            out = req.into_data();
            if out.len() != len * tsz {
                return Err(bug(format!(
                    "a result of {} bytes, {} expected",
                    out.len(),
                    len * tsz
                )));
            }
            self.mpi_wait("sending to the next node", &mut sends, 1, kind)?;
        }
        for r in sends {
            self.recycle(r.into_data());
        }
        Ok(out)
    }

    /// Broadcast: the root sends to every other node's leader, and each node broadcasts in
    /// shared memory (the root's node from the root).
    fn broadcast(&mut self, call: &Call) -> Result<(), CommError> {
        let (n, kind) = (call.count, call.kind);
        if n == 0 {
            return Ok(());
        }
        let sz = call.dtype.size();
        let (root_node, root_local) = self.layout.place[call.root];
        if self.node_index == root_node {
            let mut sends = Vec::new();
            if self.rank == call.root {
                let data = read_mem(call.send, sz, 0, n).map_err(bug)?;
                for k in (0..self.layout.nodes.len()).filter(|&k| k != root_node) {
                    let g = self.layout.global(k, 0);
                    sends.push(self.mpi.isend(g, TAG_DATA, data.clone()).map_err(mpi_err)?);
                }
            }
            self.on_node(
                &Call {
                    root: root_local,
                    ..*call
                },
                2,
                kind,
            )?;
            let sent = self.mpi_wait("broadcast to the other nodes", &mut sends, 1, kind);
            self.settle(sent, kind)
        } else {
            let mut got = Ok(());
            if self.leader() {
                let mut one = [self
                    .mpi
                    .irecv(call.root, TAG_DATA, n * sz)
                    .map_err(mpi_err)?];
                got = self.mpi_wait("broadcast from the root", &mut one, 1, kind);
                if got.is_ok() {
                    let [req] = one;
                    got = write_mem(call.recv, sz, 0, &req.into_data()).map_err(bug);
                }
            }
            self.settle(got, kind)?;
            let local = Call {
                root: 0,
                send: call.recv,
                ..*call
            };
            self.on_node(&local, 2, kind)
        }
    }

    /// All-gather: gathered in each node, exchanged between the leaders, and handed to the
    /// node's ranks in global rank order.
    fn all_gather_t<T: Element>(&mut self, call: &Call) -> Result<(), CommError> {
        let (n, kind) = (call.count, call.kind);
        if n == 0 {
            return Ok(());
        }
        let sz = std::mem::size_of::<T>();
        let nl = self.node_size();
        let mut local: Vec<T> = vec![T::default(); nl * n];
        let gather = Call {
            kind: CollKind::AllGather,
            recv: host_mut(&mut local),
            ..*call
        };
        self.on_node(&gather, 2, kind)?;
        let buf = self.world_blocks(to_bytes(&local), n * sz, TAG_DATA, kind)?;
        write_mem(call.recv, sz, 0, &buf[STATUS_BYTES..]).map_err(bug)
    }

    /// Point-to-point: peers on this node through its shared memory, others through MPI (each
    /// message carries its dtype and count, checked by the receiver).
    fn p2p_ops(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        let here = self.node_index;
        let kind = ops.first().map_or(CollKind::Send, |o| o.kind);
        let mut local = Vec::new();
        let mut reqs = Vec::new();
        let mut recvs = Vec::new();
        for op in ops.iter() {
            let (k, l) = self.layout.place[op.peer];
            let sz = op.dtype.size();
            if k == here {
                local.push(P2pOp { peer: l, ..*op });
            } else if op.kind == CollKind::Send {
                let mut msg = vec![0u8; P2P_HEADER];
                msg[0] = op.dtype as u8;
                msg[8..16].copy_from_slice(&(op.mem.len as u64).to_le_bytes());
                msg.extend(read_mem(op.mem, sz, 0, op.mem.len).map_err(bug)?);
                reqs.push(self.mpi.isend(op.peer, TAG_P2P, msg).map_err(mpi_err)?);
            } else {
                recvs.push((reqs.len(), *op));
                reqs.push(
                    self.mpi
                        .irecv(op.peer, TAG_P2P, P2P_HEADER + op.mem.len * sz)
                        .map_err(mpi_err)?,
                );
            }
        }
        if !local.is_empty() {
            self.node.set_timeout(self.timeout)?;
            self.node
                .p2p_checked(&mut local)
                .map_err(|e| self.node_error(e, kind))?;
        }
        if reqs.is_empty() {
            return Ok(());
        }
        self.mpi_wait("send/recv between nodes", &mut reqs, 0, kind)?;
        let mut data: Vec<Option<Vec<u8>>> =
            reqs.into_iter().map(|r| Some(r.into_data())).collect();
        for (i, op) in recvs {
            let msg = data[i].take().unwrap_or_default();
            let sz = op.dtype.size();
            let (dtype, count) = match msg.get(..P2P_HEADER) {
                Some(h) => (
                    h[0],
                    u64::from_le_bytes(h[8..16].try_into().unwrap_or([0; 8])) as usize,
                ),
                None => (0, 0),
            };
            if dtype != op.dtype as u8 || count != op.mem.len {
                let theirs = Dtype::from_u8(dtype).map_or("?", |d| d.name());
                return Err(CommError::Mismatch {
                    seq: self.seq,
                    detail: format!(
                        "rank {} sent {count} {theirs} elements but rank {} receives {} {}",
                        op.peer,
                        self.rank,
                        op.mem.len,
                        op.dtype.name()
                    ),
                });
            }
            write_mem(op.mem, sz, 0, &msg[P2P_HEADER..]).map_err(bug)?;
        }
        Ok(())
    }
}

impl Backend for HierBackend {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Hier
    }

    fn describe(&self) -> String {
        format!(
            "nodes {} node {} local_rank {} of {} rails {} order {}",
            self.layout.nodes.len(),
            self.node_index,
            self.local,
            self.node_size(),
            self.layout.rails(),
            if self.layout.is_blocked() {
                "ranks"
            } else {
                "node-major"
            }
        )
    }

    fn run(&mut self, call: &Call) -> Result<(), CommError> {
        match call.kind {
            CollKind::AllReduce
            | CollKind::Reduce
            | CollKind::ReduceScatter
            | CollKind::Broadcast
            | CollKind::AllGather
            | CollKind::Barrier => self.collective(call),
            other => Err(CommError::Unsupported(format!(
                "{other} is not supported on the hierarchical backend (shared memory inside nodes, MPI between them); build it from all_gather, broadcast or send/recv, or run the job on one node"
            ))),
        }
    }

    fn p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        if let Some((by, reason)) = &self.failed {
            return Err(CommError::Aborted {
                by: *by,
                reason: format!("this communicator failed earlier ({reason}); the job cannot continue: restart it"),
            });
        }
        if ops.iter().any(|o| o.peer == ANY_SOURCE) {
            return Err(CommError::Unsupported(
                "recv_any (a receive from any source) is not supported on the hierarchical backend (shared memory inside nodes, MPI between them): receive from a named rank".into(),
            ));
        }
        let r = self.p2p_ops(ops);
        if let Err(e) = &r {
            if !matches!(e, CommError::Mismatch { .. }) {
                self.fail(e);
            }
        }
        r
    }

    fn reject(&mut self, kind: CollKind, dtype: Dtype, _reason: &CommError) {
        // Take part in the header phase with the refusal flag: the peers' matching call fails
        // with a mismatch naming this rank instead of waiting for it.
        let _ = self.begin(Header::refused(kind, dtype));
    }

    fn last_path(&self) -> crate::trace::CallPath {
        crate::trace::CallPath::Hier
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        Ok(())
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    fn set_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        self.timeout = timeout;
        Ok(())
    }
}

impl Drop for HierBackend {
    fn drop(&mut self) {
        // Give the failure notices a moment to leave, so the other nodes hear of the failure
        // rather than time out.
        if !self.notices.is_empty() {
            let mut notices = std::mem::take(&mut self.notices);
            let _ = self.mpi.poll(
                "failure notices",
                &mut notices,
                &mut [],
                Duration::from_secs(1),
            );
        }
    }
}
