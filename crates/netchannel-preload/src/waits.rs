//! The program's waits over carried fds: `epoll_wait` and friends, `poll`, `select`. The
//! kernel object the program waits on reports the truth (each placeholder mirrors its virtual
//! socket, see `carried`); what the library adds is run to completion: while the program's
//! thread waits, it serves the channels of the connections in its wait itself (reads frames,
//! dispatches them, which writes the placeholders' tokens, and sends), the way a thread blocked
//! in `VSocket::recv` does, instead of sleeping until an engine worker did it and woke it.
//!
//! An epoll set is watched for carried members from `epoll_ctl` on: a wait on a set that has
//! none (or a poll over fds none of which is carried) goes straight to the kernel. A wait on a
//! set also reports the readability of members whose tokens were elided (`elide`).

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use netchannel::sys::SignalPolicy;
use netchannel::ServeSet;
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::carried::{Carried, Registration};
use crate::interpose::{signals, with_fd};
use crate::process::pid;
use crate::table::{self, CARRIED, EPOLL, EPOLL_INSTANCE, EPOLL_OBSERVED, REMOTE};

/// What the library knows of one epoll set holding carried fds.
#[derive(Default)]
pub(crate) struct EpollInfo {
    /// Carried members, by fd number (weak: the set does not keep a connection open), with
    /// the `data` of their registration.
    members: HashMap<c_int, (Weak<Carried>, u64)>,
    /// How many carried members registered each `data` (an elided report is told from the
    /// kernel's events by its `data` alone, so a shared one is not elided).
    datas: HashMap<u64, u32>,
    /// Epoll sets with carried members nested in this one.
    nested: Vec<c_int>,
    /// The sessions of the members, served during waits (copied out for each wait).
    serve: Arc<ServeSet>,
    /// Whose readability the set's own wait reports (`elide`).
    elision: Arc<crate::elide::SetState>,
}

/// The carried connection under `fd` if this process serves it; a placeholder this process
/// holds but does not own is taken over first (it is kernel TCP afterwards).
pub(crate) fn served(fd: c_int) -> Option<Arc<Carried>> {
    let k = table::kind(fd);
    if k & (CARRIED | REMOTE) == 0 {
        return None;
    }
    if let Some(c) = table::carried(fd) {
        if c.owner == pid() {
            return Some(c);
        }
    }
    with_fd(fd, |app| crate::inherit::take_over(fd, app));
    None
}

/// Before `epoll_ctl(epfd, op, fd)`: a carried member starts mirroring its readiness.
pub(crate) fn before_ctl(op: c_int, fd: c_int, events: u32) -> Option<Arc<Carried>> {
    let c = served(fd)?;
    if op != libc::EPOLL_CTL_DEL {
        with_fd(fd, |app| c.arm(app, events & libc::EPOLLET as u32 != 0));
    }
    Some(c)
}

/// After a successful `epoll_ctl` (`event`: the program's events and data): the set's members
/// and sessions follow, and whether a member's readability may be elided.
pub(crate) fn after_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    c: Option<Arc<Carried>>,
    event: (u32, u64),
) {
    if op == libc::EPOLL_CTL_ADD && table::kind(fd) & (EPOLL | EPOLL_INSTANCE) != 0 {
        // A set nested in this one: its members' readiness must reach the kernel, which is all
        // this set's wait sees of them.
        observe_set(fd);
    }
    // Nested sets matter here only for the sessions their members need served.
    let nested = table::kind(fd) & EPOLL != 0;
    if c.is_none() && !nested {
        return;
    }
    let info = table::epoll(epfd).unwrap_or_else(|| {
        let info = Arc::new(Mutex::new(EpollInfo::default()));
        table::map_epoll(epfd, info.clone());
        info
    });
    let (events, data) = event;
    let mut i = info.lock();
    // Called once this member's `data` is counted.
    let elidable = |i: &EpollInfo| {
        (events & libc::EPOLLIN as u32 != 0)
            && (events & !crate::elide::ELIDABLE == 0)
            && table::kind(epfd) & EPOLL_OBSERVED == 0
            && i.datas.get(&data) == Some(&1)
    };
    let reg = Registration { set: i.elision.clone(), events, data };
    match (op, c) {
        (libc::EPOLL_CTL_ADD, Some(c)) => {
            if let Some((_, was)) = i.members.insert(fd, (Arc::downgrade(&c), data)) {
                i.uncount(was);
            }
            *i.datas.entry(data).or_default() += 1;
            let ok = elidable(&i);
            Arc::make_mut(&mut i.serve).add(&c.vs);
            drop(i);
            c.joined_set(ok.then_some(reg));
        }
        (libc::EPOLL_CTL_MOD, Some(c)) => {
            if let Some(was) = i.members.get_mut(&fd).map(|m| std::mem::replace(&mut m.1, data)) {
                if was != data {
                    i.uncount(was);
                    *i.datas.entry(data).or_default() += 1;
                }
            }
            let ok = elidable(&i);
            drop(i);
            c.changed_set(ok.then_some(reg));
        }
        (libc::EPOLL_CTL_DEL, Some(c)) if i.members.contains_key(&fd) => {
            if let Some((_, was)) = i.members.remove(&fd) {
                i.uncount(was);
            }
            Arc::make_mut(&mut i.serve).remove(&c.vs);
            let set = i.elision.clone();
            drop(i);
            c.left_set(&set);
        }
        (libc::EPOLL_CTL_ADD, None) => i.nested.push(fd),
        (libc::EPOLL_CTL_DEL, None) => i.nested.retain(|&n| n != fd),
        _ => {}
    }
}

