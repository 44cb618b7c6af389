//! Every OS call the engine makes that std does not wrap: eventfd, epoll, readv/writev into
//! uninitialised memory, socket options, network namespaces. All `unsafe` of the crate is here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

/// Turns the `-1`-and-errno convention into `io::Result`.
macro_rules! syscall {
    ($name:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: each call site passes arguments that satisfy the named syscall's contract;
        // the specific reasoning is written at the call site.
        let res = unsafe { libc::$name($($arg),*) };
        if res == -1 { Err(io::Error::last_os_error()) } else { Ok(res) }
    }};
}

/// A counter fd that wakes epoll waiters: how other threads wake a parked worker and how
/// applications learn that a virtual socket became ready.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        // eventfd takes no pointers.
        let fd = syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn notify(&self) {
        let one: u64 = 1;
        // A full counter (EAGAIN) already means "readable"; nothing to do on error.
        // SAFETY: writes 8 bytes from a live u64 to an fd we own.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter; returns whether it was signalled.
    pub fn drain(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an fd we own.
        let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        n == 8
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Level-triggered epoll over a handful of fds, identified by a u64 token.
pub struct Epoll(OwnedFd);

pub const READABLE: u32 = libc::EPOLLIN as u32;
pub const WRITABLE: u32 = libc::EPOLLOUT as u32;
pub const EDGE: u32 = libc::EPOLLET as u32;

impl Epoll {
    pub fn new() -> io::Result<Self> {
        let fd = syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by nobody else.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // `ev` is a valid epoll_event that outlives the call.
        syscall!(epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev))?;
        Ok(())
    }

    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    /// Waits for events; returns how many entries of `events` were filled. Timeouts below a
    /// millisecond are honoured exactly (epoll_wait itself would round them to zero: a spin).
    pub fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let ms = match timeout {
            None => -1,
            Some(d) if !d.is_zero() && d < Duration::from_millis(1) => {
                if !poll_readable(self.0.as_raw_fd(), Some(d))? {
                    return Ok(0);
                }
                0
            }
            Some(d) => d.as_millis().min(i32::MAX as u128) as i32,
        };
        // `events` is a writable buffer of the length we pass.
        match syscall!(epoll_wait(self.0.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, ms))
        {
            Ok(n) => Ok(n as usize),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
            Err(e) => Err(e),
        }
    }
}

/// Waits up to `timeout` (None: forever) for `fd` to become readable, with nanosecond precision.
pub fn poll_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // One live pollfd, count 1; the timespec (or null) outlives the call; no signal mask.
    match syscall!(ppoll(&mut pfd, 1, ts_ptr, std::ptr::null())) {
        Ok(n) => Ok(n > 0),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reads up to `max` bytes from `fd` into the spare capacity of `buf`, extending its length by
/// the bytes read. Avoids zero-filling buffers that the kernel is about to overwrite.
pub fn read_append(fd: RawFd, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    let want = spare.len().min(max);
    // The pointer and length describe `want` bytes of spare capacity owned by `buf`.
    let n = syscall!(read(fd, spare.as_mut_ptr().cast(), want))? as usize;
    // SAFETY: the kernel initialised exactly `n <= want` bytes after the old length.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Gathers `slices` into one `writev`.
pub fn writev(fd: RawFd, slices: &[io::IoSlice<'_>]) -> io::Result<usize> {
    let count = slices.len().min(libc::UIO_MAXIOV as usize) as i32;
    // IoSlice is ABI-compatible with iovec on Unix and every slice outlives the call.
    let n = syscall!(writev(fd, slices.as_ptr().cast(), count))?;
    Ok(n as usize)
}

/// Sets an integer socket option that std and socket2 do not cover.
pub fn set_int_sockopt(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // The option value is a live c_int and its size is passed.
    syscall!(setsockopt(
        fd,
        level,
        name,
        (&value as *const i32).cast(),
        std::mem::size_of::<i32>() as libc::socklen_t,
    ))?;
    Ok(())
}

/// Moves the calling thread into the network namespace at `path` (e.g. /run/netns/NAME).
/// Sockets created afterwards by this thread, and threads it spawns, live in that namespace.
pub fn enter_netns(path: &Path) -> io::Result<()> {
    let file = std::fs::File::open(path).map_err(|e| {
        io::Error::new(e.kind(), format!("cannot open network namespace {}: {e}", path.display()))
    })?;
    // setns takes an fd we keep open for the duration of the call.
    syscall!(setns(file.as_raw_fd(), libc::CLONE_NEWNET)).map_err(|e| {
        io::Error::new(e.kind(), format!("cannot enter network namespace {}: {e}", path.display()))
    })?;
    Ok(())
}

/// 64 random bits from the kernel, for engine ids.
pub fn random_u64() -> u64 {
    let mut v: u64 = 0;
    // SAFETY: getrandom writes at most 8 bytes into a live u64.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n == 8 {
        v
    } else {
        // Fall back to time and pid; ids only need to differ between live engines.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ ((std::process::id() as u64) << 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventfd_wakes_epoll() {
        let ep = Epoll::new().unwrap();
        let ev = EventFd::new().unwrap();
        ep.add(ev.raw(), READABLE, 7).unwrap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
        assert_eq!(ep.wait(&mut events, Some(Duration::ZERO)).unwrap(), 0);
        ev.notify();
        assert_eq!(ep.wait(&mut events, Some(Duration::from_secs(1))).unwrap(), 1);
        let token = events[0].u64;
        assert_eq!(token, 7);
        assert!(ev.drain());
        assert!(!ev.drain());
    }

    #[test]
    fn read_append_and_writev_over_a_pipe() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two fds into a live [c_int; 2].
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both fds were just created and are owned only here.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let n = writev(w.as_raw_fd(), &[io::IoSlice::new(b"hello "), io::IoSlice::new(b"world")])
            .unwrap();
        assert_eq!(n, 11);
        let mut buf = b">".to_vec();
        assert_eq!(read_append(r.as_raw_fd(), &mut buf, 5).unwrap(), 5);
        assert_eq!(read_append(r.as_raw_fd(), &mut buf, 64).unwrap(), 6);
        assert_eq!(buf, b">hello world");
    }

    #[test]
    fn missing_netns_is_a_clear_error() {
        let err = std::thread::spawn(|| enter_netns(Path::new("/run/netns/does-not-exist")))
            .join()
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("does-not-exist"), "{err}");
    }
}
