//! Many peers: a server engine full of multi-channel sessions still admits new peers, engines
//! standing in for hosts dial from addresses of their own, a session's background dials and its
//! growth together stay within `max_channels`, and a session's channels follow the threads that
//! use it, up and down; a peer that carries little traffic costs one channel.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};

use common::*;
use netchannel::{Config, Engine};

both_testbeds!(
    idle_peers_cost_one_channel_each,
    threads_sharing_a_session_get_its_channels_below_the_rate,
    a_full_channel_budget_keeps_room_for_new_peers,
    dialed_channels_leave_from_dial_source,
    a_sender_short_of_room_while_channels_are_dialed_adds_none_beyond_max,
    one_poller_serves_sockets_of_many_peers_and_of_peers_that_come_later,
    channels_grow_with_the_threads_that_send_and_are_given_back_when_they_stop,
    an_idle_session_gives_back_its_channels_and_dials_them_again_for_traffic,
);

/// The engine's open throughput channels.
fn throughput(e: &Engine) -> usize {
    e.stats().channels.iter().filter(|c| c.channel.class == netchannel::Class::Throughput).count()
}

/// Waits (up to 10 s) until engine `e` has `n` open throughput channels.
fn wait_for_throughput(e: &Engine, n: usize, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while throughput(e) != n {
        assert!(std::time::Instant::now() < deadline, "{what}: {} channels", throughput(e));
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Engine `e` gave back (retired) `n` channels, and dialed none of them again.
fn assert_given_back(e: &Engine, n: usize) {
    let st = e.stats();
    assert_eq!(st.redialed_channels, 0, "a channel given back is not dialed again");
    let retired = st
        .closed_channels
        .iter()
        .filter(|c| c.channel.close_reason.as_deref().is_some_and(|r| r.contains("retired")));
    assert_eq!(retired.count(), n, "{:?}", st.closed_channels);
}

/// Echoes one message over a new socket from `client` to the listener's engine.
fn exchange(client: &Engine, server: SocketAddr, l: &netchannel::Listener, msg: &[u8]) {
    let s = client
        .connect(server, 9)
        .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(msg)));
    let p = l.accept().unwrap();
    s.send(msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    (&p).read_exact(&mut got).unwrap();
    assert_eq!(got, msg);
}

fn idle_peers_cost_one_channel_each(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Engine::new(tb.config_b()).unwrap();
    let l = server.listen(9).unwrap();
    let addr = server.local_addr();
    let peers: Vec<Engine> = (0..6).map(|_| Engine::new(tb.config_a()).unwrap()).collect();
    for (i, p) in peers.iter().enumerate() {
        exchange(p, addr, &l, format!("peer {i}").as_bytes());
    }
    // Past several looks at their traffic (`rest_channels_after`, then twice as far each time):
    // a few bytes are not worth the other channels, nor the latency one.
    std::thread::sleep(tb.config_a().rest_channels_after * 8);
    for (i, p) in peers.iter().enumerate() {
        exchange(p, addr, &l, format!("again {i}").as_bytes());
        assert_eq!(p.stats().channels.len(), 1, "peer {i}");
    }
    assert_eq!(server.stats().channels.len(), 6);
    assert_eq!(server.stats().sessions, 6);
}

fn threads_sharing_a_session_get_its_channels_below_the_rate(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Engine::new(tb.config_b()).unwrap();
    let l = server.listen(9).unwrap();
    let addr = server.local_addr();
    // One shard: the two threads share the session.
    let client = Engine::new(Config { session_shards: 1, ..tb.config_a() }).unwrap();
    let all = client.config().channels;
    let rate = client.config().rest_channels_rate;
    let chunk = vec![3u8; 64 << 10];
    // Each of two threads sends 64 KiB every 20 ms: 6.4 MB/s in all, below the rate for one
    // thread but above a sixteenth of it (`SHARED_RATE_DIVISOR`): each thread's streams keep
    // to a home channel, so the session dials its others.
    assert!(2 * chunk.len() as u64 * 50 < rate);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            let (client, chunk) = (&client, &chunk);
            let s = client.connect(addr, 9).unwrap();
            let p = l.accept().unwrap();
            scope.spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                while (&p).read(&mut buf).unwrap() > 0 {}
            });
            scope.spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while throughput(client) < all {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{} channels",
                        throughput(client)
                    );
                    (&s).write_all(chunk).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                s.shutdown().unwrap();
            });
        }
    });
    assert_eq!(client.stats().sessions, 1);
}

