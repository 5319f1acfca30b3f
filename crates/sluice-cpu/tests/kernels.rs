//! Matmul kernels on every stored format and every ISA this CPU has.
//!
//! These tests switch the process-wide ISA (`set_isa`), so they live in their own
//! test binary and take a lock around every switch.
//!
//! Tolerance. Quantized weights are multiplied with activations quantized to 8 bits
//! per block of 32 elements, each element off by at most half a step,
//! `max|x_block| / 254`. So against the exact dot product of the dequantized
//! weights with the original f32 activations (in f64), an output may be off by
//!
//! ```text
//! sum over blocks b of (max|x_b| / 254) * sum_{i in b} |w_i|     (the 8-bit bound)
//!   + 2e-6 * sum_i |w_i x_i| + 1e-6                              (f32 accumulation)
//! ```
//!
//! which is a worst case, not a statistical guess, so the test cannot be flaky; the
//! typical error is about 1/10 of it. With `Precision::Accurate` activations have 16
//! bits, steps of `max|x_block| / 32512`, so the first line becomes
//! `sum over b of 0.51 * (max|x_b| / 32512) * sum |w_i|` (half a step, and room for
//! the rounding of `x * (1 / d)` near 32512). Plain f32, f16 and bf16 weights use
//! only the second line.

mod common;

use std::sync::Mutex;

use common::{ALL, Rng, random_input, random_matrix};
use sluice_core::quant::dequantize_row;
use sluice_core::{DType, MatRef, Precision};
use sluice_cpu::{
    Isa, Product, dot_f32, dot_row, isa, matmul, matmul_grouped, matmul_many, row_to_f32, set_avx2_vnni, set_isa,
};

static ISA_LOCK: Mutex<()> = Mutex::new(());

/// Every kernel variant this CPU can run: an ISA, and for AVX2 with and without AVX-VNNI.
fn variants() -> Vec<(Isa, bool)> {
    let mut v = vec![];
    for want in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon] {
        if set_isa(want) {
            v.push((want, true));
            if want == Isa::Avx2 {
                v.push((want, false));
            }
        }
    }
    // Every aarch64 CPU has NEON; make sure its kernels are among those tested.
    #[cfg(target_arch = "aarch64")]
    assert!(v.iter().any(|&(i, _)| i == Isa::Neon));
    v
}

fn select((which, vnni): (Isa, bool)) {
    assert!(set_isa(which));
    set_avx2_vnni(vnni);
}

fn best() -> (Isa, bool) {
    *variants().last().unwrap()
}

const PRECISIONS: [Precision; 2] = [Precision::Fast, Precision::Accurate];

fn run(dtype: DType, bytes: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, p: Precision) -> Vec<f32> {
    let w = MatRef::new(dtype, rows, cols, bytes).unwrap();
    let mut out = vec![f32::NAN; n * rows];
    matmul(w, x, n, &mut out, p);
    out
}

/// The largest error activation quantization (as `act.rs` does it) leaves in a
/// block: half a step, of 8 bits or with `Accurate` of 16.
fn block_step(xb: &[f32], p: Precision) -> f64 {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    match p {
        Precision::Fast => amax / 254.0,
        Precision::Accurate => 0.51 * amax / 32512.0,
    }
}

/// The exact result (f64 over the dequantized weights and original activations) and
/// the tolerance described at the top of this file, per output.
fn reference(
    dtype: DType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    p: Precision,
) -> (Vec<f64>, Vec<f64>) {
    let rb = bytes.len() / rows;
    // Activations are quantized in blocks of 32 for every format.
    let blk = if dtype.is_quantized() { 32 } else { cols };
    let mut want = vec![0f64; n * rows];
    let mut tol = vec![0f64; n * rows];
    let mut wrow = vec![0f32; cols];
    for r in 0..rows {
        dequantize_row(dtype, &bytes[r * rb..(r + 1) * rb], &mut wrow);
        for t in 0..n {
            let xr = &x[t * cols..(t + 1) * cols];
            let exact: f64 = wrow.iter().zip(xr).map(|(&w, &x)| w as f64 * x as f64).sum();
            let abs: f64 = wrow.iter().zip(xr).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
            let mut qerr = 0f64;
            if dtype.is_quantized() {
                for (wb, xb) in wrow.chunks(blk).zip(xr.chunks(blk)) {
                    qerr += block_step(xb, p) * wb.iter().map(|w| w.abs() as f64).sum::<f64>();
                }
            }
            want[t * rows + r] = exact;
            tol[t * rows + r] = qerr * 1.001 + 2e-6 * abs + 1e-6;
        }
    }
    (want, tol)
}

