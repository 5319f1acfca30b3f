//! The vector operations the quantized kernels are written in, one lane per weight row.
//!
//! A tile is `N` consecutive weight rows (16 for AVX-512, 8 for AVX2 and scalar, 4 for
//! NEON). Lane `i` of every vector belongs to row `i`, so a tile's unpacked weights for
//! four consecutive elements sit in one 32-bit lane, the activation's matching four
//! bytes are broadcast to all lanes, and one `vpdpbusd` advances all `N` rows at once.
//! Scales are per row, hence per lane, and a finished tile is `N` output values that
//! are stored without any horizontal sum.
//!
//! Weights reach the lanes through a transpose: each row's next `WIN` bytes (a whole
//! 64-byte cache line on AVX-512) are loaded and transposed so that vector `j` holds
//! bytes `4j..4j + 4` of every row (`seg.rs`). Reading whole lines per row matters:
//! sixteen rows read a few bytes at a time in lockstep run at about 60% of the
//! memory bandwidth that the same rows read a line at a time get.
//!
//! Every implementation computes the same integers exactly and the same float
//! operations lane by lane (convert, multiply, fused multiply-add), so all ISAs give
//! bitwise the same results.

/// A tile of weight rows: row `i` starts at `base + offs[i]` and holds `bytes` bytes.
/// Rows past the end of the matrix repeat its last row (their results are never
/// stored).
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub base: *const u8,
    pub offs: [usize; 16],
    /// Rows of the tile that exist.
    pub valid: usize,
    /// Bytes per row.
    pub bytes: usize,
    /// Bytes that may be read from the start of every row: to the end of the
    /// matrix data for its last row. Reading past a row's own end into the next
    /// row is harmless (those bytes are never used); past the data, it may fault.
    pub readable: usize,
}

impl Tile {
    /// Rows `first..first + lanes` of a matrix whose rows are `row_bytes` apart,
    /// clamped to `rows`.
    pub fn new(data: &[u8], row_bytes: usize, rows: usize, first: usize, lanes: usize) -> Tile {
        debug_assert!(first < rows && lanes <= 16);
        let valid = (rows - first).min(lanes);
        let mut offs = [0; 16];
        for (i, o) in offs.iter_mut().enumerate() {
            *o = i.min(valid - 1) * row_bytes;
        }
        let readable = data.len() - (first + valid - 1) * row_bytes;
        Tile { base: data[first * row_bytes..].as_ptr(), offs, valid, bytes: row_bytes, readable }
    }

    #[inline(always)]
    pub fn row(&self, i: usize) -> *const u8 {
        unsafe { self.base.add(self.offs[i]) }
    }
}

/// One ISA's lanes. `I` holds `N` 32-bit integer lanes (often viewed as four bytes
/// each), `F` holds `N` f32 lanes.
///
/// Safety: every function is `unsafe` because it may use instructions the CPU must
/// have; callers run them inside a function compiled for that ISA's features.
pub(crate) trait Lanes: Copy {
    const N: usize;
    type I: Copy;
    type F: Copy;

    /// Bytes of each row one [`Lanes::transpose`] reads.
    const WIN: usize;

    /// Most tokens one straight pass over a tile carries (decode of a few sequences,
    /// an expert's rows), each with its accumulators in registers. Four fit sixteen
    /// registers; AVX-512 overrides it with eight.
    const DIRECT_GROUP: usize = 4;

    /// Reads `WIN` bytes at `row(i) + off` of every row (all in bounds) and writes
    /// `WIN / 4` vectors to `out`: `out[j]` lane `i` is bytes `4j..4j + 4` of row `i`'s.
    unsafe fn transpose(t: &Tile, off: usize, out: *mut Self::I);

    unsafe fn splat(v: u32) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn xor(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn add(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn srli<const S: u32>(a: Self::I) -> Self::I;
    unsafe fn slli<const S: u32>(a: Self::I) -> Self::I;
    unsafe fn srai<const S: u32>(a: Self::I) -> Self::I;
    /// Logical shifts by a run-time count (< 32).
    unsafe fn srl(a: Self::I, s: u32) -> Self::I;
    unsafe fn sll(a: Self::I, s: u32) -> Self::I;
    /// Bytewise table lookup: each byte (all < 16) is replaced by `table[byte]`.
    unsafe fn lut16(a: Self::I, table: &[u8; 16]) -> Self::I;

    /// `acc + sum over the four bytes j of w.byte[j] (unsigned) * x.byte[j] (signed)`,
    /// with `x` broadcast. The weight bytes are below 128 (`vpmaddubsw` cannot overflow).
    unsafe fn dpbusd(acc: Self::I, w: Self::I, x: u32) -> Self::I;
    /// As [`Lanes::dpbusd`] for weight bytes of any value.
    unsafe fn dpbusd_full(acc: Self::I, w: Self::I, x: u32) -> Self::I;
    /// `acc` plus four [`Lanes::dpbusd`] (`w[k]` against `x[k]`; [`Lanes::dpbusd_full`]
    /// if `MAX > 127`), where `MAX` is the largest value a weight byte can take. The
    /// sum is exact, so an ISA may group the products as it likes: AVX2 without VNNI,
    /// whose byte products are 16 bits wide, adds as many as `MAX` lets fit in 16 bits
    /// before widening them.
    #[inline(always)]
    unsafe fn dpbusd4<const MAX: u32>(acc: Self::I, w: [Self::I; 4], x: [u32; 4]) -> Self::I {
        unsafe {
            let mut acc = acc;
            for k in 0..4 {
                acc = if MAX > 127 { Self::dpbusd_full(acc, w[k], x[k]) } else { Self::dpbusd(acc, w[k], x[k]) };
            }
            acc
        }
    }

    unsafe fn zero_f() -> Self::F;
    unsafe fn splat_f(v: f32) -> Self::F;
    /// Signed integer to f32, rounding to nearest even.
    unsafe fn cvt(a: Self::I) -> Self::F;
    /// The low 16 bits of each lane as an IEEE half, converted exactly.
    unsafe fn f16_lo(a: Self::I) -> Self::F;
    /// The lanes' bits as f32.
    unsafe fn bits_f(a: Self::I) -> Self::F;
    unsafe fn mul_f(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c`, rounded once.
    unsafe fn fma_f(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Stores the first `valid` lanes to `out[0..valid]`.
    unsafe fn store(v: Self::F, out: *mut f32, valid: usize);

    /// Hints that the cache line at `p` will be read soon (never faults). No-op where
    /// the ISA has no stable prefetch intrinsic.
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    /// As [`Lanes::prefetch`], into L2 only (for data needed later, so it does not
    /// push the current working set out of L1).
    #[inline(always)]
    unsafe fn prefetch_l2(_p: *const u8) {}
}

/// Bit 4 of bytes 0..4 from bits 0..4 of each lane (the fifth bit of four Q5
/// elements). Shifts rather than a multiply, which is slow on some CPUs.
#[inline(always)]
pub(crate) unsafe fn spread4_bit4<S: Lanes>(v: S::I) -> S::I {
    unsafe {
        let t = S::and(v, S::splat(0xF));
        let t = S::and(S::or(t, S::slli::<14>(t)), S::splat(0x0003_0003));
        let t = S::and(S::or(t, S::slli::<7>(t)), S::splat(0x0101_0101));
        S::slli::<4>(t)
    }
}

/// Reads the four activation bytes at `p` as one little-endian word.
#[inline(always)]
pub(crate) unsafe fn word(p: *const i8) -> u32 {
    unsafe { u32::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 4])) }
}
