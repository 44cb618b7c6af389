//! The data path's byte copies, around a slow case of the C library's `memcpy`.
//!
//! glibc 2.33 to 2.38 copy blocks of about 2 KiB and more with `rep movsb`, and on AMD Zen 3
//! and Zen 4 that instruction runs more than ten times slower when the destination lies a few
//! bytes above the source modulo a 4 KiB page (glibc bug 30994, fixed in 2.39 by not using it
//! there). On one of the 2-core machines this project is measured on (AMD EPYC, Zen 3, Debian
//! 12's glibc 2.36): 2 GB/s against 35 GB/s for 64 KiB (docs/BENCHMARKS.md, "A slow memcpy"). The
//! engine copies every byte twice in user space (into the send buffer, out of a staged read),
//! between buffers whose addresses it does not choose, so a share of its copies fell in that
//! case. Such a pair is copied here in pieces below the size where glibc switches to
//! `rep movsb`, which it copies with vector moves at full speed whatever the distance.
//!
//! Only where the slow case exists: the pieces cost a quarter of the copy's speed on a CPU
//! without it (an Intel Xeon of this class: 64 KiB in 2 KiB pieces 13.6 GB/s, in one call
//! 17.9 at any distance; docs/BENCHMARKS.md, "An Intel machine"). AMD's CPUs (and Hygon's,
//! Zen underneath) are told apart by SSE4a, an AMD extension no Intel CPU has, which the
//! standard library detects once and caches; the C library's version is not asked (this layer
//! makes no calls into it), so an AMD machine with glibc 2.39 or later still copies such pairs
//! in pieces, at about four fifths of full speed (29 against 36 GB/s on the machine of "A slow
//! memcpy").
//!
//! The kernel's copies from a socket into a channel's read buffer have the same slow case, and
//! there the engine chooses the destination: an empty read buffer starts its reads clear of
//! it (`clear_of_page_start`).

use bytes::BytesMut;

/// Destinations this close above their source (modulo a page) are the slow case. The
/// measured penalty is largest below 32 bytes and gone at 64.
const NEAR: usize = 64;
const PAGE: usize = 4096;
/// The pieces: below glibc's smallest `rep movsb` threshold on machines with AVX2 (2,112
/// bytes with fast short `rep movsb`, 4,096 without).
const PIECE: usize = 2048;

/// Whether copying `len` bytes from `src` to `dst` (addresses) would hit the slow case.
fn near_above(dst: usize, src: usize, len: usize) -> bool {
    let distance = dst.wrapping_sub(src) % PAGE;
    len > PIECE && distance != 0 && distance < NEAR
}

/// Whether a copy of `len` bytes from `src` to `dst` goes in pieces here.
fn split(dst: usize, src: usize, len: usize) -> bool {
    near_above(dst, src, len) && slow_case_here()
}

/// Whether this CPU's `rep movsb` has the slow case: an AMD (or Hygon) CPU.
fn slow_case_here() -> bool {
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    {
        std::is_x86_feature_detected!("sse4a")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "x86")))]
    {
        false
    }
}

/// `dst.copy_from_slice(src)` (the lengths must be equal).
pub fn copy(dst: &mut [u8], src: &[u8]) {
    copy_in_pieces_if(split(dst.as_ptr().addr(), src.as_ptr().addr(), src.len()), dst, src);
}

fn copy_in_pieces_if(pieces: bool, dst: &mut [u8], src: &[u8]) {
    if pieces {
        assert_eq!(dst.len(), src.len(), "copy: lengths differ");
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
    } else {
        dst.copy_from_slice(src);
    }
}

/// A buffer that bytes are appended to.
pub trait Append {
    /// Makes room for `additional` more bytes; returns the address they will be written at.
    fn room_for(&mut self, additional: usize) -> usize;
    /// Appends `data` (room was made).
    fn append(&mut self, data: &[u8]);
}

impl Append for BytesMut {
    fn room_for(&mut self, additional: usize) -> usize {
        self.reserve(additional);
        self.as_ptr().addr() + self.len()
    }

    fn append(&mut self, data: &[u8]) {
        self.extend_from_slice(data);
    }
}

