//! The channel listener: accepts TCP connections and runs their handshakes without blocking,
//! many at once on one thread, each with a deadline (`handshake_timeout`). Nothing per peer
//! exists until a handshake is confirmed (with a pre-shared key: until the dialer proved it holds
//! the key).
//!
//! Bounded, and fair between sources (an IPv4 address or IPv6 /64): at most `max_handshakes` in
//! progress and `max_handshakes_per_source` from one source; when every slot is taken, a
//! newcomer from a source holding fewer slots than the busiest one takes that source's oldest
//! slot (so reopening silent connections from one place cannot keep others out). A source
//! already at its channel budget is refused before its handshake starts. When the process is
//! out of file descriptors, the acceptor refuses the waiting connection with a spare fd kept
//! for that and stops accepting for a moment instead of spinning on a listener that keeps
//! failing.

use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{Refusal, SourceKey};
use super::EngineCtx;
use crate::driver::tcp::{Incoming, Progress};
use crate::sys::{Epoll, EventFd, READABLE};
use crate::wire::{Handshake, RejectReason};

const TOKEN_LISTENER: u64 = 0;
const TOKEN_STOP: u64 = 1;
/// How long the listener rests after the process ran out of file descriptors.
const FD_BACKOFF: Duration = Duration::from_millis(100);
/// When a server engine looks for stale control endpoints (`control::remove_stale`).
const SWEEP_AFTER: Duration = Duration::from_secs(1);

/// `control_dir`: where the engine's control endpoint is, swept once for stale ones.
pub(crate) fn run(
    ctx: Arc<EngineCtx>,
    listener: crate::sys::ShedOnFork<TcpListener>,
    stop: Arc<EventFd>,
    control_dir: Option<std::path::PathBuf>,
) {
    if let Err(e) = serve(&ctx, &listener, &stop, control_dir) {
        crate::sys::warn(format_args!("netchannel: channel listener stopped: {e}"));
    }
}

/// A handshake in progress.
struct Pending {
    inc: Incoming,
    source: Option<SourceKey>,
    started: Instant,
}

/// The handshakes in progress, by epoll token, counted per source.
#[derive(Default)]
struct Handshakes {
    pending: HashMap<u64, Pending>,
    per_source: HashMap<SourceKey, usize>,
    next_token: u64,
}

impl Handshakes {
    fn insert(&mut self, epoll: &Epoll, inc: Incoming) -> io::Result<()> {
        let token = self.next_token.max(2);
        self.next_token = token + 1;
        epoll.add(inc.fd(), READABLE, token)?;
        let source = inc.peer.map(SourceKey::of);
        if let Some(s) = source {
            *self.per_source.entry(s).or_insert(0) += 1;
        }
        self.pending.insert(token, Pending { inc, source, started: Instant::now() });
        Ok(())
    }

    fn remove(&mut self, epoll: &Epoll, token: u64) -> Option<Incoming> {
        let p = self.pending.remove(&token)?;
        let _ = epoll.delete(p.inc.fd());
        if let Some(s) = p.source {
            if let Some(n) = self.per_source.get_mut(&s) {
                *n -= 1;
                if *n == 0 {
                    self.per_source.remove(&s);
                }
            }
        }
        Some(p.inc)
    }

    fn from(&self, source: Option<SourceKey>) -> usize {
        source.and_then(|s| self.per_source.get(&s).copied()).unwrap_or(0)
    }

    /// The oldest handshake of the source holding the most slots, if that source holds more
    /// than `than`.
    fn evictable(&self, than: usize) -> Option<u64> {
        let (&busiest, &held) = self.per_source.iter().max_by_key(|(_, &n)| n)?;
        if held <= than {
            return None;
        }
        self.pending
            .iter()
            .filter(|(_, p)| p.source == Some(busiest))
            .min_by_key(|(_, p)| p.started)
            .map(|(&t, _)| t)
    }
}

