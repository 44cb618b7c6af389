//! Every OS call the engine makes that std does not wrap: eventfd, epoll, reads into spare
//! buffer capacity, vectored sends, socket options, network namespaces, thread priorities. System calls
//! go through rustix (raw system calls, never through libc's symbols, so an `LD_PRELOAD`
//! library interposing libc is never re-entered). The crate's few `unsafe` blocks are here.

// The one module where system interfaces demand `unsafe`; every block says why it is sound.
#![allow(unsafe_code)]
// Some wrappers serve only netchannel's tools (the preload library), through `internals`.
#![cfg_attr(not(feature = "internals"), allow(dead_code))]

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

use bytes::BytesMut;
use rustix::event::{epoll, eventfd, EventfdFlags};

/// A counter fd that wakes epoll waiters: how other threads wake a parked worker or a waiting
/// application thread, and how applications learn that a virtual socket became ready.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd (non-blocking, close-on-exec).
    pub fn new() -> io::Result<Self> {
        Ok(EventFd(raised(eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?)))
    }

    /// Adds one to the counter: readable, and a new edge for edge-triggered epoll.
    pub fn notify(&self) {
        // A full counter (EAGAIN) already means "readable"; nothing to do on error.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Resets the counter; returns whether it was signalled.
    pub fn drain(&self) -> bool {
        let mut v = [0u8; 8];
        matches!(rustix::io::read(&self.0, &mut v), Ok(8))
    }

    /// Its number (for an application's own epoll set).
    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The same eventfd under the lowest free number at or above `min` (close-on-exec): an
    /// interposition library keeps its fds out of the numbers a program expects to get.
    pub fn moved_above(self, min: RawFd) -> io::Result<Self> {
        Ok(EventFd(rustix::io::fcntl_dupfd_cloexec(&self.0, min)?))
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Epoll interest: readable (`EPOLLIN`).
pub const READABLE: u32 = epoll::EventFlags::IN.bits();
/// Epoll interest: writable (`EPOLLOUT`).
pub const WRITABLE: u32 = epoll::EventFlags::OUT.bits();
/// Edge-triggered (`EPOLLET`).
pub const EDGE: u32 = epoll::EventFlags::ET.bits();
/// Only one of the epoll sets holding the fd (the first with a waiting thread) is woken.
pub const EXCLUSIVE: u32 = epoll::EventFlags::EXCLUSIVE.bits();
/// The peer shut down its side, or the connection failed.
pub const HANGUP: u32 =
    epoll::EventFlags::HUP.bits() | epoll::EventFlags::ERR.bits() | epoll::EventFlags::RDHUP.bits();
/// Interest in the peer's shutdown (reported as part of `HANGUP`).
pub const PEER_SHUTDOWN: u32 = epoll::EventFlags::RDHUP.bits();

/// An epoll set whose entries carry a u64 token.
#[derive(Debug)]
pub struct Epoll(OwnedFd);

impl Epoll {
    /// A new epoll set (close-on-exec).
    pub fn new() -> io::Result<Self> {
        Ok(Epoll(raised(epoll::create(epoll::CreateFlags::CLOEXEC)?)))
    }

    /// The same epoll set under the lowest free number at or above `min` (close-on-exec).
    pub fn moved_above(self, min: RawFd) -> io::Result<Self> {
        Ok(Epoll(rustix::io::fcntl_dupfd_cloexec(&self.0, min)?))
    }

    /// Its number (to nest it, or to hand it to `Poller::wake_on`).
    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Adds `fd` with interest `events`, reported with `token`.
    pub fn add(&self, fd: BorrowedFd<'_>, events: u32, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::from_bits_retain(events);
        Ok(epoll::add(&self.0, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Changes the interest or token of `fd`.
    pub fn modify(&self, fd: BorrowedFd<'_>, events: u32, token: u64) -> io::Result<()> {
        let flags = epoll::EventFlags::from_bits_retain(events);
        Ok(epoll::modify(&self.0, fd, epoll::EventData::new_u64(token), flags)?)
    }

    /// Removes `fd`.
    pub fn delete(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(epoll::delete(&self.0, fd)?)
    }

    /// Adds, or updates, an fd the caller does not own, by number (an application's own epoll
    /// set it gave to `Poller::wake_on`). Registering keeps no reference that outlives the
    /// call: the kernel drops the entry when the file closes, and a number that is not open
    /// is an error (`EBADF`).
    pub fn add_or_modify_raw(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        // SAFETY: the borrow lives only for these calls; epoll_ctl validates the number and
        // retains no reference to the caller's object.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        self.add(b, events, token).or_else(|_| self.modify(b, events, token))
    }

    /// Removes an fd added by number; an fd closed meanwhile is already gone (harmless error).
    pub fn delete_raw(&self, fd: RawFd) -> io::Result<()> {
        // SAFETY: as in `add_or_modify_raw`: a borrow for the duration of the call only.
        self.delete(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// Waits for at most `max` (up to `MAX_EVENTS`) events and appends `(token, events)` to
    /// `out`. `None` waits forever. Timeouts below a millisecond are honoured (epoll_wait would
    /// round them to zero: a spin).
    pub fn wait(
        &self,
        out: &mut Vec<(u64, u32)>,
        max: usize,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let ts = timeout.map(|d| rustix::time::Timespec {
            tv_sec: d.as_secs().min(i32::MAX as u64) as i64,
            tv_nsec: d.subsec_nanos() as _,
        });
        // On the stack: a wait is made per message on the data path (an allocation each was
        // about a third of the library's allocations per message).
        let mut events = [const { MaybeUninit::<epoll::Event>::uninit() }; MAX_EVENTS];
        let room = &mut events[..max.clamp(1, MAX_EVENTS)];
        match epoll::wait(&self.0, room, ts.as_ref()) {
            Ok((got, _)) => {
                out.extend(got.iter().map(|e| {
                    let (data, flags) = (e.data, e.flags);
                    (data.u64(), flags.bits())
                }));
                Ok(got.len())
            }
            Err(rustix::io::Errno::INTR) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }
}

/// The most events one wait returns (`Epoll::wait`): its buffer is on the stack.
pub const MAX_EVENTS: usize = 256;

/// How a wait treats signals: whether an interrupted wait fails with `Interrupted` (instead of
/// returning no event), and the signal mask to wait under (as `epoll_pwait`'s).
#[derive(Clone, Copy, Default)]
pub struct SignalPolicy<'a> {
    /// An interrupted wait fails with `ErrorKind::Interrupted`.
    pub interruptible: bool,
    /// Signals blocked during the wait only (`None`: the thread's mask).
    pub mask: Option<&'a libc::sigset_t>,
    /// How many signal handlers this thread has run (a count that only changes when one
    /// runs). A wait that polls before it sleeps runs in user space meanwhile, where a signal
    /// interrupts no system call: an interruptible wait polls only with this, and ends as
    /// interrupted when the count moves.
    pub handled: Option<fn() -> u32>,
}

impl SignalPolicy<'_> {
    /// Whether a wait under this policy may poll for a moment before it sleeps: not under a
    /// mask of its own (a signal that mask blocks would be handled while polling), and when
    /// interruptible only if a handler's run can be seen.
    pub fn may_poll_first(&self) -> bool {
        self.mask.is_none() && (!self.interruptible || self.handled.is_some())
    }
}

impl Epoll {
    /// `wait` under a signal policy: with a mask it is `epoll_pwait2`, and an interruptible
    /// wait reports a signal as `Interrupted`, so that a caller can apply the rules of the
    /// call it stands in for (`SA_RESTART`, socket timeouts).
    pub fn wait_signals(
        &self,
        out: &mut Vec<(u64, u32)>,
        max: usize,
        timeout: Option<Duration>,
        signals: SignalPolicy<'_>,
    ) -> io::Result<usize> {
        if signals.mask.is_none() && !signals.interruptible {
            return self.wait(out, max, timeout);
        }
        let ts = timeout.map(|d| libc::timespec {
            tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: d.subsec_nanos() as _,
        });
        let max = max.clamp(1, MAX_EVENTS);
        let mut events = [const { MaybeUninit::<libc::epoll_event>::uninit() }; MAX_EVENTS];
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        let mask_ptr = signals.mask.map_or(std::ptr::null(), |m| m as *const libc::sigset_t);
        // The kernel answered ENOSYS to epoll_pwait2 once: it never will (asked again, each
        // wait would make two system calls).
        static NO_PWAIT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let no_pwait2 = || NO_PWAIT2.load(std::sync::atomic::Ordering::Relaxed);
        let n = if no_pwait2() {
            -1
        } else {
            // SAFETY: a raw system call (never an interposed libc symbol) on our own epoll fd;
            // the kernel writes at most `max` (<= MAX_EVENTS) events into the array, and
            // reads the timespec and the 8-byte kernel sigset (the first 8 bytes of glibc's
            // sigset_t) only for the duration of the call.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_epoll_pwait2,
                    self.0.as_raw_fd(),
                    events.as_mut_ptr(),
                    max as libc::c_int,
                    ts_ptr,
                    mask_ptr,
                    8usize,
                )
            };
            if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                NO_PWAIT2.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            n
        };
        let n = if no_pwait2() {
            // A kernel before 5.11 (or valgrind): epoll_pwait, to the millisecond (rounded up,
            // so that a deadline is never woken early).
            let ms = timeout.map_or(-1, |d| {
                d.as_nanos().div_ceil(1_000_000).min(libc::c_int::MAX as u128) as libc::c_int
            });
            // SAFETY: as above, epoll_pwait's arguments: our epoll fd, room for `max` events,
            // a timeout in ms, and the 8-byte kernel sigset read for the call's duration.
            unsafe {
                libc::syscall(
                    libc::SYS_epoll_pwait,
                    self.0.as_raw_fd(),
                    events.as_mut_ptr(),
                    max as libc::c_int,
                    ms,
                    mask_ptr,
                    8usize,
                )
            }
        } else {
            n
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted && !signals.interruptible {
                return Ok(0);
            }
            return Err(e);
        }
        // SAFETY: the kernel initialised the first `n` (<= max) entries.
        let got = unsafe {
            std::slice::from_raw_parts(events.as_ptr().cast::<libc::epoll_event>(), n as usize)
        };
        out.extend(got.iter().map(|e| (e.u64, e.events)));
        Ok(n as usize)
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

// The engine's own TCP sockets are made with raw system calls (rustix's linux_raw backend), not
// libc's: in a program run under `netchannel run`, libc's `connect`, `listen` and `accept` are
// the interposition library's, and the engine's calls must never come back into it.

fn tcp_socket(addr: &std::net::SocketAddr, flags: rustix::net::SocketFlags) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() {
        rustix::net::AddressFamily::INET
    } else {
        rustix::net::AddressFamily::INET6
    };
    let flags = flags | rustix::net::SocketFlags::CLOEXEC;
    Ok(raised(rustix::net::socket_with(family, rustix::net::SocketType::STREAM, flags, None)?))
}

/// The lowest number the engine's own fds take (0: any), for an interposition library.
static FD_FLOOR: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Makes the engine put every fd it creates from now on (channel sockets, epoll sets,
/// eventfds) at `min` or above: a program run under an interposition library then keeps
/// getting the low numbers it expects (select's 1024, event loops sized to their own fds),
/// even when the engine dials or accepts channels under load in its own threads.
pub fn keep_fds_above(min: RawFd) {
    FD_FLOOR.store(min, std::sync::atomic::Ordering::Relaxed);
}

/// `fd` moved to the floor (`keep_fds_above`) or above, close-on-exec; itself if no floor is
/// set or no number is free there.
pub fn raised(fd: OwnedFd) -> OwnedFd {
    let floor = FD_FLOOR.load(std::sync::atomic::Ordering::Relaxed);
    let fd = if floor <= 0 || fd.as_raw_fd() >= floor {
        fd
    } else {
        rustix::io::fcntl_dupfd_cloexec(&fd, floor).unwrap_or(fd)
    };
    note_own_fd(fd.as_raw_fd());
    fd
}

/// A socket of this process's own (a channel, the channel listener, a relay's end of a
/// connection) that a forked child must not keep open. The child has none of the threads that serve it, so its copy
/// only keeps the connection alive past the parent: a parent killed while a child lives
/// would otherwise leave its peers waiting on channels nobody reads (they see them close at
/// the parent's death, as they would see its kernel sockets close), and a relay's close or
/// reset would not reach the process at the other end.
///
/// The number is noted (in a lock-free bitmap) while this owns it; in a forked child
/// (`pthread_atfork`, registered with the first one) every noted number is pointed at
/// /dev/null: the socket is released, and the number stays taken, so that the copy of this
/// object in the child's memory, should it ever be dropped there, closes nothing of the
/// child's. A fork in the moment between the socket's creation and `new` (or between `drop`
/// and the close) leaves the child its copy, as before.
#[derive(Debug)]
pub struct ShedOnFork<T: AsRawFd>(T);

impl<T: AsRawFd> ShedOnFork<T> {
    /// Notes `inner`'s fd until this is dropped.
    pub fn new(inner: T) -> Self {
        fdsets::SHED.insert(inner.as_raw_fd());
        ShedOnFork(inner)
    }
}

impl<T: AsRawFd> std::ops::Deref for ShedOnFork<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: AsRawFd + AsFd> AsFd for ShedOnFork<T> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl<T: AsRawFd> Drop for ShedOnFork<T> {
    fn drop(&mut self) {
        // Forgotten before the field closes it: a child never sheds a number that may be
        // another file's by then.
        fdsets::SHED.remove(self.0.as_raw_fd());
    }
}

/// Notes `fd` as one of this process's own (the engine's or the interposition library's, made
/// above the floor: `raised`), so that a program that closes a range of its fds
/// (`close_range`, `closefrom`) closes the program's alone (`own_fds_in`). Forgotten when it is
/// closed through libc's `close` (the library's wrapper calls `forget_own_fd`), and all of them
/// in a forked child, whose copies are not its library's.
pub fn note_own_fd(fd: RawFd) {
    fdsets::OWN.insert(fd);
}

/// `fd` is closed (or about to be): no longer one of this process's own.
pub fn forget_own_fd(fd: RawFd) {
    if fdsets::OWN.contains(fd) {
        fdsets::OWN.remove(fd);
    }
}

/// Whether `fd` is one of this process's own (`note_own_fd`).
pub fn is_own_fd(fd: RawFd) -> bool {
    fdsets::OWN.contains(fd)
}

/// Whether this process has any own fd (`note_own_fd`).
pub fn has_own_fds() -> bool {
    fdsets::OWN.any()
}

/// This process's own fds (`note_own_fd`) from `first` to `last`, in order.
pub fn own_fds_in(first: RawFd, last: RawFd) -> Vec<RawFd> {
    fdsets::OWN.members_in(first, last)
}

mod fdsets {
    use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
    use std::sync::Once;

    /// fds per chunk of a set, and chunks: numbers up to 16M (`fd_limit`'s cap).
    const PER_CHUNK: usize = 1 << 16;
    const CHUNKS: usize = 256;
    type Chunk = [AtomicU64; PER_CHUNK / 64];

    /// A lock-free set of fd numbers: a bitmap in chunks allocated on first use and never
    /// freed, so that a fork's child handler reads it without a lock or an allocation.
    pub(super) struct FdSet([AtomicPtr<Chunk>; CHUNKS]);

    /// `ShedOnFork`'s numbers.
    pub(super) static SHED: FdSet = FdSet::new();
    /// The process's own fds (`note_own_fd`).
    pub(super) static OWN: FdSet = FdSet::new();
    static AT_FORK: Once = Once::new();

    fn place(fd: i32) -> Option<(usize, usize, u64)> {
        let fd = usize::try_from(fd).ok()?;
        let chunk = fd / PER_CHUNK;
        (chunk < CHUNKS).then(|| (chunk, fd % PER_CHUNK / 64, 1u64 << (fd % 64)))
    }

    impl FdSet {
        const fn new() -> Self {
            FdSet([const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS])
        }

        fn chunk(&self, c: usize) -> Option<&Chunk> {
            let chunk = self.0[c].load(Ordering::Acquire);
            // SAFETY: chunks are never freed once published.
            (!chunk.is_null()).then(|| unsafe { &*chunk })
        }

        pub(super) fn insert(&self, fd: i32) {
            let Some((c, word, bit)) = place(fd) else { return };
            AT_FORK.call_once(|| {
                // SAFETY: registers a plain extern "C" function without arguments; glibc calls
                // it in the child of every later fork.
                unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
            });
            let mut chunk = self.0[c].load(Ordering::Acquire);
            if chunk.is_null() {
                let fresh = Box::into_raw(Box::new([const { AtomicU64::new(0) }; PER_CHUNK / 64]));
                chunk = match self.0[c].compare_exchange(
                    std::ptr::null_mut(),
                    fresh,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => fresh,
                    Err(theirs) => {
                        // SAFETY: `fresh` came from Box::into_raw above and was never shared.
                        drop(unsafe { Box::from_raw(fresh) });
                        theirs
                    }
                };
            }
            // SAFETY: chunks are never freed once published.
            let chunk = unsafe { &*chunk };
            chunk[word].fetch_or(bit, Ordering::SeqCst);
        }

        pub(super) fn remove(&self, fd: i32) {
            let Some((c, word, bit)) = place(fd) else { return };
            if let Some(chunk) = self.chunk(c) {
                chunk[word].fetch_and(!bit, Ordering::SeqCst);
            }
        }

        pub(super) fn contains(&self, fd: i32) -> bool {
            let Some((c, word, bit)) = place(fd) else { return false };
            self.chunk(c).is_some_and(|chunk| chunk[word].load(Ordering::Acquire) & bit != 0)
        }

        /// The members from `first` to `last`, in order.
        pub(super) fn members_in(&self, first: i32, last: i32) -> Vec<i32> {
            let mut out = Vec::new();
            let (first, last) = (first.max(0) as usize, last.max(0) as usize);
            for c in first / PER_CHUNK..=(last / PER_CHUNK).min(CHUNKS - 1) {
                let Some(chunk) = self.chunk(c) else { continue };
                for (w, word) in chunk.iter().enumerate() {
                    let mut bits = word.load(Ordering::Acquire);
                    while bits != 0 {
                        let fd = c * PER_CHUNK + w * 64 + bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        if (first..=last).contains(&fd) {
                            out.push(fd as i32);
                        }
                    }
                }
            }
            out
        }

        pub(super) fn any(&self) -> bool {
            (0..CHUNKS).any(|c| {
                self.chunk(c)
                    .is_some_and(|chunk| chunk.iter().any(|w| w.load(Ordering::Acquire) != 0))
            })
        }

        /// Empties the set, calling `f` with each member once.
        pub(super) fn drain(&self, mut f: impl FnMut(i32)) {
            for c in 0..CHUNKS {
                let Some(chunk) = self.chunk(c) else { continue };
                for (w, word) in chunk.iter().enumerate() {
                    let mut bits = word.swap(0, Ordering::SeqCst);
                    while bits != 0 {
                        let b = bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        f((c * PER_CHUNK + w * 64 + b) as i32);
                    }
                }
            }
        }
    }

    /// The fork's child handler: no lock, no allocation (raw system calls only). The parent's
    /// own fds are not the child's library's: a range the child closes closes them.
    extern "C" fn in_child() {
        super::shed_noted();
        OWN.drain(|_| {});
    }
}

/// Points every noted number (`ShedOnFork`) at /dev/null and forgets it: what a forked child
/// does first.
fn shed_noted() {
    let Ok(null) = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return;
    };
    fdsets::SHED.drain(|fd| {
        // SAFETY: `fd` was noted by a `ShedOnFork` that owns it (noted after it was opened,
        // forgotten before it is closed), so the number is open and nothing else in this
        // process refers to it. The temporary owner is never dropped: dup3 only replaces the
        // file under the number, which stays the (parent's image of the) owner's.
        let mut target = std::mem::ManuallyDrop::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let _ = rustix::io::dup3(&null, &mut target, rustix::io::DupFlags::CLOEXEC);
    });
}

/// The local address of a connected socket (a channel's, for the address a program's
/// `getsockname` reports on a carried connection).
pub fn local_addr(fd: BorrowedFd<'_>) -> Option<std::net::SocketAddr> {
    std::net::SocketAddr::try_from(rustix::net::getsockname(fd).ok()?).ok()
}

/// `TcpStream::connect_timeout`, by raw system calls: connects within `timeout` (a refusal is
/// `ConnectionRefused`, silence `TimedOut`). The stream is returned in blocking mode.
pub fn tcp_connect(
    addr: &std::net::SocketAddr,
    source: Option<std::net::IpAddr>,
    timeout: Duration,
) -> io::Result<std::net::TcpStream> {
    let fd = tcp_socket(addr, rustix::net::SocketFlags::NONBLOCK)?;
    if let Some(ip) = source {
        rustix::net::bind(&fd, &std::net::SocketAddr::new(ip, 0)).map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("cannot dial from {ip} (Config::dial_source): {e}"),
            )
        })?;
    }
    match rustix::net::connect(&fd, addr) {
        Ok(()) => {}
        Err(e) if e == rustix::io::Errno::INPROGRESS => {
            let deadline = std::time::Instant::now() + timeout;
            // A signal ends a poll early (false): wait out the rest.
            while !poll_writable(
                fd.as_fd(),
                Some(deadline.saturating_duration_since(std::time::Instant::now())),
            )? {
                if std::time::Instant::now() >= deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "connection timed out"));
                }
            }
            rustix::net::sockopt::socket_error(&fd)??;
        }
        Err(e) => return Err(e.into()),
    }
    rustix::io::ioctl_fionbio(&fd, false)?;
    Ok(std::net::TcpStream::from(fd))
}

