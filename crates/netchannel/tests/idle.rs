//! Engines that wait use no CPU: an idle engine's workers park in epoll, and so does a sender
//! blocked on a peer that stopped reading. Its own test binary, so no other test runs in the
//! process while CPU time is measured.

mod common;
use common::*;

/// CPU time (user + system) of this whole process, in clock ticks.
fn process_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // After the state letter (not parsed), utime and stime are fields 14 and 15 overall.
    f[10] + f[11]
}

/// The tests measure CPU time or wake-ups of the whole process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Two engines on loopback and a connected pair of sockets between them (client, server).
fn connected(
    tb: &Testbed,
) -> (netchannel::Engine, netchannel::Engine, netchannel::VSocket, netchannel::VSocket) {
    let (a, b) = tb.engines(|_| {});
    let l = b.listen(9).unwrap();
    let s = a.connect(b.local_addr(), 9).unwrap();
    let p = l.accept().unwrap();
    (a, b, s, p)
}

#[test]
fn idle_engines_use_no_cpu() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::loopback();
    let (_a, _b, s, p) = connected(&tb);
    s.send(b"wake everybody up").unwrap();
    let mut buf = [0u8; 32];
    p.recv(&mut buf).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100)); // let workers park
    let before = process_ticks();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let used = process_ticks() - before;
    // 10 workers polling would burn 100+ ticks (two cores' worth) in a second; parked ones ~0.
    assert!(used <= 3, "idle engines used {used} clock ticks in one second");
}

#[test]
fn a_sender_blocked_by_a_reader_that_stopped_uses_no_cpu() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::loopback();
    let (a, b) = tb.engines(|c| c.stream_window = 1 << 20);
    let l = b.listen(9).unwrap();
    let s = a.connect(b.local_addr(), 9).unwrap();
    let _never_read = l.accept().unwrap();
    let sender = std::thread::spawn(move || {
        // Blocks once the peer's window is full; fails when the test ends and drops the peer.
        let chunk = vec![1u8; 256 * 1024];
        let mut sent = 0u64;
        while let Ok(n) = s.send(&chunk) {
            sent += n as u64;
        }
        sent
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.stats().sockets.first().is_none_or(|s| s.bytes_sent < 1 << 20) {
        assert!(std::time::Instant::now() < deadline, "the window never filled");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(100)); // let everything settle
    let before = process_ticks();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let used = process_ticks() - before;
    assert!(used <= 3, "a blocked sender and its engines used {used} clock ticks in one second");
    drop(_never_read);
    drop(l);
    drop(b);
    assert!(sender.join().unwrap() >= 1 << 20);
}

/// A lone request and its answer leave an acknowledgement owed on each side. The workers
/// ticked every millisecond until it was due (5 ms) and two more after: about 11 wake-ups of
/// the two engines' workers per request. Now each worker wakes when the acknowledgement is
/// due, and reads the peer's: about 5.
#[test]
fn a_quiet_exchange_wakes_the_workers_when_acknowledgements_are_due_not_every_tick() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::loopback();
    let (a, b, s, p) = connected(&tb);
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok(n) = p.recv(&mut buf) {
            if n == 0 || p.send(&buf[..n]).is_err() {
                break;
            }
        }
    });
    let mut buf = [0u8; 64];
    let mut exchange = || {
        s.send(&[7u8; 64]).unwrap();
        let mut got = 0;
        while got < 64 {
            got += s.recv(&mut buf[got..]).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for _ in 0..5 {
        exchange();
    }
    const REQUESTS: u64 = 50;
    let before = worker_wakes(&[&a, &b]);
    for _ in 0..REQUESTS {
        exchange();
    }
    let per_request = (worker_wakes(&[&a, &b]) - before) as f64 / REQUESTS as f64;
    eprintln!("{per_request:.1} worker wake-ups per request");
    assert!(per_request < 9.0, "{per_request:.1} worker wake-ups per quiet request");
    drop(s);
    echo.join().unwrap();
}
