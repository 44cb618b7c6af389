//! The interposed C entry points, and the few raw system interfaces the library needs. The one
//! module of this crate where `unsafe` is allowed: it turns C arguments (pointers, lengths,
//! raw fd numbers) into Rust types and hands them to the safe modules.
//!
//! Every entry point starts with one atomic load (`table::kind`) and, for an fd that is not the
//! library's, calls libc's own function at once: no lock, no allocation, nothing that is not
//! async-signal-safe.

use std::cell::Cell;
use std::ffi::{c_int, c_long, c_void};
use std::io::{IoSlice, IoSliceMut};
use std::mem::ManuallyDrop;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{sockaddr, socklen_t};

use crate::carried::Carried;
use crate::process::{self, bump, is_inside, COUNTERS};
use crate::table::{self, CARRIED, EPOLL, LISTENING, RELAYED, REMOTE};
use crate::{connect, inherit, listen, sockopt, waits};

// ---------------------------------------------------------------------------------------------
// The real libc functions, resolved at load time (dlsym is not async-signal-safe, so the hot
// path only loads a pointer).

macro_rules! reals {
    ($($name:ident : $ty:ty,)*) => {
        #[allow(non_upper_case_globals)]
        mod slots {
            use std::sync::atomic::AtomicUsize;
            $(pub static $name: AtomicUsize = AtomicUsize::new(0);)*
        }
        fn resolve_all() {
            $(resolve(&slots::$name, concat!(stringify!($name), "\0").as_bytes());)*
        }
        #[allow(non_camel_case_types)]
        mod types {
            use super::*;
            $(pub type $name = $ty;)*
        }
    };
}

macro_rules! real {
    ($name:ident) => {
        as_fn::<types::$name>(resolve(&slots::$name, concat!(stringify!($name), "\0").as_bytes()))
    };
}

/// A resolved symbol as the function type it was declared with in `reals!`.
fn as_fn<F: Copy>(p: usize) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: `p` is libc's definition of the symbol (RTLD_NEXT) whose C signature `F` is, as
    // declared in `reals!`; every symbol listed exists in glibc (a null would be a load bug).
    unsafe { std::mem::transmute_copy::<usize, F>(&p) }
}

type Ssize = isize;

reals! {
    read: unsafe extern "C" fn(c_int, *mut c_void, usize) -> Ssize,
    write: unsafe extern "C" fn(c_int, *const c_void, usize) -> Ssize,
    readv: unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> Ssize,
    writev: unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> Ssize,
    recv: unsafe extern "C" fn(c_int, *mut c_void, usize, c_int) -> Ssize,
    send: unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> Ssize,
    recvfrom: unsafe extern "C" fn(c_int, *mut c_void, usize, c_int, *mut sockaddr, *mut socklen_t) -> Ssize,
    sendto: unsafe extern "C" fn(c_int, *const c_void, usize, c_int, *const sockaddr, socklen_t) -> Ssize,
    recvmsg: unsafe extern "C" fn(c_int, *mut libc::msghdr, c_int) -> Ssize,
    sendmsg: unsafe extern "C" fn(c_int, *const libc::msghdr, c_int) -> Ssize,
    recvmmsg: unsafe extern "C" fn(c_int, *mut libc::mmsghdr, u32, c_int, *mut libc::timespec) -> c_int,
    sendmmsg: unsafe extern "C" fn(c_int, *mut libc::mmsghdr, u32, c_int) -> c_int,
    __read_chk: unsafe extern "C" fn(c_int, *mut c_void, usize, usize) -> Ssize,
    __recv_chk: unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int) -> Ssize,
    __recvfrom_chk: unsafe extern "C" fn(c_int, *mut c_void, usize, usize, c_int, *mut sockaddr, *mut socklen_t) -> Ssize,
    sendfile: unsafe extern "C" fn(c_int, c_int, *mut libc::off_t, usize) -> Ssize,
    sendfile64: unsafe extern "C" fn(c_int, c_int, *mut libc::off64_t, usize) -> Ssize,
    splice: unsafe extern "C" fn(c_int, *mut libc::loff_t, c_int, *mut libc::loff_t, usize, u32) -> Ssize,
    epoll_create: unsafe extern "C" fn(c_int) -> c_int,
    epoll_create1: unsafe extern "C" fn(c_int) -> c_int,
    epoll_ctl: unsafe extern "C" fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int,
    epoll_wait: unsafe extern "C" fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int,
    epoll_pwait: unsafe extern "C" fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int,
    epoll_pwait2: unsafe extern "C" fn(c_int, *mut libc::epoll_event, c_int, *const libc::timespec, *const libc::sigset_t) -> c_int,
    poll: unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int,
    ppoll: unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int,
    __poll_chk: unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, c_int, usize) -> c_int,
    __ppoll_chk: unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t, usize) -> c_int,
    select: unsafe extern "C" fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int,
    pselect: unsafe extern "C" fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int,
    fcntl: unsafe extern "C" fn(c_int, c_int, usize) -> c_int,
    fcntl64: unsafe extern "C" fn(c_int, c_int, usize) -> c_int,
    ioctl: unsafe extern "C" fn(c_int, libc::c_ulong, *mut c_void) -> c_int,
    getsockopt: unsafe extern "C" fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int,
    setsockopt: unsafe extern "C" fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int,
    shutdown: unsafe extern "C" fn(c_int, c_int) -> c_int,
    close: unsafe extern "C" fn(c_int) -> c_int,
    close_range: unsafe extern "C" fn(u32, u32, c_int) -> c_int,
    closefrom: unsafe extern "C" fn(c_int),
    dup: unsafe extern "C" fn(c_int) -> c_int,
    dup2: unsafe extern "C" fn(c_int, c_int) -> c_int,
    dup3: unsafe extern "C" fn(c_int, c_int, c_int) -> c_int,
    getsockname: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    getpeername: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    connect: unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int,
    listen: unsafe extern "C" fn(c_int, c_int) -> c_int,
    accept: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
    accept4: unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int,
    sigaction: unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int,
    siginterrupt: unsafe extern "C" fn(c_int, c_int) -> c_int,
    syscall: unsafe extern "C" fn(c_long, ...) -> c_long,
    _exit: unsafe extern "C" fn(c_int) -> !,
    _Exit: unsafe extern "C" fn(c_int) -> !,
}

fn resolve(slot: &AtomicUsize, name: &'static [u8]) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated literal; RTLD_NEXT finds libc's definition behind us.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    slot.store(p, Ordering::Relaxed);
    p
}

extern "C" fn init() {
    if let Some(Some(why)) = caught(process::liburing_refusal) {
        let _ = std::io::Write::write_all(&mut std::io::stderr(), why.as_bytes());
        // SAFETY: ends the process before its own code ran (the launcher's refusal, status 2).
        unsafe { libc::_exit(2) };
    }
    // Asked of the program the launcher started, once: not of what it execs later under the
    // same pid, nor of its descendants.
    // SAFETY: a NUL-terminated literal; at load time, before the program's main, no thread of
    // the program reads the environment.
    unsafe { libc::unsetenv(c"NETCHANNEL_REFUSE_LIBURING".as_ptr()) };
    process::set_pid();
    resolve_all();
    // SAFETY: registering plain extern "C" functions with no arguments.
    unsafe {
        libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child));
        libc::atexit(at_exit);
    }
    if !process::settings().disabled {
        let _ = caught(inherit::scan_inherited);
    }
}

extern "C" fn at_exit() {
    let _ = caught(process::at_exit);
}

/// # Safety
/// C ABI: as _exit(2). A process that ends this way (no `atexit` handlers) leaves what its
/// sockets queued to its kernel too: the engine delivers it first (`process::drain_engines`),
/// except from a signal handler, where `_exit` must stay async-signal-safe.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    let _ = caught(process::drain_engines);
    // SAFETY: forwarding the caller's argument.
    unsafe { real!(_exit)(status) }
}

/// # Safety
/// C ABI: as _Exit(2) (the same as `_exit`).
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    let _ = caught(process::drain_engines);
    // SAFETY: forwarding the caller's argument.
    unsafe { real!(_Exit)(status) }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

// fork: the tables' locks are taken before and released after on both sides, so that a child
// never inherits one held by a thread it does not have (`forklock`).

extern "C" fn fork_prepare() {
    // Before the locks: ending elision writes tokens (and takes the registry's lock).
    let _ = caught(crate::elide::before_fork);
    // The relay's locks first (the taker-end lock, whose holder takes the address books, the
    // listener table and the registry, then the address books), then the connect path's
    // memories: nothing takes these while holding a table's lock or the registry's.
    crate::relay::hold_across_fork();
    crate::connect::NO_ENGINE.hold_across_fork();
    crate::connect::CARRIED_BEFORE.hold_across_fork();
    table::hold_across_fork();
    crate::carried::hold_registry_across_fork();
}

extern "C" fn fork_parent() {
    crate::forklock::release_held();
}

extern "C" fn fork_child() {
    process::set_pid();
    crate::forklock::release_held();
    table::forget_epolls_after_fork();
    crate::carried::close_forked_copies();
    crate::listen::close_queue_copies_in_child();
}

// ---------------------------------------------------------------------------------------------
// Helpers for the safe modules.

