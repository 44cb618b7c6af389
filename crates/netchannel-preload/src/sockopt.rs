//! Socket options of carried connections, answered as the kernel would answer them for a TCP
//! socket: a value the program set is checked and read back through a scratch TCP socket (so
//! that, say, `SO_SNDBUF` reads back doubled and a bad length is `EINVAL`), anything else comes
//! from an untouched template TCP socket of the same family. The few options that change
//! behaviour are also kept in a form the data path uses (timeouts, `SO_LINGER`).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;

use crate::carried::Carried;
use crate::interpose::{raw_getsockopt, raw_setsockopt};

/// An option as the program set it: (level, name) and the value's bytes.
type SetOption = ((i32, i32), Vec<u8>);

/// A carried connection's options.
#[derive(Default)]
pub(crate) struct Options {
    /// (level, name) -> the bytes the program set, in order of first setting.
    set: Mutex<Vec<SetOption>>,
    rcv_timeout_ns: AtomicU64,
    snd_timeout_ns: AtomicU64,
    linger_abort: AtomicBool,
    /// `SO_LINGER` on with a positive time: its seconds (0: off, or a zero time).
    linger_secs: AtomicU32,
    /// `SO_RCVLOWAT` as the kernel keeps it (0: never set, which is 1).
    rcv_lowat: AtomicU32,
}

impl Options {
    pub fn rcv_timeout(&self) -> Option<Duration> {
        duration(self.rcv_timeout_ns.load(Ordering::Relaxed))
    }

    pub fn snd_timeout(&self) -> Option<Duration> {
        duration(self.snd_timeout_ns.load(Ordering::Relaxed))
    }

    /// `SO_RCVLOWAT`: the bytes a blocking read waits for (at most what it asked), and below
    /// which the connection does not show readable (unless it ended).
    pub fn rcv_lowat(&self) -> usize {
        self.rcv_lowat.load(Ordering::Relaxed).max(1) as usize
    }

    /// `SO_LINGER` on with a zero timeout: the last close resets the connection.
    pub fn linger_abort(&self) -> bool {
        self.linger_abort.load(Ordering::Relaxed)
    }

    /// `SO_LINGER` on with a positive time: the last close waits up to that long for the peer
    /// to have every byte and the end of stream.
    pub fn linger_time(&self) -> Option<Duration> {
        match self.linger_secs.load(Ordering::Relaxed) {
            0 => None,
            secs => Some(Duration::from_secs(secs.into())),
        }
    }

    /// The options the program set, to apply to a kernel socket that takes the connection
    /// over (a relay connection after fork). Called in a forked child, where the lock is only
    /// tried: one that a parent thread held at the fork (a `setsockopt` on this connection)
    /// stays held here for good, and the options are then not copied.
    pub fn all(&self) -> Vec<SetOption> {
        self.set.try_lock().map(|set| set.clone()).unwrap_or_default()
    }
}

fn duration(ns: u64) -> Option<Duration> {
    match ns {
        0 => None,
        EXPIRED => Some(Duration::ZERO),
        ns => Some(Duration::from_nanos(ns)),
    }
}

/// A negative timeout: the kernel keeps it as zero jiffies, so a call that would block fails
/// at once with `EAGAIN` (unlike 0, which means none).
const EXPIRED: u64 = u64::MAX;

/// Template sockets of one family: `defaults` is never changed, `scratch` takes the options
/// being checked or read back. `adopted` holds the `ADOPTED` options' values on `defaults`,
/// read once (every carried connection compares against them).
struct Templates {
    defaults: OwnedFd,
    scratch: Mutex<OwnedFd>,
    adopted: [Option<Vec<u8>>; ADOPTED.len()],
}

/// The family's templates, made on its first use (a client of IPv4 peers never makes IPv6's).
fn templates(v6: bool) -> Option<&'static Templates> {
    static T: [OnceLock<Option<Templates>>; 2] = [OnceLock::new(), OnceLock::new()];
    let family =
        if v6 { rustix::net::AddressFamily::INET6 } else { rustix::net::AddressFamily::INET };
    T[usize::from(v6)]
        .get_or_init(|| {
            let sock = || {
                rustix::net::socket_with(
                    family,
                    rustix::net::SocketType::STREAM,
                    rustix::net::SocketFlags::CLOEXEC,
                    None,
                )
                .ok()
                .map(crate::process::relocate)
            };
            let defaults = sock()?;
            let adopted = ADOPTED.map(|(level, name)| {
                let mut v = [0u8; 16];
                let n = raw_getsockopt(defaults.as_fd(), level, name, &mut v).ok()?;
                Some(v[..n].to_vec())
            });
            Some(Templates { defaults, scratch: Mutex::new(sock()?), adopted })
        })
        .as_ref()
}

/// Options that change what a carried connection does, or that programs read back, taken
/// over from the kernel socket it replaces (`adopt`).
const ADOPTED: [(i32, i32); 9] = [
    (libc::SOL_SOCKET, libc::SO_SNDBUF),
    (libc::SOL_SOCKET, libc::SO_RCVBUF),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO),
    (libc::SOL_SOCKET, libc::SO_LINGER),
    (libc::SOL_SOCKET, libc::SO_RCVLOWAT),
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
    (libc::IPPROTO_TCP, libc::TCP_NODELAY),
    (libc::SOL_SOCKET, libc::SO_OOBINLINE),
];