fn serve(
    ctx: &Arc<EngineCtx>,
    listener: &TcpListener,
    stop: &EventFd,
    control_dir: Option<std::path::PathBuf>,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let epoll = Epoll::new()?;
    epoll.add(listener.as_fd(), READABLE, TOKEN_LISTENER)?;
    epoll.add(stop.as_fd(), READABLE, TOKEN_STOP)?;
    let mut hs = Handshakes::default();
    let mut events = Vec::new();
    let key = ctx.config.psk.clone();
    // Kept open to be closed when the process is out of fds: room to accept one connection
    // and refuse it, rather than leave dialers to time out.
    let mut spare: Option<OwnedFd> = crate::sys::spare_fd().ok();
    let mut resting_until: Option<Instant> = None;
    // Control endpoints left by killed processes are swept once this engine has run a while
    // (a server's: a short-lived client never reads the whole directory).
    let mut sweep = control_dir.map(|dir| (Instant::now() + SWEEP_AFTER, dir));
    loop {
        let mut timeout = hs
            .pending
            .values()
            .map(|p| p.inc.deadline)
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()));
        for t in [resting_until, sweep.as_ref().map(|(t, _)| *t)].into_iter().flatten() {
            let left = t.saturating_duration_since(Instant::now());
            timeout = Some(timeout.map_or(left, |x| x.min(left)));
        }
        events.clear();
        epoll.wait(&mut events, 64, timeout)?;
        if ctx.stopping.load(Ordering::Acquire) {
            return Ok(());
        }
        if sweep.as_ref().is_some_and(|(t, _)| Instant::now() >= *t) {
            if let Some((_, dir)) = sweep.take() {
                super::control::remove_stale(&dir);
            }
        }
        if resting_until.is_some_and(|t| Instant::now() >= t) {
            resting_until = None;
            epoll.add(listener.as_fd(), READABLE, TOKEN_LISTENER)?;
        }
        for &(token, _) in &events {
            match token {
                TOKEN_STOP => return Ok(()),
                TOKEN_LISTENER => {
                    if accept_all(ctx, listener, &epoll, &mut hs, &mut spare) {
                        // Out of fds: rest, level-triggered interest removed meanwhile.
                        let _ = epoll.delete(listener.as_fd());
                        resting_until = Some(Instant::now() + FD_BACKOFF);
                    }
                }
                token => {
                    let Some(p) = hs.pending.get_mut(&token) else { continue };
                    let mut check = |h: &Handshake| ctx.check_hello(h);
                    match p.inc.advance(ctx.id, key.as_deref(), &ctx.tcp_options, &mut check) {
                        Progress::Pending => {}
                        Progress::Failed(why) => {
                            let inc = hs.remove(&epoll, token).expect("present");
                            ctx.handshake_failed(inc.peer, why);
                        }
                        Progress::Confirmed(hello) => {
                            let inc = hs.remove(&epoll, token).expect("present");
                            ctx.admit(inc, hello);
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        let expired: Vec<u64> =
            hs.pending.iter().filter(|(_, p)| p.inc.deadline <= now).map(|(&t, _)| t).collect();
        for t in expired {
            let inc = hs.remove(&epoll, t).expect("present");
            ctx.handshake_failed(inc.peer, "handshake timed out".into());
        }
    }
}

/// Accepts every waiting connection and starts its handshake, or refuses it. Returns true when
/// the process ran out of file descriptors (the caller rests).
fn accept_all(
    ctx: &Arc<EngineCtx>,
    listener: &TcpListener,
    epoll: &Epoll,
    hs: &mut Handshakes,
    spare: &mut Option<OwnedFd>,
) -> bool {
    let reject =
        |sock: &std::net::TcpStream, reason| crate::driver::tcp::reject(sock, ctx.id, reason);
    loop {
        let sock = match crate::sys::tcp_accept(listener) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if crate::sys::out_of_fds(&e) => {
                ctx.refused("out of file descriptors");
                // Free the spare, take the waiting connection and refuse it, then keep a spare
                // again (if fds allow).
                if spare.take().is_some() {
                    if let Ok(s) = crate::sys::tcp_accept(listener) {
                        reject(&s, RejectReason::Limit);
                    }
                    *spare = crate::sys::spare_fd().ok();
                }
                return true;
            }
            // Out of memory or a connection that died while waiting: leave it for a moment.
            Err(_) => return false,
        };
        let source = sock.peer_addr().ok().map(SourceKey::of);
        if let Some(s) = source {
            match ctx.channel_budget.has_room(s) {
                // Every place is taken, but a peer's extra channel can make room for a new
                // peer's first: only the hello says which this is (`admit`).
                Err(Refusal::EngineFull) if ctx.can_shed() => {}
                Err(why) => {
                    ctx.refused(why.reason());
                    reject(&sock, RejectReason::Limit);
                    continue;
                }
                Ok(()) => {}
            }
        }
        let held = hs.from(source);
        if held >= ctx.config.max_handshakes_per_source {
            ctx.refused("handshakes in progress at the per-source limit");
            reject(&sock, RejectReason::Limit);
            continue;
        }
        if hs.pending.len() >= ctx.config.max_handshakes {
            // A quieter source takes the oldest slot of the busiest one.
            match hs.evictable(held + 1) {
                Some(token) => {
                    let mut old = hs.remove(epoll, token).expect("present");
                    old.refuse(ctx.id, RejectReason::Limit);
                    ctx.refused("handshake evicted for a quieter source");
                }
                None => {
                    ctx.refused("handshakes in progress at the limit");
                    reject(&sock, RejectReason::Limit);
                    continue;
                }
            }
        }
        let advertised = ctx.config.advertised_addr;
        let Ok(inc) = Incoming::new(sock, ctx.config.handshake_timeout, advertised) else {
            continue;
        };
        let _ = hs.insert(epoll, inc);
    }
}