/// Runs `f` with the program's fd `fd` borrowed.
pub(crate) fn with_fd<T>(fd: RawFd, f: impl FnOnce(BorrowedFd<'_>) -> T) -> T {
    // SAFETY: the number was given to an interposed call by the program, which keeps it open
    // for the duration of that call (a concurrent close by another of its threads is the
    // program's race, as on kernel TCP); the borrow does not outlive `f`, and the kernel
    // checks the number on every use.
    f(unsafe { BorrowedFd::borrow_raw(fd) })
}

/// Borrows an fd that `owner` keeps open.
pub(crate) fn borrow_raw<'a, O>(fd: RawFd, _owner: &'a O) -> BorrowedFd<'a> {
    // SAFETY: the caller passes the object that owns `fd`; the borrow lives no longer than it.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Drops the contents of `slot` (a field whose drop depends on the process, see
/// `Carried::drop`).
pub(crate) fn drop_once<T>(slot: &mut ManuallyDrop<T>) {
    // SAFETY: called only from the owner's `Drop` impl, once, and the slot is never read after.
    unsafe { ManuallyDrop::drop(slot) }
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

fn last(rc: i64) -> Result<usize, i32> {
    if rc < 0 {
        Err(errno())
    } else {
        Ok(rc as usize)
    }
}

fn ret(r: Result<usize, i32>) -> Ssize {
    match r {
        Ok(n) => n as Ssize,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

fn ret_int(r: Result<usize, i32>) -> c_int {
    ret(r) as c_int
}

/// Runs `f`; `None` if it panicked (a bug of ours must not unwind into the program's C).
fn caught<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok()
}

/// Runs a slow path, turning a panic (a bug of ours) into `EIO` rather than unwinding into C.
fn guard(f: impl FnOnce() -> Result<usize, i32>) -> Result<usize, i32> {
    caught(f).unwrap_or(Err(libc::EIO))
}

/// The carried connection this process serves under `fd`; a placeholder it holds but does not
/// own is taken over first (then `None`: the fd is kernel TCP for the real call).
#[inline]
fn served(fd: c_int) -> Option<Arc<Carried>> {
    if table::kind(fd) & (CARRIED | REMOTE) == 0 {
        return None;
    }
    caught(|| waits::served(fd)).flatten()
}

/// `dup3(src, target)` by raw system call, with `target`'s close-on-exec flag.
pub(crate) fn dup_onto(src: BorrowedFd<'_>, target: RawFd, cloexec: bool) -> Result<(), i32> {
    use std::os::fd::AsRawFd;
    let flags = if cloexec { libc::O_CLOEXEC } else { 0 };
    // SAFETY: a raw dup3 between valid numbers; `target`'s previous file is released by the
    // kernel as the program's own dup3 would.
    let rc = unsafe { libc::syscall(libc::SYS_dup3, src.as_raw_fd(), target, flags) };
    last(rc).map(|_| ())
}

/// The program's own `connect` on `fd` (to a relay listener).
pub(crate) fn real_connect(fd: RawFd, to: SocketAddr) -> Result<(), i32> {
    let (ss, len) = from_socketaddr(to);
    // SAFETY: a well-formed sockaddr of `len` bytes for libc's connect.
    let rc = unsafe { real!(connect)(fd, &ss as *const _ as *const sockaddr, len) };
    last(rc as i64).map(|_| ())
}

/// `setsockopt` by raw system call (the template sockets, a taken-over socket).
pub(crate) fn raw_setsockopt(
    fd: BorrowedFd<'_>,
    level: i32,
    name: i32,
    v: &[u8],
) -> Result<(), i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: the kernel reads `v.len()` bytes from `v`.
    let rc = unsafe {
        libc::syscall(libc::SYS_setsockopt, fd.as_raw_fd(), level, name, v.as_ptr(), v.len())
    };
    last(rc).map(|_| ())
}

/// `getsockopt` by raw system call; returns the length the kernel reports.
pub(crate) fn raw_getsockopt(
    fd: BorrowedFd<'_>,
    level: i32,
    name: i32,
    out: &mut [u8],
) -> Result<usize, i32> {
    use std::os::fd::AsRawFd;
    let mut len = out.len() as socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `out` and updates `len`.
    let rc = unsafe {
        libc::syscall(libc::SYS_getsockopt, fd.as_raw_fd(), level, name, out.as_mut_ptr(), &mut len)
    };
    last(rc).map(|_| len as usize)
}

/// Raises `SIGPIPE` in the calling thread, as the kernel does for a write on a closed
/// connection without `MSG_NOSIGNAL`.
pub(crate) fn raise_sigpipe() {
    // SAFETY: signalling the calling thread.
    unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
}

fn mut_slice<'a>(buf: *mut c_void, len: usize) -> &'a mut [u8] {
    if len == 0 || buf.is_null() {
        return &mut [];
    }
    // SAFETY: the program passed `len` writable bytes at `buf`, as for the real call.
    unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, len) }
}

fn slice<'a>(buf: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 || buf.is_null() {
        return &[];
    }
    // SAFETY: the program passed `len` readable bytes at `buf`, as for the real call.
    unsafe { std::slice::from_raw_parts(buf as *const u8, len) }
}

/// The program's `n` iovecs at `iov`, checked as the kernel's import_iovec: `EINVAL` for a
/// count beyond `UIO_MAXIOV`, `EFAULT` for a NULL array or a NULL base with a length.
fn iovec_array<'a>(iov: *const libc::iovec, n: c_int) -> Result<&'a [libc::iovec], i32> {
    if n < 0 || n as usize > libc::UIO_MAXIOV as usize {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(&[]);
    }
    if iov.is_null() {
        return Err(libc::EFAULT);
    }
    // SAFETY: the program passed `n` iovecs at `iov` (not NULL, checked).
    let v = unsafe { std::slice::from_raw_parts(iov, n as usize) };
    if v.iter().any(|i| i.iov_base.is_null() && i.iov_len > 0) {
        return Err(libc::EFAULT);
    }
    Ok(v)
}

fn iovecs_mut<'a>(iov: *const libc::iovec, n: c_int) -> Result<Vec<IoSliceMut<'a>>, i32> {
    // Each names writable memory, as the program promised.
    let v = iovec_array(iov, n)?;
    Ok(v.iter().map(|i| IoSliceMut::new(mut_slice(i.iov_base, i.iov_len))).collect())
}

/// A message's vector count: `EMSGSIZE` beyond `UIO_MAXIOV`, as the kernel's `__copy_msghdr`
/// (`readv`/`writev` say `EINVAL` for the same).
fn msg_iovlen(m: &libc::msghdr) -> Result<c_int, i32> {
    if m.msg_iovlen > libc::UIO_MAXIOV as usize {
        return Err(libc::EMSGSIZE);
    }
    Ok(m.msg_iovlen as c_int)
}

fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> Result<Vec<IoSlice<'a>>, i32> {
    // Each names readable memory, as the program promised.
    let v = iovec_array(iov, n)?;
    Ok(v.iter().map(|i| IoSlice::new(slice(i.iov_base, i.iov_len))).collect())
}

// ---------------------------------------------------------------------------------------------
// sockaddr conversions.

/// # Safety
/// `addr` must point to `len` readable bytes (or be null).
unsafe fn to_socketaddr(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: caller guarantees `len` bytes; each cast is checked against the length first.
    unsafe {
        match (*addr).sa_family as c_int {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let a = &*(addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let a = &*(addr as *const libc::sockaddr_in6);
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
            }
            _ => None,
        }
    }
}

fn from_socketaddr(a: SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as _;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as _;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

/// Whether getsockname/getpeername may write an address there: the kernel's
/// move_addr_to_user faults on a NULL length, or a NULL address with room in it.
///
/// # Safety
/// `len` NULL or readable, as passed by the program.
unsafe fn addr_out_ok(addr: *mut sockaddr, len: *mut socklen_t) -> bool {
    // SAFETY: `len` is not NULL here, and the program's.
    !(len.is_null() || (addr.is_null() && unsafe { *len } > 0))
}

/// Copies `a` into a caller's (addr, len) result pair, truncating as the kernel does.
///
/// # Safety
/// `addr`/`len` as passed to accept/getpeername by the program.
unsafe fn write_addr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let (ss, l) = from_socketaddr(a);
    // SAFETY: the caller provides `*len` writable bytes at `addr`; we copy at most that many.
    unsafe {
        let n = (*len).min(l) as usize;
        std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, addr as *mut u8, n);
        *len = l;
    }
}

// ---------------------------------------------------------------------------------------------
// Signals: which handlers restart system calls. The program's handlers are installed behind a
// trampoline that counts, per thread, the signals handled without `SA_RESTART`; a blocking
// call on a carried socket interrupted by a signal restarts or fails with EINTR as the kernel
// would decide for that handler.

const NSIG: usize = 65;
static APP_HANDLER: [AtomicUsize; NSIG] = [const { AtomicUsize::new(0) }; NSIG];
static APP_FLAGS: [AtomicI32; NSIG] = [const { AtomicI32::new(0) }; NSIG];
/// Signals `siginterrupt` made interrupting (no `SA_RESTART` for `signal`).
static INTERRUPTING: [AtomicI32; NSIG] = [const { AtomicI32::new(0) }; NSIG];