fn check_close(what: &str, got: &[f32], want: &[f64], tol: &[f64]) {
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        assert!((g as f64 - w).abs() <= t, "{what}: output {i}: {g} vs exact {w} (tolerance {t})");
    }
}

fn assert_bitwise(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: output {i}: {x} vs {y}");
    }
}

fn shapes(dtype: DType) -> Vec<(usize, usize)> {
    // Rows not a multiple of any tile (16, 8, 4), a single row, and whole tiles; rows
    // of one block, and rows long enough to span several segments (kernel.rs and
    // seg.rs: a segment is at most 512 to 1024 bytes of each row).
    let rows = [1, 7, 37, 64];
    let cols: &[usize] = match dtype.block_elems() {
        256 => &[256, 768, 2304, 4352],
        32 => &[32, 96, 544, 1696],
        _ => &[1, 16, 33, 100, 1000],
    };
    rows.iter().flat_map(|&r| cols.iter().map(move |&c| (r, c))).collect()
}

/// Every format, every variant, both precisions, odd shapes, n = 1, 3, 17: close to
/// the exact result, and bitwise equal to the scalar kernels.
#[test]
fn all_formats_all_isas_match_reference() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(1);
    for dtype in ALL {
        for (rows, cols) in shapes(dtype) {
            let bytes = random_matrix(dtype, rows, cols, &mut rng);
            for (n, p) in [1, 3, 17].into_iter().flat_map(|n| PRECISIONS.map(|p| (n, p))) {
                let x = random_input(n, cols, &mut rng);
                let (want, tol) = reference(dtype, &bytes, rows, cols, &x, n, p);
                let mut first: Option<Vec<f32>> = None;
                for v in variants() {
                    select(v);
                    let got = run(dtype, &bytes, rows, cols, &x, n, p);
                    let what = format!("{dtype} {v:?} {p:?} [{rows}x{cols}] n={n}");
                    check_close(&what, &got, &want, &tol);
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert_bitwise(&format!("{what} vs scalar"), &got, f),
                    }
                }
            }
        }
    }
    select(best());
}

/// A prefill-sized batch (n = 128, several panel passes and a remainder group) and
/// decode-path batches of a few rows (n = 3, 6, 7: passes with spare slots, or
/// groups of 4 and 2; n = 8) give bitwise the rows of one-token calls, on every
/// variant and at both precisions.
#[test]
fn batch_equals_one_token_at_a_time() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(2);
    for dtype in ALL {
        for n in [3, 6, 7, 8, 128] {
            let (rows, cols) = (21, if dtype.block_elems() == 256 { 512 } else { 160 });
            let bytes = random_matrix(dtype, rows, cols, &mut rng);
            let x = random_input(n, cols, &mut rng);
            for p in PRECISIONS {
                let (want, tol) = reference(dtype, &bytes, rows, cols, &x, n, p);
                for v in variants() {
                    select(v);
                    let batch = run(dtype, &bytes, rows, cols, &x, n, p);
                    check_close(&format!("{dtype} {v:?} {p:?} n={n}"), &batch, &want, &tol);
                    for t in [0, 1, 7, 8, 64, 120, 127].into_iter().filter(|&t| t < n) {
                        let one = run(dtype, &bytes, rows, cols, &x[t * cols..(t + 1) * cols], 1, p);
                        let what = format!("{dtype} {v:?} {p:?} token {t}");
                        assert_bitwise(&what, &batch[t * rows..(t + 1) * rows], &one);
                    }
                }
            }
        }
    }
    select(best());
}

/// The same call in pools of 1, 2 and 3 threads gives bitwise the same output, for
/// matrices big enough to be split.
#[test]
fn thread_count_does_not_change_results() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(3);
    for dtype in ALL {
        let (rows, cols) = (389, 1024);
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        for (n, p) in [1, 5].into_iter().flat_map(|n| PRECISIONS.map(|p| (n, p))) {
            let x = random_input(n, cols, &mut rng);
            for v in variants() {
                select(v);
                let outs: Vec<Vec<f32>> = [1, 2, 3]
                    .iter()
                    .map(|&t| {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
                        pool.install(|| run(dtype, &bytes, rows, cols, &x, n, p))
                    })
                    .collect();
                assert_bitwise(&format!("{dtype} {v:?} {p:?} n={n}: 1 vs 2 threads"), &outs[0], &outs[1]);
                assert_bitwise(&format!("{dtype} {v:?} {p:?} n={n}: 1 vs 3 threads"), &outs[0], &outs[2]);
            }
        }
    }
    select(best());
}

