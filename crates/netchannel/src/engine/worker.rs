//! The channel worker: drives one channel's transport and dispatches what it receives into VNS.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::session::Session;
use super::EngineInner;
use crate::driver::{Channel, ChannelError, ChannelIo, ChannelQueues, InFrame};
use crate::vns::stream::{Phase, StreamState};
use crate::vns::table::Lookup;
use crate::vns::Stream;
use crate::wire::{Frame, RstReason};

/// A parked worker re-checks its channel this often even without a wake-up (only matters if a
/// wake-up were ever lost; normal wake-ups are immediate).
const PARK_TIMEOUT: Duration = Duration::from_millis(500);

pub(crate) fn run(
    engine: &Arc<EngineInner>,
    session: &Arc<Session>,
    queues: &Arc<ChannelQueues>,
    mut io: Box<dyn ChannelIo>,
) {
    let reason = serve(engine, session, queues, io.as_mut());
    queues.close(&reason);
    drop(io);
    engine.channel_closed(session, queues);
}

fn serve(
    engine: &Arc<EngineInner>,
    session: &Arc<Session>,
    queues: &Arc<ChannelQueues>,
    io: &mut dyn ChannelIo,
) -> ChannelError {
    let index = queues.meta().index;
    let config = &engine.config;
    let mut idle_since: Option<Instant> = None;
    let mut sink = |frame: InFrame| dispatch(engine, session, index, frame);
    loop {
        if !queues.is_open() || engine.stopping() {
            return ChannelError::Io(io::Error::other("closed locally"));
        }
        let received = match io.dequeue(config.rx_batch_frames, &mut sink) {
            Ok(n) => n,
            Err(e) => return e,
        };
        let sent = match io.transmit(config.tx_batch_bytes) {
            Ok(n) => n,
            Err(e) => return e,
        };
        if sent > 0 {
            session.space_freed(queues.queued_bytes());
        }
        if received > 0 || sent > 0 {
            idle_since = None;
            continue;
        }
        let now = Instant::now();
        if now.duration_since(*idle_since.get_or_insert(now)) < config.idle_spin {
            std::hint::spin_loop();
            continue;
        }
        queues.set_parked(true);
        if !queues.has_work() {
            if let Err(e) = io.park(Some(PARK_TIMEOUT)) {
                queues.set_parked(false);
                return ChannelError::Io(e);
            }
        }
        queues.set_parked(false);
        idle_since = None;
    }
}

/// Where a received frame changes VNS state. An `Err` is a protocol violation: the channel it
/// arrived on is closed and counted.
fn dispatch(
    engine: &Arc<EngineInner>,
    session: &Arc<Session>,
    channel: u16,
    frame: InFrame,
) -> Result<(), String> {
    let bit = 1u64 << channel;
    let frame = match frame {
        InFrame::Data { stream, offset, payload } => {
            let Some(s) = live_stream(engine, session, stream)? else {
                return Ok(());
            };
            let mut st = s.lock();
            st.channel_mask |= bit;
            st.frames_received += 1;
            if st.app_closed {
                // Data for a socket the application closed: like TCP, answer with a reset.
                abort_closed(engine, &s, st);
                return Ok(());
            }
            let readable = st.on_data(offset, payload).map_err(|v| {
                st.protocol_errors += 1;
                format!("stream {stream}: {v}")
            })?;
            drop(st);
            if readable > 0 {
                s.wake();
            }
            return Ok(());
        }
        InFrame::Control(f) => f,
    };
    match frame {
        Frame::Syn { src, port, class, window } => {
            accept_syn(engine, session, channel, src, port, class, window);
            Ok(())
        }
        Frame::SynAck { dst, src, window } => {
            let Some(s) = live_stream(engine, session, dst)? else {
                // The connector gave up (timed out): tell the acceptor.
                let rst = Frame::Rst { dst: src, reason: RstReason::Aborted };
                session.send_control(src, crate::wire::Class::Throughput, rst);
                return Ok(());
            };
            let mut st = s.lock();
            if st.phase != Phase::Connecting {
                st.protocol_errors += 1;
                return Err(format!("stream {dst}: SYN_ACK for an open stream"));
            }
            st.channel_mask |= bit;
            st.open(src, window);
            drop(st);
            s.wake();
            Ok(())
        }
        Frame::Fin { dst, final_offset } => {
            let Some(s) = live_stream(engine, session, dst)? else {
                return Ok(());
            };
            let mut st = s.lock();
            st.channel_mask |= bit;
            st.on_fin(final_offset).map_err(|v| {
                st.protocol_errors += 1;
                format!("stream {dst}: {v}")
            })?;
            let both_closed = st.app_closed;
            drop(st);
            if both_closed {
                engine.streams.remove(dst);
            }
            s.wake();
            Ok(())
        }
        Frame::Rst { dst, reason } => {
            let Some(s) = live_stream(engine, session, dst)? else {
                return Ok(());
            };
            let mut st = s.lock();
            st.on_reset(crate::vns::stream::ResetCause::Peer(reason));
            let closed = st.app_closed;
            drop(st);
            if closed {
                engine.streams.remove(dst);
            }
            s.wake();
            Ok(())
        }
        Frame::Credit { dst, consumed, window } => {
            let Some(s) = live_stream(engine, session, dst)? else {
                return Ok(());
            };
            let mut st = s.lock();
            st.channel_mask |= bit;
            let grew = st.on_credit(consumed, window).map_err(|v| {
                st.protocol_errors += 1;
                format!("stream {dst}: {v}")
            })?;
            drop(st);
            if grew {
                s.wake();
            }
            Ok(())
        }
        Frame::Data { .. } => unreachable!("DATA is handled above"),
    }
}

