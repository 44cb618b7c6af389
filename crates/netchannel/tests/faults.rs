//! Bad input and faults. Each fault closes at most the channel it concerns, is counted, and
//! leaves other peers and their sockets working.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use netchannel::wire::frame::MAX_HEADER_LEN;
use netchannel::wire::handshake::HANDSHAKE_LEN;
use netchannel::wire::{Frame, Handshake, HandshakeKind, RejectReason};
use netchannel::{Class, Engine, VSocket};

both_testbeds!(
    connect_where_no_engine_listens,
    connect_to_port_without_listener,
    a_new_peer_at_max_sessions_waits_for_room_within_its_busy_dial_timeout,
    killed_peer_ends_every_socket,
    garbage_instead_of_handshake,
    wrong_version_is_refused_by_the_acceptor,
    wrong_version_or_magic_is_refused_by_the_dialer,
    truncated_frame,
    unknown_stream_id,
    data_beyond_credit,
    garbage_frame_after_handshake,
);

/// A working socket from a legitimate peer, checked before and after each fault.
struct Bystander {
    client: VSocket,
    server: VSocket,
}

impl Bystander {
    fn new(a: &Engine, b: &Engine) -> Bystander {
        let l = b.listen(4000).unwrap();
        let client = a.connect(b.local_addr(), 4000).unwrap();
        let server = l.accept().unwrap();
        let by = Bystander { client, server };
        by.check();
        by
    }

    fn check(&self) {
        for msg in [&b"before"[..], &[7u8; 50_000][..]] {
            self.client.send(msg).unwrap();
            let mut got = vec![0u8; msg.len()];
            (&self.server).read_exact(&mut got).unwrap();
            assert_eq!(got, msg);
            self.server.send(msg).unwrap();
            (&self.client).read_exact(&mut got).unwrap();
            assert_eq!(got, msg);
        }
    }
}

/// Reads until the engine closes the connection.
fn expect_closed(s: &mut TcpStream) {
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => {}
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}"),
    }
}

/// Waits until `engine` has counted `n` protocol errors and returns the closed channels' reasons.
fn wait_for_errors(engine: &Engine, n: u64) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = engine.stats();
        if stats.protocol_errors >= n {
            return stats
                .closed_channels
                .iter()
                .filter_map(|c| c.channel.close_reason.clone())
                .collect();
        }
        assert!(Instant::now() < deadline, "no protocol error counted: {stats:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn connect_where_no_engine_listens(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, _b) = tb.engines(|_| {});
    // A port nobody listens on, on host B.
    let port = match hosts {
        Hosts::Loopback => TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port(),
        Hosts::Netns => 9,
    };
    let start = Instant::now();
    let err = a.connect(SocketAddr::new(tb.addr_b, port), 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
}

fn connect_to_port_without_listener(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // Every channel dialed, traffic or not.
    let (a, b) = tb.engines(|c| c.rest_channels_rate = 0);
    let _l = b.listen(1).unwrap();
    let err = a.connect(b.local_addr(), 2).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    // The channels stay up: the refusal was per stream.
    assert!(a.connect(b.local_addr(), 1).is_ok());
    common::wait_for_channels(&a, 5);
    assert_eq!(a.stats().channels.len(), 5);
}

fn a_new_peer_at_max_sessions_waits_for_room_within_its_busy_dial_timeout(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let server = Engine::new(netchannel::Config { max_sessions: 1, ..tb.config_b() }).unwrap();
    let l = server.listen(5).unwrap();
    let addr = server.local_addr();
    let first = Engine::new(tb.config_a()).unwrap();
    let s1 = first.connect(addr, 5).unwrap();
    let _p1 = l.accept().unwrap();
    // A second peer finds no room and is refused (as a full backlog drops a SYN): it tries
    // again for `busy_dial_timeout` (30 s by default), longer than one dial's timeout, and gets
    // in once the first peer has left.
    let second = Engine::new(netchannel::Config {
        dial_timeout: Duration::from_millis(300),
        ..tb.config_a()
    })
    .unwrap();
    let t = std::thread::spawn(move || {
        let r = second.connect(addr, 5);
        (second, r)
    });
    std::thread::sleep(Duration::from_millis(1200));
    drop(s1);
    drop(first);
    let (_second, r) = t.join().unwrap();
    let s2 = r.expect("the second peer got in once the first left");
    let p2 = l.accept().unwrap();
    s2.send(b"in").unwrap();
    let mut got = [0u8; 2];
    (&p2).read_exact(&mut got).unwrap();
    assert_eq!(&got, b"in");
    // No room for the whole of its busy dial timeout: the refusal, with its reason.
    let third = Engine::new(netchannel::Config {
        busy_dial_timeout: Duration::from_millis(500),
        ..tb.config_a()
    })
    .unwrap();
    let start = Instant::now();
    let err = third.connect(addr, 5).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert!(err.to_string().contains("resource limit"), "{err}");
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(100), "tried again for {took:?} only");
    assert!(took < Duration::from_secs(2), "took {took:?} for a 500 ms busy dial timeout");
}