fn a_full_channel_budget_keeps_room_for_new_peers(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // Room for 8 channels; each peer wants 5 (4 throughput, 1 latency), traffic or not.
    let server = Engine::new(Config { max_channels_total: 8, ..tb.config_b() }).unwrap();
    let l = server.listen(9).unwrap();
    let addr = server.local_addr();
    let peers: Vec<Engine> = (0..7)
        .map(|_| Engine::new(Config { rest_channels_rate: 0, ..tb.config_a() }).unwrap())
        .collect();
    for (i, p) in peers.iter().enumerate() {
        exchange(p, addr, &l, format!("peer {i}").as_bytes());
        // Let its background dials finish (or be refused) before the next peer comes.
        std::thread::sleep(std::time::Duration::from_millis(100));
        if i == 0 {
            wait_for_channels(p, 5);
        }
    }
    let st = server.stats();
    assert_eq!(st.sessions, 7, "every peer has a session: {:?}", st.refusals);
    assert!(st.channels.len() <= 8, "{} channels", st.channels.len());
    let refused = |what: &str| st.refusals.iter().any(|(why, _)| why.contains(what));
    // Later channels of known peers stopped at three quarters; then the first peer's extra
    // throughput channels were shed, one per newcomer, and it kept one of each class.
    assert!(refused("new peers"), "{:?}", st.refusals);
    assert!(refused("shed"), "{:?}", st.refusals);
    assert_eq!(peers[0].stats().channels.len(), 2);
    // Every peer keeps working over what it has.
    for (i, p) in peers.iter().enumerate() {
        exchange(p, addr, &l, format!("again {i}").as_bytes());
    }
}

fn dialed_channels_leave_from_dial_source(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // A source address host A owns besides its own: another loopback address, or host A's
    // address itself between the namespaces (the only one it has).
    let source: IpAddr = match hosts {
        Hosts::Loopback => "127.0.0.7".parse().unwrap(),
        Hosts::Netns => tb.addr_a,
    };
    let server = Engine::new(tb.config_b()).unwrap();
    let l = server.listen(9).unwrap();
    let client =
        Engine::new(Config { dial_source: Some(source), rest_channels_rate: 0, ..tb.config_a() })
            .unwrap();
    exchange(&client, server.local_addr(), &l, b"from where?");
    wait_for_channels(&client, 5);
    let st = server.stats();
    assert!(!st.channels.is_empty());
    for ch in &st.channels {
        assert_eq!(ch.peer_addr.map(|a| a.ip()), Some(source), "{:?}", ch.peer_addr);
    }
    // An address the host does not own: a clear error naming it.
    let stranger =
        Engine::new(Config { dial_source: Some("192.0.2.1".parse().unwrap()), ..tb.config_a() })
            .unwrap();
    let err = stranger.connect(server.local_addr(), 9).unwrap_err();
    assert!(err.to_string().contains("192.0.2.1"), "{err}");
}

fn a_sender_short_of_room_while_channels_are_dialed_adds_none_beyond_max(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // Little room per channel: a bulk sender is short of it at once, while the session's
    // other channels are still being dialed.
    let (a, b) = tb.engines(|c| {
        c.channels = 4;
        c.max_channels = 4;
        c.channel_queue_threshold = 64 << 10;
    });
    let l = b.listen(9).unwrap();
    let s = a.connect(b.local_addr(), 9).unwrap();
    let p = l.accept().unwrap();
    const LEN: u64 = 64 << 20;
    let reader = std::thread::spawn(move || recv_pattern(&p, 3, 1 << 20));
    send_pattern(&s, 3, LEN, 1 << 20);
    s.shutdown().unwrap();
    assert_eq!(reader.join().unwrap(), LEN);
    wait_for_channels(&a, 5);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(throughput(&a), 4, "max_channels throughput channels, the dialed ones included");
    assert_eq!(throughput(&b), 4);
}

fn one_poller_serves_sockets_of_many_peers_and_of_peers_that_come_later(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Engine::new(tb.config_b()).unwrap();
    let l = server.listen(9).unwrap();
    let poller = netchannel::Poller::new().unwrap();
    let mut clients = Vec::new();
    let mut accepted = Vec::new();
    // A poller that has waited already (and so looked at its sessions) gets sockets of new
    // peers, whose sessions' channels also change while it waits (background dials).
    let mut tokens = Vec::new();
    for round in 0..3 {
        for _ in 0..16 {
            let e = Engine::new(tb.config_a()).unwrap();
            let s = e.connect(server.local_addr(), 9).unwrap();
            let p = l.accept().unwrap();
            p.set_nonblocking(true);
            poller.register(&p, accepted.len() as u64).unwrap();
            accepted.push(p);
            clients.push((e, s));
        }
        poller.wait(&mut tokens, Some(std::time::Duration::from_millis(10))).unwrap();
        // Every peer sends; the poller reports each of its sockets until all is read.
        for (i, (_, s)) in clients.iter().enumerate() {
            s.send(format!("{round}:{i};").as_bytes()).unwrap();
        }
        let mut got = vec![String::new(); accepted.len()];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.iter().enumerate().any(|(i, g)| *g != format!("{round}:{i};")) {
            assert!(std::time::Instant::now() < deadline, "round {round}: {got:?}");
            poller.wait(&mut tokens, Some(std::time::Duration::from_millis(100))).unwrap();
            for &t in &tokens {
                let mut buf = [0u8; 64];
                while let Ok(n) = accepted[t as usize].recv(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    got[t as usize].push_str(std::str::from_utf8(&buf[..n]).unwrap());
                }
            }
        }
    }
}