thread_local! {
    // Plain thread-locals with constant initialisers: no lazy init, safe in a handler.
    static HANDLED_NO_RESTART: Cell<u32> = const { Cell::new(0) };
    static HANDLED: Cell<u32> = const { Cell::new(0) };
    /// Program handlers running in this thread now (one that jumps out leaves it counted).
    static IN_HANDLER: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a program's signal handler: an `_exit` there must stay
/// async-signal-safe (no lock, no allocation), so it does not wait for the engine.
pub(crate) fn in_signal_handler() -> bool {
    IN_HANDLER.with(|c| c.get()) > 0
}

/// Per-thread counts of handled signals: without `SA_RESTART` (for `carried`'s blocking calls)
/// and all of them (for the waits the kernel never restarts: poll, select, epoll_wait).
pub(crate) mod signals {
    /// A point in a thread's signal history.
    #[derive(Clone, Copy)]
    pub(crate) struct Snapshot {
        no_restart: u32,
        handled: u32,
    }

    pub(crate) fn snapshot() -> Snapshot {
        Snapshot {
            no_restart: super::HANDLED_NO_RESTART.with(|c| c.get()),
            handled: super::HANDLED.with(|c| c.get()),
        }
    }

    /// How many handlers ran in this thread (`SignalPolicy::handled`: a wait that polls before
    /// it sleeps ends when this moves).
    pub(crate) fn handled_count() -> u32 {
        super::HANDLED.with(|c| c.get())
    }

    /// Whether a handler without `SA_RESTART` ran in this thread since `s`.
    pub(crate) fn no_restart_since(s: Snapshot) -> bool {
        super::HANDLED_NO_RESTART.with(|c| c.get()) != s.no_restart
    }

    /// Whether any handler ran in this thread since `s`: a wait the library made of several
    /// system calls fails with EINTR then, as the kernel's single call would have, even when
    /// the handler ran between two of them rather than during a sleep.
    pub(crate) fn handled_since(s: Snapshot) -> bool {
        super::HANDLED.with(|c| c.get()) != s.handled
    }
}

extern "C" fn trampoline(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let i = sig as usize;
    if i >= NSIG {
        return;
    }
    let flags = APP_FLAGS[i].load(Ordering::Relaxed);
    if flags & libc::SA_RESTART == 0 {
        HANDLED_NO_RESTART.with(|c| c.set(c.get().wrapping_add(1)));
    }
    let h = APP_HANDLER[i].load(Ordering::Relaxed);
    if h == 0 || h == libc::SIG_DFL || h == libc::SIG_IGN {
        return;
    }
    HANDLED.with(|c| c.set(c.get().wrapping_add(1)));
    IN_HANDLER.with(|c| c.set(c.get() + 1));
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the program installed `h` as an SA_SIGINFO handler.
        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx)
    } else {
        // SAFETY: the program installed `h` as a plain handler.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(h) };
        f(sig)
    }
    IN_HANDLER.with(|c| c.set(c.get().saturating_sub(1)));
}

/// # Safety
/// C ABI: as sigaction(2).
#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let real = real!(sigaction);
    let i = sig as usize;
    if sig <= 0 || i >= NSIG || sig == libc::SIGKILL || sig == libc::SIGSTOP {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(sig, act, old) };
    }
    let (prev_h, prev_f) =
        (APP_HANDLER[i].load(Ordering::Relaxed), APP_FLAGS[i].load(Ordering::Relaxed));
    // SAFETY: zeroed sigaction is valid plain data.
    let mut kernel_old: libc::sigaction = unsafe { std::mem::zeroed() };
    let rc = if act.is_null() {
        // SAFETY: a query only.
        unsafe { real(sig, std::ptr::null(), &mut kernel_old) }
    } else {
        // SAFETY: the program passed a valid sigaction.
        let mut a = unsafe { *act };
        let h = a.sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            APP_HANDLER[i].store(0, Ordering::Relaxed);
        } else {
            APP_HANDLER[i].store(h, Ordering::Relaxed);
            APP_FLAGS[i].store(a.sa_flags, Ordering::Relaxed);
            a.sa_sigaction = trampoline as *const () as usize;
            a.sa_flags |= libc::SA_SIGINFO;
        }
        // SAFETY: a valid sigaction for libc.
        let rc = unsafe { real(sig, &a, &mut kernel_old) };
        if rc != 0 {
            APP_HANDLER[i].store(prev_h, Ordering::Relaxed);
            APP_FLAGS[i].store(prev_f, Ordering::Relaxed);
        }
        rc
    };
    if rc == 0 && !old.is_null() {
        if kernel_old.sa_sigaction == trampoline as *const () as usize {
            kernel_old.sa_sigaction = prev_h;
            kernel_old.sa_flags = prev_f;
        }
        // SAFETY: the program passed a writable sigaction.
        unsafe { *old = kernel_old };
    }
    rc
}

/// `signal` with BSD semantics (glibc's): restarting unless `siginterrupt` said otherwise.
fn install(sig: c_int, handler: libc::sighandler_t, flags: c_int) -> libc::sighandler_t {
    // SAFETY: zeroed sigaction is valid plain data; sigemptyset/sigaddset initialise the mask.
    unsafe {
        let mut a: libc::sigaction = std::mem::zeroed();
        let mut old: libc::sigaction = std::mem::zeroed();
        a.sa_sigaction = handler;
        a.sa_flags = flags;
        libc::sigemptyset(&mut a.sa_mask);
        if flags & libc::SA_NODEFER == 0 {
            libc::sigaddset(&mut a.sa_mask, sig);
        }
        if sigaction(sig, &a, &mut old) != 0 {
            return libc::SIG_ERR;
        }
        old.sa_sigaction
    }
}

/// # Safety
/// C ABI: as signal(2).
#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    let i = sig as usize;
    let interrupting = i < NSIG && INTERRUPTING[i].load(Ordering::Relaxed) != 0;
    install(sig, handler, if interrupting { 0 } else { libc::SA_RESTART })
}

/// # Safety
/// C ABI: as bsd_signal(3).
#[no_mangle]
pub unsafe extern "C" fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: same contract.
    unsafe { signal(sig, handler) }
}

/// # Safety
/// C ABI: as sysv_signal(3).
#[no_mangle]
pub unsafe extern "C" fn sysv_signal(
    sig: c_int,
    handler: libc::sighandler_t,
) -> libc::sighandler_t {
    install(sig, handler, libc::SA_RESETHAND | libc::SA_NODEFER)
}

/// # Safety
/// C ABI: as siginterrupt(3).
#[no_mangle]
pub unsafe extern "C" fn siginterrupt(sig: c_int, flag: c_int) -> c_int {
    let i = sig as usize;
    if i > 0 && i < NSIG {
        INTERRUPTING[i].store(flag, Ordering::Relaxed);
        let f = APP_FLAGS[i].load(Ordering::Relaxed);
        let f = if flag != 0 { f & !libc::SA_RESTART } else { f | libc::SA_RESTART };
        APP_FLAGS[i].store(f, Ordering::Relaxed);
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(siginterrupt)(sig, flag) }
}

// ---------------------------------------------------------------------------------------------
// Reading.

fn recv_one(
    c: &Carried,
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> Result<usize, i32> {
    if buf.is_null() && len > 0 {
        if flags & libc::MSG_TRUNC == 0 {
            // The kernel's copy into it fails, once there is something to copy.
            return guard(|| with_fd(fd, |app| c.recv_into_null(app, flags)));
        }
        // MSG_TRUNC discards without a buffer: into a scratch one (a read may return less).
        let mut scratch = vec![0u8; len.min(64 * 1024)];
        return guard(|| {
            with_fd(fd, |app| c.recv(app, &mut [IoSliceMut::new(&mut scratch)], flags))
        });
    }
    guard(|| with_fd(fd, |app| c.recv(app, &mut [IoSliceMut::new(mut_slice(buf, len))], flags)))
}

/// # Safety
/// C ABI: as read(2).
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, len: usize) -> Ssize {
    if let Some(c) = served(fd) {
        // As the kernel's sock_read_iter: reading nothing returns 0 at once.
        if len == 0 {
            return 0;
        }
        return ret(recv_one(&c, fd, buf, len, 0));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(read)(fd, buf, len) }
}

/// # Safety
/// C ABI: as glibc's __read_chk.
#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, len: usize, size: usize) -> Ssize {
    if len <= size {
        if let Some(c) = served(fd) {
            if len == 0 {
                return 0;
            }
            return ret(recv_one(&c, fd, buf, len, 0));
        }
    }
    // SAFETY: forwarding (glibc aborts on an overflowing length).
    unsafe { real!(__read_chk)(fd, buf, len, size) }
}

/// # Safety
/// C ABI: as recv(2).
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, len: usize, flags: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(recv_one(&c, fd, buf, len, flags));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(recv)(fd, buf, len, flags) }
}

/// # Safety
/// C ABI: as glibc's __recv_chk.
#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    size: usize,
    flags: c_int,
) -> Ssize {
    if len <= size {
        if let Some(c) = served(fd) {
            return ret(recv_one(&c, fd, buf, len, flags));
        }
    }
    // SAFETY: forwarding (glibc aborts on an overflowing length).
    unsafe { real!(__recv_chk)(fd, buf, len, size, flags) }
}

/// A stream socket's recvfrom reports no address (its length comes back 0).
///
/// # Safety
/// `alen` as passed by the program.
unsafe fn no_address(alen: *mut socklen_t) {
    if !alen.is_null() {
        // SAFETY: the program passed a writable length.
        unsafe { *alen = 0 };
    }
}

/// # Safety
/// C ABI: as recvfrom(2).
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> Ssize {
    if let Some(c) = served(fd) {
        let r = recv_one(&c, fd, buf, len, flags);
        if r.is_ok() && !addr.is_null() {
            // SAFETY: as passed by the program.
            unsafe { no_address(alen) };
        }
        return ret(r);
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(recvfrom)(fd, buf, len, flags, addr, alen) }
}

