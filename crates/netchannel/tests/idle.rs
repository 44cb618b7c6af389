//! An idle engine uses no CPU: its workers park in epoll. Its own test binary, so no other test
//! runs in the process while CPU time is measured.

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

#[test]
fn idle_engines_use_no_cpu() {
    let tb = Testbed::loopback();
    let (a, b) = tb.engines(|_| {});
    let l = b.listen(9).unwrap();
    let s = a.connect(b.local_addr(), 9).unwrap();
    let p = l.accept().unwrap();
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
