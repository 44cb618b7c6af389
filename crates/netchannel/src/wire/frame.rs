//! Frames inside a channel's byte stream, after the handshake (protocol version 6).
//!
//! Every frame starts with a 12-byte common header, followed by a type-specific part (big-endian):
//!
//! ```text
//! common   type u8 | flags u8 | reserved u16 (0) | stream u64
//!          (flags: 0, but for SYN_ACK's bit 0, `FLAG_KERNEL_PREFERRED`)
//! DATA   1 offset u64 | length u32 | payload[length]             24 + length
//! SYN    2 port u16 | class u8 | reserved u8 (0) | window u32       20
//! SYNACK 3 source stream u64 | window u32                         24
//! RST    4 reason u8 | reserved [u8; 3] (0) | final offset u64     24
//! FIN    5 final offset u64                                        20
//! CREDIT 6 consumed u64 | window u32                               24
//! ACK    7 channel u16 | incarnation u16 | position u64           24   (stream 0)
//! URGENT 8 offset u64 | byte u8 | reserved [u8; 3] (0)              24
//! ```
//!
//! `stream` is the *receiver's* stream id for every type but SYN, where it is the sender's own id
//! (the receiver has none yet), and ACK, which concerns a channel, not a stream. The decoder
//! never panics and never reads past the slice: every length is checked before a field is read,
//! and every field is validated.

use super::{Class, WireError};

/// Bytes of the header every frame starts with.
pub const COMMON_LEN: usize = 12;
/// Bytes of a DATA frame before its payload.
pub const DATA_HEADER_LEN: usize = 24;
/// Largest DATA payload a peer may send.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Largest window a SYN, SYN_ACK or CREDIT may grant (1 GiB), so offsets cannot be pushed toward
/// overflow by a single frame.
pub const MAX_WINDOW: u32 = 1 << 30;
/// Longest encoded frame header (a whole control frame, or DATA without its payload).
pub const MAX_HEADER_LEN: usize = 24;

/// SYN_ACK flag: the acceptor serves this port through forked processes (the opener's
/// connection is relayed there) and asks the opener's further connections to the port to go
/// over kernel TCP for a while.
pub const FLAG_KERNEL_PREFERRED: u8 = 1;

const T_DATA: u8 = 1;
const T_SYN: u8 = 2;
const T_SYN_ACK: u8 = 3;
const T_RST: u8 = 4;
const T_FIN: u8 = 5;
const T_CREDIT: u8 = 6;
const T_ACK: u8 = 7;
const T_URGENT: u8 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// Why a stream was reset (RST's reason field).
pub enum RstReason {
    /// No listener on the requested port.
    NoListener,
    /// A listener exists but refused the stream (backlog full, stream limit).
    Refused,
    /// The stream was aborted (closed with unread data, undeliverable bytes, peer gone).
    Aborted,
    /// The stream timed out (an open never answered, a close never finished).
    TimedOut,
    /// A reason code this version does not know; treated as `Aborted`.
    Unknown(u8),
}

impl RstReason {
    /// Its code on the wire.
    pub fn code(self) -> u8 {
        match self {
            RstReason::NoListener => 1,
            RstReason::Refused => 2,
            RstReason::Aborted => 3,
            RstReason::TimedOut => 4,
            RstReason::Unknown(n) => n,
        }
    }
    /// The reason of a code (unknown codes are `Aborted`).
    pub fn from_code(n: u8) -> Self {
        match n {
            1 => RstReason::NoListener,
            2 => RstReason::Refused,
            3 => RstReason::Aborted,
            4 => RstReason::TimedOut,
            n => RstReason::Unknown(n),
        }
    }
}

