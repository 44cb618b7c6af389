//! Engine configuration: every knob, with defaults.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::proto::table::MAX_STREAMS;
use crate::scheduler::Policy;
use crate::sys::ThreadPolicy;
use crate::wire::frame::{MAX_PAYLOAD, MAX_WINDOW};
use crate::wire::Class;

/// Most shards of application threads an engine opens to one peer (`Config::session_shards`);
/// the last shard id is the latency class's (`LATENCY_SHARD`).
pub const MAX_SHARDS: usize = crate::wire::handshake::MAX_SHARD_IDS as usize - 1;
/// The shard of latency-class streams opened here, while `session_shards` is above 1.
pub const LATENCY_SHARD: u16 = crate::wire::handshake::MAX_SHARD_IDS - 1;

/// How application threads are demoted while the engine isolates (`Config::app_demotion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppDemotion {
    /// For each call that does throughput-class channel work, put back when it returns. Gives
    /// an L-app that waits on its answers (closed loop) its best tail, but starves one that
    /// sleeps on a timer between requests (open loop): each putting back re-weights the
    /// thread, and the L-app waited up to half a second for a core behind the T-apps' threads.
    PerCall,
    /// The default. From a thread's first throughput-class call until it does latency-class
    /// work or isolation ends (then per call): a thread that only does throughput work stays
    /// demoted, its own work too, and is never re-weighted. Both kinds of L-app keep their
    /// tails; a demoted thread that holds a lock of the program's runs only on spare CPU
    /// meanwhile.
    Sticky,
    /// Only the workers are demoted: netchannel's L-apps wait for a core as on Linux.
    Off,
}

/// When the engine demotes throughput-class work (`Config::isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// While this engine has a latency-class socket open: then there is latency work to
    /// protect; otherwise throughput work runs at full priority (demotion costs system calls
    /// and, on a busy host, throughput).
    Auto,
    /// Always, e.g. in a process of bulk applications sharing the host with latency
    /// applications in other processes.
    Always,
    /// Never: every thread keeps its own scheduling.
    Never,
}

