//! What the library knows about the program's fds: one atomic byte per fd number (`kind`),
//! loaded by every interposed call, and behind it tables locked only for fds that are ours.
//!
//! A call on an fd that is not ours costs one atomic load and goes straight to libc: no lock,
//! no allocation (async-signal-safe, as the call it stands in for).

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::carried::Carried;
use crate::forklock::{ForkMutex, ForkRwLock};
use crate::inherit::Remote;
use crate::listen::ListenEntry;
use crate::waits::EpollInfo;

/// Highest fd number tracked; above it sockets are left to kernel TCP (counted).
pub(crate) const MAX_FD: usize = 65536;

/// The fd is a carried connection served by the direct path (its number holds a placeholder).
pub(crate) const CARRIED: u8 = 1;
/// The fd is a listening socket with an engine `Listener` beside it.
pub(crate) const LISTENING: u8 = 2;
/// The fd is an epoll set holding carried fds (directly or nested): waits on it serve channels.
pub(crate) const EPOLL: u8 = 4;
/// The fd is a placeholder this process inherited (exec, `SCM_RIGHTS`): its connection lives
/// in another process's engine and is reached through that process's relay on first use.
pub(crate) const REMOTE: u8 = 8;
/// `--path relay`: a kernel socket relayed to a virtual connection (`getpeername` reports the
/// virtual peer).
pub(crate) const RELAYED: u8 = 16;
/// The fd is an epoll instance (from `epoll_create*`): adding it to another set nests it.
pub(crate) const EPOLL_INSTANCE: u8 = 32;
/// The epoll instance is seen by more than its own waits (nested in another set, polled,
/// selected, or dup'd): its members' readiness must be in the kernel (see `elide`).
pub(crate) const EPOLL_OBSERVED: u8 = 64;

static KIND: [AtomicU8; MAX_FD] = [const { AtomicU8::new(0) }; MAX_FD];

/// What kind of fd `fd` is (0: not ours).
#[inline]
pub(crate) fn kind(fd: c_int) -> u8 {
    if fd >= 0 && (fd as usize) < MAX_FD {
        KIND[fd as usize].load(Ordering::Acquire)
    } else {
        0
    }
}

pub(crate) fn in_range(fd: c_int) -> bool {
    fd >= 0 && (fd as usize) < MAX_FD
}

pub(crate) fn set_bits(fd: c_int, bits: u8) {
    if in_range(fd) {
        KIND[fd as usize].fetch_or(bits, Ordering::AcqRel);
    }
}

pub(crate) fn clear_bits(fd: c_int, bits: u8) {
    if in_range(fd) {
        KIND[fd as usize].fetch_and(!bits, Ordering::AcqRel);
    }
}

const SHARDS: usize = 16;

/// Carried fds by number, sharded so that threads working on different fds rarely meet.
pub(crate) struct Tables {
    carried: [ForkRwLock<FxHashMap<c_int, Arc<Carried>>>; SHARDS],
    pub(crate) remote: ForkMutex<HashMap<c_int, Arc<Remote>>>,
    pub(crate) listeners: ForkMutex<HashMap<c_int, Arc<ListenEntry>>>,
    pub(crate) epolls: ForkMutex<HashMap<c_int, Arc<Mutex<EpollInfo>>>>,
}

/// The tables (only ever touched for fds whose `kind` says they are ours).
pub(crate) static TABLES: LazyLock<Tables> = LazyLock::new(|| Tables {
    carried: std::array::from_fn(|_| ForkRwLock::new(FxHashMap::default())),
    remote: ForkMutex::new(HashMap::new()),
    listeners: ForkMutex::new(HashMap::new()),
    epolls: ForkMutex::new(HashMap::new()),
});

fn shard(fd: c_int) -> &'static ForkRwLock<FxHashMap<c_int, Arc<Carried>>> {
    &TABLES.carried[fd as usize % SHARDS]
}

/// The carried connection under `fd`.
pub(crate) fn carried(fd: c_int) -> Option<Arc<Carried>> {
    shard(fd).read().get(&fd).cloned()
}

/// Puts `c` under `fd` (a new number for it: connect, accept, dup).
pub(crate) fn map_carried(fd: c_int, c: Arc<Carried>) {
    c.fd_mapped();
    shard(fd).write().insert(fd, c);
    set_bits(fd, CARRIED);
}

