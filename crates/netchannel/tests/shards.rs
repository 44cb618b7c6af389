//! Session shards (`Config::session_shards`): application threads that open streams to one
//! peer get sessions of their own, which share no lock and no channel; the peer counts them
//! as one peer; a shard the peer refuses leaves its thread on a shard it has.

mod common;

use std::io::{Read, Write};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use netchannel::wire::handshake;
use netchannel::{Class, Config, Engine};

both_testbeds!(
    each_thread_gets_a_session_of_its_own,
    latency_streams_take_a_shard_of_their_own,
    the_shards_of_one_peer_count_once_at_max_sessions,
    a_refused_shard_leaves_its_thread_on_a_shard_the_peer_has,
    latency_streams_arriving_together_on_a_new_session_get_its_latency_channel,
);

/// Echoes every accepted stream until end of file, forever (a thread per stream).
fn echo_server(server: &Engine, port: u16) {
    let l = server.listen(port).unwrap();
    std::thread::spawn(move || {
        while let Ok(s) = l.accept() {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match (&s).read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => (&s).write_all(&buf[..n]).unwrap(),
                    }
                }
            });
        }
    });
}

/// Sends `len` bytes of a pattern that depends on `seed` and checks that every one comes back.
fn echo_exact(s: &netchannel::VSocket, len: usize, seed: u8) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let mut back = vec![0u8; len];
    std::thread::scope(|scope| {
        scope.spawn(|| (&*s).write_all(&data).unwrap());
        (&*s).read_exact(&mut back).unwrap();
    });
    assert!(back == data, "echo of seed {seed} differs");
}