#[derive(Clone)]
/// An engine's configuration: every knob, with safe defaults (`Config::default`).
pub struct Config {
    /// Address the channel listener binds (IPv4 or IPv6; port 0 picks one).
    pub listen_addr: SocketAddr,
    /// Source address of the channels this engine dials (`None`: the kernel's choice for the
    /// route). A host with several addresses, or several engines standing in for hosts, each
    /// dialing from an address of its own: an acceptor counts its per-source limits
    /// (`max_channels_per_source`, `max_handshakes_per_source`) by this address.
    pub dial_source: Option<std::net::IpAddr>,
    /// Run every engine thread, and so every channel socket, inside this network namespace
    /// (e.g. `/run/netns/NAME`). The application's own threads are not moved.
    pub netns: Option<PathBuf>,
    /// Throughput-class channels of a busy session to each peer (the least it shrinks to while
    /// busy): the first before the first stream, the rest (and the latency channel, unless a
    /// latency stream opened the session and had it dialed first) once the session carries
    /// traffic (`rest_channels_rate`) or a sender runs short of room. Idle, it shrinks to one
    /// (`channel_retire_after`), and grows back with traffic.
    pub channels: usize,
    /// When the session is first looked at for traffic, after it opens (then at twice the
    /// interval each time, up to a second, while it moves little; not while it moves nothing,
    /// until it receives a frame again). A short-lived client (a shell
    /// loop's `redis-cli`, a health check) is gone before: it pays for one or two channels, not
    /// for `channels` plus the latency one, and so does the peer (docs/BENCHMARKS.md, "Short-lived
    /// clients, again"). Zero: the rest are dialed at once, whatever the traffic.
    pub rest_channels_after: Duration,
    /// Bytes a second (sent and received, frames on its channels) a session must carry, at a
    /// look (`rest_channels_after`), for the dialing side to dial its other channels: a peer
    /// that is idle or barely used (a health check, a few requests a second) costs one
    /// channel, and a socket pair on each side, not `channels` plus the latency one. A sender
    /// short of room dials them at once whatever this says; two or more application threads
    /// sending on the session need a sixteenth of it (each thread's streams keep to a channel
    /// of their own). Below it for `channel_retire_after`, a session is idle and gives its
    /// throughput channels back down to one. Zero: at the first look, traffic or not, and
    /// never below `channels`.
    pub rest_channels_rate: u64,
    /// Most throughput-class channels per peer. While senders find every channel of the class
    /// holding its share of unsent bytes, or more application threads are busy sending to the
    /// peer (`busy_thread_rate`) than it has channels (each thread's streams keep
    /// to a channel of their own), the dialing engine adds one, up to this.
    pub max_channels: usize,
    /// Bytes a second an application thread must send to a peer to be busy on it and want a
    /// throughput channel of its own (`max_channels`). A channel of its own pays for a thread
    /// that moves many bytes; threads of small messages are better off sharing one.
    pub busy_thread_rate: u64,
    /// A session of this engine's dialing with more throughput channels than `channels` (than
    /// one when it has been idle this long: `rest_channels_rate`) and than the application
    /// threads busy on it (see `max_channels`), for this long, closes one (then waits as long
    /// again before the next).
    pub channel_retire_after: Duration,
    /// Latency-class channels dialed to each peer (0: latency sockets share throughput ones).
    pub latency_channels: usize,
    /// Sessions this engine may open to one peer (shards). A stream opened here belongs to
    /// the shard of the application thread that opened it (threads in order of first use,
    /// modulo this), dialed on that thread's first connect: streams of different shards share
    /// no session lock, channel or wake-up. The first shard (the first thread's) starts with
    /// `channels` throughput channels, the others with `channels / session_shards` (at least
    /// one): a one-thread program's session is what it was without shards, and more threads
    /// do not multiply the first channels. `max_channels` and `latency_channels` apply to
    /// each shard. The peer keys each shard as a session, but counts it as a new peer against its
    /// `max_sessions` only when it is the engine's first there. A shard the peer refuses
    /// leaves its threads on another shard of that peer for a while. With more than one
    /// shard, latency-class streams opened here (their class at connect) take a shard of
    /// their own instead (`LATENCY_SHARD`, one throughput channel and the latency channels),
    /// so that no latency stream waits on a lock held for throughput work to the same peer.
    /// Default: one per core, at most 16.
    pub session_shards: usize,
    /// How the scheduler picks the channel of a stream's next chunk.
    pub policy: Policy,
    /// Unsent bytes a class may hold per channel before senders wait (paper: 2 MB per queue).
    pub channel_queue_threshold: u64,
    /// Largest DATA payload this engine sends.
    pub max_frame_payload: usize,
    /// Receive window granted to the peer per virtual socket.
    pub stream_window: u32,
    /// Most virtual sockets open at once per peer.
    pub max_streams: u32,
    /// Out-of-order segments held per virtual socket before the peer is deemed abusive.
    pub max_out_of_order_segments: usize,
    /// How long `connect` waits for the peer to accept the virtual socket.
    pub connect_timeout: Duration,
    /// Timeout for dialing one channel: TCP connect and handshake. Above TCP's first SYN
    /// retransmission (1 s), so that one lost SYN or ARP request does not fail a connect.
    pub dial_timeout: Duration,
    /// How long a new peer's first channel is dialed again while the peer's acceptor refuses it
    /// at one of its limits (handshakes in progress, sessions, channels): a busy server, as
    /// when thousands of peers arrive together after it restarts, which TCP meets by sending a
    /// SYN again for about two minutes. The tries back off (doubling, with a random part, up to
    /// a second apart), so that the peers spread out. A silent host still fails within
    /// `dial_timeout`; a refusal past this fails the connect with `ConnectionRefused`.
    pub busy_dial_timeout: Duration,
    /// How long the acceptor gives a dialer to complete a channel handshake once its TCP
    /// connection is accepted (a silent dialer holds a handshake slot no longer).
    pub handshake_timeout: Duration,
    /// Whether the engine listens on `listen_addr` for peers' channels. An engine that only
    /// dials (a client's) needs no channel listener and no acceptor thread: nothing dials it.
    pub accept_channels: bool,
    /// Streams the engine accepts for a listener before the application does (more wait
    /// unanswered, then are refused).
    pub accept_backlog: usize,
    /// Bytes a channel writes per run before another channel gets a turn.
    pub tx_batch_bytes: usize,
    /// `TCP_NOTSENT_LOWAT` of throughput channels: the rest waits in user space.
    pub notsent_lowat: u32,
    /// `TCP_NOTSENT_LOWAT` of latency channels.
    pub latency_notsent_lowat: u32,
    /// Congestion control of the channels (`TCP_CONGESTION`), in order of preference: the
    /// first one the kernel accepts is used; none accepted (or an empty list) leaves the host's
    /// default. The default prefers loss-based algorithms (cubic, then reno) to the host's
    /// choice because one stream is striped over several channels: a channel waits on the
    /// others' bytes, and a rate-based algorithm such as BBR, whose bandwidth estimate (a max
    /// over about ten round trips: under a millisecond in a data centre) collapses during such a
    /// wait, then paces that channel at a fraction of the link and the whole stream waits on it
    /// (docs/BENCHMARKS.md, "The stall of one stream between the namespaces").
    pub congestion: Vec<String>,
    /// Worker threads serving throughput channels when no application thread does.
    pub workers: usize,
    /// With 3 workers or more (4 cores), a thread's bulk sends (frames not kept to its home
    /// channel) are written by the channels' workers while the thread writes one channel
    /// itself: one application thread's stream spreads its kernel work over several cores.
    pub spread_bulk_writes: bool,
    /// DATA payloads at least this large stay in the socket until their reader reads them
    /// straight into its buffer (0: never; everything is staged).
    pub defer_min: usize,
    /// How long a deferred payload waits for its reader before the engine stages it (so a
    /// reader that went away cannot hold up the other streams of its channel).
    pub defer_grace: Duration,
    /// How long a closed socket may take to deliver its last bytes before it is reset (as
    /// `SO_LINGER`), and how long a closed socket waits for its peer to finish.
    pub linger: Duration,
    /// Channel handshakes in progress at once; more connections are refused.
    pub max_handshakes: usize,
    /// Peer engines this engine accepts sessions from at once (the shards of one peer,
    /// `session_shards`, count once); a channel from one more is refused (and its dialer tries
    /// again within its `busy_dial_timeout`). A server for more peers raises it: an idle peer
    /// costs about 24-41 KB and one fd, a busy one five (docs/BENCHMARKS.md, "Many peers" and
    /// "One fd per channel"), and each session's receive share is one `stream_window` at least.
    pub max_sessions: usize,
    /// Receive credit one peer may be granted beyond each stream's own minimum window
    /// (`min_stream_window`, which every stream gets, as every TCP socket has a receive
    /// buffer): the received bytes it can make this engine hold for applications that have not
    /// read them. Streams that want more wait for applications to read; the channels are always
    /// read, so acknowledgements and credits keep flowing.
    pub max_peer_buffered: u64,
    /// The window every stream is granted whatever the receive budget, so that a stream its
    /// application reads always makes progress (what each open stream can make this engine
    /// hold, beyond the budget). 64 KiB, about the window a Linux socket's default receive
    /// buffer gives: with 10,000 streams to a peer, 16 KiB made every stream go through a
    /// credit round trip and a wake-up per 8 KiB (docs/BENCHMARKS.md, "A stream's own window").
    pub min_stream_window: u32,
    /// The same over every peer together (each session gets a share, one stream window at
    /// least).
    pub max_buffered: u64,
    /// Unsent and unacknowledged bytes of every peer together (each session gets a share):
    /// senders wait beyond it. With `max_retained_bytes` per channel, what a peer that reads
    /// or acknowledges nothing can make this engine hold for it.
    pub max_send_buffered: u64,
    /// Window granted to a stream the engine accepted and the application has not (yet): a
    /// peer cannot make an unaccepted backlog hold `accept_backlog` full windows.
    pub unaccepted_window: u32,
    /// Control frames (RSTs to unknown streams) queued per session and class for a peer that
    /// does not read; past it they are dropped and counted.
    pub max_control_backlog: usize,
    /// When throughput-class work runs at `throughput_policy` (see docs/ARCHITECTURE.md,
    /// "Isolation").
    pub isolation: Isolation,
    /// Scheduling of throughput-class work while isolation is on: the workers that serve
    /// throughput channels, and application threads while they do throughput-class channel
    /// work. SCHED_IDLE by default: bulk work never delays a latency-class thread on a shared
    /// core.
    pub throughput_policy: ThreadPolicy,
    /// Whether, and how, application threads are demoted while isolation is on (the workers
    /// always are). See `AppDemotion` and docs/BENCHMARKS.md, "Cores: 1 to 16 application
    /// threads, and session shards".
    pub app_demotion: AppDemotion,
    /// Throughput workers leave the cores to application threads while they have no send
    /// backlog: outside isolation too they run at `throughput_policy` unless a channel of
    /// theirs waited for room in its socket lately (docs/ARCHITECTURE.md, "Workers that
    /// yield"; `netchannel run --workers-yield`). Off by default: request-response programs
    /// gained and a bulk transfer lost on a 2-core host.
    pub workers_yield: bool,
    /// Scheduling of the worker that serves latency-class channels.
    pub latency_policy: ThreadPolicy,
    /// Cores the throughput workers may run on (`None`: any).
    pub throughput_cpus: Option<Vec<usize>>,
    /// Cores the latency worker may run on (`None`: any), e.g. a core of its own, as the paper
    /// gave latency channels.
    pub latency_cpus: Option<Vec<usize>>,
    /// Class of sockets `Engine::connect` opens (`connect_with_class` and `set_class` choose
    /// per socket).
    pub default_class: Class,
    /// Pre-shared key: when set, every channel is authenticated both ways (HMAC-SHA256
    /// challenge-response) before it is admitted, and peers without the key are refused.
    pub psk: Option<Vec<u8>>,
    /// The address dialers use to reach this engine, where it differs from the address the
    /// listener sees (address translation in between). The key's proofs bind the address a
    /// dialer dialed; without this the acceptor binds the local address of each channel.
    pub advertised_addr: Option<SocketAddr>,
    /// Channel handshakes in progress from one source (an IPv4 address or IPv6 /64): one
    /// source cannot hold every handshake slot; at `max_handshakes` a newcomer from a quieter
    /// source takes the oldest slot of the busiest one.
    pub max_handshakes_per_source: usize,
    /// Channels open at once, every peer (each costs one file descriptor). 0: half the
    /// process's file-descriptor limit, so that the engine's channels use at most half of it. A
    /// session's second and later channels take three quarters at most, and a new peer's first
    /// channel takes another session's extra one when every place is taken.
    pub max_channels_total: usize,
    /// Channels accepted from one source (an IPv4 address or IPv6 /64) at once.
    pub max_channels_per_source: usize,
    /// Bytes of DATA a channel holds unacknowledged by the peer before it takes no more (the
    /// senders then wait): what a peer that stops acknowledging can make this engine keep.
    pub max_retained_bytes: u64,
    /// Frames a channel holds unacknowledged before it takes no more.
    pub max_retained_frames: usize,
    /// A channel whose peer engine acknowledged nothing for this long while frames waited for it
    /// is looked at. Closed (its frames go on the other channels) if the peer engine
    /// acknowledged its other channels meanwhile (this one is broken), or if the peer's kernel
    /// is silent too (`user_timeout`: a black hole); else looked at again after as long. A peer
    /// whose kernel answers while its engine processes nothing is alive and only paused (a
    /// stopped process, a debugger's breakpoint), and TCP waits for it; what it may cost
    /// meanwhile is bounded (`max_retained_bytes`).
    pub ack_timeout: Duration,
    /// An idle channel is probed after this long without traffic (TCP keepalive).
    pub keepalive_idle: Duration,
    /// Between keepalive probes.
    pub keepalive_interval: Duration,
    /// Unanswered probes before an idle channel is dead.
    pub keepalive_count: u32,
    /// A channel whose peer engine acknowledged nothing for `ack_timeout` fails if its bytes
    /// in flight have had no acknowledgement from the peer's kernel either for this long (a
    /// black hole; read from `TCP_INFO`, not set as `TCP_USER_TIMEOUT`, whose zero-window abort
    /// would also drop a peer that only stopped reading).
    pub user_timeout: Duration,
    /// Answer `netchannel stat` through a control endpoint: a Unix socket that only this user
    /// (and root) can reach, in `control_dir`. Off: nothing outside the process sees the engine.
    pub control: bool,
    /// Where the control endpoint goes (`None`: `$NETCHANNEL_CONTROL_DIR`, else
    /// `/run/netchannel` for root, `$XDG_RUNTIME_DIR/netchannel`, or `/tmp/netchannel-UID`).
    pub control_dir: Option<PathBuf>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("listen_addr", &self.listen_addr)
            .field("dial_source", &self.dial_source)
            .field("netns", &self.netns)
            .field("channels", &self.channels)
            .field("max_channels", &self.max_channels)
            .field("busy_thread_rate", &self.busy_thread_rate)
            .field("latency_channels", &self.latency_channels)
            .field("policy", &self.policy)
            .field("workers", &self.workers)
            .field("psk", &self.psk.as_ref().map(|_| "<set>"))
            .finish_non_exhaustive()
    }
}

