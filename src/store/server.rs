//! The store's server: [`StoreServer`], hosted by the node-0 launcher, with the gatekeeper that
//! holds unauthenticated peers to a small budget (the rules are in the protocol's documentation,
//! `wire.rs`).

use std::collections::{BTreeMap, HashMap};
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::token::{tokens_equal, validate_token};
use super::wire::*;
use super::StoreError;

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
