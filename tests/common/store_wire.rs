//! The rendezvous store's wire format, as far as the tests that talk to it by hand need it.

/// A framed HELLO for `token`: the request code 1, protocol version 1, the token's length and
/// bytes, behind the frame's little-endian length.
pub fn hello(token: &str) -> Vec<u8> {
    let mut body = vec![1u8];
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&(token.len() as u32).to_le_bytes());
    body.extend_from_slice(token.as_bytes());
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    f
}