/// # Safety
/// C ABI: as glibc's __recvfrom_chk.
#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    len: usize,
    size: usize,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> Ssize {
    if len <= size {
        // SAFETY: same contract as recvfrom.
        return unsafe { recvfrom(fd, buf, len, flags, addr, alen) };
    }
    // SAFETY: forwarding (glibc aborts on an overflowing length).
    unsafe { real!(__recvfrom_chk)(fd, buf, len, size, flags, addr, alen) }
}

/// # Safety
/// C ABI: as readv(2).
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(guard(|| {
            let mut v = iovecs_mut(iov, n)?;
            if v.iter().all(|b| b.is_empty()) {
                return Ok(0);
            }
            with_fd(fd, |app| c.recv(app, &mut v, 0))
        }));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(readv)(fd, iov, n) }
}

/// # Safety
/// C ABI: as recvmsg(2).
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(guard(|| {
            // SAFETY: the program passed a valid msghdr.
            let m = unsafe { &mut *msg };
            let mut v = iovecs_mut(m.msg_iov, msg_iovlen(m)?)?;
            let n = with_fd(fd, |app| c.recv(app, &mut v, flags))?;
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            // As `tcp_recv_urg`: the urgent byte comes flagged.
            m.msg_flags = flags & libc::MSG_OOB;
            Ok(n)
        }));
    }
    // SAFETY: forwarding the caller's arguments.
    let n = unsafe { real!(recvmsg)(fd, msg, flags) };
    if n >= 0 && !msg.is_null() {
        // SAFETY: the kernel filled the program's msghdr.
        unsafe { received_fds(&*msg) };
    }
    n
}

/// Placeholders received by `SCM_RIGHTS` are adopted (their connection is reached through its
/// owner on first use).
///
/// # Safety
/// `m` is a msghdr the kernel just filled.
unsafe fn received_fds(m: &libc::msghdr) {
    if m.msg_controllen == 0 || m.msg_control.is_null() || process::settings().disabled {
        return;
    }
    // SAFETY: walking the control buffer the kernel filled, with libc's CMSG macros.
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(m);
        while !cm.is_null() {
            if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cm) as *const c_int;
                let bytes = (*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for k in 0..bytes / std::mem::size_of::<c_int>() {
                    let fd = std::ptr::read_unaligned(data.add(k));
                    let _ = caught(|| with_fd(fd, |app| inherit::adopt(fd, app)));
                }
            }
            cm = libc::CMSG_NXTHDR(m, cm);
        }
    }
}

/// # Safety
/// C ABI: as recvmmsg(2).
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: u32,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if let Some(_c) = served(fd) {
        // As the kernel's do_recvmmsg: each message is one recvmsg; only MSG_WAITFORONE makes
        // those after the first non-blocking; the timeout is looked at between messages (it
        // does not bound a wait), and what is left of it is written back.
        // SAFETY: the program passed a timespec or NULL.
        let deadline = unsafe { timeout.as_ref() }.and_then(|t| {
            let t = Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32);
            // Beyond what an Instant holds: no deadline (a program's "forever").
            Instant::now().checked_add(t)
        });
        if msgs.is_null() && n > 0 {
            set_errno(libc::EFAULT);
            return -1;
        }
        let mut f = flags & !libc::MSG_WAITFORONE;
        let mut done = 0;
        // The kernel takes at most UIO_MAXIOV messages a call.
        for i in 0..(n as usize).min(libc::UIO_MAXIOV as usize) {
            // SAFETY: the program passed `n` mmsghdrs.
            let m = unsafe { &mut *msgs.add(i) };
            // SAFETY: same contract as recvmsg.
            let r = unsafe { recvmsg(fd, &mut m.msg_hdr, f) };
            if r < 0 {
                if done == 0 {
                    return -1;
                }
                break;
            }
            m.msg_len = r as u32;
            done += 1;
            if flags & libc::MSG_WAITFORONE != 0 {
                f |= libc::MSG_DONTWAIT;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
        }
        if let (Some(d), false) = (deadline, timeout.is_null()) {
            let left = d.saturating_duration_since(Instant::now());
            // SAFETY: checked non-null; the program's timespec.
            unsafe {
                (*timeout).tv_sec = left.as_secs() as libc::time_t;
                (*timeout).tv_nsec = left.subsec_nanos() as libc::c_long;
            }
        }
        return done;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(recvmmsg)(fd, msgs, n, flags, timeout) }
}

// ---------------------------------------------------------------------------------------------
// Writing.

fn send_one(
    c: &Carried,
    fd: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> Result<usize, i32> {
    if buf.is_null() && len > 0 {
        return Err(libc::EFAULT); // what the kernel's copy from it says
    }
    guard(|| with_fd(fd, |app| c.send(app, &[IoSlice::new(slice(buf, len))], flags)))
}

/// # Safety
/// C ABI: as write(2).
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, len: usize) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(send_one(&c, fd, buf, len, 0));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(write)(fd, buf, len) }
}

/// # Safety
/// C ABI: as send(2).
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, len: usize, flags: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(send_one(&c, fd, buf, len, flags));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(send)(fd, buf, len, flags) }
}

/// # Safety
/// C ABI: as sendto(2). A connected stream socket ignores the address.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(send_one(&c, fd, buf, len, flags));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(sendto)(fd, buf, len, flags, addr, alen) }
}

/// # Safety
/// C ABI: as writev(2).
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(guard(|| {
            let v = iovecs(iov, n)?;
            // As the kernel's vfs_writev: nothing to write never reaches the socket.
            if v.iter().all(|b| b.is_empty()) {
                return Ok(0);
            }
            with_fd(fd, |app| c.send(app, &v, 0))
        }));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(writev)(fd, iov, n) }
}

/// # Safety
/// C ABI: as sendmsg(2).
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> Ssize {
    if let Some(c) = served(fd) {
        return ret(guard(|| {
            // SAFETY: the program passed a valid msghdr.
            let m = unsafe { &*msg };
            let v = iovecs(m.msg_iov, msg_iovlen(m)?)?;
            with_fd(fd, |app| c.send(app, &v, flags))
        }));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(sendmsg)(fd, msg, flags) }
}

/// # Safety
/// C ABI: as sendmmsg(2).
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: u32,
    flags: c_int,
) -> c_int {
    if served(fd).is_some() {
        let mut done = 0;
        for i in 0..n as usize {
            // SAFETY: the program passed `n` mmsghdrs.
            let m = unsafe { &mut *msgs.add(i) };
            // SAFETY: same contract as sendmsg.
            let r = unsafe { sendmsg(fd, &m.msg_hdr, flags) };
            if r < 0 {
                if done == 0 {
                    return -1;
                }
                break;
            }
            m.msg_len = r as u32;
            done += 1;
        }
        return done;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(sendmmsg)(fd, msgs, n, flags) }
}

/// `sendfile` into a carried socket: the file's bytes are read here and sent.
fn sendfile_carried(
    c: &Carried,
    out: c_int,
    inp: c_int,
    offset: Option<&mut i64>,
    count: usize,
) -> Result<usize, i32> {
    let mut buf = vec![0u8; count.min(256 * 1024)];
    let mut at = offset.as_ref().map(|o| **o);
    let mut total = 0;
    while total < count {
        let want = (count - total).min(buf.len());
        let got = with_fd(inp, |f| match at {
            Some(pos) => rustix::io::pread(f, &mut buf[..want], pos as u64),
            None => rustix::io::read(f, &mut buf[..want]),
        })
        .map_err(|e| e.raw_os_error())?;
        if got == 0 {
            break;
        }
        let sent = match with_fd(out, |app| c.send(app, &[IoSlice::new(&buf[..got])], 0)) {
            Ok(n) => n,
            Err(e) if total == 0 && at.is_none() => {
                // Nothing went out: the file position goes back to where it was.
                let _ = with_fd(inp, |f| {
                    rustix::fs::seek(f, rustix::fs::SeekFrom::Current(-(got as i64)))
                });
                return Err(e);
            }
            Err(e) if total == 0 => return Err(e),
            Err(_) => 0,
        };
        if sent < got && at.is_none() {
            let back = (got - sent) as i64;
            let _ = with_fd(inp, |f| rustix::fs::seek(f, rustix::fs::SeekFrom::Current(-back)));
        }
        total += sent;
        if let Some(p) = at.as_mut() {
            *p += sent as i64;
        }
        if sent < got {
            break;
        }
    }
    if let (Some(o), Some(p)) = (offset, at) {
        *o = p;
    }
    Ok(total)
}

/// # Safety
/// C ABI: as sendfile(2).
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    offset: *mut libc::off_t,
    count: usize,
) -> Ssize {
    if let Some(c) = served(out) {
        // SAFETY: the program's offset pointer, if any.
        let off = unsafe { offset.as_mut() };
        return ret(guard(|| sendfile_carried(&c, out, inp, off, count)));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(sendfile)(out, inp, offset, count) }
}

/// # Safety
/// C ABI: as sendfile64(2).
#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    offset: *mut libc::off64_t,
    count: usize,
) -> Ssize {
    if let Some(c) = served(out) {
        // SAFETY: the program's offset pointer, if any.
        let off = unsafe { offset.as_mut() };
        return ret(guard(|| sendfile_carried(&c, out, inp, off, count)));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(sendfile64)(out, inp, offset, count) }
}