/// Options the program set on the kernel socket before it was carried (before its `connect`,
/// or on the listener an accepted socket inherits them from, as TCP's accepted sockets do):
/// they hold for the carried connection and read back as set. A common pattern (timeouts set,
/// then `connect`) had its timeouts dropped: a read waited for data forever. The buffer sizes
/// only from a socket not yet connected (`accepted` false): a connected one's grew on its own.
pub(crate) fn adopt(c: &Carried, from: BorrowedFd<'_>, accepted: bool) {
    let Some(t) = templates(c.v6) else { return };
    let mut now = [0u8; 16];
    for ((level, name), fresh) in ADOPTED.into_iter().zip(&t.adopted) {
        let Some(fresh) = fresh else { continue };
        let buffer = level == libc::SOL_SOCKET && matches!(name, libc::SO_SNDBUF | libc::SO_RCVBUF);
        if buffer && accepted {
            continue;
        }
        let Ok(n) = raw_getsockopt(from, level, name, &mut now) else { continue };
        if now[..n] == fresh[..] {
            continue;
        }
        if buffer && n == 4 {
            // The kernel reads back twice what was set: set half to read back the same.
            let set_value = i32::from_ne_bytes(now[..4].try_into().unwrap()) / 2;
            let _ = set(c, level, name, &set_value.to_ne_bytes());
        } else {
            let _ = set(c, level, name, &now[..n]);
        }
    }
}

/// `setsockopt` on a carried connection.
pub(crate) fn set(c: &Carried, level: i32, name: i32, value: &[u8]) -> Result<(), i32> {
    let t = templates(c.v6).ok_or(libc::ENOMEM)?;
    {
        let scratch = t.scratch.lock();
        raw_setsockopt(scratch.as_fd(), level, name, value)?;
    }
    let o = &c.opts;
    if level == libc::SOL_SOCKET {
        match name {
            libc::SO_RCVTIMEO | libc::SO_SNDTIMEO => {
                let ns = timeval_ns(value).ok_or(libc::EINVAL)?;
                let slot =
                    if name == libc::SO_RCVTIMEO { &o.rcv_timeout_ns } else { &o.snd_timeout_ns };
                slot.store(ns, Ordering::Relaxed);
            }
            libc::SO_RCVLOWAT => {
                // As the kernel clamps it (half the largest receive buffer), read back.
                let mut v = [0u8; 4];
                let scratch = t.scratch.lock();
                if raw_getsockopt(scratch.as_fd(), level, name, &mut v) == Ok(4) {
                    o.rcv_lowat.store(i32::from_ne_bytes(v).max(1) as u32, Ordering::Relaxed);
                }
            }
            libc::SO_OOBINLINE if value.len() >= 4 => {
                c.vs.set_oob_inline(i32::from_ne_bytes(value[..4].try_into().unwrap()) != 0);
            }
            libc::SO_LINGER if value.len() >= 8 => {
                let on = i32::from_ne_bytes(value[0..4].try_into().unwrap());
                let secs = i32::from_ne_bytes(value[4..8].try_into().unwrap());
                o.linger_abort.store(on != 0 && secs == 0, Ordering::Relaxed);
                let wait = if on != 0 && secs > 0 { secs as u32 } else { 0 };
                o.linger_secs.store(wait, Ordering::Relaxed);
            }
            _ => {}
        }
    }
    let mut set = o.set.lock();
    match set.iter_mut().find(|(k, _)| *k == (level, name)) {
        Some((_, v)) => *v = value.to_vec(),
        None => set.push(((level, name), value.to_vec())),
    }
    Ok(())
}

/// `getsockopt` on a carried connection (`SO_ERROR` and `TCP_INFO` are the caller's): how many
/// bytes of `out` were written.
pub(crate) fn get(c: &Carried, level: i32, name: i32, out: &mut [u8]) -> Result<usize, i32> {
    let t = templates(c.v6).ok_or(libc::ENOMEM)?;
    let stored =
        c.opts.set.lock().iter().find(|(k, _)| *k == (level, name)).map(|(_, v)| v.clone());
    match stored {
        Some(v) => {
            let scratch = t.scratch.lock();
            raw_setsockopt(scratch.as_fd(), level, name, &v)?;
            raw_getsockopt(scratch.as_fd(), level, name, out)
        }
        None => raw_getsockopt(t.defaults.as_fd(), level, name, out),
    }
}

/// A `struct timeval` as nanoseconds (0: no timeout; `EXPIRED`: negative), or `None` when
/// malformed (`EDOM` for the kernel too, but `EINVAL` for a short buffer: the scratch socket
/// already said which).
fn timeval_ns(v: &[u8]) -> Option<u64> {
    if v.len() < 16 {
        return None;
    }
    let secs = i64::from_ne_bytes(v[0..8].try_into().ok()?);
    let usecs = i64::from_ne_bytes(v[8..16].try_into().ok()?);
    if secs < 0 {
        return Some(EXPIRED);
    }
    let ns = (secs as u64).saturating_mul(1_000_000_000).saturating_add(usecs.max(0) as u64 * 1000);
    Some(ns.min(EXPIRED - 1))
}