/// Resolves a stream id from a peer: `Ok(None)` for a stream closed here (stale, ignored),
/// `Err` for an id that was never issued or belongs to another peer.
fn live_stream(
    engine: &EngineInner,
    session: &Arc<Session>,
    id: u32,
) -> Result<Option<Arc<Stream>>, String> {
    match engine.streams.lookup(id) {
        Lookup::Live(s) if Arc::ptr_eq(&s.session, session) => Ok(Some(s)),
        Lookup::Live(_) => Err(format!("stream {id} belongs to another peer")),
        Lookup::Stale => {
            engine.counters.stale_frames.fetch_add(1, Ordering::Relaxed);
            Ok(None)
        }
        Lookup::Unknown => Err(format!("unknown stream id {id}")),
    }
}

fn abort_closed(
    engine: &EngineInner,
    s: &Arc<Stream>,
    mut st: std::sync::MutexGuard<'_, StreamState>,
) {
    let (peer, class) = (st.peer_stream, st.class);
    st.on_reset(crate::vns::stream::ResetCause::Peer(RstReason::Aborted));
    drop(st);
    s.session.send_control(s.id, class, Frame::Rst { dst: peer, reason: RstReason::Aborted });
    engine.streams.remove(s.id);
}

#[allow(clippy::too_many_arguments)]
fn accept_syn(
    engine: &Arc<EngineInner>,
    session: &Arc<Session>,
    channel: u16,
    src: u32,
    port: u16,
    class: crate::wire::Class,
    window: u32,
) {
    let refuse = |reason| {
        session.send_control(src, class, Frame::Rst { dst: src, reason });
    };
    let listener = engine.listeners.lock().unwrap_or_else(|e| e.into_inner()).get(&port).cloned();
    let Some(listener) = listener else {
        return refuse(RstReason::NoListener);
    };
    if listener.is_full() {
        return refuse(RstReason::Refused);
    }
    let config = &engine.config;
    let stream = engine.streams.insert(|id| {
        let mut st =
            StreamState::new(class, config.stream_window, config.max_out_of_order_segments);
        st.open(src, window);
        st.channel_mask |= 1u64 << channel;
        Arc::new(Stream::new(id, port, session.clone(), st))
    });
    let Some(stream) = stream else {
        return refuse(RstReason::Refused);
    };
    // Queued before it is acknowledged, so sequential connects are accepted in order.
    if !listener.push(stream.clone()) {
        // The listener closed or filled up in between.
        engine.streams.remove(stream.id);
        return refuse(RstReason::Refused);
    }
    let ack = Frame::SynAck { dst: src, src: stream.id, window: config.stream_window };
    if let Some(used) = session.send_control(stream.id, class, ack) {
        stream.lock().channel_mask |= 1u64 << used;
    }
}
