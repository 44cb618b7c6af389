//! Many peers: a server engine full of multi-channel sessions still admits new peers, and
//! engines standing in for hosts dial from addresses of their own.

mod common;

use std::io::Read;
use std::net::{IpAddr, SocketAddr};

use common::*;
use netchannel::{Config, Engine};

both_testbeds!(
    a_full_channel_budget_keeps_room_for_new_peers,
    dialed_channels_leave_from_dial_source
);

/// Echoes one message over a new socket from `client` to the listener's engine.
fn exchange(client: &Engine, server: SocketAddr, l: &netchannel::Listener, msg: &[u8]) {
    let s = client.connect(server, 9).unwrap();
    let p = l.accept().unwrap();
    s.send(msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    (&p).read_exact(&mut got).unwrap();
    assert_eq!(got, msg);
}

fn a_full_channel_budget_keeps_room_for_new_peers(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // Room for 8 channels; each peer wants 5 (4 throughput, 1 latency).
    let server = Engine::new(Config { max_channels_total: 8, ..tb.config_b() }).unwrap();
    let l = server.listen(9).unwrap();
    let addr = server.local_addr();
    let peers: Vec<Engine> = (0..3).map(|_| Engine::new(tb.config_a()).unwrap()).collect();
    for (i, p) in peers.iter().enumerate() {
        exchange(p, addr, &l, format!("peer {i}").as_bytes());
        // Let its background dials finish (or be refused) before the next peer comes.
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let st = server.stats();
    assert_eq!(st.sessions, 3, "every peer has a session: {:?}", st.refusals);
    // A peer's second and later channels fill three quarters at most; the last quarter is for
    // first channels.
    assert!(st.channels.len() <= 8, "{} channels", st.channels.len());
    assert!(
        st.refusals.iter().any(|(why, _)| why.contains("new peers")),
        "later channels were refused for the new peers' room: {:?}",
        st.refusals
    );
    // Every peer keeps working over what it got.
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
    let client = Engine::new(Config { dial_source: Some(source), ..tb.config_a() }).unwrap();
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
