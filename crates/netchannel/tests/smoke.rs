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