/// `dot_row` on a quantized row is that row of a `Fast` `matmul`; on plain rows it is close
/// to the f64 dot product.
#[test]
fn dot_row_all_formats() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(4);
    for dtype in ALL {
        let cols = if dtype.block_elems() == 256 { 512 } else { 96 };
        let bytes = random_matrix(dtype, 3, cols, &mut rng);
        let x = random_input(1, cols, &mut rng);
        let (want, tol) = reference(dtype, &bytes, 3, cols, &x, 1, Precision::Fast);
        for v in variants() {
            select(v);
            let m = run(dtype, &bytes, 3, cols, &x, 1, Precision::Fast);
            let rb = bytes.len() / 3;
            for r in 0..3 {
                let d = dot_row(dtype, &bytes[r * rb..(r + 1) * rb], &x);
                let what = format!("{dtype} {v:?} row {r}");
                let plain_tol = 1e-5 * (1.0 + want[r].abs());
                assert!((d as f64 - want[r]).abs() <= tol[r].max(plain_tol), "{what}: {d} vs {}", want[r]);
                if dtype.is_quantized() {
                    assert_eq!(d.to_bits(), m[r].to_bits(), "{what}: dot_row vs matmul");
                }
            }
        }
    }
    select(best());
}

/// `dot_f32` on every variant and on lengths that exercise the vector body and tail.
#[test]
fn dot_f32_all_isas() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for n in [1, 7, 8, 31, 64, 100, 257] {
        let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0).collect();
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        for v in variants() {
            select(v);
            let got = dot_f32(&a, &b) as f64;
            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{v:?} n={n}: {got} vs {want}");
        }
    }
    select(best());
}

/// `row_to_f32` is the reference dequantizer, bit for bit, whatever the ISA.
#[test]
fn row_to_f32_is_reference() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(5);
    for dtype in ALL {
        let cols = 512;
        let bytes = random_matrix(dtype, 2, cols, &mut rng);
        let mut want = vec![0f32; cols];
        dequantize_row(dtype, &bytes[..bytes.len() / 2], &mut want);
        for v in variants() {
            select(v);
            let mut got = vec![0f32; cols];
            row_to_f32(dtype, &bytes[..bytes.len() / 2], &mut got);
            assert_bitwise(&format!("{dtype} {v:?}"), &got, &want);
        }
    }
    select(best());
    assert_eq!(isa(), best().0);
}

/// Edge-case scales through the kernels: MXFP4's subnormal e8m0 exponents (0, 1) and
/// their neighbours, and subnormal or zero f16 scales, on every variant.
#[test]
fn extreme_scales() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(6);
    let (rows, cols, n) = (19, 256, 3);
    let x = random_input(n, cols, &mut rng);
    for dtype in [DType::MXFP4, DType::Q4_0, DType::Q8_0, DType::Q4_1, DType::Q4K, DType::Q6K] {
        let mut bytes = random_matrix(dtype, rows, cols, &mut rng);
        let bb = dtype.block_bytes();
        let tiny = [0u16, 1, 0x0200, 0x03FF, 0x0400, 0x8001];
        for (b, blk) in bytes.chunks_exact_mut(bb).enumerate() {
            let h = tiny[b % tiny.len()].to_le_bytes();
            match dtype {
                DType::MXFP4 => blk[0] = [0u8, 1, 2, 3, 127, 130][b % 6],
                DType::Q6K => blk[208..210].copy_from_slice(&h),
                _ => blk[0..2].copy_from_slice(&h),
            }
        }
        for p in PRECISIONS {
            let (want, tol) = reference(dtype, &bytes, rows, cols, &x, n, p);
            let mut first: Option<Vec<f32>> = None;
            for v in variants() {
                select(v);
                let got = run(dtype, &bytes, rows, cols, &x, n, p);
                check_close(&format!("{dtype} {v:?} {p:?}"), &got, &want, &tol);
                match &first {
                    None => first = Some(got),
                    Some(f) => assert_bitwise(&format!("{dtype} {v:?} {p:?} vs scalar"), &got, f),
                }
            }
        }
    }
    select(best());
}

