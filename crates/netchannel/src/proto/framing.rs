//! Splitting a channel's received byte stream into frames, without I/O: the reader says how many
//! bytes it wants next and where they go, the transport reads them into its buffer, and
//! [`FrameReader::parse`] turns them into session inputs.
//!
//! Whole frames are parsed where they were read: a DATA payload becomes a reference-counted
//! slice of the read buffer, never a copy. A large DATA payload whose header arrived before it
//! is not read into the buffer at all: the session either *defers* it (its stream's reader
//! reads it straight from the socket into the application's buffer, and this reader stands
//! still until then), has it read into a buffer of its own (*stage*), or has it dropped. After a
//! large payload the reader asks for just one header's worth of bytes, so the next large payload
//! is not half-read into the staging buffer.

use bytes::{Buf, Bytes, BytesMut};

use crate::wire::frame::{self, DATA_HEADER_LEN, MAX_HEADER_LEN};
use crate::wire::{Decoded, Frame, WireError};

/// Where the reader gets memory of its own for a payload it stages (reads whole into user
/// space): a pool of reused buffers at run time, plain allocations in tests. The reader never
/// owns a pool or a lock; it only asks for a buffer.
pub trait Buffers {
    /// A buffer with room for at least one piece; `Bytes::from_owner` shares it once full.
    type Buf: AsMut<Vec<u8>> + AsRef<[u8]> + Send + 'static;
    /// An empty buffer.
    fn get(&self) -> Self::Buf;

    /// An empty staging buffer with room for at least `min` bytes, for when the reader's own
    /// is still shared by slices not yet read.
    fn staging(&self, min: usize) -> BytesMut {
        BytesMut::with_capacity(min.max(READ_SIZE))
    }

    /// A staging buffer the reader let go while slices of it are still unread: a pool may take
    /// it up again once they are gone (`staging`), instead of freeing it.
    fn retire(&self, buf: BytesMut) {
        drop(buf);
    }
}

/// Plain heap buffers of a fixed capacity (tests, and readers without a pool).
#[derive(Debug, Clone, Copy)]
pub struct Heap(pub usize);

impl Buffers for Heap {
    type Buf = Vec<u8>;
    fn get(&self) -> Vec<u8> {
        Vec::with_capacity(self.0)
    }
}

/// Bytes asked of one read when frames are small.
pub const READ_SIZE: usize = 256 * 1024;
/// A buffer with at least this much room is read into without reserving more.
const MIN_ROOM: usize = 64 * 1024;

/// What one parse step produced.
#[derive(Debug)]
pub enum Parsed {
    /// A whole control frame.
    Control(Frame<'static>),
    /// A whole DATA frame.
    Data { stream: u64, offset: u64, payload: Bytes },
    /// The header of a large DATA frame and the part of its payload already read. The reader
    /// stops here until [`FrameReader::verdict`] says what to do with the rest.
    Header { stream: u64, offset: u64, len: u64, prefix: Bytes },
    /// More of a staged payload (after `Verdict::Stage`).
    Piece { stream: u64, offset: u64, data: Bytes },
    /// More of a deferred payload read by the engine itself (its reader did not come in time).
    StagedDeferred(Bytes),
    /// Bytes of a payload nobody wants, read and dropped.
    Discarded { bytes: u64, deferred: bool },
}

impl Parsed {
    /// A frame began here (counted as a received frame); the rest are pieces of payloads.
    pub fn is_frame(&self) -> bool {
        matches!(self, Parsed::Control(_) | Parsed::Data { .. } | Parsed::Header { .. })
    }
}

/// What the session decided for the rest of a large payload whose header was parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Leave it in the socket: the stream's reader reads it straight into its own buffer.
    /// The channel carries nothing else until it has been read (or taken over).
    Defer,
    /// Read it into user space (it arrives as `Parsed::Piece`).
    Stage,
    /// Read and drop it (reported as `Parsed::Discarded`): its stream is gone.
    Discard,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Stage {
        stream: u64,
    },
    Discard,
    /// A deferred payload read by the engine: staged for its stream, or dropped.
    Deferred {
        keep: bool,
    },
}

#[derive(Debug, Clone, Copy)]
struct Payload {
    mode: Mode,
    offset: u64,
    remaining: u64,
}

