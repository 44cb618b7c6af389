//! Two sessions joined by in-memory channels and driven with a virtual clock, as quinn's `Pair`:
//! the protocol core and the channel framer tested without sockets, threads or sleeps. Every
//! choice (which channel delivers next, how many bytes, send and recv sizes, whether a payload
//! is deferred) comes from a seeded generator, so a failure replays exactly.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::framing::{FrameReader, Heap, Parsed};
use super::stream::{Violation, F_RST_PENDING};
use super::*;
use crate::scheduler::Policy;
use crate::wire::{Class, Frame, RstReason};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Deterministic stream content: byte `offset` of stream `seed`.
fn pattern(seed: u64, offset: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let p = offset + i as u64;
        *b = ((p.wrapping_mul(0x9E37_79B9) >> 7) ^ seed ^ (p >> 13)) as u8;
    }
}

/// One direction of a channel: the bytes "in the kernel" and the receiver's framer.
struct Dir {
    pipe: VecDeque<u8>,
    reader: FrameReader,
}

struct Link {
    index: ChannelId,
    alive: bool,
    /// Killed, and this side learns of it only after this many more steps (a reset reaches
    /// the two ends at different times: one may resend before the other knows).
    late_loss: Option<(usize, u32)>,
    /// `dirs[s]`: bytes sent by side `s`, read by side `1 - s`.
    dirs: [Dir; 2],
}

struct Pair {
    sides: [Session<()>; 2],
    links: Vec<Link>,
    now: Instant,
    rng: Rng,
    /// Bytes one direction of a channel holds before its sender stops pulling.
    pipe_cap: usize,
    /// Percent of large payloads deferred (left for the reader) rather than staged.
    defer_percent: u64,
    /// Virtual time after which the engine reads a deferred payload itself.
    grace: Duration,
    listening: [HashSet<u16>; 2],
    events: [Vec<(StreamId, u8)>; 2],
    /// A side may receive garbage (fuzzing): a bad frame closes the channel it came on, as the
    /// engine does, instead of failing the test.
    hostile: bool,
    /// Channels closed for a protocol violation.
    violations: usize,
}

const LARGE: usize = 16 * 1024;

impl Pair {
    fn new(seed: u64, channels: &[Class], cfg: CoreConfig) -> Pair {
        let mut p = Pair {
            sides: [Session::new(cfg.clone()), Session::new(cfg)],
            links: Vec::new(),
            now: Instant::now(),
            rng: Rng(seed | 1),
            pipe_cap: 256 * 1024,
            defer_percent: 70,
            grace: Duration::from_millis(5),
            listening: [HashSet::new(), HashSet::new()],
            events: [Vec::new(), Vec::new()],
            hostile: false,
            violations: 0,
        };
        for (i, &class) in channels.iter().enumerate() {
            p.add_link(i as u16, class);
        }
        p
    }

    /// Adds channel `index`: its next incarnation if the index was used before.
    fn add_link(&mut self, index: u16, class: Class) {
        let incarnation = self
            .links
            .iter()
            .filter(|l| l.index.index == index)
            .map(|l| l.index.incarnation.wrapping_add(1))
            .max()
            .unwrap_or(0);
        let index = ChannelId::new(index, incarnation);
        for s in &mut self.sides {
            s.add_channel(index, class);
        }
        self.links.push(Link {
            index,
            alive: true,
            late_loss: None,
            dirs: [
                Dir { pipe: VecDeque::new(), reader: FrameReader::new(LARGE, Heap(256 * 1024)) },
                Dir { pipe: VecDeque::new(), reader: FrameReader::new(LARGE, Heap(256 * 1024)) },
            ],
        });
    }

    /// Kills the live channel with index `index`.
    fn kill(&mut self, index: u16) {
        self.end_channel(index, false);
    }

    /// Ends the live channel with index `index`, as a failure or (`closed_by_peer`) as a clean
    /// close by the other side's process.
    fn end_channel(&mut self, index: u16, closed_by_peer: bool) {
        let l = self.links.iter_mut().find(|l| l.index.index == index && l.alive).unwrap();
        let index = l.index;
        l.alive = false;
        l.dirs[0].pipe.clear();
        l.dirs[1].pipe.clear();
        for s in &mut self.sides {
            s.channel_lost(index, closed_by_peer);
        }
    }

    /// Kills the live channel with index `index`; side `first` learns of it now, the other side
    /// `after` steps later.
    fn kill_staggered(&mut self, index: u16, first: usize, after: u32) {
        let l = self.links.iter_mut().find(|l| l.index.index == index && l.alive).unwrap();
        let index = l.index;
        l.alive = false;
        // The late side may still read what its socket had received.
        l.dirs[1 - first].pipe.clear();
        l.late_loss = Some((1 - first, after));
        self.sides[first].channel_lost(index, false);
    }

    /// Pulls frames for every channel with room and writes them into the pipes.
    fn transmit(&mut self, side: usize) {
        let mut out = Vec::new();
        // A side that has not yet learnt its channel died still sends into it (a black hole).
        let late = |l: &Link| l.late_loss.is_some_and(|(s, _)| s == side);
        for l in self.links.iter_mut().filter(|l| l.alive || late(l)) {
            if !l.alive {
                l.dirs[side].pipe.clear();
            }
            let pipe = &mut l.dirs[side].pipe;
            let room = self.pipe_cap.saturating_sub(pipe.len());
            if room == 0 {
                continue;
            }
            let force = self.rng.chance(20);
            self.sides[side].poll_transmit(l.index, room, 64, force, &mut out);
            for f in out.drain(..) {
                pipe.extend(&f.header[..f.header_len as usize]);
                pipe.extend(&f.payload[..]);
            }
        }
    }

    /// Side `side` reads some bytes of channel `li` as a channel worker would.
    fn receive(&mut self, side: usize, li: usize) {
        let l = &mut self.links[li];
        if !l.alive && l.late_loss.is_none_or(|(late, _)| late != side) {
            return;
        }
        let ch = l.index;
        let dir = &mut l.dirs[1 - side];
        let session = &mut self.sides[side];
        if !session.reader_may_read(ch, &mut dir.reader, self.now, self.grace) {
            return;
        }
        let want = dir.reader.want();
        if want == 0 || dir.pipe.is_empty() {
            return;
        }
        let n = want.min(dir.pipe.len()).min(1 + self.rng.below(300_000) as usize);
        let buf = dir.reader.buffer(n);
        let (a, b) = dir.pipe.as_slices();
        let from_a = n.min(a.len());
        buf.extend_from_slice(&a[..from_a]);
        buf.extend_from_slice(&b[..n - from_a]);
        dir.pipe.drain(..n);
        let mut parsed = Vec::new();
        let mut violated = false;
        'read: loop {
            parsed.clear();
            if let Err(e) = dir.reader.parse(&mut parsed, 64) {
                assert!(self.hostile, "honest peers send valid frames: {e}");
                violated = true;
                break;
            }
            if parsed.is_empty() {
                break;
            }
            for item in parsed.drain(..) {
                let defer = self.rng.chance(self.defer_percent);
                let r = session.receive(ch, item, self.now, |_, _| defer);
                if let Ok(Some(v)) = r {
                    dir.reader.verdict(v);
                }
                if let Err(v) = r {
                    assert!(self.hostile, "no protocol violation between honest peers: {v}");
                    if side == 0 {
                        // Side 0 is the attacker's alter ego: it sees honest answers to frames
                        // it never sent (ACKs of injected bytes, RSTs for ids it never issued),
                        // and, being the attacker, ignores them.
                        continue;
                    }
                    violated = true;
                    break 'read;
                }
            }
        }
        if violated {
            // The engine closes the channel a bad frame came on; both ends see it go.
            self.violations += 1;
            let index = self.links[li].index;
            self.kill(index.index);
        }
    }

    /// One round: both sides transmit, a random subset of channel directions deliver, incoming
    /// streams are decided, events collected, timers run. The clock advances 100 us.
    fn step(&mut self) {
        for l in &mut self.links {
            match &mut l.late_loss {
                Some((side, 0)) => {
                    self.sides[*side].channel_lost(l.index, false);
                    l.dirs[1 - *side].pipe.clear();
                    l.late_loss = None;
                }
                Some((_, n)) => *n -= 1,
                None => {}
            }
        }
        for side in 0..2 {
            self.transmit(side);
        }
        for _ in 0..self.links.len() * 2 {
            let side = self.rng.below(2) as usize;
            let li = self.rng.below(self.links.len() as u64) as usize;
            self.receive(side, li);
        }
        for side in 0..2 {
            while let Some((id, port)) = self.sides[side].poll_incoming() {
                if self.listening[side].contains(&port) {
                    let w = self.sides[side].config().window;
                    self.sides[side].handle(id).accept(w);
                } else {
                    self.sides[side].handle(id).refuse(RstReason::NoListener);
                }
            }
            while let Some(e) = self.sides[side].poll_event() {
                self.events[side].push(e);
            }
            self.sides[side].handle_timeout(self.now);
        }
        self.now += Duration::from_micros(100);
    }

    /// An application `recv` on side `side`: copies ready bytes or reads a deferred payload
    /// straight from its channel, as the runtime does.
    fn recv(&mut self, side: usize, id: StreamId, buf: &mut [u8]) -> Recv {
        let mut slices = Vec::new();
        match self.sides[side].handle(id).recv(buf.len() as u64, &mut slices) {
            Recv::Data(n) => {
                let mut at = 0;
                for s in slices {
                    buf[at..at + s.len()].copy_from_slice(&s);
                    at += s.len();
                }
                assert_eq!(at as u64, n);
                Recv::Data(n)
            }
            Recv::Deferred { channel, max } => {
                let l = self.links.iter_mut().find(|l| l.index == channel).unwrap();
                let pipe = &mut l.dirs[1 - side].pipe;
                let n = (max as usize).min(pipe.len());
                if n == 0 {
                    self.sides[side].handle(id).deferred_empty();
                    return Recv::Empty;
                }
                for (i, b) in pipe.drain(..n).enumerate() {
                    buf[i] = b;
                }
                assert!(self.sides[side].handle(id).deferred_read(channel, n as u64));
                if self.sides[side].deferred(channel).is_none() {
                    l.dirs[1 - side].reader.resume();
                }
                Recv::Data(n as u64)
            }
            Recv::DropDeferred { channel } => {
                // An urgent byte kept out of the stream, still in its channel: dropped.
                let l = self.links.iter_mut().find(|l| l.index == channel).unwrap();
                let pipe = &mut l.dirs[1 - side].pipe;
                if pipe.is_empty() {
                    self.sides[side].handle(id).deferred_empty();
                    return Recv::Empty;
                }
                pipe.drain(..1);
                assert!(self.sides[side].handle(id).deferred_read(channel, 1));
                if self.sides[side].deferred(channel).is_none() {
                    l.dirs[1 - side].reader.resume();
                }
                self.recv(side, id, buf)
            }
            Recv::Empty => {
                // A reader woken for "readable" must find something: never readable and empty.
                assert!(
                    !self.sides[side].handle(id).readable(),
                    "recv found nothing on a stream that says it is readable"
                );
                Recv::Empty
            }
            other => other,
        }
    }

    /// Opens a stream from side 0 to `port` on side 1 and returns both ids.
    fn open(&mut self, port: u16, class: Class) -> (StreamId, StreamId) {
        self.listening[1].insert(port);
        let a = self.sides[0].open(port, class, (), self.now).unwrap();
        for _ in 0..1000 {
            self.step();
            if self.sides[0].stream(a).is_some_and(|s| s.phase == Phase::Open) {
                // Side 1's own id for the stream, as side 0 learnt it from the SYN_ACK.
                let peer = self.sides[0].stream(a).unwrap().peer;
                return (a, StreamId(peer.get()));
            }
        }
        panic!("stream never opened");
    }
}

fn config() -> CoreConfig {
    CoreConfig { max_frame_payload: 64 * 1024, window: 1 << 20, ..CoreConfig::default() }
}

/// Sends `len` bytes of `pattern(seed)` from side 0 and reads them on side 1 with random call
/// sizes, checking every byte. Returns the steps taken.
struct Transfer {
    a: StreamId,
    b: StreamId,
    seed: u64,
    len: u64,
    sent: u64,
    received: u64,
    shut: bool,
    eof: bool,
}

impl Transfer {
    fn new(a: StreamId, b: StreamId, seed: u64, len: u64) -> Self {
        Transfer { a, b, seed, len, sent: 0, received: 0, shut: false, eof: false }
    }