/// `Accurate` is what it claims: on every format its mean error against the exact
/// result is a small fraction of `Fast`'s (8 more bits should give about 1/250; the
/// bound here leaves room for the f32 accumulation both share).
#[test]
fn accurate_is_much_closer_than_fast() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    select(best());
    let mut rng = Rng(7);
    for dtype in ALL.into_iter().filter(|d| d.is_quantized()) {
        let (rows, cols, n) = (64, 1024, 4);
        let bytes = random_matrix(dtype, rows, cols, &mut rng);
        let x = random_input(n, cols, &mut rng);
        let (want, _) = reference(dtype, &bytes, rows, cols, &x, n, Precision::Fast);
        let err = |p| {
            let got = run(dtype, &bytes, rows, cols, &x, n, p);
            got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).sum::<f64>() / want.len() as f64
        };
        let (fast, accurate) = (err(Precision::Fast), err(Precision::Accurate));
        assert!(fast > 0.0 && accurate < fast / 30.0, "{dtype}: mean error fast {fast:e}, accurate {accurate:e}");
    }
}

/// `matmul_many` gives each matrix bitwise what `matmul` alone gives: mixed formats
/// (so several activation kinds), both precisions, one token and a batch, and rows
/// that do not fill a tile.
#[test]
fn matmul_many_equals_separate_calls() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    select(best());
    let mut rng = Rng(8);
    let cols = 512;
    let mats: Vec<(DType, usize, Vec<u8>)> = [(DType::Q4K, 37), (DType::Q6K, 300), (DType::Q8_0, 16), (DType::Q4K, 5)]
        .into_iter()
        .map(|(d, rows)| (d, rows, random_matrix(d, rows, cols, &mut rng)))
        .collect();
    let ws: Vec<MatRef> = mats.iter().map(|(d, r, b)| MatRef::new(*d, *r, cols, b).unwrap()).collect();
    for (n, p) in [1, 5].into_iter().flat_map(|n| PRECISIONS.map(|p| (n, p))) {
        let x = random_input(n, cols, &mut rng);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
        let mut bufs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| matmul_many(&ws, &x, n, &mut bufs, p));
        for (i, ((d, rows, bytes), got)) in mats.iter().zip(&outs).enumerate() {
            let want = run(*d, bytes, *rows, cols, &x, n, p);
            assert_bitwise(&format!("matrix {i} ({d}) {p:?} n={n}"), got, &want);
        }
    }
}

/// `matmul_grouped` gives each product bitwise what `matmul` alone gives: products
/// with inputs of their own and one shared, rows from 1 to 9 (one-row, decode-path
/// and panel kernels in one call), quantized and plain formats, both precisions.
#[test]
fn matmul_grouped_equals_separate_calls() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    select(best());
    let mut rng = Rng(10);
    let cols = 512;
    let shapes =
        [(DType::Q4K, 48, 3), (DType::Q6K, 300, 1), (DType::Q4K, 37, 9), (DType::Q8_0, 16, 2), (DType::F16, 20, 3)];
    let mats: Vec<(DType, usize, usize, Vec<u8>)> =
        shapes.into_iter().map(|(d, rows, n)| (d, rows, n, random_matrix(d, rows, cols, &mut rng))).collect();
    let inputs: Vec<Vec<f32>> = mats.iter().map(|&(_, _, n, _)| random_input(n, cols, &mut rng)).collect();
    for (k, p) in PRECISIONS.into_iter().enumerate() {
        // The first two products share an input (as an expert's gate and up do),
        // and the precision alternates product by product.
        let x_of = |i: usize| if i == 1 { &inputs[0][..cols] } else { &inputs[i][..] };
        let n_of = |i: usize| if i == 1 { 1 } else { mats[i].2 };
        let prec = |i: usize| PRECISIONS[(i + k) % 2];
        let mut outs: Vec<Vec<f32>> = (0..mats.len()).map(|i| vec![f32::NAN; n_of(i) * mats[i].1]).collect();
        let mut products: Vec<Product> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, out)| {
                let (d, rows, _, bytes) = &mats[i];
                let w = MatRef::new(*d, *rows, cols, bytes).unwrap();
                Product { w, x: x_of(i), n: n_of(i), out, precision: prec(i) }
            })
            .collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| matmul_grouped(&mut products));
        for (i, got) in outs.iter().enumerate() {
            let (d, rows, _, bytes) = &mats[i];
            let want = run(*d, bytes, *rows, cols, x_of(i), n_of(i), prec(i));
            assert_bitwise(&format!("product {i} ({d}) {:?}, pass {p:?}", prec(i)), got, &want);
        }
    }
}