/// Takes the carried connection off `fd` (close, or a dup2 over it).
pub(crate) fn unmap_carried(fd: c_int) -> Option<Arc<Carried>> {
    clear_bits(fd, CARRIED);
    let c = shard(fd).write().remove(&fd);
    if let Some(c) = &c {
        c.fd_unmapped();
    }
    c
}

/// Every fd of this process that holds `c`.
pub(crate) fn fds_of(c: &Arc<Carried>) -> Vec<c_int> {
    let mut out = Vec::new();
    for s in &TABLES.carried {
        out.extend(s.read().iter().filter(|(_, x)| Arc::ptr_eq(x, c)).map(|(fd, _)| *fd));
    }
    out
}

pub(crate) fn map_remote(fd: c_int, r: Arc<Remote>) {
    TABLES.remote.lock().insert(fd, r);
    set_bits(fd, REMOTE);
}

pub(crate) fn remote(fd: c_int) -> Option<Arc<Remote>> {
    TABLES.remote.lock().get(&fd).cloned()
}

pub(crate) fn unmap_remote(fd: c_int) -> Option<Arc<Remote>> {
    clear_bits(fd, REMOTE);
    TABLES.remote.lock().remove(&fd)
}

pub(crate) fn map_listener(fd: c_int, l: Arc<ListenEntry>) {
    TABLES.listeners.lock().insert(fd, l);
    set_bits(fd, LISTENING);
}

pub(crate) fn unmap_listener(fd: c_int) -> Option<Arc<ListenEntry>> {
    clear_bits(fd, LISTENING);
    TABLES.listeners.lock().remove(&fd)
}

pub(crate) fn map_epoll(fd: c_int, e: Arc<Mutex<EpollInfo>>) {
    TABLES.epolls.lock().insert(fd, e);
    set_bits(fd, EPOLL);
}

pub(crate) fn epoll(fd: c_int) -> Option<Arc<Mutex<EpollInfo>>> {
    TABLES.epolls.lock().get(&fd).cloned()
}

pub(crate) fn unmap_epoll(fd: c_int) -> Option<Arc<Mutex<EpollInfo>>> {
    clear_bits(fd, EPOLL);
    TABLES.epolls.lock().remove(&fd)
}

/// In a forked child: the epoll sets it inherited hold its parent's connections, whose
/// channels only the parent serves, so its waits on them go straight to the kernel (a child
/// that served them would read the parent's channels from under it).
pub(crate) fn forget_epolls_after_fork() {
    let inherited = std::mem::take(&mut *TABLES.epolls.lock());
    for fd in inherited.into_keys() {
        clear_bits(fd, EPOLL);
    }
}

/// Every epoll set this process knows of (before a fork: the child shares them).
pub(crate) fn epoll_instances() -> Vec<c_int> {
    (0..MAX_FD as c_int).filter(|&fd| kind(fd) & (EPOLL | EPOLL_INSTANCE) != 0).collect()
}

/// Takes the tables' locks until `forklock::release_held` (before `fork`, so that a child never
/// inherits one held by a thread it does not have).
pub(crate) fn hold_across_fork() {
    TABLES.carried.iter().for_each(ForkRwLock::hold_across_fork);
    TABLES.remote.hold_across_fork();
    TABLES.listeners.hold_across_fork();
    TABLES.epolls.hold_across_fork();
}

/// Copies what `old` is to `new` after a `dup` (the new number names the same object).
pub(crate) fn dup_into(old: c_int, new: c_int) {
    let k = kind(old);
    if k & CARRIED != 0 {
        if let Some(c) = carried(old) {
            map_carried(new, c);
        }
    }
    if k & REMOTE != 0 {
        if let Some(r) = remote(old) {
            map_remote(new, r);
        }
    }
    if k & EPOLL != 0 {
        if let Some(e) = epoll(old) {
            map_epoll(new, e);
        }
    }
    if k & CARRIED != 0 {
        // Two numbers for one placeholder: its registrations are no longer one per set.
        if let Some(c) = carried(old) {
            c.forbid_elision();
        }
    }
    if k & (EPOLL | EPOLL_INSTANCE) != 0 {
        // A set waited on under two numbers: its waits no longer know it by one.
        crate::waits::observe_set(old);
        set_bits(new, k & EPOLL_INSTANCE | EPOLL_OBSERVED);
    }
}
