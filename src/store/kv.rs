//! The [`Store`] trait every rendezvous store implements, and [`StoreError`].

use std::time::Duration;

/// Errors of the rendezvous store, each saying what to check next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The server could not listen because the port is taken.
    #[error("rendezvous port {port} on {host} is already in use (another job or a leftover launcher?); pick a free one with --master-port (or MASTER_PORT), or stop the process holding it")]
    PortInUse {
        /// The address it tried to listen on.
        host: String,
        /// The busy port.
        port: u16,
    },
    /// Listening failed for another reason.
    #[error("cannot listen on {addr} for the rendezvous store: {source}; check --master-addr names an address of this machine")]
    Bind {
        /// `host:port`.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The master address does not resolve.
    #[error(
        "cannot resolve rendezvous address {addr}: {detail}; check --master-addr / MASTER_ADDR"
    )]
    Resolve {
        /// `host:port`.
        addr: String,
        /// What the resolver said.
        detail: String,
    },
    /// The server never answered.
    #[error("could not reach the rendezvous store at {addr} after {attempts} attempts over {secs:.1} s (last error: {source}); is the node-0 launcher running, and do all nodes use the same --master-addr/--master-port?")]
    Unreachable {
        /// `host:port`.
        addr: String,
        /// Connection attempts made.
        attempts: u32,
        /// Seconds spent.
        secs: f64,
        /// The last error.
        #[source]
        source: std::io::Error,
    },
    /// The server rejected this client's token.
    #[error("the rendezvous store at {addr} rejected this job's token; every node must use the same token (LOCKSTEP_TOKEN, --token-file or --token), or another job owns this port: pick another --master-port")]
    WrongToken {
        /// `host:port`.
        addr: String,
    },
    /// Something accepted the connection but does not answer like a rendezvous store: it stayed
    /// silent, answered garbage, or closed every connection without answering.
    #[error("the peer at {addr} does not speak the lockstep store protocol: {detail}; check that --master-addr/--master-port (MASTER_ADDR/MASTER_PORT) name the node-0 launcher's rendezvous store, not another service")]
    NotStore {
        /// `host:port`.
        addr: String,
        /// What the peer did.
        detail: String,
    },
    /// The job token breaks the rules of [`validate_token`](super::validate_token) (too short, too long, whitespace).
    #[error("invalid job token: {0}")]
    InvalidToken(String),
    /// A token could not be read or generated.
    #[error("cannot {what}: {source}")]
    TokenSource {
        /// What was being done, naming the file.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// [`ServerLimits`](super::ServerLimits) with a zero where at least one is needed.
    #[error("invalid rendezvous store limits: {0}")]
    Limits(String),
    /// A wait ran out of time.
    #[error("waited {secs:.1} s in the rendezvous store for {keys:?}; some ranks or nodes did not arrive (did every node start, with the same --nnodes and --nproc-per-node?)")]
    Timeout {
        /// The keys that were awaited.
        keys: Vec<String>,
        /// Seconds waited.
        secs: f64,
    },
    /// The server answered something this client does not understand, or rejected a request.
    #[error(
        "rendezvous store protocol error: {0}; are all nodes running the same lockstep version?"
    )]
    Protocol(String),
    /// The connection failed mid-request.
    #[error("rendezvous store {op} failed: {source}; the node-0 launcher may have exited (look at its output)")]
    Io {
        /// The operation.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// A rendezvous key-value store.
pub trait Store {
    /// Set `key` to `value` (overwriting), waking waiters.
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// The value of `key`, if set.
    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Wait until every key in `keys` is set, at most `timeout`.
    fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// Atomically add `delta` to the integer counter `key` (missing = 0) and return the new value.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError>;

    /// Wait for `key` and return its value.
    fn wait_get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        self.get(key)?
            .ok_or_else(|| StoreError::Protocol(format!("key {key:?} vanished after wait")))
    }

    /// Block until `n` participants have called `barrier` with the same `name` (use a fresh name
    /// for every barrier).
    fn barrier(&mut self, name: &str, n: usize, timeout: Duration) -> Result<(), StoreError> {
        let count = self.add(&format!("barrier/{name}/count"), 1)?;
        let done = format!("barrier/{name}/done");
        if count as usize == n {
            self.set(&done, b"1")?;
        }
        self.wait(&[&done], timeout)
    }
}
