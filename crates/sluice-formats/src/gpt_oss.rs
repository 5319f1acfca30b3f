//! gpt-oss's Hugging Face experts, rearranged once into the layout sluice computes on.
//!
//! transformers keeps a layer's experts in one of two forms:
//! - float, input-major as `x @ W` multiplies them: `mlp.experts.gate_up_proj [E, H, 2I]`
//!   (gate is column `2i`, up `2i + 1`) and `down_proj [E, I, H]`;
//! - MXFP4, as the published checkpoints are: `gate_up_proj_blocks [E, 2I, H/32, 16]`
//!   and `gate_up_proj_scales [E, 2I, H/32]` (bytes; output rows, gate rows even, up
//!   rows odd), `down_proj_blocks [E, H, I/32, 16]` and `down_proj_scales`; a block's
//!   byte `j` holds elements `2j` (low nibble) and `2j + 1` (high), its scale byte is
//!   the e8m0 exponent.
//!
//! and in both `gate_up_proj_bias [E, 2I]` (interleaved the same way) and
//! `down_proj_bias [E, H]`. sluice's products read a weight as `[out, in]` rows, in
//! GGUF's MXFP4 blocks where the codes are MXFP4 (17 bytes: the exponent, then byte
//! `j` holding elements `j` (low nibble) and `j + 16` (high)). So each layer's experts
//! are rewritten as `mlp.experts.gate_proj [E, I, H]`, `up_proj [E, I, H]` and
//! `down_proj [E, H, I]`, with the gate and up biases apart: the layout llama.cpp's
//! converter writes. The values are the same; only their places change.
//!
//! The rewrite goes to a file in sluice's cache (`$SLUICE_CACHE_DIR/gpt-oss`, named by
//! the source files' identity), written once and mapped after: the experts are then
//! served from it like any file's, streamed or mapped, and a model larger than memory
//! is rearranged without holding it. Where sluice's cache cannot be written the file
//! goes to the temporary folder; a write that fails there too (a full disk) is an
//! error naming the file.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_core::cache::{cache_dir, fnv64};
use sluice_core::{DType, Error, ModelSpec, Result};

use crate::mapped::{MappedFile, TensorView, check_shape};
use crate::safetensors::ByteTensor;

/// Bumped whenever the rewritten layout changes, so older cache files are not read.
const LAYOUT_VERSION: &[u8] = b"gpt-oss experts v1";

/// Each rewritten tensor starts at a multiple of this (the page and O_DIRECT unit).
const ALIGN: usize = 4096;

/// A layer's experts as the checkpoint holds them.
enum Source {
    Float { gate_up: TensorView, down: TensorView },
    Mxfp4 { gate_up: (ByteTensor, ByteTensor), down: (ByteTensor, ByteTensor) },
}

/// One layer's checked sources and its geometry.
struct Layer {
    base: String,
    e: usize,
    i: usize,
    h: usize,
    source: Source,
    bias: TensorView,
}

/// How a rewritten tensor is made from its layer's sources.
#[derive(Clone, Copy)]
enum Part {
    Gate,
    Up,
    Down,
    GateBias,
    UpBias,
}

/// One rewritten tensor: its name, type, shape and place in the output.
struct Out {
    layer: usize,
    part: Part,
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// Replaces every layer's Hugging Face expert tensors (in `tensors`, or the byte tensors
/// in `bytes`) by the rewritten ones (see the module docs). `prefix` is the model's
/// module path (`model.`).
pub(crate) fn rearrange(
    dir: &Path,
    prefix: &str,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
    bytes: &mut HashMap<String, ByteTensor>,
) -> Result<()> {
    let layers = take_sources(dir, prefix, spec, tensors, bytes)?;
    let outs = plan(&layers);
    let Some(total) = outs.last().map(|o| o.offset + o.len) else { return Ok(()) };
    let file = cached_file(dir, &layers, &outs, total)?;
    for o in outs {
        let t = TensorView::new(o.name.clone(), o.dtype, o.shape, file.clone(), o.offset, o.len)?;
        tensors.insert(o.name, t);
    }
    Ok(())
}

/// Takes each MoE layer's expert tensors out of the maps, checking their shapes and
/// types against the spec before any byte is read.
fn take_sources(
    dir: &Path,
    prefix: &str,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
    bytes: &mut HashMap<String, ByteTensor>,
) -> Result<Vec<Layer>> {
    let h = spec.hidden_size;
    let mut out = Vec::new();
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(moe) = &layer.moe else { continue };
        let (e, i) = (moe.n_experts, moe.intermediate);
        let base = format!("{prefix}layers.{l}.mlp.experts.");
        let float = |tensors: &mut HashMap<String, TensorView>, name: &str, shape: &[usize]| -> Result<TensorView> {
            let full = format!("{base}{name}");
            let t = tensors.remove(&full).ok_or_else(|| missing(dir, &full))?;
            check_shape(t.path(), &t.name, &t.shape, shape)?;
            if t.dtype.is_quantized() {
                return Err(Error::format(t.path(), format!("tensor '{}' is {}, not a float type", t.name, t.dtype)));
            }
            Ok(t)
        };
        let source = if bytes.contains_key(&format!("{base}gate_up_proj_blocks")) {
            if !h.is_multiple_of(32) || !i.is_multiple_of(32) {
                return Err(Error::format(
                    dir,
                    format!("MXFP4 experts need hidden ({h}) and intermediate ({i}) sizes in whole blocks of 32"),
                ));
            }
            let mut byte = |name: &str, shape: &[usize]| -> Result<ByteTensor> {
                let full = format!("{base}{name}");
                let t = bytes.remove(&full).ok_or_else(|| missing(dir, &full))?;
                check_shape(t.file().path(), &t.name, &t.shape, shape)?;
                Ok(t)
            };
            Source::Mxfp4 {
                gate_up: (
                    byte("gate_up_proj_blocks", &[e, 2 * i, h / 32, 16])?,
                    byte("gate_up_proj_scales", &[e, 2 * i, h / 32])?,
                ),
                down: (byte("down_proj_blocks", &[e, h, i / 32, 16])?, byte("down_proj_scales", &[e, h, i / 32])?),
            }
        } else {
            Source::Float {
                gate_up: float(tensors, "gate_up_proj", &[e, h, 2 * i])?,
                down: float(tensors, "down_proj", &[e, i, h])?,
            }
        };
        let bias = float(tensors, "gate_up_proj_bias", &[e, 2 * i])?;
        out.push(Layer { base, e, i, h, source, bias });
    }
    Ok(out)
}