impl EpollInfo {
    fn uncount(&mut self, data: u64) {
        if let Some(n) = self.datas.get_mut(&data) {
            *n -= 1;
            if *n == 0 {
                self.datas.remove(&data);
            }
        }
    }
}

/// Epoll set `epfd` is seen by more than its own waits (nested, polled, selected, dup'd):
/// none of its members is elided from now on.
pub(crate) fn observe_set(epfd: c_int) {
    table::set_bits(epfd, EPOLL_OBSERVED);
    if let Some(info) = table::epoll(epfd) {
        set_closed(&info);
    }
}

/// Epoll set `epfd` is being closed (or observed, above): its number may name another set
/// soon, so its members are no longer elided (the kernel drops their registrations when the
/// set goes).
pub(crate) fn set_closed(info: &Mutex<EpollInfo>) {
    let members: Vec<Arc<Carried>> =
        info.lock().members.values().filter_map(|(w, _)| w.upgrade()).collect();
    for c in members {
        c.forbid_elision();
    }
}

/// The sessions a wait on epoll set `epfd` serves (nested sets included).
fn serve_set(epfd: c_int, depth: usize) -> Option<ServeSet> {
    serve_set_and_elision(epfd, depth).map(|(s, _)| s)
}

/// `serve_set`, and the set's own elision state.
fn serve_set_and_elision(
    epfd: c_int,
    depth: usize,
) -> Option<(ServeSet, Arc<crate::elide::SetState>)> {
    let info = table::epoll(epfd)?;
    let (mut set, nested, elision) = {
        let i = info.lock();
        ((*i.serve).clone(), i.nested.clone(), i.elision.clone())
    };
    if depth < 4 {
        for n in nested {
            if let Some(s) = serve_set(n, depth + 1) {
                set.merge(&s);
            }
        }
    }
    Some((set, elision))
}

