//! The channel handshake: the first messages each side writes on a new channel (version 2).
//!
//! Four fixed-size messages: the dialer's `Hello`, the acceptor's `Challenge`, the dialer's
//! `Confirm`, and the acceptor's `Accept`; either side may answer `Reject` instead. With a
//! pre-shared key, `Confirm` and `Accept` each carry an HMAC-SHA256 over both nonces, both engine
//! ids, the channel index and the class: the dialer proves it holds the key before the acceptor
//! grants it anything, then the acceptor proves it, and its `Accept` also says the channel was
//! admitted. Layout (big-endian), see docs/PROTOCOL.md:
//!
//! ```text
//!  0  magic        [u8; 4] = "NCHN"
//!  4  version      u16 = 2
//!  6  kind         u8   1 Hello, 2 Challenge, 3 Reject, 4 Confirm, 5 Accept
//!  7  class        u8   0 Throughput, 1 Latency
//!  8  engine_id    u64
//! 16  channel      u16  channel index within the session (< 64)
//! 18  reason       u16  0 unless kind == Reject
//! 20  flags        u32  bit 0: the sender authenticates (holds a pre-shared key)
//! 24  nonce        [u8; 16]  fresh random bytes (Hello, Challenge)
//! 40  mac          [u8; 32]  HMAC-SHA256 (Confirm, Accept with a key), else zero
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{Class, WireError};

/// First bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"NCHN";
/// The protocol version this engine speaks.
pub const VERSION: u16 = 2;
/// Bytes of every handshake message.
pub const HANDSHAKE_LEN: usize = 72;
/// Channel indexes are bits of 64-bit masks.
pub const MAX_CHANNEL_INDEX: u16 = 63;
/// Flag: the sender authenticates (holds a pre-shared key).
pub const FLAG_AUTH: u32 = 1;

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
            flags: 0,
            nonce: [0; 16],
            mac: [0; 32],
        }
    }

    /// The dialer's Hello for channel `channel`; `auth`: it holds a key.
    pub fn hello(engine_id: u64, channel: u16, class: Class, nonce: [u8; 16], auth: bool) -> Self {
        let mut h = Handshake::new(HandshakeKind::Hello, engine_id, channel, class);
        h.nonce = nonce;
        h.flags = if auth { FLAG_AUTH } else { 0 };
        h
    }

    /// The acceptor's answer to `hello`: its id and nonce; `auth` says it requires a proof.
    pub fn challenge(engine_id: u64, hello: &Handshake, nonce: [u8; 16], auth: bool) -> Self {
        let mut h = Handshake::new(HandshakeKind::Challenge, engine_id, hello.channel, hello.class);
        h.nonce = nonce;
        h.flags = if auth { FLAG_AUTH } else { 0 };
        h
    }

    /// The dialer's answer to the challenge; with a key, it carries the dialer's proof.
    pub fn confirm(hello: &Handshake, challenge: &Handshake, key: Option<&[u8]>) -> Self {
        let mut h =
            Handshake::new(HandshakeKind::Confirm, hello.engine_id, hello.channel, hello.class);
        if let Some(key) = key {
            h.flags = FLAG_AUTH;
            h.mac = proof(key, b"netchannel v2 confirm", hello, challenge);
        }
        h
    }

    /// The acceptor admitted the channel; with a key, it carries the acceptor's proof.
    pub fn accept(hello: &Handshake, challenge: &Handshake, key: Option<&[u8]>) -> Self {
        let mut h =
            Handshake::new(HandshakeKind::Accept, challenge.engine_id, hello.channel, hello.class);
        if let Some(key) = key {
            h.flags = FLAG_AUTH;
            h.mac = proof(key, b"netchannel v2 accept", hello, challenge);
        }
        h
    }

    /// A refusal with `reason`.
    pub fn reject(engine_id: u64, reason: RejectReason) -> Self {
        Handshake::new(HandshakeKind::Reject(reason), engine_id, 0, Class::Throughput)
    }

    /// Checks the acceptor's proof in `accept` (dialer side).
    pub fn verify_accept(
        key: &[u8],
        hello: &Handshake,
        challenge: &Handshake,
        accept: &Handshake,
    ) -> bool {
        accept.flags & FLAG_AUTH != 0
            && accept.engine_id == challenge.engine_id
            && verify(key, b"netchannel v2 accept", hello, challenge, &accept.mac)
    }

    /// Checks the dialer's proof in `confirm` (acceptor side).
    pub fn verify_confirm(
        key: &[u8],
        hello: &Handshake,
        challenge: &Handshake,
        confirm: &Handshake,
    ) -> bool {
        confirm.flags & FLAG_AUTH != 0
            && confirm.engine_id == hello.engine_id
            && verify(key, b"netchannel v2 confirm", hello, challenge, &confirm.mac)
    }

    /// The message's bytes.
    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_be_bytes());
        let (kind, reason) = match self.kind {
            HandshakeKind::Hello => (1, 0),
            HandshakeKind::Challenge => (2, 0),
            HandshakeKind::Reject(r) => (3, r.code()),
            HandshakeKind::Confirm => (4, 0),
            HandshakeKind::Accept => (5, 0),
        };
        out[6] = kind;
        out[7] = self.class.code();
        out[8..16].copy_from_slice(&self.engine_id.to_be_bytes());
        out[16..18].copy_from_slice(&self.channel.to_be_bytes());
        out[18..20].copy_from_slice(&reason.to_be_bytes());
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
        let reason = u16::from_be_bytes([buf[18], buf[19]]);
        let kind = match buf[6] {
            1 => HandshakeKind::Hello,
            2 => HandshakeKind::Challenge,
            3 => HandshakeKind::Reject(RejectReason::from_code(reason)),
            4 => HandshakeKind::Confirm,
            5 => HandshakeKind::Accept,
            k => return Err(WireError::BadField { field: "handshake kind", value: k as u64 }),
        };
        if !matches!(kind, HandshakeKind::Reject(_)) && reason != 0 {
            return Err(WireError::BadField { field: "handshake reason", value: reason as u64 });
        }
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