/// The rewritten tensors in file order, each at an aligned offset.
fn plan(layers: &[Layer]) -> Vec<Out> {
    let mut outs = Vec::new();
    let mut at = 0usize;
    for (l, ly) in layers.iter().enumerate() {
        let (e, i, h) = (ly.e, ly.i, ly.h);
        let wt = match &ly.source {
            Source::Float { gate_up, .. } => gate_up.dtype,
            Source::Mxfp4 { .. } => DType::MXFP4,
        };
        let bt = ly.bias.dtype;
        let parts = [
            (Part::Gate, "gate_proj", wt, vec![e, i, h]),
            (Part::Up, "up_proj", wt, vec![e, i, h]),
            (Part::Down, "down_proj", wt, vec![e, h, i]),
            (Part::GateBias, "gate_proj_bias", bt, vec![e, i]),
            (Part::UpBias, "up_proj_bias", bt, vec![e, i]),
        ];
        for (part, what, dtype, shape) in parts {
            let len = shape[..shape.len() - 1].iter().product::<usize>()
                * dtype.bytes_for(shape[shape.len() - 1]).expect("whole blocks, checked");
            let offset = at.next_multiple_of(ALIGN);
            at = offset + len;
            outs.push(Out { layer: l, part, name: format!("{}{what}", ly.base), dtype, shape, offset, len });
        }
    }
    outs
}

/// The cache file for these sources, written now if it is not there yet; `None` when
/// no cache directory can be used.
fn cached_file(dir: &Path, layers: &[Layer], outs: &[Out], total: usize) -> Result<Arc<MappedFile>> {
    let name = format!("{:016x}.bin", source_key(dir, layers)?);
    // sluice's cache, else the temporary folder (for a home that cannot be written).
    let homes: Vec<PathBuf> =
        [cache_dir("gpt-oss"), Some(std::env::temp_dir().join("sluice-gpt-oss"))].into_iter().flatten().collect();
    let done = |p: &PathBuf| std::fs::metadata(p).is_ok_and(|m| m.len() == total as u64);
    if let Some(path) = homes.iter().map(|h| h.join(&name)).find(done) {
        return MappedFile::open(&path);
    }
    let mut failed = None;
    for home in &homes {
        let path = home.join(&name);
        match write_cache(dir, layers, outs, (home, &path), total) {
            Ok(()) => return MappedFile::open(&path),
            Err(e) => failed = Some(Error::io(&path, e)),
        }
    }
    Err(failed.expect("the temporary folder is always a home"))
}