/// # Safety
/// C ABI: as splice(2). A carried socket on either side is served by a copy through this
/// library: socket -> pipe takes at most what the pipe has room for; pipe -> socket sends all
/// it took from the pipe (waiting for the window if need be).
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: usize,
    flags: u32,
) -> Ssize {
    let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
    if let Some(c) = served(fd_in) {
        if !off_in.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        return ret(guard(|| {
            let room = with_fd(fd_out, pipe_room)?;
            if room == 0 {
                return Err(libc::EAGAIN);
            }
            let mut buf = vec![0u8; len.min(room).min(256 * 1024)];
            let f = if nonblock { libc::MSG_DONTWAIT } else { 0 };
            let n = with_fd(fd_in, |app| c.recv(app, &mut [IoSliceMut::new(&mut buf)], f))?;
            let mut put = 0;
            while put < n {
                put += with_fd(fd_out, |p| rustix::io::write(p, &buf[put..n]))
                    .map_err(|e| e.raw_os_error())?;
            }
            Ok(n)
        }));
    }
    if let Some(c) = served(fd_out) {
        if !off_out.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        return ret(guard(|| {
            let mut buf = vec![0u8; len.min(256 * 1024)];
            let n =
                with_fd(fd_in, |p| rustix::io::read(p, &mut buf)).map_err(|e| e.raw_os_error())?;
            let mut sent = 0;
            while sent < n {
                sent += with_fd(fd_out, |app| c.send(app, &[IoSlice::new(&buf[sent..n])], 0))?;
            }
            Ok(n)
        }));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(splice)(fd_in, off_in, fd_out, off_out, len, flags) }
}

/// Free bytes in a pipe.
fn pipe_room(p: BorrowedFd<'_>) -> Result<usize, i32> {
    use std::os::fd::AsRawFd;
    let size = rustix::pipe::fcntl_getpipe_size(p).map_err(|e| e.raw_os_error())?;
    let mut used: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let rc = unsafe { libc::ioctl(p.as_raw_fd(), libc::FIONREAD, &mut used) };
    if rc < 0 {
        return Err(errno());
    }
    Ok(size.saturating_sub(used.max(0) as usize))
}

// ---------------------------------------------------------------------------------------------
// Waiting.

/// Marks a new epoll instance (adding it to another set nests it, see `elide`).
fn epoll_created(rc: c_int) -> c_int {
    if rc >= 0 {
        forget_stale(rc);
        table::set_bits(rc, table::EPOLL_INSTANCE);
    }
    rc
}

/// # Safety
/// C ABI: as epoll_create(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarding the caller's argument.
    epoll_created(unsafe { real!(epoll_create)(size) })
}

/// # Safety
/// C ABI: as epoll_create1(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwarding the caller's argument.
    epoll_created(unsafe { real!(epoll_create1)(flags) })
}

/// # Safety
/// C ABI: as epoll_ctl(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    let real = real!(epoll_ctl);
    if table::kind(fd) == 0 {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real(epfd, op, fd, ev) };
    }
    // SAFETY: the program's event, if any.
    let event = unsafe { ev.as_ref() }.map_or((0, 0), |e| (e.events, e.u64));
    let c = caught(|| waits::before_ctl(op, fd, event.0)).flatten();
    // A placeholder is a Unix socket, which reports `EPOLLWRBAND` with `EPOLLOUT`; TCP never
    // sets it, so the kernel is not asked for it.
    let wrband = libc::EPOLLWRBAND as u32;
    let mut tcp_events = libc::epoll_event { events: event.0 & !wrband, u64: event.1 };
    let ev = if c.is_some() && event.0 & wrband != 0 { &mut tcp_events as *mut _ } else { ev };
    // SAFETY: forwarding the caller's arguments (or the same event less EPOLLWRBAND).
    let rc = unsafe { real(epfd, op, fd, ev) };
    if rc == 0 {
        let e = errno();
        let _ = caught(|| waits::after_ctl(epfd, op, fd, c, event));
        set_errno(e);
    }
    rc
}

fn ms(timeout: c_int) -> Option<Duration> {
    (timeout >= 0).then(|| Duration::from_millis(timeout as u64))
}

/// The program's timeout (`Some(None)`: none), or `None` when the kernel refuses it (seconds
/// below 0, nanoseconds outside a second): the call then goes to the kernel, which answers
/// `EINVAL` before it looks at anything else.
fn ts(t: *const libc::timespec) -> Option<Option<Duration>> {
    // SAFETY: the program's timespec, if any.
    match unsafe { t.as_ref() } {
        None => Some(None),
        Some(t) if t.tv_sec >= 0 && (0..1_000_000_000).contains(&t.tv_nsec) => {
            Some(Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32)))
        }
        Some(_) => None,
    }
}

/// `select`'s timeout as the kernel reads it: microseconds beyond a second carry into the
/// seconds; `None` for a negative time, which the kernel refuses (`EINVAL`).
fn timeval(t: *const libc::timeval) -> Option<Option<Duration>> {
    // SAFETY: the program's timeval, if any.
    let Some(t) = (unsafe { t.as_ref() }) else { return Some(None) };
    let secs = t.tv_sec.checked_add(t.tv_usec / 1_000_000)?;
    let usecs = t.tv_usec % 1_000_000;
    (secs >= 0 && usecs >= 0).then(|| Some(Duration::new(secs as u64, usecs as u32 * 1000)))
}

/// Shared by the epoll waits: `None` when the set holds nothing carried.
fn epoll_common(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    if table::kind(epfd) & EPOLL == 0 {
        return None;
    }
    let real = real!(epoll_wait);
    // SAFETY: the program's sigmask, if any.
    let mask = unsafe { mask.as_ref() };
    let r = caught(|| {
        waits::epoll_wait(epfd, timeout, mask, |elision| {
            if max <= 0 || events.is_null() {
                // SAFETY: forwarding the caller's arguments (the kernel reports the error).
                return last(unsafe { real(epfd, events, max, 0) } as i64);
            }
            // SAFETY: the program's buffer of `max` events (`room` of them); a zero timeout.
            let kernel = |room: usize| last(unsafe { real(epfd, events, room as c_int, 0) } as i64);
            let room = elision.kernel_room(max as usize);
            let n = if room == 0 { 0 } else { kernel(room)? };
            let n = {
                // SAFETY: the program passed a buffer of `max` events (epoll_wait's contract);
                // the kernel just wrote the first `n` of them.
                let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
                elision.report(out, n)
            };
            if n == 0 && room == 0 {
                // Nothing elided to report after all, and the kernel was not asked: its events
                // in full. (Asked for fewer, it had none: `report` only adds events.)
                return kernel(max as usize);
            }
            Ok(n)
        })
    })
    .flatten()?;
    Some(ret_int(r))
}

/// # Safety
/// C ABI: as epoll_wait(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    if let Some(n) = epoll_common(epfd, events, max, ms(timeout), std::ptr::null()) {
        return n;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(epoll_wait)(epfd, events, max, timeout) }
}

/// # Safety
/// C ABI: as epoll_pwait(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(n) = epoll_common(epfd, events, max, ms(timeout), mask) {
        return n;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(epoll_pwait)(epfd, events, max, timeout, mask) }
}

/// # Safety
/// C ABI: as epoll_pwait2(2).
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(timeout) = ts(timeout) {
        if let Some(n) = epoll_common(epfd, events, max, timeout, mask) {
            return n;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(epoll_pwait2)(epfd, events, max, timeout, mask) }
}

fn pollfds<'a>(fds: *mut libc::pollfd, n: libc::nfds_t) -> &'a mut [libc::pollfd] {
    if fds.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the program passed `n` pollfds.
    unsafe { std::slice::from_raw_parts_mut(fds, n as usize) }
}

/// The kernel's ppoll over `fds` with the program's mask.
fn kernel_ppoll(
    fds: &mut [libc::pollfd],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Result<usize, i32> {
    let t = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as _,
    });
    let tp = t.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: a valid pollfd slice, timespec and mask (or null) for libc's ppoll.
    last(unsafe { real!(ppoll)(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tp, mask) } as i64)
}

/// Shared by the poll family: `None` when no fd of the set is the library's.
fn poll_common(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    let set = pollfds(fds, n);
    if !waits::any_ours(set.iter().map(|p| p.fd)) {
        return None;
    }
    // SAFETY: the program's sigmask, if any.
    let sigmask = unsafe { mask.as_ref() };
    let r = guard(|| waits::poll(set, timeout, sigmask, &mut |f, t| kernel_ppoll(f, t, mask)));
    Some(ret_int(r))
}

/// # Safety
/// C ABI: as poll(2).
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    if let Some(r) = poll_common(fds, n, ms(timeout), std::ptr::null()) {
        return r;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(poll)(fds, n, timeout) }
}

/// # Safety
/// C ABI: as glibc's __poll_chk.
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    size: usize,
) -> c_int {
    if (n as usize).saturating_mul(std::mem::size_of::<libc::pollfd>()) <= size {
        if let Some(r) = poll_common(fds, n, ms(timeout), std::ptr::null()) {
            return r;
        }
    }
    // SAFETY: forwarding (glibc aborts on an overflowing count).
    unsafe { real!(__poll_chk)(fds, n, timeout, size) }
}

/// # Safety
/// C ABI: as ppoll(2).
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(t) = ts(timeout) {
        if let Some(r) = poll_common(fds, n, t, mask) {
            return r;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(ppoll)(fds, n, timeout, mask) }
}

/// # Safety
/// C ABI: as glibc's __ppoll_chk.
#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
    size: usize,
) -> c_int {
    let fits = (n as usize).saturating_mul(std::mem::size_of::<libc::pollfd>()) <= size;
    if let (true, Some(t)) = (fits, ts(timeout)) {
        if let Some(r) = poll_common(fds, n, t, mask) {
            return r;
        }
    }
    // SAFETY: forwarding (glibc aborts on an overflowing count).
    unsafe { real!(__ppoll_chk)(fds, n, timeout, mask, size) }
}

