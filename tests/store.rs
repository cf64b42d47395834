//! Tests of the TCP rendezvous store (threads only, no fork: the default harness is fine).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lockstep::store::{Store, StoreError, StoreServer, TcpStore};

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
    let (_s, port) = server("tok");
    let mut a = client(port, "tok").unwrap();
    assert_eq!(a.get("missing").unwrap(), None);
    a.set("k", b"v").unwrap();
    assert_eq!(a.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(a.add("n", 5).unwrap(), 5);
    assert_eq!(a.add("n", -2).unwrap(), 3);
    // A waiter wakes when another client sets the key.
    let h = std::thread::spawn(move || {
        let mut b = client(port, "tok").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        b.set("late", b"x").unwrap();
        b.barrier("b0", 2, Duration::from_secs(5)).unwrap();
    });
    a.wait(&["late", "k"], Duration::from_secs(5)).unwrap();
    a.barrier("b0", 2, Duration::from_secs(5)).unwrap();
    h.join().unwrap();
    let t = Instant::now();
    let e = a.wait(&["never"], Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }) && t.elapsed() < Duration::from_secs(2), "{e}");
    assert!(e.to_string().contains("\"never\""), "{e}");
}

#[test]
fn wrong_token_is_rejected() {
    let (_s, port) = server("right");
    let e = client(port, "wrong").unwrap_err();
    assert!(matches!(e, StoreError::WrongToken { .. }), "{e}");
    assert!(e.to_string().contains("rejected this job's token"), "{e}");
    client(port, "right").unwrap();
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
    let (_s, port) = server("tok");
    // Oversized frame length.
    let r = raw_exchange(port, &u32::MAX.to_le_bytes());
    assert!(r.len() > 5 && r[4] == 4, "expected BAD_REQUEST, got {r:?}");
    // A truncated HELLO inside a valid frame.
    let r = raw_exchange(port, &[3, 0, 0, 0, 1, 1, 0]);
    assert!(r.len() > 5 && r[4] == 4 && String::from_utf8_lossy(&r).contains("truncated"), "{r:?}");
    // Garbage op before HELLO.
    let r = raw_exchange(port, &[1, 0, 0, 0, 99]);
    assert!(r.len() > 5 && r[4] == 4, "{r:?}");
    // A connection that closes mid-frame.
    let _ = raw_exchange(port, &[100, 0, 0, 0, 1, 2]);
    // Unknown request after a valid HELLO.
    let mut hello = vec![1u8];
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&3u32.to_le_bytes());
    hello.extend_from_slice(b"tok");
    let mut msg = (hello.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(&hello);
    msg.extend_from_slice(&[1, 0, 0, 0, 77]);
    let r = raw_exchange(port, &msg);
    assert_eq!(&r[..5], &[1, 0, 0, 0, 0], "HELLO ok first: {r:?}");
    assert!(String::from_utf8_lossy(&r).contains("unknown request type 77"), "{r:?}");
    // The store still serves well-behaved clients.
    let mut c = client(port, "tok").unwrap();
    c.set("still", b"alive").unwrap();
    assert_eq!(c.get("still").unwrap().as_deref(), Some(&b"alive"[..]));
    // Oversized values are refused on the client side with a clear error.
    let e = c.set("big", &vec![0u8; 2 << 20]).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
}

#[test]
fn busy_port_is_named() {
    let (_s, port) = server("tok");
    let e = StoreServer::start("127.0.0.1", port, "tok").unwrap_err();
    assert!(matches!(e, StoreError::PortInUse { port: p, .. } if p == port), "{e}");
    assert!(e.to_string().contains(&format!("port {port}")) && e.to_string().contains("--master-port"), "{e}");
}

#[test]
fn unreachable_master_retries_then_fails() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, "tok", Duration::from_millis(500)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    match &e {
        StoreError::Unreachable { attempts, .. } => assert!(*attempts > 1, "{e}"),
        _ => panic!("unexpected {e}"),
    }
    assert!(e.to_string().contains("is the node-0 launcher running"), "{e}");
}

#[test]
fn late_server_is_found_by_retrying_client() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let s = StoreServer::start("127.0.0.1", port, "tok").unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(s);
    });
    let mut c = TcpStore::connect("127.0.0.1", port, "tok", Duration::from_secs(5)).unwrap();
    c.set("a", b"b").unwrap();
    h.join().unwrap();
}
