//! The TCP rendezvous store's protocol: a length-prefixed binary format over `std::net`, shared by
//! the server (`server.rs`) and the client (`client.rs`).
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

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::token::MAX_TOKEN_LEN;

/// Largest frame either side accepts once authenticated (keys and values are small: host ids,
/// NCCL unique ids).
pub const MAX_FRAME: usize = 1 << 20;
/// Largest frame a peer may send before it has authenticated: a HELLO with the longest token
/// (op, version, length and [`MAX_TOKEN_LEN`] bytes) fits with room to spare.
pub const MAX_HELLO_FRAME: usize = 512;
const _: () = assert!(1 + 4 + 4 + MAX_TOKEN_LEN <= MAX_HELLO_FRAME);
/// Longest answer to HELLO a client accepts: a status byte or a short error message. Anything
/// longer comes from something that is not a lockstep store.
pub(super) const MAX_HELLO_REPLY: usize = 4096;
/// Protocol version sent in `HELLO`.
pub(super) const VERSION: u32 = 1;
/// Sources whose wrong-token delay is tracked one by one; past this many (a distributed guessing
/// attack), new sources share one delay.
pub(super) const MAX_GATED_SOURCES: usize = 4096;
/// Longest pause of the accept loop after `accept` failed for lack of resources.
pub(super) const MAX_ACCEPT_PAUSE: Duration = Duration::from_millis(500);
/// Out of descriptors, an unauthenticated connection pending at least this long is closed to
/// accept the next (younger ones may be real clients whose HELLO is still in flight).
pub(super) const EVICT_GRACE: Duration = Duration::from_millis(100);
/// Connections accepted per gatekeeper round, so a flood cannot keep it from the handshakes it
/// already holds.
pub(super) const ACCEPTS_PER_ROUND: usize = 256;
/// A client waits at least this long for the answer to HELLO, even when its rendezvous time is
/// almost spent (a store that is up answers in well under a millisecond).
pub(super) const MIN_HELLO_WAIT: Duration = Duration::from_millis(250);

pub(super) const OP_HELLO: u8 = 1;
pub(super) const OP_SET: u8 = 2;
pub(super) const OP_GET: u8 = 3;
pub(super) const OP_WAIT: u8 = 4;
pub(super) const OP_ADD: u8 = 5;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_NOT_FOUND: u8 = 1;
pub(super) const ST_TIMEOUT: u8 = 2;
pub(super) const ST_BAD_TOKEN: u8 = 3;
pub(super) const ST_BAD_REQUEST: u8 = 4;

pub(super) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// A cursor over a received body; every getter fails cleanly on truncation.
pub(super) struct Cursor<'a>(pub(super) &'a [u8]);

impl<'a> Cursor<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
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
    pub(super) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub(super) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(super) fn key(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "key is not UTF-8".to_string())
    }
    pub(super) fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} trailing bytes after the request", self.0.len()))
        }
    }
}

/// Why reading a frame failed.
pub(super) enum FrameError {
    /// The peer closed the connection (or the socket failed).
    Closed(std::io::Error),
    /// The announced length exceeds [`MAX_FRAME`].
    TooLarge(usize),
}

pub(super) fn read_frame(s: &mut TcpStream) -> Result<Vec<u8>, FrameError> {
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

pub(super) fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    s.write_all(&out)
}