/// An fd_set as its bit words.
fn fd_words<'a>(set: *mut libc::fd_set) -> Option<&'a mut [u64; 16]> {
    // SAFETY: fd_set is 1024 bits of plain data on Linux (16 x u64), as the program passed it.
    unsafe { (set as *mut [u64; 16]).as_mut() }
}

fn fds_in<'a>(words: &'a Option<&mut [u64; 16]>, nfds: usize) -> impl Iterator<Item = c_int> + 'a {
    (0..nfds.min(1024))
        .filter(move |&fd| words.as_ref().is_some_and(|w| w[fd / 64] & (1 << (fd % 64)) != 0))
        .map(|fd| fd as c_int)
}

/// select/pselect over sets holding carried fds, through `waits::poll` (the kernel's select is
/// its poll with these bit mappings). `None` when no fd is the library's.
fn select_common(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<(Result<usize, i32>, Option<Duration>)> {
    let nfds = nfds.clamp(0, 1024) as usize;
    let (mut rs, mut ws, mut es) = (fd_words(r), fd_words(w), fd_words(e));
    let ours = waits::any_ours(fds_in(&rs, nfds).chain(fds_in(&ws, nfds)).chain(fds_in(&es, nfds)));
    if !ours {
        return None;
    }
    let mut p: Vec<libc::pollfd> = Vec::new();
    for fd in 0..nfds as c_int {
        let bit = |s: &Option<&mut [u64; 16]>| {
            s.as_ref().is_some_and(|x| x[fd as usize / 64] & (1 << (fd % 64)) != 0)
        };
        let mut ev = 0;
        if bit(&rs) {
            ev |= libc::POLLIN;
        }
        if bit(&ws) {
            ev |= libc::POLLOUT;
        }
        if bit(&es) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            p.push(libc::pollfd { fd, events: ev, revents: 0 });
        }
    }
    let start = std::time::Instant::now();
    // SAFETY: the program's sigmask, if any.
    let sigmask = unsafe { mask.as_ref() };
    let res = guard(|| waits::poll(&mut p, timeout, sigmask, &mut |f, t| kernel_ppoll(f, t, mask)));
    let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
    let res = res.and_then(|_| {
        if p.iter().any(|x| x.revents & libc::POLLNVAL != 0) {
            return Err(libc::EBADF);
        }
        for s in [&mut rs, &mut ws, &mut es].into_iter().flatten() {
            s.iter_mut().for_each(|x| *x = 0);
        }
        let mut count = 0;
        for x in &p {
            let (fd, rv) = (x.fd as usize, x.revents);
            let mut set = |s: &mut Option<&mut [u64; 16]>, on: bool| {
                if on {
                    if let Some(s) = s.as_mut() {
                        s[fd / 64] |= 1 << (fd % 64);
                        count += 1;
                    }
                }
            };
            set(
                &mut rs,
                x.events & libc::POLLIN != 0
                    && rv & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0,
            );
            set(
                &mut ws,
                x.events & libc::POLLOUT != 0 && rv & (libc::POLLOUT | libc::POLLERR) != 0,
            );
            set(&mut es, x.events & libc::POLLPRI != 0 && rv & libc::POLLPRI != 0);
        }
        Ok(count)
    });
    Some((res, left))
}

/// # Safety
/// C ABI: as select(2).
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let ours = timeval(tv).and_then(|t| select_common(nfds, r, w, e, t, std::ptr::null()));
    if let Some((res, left)) = ours {
        // Linux writes back the time left.
        // SAFETY: the program's timeval, if any.
        if let (Some(t), Some(l)) = (unsafe { tv.as_mut() }, left) {
            t.tv_sec = l.as_secs() as _;
            t.tv_usec = l.subsec_micros() as _;
        }
        return ret_int(res);
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(select)(nfds, r, w, e, tv) }
}

/// # Safety
/// C ABI: as pselect(2).
#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some(t) = ts(timeout) {
        if let Some((res, _)) = select_common(nfds, r, w, e, t, mask) {
            return ret_int(res);
        }
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(pselect)(nfds, r, w, e, timeout, mask) }
}

// ---------------------------------------------------------------------------------------------
// Control: fcntl, ioctl, socket options, shutdown, names.

fn fcntl_common(fd: c_int, cmd: c_int, arg: usize, real: types::fcntl) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { real(fd, cmd, arg) };
    if rc >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && table::kind(fd) != 0 {
        let e = errno();
        let _ = caught(|| table::dup_into(fd, rc));
        set_errno(e);
    }
    rc
}

/// # Safety
/// C ABI: as fcntl(2) (its third argument is read as one machine word, as glibc does).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_common(fd, cmd, arg, real!(fcntl))
}

/// # Safety
/// C ABI: as fcntl64.
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    fcntl_common(fd, cmd, arg, real!(fcntl64))
}

/// # Safety
/// C ABI: as ioctl(2).
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: *mut c_void) -> c_int {
    if let Some(c) = served(fd) {
        let v = match req {
            libc::FIONREAD => Some(c.unread()),
            libc::TIOCOUTQ => Some(c.outq(false)),
            0x894B /* SIOCOUTQNSD */ => Some(c.outq(true)),
            0x8905 /* SIOCATMARK */ => Some(usize::from(c.at_urgent_mark())),
            _ => None,
        };
        if let Some(v) = v {
            if arg.is_null() {
                set_errno(libc::EFAULT);
                return -1;
            }
            // SAFETY: these requests write one int at `arg`.
            unsafe { *(arg as *mut c_int) = v.min(c_int::MAX as usize) as c_int };
            return 0;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(ioctl)(fd, req, arg) }
}

/// # Safety
/// C ABI: as getsockopt(2).
#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if let Some(c) = served(fd) {
        if val.is_null() || len.is_null() {
            set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: the program's length.
        let cap = unsafe { *len } as usize;
        let out = mut_slice(val, cap);
        let r = guard(|| match (level, name) {
            (libc::SOL_SOCKET, libc::SO_ERROR) => {
                let v = with_fd(fd, |app| c.so_error(app)).to_ne_bytes();
                let n = cap.min(4);
                out[..n].copy_from_slice(&v[..n]);
                Ok(n)
            }
            (libc::IPPROTO_TCP, libc::TCP_INFO) => {
                let n = sockopt::get(&c, level, name, out)?;
                if n > 0 {
                    out[0] = c.tcp_state();
                }
                Ok(n)
            }
            _ => sockopt::get(&c, level, name, out),
        });
        return match r {
            Ok(n) => {
                // SAFETY: the program's length.
                unsafe { *len = n as socklen_t };
                0
            }
            Err(e) => {
                set_errno(e);
                -1
            }
        };
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(getsockopt)(fd, level, name, val, len) }
}

/// # Safety
/// C ABI: as setsockopt(2).
#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(c) = served(fd) {
        let v = slice(val, len as usize);
        return ret_int(guard(|| sockopt::set(&c, level, name, v).map(|_| 0)));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(setsockopt)(fd, level, name, val, len) }
}

/// # Safety
/// C ABI: as shutdown(2).
#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(c) = served(fd) {
        return ret_int(guard(|| with_fd(fd, |app| c.shutdown(app, how)).map(|_| 0)));
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(shutdown)(fd, how) }
}

/// # Safety
/// C ABI: as getsockname(2).
#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if let Some(c) = served(fd) {
        // SAFETY: as passed by the program.
        if unsafe { !addr_out_ok(addr, len) } {
            set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: forwarded from the caller.
        unsafe { write_addr(c.local, addr, len) };
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real!(getsockname)(fd, addr, len) }
}

/// # Safety
/// C ABI: as getpeername(2).
#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if let Some(c) = served(fd) {
        // As the kernel's: no peer while connecting, nor once the connection is closed
        // (reset, or both FINs in).
        let state = caught(|| c.tcp_state());
        if state
            .is_some_and(|s| s == crate::carried::TCP_CLOSE || s == crate::carried::TCP_SYN_SENT)
        {
            set_errno(libc::ENOTCONN);
            return -1;
        }
        // SAFETY: as passed by the program.
        if unsafe { !addr_out_ok(addr, len) } {
            set_errno(libc::EFAULT);
            return -1;
        }
        // SAFETY: forwarded from the caller.
        unsafe { write_addr(c.peer, addr, len) };
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { real!(getpeername)(fd, addr, len) };
    if rc == 0 && table::kind(fd) & RELAYED != 0 {
        if let Some(p) = crate::relay::relayed_peer(fd) {
            // SAFETY: forwarded from the caller.
            unsafe { write_addr(p, addr, len) };
        }
    }
    rc
}

// ---------------------------------------------------------------------------------------------
// close, dup2, dup3, close_range.

/// What closing the number `fd` means for the library (after the real close).
/// What `close` took out of the tables for `fd`, finished after the real close.
struct Forgotten {
    carried: Option<Arc<Carried>>,
    listener: Option<Arc<crate::listen::ListenEntry>>,
}

/// Takes `fd` out of the tables before the real close: once the number is free, another
/// thread may get it for a new socket at once (and must not find it ours: its `connect`
/// would fail with EISCONN).
fn forget(fd: c_int, k: u8) -> Forgotten {
    let carried = if k & CARRIED != 0 { table::unmap_carried(fd) } else { None };
    if k & REMOTE != 0 {
        table::unmap_remote(fd);
    }
    let listener = if k & LISTENING != 0 { table::unmap_listener(fd) } else { None };
    if k & EPOLL != 0 {
        if let Some(info) = table::unmap_epoll(fd) {
            waits::set_closed(&info);
        }
    }
    if k & (table::EPOLL_INSTANCE | table::EPOLL_OBSERVED) != 0 {
        table::clear_bits(fd, table::EPOLL_INSTANCE | table::EPOLL_OBSERVED);
    }
    if k & RELAYED != 0 {
        crate::relay::forget_relayed(fd);
    }
    Forgotten { carried, listener }
}

