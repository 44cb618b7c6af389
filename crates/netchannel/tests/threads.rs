//! What an engine starts, and when: the threads a short-lived client would pay for are only
//! started once something needs them. One test in this binary (a process of its own), so that
//! counting the process's threads by name sees only this test's engines.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use netchannel::{Class, Config, Engine};

mod common;

/// Threads of this process named `name`.
fn threads(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn service_threads_start_on_first_need() {
    let dir = std::env::temp_dir().join(format!("nc-threads-{}", std::process::id()));
    let cfg = |addr: &str| Config {
        control_dir: Some(dir.clone()),
        ..Config::new(addr.parse().unwrap())
    };
    let server = Engine::new(cfg("127.0.0.1:0")).unwrap();
    // A client engine that only dials: no channel listener, no acceptor thread.
    let client = Engine::new(Config { accept_channels: false, ..cfg("127.0.0.1:0") }).unwrap();
    wait_until("no acceptor for the server", || threads("nc-accept") == 1);
    assert_eq!(client.stats().local_addr, None);

    // No control thread until a reader comes; then one, serving the engine's document.
    assert_eq!(threads("nc-control"), 0);
    let path = client.control_path().expect("a control endpoint");
    let mut doc = String::new();
    UnixStream::connect(&path).unwrap().read_to_string(&mut doc).unwrap();
    assert!(doc.contains(&format!("{:016x}", client.id())), "{doc}");
    assert_eq!(threads("nc-control"), 1);

    // No latency worker until a latency channel; a throughput stream's session dials no
    // other channel while it carries no traffic, however long it lives.
    let workers = |e: &Engine| e.stats().workers.len();
    assert_eq!(workers(&client), client.config().workers);
    let l = server.listen(7).unwrap();
    let mut bulk = client.connect_with_class(server.local_addr(), 7, Class::Throughput).unwrap();
    let b = l.accept().unwrap();
    assert_eq!(client.stats().channels.len(), 1, "only the first channel, at first");
    std::thread::sleep(client.config().rest_channels_after * 6); // three looks at it
    assert_eq!(client.stats().channels.len(), 1, "an idle session dialed more channels");
    // And once it moves nothing, nothing looks at it: its workers sleep (a look a second
    // would wake one twice in these two seconds).
    let wakes = || common::worker_wakes(&[&client]);
    let before = wakes();
    std::thread::sleep(Duration::from_secs(2));
    assert!(wakes() <= before + 1, "an idle engine's workers woke {} times", wakes() - before);
    assert_eq!(client.stats().channels.len(), 1);
    assert_eq!(workers(&client), client.config().workers);
    // A download (the dialing side only receives, so no sender of its runs short of room):
    // the rest come, the latency channel among them, and the latency worker with it.
    let all = client.config().channels + client.config().latency_channels;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let chunk = vec![7u8; 64 << 10];
            let mut b = b;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && b.write_all(&chunk).is_ok() {}
        })
    };
    let mut buf = vec![0u8; 64 << 10];
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.stats().channels.len() < all {
        assert!(Instant::now() < deadline, "a busy session's other channels never came");
        assert!(bulk.read(&mut buf).unwrap() > 0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(bulk);
    sender.join().unwrap();
    wait_until("no latency worker", || workers(&client) == client.config().workers + 1);
    assert_eq!(threads("nc-accept"), 1, "the client started an acceptor");

    // Stopped: the control thread is joined, and a watched socket that never became readable
    // is closed without its thread ever starting.
    client.shutdown();
    server.shutdown();
    wait_until("control thread left running", || threads("nc-control") == 0);
    assert_eq!(threads("nc-accept"), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
