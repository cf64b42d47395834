//! The TCP rendezvous store: a length-prefixed binary protocol over `std::net`.
//!
//! Wire format (all integers little-endian):
//!
//! ```text
//! frame    = len:u32  body[len]                       (len <= MAX_FRAME; <= MAX_HELLO_FRAME before HELLO)
//! request  = op:u8 args...            response = status:u8 payload...
//! bytes    = n:u32 data[n]
//! HELLO    = 1 version:u32 token:bytes               -> OK | BAD_TOKEN
//! SET      = 2 key:bytes value:bytes                 -> OK
//! GET      = 3 key:bytes                             -> OK value:bytes | NOT_FOUND
//! WAIT     = 4 timeout_ms:u64 n:u32 key:bytes*n      -> OK | TIMEOUT
//! ADD      = 5 key:bytes delta:i64                   -> OK value:i64
//! ```
//!
//! The first request of a connection must be `HELLO` with the job's token. A malformed or
//! oversized request gets `BAD_REQUEST message:bytes` and the connection is closed; the server
//! keeps serving everyone else.
//!
//! The port is open to anyone who can reach it, so the server spends next to nothing on a peer
//! before it has shown the token: one thread (the gatekeeper) multiplexes every unauthenticated
//! connection with `poll`, holds at most [`ServerLimits::max_pending`] of them (the oldest is
//! closed for a newcomer), buffers at most one [`MAX_HELLO_FRAME`]-byte frame each, and closes
//! any that has not completed the handshake within [`ServerLimits::handshake_timeout`] of being
//! accepted (a deadline for the whole handshake, so trickling bytes does not extend it). After a
//! wrong token, the next token from the same source (IPv4 address or IPv6 /64) is checked no
//! earlier than [`ServerLimits::wrong_token_delay`] later, however many connections it opens.
//! Only an authenticated connection gets its own thread and may send frames up to [`MAX_FRAME`].
//! When `accept` fails for lack of descriptors or memory, the gatekeeper stops listening for a
//! growing pause instead of spinning on the ever-ready listener; authenticated connections are
//! served by their own threads meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::token::{tokens_equal, validate_token, MAX_TOKEN_LEN};
use super::{Store, StoreError};

/// Largest frame either side accepts once authenticated (keys and values are small: host ids,
/// NCCL unique ids).
pub const MAX_FRAME: usize = 1 << 20;
/// Largest frame a peer may send before it has authenticated: a HELLO with the longest token
/// (op, version, length and [`MAX_TOKEN_LEN`] bytes) fits with room to spare.
pub const MAX_HELLO_FRAME: usize = 512;
const _: () = assert!(1 + 4 + 4 + MAX_TOKEN_LEN <= MAX_HELLO_FRAME);
/// Longest answer to HELLO a client accepts: a status byte or a short error message. Anything
/// longer comes from something that is not a lockstep store.
const MAX_HELLO_REPLY: usize = 4096;
/// Protocol version sent in `HELLO`.
const VERSION: u32 = 1;
/// Sources whose wrong-token delay is tracked one by one; past this many (a distributed guessing
/// attack), new sources share one delay.
const MAX_GATED_SOURCES: usize = 4096;
/// Longest pause of the accept loop after `accept` failed for lack of resources.
const MAX_ACCEPT_PAUSE: Duration = Duration::from_millis(500);
/// Out of descriptors, an unauthenticated connection pending at least this long is closed to
/// accept the next (younger ones may be real clients whose HELLO is still in flight).
const EVICT_GRACE: Duration = Duration::from_millis(100);
/// Connections accepted per gatekeeper round, so a flood cannot keep it from the handshakes it
/// already holds.
const ACCEPTS_PER_ROUND: usize = 256;
/// A client waits at least this long for the answer to HELLO, even when its rendezvous time is
/// almost spent (a store that is up answers in well under a millisecond).
const MIN_HELLO_WAIT: Duration = Duration::from_millis(250);

const OP_HELLO: u8 = 1;
const OP_SET: u8 = 2;
const OP_GET: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_ADD: u8 = 5;

const ST_OK: u8 = 0;
const ST_NOT_FOUND: u8 = 1;
const ST_TIMEOUT: u8 = 2;
const ST_BAD_TOKEN: u8 = 3;
const ST_BAD_REQUEST: u8 = 4;