/// A 16-bit KV cache's rows convert to f32 exactly on every ISA (sixteen, eight and
/// one at a time): normal, subnormal, zero and infinite values, every length to 40.
#[test]
fn f16_rows_convert_exactly() {
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(11);
    let special = [0.0f32, -0.0, 1e-7, -3e-6, 65504.0, f32::INFINITY, f32::NEG_INFINITY];
    let vals: Vec<half::f16> = (0..40)
        .map(|i| half::f16::from_f32(if i % 5 == 0 { special[i / 5 % 7] } else { rng.range(-300.0, 300.0) }))
        .collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    for v in variants() {
        select(v);
        for n in 0..=40 {
            let mut out = vec![f32::NAN; n];
            sluice_cpu::dot::f16_to_f32(&bytes[..2 * n], &mut out);
            let want: Vec<f32> = vals[..n].iter().map(|h| h.to_f32()).collect();
            assert_bitwise(&format!("{v:?} n={n}"), &out, &want);
        }
    }
    select(best());
}

/// A TurboQuant cache's codes decode to their centroid times the norm on every ISA
/// (sixteen, eight at a time), at every width, for runs of 8 to 136 codes, and a
/// cache decodes whole heads alike on every ISA.
#[test]
fn kv_codes_unpack_to_their_centroids() {
    use sluice_cpu::kv::{Codebook, unpack};
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(5);
    for bits in 2..=4u32 {
        let book = Codebook::lloyd_max(bits, 128);
        let bytes: Vec<u8> = (0..17 * bits).map(|_| rng.byte()).collect();
        // The codes as the writer packs them: eight in each `bits` bytes, first code lowest.
        let codes: Vec<usize> = bytes
            .chunks(bits as usize)
            .flat_map(|g| {
                let w = g.iter().rev().fold(0u32, |w, &b| w << 8 | b as u32);
                (0..8).map(move |i| (w >> (i * bits) & ((1 << bits) - 1)) as usize)
            })
            .collect();
        let norm = 3.7f32;
        for v in variants() {
            select(v);
            for n in (8..=136).step_by(8) {
                let mut out = vec![f32::NAN; n];
                unpack(&book, norm, &bytes, &mut out);
                let want: Vec<f32> = codes[..n].iter().map(|&c| book.centroids()[c] * norm).collect();
                assert_bitwise(&format!("{v:?} {bits} bits n={n}"), &out, &want);
            }
        }
    }
    // A whole head through a cache, every width (3.5 bits: halves of 4 and 3).
    use sluice_core::{KvFormat, KvLayout, TurboBits};
    for bits in [TurboBits::Two, TurboBits::Three, TurboBits::ThreeHalf, TurboBits::Four] {
        for hd in [64, 128, 256] {
            let format = KvFormat::Turbo(bits);
            let layout = KvLayout { seed: 1, ..KvLayout::plain(2 * hd, hd, format) };
            let mut cache = sluice_cpu::KvCache::with_layout(&layout).unwrap();
            let row = random_input(1, 2 * hd, &mut rng);
            cache.append(&row, &row);
            let decoded = |v: (Isa, bool)| {
                select(v);
                let mut out = vec![f32::NAN; 2 * hd];
                cache.key_into(0, 0, &mut out[..hd]);
                cache.value_into(0, 1, &mut out[hd..]);
                out
            };
            let want = decoded((Isa::Scalar, false));
            for v in variants() {
                assert_bitwise(&format!("{v:?} {format:?} head {hd}"), &decoded(v), &want);
            }
        }
    }
    select(best());
}

