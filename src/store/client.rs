//! The store's client: [`TcpStore`], a connection to a [`StoreServer`](super::StoreServer)
//! that has shown the job token.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::token::validate_token;
use super::wire::*;
use super::{Store, StoreError};

/// A connection to a [`StoreServer`](super::StoreServer).
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