// ------------------------------------------------------------------------------------------------
// Encoding helpers

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// A cursor over a received body; every getter fails cleanly on truncation.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "message truncated: wanted {n} more bytes, {} left",
                self.0.len()
            ));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn key(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "key is not UTF-8".to_string())
    }
    fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} trailing bytes after the request", self.0.len()))
        }
    }
}

/// Why reading a frame failed.
enum FrameError {
    /// The peer closed the connection (or the socket failed).
    Closed(std::io::Error),
    /// The announced length exceeds [`MAX_FRAME`].
    TooLarge(usize),
}

fn read_frame(s: &mut TcpStream) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(FrameError::Closed)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(FrameError::Closed)?;
    Ok(body)
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    s.write_all(&out)
}

// ------------------------------------------------------------------------------------------------
// Server

/// How much a [`StoreServer`] grants peers, above all those that have not shown the token yet.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Time from accepting a connection to a complete HELLO (default 10 s). It bounds the whole
    /// handshake, not each read: a peer trickling bytes is closed when it runs out.
    pub handshake_timeout: Duration,
    /// Unauthenticated connections held at once (default 512); a newcomer beyond that closes the
    /// oldest. Each costs a descriptor and at most [`MAX_HELLO_FRAME`] bytes of buffer.
    pub max_pending: usize,
    /// After a wrong token, further tokens from the same source are checked no earlier than this
    /// much later (default 100 ms, so at most 10 guesses a second per source, however many
    /// connections it opens). A first wrong token is answered at once.
    pub wrong_token_delay: Duration,
    /// Authenticated connections served at once (default 8192, one thread each; jobs have at most
    /// a few thousand ranks); a further client is told the store is full.
    pub max_connections: usize,
}

impl Default for ServerLimits {
    fn default() -> ServerLimits {
        ServerLimits {
            handshake_timeout: Duration::from_secs(10),
            max_pending: 512,
            wrong_token_delay: Duration::from_millis(100),
            max_connections: 8192,
        }
    }
}

/// The key-value map and the condition variable waiters sleep on. One mutex for everything: the
/// store sees a handful of requests per rank at start-up, never a hot path.
#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A running store server. Dropping it stops accepting connections and closes those that have
/// not authenticated (authenticated ones finish their current request and end when the client
/// closes).
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    gatekeeper: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl StoreServer {
    /// Listen on `host:port` (port 0 picks a free one) and serve clients that present `token`,
    /// from background threads, with the default [`ServerLimits`].
    pub fn start(host: &str, port: u16, token: &str) -> Result<StoreServer, StoreError> {
        StoreServer::start_with_limits(host, port, token, ServerLimits::default())
    }

    /// [`start`](StoreServer::start) with explicit limits (tests shorten the handshake deadline).
    pub fn start_with_limits(
        host: &str,
        port: u16,
        token: &str,
        limits: ServerLimits,
    ) -> Result<StoreServer, StoreError> {
        validate_token(token)?;
        if limits.max_pending == 0
            || limits.max_connections == 0
            || limits.handshake_timeout.is_zero()
        {
            return Err(StoreError::Limits(format!(
                "max_pending, max_connections and handshake_timeout must all be above zero, got {limits:?}"
            )));
        }
        let addr = format!("{host}:{port}");
        let listener = match TcpListener::bind(&addr) {
            Ok(l) => l,
            Err(e) if e.kind() == ErrorKind::AddrInUse => {
                return Err(StoreError::PortInUse {
                    host: host.to_string(),
                    port,
                })
            }
            Err(e) => return Err(StoreError::Bind { addr, source: e }),
        };
        let local = listener.local_addr().map_err(|e| StoreError::Bind {
            addr: addr.clone(),
            source: e,
        })?;
        // Non-blocking so one `poll` serves the listener and every pending handshake, and an
        // accept loop ends when the queue is empty.
        listener
            .set_nonblocking(true)
            .map_err(|e| StoreError::Bind {
                addr: addr.clone(),
                source: e,
            })?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let gk = Gatekeeper {
            listener,
            token: token.as_bytes().to_vec(),
            limits,
            shared: shared.clone(),
            stop: stop.clone(),
            live: Arc::new(AtomicUsize::new(0)),
            pending: BTreeMap::new(),
            next_id: 0,
            gates: HashMap::new(),
            paused_until: None,
            pause: Duration::ZERO,
        };
        let gatekeeper = std::thread::Builder::new()
            .name("lockstep-store".into())
            .spawn(move || gk.run())
            .map_err(|e| StoreError::Bind { addr, source: e })?;
        Ok(StoreServer {
            addr: local,
            stop,
            shared,
            gatekeeper: Some(gatekeeper),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Set a key directly in the server's map (the hosting launcher uses this for the job id).
    pub fn set_local(&self, key: &str, value: &[u8]) {
        let mut m = self.shared.map.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(key.to_string(), value.to_vec());
        self.shared.changed.notify_all();
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the gatekeeper's poll so it sees the flag now rather than at its next timeout
        // (at most a few hundred ms), then wait for it so the port is closed when this returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
        if let Some(t) = self.gatekeeper.take() {
            let _ = t.join();
        }
    }
}

/// Where a connection comes from, for the wrong-token delay: an IPv4 address, or an IPv6 /64
/// (one host usually owns a whole /64, so counting single IPv6 addresses would be no limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    V4([u8; 4]),
    V6([u8; 8]),
    /// Every source not tracked one by one once [`MAX_GATED_SOURCES`] are.
    Overflow,
}

impl Source {
    fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(a) => Source::V4(a.octets()),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => Source::V4(v4.octets()),
                None => Source::V6(a.octets()[..8].try_into().expect("8 bytes")),
            },
        }
    }
}

