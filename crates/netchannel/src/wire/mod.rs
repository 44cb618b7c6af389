//! Wire format: where a channel handshake and a frame get parsed and emitted.
//!
//! Pure codec, no I/O: decoders take byte slices and return values or a [`WireError`]; encoders
//! write into caller buffers. The normative description is docs/PROTOCOL.md (version 2).

pub mod frame;
pub mod handshake;

pub use frame::{decode, Decoded, Frame, RstReason};
pub use handshake::{Handshake, HandshakeKind, RejectReason};

/// Traffic class of a virtual socket or channel. Latency-class sockets only ever use
/// latency-class channels (while the session has one), so bulk transfers cannot queue in front
/// of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Class {
    #[default]
    Throughput,
    Latency,
}

impl Class {
    pub fn code(self) -> u8 {
        match self {
            Class::Throughput => 0,
            Class::Latency => 1,
        }
    }
    pub fn from_code(n: u8) -> Option<Self> {
        match n {
            0 => Some(Class::Throughput),
            1 => Some(Class::Latency),
            _ => None,
        }
    }
    pub fn index(self) -> usize {
        self.code() as usize
    }
}

/// Why bytes from a peer were refused. Any of these closes the channel they arrived on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    BadMagic,
    UnsupportedVersion(u16),
    UnknownType(u8),
    BadField { field: &'static str, value: u64 },
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::BadMagic => write!(f, "bad magic: peer is not a netchannel engine"),
            WireError::UnsupportedVersion(v) => write!(
                f,
                "unsupported protocol version {v} (this engine speaks {})",
                handshake::VERSION
            ),
            WireError::UnknownType(t) => write!(f, "unknown frame type {t}"),
            WireError::BadField { field, value } => write!(f, "invalid {field} ({value})"),
        }
    }
}

impl std::error::Error for WireError {}