/// `TcpListener::bind`, by raw system calls (SO_REUSEADDR, as std sets it).
pub fn tcp_listen(addr: &std::net::SocketAddr) -> io::Result<std::net::TcpListener> {
    let fd = tcp_socket(addr, rustix::net::SocketFlags::empty())?;
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
    rustix::net::bind(&fd, addr)?;
    rustix::net::listen(&fd, 1024)?;
    Ok(std::net::TcpListener::from(fd))
}

/// `TcpListener::accept`, by raw system calls (close-on-exec, as std makes it).
pub fn tcp_accept(listener: &std::net::TcpListener) -> io::Result<std::net::TcpStream> {
    let fd = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC)?;
    Ok(std::net::TcpStream::from(raised(fd)))
}

/// Waits up to `timeout` (None: forever) for `fd` to become readable.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    poll_one(fd, rustix::event::PollFlags::IN, timeout)
}

/// Waits up to `timeout` for `fd` to become writable.
pub fn poll_writable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    poll_one(fd, rustix::event::PollFlags::OUT, timeout)
}

fn poll_one(
    fd: BorrowedFd<'_>,
    flags: rustix::event::PollFlags,
    timeout: Option<Duration>,
) -> io::Result<bool> {
    let mut fds = [rustix::event::PollFd::new(&fd, flags)];
    let ts = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos() as _,
    });
    match rustix::event::poll(&mut fds, ts.as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Reads up to `max` bytes from `fd` into the spare capacity of `buf` (which must have room),
/// extending its length by the bytes read. No zero-filling of memory the kernel overwrites.
pub fn read_append(fd: BorrowedFd<'_>, buf: &mut BytesMut, max: usize) -> io::Result<usize> {
    let spare = buf.spare_capacity_mut();
    let want = spare.len().min(max);
    let (init, _) = rustix::io::read(fd, &mut spare[..want])?;
    let n = init.len();
    // SAFETY: the kernel initialised exactly the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Reads up to `max` bytes from `fd` into the spare capacity of a `Vec` (a pooled buffer).
pub fn read_append_vec(fd: BorrowedFd<'_>, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    let spare = buf.spare_capacity_mut();
    let want = spare.len().min(max);
    let (init, _) = rustix::io::read(fd, &mut spare[..want])?;
    let n = init.len();
    // SAFETY: the kernel initialised exactly the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Reads into an initialised buffer (an application's buffer: direct placement).
pub fn read_into(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    Ok(rustix::io::read(fd, buf)?)
}

/// Gathers `slices` into one send on socket `fd`. `MSG_NOSIGNAL`: a peer that closed the
/// connection is an `EPIPE` for the engine to handle, never a `SIGPIPE` (in a program under
/// `netchannel run` whose handler is the default, that would end the program).
pub fn send_vectored(fd: BorrowedFd<'_>, slices: &[IoSlice<'_>]) -> io::Result<usize> {
    let n = slices.len().min(1024);
    let mut no_control = rustix::net::SendAncillaryBuffer::default();
    Ok(rustix::net::sendmsg(fd, &slices[..n], &mut no_control, rustix::net::SendFlags::NOSIGNAL)?)
}

/// Sets an integer socket option that neither rustix nor socket2 covers.
pub fn set_int_sockopt(fd: BorrowedFd<'_>, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: the option value is a live c_int whose size is passed; the fd is borrowed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the calling thread into the network namespace at `path` (e.g. /run/netns/NAME).
/// Sockets created afterwards by this thread, and threads it spawns, live in that namespace.
pub fn enter_netns(path: &Path) -> io::Result<()> {
    let file = std::fs::File::open(path).map_err(|e| {
        io::Error::new(e.kind(), format!("cannot open network namespace {}: {e}", path.display()))
    })?;
    rustix::thread::move_into_link_name_space(
        file.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .map_err(|e| {
        let e = io::Error::from(e);
        io::Error::new(e.kind(), format!("cannot enter network namespace {}: {e}", path.display()))
    })
}

/// Random bytes from the kernel (engine ids, handshake nonces).
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => {
                // No getrandom (ancient kernel): time and pid only need to differ between live
                // engines; nonces then lose their strength, which the PSK check still guards.
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
                    ^ ((std::process::id() as u64) << 32);
                for (i, b) in out[filled..].iter_mut().enumerate() {
                    *b = (t >> ((i % 8) * 8)) as u8 ^ i as u8;
                }
                break;
            }
        }
    }
    out
}

/// A random u64 (engine ids).
pub fn random_u64() -> u64 {
    u64::from_ne_bytes(random_bytes::<8>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's (policy, nice) as the kernel reports them.
    fn policy_and_nice() -> (i32, i32) {
        // SAFETY: sched_getscheduler(0) reads the calling thread's policy; no memory is passed.
        let policy = unsafe { libc::sched_getscheduler(0) };
        (policy, rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap())
    }

    /// Whether `fd` is a socket, in the calling process.
    fn is_socket(fd: RawFd) -> bool {
        // SAFETY: a borrow for the duration of the call; the kernel checks the number.
        rustix::net::sockopt::socket_type(unsafe { BorrowedFd::borrow_raw(fd) }).is_ok()
    }

    #[test]
    fn own_fds_are_listed_by_range_until_forgotten() {
        // Numbers no test opens, in two chunks of the set (65,536 numbers each).
        let (a, b, c) = (200_001, 200_063, 262_200);
        for fd in [c, a, b] {
            note_own_fd(fd);
        }
        assert!(has_own_fds());
        assert!(is_own_fd(a) && is_own_fd(b) && is_own_fd(c) && !is_own_fd(a + 1));
        assert_eq!(own_fds_in(200_000, 300_000), vec![a, b, c]);
        assert_eq!(own_fds_in(a + 1, b), vec![b]);
        assert_eq!(own_fds_in(b + 1, c - 1), Vec::<RawFd>::new());
        forget_own_fd(b);
        assert_eq!(own_fds_in(200_000, 300_000), vec![a, c]);
        forget_own_fd(a);
        forget_own_fd(c);
        assert!(own_fds_in(200_000, 300_000).is_empty());
        // Beyond the set's numbers: never noted, never listed.
        note_own_fd(RawFd::MAX);
        assert!(!is_own_fd(RawFd::MAX) && own_fds_in(RawFd::MAX - 1, RawFd::MAX).is_empty());
    }

    #[test]
    fn a_forked_child_keeps_no_copy_of_a_noted_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let noted = ShedOnFork::new(std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let (mut far, _) = l.accept().unwrap();
        // Noted and dropped before the fork: its number is not shed (a new file may take it).
        let gone = ShedOnFork::new(std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap());
        drop(gone);
        let zero =
            rustix::fs::open("/dev/zero", rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty())
                .unwrap();
        let zero_dev = rustix::fs::fstat(&zero).unwrap().st_rdev;
        let (n, f, z) = (noted.as_raw_fd(), far.as_raw_fd(), zero.as_raw_fd());
        // SAFETY: the child makes system calls only (no lock; the sleep allocates nothing) and
        // leaves by _exit; the parent waits for it.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // The handler has run: the noted socket is gone, the others are as they were.
            // SAFETY: a borrow for the duration of the call.
            let z_dev = rustix::fs::fstat(unsafe { BorrowedFd::borrow_raw(z) }).map(|s| s.st_rdev);
            let ok = !is_socket(n) && is_socket(f) && z_dev == Ok(zero_dev);
            // Hold the copies a while: the parent's close must not wait for us.
            std::thread::sleep(Duration::from_millis(500));
            // SAFETY: ends the child without running the test harness's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        assert!(child > 0);
        // The parent's close ends the connection at once, though the child still runs.
        drop(noted);
        use std::io::Read;
        far.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(far.read(&mut b).unwrap(), 0, "end of stream while the child lives");
        let mut status = 0;
        // SAFETY: waits for our own child; `status` outlives the call.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child saw {status}");
    }

    /// A kernel without `epoll_pwait2` (before 5.11; valgrind 3.19 too): a forked child whose
    /// seccomp filter answers it with ENOSYS still waits with a signal mask, through
    /// `epoll_pwait`, and gets the event.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_masked_wait_falls_back_to_epoll_pwait_without_epoll_pwait2() {
        let ep = Epoll::new().unwrap();
        let ev = EventFd::new().unwrap();
        ep.add(ev.as_fd(), READABLE, 7).unwrap();
        // SAFETY: an empty sigset filled by sigemptyset before any use.
        let mask = unsafe {
            let mut m = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut m);
            m
        };
        // seccomp BPF: load the system call number; epoll_pwait2 -> ENOSYS; the rest allowed.
        let filter = [
            libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 },
            libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: libc::SYS_epoll_pwait2 as u32 },
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::ENOSYS as u32 },
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 },
        ];
        let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut _ };
        // SAFETY: the child makes system calls and one small allocation (glibc's malloc is
        // usable after fork) and leaves by _exit; the parent waits for it.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: prctl with the documented arguments; `prog` and `filter` outlive the call.
            let filtered = unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                    && libc::prctl(libc::PR_SET_SECCOMP, 2, &prog as *const libc::sock_fprog) == 0
            };
            // SAFETY: a raw call with no arguments that matter: only its error is looked at.
            let enosys = unsafe { libc::syscall(libc::SYS_epoll_pwait2, -1, 0, 0, 0, 0, 0) } < 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS);
            ev.notify();
            let mut out = Vec::new();
            let policy = SignalPolicy { interruptible: true, mask: Some(&mask), handled: None };
            let got = ep.wait_signals(&mut out, 4, Some(Duration::from_secs(2)), policy);
            let ok = filtered && enosys && got.is_ok_and(|n| n == 1) && out[0].0 == 7;
            // SAFETY: ends the child without running the test harness's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        assert!(child > 0);
        let mut status = 0;
        // SAFETY: waits for our own child; `status` outlives the call.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child saw {status}");
    }

    #[test]
    fn a_demotion_puts_back_the_policy_and_nice_value_it_found() {
        // On a scratch thread: its scheduling is its own. Nice 3 first (raising nice needs no
        // privilege), then SCHED_BATCH, so that restoring a default would show.
        std::thread::spawn(|| {
            rustix::process::setpriority_process(Some(rustix::thread::gettid()), 3).unwrap();
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is a live sched_param.
            assert_eq!(unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) }, 0);
            let found = policy_and_nice();
            assert_eq!(found, (libc::SCHED_BATCH, 3));

            let Some(before) = demote_thread(ThreadPolicy::Idle).unwrap() else {
                panic!("a SCHED_BATCH thread is demoted")
            };
            assert_eq!(policy_and_nice().0, libc::SCHED_IDLE);
            let putting_back = restore_thread_schedule(before);
            if putting_back.is_err() {
                eprintln!("skipping the rest: no right to leave SCHED_IDLE (no CAP_SYS_NICE)");
                return;
            }
            assert_eq!(policy_and_nice(), found, "SCHED_IDLE and back keeps the nice value");

            let before = demote_thread(ThreadPolicy::Nice(19)).unwrap().expect("demoted");
            assert_eq!(policy_and_nice(), (libc::SCHED_BATCH, 19));
            restore_thread_schedule(before).unwrap();
            assert_eq!(policy_and_nice(), found);

            // A worker put back from SCHED_IDLE to a nice value is SCHED_OTHER again.
            demote_thread(ThreadPolicy::Idle).unwrap().expect("demoted");
            set_thread_policy(ThreadPolicy::Nice(5), None).unwrap();
            assert_eq!(policy_and_nice(), (libc::SCHED_OTHER, 5));
            demote_thread(ThreadPolicy::Idle).unwrap().expect("demoted");
            set_thread_policy(ThreadPolicy::Normal, None).unwrap();
            assert_eq!(policy_and_nice(), (libc::SCHED_OTHER, 0));

            // An idle thread is left as it is.
            // SAFETY: as above.
            assert_eq!(unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) }, 0);
            assert!(demote_thread(ThreadPolicy::Nice(19)).unwrap().is_none());
            assert_eq!(policy_and_nice().0, libc::SCHED_IDLE);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn tcp_info_reads_a_tcp_connection_and_nothing_else() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let info = tcp_info(c.as_fd()).expect("TCP_INFO of a TCP socket");
        assert!(info.snd_cwnd > 0, "{info:?}");
        let (u, _) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(tcp_info(u.as_fd()), None);
    }

    #[test]
    fn eventfd_wakes_epoll_on_every_notify_when_edge_triggered() {
        let ep = Epoll::new().unwrap();
        let ev = EventFd::new().unwrap();
        ep.add(ev.as_fd(), READABLE | EDGE, 7).unwrap();
        let mut out = Vec::new();
        assert_eq!(ep.wait(&mut out, 4, Some(Duration::ZERO)).unwrap(), 0);
        ev.notify();
        assert_eq!(ep.wait(&mut out, 4, Some(Duration::from_secs(1))).unwrap(), 1);
        assert_eq!(out[0].0, 7);
        // Not drained: a second notify is a second edge (waiters never need to read it).
        ev.notify();
        assert_eq!(ep.wait(&mut out, 4, Some(Duration::from_secs(1))).unwrap(), 1);
        assert_eq!(ep.wait(&mut out, 4, Some(Duration::from_micros(200))).unwrap(), 0);
        assert!(ev.drain());
        assert!(!ev.drain());
    }

    #[test]
    fn read_append_and_send_vectored_over_a_socket_pair() {
        let (r, w) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let n =
            send_vectored(w.as_fd(), &[IoSlice::new(b"hello "), IoSlice::new(b"world")]).unwrap();
        assert_eq!(n, 11);
        let mut buf = BytesMut::with_capacity(64);
        buf.extend_from_slice(b">");
        assert_eq!(read_append(r.as_fd(), &mut buf, 5).unwrap(), 5);
        assert_eq!(read_append(r.as_fd(), &mut buf, 64).unwrap(), 6);
        assert_eq!(&buf[..], b">hello world");
        let mut direct = [0u8; 4];
        send_vectored(w.as_fd(), &[IoSlice::new(b"abcd")]).unwrap();
        assert_eq!(read_into(r.as_fd(), &mut direct).unwrap(), 4);
        assert_eq!(&direct, b"abcd");
        // A closed peer is an error for the caller (`EPIPE`; with `MSG_NOSIGNAL`, no signal).
        drop(r);
        let e = send_vectored(w.as_fd(), &[IoSlice::new(b"x")]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn missing_netns_is_a_clear_error() {
        let err = std::thread::spawn(|| enter_netns(Path::new("/run/netns/does-not-exist")))
            .join()
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("does-not-exist"), "{err}");
    }

    #[test]
    fn random_bytes_differ() {
        assert_ne!(random_bytes::<16>(), random_bytes::<16>());
    }
}

