//! gpt-oss's Hugging Face experts, rearranged once at open into the layout sluice
//! computes on.
//!
//! transformers keeps a layer's experts input-major, as `x @ W` multiplies them:
//! `mlp.experts.gate_up_proj [E, H, 2I]` with the gate and up columns interleaved
//! (gate is column `2i`, up `2i + 1`), `mlp.experts.down_proj [E, I, H]`, and the
//! biases `gate_up_proj_bias [E, 2I]` (interleaved the same way) and `down_proj_bias
//! [E, H]`. sluice's products read a weight as `[out, in]` rows, so each layer's
//! experts are copied once, at open, into this process's memory as
//! `mlp.experts.gate_proj [E, I, H]`, `up_proj [E, I, H]` and `down_proj [E, H, I]`,
//! with the gate and up biases apart: the layout llama.cpp's converter writes to GGUF.
//! The copies are in no file, so the expert store serves them where they are
//! (`mapped`); a GGUF or a `sluice pack` of the folder streams from disk.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use sluice_core::{DType, Error, ModelSpec, Result};

use crate::mapped::{MappedFile, TensorView};

/// One rearranged tensor before its bytes have a home: name, type, shape, and where
/// in the shared buffer it starts.
struct Placed {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// Replaces every layer's Hugging Face expert tensors in `tensors` by the rearranged
/// ones (see the module docs). `prefix` is the model's module path (`model.`).
pub(crate) fn rearrange(
    dir: &Path,
    prefix: &str,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
) -> Result<()> {
    let h = spec.hidden_size;
    let mut buf: Vec<u8> = Vec::new();
    let mut placed: Vec<Placed> = Vec::new();
    let mut place = |name: String, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>| {
        let offset = buf.len().next_multiple_of(64);
        buf.resize(offset, 0);
        buf.extend_from_slice(&bytes);
        placed.push(Placed { name, dtype, shape, offset, len: bytes.len() });
    };
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(moe) = &layer.moe else { continue };
        let (e, i) = (moe.n_experts, moe.intermediate);
        let base = format!("{prefix}layers.{l}.mlp.experts.");
        let take = |tensors: &mut HashMap<String, TensorView>, name: &str, shape: &[usize]| -> Result<TensorView> {
            let full = format!("{base}{name}");
            let t = tensors.remove(&full).ok_or_else(|| missing(dir, &full))?;
            if t.shape != shape {
                return Err(Error::TensorShape {
                    path: t.path().to_path_buf(),
                    name: t.name.clone(),
                    expected: format!("shape {shape:?}"),
                    got: format!("shape {:?}", t.shape),
                });
            }
            if t.dtype.block_elems() != 1 {
                return Err(Error::format(
                    t.path(),
                    format!("tensor '{}' is {}, not a plain float type", t.name, t.dtype),
                ));
            }
            Ok(t)
        };
        let gu = take(tensors, "gate_up_proj", &[e, h, 2 * i])?;
        let down = take(tensors, "down_proj", &[e, i, h])?;
        let gub = take(tensors, "gate_up_proj_bias", &[e, 2 * i])?;
        // gate[x][r][c] = gu[x][c][2r], up[x][r][c] = gu[x][c][2r + 1].
        for (half, what) in [(0, "gate_proj"), (1, "up_proj")] {
            let bytes = gather(&gu, e, i * h, |r| {
                let (row, col) = (r / h, r % h);
                col * 2 * i + 2 * row + half
            });
            place(format!("{base}{what}"), gu.dtype, vec![e, i, h], bytes);
            let bias = gather(&gub, e, i, |r| 2 * r + half);
            place(format!("{base}{what}_bias"), gub.dtype, vec![e, i], bias);
        }
        // down[x][r][c] = down_hf[x][c][r].
        let bytes = gather(&down, e, h * i, |r| {
            let (row, col) = (r / i, r % i);
            col * h + row
        });
        place(format!("{base}down_proj"), down.dtype, vec![e, h, i], bytes);
    }
    if placed.is_empty() {
        return Ok(());
    }
    let file: Arc<MappedFile> = MappedFile::in_memory(dir, &buf)?;
    for p in placed {
        let t = TensorView::new(p.name.clone(), p.dtype, p.shape, file.clone(), p.offset, p.len)?;
        tensors.insert(p.name, t);
    }
    Ok(())
}

/// `per` elements for each of `t`'s `outer` slices (experts): element `j` of a slice
/// is element `src(j)` of the same slice of `t`.
fn gather(t: &TensorView, outer: usize, per: usize, src: impl Fn(usize) -> usize) -> Vec<u8> {
    let es = t.dtype.block_bytes();
    let b = t.bytes();
    let from_len = b.len() / outer;
    let mut out = vec![0u8; outer * per * es];
    for (from, to) in b.chunks_exact(from_len).zip(out.chunks_exact_mut(per * es)) {
        for (j, dst) in to.chunks_exact_mut(es).enumerate() {
            let s = src(j) * es;
            dst.copy_from_slice(&from[s..s + es]);
        }
    }
    out
}

fn missing(dir: &Path, name: &str) -> Error {
    Error::MissingTensor { path: dir.to_path_buf(), name: name.to_string() }
}
