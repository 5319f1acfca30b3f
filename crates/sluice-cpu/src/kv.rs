//! KV caches: one layer's keys and values, in f32 or in a narrower format
//! ([`KvFormat`]: f16, 8-bit, TurboQuant at 2 to 4 bits).
//!
//! An f32 cache hands out its rows as slices. A coded cache stores each head of each
//! position as bytes and decodes one head's row at a time into the caller's buffer
//! ([`KvCache::key_into`]), so attention reads the codes and never expands the cache.
//!
//! TurboQuant (Zandieh et al.): each head is cut into power-of-two blocks; a block `y`
//! is stored as its norm (f16) and the codes of `H D y / |y|`, `D` random signs fixed
//! per layer and head, `H` the normalised Walsh-Hadamard transform. A rotated unit vector's
//! coordinates follow one known distribution (density proportional to (1 - x^2)^((b-3)/2)
//! for a block of b), so one Lloyd-Max codebook per width serves every layer. The cache
//! decodes rows in the rotated basis: attention rotates the query once, scores
//! against rotated keys (the rotation keeps dot products), sums rotated values and
//! rotates the sum back once.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use half::f16;
use half::slice::HalfFloatSliceExt;
use sluice_core::{Error, ExactRows, KvFormat, KvLayout, Result};

use crate::tile::Lanes;

/// One layer's keys and values, `kv_dim` floats per position. Full-attention layers
/// keep every position; sliding layers keep a ring of the last `window`.
#[derive(Clone, Debug)]
pub struct KvCache {
    kv_dim: usize,
    window: Option<usize>,
    rows: Rows,
    /// Positions written so far; the next one appended is position `len`.
    len: usize,
}

#[derive(Clone, Debug)]
enum Rows {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// `codec.row_bytes()` per position, in blocks of [`BLOCK`] slots: a block holds
    /// head 0's rows of its slots, then head 1's, and so on ([`Codec::head_at`]).
    Coded {
        codec: Arc<Codec>,
        k: Vec<u8>,
        v: Vec<u8>,
        /// TurboQuant's positions also kept as computed, if any.
        exact: Option<Box<Exact>>,
    },
}

/// A TurboQuant cache's positions kept as computed ([`ExactRows`]), in 16 bits (what
/// the default cache keeps) and in the codec's basis (keys moved and rotated like the
/// codes, values rotated), so that attention reads them with the query it scores the
/// codes with.
#[derive(Clone, Debug)]
struct Exact {
    rows: ExactRows,
    /// The sequence's first `rows.sinks` positions.
    sinks: KvCache,
    /// A ring of the last `rows.recent` positions (at least one, so that sinks alone
    /// need no case of their own); every position in a chunk's own cache.
    recent: KvCache,
}

impl Exact {
    fn new(codec: &Codec, rows: ExactRows) -> Result<Box<Exact>> {
        let (sinks, recent) = (Exact::half(codec, None)?, Exact::half(codec, Some(rows.recent.max(1)))?);
        Ok(Box::new(Exact { rows, sinks, recent }))
    }

    /// A 16-bit cache of the codec's heads.
    fn half(codec: &Codec, window: Option<usize>) -> Result<KvCache> {
        let (head_dim, kv_dim) = (codec.head_dim, codec.heads * codec.head_dim);
        KvCache::with_layout(&KvLayout { window, ..KvLayout::plain(kv_dim, head_dim, KvFormat::F16) })
    }
}

/// Which of a position's rows.
#[derive(Clone, Copy)]
enum Side {
    Keys,
    Values,
}

/// Slots per block of a coded cache. Attention reads tiles of this many positions
/// (aligned to it), so that a tile of one head is one run of bytes in memory: the
/// hardware's prefetchers follow it, and a 16-bit tile converts in one call (decode at
/// 8k positions spent a quarter of its time fetching rows 512 bytes apart, a head's
/// 256 at a time).
pub const BLOCK: usize = 32;

impl KvCache {
    /// An f32 cache.
    pub fn new(kv_dim: usize, window: Option<usize>) -> Self {
        KvCache { kv_dim, window, rows: Rows::F32 { k: Vec::new(), v: Vec::new() }, len: 0 }
    }

