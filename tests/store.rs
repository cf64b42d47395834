//! Tests of the TCP rendezvous store (threads only, no fork: the default harness is fine).

#[path = "common/store_wire.rs"]
mod store_wire;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lockstep::store::{Store, StoreError, StoreServer, TcpStore};

/// A valid job token (at least 16 bytes) for most tests.
const TOK: &str = "0123456789abcdef-tok";

fn server(token: &str) -> (StoreServer, u16) {
    let s = StoreServer::start("127.0.0.1", 0, token).expect("start store");
    let p = s.local_addr().port();
    (s, p)
}

fn client(port: u16, token: &str) -> Result<TcpStore, StoreError> {
    TcpStore::connect("127.0.0.1", port, token, Duration::from_secs(2))
}

#[test]
fn set_get_wait_add_barrier() {
    let (_s, port) = server(TOK);
    let mut a = client(port, TOK).unwrap();
    assert_eq!(a.get("missing").unwrap(), None);
    a.set("k", b"v").unwrap();
    assert_eq!(a.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(a.add("n", 5).unwrap(), 5);
    assert_eq!(a.add("n", -2).unwrap(), 3);
    // A waiter wakes when another client sets the key.
    let h = std::thread::spawn(move || {
        let mut b = client(port, TOK).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        b.set("late", b"x").unwrap();
        b.barrier("b0", 2, Duration::from_secs(5)).unwrap();
    });
    a.wait(&["late", "k"], Duration::from_secs(5)).unwrap();
    a.barrier("b0", 2, Duration::from_secs(5)).unwrap();
    h.join().unwrap();
    let t = Instant::now();
    let e = a.wait(&["never"], Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(e, StoreError::Timeout { .. }) && t.elapsed() < Duration::from_secs(2),
        "{e}"
    );
    assert!(e.to_string().contains("\"never\""), "{e}");
}

#[test]
fn wrong_token_is_rejected() {
    let (_s, port) = server("right-token-0123456789");
    let t = Instant::now();
    let e = client(port, "wrong-token-0123456789").unwrap_err();
    assert!(matches!(e, StoreError::WrongToken { .. }), "{e}");
    assert!(e.to_string().contains("rejected this job's token"), "{e}");
    // A first wrong token is answered at once, so a misconfigured node learns quickly.
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    client(port, "right-token-0123456789").unwrap();
}

fn raw_exchange(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    // Half-close: a request cut short then reads as a closed connection on the server.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn malformed_and_oversized_messages_do_not_crash_the_store() {
    let (_s, port) = server(TOK);
    // Oversized frame length.
    let r = raw_exchange(port, &u32::MAX.to_le_bytes());
    assert!(r.len() > 5 && r[4] == 4, "expected BAD_REQUEST, got {r:?}");
    // A truncated HELLO inside a valid frame.
    let r = raw_exchange(port, &[3, 0, 0, 0, 1, 1, 0]);
    assert!(
        r.len() > 5 && r[4] == 4 && String::from_utf8_lossy(&r).contains("truncated"),
        "{r:?}"
    );
    // Garbage op before HELLO.
    let r = raw_exchange(port, &[1, 0, 0, 0, 99]);
    assert!(r.len() > 5 && r[4] == 4, "{r:?}");
    // A connection that closes mid-frame.
    let _ = raw_exchange(port, &[100, 0, 0, 0, 1, 2]);
    // Unknown request after a valid HELLO.
    let mut msg = store_wire::hello(TOK);
    msg.extend_from_slice(&[1, 0, 0, 0, 77]);
    let r = raw_exchange(port, &msg);
    assert_eq!(&r[..5], &[1, 0, 0, 0, 0], "HELLO ok first: {r:?}");
    assert!(
        String::from_utf8_lossy(&r).contains("unknown request type 77"),
        "{r:?}"
    );
    // The store still serves well-behaved clients.
    let mut c = client(port, TOK).unwrap();
    c.set("still", b"alive").unwrap();
    assert_eq!(c.get("still").unwrap().as_deref(), Some(&b"alive"[..]));
    // Oversized values are refused on the client side with a clear error.
    let e = c.set("big", &vec![0u8; 2 << 20]).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
}

#[test]
fn busy_port_is_named() {
    let (_s, port) = server(TOK);
    let e = StoreServer::start("127.0.0.1", port, TOK).unwrap_err();
    assert!(
        matches!(e, StoreError::PortInUse { port: p, .. } if p == port),
        "{e}"
    );
    assert!(
        e.to_string().contains(&format!("port {port}")) && e.to_string().contains("--master-port"),
        "{e}"
    );
}

#[test]
fn unreachable_master_retries_then_fails() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, TOK, Duration::from_millis(500)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    match &e {
        StoreError::Unreachable { attempts, .. } => assert!(*attempts > 1, "{e}"),
        _ => panic!("unexpected {e}"),
    }
    assert!(
        e.to_string().contains("is the node-0 launcher running"),
        "{e}"
    );
}

