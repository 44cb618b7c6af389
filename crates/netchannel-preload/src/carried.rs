//! A carried connection on the direct path: the program's fd number holds a placeholder, one
//! end (P) of an AF_UNIX stream socketpair, and every data call on it is served from the
//! connection's `VSocket` in the calling thread (no relay, no copy through the kernel).
//!
//! The placeholder exists for the kernel's sake: whatever the program waits in (epoll in every
//! mode, poll, select, a dup, a nested epoll set, another process after fork) sees P's
//! readiness, and the library makes P's readiness mirror the virtual socket's through the
//! other end (L), which only the library holds:
//!
//! | virtual socket           | placeholder P                | done through L            |
//! |--------------------------|------------------------------|---------------------------|
//! | readable (data, EOF)     | `POLLIN`                     | a token byte written to P |
//! | new data (edge)          | a new `EPOLLET` edge         | one more token byte       |
//! | read drained             | not readable                 | the program's next read drains P's tokens |
//! | not writable (window)    | not `POLLOUT`                | ballast written into L from P fills P's minimal send buffer |
//! | writable again           | `POLLOUT`                    | L reads the ballast       |
//! | peer's FIN               | `POLLIN`/`POLLRDHUP`         | `shutdown(L, SHUT_WR)`    |
//! | both halves shut         | `POLLHUP`                    | L read empty, then closed |
//! | reset                    | `POLLERR`/`POLLHUP`, `SO_ERROR` | L closed with a byte unread (the "primer") |
//!
//! Readiness is mirrored only once the placeholder is watched by the kernel (the program put it
//! in an epoll set or a poll/select): a program that only makes blocking calls costs no token.
//! A placeholder whose readability only the program's own `epoll_wait` on its one set can see
//! costs none either: that wait reports it (`elide`).
//! L also tells when the program's last copy of P, in any process, is closed: L reports
//! `POLLHUP` then and only then (P is never shut down in both directions while L is open).

use std::collections::HashMap;
use std::ffi::c_int;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use netchannel::sys::SignalPolicy;
use netchannel::{ReadinessObserver, ThreadWake, VSocket};
use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags};
use rustix::net::{RecvFlags, SendFlags};

use crate::forklock::ForkMutex;
use crate::interpose::{raise_sigpipe, signals};
use crate::process::{pid, relocate, COUNTERS};

/// Carried connections by id: how a process that inherited a placeholder (fork, exec,
/// `SCM_RIGHTS`) finds the connection through the relay, and who holds it while the owner's
/// own fds are closed but a copy of P lives elsewhere.
static REGISTRY: ForkMutex<Option<HashMap<u64, Arc<Carried>>>> = ForkMutex::new(None);

/// `TCP_INFO`'s state of a closed connection (`Carried::tcp_state`).
pub(crate) const TCP_CLOSE: u8 = 7;
pub(crate) const TCP_SYN_SENT: u8 = 2;

/// Bytes a large write sends through the virtual socket in one call; writes up to this size
/// from several buffers are gathered into one send.
const GATHER: usize = 64 * 1024;

/// The most a peek that waits for more keeps taken out of the virtual socket (`peek_at_least`):
/// about what TCP's largest receive buffer holds.
const PEEK_HELD: usize = 4 << 20;

/// The placeholder's mirror state (see the module doc).
struct Mirror {
    /// The library's end; `None` once a terminal state is mirrored by closing it.
    l: Option<OwnedFd>,
    /// Token bytes written into P and not drained yet.
    tokens: u32,
    /// Ballast bytes in L (beyond the primer).
    ballast: u32,
    /// The peer's FIN is mirrored (`shutdown(L, SHUT_WR)`).
    eof: bool,
    /// The program shut its halves down.
    wr_shut: bool,
    rd_shut: bool,
    /// The one epoll set P is registered in while its readability may be elided (`elide`).
    elided_in: Option<Registration>,
    /// Epoll sets P is registered in.
    sets: u32,
    /// Elision ended for good (see `elide`).
    no_elision: bool,
    /// In `elide`'s ready list: readable without a token, reported by the next wait on its set.
    queued: bool,
    /// A wait reported it readable (elided), and no read has found it empty since.
    reported: bool,
    /// An out-of-band byte sent from L shows the peer's urgent data on P (`POLLPRI`, and
    /// `SIGURG` to P's owner when it was sent).
    oob: bool,
    /// Tokens in P ahead of that byte (a drain reads no further: a read at the mark would
    /// take the byte away).
    tokens_before_oob: u32,
}

/// Where and how an elided placeholder is registered: what its set's wait reports for it.
#[derive(Clone)]
pub(crate) struct Registration {
    pub set: Arc<crate::elide::SetState>,
    pub events: u32,
    pub data: u64,
}

/// A handed-over connection, between the relay serving the process that took it over and the
/// owner's own calls (kernel TCP lets both processes use the socket; the common case is one
/// after the other: a child uses it and exits, and the parent goes on).
#[derive(Default)]
struct Share {
    /// A copy of the relay's end of the taker's connection: tells the owner that the taker
    /// closed it before the relay has noticed.
    link: Option<netchannel::sys::ShedOnFork<OwnedFd>>,
    /// Bytes the relay took from the virtual socket and could not deliver to the taker (it
    /// closed): the owner's next reads return them first.
    returned: Vec<u8>,
}

/// The connection's pending error, reported once as TCP reports `sk_err`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ErrorState {
    None,
    Pending(i32),
    Reported,
}

/// A carried connection on the direct path.
pub(crate) struct Carried {
    /// Dropped only in the owning process (a forked child's copy of the engine has no threads
    /// and must never write to the parent's channels).
    pub vs: ManuallyDrop<VSocket>,
    pub id: u64,
    /// The process whose engine carries it.
    pub owner: u32,
    /// The placeholder's identity (a process taking the connection over proves it holds it).
    inode: (u64, u64),
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// The program's socket was IPv6 (getsockopt answers for its family).
    pub v6: bool,
    /// Itself, for `elide`'s ready list.
    me: Weak<Carried>,
    /// `elide::forks()` when it was made.
    forks: u64,
    mirror: Mutex<Mirror>,
    error: Mutex<ErrorState>,
    /// P is, or was, in a kernel wait (epoll set, poll, select): mirror readiness.
    watched: AtomicBool,
    /// P is registered edge-triggered somewhere: every arrival makes a new edge.
    edge: AtomicBool,
    /// Numbers of this process's fd table that hold P.
    fds: AtomicUsize,
    pub(crate) opts: crate::sockopt::Options,
    /// A child or another process took the connection over through the relay.
    pub handed_over: AtomicBool,
    /// What the relay and this process's own calls share while it is handed over.
    share: Mutex<Share>,
    closed: AtomicBool,
    /// Threads in a `poll` over carried fds only (`waits::poll`), woken after each change is
    /// mirrored into P (so the wait they sleep in, which is not P's, sees it when they look).
    sleepers: Mutex<Vec<ThreadWake>>,
    /// This process closed its last fd for it while a copy of P lived elsewhere.
    orphaned: AtomicBool,
    /// Where the connect stands, for a second `connect` and for the state reported
    /// (`CONNECT_*`).
    connect_state: AtomicU8,
    /// A write after the peer's FIN already met the connection's end once (see `send`).
    wrote_past_end: AtomicBool,
    /// A `shutdown` gave the connect in progress up: reads fail with `ENOTCONN` (after the
    /// pending error), as on TCP's socket back in CLOSE.
    given_up: AtomicBool,
    /// `Mirror::oob`, read without the lock on the data path.
    urgent_shown: AtomicBool,
}

/// `connect` returned 0 (or the connection was accepted): a second one fails with `EISCONN`.
const CONNECT_DONE: u8 = 0;
/// `connect` returned `EINPROGRESS` and the peer has not answered yet.
const CONNECT_IN_PROGRESS: u8 = 1;
/// The peer answered (accepted or refused) a connect in progress, and no `connect` since has
/// reported it.
const CONNECT_ANSWERED: u8 = 2;

/// A socket error as the errno TCP reports.
pub(crate) fn errno_of(e: &io::Error) -> i32 {
    use io::ErrorKind::*;
    match e.kind() {
        WouldBlock => libc::EAGAIN,
        ConnectionReset => libc::ECONNRESET,
        ConnectionRefused => libc::ECONNREFUSED,
        ConnectionAborted => libc::ECONNABORTED,
        TimedOut => libc::ETIMEDOUT,
        BrokenPipe => libc::EPIPE,
        NotConnected => libc::ENOTCONN,
        Interrupted => libc::EINTR,
        _ => e.raw_os_error().unwrap_or(libc::EIO),
    }
}

