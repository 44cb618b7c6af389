//! Ids as types, so that the session's API cannot mix them up: this side's stream ids, the
//! peer's stream ids, and channel indexes. On the wire all are plain integers (docs/PROTOCOL.md);
//! a peer-supplied id becomes a [`StreamId`] only once the stream table resolved it.

use super::table;

/// A stream's id on this side of a session: `generation << 24 | index` (see `table`). Frames
/// from the peer carry it as their destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub(crate) u64);

impl StreamId {
    /// The id as it travels on the wire and shows in statistics.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The stream table slot it names.
    pub(crate) fn index(self) -> usize {
        table::index_of(self.0)
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The peer's id for a stream (from its SYN or SYN_ACK): frames to the peer carry it. 0 until
/// the peer told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PeerStreamId(pub(crate) u64);

impl PeerStreamId {
    /// The id as it travels on the wire.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// A channel of a session: its index (0..=63, `wire::handshake::MAX_CHANNEL_INDEX`) and its
/// incarnation (a channel dialed again under the same index is another channel: frames, ACKs
/// and runners of the old one must not act on the new one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ChannelId {
    /// Its index within the session.
    pub index: u16,
    /// How many times the index was dialed before this channel (wrapping).
    pub incarnation: u16,
}

impl ChannelId {
    /// Channel `index`, incarnation `incarnation`.
    pub const fn new(index: u16, incarnation: u16) -> Self {
        ChannelId { index, incarnation }
    }

    /// The session's slot for the index (any incarnation).
    pub(crate) fn slot(self) -> usize {
        self.index as usize
    }

    /// Its bit in a set of a session's channels by index (at most 64:
    /// `wire::handshake::MAX_CHANNEL_INDEX`).
    pub(crate) fn bit(self) -> u64 {
        1 << (self.index & 63)
    }
}

impl std::fmt::Display for ChannelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.index, self.incarnation)
    }
}

impl From<StreamId> for u64 {
    /// For the scheduler's sticky hashing.
    fn from(id: StreamId) -> u64 {
        id.0
    }
}

impl From<ChannelId> for usize {
    /// For the scheduler's per-channel queues (by index: one incarnation at a time).
    fn from(ch: ChannelId) -> usize {
        ch.index as usize
    }
}