/// The cores this process may run on, asked once: each ask reads cgroup and mount files (about
/// 100 us), and a short-lived program's first connect would ask several times.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            dial_source: None,
            netns: None,
            channels: 4,
            rest_channels_after: Duration::from_millis(50),
            rest_channels_rate: 16 << 20,
            max_channels: 8,
            busy_thread_rate: 64 << 20,
            channel_retire_after: Duration::from_secs(10),
            latency_channels: 1,
            session_shards: cores().clamp(1, 16),
            policy: Policy::RoundRobin,
            channel_queue_threshold: 2 << 20,
            max_frame_payload: 256 * 1024,
            stream_window: 4 << 20,
            max_streams: 1 << 21,
            max_out_of_order_segments: 4096,
            connect_timeout: Duration::from_secs(5),
            dial_timeout: Duration::from_secs(3),
            busy_dial_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(1),
            accept_channels: true,
            accept_backlog: 4096,
            tx_batch_bytes: 512 * 1024,
            notsent_lowat: 1 << 20,
            latency_notsent_lowat: 16 * 1024,
            congestion: vec!["cubic".into(), "reno".into()],
            workers: cores().saturating_sub(1).max(1),
            spread_bulk_writes: true,
            defer_min: 32 * 1024,
            defer_grace: Duration::from_millis(2),
            linger: Duration::from_secs(30),
            max_handshakes: 64,
            max_sessions: 256,
            max_peer_buffered: 32 << 20,
            min_stream_window: 64 * 1024,
            max_buffered: 1 << 30,
            max_send_buffered: 1 << 30,
            unaccepted_window: 64 * 1024,
            max_control_backlog: 4096,
            isolation: Isolation::Auto,
            throughput_policy: ThreadPolicy::Idle,
            app_demotion: AppDemotion::Sticky,
            workers_yield: false,
            latency_policy: ThreadPolicy::Normal,
            throughput_cpus: None,
            latency_cpus: None,
            default_class: Class::Throughput,
            psk: None,
            advertised_addr: None,
            max_handshakes_per_source: 16,
            max_channels_total: 0,
            max_channels_per_source: 256,
            max_retained_bytes: 4 << 20,
            max_retained_frames: 1 << 16,
            ack_timeout: Duration::from_secs(20),
            keepalive_idle: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            keepalive_count: 3,
            user_timeout: Duration::from_secs(20),
            control: true,
            control_dir: None,
        }
    }
}