fn keyed(key: &[u8], label: &[u8], hello: &Handshake, challenge: &Handshake) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(label);
    mac.update(&hello.nonce);
    mac.update(&challenge.nonce);
    mac.update(&hello.engine_id.to_be_bytes());
    mac.update(&challenge.engine_id.to_be_bytes());
    mac.update(&hello.channel.to_be_bytes());
    mac.update(&[hello.class.code()]);
    mac
}

fn proof(key: &[u8], label: &[u8], hello: &Handshake, challenge: &Handshake) -> [u8; 32] {
    keyed(key, label, hello, challenge).finalize().into_bytes().into()
}

fn verify(key: &[u8], label: &[u8], hello: &Handshake, challenge: &Handshake, mac: &[u8]) -> bool {
    // Constant-time comparison, from the hmac crate.
    keyed(key, label, hello, challenge).verify_slice(mac).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Handshake {
        Handshake::hello(7, 3, Class::Latency, [1; 16], true)
    }

    #[test]
    fn round_trip() {
        let h = hello();
        let c = Handshake::challenge(u64::MAX, &h, [2; 16], true);
        for hs in [
            h,
            c,
            Handshake::confirm(&h, &c, Some(b"key")),
            Handshake::accept(&h, &c, Some(b"key")),
            Handshake::reject(1, RejectReason::UnsupportedVersion),
            Handshake::reject(1, RejectReason::AuthFailed),
        ] {
            assert_eq!(Handshake::decode(&hs.encode()).unwrap(), hs);
        }
    }

    #[test]
    fn proofs_need_the_same_key_and_the_same_nonces() {
        let h = hello();
        let ch = Handshake::challenge(9, &h, [2; 16], true);
        let c = Handshake::confirm(&h, &ch, Some(b"secret"));
        assert!(Handshake::verify_confirm(b"secret", &h, &ch, &c));
        assert!(!Handshake::verify_confirm(b"other", &h, &ch, &c));
        let a = Handshake::accept(&h, &ch, Some(b"secret"));
        assert!(Handshake::verify_accept(b"secret", &h, &ch, &a));
        assert!(!Handshake::verify_accept(b"other", &h, &ch, &a));
        // A confirm recorded for one acceptor nonce is worthless for another (no replay).
        let ch2 = Handshake::challenge(9, &h, [3; 16], true);
        assert!(!Handshake::verify_confirm(b"secret", &h, &ch2, &c));
        // The accept's proof cannot be reused as a confirm (labels differ).
        let mut forged = c;
        forged.mac = a.mac;
        assert!(!Handshake::verify_confirm(b"secret", &h, &ch, &forged));
        // Without a key nothing verifies.
        let unauth = Handshake::accept(&h, &ch, None);
        assert!(!Handshake::verify_accept(b"secret", &h, &ch, &unauth));
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
        for (at, v) in [(16, 0u8), (7, 9), (6, 9), (19, 1), (23, 2)] {
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
            let h = Handshake::hello(id, channel, Class::Throughput, nonce, true);
            let c = Handshake::challenge(id ^ 1, &h, [9; 16], true);
            let confirm = Handshake::confirm(&h, &c, Some(&key));
            let mut other = key.clone();
            other[0] ^= 1;
            proptest::prop_assert!(confirm.mac != Handshake::confirm(&h, &c, Some(&other)).mac);
        }
    }
}