    /// A cache of the layout's format; fails on a head that format cannot code.
    pub fn with_layout(l: &KvLayout) -> Result<Self> {
        let rows = match l.format {
            KvFormat::F32 => Rows::F32 { k: Vec::new(), v: Vec::new() },
            _ => {
                let codec = Arc::new(Codec::new(l)?);
                let exact =
                    (codec.rotates() && l.exact != ExactRows::NONE).then(|| Exact::new(&codec, l.exact)).transpose()?;
                Rows::Coded { codec, k: Vec::new(), v: Vec::new(), exact }
            }
        };
        Ok(KvCache { kv_dim: l.kv_dim, window: l.window, rows, len: 0 })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Oldest position still held.
    pub fn first(&self) -> usize {
        self.window.map_or(0, |w| self.len.saturating_sub(w))
    }

    pub fn bytes(&self) -> usize {
        match &self.rows {
            Rows::F32 { k, v } => (k.capacity() + v.capacity()) * 4,
            Rows::Coded { k, v, exact, .. } => {
                k.capacity() + v.capacity() + exact.as_ref().map_or(0, |e| e.sinks.bytes() + e.recent.bytes())
            }
        }
    }

    /// Bytes one position takes (keys and values).
    pub fn bytes_per_position(&self) -> usize {
        2 * match &self.rows {
            Rows::F32 { .. } => 4 * self.kv_dim,
            Rows::Coded { codec, .. } => codec.row_bytes(),
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
        if let Rows::Coded { exact: Some(e), .. } = &mut self.rows {
            e.sinks.clear();
            e.recent.clear();
        }
    }

    /// The codec of a coded cache; `None` for f32, whose rows [`KvCache::key`] gives.
    pub fn codec(&self) -> Option<&Codec> {
        match &self.rows {
            Rows::F32 { .. } => None,
            Rows::Coded { codec, .. } => Some(codec),
        }
    }

    /// The positions this cache keeps as computed beside their codes (none but in a
    /// TurboQuant cache).
    pub fn exact_rows(&self) -> ExactRows {
        match &self.rows {
            Rows::Coded { exact: Some(e), .. } => e.rows,
            _ => ExactRows::NONE,
        }
    }

    /// Head `head` of position `pos`'s key and value as computed, in the codec's basis
    /// (as [`KvCache::key_into`] decodes them), for a position [`ExactRows`] keeps
    /// (`pos` among the first `sinks`, or among the last `recent` held).
    pub fn exact_into(&self, pos: usize, head: usize, k: &mut [f32], v: &mut [f32]) {
        let Rows::Coded { exact: Some(e), .. } = &self.rows else { panic!("KvCache::exact_into: no exact rows") };
        let c = if pos < e.sinks.len() { &e.sinks } else { &e.recent };
        c.key_into(pos, head, k);
        c.value_into(pos, head, v);
    }

    /// Asks the CPU to start reading head `head` of position `pos` (keys and values)
    /// into its caches, if a coded cache holds it: attention asks for the next tile's rows
    /// while it scores the current one, so that a long cache streams from memory
    /// without the core waiting at each tile's start.
    pub fn prefetch(&self, pos: usize, head: usize) {
        if pos < self.first() || pos >= self.len {
            return;
        }
        // (an f32 cache is the exact references' and the tests', not worth the lines)
        let Rows::Coded { codec, k, v, .. } = &self.rows else { return };
        let (at, bytes) = (codec.head_at(self.slot(pos), head), codec.head_bytes);
        #[cfg(target_arch = "x86_64")]
        for line in (0..bytes).step_by(64) {
            // Safety: `at + line` lies inside both buffers (the position is held), and
            // a prefetch reads nothing the program sees.
            unsafe {
                use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
                _mm_prefetch::<_MM_HINT_T0>(k.as_ptr().add(at + line) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().add(at + line) as *const i8);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (k, v, at, bytes);
    }

    fn slot(&self, pos: usize) -> usize {
        self.window.map_or(pos, |w| pos % w)
    }

    /// Position `pos`'s keys, of an f32 cache.
    pub fn key(&self, pos: usize) -> &[f32] {
        debug_assert!(pos >= self.first() && pos < self.len);
        let s = self.slot(pos) * self.kv_dim;
        match &self.rows {
            Rows::F32 { k, .. } => &k[s..s + self.kv_dim],
            Rows::Coded { .. } => panic!("KvCache::key on a coded cache"),
        }
    }

    /// Position `pos`'s values, of an f32 cache.
    pub fn value(&self, pos: usize) -> &[f32] {
        let s = self.slot(pos) * self.kv_dim;
        match &self.rows {
            Rows::F32 { v, .. } => &v[s..s + self.kv_dim],
            Rows::Coded { .. } => panic!("KvCache::value on a coded cache"),
        }
    }

    /// Head `head` of position `pos`'s key, decoded into `out` (`head_dim`), in the
    /// codec's basis (rotated for TurboQuant), less the codec's [`Codec::key_shift`].
    pub fn key_into(&self, pos: usize, head: usize, out: &mut [f32]) {
        self.decode(pos, head, out, |r| r.0)
    }

    /// Head `head` of position `pos`'s value, as [`KvCache::key_into`].
    pub fn value_into(&self, pos: usize, head: usize, out: &mut [f32]) {
        self.decode(pos, head, out, |r| r.1)
    }

    fn decode<'a>(&'a self, pos: usize, head: usize, out: &mut [f32], side: impl Fn((&'a [u8], &'a [u8])) -> &'a [u8]) {
        debug_assert!(pos >= self.first() && pos < self.len);
        let Rows::Coded { codec, k, v, .. } = &self.rows else { panic!("KvCache::key_into on an f32 cache") };
        let at = codec.head_at(self.slot(pos), head);
        codec.decode(&side((k, v))[at..at + codec.head_bytes], out);
    }

    /// Head `head` of positions `run`, keys into `k` and values into `v` (`head_dim`
    /// each), as [`KvCache::key_into`] and [`KvCache::value_into`] decode them one at a
    /// time; the positions of one block are read as one run of bytes.
    pub fn run_into(&self, run: Range<usize>, head: usize, k: &mut [f32], v: &mut [f32]) {
        self.side_into(run.clone(), head, Side::Keys, k);
        self.side_into(run, head, Side::Values, v);
    }

    /// Head `head` of positions `run`, values only, as [`KvCache::run_into`].
    pub fn values_into(&self, run: Range<usize>, head: usize, v: &mut [f32]) {
        self.side_into(run, head, Side::Values, v)
    }

    fn side_into(&self, run: Range<usize>, head: usize, side: Side, out: &mut [f32]) {
        debug_assert!(run.start >= self.first() && run.end <= self.len);
        let Rows::Coded { codec, k, v, .. } = &self.rows else { panic!("KvCache::run_into on an f32 cache") };
        let (hd, hb) = (codec.head_dim, codec.head_bytes);
        let bytes = match side {
            Side::Keys => k,
            Side::Values => v,
        };
        for (pos, slot, n) in self.block_runs(run.clone()) {
            let (at, o) = (codec.head_at(slot, head), (pos - run.start) * hd);
            codec.decode_rows(&bytes[at..at + n * hb], &mut out[o..o + n * hd]);
        }
    }

    /// Positions `run` cut where a block or a ring's last slot ends, as `(position, its
    /// slot, positions)`: each piece's rows of one head are one run of bytes.
    fn block_runs(&self, run: Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let mut pos = run.start;
        std::iter::from_fn(move || {
            (pos < run.end).then(|| {
                let slot = self.slot(pos);
                let n = (run.end - pos).min(BLOCK - slot % BLOCK).min(self.window.map_or(usize::MAX, |w| w - slot));
                pos += n;
                (pos - n, slot, n)
            })
        })
    }

    /// Whether [`KvCache::key_scores`] reads this cache: TurboQuant on AVX-512.
    pub fn scores_from_codes(&self) -> bool {
        let turbo = matches!(&self.rows, Rows::Coded { codec, .. } if codec.rotates());
        turbo && cfg!(target_arch = "x86_64") && crate::isa() == crate::Isa::Avx512
    }

    /// Every query's score against head `head`'s keys at positions `run`, read straight
    /// from their codes: `out[t * q.width() + i]` for position `run.start + t`, the bits
    /// [`crate::tile::scores`] gives on the keys [`KvCache::run_into`] decodes (the padding
    /// queries score zero). `scratch` holds at least `32 * head_dim` floats. Only where
    /// [`KvCache::scores_from_codes`] says so.
    pub fn key_scores(&self, run: Range<usize>, head: usize, q: &Lanes, out: &mut [f32], scratch: &mut [f32]) {
        assert!(self.scores_from_codes(), "KvCache::key_scores on a cache it cannot read");
        let Rows::Coded { codec, k, .. } = &self.rows else { unreachable!() };
        let (hb, width) = (codec.head_bytes, q.width());
        assert!(
            q.head_dim() == codec.head_dim,
            "key_scores: queries of {} for heads of {}",
            q.head_dim(),
            codec.head_dim
        );
        let split = BlockSplit::new(&codec.books, codec.block);
        for (pos, slot, n) in self.block_runs(run.clone()) {
            let (at, o) = (codec.head_at(slot, head), (pos - run.start) * width);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `scores_from_codes` checked the ISA.
            unsafe {
                x86::key_scores_avx512(
                    [&codec.books[0].table, &codec.books[1].table],
                    (split, hb),
                    (&k[at..at + n * hb], n),
                    q,
                    &mut out[o..o + n * width],
                    scratch,
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (at, o, n, split, hb, k, out.len(), scratch.len());
        }
    }

    /// A cache holding this one's positions `0..keep` (as a ring: the last `window` of
    /// them), or `None` when some of those positions are no longer held (a ring that
    /// has gone round past them, or a TurboQuant cache whose ring of exact positions has).
    /// For a prompt that shares only a prefix with a kept sequence (the same system
    /// prompt, another question).
    pub fn prefix(&self, keep: usize) -> Option<KvCache> {
        let from = self.window.map_or(0, |w| keep.saturating_sub(w));
        if keep > self.len || from < self.first() {
            return None;
        }
        // A ring keeps position `pos` in slot `pos % window` whatever its length, so the
        // slots of positions `from..keep` are the first `min(keep, window)` as they are.
        let slots = self.window.map_or(keep, |w| keep.min(w));
        let rows = match &self.rows {
            Rows::F32 { k, v } => {
                let n = slots * self.kv_dim;
                Rows::F32 { k: k[..n].to_vec(), v: v[..n].to_vec() }
            }
            Rows::Coded { codec, k, v, exact } => {
                // (whole blocks: a block's heads lie apart)
                let n = slots.next_multiple_of(BLOCK) * codec.row_bytes();
                let exact = match exact {
                    Some(e) => Some(Box::new(Exact {
                        rows: e.rows,
                        sinks: e.sinks.prefix(keep.min(e.sinks.len()))?,
                        recent: e.recent.prefix(keep)?,
                    })),
                    None => None,
                };
                Rows::Coded { codec: codec.clone(), k: k[..n].to_vec(), v: v[..n].to_vec(), exact }
            }
        };
        Some(KvCache { kv_dim: self.kv_dim, window: self.window, rows, len: keep })
    }

    /// An empty cache of the same format holding every position it is given (no
    /// ring, and every position also exact where this one keeps some): attention codes
    /// a chunk's own keys and values in it, so that a chunk reads its rows as later
    /// steps will read them from the cache.
    pub fn empty_like(&self) -> KvCache {
        let rows = match &self.rows {
            Rows::F32 { .. } => Rows::F32 { k: Vec::new(), v: Vec::new() },
            Rows::Coded { codec, exact, .. } => {
                // Every position in the ring that holds all, none as sinks.
                let exact = exact.as_ref().map(|e| {
                    let every = Exact::half(codec, None).expect("a codec's heads take a 16-bit cache");
                    Box::new(Exact { rows: ExactRows { sinks: 0, ..e.rows }, sinks: every.clone(), recent: every })
                });
                Rows::Coded { codec: codec.clone(), k: Vec::new(), v: Vec::new(), exact }
            }
        };
        KvCache { kv_dim: self.kv_dim, window: None, rows, len: 0 }
    }

    /// Appends `n` positions (`[n, kv_dim]` each).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let n = k.len() / d;
        assert_eq!(v.len(), n * d);
        // Only the last `window` of a long chunk survive in a ring.
        let skip = self.window.map_or(0, |w| n.saturating_sub(w));
        let held = self.window.map_or(self.len + n, |w| (self.len + n).min(w));
        let slots: Vec<usize> = (skip..n).map(|i| self.slot(self.len + i)).collect();
        match &mut self.rows {
            Rows::F32 { k: ks, v: vs } => {
                if ks.len() < held * d {
                    ks.resize(held * d, 0.0);
                    vs.resize(held * d, 0.0);
                }
                for (i, s) in (skip..n).zip(slots) {
                    ks[s * d..(s + 1) * d].copy_from_slice(&k[i * d..(i + 1) * d]);
                    vs[s * d..(s + 1) * d].copy_from_slice(&v[i * d..(i + 1) * d]);
                }
            }
            Rows::Coded { codec, k: ks, v: vs, exact } => {
                let (rb, hb) = (codec.row_bytes(), codec.head_bytes);
                // (whole blocks: a block's heads lie apart)
                let bytes = held.next_multiple_of(BLOCK) * rb;
                if ks.len() < bytes {
                    ks.resize(bytes, 0);
                    vs.resize(bytes, 0);
                }
                let mut moved = vec![0f32; if codec.moves_keys() { d } else { 0 }];
                let mut row = vec![0u8; rb];
                for (i, s) in (skip..n).zip(slots) {
                    let mut key = &k[i * d..(i + 1) * d];
                    if !moved.is_empty() {
                        moved.copy_from_slice(key);
                        codec.move_key(&mut moved);
                        key = &moved;
                    }
                    for (x, out) in [(key, &mut *ks), (&v[i * d..(i + 1) * d], &mut *vs)] {
                        codec.encode_row(x, &mut row);
                        for (h, bytes) in row.chunks(hb).enumerate() {
                            let at = codec.head_at(s, h);
                            out[at..at + hb].copy_from_slice(bytes);
                        }
                    }
                }
                if let Some(e) = exact {
                    e.append(codec, self.len, k, v);
                }
            }
        }
        self.len += n;
    }
}

impl Exact {
    /// Positions `len..` (`k` and `v` as [`KvCache::append`] takes them) into the
    /// codec's basis: those before `rows.sinks` to the sinks, and as many of the last
    /// as the ring holds to the ring.
    fn append(&mut self, codec: &Codec, len: usize, k: &[f32], v: &[f32]) {
        let d = self.recent.kv_dim;
        let n = k.len() / d;
        let basis = |rows: std::ops::Range<usize>| {
            let (mut tk, mut tv) = (k[rows.start * d..rows.end * d].to_vec(), v[rows.start * d..rows.end * d].to_vec());
            tk.chunks_mut(d).zip(tv.chunks_mut(d)).for_each(|(k, v)| codec.to_basis(k, v));
            (tk, tv)
        };
        let sinks = self.rows.sinks.saturating_sub(len).min(n);
        if sinks > 0 {
            let (tk, tv) = basis(0..sinks);
            self.sinks.append(&tk, &tv);
        }
        // A ring would drop all but its window of a long chunk: only those are taken
        // into the basis, the ring's length moved past the others.
        let from = self.recent.window.map_or(0, |w| n.saturating_sub(w));
        let (tk, tv) = basis(from..n);
        self.recent.len = len + from;
        self.recent.append(&tk, &tv);
    }
}

/// How a coded cache writes and reads one head of one position.
#[derive(Debug)]
pub struct Codec {
    format: KvFormat,
    heads: usize,
    head_dim: usize,
    head_bytes: usize,
    /// TurboQuant's rotation block (a power of two dividing `head_dim`), its random
    /// signs (`heads * head_dim`), and the codebooks of a block's first and second half.
    block: usize,
    signs: Vec<f32>,
    books: [Arc<Codebook>; 2],
    /// [`KvLayout::key_shift`] (`kv_dim`, in the keys' own basis), empty for none.
    key_shift: Vec<f32>,
    /// [`KvLayout::key_scale`] (`kv_dim`), empty for none and in all but TurboQuant.
    key_scale: Vec<f32>,
}

impl Codec {
    pub fn new(l: &KvLayout) -> Result<Codec> {
        let hd = l.head_dim;
        if hd == 0 || !l.kv_dim.is_multiple_of(hd) {
            return Err(Error::Usage(format!("a KV cache of {} floats per position in heads of {hd}", l.kv_dim)));
        }
        let heads = l.kv_dim / hd;
        // The largest power of two that divides the head (a head of 576 = 9 x 64 rotates
        // in blocks of 64).
        let block = 1usize << hd.trailing_zeros().min(10);
        let (head_bytes, books) = match l.format {
            KvFormat::F32 => unreachable!("an f32 cache has no codec"),
            KvFormat::F16 => (2 * hd, [Codebook::empty(), Codebook::empty()]),
            KvFormat::Q8 => (4 + hd, [Codebook::empty(), Codebook::empty()]),
            KvFormat::Turbo(bits) => {
                if block < 16 {
                    return Err(Error::Unsupported(format!(
                        "--kv-bits {}: TurboQuant rotates heads in power-of-two blocks of at least 16, \
                         and a head of {hd} has none",
                        l.format
                    )));
                }
                let code_bits: u32 = (0..block).map(|i| bits.of(i, block)).sum();
                let per_block = 2 + (code_bits as usize).div_ceil(8);
                (
                    hd / block * per_block,
                    [
                        Codebook::lloyd_max(bits.of(0, block), block),
                        Codebook::lloyd_max(bits.of(block - 1, block), block),
                    ],
                )
            }
        };
        let signs = match l.format {
            KvFormat::Turbo(_) => (0..heads * hd)
                .map(|i| if splitmix(l.seed.wrapping_mul(0x9E37_79B9) ^ i as u64) & 1 == 0 { 1.0 } else { -1.0 })
                .collect(),
            _ => Vec::new(),
        };
        let key_shift = match l.key_shift {
            Some(s) if s.len() != l.kv_dim => {
                return Err(Error::Usage(format!("a key shift of {} floats for keys of {}", s.len(), l.kv_dim)));
            }
            s => s.map_or_else(Vec::new, <[f32]>::to_vec),
        };
        let key_scale = match l.key_scale {
            Some(s) if s.len() != l.kv_dim => {
                return Err(Error::Usage(format!("a key scale of {} floats for keys of {}", s.len(), l.kv_dim)));
            }
            Some(s) if matches!(l.format, KvFormat::Turbo(_)) => s.to_vec(),
            _ => Vec::new(),
        };
        Ok(Codec { format: l.format, heads, head_dim: hd, head_bytes, block, signs, books, key_shift, key_scale })
    }

    pub fn format(&self) -> KvFormat {
        self.format
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Head `head`'s part of the vector every key was coded relative to: decoded keys
    /// are `key - shift`, and a score needs `q · shift` added back.
    pub fn key_shift(&self, head: usize) -> Option<&[f32]> {
        (!self.key_shift.is_empty()).then(|| &self.key_shift[head * self.head_dim..(head + 1) * self.head_dim])
    }

    /// Head `head`'s part of the vector keys were multiplied by before coding
    /// ([`KvLayout::key_scale`]): a query must be divided by it.
    pub fn key_scale(&self, head: usize) -> Option<&[f32]> {
        (!self.key_scale.is_empty()).then(|| &self.key_scale[head * self.head_dim..(head + 1) * self.head_dim])
    }

    /// Whether keys are coded as other than themselves ([`Codec::move_key`]).
    fn moves_keys(&self) -> bool {
        !self.key_shift.is_empty() || !self.key_scale.is_empty()
    }

    /// One position's key (`kv_dim`) as it is coded: less the shift, times the scale.
    fn move_key(&self, k: &mut [f32]) {
        if !self.key_shift.is_empty() {
            k.iter_mut().zip(&self.key_shift).for_each(|(k, s)| *k -= s);
        }
        if !self.key_scale.is_empty() {
            k.iter_mut().zip(&self.key_scale).for_each(|(k, s)| *k *= s);
        }
    }

    fn row_bytes(&self) -> usize {
        self.heads * self.head_bytes
    }

    /// Where head `head` of slot `slot` begins in a cache's bytes ([`BLOCK`]).
    fn head_at(&self, slot: usize, head: usize) -> usize {
        slot / BLOCK * BLOCK * self.row_bytes() + head * BLOCK * self.head_bytes + slot % BLOCK * self.head_bytes
    }

    /// Whether rows decode in a rotated basis: a query must then go through
    /// [`Codec::rotate`] and a sum of values through [`Codec::unrotate`].
    pub fn rotates(&self) -> bool {
        matches!(self.format, KvFormat::Turbo(_))
    }

    /// Takes head `head`'s `x` (`head_dim`) into the basis its keys decode in.
    pub fn rotate(&self, head: usize, x: &mut [f32]) {
        let signs = &self.signs[head * self.head_dim..(head + 1) * self.head_dim];
        for (b, s) in x.chunks_mut(self.block).zip(signs.chunks(self.block)) {
            b.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
            hadamard(b);
        }
    }

    /// The inverse of [`Codec::rotate`].
    pub fn unrotate(&self, head: usize, x: &mut [f32]) {
        let signs = &self.signs[head * self.head_dim..(head + 1) * self.head_dim];
        for (b, s) in x.chunks_mut(self.block).zip(signs.chunks(self.block)) {
            hadamard(b);
            b.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
        }
    }

    /// One position's key and value (`kv_dim` each) into the basis their codes decode
    /// in: the key moved ([`Codec::move_key`]), both rotated head by head.
    fn to_basis(&self, k: &mut [f32], v: &mut [f32]) {
        self.move_key(k);
        if self.rotates() {
            for (h, (k, v)) in k.chunks_mut(self.head_dim).zip(v.chunks_mut(self.head_dim)).enumerate() {
                self.rotate(h, k);
                self.rotate(h, v);
            }
        }
    }

    /// Codes one position's `kv_dim` floats into `out` (`heads * head_bytes`).
    pub fn encode_row(&self, x: &[f32], out: &mut [u8]) {
        let mut tmp = vec![0f32; self.head_dim];
        for (h, (x, out)) in x.chunks(self.head_dim).zip(out.chunks_mut(self.head_bytes)).enumerate() {
            match self.format {
                KvFormat::F32 => unreachable!(),
                KvFormat::F16 => match unsafe { out.align_to_mut::<f16>() } {
                    ([], halves, []) if cfg!(target_endian = "little") => halves.convert_from_f32_slice(x),
                    _ => {
                        for (x, o) in x.iter().zip(out.chunks_mut(2)) {
                            o.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
                        }
                    }
                },
                KvFormat::Q8 => {
                    let max = x.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let scale = max / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    out[..4].copy_from_slice(&scale.to_le_bytes());
                    for (x, o) in x.iter().zip(&mut out[4..]) {
                        *o = (x * inv).round().clamp(-127.0, 127.0) as i8 as u8;
                    }
                }
                KvFormat::Turbo(_) => {
                    tmp.copy_from_slice(x);
                    self.encode_turbo(h, &mut tmp, out);
                }
            }
        }
    }

    fn encode_turbo(&self, head: usize, x: &mut [f32], out: &mut [u8]) {
        let b = self.block;
        let per_block = self.head_bytes / (self.head_dim / b);
        let norms: Vec<f32> = x.chunks(b).map(|c| c.iter().map(|v| v * v).sum::<f32>().sqrt()).collect();
        self.rotate(head, x);
        for ((c, o), norm) in x.chunks(b).zip(out.chunks_mut(per_block)).zip(norms) {
            let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
            let mut bits = BitWriter::new(&mut o[2..]);
            // The codes' own norm: the stored scale brings the decoded block back to the
            // norm of the input (the centroids alone shrink it by the distortion, which
            // would scale every score down by as much).
            let mut coded = 0f32;
            for (i, v) in c.iter().enumerate() {
                let book = &self.books[usize::from(i >= b / 2)];
                let code = book.code(v * inv);
                coded += book.table[code as usize] * book.table[code as usize];
                bits.put(code, book.bits);
            }
            let scale = if coded > 0.0 { norm / coded.sqrt() } else { 0.0 };
            o[..2].copy_from_slice(&f16::from_f32(scale.min(f16::MAX.to_f32())).to_le_bytes());
        }
    }

    /// Decodes rows of one head (`head_bytes` each, one after another) into `out`
    /// (`head_dim` each).
    fn decode_rows(&self, bytes: &[u8], out: &mut [f32]) {
        match self.format {
            KvFormat::F16 => crate::dot::f16_to_f32(bytes, out),
            // (every row's blocks in one pass: a row is whole blocks)
            KvFormat::Turbo(_) => unpack_blocks(&self.books, self.block, bytes, out),
            _ => bytes.chunks(self.head_bytes).zip(out.chunks_mut(self.head_dim)).for_each(|(b, o)| self.decode(b, o)),
        }
    }

    /// Decodes one head (`head_bytes`) into `out` (`head_dim`), in the codec's basis.
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        match self.format {
            KvFormat::F32 => unreachable!(),
            KvFormat::F16 => crate::dot::f16_to_f32(bytes, out),
            KvFormat::Q8 => {
                let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                for (o, &c) in out.iter_mut().zip(&bytes[4..]) {
                    *o = c as i8 as f32 * scale;
                }
            }
            KvFormat::Turbo(_) => unpack_blocks(&self.books, self.block, &bytes[..self.head_bytes], out),
        }
    }
}

/// The Lloyd-Max quantizer of one code width for the coordinates of a randomly
/// rotated unit vector of `block` dimensions: the centroids that minimise the mean
/// squared error under that distribution, and the midpoints between them.
#[derive(Debug)]
pub struct Codebook {
    pub bits: u32,
    /// The centroids, padded with zeros to sixteen as the unpacking kernels load them.
    table: [f32; 16],
    thresholds: Vec<f32>,
}

impl Codebook {
    fn empty() -> Arc<Codebook> {
        Arc::new(Codebook { bits: 0, table: [0.0; 16], thresholds: Vec::new() })
    }

    /// The book's `2^bits` centroids, ascending (none for the empty book).
    pub fn centroids(&self) -> &[f32] {
        &self.table[..if self.bits == 0 { 0 } else { 1 << self.bits }]
    }

    /// The code of `x`: the index of its nearest centroid.
    fn code(&self, x: f32) -> u32 {
        self.thresholds.iter().filter(|&&t| x > t).count() as u32
    }

    /// The codebook of `bits` for blocks of `block`, computed once per process.
    pub fn lloyd_max(bits: u32, block: usize) -> Arc<Codebook> {
        type Books = HashMap<(u32, usize), Arc<Codebook>>;
        static BOOKS: OnceLock<Mutex<Books>> = OnceLock::new();
        let mut books = BOOKS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        books.entry((bits, block)).or_insert_with(|| Arc::new(Codebook::compute(bits, block))).clone()
    }

    /// Lloyd's iteration on the density (1 - x^2)^((block - 3) / 2) over [-1, 1],
    /// integrated on a grid fine enough for the block's spread (1 / sqrt(block)).
    fn compute(bits: u32, block: usize) -> Codebook {
        let levels = 1usize << bits;
        let sigma = 1.0 / (block as f64).sqrt();
        // The grid spans +-12 sigma (or the whole interval), 2^16 cells.
        let span = (12.0 * sigma).min(1.0);
        let cells = 1 << 16;
        let dx = 2.0 * span / cells as f64;
        let e = (block as f64 - 3.0) / 2.0;
        let mut cum_p = vec![0f64; cells + 1];
        let mut cum_xp = vec![0f64; cells + 1];
        for i in 0..cells {
            let x = -span + (i as f64 + 0.5) * dx;
            let p = (1.0 - x * x).max(0.0).powf(e);
            cum_p[i + 1] = cum_p[i] + p;
            cum_xp[i + 1] = cum_xp[i] + x * p;
        }
        let cell = |t: f64| (((t + span) / dx).round().max(0.0) as usize).min(cells);
        let mut c: Vec<f64> =
            (0..levels).map(|i| sigma * 3.0 * (2.0 * i as f64 + 1.0 - levels as f64) / levels as f64).collect();
        for _ in 0..500 {
            let t: Vec<f64> = c.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            for (i, ci) in c.iter_mut().enumerate() {
                let lo = if i == 0 { 0 } else { cell(t[i - 1]) };
                let hi = if i == levels - 1 { cells } else { cell(t[i]) };
                let p = cum_p[hi] - cum_p[lo];
                if p > 0.0 {
                    *ci = (cum_xp[hi] - cum_xp[lo]) / p;
                }
            }
        }
        Codebook::of(bits, &c)
    }

    /// The book of `bits` with these centroids (ascending), coding to the nearest.
    fn of(bits: u32, c: &[f64]) -> Codebook {
        let thresholds = c.windows(2).map(|w| ((w[0] + w[1]) / 2.0) as f32).collect();
        let mut table = [0f32; 16];
        table.iter_mut().zip(c).for_each(|(t, &c)| *t = c as f32);
        Codebook { bits, table, thresholds }
    }
}

/// The normalised fast Walsh-Hadamard transform of a power-of-two block, in place
/// (its own inverse).
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Codes of a few bits each, packed from the lowest bit of the first byte.
struct BitWriter<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut [u8]) -> Self {
        out.fill(0);
        BitWriter { out, at: 0 }
    }

    fn put(&mut self, code: u32, bits: u32) {
        for b in 0..bits {
            if code >> b & 1 == 1 {
                self.out[self.at / 8] |= 1 << (self.at % 8);
            }
            self.at += 1;
        }
    }
}

/// Decodes `out.len()` codes of `book` (packed by [`BitWriter`], eight codes in each
/// `book.bits` bytes) into `norm` times their centroids. The same bits on every ISA.
pub fn unpack(book: &Codebook, norm: f32, bytes: &[u8], out: &mut [f32]) {
    let bits = book.bits as usize;
    assert!((1..=4).contains(&bits) && out.len().is_multiple_of(8), "unpack: {} codes of {bits} bits", out.len());
    assert!(
        bytes.len() >= out.len() / 8 * bits,
        "unpack: {} bytes for {} codes of {bits} bits",
        bytes.len(),
        out.len()
    );
    unpack_on(crate::isa(), Table { centroids: &book.table, norm }, bits, bytes, out);
}

/// Heads of a TurboQuant cache decoded, one after another: per rotation block of
/// `block` values, its f16 norm, then each half's codes in its own book's width (whole
/// bytes: a half is a multiple of 8 codes). Attention decodes a tile's rows of a head at
/// every step, so this is one dispatch per tile and a table lookup per sixteen codes on
/// AVX-512 (per eight on AVX2), the table scaled by the block's norm in registers.
/// (Made one dispatch for the tile's blocks on AVX-512, with the 3-bit half of 3.5 bits
/// read 32 codes a load as the 4-bit half was: decode after 4096 positions at 3.5 bits
/// spent 10% of its time unpacking, most of it in the 3-bit half's 16-code path.)
fn unpack_blocks(books: &[Arc<Codebook>; 2], block: usize, bytes: &[u8], out: &mut [f32]) {
    let split = BlockSplit::new(books, block);
    assert_eq!(bytes.len(), out.len() / block * split.per_block, "unpack: a head's bytes");
    let isa = crate::isa();
    #[cfg(target_arch = "x86_64")]
    if isa == crate::Isa::Avx512 {
        // SAFETY: `isa` came from `crate::isa()`, which checked the CPU's features.
        return unsafe { x86::unpack_blocks_avx512([&books[0].table, &books[1].table], split, bytes, out) };
    }
    for (o, c) in out.chunks_exact_mut(block).zip(bytes.chunks_exact(split.per_block)) {
        let norm = f16::from_le_bytes([c[0], c[1]]).to_f32();
        let (first, second) = o.split_at_mut(block / 2);
        let (a, b) = split.halves(c);
        for (book, bits, codes, o) in [(&books[0], split.bits[0], a, first), (&books[1], split.bits[1], b, second)] {
            unpack_on(isa, Table { centroids: &book.table, norm }, bits, codes, o);
        }
    }
}

/// Where a rotation block's parts lie in its bytes: the f16 norm, then the first half's
/// codes (`bits[0]` wide), then the second's.
#[derive(Clone, Copy)]
struct BlockSplit {
    /// Values in a block (a rotation's length).
    block: usize,
    bits: [usize; 2],
    /// Bytes of the block from the end of the norm to the second half's codes.
    first: usize,
    per_block: usize,
}

impl BlockSplit {
    fn new(books: &[Arc<Codebook>; 2], block: usize) -> BlockSplit {
        let bits = [books[0].bits as usize, books[1].bits as usize];
        let first = block / 2 * bits[0] / 8;
        BlockSplit { block, bits, first, per_block: 2 + first + block / 2 * bits[1] / 8 }
    }

    /// One block's bytes: the codes of its two halves.
    #[inline(always)]
    fn halves(self, block: &[u8]) -> (&[u8], &[u8]) {
        block[2..].split_at(self.first)
    }
}

/// [`unpack`] on a chosen ISA, the table already scaled.
#[inline(always)]
fn unpack_on(isa: crate::Isa, table: Table<'_>, bits: usize, bytes: &[u8], out: &mut [f32]) {
    match isa {
        // SAFETY: `isa` came from `crate::isa()`, which checked the CPU's features.
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx512 => unsafe { x86::unpack_avx512(table, bits, bytes, out) },
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx2 => unsafe { x86::unpack_avx2(table, bits, bytes, out) },
        _ => unpack_scalar(table, bits, bytes, out),
    }
}

/// A book's centroids and one block's norm: a code decodes to its centroid times the
/// norm (a product the kernels form sixteen at a time in a register; writing the
/// products to memory for a vector load to read back stalled that load).
#[derive(Clone, Copy)]
struct Table<'a> {
    centroids: &'a [f32; 16],
    norm: f32,
}

/// Eight codes' bytes (`bits` of them, at most 4) from `at` as one little-endian word.
/// Reads eight bytes at once where the slice has them (a copy of a variable length
/// would be a call to `memcpy` per group).
#[inline(always)]
fn group(bytes: &[u8], at: usize, bits: usize) -> u32 {
    if at + 8 <= bytes.len() {
        let all = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        (all & ((1u64 << (8 * bits)) - 1)) as u32
    } else {
        bytes[at..at + bits].iter().rev().fold(0u32, |w, &b| w << 8 | b as u32)
    }
}

fn unpack_scalar(table: Table<'_>, bits: usize, bytes: &[u8], out: &mut [f32]) {
    let mask = (1u32 << bits) - 1;
    for (k, o) in out.chunks_exact_mut(8).enumerate() {
        let w = group(bytes, k * bits, bits);
        for (i, o) in o.iter_mut().enumerate() {
            *o = table.centroids[(w >> (i * bits) & mask) as usize] * table.norm;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BlockSplit, Table, group};
    use crate::tile::{LANES, Lanes};

    /// Where the codes of one width lie for a step of 32 (at most sixteen bytes, loaded
    /// once and repeated in each 128-bit lane): per lane `j` of a register, the shuffle
    /// that brings the two bytes holding code `j` (codes 0-15) or `16 + j` (16-31) into
    /// it, and the shift to the code's first bit. A code of at most four bits starting at
    /// most seven bits into a byte lies within two bytes. What is left above the code after
    /// the shift is the next codes' bits: the table, repeated every `2^bits` entries, looks
    /// the same value up whatever they are, so no mask is needed.
    struct Layout {
        bits: usize,
        shuffle: [__m512i; 2],
        shift: __m512i,
    }

    impl Layout {
        #[target_feature(enable = "avx512f")]
        fn new(bits: usize) -> Layout {
            let mut shuffle = [[0x80u8; 64]; 2];
            let mut shift = [0u32; 16];
            for j in 0..16 {
                let bit = bits * j;
                shift[j] = (bit % 8) as u32;
                for (k, s) in shuffle.iter_mut().enumerate() {
                    let at = 2 * bits * k + bit / 8;
                    // (byte 16 would be past the load; a 4-bit code never reaches into it)
                    s[4 * j] = at as u8;
                    s[4 * j + 1] = (at + 1).min(15) as u8;
                }
            }
            // SAFETY: each array is 64 bytes, as a 512-bit load reads.
            unsafe {
                Layout {
                    bits,
                    shuffle: shuffle.map(|s| _mm512_loadu_si512(s.as_ptr() as *const _)),
                    shift: _mm512_loadu_si512(shift.as_ptr() as *const _),
                }
            }
        }

        /// `out.len()` codes (a multiple of 8) from `bytes` into the values of table `t`
        /// (already scaled by the block's norm): thirty-two a step, the step's bytes read
        /// by one masked load (never past the codes).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        #[inline]
        fn decode(&self, t: __m512, bytes: &[u8], out: &mut [f32]) {
            let (n, bits) = (out.len(), self.bits);
            assert!(n.is_multiple_of(8) && bytes.len() >= n / 8 * bits, "unpack: {n} codes of {bits} bits");
            // Whole steps of 32 codes (4 bits bytes each) with no length or mask worked
            // out per step: a row of 128 is four of them, each a few vector instructions.
            let step = ((1u32 << (4 * bits)) - 1) as u16;
            let whole = n / 32;
            for s in 0..whole {
                // SAFETY: the load reads `4 bits` bytes from `4 bits s`, within `bytes` by
                // the assertion (32 codes of `bits`); the stores write 32 floats from `32 s < n`.
                unsafe {
                    let x = _mm_maskz_loadu_epi8(step, bytes.as_ptr().add(s * 4 * bits) as *const i8);
                    let x = _mm512_broadcast_i32x4(x);
                    let at = out.as_mut_ptr().add(32 * s);
                    for (k, shuffle) in self.shuffle.iter().enumerate() {
                        let codes = _mm512_srlv_epi32(_mm512_shuffle_epi8(x, *shuffle), self.shift);
                        _mm512_storeu_ps(at.add(16 * k), _mm512_permutexvar_ps(codes, t));
                    }
                }
            }
            let i = 32 * whole;
            if i < n {
                let left = n - i;
                let len = left / 8 * bits;
                // SAFETY: as above, `len` bytes from `i / 8 * bits`; at most `left` floats
                // stored from `i`.
                unsafe {
                    let x =
                        _mm_maskz_loadu_epi8(((1u32 << len) - 1) as u16, bytes.as_ptr().add(i / 8 * bits) as *const i8);
                    let x = _mm512_broadcast_i32x4(x);
                    for (k, shuffle) in self.shuffle.iter().enumerate().take(left.div_ceil(16)) {
                        let codes = _mm512_srlv_epi32(_mm512_shuffle_epi8(x, *shuffle), self.shift);
                        let v = _mm512_permutexvar_ps(codes, t);
                        let at = out.as_mut_ptr().add(i + 16 * k);
                        if left >= 16 * (k + 1) {
                            _mm512_storeu_ps(at, v);
                        } else {
                            _mm512_mask_storeu_ps(at, 0xff, v);
                        }
                    }
                }
            }
        }
    }

    /// A book of `bits` codes' sixteen-entry table repeated every `2^bits` entries: a
    /// lookup by the low four bits of a word whose code is its lowest `bits` finds the
    /// code's centroid whatever lies above it.
    #[target_feature(enable = "avx512f")]
    fn repeated(bits: usize, centroids: &[f32; 16]) -> __m512 {
        let mask = _mm512_set1_epi32((1 << bits) - 1);
        let index = _mm512_and_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), mask);
        // SAFETY: sixteen floats.
        _mm512_permutexvar_ps(index, unsafe { _mm512_loadu_ps(centroids.as_ptr()) })
    }

