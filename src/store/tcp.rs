//! The TCP rendezvous store: a length-prefixed binary protocol over `std::net`.
//!
//! Wire format (all integers little-endian):
//!
//! ```text
//! frame    = len:u32  body[len]                       (len <= MAX_FRAME)
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

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Store, StoreError};

/// Largest frame either side accepts (keys and values are small: host ids, NCCL unique ids).
pub const MAX_FRAME: usize = 1 << 20;
/// Protocol version sent in `HELLO`.
const VERSION: u32 = 1;
/// Time a fresh connection has to present its token.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once (one thread each); more are closed at once, and the clients'
/// retries find room once others finish. Jobs have at most a few thousand ranks.
const MAX_CONNECTIONS: usize = 8192;

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
            return Err(format!("message truncated: wanted {n} more bytes, {} left", self.0.len()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
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

/// The key-value map and the condition variable waiters sleep on. One mutex for everything: the
/// store sees a handful of requests per rank at start-up, never a hot path.
#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A running store server. Dropping it stops accepting connections (open ones finish their
/// current request and end when the client closes).
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer").field("addr", &self.addr).finish()
    }
}

impl StoreServer {
    /// Listen on `host:port` (port 0 picks a free one) and serve clients that present `token`,
    /// from a background thread.
    pub fn start(host: &str, port: u16, token: &str) -> Result<StoreServer, StoreError> {
        let addr = format!("{host}:{port}");
        let listener = match TcpListener::bind(&addr) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(StoreError::PortInUse { host: host.to_string(), port }),
            Err(e) => return Err(StoreError::Bind { addr, source: e }),
        };
        let local = listener.local_addr().map_err(|e| StoreError::Bind { addr: addr.clone(), source: e })?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let (stop2, shared2, token) = (stop.clone(), shared.clone(), token.as_bytes().to_vec());
        std::thread::Builder::new()
            .name("lockstep-store".into())
            .spawn(move || accept_loop(listener, stop2, shared2, Arc::new(token)))
            .map_err(|e| StoreError::Bind { addr, source: e })?;
        Ok(StoreServer { addr: local, stop, shared })
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
        // Wake the accept call so the thread sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>, shared: Arc<Shared>, token: Arc<Vec<u8>>) {
    let live = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            continue; // dropped: closed
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (shared, token, live2) = (shared.clone(), token.clone(), live.clone());
        // A failed spawn just drops this connection; the client sees it closed.
        let spawned = std::thread::Builder::new().name("lockstep-store-conn".into()).spawn(move || {
            serve(stream, &shared, &token);
            live2.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            live.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Serve one connection until it closes or misbehaves. Requests are answered in order; a `WAIT`
/// blocks only this connection's thread. The first request must authenticate within
/// `HELLO_TIMEOUT` (so port scanners and stuck peers do not hold threads forever); after that the
/// connection may idle as long as the job runs.
fn serve(mut s: TcpStream, shared: &Shared, token: &[u8]) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut authed = false;
    loop {
        let body = match read_frame(&mut s) {
            Ok(b) => b,
            Err(FrameError::Closed(_)) => return,
            Err(FrameError::TooLarge(n)) => {
                reject(&mut s, &format!("frame of {n} bytes exceeds the limit of {MAX_FRAME}"));
                return;
            }
        };
        let reply = if authed { handle(&body, shared) } else { hello(&body, token) };
        match reply {
            Ok(r) => {
                if !authed {
                    if r[0] != ST_OK {
                        let _ = write_frame(&mut s, &r);
                        return;
                    }
                    authed = true;
                    let _ = s.set_read_timeout(None);
                }
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

fn hello(body: &[u8], token: &[u8]) -> Result<Vec<u8>, String> {
    let mut c = Cursor(body);
    if c.u8()? != OP_HELLO {
        return Err("the first request must be HELLO with the job token".into());
    }
    let version = c.u32()?;
    let t = c.bytes()?;
    c.end()?;
    if version != VERSION {
        return Err(format!("protocol version {version} is not supported (server speaks {VERSION})"));
    }
    Ok(vec![if t == token { ST_OK } else { ST_BAD_TOKEN }])
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
                m = shared.changed.wait_timeout(m, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
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

impl TcpStore {
    /// Connect to `host:port` and present `token`, retrying refused or failed connections with
    /// exponential backoff (10 ms doubling to 1 s) for up to `connect_timeout`.
    ///
    /// Refused connections are the normal case while the node-0 launcher is still starting, so
    /// they are retried; a wrong token is not (retrying cannot fix it).
    pub fn connect(host: &str, port: u16, token: &str, connect_timeout: Duration) -> Result<TcpStore, StoreError> {
        let addr = format!("{host}:{port}");
        let start = Instant::now();
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u32;
        let stream = loop {
            attempts += 1;
            let err = match resolve(&addr) {
                Ok(sa) => match TcpStream::connect_timeout(&sa, Duration::from_secs(2)) {
                    Ok(s) => break s,
                    Err(e) => e,
                },
                Err(StoreError::Resolve { detail, .. }) if start.elapsed() < connect_timeout => std::io::Error::other(detail),
                Err(e) => return Err(e),
            };
            if start.elapsed() + backoff > connect_timeout {
                return Err(StoreError::Unreachable { addr, attempts, secs: start.elapsed().as_secs_f64(), source: err });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(1));
        };
        let _ = stream.set_nodelay(true);
        let mut st = TcpStore { stream, addr };
        let mut req = vec![OP_HELLO];
        req.extend_from_slice(&VERSION.to_le_bytes());
        put_bytes(&mut req, token.as_bytes());
        let r = st.request("hello", &req, Some(HELLO_TIMEOUT))?;
        match r[0] {
            ST_OK => Ok(st),
            ST_BAD_TOKEN => Err(StoreError::WrongToken { addr: st.addr }),
            s => Err(StoreError::Protocol(format!("unexpected HELLO reply status {s}"))),
        }
    }

    /// The server's `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Send one request and read its reply (status byte first, never empty). `timeout` bounds the
    /// wait for the reply so a vanished server turns into an error instead of a hang.
    fn request(&mut self, op: &'static str, body: &[u8], timeout: Option<Duration>) -> Result<Vec<u8>, StoreError> {
        self.stream.set_read_timeout(timeout).map_err(|e| StoreError::Io { op, source: e })?;
        write_frame(&mut self.stream, body).map_err(|e| StoreError::Io { op, source: e })?;
        let r = match read_frame(&mut self.stream) {
            Ok(r) => r,
            Err(FrameError::Closed(e)) => return Err(StoreError::Io { op, source: e }),
            Err(FrameError::TooLarge(n)) => return Err(StoreError::Protocol(format!("{op}: reply of {n} bytes exceeds the limit"))),
        };
        match r.first() {
            None => Err(StoreError::Protocol(format!("{op}: empty reply"))),
            Some(&ST_BAD_REQUEST) => {
                let msg = Cursor(&r[1..]).key().unwrap_or_else(|_| "(unreadable message)".into());
                Err(StoreError::Protocol(format!("{op} rejected by the server: {msg}")))
            }
            Some(_) => Ok(r),
        }
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, StoreError> {
    let mut it = addr.to_socket_addrs().map_err(|e| StoreError::Resolve { addr: addr.to_string(), detail: e.to_string() })?;
    it.next().ok_or_else(|| StoreError::Resolve { addr: addr.to_string(), detail: "no addresses".into() })
}

/// Requests carry small payloads; reject anything the server would refuse anyway, up front.
fn check_size(what: &str, n: usize) -> Result<(), StoreError> {
    if n > MAX_FRAME - 64 {
        return Err(StoreError::Protocol(format!("{what} of {n} bytes is too large for the rendezvous store (limit {MAX_FRAME})")));
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
            ST_OK => Ok(Some(Cursor(&r[1..]).bytes().map_err(StoreError::Protocol)?.to_vec())),
            ST_NOT_FOUND => Ok(None),
            s => Err(StoreError::Protocol(format!("unexpected GET reply status {s}"))),
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
            ST_TIMEOUT => Err(StoreError::Timeout { keys: keys.iter().map(|k| k.to_string()).collect(), secs: timeout.as_secs_f64() }),
            s => Err(StoreError::Protocol(format!("unexpected WAIT reply status {s}"))),
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