fn killed_peer_ends_every_socket(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, _) = tb.engines(|_| {});
    let mut echo = EchoProcess::start(&tb, &[]);
    let peer = echo.addr;
    let socks: Vec<VSocket> = (0..8).map(|_| a.connect(peer, 7).unwrap()).collect();
    for s in &socks {
        s.send(b"echo?").unwrap();
        let mut buf = [0u8; 5];
        (&*s).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"echo?");
    }
    let socks = std::sync::Arc::new(socks);
    let readers: Vec<_> = (0..4)
        .map(|i| {
            let socks = socks.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 16];
                socks[i].recv(&mut buf).map_err(|e| e.kind())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let killed = Instant::now();
    echo.child.kill().unwrap();
    echo.child.wait().unwrap();
    // Each blocked reader ends: with a reset, or with end of file where the peer had told it
    // read everything sent to it before its channels closed cleanly (the killed process's
    // kernel sends a FIN then, and kernel TCP gives end of file too: `Stream::end_with_peer`).
    for r in readers {
        let end = r.join().unwrap();
        assert!(matches!(end, Ok(0) | Err(ErrorKind::ConnectionReset)), "{end:?}");
    }
    for s in &socks[4..] {
        let err = loop {
            match s.send(&[0u8; 65536]) {
                Ok(_) => assert!(killed.elapsed() < Duration::from_secs(5), "send never failed"),
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    }
    assert!(killed.elapsed() < Duration::from_secs(5), "took {:?}", killed.elapsed());
}

fn garbage_instead_of_handshake(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let by = Bystander::new(&a, &b);
    let mut s = raw::peer(&tb, b.local_addr());
    s.write_all(b"GET / HTTP/1.1\r\nHost: netchannel\r\n\r\n").unwrap();
    let reply = raw::read_handshake(&mut s);
    assert_eq!(reply.kind, HandshakeKind::Reject(RejectReason::BadMagic));
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("bad magic")), "{reasons:?}");
    assert_eq!(b.stats().handshake_failures, 1);
    by.check();
}

fn wrong_version_is_refused_by_the_acceptor(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let by = Bystander::new(&a, &b);
    let mut hello = Handshake::hello(1, 0, 0, Class::Throughput, [1; 16], false).encode();
    hello[4..6].copy_from_slice(&9u16.to_be_bytes());
    let mut s = raw::peer(&tb, b.local_addr());
    s.write_all(&hello).unwrap();
    assert_eq!(
        raw::read_handshake(&mut s).kind,
        HandshakeKind::Reject(RejectReason::UnsupportedVersion)
    );
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("unsupported protocol version 9")), "{reasons:?}");
    by.check();
}

fn wrong_version_or_magic_is_refused_by_the_dialer(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, _b) = tb.engines(|_| {});
    // A fake engine on host B answering every hello with a corrupted challenge: first a wrong
    // version (bytes 4..6), then a wrong magic (byte 0).
    let ns = tb.b.clone();
    let bind = SocketAddr::new(tb.addr_b, 0);
    let fake = std::thread::spawn(move || {
        if let Some(ns) = ns {
            netchannel::enter_netns(&ns).unwrap();
        }
        TcpListener::bind(bind).unwrap()
    })
    .join()
    .unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let corrupt_magic = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mode = corrupt_magic.clone();
    std::thread::spawn(move || {
        for conn in fake.incoming() {
            let Ok(mut s) = conn else { return };
            let mut hello = [0u8; HANDSHAKE_LEN];
            if s.read_exact(&mut hello).is_err() {
                continue;
            }
            let hello = Handshake::decode(&hello).unwrap();
            let mut reply = Handshake::challenge(42, &hello, [0; 16], false).encode();
            if mode.load(std::sync::atomic::Ordering::SeqCst) {
                reply[0] = b'X';
            } else {
                reply[4..6].copy_from_slice(&9u16.to_be_bytes());
            }
            let _ = s.write_all(&reply);
        }
    });
    let err = a.connect(fake_addr, 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert!(err.to_string().contains("unsupported protocol version 9"), "{err}");
    corrupt_magic.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = a.connect(fake_addr, 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
    assert!(err.to_string().contains("bad magic"), "{err}");
}

fn truncated_frame(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let by = Bystander::new(&a, &b);
    let mut s = raw::channel(&tb, b.local_addr());
    let mut frame = Vec::new();
    Frame::Data { stream: 0, offset: 0, payload: &[1, 2, 3, 4] }.encode(&mut frame);
    s.write_all(&frame[..12]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("truncated")), "{reasons:?}");
    by.check();
}

fn unknown_stream_id(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let by = Bystander::new(&a, &b);
    let mut s = raw::channel(&tb, b.local_addr());
    let mut frame = Vec::new();
    Frame::Credit { dst: 0x00AB_CDEF, consumed: 0, window: 10 }.encode(&mut frame);
    s.write_all(&frame).unwrap();
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("unknown stream id")), "{reasons:?}");
    by.check();
}

fn garbage_frame_after_handshake(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|_| {});
    let by = Bystander::new(&a, &b);
    let mut s = raw::channel(&tb, b.local_addr());
    s.write_all(&[0xEE; 64]).unwrap();
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("unknown frame type 238")), "{reasons:?}");
    by.check();
}

fn data_beyond_credit(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|c| c.stream_window = 65536);
    let by = Bystander::new(&a, &b);
    let l = b.listen(77).unwrap();
    let mut s = raw::channel(&tb, b.local_addr());
    let mut out = Vec::with_capacity(MAX_HEADER_LEN);
    Frame::Syn { src: 1, port: 77, class: Class::Throughput, window: 65536 }.encode(&mut out);
    s.write_all(&out).unwrap();
    let id = raw::read_syn_ack(&mut s);
    let victim = l.accept().unwrap();
    out.clear();
    let payload = vec![0u8; 65537];
    Frame::Data { stream: id, offset: 0, payload: &payload }.encode(&mut out);
    s.write_all(&out).unwrap();
    expect_closed(&mut s);
    let reasons = wait_for_errors(&b, 1);
    assert!(reasons.iter().any(|r| r.contains("beyond granted credit")), "{reasons:?}");
    assert_eq!(victim.stats().protocol_errors, 1);
    let mut buf = [0u8; 8];
    assert_eq!(victim.recv(&mut buf).unwrap_err().kind(), ErrorKind::ConnectionReset);
    by.check();
}