/// Attention's tile products give the bits of their definitions on every ISA and for
/// any number of queries: a score is one fused multiply-add chain over the channels in
/// order, a value sum one chain per channel over the positions in order, each starting
/// from what the accumulator held. Query counts that fill no vector, head dims that are
/// no multiple of sixteen, key ranges that start inside the tile.
#[test]
fn attention_tiles_keep_their_chains() {
    use sluice_cpu::tile::{Lanes, scores, values};
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(9);
    for (hd, queries) in [(64, 1), (128, 6), (128, 19), (256, 8), (72, 3), (8, 17), (3, 2), (96, 5)] {
        let len = 37;
        let q = random_input(queries, hd, &mut rng);
        let keys = random_input(len, hd, &mut rng);
        // Weights position-major, as attention keeps them: `w[t * queries + i]`.
        let w = random_input(len, queries, &mut rng);
        let start = random_input(queries, hd, &mut rng);
        let rows = 5..len;
        let lanes = Lanes::new(&q, hd);
        let want_score = |i: usize, t: usize| (0..hd).fold(0f32, |a, d| keys[t * hd + d].mul_add(q[i * hd + d], a));
        let mut want_acc = start.clone();
        for (i, acc) in want_acc.chunks_mut(hd).enumerate() {
            for t in rows.clone() {
                acc.iter_mut().enumerate().for_each(|(c, a)| *a = w[t * queries + i].mul_add(keys[t * hd + c], *a));
            }
        }
        for v in variants() {
            select(v);
            let mut got = vec![f32::NAN; len * lanes.width()];
            scores(&lanes, &keys, rows.clone(), &mut got);
            for i in 0..queries {
                let got: Vec<f32> = rows.clone().map(|t| got[t * lanes.width() + i]).collect();
                let want: Vec<f32> = rows.clone().map(|t| want_score(i, t)).collect();
                assert_bitwise(&format!("scores {v:?} head_dim {hd}, query {i} of {queries}"), &got, &want);
            }
            let mut acc = start.clone();
            let value_rows: Vec<&[f32]> = rows.clone().map(|t| &keys[t * hd..(t + 1) * hd]).collect();
            values(&mut acc, hd, (&w[rows.start * queries..], queries), &value_rows);
            assert_bitwise(&format!("values {v:?} head_dim {hd}, {queries} queries"), &acc, &want_acc);
        }
    }
    select(best());
}

/// Scores read straight from a TurboQuant cache's codes (AVX-512) are the bits of the
/// general kernel on the keys the cache decodes, on every ISA: every width, heads of one
/// and of several rotation blocks, runs that start and end inside blocks, a ring's wrap,
/// query counts that fill no vector and more than one.
#[test]
fn key_scores_from_codes_keep_their_chains() {
    use sluice_core::{KvFormat, KvLayout, TurboBits};
    use sluice_cpu::tile::{Lanes, scores};
    let _g = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    select(best());
    let mut rng = Rng(11);
    let mut checked = 0;
    for bits in [TurboBits::Two, TurboBits::Three, TurboBits::ThreeHalf, TurboBits::Four] {
        for (hd, window) in [(64, None), (128, None), (256, None), (576, None), (128, Some(40))] {
            let layout = KvLayout { seed: 3, window, ..KvLayout::plain(2 * hd, hd, KvFormat::Turbo(bits)) };
            let mut cache = sluice_cpu::KvCache::with_layout(&layout).unwrap();
            let len = 75;
            let rows = random_input(len, 2 * hd, &mut rng);
            cache.append(&rows, &rows);
            if !cache.scores_from_codes() {
                eprintln!("key_scores_from_codes_keep_their_chains: this CPU has no AVX-512; nothing to compare");
                return;
            }
            for queries in [1, 6, 8, 13, 19] {
                let q = random_input(queries, hd, &mut rng);
                let lanes = Lanes::new(&q, hd);
                let width = lanes.width();
                for run in [cache.first()..len, cache.first() + 3..cache.first() + 4, len - 20..len - 1] {
                    let n = run.len();
                    let (mut k, mut v) = (vec![0f32; n * hd], vec![0f32; n * hd]);
                    cache.run_into(run.clone(), 1, &mut k, &mut v);
                    let mut want = vec![f32::NAN; n * width];
                    select(best());
                    let mut got = vec![f32::NAN; n * width];
                    let mut scratch = vec![0f32; 32 * hd];
                    cache.key_scores(run.clone(), 1, &lanes, &mut got, &mut scratch);
                    for v in variants() {
                        select(v);
                        scores(&lanes, &k, 0..n, &mut want);
                        for t in 0..n {
                            let what =
                                format!("{v:?} {bits:?} head {hd} {window:?}, {queries} queries, {run:?} row {t}");
                            assert_bitwise(
                                &what,
                                &got[t * width..t * width + queries],
                                &want[t * width..t * width + queries],
                            );
                            assert!(
                                got[t * width + queries..(t + 1) * width].iter().all(|&x| x == 0.0),
                                "{what}: padding"
                            );
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    select(best());
    assert_eq!(checked, 4 * 5 * 5 * 3);
}
