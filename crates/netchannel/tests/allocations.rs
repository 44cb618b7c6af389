//! Heap allocations on the message path, counted by a global allocator per thread: a blocking
//! ping-pong's client thread allocates nothing per round trip once warm (a blocking wait used
//! to allocate its event list and its stream's waiter list each time). Its own test binary,
//! so that the allocator counts only what this test does.

mod common;
use common::*;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call goes to the system allocator unchanged; the counter is a const-initialised
// thread-local without a destructor, which never allocates (and `try_with` fails softly while
// a thread is exiting).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn a_blocking_round_trip_allocates_nothing_once_warm() {
    const WARM: usize = 500;
    const COUNTED: usize = 5_000;
    let tb = Testbed::loopback();
    let (a, b) = tb.engines(|_| {});
    let l = b.listen(5).unwrap();
    let c = a.connect(b.local_addr(), 5).unwrap();
    let s = l.accept().unwrap();
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while (&s).read_exact(&mut buf).is_ok() {
            (&s).write_all(&buf).unwrap();
        }
    });
    let mut buf = [7u8; 64];
    let round_trip = |buf: &mut [u8; 64]| {
        (&c).write_all(&buf[..]).unwrap();
        (&c).read_exact(&mut buf[..]).unwrap();
    };
    for _ in 0..WARM {
        round_trip(&mut buf);
    }
    let before = allocations();
    for _ in 0..COUNTED {
        round_trip(&mut buf);
    }
    let per_round_trip = (allocations() - before) as f64 / COUNTED as f64;
    eprintln!("client thread: {per_round_trip:.3} allocations per round trip");
    // A few may come from growth the warm-up did not reach; one per round trip would not.
    assert!(per_round_trip < 0.05, "{per_round_trip:.3} allocations per blocking round trip");
    c.shutdown().unwrap();
    drop(c);
    echo.join().unwrap();
}