    /// [`super::KvCache::key_scores`] over `rows` rows of one head (`head_bytes` apart from
    /// the start of `bytes`), [`ROWS`] at a time. Their codes are gathered sixteen rows a
    /// vector, a 32-bit word of eight codes from each row, decoded to the values
    /// [`unpack_blocks_avx512`] gives (a centroid times the block's norm, one rounding) and
    /// laid out channel by channel with the rows side by side (`scratch`,
    /// `[head_dim][ROWS]`); each query's chain over the channels then runs for the rows in
    /// two vectors, its channel's value broadcast. A decode step's six queries of a KV head
    /// took one 8-lane vector a position in the general kernel, 128 multiply-adds a
    /// position of 128 channels; here they take 48 on 16 lanes. (Decode's attention at
    /// 8192 positions, 28 layers: 24 ms a step at 4 bits before, 20 after; the gathers cost
    /// nothing measurable against plain loads.)
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub fn key_scores_avx512(
        books: [&[f32; 16]; 2],
        (split, head_bytes): (BlockSplit, usize),
        (bytes, rows): (&[u8], usize),
        q: &Lanes,
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let (hd, block, width) = (q.head_dim(), split.block, q.width());
        assert!(
            bytes.len() >= rows * head_bytes
                && head_bytes == hd / block * split.per_block
                && split.bits.iter().all(|b| (2..=4).contains(b))
                && scratch.len() >= ROWS * hd
                && out.len() >= rows * width,
            "key_scores: {rows} rows of {head_bytes} bytes in {}, scratch {}, out {}",
            bytes.len(),
            scratch.len(),
            out.len()
        );
        let tables = [repeated(split.bits[0], books[0]), repeated(split.bits[1], books[1])];
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let rows_at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(head_bytes as i32));
        for r0 in (0..rows).step_by(ROWS) {
            let m = (rows - r0).min(ROWS);
            // (a half past the rows is left as it was: its chains are not read)
            for half in 0..m.div_ceil(16) {
                let first = r0 + 16 * half;
                let mask = ((1u32 << (m - 16 * half).min(16)) - 1) as __mmask16;
                // SAFETY (every gather below): lane `l` of a mask reads the four bytes from
                // `off` of row `first + l < rows`, and every `off` is at most
                // `head_bytes - 4`: within `bytes` by the assertion. The other lanes read
                // nothing.
                let gather = |off: usize| unsafe {
                    let base = bytes.as_ptr().wrapping_add(first * head_bytes + off) as *const i32;
                    _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, rows_at, base)
                };
                for b in 0..hd / block {
                    let at = b * split.per_block;
                    // The block's f16 norm is the low half of the word at its start.
                    let norm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(gather(at)));
                    for (h, table) in tables.iter().enumerate() {
                        let bits = split.bits[h];
                        let codes_at = at + 2 + h * split.first;
                        for g in 0..block / 16 {
                            // Eight codes in `bits` bytes: the word that ends where they
                            // end (it begins at or after the norm), its top `8 bits` bits
                            // theirs.
                            let end = codes_at + (g + 1) * bits;
                            let word = gather(end - 4);
                            let d = b * block + h * block / 2 + 8 * g;
                            let to = &mut scratch[ROWS * d + 16 * half..][..ROWS * 7 + 16];
                            let table = (*table, norm);
                            match bits {
                                2 => spread::<2>(word, table, to),
                                3 => spread::<3>(word, table, to),
                                _ => spread::<4>(word, table, to),
                            }
                        }
                    }
                }
            }
            let out = &mut out[r0 * width..];
            let n = q.queries();
            for g in (0..n).step_by(LANES) {
                match n - g {
                    1 => chains::<1>(q, g, (scratch, m), out),
                    2 => chains::<2>(q, g, (scratch, m), out),
                    3 => chains::<3>(q, g, (scratch, m), out),
                    4 => chains::<4>(q, g, (scratch, m), out),
                    5 => chains::<5>(q, g, (scratch, m), out),
                    6 => chains::<6>(q, g, (scratch, m), out),
                    7 => chains::<7>(q, g, (scratch, m), out),
                    _ => chains::<8>(q, g, (scratch, m), out),
                }
            }
            for t in 0..m {
                out[t * width + n..(t + 1) * width].fill(0.0);
            }
        }
    }

    /// The eight codes of `BITS` at the top of each lane's `word` to their values (the
    /// `table`'s centroid times the lane's norm), code `j` to `to[ROWS j..][..16]`. (The
    /// widths are constants so that each shift is one: a shift by a vector the compiler
    /// cannot bound below 32 becomes a comparison and a masked shift.)
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn spread<const BITS: u32>(word: __m512i, (table, norm): (__m512, __m512), to: &mut [f32]) {
        assert!(to.len() >= ROWS * 7 + 16);
        for j in 0..8 {
            let code = _mm512_srlv_epi32(word, _mm512_set1_epi32((32 - 8 * BITS + BITS * j) as i32));
            let v = _mm512_mul_ps(_mm512_permutexvar_ps(code, table), norm);
            // SAFETY: within `to` by the assertion.
            unsafe { _mm512_storeu_ps(to.as_mut_ptr().add(ROWS * j as usize), v) };
        }
    }

    /// Rows a step of [`key_scores_avx512`]: two vectors of chains per query, so that
    /// a decode step's six queries keep twelve chains in flight (six, one a query, left
    /// the multipliers waiting on each chain's previous step).
    const ROWS: usize = 32;

    /// Queries `first..first + Q` (of one group) against the `m` rows of `keys`
    /// (`[head_dim][ROWS]`), into `out[t * q.width() + first + i]`.
    #[target_feature(enable = "avx512f")]
    fn chains<const Q: usize>(q: &Lanes, first: usize, (keys, m): (&[f32], usize), out: &mut [f32]) {
        let (hd, width) = (q.head_dim(), q.width());
        let group = q.group(first / LANES);
        assert!(keys.len() >= ROWS * hd && group.len() == hd && out.len() >= (m - 1) * width + first + Q);
        let mut acc = [[_mm512_setzero_ps(); 2]; Q];
        for (d, qd) in group.iter().enumerate() {
            // SAFETY: `ROWS (d + 1) <= keys.len()` by the assertion.
            let k = unsafe { [0, 16].map(|h| _mm512_loadu_ps(keys.as_ptr().add(ROWS * d + h))) };
            for (a, &x) in acc.iter_mut().zip(qd) {
                let x = _mm512_set1_ps(x);
                a[0] = _mm512_fmadd_ps(k[0], x, a[0]);
                a[1] = _mm512_fmadd_ps(k[1], x, a[1]);
            }
        }
        let mut rows = [[0f32; ROWS]; Q];
        for (r, a) in rows.iter_mut().zip(acc) {
            // SAFETY: thirty-two floats.
            unsafe {
                _mm512_storeu_ps(r.as_mut_ptr(), a[0]);
                _mm512_storeu_ps(r.as_mut_ptr().add(16), a[1]);
            }
        }
        for t in 0..m {
            for (i, r) in rows.iter().enumerate() {
                out[t * width + first + i] = r[t];
            }
        }
    }

    /// [`super::unpack`] on AVX-512.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub fn unpack_avx512(table: Table<'_>, bits: usize, bytes: &[u8], out: &mut [f32]) {
        let layout = Layout::new(bits);
        let t = _mm512_mul_ps(repeated(layout.bits, table.centroids), _mm512_set1_ps(table.norm));
        layout.decode(t, bytes, out);
    }

    /// [`super::unpack_blocks`] on AVX-512: the layouts and tables made once for all the
    /// blocks, each block's table scaled by its norm in a register.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub fn unpack_blocks_avx512(books: [&[f32; 16]; 2], split: BlockSplit, bytes: &[u8], out: &mut [f32]) {
        let layouts = split.bits.map(|bits| Layout::new(bits));
        let tables = [repeated(layouts[0].bits, books[0]), repeated(layouts[1].bits, books[1])];
        let block = split.block;
        for (o, c) in out.chunks_exact_mut(block).zip(bytes.chunks_exact(split.per_block)) {
            // (the F16C conversion: `half`'s own, outside a function compiled for F16C,
            // takes its software path)
            let norm = u16::from_le_bytes([c[0], c[1]]);
            let norm = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(norm as i32)));
            let (first, second) = o.split_at_mut(block / 2);
            let (a, b) = split.halves(c);
            layouts[0].decode(_mm512_mul_ps(tables[0], norm), a, first);
            layouts[1].decode(_mm512_mul_ps(tables[1], norm), b, second);
        }
    }

    /// Eight codes a step; a table of sixteen takes two eight-entry lookups and a
    /// blend on the code's top bit.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn unpack_avx2(table: Table<'_>, bits: usize, bytes: &[u8], out: &mut [f32]) {
        let b = bits as i32;
        unsafe {
            let norm = _mm256_set1_ps(table.norm);
            let lo = _mm256_mul_ps(_mm256_loadu_ps(table.centroids.as_ptr()), norm);
            let hi = _mm256_mul_ps(_mm256_loadu_ps(table.centroids.as_ptr().add(8)), norm);
            let shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
            let mask = _mm256_set1_epi32((1 << bits) - 1);
            for (k, o) in out.chunks_exact_mut(8).enumerate() {
                let w = _mm256_set1_epi32(group(bytes, k * bits, bits) as i32);
                let codes = _mm256_and_si256(_mm256_srlv_epi32(w, shifts), mask);
                let mut v = _mm256_permutevar8x32_ps(lo, codes);
                if bits == 4 {
                    let top = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
                    v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, codes), top);
                }
                _mm256_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use sluice_core::TurboBits;

    pub(crate) fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        // Box-Muller over splitmix's uniforms.
        (0..n)
            .map(|i| {
                let u = |k: u64| ((splitmix(seed ^ (2 * i as u64 + k) << 20) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                ((-2.0 * u(0).ln()).sqrt() * (2.0 * std::f64::consts::PI * u(1)).cos()) as f32
            })
            .collect()
    }

    /// TurboQuant's round trip on Gaussian vectors of 128: the relative squared error
    /// per width is the Lloyd-Max distortion of a unit Gaussian at that width (0.1175
    /// at 2 bits, 0.03454 at 3, 0.009497 at 4; Max 1960), which the rotation makes every
    /// coordinate's; 3.5 bits is the mean of 3 and 4.
    #[test]
    fn turbo_round_trip_meets_lloyd_max_distortion() {
        let hd = 128;
        for (bits, want) in [
            (TurboBits::Two, 0.1175),
            (TurboBits::Three, 0.03454),
            (TurboBits::ThreeHalf, (0.03454 + 0.009497) / 2.0),
            (TurboBits::Four, 0.009497),
        ] {
            let l = KvLayout { seed: 3, ..KvLayout::plain(2 * hd, hd, KvFormat::Turbo(bits)) };
            let codec = Codec::new(&l).unwrap();
            let (mut err, mut norm) = (0f64, 0f64);
            let mut bytes = vec![0u8; codec.row_bytes()];
            let mut back = vec![0f32; hd];
            for n in 0..400 {
                let x = gaussian(2 * hd, n);
                codec.encode_row(&x, &mut bytes);
                for h in 0..2 {
                    codec.decode(&bytes[h * codec.head_bytes..(h + 1) * codec.head_bytes], &mut back);
                    codec.unrotate(h, &mut back);
                    for (a, b) in x[h * hd..(h + 1) * hd].iter().zip(&back) {
                        err += ((a - b) as f64).powi(2);
                        norm += (*a as f64).powi(2);
                    }
                }
            }
            let got = err / norm;
            assert!((got / want - 1.0).abs() < 0.05, "{bits:?}: relative error {got:.5}, Lloyd-Max {want}");
        }
    }

    /// Rotation keeps dot products; unrotate undoes rotate.
    #[test]
    fn rotation_is_orthogonal() {
        let l = KvLayout { seed: 9, ..KvLayout::plain(576, 576, KvFormat::Turbo(TurboBits::Four)) };
        let codec = Codec::new(&l).unwrap();
        assert_eq!(codec.block, 64);
        let (a, b) = (gaussian(576, 1), gaussian(576, 2));
        let (mut ra, mut rb) = (a.clone(), b.clone());
        codec.rotate(0, &mut ra);
        codec.rotate(0, &mut rb);
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p * q) as f64).sum::<f64>();
        assert!((dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-3);
        codec.unrotate(0, &mut ra);
        assert!(a.iter().zip(&ra).all(|(x, y)| (x - y).abs() < 1e-5));
    }

    /// Bytes per position: 3.5 bits is at most a quarter of 16 at the head sizes of
    /// real models; 8 bits about half.
    #[test]
    fn widths_save_what_they_say() {
        for hd in [64, 128, 256] {
            let bytes = |format| {
                let l = KvLayout::plain(4 * hd, hd, format);
                KvCache::with_layout(&l).unwrap().bytes_per_position() as f64
            };
            let f16 = bytes(KvFormat::F16);
            assert!(bytes(KvFormat::Turbo(TurboBits::ThreeHalf)) <= 0.25 * f16, "head {hd}");
            assert!(bytes(KvFormat::Q8) <= 0.54 * f16);
            assert_eq!(bytes(KvFormat::F32), 2.0 * f16);
        }
        let l = KvLayout::plain(40, 40, KvFormat::Turbo(TurboBits::Four));
        assert!(KvCache::with_layout(&l).unwrap_err().to_string().contains("head of 40"));
    }

    /// F16 and 8-bit round trips stay within their formats' rounding.
    #[test]
    fn f16_and_q8_round_trip() {
        let x = gaussian(64, 5);
        for (format, tol) in [(KvFormat::F16, 1e-3), (KvFormat::Q8, 0.02)] {
            let l = KvLayout::plain(64, 64, format);
            let mut c = KvCache::with_layout(&l).unwrap();
            c.append(&x, &x);
            let mut back = vec![0f32; 64];
            c.value_into(0, 0, &mut back);
            let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() <= tol * max), "{format:?}");
        }
    }

    /// Each head's rows lie in blocks of [`BLOCK`] slots: a cache appended in uneven
    /// chunks, as a ring whose window is or is not a multiple of the block, and copied
    /// by `prefix`, gives every held position's head back as its format rounds the input
    /// (16 bits) or as that row coded alone (8 bits), one position at a time and in runs.
    #[test]
    fn blocks_keep_each_heads_rows() {
        let (hd, heads, n) = (16, 3, 150);
        let kd = heads * hd;
        let (k, v) = (gaussian(n * kd, 1), gaussian(n * kd, 2));
        for format in [KvFormat::F16, KvFormat::Q8] {
            let codec = Codec::new(&KvLayout::plain(kd, hd, format)).unwrap();
            // Position `pos`'s head `h` of `x` as its format codes it alone.
            let want = |x: &[f32], pos: usize, h: usize| {
                let mut row = vec![0u8; codec.row_bytes()];
                codec.encode_row(&x[pos * kd..(pos + 1) * kd], &mut row);
                let mut out = vec![0f32; hd];
                codec.decode(&row[h * codec.head_bytes..(h + 1) * codec.head_bytes], &mut out);
                out
            };
            for window in [None, Some(64), Some(37)] {
                let mut c = KvCache::with_layout(&KvLayout { window, ..KvLayout::plain(kd, hd, format) }).unwrap();
                let mut at = 0;
                for len in [1, 40, 7, 33, 69] {
                    c.append(&k[at * kd..(at + len) * kd], &v[at * kd..(at + len) * kd]);
                    at += len;
                }
                assert_eq!(c.len(), n);
                // (a ring holds no shorter prefix than its length)
                let keep = if window.is_some() { n } else { n - 5 };
                let cut = c.prefix(keep).unwrap();
                for (c, len) in [(&c, n), (&cut, keep)] {
                    let first = window.map_or(0, |w| len - w);
                    let (mut kr, mut vr) = (vec![0f32; len * hd], vec![0f32; len * hd]);
                    let mut one = vec![0f32; hd];
                    for h in 0..heads {
                        c.run_into(first..len, h, &mut kr, &mut vr);
                        for pos in first..len {
                            let r = (pos - first) * hd..(pos - first + 1) * hd;
                            assert_eq!(kr[r.clone()], want(&k, pos, h), "{format:?} {window:?} key {pos} head {h}");
                            assert_eq!(vr[r.clone()], want(&v, pos, h), "{format:?} {window:?} value {pos} head {h}");
                            c.key_into(pos, h, &mut one);
                            assert_eq!(one, kr[r]);
                        }
                    }
                    if format == KvFormat::F16 {
                        let x = half::f16::from_f32(k[(len - 1) * kd + hd]).to_f32();
                        c.key_into(len - 1, 1, &mut one);
                        assert_eq!(one[0], x, "the 16-bit key is the input rounded");
                    }
                }
            }
        }
    }

    /// Codes of every width written by `BitWriter` come back from `unpack` as written
    /// (centroid `k` is `k`, the norm 1), whatever straddles a byte.
    #[test]
    fn unpack_reads_what_the_writer_packed() {
        for bits in 2..=4u32 {
            let book = Codebook::of(bits, &(0..1 << bits).map(f64::from).collect::<Vec<_>>());
            let codes: Vec<u32> = (0..64u64).map(|i| (splitmix(i * 7 + bits as u64) % (1 << bits)) as u32).collect();
            let mut bytes = vec![0u8; 64 * bits as usize / 8];
            let mut w = BitWriter::new(&mut bytes);
            codes.iter().for_each(|&c| w.put(c, bits));
            let mut out = vec![0f32; 64];
            unpack(&book, 1.0, &bytes, &mut out);
            assert_eq!(out, codes.iter().map(|&c| c as f32).collect::<Vec<_>>(), "{bits} bits");
        }
    }
}
