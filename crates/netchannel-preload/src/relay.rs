//! Relay loops: move bytes between the kernel end of each carried connection (the loopback
//! socket the application's fd is connected to) and its virtual socket.
//!
//! A few threads (one per CPU, at most 4) each run one epoll set over the kernel ends of their
//! connections and one `Poller` over their virtual sockets, and sleep in the poller (which the
//! epoll set also wakes: `Poller::wake_on`). Against two blocking pump threads per connection
//! (the first design), a loaded program's many connections are served in batches, one wake-up
//! for many of them, and the sends one round makes leave together: they are flushed once, at
//! the end of the round.
//!
//! Each connection holds at most one read's worth (`CHUNK`) of bytes per direction that the
//! other side has not taken yet; while it does, the loop stops reading that direction, so a slow
//! receiver holds the sender back through both kernels' windows (backpressure, nothing dropped).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use netchannel::sys::{Epoll, EventFd, EDGE, PEER_SHUTDOWN, READABLE, WRITABLE};
use netchannel::{Poller, VSocket};
use parking_lot::Mutex;

use crate::interpose::{fd_base, inside, reset, COUNTERS};

/// Bytes moved per read.
const CHUNK: usize = 64 * 1024;
/// epoll tokens of the loop's own fds (connection ids count up from 0).
const WAKE: u64 = u64::MAX;

pub(crate) struct Loop {
    /// Connections handed over, not yet registered.
    inbox: Mutex<Vec<(TcpStream, VSocket)>>,
    /// The inbox has something.
    wake: EventFd,
}

/// The relay loops, started on first use. Called where the process's engine is created, with
/// the low fd slots held (`fds_high`), so the loops' own fds land above the application's: a
/// loop started later from one of our threads would hold those slots while the application
/// accepts, and push its fds past select's 1024.
pub(crate) fn loops() -> &'static [Arc<Loop>] {
    static LOOPS: OnceLock<Vec<Arc<Loop>>> = OnceLock::new();
    LOOPS.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4);
        (0..n).filter_map(|_| start()).collect()
    })
}

fn start() -> Option<Arc<Loop>> {
    let wake = EventFd::new().and_then(|e| e.moved_above(fd_base())).ok()?;
    let ep = Epoll::new().and_then(|e| e.moved_above(fd_base())).ok()?;
    let poller = Poller::new().ok()?;
    let lp = Arc::new(Loop { inbox: Mutex::new(Vec::new()), wake });
    ep.add(lp.wake.as_fd(), READABLE, WAKE).ok()?;
    let run_lp = lp.clone();
    std::thread::Builder::new()
        .name("nc-relay-loop".into())
        .spawn(move || inside(|| run(&run_lp, ep, poller)))
        .ok()?;
    Some(lp)
}

/// Hands a connection to a relay loop (round robin).
pub(crate) fn relay(app: TcpStream, vs: VSocket) {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let all = loops();
    if all.is_empty() {
        // No thread could be started: the connection cannot be served; dropping both ends
        // closes them, so the application sees its connection end rather than hang.
        return;
    }
    let lp = &all[NEXT.fetch_add(1, Ordering::Relaxed) % all.len()];
    lp.inbox.lock().push((app, vs));
    lp.wake.notify();
}

struct Conn {
    app: TcpStream,
    vs: VSocket,
    /// Read from the application, not yet taken by the virtual socket.
    up: Vec<u8>,
    /// Received from the virtual socket, not yet written to the application.
    down: Vec<u8>,
    up_done: bool,
    down_done: bool,
}

/// Kernel events the loop takes per round.
const EVENTS_PER_ROUND: usize = 256;