    fn drive(&mut self, p: &mut Pair, sendbuf: &mut [u8], recvbuf: &mut [u8], max_io: u64) {
        while self.sent < self.len {
            let n = (1 + p.rng.below(max_io)).min(self.len - self.sent) as usize;
            pattern(self.seed, self.sent, &mut sendbuf[..n]);
            match p.sides[0].handle(self.a).send(&sendbuf[..n]) {
                Ok(k) => self.sent += k as u64,
                Err(SendError::NoCredit | SendError::NoSpace) => break,
                Err(e) => panic!("send: {e:?}"),
            }
        }
        if self.sent == self.len && !self.shut {
            p.sides[0].handle(self.a).shutdown_write().unwrap();
            self.shut = true;
        }
        for _ in 0..4 {
            let n = (1 + p.rng.below(max_io)) as usize;
            match p.recv(1, self.b, &mut recvbuf[..n]) {
                Recv::Data(k) => {
                    let k = k as usize;
                    let mut expect = vec![0u8; k];
                    pattern(self.seed, self.received, &mut expect);
                    assert!(recvbuf[..k] == expect[..], "bytes differ at {}", self.received);
                    self.received += k as u64;
                }
                Recv::Eof => {
                    self.eof = true;
                    break;
                }
                Recv::Empty => break,
                other => panic!("recv: {other:?}"),
            }
        }
    }

    fn done(&self) -> bool {
        self.eof
    }
}

fn run_transfer(p: &mut Pair, t: &mut Transfer, max_io: u64, max_steps: usize) -> usize {
    let mut sendbuf = vec![0u8; max_io as usize];
    let mut recvbuf = vec![0u8; max_io as usize];
    for step in 0..max_steps {
        t.drive(p, &mut sendbuf, &mut recvbuf, max_io);
        if t.done() {
            assert_eq!(t.received, t.len);
            return step;
        }
        p.step();
    }
    panic!("transfer stalled: sent {} received {} of {}", t.sent, t.received, t.len);
}

#[test]
fn one_gib_striped_over_four_channels_with_random_sizes() {
    let mut p = Pair::new(7, &[Class::Throughput; 4], config());
    let (a, b) = p.open(80, Class::Throughput);
    let mut t = Transfer::new(a, b, 1, 1 << 30);
    run_transfer(&mut p, &mut t, 1 << 20, 10_000_000);
    // Every channel carried a share, and everything was acknowledged in the end.
    for _ in 0..20 {
        p.step();
    }
    assert!(p.sides[0].retained_bytes() < 1 << 20);
    assert!(p.sides[0].stats().retransmitted_bytes == 0);
}