fn channels_grow_with_the_threads_that_send_and_are_given_back_when_they_stop(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|c| {
        c.channels = 2;
        c.max_channels = 4;
        c.channel_retire_after = std::time::Duration::from_millis(300);
        // Idle, it would give back channels down to one (the test after this one).
        c.rest_channels_rate = 0;
        // Busy at any speed the machine allows: what is tested is the count, not the rate.
        c.busy_thread_rate = 1 << 20;
    });
    let l = b.listen(9).unwrap();
    // Four threads each send on a socket of their own, until the session has a channel for
    // each (the accepting side sees them too). The counts are taken while all four still send:
    // once one stops, the session may rightly begin to give channels back.
    let round = |seed: u64| -> (usize, usize) {
        let ready = std::sync::atomic::AtomicUsize::new(0);
        let seen = std::sync::Mutex::new((0, 0));
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let s = a.connect(b.local_addr(), 9).unwrap();
                let p = l.accept().unwrap();
                let (a, b, ready, seen) = (&a, &b, &ready, &seen);
                scope.spawn(move || {
                    let reader = std::thread::spawn(move || recv_pattern(&p, seed + t, 64 << 10));
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                    let (mut sent, mut buf) = (0u64, vec![0u8; 64 << 10]);
                    let mut counted = false;
                    while ready.load(std::sync::atomic::Ordering::SeqCst) < 4 {
                        let now = (throughput(a), throughput(b));
                        assert!(std::time::Instant::now() < deadline, "{now:?} channels");
                        if !counted && now.0 >= 4 && now.1 >= 4 && sent >= 4 << 20 {
                            counted = true;
                            if ready.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 3 {
                                // The last to get there: every thread is still sending.
                                *seen.lock().unwrap() = (throughput(a), throughput(b));
                            }
                        }
                        pattern(seed + t, sent, &mut buf);
                        (&s).write_all(&buf).unwrap();
                        sent += buf.len() as u64;
                    }
                    s.shutdown().unwrap();
                    assert_eq!(reader.join().unwrap(), sent, "thread {t}: every byte, in order");
                });
            }
        });
        seen.into_inner().unwrap()
    };
    assert_eq!(round(10), (4, 4), "a channel per thread, max_channels 4, on both sides");
    // The threads stopped: within a few retire_after, back to `channels`, on both sides, and
    // nothing dialed again.
    wait_for_throughput(&a, 2, "given back");
    wait_for_throughput(&b, 2, "the accepting side, given back");
    assert_given_back(&a, 2);
    // They come back when the threads do (the indexes given back are taken again).
    assert_eq!(round(20), (4, 4));
    let mut indexes: Vec<u16> = a.stats().channels.iter().map(|c| c.channel.index).collect();
    indexes.sort();
    assert!(indexes.iter().all(|&i| i <= 4), "no new indexes: {indexes:?}");
}

fn an_idle_session_gives_back_its_channels_and_dials_them_again_for_traffic(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|c| c.channel_retire_after = std::time::Duration::from_millis(200));
    let l = b.listen(9).unwrap();
    let all = a.config().channels;
    // A download: the dialing side only reads, so its channels come from its looks at the
    // session's traffic, not from a sender short of room.
    let download = |seed: u64| {
        let s = a.connect(b.local_addr(), 9).unwrap();
        let p = l.accept().unwrap();
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| recv_pattern(&s, seed, 64 << 10));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let (mut sent, mut buf) = (0u64, vec![0u8; 64 << 10]);
            while throughput(&a) < all || sent < 8 << 20 {
                assert!(std::time::Instant::now() < deadline, "{} channels", throughput(&a));
                pattern(seed, sent, &mut buf);
                (&p).write_all(&buf).unwrap();
                sent += buf.len() as u64;
            }
            p.shutdown().unwrap();
            assert_eq!(reader.join().unwrap(), sent, "every byte, in order");
        });
    };
    download(1);
    assert_eq!(throughput(&a), all);
    // Idle: given back down to one throughput channel, one per `channel_retire_after`, on both
    // sides, and not dialed again while it stays idle.
    wait_for_throughput(&a, 1, "given back");
    wait_for_throughput(&b, 1, "the accepting side, given back");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(throughput(&a), 1);
    assert_given_back(&a, all - 1);
    // Traffic again: back to `channels`.
    download(2);
    assert_eq!(throughput(&a), all);
}
