//! Safetensors files and Hugging Face shard sets. The `safetensors` crate parses and
//! validates the header (offsets contiguous, sizes matching shapes, file fully
//! covered); this module turns its entries into [`TensorView`]s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::tensor::{Dtype, SafeTensors};
use sluice_core::{DType, Error, Result};

use crate::mapped::{MappedFile, TensorView};

/// Reads one `.safetensors` file's header and returns its tensors.
pub fn read_file(path: &Path) -> Result<Vec<TensorView>> {
    let file = MappedFile::open(path)?;
    let (header_len, meta) = SafeTensors::read_metadata(file.bytes())
        .map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(Error::format(
                    path,
                    format!("tensor '{name}' has type {other:?}, which sluice does not read (F32, F16, BF16)"),
                ));
            }
        };
        let (s, e) = info.data_offsets;
        out.push(TensorView::new(name, dtype, info.shape.clone(), Arc::clone(&file), data_start + s, e - s)?);
    }
    Ok(out)
}

/// All tensors of a Hugging Face folder: `model.safetensors`, or the shards that
/// `model.safetensors.index.json` lists.
pub fn read_folder(dir: &Path) -> Result<HashMap<String, TensorView>> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::format(&index, format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::format(&index, "no 'weight_map' object"))?;
        let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        let single = dir.join("model.safetensors");
        if single.exists() {
            vec![single]
        } else {
            // Some exports use other names; take every .safetensors file there is.
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            if v.is_empty() {
                return Err(Error::format(dir, "no .safetensors files in this folder"));
            }
            v
        }
    };
    let mut tensors = HashMap::new();
    for f in files {
        for t in read_file(&f)? {
            if let Some(prev) = tensors.insert(t.name.clone(), t) {
                return Err(Error::format(
                    &f,
                    format!("tensor '{}' also appears in {}", prev.name, prev.path().display()),
                ));
            }
        }
    }
    Ok(tensors)
}
