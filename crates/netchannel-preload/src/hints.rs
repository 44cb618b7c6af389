//! What the processes of a host learnt about destinations left to kernel TCP, shared: no engine
//! there, silence at its channel port, or a listener that asked for kernel TCP (a forked
//! server). Each process keeps its own map (`connect::NO_ENGINE`); this file lets a new process
//! start from what another one learnt, instead of paying it again: the dial timeout (250 ms) at
//! a host that drops the channel port, a relayed first connection to a forked server, an engine
//! started and a round trip for a host with none. A shell loop of short-lived clients paid each
//! of these once per run.
//!
//! One file per network namespace (a namespace is a host: its destinations are its own) in the
//! user's private control directory (`netchannel::control::default_control_dir`, mode 0700):
//! 4,096 slots of 64 bytes, a destination's slot picked by hash. A slot holds one destination,
//! its kind, when it expires and the wait that led to it (silences double it), and a checksum:
//! a torn or foreign slot reads as empty, and two destinations that share a slot only forget
//! each other. The file's size is fixed, so what it costs does not grow with destinations;
//! other namespaces' files unused for a day are removed when a process creates its own. A file
//! is per namespace and channel port (`netchannel run --port`).

use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const SLOTS: u64 = 4096;
const SLOT: usize = 64;
/// Bytes a slot's checksum covers (the checksum follows them).
const BODY: usize = 32;

/// Why a destination is left to kernel TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Its engine refused (none there, or no listener on that port).
    Refused = 1,
    /// Nothing answered at its channel port within the dial timeout.
    Silent = 2,
    /// Its listener asked for kernel TCP (forked processes serve it).
    Forked = 3,
}

/// A destination's hint: its kind, how much longer it holds, and the wait it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hint {
    pub kind: Kind,
    pub remaining: Duration,
    pub wait: Duration,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// The destination's address and port as slot bytes (IPv4 in its IPv6-mapped form, so that a
/// connect through either family finds it).
fn key(dest: SocketAddr) -> [u8; 18] {
    let ip = match dest.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut k = [0u8; 18];
    k[..16].copy_from_slice(&ip.octets());
    k[16..].copy_from_slice(&dest.port().to_be_bytes());
    k
}

fn slot_offset(k: &[u8; 18]) -> u64 {
    fnv1a(k) % SLOTS * SLOT as u64
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn encode(k: &[u8; 18], kind: Kind, until_ms: u64, wait: Duration) -> [u8; SLOT] {
    let mut s = [0u8; SLOT];
    s[..18].copy_from_slice(k);
    s[18] = kind as u8;
    s[20..24].copy_from_slice(&(wait.as_millis().min(u32::MAX as u128) as u32).to_le_bytes());
    s[24..32].copy_from_slice(&until_ms.to_le_bytes());
    let sum = fnv1a(&s[..BODY]);
    s[BODY..BODY + 8].copy_from_slice(&sum.to_le_bytes());
    s
}

/// The hint a slot holds for `k` at `now_ms`, if it is intact, `k`'s, and not expired.
fn decode(s: &[u8; SLOT], k: &[u8; 18], now_ms: u64) -> Option<Hint> {
    let sum = u64::from_le_bytes(s[BODY..BODY + 8].try_into().ok()?);
    if sum != fnv1a(&s[..BODY]) || s[..18] != k[..] {
        return None;
    }
    let kind = match s[18] {
        1 => Kind::Refused,
        2 => Kind::Silent,
        3 => Kind::Forked,
        _ => return None,
    };
    let wait = Duration::from_millis(u32::from_le_bytes(s[20..24].try_into().ok()?).into());
    let until = u64::from_le_bytes(s[24..32].try_into().ok()?);
    // A hint never holds beyond its own wait from now (a clock set back, a damaged slot).
    let remaining = Duration::from_millis(until.checked_sub(now_ms)?).min(wait);
    (!remaining.is_zero()).then_some(Hint { kind, remaining, wait })
}

/// The network namespace this process is in (its inode), which names its host's file.
fn netns() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/net").ok()?;
    let s = link.to_str()?;
    Some(s.strip_prefix("net:[")?.strip_suffix(']')?.to_string())
}