#[test]
fn late_server_is_found_by_retrying_client() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let s = StoreServer::start("127.0.0.1", port, TOK).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(s);
    });
    let mut c = TcpStore::connect("127.0.0.1", port, TOK, Duration::from_secs(5)).unwrap();
    c.set("a", b"b").unwrap();
    h.join().unwrap();
}

#[test]
fn short_tokens_are_refused_on_both_sides() {
    for bad in ["", "t", "fifteen-bytes!!"] {
        let e = StoreServer::start("127.0.0.1", 0, bad).unwrap_err();
        assert!(
            matches!(e, StoreError::InvalidToken(_)) && e.to_string().contains("at least 16"),
            "{bad:?}: {e}"
        );
        // The client refuses before connecting anywhere: port 9 (discard) is never contacted.
        let t = Instant::now();
        let e = TcpStore::connect("127.0.0.1", 9, bad, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(e, StoreError::InvalidToken(_)) && t.elapsed() < Duration::from_millis(100),
            "{bad:?}: {e}"
        );
    }
}

/// A port held by something that accepts connections and then does `behave` with each.
fn fake_peer(behave: fn(TcpStream)) -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || behave(s));
        }
    });
    port
}

#[test]
fn silent_peer_is_named_within_the_rendezvous_timeout() {
    // Accepts and holds the connection without a word (reads, so the client's HELLO is taken).
    let port = fake_peer(|mut s| {
        let mut sink = [0u8; 64];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    let t = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, TOK, Duration::from_millis(800)).unwrap_err();
    let took = t.elapsed();
    assert!(matches!(e, StoreError::NotStore { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains(&format!(
            "the peer at 127.0.0.1:{port} does not speak the lockstep store protocol"
        )),
        "{m}"
    );
    assert!(
        m.contains("sent no answer") && m.contains("--master-port"),
        "{m}"
    );
    // Bounded by the rendezvous timeout (800 ms), not a fixed 10 s.
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(1500),
        "{took:?}"
    );
}

#[test]
fn garbage_answer_is_named_at_once() {
    let port = fake_peer(|mut s| {
        let mut b = [0u8; 64];
        let _ = s.read(&mut b);
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        std::thread::sleep(Duration::from_secs(2));
    });
    let t = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, TOK, Duration::from_secs(10)).unwrap_err();
    assert!(matches!(e, StoreError::NotStore { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("does not speak the lockstep store protocol")
            && e.to_string().contains("HTTP"),
        "{e}"
    );
    // Garbage is not retried: the answer comes long before the 10 s rendezvous timeout.
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn peer_that_hangs_up_is_retried_then_named() {
    // Accepts and closes every connection without answering.
    let port = fake_peer(drop);
    let t = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, TOK, Duration::from_millis(600)).unwrap_err();
    match &e {
        StoreError::NotStore { detail, .. } => {
            assert!(detail.contains("closed each without answering"), "{e}")
        }
        _ => panic!("unexpected {e}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
}
