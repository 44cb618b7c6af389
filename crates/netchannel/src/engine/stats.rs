//! What `Engine::stats` reports: per engine, per channel, per virtual socket.

use std::net::SocketAddr;

use super::readiness::StreamUser;
use super::worker::WorkerThread;
use crate::driver::ChannelStats;
use crate::proto::{Stream, StreamId};
use crate::wire::Class;

/// Counters of the whole engine.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// This engine's id.
    pub engine_id: u64,
    /// Its channel listener's address.
    pub local_addr: Option<SocketAddr>,
    /// Open channels, every peer.
    pub channels: Vec<PeerChannelStats>,
    /// The most recently closed channels, with why they closed.
    pub closed_channels: Vec<PeerChannelStats>,
    /// Virtual sockets holding state, every peer.
    pub sockets: Vec<SocketStats>,
    /// Virtual sockets holding state (open, or closed and still delivering).
    pub open_sockets: usize,
    /// Channels closed because the peer broke the protocol, handshakes included.
    pub protocol_errors: u64,
    /// Channel handshakes that failed (refused, timed out, broken).
    pub handshake_failures: u64,
    /// Frames for streams already closed here (normal after a reset; ignored).
    pub stale_frames: u64,
    /// Bytes sent again after a channel loss.
    pub retransmitted_bytes: u64,
    /// Sessions (peers) with at least one channel.
    pub sessions: usize,
    /// Sessions the engine keeps, with channels or not (a dialed session lost and not dialed
    /// again yet): what its session maps hold.
    pub session_entries: usize,
    /// Refusals by reason ("handshakes in progress at the limit", ...).
    pub refusals: Vec<(String, u64)>,
    /// Lost channels this engine dialed again.
    pub redialed_channels: u64,
    /// Received bytes held for applications that have not read them, every peer.
    pub held_bytes: u64,
    /// Bytes applications sent that are not on a channel yet, every peer.
    pub unsent_bytes: u64,
    /// Bytes written on channels and kept until the peer acknowledges them, every peer.
    pub retained_bytes: u64,
    /// Receive credit granted to peers and not yet read, every peer (received bytes can never
    /// exceed it), and what the sessions may grant in all (their budgets).
    pub rx_granted: u64,
    /// See `rx_granted`.
    pub rx_budget: u64,
    /// Channels open (two file descriptors each) and the engine's limit.
    pub channels_open: usize,
    /// See `channels_open`.
    pub max_channels_total: usize,
    /// The worker threads: which class each serves and how it is scheduled.
    pub workers: Vec<WorkerThread>,
    /// Application threads run their throughput-class work (channel writes and reads, waits)
    /// at `throughput_policy` while isolating, and are put back after; false where the process
    /// lacks the right to put them back (then only the workers are demoted).
    pub app_threads_demoted: bool,
    /// Throughput-class work runs demoted now (`Config::isolation`; with `Auto`, while a
    /// latency-class socket is open).
    pub isolating: bool,
}

#[derive(Debug, Clone, Default)]
/// A channel and the peer it goes to.
pub struct PeerChannelStats {
    /// The peer engine's address.
    pub peer_addr: Option<SocketAddr>,
    /// The channel's session: the engine id its dialer presents (the dialer's own, or one of
    /// its shards', `Config::session_shards`), the same at both ends; 0 when not known.
    pub session: u64,
    /// The peer engine's id as it presented it (a shard's, when the peer dialed from one);
    /// 0 when not known. `wire::handshake::engine_key` of it names the engine.
    pub peer_engine: u64,
    /// The channel's counters.
    pub channel: ChannelStats,
}

/// Per-socket counters (a snapshot).
#[derive(Debug, Clone)]
pub struct SocketStats {
    /// The socket's id in its session.
    pub id: u64,
    /// The virtual port it was opened to or accepted on.
    pub port: u16,
    /// Its traffic class.
    pub class: Class,
    /// The peer engine's channel address.
    pub peer_engine_addr: SocketAddr,
    /// Bytes the application sent.
    pub bytes_sent: u64,
    /// Bytes received in order.
    pub bytes_received: u64,
    /// Frames of this socket pulled onto channels.
    pub frames_sent: u64,
    /// Frames for this socket received.
    pub frames_received: u64,
    /// Received bytes the application has not read yet.
    pub unread_bytes: u64,
    /// Accepted from the application and not yet on a channel.
    pub unsent_bytes: u64,
    /// Sent bytes the peer application has not read yet.
    pub unacked_bytes: u64,
    /// Bytes the peer's credit lets the application send now (TCP's send window less what is
    /// in flight).
    pub send_window: u64,
    /// Protocol violations by the peer on this socket.
    pub protocol_errors: u32,
    /// `open`, `connecting`, `incoming`, `write-closed`, `peer-finished`, `finished`,
    /// `closed` (delivering after close) or `reset`.
    pub state: &'static str,
    /// Local and peer addresses as the application knows them, if it said
    /// (`VSocket::set_app_addresses`; the interposition library does).
    pub app_addrs: Option<[SocketAddr; 2]>,
}

impl SocketStats {
    pub(crate) fn of(id: StreamId, s: &Stream<StreamUser>, peer: SocketAddr) -> SocketStats {
        SocketStats {
            id: id.get(),
            port: s.port,
            class: s.class,
            peer_engine_addr: peer,
            bytes_sent: s.bytes_sent(),
            bytes_received: s.bytes_received(),
            frames_sent: s.frames_sent as u64,
            frames_received: s.frames_received as u64,
            unread_bytes: s.unread_bytes(),
            unsent_bytes: s.unsent_bytes(),
            unacked_bytes: s.unacked_bytes(),
            send_window: s.send_window(),
            protocol_errors: s.protocol_errors as u32,
            state: s.state_name(),
            app_addrs: None,
        }
    }
}
