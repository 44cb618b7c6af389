//! The protocol core: where a received frame or an application call changes stream state, and
//! where the frames each channel sends next are chosen. Sans-IO, as quinn-proto and smoltcp: one
//! deterministic state machine per session ([`Session`]) whose inputs are frames (by channel),
//! application calls and time, and whose outputs are frames to write (by channel) and events
//! (a stream became readable or writable, a stream is incoming). The engine only moves bytes,
//! wake-ups and time into it; `tests` drive two sessions against each other in memory with a
//! virtual clock.
//!
//! - [`ids`]: stream and channel ids as types.
//! - [`table`]: dense stream ids with 40-bit generations.
//! - [`sendbuf`] / [`recvbuf`]: a stream's unsent bytes and its reorder buffer.
//! - [`framing`]: splitting a channel's byte stream into frames (the reader feeding `receive`).
//! - [`stream`]: per-stream offsets, credit, FIN and RST rules.
//! - [`session`]: the session state machine, channel retention and acknowledgements.

pub mod framing;
pub mod ids;
pub mod recvbuf;
pub mod sendbuf;
pub mod session;
pub mod stream;
pub mod table;

#[cfg(test)]
mod tests;

/// Points `buf` (emptied, or cut from a larger buffer) back at the whole of its allocation when
/// no other handle shares it: asking for one byte more than the room it sees makes `bytes`
/// reclaim the allocation from its start, with nothing to copy or allocate. False (and `buf`
/// unchanged) while another handle still shares the allocation.
pub(crate) fn reclaim_whole(buf: &mut bytes::BytesMut) -> bool {
    buf.try_reclaim(buf.capacity() - buf.len() + 1)
}

pub use ids::{ChannelId, StreamId};
pub use session::{CoreConfig, OpenError, OutFrame, Recv, Session, EV_READ, EV_URGENT, EV_WRITE};
pub use stream::{Phase, ResetCause, SendError, Stream};