/// A reset after the peer's FIN (TCP's CLOSE_WAIT) is reported as `EPIPE`, as Linux does.
fn reset_errno(errno: i32, after_fin: bool) -> i32 {
    if errno == libc::ECONNRESET && after_fin {
        libc::EPIPE
    } else {
        errno
    }
}

fn kind_errno(k: io::ErrorKind) -> i32 {
    errno_of(&io::Error::from(k))
}

/// What a blocking call does when its wait is interrupted by a signal: Linux restarts socket
/// calls whose handler has `SA_RESTART`, unless the socket has a timeout for that direction.
fn restart_after_signal(seen: signals::Snapshot, has_timeout: bool) -> bool {
    !has_timeout && !signals::no_restart_since(seen)
}

impl Carried {
    /// Makes the placeholder for `vs` (returned as P, for the caller to put under the
    /// program's fd number with the program's close-on-exec flag) and registers the
    /// connection. `nonblocking`: the program's socket was non-blocking (P inherits it).
    pub(crate) fn create(
        vs: VSocket,
        peer: SocketAddr,
        local: SocketAddr,
        v6: bool,
        nonblocking: bool,
    ) -> io::Result<(Arc<Carried>, OwnedFd)> {
        use rustix::net::{AddressFamily, SocketFlags, SocketType};
        static IDS: AtomicU64 = AtomicU64::new(1);
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let (p, l) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        // L above the program's numbers at once. P stays low for the few calls until it is
        // moved under the program's number (`install`): moving it up first would cost two
        // calls per connection to spare another thread of the program a number one higher for
        // a moment.
        let l = relocate(l);
        // Named, so that a process that inherits P (exec, SCM_RIGHTS) recognises it and finds
        // the connection ("nc/<owner pid>/<id>" in the abstract namespace), through the owner's
        // attach socket.
        crate::relay::start_attach_server();
        let name = crate::inherit::placeholder_name(pid(), id);
        let addr = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())?;
        rustix::net::bind(&p, &addr)?;
        // The smallest send buffer: one ballast byte beyond the primer makes P unwritable.
        rustix::net::sockopt::set_socket_send_buffer_size(&p, 1)?;
        // The primer: a byte L never reads while the connection lives, so that closing L
        // reports ECONNRESET on P (a reset); read before a clean close (both halves shut).
        rustix::net::send(&p, &[0], SendFlags::DONTWAIT)?;
        if nonblocking {
            let fl = rustix::fs::fcntl_getfl(&p)?;
            rustix::fs::fcntl_setfl(&p, fl | rustix::fs::OFlags::NONBLOCK)?;
        }
        let st = rustix::fs::fstat(&p)?;
        vs.set_nonblocking(true);
        let c = Arc::new_cyclic(|me| Carried {
            vs: ManuallyDrop::new(vs),
            id,
            owner: pid(),
            inode: (st.st_dev, st.st_ino),
            peer,
            local,
            v6,
            me: me.clone(),
            forks: crate::elide::forks(),
            mirror: Mutex::new(Mirror {
                l: Some(l),
                tokens: 0,
                ballast: 0,
                eof: false,
                wr_shut: false,
                rd_shut: false,
                elided_in: None,
                sets: 0,
                no_elision: false,
                queued: false,
                reported: false,
                oob: false,
                tokens_before_oob: 0,
            }),
            error: Mutex::new(ErrorState::None),
            watched: AtomicBool::new(false),
            edge: AtomicBool::new(false),
            fds: AtomicUsize::new(0),
            opts: crate::sockopt::Options::default(),
            handed_over: AtomicBool::new(false),
            share: Mutex::new(Share::default()),
            closed: AtomicBool::new(false),
            sleepers: Mutex::new(Vec::new()),
            orphaned: AtomicBool::new(false),
            connect_state: AtomicU8::new(CONNECT_DONE),
            wrote_past_end: AtomicBool::new(false),
            given_up: AtomicBool::new(false),
            urgent_shown: AtomicBool::new(false),
        });
        REGISTRY.lock().get_or_insert_with(HashMap::new).insert(id, c.clone());
        Ok((c, p))
    }

    /// Starts mirroring readiness changes (after the placeholder is in the program's fd table).
    pub(crate) fn observe(self: &Arc<Self>) {
        let o: Arc<dyn ReadinessObserver> = Arc::new(Observer(Arc::downgrade(self)));
        let _ = self.vs.set_observer(o);
    }

    pub(crate) fn fd_mapped(&self) {
        self.fds.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn fd_unmapped(&self) {
        self.fds.fetch_sub(1, Ordering::AcqRel);
    }

    // -----------------------------------------------------------------------------------------
    // Mirroring

    /// Mirrors the virtual socket's state into the placeholder, from any thread (only L is
    /// touched). `new_data`: an arrival, which makes a new edge for edge-triggered waiters.
    /// Returns the writability it read (`None` once L is closed), for `arm`.
    fn sync(&self, new_data: bool) -> Option<bool> {
        let mut m = self.mirror.lock();
        m.l.as_ref()?;
        // Read under the mirror lock: a reader that drained the stream meanwhile takes the
        // same lock to drain P's tokens, so a token is never written for data already gone
        // (a stale POLLIN makes programs such as wrk count a read error on EAGAIN).
        let r = self.vs.readiness();
        if let Some(kind) = r.error {
            self.note_error(reset_errno(kind_errno(kind), r.peer_finished || m.eof));
            // Closed with the primer unread: P reports ECONNRESET, POLLERR and POLLHUP.
            m.l = None;
            drop(m);
            self.l_closed();
            return None;
        }
        if r.peer_finished && !m.eof {
            m.eof = true;
            if m.wr_shut {
                close_clean(&mut m);
                drop(m);
                self.l_closed();
                return None;
            }
            if let Some(l) = &m.l {
                let _ = rustix::net::shutdown(l, rustix::net::Shutdown::Write);
            }
        }
        if self.shown_readable(&r) && !m.eof && !m.rd_shut {
            let edge = new_data && self.edge.load(Ordering::Relaxed);
            if m.tokens == 0 || edge {
                let awake = self.may_elide(&m).is_some_and(|set| {
                    let queue = !std::mem::replace(&mut m.queued, true);
                    set.elided(queue.then(|| self.me.clone()))
                });
                if !awake {
                    let l = m.l.as_ref().expect("checked");
                    let token = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
                    if rustix::net::send(l, &[1], token).is_ok() {
                        m.tokens += 1;
                        crate::process::bump(&COUNTERS.readiness_tokens);
                    }
                }
            }
        }
        if m.ballast > 0 && r.writable {
            drain_ballast(&mut m);
        }
        Some(r.writable)
    }

    /// The program put P in a kernel wait: from now on readiness is mirrored. Called in the
    /// program's thread with P at hand (`fd`), so a full window also makes P unwritable.
    pub(crate) fn arm(&self, fd: BorrowedFd<'_>, edge: bool) {
        if edge {
            self.edge.store(true, Ordering::Relaxed);
        }
        self.watched.store(true, Ordering::Release);
        // One look at the virtual socket serves both (each takes its session's lock).
        let writable = self.sync(false);
        self.block_writes(fd, writable);
    }

    /// `wake` is woken after each change mirrored from now on, until `remove_sleeper`.
    pub(crate) fn add_sleeper(&self, wake: &ThreadWake) {
        let mut s = self.sleepers.lock();
        if !s.iter().any(|x| x.same(wake)) {
            s.push(wake.clone());
        }
    }

    pub(crate) fn remove_sleeper(&self, wake: &ThreadWake) {
        self.sleepers.lock().retain(|x| !x.same(wake));
    }

    /// Wakes the threads in a wait over this connection (after its change was mirrored).
    fn wake_sleepers(&self) {
        let s = self.sleepers.lock();
        for w in s.iter() {
            w.wake();
        }
    }

    /// What `poll` reports for this connection given `events`, when it is plainly open
    /// (connected or connecting, no error, no end of stream either way, no shutdown, no bytes
    /// given back by a relay): readable and writable as its virtual socket is, as kernel TCP sets
    /// `POLLIN | POLLRDNORM` and `POLLOUT | POLLWRNORM`. `None` in any other state.
    pub(crate) fn plain_revents(&self, events: i16) -> Option<i16> {
        if self.handed_over.load(Ordering::Acquire) {
            return None;
        }
        let r = self.vs.readiness();
        // A connect in progress is plain too (neither readable nor writable until the peer
        // answers, as `tcp_poll` says of SYN_SENT): a program that polls for its completion
        // must not arm the placeholder for the connection's whole life.
        let connecting = self.connect_state.load(Ordering::Acquire) == CONNECT_IN_PROGRESS;
        let plain = (r.connected || connecting)
            && !r.urgent
            && !self.urgent_shown.load(Ordering::Acquire)
            && r.error.is_none()
            && !r.peer_finished
            && !r.write_closed
            && !r.read_closed
            && !self.has_returned();
        if !plain {
            return None;
        }
        {
            let m = self.mirror.lock();
            if m.l.is_none() || m.eof || m.wr_shut || m.rd_shut {
                return None;
            }
        }
        let mut ready = 0;
        if self.shown_readable(&r) {
            ready |= libc::POLLIN | libc::POLLRDNORM;
        }
        if r.writable {
            ready |= libc::POLLOUT | libc::POLLWRNORM;
        }
        Some(events & ready)
    }

    pub(crate) fn watched(&self) -> bool {
        self.watched.load(Ordering::Acquire)
    }

    /// P unwritable while the virtual socket is: ballast from P into L until P's send buffer
    /// is past the writable mark. Checked again after, since credit may have come meanwhile
    /// (the observer found no ballast to take then).
    /// `writable`: what the caller just read, if it did.
    fn block_writes(&self, fd: BorrowedFd<'_>, writable: Option<bool>) {
        if writable.unwrap_or_else(|| self.vs.readiness().writable) {
            return;
        }
        let mut m = self.mirror.lock();
        if m.l.is_none() || m.wr_shut || m.ballast > 0 {
            return;
        }
        for _ in 0..8 {
            if rustix::net::send(fd, &[0], SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_err() {
                break;
            }
            m.ballast += 1;
            if revents_now(fd, PollFlags::OUT).is_some_and(|r| !r.contains(PollFlags::OUT)) {
                break;
            }
        }
        if self.vs.readiness().writable {
            drain_ballast(&mut m);
        }
    }

    /// The peer's urgent byte came: an out-of-band byte from L shows it on P, which makes
    /// every kind of wait see `POLLPRI` (and `select` its exceptional condition), and the
    /// kernel sends `SIGURG` to P's owner (`F_SETOWN`), as TCP's does when an urgent pointer
    /// comes. A newer mark sends another (the one before becomes an ordinary byte in P, as an
    /// unread urgent byte does in TCP's stream).
    fn show_urgent(&self) {
        let mut m = self.mirror.lock();
        if m.eof || !self.vs.readiness().urgent {
            return;
        }
        let Some(l) = m.l.as_ref() else { return };
        let flags = SendFlags::OOB | SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        if rustix::net::send(l, b"!", flags).is_ok() {
            if m.oob {
                m.tokens += 1;
            }
            m.oob = true;
            m.tokens_before_oob = m.tokens;
            self.urgent_shown.store(true, Ordering::Release);
        }
    }

    /// After a read: once the urgent byte is taken out of band or read past, P's out-of-band
    /// byte goes too (`POLLPRI` ends, as TCP's).
    #[inline]
    fn clear_urgent(&self, fd: BorrowedFd<'_>) {
        if self.urgent_shown.load(Ordering::Acquire) {
            self.take_back_urgent(fd);
        }
    }

    #[cold]
    #[inline(never)]
    fn take_back_urgent(&self, fd: BorrowedFd<'_>) {
        let mut m = self.mirror.lock();
        if !m.oob || self.vs.readiness().urgent {
            return;
        }
        let mut byte = [0u8; 1];
        let _ = rustix::net::recv(fd, &mut byte, RecvFlags::OOB | RecvFlags::DONTWAIT);
        m.oob = false;
        m.tokens_before_oob = 0;
        self.urgent_shown.store(false, Ordering::Release);
    }

    /// `recv` with `MSG_OOB`: the peer's urgent byte, as TCP's `tcp_recv_urg` (`EINVAL` when
    /// there is none to read; never waits).
    fn recv_urgent(
        &self,
        fd: BorrowedFd<'_>,
        bufs: &mut [IoSliceMut<'_>],
        flags: c_int,
    ) -> Result<usize, i32> {
        let byte = self.vs.recv_urgent(flags & libc::MSG_PEEK != 0).map_err(|_| libc::EINVAL)?;
        let n = match bufs.iter_mut().find(|b| !b.is_empty()) {
            Some(b) if flags & libc::MSG_TRUNC == 0 => {
                b[0] = byte;
                1
            }
            Some(_) => 1,
            None => 0,
        };
        self.clear_urgent(fd);
        Ok(n)
    }

    /// `SIOCATMARK`: the next byte the program reads is the peer's urgent byte.
    pub(crate) fn at_urgent_mark(&self) -> bool {
        !self.has_returned() && self.vs.at_urgent_mark()
    }

    /// After the program read: P's tokens are taken once nothing is left to read.
    fn drain_tokens(&self, fd: BorrowedFd<'_>) {
        let mut m = self.mirror.lock();
        if (m.tokens == 0 && !m.reported) || m.l.is_none() || m.eof {
            return;
        }
        if self.shown_readable(&self.vs.readiness()) {
            return;
        }
        m.reported = false;
        if m.tokens == 0 {
            return;
        }
        let mut buf = [0u8; 64];
        if m.oob {
            // Only the tokens ahead of the out-of-band byte (see `show_urgent`).
            while m.tokens_before_oob > 0 {
                let k = (m.tokens_before_oob as usize).min(buf.len());
                match rustix::net::recv(fd, &mut buf[..k], RecvFlags::DONTWAIT) {
                    Ok((n, _)) if n > 0 => {
                        m.tokens_before_oob -= n as u32;
                        m.tokens = m.tokens.saturating_sub(n as u32);
                    }
                    _ => break,
                }
            }
            return;
        }
        while let Ok((n, _)) = rustix::net::recv(fd, &mut buf, RecvFlags::DONTWAIT) {
            if n < buf.len() {
                break;
            }
        }
        m.tokens = 0;
    }

    fn note_error(&self, errno: i32) {
        let mut e = self.error.lock();
        if *e == ErrorState::None {
            *e = ErrorState::Pending(errno);
        }
    }

    /// Reports the pending error once (as TCP consumes `sk_err`); clears P's own error too.
    fn take_error(&self, fd: BorrowedFd<'_>) -> Option<i32> {
        let mut e = self.error.lock();
        match *e {
            ErrorState::Pending(errno) => {
                *e = ErrorState::Reported;
                let _ = rustix::net::sockopt::socket_error(fd);
                Some(errno)
            }
            _ => None,
        }
    }

    /// The connect returned `EINPROGRESS`: the open completes in the background. An answer
    /// that came before this (the placeholder was observed already) is noted now.
    pub(crate) fn set_connect_in_progress(&self) {
        self.connect_state.store(CONNECT_IN_PROGRESS, Ordering::Release);
        self.note_open_outcome(&self.vs.readiness());
    }

    /// Whether a connect that returned `EINPROGRESS` is still waiting for the peer's answer
    /// (TCP's SYN_SENT).
    pub(crate) fn connecting(&self) -> bool {
        self.connect_state.load(Ordering::Acquire) == CONNECT_IN_PROGRESS
            && self.vs.take_error().is_ok_and(|open| !open)
    }

    /// A `connect` on the connected (or connecting) socket, as `inet_stream_connect` answers
    /// it: `EALREADY` while the connect in progress waits (a blocking socket waits first),
    /// then once 0 (or its error), then `EISCONN`.
    pub(crate) fn connect_again(&self, fd: BorrowedFd<'_>) -> Result<(), i32> {
        if self.connect_state.load(Ordering::Acquire) == CONNECT_DONE {
            return Err(libc::EISCONN);
        }
        if !self.nonblocking(fd) && self.vs.take_error().is_ok_and(|open| !open) {
            // A blocking socket waits for the answer again (up to its send timeout, then
            // `EALREADY`; a signal interrupts it as TCP's wait), as `inet_stream_connect` does:
            // a retry loop on it must not spin.
            let timeout = self.opts.snd_timeout();
            let deadline = timeout.map(|t| Instant::now() + t);
            let seen = signals::snapshot();
            while self.vs.take_error().is_ok_and(|open| !open) {
                match self.block(false, deadline, seen, timeout.is_some(), 0) {
                    Ok(()) => {}
                    Err(Err(libc::EAGAIN)) => return Err(libc::EALREADY),
                    Err(Err(errno)) => return Err(errno),
                    Err(Ok(_)) => return Err(libc::EALREADY),
                }
            }
        }
        match self.vs.take_error() {
            Ok(false) => Err(libc::EALREADY),
            Ok(true) => {
                self.connect_state.store(CONNECT_DONE, Ordering::Release);
                Ok(())
            }
            Err(_) => {
                self.connect_state.store(CONNECT_DONE, Ordering::Release);
                match self.so_error(fd) {
                    0 => Err(libc::ECONNABORTED),
                    errno => Err(errno),
                }
            }
        }
    }

    /// The peer answered a connect in progress (`r` shows it open or failed): a refusal puts
    /// the destination back to waiting for the answer (`connect::refused_later`). Later
    /// readiness changes no longer look.
    fn note_open_outcome(&self, r: &netchannel::Readiness) {
        if !(r.connected || r.error.is_some()) {
            return;
        }
        let answered = self.connect_state.compare_exchange(
            CONNECT_IN_PROGRESS,
            CONNECT_ANSWERED,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        if answered.is_ok() && r.error == Some(io::ErrorKind::ConnectionRefused) {
            crate::connect::refused_later(self.peer);
        }
        if answered.is_ok() && r.connected && self.vs.peer_prefers_kernel() {
            crate::connect::kernel_preferred(self.peer);
        }
    }

    /// `SO_ERROR`.
    pub(crate) fn so_error(&self, fd: BorrowedFd<'_>) -> i32 {
        self.note_connection_error(&self.vs.readiness());
        self.take_error(fd).unwrap_or(0)
    }

    /// Notes the connection's error `r` shows, if any, as `failed` reports it: a reset after
    /// the peer's FIN is `EPIPE` (TCP's CLOSE_WAIT).
    fn note_connection_error(&self, r: &netchannel::Readiness) {
        if let Some(kind) = r.error {
            let after_fin = r.peer_finished || self.mirror.lock().eof;
            self.note_error(reset_errno(kind_errno(kind), after_fin));
        }
    }

    /// TCP takes the first write after the peer's FIN even when the peer has gone since (its
    /// process exited): the bytes leave, and only the reset they draw fails the next write
    /// with `EPIPE`. A server that answers after reading end of stream (conform's `w`) must
    /// not die of `SIGPIPE` where TCP lets its answer go; on a carried connection the peer's
    /// engine is gone with its process, and that write failed at once. The bytes are dropped,
    /// as the peer's kernel would drop them; the error stays for the next call. A reset the
    /// peer's engine sent is the reset TCP's write would have drawn: that one fails at once.
    fn first_write_past_end(&self, e: &io::Error) -> bool {
        e.kind() == io::ErrorKind::ConnectionReset
            && self.vs.lost_with_peer()
            && (self.vs.readiness().peer_finished || self.mirror.lock().eof)
            && !self.wrote_past_end.swap(true, Ordering::AcqRel)
    }

    /// `failed` for a write: every `EPIPE` raises SIGPIPE unless `MSG_NOSIGNAL` (the kernel's
    /// rule, whether the pipe broke by our shutdown or by a reset after the peer's FIN).
    fn write_failed(
        &self,
        fd: BorrowedFd<'_>,
        e: &io::Error,
        nosignal: bool,
    ) -> Result<usize, i32> {
        match self.failed(fd, e, true) {
            0 => Ok(0),
            libc::EPIPE => {
                if !nosignal {
                    raise_sigpipe();
                }
                Err(libc::EPIPE)
            }
            errno => Err(errno),
        }
    }

    /// A failed call learned that the connection is gone: mirror it and report it once.
    /// What comes after the report: reads see end of stream, writes `EPIPE`.
    /// A write given `EPIPE` raises SIGPIPE (`write_failed`), as TCP's `sk_stream_error` does.
    fn failed(&self, fd: BorrowedFd<'_>, e: &io::Error, writing: bool) -> i32 {
        let errno = errno_of(e);
        if !matches!(errno, libc::EAGAIN | libc::EINTR) {
            // The exit's own shutdown or reset, met by another thread's call under way.
            crate::process::hold_if_exiting();
        }
        if matches!(errno, libc::EAGAIN | libc::EINTR | libc::EPIPE | libc::ENOTCONN) {
            return errno;
        }
        let after_fin = self.mirror.lock().eof || self.vs.readiness().peer_finished;
        self.note_error(reset_errno(errno, after_fin));
        self.sync(false);
        if !writing && after_fin {
            // As TCP: once the peer's FIN is in, a read returns end of stream; the error
            // stays for SO_ERROR and the next write.
            return 0;
        }
        match self.take_error(fd) {
            Some(errno) => errno,
            None if writing => libc::EPIPE,
            None => 0,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Data

    fn nonblocking(&self, fd: BorrowedFd<'_>) -> bool {
        rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f.contains(rustix::fs::OFlags::NONBLOCK))
    }

    /// `recv`/`read`/`readv`/`recvmsg` on the connection: `Ok(n)` (0 at end of stream) or an
    /// errno, with blocking, timeouts and signals as on a TCP socket.
    pub(crate) fn recv(
        &self,
        fd: BorrowedFd<'_>,
        bufs: &mut [IoSliceMut<'_>],
        flags: c_int,
    ) -> Result<usize, i32> {
        if flags & libc::MSG_OOB != 0 {
            return self.recv_urgent(fd, bufs, flags);
        }
        if flags & libc::MSG_ERRQUEUE != 0 {
            return Err(libc::EAGAIN);
        }
        if self.given_up.load(Ordering::Acquire) {
            // As `tcp_recvmsg` on a socket that never connected: the error first, then
            // ENOTCONN (never an end of stream).
            return Err(self.take_error(fd).unwrap_or(libc::ENOTCONN));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let peek = flags & libc::MSG_PEEK != 0;
        if self.handed_over.load(Ordering::Acquire) {
            self.await_retired();
        }
        if total == 0 {
            return self.recv_nothing(fd, flags);
        }
        // What the call waits for, as TCP's `sock_rcvlowat`: all of it with `MSG_WAITALL`,
        // else `SO_RCVLOWAT` bytes (at most those asked for).
        let target =
            if flags & libc::MSG_WAITALL != 0 { total } else { self.opts.rcv_lowat().min(total) };
        if peek && (target > 1 || self.has_returned()) {
            return self.peek_at_least(fd, bufs, target, flags);
        }
        // Bytes given back come first.
        let mut got = if peek { 0 } else { self.take_returned(bufs, false).unwrap_or(0) };
        let dontwait = flags & libc::MSG_DONTWAIT != 0;
        let timeout = self.opts.rcv_timeout();
        let deadline = timeout.map(|t| Instant::now() + t);
        let seen = signals::snapshot();
        let mut settled = false;
        let result = loop {
            if got >= target {
                break Ok(got);
            }
            if got > 0 && self.vs.at_urgent_mark() {
                // As TCP's: a read with bytes stops at the mark, `MSG_WAITALL` or not.
                break Ok(got);
            }
            let attempt =
                if peek { self.peek_into(bufs) } else { self.take_into(bufs, got, flags) };
            match attempt {
                Ok(0) => break Ok(got),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if dontwait || self.nonblocking(fd) {
                        if got == 0
                            && !settled
                            && !peek
                            && !self.urgent_shown.load(Ordering::Acquire)
                            && self.told_readable()
                        {
                            // P shows readable, so the program was told there is something to
                            // read (a kernel socket then has it), but the stream's state moved
                            // under it: a payload the engine is taking out of its channel on a
                            // thread that is not running. Wait for it briefly, as a kernel
                            // reader waits for the socket lock, rather than report EAGAIN,
                            // which programs such as wrk count as an error.
                            settled = true;
                            let until = Some(Instant::now() + SETTLE);
                            let _ = self.vs.wait_ready(true, false, until, uninterruptible());
                            continue;
                        }
                        break if got > 0 { Ok(got) } else { Err(libc::EAGAIN) };
                    }
                    match self.block_read(deadline, seen, timeout.is_some(), got) {
                        Err(outcome) => break outcome,
                        // A peek copies them and leaves them first in line.
                        Ok(true) if peek && self.has_returned() => {
                            break Ok(self.take_returned(bufs, true).unwrap_or(0));
                        }
                        Ok(true) if !peek => got += self.take_returned_at(bufs, got),
                        Ok(_) => {}
                    }
                }
                Err(e) => {
                    if got > 0 {
                        break Ok(got);
                    }
                    match self.failed(fd, &e, false) {
                        0 => break Ok(0),
                        errno => break Err(errno),
                    }
                }
            }
        };
        if result.is_ok_and(|n| n > 0) {
            COUNTERS.bytes_in.fetch_add(*result.as_ref().unwrap() as u64, Ordering::Relaxed);
        }
        self.clear_urgent(fd);
        if self.watched() {
            self.drain_tokens(fd);
        }
        result
    }

    /// A `MSG_PEEK` that waits for `target` bytes (`MSG_WAITALL`, or `SO_RCVLOWAT`), as TCP's
    /// does, or one with bytes given back before it. The bytes peeked are taken out of the
    /// virtual socket and kept with those given back, which the next reads return first (so a
    /// wait for more sleeps until more arrive). At most `PEEK_HELD` are kept: a peek for more
    /// returns that much, where TCP would wait until its timeout, with its window closed.
    fn peek_at_least(
        &self,
        fd: BorrowedFd<'_>,
        bufs: &mut [IoSliceMut<'_>],
        target: usize,
        flags: c_int,
    ) -> Result<usize, i32> {
        let dontwait = flags & libc::MSG_DONTWAIT != 0;
        let timeout = self.opts.rcv_timeout();
        let deadline = timeout.map(|t| Instant::now() + t);
        let seen = signals::snapshot();
        // Everything there up to what was asked, as a peek copies; waiting only below `target`.
        let total: usize = bufs.iter().map(|b| b.len()).sum::<usize>().min(PEEK_HELD);
        let target = target.min(total);
        let mut more = Vec::new();
        loop {
            let have = self.share.lock().returned.len();
            if have >= total {
                break;
            }
            more.resize(total - have, 0);
            match self.take_into(&mut [IoSliceMut::new(&mut more)], 0, 0) {
                Ok(0) => break, // end of stream: what is there
                Ok(n) => self.share.lock().returned.extend_from_slice(&more[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && have >= target => break,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if dontwait || self.nonblocking(fd) {
                        if have == 0 {
                            return Err(libc::EAGAIN);
                        }
                        break;
                    }
                    // Bytes given back meanwhile join `returned`, which the next round counts.
                    match self.block_read(deadline, seen, timeout.is_some(), have) {
                        Ok(_) => {}
                        Err(Ok(_)) => break, // the timeout or a signal, with bytes to peek
                        Err(Err(errno)) => return Err(errno),
                    }
                }
                Err(e) => {
                    if have > 0 {
                        break;
                    }
                    return match self.failed(fd, &e, false) {
                        0 => Ok(0),
                        errno => Err(errno),
                    };
                }
            }
        }
        Ok(self.take_returned(bufs, true).unwrap_or(0))
    }

    /// A `recv` into a NULL buffer of some length: as TCP's, `EFAULT` once there are bytes to
    /// copy (they stay unread), and until then what a read finds: 0 at the end of stream, the
    /// pending error, `EAGAIN` when it may not wait; otherwise it waits (timeout and signals
    /// as for any read).
    pub(crate) fn recv_into_null(&self, fd: BorrowedFd<'_>, flags: c_int) -> Result<usize, i32> {
        if flags & libc::MSG_OOB != 0 {
            // As TCP's: the byte is taken, then the copy faults.
            return match self.vs.recv_urgent(flags & libc::MSG_PEEK != 0) {
                Ok(_) => {
                    self.clear_urgent(fd);
                    Err(libc::EFAULT)
                }
                Err(_) => Err(libc::EINVAL),
            };
        }
        let timeout = self.opts.rcv_timeout();
        let deadline = timeout.map(|t| Instant::now() + t);
        let seen = signals::snapshot();
        loop {
            if let Some(outcome) = self.read_at_once(fd, flags, Err(libc::EFAULT)) {
                return outcome;
            }
            if let Err(outcome) = self.block_read(deadline, seen, timeout.is_some(), 0) {
                return outcome;
            }
        }
    }

    /// What a read that copies nothing returns without waiting, if anything: `with_bytes` when
    /// bytes are there, the pending error once, 0 at the end of stream, `EAGAIN` when it may
    /// not wait. `None`: it would wait.
    fn read_at_once(
        &self,
        fd: BorrowedFd<'_>,
        flags: c_int,
        with_bytes: Result<usize, i32>,
    ) -> Option<Result<usize, i32>> {
        let r = self.vs.readiness();
        if self.has_returned() || r.unread > 0 {
            return Some(with_bytes);
        }
        self.note_connection_error(&r);
        if let Some(errno) = self.take_error(fd) {
            return Some(Err(errno));
        }
        if r.readable {
            return Some(Ok(0)); // end of stream, or an error reported already
        }
        if flags & libc::MSG_DONTWAIT != 0 || self.nonblocking(fd) {
            return Some(Err(libc::EAGAIN));
        }
        None
    }

    /// A `recv` of zero bytes (`read`/`readv` of zero never get here: the kernel answers them
    /// 0 at once). As TCP's: 0 at once when something is there to read, the pending error once,
    /// `EAGAIN` when it may not wait, else 0 after one wait (for bytes, the timeout or a
    /// signal).
    fn recv_nothing(&self, fd: BorrowedFd<'_>, flags: c_int) -> Result<usize, i32> {
        if let Some(outcome) = self.read_at_once(fd, flags, Ok(0)) {
            return outcome;
        }
        // One wait, whatever ends it (bytes, the timeout, a signal): the kernel's loop then
        // ends, having nothing to copy, and returns 0. A negative timeout never waits.
        let timeout = self.opts.rcv_timeout();
        if timeout == Some(std::time::Duration::ZERO) {
            return Err(libc::EAGAIN);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let _ = self.block(true, deadline, signals::snapshot(), timeout.is_some(), 0);
        Ok(0)
    }

    /// Waits in a blocking `recv` (`read`) or `send` until the socket is ready, as a blocking
    /// TCP call does: `Err(outcome)` ends the call (`done` bytes so far, `EAGAIN` at the
    /// timeout, `EINTR` for a signal that does not restart it, or the connection's error).
    fn block(
        &self,
        read: bool,
        deadline: Option<Instant>,
        seen: signals::Snapshot,
        has_timeout: bool,
        done: usize,
    ) -> Result<(), Result<usize, i32>> {
        let woke = self.vs.wait_ready(read, !read, deadline, interruptible());
        Self::wait_outcome(woke, seen, has_timeout, done)
    }

    /// What a blocking call does after its wait: goes on (`Ok`), or returns what it has.
    fn wait_outcome(
        woke: io::Result<()>,
        seen: signals::Snapshot,
        has_timeout: bool,
        done: usize,
    ) -> Result<(), Result<usize, i32>> {
        let so_far = || if done > 0 { Ok(done) } else { Err(libc::EAGAIN) };
        match woke {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Err(so_far()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if done > 0 {
                    Err(Ok(done))
                } else if restart_after_signal(seen, has_timeout) {
                    Ok(())
                } else {
                    Err(Err(libc::EINTR))
                }
            }
            Err(e) => {
                // The exit tears down what the wait used (the exiting thread's waiter goes with
                // its thread-locals): as with any failure then, wait for the exit.
                crate::process::hold_if_exiting();
                Err(Err(errno_of(&e)))
            }
        }
    }

    /// One non-blocking read into `bufs`, skipping the first `skip` bytes (already filled):
    /// `Ok(0)` at end of stream, `WouldBlock` when nothing is there.
    fn take_into(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        skip: usize,
        flags: c_int,
    ) -> io::Result<usize> {
        let trunc = flags & libc::MSG_TRUNC != 0;
        let mut at = 0;
        let mut got = 0;
        for b in bufs.iter_mut() {
            let len = b.len();
            if at + len <= skip {
                at += len;
                continue;
            }
            let from = skip.saturating_sub(at);
            at += len;
            let want = &mut b[from..];
            let r = if trunc {
                // MSG_TRUNC on TCP: the bytes are consumed, not copied.
                let mut scratch = vec![0u8; want.len()];
                self.vs.recv(&mut scratch)
            } else {
                self.vs.recv(want)
            };
            match r {
                Ok(n) => {
                    got += n;
                    if n < want.len() {
                        break;
                    }
                }
                Err(e) if got > 0 && e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if got > 0 => {
                    // Reported on the next call, as TCP reports an error after data.
                    let _ = e;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    fn peek_into(&self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut tmp = vec![0u8; total];
        let n = self.vs.peek(&mut tmp)?;
        scatter(&tmp[..n], bufs);
        Ok(n)
    }

    /// `send`/`write`/`writev`/`sendmsg` on the connection: every byte (blocking), or what the
    /// window takes (non-blocking), with `EPIPE`/`SIGPIPE`, timeouts and signals as on TCP.
    pub(crate) fn send(
        &self,
        fd: BorrowedFd<'_>,
        bufs: &[IoSlice<'_>],
        flags: c_int,
    ) -> Result<usize, i32> {
        crate::process::hold_if_exiting();
        let nosignal = flags & libc::MSG_NOSIGNAL != 0;
        let dontwait = flags & libc::MSG_DONTWAIT != 0;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return match self.vs.send(&[]) {
                Ok(_) => Ok(0),
                Err(e) => self.write_failed(fd, &e, nosignal),
            };
        }
        // Small vectors leave in one send (one lock, one frame); large ones buffer by buffer.
        let gathered: Option<Vec<u8>> = (bufs.len() > 1 && total <= GATHER).then(|| {
            let mut g = Vec::with_capacity(total);
            for b in bufs {
                netchannel::copy::extend(&mut g, b);
            }
            g
        });
        let timeout = self.opts.snd_timeout();
        let deadline = timeout.map(|t| Instant::now() + t);
        let seen = signals::snapshot();
        let mut sent = 0;
        let chunk = |at: usize| -> &[u8] {
            if let Some(g) = &gathered {
                return &g[at..];
            }
            let mut off = at;
            for b in bufs {
                if off < b.len() {
                    return &b[off..];
                }
                off -= b.len();
            }
            &[]
        };
        let urgent = flags & libc::MSG_OOB != 0;
        let result = loop {
            let part = chunk(sent);
            // With `MSG_OOB` each part marks its last byte, the last part's last byte last.
            let r = if urgent { self.vs.send_urgent(part) } else { self.vs.send(part) };
            match r {
                Ok(n) => {
                    sent += n;
                    if sent == total {
                        break Ok(sent);
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    if sent > 0 {
                        break Ok(sent);
                    }
                    if self.first_write_past_end(&e) {
                        break Ok(total);
                    }
                    break self.write_failed(fd, &e, nosignal);
                }
            }
            if dontwait || self.nonblocking(fd) {
                break if sent > 0 { Ok(sent) } else { Err(libc::EAGAIN) };
            }
            if let Err(outcome) = self.block(false, deadline, seen, timeout.is_some(), sent) {
                break outcome;
            }
        };
        if let Ok(n) = result {
            COUNTERS.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
        }
        if self.watched() {
            self.block_writes(fd, None);
        }
        result
    }

    /// `FIONREAD`.
    pub(crate) fn unread(&self) -> usize {
        let returned = self.share.lock().returned.len() as u64;
        let mut unread = self.vs.readiness().unread;
        if let Some(before) = self.vs.unread_before_mark() {
            // As TCP's: only the bytes before an urgent byte kept out of the stream.
            unread = unread.min(before);
        }
        (unread + returned).min(i32::MAX as u64) as usize
    }

    /// `SIOCOUTQ` (unsent and unacknowledged) or `SIOCOUTQNSD` (unsent only).
    pub(crate) fn outq(&self, unsent_only: bool) -> usize {
        let s = self.vs.stats();
        let n = if unsent_only { s.unsent_bytes } else { s.unsent_bytes + s.unacked_bytes };
        n.min(i32::MAX as u64) as usize
    }

    /// TCP state for `TCP_INFO`.
    pub(crate) fn tcp_state(&self) -> u8 {
        if self.connecting() {
            return TCP_SYN_SENT;
        }
        let r = self.vs.readiness();
        let m = self.mirror.lock();
        match (r.error.is_some(), r.peer_finished, m.wr_shut) {
            (true, ..) => TCP_CLOSE,
            // Both FINs: LAST_ACK while our bytes before the FIN are still to leave, then
            // closed.
            (false, true, true) if self.outq(true) > 0 => 9,
            (false, true, true) => TCP_CLOSE,
            (false, true, false) => 8, // TCP_CLOSE_WAIT
            // TCP_FIN_WAIT1 while bytes before our FIN are still to leave, then TCP_FIN_WAIT2
            // (the kernel's FIN_WAIT1 lasts until the peer's kernel acknowledges, a round
            // trip; the peer's application reading is not needed for it).
            (false, false, true) if self.outq(true) > 0 => 4,
            (false, false, true) => 5,
            _ => 1, // TCP_ESTABLISHED
        }
    }

    // -----------------------------------------------------------------------------------------
    // Shutdown and close

    /// `shutdown(how)`; threads in a `poll` over it look again once P shows it, as TCP's
    /// state change wakes its pollers.
    pub(crate) fn shutdown(&self, fd: BorrowedFd<'_>, how: c_int) -> Result<(), i32> {
        let r = self.shutdown_mirrored(fd, how);
        self.wake_sleepers();
        r
    }

    fn shutdown_mirrored(&self, fd: BorrowedFd<'_>, how: c_int) -> Result<(), i32> {
        let (rd, wr) = match how {
            libc::SHUT_RD => (true, false),
            libc::SHUT_WR => (false, true),
            libc::SHUT_RDWR => (true, true),
            _ => return Err(libc::EINVAL),
        };
        // A connect in progress is given up, as TCP's shutdown in SYN_SENT does: 0, then the
        // socket shows POLLERR|POLLHUP and SO_ERROR ECONNRESET.
        if self.connecting() && self.vs.abort_connect() {
            self.given_up.store(true, Ordering::Release);
            return Ok(());
        }
        let r = self.vs.readiness();
        if r.error.is_some() {
            return Err(libc::ENOTCONN);
        }
        if wr {
            match self.vs.shutdown() {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {}
                Err(e) => return Err(errno_of(&e)),
            }
        }
        if rd {
            self.vs.shutdown_read();
        }
        let mut m = self.mirror.lock();
        m.rd_shut |= rd;
        m.wr_shut |= wr;
        if m.l.is_none() {
            return Ok(());
        }
        if wr && (rd || m.eof) {
            // TCP reports POLLHUP once both directions are done (or the program shut both).
            close_clean(&mut m);
            drop(m);
            self.l_closed();
            return Ok(());
        }
        if rd {
            // P itself reports POLLIN|POLLRDHUP, as TCP after SHUT_RD.
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Read);
        }
        if wr && m.ballast > 0 {
            // Writes fail at once now: TCP reports POLLOUT after SHUT_WR.
            drain_ballast(&mut m);
        }
        Ok(())
    }

    /// The process's last fd for this connection was closed: end it when no copy of P is left
    /// anywhere (now, or when L reports it), otherwise keep it for the process holding a copy.
    pub(crate) fn last_fd_closed(self: &Arc<Self>) {
        if self.owner != pid() || self.handed_over.load(Ordering::Acquire) {
            return;
        }
        let hup = {
            let m = self.mirror.lock();
            match &m.l {
                None => true,
                Some(l) => {
                    revents_now(l, PollFlags::empty()).is_some_and(|r| r.contains(PollFlags::HUP))
                }
            }
        };
        if hup {
            if let Some(time) = self.opts.linger_time() {
                self.linger(time);
            }
            self.finish();
        } else {
            self.orphaned.store(true, Ordering::Release);
            crate::reaper::watch(self.clone());
        }
    }

    /// The last close with `SO_LINGER` on and a time, as TCP's: the end of stream goes after
    /// the bytes queued, and the close waits (whatever `O_NONBLOCK` says) until the peer's
    /// engine has them all, or the time is up; what is left is still delivered after. With
    /// bytes unread the close resets the connection instead, without waiting.
    fn linger(&self, time: std::time::Duration) {
        const LOOK: std::time::Duration = std::time::Duration::from_millis(1);
        if self.vs.readiness().unread > 0 || self.has_returned() || self.vs.shutdown().is_err() {
            return;
        }
        let deadline = Instant::now() + time;
        while !self.vs.send_delivered() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let step = (now + LOOK).min(deadline);
            if self.vs.readiness().readable {
                // Bytes or the peer's end came meanwhile: a wait for them would not sleep.
                std::thread::sleep(step - now);
            } else {
                // Serves the channels meanwhile: their acknowledgements are what it waits for.
                let _ = self.vs.wait_ready(true, false, Some(step), uninterruptible());
            }
        }
    }

    /// L was closed (a terminal state): an orphaned connection has nothing left to wait for.
    fn l_closed(&self) {
        if self.orphaned.load(Ordering::Acquire) {
            crate::reaper::unwatch(self.id);
            self.finish();
        }
    }

    /// Ends the connection: as TCP's last close (FIN after the bytes sent, a reset when bytes
    /// were left unread or `SO_LINGER` is zero).
    pub(crate) fn finish(&self) {
        REGISTRY.lock().get_or_insert_with(HashMap::new).remove(&self.id);
        if self.handed_over.load(Ordering::Acquire) || self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.vs.deregister();
        if self.opts.linger_abort() {
            self.vs.abort();
        }
        // The VSocket itself closes when the last reference goes (Drop below).
    }

    /// Whether `fd` is this connection's placeholder (a copy of P).
    pub(crate) fn is_placeholder(&self, fd: BorrowedFd<'_>) -> bool {
        rustix::fs::fstat(fd).is_ok_and(|st| (st.st_dev, st.st_ino) == self.inode)
    }

    /// The library's end, for the reaper's epoll set.
    pub(crate) fn with_l<T>(&self, f: impl FnOnce(Option<BorrowedFd<'_>>) -> T) -> T {
        let m = self.mirror.lock();
        f(m.l.as_ref().map(|l| l.as_fd()))
    }

    /// A process that inherited P takes the connection over through the relay: the owner's
    /// direct path stops mirroring it.
    pub(crate) fn hand_over(&self) {
        self.handed_over.store(true, Ordering::Release);
        self.vs.deregister();
        REGISTRY.lock().get_or_insert_with(HashMap::new).remove(&self.id);
        // A poll over it goes back to the kernel alone.
        self.wake_sleepers();
    }

    /// The relay serves the taker through `link` (its end of the taker's connection).
    pub(crate) fn relay_link(&self, link: Option<OwnedFd>) {
        self.share.lock().link = link.map(netchannel::sys::ShedOnFork::new);
    }

    /// Whether this process still holds P (the relay's taker closing is then not the last
    /// close, and the connection comes back to this process).
    pub(crate) fn held_here(&self) -> bool {
        self.fds.load(Ordering::Acquire) > 0 && !self.orphaned.load(Ordering::Acquire)
    }

    /// The taker closed its connection while this process holds P: the relay gives back what
    /// it could not deliver and the direct path serves the connection again. Called by the
    /// relay, which has taken its own registration away.
    pub(crate) fn retire_relay(self: &Arc<Self>, undelivered: &mut Vec<u8>) {
        {
            let mut sh = self.share.lock();
            sh.link = None;
            sh.returned.append(undelivered);
        }
        REGISTRY.lock().get_or_insert_with(HashMap::new).insert(self.id, self.clone());
        self.handed_over.store(false, Ordering::Release);
        self.observe();
        self.sync(false);
        self.wake_sleepers();
    }

    /// A read on a handed-over connection: if the taker has closed its end (the relay may not
    /// have seen it yet), waits for the relay to give the connection back, so that bytes it
    /// would otherwise pass to the closed end stay in order for this read. The relay sees the
    /// close within its next round, however long a loaded machine keeps it from running (a
    /// bound of 200 ms let a read go on beside it: the relay then took the reply, gave it
    /// back, and the read slept on the stream for good); `GIVE_BACK_WAIT` only keeps a broken
    /// relay from hanging the program.
    fn await_retired(&self) {
        if !self.taker_closed() {
            return;
        }
        let start = Instant::now();
        while self.handed_over.load(Ordering::Acquire) && start.elapsed() < GIVE_BACK_WAIT {
            let waited = start.elapsed();
            let nap = if waited < std::time::Duration::from_millis(5) { 50 } else { 1000 };
            std::thread::sleep(std::time::Duration::from_micros(nap));
        }
    }

    /// Whether the process that took this connection over has closed its end (the relay may
    /// not have seen it yet); false while no relay serves a taker.
    pub(crate) fn taker_closed(&self) -> bool {
        let sh = self.share.lock();
        let Some(link) = &sh.link else { return false };
        revents_now(link, PollFlags::RDHUP)
            .is_some_and(|r| r.intersects(PollFlags::RDHUP | PollFlags::HUP))
    }

    /// A blocking read's wait; `Ok(true)` when bytes given back may be there for the caller to
    /// take. On a connection another process took over, the relay may give it back while the
    /// thread waits, and the bytes it read for the taker then come back as given-back bytes,
    /// not through the stream, which never wakes the wait for them: that wait is cut into
    /// `GIVE_BACK_SLICE`s, each followed by a look at them. A give-back that came between the
    /// caller's last look and this wait is seen here (the relay stores the bytes before it
    /// clears `handed_over`): under load, the read of a parent whose spawned child had just
    /// exited otherwise slept on the stream for good beside its answer.
    fn block_read(
        &self,
        deadline: Option<Instant>,
        seen: signals::Snapshot,
        has_timeout: bool,
        done: usize,
    ) -> Result<bool, Result<usize, i32>> {
        if !self.handed_over.load(Ordering::Acquire) {
            if self.has_returned() {
                return Ok(true);
            }
            return self.block(true, deadline, seen, has_timeout, done).map(|()| false);
        }
        let slice = Instant::now() + GIVE_BACK_SLICE;
        let until = deadline.map_or(slice, |d| d.min(slice));
        match self.vs.wait_ready(true, false, Some(until), interruptible()) {
            Err(e) if e.kind() == io::ErrorKind::TimedOut && until == slice => Ok(true),
            woke => Self::wait_outcome(woke, seen, has_timeout, done).map(|()| true),
        }
    }

    /// Bytes given back into `bufs` after their first `skip` bytes (already filled).
    fn take_returned_at(&self, bufs: &mut [IoSliceMut<'_>], skip: usize) -> usize {
        let mut sh = self.share.lock();
        let (mut at, mut copied) = (0, 0);
        for b in bufs.iter_mut() {
            let from = skip.saturating_sub(at).min(b.len());
            at += b.len();
            let n = (b.len() - from).min(sh.returned.len() - copied);
            netchannel::copy::copy(&mut b[from..from + n], &sh.returned[copied..copied + n]);
            copied += n;
        }
        sh.returned.drain(..copied);
        copied
    }

    /// P shows readable (a token is in it, or the peer's FIN is mirrored), or its wait reports
    /// it so.
    fn told_readable(&self) -> bool {
        let m = self.mirror.lock();
        self.watched() && (m.tokens > 0 || m.eof || m.reported)
    }

    // -----------------------------------------------------------------------------------------
    // Elided readiness (`elide`)

    /// The set whose wait reports P's readability, if an arrival may go without a token: see
    /// `elide` for the conditions.
    fn may_elide(&self, m: &Mirror) -> Option<Arc<crate::elide::SetState>> {
        let reg = m.elided_in.as_ref()?;
        let ok = !m.no_elision
            && self.owner == pid()
            && self.forks == crate::elide::forks()
            && reg.set.single_waiter()
            && !self.edge.load(Ordering::Relaxed)
            && !self.handed_over.load(Ordering::Acquire);
        ok.then(|| reg.set.clone())
    }

    /// P joined an epoll set (`ADD`); `reg` when that registration could be elided (its
    /// events and data allow it). A second set ends elision for good.
    pub(crate) fn joined_set(&self, reg: Option<Registration>) {
        let mut m = self.mirror.lock();
        m.sets += 1;
        if m.sets > 1 {
            drop(m);
            self.forbid_elision();
            return;
        }
        self.elide_in(m, reg);
    }

    /// P's registration in its set changed (`MOD`); `reg` when it could be elided now.
    pub(crate) fn changed_set(&self, reg: Option<Registration>) {
        let m = self.mirror.lock();
        if m.sets == 1 {
            self.elide_in(m, reg);
        }
    }

    /// P's one registration is now `reg` (`None`: one whose readiness must be in the kernel).
    fn elide_in(&self, mut m: parking_lot::MutexGuard<'_, Mirror>, reg: Option<Registration>) {
        if m.no_elision {
            return;
        }
        let was = m.elided_in.is_some();
        let now = reg.is_some();
        m.elided_in = reg;
        if was && !now {
            drop(m);
            self.end_elision();
        }
    }

    /// P left the epoll set whose state is `set` (`DEL`).
    pub(crate) fn left_set(&self, set: &Arc<crate::elide::SetState>) {
        let mut m = self.mirror.lock();
        m.sets = m.sets.saturating_sub(1);
        if m.elided_in.as_ref().is_some_and(|r| Arc::ptr_eq(&r.set, set)) {
            m.elided_in = None;
        }
    }

    /// Something the library does not answer for may look at P: its readiness is in the kernel
    /// from now on (a token now if it is readable).
    pub(crate) fn forbid_elision(&self) {
        {
            let mut m = self.mirror.lock();
            if m.no_elision {
                // Ended before, and its token written then: every poll of P comes here.
                return;
            }
            m.no_elision = true;
            m.elided_in = None;
        }
        self.end_elision();
    }

    /// The conditions of elision may have stopped holding: a readable P gets its token.
    pub(crate) fn end_elision(&self) {
        if self.watched() {
            self.sync(false);
        }
    }

    /// For the wait on `set`, this queued connection's report `(events, data)`, or `None` to
    /// take it off the set's ready list (not readable, no longer elided there, or the kernel
    /// shows it now).
    pub(crate) fn elided_report(&self, set: &crate::elide::SetState) -> Option<(u32, u64)> {
        let mut m = self.mirror.lock();
        // Elided here no longer (conditions gone, or it moved to another set, where an arrival
        // queues it): off this list, with its token if readable.
        if !self.may_elide(&m).is_some_and(|s| std::ptr::eq(Arc::as_ptr(&s), set)) {
            m.queued = false;
            drop(m);
            self.end_elision();
            return None;
        }
        let shown_by_kernel = m.tokens > 0 || m.eof || m.rd_shut || m.l.is_none();
        let closed = self.fds.load(Ordering::Acquire) == 0;
        if shown_by_kernel || closed || !self.shown_readable(&self.vs.readiness()) {
            m.queued = false;
            return None;
        }
        m.reported = true;
        let reg = m.elided_in.as_ref().expect("checked by may_elide");
        Some((reg.events & crate::elide::REPORTED, reg.data))
    }

    fn has_returned(&self) -> bool {
        !self.share.lock().returned.is_empty()
    }

    /// Whether waits show the connection readable (`POLLIN`): as its virtual socket is, or
    /// with bytes given back, but with `SO_RCVLOWAT` set only once that many are there (or the
    /// stream ended, failed or was shut for reading), as `tcp_poll` has it.
    fn shown_readable(&self, r: &netchannel::Readiness) -> bool {
        let returned = self.share.lock().returned.len();
        if !r.readable && returned == 0 {
            return false;
        }
        let lowat = self.opts.rcv_lowat();
        lowat <= 1
            || r.unread as usize + returned >= lowat
            || r.error.is_some()
            || r.peer_finished
            || r.read_closed
    }

    /// Every byte given back, for a relay that takes the connection over (it delivers them
    /// first).
    pub(crate) fn take_all_returned(&self) -> Vec<u8> {
        std::mem::take(&mut self.share.lock().returned)
    }

    /// Bytes the relay gave back, read before the virtual socket's.
    fn take_returned(&self, bufs: &mut [IoSliceMut<'_>], peek: bool) -> Option<usize> {
        let mut sh = self.share.lock();
        if sh.returned.is_empty() {
            return None;
        }
        let n = scatter(&sh.returned, bufs);
        if !peek {
            sh.returned.drain(..n);
        }
        Some(n)
    }
}

impl Drop for Carried {
    fn drop(&mut self) {
        // Only the owning process closes the virtual socket; a forked child's copy of it is
        // left alone (its engine has no threads, and its channels are the parent's).
        if self.owner == pid() {
            crate::interpose::drop_once(&mut self.vs);
        }
    }
}

/// In a forked child: closes its copies of the owner's L ends, and forgets them, so that
/// nothing in the child touches the number again (it may soon name another fd of the child's,
/// such as its relay connection). A child that held one (a worker, a `BGSAVE`, a daemon) kept
/// the socket pair open, so the owner's closing of L told the placeholder nothing: a peer's
/// reset showed no `POLLERR`/`POLLHUP` (nor `POLLIN`) in the owner's waits until the child
/// exited. The registry is consistent here (its lock is held across `fork`); a mirror's lock
/// is only tried (a parent thread may have held it at the fork), and a connection whose lock
/// does not come keeps its copy, as before.
pub(crate) fn close_forked_copies() {
    let registry = REGISTRY.lock();
    for c in registry.iter().flat_map(|r| r.values()) {
        if let Some(mut m) = c.mirror.try_lock() {
            drop(m.l.take());
        }
    }
}

/// Takes the registry's lock until `forklock::release_held` (`interpose::fork_prepare`).
pub(crate) fn hold_registry_across_fork() {
    REGISTRY.hold_across_fork();
}

/// The registered connection `id` (for a process taking it over through the relay).
pub(crate) fn registered(id: u64) -> Option<Arc<Carried>> {
    REGISTRY.lock().get_or_insert_with(HashMap::new).get(&id).cloned()
}

/// At the exit of the process that owns them, every connection it still holds ends as its
/// kernel ends a TCP socket when the exit closes the last fd: end of stream after the bytes
/// queued, or a reset with bytes unread (or `SO_LINGER` 0). Without this the peer saw the
/// channels go with the process and read a reset where TCP gives a FIN. The registry's lock
/// is only tried: `exit` may be called where this thread holds it (a signal handler).
pub(crate) fn end_all_at_exit() {
    let Some(held) = REGISTRY
        .try_lock_for(std::time::Duration::from_millis(100))
        .map(|mut r| r.get_or_insert_with(HashMap::new).values().cloned().collect::<Vec<_>>())
    else {
        return;
    };
    for c in held {
        if c.owner == pid()
            && !c.handed_over.load(Ordering::Acquire)
            && !c.closed.load(Ordering::Acquire)
        {
            if c.opts.linger_abort() || c.has_returned() || c.vs.readiness().unread > 0 {
                c.vs.abort();
            } else {
                let _ = c.vs.shutdown();
            }
        }
    }
}

fn drain_ballast(m: &mut Mirror) {
    let Some(l) = &m.l else { return };
    let mut buf = [0u8; 16];
    let mut left = m.ballast as usize;
    while left > 0 {
        match rustix::net::recv(l, &mut buf[..left.min(16)], RecvFlags::DONTWAIT) {
            Ok((0, _)) | Err(_) => break,
            Ok((n, _)) => left -= n,
        }
    }
    m.ballast = left as u32;
}

/// Closes L with nothing unread: P reports POLLHUP without an error (both halves done).
fn close_clean(m: &mut Mirror) {
    if let Some(l) = &m.l {
        let mut buf = [0u8; 64];
        while let Ok((n, _)) = rustix::net::recv(l, &mut buf, RecvFlags::DONTWAIT) {
            if n == 0 {
                break;
            }
        }
    }
    m.l = None;
    m.ballast = 0;
}

/// Copies `data` into `bufs` in order; the bytes copied.
fn scatter(mut data: &[u8], bufs: &mut [IoSliceMut<'_>]) -> usize {
    let mut copied = 0;
    for b in bufs.iter_mut() {
        if data.is_empty() {
            break;
        }
        let n = b.len().min(data.len());
        netchannel::copy::copy(&mut b[..n], &data[..n]);
        data = &data[n..];
        copied += n;
    }
    copied
}

/// How long a non-blocking read that P told "readable" waits for the stream to settle.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(10);

/// The longest a read waits for the relay to give back a connection whose taker closed its end
/// (`Carried::await_retired`).
const GIVE_BACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a blocked read on a handed-over connection sleeps before it looks for bytes given
/// back (`Carried::block_read`).
const GIVE_BACK_SLICE: std::time::Duration = std::time::Duration::from_millis(20);

/// What `fd` reports for `events` now (a poll that does not wait); `None` if the poll failed.
fn revents_now(fd: impl AsFd, events: PollFlags) -> Option<PollFlags> {
    let mut p = [PollFd::new(&fd, events)];
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    rustix::event::poll(&mut p, Some(&zero)).ok()?;
    Some(p[0].revents())
}

fn uninterruptible() -> SignalPolicy<'static> {
    SignalPolicy { interruptible: false, mask: None, handled: None }
}

fn interruptible() -> SignalPolicy<'static> {
    SignalPolicy { interruptible: true, mask: None, handled: Some(signals::handled_count) }
}

struct Observer(Weak<Carried>);

impl ReadinessObserver for Observer {
    fn urgent(&self) {
        if let Some(c) = self.0.upgrade() {
            c.show_urgent();
        }
    }

    fn changed(&self, readable: bool, _writable: bool) {
        let Some(c) = self.0.upgrade() else { return };
        if c.connect_state.load(Ordering::Relaxed) == CONNECT_IN_PROGRESS {
            c.note_open_outcome(&c.vs.readiness());
        }
        if c.watched() {
            c.sync(readable);
        }
        c.wake_sleepers();
    }
}
