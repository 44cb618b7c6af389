//! The channel handshake: the first messages each side writes on a new channel (version 6).
//!
//! Four fixed-size messages: the dialer's `Hello`, the acceptor's `Challenge`, the dialer's
//! `Confirm`, and the acceptor's `Accept`; either side may answer `Reject` instead. With a
//! pre-shared key, `Confirm` and `Accept` each carry an HMAC-SHA256 over a transcript that binds
//! both roles (who dialed, who accepted: their engine ids in that order, and a label per role),
//! both nonces, the channel, its incarnation and class, and the address the dialer dialed (which
//! the acceptor knows as the address it accepted on): the dialer proves it holds the key before
//! the acceptor grants it anything, then the acceptor proves it, and its `Accept` also says the
//! channel was admitted. Layout (big-endian), see docs/PROTOCOL.md:
//!
//! ```text
//!  0  magic        [u8; 4] = "NCHN"
//!  4  version      u16 = 6
//!  6  kind         u8   1 Hello, 2 Challenge, 3 Reject, 4 Confirm, 5 Accept
//!  7  class        u8   0 Throughput, 1 Latency
//!  8  engine_id    u64
//! 16  channel      u16  channel index within the session (< 64)
//! 18  incarnation  u16  Reject: the reason; otherwise the channel's incarnation
//! 20  flags        u32  bit 0: the sender authenticates (holds a pre-shared key)
//! 24  nonce        [u8; 16]  fresh random bytes (Hello, Challenge)
//! 40  mac          [u8; 32]  HMAC-SHA256 (Confirm, Accept with a key), else zero
//! ```

use std::net::{IpAddr, SocketAddr};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{Class, WireError};

/// First bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"NCHN";
/// The protocol version this engine speaks.
pub const VERSION: u16 = 6;
/// Bytes of every handshake message.
pub const HANDSHAKE_LEN: usize = 72;
/// Channel indexes are bits of 64-bit masks.
pub const MAX_CHANNEL_INDEX: u16 = 63;
/// Flag: the sender authenticates (holds a pre-shared key).
pub const FLAG_AUTH: u32 = 1;
/// Most engine ids one engine presents: its own and one per session shard beyond the first.
pub const MAX_SHARD_IDS: u16 = 64;
/// The bits of an engine id a shard changes (the top six): the rest identify the engine.
const SHARD_SHIFT: u32 = 58;

/// The engine id a session shard presents to its peer: `engine_id` itself for shard 0, for
/// the others `engine_id` with its top six bits changed, so that the peer keys each shard as
/// a session of its own and still tells which engine it belongs to (`engine_key`).
pub fn shard_engine_id(engine_id: u64, shard: u16) -> u64 {
    engine_id ^ (u64::from(shard % MAX_SHARD_IDS) << SHARD_SHIFT)
}

/// What every id of one engine (its own and its shards') has in common.
pub fn engine_key(id: u64) -> u64 {
    id & ((1 << SHARD_SHIFT) - 1)
}

/// The bits of an id that tell an engine's shards apart (six; random between engines).
pub fn shard_bits(id: u64) -> u64 {
    id >> SHARD_SHIFT
}

