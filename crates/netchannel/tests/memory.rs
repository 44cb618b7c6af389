//! Memory per idle virtual socket, measured as the process's resident memory from /proc (not
//! `size_of`): the design target is at most 512 bytes per idle stream endpoint, so a million
//! idle sockets stay around half a GiB. Its own test binary, so nothing else allocates meanwhile.

mod common;
use common::*;

#[test]
fn an_idle_stream_costs_at_most_512_bytes_per_end() {
    const N: usize = 100_000;
    let tb = Testbed::loopback();
    let (a, b) = tb.engines(|_| {});
    let l = b.listen(9).unwrap();
    // Warm up: the session, its channels, the threads' buffers.
    let warm: Vec<_> = (0..100).map(|_| a.connect(b.local_addr(), 9).unwrap()).collect();
    let warm_peers: Vec<_> = (0..100).map(|_| l.accept().unwrap()).collect();
    let mut clients = Vec::with_capacity(N);
    let mut servers = Vec::with_capacity(N);
    let before = rss_bytes("self");
    for _ in 0..N {
        clients.push(a.connect(b.local_addr(), 9).unwrap());
        servers.push(l.accept().unwrap());
    }
    let after = rss_bytes("self");
    // Both ends of every stream live in this process: two endpoints per stream. The handles'
    // Vecs were allocated before `before` and do not count.
    let per_end = (after - before) as f64 / (2 * N) as f64;
    eprintln!("{N} idle streams: {per_end:.0} bytes of resident memory per endpoint");
    assert!(per_end <= 512.0, "{per_end:.0} bytes per idle stream endpoint");
    assert_eq!(a.stats().open_sockets, N + 100);
    drop((warm, warm_peers));
}