/// A decoded frame; DATA borrows its payload from the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Stream bytes at `offset` (DATA).
    Data {
        /// The receiver's stream id.
        stream: u64,
        /// Stream offset of the first payload byte.
        offset: u64,
        /// 1..=`MAX_PAYLOAD` bytes.
        payload: &'a [u8],
    },
    /// Opens a stream to `port` (SYN): `src` is the sender's id for it.
    Syn {
        /// The opener's id for the stream.
        src: u64,
        /// Virtual port at the receiver.
        port: u16,
        /// The stream's class.
        class: Class,
        /// Bytes the opener lets the acceptor send before a CREDIT.
        window: u32,
    },
    /// Accepts stream `dst` (SYN_ACK): `src` is the acceptor's id for it.
    SynAck {
        /// The opener's id for the stream.
        dst: u64,
        /// The acceptor's id for it.
        src: u64,
        /// Bytes the acceptor lets the opener send before a CREDIT.
        window: u32,
        /// `FLAG_KERNEL_PREFERRED`.
        kernel_preferred: bool,
    },
    /// Aborts stream `dst` (RST) once the bytes sent before it are in: as TCP's RST comes after
    /// the segments sent before it, the receiver delivers the stream's bytes below
    /// `final_offset` (which may still be on other channels) before the reset.
    Rst {
        /// The receiver's stream id.
        dst: u64,
        /// Why.
        reason: RstReason,
        /// The sender sent none of the stream's bytes at or beyond this offset, and will send
        /// none (0 when it knows of no bytes, e.g. for a stream it does not have).
        final_offset: u64,
    },
    /// No byte at or beyond `final_offset` will follow (FIN).
    Fin {
        /// The receiver's stream id.
        dst: u64,
        /// The stream's length.
        final_offset: u64,
    },
    /// The receiver consumed `consumed` bytes; the sender may go `window` beyond (CREDIT).
    Credit {
        /// The receiver's stream id.
        dst: u64,
        /// Bytes of the stream the sender's application has read.
        consumed: u64,
        /// Bytes beyond `consumed` the peer may send.
        window: u32,
    },
    /// The sender of this frame has processed `position` bytes of the frames its peer sent on
    /// channel `channel` (counted from the end of the handshake).
    Ack {
        /// The channel acknowledged (any channel may carry the ACK).
        channel: u16,
        /// Its incarnation: a channel dialed again under the same index is another channel,
        /// and an ACK meant for the one before it must not act on it.
        incarnation: u16,
        /// Frame bytes processed on it.
        position: u64,
    },
    /// The byte at `offset` of the stream is urgent (TCP's urgent pointer, `MSG_OOB`), and its
    /// value is `byte` (URGENT). May arrive before or after the DATA that carries the byte.
    Urgent {
        /// The receiver's stream id.
        dst: u64,
        /// Stream offset of the urgent byte.
        offset: u64,
        /// Its value, so that the receiver can hand it out of band before the DATA is in.
        byte: u8,
    },
}

/// What [`decode`] found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A whole frame that occupies the first `len` bytes.
    Frame(Frame<'a>, usize),
    /// A valid DATA header whose payload is not all there yet: `header` bytes of header are
    /// followed by the first bytes of a `len`-byte payload. Lets a reader place the rest of the
    /// payload wherever it wants instead of staging it.
    PartialData {
        /// The receiver's stream id.
        stream: u64,
        /// Stream offset of the payload.
        offset: u64,
        /// Payload bytes.
        len: usize,
    },
    /// Not enough bytes to decide; at least `needed` bytes in total are required.
    Incomplete {
        /// Bytes needed in total.
        needed: usize,
    },
}

