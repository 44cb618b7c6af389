mod common;
use common::*;

#[test]
fn echo_over_loopback() {
    let tb = Testbed::loopback();
    let (a, b) = tb.engines(|_| {});
    let l = b.listen(9).unwrap();
    let s = a.connect(b.local_addr(), 9).unwrap();
    let p = l.accept().unwrap();
    s.send(b"hello").unwrap();
    let mut buf = [0u8; 16];
    let n = p.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"hello");
    p.send(b"world!").unwrap();
    let n = s.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"world!");
    s.shutdown().unwrap();
    assert_eq!(p.recv(&mut buf).unwrap(), 0);
}

/// Each channel runs the first congestion control in `Config::congestion` that the kernel
/// accepts (an unknown name is skipped), and an empty list keeps the host's default; stats
/// show which one each channel got.
#[test]
fn channels_use_the_first_congestion_control_the_kernel_accepts() {
    let host_default =
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
    let client = netchannel::Engine::new(netchannel::Config {
        congestion: vec!["no-such-algorithm".into(), "reno".into()],
        ..netchannel::Config::new("127.0.0.1:0".parse().unwrap())
    })
    .unwrap();
    let server = netchannel::Engine::new(netchannel::Config {
        congestion: vec![],
        ..netchannel::Config::new("127.0.0.1:0".parse().unwrap())
    })
    .unwrap();
    let l = server.listen(9).unwrap();
    let s = client.connect(server.local_addr(), 9).unwrap();
    let p = l.accept().unwrap();
    s.send(b"x").unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(p.recv(&mut buf).unwrap(), 1);
    let algorithms = |e: &netchannel::Engine| -> Vec<Option<String>> {
        e.stats()
            .channels
            .iter()
            .filter(|c| c.channel.open)
            .map(|c| c.channel.congestion.clone())
            .collect()
    };
    let dialed = algorithms(&client);
    assert!(!dialed.is_empty());
    assert!(dialed.iter().all(|c| c.as_deref() == Some("reno")), "{dialed:?}");
    let accepted = algorithms(&server);
    assert!(!accepted.is_empty());
    assert!(accepted.iter().all(|c| c.as_deref() == Some(host_default.trim())), "{accepted:?}");
}