/// Writes the rewrite to `path` in `home` (made if need be).
fn write_cache(
    dir: &Path,
    layers: &[Layer],
    outs: &[Out],
    (home, path): (&Path, &Path),
    total: usize,
) -> std::io::Result<()> {
    std::fs::create_dir_all(home)?;
    eprintln!(
        "sluice: rearranging the experts of {} into {} ({:.1} GB, once)",
        dir.display(),
        path.display(),
        total as f64 / 1e9
    );
    // Written beside its name and renamed over it, so a cut-off write is never read; two
    // openers at once (threads of one process too) each write their own.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp-{}-{n}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(&tmp)?);
        write_into(layers, outs, &mut f)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Names the sources: the layout version, the folder, and each source file's path,
/// length and modification time.
fn source_key(dir: &Path, layers: &[Layer]) -> Result<u64> {
    let mut files: Vec<PathBuf> = Vec::new();
    for ly in layers {
        let paths: Vec<&Path> = match &ly.source {
            Source::Float { gate_up, down } => vec![gate_up.path(), down.path()],
            Source::Mxfp4 { gate_up, down } => {
                vec![gate_up.0.file().path(), gate_up.1.file().path(), down.0.file().path(), down.1.file().path()]
            }
        };
        files.extend(paths.into_iter().chain([ly.bias.path()]).map(Path::to_path_buf));
    }
    files.sort();
    files.dedup();
    let dir = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let mut id = Vec::new();
    id.extend_from_slice(dir.as_os_str().as_encoded_bytes());
    for f in &files {
        let m = std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
        let mtime = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
        id.extend_from_slice(f.as_os_str().as_encoded_bytes());
        id.extend_from_slice(&m.len().to_le_bytes());
        id.extend_from_slice(&mtime.as_nanos().to_le_bytes());
    }
    Ok(fnv64(&[LAYOUT_VERSION, &id]))
}

/// Writes every rewritten tensor in order, zeros between them, one expert at a time.
fn write_into(layers: &[Layer], outs: &[Out], w: &mut dyn Write) -> std::io::Result<()> {
    let mut at = 0;
    for o in outs {
        w.write_all(&vec![0u8; o.offset - at])?;
        let ly = &layers[o.layer];
        for x in 0..ly.e {
            w.write_all(&expert_part(ly, o.part, x))?;
        }
        at = o.offset + o.len;
    }
    Ok(())
}

/// Expert `x`'s share of a rewritten tensor.
fn expert_part(ly: &Layer, part: Part, x: usize) -> Vec<u8> {
    let (i, h) = (ly.i, ly.h);
    match (part, &ly.source) {
        // gate[r][c] = gu[c][2r], up[r][c] = gu[c][2r + 1]: a transpose of the even or odd columns.
        (Part::Gate | Part::Up, Source::Float { gate_up, .. }) => {
            let half = matches!(part, Part::Up) as usize;
            gather(slice(gate_up.bytes(), ly.e, x), gate_up.dtype, i * h, |j| (j % h) * 2 * i + 2 * (j / h) + half)
        }
        // down[r][c] = down_hf[c][r].
        (Part::Down, Source::Float { down, .. }) => {
            gather(slice(down.bytes(), ly.e, x), down.dtype, h * i, |j| (j % i) * h + j / i)
        }
        (Part::Gate | Part::Up, Source::Mxfp4 { gate_up: (blocks, scales), .. }) => {
            let half = matches!(part, Part::Up) as usize;
            let (b, s) = (slice(blocks.bytes(), ly.e, x), slice(scales.bytes(), ly.e, x));
            let per_row = h / 32;
            let rows: Vec<usize> = (0..i).map(|r| 2 * r + half).collect();
            mxfp4_rows(b, s, per_row, &rows)
        }
        (Part::Down, Source::Mxfp4 { down: (blocks, scales), .. }) => {
            let (b, s) = (slice(blocks.bytes(), ly.e, x), slice(scales.bytes(), ly.e, x));
            mxfp4_rows(b, s, i / 32, &(0..h).collect::<Vec<_>>())
        }
        (Part::GateBias | Part::UpBias, _) => {
            let half = matches!(part, Part::UpBias) as usize;
            gather(slice(ly.bias.bytes(), ly.e, x), ly.bias.dtype, i, |j| 2 * j + half)
        }
    }
}

/// Expert `x`'s part of a tensor whose outermost dimension is the `e` experts.
fn slice(b: &[u8], e: usize, x: usize) -> &[u8] {
    let n = b.len() / e;
    &b[x * n..(x + 1) * n]
}

/// `n` elements of a plain type: element `j` is element `src(j)` of `from`.
fn gather(from: &[u8], dtype: DType, n: usize, src: impl Fn(usize) -> usize) -> Vec<u8> {
    let es = dtype.block_bytes();
    let mut out = vec![0u8; n * es];
    for (j, dst) in out.chunks_exact_mut(es).enumerate() {
        let s = src(j) * es;
        dst.copy_from_slice(&from[s..s + es]);
    }
    out
}

/// The given rows of one expert's Hugging Face MXFP4 codes (`blocks`, 16 bytes a block)
/// and exponents (`scales`, a byte a block), `per_row` blocks a row, as GGUF MXFP4 blocks.
fn mxfp4_rows(blocks: &[u8], scales: &[u8], per_row: usize, rows: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * per_row * 17);
    for &r in rows {
        for b in r * per_row..(r + 1) * per_row {
            let codes = &blocks[b * 16..(b + 1) * 16];
            // Element k is nibble k % 2 of byte k / 2; GGUF's byte j holds elements j and j + 16.
            let nib = |k: usize| (codes[k / 2] >> (4 * (k % 2))) & 0x0f;
            out.push(scales[b]);
            out.extend((0..16).map(|j| nib(j) | nib(j + 16) << 4));
        }
    }
    out
}

fn missing(dir: &Path, name: &str) -> Error {
    Error::MissingTensor { path: dir.to_path_buf(), name: name.to_string() }
}