impl Frame<'_> {
    /// The frame without its borrow: a DATA frame keeps its header and drops its payload (for
    /// control frames, which carry none, and for logging what was read).
    pub fn into_owned_control(self) -> Frame<'static> {
        match self {
            Frame::Data { stream, offset, .. } => Frame::Data { stream, offset, payload: &[] },
            Frame::Syn { src, port, class, window } => Frame::Syn { src, port, class, window },
            Frame::SynAck { dst, src, window, kernel_preferred } => {
                Frame::SynAck { dst, src, window, kernel_preferred }
            }
            Frame::Rst { dst, reason, final_offset } => Frame::Rst { dst, reason, final_offset },
            Frame::Fin { dst, final_offset } => Frame::Fin { dst, final_offset },
            Frame::Credit { dst, consumed, window } => Frame::Credit { dst, consumed, window },
            Frame::Ack { channel, incarnation, position } => {
                Frame::Ack { channel, incarnation, position }
            }
            Frame::Urgent { dst, offset, byte } => Frame::Urgent { dst, offset, byte },
        }
    }

    /// Bytes this frame occupies on the wire, payload included.
    pub fn wire_len(&self) -> usize {
        match self {
            Frame::Data { payload, .. } => DATA_HEADER_LEN + payload.len(),
            Frame::Syn { .. } | Frame::Fin { .. } => 20,
            Frame::SynAck { .. }
            | Frame::Rst { .. }
            | Frame::Credit { .. }
            | Frame::Ack { .. }
            | Frame::Urgent { .. } => 24,
        }
    }

    /// Writes the header (for DATA: without the payload) into `out` and returns its length.
    pub fn encode_header(&self, out: &mut [u8; MAX_HEADER_LEN]) -> usize {
        let (ty, stream) = match *self {
            Frame::Data { stream, .. } => (T_DATA, stream),
            Frame::Syn { src, .. } => (T_SYN, src),
            Frame::SynAck { dst, .. } => (T_SYN_ACK, dst),
            Frame::Rst { dst, .. } => (T_RST, dst),
            Frame::Fin { dst, .. } => (T_FIN, dst),
            Frame::Credit { dst, .. } => (T_CREDIT, dst),
            Frame::Ack { .. } => (T_ACK, 0),
            Frame::Urgent { dst, .. } => (T_URGENT, dst),
        };
        out.fill(0);
        out[0] = ty;
        if let Frame::SynAck { kernel_preferred: true, .. } = *self {
            out[1] = FLAG_KERNEL_PREFERRED;
        }
        out[4..12].copy_from_slice(&stream.to_be_bytes());
        let rest = &mut out[COMMON_LEN..];
        match *self {
            Frame::Data { offset, payload, .. } => {
                rest[0..8].copy_from_slice(&offset.to_be_bytes());
                rest[8..12].copy_from_slice(&(payload.len() as u32).to_be_bytes());
                DATA_HEADER_LEN
            }
            Frame::Syn { port, class, window, .. } => {
                rest[0..2].copy_from_slice(&port.to_be_bytes());
                rest[2] = class.code();
                rest[4..8].copy_from_slice(&window.to_be_bytes());
                20
            }
            Frame::SynAck { src, window, .. } => {
                rest[0..8].copy_from_slice(&src.to_be_bytes());
                rest[8..12].copy_from_slice(&window.to_be_bytes());
                24
            }
            Frame::Rst { reason, final_offset, .. } => {
                rest[0] = reason.code();
                rest[4..12].copy_from_slice(&final_offset.to_be_bytes());
                24
            }
            Frame::Fin { final_offset, .. } => {
                rest[0..8].copy_from_slice(&final_offset.to_be_bytes());
                20
            }
            Frame::Credit { consumed, window, .. } => {
                rest[0..8].copy_from_slice(&consumed.to_be_bytes());
                rest[8..12].copy_from_slice(&window.to_be_bytes());
                24
            }
            Frame::Ack { channel, incarnation, position } => {
                rest[0..2].copy_from_slice(&channel.to_be_bytes());
                rest[2..4].copy_from_slice(&incarnation.to_be_bytes());
                rest[4..12].copy_from_slice(&position.to_be_bytes());
                24
            }
            Frame::Urgent { offset, byte, .. } => {
                rest[0..8].copy_from_slice(&offset.to_be_bytes());
                rest[8] = byte;
                24
            }
        }
    }

    /// Appends the whole frame, payload included, to `out`.
    #[cfg(any(test, feature = "internals"))]
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut header = [0u8; MAX_HEADER_LEN];
        let n = self.encode_header(&mut header);
        out.extend_from_slice(&header[..n]);
        if let Frame::Data { payload, .. } = self {
            out.extend_from_slice(payload);
        }
    }
}