/// A connection that has not authenticated yet.
struct Pending {
    stream: TcpStream,
    source: Source,
    /// When it was accepted (the handshake deadline runs from here).
    accepted: Instant,
    /// The HELLO frame as received so far (length prefix included), at most
    /// `4 + MAX_HELLO_FRAME` bytes.
    buf: Vec<u8>,
    /// The body length, once the prefix is in.
    body_len: Option<usize>,
}

impl Pending {
    fn complete(&self) -> bool {
        self.body_len.is_some_and(|n| self.buf.len() == 4 + n)
    }
}

/// What reading from a pending connection came to.
enum ReadState {
    /// More bytes are needed (none available now).
    Waiting,
    /// The HELLO frame is complete.
    Complete,
    /// The peer closed the connection or it failed.
    Closed,
    /// The announced frame is larger than [`MAX_HELLO_FRAME`].
    TooLarge(usize),
}

/// The thread that accepts connections and runs every handshake (see the module docs).
struct Gatekeeper {
    listener: TcpListener,
    token: Vec<u8>,
    limits: ServerLimits,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    /// Authenticated connections being served.
    live: Arc<AtomicUsize>,
    /// Unauthenticated connections by arrival number (so the first entry is the oldest).
    pending: BTreeMap<u64, Pending>,
    next_id: u64,
    /// Per source: no token is checked before this instant (set by a wrong token).
    gates: HashMap<Source, Instant>,
    /// The listener is left out of `poll` until then (after `accept` failed for lack of
    /// resources).
    paused_until: Option<Instant>,
    /// The current pause length, doubling while `accept` keeps failing.
    pause: Duration,
}

