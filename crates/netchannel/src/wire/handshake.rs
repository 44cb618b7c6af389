//! The channel handshake: the first 24 bytes each side writes on a new channel.
//!
//! The dialing engine sends `Hello`; the accepting engine answers `Accept` (with its own engine id)
//! or `Reject` (with a reason) and closes. Layout (big-endian), see docs/PROTOCOL.md:
//!
//! ```text
//!  0  magic        [u8; 4] = "NCHN"
//!  4  version      u16
//!  6  kind         u8   1 Hello, 2 Accept, 3 Reject
//!  7  class        u8   0 Throughput, 1 Latency
//!  8  engine_id    u64
//! 16  channel      u16  channel index within the session (< 64)
//! 18  reason       u16  0 unless kind == Reject
//! 20  reserved     u32  must be zero
//! ```

use super::{Class, WireError};

pub const MAGIC: [u8; 4] = *b"NCHN";
pub const VERSION: u16 = 1;
pub const HANDSHAKE_LEN: usize = 24;
/// Channel indexes are bits of a per-stream 64-bit mask.
pub const MAX_CHANNEL_INDEX: u16 = 63;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeKind {
    Hello,
    Accept,
    Reject(RejectReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    BadMagic,
    UnsupportedVersion,
    BadField,
    /// The acceptor is at a resource limit (channels per session, handshakes in progress).
    Limit,
    Unknown(u16),
}

impl RejectReason {
    fn code(self) -> u16 {
        match self {
            RejectReason::BadMagic => 1,
            RejectReason::UnsupportedVersion => 2,
            RejectReason::BadField => 3,
            RejectReason::Limit => 4,
            RejectReason::Unknown(n) => n,
        }
    }
    fn from_code(n: u16) -> Self {
        match n {
            1 => RejectReason::BadMagic,
            2 => RejectReason::UnsupportedVersion,
            3 => RejectReason::BadField,
            4 => RejectReason::Limit,
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
            RejectReason::Unknown(n) => write!(f, "unknown reason {n}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    pub version: u16,
    pub kind: HandshakeKind,
    pub class: Class,
    pub engine_id: u64,
    pub channel: u16,
}

impl Handshake {
    pub fn hello(engine_id: u64, channel: u16, class: Class) -> Self {
        Handshake { version: VERSION, kind: HandshakeKind::Hello, class, engine_id, channel }
    }

    pub fn accept(engine_id: u64, channel: u16, class: Class) -> Self {
        Handshake { version: VERSION, kind: HandshakeKind::Accept, class, engine_id, channel }
    }

    pub fn reject(engine_id: u64, reason: RejectReason) -> Self {
        Handshake {
            version: VERSION,
            kind: HandshakeKind::Reject(reason),
            class: Class::Throughput,
            engine_id,
            channel: 0,
        }
    }

    pub fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_be_bytes());
        let (kind, reason) = match self.kind {
            HandshakeKind::Hello => (1, 0),
            HandshakeKind::Accept => (2, 0),
            HandshakeKind::Reject(r) => (3, r.code()),
        };
        out[6] = kind;
        out[7] = self.class.code();
        out[8..16].copy_from_slice(&self.engine_id.to_be_bytes());
        out[16..18].copy_from_slice(&self.channel.to_be_bytes());
        out[18..20].copy_from_slice(&reason.to_be_bytes());
        out
    }

    /// Parses and validates a handshake. Magic is checked first and version second, so the error
    /// says exactly why a peer is refused; a different version is reported with the version the
    /// peer speaks, before any other field is interpreted.
    pub fn decode(buf: &[u8; HANDSHAKE_LEN]) -> Result<Self, WireError> {
        if buf[0..4] != MAGIC {
            return Err(WireError::BadMagic);
        }
        let version = u16::from_be_bytes([buf[4], buf[5]]);
        if version != VERSION {
            return Err(WireError::UnsupportedVersion(version));
        }
        let reason = u16::from_be_bytes([buf[18], buf[19]]);
        let kind = match buf[6] {
            1 => HandshakeKind::Hello,
            2 => HandshakeKind::Accept,
            3 => HandshakeKind::Reject(RejectReason::from_code(reason)),
            k => return Err(WireError::BadField { field: "handshake kind", value: k as u64 }),
        };
        if kind != HandshakeKind::Reject(RejectReason::from_code(reason)) && reason != 0 {
            return Err(WireError::BadField { field: "handshake reason", value: reason as u64 });
        }
        let class = Class::from_code(buf[7])
            .ok_or(WireError::BadField { field: "class", value: buf[7] as u64 })?;
        let engine_id = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
        let channel = u16::from_be_bytes([buf[16], buf[17]]);
        if channel > MAX_CHANNEL_INDEX {
            return Err(WireError::BadField { field: "channel index", value: channel as u64 });
        }
        if buf[20..24] != [0; 4] {
            return Err(WireError::BadField { field: "handshake reserved", value: 0 });
        }
        Ok(Handshake { version, kind, class, engine_id, channel })
    }

    /// A reply to a peer whose hello failed to parse: the reason matching the parse error.
    pub fn reject_for(err: &WireError, engine_id: u64) -> Self {
        let reason = match err {
            WireError::BadMagic => RejectReason::BadMagic,
            WireError::UnsupportedVersion(_) => RejectReason::UnsupportedVersion,
            _ => RejectReason::BadField,
        };
        Handshake::reject(engine_id, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for hs in [
            Handshake::hello(7, 3, Class::Latency),
            Handshake::accept(u64::MAX, 63, Class::Throughput),
            Handshake::reject(1, RejectReason::UnsupportedVersion),
        ] {
            assert_eq!(Handshake::decode(&hs.encode()).unwrap(), hs);
        }
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let mut b = Handshake::hello(1, 0, Class::Throughput).encode();
        b[4..6].copy_from_slice(&9u16.to_be_bytes());
        assert_eq!(Handshake::decode(&b), Err(WireError::UnsupportedVersion(9)));
        b[0] = b'X';
        assert_eq!(Handshake::decode(&b), Err(WireError::BadMagic));
    }

    #[test]
    fn invalid_fields_are_refused() {
        let good = Handshake::hello(1, 0, Class::Throughput).encode();
        let mut b = good;
        b[16..18].copy_from_slice(&64u16.to_be_bytes());
        assert!(matches!(Handshake::decode(&b), Err(WireError::BadField { .. })));
        let mut b = good;
        b[7] = 9;
        assert!(matches!(Handshake::decode(&b), Err(WireError::BadField { .. })));
        let mut b = good;
        b[23] = 1;
        assert!(matches!(Handshake::decode(&b), Err(WireError::BadField { .. })));
        let mut b = good;
        b[19] = 1; // a reason on a hello
        assert!(matches!(Handshake::decode(&b), Err(WireError::BadField { .. })));
    }
}