/// Encodes a DATA header for a payload of `len` bytes.
pub fn data_header(stream: u64, offset: u64, len: usize) -> [u8; DATA_HEADER_LEN] {
    let mut h = [0u8; DATA_HEADER_LEN];
    h[0] = T_DATA;
    h[4..12].copy_from_slice(&stream.to_be_bytes());
    h[12..20].copy_from_slice(&offset.to_be_bytes());
    h[20..24].copy_from_slice(&(len as u32).to_be_bytes());
    h
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn check_window(window: u32) -> Result<u32, WireError> {
    if window > MAX_WINDOW {
        return Err(WireError::BadField { field: "window", value: window as u64 });
    }
    Ok(window)
}

fn zero(b: &[u8], field: &'static str) -> Result<(), WireError> {
    match b.iter().position(|&x| x != 0) {
        None => Ok(()),
        Some(i) => Err(WireError::BadField { field, value: b[i] as u64 }),
    }
}

/// Decodes the frame at the front of `buf`.
pub fn decode(buf: &[u8]) -> Result<Decoded<'_>, WireError> {
    if buf.is_empty() {
        return Ok(Decoded::Incomplete { needed: COMMON_LEN });
    }
    let ty = buf[0];
    let fixed = match ty {
        T_DATA | T_SYN_ACK | T_RST | T_CREDIT | T_ACK | T_URGENT => 24,
        T_SYN | T_FIN => 20,
        t => return Err(WireError::UnknownType(t)),
    };
    if buf.len() < COMMON_LEN {
        return Ok(Decoded::Incomplete { needed: COMMON_LEN });
    }
    let allowed_flags = if ty == T_SYN_ACK { FLAG_KERNEL_PREFERRED } else { 0 };
    if buf[1] & !allowed_flags != 0 {
        return Err(WireError::BadField { field: "flags", value: buf[1] as u64 });
    }
    zero(&buf[2..4], "reserved")?;
    if buf.len() < fixed {
        return Ok(Decoded::Incomplete { needed: fixed });
    }
    let stream = be_u64(buf, 4);
    let r = COMMON_LEN;
    let frame = match ty {
        T_DATA => {
            let offset = be_u64(buf, r);
            let len = be_u32(buf, r + 8) as usize;
            if len == 0 || len > MAX_PAYLOAD {
                return Err(WireError::BadField { field: "payload length", value: len as u64 });
            }
            if offset.checked_add(len as u64).is_none() {
                return Err(WireError::BadField { field: "offset", value: offset });
            }
            let total = DATA_HEADER_LEN + len;
            if buf.len() < total {
                return Ok(Decoded::PartialData { stream, offset, len });
            }
            return Ok(Decoded::Frame(
                Frame::Data { stream, offset, payload: &buf[DATA_HEADER_LEN..total] },
                total,
            ));
        }
        T_SYN => {
            let class = Class::from_code(buf[r + 2])
                .ok_or(WireError::BadField { field: "class", value: buf[r + 2] as u64 })?;
            zero(&buf[r + 3..r + 4], "reserved")?;
            Frame::Syn {
                src: stream,
                port: be_u16(buf, r),
                class,
                window: check_window(be_u32(buf, r + 4))?,
            }
        }
        T_SYN_ACK => Frame::SynAck {
            dst: stream,
            src: be_u64(buf, r),
            window: check_window(be_u32(buf, r + 8))?,
            kernel_preferred: buf[1] & FLAG_KERNEL_PREFERRED != 0,
        },
        T_RST => {
            zero(&buf[r + 1..r + 4], "reserved")?;
            Frame::Rst {
                dst: stream,
                reason: RstReason::from_code(buf[r]),
                final_offset: be_u64(buf, r + 4),
            }
        }
        T_FIN => Frame::Fin { dst: stream, final_offset: be_u64(buf, r) },
        T_CREDIT => {
            let consumed = be_u64(buf, r);
            let window = check_window(be_u32(buf, r + 8))?;
            if consumed.checked_add(window as u64).is_none() {
                return Err(WireError::BadField { field: "consumed", value: consumed });
            }
            Frame::Credit { dst: stream, consumed, window }
        }
        T_ACK => {
            if stream != 0 {
                return Err(WireError::BadField { field: "ack stream", value: stream });
            }
            Frame::Ack {
                channel: be_u16(buf, r),
                incarnation: be_u16(buf, r + 2),
                position: be_u64(buf, r + 4),
            }
        }
        T_URGENT => {
            zero(&buf[r + 9..r + 12], "reserved")?;
            let offset = be_u64(buf, r);
            // The byte's end must not overflow, as a DATA range's (checked as a one-byte range).
            if offset == u64::MAX {
                return Err(WireError::BadField { field: "offset", value: offset });
            }
            Frame::Urgent { dst: stream, offset, byte: buf[r + 8] }
        }
        _ => unreachable!("type checked above"),
    };
    Ok(Decoded::Frame(frame, fixed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Spec = (u8, u64, u64, u32, u16, bool, Vec<u8>);

    fn arb_frame() -> impl Strategy<Value = Spec> {
        (
            0u8..8,
            any::<u64>(),
            0u64..u64::MAX / 2,
            0u32..=MAX_WINDOW,
            any::<u16>(),
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 1..2048),
        )
    }

    fn build(spec: &Spec) -> Frame<'_> {
        let (ty, s, off, win, port, lat, payload) = spec;
        let class = if *lat { Class::Latency } else { Class::Throughput };
        match ty {
            0 => Frame::Data { stream: *s, offset: *off, payload },
            1 => Frame::Syn { src: *s, port: *port, class, window: *win },
            2 => Frame::SynAck {
                dst: *s,
                src: off.wrapping_mul(3),
                window: *win,
                kernel_preferred: *lat,
            },
            3 => Frame::Rst {
                dst: *s,
                reason: RstReason::from_code((*port % 5) as u8),
                final_offset: *off,
            },
            4 => Frame::Fin { dst: *s, final_offset: *off },
            5 => Frame::Credit { dst: *s, consumed: *off, window: *win },
            6 => Frame::Urgent { dst: *s, offset: *off, byte: *port as u8 },
            _ => Frame::Ack { channel: *port, incarnation: *win as u16, position: *off },
        }
    }

    proptest! {
        #[test]
        fn round_trip(specs in proptest::collection::vec(arb_frame(), 1..8)) {
            let frames: Vec<Frame<'_>> = specs.iter().map(build).collect();
            let mut buf = Vec::new();
            for f in &frames { f.encode(&mut buf); }
            let mut at = 0;
            for f in &frames {
                match decode(&buf[at..]).unwrap() {
                    Decoded::Frame(got, n) => {
                        prop_assert_eq!(&got, f);
                        prop_assert_eq!(n, f.wire_len());
                        at += n;
                    }
                    other => prop_assert!(false, "unexpected {:?}", other),
                }
            }
            prop_assert_eq!(at, buf.len());
        }

        #[test]
        fn every_prefix_is_incomplete_never_wrong(spec in arb_frame()) {
            let f = build(&spec);
            let mut buf = Vec::new();
            f.encode(&mut buf);
            for cut in 0..buf.len() {
                match decode(&buf[..cut]).unwrap() {
                    Decoded::Incomplete { needed } => prop_assert!(needed > cut),
                    Decoded::PartialData { len, .. } => prop_assert!(DATA_HEADER_LEN + len > cut),
                    Decoded::Frame(..) => prop_assert!(false, "frame from a prefix"),
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut rest: &[u8] = &bytes;
            // Walk the buffer as a channel reader would, until an error or a short frame.
            while let Ok(Decoded::Frame(f, n)) = decode(rest) {
                prop_assert_eq!(n, f.wire_len());
                prop_assert!(n <= rest.len());
                rest = &rest[n..];
            }
        }
    }

    #[test]
    fn invalid_fields_are_errors() {
        let mut b = Vec::new();
        Frame::Data { stream: 1, offset: 0, payload: &[1, 2, 3] }.encode(&mut b);
        let mut bad = b.clone();
        bad[0] = 99;
        assert_eq!(decode(&bad), Err(WireError::UnknownType(99)));
        let mut bad = b.clone();
        bad[1] = 1;
        assert!(matches!(decode(&bad), Err(WireError::BadField { field: "flags", .. })));
        // SYN_ACK alone may carry a flag, and only the one defined.
        let mut syn_ack = Vec::new();
        let frame = Frame::SynAck { dst: 1, src: 2, window: 3, kernel_preferred: true };
        frame.encode(&mut syn_ack);
        assert_eq!(syn_ack[1], FLAG_KERNEL_PREFERRED);
        assert_eq!(decode(&syn_ack), Ok(Decoded::Frame(frame, 24)));
        syn_ack[1] |= 2;
        assert!(matches!(decode(&syn_ack), Err(WireError::BadField { field: "flags", .. })));
        let mut bad = b.clone();
        bad[20..24].copy_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
        assert!(matches!(decode(&bad), Err(WireError::BadField { .. })));
        let mut bad = b.clone();
        bad[20..24].copy_from_slice(&0u32.to_be_bytes());
        assert!(matches!(decode(&bad), Err(WireError::BadField { .. })));
        let mut bad = b;
        bad[12..20].copy_from_slice(&(u64::MAX - 1).to_be_bytes());
        assert!(matches!(decode(&bad), Err(WireError::BadField { field: "offset", .. })));
        let mut c = Vec::new();
        Frame::Credit { dst: 1, consumed: 0, window: 5 }.encode(&mut c);
        c[20..24].copy_from_slice(&(MAX_WINDOW + 1).to_be_bytes());
        assert!(matches!(decode(&c), Err(WireError::BadField { field: "window", .. })));
        let mut a = Vec::new();
        Frame::Ack { channel: 3, incarnation: 1, position: 9 }.encode(&mut a);
        a[11] = 1;
        assert!(matches!(decode(&a), Err(WireError::BadField { field: "ack stream", .. })));
        let mut u = Vec::new();
        let urgent = Frame::Urgent { dst: 4, offset: 7, byte: b'!' };
        urgent.encode(&mut u);
        assert_eq!(decode(&u), Ok(Decoded::Frame(urgent, 24)));
        u[23] = 1;
        assert!(matches!(decode(&u), Err(WireError::BadField { field: "reserved", .. })));
        let mut u = Vec::new();
        Frame::Urgent { dst: 4, offset: u64::MAX, byte: 0 }.encode(&mut u);
        assert!(matches!(decode(&u), Err(WireError::BadField { field: "offset", .. })));
    }

    #[test]
    fn partial_data_reports_header() {
        let payload = vec![7u8; 1000];
        let mut b = Vec::new();
        Frame::Data { stream: 9, offset: 77, payload: &payload }.encode(&mut b);
        assert_eq!(
            decode(&b[..DATA_HEADER_LEN + 10]).unwrap(),
            Decoded::PartialData { stream: 9, offset: 77, len: 1000 }
        );
        assert_eq!(&b[..DATA_HEADER_LEN], &data_header(9, 77, 1000));
    }
}