/// How a thread is scheduled (`Config::throughput_policy`, `Config::latency_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadPolicy {
    /// SCHED_OTHER at nice 0, as application threads.
    Normal,
    /// SCHED_OTHER at this nice value (-20..=19; below 0 needs CAP_SYS_NICE).
    Nice(i8),
    /// SCHED_IDLE: runs only when no normal thread wants the core, and any normal thread that
    /// wakes preempts it at once.
    Idle,
}

impl std::fmt::Display for ThreadPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ThreadPolicy::Normal => write!(f, "SCHED_OTHER nice 0"),
            ThreadPolicy::Nice(n) => write!(f, "SCHED_OTHER nice {n}"),
            ThreadPolicy::Idle => write!(f, "SCHED_IDLE"),
        }
    }
}

/// Writes a warning line to stderr, ignoring failures: `eprintln!` panics when the write
/// fails (a closed pipe with SIGPIPE ignored, as many servers run), and a warning must not
/// take down the thread that gives it (an engine worker, or a program's thread inside an
/// interposed call).
pub fn warn(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// Applies `policy`, and the CPU set if given, to the calling thread. A nice value
/// (`Normal`, `Nice`) on a SCHED_IDLE thread first puts it back to SCHED_OTHER: a nice value
/// alone leaves the policy as it is, and a worker put back after isolation stayed SCHED_IDLE.
pub fn set_thread_policy(policy: ThreadPolicy, cpus: Option<&[usize]>) -> io::Result<()> {
    let tid = rustix::thread::gettid();
    match policy {
        ThreadPolicy::Normal | ThreadPolicy::Nice(_) => {
            // SAFETY: sched_getscheduler(0) reads the calling thread's policy; no memory is
            // passed.
            let found = unsafe { libc::sched_getscheduler(0) };
            if found >= 0 && found & !libc::SCHED_RESET_ON_FORK == libc::SCHED_IDLE {
                let param = libc::sched_param { sched_priority: 0 };
                // SAFETY: pid 0 is the calling thread; `param` is a live, initialised
                // sched_param (SCHED_OTHER requires priority 0). No memory is retained.
                if unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) } != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            set_nice(tid, policy)?;
        }
        ThreadPolicy::Idle => {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is a live, initialised sched_param
            // (SCHED_IDLE requires priority 0). No memory is retained by the call.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    if let Some(cpus) = cpus {
        let mut set = rustix::thread::CpuSet::new();
        for &c in cpus {
            set.set(c);
        }
        rustix::thread::sched_setaffinity(None, &set)?;
    }
    Ok(())
}

/// Sets the nice value `policy` names (`Normal`: 0) on thread `tid`, its policy as it is.
fn set_nice(tid: rustix::thread::Pid, policy: ThreadPolicy) -> io::Result<()> {
    let nice = if let ThreadPolicy::Nice(n) = policy { n as i32 } else { 0 };
    Ok(rustix::process::setpriority_process(Some(tid), nice)?)
}

/// An fd kept in reserve (on /dev/null) to be closed when the process runs out of fds: room
/// to accept one waiting connection and refuse it.
/// Above the floor like the engine's other fds (`keep_fds_above`).
pub fn spare_fd() -> io::Result<OwnedFd> {
    Ok(raised(rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?))
}

/// Whether an error says the process (`EMFILE`) or the system (`ENFILE`) is out of fds.
pub fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The process's soft limit on open file descriptors (`RLIMIT_NOFILE`; large when unlimited).
pub fn fd_limit() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current.unwrap_or(1 << 20).min(1 << 24) as usize
}