thread_local! {
    /// The thread's last `epoll_wait` over carried fds found events without sleeping.
    static BUSY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `epoll_wait`/`epoll_pwait`/`epoll_pwait2` on a set holding carried fds. `real(timeout)`
/// makes the kernel call into the program's buffer (only ever with a zero timeout here).
pub(crate) fn epoll_wait(
    epfd: c_int,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    mut real: impl FnMut(&crate::elide::SetState) -> Result<usize, i32>,
) -> Option<Result<usize, i32>> {
    let (set, elision) = serve_set_and_elision(epfd, 0)?;
    elision.before_wait();
    netchannel::flush_sends();
    let deadline = timeout.map(|t| Instant::now() + t);
    let signals = SignalPolicy { interruptible: true, mask, handled: Some(signals::handled_count) };
    let handled = signals::snapshot();
    // What the channels hold already is read here, before the program's events are reported,
    // by a loop so busy that its last wait did not sleep: its set always has something ready,
    // so it would otherwise leave its channels to an engine worker (a wake-up, and the payloads
    // handed across threads). A loop that sleeps serves them in its sleep, and a ping-pong
    // would pay the extra system call in its latency. Outside the program's mask: a signal it
    // unblocks for the wait only is left for the sleep to take.
    if BUSY.with(|b| b.get()) {
        let _ = set.wait_until(Some(Instant::now()), SignalPolicy::default(), false, || false);
    }
    let mut first = true;
    loop {
        // Read before the report inside `real`: an elided arrival after it keeps us awake.
        let seen = elision.arrivals();
        match real(&elision) {
            Ok(0) => {}
            r => {
                BUSY.with(|b| b.set(first));
                return Some(r);
            }
        }
        if signals::handled_since(handled) {
            return Some(Err(libc::EINTR));
        }
        if timeout == Some(Duration::ZERO)
            || (!first && deadline.is_some_and(|d| Instant::now() >= d))
        {
            return Some(Ok(0));
        }
        first = false;
        let Some(asleep) = crate::elide::Asleep::enter(&elision, seen) else { continue };
        match set.wait(epfd, deadline, signals, || drop(asleep)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Some(Err(libc::EINTR)),
            Err(_) => {}
        }
    }
}

/// The kernel's `ppoll` with the program's signal mask: ready count or errno.
pub(crate) type KernelPoll<'a> =
    dyn FnMut(&mut [libc::pollfd], Option<Duration>) -> Result<usize, i32> + 'a;

/// `poll`/`ppoll` (and `select` through it) over fds some of which are carried (or epoll sets
/// holding carried fds). `real(fds, timeout)` is the kernel's ppoll with the program's mask,
/// `mask` that mask for the library's own sleep.
pub(crate) fn poll(
    fds: &mut [libc::pollfd],
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    real: &mut KernelPoll<'_>,
) -> Result<usize, i32> {
    let mut set = ServeSet::new();
    let mut ours = false;
    // The served connections, in the order of their fds; whether every fd is one of them
    // (`poll_carried`).
    // Inline for the usual few fds: no allocation per call.
    let mut found: SmallVec<[Arc<Carried>; 4]> = SmallVec::new();
    // Their fds, in the same order (a mixed set has other fds between them).
    let mut found_fds: SmallVec<[c_int; 4]> = SmallVec::new();
    let mut carried = true;
    for p in fds.iter() {
        if p.fd < 0 {
            continue; // poll ignores it
        }
        let k = table::kind(p.fd);
        if k & (EPOLL | EPOLL_INSTANCE) != 0 && k & EPOLL_OBSERVED == 0 {
            observe_set(p.fd);
        }
        let mut served_here = false;
        if k & (CARRIED | REMOTE) != 0 {
            if let Some(c) = served(p.fd) {
                set.add(&c.vs);
                ours = true;
                served_here = !c.handed_over.load(std::sync::atomic::Ordering::Acquire);
                found.push(c);
                found_fds.push(p.fd);
            }
        }
        if !served_here {
            carried = false;
        }
        if k & EPOLL != 0 {
            if let Some(s) = serve_set(p.fd, 0) {
                set.merge(&s);
                ours = true;
            }
        }
    }
    if !ours {
        return real(fds, timeout);
    }
    // A placeholder is a Unix socket, which adds `POLLWRBAND` to `POLLOUT`; TCP never sets it.
    let real = &mut |fds: &mut [libc::pollfd], timeout| {
        let n = real(fds, timeout)?;
        let mut masked = false;
        for p in fds.iter_mut() {
            if p.revents & libc::POLLWRBAND != 0 && found_fds.contains(&p.fd) {
                p.revents &= !libc::POLLWRBAND;
                masked = true;
            }
        }
        Ok(if masked { fds.iter().filter(|p| p.revents != 0).count() } else { n })
    };
    if carried {
        return poll_carried(fds, &found, &set, timeout, mask, real);
    }
    // The kernel reports them beside the program's other fds: their placeholders mirror them.
    arm(found_fds.iter().copied().zip(&found));
    netchannel::flush_sends();
    let handled = signals::snapshot();
    let n = real(fds, Some(Duration::ZERO))?;
    if n > 0 || timeout == Some(Duration::ZERO) {
        return Ok(n);
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut ext: Vec<libc::pollfd> = Vec::with_capacity(fds.len() + 1);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let slept = set.sleep_beside(|waiter| {
            ext.clear();
            ext.extend_from_slice(fds);
            ext.push(libc::pollfd { fd: waiter, events: libc::POLLIN, revents: 0 });
            let r = real(&mut ext, left);
            let last = ext.len() - 1;
            for (p, e) in fds.iter_mut().zip(&ext[..last]) {
                p.revents = e.revents;
            }
            r.map(|n| n - usize::from(ext[last].revents != 0))
        });
        match slept {
            Ok(Some(Ok(n))) if n > 0 => return Ok(n),
            Ok(Some(Err(e))) => return Err(e),
            Ok(_) => {}
            // No waiter for this thread (out of fds): the kernel alone.
            Err(_) => return real(fds, left),
        }
        let n = real(fds, Some(Duration::ZERO))?;
        if n > 0 {
            return Ok(n);
        }
        if signals::handled_since(handled) {
            return Err(libc::EINTR);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(0);
        }
    }
}

/// `poll` over carried fds only: the thread sleeps in its own epoll set (serving the channels)
/// and the connections wake it once a change shows in their placeholders, which the kernel's
/// zero-timeout ppoll then reports exactly. Sleeping in a ppoll beside that epoll set instead
/// (as a mixed set must) makes every thread polling a channel's connections wake for each of
/// its events: an exclusive wake-up counts only for a thread in `epoll_wait`.
fn poll_carried(
    fds: &mut [libc::pollfd],
    carried: &[Arc<Carried>],
    set: &ServeSet,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    real: &mut KernelPoll<'_>,
) -> Result<usize, i32> {
    // While every connection is plainly open, what poll reports is its virtual socket's
    // readability and writability, read here: no token written into a placeholder per arrival
    // and drained per read, no ppoll (three system calls per message of a thread that polls
    // one connection before each read). Any other state (end of stream, an error, a shutdown,
    // still connecting) has the kernel report the placeholders, which mirror it exactly.
    let mut plain = true;
    let mut look = |fds: &mut [libc::pollfd], real: &mut KernelPoll<'_>| {
        if plain {
            if let Some(n) = plain_poll(fds, carried) {
                return Ok(n);
            }
            plain = false;
            arm_for_poll(fds, carried);
        }
        real(fds, Some(Duration::ZERO))
    };
    if timeout == Some(Duration::ZERO) {
        netchannel::flush_sends();
        return look(fds, real);
    }
    let Ok(wake) = netchannel::ThreadWake::current() else {
        // No waiter for this thread (out of fds): the kernel alone.
        arm_for_poll(fds, carried);
        netchannel::flush_sends();
        return real(fds, timeout);
    };
    let deadline = timeout.map(|t| Instant::now() + t);
    let handled = signals::snapshot();
    // No round serves first (`serve_first`): a sleep with channel events queued returns at
    // once with them, and one with none saves the look that would have found nothing.
    let result = loop {
        let mut found = Ok(0);
        let signals =
            SignalPolicy { interruptible: true, mask, handled: Some(signals::handled_count) };
        let slept = set.wait_until(deadline, signals, false, || {
            for c in carried {
                c.add_sleeper(&wake);
            }
            match look(fds, real) {
                Ok(0) => signals::handled_since(handled),
                r => {
                    found = r;
                    true
                }
            }
        });
        if matches!(found, Ok(0)) && signals::handled_since(handled) {
            break Err(libc::EINTR);
        }
        match slept {
            Ok(true) => break found,
            Ok(false) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => break Err(libc::EINTR),
            Err(_) => {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                arm_for_poll(fds, carried);
                break real(fds, left);
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break look(fds, real);
        }
    };
    for c in carried {
        c.remove_sleeper(&wake);
    }
    result
}

/// `carried` (one per non-negative fd of `fds`, in order: every fd of the set is carried) go
/// into a wait the kernel answers: their placeholders mirror them from now on.
fn arm_for_poll(fds: &[libc::pollfd], carried: &[Arc<Carried>]) {
    arm(fds.iter().filter(|p| p.fd >= 0).map(|p| p.fd).zip(carried));
}

/// Each connection's placeholder, under its own fd, mirrors it from now on.
fn arm<'a>(pairs: impl Iterator<Item = (c_int, &'a Arc<Carried>)>) {
    for (fd, c) in pairs {
        c.forbid_elision();
        with_fd(fd, |app| c.arm(app, false));
    }
}