fn run(lp: &Loop, ep: Epoll, poller: Poller) {
    // The loop sleeps in the poller (so it serves its virtual sockets' channels itself, one
    // wake-up per message as an application thread blocked in recv would), woken also by its
    // epoll set of kernel ends, which it polls without blocking each round.
    poller.wake_on(ep.raw());
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut next_id: u64 = 0;
    let mut scratch = vec![0u8; CHUNK];
    let mut events: Vec<(u64, u32)> = Vec::with_capacity(EVENTS_PER_ROUND);
    let mut tokens = Vec::new();
    let mut due: Vec<u64> = Vec::new();
    let mut sleep = false;
    loop {
        due.clear();
        let _ = poller.wait(&mut tokens, (!sleep).then_some(Duration::ZERO));
        due.extend_from_slice(&tokens);
        events.clear();
        // An interrupted wait reports no event (the round goes on); other errors end the loop.
        let n = match ep.wait(&mut events, EVENTS_PER_ROUND, Some(Duration::ZERO)) {
            Ok(n) => n,
            Err(_) => return,
        };
        for &(token, _) in &events {
            if token != WAKE {
                due.push(token);
                continue;
            }
            lp.wake.drain();
            let arrived = std::mem::take(&mut *lp.inbox.lock());
            for (app, vs) in arrived {
                let id = next_id;
                next_id += 1;
                let _ = app.set_nonblocking(true);
                let _ = app.set_nodelay(true);
                vs.set_nonblocking(true);
                let flags = READABLE | WRITABLE | PEER_SHUTDOWN | EDGE;
                if ep.add(app.as_fd(), flags, id).is_err() || poller.register(&vs, id).is_err() {
                    reset(&app);
                    continue;
                }
                let c = Conn {
                    app,
                    vs,
                    up: Vec::new(),
                    down: Vec::new(),
                    up_done: false,
                    down_done: false,
                };
                conns.insert(id, c);
                due.push(id);
            }
        }
        // A full batch of kernel events may have left more: go round without sleeping.
        sleep = due.is_empty() && n < EVENTS_PER_ROUND;
        due.sort_unstable();
        due.dedup();
        for id in &due {
            let Some(c) = conns.get_mut(id) else { continue };
            drive(c, &mut scratch);
            if c.up_done && c.down_done {
                // Closing the kernel end takes it out of the epoll set; dropping the virtual
                // socket closes it (delivering what is queued, or resetting if bytes were
                // left unread, as TCP does).
                conns.remove(id);
            }
        }
        // What this batch sent leaves now, together (a burst is otherwise held until the
        // loop sleeps, and under steady load it may not).
        netchannel::flush_sends();
    }
}

/// How one direction of a connection stopped moving.
enum Stop {
    /// Either side would block: wait for its next event.
    Blocked,
    /// The reading side ended (EOF).
    Ended,
    /// The reading side failed (reset).
    ReadFailed,
    /// The writing side failed (gone); what is pending is dropped.
    WriteFailed,
}

/// Moves bytes from `read` to `write` until one of them stops: straight through while `write`
/// takes everything, with what it leaves in `pending` (then nothing more is read until it is
/// taken: backpressure).
fn forward(
    pending: &mut Vec<u8>,
    scratch: &mut [u8],
    moved: &AtomicU64,
    mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
    mut write: impl FnMut(&[u8]) -> io::Result<usize>,
) -> Stop {
    let blocked = |e: &io::Error| e.kind() == io::ErrorKind::WouldBlock;
    let interrupted = |e: &io::Error| e.kind() == io::ErrorKind::Interrupted;
    loop {
        if !pending.is_empty() {
            match write(pending) {
                Ok(n) => {
                    pending.drain(..n);
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if blocked(&e) => return Stop::Blocked,
                Err(e) if interrupted(&e) => {}
                Err(_) => {
                    pending.clear();
                    return Stop::WriteFailed;
                }
            }
            continue;
        }
        match read(scratch) {
            Ok(0) => return Stop::Ended,
            Ok(n) => match write(&scratch[..n]) {
                Ok(m) => {
                    moved.fetch_add(m as u64, Ordering::Relaxed);
                    pending.extend_from_slice(&scratch[m..n]);
                }
                // Kept: the pending branch above retries it and sees the error again, if any.
                Err(_) => pending.extend_from_slice(&scratch[..n]),
            },
            Err(e) if blocked(&e) => return Stop::Blocked,
            Err(e) if interrupted(&e) => {}
            Err(_) => return Stop::ReadFailed,
        }
    }
}

/// Moves what can move in both directions until each would block.
fn drive(c: &mut Conn, scratch: &mut [u8]) {
    if !c.up_done {
        let (app, vs) = (&c.app, &c.vs);
        match forward(&mut c.up, scratch, &COUNTERS.bytes_out, |b| (&*app).read(b), |b| vs.send(b))
        {
            Stop::Blocked => {}
            Stop::Ended => {
                let _ = c.vs.shutdown();
                c.up_done = true;
            }
            // The virtual connection is gone: what the application writes goes nowhere.
            Stop::WriteFailed => {
                let _ = c.app.shutdown(Shutdown::Read);
                c.up_done = true;
            }
            // The application reset its connection: so does the virtual one (dropped with the
            // connection, its unread bytes make it a reset).
            Stop::ReadFailed => {
                c.up_done = true;
                c.down_done = true;
            }
        }
    }
    if !c.down_done {
        let (app, vs) = (&c.app, &c.vs);
        match forward(
            &mut c.down,
            scratch,
            &COUNTERS.bytes_in,
            |b| vs.recv(b),
            |b| (&*app).write(b),
        ) {
            Stop::Blocked => {}
            Stop::Ended => {
                let _ = c.app.shutdown(Shutdown::Write);
                c.down_done = true;
            }
            Stop::WriteFailed => c.down_done = true,
            // The virtual connection was reset: reset the application's too.
            Stop::ReadFailed => {
                reset(&c.app);
                c.down_done = true;
                c.up_done = true;
            }
        }
    }
}