impl Gatekeeper {
    fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            self.expire(now);
            self.check_hellos(now);
            let listen = self.paused_until.is_none_or(|t| now >= t);
            // Sleep until the next deadline, gate opening or end of pause, and at least every
            // 250 ms to notice `stop`.
            let mut wake = now + Duration::from_millis(250);
            for p in self.pending.values() {
                wake = wake.min(p.accepted + self.limits.handshake_timeout);
                if p.complete() {
                    if let Some(g) = self.gate(p.source) {
                        wake = wake.min(g);
                    }
                }
            }
            if let Some(t) = self.paused_until.filter(|_| !listen) {
                wake = wake.min(t);
            }
            // Round up, so the loop does not wake a fraction of a millisecond early again and again.
            let ms = wake
                .saturating_duration_since(now)
                .as_micros()
                .div_ceil(1000)
                .clamp(1, 250) as u16;
            // Complete handshakes wait for their gate, not for bytes: polling them would spin on
            // their readable (or hung-up) sockets.
            let ids: Vec<u64> = self
                .pending
                .iter()
                .filter(|(_, p)| !p.complete())
                .map(|(id, _)| *id)
                .collect();
            let (listener_ready, readable) = {
                let mut fds = Vec::with_capacity(ids.len() + 1);
                if listen {
                    fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                }
                for id in &ids {
                    fds.push(PollFd::new(
                        self.pending[id].stream.as_fd(),
                        PollFlags::POLLIN,
                    ));
                }
                match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        // Only EINVAL/ENOMEM are possible; do not spin on them.
                        tracing::warn!("rendezvous store: poll failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                }
                let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
                let off = usize::from(listen);
                let readable: Vec<u64> = ids
                    .iter()
                    .zip(&fds[off..])
                    .filter(|(_, f)| ready(f))
                    .map(|(id, _)| *id)
                    .collect();
                (listen && ready(&fds[0]), readable)
            };
            for id in readable {
                self.read_pending(id);
            }
            if listener_ready {
                self.accept_some();
            }
        }
    }

    /// The instant before which no token from `source` is checked, if that is still ahead.
    fn gate(&self, source: Source) -> Option<Instant> {
        let g = self.gates.get(&source).or_else(|| {
            (self.gates.len() >= MAX_GATED_SOURCES)
                .then(|| self.gates.get(&Source::Overflow))
                .flatten()
        });
        g.copied()
    }

    /// Accept what is queued (up to [`ACCEPTS_PER_ROUND`]).
    fn accept_some(&mut self) {
        for _ in 0..ACCEPTS_PER_ROUND {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    self.pause = Duration::ZERO;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let id = self.next_id;
                    self.next_id += 1;
                    let now = Instant::now();
                    let p = Pending {
                        stream,
                        source: Source::of(peer.ip()),
                        accepted: now,
                        buf: Vec::new(),
                        body_len: None,
                    };
                    self.pending.insert(id, p);
                    if self.pending.len() > self.limits.max_pending {
                        // The oldest has had the longest to authenticate; a real client sends its
                        // HELLO right after connecting, so it is the flood that is oldest.
                        self.pending.pop_first();
                    }
                    // A client sends HELLO with its connect: read and check it now, before more
                    // arrivals could push it out.
                    self.read_pending(id);
                    if self.pending.get(&id).is_some_and(Pending::complete) {
                        self.check_hello(id, now);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // Out of descriptors (EMFILE/ENFILE) or memory. An unauthenticated connection
                    // that has had its chance gives its descriptor to the next in line (as when
                    // `max_pending` is reached); one accepted just now may still be waiting for
                    // its HELLO to arrive, and is kept.
                    let oldest = self
                        .pending
                        .first_key_value()
                        .filter(|(_, p)| p.accepted.elapsed() >= EVICT_GRACE)
                        .map(|(id, _)| *id);
                    if let (Some(libc::EMFILE), Some(id)) = (e.raw_os_error(), oldest) {
                        self.pending.remove(&id);
                        continue;
                    }
                    // Otherwise the connection stays queued in the kernel, and the listener
                    // would poll ready again at once: stop listening for a doubling pause.
                    self.pause =
                        (self.pause * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_PAUSE);
                    if self.pause == Duration::from_millis(10) {
                        tracing::warn!(
                            "rendezvous store: cannot accept connections ({e}); retrying with pauses of up to {MAX_ACCEPT_PAUSE:?}"
                        );
                    }
                    self.paused_until = Some(Instant::now() + self.pause);
                    return;
                }
            }
        }
    }

    /// Read what has arrived on pending connection `id`, closing it on error or oversize.
    fn read_pending(&mut self, id: u64) {
        let Some(p) = self.pending.get_mut(&id) else {
            return;
        };
        match read_hello_bytes(p) {
            ReadState::Waiting | ReadState::Complete => {}
            ReadState::Closed => {
                self.pending.remove(&id);
            }
            ReadState::TooLarge(n) => {
                if let Some(p) = self.pending.remove(&id) {
                    reject_pending(
                        p.stream,
                        &format!("frame of {n} bytes exceeds the limit of {MAX_HELLO_FRAME} before authentication (the first request must be HELLO with the job token)"),
                    );
                }
            }
        }
    }

    /// Close the connections whose handshake deadline has passed.
    fn expire(&mut self, now: Instant) {
        let timeout = self.limits.handshake_timeout;
        let late: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.accepted + timeout <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            if let Some(p) = self.pending.remove(&id) {
                let secs = self.limits.handshake_timeout.as_secs_f64();
                reject_pending(
                    p.stream,
                    &format!("the handshake was not completed within {secs:.1} s of connecting"),
                );
            }
        }
    }

    /// Check the complete HELLOs whose source is not held back by an earlier wrong token, oldest
    /// first.
    fn check_hellos(&mut self, now: Instant) {
        if self.gates.len() >= MAX_GATED_SOURCES / 2 {
            self.gates.retain(|_, t| *t > now);
        }
        let ready: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.complete())
            .map(|(id, _)| *id)
            .collect();
        for id in ready {
            self.check_hello(id, now);
        }
    }

    /// Check the complete HELLO of pending connection `id` unless its source is held back by an
    /// earlier wrong token; admit it, answer BAD_TOKEN, or reject it.
    fn check_hello(&mut self, id: u64, now: Instant) {
        let Some(source) = self.pending.get(&id).map(|p| p.source) else {
            return;
        };
        // A wrong token just now from the same source holds back the rest of its queue.
        if self.gate(source).is_some_and(|g| g > now) {
            return;
        }
        let Some(mut p) = self.pending.remove(&id) else {
            return;
        };
        match parse_hello(&p.buf[4..]) {
            Err(msg) => reject_pending(p.stream, &msg),
            Ok(t) if tokens_equal(&self.token, t) => self.admit(p.stream),
            Ok(_) => {
                let first = !self.gates.contains_key(&source);
                let key = if first && self.gates.len() >= MAX_GATED_SOURCES {
                    Source::Overflow
                } else {
                    source
                };
                self.gates.insert(key, now + self.limits.wrong_token_delay);
                let peer = p
                    .stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into());
                if first {
                    tracing::warn!("rendezvous store: {peer} presented a wrong token (further tries from there are throttled)");
                } else {
                    tracing::debug!("rendezvous store: {peer} presented a wrong token again");
                }
                let _ = write_frame(&mut p.stream, &[ST_BAD_TOKEN]);
            }
        }
    }

    /// Serve an authenticated connection from a thread of its own.
    fn admit(&mut self, mut stream: TcpStream) {
        let limit = self.limits.max_connections;
        if self.live.load(Ordering::SeqCst) >= limit {
            reject_pending(
                stream,
                &format!("the store is serving its limit of {limit} connections; try again later"),
            );
            return;
        }
        if stream.set_nonblocking(false).is_err() {
            return;
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        let (shared, live) = (self.shared.clone(), self.live.clone());
        let spawned = std::thread::Builder::new()
            .name("lockstep-store-conn".into())
            .spawn(move || {
                if write_frame(&mut stream, &[ST_OK]).is_ok() {
                    serve(stream, &shared);
                }
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            // The closure, and with it the connection, is gone: the client sees it closed
            // without an answer and retries.
            self.live.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                "rendezvous store: cannot start a thread for an authenticated connection: {e}"
            );
        }
    }
}

