//! The store server under connection churn and oversized frames: what a client leaves behind
//! when it goes must go with it. One test in its own binary, so the process's descriptor
//! count and resident memory are this test's alone.
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use comm::auth::JobToken;
use comm::store::{TcpStore, TcpStoreServer};
use comm::Store;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no memory effects.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
}

/// Waits (bounded) for the server's threads to notice every departed client.
fn settle(server: &TcpStoreServer, fds: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = open_fds();
        if (server.open_connections() == 0 && now <= fds) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn connection_churn_and_huge_frames_leave_descriptors_and_memory_where_they_were() {
    let token = JobToken::new("churn-test-token-0123").unwrap();
    let server = TcpStoreServer::bind("127.0.0.1:0", token.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let t = Duration::from_secs(10);
    // Warm up: the first connections allocate the server's lasting structures.
    for _ in 0..20 {
        TcpStore::connect(&addr, &token, t)
            .unwrap()
            .set("warm", b"1")
            .unwrap();
    }
    let fds = settle(&server, usize::MAX);
    let rss = resident_bytes();

    // 2,000 cycles: strangers that connect and leave, strangers that say hello and leave,
    // and members that prove the token, write a key and leave.
    for i in 0..2000 {
        match i % 4 {
            0 | 1 => drop(TcpStream::connect(&addr).unwrap()),
            2 => {
                let mut s = TcpStream::connect(&addr).unwrap();
                let _ = s.write_all(&[41, 0, 0, 0, 0, b'X', b'T', b'S', b'T']);
            }
            _ => {
                let c = TcpStore::connect(&addr, &token, t).unwrap();
                c.set(&format!("k/{}", i % 8), b"v").unwrap();
            }
        }
    }
    // Eight strangers at once, each announcing a 60 MiB frame and sending most of it (the
    // server refuses at the header and closes, so the sends soon fail).
    let floods: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let chunk = vec![0u8; 1 << 20];
                let mut s = TcpStream::connect(&addr).unwrap();
                let mut sent = 0;
                if s.write_all(&(60u32 << 20).to_le_bytes()).is_ok() {
                    while sent < 56 && s.write_all(&chunk).is_ok() {
                        sent += 1;
                    }
                }
                sent
            })
        })
        .collect();
    for f in floods {
        f.join().unwrap();
    }

    let after = settle(&server, fds);
    assert_eq!(server.open_connections(), 0);
    assert_eq!(server.clients(), 0);
    assert!(after <= fds, "descriptors: {fds} before, {after} after");
    let grown = resident_bytes().saturating_sub(rss);
    eprintln!(
        "descriptors {fds} -> {after}, resident {} KiB -> +{} KiB",
        rss >> 10,
        grown >> 10
    );
    assert!(
        grown < 16 << 20,
        "resident memory grew by {} KiB",
        grown >> 10
    );
    // The server still serves, and holds the members' keys only.
    let c = TcpStore::connect(&addr, &token, t).unwrap();
    assert_eq!(c.get("k/3", t).unwrap(), b"v");
    assert!(c.get("k/0", Duration::from_millis(10)).is_err());
}