#[test]
fn small_writes_coalesce_and_arrive_intact() {
    let mut p = Pair::new(3, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    let mut t = Transfer::new(a, b, 2, 4 << 20);
    run_transfer(&mut p, &mut t, 64, 10_000_000);
    let frames = p.sides[0].stream(a).map_or(0, |s| s.frames_sent);
    assert!(frames < (4 << 20) / 64 / 8, "64 B writes left in {frames} frames");
}

/// Steps the pair until side 1 has read `len` bytes of stream `b` (in one or more reads).
fn read_exactly(p: &mut Pair, b: StreamId, len: usize) {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    for _ in 0..1000 {
        if let Recv::Data(n) = p.recv(1, b, &mut buf[got..]) {
            got += n as usize;
            if got == len {
                return;
            }
            continue;
        }
        p.step();
    }
    panic!("{got} of {len} bytes arrived");
}

#[test]
fn a_credit_may_wait_only_while_the_sender_has_credit_left() {
    // No budget beyond the 16 KiB floor: a CREDIT is due after every 8 KiB read.
    let cfg = CoreConfig { rx_budget: 0, min_window: 16 * 1024, ..config() };
    let mut p = Pair::new(21, &[Class::Throughput], cfg);
    let msg = [3u8; 4096];

    // Request-sized messages, each read before the next is sent: the sender never used more
    // than half of its credit, so the CREDIT may ride with the next frames out.
    let (a, b) = p.open(80, Class::Throughput);
    for _ in 0..2 {
        assert_eq!(p.sides[0].handle(a).send(&msg), Ok(4096));
        read_exactly(&mut p, b, 4096);
    }
    assert!(p.sides[1].handle(b).owes_control(), "8 KiB read: a CREDIT is due");
    assert!(p.sides[1].handle(b).control_can_wait(), "the sender still has 8 KiB of credit");

    // A sender that used its whole window: the CREDIT it waits for may not wait.
    let (a, b) = p.open(81, Class::Throughput);
    assert_eq!(p.sides[0].handle(a).send(&msg), Ok(4096));
    read_exactly(&mut p, b, 4096);
    assert!(!p.sides[1].handle(b).owes_control());
    let rest = [4u8; 12 * 1024];
    assert_eq!(p.sides[0].handle(a).send(&rest), Ok(12 * 1024), "the window's last 12 KiB");
    assert_eq!(p.sides[0].handle(a).send(&msg), Err(SendError::NoCredit));
    for _ in 0..50 {
        p.step(); // all of it arrives; nothing is owed yet, so no CREDIT leaves meanwhile
    }
    assert_eq!(p.sides[1].stream(b).map(|s| s.rx.high()), Some(16 * 1024));
    read_exactly(&mut p, b, 4096);
    assert!(p.sides[1].handle(b).owes_control());
    assert!(!p.sides[1].handle(b).control_can_wait(), "the sender is out of credit");
}

#[test]
fn many_streams_share_channels_fairly_and_intact() {
    let mut p = Pair::new(11, &[Class::Throughput; 3], config());
    let mut ts: Vec<Transfer> = (0..50)
        .map(|i| {
            let (a, b) = p.open(80, Class::Throughput);
            Transfer::new(a, b, 100 + i, 1 + (i * 7919) % 300_000)
        })
        .collect();
    let mut sendbuf = vec![0u8; 70_000];
    let mut recvbuf = vec![0u8; 70_000];
    let mut most_spare = 0;
    for _ in 0..200_000 {
        for t in ts.iter_mut().filter(|t| !t.done()) {
            t.drive(&mut p, &mut sendbuf, &mut recvbuf, 70_000);
        }
        let spare = p.sides[0].stats().spare_bytes;
        assert!(spare <= config().tx_budget, "{spare} bytes of spare chunks");
        most_spare = most_spare.max(spare);
        if ts.iter().all(Transfer::done) {
            assert!(most_spare > 0, "acknowledged chunks were never kept for reuse");
            return;
        }
        p.step();
    }
    panic!("not every stream finished");
}

#[test]
fn stalled_reader_does_not_stop_other_streams() {
    let mut p = Pair::new(5, &[Class::Throughput; 2], config());
    let (stalled, _never_read) = p.open(80, Class::Throughput);
    // Fill the stalled stream's window; its bytes sit at the receiver (staged after the grace
    // period if they were deferred), not in front of anybody else.
    let chunk = vec![1u8; 64 * 1024];
    let mut sent = 0;
    for _ in 0..10_000 {
        if let Ok(n) = p.sides[0].handle(stalled).send(&chunk) {
            sent += n;
        }
        p.step();
        if sent as u32 >= config().window {
            break;
        }
    }
    assert_eq!(sent as u32, config().window, "the window fills, then send waits for credit");
    assert_eq!(p.sides[0].handle(stalled).send(&chunk), Err(SendError::NoCredit));
    let (a, b) = p.open(81, Class::Throughput);
    let mut t = Transfer::new(a, b, 9, 16 << 20);
    run_transfer(&mut p, &mut t, 256 * 1024, 1_000_000);
}

#[test]
fn fin_overtaking_data_never_truncates_and_half_close_works() {
    for seed in 1..40 {
        let mut p = Pair::new(seed, &[Class::Throughput; 4], config());
        let (a, b) = p.open(80, Class::Throughput);
        let len = 1 + Rng(seed).below(200_000);
        let mut t = Transfer::new(a, b, seed, len);
        run_transfer(&mut p, &mut t, 5000, 1_000_000);
        // The other direction still works after side 0 finished writing.
        let data = vec![4u8; 1000];
        assert_eq!(p.sides[1].handle(b).send(&data), Ok(1000));
        p.sides[1].handle(b).shutdown_write().unwrap();
        let mut buf = vec![0u8; 4096];
        let mut got = 0;
        for _ in 0..10_000 {
            p.step();
            let mut slices = Vec::new();
            match p.sides[0].handle(a).recv(4096, &mut slices) {
                Recv::Data(n) => got += n,
                Recv::Eof => break,
                Recv::Deferred { .. } => panic!("1000 bytes are never deferred"),
                _ => {}
            }
            let _ = &mut buf;
        }
        assert_eq!(got, 1000);
    }
}

#[test]
fn losing_a_channel_mid_transfer_loses_no_byte() {
    for seed in 1..6 {
        let mut p = Pair::new(seed, &[Class::Throughput; 4], config());
        let (a, b) = p.open(80, Class::Throughput);
        let mut t = Transfer::new(a, b, seed, 64 << 20);
        let mut sendbuf = vec![0u8; 1 << 20];
        let mut recvbuf = vec![0u8; 1 << 20];
        let mut killed = false;
        for _ in 0..2_000_000 {
            t.drive(&mut p, &mut sendbuf, &mut recvbuf, 1 << 20);
            // Kill the channel carrying the most unacknowledged bytes, once a third arrived.
            let victim = (0..4u16)
                .max_by_key(|&c| p.sides[0].channel_retained(ChannelId::new(c, 0)))
                .unwrap();
            if !killed
                && t.received > t.len / 3
                && p.sides[0].channel_retained(ChannelId::new(victim, 0)) > 0
            {
                p.kill(victim);
                killed = true;
            }
            if t.done() {
                break;
            }
            p.step();
        }
        assert!(killed && t.done(), "seed {seed}: received {} of {}", t.received, t.len);
        assert!(p.sides[0].stats().retransmitted_bytes > 0, "seed {seed}: nothing was resent");
        assert!(p.sides[0].stream(a).unwrap().reset.is_none());
    }
}

#[test]
fn a_channel_lost_at_one_end_before_the_other_loses_no_byte() {
    // The sender learns first and sends the channel's unacknowledged bytes again while the
    // receiver still counts on a payload deferred in the dead socket (and the other way round):
    // nothing may be dropped as a duplicate of bytes the receiver never got.
    for seed in 1..17 {
        let mut p = Pair::new(seed, &[Class::Throughput; 4], config());
        p.defer_percent = 100;
        p.grace = Duration::from_millis(20);
        let (a, b) = p.open(80, Class::Throughput);
        let mut t = Transfer::new(a, b, seed, 16 << 20);
        let mut sendbuf = vec![0u8; 1 << 20];
        let mut recvbuf = vec![0u8; 1 << 20];
        let mut killed = false;
        let first = (seed % 2) as usize;
        for _ in 0..50_000 {
            t.drive(&mut p, &mut sendbuf, &mut recvbuf, 1 << 20);
            // Kill a channel holding a payload deferred at the receiver, once a third arrived.
            let victim = (0..4u16).find(|&c| p.sides[1].deferred(ChannelId::new(c, 0)).is_some());
            if let Some(victim) = victim.filter(|_| !killed && t.received > t.len / 3) {
                let after = 1 + p.rng.below(50) as u32;
                p.kill_staggered(victim, first, after);
                killed = true;
            }
            // The bytes held (resent copies included) stay accounted for.
            let _ = p.sides[1].stats();
            if t.done() {
                break;
            }
            p.step();
        }
        assert!(killed && t.done(), "seed {seed}: received {} of {}", t.received, t.len);
        assert_eq!(p.sides[1].stats().held_bytes, 0, "seed {seed}");
        assert!(p.sides[0].stream(a).unwrap().reset.is_none());
    }
}

#[test]
fn losing_every_channel_resets_every_stream() {
    let mut p = Pair::new(2, &[Class::Throughput, Class::Latency], config());
    let (a, _b) = p.open(80, Class::Throughput);
    let (l, _lb) = p.open(81, Class::Latency);
    p.kill(0);
    assert!(p.sides[0].stream(a).unwrap().reset.is_none(), "the latency channel remains");
    p.kill(1);
    for id in [a, l] {
        assert_eq!(p.sides[0].stream(id).unwrap().reset, Some(ResetCause::ChannelLost));
    }
    assert_eq!(p.sides[0].open(80, Class::Throughput, (), p.now), Err(OpenError::NoChannels));
}

#[test]
fn a_class_without_channels_borrows_the_other_class() {
    let mut p = Pair::new(4, &[Class::Throughput], config());
    let (a, b) = p.open(80, Class::Latency);
    let mut t = Transfer::new(a, b, 4, 1 << 20);
    run_transfer(&mut p, &mut t, 10_000, 100_000);
}

#[test]
fn latency_frames_never_wait_behind_throughput_frames() {
    // Pull for the throughput channel never yields a latency stream's bytes and vice versa.
    let mut p = Pair::new(8, &[Class::Throughput, Class::Latency], config());
    let (bulk, _) = p.open(80, Class::Throughput);
    let (lat, _) = p.open(81, Class::Latency);
    p.sides[0].handle(bulk).send(&vec![1u8; 500_000]).unwrap();
    p.sides[0].handle(lat).send(&[2u8; 100]).unwrap();
    let mut out = Vec::new();
    p.sides[0].poll_transmit(ChannelId::new(1, 0), 1 << 20, 64, false, &mut out);
    let lat_peer = p.sides[0].stream(lat).unwrap().peer;
    let data = |out: &[OutFrame]| -> Vec<u64> {
        out.iter()
            .filter(|f| f.header[0] == 1)
            .map(|f| u64::from_be_bytes(f.header[4..12].try_into().unwrap()))
            .collect()
    };
    assert_eq!(data(&out), vec![lat_peer.get()], "only the latency stream's frame");
    out.clear();
    p.sides[0].poll_transmit(ChannelId::new(0, 0), 1 << 20, 64, false, &mut out);
    let bulk = data(&out);
    assert!(!bulk.is_empty() && !bulk.contains(&lat_peer.get()));
}

#[test]
fn open_to_no_listener_is_refused_and_a_silent_peer_times_out() {
    let mut p = Pair::new(6, &[Class::Throughput], config());
    let a = p.sides[0].open(99, Class::Throughput, (), p.now).unwrap();
    for _ in 0..100 {
        p.step();
    }
    assert_eq!(p.sides[0].stream(a).unwrap().reset, Some(ResetCause::Peer(RstReason::NoListener)));
    // Nothing is delivered any more: the open times out on the virtual clock.
    let a = p.sides[0].open(80, Class::Throughput, (), p.now).unwrap();
    p.now += config().connect_timeout + Duration::from_millis(1);
    p.sides[0].handle_timeout(p.now);
    assert_eq!(p.sides[0].stream(a).unwrap().reset, Some(ResetCause::ConnectTimeout));
}

#[test]
fn close_with_unread_data_resets_the_peer_and_closed_streams_are_freed() {
    let mut p = Pair::new(9, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[0].handle(a).send(&[1u8; 1000]).unwrap();
    for _ in 0..50 {
        p.step();
    }
    assert_eq!(p.sides[1].stream(b).unwrap().unread_bytes(), 1000);
    p.sides[1].handle(b).close(p.now);
    assert!(p.sides[1].stream(b).is_none(), "a reset stream is freed at once");
    for _ in 0..50 {
        p.step();
    }
    assert_eq!(p.sides[0].stream(a).unwrap().reset, Some(ResetCause::Peer(RstReason::Aborted)));
    p.sides[0].handle(a).close(p.now);
    assert_eq!(p.sides[0].stream_count(), 0);

    // A clean close on both sides frees both streams once everything is acknowledged.
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[0].handle(a).send(&[1u8; 10]).unwrap();
    p.sides[0].handle(a).close(p.now);
    for _ in 0..50 {
        p.step();
    }
    let mut buf = [0u8; 16];
    assert_eq!(p.recv(1, b, &mut buf), Recv::Data(10));
    assert_eq!(p.recv(1, b, &mut buf), Recv::Eof);
    p.sides[1].handle(b).close(p.now);
    for _ in 0..50 {
        p.step();
    }
    assert_eq!(p.sides[0].stream_count() + p.sides[1].stream_count(), 0);
}

#[test]
fn sticky_policy_keeps_a_stream_on_one_channel() {
    let cfg = CoreConfig { policy: Policy::Sticky, ..config() };
    let mut p = Pair::new(12, &[Class::Throughput; 4], cfg);
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[0].handle(a).send(&vec![3u8; 300_000]).unwrap();
    let mut used = HashSet::new();
    let mut out = Vec::new();
    for ch in 0..4u16 {
        p.sides[0].poll_transmit(ChannelId::new(ch, 0), 1 << 20, 64, false, &mut out);
        if out.iter().any(|f| f.header[0] == 1) {
            used.insert(ch);
        }
        out.clear();
    }
    assert_eq!(used.len(), 1, "{used:?}");
    let _ = b;
}

/// Channels (by index) on which side `side` sends DATA when each pulls now (the frames go
/// into the channels' pipes, as `transmit` puts them).
fn data_channels(p: &mut Pair, side: usize) -> Vec<u16> {
    let mut used = Vec::new();
    let mut out = Vec::new();
    for l in p.links.iter_mut().filter(|l| l.alive) {
        p.sides[side].poll_transmit(l.index, 128 * 1024, 64, false, &mut out);
        if out.iter().any(|f| f.header[0] == 1) {
            used.push(l.index.index);
        }
        for f in out.drain(..) {
            l.dirs[side].pipe.extend(&f.header[..f.header_len as usize]);
            l.dirs[side].pipe.extend(&f.payload[..]);
        }
    }
    used
}

/// Steps the pair until side `side` has read `len` bytes of stream `id`; returns them.
fn read_all(p: &mut Pair, side: usize, id: StreamId, len: usize) -> Vec<u8> {
    let mut got = Vec::new();
    for _ in 0..10_000 {
        if got.len() >= len {
            return got;
        }
        p.step();
        let mut buf = vec![0u8; len - got.len()];
        if let Recv::Data(n) = p.recv(side, id, &mut buf) {
            got.extend_from_slice(&buf[..n as usize]);
        }
    }
    panic!("read {} of {len} bytes", got.len());
}

#[test]
fn a_thread_s_messages_and_their_answers_keep_to_its_channel() {
    let mut p = Pair::new(14, &[Class::Throughput; 4], config());
    p.listening[1].insert(80);
    // Thread 40 of side 0 is the first to use the session: its channel is the first.
    let a = p.sides[0].open_from(80, Class::Throughput, (), p.now, Some(40)).unwrap();
    for _ in 0..1000 {
        if p.sides[0].stream(a).is_some_and(|s| s.phase == Phase::Open) {
            break;
        }
        p.step();
    }
    let b = StreamId(p.sides[0].stream(a).unwrap().peer.get());
    p.sides[0].take_kicked(Class::Throughput);
    p.sides[0].handle(a).send(&[7u8; 4096]).unwrap();
    assert_eq!(p.sides[0].take_kicked(Class::Latency), 0, "only its class's channels");
    assert_eq!(p.sides[0].take_kicked(Class::Throughput), 1, "its home is told to write");
    assert_eq!(data_channels(&mut p, 0), vec![0], "a message leaves on the thread's channel");
    assert_eq!(read_all(&mut p, 1, b, 4096), vec![7u8; 4096]);
    p.sides[1].handle(b).send(&[9u8; 4096]).unwrap();
    assert_eq!(data_channels(&mut p, 1), vec![0], "the answer goes back where it came from");
    assert_eq!(read_all(&mut p, 0, a, 4096), vec![9u8; 4096]);
    // A backlog spreads over every channel with room.
    p.sides[0].handle(a).send(&vec![1u8; 400 * 1024]).unwrap();
    assert!(data_channels(&mut p, 0).len() > 1, "a bulk stream uses several channels");
    assert_eq!(read_all(&mut p, 1, b, 400 * 1024), vec![1u8; 400 * 1024]);
    // A second thread uses the stream: its messages follow it to the second channel.
    p.sides[0].set_thread(a, 7, p.now, 100);
    p.sides[0].handle(a).send(&[2u8; 100]).unwrap();
    assert_eq!(data_channels(&mut p, 0), vec![1]);
    assert_eq!(read_all(&mut p, 1, b, 100), vec![2u8; 100]);
    // Its channel lost, it keeps to one of those left, and nothing is lost.
    p.kill(1);
    p.sides[0].handle(a).send(&[3u8; 100]).unwrap();
    let used = data_channels(&mut p, 0);
    assert_eq!(used.len(), 1, "{used:?}");
    assert_ne!(used, vec![1]);
    assert_eq!(read_all(&mut p, 1, b, 100), vec![3u8; 100]);
}

/// Opens a stream from side 0 as application thread `thread` and waits until it is open.
fn open_as(p: &mut Pair, thread: u16) -> (StreamId, StreamId) {
    let a = p.sides[0].open_from(80, Class::Throughput, (), p.now, Some(thread)).unwrap();
    for _ in 0..1000 {
        if p.sides[0].stream(a).is_some_and(|s| s.phase == Phase::Open) {
            break;
        }
        p.step();
    }
    (a, StreamId(p.sides[0].stream(a).unwrap().peer.get()))
}

/// Side 0's application thread `thread` sends enough on stream `a` to count as busy (more than
/// `busy_thread_rate` in a window).
fn busy(p: &mut Pair, a: StreamId, thread: u16) {
    for _ in 0..100 {
        p.sides[0].set_thread(a, thread, p.now, 1 << 20);
    }
}

#[test]
fn bulk_streams_of_several_threads_keep_to_their_threads_channels() {
    let mut p = Pair::new(15, &[Class::Throughput; 4], config());
    p.listening[1].insert(80);
    let (a, b) = open_as(&mut p, 3);
    // One thread alone: its backlog spreads over every channel with room.
    busy(&mut p, a, 3);
    p.sides[0].handle(a).send(&vec![1u8; 400 * 1024]).unwrap();
    assert!(data_channels(&mut p, 0).len() > 1, "a lone bulk stream uses several channels");
    assert_eq!(read_all(&mut p, 1, b, 400 * 1024), vec![1u8; 400 * 1024]);
    // A second thread sends too: each backlog keeps to its thread's channel, so that each
    // channel carries one thread's streams and their reader reads its own payloads.
    let (c, d) = open_as(&mut p, 9);
    busy(&mut p, c, 9);
    p.sides[0].handle(a).send(&vec![2u8; 400 * 1024]).unwrap();
    p.sides[0].handle(c).send(&vec![3u8; 400 * 1024]).unwrap();
    let mut used = [Vec::new(), Vec::new()];
    for _ in 0..200 {
        let mut out = Vec::new();
        for l in p.links.iter_mut().filter(|l| l.alive) {
            p.sides[0].poll_transmit(l.index, 128 * 1024, 64, false, &mut out);
            for f in out.drain(..) {
                if f.header[0] == 1 {
                    let dst = u64::from_be_bytes(f.header[4..12].try_into().unwrap());
                    let which = usize::from(dst != b.0);
                    if !used[which].contains(&l.index.index) {
                        used[which].push(l.index.index);
                    }
                }
                l.dirs[0].pipe.extend(&f.header[..f.header_len as usize]);
                l.dirs[0].pipe.extend(&f.payload[..]);
            }
        }
        p.step();
    }
    assert_eq!(used, [vec![0], vec![1]], "each thread's backlog on its own channel");
    assert_eq!(read_all(&mut p, 1, b, 400 * 1024), vec![2u8; 400 * 1024]);
    assert_eq!(read_all(&mut p, 1, d, 400 * 1024), vec![3u8; 400 * 1024]);
}

#[test]
fn a_session_wants_a_channel_per_active_thread_up_to_max_channels() {
    let cfg = || CoreConfig { max_channels: 3, ..config() };
    let classes = [Class::Throughput, Class::Throughput, Class::Latency];
    let mut p = Pair::new(16, &classes, cfg());
    p.listening[1].insert(80);
    let streams: Vec<_> = (0..4).map(|t| (t, open_as(&mut p, 20 + t).0)).collect();
    let busy_all = |p: &mut Pair, threads: std::ops::Range<u16>| {
        for &(t, a) in &streams {
            if threads.contains(&t) {
                busy(p, a, 20 + t);
            }
        }
    };
    // Four threads opened a stream each: opening does not make a thread busy (it may hand
    // the stream to another), nor do small messages, however many; many bytes do.
    assert!(!p.sides[0].wants_channel(Class::Throughput), "nobody sent yet");
    for _ in 0..10_000 {
        for &(t, a) in &streams {
            p.sides[0].set_thread(a, 20 + t, p.now, 100);
        }
    }
    assert!(!p.sides[0].wants_channel(Class::Throughput), "small messages are no reason for one");
    busy_all(&mut p, 0..4);
    assert!(p.sides[0].wants_channel(Class::Throughput), "four threads, two channels");
    assert!(!p.sides[0].wants_channel(Class::Latency), "latency channels do not grow");
    // Two of them stop: once a whole window has passed without them, only two count.
    for _ in 0..2 {
        p.now += Duration::from_millis(1100);
        busy_all(&mut p, 0..2);
    }
    assert!(!p.sides[0].wants_channel(Class::Throughput), "two busy threads, two channels");
    // They come back: they count as soon as they are busy again.
    p.now += Duration::from_millis(20);
    busy_all(&mut p, 0..4);
    assert!(p.sides[0].wants_channel(Class::Throughput), "four again");
    // At max_channels the session wants no more, however many threads send.
    let mut p = Pair::new(17, &[Class::Throughput; 3], cfg());
    p.listening[1].insert(80);
    for t in 0..6 {
        let (a, _) = open_as(&mut p, 40 + t);
        busy(&mut p, a, 40 + t);
    }
    assert!(!p.sides[0].wants_channel(Class::Throughput), "three channels, max_channels 3");
}

#[test]
fn an_idle_session_gives_back_channels_down_to_one() {
    let cfg = CoreConfig {
        max_channels: 4,
        min_channels: 3,
        idle_rate: 1 << 20,
        retire_after: Duration::from_secs(1),
        ..config()
    };
    let mut p = Pair::new(19, &[Class::Throughput; 4], cfg);
    p.listening[1].insert(80);
    let (a, b) = open_as(&mut p, 30);
    for _ in 0..100 {
        p.step();
    }
    let mut given = Vec::new();
    let look = |p: &mut Pair, given: &mut Vec<u16>| {
        if let Some(ch) = p.sides[0].surplus_channel(p.now) {
            given.push(ch.index);
            p.kill(ch.index);
        }
    };
    // 2 MiB a second, above `idle_rate`, from one thread (not busy as `busy` counts it): the
    // session keeps `min_channels`, and gives back only the fourth.
    for _ in 0..16 {
        p.now += Duration::from_millis(250);
        assert_eq!(p.sides[0].handle(a).send(&[5u8; 512 << 10]), Ok(512 << 10));
        assert_eq!(read_all(&mut p, 1, b, 512 << 10), vec![5u8; 512 << 10]);
        look(&mut p, &mut given);
    }
    assert_eq!(given, [3]);
    // Idle for `retire_after`: down to one channel, one per `retire_after`, and no more looks.
    for _ in 0..12 {
        p.now += Duration::from_millis(500);
        for _ in 0..10 {
            p.step();
        }
        look(&mut p, &mut given);
    }
    assert_eq!(given, [3, 2, 1]);
    assert_eq!(p.sides[0].next_surplus_check(), None);
    // What is left carries on.
    p.sides[0].handle(a).send(b"still").unwrap();
    assert_eq!(read_all(&mut p, 1, b, 5), b"still");
}

#[test]
fn a_session_gives_back_channels_its_threads_no_longer_need() {
    let cfg = CoreConfig {
        max_channels: 4,
        min_channels: 2,
        retire_after: Duration::from_secs(1),
        ..config()
    };
    let classes = [Class::Throughput, Class::Throughput, Class::Throughput, Class::Throughput];
    let mut p = Pair::new(18, &classes, cfg);
    p.listening[1].insert(80);
    let streams: Vec<_> = (0..4).map(|t| open_as(&mut p, 30 + t)).collect();
    for _ in 0..100 {
        p.step(); // the SYNs and SYN_ACKs acknowledged
    }
    assert!(p.sides[0].next_surplus_check().is_some(), "four channels, two kept");
    // Four threads active: nothing is surplus however long.
    assert_eq!(p.sides[0].surplus_channel(p.now), None);
    p.now += Duration::from_millis(500);
    for &(a, _) in &streams {
        let t = p.sides[0].stream(a).unwrap().thread_number;
        busy(&mut p, a, t);
    }
    assert_eq!(p.sides[0].surplus_channel(p.now), None);
    // One thread goes on; the others stop. Once a whole window (1 s) has passed without
    // them the session has more channels than it needs, and `retire_after` later it gives
    // back the highest.
    let (a, b) = streams[0];
    for step in 0..5 {
        p.now += Duration::from_millis(500);
        busy(&mut p, a, 30);
        let expected = (step == 4).then_some(3);
        assert_eq!(p.sides[0].surplus_channel(p.now).map(|c| c.index), expected, "step {step}");
    }
    // What the runtime does with the channel given back.
    p.kill(3);
    // A channel with frames unacknowledged is not given back until they are.
    p.sides[0].handle(a).send(&vec![4u8; 300 * 1024]).unwrap();
    let mut out = Vec::new();
    p.sides[0].poll_transmit(ChannelId::new(2, 0), 512 * 1024, 64, false, &mut out);
    assert!(!out.is_empty());
    p.now += Duration::from_millis(1100);
    assert_eq!(p.sides[0].surplus_channel(p.now), None, "channel 2 holds frames");
    let l = p.links.iter_mut().find(|l| l.index.index == 2).unwrap();
    for f in out.drain(..) {
        l.dirs[0].pipe.extend(&f.header[..f.header_len as usize]);
        l.dirs[0].pipe.extend(&f.payload[..]);
    }
    assert_eq!(read_all(&mut p, 1, b, 300 * 1024), vec![4u8; 300 * 1024]);
    for _ in 0..100 {
        p.step();
    }
    p.now += Duration::from_millis(1100);
    assert_eq!(p.sides[0].surplus_channel(p.now).map(|c| c.index), Some(2));
    // Down to `min_channels`: nothing more to give back, nothing more to check.
    p.kill(2);
    assert_eq!(p.sides[0].next_surplus_check(), None);
    p.now += Duration::from_secs(5);
    assert_eq!(p.sides[0].surplus_channel(p.now), None);
}

#[test]
fn payloads_the_engine_takes_over_mid_read_stay_intact() {
    // A grace period of one step: the engine regularly stages a deferred payload itself while
    // the reader also reads deferred payloads straight from the channel.
    for seed in 1..4 {
        let mut p = Pair::new(seed, &[Class::Throughput; 3], config());
        p.grace = Duration::from_micros(100);
        p.defer_percent = 100;
        let (a, b) = p.open(80, Class::Throughput);
        let mut t = Transfer::new(a, b, seed, 64 << 20);
        run_transfer(&mut p, &mut t, 300_000, 2_000_000);
    }
}

/// A reader reads part of a deferred payload from its channel, and before it records the
/// read, the stream is reset (by another thread, on another channel's frame). The bytes left
/// the channel all the same: the channel's deferred payload must move past them, or its next
/// frame would be read from the middle of the payload.
#[test]
fn a_deferred_read_that_loses_its_stream_still_moves_the_channel_on() {
    let mut p = Pair::new(7, &[Class::Throughput], config());
    p.defer_percent = 100;
    p.grace = Duration::from_secs(60);
    let (a, b) = p.open(80, Class::Throughput);
    let data = vec![5u8; 64 * 1024];
    assert_eq!(p.sides[0].handle(a).send(&data), Ok(data.len()));
    let mut found = None;
    for _ in 0..1000 {
        p.step();
        let mut out = Vec::new();
        if let Recv::Deferred { channel, max } = p.sides[1].handle(b).recv(1 << 20, &mut out) {
            found = Some((channel, max));
            break;
        }
    }
    let (channel, max) = found.expect("a payload was deferred");
    let before = p.sides[1].deferred(channel).expect("deferred in its channel");
    let l = p.links.iter_mut().find(|l| l.index == channel).unwrap();
    let n = (max as usize).min(l.dirs[0].pipe.len()).min(1000);
    assert!(n > 0, "some of the payload is in the channel");
    l.dirs[0].pipe.drain(..n);
    // The reset comes between the read and its record.
    p.sides[1].handle(b).abort(ResetCause::LocalAbort);
    assert!(!p.sides[1].handle(b).deferred_read(channel, n as u64), "not delivered");
    match p.sides[1].deferred(channel) {
        Some(d) => assert_eq!(d.remaining, before.remaining - n as u64, "{d:?}"),
        None => assert_eq!(before.remaining, n as u64),
    }
}

#[test]
fn an_idle_session_falls_silent() {
    // After traffic, acknowledgements settle and nothing more is sent: no ACK for an ACK.
    let mut p = Pair::new(13, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    let mut t = Transfer::new(a, b, 13, 100_000);
    run_transfer(&mut p, &mut t, 10_000, 100_000);
    for _ in 0..200 {
        p.step(); // forced acknowledgements go out at random steps
    }
    let mut out = Vec::new();
    for side in 0..2 {
        assert!(!p.sides[side].owes_ack(), "side {side} still owes an acknowledgement");
        for ch in 0..2 {
            p.sides[side].poll_transmit(ChannelId::new(ch, 0), 1 << 20, 64, true, &mut out);
        }
    }
    assert!(out.is_empty(), "an idle session sent {} frames", out.len());
    for side in 0..2 {
        let spare = p.sides[side].stats().spare_bytes;
        assert!(spare <= 8192, "side {side} keeps {spare} bytes of spare chunks while idle");
    }
}

/// Reads side `side`'s stream `id` until end of stream, stepping the pair; returns the bytes.
fn read_to_eof(p: &mut Pair, side: usize, id: StreamId) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    for _ in 0..20_000 {
        match p.recv(side, id, &mut buf) {
            Recv::Data(n) => got.extend_from_slice(&buf[..n as usize]),
            Recv::Eof => return got,
            Recv::Empty => p.step(),
            other => panic!("unexpected {other:?} after {} bytes", got.len()),
        }
    }
    panic!("no end of stream after {} bytes", got.len());
}

/// Steps until side 1's stream `b` holds an urgent mark and `want` bytes in order.
fn await_urgent(p: &mut Pair, b: StreamId, want: u64) {
    for _ in 0..10_000 {
        p.step();
        let s = p.sides[1].stream(b).unwrap();
        if p.sides[1].urgent_mark(b).is_some() && s.bytes_received() >= want {
            return;
        }
    }
    panic!("the urgent mark never came");
}

/// Reads once into a 64-byte buffer: the bytes, or `None` when nothing is there.
fn read_once(p: &mut Pair, b: StreamId) -> Option<Vec<u8>> {
    let mut buf = [0u8; 64];
    match p.recv(1, b, &mut buf) {
        Recv::Data(n) => Some(buf[..n as usize].to_vec()),
        Recv::Empty => None,
        other => panic!("{other:?}"),
    }
}

#[test]
fn urgent_bytes_stop_reads_and_are_read_out_of_band() {
    for seed in 1..12 {
        for inline in [false, true] {
            let mut p = Pair::new(seed, &[Class::Throughput; 2], config());
            let (a, b) = p.open(80, Class::Throughput);
            p.sides[1].handle(b).set_oob_inline(inline);
            let mut h = p.sides[0].handle(a);
            h.send(b"abc").unwrap();
            h.send(b"!").unwrap();
            h.mark_urgent(b'!');
            h.send(b"def").unwrap();
            await_urgent(&mut p, b, 7);
            assert!(p.sides[1].urgent_pending(b));
            assert!(!p.sides[1].at_urgent_mark(b));
            // As TCP's: the read stops before the mark, whatever the buffer's size.
            assert_eq!(read_once(&mut p, b).unwrap(), b"abc");
            assert!(p.sides[1].at_urgent_mark(b));
            let out_of_band = if inline { None } else { Some(b'!') };
            assert_eq!(p.sides[1].handle(b).take_urgent(true), out_of_band);
            assert_eq!(p.sides[1].handle(b).take_urgent(false), out_of_band);
            assert_eq!(p.sides[1].handle(b).take_urgent(false), None, "read once only");
            let rest: &[u8] = if inline { b"!def" } else { b"def" };
            assert_eq!(read_once(&mut p, b).unwrap(), rest);
            assert!(p.sides[1].urgent_mark(b).is_none(), "read past");
        }
    }
}

#[test]
fn an_urgent_byte_read_past_is_dropped_and_a_newer_mark_replaces_the_older() {
    for seed in 1..12 {
        let mut p = Pair::new(seed, &[Class::Throughput; 2], config());
        let (a, b) = p.open(80, Class::Throughput);
        let mut h = p.sides[0].handle(a);
        h.send(b"xyz#").unwrap();
        h.mark_urgent(b'#');
        await_urgent(&mut p, b, 4);
        assert_eq!(read_once(&mut p, b).unwrap(), b"xyz");
        // Only the urgent byte is left: not readable, and a read goes past it.
        assert!(!p.sides[1].handle(b).readable());
        assert_eq!(read_once(&mut p, b), None);
        assert_eq!(p.sides[1].handle(b).take_urgent(false), None);
        // Two marks before the reader comes: the newer one holds; the older byte stays in the
        // stream (TCP's), and the reader standing on an older mark steps over its byte.
        let mut h = p.sides[0].handle(a);
        h.send(b"12").unwrap();
        h.send(b"3").unwrap();
        h.mark_urgent(b'3');
        await_urgent(&mut p, b, 7);
        assert_eq!(read_once(&mut p, b).unwrap(), b"12");
        let mut h = p.sides[0].handle(a);
        h.send(b"45").unwrap();
        h.send(b"6").unwrap();
        h.mark_urgent(b'6');
        h.send(b"78").unwrap();
        for _ in 0..1000 {
            p.step();
        }
        assert_eq!(p.sides[1].handle(b).take_urgent(false), Some(b'6'));
        assert_eq!(read_once(&mut p, b).unwrap(), b"45");
        assert_eq!(read_once(&mut p, b).unwrap(), b"78");
    }
}

#[test]
fn an_urgent_byte_still_in_its_channel_is_dropped_from_there() {
    // Payloads left in the channel's socket (direct placement): the read stops before the mark
    // inside one, and the urgent byte is read out of the socket and dropped.
    for seed in 1..8 {
        let mut p = Pair::new(seed, &[Class::Throughput; 1], config());
        p.defer_percent = 100;
        let (a, b) = p.open(80, Class::Throughput);
        let data: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let mut h = p.sides[0].handle(a);
        assert_eq!(h.send(&data), Ok(data.len()));
        h.mark_urgent(data[data.len() - 1]);
        h.send(b"after").unwrap();
        h.shutdown_write().unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 7000];
        for _ in 0..100_000 {
            p.step();
            match p.recv(1, b, &mut buf) {
                Recv::Data(n) => got.extend_from_slice(&buf[..n as usize]),
                Recv::Eof => break,
                _ => {}
            }
        }
        let mut want = data[..data.len() - 1].to_vec();
        want.extend_from_slice(b"after");
        assert_eq!(got.len(), want.len());
        assert!(got == want, "seed {seed}");
    }
}

#[test]
fn an_urgent_mark_lost_with_its_channel_is_sent_again() {
    for victim in 0..2u16 {
        let mut p = Pair::new(21 + victim as u64, &[Class::Throughput; 2], config());
        let (a, b) = p.open(80, Class::Throughput);
        let mut h = p.sides[0].handle(a);
        h.send(b"abc!").unwrap();
        h.mark_urgent(b'!');
        p.transmit(0);
        p.kill(victim);
        await_urgent(&mut p, b, 4);
        assert_eq!(p.sides[1].handle(b).take_urgent(false), Some(b'!'), "victim {victim}");
        assert_eq!(read_once(&mut p, b).unwrap(), b"abc");
    }
}

#[test]
fn a_fin_lost_with_its_channel_is_sent_again() {
    // Whichever channel carried the FIN (and the data), losing it before delivery loses nothing.
    for victim in 0..2u16 {
        let mut p = Pair::new(11 + victim as u64, &[Class::Throughput; 2], config());
        let (a, b) = p.open(80, Class::Throughput);
        p.sides[0].handle(a).send(&[5u8; 3000]).unwrap();
        p.sides[0].handle(a).shutdown_write().unwrap();
        p.transmit(0);
        p.kill(victim);
        assert_eq!(read_to_eof(&mut p, 1, b), vec![5u8; 3000], "victim {victim}");
    }
}

#[test]
fn a_peer_that_finished_then_vanished_stays_readable() {
    let mut p = Pair::new(12, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[1].handle(b).send(&[9u8; 700]).unwrap();
    p.sides[1].handle(b).shutdown_write().unwrap();
    for _ in 0..200 {
        p.step();
    }
    p.kill(0);
    p.kill(1);
    let mut buf = [0u8; 1024];
    assert_eq!(p.recv(0, a, &mut buf), Recv::Data(700));
    assert_eq!(&buf[..700], &[9u8; 700][..]);
    assert_eq!(p.recv(0, a, &mut buf), Recv::Eof);
    assert_eq!(p.sides[0].handle(a).send(b"x"), Err(SendError::Reset(ResetCause::ChannelLost)));
}

#[test]
fn a_lost_session_gives_what_arrived_in_order_before_the_reset() {
    let mut p = Pair::new(12, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[1].handle(b).send(&[7u8; 500]).unwrap();
    for _ in 0..200 {
        p.step();
    }
    p.kill(0);
    p.kill(1);
    let mut buf = [0u8; 1024];
    assert_eq!(p.recv(0, a, &mut buf), Recv::Data(500));
    assert_eq!(&buf[..500], &[7u8; 500][..]);
    assert_eq!(p.recv(0, a, &mut buf), Recv::Reset(ResetCause::ChannelLost));
}

/// The other side's process closed its channels (exited, or was killed): each stream ends as
/// its kernel would have ended a TCP connection, after what arrived in order. With a FIN where
/// the peer had read everything sent to it; with a reset where it had not.
#[test]
fn a_peer_that_closed_its_channels_ends_streams_it_owed_nothing_with_eof() {
    let mut p = Pair::new(13, &[Class::Throughput; 2], config());
    let (quiet, quiet_b) = p.open(80, Class::Throughput);
    let (unread, _unread_b) = p.open(80, Class::Throughput);
    p.sides[1].handle(quiet_b).send(&[5u8; 300]).unwrap();
    p.sides[0].handle(unread).send(&[6u8; 200]).unwrap();
    for _ in 0..200 {
        p.step();
    }
    p.end_channel(0, true);
    p.end_channel(1, true);
    let mut buf = [0u8; 1024];
    assert_eq!(p.recv(0, quiet, &mut buf), Recv::Data(300));
    assert_eq!(p.recv(0, quiet, &mut buf), Recv::Eof);
    assert_eq!(
        p.sides[0].handle(quiet).send(b"x"),
        Err(SendError::Reset(ResetCause::ChannelLost)),
        "writing after the peer went away fails"
    );
    assert_eq!(p.recv(0, unread, &mut buf), Recv::Reset(ResetCause::ChannelLost));
    // The last channel failing (not closed) is a reset whatever was read: the peer may live.
    let mut p = Pair::new(14, &[Class::Throughput; 2], config());
    let (quiet, quiet_b) = p.open(80, Class::Throughput);
    p.sides[1].handle(quiet_b).send(&[5u8; 300]).unwrap();
    for _ in 0..200 {
        p.step();
    }
    p.end_channel(0, true);
    p.end_channel(1, false);
    assert_eq!(p.recv(0, quiet, &mut buf), Recv::Data(300));
    assert_eq!(p.recv(0, quiet, &mut buf), Recv::Reset(ResetCause::ChannelLost));
}

/// Feeds 1-byte DATA frames for side 1's stream `id` straight into it, as a hostile peer would,
/// each a slice of one large read buffer (as the framer produces).
fn feed_tiny_frames(p: &mut Pair, id: StreamId, offsets: impl Iterator<Item = u64>) {
    let read_buffer = Bytes::from(vec![1u8; 256 * 1024]);
    for (i, off) in offsets.enumerate() {
        let payload = read_buffer.slice(i % 1024..i % 1024 + 1);
        let item = Parsed::Data { stream: id.get(), offset: off, payload };
        p.sides[1].receive(ChannelId::new(0, 0), item, p.now, |_, _| false).expect("valid frame");
    }
}

#[test]
fn tiny_frames_cost_memory_in_proportion_to_their_bytes() {
    let mut p = Pair::new(13, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    // Out of order: each byte is copied out of the read buffer and its bookkeeping counted.
    feed_tiny_frames(&mut p, b, (0..2000).map(|i| 1 + 2 * i));
    let held = p.sides[1].rx_held();
    assert_eq!(held, 2000 * (1 + super::recvbuf::OOO_SEG_COST));
    assert_eq!(p.sides[1].stats().held_bytes, held);
    // In order, never read: small slices are merged into buffers of their own, so neither the
    // segment count nor the pinned read buffers grow with the frame count.
    let mut q = Pair::new(14, &[Class::Throughput], config());
    let (_a, b) = q.open(80, Class::Throughput);
    feed_tiny_frames(&mut q, b, 0..5000);
    assert_eq!(q.sides[1].rx_held(), 5000);
    assert!(q.sides[1].stream(b).unwrap().rx.ready_segments() <= 65);
    assert!(q.sides[1].stats().compacted_bytes >= 4900);
    let mut buf = vec![0u8; 8192];
    assert_eq!(q.recv(1, b, &mut buf), Recv::Data(5000));
    assert!(buf[..5000].iter().all(|&x| x == 1));
    assert_eq!(q.sides[1].rx_held(), 0);
}

/// A read buffer that holds a clone of `alive` while it lives (a stand-in for a channel's read
/// buffer, to see how many the slices held keep alive: `Arc::strong_count(alive) - 1`).
struct CountedBuffer {
    bytes: Vec<u8>,
    _alive: std::sync::Arc<()>,
}

impl AsRef<[u8]> for CountedBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

fn counted_read_buffer(alive: &std::sync::Arc<()>, fill: u8) -> Bytes {
    Bytes::from_owner(CountedBuffer { bytes: vec![fill; 256 * 1024], _alive: alive.clone() })
}

#[test]
fn slices_left_unread_in_mostly_read_buffers_do_not_keep_them_alive() {
    let mut p = Pair::new(15, &[Class::Throughput], config());
    let (_a, bulk) = p.open(80, Class::Throughput);
    let tiny: Vec<StreamId> = (0..200).map(|_| p.open(81, Class::Throughput).1).collect();
    let alive = std::sync::Arc::new(());
    let live = || std::sync::Arc::strong_count(&alive) - 1;
    let ch = ChannelId::new(0, 0);
    let mut buf = vec![0u8; 256 * 1024];
    // Each read buffer carries 200 KiB the application reads at once and one byte for a stream
    // it never reads: without compaction, each byte would keep its 256 KiB buffer alive.
    for (i, &t) in tiny.iter().enumerate() {
        let read_buffer = counted_read_buffer(&alive, i as u8);
        let big = 200 * 1024;
        let item = Parsed::Data {
            stream: bulk.get(),
            offset: (i * big) as u64,
            payload: read_buffer.slice(..big),
        };
        p.sides[1].receive(ch, item, p.now, |_, _| false).expect("valid frame");
        let item =
            Parsed::Data { stream: t.get(), offset: 0, payload: read_buffer.slice(big..big + 1) };
        p.sides[1].receive(ch, item, p.now, |_, _| false).expect("valid frame");
        drop(read_buffer);
        assert_eq!(p.recv(1, bulk, &mut buf), Recv::Data(big as u64));
        // The CREDIT for more (what the peer would be told is dropped: it is this test).
        p.sides[1].poll_transmit(ch, usize::MAX, 1024, false, &mut Vec::new());
    }
    assert_eq!(p.sides[1].rx_held(), 200);
    // 8 MiB read between compactions: about 41 buffers of 200 KiB, not 200.
    let kept = live();
    assert!(kept <= 48, "{kept} read buffers kept alive by 200 unread bytes");
    for (i, &t) in tiny.iter().enumerate() {
        assert_eq!(p.recv(1, t, &mut buf), Recv::Data(1));
        assert_eq!(buf[0], i as u8);
    }
    assert_eq!(live(), 0);
}

#[test]
fn dense_small_slices_are_held_without_a_copy() {
    let mut cfg = config();
    cfg.window = 256 * 1024;
    let mut p = Pair::new(16, &[Class::Throughput], cfg);
    let streams: Vec<StreamId> = (0..100).map(|_| p.open(80, Class::Throughput).1).collect();
    let ch = ChannelId::new(0, 0);
    // 40 read buffers, each 64 writes of 4 KiB to 64 different streams, none read yet (10 MiB):
    // the buffers are full of bytes held, so copying them would save no memory.
    let mut next = vec![0u64; streams.len()];
    for b in 0..40 {
        let read_buffer = Bytes::from(vec![b as u8; 256 * 1024]);
        for j in 0..64 {
            let k = (b * 64 + j) % streams.len();
            let item = Parsed::Data {
                stream: streams[k].get(),
                offset: next[k],
                payload: read_buffer.slice(j * 4096..(j + 1) * 4096),
            };
            p.sides[1].receive(ch, item, p.now, |_, _| false).expect("valid frame");
            next[k] += 4096;
        }
    }
    assert_eq!(p.sides[1].rx_held(), 40 * 256 * 1024);
    assert_eq!(p.sides[1].stats().compacted_bytes, 0);
}

#[test]
fn a_syn_naming_a_high_index_allocates_nothing() {
    // The peer chooses its stream ids: a table sized by them made one SYN cost 64 MiB.
    let mut p = Pair::new(21, &[Class::Throughput], config());
    // Side 0 did not send these SYNs: it ignores the answers.
    p.hostile = true;
    p.listening[1].insert(80);
    let high = (1u64 << 24) | 0xFF_FFFF;
    let mut wire = Vec::new();
    Frame::Syn { src: high, port: 80, class: Class::Throughput, window: 1 << 20 }.encode(&mut wire);
    Frame::Syn { src: high + (5 << 24), port: 81, class: Class::Throughput, window: 1 << 20 }
        .encode(&mut wire);
    p.links[0].dirs[0].pipe.extend(wire);
    for _ in 0..50 {
        p.step();
    }
    // One stream opened (port 80), one refused (nobody listens on 81): one entry.
    assert_eq!(p.sides[1].stats().streams, 1);
    assert_eq!(p.sides[1].peer_index_entries(), 1);
}

#[test]
fn an_ack_for_an_earlier_incarnation_does_not_act_on_the_channel_dialed_again() {
    let mut p = Pair::new(22, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    let mut t = Transfer::new(a, b, 22, 200_000);
    run_transfer(&mut p, &mut t, 4096, 100_000);
    p.kill(0);
    p.add_link(0, Class::Throughput);
    let again = p.links.iter().find(|l| l.alive && l.index.index == 0).unwrap().index;
    assert_eq!(again.incarnation, 1);
    // Side 0 sends on the new incarnation; then an ACK meant for the old one (a position far
    // beyond anything sent on the new one) arrives on channel 1.
    let (c, _) = p.open(81, Class::Throughput);
    p.sides[0].handle(c).send(&[1u8; 5000]).unwrap();
    p.transmit(0);
    let ack = Frame::Ack { channel: 0, incarnation: 0, position: 10_000_000 };
    let item = Parsed::Control(ack);
    let r = p.sides[0].receive(ChannelId::new(1, 0), item, p.now, |_, _| false);
    assert!(r.is_ok(), "an earlier incarnation's ACK closed a channel: {r:?}");
    assert!(p.sides[0].has_channel(again));
    // The same ACK for the new incarnation acknowledges bytes never sent: a violation.
    let ack = Frame::Ack { channel: 0, incarnation: 1, position: 10_000_000 };
    let r = p.sides[0].receive(ChannelId::new(1, 0), Parsed::Control(ack), p.now, |_, _| false);
    assert_eq!(r, Err(Violation::BadAck));
}

#[test]
fn a_peer_that_never_acknowledges_holds_a_bounded_retention_and_is_timed_out() {
    // Side 1 receives and never answers (nothing travels from it to side 0): no ACK, no
    // CREDIT. A large window lets side 0 send; the retention limit stops it first.
    let cfg = CoreConfig {
        window: 64 << 20,
        max_retained_bytes: 1 << 20,
        ack_timeout: Duration::from_secs(3),
        ..config()
    };
    let mut p = Pair::new(23, &[Class::Throughput], cfg);
    let (a, _b) = p.open(80, Class::Throughput);
    let ch = p.links[0].index;
    let chunk = vec![7u8; 64 * 1024];
    let mut sent = 0u64;
    for _ in 0..2000 {
        if let Ok(n) = p.sides[0].handle(a).send(&chunk) {
            sent += n as u64;
        }
        p.transmit(0);
        p.links[0].dirs[1].pipe.clear(); // side 1 says nothing
        let li = 0;
        p.receive(1, li);
        p.now += Duration::from_micros(100);
    }
    let retained = p.sides[0].channel_retained(ch);
    assert!(retained <= (1 << 20) + 64 * 1024, "retained {retained}");
    let unsent = p.sides[0].stats().unsent_bytes;
    assert!(sent <= retained + unsent, "sent {sent}, retained {retained}, unsent {unsent}");
    assert!(!p.sides[0].handle(a).writable(), "the sender must wait, not grow memory");
    // No acknowledgement for the timeout: the channel is reported, with the peer engine
    // silent on every channel (the runtime asks the channel's TCP state what that means).
    assert!(p.sides[0].unacknowledging_channels(p.now).is_empty());
    let later = p.now + Duration::from_secs(3);
    assert_eq!(p.sides[0].unacknowledging_channels(later), vec![ch]);
    assert!(!p.sides[0].peer_engine_active(later));
}

#[test]
fn a_channel_whose_frames_vanish_while_the_peer_acknowledges_others_is_broken() {
    // Side 0's frames on channel 0 never arrive (its connection is gone and nobody noticed);
    // channel 1 works, and side 1 acknowledges what comes on it.
    let cfg = CoreConfig { window: 64 << 20, ack_timeout: Duration::from_millis(30), ..config() };
    let mut p = Pair::new(29, &[Class::Throughput; 2], cfg);
    let (a, b) = p.open(80, Class::Throughput);
    let broken = p.links[0].index;
    // Sends of more than a home channel keeps (64 KiB unsent): the frames spread over both.
    let chunk = vec![7u8; 256 * 1024];
    let mut buf = vec![0u8; 64 * 1024];
    let mut reported = None;
    for _ in 0..2000 {
        let _ = p.sides[0].handle(a).send(&chunk);
        p.transmit(0);
        p.links[0].dirs[0].pipe.clear();
        p.step();
        let _ = p.recv(1, b, &mut buf);
        let due = p.sides[0].unacknowledging_channels(p.now);
        if !due.is_empty() {
            reported = Some((due, p.sides[0].peer_engine_active(p.now)));
            break;
        }
    }
    // Reported as broken (the peer engine is processing), not as a silent peer.
    assert_eq!(reported, Some((vec![broken], true)));
}

#[test]
fn a_stream_nobody_reads_cannot_starve_one_that_is_read() {
    // A small receive budget: the unread stream takes its share, the one that is read keeps
    // moving on its guaranteed window, and what side 1 holds stays within the budget plus
    // the guaranteed windows.
    let cfg =
        CoreConfig { window: 1 << 20, rx_budget: 512 * 1024, min_window: 32 * 1024, ..config() };
    let mut p = Pair::new(24, &[Class::Throughput; 2], cfg);
    let (a1, _b1) = p.open(80, Class::Throughput);
    let (a2, b2) = p.open(81, Class::Throughput);
    let mut unread = Transfer::new(a1, _b1, 1, 8 << 20);
    let mut read = Transfer::new(a2, b2, 2, 4 << 20);
    let mut sendbuf = vec![0u8; 65536];
    let mut recvbuf = vec![0u8; 65536];
    for _ in 0..400_000 {
        // Only the sender half of the unread stream runs.
        if unread.sent < unread.len {
            let n = (unread.len - unread.sent).min(65536) as usize;
            pattern(unread.seed, unread.sent, &mut sendbuf[..n]);
            if let Ok(m) = p.sides[0].handle(a1).send(&sendbuf[..n]) {
                unread.sent += m as u64;
            }
        }
        read.drive(&mut p, &mut sendbuf, &mut recvbuf, 65536);
        p.step();
        let held = p.sides[1].rx_held();
        assert!(held <= 512 * 1024 + 2 * 32 * 1024 + 64 * 1024, "held {held}");
        if read.done() {
            return;
        }
    }
    panic!("the stream that is read stalled behind the one that is not");
}

#[test]
fn busy_streams_come_to_share_the_receive_budget() {
    // A budget of 4 MiB and windows of 4 MiB: granted in order of asking, the first stream
    // opened holds the whole budget for good and the other seven stay at their 32 KiB floor.
    // Shared, the first streams' grants shrink to their share as they are read, and every
    // stream's grant grows past its floor to about 4 MiB / 8.
    let cfg = CoreConfig { window: 4 << 20, rx_budget: 4 << 20, min_window: 32 * 1024, ..config() };
    let mut p = Pair::new(26, &[Class::Throughput; 2], cfg);
    let pairs: Vec<_> = (0..8).map(|i| p.open(90 + i, Class::Throughput)).collect();
    let buf = vec![7u8; 16 * 1024];
    let mut rbuf = vec![0u8; 4096];
    let ahead = |p: &Pair, b| p.sides[1].stream(b).map_or(0, |s| s.granted - s.rx.consumed());
    for _ in 0..4000 {
        for &(a, b) in &pairs {
            let _ = p.sides[0].handle(a).send(&buf);
            // Read a little of each, so that every stream stays busy with bytes waiting.
            let _ = p.recv(1, b, &mut rbuf);
        }
        p.step();
        let _ = p.sides[1].stats(); // checks the count of competing streams (debug builds)
    }
    let share = (4u64 << 20) / 8;
    for (i, &(_, b)) in pairs.iter().enumerate() {
        let g = ahead(&p, b);
        assert!(g > 32 * 1024, "stream {i} is held at its floor: {g}");
        assert!(g <= share + share / 2, "stream {i} holds {g}, its share is {share}");
    }
}

#[test]
fn streams_that_starve_and_go_leave_nothing_in_the_starved_queue() {
    // Side 1's budget is held by bytes nobody reads, so each new stream is granted less than
    // it wants and queues for room; a peer opening and resetting streams must not make that
    // queue grow with every stream it ever opened.
    let cfg =
        CoreConfig { window: 1 << 20, rx_budget: 512 * 1024, min_window: 32 * 1024, ..config() };
    let mut p = Pair::new(25, &[Class::Throughput; 2], cfg);
    let (a1, _b1) = p.open(80, Class::Throughput);
    let buf = vec![0u8; 65536];
    for _ in 0..200 {
        let _ = p.sides[0].handle(a1).send(&buf);
        p.step();
    }
    for _ in 0..2000 {
        let (a, b) = p.open(81, Class::Throughput);
        p.sides[0].handle(a).abort(ResetCause::LocalAbort);
        for _ in 0..4 {
            p.step();
        }
        let now = p.now;
        p.sides[1].handle(b).close(now);
        p.step();
    }
    let (queued, live) = (p.sides[1].starved_len(), p.sides[1].stats().streams);
    assert!(queued <= 2 * live + 64, "{queued} queued for {live} live streams");
}

/// Fuzzing the protocol core as a channel's peer could: arbitrary bytes, and sequences of
/// well-formed frames with hostile contents, into channel 0 of a session that serves a real
/// stream over channel 1. Each case must close at most channel 0, never panic, keep the core's
/// accounting consistent (checked by `stats()`), and leave a new stream working. Case counts
/// come from `PROPTEST_CASES` (the long run in docs/PROTOCOL.md sets millions).
mod fuzz {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::Frame;

    fn hostile_pair(seed: u64) -> (Pair, StreamId, StreamId) {
        let mut p = Pair::new(seed, &[Class::Throughput; 2], config());
        p.hostile = true;
        let (a, b) = p.open(80, Class::Throughput);
        (p, a, b)
    }

    /// Delivers what is in channel 0's pipe towards side 1, then lets both sides run.
    fn deliver(p: &mut Pair) {
        for _ in 0..10_000 {
            if !p.links[0].alive || p.links[0].dirs[0].pipe.is_empty() {
                break;
            }
            p.receive(1, 0);
        }
        for _ in 0..20 {
            p.step();
        }
        let _ = p.sides[1].stats();
    }

    /// After the attack, a new stream still carries bytes intact over channel 1: only the
    /// channel the garbage came on may close (side 0 ignores what it did not cause).
    fn still_works(p: &mut Pair) {
        // Let every answer to the garbage arrive first.
        for _ in 0..300 {
            p.step();
        }
        assert!(
            p.sides[1].has_channel(ChannelId::new(1, 0)),
            "the attack closed a channel it did not use"
        );
        let (a, b) = p.open(81, Class::Throughput);
        let mut t = Transfer::new(a, b, 3, 20_000);
        let mut sendbuf = vec![0u8; 4096];
        let mut recvbuf = vec![0u8; 4096];
        for _ in 0..20_000 {
            t.drive(p, &mut sendbuf, &mut recvbuf, 4096);
            if t.done() {
                return;
            }
            p.step();
        }
        panic!("a new stream did not work after the attack");
    }

    #[derive(Debug, Clone)]
    enum Spec {
        Data { id: u8, offset: u64, len: u16 },
        Syn { src: u64, port: u16, window: u32, latency: bool },
        SynAck { id: u8, src: u64, window: u32 },
        Rst { id: u8, reason: u8, offset: u64 },
        Fin { id: u8, offset: u64 },
        Credit { id: u8, consumed: u64, window: u32 },
        Ack { channel: u16, incarnation: u16, position: u64 },
        Urgent { id: u8, offset: u64, byte: u8 },
    }

    /// Stream ids a peer might use: the real ones, stale generations, never issued, zero.
    fn id_of(which: u8, real: u64) -> u64 {
        match which % 5 {
            0 | 1 => real,
            2 => real.wrapping_add(1 << 24),
            3 => real ^ 0xFF_FFFF,
            _ => which as u64 * 0x0100_0001,
        }
    }

    fn arb_spec() -> impl Strategy<Value = Spec> {
        let offset = prop_oneof![0u64..70_000, any::<u64>()];
        let window = prop_oneof![0u32..(2 << 20), any::<u32>()];
        prop_oneof![
            4 => (any::<u8>(), offset.clone(), 0u16..3000)
                .prop_map(|(id, offset, len)| Spec::Data { id, offset, len }),
            1 => (any::<u64>(), prop_oneof![Just(80u16), any::<u16>()], window.clone(), any::<bool>())
                .prop_map(|(src, port, window, latency)| Spec::Syn { src, port, window, latency }),
            1 => (any::<u8>(), any::<u64>(), window.clone())
                .prop_map(|(id, src, window)| Spec::SynAck { id, src, window }),
            1 => (any::<u8>(), any::<u8>(), offset.clone())
                .prop_map(|(id, reason, offset)| Spec::Rst { id, reason, offset }),
            1 => (any::<u8>(), offset.clone()).prop_map(|(id, offset)| Spec::Fin { id, offset }),
            2 => (any::<u8>(), offset.clone(), window)
                .prop_map(|(id, consumed, window)| Spec::Credit { id, consumed, window }),
            1 => (0u16..80, prop_oneof![Just(0u16), any::<u16>()], prop_oneof![0u64..100_000, any::<u64>()])
                .prop_map(|(channel, incarnation, position)| Spec::Ack { channel, incarnation, position }),
            1 => (any::<u8>(), offset.clone(), any::<u8>())
                .prop_map(|(id, offset, byte)| Spec::Urgent { id, offset, byte }),
        ]
    }

    fn encode(spec: &Spec, real: u64, out: &mut Vec<u8>) {
        let payload = vec![0x5A; 3000];
        let f = match *spec {
            Spec::Data { id, offset, len } => {
                Frame::Data { stream: id_of(id, real), offset, payload: &payload[..len as usize] }
            }
            Spec::Syn { src, port, window, latency } => Frame::Syn {
                src,
                port,
                class: if latency { Class::Latency } else { Class::Throughput },
                window,
            },
            Spec::SynAck { id, src, window } => {
                Frame::SynAck { dst: id_of(id, real), src, window, kernel_preferred: false }
            }
            Spec::Rst { id, reason, offset } => Frame::Rst {
                dst: id_of(id, real),
                reason: RstReason::from_code(reason % 6),
                final_offset: offset,
            },
            Spec::Fin { id, offset } => Frame::Fin { dst: id_of(id, real), final_offset: offset },
            Spec::Credit { id, consumed, window } => {
                Frame::Credit { dst: id_of(id, real), consumed, window }
            }
            Spec::Ack { channel, incarnation, position } => {
                Frame::Ack { channel, incarnation, position }
            }
            Spec::Urgent { id, offset, byte } => {
                Frame::Urgent { dst: id_of(id, real), offset, byte }
            }
        };
        f.encode(out);
    }

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_into_a_channel(seed in any::<u64>(), bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let (mut p, _a, _b) = hostile_pair(seed);
            p.links[0].dirs[0].pipe.extend(bytes);
            deliver(&mut p);
            still_works(&mut p);
        }

        #[test]
        fn hostile_frame_sequences_into_a_channel(seed in any::<u64>(), specs in proptest::collection::vec(arb_spec(), 1..40)) {
            let (mut p, _a, b) = hostile_pair(seed);
            let mut wire = Vec::new();
            for s in &specs {
                encode(s, b.get(), &mut wire);
            }
            p.links[0].dirs[0].pipe.extend(wire);
            deliver(&mut p);
            still_works(&mut p);
        }
    }
}

#[test]
fn a_sender_that_filled_the_class_space_is_told_when_it_frees() {
    // A write that fills the class space succeeds in part; a blocking sender (or a program
    // waiting for EPOLLOUT) then waits for "writable" without another write failing first.
    // Asking, it must be registered: the space freed by the channel wakes it. (The engine's
    // blocking send hung forever this way when the worker, not the sender, pulled the bytes.)
    let cfg = CoreConfig { queue_threshold: 256 * 1024, window: 4 << 20, ..config() };
    let mut p = Pair::new(31, &[Class::Throughput], cfg);
    let (a, _b) = p.open(80, Class::Throughput);
    while let Some(_e) = p.sides[0].poll_event() {}
    let chunk = vec![7u8; 1 << 20];
    let n = p.sides[0].handle(a).send(&chunk).unwrap();
    assert_eq!(n, 256 * 1024, "the class space takes a part");
    assert!(!p.sides[0].handle(a).writable(), "full: the sender waits");
    p.transmit(0);
    let mut told = false;
    while let Some((id, bits)) = p.sides[0].poll_event() {
        told |= id == a && bits & EV_WRITE != 0;
    }
    assert!(p.sides[0].handle(a).writable());
    assert!(told, "space freed after the sender asked must be announced to it");
}

#[test]
fn space_left_unused_by_woken_senders_reaches_the_others() {
    // Senders are woken a quantum of space at a time. One woken that does not write (a program
    // told EPOLLOUT that has nothing to say now) must not strand those behind it once the
    // class's channel has nothing left to pull (no later pull would wake them).
    let cfg = CoreConfig { queue_threshold: 256 * 1024, window: 4 << 20, ..config() };
    let mut p = Pair::new(32, &[Class::Throughput], cfg);
    let streams: Vec<StreamId> = (0..8).map(|i| p.open(80 + i, Class::Throughput).0).collect();
    while let Some(_e) = p.sides[0].poll_event() {}
    let chunk = vec![7u8; 1 << 20];
    assert_eq!(p.sides[0].handle(streams[0]).send(&chunk).unwrap(), 256 * 1024);
    for &s in &streams {
        assert!(!p.sides[0].handle(s).writable());
    }
    // Nobody writes: the channel drains what was sent, and side 1 reads it off the channel.
    let mut told = HashSet::new();
    for _ in 0..100 {
        p.transmit(0);
        while let Some((id, bits)) = p.sides[0].poll_event() {
            if bits & EV_WRITE != 0 {
                told.insert(id);
            }
        }
        p.receive(1, 0);
    }
    assert_eq!(p.sides[0].stats().unsent_bytes, 0);
    assert_eq!(told.len(), streams.len(), "every waiting sender hears of the space: {told:?}");
}

#[test]
fn a_pull_wakes_a_sender_per_quantum_of_room_not_every_waiter_each_time() {
    // Sixty-four senders wait for class space. Each pull asks to wake some: one per whole
    // quantum of room (64 KiB), less those woken before that have not written yet. Waking for
    // the whole room on every pull, or for part of a quantum, sent most senders round for
    // nothing (a million streams: ten failed writes for each that went through).
    let cfg = CoreConfig { queue_threshold: 256 * 1024, window: 4 << 20, ..config() };
    let mut p = Pair::new(33, &[Class::Throughput], cfg);
    let streams: Vec<StreamId> = (0..64).map(|i| p.open(80 + i, Class::Throughput).0).collect();
    while let Some(_e) = p.sides[0].poll_event() {}
    let chunk = vec![7u8; 1 << 20];
    assert_eq!(p.sides[0].handle(streams[0]).send(&chunk).unwrap(), 256 * 1024);
    for &s in &streams {
        assert!(!p.sides[0].handle(s).writable(), "every sender waits for space");
    }
    let channel = p.links[0].index;
    let mut woken = Vec::new();
    let pull = |p: &mut Pair, bytes: usize, woken: &mut Vec<StreamId>| {
        let mut out = Vec::new();
        p.sides[0].poll_transmit(channel, bytes, 64, false, &mut out);
        // About `bytes` of DATA (a FIN owed takes a few bytes of the budget).
        let pulled = out.iter().map(|f| f.payload.len()).sum::<usize>();
        assert!(pulled > bytes - 64 && pulled <= bytes, "{pulled}");
        while let Some((id, bits)) = p.sides[0].poll_event() {
            if bits & EV_WRITE != 0 {
                woken.push(id);
            }
        }
    };
    // 48 KiB freed in three pulls: not a quantum yet.
    for _ in 0..3 {
        pull(&mut p, 16 * 1024, &mut woken);
    }
    assert_eq!(woken.len(), 0, "no sender woken for part of a quantum: {woken:?}");
    // 128 KiB freed: two quanta, two senders, however many pulls it took.
    for _ in 0..5 {
        pull(&mut p, 16 * 1024, &mut woken);
    }
    assert_eq!(woken.len(), 2, "a sender per quantum of room: {woken:?}");
    // One of them writes its quantum and more; the next pull does not wake a third for room
    // the writer took, nor the one woken before for the room it is counted on to take.
    let writer = woken[0];
    assert_eq!(p.sides[0].handle(writer).send(&chunk[..96 * 1024]).unwrap(), 96 * 1024);
    pull(&mut p, 16 * 1024, &mut woken);
    assert_eq!(woken.len(), 2, "{woken:?}");
    // The other one shuts its write half: it will take nothing, so a quantum of room wakes
    // the next sender in its place.
    p.sides[0].handle(woken[1]).shutdown_write().unwrap();
    while let Some(_e) = p.sides[0].poll_event() {} // its own EV_WRITE (end of stream owed)
    for _ in 0..2 {
        pull(&mut p, 16 * 1024, &mut woken);
    }
    assert_eq!(woken.len(), 3, "{woken:?}");
    assert!(!woken[..2].contains(&woken[2]), "a sender still waiting: {woken:?}");
    // Once the class has nothing left to pull, every sender still waiting hears of it.
    let mut out = Vec::new();
    while p.sides[0].poll_transmit(channel, 1 << 20, 64, false, &mut out) > 0 {}
    assert_eq!(p.sides[0].stats().unsent_bytes, 0);
    while let Some((id, bits)) = p.sides[0].poll_event() {
        if bits & EV_WRITE != 0 {
            woken.push(id);
        }
    }
    let told: HashSet<StreamId> = woken.iter().copied().collect();
    assert_eq!(told.len(), streams.len(), "drained: everyone is told");
}

#[test]
fn credit_tells_a_sender_writable_only_if_it_had_none_left() {
    // As kernel TCP wakes a writer only after one found no room: a CREDIT that grows a limit
    // the sender was still short of is news (EV_WRITE); one that grows it while credit was
    // left is not (the sender could write all along: an event loop would only go round).
    let cfg = CoreConfig { window: 64 * 1024, ..config() };
    let mut p = Pair::new(34, &[Class::Throughput], cfg);
    let (a, b) = p.open(80, Class::Throughput);
    let mut buf = vec![0u8; 1 << 20];
    let exchange = |p: &mut Pair, bytes: usize, buf: &mut Vec<u8>| -> bool {
        while let Some(_e) = p.sides[0].poll_event() {}
        p.events[0].clear();
        assert_eq!(p.sides[0].handle(a).send(&buf[..bytes]).unwrap(), bytes);
        let mut read = 0;
        let mut told = false;
        for _ in 0..200 {
            p.step();
            while read < bytes {
                match p.recv(1, b, &mut buf[..]) {
                    Recv::Data(n) => read += n as usize,
                    _ => break,
                }
            }
            // `step` collects the events.
            told |= p.events[0].drain(..).any(|(id, bits)| id == a && bits & EV_WRITE != 0);
            let s = p.sides[0].stream(a).unwrap();
            if read == bytes && s.send_limit >= s.send_next + 64 * 1024 {
                break;
            }
        }
        let s = p.sides[0].stream(a).unwrap();
        assert_eq!(s.send_limit, s.send_next + 64 * 1024, "the whole window is back");
        told
    };
    assert!(!exchange(&mut p, 40 * 1024, &mut buf), "credit was left: no news");
    assert!(exchange(&mut p, 64 * 1024, &mut buf), "the window was used up: writable is news");
}

/// As TCP's RST comes after the segments sent before it, the peer reads every byte the resetter
/// sent before its RST, then the reset: the RST (on any channel) waits for bytes still on the
/// others. Bytes the resetter had not sent yet are dropped, as TCP drops its unsent queue.
#[test]
fn a_reset_comes_after_the_bytes_sent_before_it() {
    let mut overtaken = 0;
    for seed in 1..60 {
        let mut p = Pair::new(seed, &[Class::Throughput; 4], config());
        let (a, b) = p.open(80, Class::Throughput);
        // Side 1 writes, pulls some of it onto the channels, and resets.
        let mut sent = 0u64;
        let mut chunk = vec![0u8; 40_000];
        for _ in 0..(1 + p.rng.below(8)) {
            let n = 1 + p.rng.below(chunk.len() as u64) as usize;
            pattern(seed, sent, &mut chunk[..n]);
            match p.sides[1].handle(b).send(&chunk[..n]) {
                Ok(k) => sent += k as u64,
                Err(_) => break,
            }
            if p.rng.chance(50) {
                p.transmit(1);
            }
        }
        let s = p.sides[1].stream(b).unwrap();
        let final_offset = s.tx.sent_end(s.send_next);
        p.sides[1].handle(b).abort(ResetCause::LocalAbort);
        // The channel the bytes went on (the first) is full for now: the RST takes another.
        let cap = p.pipe_cap;
        p.pipe_cap = p.links[0].dirs[1].pipe.len();
        p.transmit(1);
        p.pipe_cap = cap;
        let mut got = 0u64;
        let mut buf = vec![0u8; 70_000];
        let mut reset = false;
        for _ in 0..20_000 {
            p.step();
            match p.recv(0, a, &mut buf) {
                Recv::Data(n) => {
                    let mut expect = vec![0u8; n as usize];
                    pattern(seed, got, &mut expect);
                    assert!(buf[..n as usize] == expect[..], "seed {seed}: bytes differ at {got}");
                    got += n;
                }
                Recv::Reset(cause) => {
                    assert_eq!(cause, ResetCause::Peer(RstReason::Aborted));
                    reset = true;
                    break;
                }
                Recv::Empty => {}
                other => panic!("seed {seed}: {other:?}"),
            }
            if p.sides[0].stream(a).is_some_and(|s| s.flags & F_RST_PENDING != 0) {
                overtaken += 1;
            }
        }
        assert!(reset, "seed {seed}: the reset never came");
        assert_eq!(
            got, final_offset,
            "seed {seed}: read {got} of the {final_offset} sent before the RST"
        );
    }
    assert!(overtaken > 0, "no RST overtook its stream's bytes: the test tests nothing");
}

/// A peer's RST is validated like its FIN: one that claims bytes beyond the credit granted is
/// a violation (the channel closes); one that claims bytes it never sends leaves the stream
/// open, holding nothing, until the application closes it or a second has passed.
#[test]
fn an_rst_is_held_to_the_window_and_waits_only_within_it() {
    let mut p = Pair::new(17, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    let ch = ChannelId::new(0, 0);
    let granted = p.sides[1].stream(b).unwrap().granted;
    let rst = |final_offset| {
        Parsed::Control(Frame::Rst { dst: b.get(), reason: RstReason::Aborted, final_offset })
    };
    let r = p.sides[1].receive(ch, rst(granted + 1), p.now, |_, _| false);
    assert_eq!(r, Err(Violation::BeyondCredit));

    // (Injected frames move the channel's position past what the peer sent: a fresh pair,
    // and no step after the injection.)
    let mut p = Pair::new(18, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    let granted = p.sides[1].stream(b).unwrap().granted;
    let rst = Parsed::Control(Frame::Rst {
        dst: b.get(),
        reason: RstReason::Aborted,
        final_offset: granted,
    });
    assert_eq!(p.sides[1].receive(ch, rst, p.now, |_, _| false), Ok(None));
    let mut buf = [0u8; 16];
    assert_eq!(p.recv(1, b, &mut buf), Recv::Empty, "the bytes before the RST are awaited");
    assert_eq!(p.sides[1].rx_held(), 0);
    p.sides[1].handle(b).close(p.now);
    assert!(p.sides[1].stream(b).is_none());
    assert_eq!(p.sides[1].pending_rst_count(), 0, "a closed stream's pending RST is forgotten");

    // Bytes that never come (they were on a channel lost before the RST arrived, and the peer
    // does not send a reset stream's bytes again) are awaited for a second at most.
    let mut p = Pair::new(19, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    let rst =
        Parsed::Control(Frame::Rst { dst: b.get(), reason: RstReason::Aborted, final_offset: 100 });
    assert_eq!(p.sides[1].receive(ch, rst, p.now, |_, _| false), Ok(None));
    p.sides[1].handle_timeout(p.now + Duration::from_millis(900));
    assert_eq!(p.recv(1, b, &mut buf), Recv::Empty);
    p.sides[1].handle_timeout(p.now + Duration::from_millis(1001));
    assert_eq!(p.recv(1, b, &mut buf), Recv::Reset(ResetCause::Peer(RstReason::Aborted)));
    assert_eq!(p.sides[1].pending_rst_count(), 0);
}

/// An RST sent while a large write is still being copied in (reserved, not yet committed) does
/// not claim those bytes: the peer applies it at once rather than wait for bytes that never come.
#[test]
fn an_rst_does_not_claim_bytes_still_being_copied_in() {
    let mut p = Pair::new(21, &[Class::Throughput; 2], config());
    let (a, b) = p.open(80, Class::Throughput);
    let (offset, n) = p.sides[1].handle(b).reserve(100_000).unwrap();
    assert_eq!((offset, n), (0, 100_000));
    p.sides[1].handle(b).abort(ResetCause::LocalAbort);
    p.sides[1].handle(b).commit(offset, Bytes::from(vec![0u8; n]));
    let mut buf = [0u8; 16];
    for _ in 0..100 {
        p.step();
        match p.recv(0, a, &mut buf) {
            Recv::Reset(cause) => {
                assert_eq!(cause, ResetCause::Peer(RstReason::Aborted));
                return;
            }
            Recv::Empty => {}
            other => panic!("{other:?}"),
        }
    }
    panic!("the reset waited for bytes that were never sent");
}

/// An open given up here while the application keeps its handle (TCP's `shutdown` in SYN_SENT,
/// or a connect timeout) stays given up when the peer's answer comes late: the answer is
/// refused with an RST, where it had turned the stream open under a reset.
#[test]
fn a_given_up_connect_refuses_the_late_answer() {
    let mut p = Pair::new(23, &[Class::Throughput], config());
    p.listening[1].insert(80);
    let a = p.sides[0].open(80, Class::Throughput, (), p.now).unwrap();
    p.transmit(0);
    p.sides[0].handle(a).abort(ResetCause::ConnectAborted);
    for _ in 0..200 {
        p.step();
    }
    let s = p.sides[0].stream(a).unwrap();
    assert_eq!((s.phase, s.reset), (Phase::Connecting, Some(ResetCause::ConnectAborted)));
    let mut buf = [0u8; 4];
    assert_eq!(p.recv(0, a, &mut buf), Recv::Reset(ResetCause::ConnectAborted));
}

#[test]
fn a_fin_is_acknowledged_at_once_and_data_is_not() {
    let mut p = Pair::new(31, &[Class::Throughput], config());
    let (a, _b) = p.open(90, Class::Throughput);
    // Settle whatever the open left owed (its SYN and SYN_ACK are acknowledged in passing).
    let ch = p.links[0].index;
    let mut out = Vec::new();
    p.sides[1].poll_transmit(ch, 1 << 20, 64, true, &mut out);
    p.sides[0].poll_transmit(ch, 1 << 20, 64, true, &mut out);
    out.clear();
    p.links[0].dirs[0].pipe.clear();
    p.links[0].dirs[1].pipe.clear();
    // A little data: its acknowledgement may wait (it rides with the next frames out).
    p.sides[0].handle(a).send(&[5u8; 100]).unwrap();
    p.transmit(0);
    while !p.links[0].dirs[0].pipe.is_empty() {
        p.receive(1, 0);
    }
    assert!(p.sides[1].owes_ack());
    assert!(!p.sides[1].ack_due(None), "100 bytes of data are acknowledged lazily");
    // The stream's end: acknowledged at once, as TCP acknowledges a FIN.
    p.sides[0].handle(a).shutdown_write().unwrap();
    p.transmit(0);
    while !p.links[0].dirs[0].pipe.is_empty() {
        p.receive(1, 0);
    }
    assert!(p.sides[1].ack_due(None), "a FIN waits for no delayed acknowledgement");
    p.sides[1].poll_transmit(ch, 1 << 20, 64, false, &mut out);
    assert!(!p.sides[1].owes_ack() && !p.sides[1].ack_due(None));
}

/// A peer's URGENT is held to the window and to its FIN: a mark at or beyond the credit granted,
/// or at or beyond the final offset, is a violation (the channel closes); one within marks.
#[test]
fn an_urgent_mark_is_held_to_the_window_and_the_fin() {
    let urgent =
        |dst: StreamId, offset| Parsed::Control(Frame::Urgent { dst: dst.get(), offset, byte: 1 });
    let ch = ChannelId::new(0, 0);
    let mut p = Pair::new(19, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    let granted = p.sides[1].stream(b).unwrap().granted;
    let r = p.sides[1].receive(ch, urgent(b, granted), p.now, |_, _| false);
    assert_eq!(r, Err(Violation::BeyondCredit));

    let mut p = Pair::new(20, &[Class::Throughput], config());
    let (a, b) = p.open(80, Class::Throughput);
    p.sides[0].handle(a).send(b"four").unwrap();
    p.sides[0].handle(a).shutdown_write().unwrap();
    let _ = read_to_eof(&mut p, 1, b);
    let r = p.sides[1].receive(ch, urgent(b, 4), p.now, |_, _| false);
    assert_eq!(r, Err(Violation::BeyondFin));

    let mut p = Pair::new(21, &[Class::Throughput], config());
    let (_a, b) = p.open(80, Class::Throughput);
    let r = p.sides[1].receive(ch, urgent(b, 10), p.now, |_, _| false);
    assert_eq!(r, Ok(None));
    assert_eq!(p.sides[1].urgent_mark(b).map(|m| m.offset), Some(10));
}

/// Channels killed at random moments of a transfer (both ends at once or one end first, the
/// channel dialed again or not, with random windows, pipes and deferrals): every byte
/// arrives, in order, then end of stream. `NC_LOSS_SEEDS` widens the sweep.
#[test]
fn channels_lost_at_random_moments_lose_no_byte() {
    let seeds: u64 = std::env::var("NC_LOSS_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(24);
    for seed in 1..=seeds {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let window = [1u32 << 20, 8 << 20, 64 << 20][r.below(3) as usize];
        let cfg = CoreConfig { window, ..config() };
        let classes = [
            Class::Throughput,
            Class::Throughput,
            Class::Throughput,
            Class::Throughput,
            Class::Latency,
        ];
        let mut p = Pair::new(seed, &classes, cfg);
        p.defer_percent = r.below(101);
        p.grace = Duration::from_micros(100 * (1 + r.below(200)));
        p.pipe_cap = 4096 << r.below(8);
        let (a, b) = p.open(80, Class::Throughput);
        let len = (1 << 20) + r.below(24 << 20);
        let mut t = Transfer::new(a, b, seed, len);
        let max_io = 1 + r.below(1 << 20);
        let mut sendbuf = vec![0u8; max_io as usize];
        let mut recvbuf = vec![0u8; max_io as usize];
        let kills = 1 + r.below(3);
        let mut killed = 0;
        let mut next_kill = r.below(len);
        let mut redial: Vec<(u16, u32)> = Vec::new();
        let mut steps = 0u64;
        while !t.done() {
            t.drive(&mut p, &mut sendbuf, &mut recvbuf, max_io);
            if killed < kills && t.received >= next_kill {
                // Any channel, the latency one (4) too: its control frames go elsewhere.
                let victim = r.below(5) as u16;
                if p.links.iter().any(|l| l.index.index == victim && l.alive) {
                    match r.below(3) {
                        0 => p.kill(victim),
                        n => {
                            let first = (n - 1) as usize;
                            let most = [100, 3000, 30_000][r.below(3) as usize];
                            p.kill_staggered(victim, first, r.below(most) as u32);
                        }
                    }
                    killed += 1;
                    next_kill = t.received + r.below(len - t.received.min(len) + 1);
                    if r.chance(70) {
                        redial.push((victim, 200 + r.below(2000) as u32));
                    }
                }
            }
            redial.retain_mut(|(index, after)| {
                if *after > 0 {
                    *after -= 1;
                    return true;
                }
                let busy = p
                    .links
                    .iter()
                    .any(|l| l.index.index == *index && (l.alive || l.late_loss.is_some()));
                if busy {
                    return true;
                }
                let class = if *index == 4 { Class::Latency } else { Class::Throughput };
                p.add_link(*index, class);
                false
            });
            p.step();
            steps += 1;
            assert!(
                steps < 3_000_000,
                "seed {seed}: stalled at {} of {} (sent {}), window {window}, pipe {}, defer {}%",
                t.received,
                t.len,
                t.sent,
                p.pipe_cap,
                p.defer_percent
            );
        }
        assert_eq!(t.received, t.len, "seed {seed}");
        assert!(p.sides[0].stream(a).unwrap().reset.is_none(), "seed {seed}");
    }
}
