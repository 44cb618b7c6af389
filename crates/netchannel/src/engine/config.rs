//! Engine configuration.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::scheduler::Policy;
use crate::wire::frame::{MAX_PAYLOAD, MAX_WINDOW};

#[derive(Debug, Clone)]
pub struct Config {
    /// Address the channel listener binds (IPv4 or IPv6; port 0 picks one).
    pub listen_addr: SocketAddr,
    /// Run every engine thread, and so every channel socket, inside this network namespace
    /// (e.g. `/run/netns/NAME`). The application's own threads are not moved.
    pub netns: Option<PathBuf>,
    /// Throughput-class channels dialed to each peer when the session opens (the minimum).
    pub channels: usize,
    /// Most throughput-class channels per peer. While every one of them is above
    /// `channel_queue_threshold` and a sender waits, the dialing engine adds one, up to this.
    pub max_channels: usize,
    /// Latency-class channels dialed to each peer (0: latency sockets share throughput ones).
    pub latency_channels: usize,
    pub policy: Policy,
    /// A channel holding more queued bytes than this is skipped by round-robin (paper: 2 MB).
    pub channel_queue_threshold: u64,
    /// Largest DATA payload this engine sends.
    pub max_frame_payload: usize,
    /// Receive window granted to the peer per virtual socket.
    pub stream_window: u32,
    /// Most virtual sockets open at once.
    pub max_streams: u32,
    /// Out-of-order segments held per virtual socket before the peer is deemed abusive.
    pub max_out_of_order_segments: usize,
    pub connect_timeout: Duration,
    /// Timeout for one channel's TCP connect and handshake.
    pub dial_timeout: Duration,
    pub accept_backlog: usize,
    /// How long a worker keeps polling after its last work before parking in epoll.
    pub idle_spin: Duration,
    /// Frames a worker parses per round before it serves transmission again.
    pub rx_batch_frames: usize,
    /// Bytes a worker writes per round before it serves reception again.
    pub tx_batch_bytes: usize,
    /// `TCP_NOTSENT_LOWAT` of channel sockets.
    pub notsent_lowat: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            netns: None,
            channels: 4,
            max_channels: 4,
            latency_channels: 1,
            policy: Policy::RoundRobin,
            channel_queue_threshold: 2 << 20,
            max_frame_payload: 128 * 1024,
            stream_window: 4 << 20,
            max_streams: 1 << 21,
            max_out_of_order_segments: 4096,
            connect_timeout: Duration::from_secs(5),
            dial_timeout: Duration::from_secs(1),
            accept_backlog: 4096,
            idle_spin: default_idle_spin(),
            rx_batch_frames: 256,
            tx_batch_bytes: 4 << 20,
            notsent_lowat: 1 << 20,
        }
    }
}

/// Idle polling only pays when a spare core exists: on two cores a polling worker takes the
/// core its peer thread needs (measured: 50 us of idle spin halved goodput; docs/BENCHMARKS.md).
fn default_idle_spin() -> Duration {
    match std::thread::available_parallelism().map_or(1, |n| n.get()) {
        0..=2 => Duration::ZERO,
        _ => Duration::from_micros(20),
    }
}

impl Config {
    pub fn new(listen_addr: SocketAddr) -> Self {
        Config { listen_addr, ..Config::default() }
    }

    pub(crate) fn validate(&self) -> io::Result<()> {
        let bad = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if self.channels == 0 {
            return bad("channels must be at least 1".into());
        }
        if self.max_channels < self.channels {
            return bad(format!(
                "max_channels ({}) is below channels ({})",
                self.max_channels, self.channels
            ));
        }
        if self.max_channels + self.latency_channels > 64 {
            return bad(format!(
                "at most 64 channels per peer (asked up to {} + {} latency)",
                self.max_channels, self.latency_channels
            ));
        }
        if self.max_frame_payload == 0 || self.max_frame_payload > MAX_PAYLOAD {
            return bad(format!("max_frame_payload must be in 1..={MAX_PAYLOAD}"));
        }
        if self.stream_window == 0 || self.stream_window > MAX_WINDOW {
            return bad(format!("stream_window must be in 1..={MAX_WINDOW}"));
        }
        if self.max_streams == 0 || self.max_streams > crate::vns::table::MAX_STREAMS {
            return bad(format!("max_streams must be in 1..={}", crate::vns::table::MAX_STREAMS));
        }
        if self.accept_backlog == 0 || self.rx_batch_frames == 0 || self.tx_batch_bytes == 0 {
            return bad("accept_backlog, rx_batch_frames and tx_batch_bytes must be > 0".into());
        }
        Ok(())
    }
}