/// Where the next read goes.
pub enum Target<'a> {
    /// The staging buffer, where frames are parsed in place.
    Staging(&'a mut BytesMut),
    /// A buffer of its own, for a payload being staged.
    Payload(&'a mut Vec<u8>),
}

/// Splits one channel's byte stream into [`Parsed`] items (see the module doc).
pub struct FrameReader<B: Buffers = Heap> {
    buf: BytesMut,
    /// The capacity `buf` had when it came from `buffers` (its allocation's size).
    buf_size: usize,
    /// A payload being read in pieces.
    payload: Option<Payload>,
    /// Where a staged payload's bytes are read (memory of its own, not the staging buffer, so
    /// the staging buffer is not re-allocated per payload).
    buffers: B,
    piece: Option<B::Buf>,
    /// Header parsed, verdict pending: `(stream, offset of the rest, bytes left)`.
    pending: Option<(u64, u64, u64)>,
    /// A payload is left in the socket for its reader; nothing is read until `resume`.
    deferred: bool,
    /// How often large payloads were deferred lately (a saturating score, 0..=8). While they
    /// mostly are, the reader reads one header at a time, so the next large payload is not
    /// half-read into the staging buffer; while they are mostly staged, it reads as much as it
    /// can and parses in place.
    defer_score: u8,
    /// Payloads at least this large are handed to the session as `Header`.
    large: usize,
}

impl<B: Buffers> FrameReader<B> {
    /// A reader that hands payloads of at least `large` bytes to the session as `Header`
    /// (the session decides where the rest goes), staging them into `buffers`.
    pub fn new(large: usize, buffers: B) -> Self {
        FrameReader {
            // Its memory is touched as bytes arrive (a channel of small messages keeps to the
            // first pages: `buffer`).
            buf: buffers.staging(READ_SIZE),
            buf_size: READ_SIZE,
            payload: None,
            buffers,
            piece: None,
            pending: None,
            deferred: false,
            defer_score: 3,
            large: large.max(1),
        }
    }

    /// Bytes the next read should ask for; 0 when the reader must not read (a payload is
    /// deferred, or a verdict is pending).
    pub fn want(&self) -> usize {
        if self.deferred || self.pending.is_some() {
            return 0;
        }
        if let Some(p) = &self.payload {
            let exact = (p.remaining as usize).min(frame::MAX_PAYLOAD);
            return match p.mode {
                // Read into a buffer of its own: exactly the payload.
                Mode::Deferred { keep: true } => exact,
                // Exactly the payload when the next payload is likely deferred; else full-size
                // reads: what follows the payload is parsed in place, as any frame.
                _ if self.deferring() => exact,
                _ => (p.remaining as usize).clamp(READ_SIZE, frame::MAX_PAYLOAD),
            };
        }
        if self.deferring() && self.buf.len() < MAX_HEADER_LEN {
            return DATA_HEADER_LEN - self.buf.len().min(DATA_HEADER_LEN - 1);
        }
        READ_SIZE
    }

    /// The buffer to read into, with room for at least `want` bytes.
    pub fn buffer(&mut self, want: usize) -> &mut BytesMut {
        if self.buf.is_empty() {
            // Everything read so far is parsed: once no slice of the buffer is left unread,
            // reads start again at its front. A channel of small messages then touches only
            // the first pages of its 256 KiB (measured: about 200 KB resident per channel of
            // 4 KiB RPCs without this), and a busy one reuses warm memory.
            let _whole = super::reclaim_whole(&mut self.buf);
            // And away from the start of a page, where the kernel's copies are slow.
            crate::copy::clear_of_page_start(&mut self.buf);
        }
        let room = self.buf.capacity() - self.buf.len();
        if room < want.min(MIN_ROOM) && !self.buf.try_reclaim(want) {
            // Slices of the buffer are still unread: another buffer takes what is left to
            // parse. It comes from the reader's buffers, not the allocator: freed and
            // allocated again at the rate bytes flow, staging memory went back to the kernel
            // and was faulted in afresh (all-to-all 64: most of its 300,000-470,000 page
            // faults in 3 s were the kernel's copies into staging buffers).
            let mut fresh = self.buffers.staging(want + self.buf.len());
            let fresh_size = fresh.capacity();
            crate::copy::extend(&mut fresh, &self.buf);
            let mut old = std::mem::replace(&mut self.buf, fresh);
            // Only buffers of the usual size come back (one grown for a large payload is
            // freed), so that retired memory stays within its bound.
            if std::mem::replace(&mut self.buf_size, fresh_size) <= READ_SIZE {
                old.clear();
                self.buffers.retire(old);
            }
            // A fresh buffer's first read is placed as every later one from its front is (a
            // first buffer starting near a page start was read there once, then 64 bytes on).
            crate::copy::clear_of_page_start(&mut self.buf);
        }
        &mut self.buf
    }

    /// Whether large payloads on this channel are mostly deferred lately.
    fn deferring(&self) -> bool {
        self.defer_score >= 4
    }

    /// Where the next read of `want` bytes goes: a pooled buffer of its own while a payload is
    /// read exactly (after the staging buffer's leftovers are parsed), else the staging buffer.
    pub fn target(&mut self, want: usize) -> Target<'_> {
        let staging_payload = match self.payload {
            Some(Payload { mode: Mode::Deferred { keep: true }, .. }) => true,
            Some(Payload { mode: Mode::Stage { .. }, .. }) => self.deferring(),
            _ => false,
        };
        if staging_payload && self.buf.is_empty() {
            let full = |p: &mut B::Buf| {
                let v = p.as_mut();
                v.len() == v.capacity()
            };
            if self.piece.as_mut().is_none_or(full) {
                self.piece = Some(self.buffers.get());
            }
            return Target::Payload(self.piece.as_mut().expect("set above").as_mut());
        }
        Target::Staging(self.buffer(want))
    }

    /// Room left in the staging buffer.
    #[cfg(test)]
    pub(crate) fn room(&self) -> usize {
        self.buf.capacity() - self.buf.len()
    }

    pub fn is_deferred(&self) -> bool {
        self.deferred
    }

    /// Mid-frame: a payload being read, or a header waiting for its verdict.
    pub fn mid_frame(&self) -> bool {
        !self.buf.is_empty() || self.payload.is_some() || self.pending.is_some() || self.deferred
    }

    /// Parses what was read into `out`, at most `max` items. Stops after a `Header` (until
    /// `verdict`). An error is a protocol violation.
    pub fn parse(&mut self, out: &mut Vec<Parsed>, max: usize) -> Result<(), WireError> {
        let start = out.len();
        while out.len() - start < max && self.pending.is_none() && !self.deferred {
            if let Some(p) = self.payload.as_mut() {
                let data = if !self.buf.is_empty() {
                    let n = (p.remaining as usize).min(self.buf.len());
                    self.buf.split_to(n).freeze()
                } else {
                    match self.piece.take() {
                        Some(piece) if !piece.as_ref().is_empty() => Bytes::from_owner(piece),
                        other => {
                            self.piece = other;
                            return Ok(());
                        }
                    }
                };
                let n = data.len();
                let offset = p.offset;
                p.offset += n as u64;
                p.remaining -= n as u64;
                let mode = p.mode;
                if p.remaining == 0 {
                    self.payload = None;
                }
                out.push(match mode {
                    Mode::Stage { stream } => Parsed::Piece { stream, offset, data },
                    Mode::Discard => Parsed::Discarded { bytes: n as u64, deferred: false },
                    Mode::Deferred { keep: true } => Parsed::StagedDeferred(data),
                    Mode::Deferred { keep: false } => {
                        Parsed::Discarded { bytes: n as u64, deferred: true }
                    }
                });
                continue;
            }
            match frame::decode(&self.buf)? {
                Decoded::Frame(Frame::Data { stream, offset, .. }, n) => {
                    let mut whole = self.buf.split_to(n).freeze();
                    whole.advance(DATA_HEADER_LEN);
                    out.push(Parsed::Data { stream, offset, payload: whole });
                }
                Decoded::Frame(f, n) => {
                    let owned = f.into_owned_control();
                    self.buf.advance(n);
                    out.push(Parsed::Control(owned));
                }
                Decoded::PartialData { stream, offset, len } if len >= self.large => {
                    self.buf.advance(DATA_HEADER_LEN);
                    let have = self.buf.len().min(len);
                    let prefix = self.buf.split_to(have).freeze();
                    let rest = (len - have) as u64;
                    self.pending = Some((stream, offset + have as u64, rest));
                    out.push(Parsed::Header { stream, offset, len: len as u64, prefix });
                }
                Decoded::PartialData { .. } | Decoded::Incomplete { .. } => return Ok(()),
            }
        }
        Ok(())
    }

    /// The session's verdict on the last `Header`. After a deferral the reader reads one
    /// header at a time (the next large payload is likely deferred too, and must not be
    /// half-read into the staging buffer); otherwise it reads as much as it can.
    pub fn verdict(&mut self, v: Verdict) {
        let Some((stream, offset, remaining)) = self.pending.take() else { return };
        self.defer_score = match v {
            Verdict::Defer => (self.defer_score + 2).min(8),
            _ => self.defer_score.saturating_sub(1),
        };
        if remaining == 0 {
            return;
        }
        match v {
            Verdict::Defer => self.deferred = true,
            Verdict::Stage => {
                self.payload = Some(Payload { mode: Mode::Stage { stream }, offset, remaining })
            }
            Verdict::Discard => {
                self.payload = Some(Payload { mode: Mode::Discard, offset, remaining })
            }
        }
    }

    /// The deferred payload was read by its stream's reader: go on with the next frame.
    pub fn resume(&mut self) {
        self.deferred = false;
    }

    /// The engine reads the rest of the deferred payload itself (`remaining` bytes), staging
    /// it for its stream (`keep`) or dropping it.
    pub fn take_over_deferred(&mut self, remaining: u64, keep: bool) {
        if !self.deferred {
            return;
        }
        self.deferred = false;
        if remaining > 0 {
            self.payload = Some(Payload { mode: Mode::Deferred { keep }, offset: 0, remaining });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Class;

    fn feed(r: &mut FrameReader, bytes: &[u8]) {
        r.buffer(bytes.len()).extend_from_slice(bytes);
    }

    #[test]
    fn reads_start_at_the_front_once_every_slice_is_read() {
        let mut frame = Vec::new();
        Frame::Data { stream: 1, offset: 0, payload: &[5u8; 4000] }.encode(&mut frame);
        let mut r = FrameReader::new(1 << 20, Heap(1000));
        let front = r.buffer(READ_SIZE).as_ptr();
        let mut out = Vec::new();
        for round in 0..3 {
            feed(&mut r, &frame);
            r.parse(&mut out, usize::MAX).unwrap();
            assert_eq!(out.len(), 1, "round {round}");
            // The payload is still held: the next read goes after it, not over it.
            let b = r.buffer(READ_SIZE);
            assert_eq!(b.as_ptr(), front.wrapping_add(frame.len()), "round {round}");
            out.clear();
            // Read: the next read starts at the front again (a channel of small messages
            // keeps touching the same first pages).
            assert_eq!(r.buffer(READ_SIZE).as_ptr(), front, "round {round}");
        }
    }

    #[test]
    fn small_frames_parse_in_place_and_large_payloads_wait_for_a_verdict() {
        let mut wire = Vec::new();
        Frame::Syn { src: 1, port: 2, class: Class::Latency, window: 3 }.encode(&mut wire);
        Frame::Data { stream: 5, offset: 0, payload: b"small" }.encode(&mut wire);
        let big = vec![7u8; 1000];
        Frame::Data { stream: 5, offset: 5, payload: &big }.encode(&mut wire);
        Frame::Fin { dst: 5, final_offset: 1005 }.encode(&mut wire);
        let header_end = 20 + 29 + DATA_HEADER_LEN;

        let mut r = FrameReader::new(100, Heap(1000));
        feed(&mut r, &wire[..header_end + 10]);
        let mut out = Vec::new();
        r.parse(&mut out, 64).unwrap();
        assert!(matches!(out[0], Parsed::Control(Frame::Syn { src: 1, .. })));
        assert!(matches!(&out[1], Parsed::Data { payload, .. } if &payload[..] == b"small"));
        assert!(
            matches!(&out[2], Parsed::Header { stream: 5, offset: 5, len: 1000, prefix } if prefix.len() == 10)
        );
        assert_eq!(r.want(), 0, "no read before the verdict");
        r.defer_score = 8;
        r.verdict(Verdict::Stage);
        assert_eq!(r.want(), 990, "payloads were deferred lately: the next one may be too");
        r.defer_score = 0;
        assert_eq!(r.want(), READ_SIZE, "mostly staged: read the payload with what follows");
        feed(&mut r, &wire[header_end + 10..]);
        out.clear();
        r.parse(&mut out, 64).unwrap();
        assert!(
            matches!(&out[0], Parsed::Piece { stream: 5, offset: 15, data } if data.len() == 990)
        );
        assert!(matches!(out[1], Parsed::Control(Frame::Fin { .. })));
    }

    #[test]
    fn deferred_payloads_stop_the_reader_until_resumed() {
        let mut r = FrameReader::new(100, Heap(1000));
        feed(&mut r, &frame::data_header(9, 0, 500));
        let mut out = Vec::new();
        r.parse(&mut out, 64).unwrap();
        assert!(matches!(&out[0], Parsed::Header { prefix, .. } if prefix.is_empty()));
        r.verdict(Verdict::Defer);
        assert_eq!(r.want(), 0);
        r.resume();
        r.defer_score = 8;
        assert_eq!(r.want(), DATA_HEADER_LEN, "payloads are deferred: one header at a time");
        r.take_over_deferred(5, true); // not deferred any more: ignored
        assert_eq!(r.want(), DATA_HEADER_LEN);
    }

    #[test]
    fn garbage_is_an_error() {
        let mut r = FrameReader::new(100, Heap(1000));
        feed(&mut r, &[0xEE; 30]);
        assert_eq!(r.parse(&mut Vec::new(), 8), Err(WireError::UnknownType(0xEE)));
    }
}