/// How many threads the machine has runnable at this instant, the caller included (the
/// kernel's count, the fourth field of /proc/loadavg), or `None` where that cannot be read.
/// Its fd is opened on first use and kept (above the fd floor, as the engine's others).
pub fn runnable_threads() -> Option<u32> {
    static LOADAVG: std::sync::OnceLock<Option<OwnedFd>> = std::sync::OnceLock::new();
    let fd = LOADAVG
        .get_or_init(|| {
            let flags = rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC;
            rustix::fs::open("/proc/loadavg", flags, rustix::fs::Mode::empty()).ok().map(raised)
        })
        .as_ref()?;
    let mut buf = [0u8; 128];
    let n = rustix::io::pread(fd, &mut buf, 0).ok()?;
    // "0.52 0.58 0.59 3/245 12345": runnable/total.
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    text.split_whitespace().nth(3)?.split('/').next()?.parse().ok()
}

/// The calling thread's id (as in /proc/self/task).
pub fn thread_id() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// What a demotion changed on a thread, to put it back: its policy as `sched_getscheduler`
/// gave it (with `SCHED_RESET_ON_FORK` if set), and its nice value when the demotion changed
/// that instead.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    policy: i32,
    nice: Option<i32>,
}

/// Demotes the calling thread to `policy`, returning what to put back; `None` (and nothing
/// changed) for a thread that is not SCHED_OTHER or SCHED_BATCH: a real-time or idle thread is
/// left as it is. Two system calls to demote and one to restore: a switch to SCHED_IDLE and
/// back keeps the thread's nice value (the kernel carries it for fair policies), so only a
/// demotion by nice reads and restores it.
pub fn demote_thread(policy: ThreadPolicy) -> io::Result<Option<Schedule>> {
    // SAFETY: sched_getscheduler(0) reads the calling thread's policy; no memory is passed.
    let found = unsafe { libc::sched_getscheduler(0) };
    if found < 0 {
        return Err(io::Error::last_os_error());
    }
    let base = found & !libc::SCHED_RESET_ON_FORK;
    if base != libc::SCHED_OTHER && base != libc::SCHED_BATCH {
        return Ok(None);
    }
    let tid = rustix::thread::gettid();
    let nice = match policy {
        // SCHED_OTHER or SCHED_BATCH (above): the nice value alone, the policy not read again.
        ThreadPolicy::Normal | ThreadPolicy::Nice(_) => {
            let before = rustix::process::getpriority_process(Some(tid))?;
            set_nice(tid, policy)?;
            Some(before)
        }
        ThreadPolicy::Idle => {
            set_thread_policy(policy, None)?;
            None
        }
    };
    Ok(Some(Schedule { policy: found, nice }))
}

