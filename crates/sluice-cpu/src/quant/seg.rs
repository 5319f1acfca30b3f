//! A segment of a tile's rows, transposed so that formats read row fields as lanes.
//!
//! The kernels read a tile a segment at a time: a run of whole units (blocks or
//! super-blocks) of every row, read a window (`Lanes::WIN` bytes, a cache line on
//! AVX-512) per row at a time and transposed into an L1-resident buffer where
//! vector `j` holds bytes `4j..4j + 4` of the segment in every row. A format then
//! asks for "the four bytes at offset `o`" and gets them for all rows at once; at an
//! offset that is not a multiple of four (Q4_0's 18-byte blocks, say) the word is
//! funnel-shifted out of two neighbours.

use std::mem::MaybeUninit;

use super::lanes::{Lanes, Tile};

/// Bytes of one segment buffer (on the stack; decode keeps two).
const BUF_BYTES: usize = 8 << 10;

#[repr(C, align(64))]
pub(crate) struct SegBuf(MaybeUninit<[u8; BUF_BYTES]>);

impl SegBuf {
    pub fn new() -> SegBuf {
        SegBuf(MaybeUninit::uninit())
    }
}

/// Whole units per segment for units of `unit_bytes`: as many as the buffer holds,
/// keeping one window and one word spare for the funnel shifts at the end.
pub(crate) fn units_per_segment<S: Lanes>(unit_bytes: usize) -> usize {
    let row_capacity = BUF_BYTES / size_of::<S::I>() * 4;
    ((row_capacity - S::WIN - 4) / unit_bytes).max(1)
}

/// A filled segment: the transposed words of `bytes` bytes of each row.
pub(crate) struct Seg<S: Lanes> {
    words: *const S::I,
}

impl<S: Lanes> Seg<S> {
    /// Windows that hold `len` bytes and the spare word after them (so a funnel
    /// shift at the end reads defined data).
    pub fn windows(len: usize) -> usize {
        (len + 4).div_ceil(S::WIN)
    }

    /// Transposes bytes `start..start + len` of each row of `t` into `buf`
    /// (`len` at most what [`units_per_segment`] allows).
    #[inline(always)]
    pub unsafe fn fill(t: &Tile, start: usize, len: usize, buf: &mut SegBuf) -> Seg<S> {
        unsafe {
            for w in 0..Self::windows(len) {
                Self::fill_window(t, start, w, buf);
            }
            Self::view(buf)
        }
    }

    /// Transposes window `w` of the segment that starts at byte `start` into `buf`.
    #[inline(always)]
    pub unsafe fn fill_window(t: &Tile, start: usize, w: usize, buf: &mut SegBuf) {
        unsafe {
            debug_assert!((w + 1) * S::WIN <= BUF_BYTES / size_of::<S::I>() * 4);
            let out = (buf.0.as_mut_ptr() as *mut S::I).add(w * (S::WIN / 4));
            let off = start + w * S::WIN;
            if off + S::WIN <= t.readable {
                S::transpose(t, off, out);
            } else {
                // The window runs past the end of the matrix data: copy what is
                // there, zero-padded.
                tail_window::<S>(t, off, out);
            }
        }
    }

    /// The segment already transposed into `buf`.
    pub fn view(buf: &SegBuf) -> Seg<S> {
        Seg { words: buf.0.as_ptr() as *const S::I }
    }

    /// The four bytes at offset `off` of the segment, of every row.
    #[inline(always)]
    pub unsafe fn word(&self, off: usize) -> S::I {
        unsafe {
            let (q, r) = (off / 4, (off % 4) as u32);
            let lo = *self.words.add(q);
            if r == 0 { lo } else { S::or(S::srl(lo, 8 * r), S::sll(*self.words.add(q + 1), 32 - 8 * r)) }
        }
    }

    /// The sixteen bytes at `off` as four words.
    #[inline(always)]
    pub unsafe fn t4(&self, off: usize) -> [S::I; 4] {
        unsafe { [self.word(off), self.word(off + 4), self.word(off + 8), self.word(off + 12)] }
    }
}

#[inline(always)]
unsafe fn tail_window<S: Lanes>(t: &Tile, off: usize, out: *mut S::I) {
    let mut tmp = [[0u8; 64]; 16];
    let have = t.bytes.min(t.readable).saturating_sub(off).min(S::WIN);
    if have > 0 {
        for (i, row) in tmp.iter_mut().enumerate().take(S::N) {
            unsafe { std::ptr::copy_nonoverlapping(t.row(i).add(off), row.as_mut_ptr(), have) };
        }
    }
    let mut offs = [0; 16];
    for (i, o) in offs.iter_mut().enumerate() {
        *o = 64 * i;
    }
    let padded = Tile { base: tmp.as_ptr() as *const u8, offs, valid: t.valid, bytes: 64, readable: 64 };
    unsafe { S::transpose(&padded, 0, out) };
}
