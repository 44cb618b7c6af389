//! A virtual socket whose reader stops reading must not slow down another virtual socket sharing
//! the same channels. Its own test binary, so no other test competes for the two cores while
//! throughput is compared.

mod common;

use std::time::{Duration, Instant};

use common::*;
use netchannel::{Engine, VSocket};

const TRANSFER: u64 = 256 << 20;

/// Seconds to move `TRANSFER` bytes over a fresh socket.
fn timed_transfer(a: &Engine, b: &Engine, port: u16) -> f64 {
    let l = b.listen(port).unwrap();
    let s = a.connect(b.local_addr(), port).unwrap();
    let p = l.accept().unwrap();
    let reader = std::thread::spawn(move || recv_pattern(&p, 5, 1 << 20));
    let start = Instant::now();
    send_pattern(&s, 5, TRANSFER, 1 << 20);
    s.shutdown().unwrap();
    assert_eq!(reader.join().unwrap(), TRANSFER);
    start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The two testbed variants compare throughput, so they must not run at the same time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn stalled_reader_does_not_block_others(hosts: Hosts) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let window = a.config().stream_window as u64;
    // Warm up the session and the page cache of both ends.
    timed_transfer(&a, &b, 100);

    let l = b.listen(1).unwrap();
    let stalled: VSocket = a.connect(b.local_addr(), 1).unwrap();
    let stalled_peer = l.accept().unwrap(); // never read
    let stalled_sender = std::thread::spawn(move || {
        stalled.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
        // Blocks once the window is full, until the test ends and the peer goes away.
        let chunk = vec![1u8; 1 << 20];
        while stalled.send(&chunk).is_ok() {}
        stalled
    });
    // Let the stalled socket exhaust its credit.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stalled_peer.stats().unread_bytes < window as usize {
        assert!(Instant::now() < deadline, "stalled socket never filled its window");
        std::thread::sleep(Duration::from_millis(5));
    }

    // Interleave: alone (stalled socket idle is the same as absent: it holds no channel queue)
    // versus beside it. Structural check first: the stalled bytes sit in the peer's receive
    // buffer, not in any channel queue.
    let queued: u64 = a.stats().channels.iter().map(|c| c.channel.queued_bytes).sum();
    assert_eq!(queued, 0, "a stalled socket must not occupy channel queues");
    assert_eq!(stalled_peer.stats().unread_bytes as u64, window);

    let (mut beside, mut alone) = (Vec::new(), Vec::new());
    let (a2, b2) = tb.engines(|_| {});
    timed_transfer(&a2, &b2, 100);
    for round in 0..5u16 {
        beside.push(timed_transfer(&a, &b, 200 + round));
        alone.push(timed_transfer(&a2, &b2, 200 + round));
    }
    let (t_beside, t_alone) = (median(beside.clone()), median(alone.clone()));
    let ratio = t_alone / t_beside;
    eprintln!("throughput beside a stalled reader / alone = {ratio:.3} ({beside:?} vs {alone:?})");
    assert!(ratio >= 0.9, "kept only {:.0}% of its throughput", ratio * 100.0);
    assert_eq!(stalled_peer.stats().unread_bytes as u64, window, "stalled socket stayed stalled");
    drop(stalled_peer);
    let _ = stalled_sender.join();
}

both_testbeds!(stalled_reader_does_not_block_others);