/// Puts the calling thread back to what `demote_thread` found.
pub fn restore_thread_schedule(s: Schedule) -> io::Result<()> {
    if let Some(nice) = s.nice {
        rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice)?;
        return Ok(());
    }
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a live sched_param (priority 0 is what
    // SCHED_OTHER and SCHED_BATCH require, the only policies demotion changes).
    if unsafe { libc::sched_setscheduler(0, s.policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What the kernel says of one TCP connection (`TCP_INFO`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpInfo {
    /// Smoothed round-trip time, microseconds.
    pub rtt_us: u32,
    /// Its mean deviation, microseconds.
    pub rtt_var_us: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// Bytes retransmitted over the connection's life (0 on kernels before 4.19).
    pub bytes_retrans: u64,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
    /// Segments sent and not yet acknowledged by the peer's kernel.
    pub unacked: u32,
    /// Milliseconds since the peer's kernel last acknowledged anything (its answers to
    /// zero-window probes included).
    pub last_ack_recv_ms: u32,
    /// Bytes queued in the socket and not sent yet.
    pub notsent_bytes: u32,
    /// The window the peer's kernel last advertised, bytes (0: it is not reading).
    pub snd_wnd: u32,
    /// Zero-window probes sent and not answered (an answer resets it).
    pub probes: u8,
}

/// `TCP_INFO` of a TCP socket; `None` for anything else.
pub fn tcp_info(fd: BorrowedFd<'_>) -> Option<TcpInfo> {
    // SAFETY: tcp_info is plain integers; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `fd` is open for the borrow; the kernel writes at most `len` bytes into `info`,
    // which is that large, and stores the length it wrote in `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(TcpInfo {
        rtt_us: info.tcpi_rtt,
        rtt_var_us: info.tcpi_rttvar,
        total_retrans: info.tcpi_total_retrans,
        bytes_retrans: info.tcpi_bytes_retrans,
        snd_cwnd: info.tcpi_snd_cwnd,
        unacked: info.tcpi_unacked,
        last_ack_recv_ms: info.tcpi_last_ack_recv,
        notsent_bytes: info.tcpi_notsent_bytes,
        snd_wnd: info.tcpi_snd_wnd,
        probes: info.tcpi_probes,
    })
}

/// Runs `f` when the process exits normally (`atexit`).
pub fn at_exit(f: extern "C" fn()) {
    // SAFETY: registers a plain extern "C" function without arguments; the library that
    // holds it is never unloaded (linked in, or preloaded for the process's life).
    unsafe { libc::atexit(f) };
}
