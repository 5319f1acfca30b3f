//! Qwen4-Exp's n-gram embedding tensors as a Hugging Face folder holds them, made into
//! the forms the engine reads: the table joined from its shards
//! (`ngram_embedding.shard_{k}.weight`, concatenated in the order of k, as transformers
//! loads them), the convolution `conv1d.weight [C, 1, K]` viewed as `[C, K]`, and the
//! saved hash constants (`layer_multipliers`, `ngram_heads_vocab_sizes`,
//! `ngram_heads_offsets`, int64) checked against the ones the spec computes, which the
//! engine uses.

use std::collections::HashMap;
use std::path::Path;

use sluice_core::{Error, ModelSpec, NgramSpec, Result};

use crate::mapped::{MappedFile, TensorView, check_shape};
use crate::names::{NgramPart, TensorId, TensorKind};
use crate::safetensors::ByteTensor;

/// Joining shards copies them into memory; a table larger than this is refused with
/// a clear error rather than taking the machine's memory.
const MAX_JOINED_TABLE_BYTES: usize = 1 << 30;

pub(crate) fn derive(
    path: &Path,
    prefix: &str,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
    bytes: &mut HashMap<String, ByteTensor>,
    name: impl Fn(TensorId) -> String,
) -> Result<()> {
    let hc = spec.hyper.map_or(1, |h| h.streams) * spec.hidden_size;
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(ng) = layer.ngram else { continue };
        let base = format!("{prefix}layers.{l}.ple.");
        let missing = |n: String| Error::MissingTensor { path: path.to_path_buf(), name: n };

        let conv_name = format!("{base}conv1d.weight");
        let conv = tensors.get(&conv_name).cloned().ok_or_else(|| missing(conv_name))?;
        check_shape(conv.path(), &conv.name, &conv.shape, &[hc, 1, ng.conv_kernel])?;
        let ck = name(TensorId::layer(l, TensorKind::Ngram(NgramPart::Conv)));
        let view = TensorView::new(
            ck.clone(),
            conv.dtype,
            vec![hc, ng.conv_kernel],
            conv.file().clone(),
            conv.offset(),
            conv.len_bytes(),
        )?;
        tensors.insert(ck, view);

        let table = name(TensorId::layer(l, TensorKind::Ngram(NgramPart::Table)));
        if !tensors.contains_key(&table) {
            let joined = join_shards(path, &format!("{base}ple_embedding.ngram_embedding."), tensors, &table)?;
            tensors.insert(table.clone(), joined);
        }
        let t = &tensors[&table];
        check_shape(t.path(), &t.name, &t.shape, &[ng.table_rows() as usize, ng.dim / ng.heads()])?;

        check_constants(path, &format!("{base}ple_embedding."), &ng, spec.vocab_size, bytes)?;
    }
    Ok(())
}

/// `shard_0.weight`, `shard_1.weight`, ... under `stem`, one after another.
fn join_shards(path: &Path, stem: &str, tensors: &HashMap<String, TensorView>, name: &str) -> Result<TensorView> {
    let shards: Vec<&TensorView> =
        (0..).map_while(|k| tensors.get(&format!("{stem}shard_{k}.weight"))).collect::<Vec<_>>();
    let Some(first) = shards.first() else {
        return Err(Error::MissingTensor { path: path.to_path_buf(), name: format!("{stem}weight") });
    };
    // Shards numbered past a gap: the one in the gap is missing.
    if tensors.keys().filter(|k| k.starts_with(&format!("{stem}shard_"))).count() != shards.len() {
        return Err(Error::MissingTensor {
            path: path.to_path_buf(),
            name: format!("{stem}shard_{}.weight", shards.len()),
        });
    }
    let cols = first.shape.get(1).copied().unwrap_or(0);
    let mut rows = 0usize;
    let mut total = 0usize;
    for s in &shards {
        if s.shape.len() != 2 || s.shape[1] != cols || s.dtype != first.dtype {
            return Err(Error::TensorShape {
                path: s.path().to_path_buf(),
                name: s.name.clone(),
                expected: format!("[rows, {cols}] of {} like {}", first.dtype, first.name),
                got: format!("{:?} of {}", s.shape, s.dtype),
            });
        }
        rows += s.shape[0];
        total = total.saturating_add(s.len_bytes());
    }
    if total > MAX_JOINED_TABLE_BYTES {
        return Err(Error::format(
            first.path(),
            format!(
                "the n-gram table {stem}shard_* is {total} bytes in {} shards; joining shards above {} bytes \
                 is not supported yet",
                shards.len(),
                MAX_JOINED_TABLE_BYTES
            ),
        ));
    }
    let mut data = Vec::with_capacity(total);
    for s in &shards {
        data.extend_from_slice(s.bytes());
    }
    let file = MappedFile::in_memory(first.path(), &data)?;
    TensorView::new(name.to_string(), first.dtype, vec![rows, cols], file, 0, total)
}

/// The saved hash constants, where the folder has them, must be the spec's.
fn check_constants(
    path: &Path,
    stem: &str,
    ng: &NgramSpec,
    vocab: usize,
    bytes: &mut HashMap<String, ByteTensor>,
) -> Result<()> {
    let (sizes, offsets) = (ng.head_sizes(), ng.head_offsets());
    for (what, want) in [
        ("layer_multipliers", ng.multipliers(vocab)),
        ("ngram_heads_vocab_sizes", sizes),
        ("ngram_heads_offsets", offsets),
    ] {
        let Some(t) = bytes.remove(&format!("{stem}{what}")) else { continue };
        let got: Vec<u64> = match t.dtype {
            "I64" => t.bytes().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u64).collect(),
            other => {
                return Err(Error::format(t.file().path(), format!("tensor '{}' has type {other}, not I64", t.name)));
            }
        };
        if got != want {
            return Err(Error::format(
                path,
                format!(
                    "tensor '{}' holds {got:?}, but Qwen4-Exp's config gives {want:?} (sluice hashes with the \
                     config's constants)",
                    t.name
                ),
            ));
        }
    }
    Ok(())
}