/// The most connections a `poll` answered from the virtual sockets may hold: the answers are
/// gathered on the stack before any is written. Larger sets take the placeholders' path.
const PLAIN_POLL_FDS: usize = 8;

/// `poll`'s answer from the virtual sockets themselves (`carried`: one per non-negative fd, in
/// order), when each is plainly open and they are at most `PLAIN_POLL_FDS`; `None` otherwise.
fn plain_poll(fds: &mut [libc::pollfd], carried: &[Arc<Carried>]) -> Option<usize> {
    // Every answer is known before any is written: a set that is not plain is left as it was.
    let mut revents = [0i16; PLAIN_POLL_FDS];
    if carried.len() > revents.len() {
        return None;
    }
    for (i, (p, c)) in fds.iter().filter(|p| p.fd >= 0).zip(carried).enumerate() {
        revents[i] = c.plain_revents(p.events)?;
    }
    let mut n = 0;
    let mut i = 0;
    for p in fds.iter_mut() {
        p.revents = 0;
        if p.fd >= 0 {
            p.revents = revents[i];
            n += usize::from(p.revents != 0);
            i += 1;
        }
    }
    Some(n)
}

/// Whether any fd of a poll set is the library's business.
pub(crate) fn any_ours(fds: impl IntoIterator<Item = c_int>) -> bool {
    fds.into_iter().any(|fd| table::kind(fd) & (CARRIED | REMOTE | EPOLL | EPOLL_INSTANCE) != 0)
}
