//! The rendezvous store: a small key-value service the ranks of a multi-node job use to find each
//! other before any communicator exists (the role of torch's `TCPStore`, NCCL's bootstrap, or
//! llm.c's "tcp" unique-id exchange in `llmc/zero.cuh`).
//!
//! * [`Store`] is the interface: `set`, `get`, `wait` for keys with a timeout, an atomic `add`
//!   counter, and a `barrier` built from the two. Callers hold a `&mut dyn Store`, so a
//!   file-backed store can sit beside the TCP one later.
//! * `wire` is the TCP protocol; `server` holds [`StoreServer`] (hosted by the node-0 launcher on
//!   `MASTER_ADDR:MASTER_PORT`) and its gatekeeper; `client` holds [`TcpStore`].
//! * `token` holds the job token's rules: at least [`MIN_TOKEN_LEN`] bytes, generated from the
//!   kernel's random source when node 0 is given none, read from a file or the environment.
//!
//! Every connection first presents the job token. Until it has, a peer is held to a small budget
//! (one short frame, a deadline for the whole handshake, a bounded number of such peers, and
//! throttled wrong guesses, see [`ServerLimits`]); the server answers malformed or oversized
//! messages with an error instead of crashing.

mod client;
mod kv;
mod server;
mod token;
mod wire;

pub use client::TcpStore;
pub use kv::{Store, StoreError};
pub use server::{ServerLimits, StoreServer};
pub use token::{
    generate_token, read_token_file, validate_token, TokenFile, MAX_TOKEN_LEN, MIN_TOKEN_LEN,
};
pub use wire::MAX_HELLO_FRAME;