/// Read from a non-blocking pending connection until the HELLO frame is complete or no more
/// bytes are available; never more than the frame.
fn read_hello_bytes(p: &mut Pending) -> ReadState {
    let mut tmp = [0u8; 4 + MAX_HELLO_FRAME];
    loop {
        let want = 4 + p.body_len.unwrap_or(0) - p.buf.len();
        if want == 0 {
            return ReadState::Complete;
        }
        match p.stream.read(&mut tmp[..want]) {
            Ok(0) => return ReadState::Closed,
            Ok(k) => {
                p.buf.extend_from_slice(&tmp[..k]);
                if p.body_len.is_none() && p.buf.len() == 4 {
                    let n = u32::from_le_bytes(p.buf[..4].try_into().expect("4 bytes")) as usize;
                    if n > MAX_HELLO_FRAME {
                        return ReadState::TooLarge(n);
                    }
                    p.body_len = Some(n);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return ReadState::Waiting,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return ReadState::Closed,
        }
    }
}

/// Answer a pending (non-blocking) connection with `BAD_REQUEST msg` and close it. Bytes the peer
/// already sent are drained first (up to 64 KiB), because closing a socket with unread data
/// makes the kernel reset the connection, and the peer would lose the message.
fn reject_pending(mut s: TcpStream, msg: &str) {
    reject(&mut s, msg);
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// Serve one authenticated connection until it closes or misbehaves. Requests are answered in
/// order; a `WAIT` blocks only this connection's thread. The connection may idle as long as the
/// job runs.
fn serve(mut s: TcpStream, shared: &Shared) {
    loop {
        let body = match read_frame(&mut s) {
            Ok(b) => b,
            Err(FrameError::Closed(_)) => return,
            Err(FrameError::TooLarge(n)) => {
                reject(
                    &mut s,
                    &format!("frame of {n} bytes exceeds the limit of {MAX_FRAME}"),
                );
                return;
            }
        };
        match handle(&body, shared) {
            Ok(r) => {
                if write_frame(&mut s, &r).is_err() {
                    return;
                }
            }
            Err(msg) => {
                reject(&mut s, &msg);
                return;
            }
        }
    }
}

fn reject(s: &mut TcpStream, msg: &str) {
    let mut r = vec![ST_BAD_REQUEST];
    put_bytes(&mut r, msg.as_bytes());
    let _ = write_frame(s, &r);
}

/// The token of a well-formed HELLO of this protocol version.
fn parse_hello(body: &[u8]) -> Result<&[u8], String> {
    let mut c = Cursor(body);
    if c.u8()? != OP_HELLO {
        return Err("the first request must be HELLO with the job token".into());
    }
    let version = c.u32()?;
    let t = c.bytes()?;
    c.end()?;
    if version != VERSION {
        return Err(format!(
            "protocol version {version} is not supported (server speaks {VERSION})"
        ));
    }
    Ok(t)
}

fn handle(body: &[u8], shared: &Shared) -> Result<Vec<u8>, String> {
    let mut c = Cursor(body);
    let op = c.u8()?;
    let lock = || shared.map.lock().unwrap_or_else(|p| p.into_inner());
    match op {
        OP_SET => {
            let key = c.key()?;
            let value = c.bytes()?.to_vec();
            c.end()?;
            lock().insert(key, value);
            shared.changed.notify_all();
            Ok(vec![ST_OK])
        }
        OP_GET => {
            let key = c.key()?;
            c.end()?;
            Ok(match lock().get(&key) {
                Some(v) => {
                    let mut r = vec![ST_OK];
                    put_bytes(&mut r, v);
                    r
                }
                None => vec![ST_NOT_FOUND],
            })
        }
        OP_WAIT => {
            let timeout = Duration::from_millis(c.u64()?.min(7 * 24 * 3600 * 1000));
            let n = c.u32()? as usize;
            let mut keys = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                keys.push(c.key()?);
            }
            c.end()?;
            // Sleep on the condition variable; every SET/ADD wakes all waiters to re-check.
            let deadline = Instant::now() + timeout;
            let mut m = lock();
            loop {
                if keys.iter().all(|k| m.contains_key(k)) {
                    return Ok(vec![ST_OK]);
                }
                let now = Instant::now();
                if now >= deadline {
                    return Ok(vec![ST_TIMEOUT]);
                }
                m = shared
                    .changed
                    .wait_timeout(m, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        OP_ADD => {
            // Counters are stored as 8 little-endian bytes, so GET reads them too.
            let key = c.key()?;
            let delta = c.u64()? as i64;
            c.end()?;
            let mut m = lock();
            let cur = match m.get(&key) {
                None => 0,
                Some(v) if v.len() == 8 => i64::from_le_bytes(v[..].try_into().expect("8 bytes")),
                Some(_) => return Err(format!("key {key:?} holds a value that is not a counter")),
            };
            let new = cur.wrapping_add(delta);
            m.insert(key, new.to_le_bytes().to_vec());
            shared.changed.notify_all();
            let mut r = vec![ST_OK];
            r.extend_from_slice(&new.to_le_bytes());
            Ok(r)
        }
        OP_HELLO => Err("HELLO sent twice".into()),
        other => Err(format!("unknown request type {other}")),
    }
}

// ------------------------------------------------------------------------------------------------
// Client

/// A connection to a [`StoreServer`].
#[derive(Debug)]
pub struct TcpStore {
    stream: TcpStream,
    addr: String,
}

/// Why a handshake attempt failed.
enum HelloError {
    /// The peer closed (or reset) the connection before answering anything: a store that is
    /// shedding load does that, so the attempt is repeated.
    Closed(std::io::Error),
    /// An answer that settles it: wrong token, not a store, a rejected request.
    Final(StoreError),
}

impl TcpStore {
    /// Connect to `host:port` and present `token`, all within `connect_timeout` (the rendezvous
    /// timeout). Refused or failed connections are retried with exponential backoff (10 ms
    /// doubling to 1 s): that is the normal case while the node-0 launcher is still starting. A
    /// wrong token is not retried (retrying cannot fix it), nor is a peer that accepts the
    /// connection but answers garbage or nothing: that is [`StoreError::NotStore`], reported
    /// at the latest when `connect_timeout` runs out.
    pub fn connect(
        host: &str,
        port: u16,
        token: &str,
        connect_timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        validate_token(token)?;
        let addr = format!("{host}:{port}");
        let start = Instant::now();
        let deadline = start + connect_timeout;
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u32;
        let mut closed = 0u32;
        loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let (err, was_closed) = match resolve(&addr) {
                Ok(sa) => match TcpStream::connect_timeout(
                    &sa,
                    left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
                ) {
                    Ok(s) => match handshake(s, &addr, token, deadline) {
                        Ok(st) => return Ok(st),
                        Err(HelloError::Final(e)) => return Err(e),
                        Err(HelloError::Closed(e)) => {
                            closed += 1;
                            (e, true)
                        }
                    },
                    Err(e) => (e, false),
                },
                Err(StoreError::Resolve { detail, .. }) if start.elapsed() < connect_timeout => {
                    (std::io::Error::other(detail), false)
                }
                Err(e) => return Err(e),
            };
            if Instant::now() + backoff > deadline {
                let secs = start.elapsed().as_secs_f64();
                if was_closed {
                    return Err(StoreError::NotStore {
                        addr,
                        detail: format!(
                            "it accepted {closed} of {attempts} connection attempts over {secs:.1} s but closed each without answering the handshake (last: {err}); if it is a lockstep store, it is overloaded"
                        ),
                    });
                }
                return Err(StoreError::Unreachable {
                    addr,
                    attempts,
                    secs,
                    source: err,
                });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// The server's `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Send one request and read its reply (status byte first, never empty). `timeout` bounds the
    /// wait for the reply so a vanished server turns into an error instead of a hang.
    fn request(
        &mut self,
        op: &'static str,
        body: &[u8],
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, StoreError> {
        self.stream
            .set_read_timeout(timeout)
            .map_err(|e| StoreError::Io { op, source: e })?;
        write_frame(&mut self.stream, body).map_err(|e| StoreError::Io { op, source: e })?;
        let r = match read_frame(&mut self.stream) {
            Ok(r) => r,
            Err(FrameError::Closed(e)) => return Err(StoreError::Io { op, source: e }),
            Err(FrameError::TooLarge(n)) => {
                return Err(StoreError::Protocol(format!(
                    "{op}: reply of {n} bytes exceeds the limit"
                )))
            }
        };
        match r.first() {
            None => Err(StoreError::Protocol(format!("{op}: empty reply"))),
            Some(&ST_BAD_REQUEST) => {
                let msg = Cursor(&r[1..])
                    .key()
                    .unwrap_or_else(|_| "(unreadable message)".into());
                Err(StoreError::Protocol(format!(
                    "{op} rejected by the server: {msg}"
                )))
            }
            Some(_) => Ok(r),
        }
    }
}

/// Present `token` on a fresh connection and read the answer, all by `deadline` (but allowing at
/// least [`MIN_HELLO_WAIT`]): a deadline for the whole answer, not per read, so a peer that
/// trickles bytes cannot hold the client past it either.
fn handshake(
    mut s: TcpStream,
    addr: &str,
    token: &str,
    deadline: Instant,
) -> Result<TcpStore, HelloError> {
    let until = deadline.max(Instant::now() + MIN_HELLO_WAIT);
    let not_store = |detail: String| {
        HelloError::Final(StoreError::NotStore {
            addr: addr.to_string(),
            detail,
        })
    };
    let _ = s.set_nodelay(true);
    let mut req = vec![OP_HELLO];
    req.extend_from_slice(&VERSION.to_le_bytes());
    put_bytes(&mut req, token.as_bytes());
    let _ = s.set_write_timeout(Some(
        until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ));
    // A few dozen bytes into a fresh socket's empty buffer: a failure means the peer is gone.
    write_frame(&mut s, &req).map_err(HelloError::Closed)?;
    let waited = |t0: Instant| t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mut head = [0u8; 4];
    match read_until(&mut s, &mut head, until) {
        Ok(()) => {}
        Err((0, e)) if e.kind() == ErrorKind::TimedOut => {
            return Err(not_store(format!(
                "it accepted the connection but sent no answer to the handshake in {:.1} s",
                waited(t0)
            )))
        }
        Err((0, e)) => return Err(HelloError::Closed(e)),
        Err((k, e)) => {
            return Err(not_store(format!(
                "it sent {k} byte(s) ({:?}) and then {e} instead of a store reply",
                String::from_utf8_lossy(&head[..k])
            )))
        }
    }
    let n = u32::from_le_bytes(head) as usize;
    if n == 0 || n > MAX_HELLO_REPLY {
        return Err(not_store(format!(
            "its answer begins {:?}, which is not a lockstep store reply",
            String::from_utf8_lossy(&head)
        )));
    }
    let mut r = vec![0u8; n];
    if let Err((k, e)) = read_until(&mut s, &mut r, until) {
        return Err(not_store(format!(
            "its answer announced {n} bytes, but only {k} came before {e}"
        )));
    }
    let _ = s.set_write_timeout(None);
    let reject = |r: &[u8]| {
        Cursor(r)
            .key()
            .unwrap_or_else(|_| "(unreadable message)".into())
    };
    match r[0] {
        ST_OK if n == 1 => Ok(TcpStore {
            stream: s,
            addr: addr.to_string(),
        }),
        ST_BAD_TOKEN if n == 1 => Err(HelloError::Final(StoreError::WrongToken {
            addr: addr.to_string(),
        })),
        ST_BAD_REQUEST => Err(HelloError::Final(StoreError::Protocol(format!(
            "hello rejected by the server: {}",
            reject(&r[1..])
        )))),
        _ => Err(not_store(format!(
            "its answer ({n} bytes beginning {:?}) is not a lockstep store reply",
            String::from_utf8_lossy(&r[..n.min(16)])
        ))),
    }
}

/// Fill `buf` from `s` by `until`. On failure: how many bytes came, and why it stopped
/// (`TimedOut` at the deadline, `UnexpectedEof` when the peer closed).
fn read_until(
    s: &mut TcpStream,
    buf: &mut [u8],
    until: Instant,
) -> Result<(), (usize, std::io::Error)> {
    let mut got = 0;
    while got < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err((got, ErrorKind::TimedOut.into()));
        }
        s.set_read_timeout(Some(left)).map_err(|e| (got, e))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err((got, ErrorKind::UnexpectedEof.into())),
            Ok(k) => got += k,
            // A socket read timeout shows as WouldBlock (EAGAIN); the loop checks the deadline.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err((got, e)),
        }
    }
    Ok(())
}

fn resolve(addr: &str) -> Result<SocketAddr, StoreError> {
    let mut it = addr.to_socket_addrs().map_err(|e| StoreError::Resolve {
        addr: addr.to_string(),
        detail: e.to_string(),
    })?;
    it.next().ok_or_else(|| StoreError::Resolve {
        addr: addr.to_string(),
        detail: "no addresses".into(),
    })
}

/// Requests carry small payloads; reject anything the server would refuse anyway, up front.
fn check_size(what: &str, n: usize) -> Result<(), StoreError> {
    if n > MAX_FRAME - 64 {
        return Err(StoreError::Protocol(format!(
            "{what} of {n} bytes is too large for the rendezvous store (limit {MAX_FRAME})"
        )));
    }
    Ok(())
}

impl Store for TcpStore {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_size("key and value", key.len() + value.len())?;
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.request("set", &req, Some(Duration::from_secs(30)))?;
        Ok(())
    }

    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_size("key", key.len())?;
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes());
        let r = self.request("get", &req, Some(Duration::from_secs(30)))?;
        match r[0] {
            ST_OK => Ok(Some(
                Cursor(&r[1..])
                    .bytes()
                    .map_err(StoreError::Protocol)?
                    .to_vec(),
            )),
            ST_NOT_FOUND => Ok(None),
            s => Err(StoreError::Protocol(format!(
                "unexpected GET reply status {s}"
            ))),
        }
    }

    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let mut req = vec![OP_WAIT];
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, k.as_bytes());
        }
        check_size("wait request", req.len())?;
        let r = self.request("wait", &req, Some(timeout + Duration::from_secs(10)))?;
        match r[0] {
            ST_OK => Ok(()),
            ST_TIMEOUT => Err(StoreError::Timeout {
                keys: keys.iter().map(|k| k.to_string()).collect(),
                secs: timeout.as_secs_f64(),
            }),
            s => Err(StoreError::Protocol(format!(
                "unexpected WAIT reply status {s}"
            ))),
        }
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_size("key", key.len())?;
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        let r = self.request("add", &req, Some(Duration::from_secs(30)))?;
        let v = Cursor(&r[1..]).u64().map_err(StoreError::Protocol)?;
        Ok(v as i64)
    }
}