impl Config {
    /// Throughput channels shard `shard` of a session starts with (see `session_shards`).
    pub(crate) fn shard_channels(&self, shard: u16) -> usize {
        if shard == 0 {
            return self.channels;
        }
        if shard == LATENCY_SHARD {
            return 1; // its streams use the latency channels
        }
        self.channels.div_ceil(self.session_shards).max(1)
    }

    /// The defaults, with the channel listener on `listen_addr`.
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
        if self.session_shards == 0 || self.session_shards > MAX_SHARDS {
            return bad(format!("session_shards must be in 1..={MAX_SHARDS}"));
        }
        if self.busy_thread_rate == 0 {
            return bad("busy_thread_rate must be > 0".into());
        }
        if self.channel_retire_after < Duration::from_millis(10) {
            return bad("channel_retire_after must be at least 10 ms".into());
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
        if self.max_streams == 0 || self.max_streams > MAX_STREAMS {
            return bad(format!("max_streams must be in 1..={MAX_STREAMS}"));
        }
        if self.accept_backlog == 0 || self.tx_batch_bytes == 0 || self.workers == 0 {
            return bad("accept_backlog, tx_batch_bytes and workers must be > 0".into());
        }
        if self.max_handshakes == 0 || self.max_sessions == 0 || self.max_control_backlog == 0 {
            return bad("max_handshakes, max_sessions and max_control_backlog must be > 0".into());
        }
        if self.unaccepted_window == 0 || self.unaccepted_window > self.stream_window {
            return bad("unaccepted_window must be in 1..=stream_window".into());
        }
        if self.min_stream_window == 0 || self.min_stream_window > self.unaccepted_window {
            return bad("min_stream_window must be in 1..=unaccepted_window".into());
        }
        for cpus in [&self.throughput_cpus, &self.latency_cpus].into_iter().flatten() {
            if cpus.is_empty() || cpus.iter().any(|&c| c >= 1024) {
                return bad("a core set must name at least one core, each below 1024".into());
            }
        }
        for p in [self.throughput_policy, self.latency_policy] {
            if matches!(p, ThreadPolicy::Nice(n) if !(-20..=19).contains(&n)) {
                return bad("a nice value must be in -20..=19".into());
            }
        }
        if self.psk.as_ref().is_some_and(|k| k.len() < 16) {
            return bad("the pre-shared key must be at least 16 bytes".into());
        }
        if self.max_handshakes_per_source == 0 || self.max_channels_per_source == 0 {
            return bad("max_handshakes_per_source and max_channels_per_source must be > 0".into());
        }
        if self.max_retained_bytes < self.max_frame_payload as u64 || self.max_retained_frames < 64
        {
            return bad(
                "max_retained_bytes must hold a frame, max_retained_frames at least 64".into()
            );
        }
        if self.ack_timeout.is_zero() || self.user_timeout.is_zero() || self.keepalive_count == 0 {
            return bad("ack_timeout, user_timeout and keepalive_count must be > 0".into());
        }
        if self.keepalive_idle < Duration::from_secs(1)
            || self.keepalive_interval < Duration::from_secs(1)
        {
            return bad(
                "keepalive_idle and keepalive_interval are whole seconds, at least 1".into()
            );
        }
        let channels = self.channels + self.latency_channels;
        if self.effective_max_channels_total() < channels {
            return bad(format!(
                "max_channels_total ({}) is below the channels of one session ({channels})",
                self.effective_max_channels_total()
            ));
        }
        Ok(())
    }

    /// `max_channels_total`, or half the file-descriptor limit when it is 0 (one fd per
    /// channel: the engine's channels take at most half, the application keeps the rest).
    pub fn effective_max_channels_total(&self) -> usize {
        if self.max_channels_total > 0 {
            return self.max_channels_total;
        }
        (crate::sys::fd_limit() / 2).max(64)
    }
}