impl Append for Vec<u8> {
    fn room_for(&mut self, additional: usize) -> usize {
        self.reserve(additional);
        self.as_ptr().addr() + self.len()
    }

    fn append(&mut self, data: &[u8]) {
        self.extend_from_slice(data);
    }
}

/// `buf.extend_from_slice(data)`.
pub fn extend<B: Append>(buf: &mut B, data: &[u8]) {
    let at = buf.room_for(data.len());
    extend_in_pieces_if(split(at, data.as_ptr().addr(), data.len()), buf, data);
}

fn extend_in_pieces_if<B: Append>(pieces: bool, buf: &mut B, data: &[u8]) {
    if pieces {
        for piece in data.chunks(PIECE) {
            buf.append(piece);
        }
    } else {
        buf.append(data);
    }
}

/// Moves the start of an empty read buffer out of the slow case for the kernel's copies into
/// it. The kernel copies socket bytes to user space with `rep movsb` as well, and is as slow
/// when the destination lies just above the source modulo a page. A channel's peer usually
/// writes each message from the start of a page of its socket memory (the kernel starts its
/// page over once the reader has emptied it), and a read buffer from `malloc` starts 16 bytes
/// into a page: every read at the buffer's front was in the slow case. Measured with memcached
/// as the server: its `_copy_to_iter` took 1.0 us a key, 0.2-0.34 with this, 0.18-0.27 on kernel
/// TCP (docs/BENCHMARKS.md, "The kernel's copies are slow at the same distance"). At most
/// `NEAR - 1` bytes of the buffer are given up.
pub fn clear_of_page_start(buf: &mut BytesMut) {
    use bytes::Buf;
    let at = buf.as_ptr().addr() % PAGE;
    if buf.is_empty() && at != 0 && at < NEAR && buf.capacity() > 2 * NEAR {
        let skip = NEAR - at;
        buf.resize(skip, 0);
        buf.advance(skip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes of `pool` (numbered, so that a byte out of place shows) starting `distance`
    /// bytes below `dst` modulo a page: a source whose copy to `dst` is at that distance.
    fn source_at(pool: &mut [u8], dst: usize, distance: usize, len: usize) -> &[u8] {
        let at = (dst.wrapping_sub(distance).wrapping_sub(pool.as_ptr().addr())) % PAGE;
        for (i, b) in pool.iter_mut().enumerate() {
            *b = (i * 7 + i / 251) as u8;
        }
        let src = &pool[at..at + len];
        assert_eq!(dst.wrapping_sub(src.as_ptr().addr()) % PAGE, distance);
        src
    }

    /// An empty buffer of `cap` bytes whose front is `at` bytes into a page.
    fn buffer_at(at: usize, cap: usize) -> BytesMut {
        use bytes::Buf;
        let mut b = BytesMut::with_capacity(cap + PAGE);
        let skip = (at + PAGE - b.as_ptr().addr() % PAGE) % PAGE;
        b.resize(skip, 0);
        b.advance(skip);
        assert_eq!(b.as_ptr().addr() % PAGE, at);
        b
    }

    #[test]
    fn an_empty_buffer_starting_just_past_a_page_start_moves_clear_of_it() {
        for at in [1, 16, 24, 63] {
            let mut b = buffer_at(at, 4 * PAGE);
            let room = b.capacity();
            clear_of_page_start(&mut b);
            assert_eq!(b.as_ptr().addr() % PAGE, NEAR, "from {at}");
            assert!(b.is_empty());
            assert_eq!(room - b.capacity(), NEAR - at, "only the skipped bytes are given up");
            b.extend_from_slice(b"still a buffer");
            assert_eq!(&b[..], b"still a buffer");
        }
        for at in [0, 64, 100, 4095] {
            let mut b = buffer_at(at, 4 * PAGE);
            clear_of_page_start(&mut b);
            assert_eq!(b.as_ptr().addr() % PAGE, at, "{at} is not the slow case");
        }
        let mut b = buffer_at(16, 4 * PAGE);
        b.extend_from_slice(b"unparsed");
        clear_of_page_start(&mut b);
        assert_eq!(&b[..], b"unparsed", "a buffer holding bytes is left where it is");
    }

    #[test]
    fn pairs_are_split_on_amd_cpus_only() {
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let Some(vendor) = cpuinfo.lines().find_map(|l| l.strip_prefix("vendor_id")) else {
            return; // not x86
        };
        let vendor = vendor.trim_start_matches([' ', '\t', ':']).trim();
        let amd = vendor == "AuthenticAMD" || vendor == "HygonGenuine";
        // A hypervisor may hide SSE4a from an AMD guest (then it copies in one call, as
        // before the workaround); it cannot show it on an Intel CPU.
        let shown = cpuinfo
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "sse4a"));
        assert_eq!(slow_case_here(), amd && shown, "{vendor}, sse4a shown: {shown}");
        assert!(amd || !shown, "SSE4a on a {vendor} CPU");
        assert_eq!(split(0x10010, 0x10000, PIECE + 1), amd && shown);
        assert!(!split(0x10040, 0x10000, PIECE + 1));
    }

    #[test]
    fn only_destinations_just_above_their_source_modulo_a_page_are_split() {
        let big = PIECE + 1;
        assert!(near_above(0x10010, 0x10000, big));
        assert!(near_above(0x23001, 0x10000, big), "distance 0x13001: 1 modulo a page");
        assert!(!near_above(0x10000, 0x10000, big), "same offset in the page");
        assert!(!near_above(0x10040, 0x10000, big), "64 bytes above");
        assert!(!near_above(0x10000, 0x10010, big), "below the source");
        assert!(!near_above(0x10010, 0x10000, PIECE), "small copies are one piece anyway");
    }

    #[test]
    fn copies_and_appends_every_byte_in_order_whatever_the_distance() {
        let len = 3 * PIECE + 123;
        let mut pool = vec![0u8; len + PAGE];
        for distance in [0, 1, 16, 63, 64, 1000] {
            let mut d = vec![0u8; len];
            let src = source_at(&mut pool, d.as_ptr().addr(), distance, len);
            assert_eq!(
                near_above(d.as_ptr().addr(), src.as_ptr().addr(), len),
                distance % 64 != 0 && distance < 64
            );
            copy(&mut d, src);
            assert_eq!(d, src, "copy at distance {distance}");

            let mut v = vec![0u8; 10];
            v.reserve(len);
            let at = v.as_ptr().addr() + v.len();
            let src = source_at(&mut pool, at, distance, len);
            extend(&mut v, src);
            assert_eq!(&v[10..], src, "extend of a Vec at distance {distance}");

            let mut b = BytesMut::with_capacity(len + 5);
            b.extend_from_slice(&[1, 2, 3, 4, 5]);
            let at = b.as_ptr().addr() + b.len();
            let src = source_at(&mut pool, at, distance, len);
            extend(&mut b, src);
            assert_eq!(&b[5..], src, "extend of a BytesMut at distance {distance}");
        }
        // A buffer that must grow: the distance is the new allocation's.
        let mut v = Vec::new();
        let src = source_at(&mut pool, 0, 0, len);
        extend(&mut v, &src[..10]);
        extend(&mut v, &src[10..]);
        assert_eq!(v, src);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match_as_for_copy_from_slice() {
        let mut pool = vec![0u8; 2 * PAGE];
        let mut d = vec![0u8; PIECE + 10];
        let src = source_at(&mut pool, d.as_ptr().addr(), 16, PIECE + 11);
        copy_in_pieces_if(true, &mut d, src);
    }

    #[test]
    fn pieces_copy_and_append_every_byte_in_order_on_any_cpu() {
        let len = 3 * PIECE + 123;
        let mut pool = vec![0u8; len + PAGE];
        let mut d = vec![0u8; len];
        let src = source_at(&mut pool, d.as_ptr().addr(), 16, len);
        copy_in_pieces_if(true, &mut d, src);
        assert_eq!(d, src);
        let mut b = BytesMut::with_capacity(7);
        b.extend_from_slice(b"front");
        extend_in_pieces_if(true, &mut b, src);
        assert_eq!(&b[..5], b"front");
        assert_eq!(&b[5..], src, "a buffer that grows while it is appended to in pieces");
    }
}
