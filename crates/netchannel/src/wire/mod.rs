//! Wire format: where a channel handshake and a frame get parsed and emitted.
//!
//! Pure codec, no I/O: decoders take byte slices and return values or a [`WireError`]; encoders
//! write into caller buffers. The normative description is docs/PROTOCOL.md (version 3).

pub mod frame;
pub mod handshake;

#[cfg(feature = "internals")]
pub use frame::decode;
pub use frame::{Decoded, Frame, RstReason};
pub use handshake::{Handshake, HandshakeKind, RejectReason};

/// Traffic class of a virtual socket or channel. Latency-class sockets only ever use
/// latency-class channels (while the session has one), so bulk transfers cannot queue in front
/// of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Class {
    #[default]
    /// Bulk traffic: throughput channels, work demoted while latency traffic is present.
    Throughput,
    /// Latency-sensitive traffic: channels and a worker of its own.
    Latency,
}

impl Class {
    /// Its code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Class::Throughput => 0,
            Class::Latency => 1,
        }
    }
    /// The class of a code, if valid.
    pub fn from_code(n: u8) -> Option<Self> {
        match n {
            0 => Some(Class::Throughput),
            1 => Some(Class::Latency),
            _ => None,
        }
    }
    /// 0 or 1, for per-class arrays.
    pub fn index(self) -> usize {
        self.code() as usize
    }
    /// Its bit in a set of classes.
    pub(crate) fn bit(self) -> u8 {
        1 << self.index()
    }
}

/// Why bytes from a peer were refused. Any of these closes the channel they arrived on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The first bytes are not `NCHN`.
    BadMagic,
    /// Another protocol version (the peer's).
    UnsupportedVersion(u16),
    /// A frame type this version does not know.
    UnknownType(u8),
    /// A field out of range: its name and value.
    BadField {
        /// The field's name.
        field: &'static str,
        /// The value found.
        value: u64,
    },
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
