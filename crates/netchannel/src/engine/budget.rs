//! Budgets of what peers can make the engine hold that the protocol core does not see: file
//! descriptors (channels, one fd each), per source address and engine-wide.
//!
//! A channel holds a [`ChannelTicket`] for as long as it exists; the ticket goes back when the
//! channel (and with it its sockets) is dropped, so the count follows the fds actually open.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Where a connection comes from, for per-source limits: an IPv4 address, or the /64 prefix of
/// an IPv6 one (a host usually owns a whole /64, so single addresses would not limit it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SourceKey(u128);

impl SourceKey {
    pub fn of(addr: SocketAddr) -> SourceKey {
        match addr.ip() {
            IpAddr::V4(v4) => SourceKey(u32::from(v4) as u128),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => SourceKey(u32::from(v4) as u128),
                None => SourceKey((u128::from(v6) >> 64 << 64) | 1 << 32),
            },
        }
    }
}

/// Open channels, engine-wide and per source.
pub(crate) struct ChannelBudget {
    total: AtomicUsize,
    max_total: usize,
    per_source: Mutex<HashMap<SourceKey, usize>>,
    max_per_source: usize,
}

/// One channel's place in the budget, given back on drop.
pub(crate) struct ChannelTicket {
    budget: Arc<ChannelBudget>,
    source: Option<SourceKey>,
}

/// Why a channel was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    EngineFull,
    /// A session's second or later channel, with only the places kept for new peers left.
    KeptForNewPeers,
    SourceFull,
}

impl Refusal {
    /// What the engine's counters (`netchannel stat`) call it.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::EngineFull => "channels at max_channels_total",
            Refusal::KeptForNewPeers => {
                "channels at max_channels_total less the new peers' quarter"
            }
            Refusal::SourceFull => "channels at max_channels_per_source",
        }
    }
}

/// Whether a channel opens a session (a peer's first) or adds to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    FirstOfSession,
    More,
}

impl ChannelBudget {
    pub fn new(max_total: usize, max_per_source: usize) -> Arc<ChannelBudget> {
        Arc::new(ChannelBudget {
            total: AtomicUsize::new(0),
            max_total,
            per_source: Mutex::new(HashMap::new()),
            max_per_source,
        })
    }

    /// Places only a session's first channel may take: a quarter of the budget. Peers that
    /// already have a channel fill at most the rest with their others, so an engine full of
    /// multi-channel sessions still admits new peers (each with one channel, which is enough to
    /// work) instead of refusing them.
    fn kept_for_new_peers(&self) -> usize {
        self.max_total / 4
    }

    /// A place for one more channel: from `source` (an accepted channel), or `None` (one this
    /// engine dials, counted engine-wide only).
    pub fn take(
        self: &Arc<Self>,
        source: Option<SourceKey>,
        purpose: Purpose,
    ) -> Result<ChannelTicket, Refusal> {
        let mut per = self.per_source.lock();
        let total = self.total.load(Ordering::Relaxed);
        if total >= self.max_total {
            return Err(Refusal::EngineFull);
        }
        if purpose == Purpose::More && total >= self.max_total - self.kept_for_new_peers() {
            return Err(Refusal::KeptForNewPeers);
        }
        if let Some(s) = source {
            let n = per.entry(s).or_insert(0);
            if *n >= self.max_per_source {
                return Err(Refusal::SourceFull);
            }
            *n += 1;
        }
        self.total.fetch_add(1, Ordering::Relaxed);
        Ok(ChannelTicket { budget: self.clone(), source })
    }

    /// Whether `source` could get a place now (checked before a handshake starts).
    pub fn has_room(&self, source: SourceKey) -> Result<(), Refusal> {
        let per = self.per_source.lock();
        if self.total.load(Ordering::Relaxed) >= self.max_total {
            return Err(Refusal::EngineFull);
        }
        if per.get(&source).is_some_and(|&n| n >= self.max_per_source) {
            return Err(Refusal::SourceFull);
        }
        Ok(())
    }

    /// Channels holding a place.
    pub fn in_use(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }

    pub fn max_total(&self) -> usize {
        self.max_total
    }
}

impl Drop for ChannelTicket {
    fn drop(&mut self) {
        let mut per = self.budget.per_source.lock();
        if let Some(s) = self.source {
            if let Some(n) = per.get_mut(&s) {
                *n -= 1;
                if *n == 0 {
                    per.remove(&s);
                }
            }
        }
        self.budget.total.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_per_source_and_in_all_and_come_back() {
        let b = ChannelBudget::new(3, 2);
        let a = SourceKey::of("10.0.0.1:5".parse().unwrap());
        let c = SourceKey::of("10.0.0.2:5".parse().unwrap());
        let first = Purpose::FirstOfSession;
        let t1 = b.take(Some(a), first).unwrap();
        let _t2 = b.take(Some(a), first).unwrap();
        assert_eq!(b.take(Some(a), first).err(), Some(Refusal::SourceFull));
        let _t3 = b.take(Some(c), first).unwrap();
        assert_eq!(b.take(None, first).err(), Some(Refusal::EngineFull));
        drop(t1);
        assert_eq!(b.in_use(), 2);
        assert!(b.take(Some(a), first).is_ok());
    }

    #[test]
    fn a_quarter_of_the_places_waits_for_new_peers() {
        let b = ChannelBudget::new(8, 100);
        let old = SourceKey::of("10.0.0.1:5".parse().unwrap());
        let held: Vec<_> = (0..6).map_while(|_| b.take(Some(old), Purpose::More).ok()).collect();
        assert_eq!(held.len(), 6, "more channels of known peers fill three quarters");
        assert_eq!(b.take(Some(old), Purpose::More).err(), Some(Refusal::KeptForNewPeers));
        let new = |i: u8| SourceKey::of(std::net::SocketAddr::from(([10, 0, 1, i], 5)));
        let _p = b.take(Some(new(1)), Purpose::FirstOfSession).unwrap();
        let _q = b.take(Some(new(2)), Purpose::FirstOfSession).unwrap();
        assert_eq!(b.take(Some(new(3)), Purpose::FirstOfSession).err(), Some(Refusal::EngineFull));
        drop(held);
        assert!(b.take(Some(old), Purpose::More).is_ok(), "places come back to everyone");
    }

    #[test]
    fn ipv6_sources_are_their_64_prefix() {
        let x = SourceKey::of("[2001:db8::1]:1".parse().unwrap());
        let y = SourceKey::of("[2001:db8::ffff:2]:1".parse().unwrap());
        let z = SourceKey::of("[2001:db8:0:1::1]:1".parse().unwrap());
        assert_eq!(x, y);
        assert_ne!(x, z);
        let v4 = SourceKey::of("10.0.0.1:1".parse().unwrap());
        let mapped = SourceKey::of("[::ffff:10.0.0.1]:1".parse().unwrap());
        assert_eq!(v4, mapped);
    }
}