/// After the real close: a connection whose last copy in this process is gone ends (or waits
/// for copies elsewhere), a listener stops.
fn closed(f: Forgotten) {
    if let Some(c) = f.carried {
        if c.owner == process::pid() && table::fds_of(&c).is_empty() {
            c.last_fd_closed();
        }
    }
    if let Some(l) = f.listener {
        l.close();
    }
}

/// # Safety
/// C ABI: as close(2).
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    // SAFETY: forwarding the caller's argument.
    close_with(fd, || unsafe { real!(close)(fd) })
}

/// `close(fd)` by `real_close` (libc's close, or the plain system call for a close made
/// through `syscall()`, which is no cancellation point), with the tables kept in step.
fn close_with(fd: c_int, real_close: impl FnOnce() -> c_int) -> c_int {
    netchannel::sys::forget_own_fd(fd);
    let k = table::kind(fd);
    let forgotten = if k != 0 { caught(|| forget(fd, k)) } else { None };
    let rc = real_close();
    if let Some(f) = forgotten {
        let e = errno();
        let _ = caught(|| closed(f));
        set_errno(e);
    }
    rc
}

/// The kernel just gave out the number `fd` (a new socket, connection or epoll set), so
/// whatever the tables still say of it is stale: the program closed it where the library could
/// not see (a system call made without libc's wrappers) and the connection it held ends now.
/// Without this, calls on the new fd would reach the old connection.
fn forget_stale(fd: c_int) {
    let k = table::kind(fd);
    if k != 0 {
        let e = errno();
        bump(&COUNTERS.closed_unseen);
        let _ = caught(|| closed(forget(fd, k)));
        set_errno(e);
    }
}

fn dup_common(old: c_int, new: c_int, rc: c_int) -> c_int {
    if rc >= 0 && old != new {
        let e = errno();
        let _ = caught(|| {
            let k = table::kind(new);
            if k != 0 {
                closed(forget(new, k));
            }
            if table::kind(old) != 0 {
                table::dup_into(old, new);
            }
        });
        set_errno(e);
    }
    rc
}

/// # Safety
/// C ABI: as dup(2).
#[no_mangle]
pub unsafe extern "C" fn dup(old: c_int) -> c_int {
    // SAFETY: forwarding the caller's argument.
    let rc = unsafe { real!(dup)(old) };
    if rc >= 0 && table::kind(old) != 0 {
        return dup_common(old, rc, rc);
    }
    rc
}

/// # Safety
/// C ABI: as dup2(2).
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let interesting = table::kind(old) != 0 || table::kind(new) != 0;
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { real!(dup2)(old, new) };
    if interesting {
        return dup_common(old, new, rc);
    }
    rc
}

/// # Safety
/// C ABI: as dup3(2).
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let interesting = table::kind(old) != 0 || table::kind(new) != 0;
    // SAFETY: forwarding the caller's arguments.
    let rc = unsafe { real!(dup3)(old, new, flags) };
    if interesting {
        return dup_common(old, new, rc);
    }
    rc
}

/// # Safety
/// C ABI: as close_range(2). The library's own fds in the range stay open: the program does
/// not know of them, and closing them cut the channels of its connections (a Python program's
/// `os.closerange(3, ...)` left its later connections waiting for nothing).
#[no_mangle]
pub unsafe extern "C" fn close_range(first: u32, last: u32, flags: c_int) -> c_int {
    let Some(spared) = Spared::new(first, last) else {
        // None of ours: nothing to allocate or lock (a forked child before exec calls this).
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real!(close_range)(first, last, flags) };
    };
    let forgotten = spared.forget_program_fds(flags);
    let rc = spared.close(first, last, flags);
    for f in forgotten {
        let _ = caught(|| closed(f));
    }
    rc
}

/// # Safety
/// C ABI: as closefrom(3). glibc's closefrom makes its own close_range call, which the wrapper
/// above would not see: the library's fds went with the program's, and the closed connections
/// stayed in the tables.
#[no_mangle]
pub unsafe extern "C" fn closefrom(lowfd: c_int) {
    let first = lowfd.max(0) as u32;
    let Some(spared) = Spared::new(first, u32::MAX) else {
        // SAFETY: forwarding the caller's argument.
        return unsafe { real!(closefrom)(lowfd) };
    };
    let forgotten = spared.forget_program_fds(0);
    if spared.close(first, u32::MAX, 0) < 0 {
        // As glibc's closefrom when close_range fails: one by one, up to the fd limit.
        let limit = netchannel::sys::fd_limit().min(c_int::MAX as usize) as c_int;
        for fd in lowfd.max(0)..limit {
            if !spared.spares(fd) {
                // SAFETY: closing a number of the program's range (EBADF where none is open).
                unsafe { real!(close)(fd) };
            }
        }
    }
    for f in forgotten {
        let _ = caught(|| closed(f));
    }
}

/// What a range the program closes must leave open: every number from the library's floor up
/// (`fd_base`: the library and the engine make their fds there) but the program's own
/// connections, listeners and sets there, and the library's fds below the floor
/// (`netchannel::sys::note_own_fd`: one that found no free number above it).
struct Spared {
    floor: u32,
    /// The library's fds below the floor, in order.
    below: Vec<c_int>,
    /// The program's fds the library knows of in the range (its tables'), with their kinds,
    /// in order.
    program: Vec<(c_int, u8)>,
    /// Those of them at or above the floor.
    program_above: Vec<c_int>,
}

impl Spared {
    /// `None` when the range holds nothing of the library's (the kernel's call as it is).
    fn new(first: u32, last: u32) -> Option<Spared> {
        // One look at the tables (a collection with nothing in it allocates nothing).
        let program: Vec<(c_int, u8)> = (first as usize..=(last as usize).min(table::MAX_FD - 1))
            .map(|fd| (fd as c_int, table::kind(fd as c_int)))
            .filter(|(_, k)| *k != 0)
            .collect();
        let any_known = !program.is_empty();
        // Before the library made any fd (or in a forked child, whose copies are not its
        // library's) nothing is spared: every number of the range is the program's, and a
        // range without the program's connections is the kernel's call alone (a forked child
        // before exec: nothing allocated, nothing locked).
        let library = netchannel::sys::has_own_fds();
        if !library && !any_known {
            return None;
        }
        let floor = if library { process::fd_base().max(0) as u32 } else { u32::MAX };
        let below_last = last.min(floor.saturating_sub(1)).min(c_int::MAX as u32);
        let below = if first < floor {
            netchannel::sys::own_fds_in(first as c_int, below_last as c_int)
        } else {
            Vec::new()
        };
        if last < floor && below.is_empty() && !any_known {
            return None;
        }
        let program_above =
            program.iter().map(|&(fd, _)| fd).filter(|&fd| fd as u32 >= floor).collect();
        Some(Spared { floor, below, program, program_above })
    }

    /// Takes the program's fds of the range out of the tables before their numbers are free
    /// (see `forget`); none with `CLOSE_RANGE_CLOEXEC`, which closes nothing now.
    fn forget_program_fds(&self, flags: c_int) -> Vec<Forgotten> {
        if flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0 {
            return Vec::new();
        }
        self.program.iter().filter_map(|&(fd, k)| caught(|| forget(fd, k))).collect()
    }

    /// Whether `fd` stays open.
    fn spares(&self, fd: c_int) -> bool {
        if (fd as u32) < self.floor {
            self.below.binary_search(&fd).is_ok()
        } else {
            self.program_above.binary_search(&fd).is_err()
        }
    }

    /// `close_range(first, last, flags)` over the program's part of the range: the runs
    /// between the spared numbers below the floor, and the program's own fds above it. 0, or -1
    /// with errno from the first call that failed.
    fn close(&self, first: u32, last: u32, flags: c_int) -> c_int {
        let mut runs = Vec::with_capacity(self.below.len() + self.program_above.len() + 1);
        let low_last = last.min(self.floor.saturating_sub(1));
        if first < self.floor {
            let mut from = first;
            for &fd in &self.below {
                let fd = fd as u32;
                if fd > from {
                    runs.push((from, fd - 1));
                }
                from = fd + 1;
            }
            if from <= low_last {
                runs.push((from, low_last));
            }
        }
        runs.extend(self.program_above.iter().map(|&fd| (fd as u32, fd as u32)));
        for (a, b) in runs {
            // SAFETY: a part of the program's range, without the library's fds.
            let rc = unsafe { real!(close_range)(a, b, flags) };
            if rc < 0 {
                return rc;
            }
        }
        0
    }
}

// ---------------------------------------------------------------------------------------------
// syscall(): libc's generic entry point. Some runtimes make socket calls through it instead of
// the named wrappers (libuv, under Node.js among others, closes every fd with
// `syscall(SYS_close, fd)` so that the close is no cancellation point). Unseen, such a close
// left the fd's number in the tables, and the program's next socket under that number reached
// the old connection. A call on one of the library's fds is served as the named call would be;
// one that makes a new fd (accept, epoll_create) goes through the wrapper too; any other goes
// straight on. Poll and select made this way are not looked at (their sets are not known).