fn each_thread_gets_a_session_of_its_own(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Arc::new(Engine::new(tb.config_b()).unwrap());
    echo_server(&server, 7);
    // 4 shards of 4 channels: the first starts with 4 throughput channels, the others with
    // one each; each with a latency channel (dialed at once, traffic or not).
    let client = Arc::new(
        Engine::new(Config { session_shards: 4, rest_channels_rate: 0, ..tb.config_a() }).unwrap(),
    );
    let addr = server.local_addr();
    let threads: Vec<_> = (0..4u8)
        .map(|seed| {
            let client = client.clone();
            std::thread::spawn(move || {
                for round in 0..2u8 {
                    // A thread's second stream uses its session again.
                    let s = client.connect(addr, 7).unwrap();
                    echo_exact(&s, 1 << 20, seed * 2 + round);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client.stats().sessions, 4, "a session per thread");
    assert_eq!(server.stats().sessions, 4, "the server keys each shard as a session");
    // Under load a shard may add throughput channels of its own, and so reach the count
    // before another shard's latency channel is in: wait for those too.
    wait_for_channels(&client, 5 + 3 * 2);
    let latency = || {
        let st = client.stats();
        st.channels.iter().filter(|c| c.channel.class == Class::Latency).count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while latency() < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(latency(), 4, "one latency channel per shard");
    // The server tells the shards apart by their ids, and their engine by what the ids share.
    let mut ids: Vec<u64> = server.stats().channels.iter().map(|c| c.channel.peer_engine).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 4, "{ids:x?}");
    assert!(ids.iter().all(|&id| handshake::same_engine(id, client.id())), "{ids:x?}");
    assert!(ids.contains(&client.id()), "shard 0 presents the engine's own id");
    // Both ends name each session by the id its dialer presents (`netchannel stat` shows it).
    let sessions = |e: &Engine| {
        let mut v: Vec<u64> = e.stats().channels.iter().map(|c| c.session).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    assert_eq!(sessions(&client), ids);
    assert_eq!(sessions(&server), ids);
    // A fifth thread shares a shard: no new session.
    let c = client.clone();
    std::thread::spawn(move || echo_exact(&c.connect(addr, 7).unwrap(), 4096, 9)).join().unwrap();
    assert_eq!(client.stats().sessions, 4);
    assert_eq!(client.stats().protocol_errors + server.stats().protocol_errors, 0);
}

fn the_shards_of_one_peer_count_once_at_max_sessions(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Arc::new(Engine::new(Config { max_sessions: 1, ..tb.config_b() }).unwrap());
    echo_server(&server, 7);
    let addr = server.local_addr();
    let client = Arc::new(Engine::new(Config { session_shards: 3, ..tb.config_a() }).unwrap());
    // Three threads, each with a stream open at once: three sessions at a server that takes
    // one peer.
    let barrier = Arc::new(Barrier::new(3));
    let threads: Vec<_> = (0..3u8)
        .map(|seed| {
            let (client, barrier) = (client.clone(), barrier.clone());
            std::thread::spawn(move || {
                let s = client.connect(addr, 7).unwrap();
                echo_exact(&s, 64 * 1024, seed);
                barrier.wait();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client.stats().sessions, 3);
    assert_eq!(server.stats().sessions, 3);
    // Another peer is the second: refused, as before shards.
    let other = Engine::new(Config {
        busy_dial_timeout: Duration::from_millis(300),
        session_shards: 1,
        ..tb.config_a()
    })
    .unwrap();
    assert!(other.connect(addr, 7).is_err(), "a second peer at max_sessions 1");
}

fn a_refused_shard_leaves_its_thread_on_a_shard_the_peer_has(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // Room for one peer's first channels and nothing more.
    let server = Arc::new(
        Engine::new(Config { channels: 1, max_channels_total: 2, ..tb.config_b() }).unwrap(),
    );
    echo_server(&server, 7);
    let addr = server.local_addr();
    let client = Arc::new(
        Engine::new(Config {
            session_shards: 2,
            channels: 2,
            // Its second channel at the first look, traffic or not.
            rest_channels_rate: 0,
            // Long: a refused further shard must not be dialed again until it runs out.
            dial_timeout: Duration::from_secs(20),
            ..tb.config_a()
        })
        .unwrap(),
    );
    let first = client.connect(addr, 7).unwrap();
    echo_exact(&first, 64 * 1024, 1);
    // The session's second channel comes at its first look (`rest_channels_after`): the
    // server's places are all taken once it did.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.stats().channels.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "the first session's channels never came");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A second thread's shard is refused (no channel place left): its streams use the first
    // shard's session, and work, without the refused shard being dialed again for the
    // dial timeout (as a new peer's first channel is).
    let c = client.clone();
    let t0 = std::time::Instant::now();
    std::thread::spawn(move || {
        for seed in 2..4 {
            echo_exact(&c.connect(addr, 7).unwrap(), 64 * 1024, seed);
        }
    })
    .join()
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "waited {:?} for a refused shard",
        t0.elapsed()
    );
    assert_eq!(client.stats().sessions, 1);
    assert_eq!(server.stats().sessions, 1);
    echo_exact(&first, 4096, 5);
}

fn latency_streams_take_a_shard_of_their_own(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Arc::new(Engine::new(tb.config_b()).unwrap());
    echo_server(&server, 7);
    let client = Engine::new(Config { session_shards: 2, ..tb.config_a() }).unwrap();
    let addr = server.local_addr();
    // One thread, both classes: the throughput stream on the thread's shard, the latency
    // stream on the latency shard, which no throughput stream of this engine uses.
    let bulk = client.connect_with_class(addr, 7, Class::Throughput).unwrap();
    let quick = client.connect_with_class(addr, 7, Class::Latency).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| echo_exact(&bulk, 4 << 20, 1));
        for seed in 0..50 {
            echo_exact(&quick, 4096, seed);
        }
    });
    assert_eq!(client.stats().sessions, 2);
    let latency_id = handshake::shard_engine_id(client.id(), handshake::MAX_SHARD_IDS - 1);
    let on_latency_shard =
        |e: &Engine| e.stats().channels.iter().filter(|c| c.session == latency_id).count();
    assert!(on_latency_shard(&server) >= 1, "the server sees the latency shard's session");
    // The throughput stream's bytes went over the thread's shard only.
    let moved_on_latency_shard: u64 = client
        .stats()
        .channels
        .iter()
        .filter(|c| c.session == latency_id)
        .map(|c| c.channel.tx_bytes)
        .sum();
    assert!(
        moved_on_latency_shard < 1 << 20,
        "{moved_on_latency_shard} bytes on the latency shard"
    );
}

/// Threads that open throughput and latency streams at once on a new session (one shard, so
/// they share it): the session is dialed for whichever comes first, and every latency stream
/// finds the session's latency channel open when its connect returns (dialed by its own
/// connect, or waited for), never a throughput channel lent for want of it. Then the rest of
/// the channels come (at the first look, traffic or not), and everything echoes.
fn latency_streams_arriving_together_on_a_new_session_get_its_latency_channel(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Arc::new(Engine::new(tb.config_b()).unwrap());
    echo_server(&server, 7);
    let client = Arc::new(Engine::new(Config { rest_channels_rate: 0, ..tb.config_a() }).unwrap());
    let addr = server.local_addr();
    let threads = 8;
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (client, start) = (client.clone(), start.clone());
            std::thread::spawn(move || {
                let class = if i % 2 == 0 { Class::Latency } else { Class::Throughput };
                start.wait();
                let s = client.connect_with_class(addr, 7, class).unwrap();
                if class == Class::Latency {
                    let latency =
                        client.stats().channels.iter().any(|c| c.channel.class == Class::Latency);
                    assert!(latency, "a latency stream's connect returned without its channel");
                }
                echo_exact(&s, 32 * 1024, i as u8);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(client.stats().sessions, 1);
    let want = client.config().channels + client.config().latency_channels;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while client.stats().channels.len() < want {
        assert!(std::time::Instant::now() < deadline, "the session's other channels never came");
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = client.connect_with_class(addr, 7, Class::Throughput).unwrap();
    echo_exact(&s, 256 * 1024, 99);
}
