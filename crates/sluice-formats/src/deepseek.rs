//! DeepSeek's latent up-projection, split per head at open.
//!
//! A Hugging Face folder (and a GGUF from an older converter) holds one
//! `kv_b_proj [heads * (nope + v), kv_lora_rank]`: per head, `nope` rows that make the
//! keys from the latent, then `v` rows that make the values. Attention in the absorbed
//! form (the engine's `mla.rs`) needs each head's key rows transposed, `[kv_lora_rank,
//! nope]`, to take a query into the latent space, and its value rows as they are. Newer
//! GGUFs store exactly those as `attn_k_b [heads, kv_lora_rank, nope]` and `attn_v_b
//! [heads, v, kv_lora_rank]`; here the older forms are split into the same two tensors,
//! in this process's memory (they are resident weights, a few MB a layer).

use std::collections::HashMap;
use std::path::Path;

use sluice_core::{Error, MlaSpec, ModelSpec, Result};

use crate::mapped::{MappedFile, TensorView, check_shape};
use crate::names::{TensorId, TensorKind};

/// Adds `AttnKB` and `AttnVB` (named by `name`) for every layer that has a
/// `kv_b_proj` (named likewise) but not the split pair.
pub(crate) fn split_kv_b(
    path: &Path,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
    name: impl Fn(TensorId) -> String,
) -> Result<()> {
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(m) = layer.attention.mla else { continue };
        let (kb, vb) = (name(TensorId::layer(l, TensorKind::AttnKB)), name(TensorId::layer(l, TensorKind::AttnVB)));
        if tensors.contains_key(&kb) && tensors.contains_key(&vb) {
            continue;
        }
        let src = name(TensorId::layer(l, TensorKind::AttnKvB));
        let t =
            tensors.get(&src).ok_or_else(|| Error::MissingTensor { path: path.to_path_buf(), name: src.clone() })?;
        let heads = layer.attention.n_heads;
        let (k, v) = split(t, heads, &m)?;
        let file = MappedFile::in_memory(t.path(), &[k.as_slice(), v.as_slice()].concat())?;
        let dtype = t.dtype;
        let k = TensorView::new(kb.clone(), dtype, vec![heads, m.kv_lora_rank, m.nope_dim], file.clone(), 0, k.len())?;
        let v = TensorView::new(vb.clone(), dtype, vec![heads, m.v_dim, m.kv_lora_rank], file, k.len_bytes(), v.len())?;
        tensors.insert(kb, k);
        tensors.insert(vb, v);
    }
    Ok(())
}

/// `kv_b`'s bytes as `(k_b, v_b)`: `k_b[h][c][d] = kv_b[h (nope + v) + d][c]` and
/// `v_b[h][e][c] = kv_b[h (nope + v) + nope + e][c]`.
fn split(t: &TensorView, heads: usize, m: &MlaSpec) -> Result<(Vec<u8>, Vec<u8>)> {
    let (c, dn, dv) = (m.kv_lora_rank, m.nope_dim, m.v_dim);
    check_shape(t.path(), &t.name, &t.shape, &[heads * (dn + dv), c])?;
    if t.dtype.is_quantized() {
        return Err(Error::Unsupported(format!(
            "{}: tensor '{}' is {}: a quantized kv_b cannot be split per head; convert the model with a llama.cpp \
             that writes attn_k_b and attn_v_b",
            t.path().display(),
            t.name,
            t.dtype
        )));
    }
    let es = t.dtype.block_bytes();
    let b = t.bytes();
    let at = |row: usize, col: usize| &b[(row * c + col) * es..(row * c + col + 1) * es];
    let mut k = Vec::with_capacity(heads * c * dn * es);
    let mut v = Vec::with_capacity(heads * dv * c * es);
    for h in 0..heads {
        let base = h * (dn + dv);
        for col in 0..c {
            for d in 0..dn {
                k.extend_from_slice(at(base + d, col));
            }
        }
        v.extend_from_slice(&b[(base + dn) * c * es..(base + dn + dv) * c * es]);
    }
    Ok((k, v))
}