/// # Safety
/// C ABI: as syscall(2). Declared with six fixed arguments after the number: on x86_64 and
/// aarch64 Linux a variadic caller passes integer arguments where a callee with fixed ones
/// reads them (a missing one reads as garbage, and is only passed on).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    // SAFETY: the caller's arguments for system call `n`, as it passed them.
    if let Some(rc) = unsafe { syscall_as_named(n, [a1, a2, a3, a4, a5, a6]) } {
        return rc;
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real!(syscall)(n, a1, a2, a3, a4, a5, a6) }
}

/// Serves system call `n` through this library's wrapper of the same call when it concerns
/// the library's fds (or makes a new fd); `None` leaves it to the kernel.
///
/// # Safety
/// `a` holds the arguments of system call `n` as its caller passed them (an `int` argument in
/// the low half of its register, pointers valid as the call requires).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn syscall_as_named(n: c_long, a: [c_long; 6]) -> Option<c_long> {
    let fd = |i: usize| a[i] as c_int;
    let ours = |i: usize| table::kind(a[i] as c_int) != 0;
    let p = |i: usize| a[i] as *mut c_void;
    // SAFETY: each arm hands the caller's arguments, as the system call takes them, to the
    // wrapper with the same C signature.
    let rc = unsafe {
        match n {
            libc::SYS_read if ours(0) => read(fd(0), p(1), a[2] as usize) as c_long,
            libc::SYS_write if ours(0) => write(fd(0), p(1), a[2] as usize) as c_long,
            libc::SYS_readv if ours(0) => readv(fd(0), p(1).cast(), fd(2)) as c_long,
            libc::SYS_writev if ours(0) => writev(fd(0), p(1).cast(), fd(2)) as c_long,
            libc::SYS_recvfrom if ours(0) => {
                recvfrom(fd(0), p(1), a[2] as usize, fd(3), p(4).cast(), p(5).cast()) as c_long
            }
            libc::SYS_sendto if ours(0) => {
                sendto(fd(0), p(1), a[2] as usize, fd(3), p(4).cast(), a[5] as socklen_t) as c_long
            }
            libc::SYS_recvmsg if ours(0) => recvmsg(fd(0), p(1).cast(), fd(2)) as c_long,
            libc::SYS_sendmsg if ours(0) => sendmsg(fd(0), p(1).cast(), fd(2)) as c_long,
            libc::SYS_recvmmsg if ours(0) => {
                recvmmsg(fd(0), p(1).cast(), a[2] as u32, fd(3), p(4).cast()) as c_long
            }
            libc::SYS_sendmmsg if ours(0) => {
                sendmmsg(fd(0), p(1).cast(), a[2] as u32, fd(3)) as c_long
            }
            libc::SYS_sendfile if ours(0) || ours(1) => {
                sendfile(fd(0), fd(1), p(2).cast(), a[3] as usize) as c_long
            }
            libc::SYS_splice if ours(0) || ours(2) => {
                splice(fd(0), p(1).cast(), fd(2), p(3).cast(), a[4] as usize, a[5] as u32) as c_long
            }
            libc::SYS_shutdown if ours(0) => shutdown(fd(0), fd(1)) as c_long,
            libc::SYS_getsockopt if ours(0) => {
                getsockopt(fd(0), fd(1), fd(2), p(3), p(4).cast()) as c_long
            }
            libc::SYS_setsockopt if ours(0) => {
                setsockopt(fd(0), fd(1), fd(2), p(3), a[4] as socklen_t) as c_long
            }
            libc::SYS_getsockname if ours(0) => {
                getsockname(fd(0), p(1).cast(), p(2).cast()) as c_long
            }
            libc::SYS_getpeername if ours(0) => {
                getpeername(fd(0), p(1).cast(), p(2).cast()) as c_long
            }
            libc::SYS_connect if ours(0) => {
                connect(fd(0), p(1).cast(), a[2] as socklen_t) as c_long
            }
            libc::SYS_fcntl if ours(0) => fcntl(fd(0), fd(1), a[2] as usize) as c_long,
            libc::SYS_ioctl if ours(0) => ioctl(fd(0), a[1] as libc::c_ulong, p(2)) as c_long,
            // The caller's own system call (no cancellation point, as libuv wants).
            libc::SYS_close if ours(0) => {
                close_with(fd(0), || real!(syscall)(n, a[0]) as c_int) as c_long
            }
            libc::SYS_close_range => close_range(a[0] as u32, a[1] as u32, fd(2)) as c_long,
            libc::SYS_dup if ours(0) => dup(fd(0)) as c_long,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_dup2 if ours(0) || ours(1) => dup2(fd(0), fd(1)) as c_long,
            libc::SYS_dup3 if ours(0) || ours(1) => dup3(fd(0), fd(1), fd(2)) as c_long,
            libc::SYS_accept => accept(fd(0), p(1).cast(), p(2).cast()) as c_long,
            libc::SYS_accept4 => accept4(fd(0), p(1).cast(), p(2).cast(), fd(3)) as c_long,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_epoll_create => epoll_create(fd(0)) as c_long,
            libc::SYS_epoll_create1 => epoll_create1(fd(0)) as c_long,
            libc::SYS_epoll_ctl if ours(0) || ours(2) => {
                epoll_ctl(fd(0), fd(1), fd(2), p(3).cast()) as c_long
            }
            #[cfg(target_arch = "x86_64")]
            libc::SYS_epoll_wait if ours(0) => {
                epoll_wait(fd(0), p(1).cast(), fd(2), fd(3)) as c_long
            }
            libc::SYS_epoll_pwait if ours(0) => {
                epoll_pwait(fd(0), p(1).cast(), fd(2), fd(3), p(4).cast()) as c_long
            }
            libc::SYS_epoll_pwait2 if ours(0) => {
                epoll_pwait2(fd(0), p(1).cast(), fd(2), p(3).cast(), p(4).cast()) as c_long
            }
            _ => return None,
        }
    };
    bump(&COUNTERS.raw_syscalls);
    Some(rc)
}

// ---------------------------------------------------------------------------------------------
// connect, listen, accept.

/// # Safety
/// C ABI: `addr` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let real = real!(connect);
    if table::kind(fd) & CARRIED != 0 {
        if let Some(c) = served(fd) {
            return ret_int(guard(|| with_fd(fd, |app| c.connect_again(app).map(|()| 0))));
        }
    }
    if is_inside() {
        bump(&COUNTERS.reentered);
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real(fd, addr, len) };
    }
    // SAFETY: the caller guarantees `len` bytes at `addr`.
    let dest = unsafe { to_socketaddr(addr, len) };
    let saved = errno();
    let carried = caught(|| dest.and_then(|d| with_fd(fd, |app| connect::try_carry(fd, app, d))));
    match carried {
        Some(Some(r)) => {
            set_errno(saved);
            ret_int(r.map(|_| 0))
        }
        _ => {
            set_errno(saved);
            // SAFETY: forwarding the caller's arguments unchanged.
            unsafe { real(fd, addr, len) }
        }
    }
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    if is_inside() {
        bump(&COUNTERS.reentered);
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real!(listen)(fd, backlog) };
    }
    // A bound socket's engine listener comes first: whoever sees the kernel listener finds
    // the engine's too.
    let fresh = table::kind(fd) & LISTENING == 0;
    let bound = fresh
        && caught(|| with_fd(fd, |app| connect::local_of(app).is_some_and(|a| a.port() != 0)))
            == Some(true);
    let prepared = if bound {
        caught(|| with_fd(fd, |app| listen::prepare_engine_listener(fd, app, backlog))).flatten()
    } else {
        None
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    let rc = unsafe { real!(listen)(fd, backlog) };
    if rc == 0 && fresh {
        let saved = errno();
        match prepared {
            Some(p) => {
                let _ = caught(|| listen::start_engine_listener(fd, p));
            }
            None if !bound => {
                let _ = caught(|| with_fd(fd, |app| listen::add_engine_listener(fd, app, backlog)));
            }
            None => {}
        }
        set_errno(saved);
    }
    rc
}

/// What `accept` and `accept4` do after the real call (errno as the real call left it).
///
/// # Safety
/// `addr` and `len` as the caller passed them to the real accept.
/// `flags`: `accept4`'s (0 for `accept`), which set the new fd's `O_NONBLOCK` and
/// `FD_CLOEXEC` (nothing is inherited from the listener on Linux).
unsafe fn after_accept(
    fd: c_int,
    nfd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    if nfd >= 0 {
        forget_stale(nfd);
    }
    if is_inside() {
        bump(&COUNTERS.reentered);
        return nfd;
    }
    if nfd < 0 || process::settings().disabled {
        return nfd;
    }
    let saved = errno();
    let modes = connect::FdModes {
        nonblocking: flags & libc::SOCK_NONBLOCK != 0,
        cloexec: flags & libc::SOCK_CLOEXEC != 0,
    };
    let peer = caught(|| with_fd(nfd, |app| listen::accepted(fd, nfd, app, modes)));
    if let Some(Some(p)) = peer {
        // SAFETY: forwarded from the caller.
        unsafe { write_addr(p, addr, len) };
    }
    set_errno(saved);
    nfd
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarding the caller's arguments unchanged.
    let nfd = unsafe { real!(accept)(fd, addr, len) };
    // SAFETY: the caller's arguments, as the real accept just used them.
    unsafe { after_accept(fd, nfd, addr, len, 0) }
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: forwarding the caller's arguments unchanged.
    let nfd = unsafe { real!(accept4)(fd, addr, len, flags) };
    // SAFETY: the caller's arguments, as the real accept4 just used them.
    unsafe { after_accept(fd, nfd, addr, len, flags) }
}