/// The host's file, opened (created if need be) on first use; `None` where it cannot be (no
/// control directory of this user's, no /proc): then each process keeps to its own map.
fn file() -> Option<&'static File> {
    if cfg!(test) {
        // Unit tests make up destinations: they must not tell the host's processes about them.
        return None;
    }
    static FILE: OnceLock<Option<File>> = OnceLock::new();
    if let Some(f) = FILE.get() {
        return f.as_ref();
    }
    // Opened outside the cell's lock (only the store takes it): a fork while a thread opens
    // it must not leave the child waiting on a lock nobody will release.
    let _ = FILE.set(open_file());
    FILE.get().and_then(Option::as_ref)
}

fn open_file() -> Option<File> {
    let dir = netchannel::control::default_control_dir();
    netchannel::control::private_dir(&dir).ok()?;
    // Per channel port too: processes asking another port learn of other engines.
    let port = crate::process::settings().channel_port;
    let path = dir.join(format!("hints-{}-{port}", netns()?));
    if std::fs::symlink_metadata(&path).is_err() {
        // Only the namespace's first process looks (a stat per file in the directory: a test
        // host held 500 of them, and every short-lived client paid that).
        remove_stale(&dir, &path);
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .ok()?;
    if f.metadata().ok()?.len() < SLOTS * SLOT as u64 {
        f.set_len(SLOTS * SLOT as u64).ok()?;
    }
    // Opened now: not stale for another day, whether written or not.
    let _ = f.set_modified(SystemTime::now());
    // Above the program's fds, as all of the library's are.
    Some(File::from(crate::process::relocate(OwnedFd::from(f))))
}

/// Removes other namespaces' files nobody opened or wrote to for a day: every hint in them
/// has expired (none holds beyond a minute), and namespaces come and go (containers, tests).
/// A process that kept one open that long without a write loses only the sharing (it writes
/// to the removed file; the namespace's new processes make another).
fn remove_stale(dir: &std::path::Path, ours: &std::path::Path) {
    const STALE: Duration = Duration::from_secs(24 * 3600);
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if !e.file_name().to_str().is_some_and(|n| n.starts_with("hints-")) || path == ours {
            continue;
        }
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE));
        if old {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What another process (or this one) learnt about `dest`, if it still holds.
pub(crate) fn lookup(dest: SocketAddr) -> Option<Hint> {
    let f = file()?;
    let k = key(dest);
    let mut s = [0u8; SLOT];
    f.read_exact_at(&mut s, slot_offset(&k)).ok()?;
    decode(&s, &k, now_ms())
}

/// `dest` is left to kernel TCP for `wait`, for every process of the host.
pub(crate) fn record(dest: SocketAddr, kind: Kind, wait: Duration) {
    let Some(f) = file() else { return };
    let k = key(dest);
    let until = now_ms().saturating_add(wait.as_millis() as u64);
    let _ = f.write_all_at(&encode(&k, kind, until, wait), slot_offset(&k));
}

/// `dest`'s engine took a connection: its hint, if its slot holds one, goes.
pub(crate) fn clear(dest: SocketAddr) {
    let Some(f) = file() else { return };
    let k = key(dest);
    let mut s = [0u8; SLOT];
    if f.read_exact_at(&mut s, slot_offset(&k)).is_ok() && s[..18] == k[..] {
        let _ = f.write_all_at(&[0u8; SLOT], slot_offset(&k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_reject_what_is_not_theirs() {
        let a: SocketAddr = "10.1.2.3:80".parse().unwrap();
        let b: SocketAddr = "10.1.2.3:81".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.1.2.3]:80".parse().unwrap();
        let wait = Duration::from_secs(8);
        let s = encode(&key(a), Kind::Silent, 1_000_000 + 5_000, wait);
        let h = decode(&s, &key(a), 1_000_000).unwrap();
        assert_eq!((h.kind, h.remaining, h.wait), (Kind::Silent, Duration::from_secs(5), wait));
        assert_eq!(decode(&s, &key(mapped), 1_000_000), Some(h), "either family finds it");
        assert_eq!(decode(&s, &key(b), 1_000_000), None, "another destination's slot");
        assert_eq!(decode(&s, &key(a), 1_005_000), None, "expired");
        // A clock set back does not make a hint outlive its wait.
        assert_eq!(decode(&s, &key(a), 0).unwrap().remaining, wait);
        // Any damaged byte, or an empty slot, reads as nothing.
        for i in 0..BODY + 8 {
            let mut t = s;
            t[i] ^= 0x40;
            assert_eq!(decode(&t, &key(a), 1_000_000), None, "byte {i}");
        }
        assert_eq!(decode(&[0u8; SLOT], &key(a), 1_000_000), None);
    }
}