/// Whether `a` and `b` are ids of one engine (its own, or one of its shards'): a handshake
/// answered with such an id is a connection to itself or a reflection.
pub fn same_engine(a: u64, b: u64) -> bool {
    engine_key(a) == engine_key(b)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// Which message of the handshake.
pub enum HandshakeKind {
    /// The dialer's first message.
    Hello,
    /// The acceptor's answer, with its nonce.
    Challenge,
    /// Either side refuses, with a reason.
    Reject(RejectReason),
    /// The dialer's proof.
    Confirm,
    /// The acceptor admitted the channel (with its proof).
    Accept,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// Why a handshake was refused.
pub enum RejectReason {
    /// Not a netchannel engine.
    BadMagic,
    /// Another protocol version.
    UnsupportedVersion,
    /// A field out of range or inconsistent.
    BadField,
    /// The acceptor is at a resource limit (channels, sessions, handshakes in progress).
    Limit,
    /// The peer did not prove it holds the pre-shared key (or holds another one).
    AuthFailed,
    /// A code this version does not know.
    Unknown(u16),
}

impl RejectReason {
    fn code(self) -> u16 {
        match self {
            RejectReason::BadMagic => 1,
            RejectReason::UnsupportedVersion => 2,
            RejectReason::BadField => 3,
            RejectReason::Limit => 4,
            RejectReason::AuthFailed => 5,
            RejectReason::Unknown(n) => n,
        }
    }
    fn from_code(n: u16) -> Self {
        match n {
            1 => RejectReason::BadMagic,
            2 => RejectReason::UnsupportedVersion,
            3 => RejectReason::BadField,
            4 => RejectReason::Limit,
            5 => RejectReason::AuthFailed,
            n => RejectReason::Unknown(n),
        }
    }
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RejectReason::BadMagic => write!(f, "bad magic"),
            RejectReason::UnsupportedVersion => write!(f, "unsupported protocol version"),
            RejectReason::BadField => write!(f, "invalid handshake field"),
            RejectReason::Limit => write!(f, "resource limit reached"),
            RejectReason::AuthFailed => write!(f, "authentication failed"),
            RejectReason::Unknown(n) => write!(f, "unknown reason {n}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// One handshake message (see the module doc for the layout).
pub struct Handshake {
    /// Protocol version.
    pub version: u16,
    /// Which message.
    pub kind: HandshakeKind,
    /// Class of the channel.
    pub class: Class,
    /// The sender's engine id.
    pub engine_id: u64,
    /// Channel index within the session.
    pub channel: u16,
    /// How many times this index was dialed before (0 for a Reject).
    pub incarnation: u16,
    /// `FLAG_AUTH` or 0.
    pub flags: u32,
    /// Fresh random bytes (Hello, Challenge).
    pub nonce: [u8; 16],
    /// HMAC-SHA256 proof (Confirm, Accept with a key).
    pub mac: [u8; 32],
}

impl Handshake {
    fn new(kind: HandshakeKind, engine_id: u64, channel: u16, class: Class) -> Self {
        Handshake {
            version: VERSION,
            kind,
            class,
            engine_id,
            channel,
            incarnation: 0,
            flags: 0,
            nonce: [0; 16],
            mac: [0; 32],
        }
    }

    /// The dialer's Hello for channel `channel` (its `incarnation`); `auth`: it holds a key.
    pub fn hello(
        engine_id: u64,
        channel: u16,
        incarnation: u16,
        class: Class,
        nonce: [u8; 16],
        auth: bool,
    ) -> Self {
        let mut h = Handshake::new(HandshakeKind::Hello, engine_id, channel, class);
        h.incarnation = incarnation;
        h.nonce = nonce;
        h.flags = if auth { FLAG_AUTH } else { 0 };
        h
    }

    /// The acceptor's answer to `hello`: its id and nonce; `auth` says it requires a proof.
    pub fn challenge(engine_id: u64, hello: &Handshake, nonce: [u8; 16], auth: bool) -> Self {
        let mut h = Handshake::new(HandshakeKind::Challenge, engine_id, hello.channel, hello.class);
        h.incarnation = hello.incarnation;
        h.nonce = nonce;
        h.flags = if auth { FLAG_AUTH } else { 0 };
        h
    }

    /// The dialer's answer to the challenge; with a key, it carries the dialer's proof over
    /// the transcript, `acceptor` being the address it dialed.
    pub fn confirm(
        hello: &Handshake,
        challenge: &Handshake,
        key: Option<&[u8]>,
        acceptor: SocketAddr,
    ) -> Self {
        let mut h = Handshake::confirm_unkeyed(hello);
        if let Some(key) = key {
            h.flags = FLAG_AUTH;
            h.mac = proof(key, CONFIRM, hello, challenge, acceptor);
        }
        h
    }

    /// A Confirm without a key: it depends on the Hello alone, so a dialer without a key sends
    /// it with its Hello and the handshake takes one round trip, not two.
    pub fn confirm_unkeyed(hello: &Handshake) -> Self {
        let mut h =
            Handshake::new(HandshakeKind::Confirm, hello.engine_id, hello.channel, hello.class);
        h.incarnation = hello.incarnation;
        h
    }

    /// The acceptor admitted the channel; with a key, it carries the acceptor's proof,
    /// `acceptor` being the address it accepted the channel on.
    pub fn accept(
        hello: &Handshake,
        challenge: &Handshake,
        key: Option<&[u8]>,
        acceptor: SocketAddr,
    ) -> Self {
        let mut h =
            Handshake::new(HandshakeKind::Accept, challenge.engine_id, hello.channel, hello.class);
        h.incarnation = hello.incarnation;
        if let Some(key) = key {
            h.flags = FLAG_AUTH;
            h.mac = proof(key, ACCEPT, hello, challenge, acceptor);
        }
        h
    }

    /// A refusal with `reason`.
    pub fn reject(engine_id: u64, reason: RejectReason) -> Self {
        Handshake::new(HandshakeKind::Reject(reason), engine_id, 0, Class::Throughput)
    }

    /// Checks the acceptor's proof in `accept` (dialer side; `acceptor`: the address dialed).
    pub fn verify_accept(
        key: &[u8],
        hello: &Handshake,
        challenge: &Handshake,
        accept: &Handshake,
        acceptor: SocketAddr,
    ) -> bool {
        accept.flags & FLAG_AUTH != 0
            && accept.engine_id == challenge.engine_id
            && accept.incarnation == hello.incarnation
            && verify(key, ACCEPT, hello, challenge, acceptor, &accept.mac)
    }

    /// Checks the dialer's proof in `confirm` (acceptor side; `acceptor`: the address the
    /// channel was accepted on).
    pub fn verify_confirm(
        key: &[u8],
        hello: &Handshake,
        challenge: &Handshake,
        confirm: &Handshake,
        acceptor: SocketAddr,
    ) -> bool {
        confirm.flags & FLAG_AUTH != 0
            && confirm.engine_id == hello.engine_id
            && confirm.incarnation == hello.incarnation
            && verify(key, CONFIRM, hello, challenge, acceptor, &confirm.mac)
    }

    /// The message's bytes.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_be_bytes());
        let (kind, field) = match self.kind {
            HandshakeKind::Hello => (1, self.incarnation),
            HandshakeKind::Challenge => (2, self.incarnation),
            HandshakeKind::Reject(r) => (3, r.code()),
            HandshakeKind::Confirm => (4, self.incarnation),
            HandshakeKind::Accept => (5, self.incarnation),
        };
        out[6] = kind;
        out[7] = self.class.code();
        out[8..16].copy_from_slice(&self.engine_id.to_be_bytes());
        out[16..18].copy_from_slice(&self.channel.to_be_bytes());
        out[18..20].copy_from_slice(&field.to_be_bytes());
        out[20..24].copy_from_slice(&self.flags.to_be_bytes());
        out[24..40].copy_from_slice(&self.nonce);
        out[40..72].copy_from_slice(&self.mac);
        out
    }

    /// Parses and validates a handshake message. Magic is checked first and version second, so
    /// the error says exactly why a peer is refused; a different version is reported with the
    /// version the peer speaks, before any other field is interpreted. A version-1 peer sends
    /// only 24 bytes: it is recognised from the first 6, so callers read those first.
    pub fn decode(buf: &[u8; HANDSHAKE_LEN]) -> Result<Self, WireError> {
        check_prefix(buf[..6].try_into().expect("6 bytes"))?;
        let field = u16::from_be_bytes([buf[18], buf[19]]);
        let kind = match buf[6] {
            1 => HandshakeKind::Hello,
            2 => HandshakeKind::Challenge,
            3 => HandshakeKind::Reject(RejectReason::from_code(field)),
            4 => HandshakeKind::Confirm,
            5 => HandshakeKind::Accept,
            k => return Err(WireError::BadField { field: "handshake kind", value: k as u64 }),
        };
        let incarnation = if matches!(kind, HandshakeKind::Reject(_)) { 0 } else { field };
        let class = Class::from_code(buf[7])
            .ok_or(WireError::BadField { field: "class", value: buf[7] as u64 })?;
        let engine_id = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
        let channel = u16::from_be_bytes([buf[16], buf[17]]);
        if channel > MAX_CHANNEL_INDEX {
            return Err(WireError::BadField { field: "channel index", value: channel as u64 });
        }
        let flags = u32::from_be_bytes(buf[20..24].try_into().expect("4 bytes"));
        if flags & !FLAG_AUTH != 0 {
            return Err(WireError::BadField { field: "handshake flags", value: flags as u64 });
        }
        Ok(Handshake {
            version: VERSION,
            kind,
            class,
            engine_id,
            channel,
            incarnation,
            flags,
            nonce: buf[24..40].try_into().expect("16 bytes"),
            mac: buf[40..72].try_into().expect("32 bytes"),
        })
    }

    /// The reject reason matching a parse error.
    pub fn reject_reason(err: &WireError) -> RejectReason {
        match err {
            WireError::BadMagic => RejectReason::BadMagic,
            WireError::UnsupportedVersion(_) => RejectReason::UnsupportedVersion,
            _ => RejectReason::BadField,
        }
    }
}

/// Checks magic and version from the first 6 bytes of any handshake message, so a peer of
/// another version is named before the rest of its (differently sized) message is read.
pub fn check_prefix(prefix: &[u8; 6]) -> Result<(), WireError> {
    if prefix[0..4] != MAGIC {
        return Err(WireError::BadMagic);
    }
    let version = u16::from_be_bytes([prefix[4], prefix[5]]);
    if version != VERSION {
        return Err(WireError::UnsupportedVersion(version));
    }
    Ok(())
}

type HmacSha256 = Hmac<Sha256>;

/// The dialer's role: it proves the key first, in its Confirm.
const CONFIRM: &[u8] = b"netchannel v3 dialer confirms";
/// The acceptor's role: it proves the key in its Accept.
const ACCEPT: &[u8] = b"netchannel v3 acceptor accepts";

/// An address as the transcript holds it: family, address bytes, port. An IPv4-mapped IPv6
/// address is its IPv4 address (one host, either way a socket reports it).
fn address_bytes(a: SocketAddr, out: &mut Vec<u8>) {
    let ip = match a.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
    out.extend_from_slice(&a.port().to_be_bytes());
}

/// The transcript both proofs cover: who dialed (the Hello's engine id) and who accepted (the
/// Challenge's), in that order, both nonces, the channel, its incarnation and class, and the
/// acceptor's address as the dialer dialed it. Each field has a fixed size, so no two
/// transcripts read alike.
fn keyed(
    key: &[u8],
    label: &[u8],
    hello: &Handshake,
    challenge: &Handshake,
    acceptor: SocketAddr,
) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts any key length");
    let mut t = Vec::with_capacity(96);
    t.extend_from_slice(label);
    t.extend_from_slice(&hello.engine_id.to_be_bytes());
    t.extend_from_slice(&challenge.engine_id.to_be_bytes());
    t.extend_from_slice(&hello.nonce);
    t.extend_from_slice(&challenge.nonce);
    t.extend_from_slice(&hello.channel.to_be_bytes());
    t.extend_from_slice(&hello.incarnation.to_be_bytes());
    t.push(hello.class.code());
    address_bytes(acceptor, &mut t);
    mac.update(&t);
    mac
}

fn proof(
    key: &[u8],
    label: &[u8],
    hello: &Handshake,
    challenge: &Handshake,
    acceptor: SocketAddr,
) -> [u8; 32] {
    keyed(key, label, hello, challenge, acceptor).finalize().into_bytes().into()
}

fn verify(
    key: &[u8],
    label: &[u8],
    hello: &Handshake,
    challenge: &Handshake,
    acceptor: SocketAddr,
    mac: &[u8],
) -> bool {
    // Constant-time comparison, from the hmac crate.
    keyed(key, label, hello, challenge, acceptor).verify_slice(mac).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Handshake {
        Handshake::hello(7, 3, 2, Class::Latency, [1; 16], true)
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn shard_ids_are_distinct_and_of_one_engine() {
        for engine in [1u64, 0x0123_4567_89ab_cdef, u64::MAX] {
            let ids: Vec<u64> = (0..MAX_SHARD_IDS).map(|k| shard_engine_id(engine, k)).collect();
            assert_eq!(ids[0], engine);
            let mut unique = ids.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), ids.len());
            assert!(ids.iter().all(|&a| ids.iter().all(|&b| same_engine(a, b))));
            assert!(!same_engine(engine, engine ^ 1));
            assert!(!same_engine(engine, engine ^ (1 << 57)));
        }
    }

    #[test]
    fn round_trip() {
        let h = hello();
        let c = Handshake::challenge(u64::MAX, &h, [2; 16], true);
        let at = addr("10.0.0.2:7450");
        for hs in [
            h,
            c,
            Handshake::confirm(&h, &c, Some(b"key"), at),
            Handshake::accept(&h, &c, Some(b"key"), at),
            Handshake::reject(1, RejectReason::UnsupportedVersion),
            Handshake::reject(1, RejectReason::AuthFailed),
        ] {
            assert_eq!(Handshake::decode(&hs.encode()).unwrap(), hs);
        }
        assert_eq!(c.incarnation, 2, "the challenge echoes the incarnation");
    }

    #[test]
    fn proofs_need_the_same_key_and_the_same_nonces() {
        let h = hello();
        let at = addr("10.0.0.2:7450");
        let ch = Handshake::challenge(9, &h, [2; 16], true);
        let c = Handshake::confirm(&h, &ch, Some(b"secret"), at);
        assert!(Handshake::verify_confirm(b"secret", &h, &ch, &c, at));
        assert!(!Handshake::verify_confirm(b"other", &h, &ch, &c, at));
        let a = Handshake::accept(&h, &ch, Some(b"secret"), at);
        assert!(Handshake::verify_accept(b"secret", &h, &ch, &a, at));
        assert!(!Handshake::verify_accept(b"other", &h, &ch, &a, at));
        // A confirm recorded for one acceptor nonce is worthless for another (no replay).
        let ch2 = Handshake::challenge(9, &h, [3; 16], true);
        assert!(!Handshake::verify_confirm(b"secret", &h, &ch2, &c, at));
        // The accept's proof cannot be reused as a confirm (labels differ).
        let mut forged = c;
        forged.mac = a.mac;
        assert!(!Handshake::verify_confirm(b"secret", &h, &ch, &forged, at));
        // Without a key nothing verifies.
        let unauth = Handshake::accept(&h, &ch, None, at);
        assert!(!Handshake::verify_accept(b"secret", &h, &ch, &unauth, at));
        // An IPv4-mapped address is its IPv4 address.
        assert!(Handshake::verify_confirm(b"secret", &h, &ch, &c, addr("[::ffff:10.0.0.2]:7450")));
    }

    #[test]
    fn a_proof_made_for_one_acceptor_is_worthless_at_another() {
        // The relay attack: a keyless machine in the middle gets a key holder to dial it (or
        // intercepts its dial to P), opens its own connection to another holder A and passes
        // the handshake through. The dialer's proof names the address it dialed, so A (which
        // accepted on its own address) refuses it.
        let h = hello();
        let ch = Handshake::challenge(9, &h, [2; 16], true);
        let dialed = addr("10.0.0.66:7450");
        let c = Handshake::confirm(&h, &ch, Some(b"secret"), dialed);
        assert!(!Handshake::verify_confirm(b"secret", &h, &ch, &c, addr("10.0.0.2:7450")));
        // Nor does another incarnation or channel of the same exchange verify.
        let mut other = h;
        other.incarnation += 1;
        assert!(!Handshake::verify_confirm(b"secret", &other, &ch, &c, dialed));
    }

    #[test]
    fn the_roles_cannot_be_swapped() {
        // Reflection: a dialer's own messages turned around. A Hello and a Challenge with the
        // engine ids swapped make another transcript, and neither proof serves the other role.
        let h = Handshake::hello(1, 0, 0, Class::Throughput, [1; 16], true);
        let ch = Handshake::challenge(2, &h, [2; 16], true);
        let at = addr("10.0.0.2:7450");
        let confirm = Handshake::confirm(&h, &ch, Some(b"secret"), at);
        let swapped_hello = Handshake::hello(2, 0, 0, Class::Throughput, [2; 16], true);
        let swapped_challenge = Handshake::challenge(1, &swapped_hello, [1; 16], true);
        let mut as_accept = Handshake::accept(&swapped_hello, &swapped_challenge, None, at);
        as_accept.flags = FLAG_AUTH;
        as_accept.mac = confirm.mac;
        assert!(!Handshake::verify_accept(
            b"secret",
            &swapped_hello,
            &swapped_challenge,
            &as_accept,
            at
        ));
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let mut b = hello().encode();
        b[4..6].copy_from_slice(&9u16.to_be_bytes());
        assert_eq!(Handshake::decode(&b), Err(WireError::UnsupportedVersion(9)));
        b[0] = b'X';
        assert_eq!(Handshake::decode(&b), Err(WireError::BadMagic));
        let mut v1 = [0u8; 6];
        v1[..4].copy_from_slice(&MAGIC);
        v1[5] = 1;
        assert_eq!(check_prefix(&v1), Err(WireError::UnsupportedVersion(1)));
    }

    #[test]
    fn invalid_fields_are_refused() {
        let good = hello().encode();
        for (at, v) in [(16, 0u8), (7, 9), (6, 9), (23, 2)] {
            let mut b = good;
            if at == 16 {
                b[16..18].copy_from_slice(&64u16.to_be_bytes());
            } else {
                b[at] = v;
            }
            assert!(matches!(Handshake::decode(&b), Err(WireError::BadField { .. })), "byte {at}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Whatever 72 bytes a peer sends: an error or a message that encodes back the same.
        #[test]
        fn arbitrary_handshakes_decode_or_fail_cleanly(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), HANDSHAKE_LEN)
        ) {
            let buf: [u8; HANDSHAKE_LEN] = bytes.try_into().unwrap();
            let _ = check_prefix(buf[..6].try_into().unwrap());
            if let Ok(h) = Handshake::decode(&buf) {
                proptest::prop_assert_eq!(Handshake::decode(&h.encode()).unwrap(), h);
            }
        }

        /// A proof made with one key never verifies with another, whatever the fields.
        #[test]
        fn proofs_bind_key_and_fields(
            id in proptest::prelude::any::<u64>(),
            channel in 0u16..=MAX_CHANNEL_INDEX,
            nonce in proptest::prelude::any::<[u8; 16]>(),
            key in proptest::collection::vec(proptest::prelude::any::<u8>(), 16..40),
        ) {
            let h = Handshake::hello(id, channel, 0, Class::Throughput, nonce, true);
            let c = Handshake::challenge(id ^ 1, &h, [9; 16], true);
            let at = "10.1.2.3:7450".parse().unwrap();
            let confirm = Handshake::confirm(&h, &c, Some(&key), at);
            let mut other = key.clone();
            other[0] ^= 1;
            proptest::prop_assert!(confirm.mac != Handshake::confirm(&h, &c, Some(&other), at).mac);
        }
    }
}
