//! Safetensors files and Hugging Face shard sets. The `safetensors` crate parses and
//! validates the header (offsets contiguous, sizes matching shapes, file fully
//! covered); this module turns its entries into [`TensorView`]s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::tensor::{Dtype, SafeTensors};
use sluice_core::{DType, Error, Result};

use crate::mapped::{MappedFile, TensorView};

/// A tensor of bytes (safetensors `U8`) or integers (`I64`) that no kernel computes on
/// as it is: gpt-oss's MXFP4 experts come as `_blocks` (the 4-bit codes) and `_scales`
/// (their exponents), which are rearranged into MXFP4 blocks at open; Qwen4-Exp saves
/// its n-gram hash constants, which are checked against its own. The safetensors
/// header has already checked that `shape` holds `len` bytes within the file.
#[derive(Clone)]
pub struct ByteTensor {
    pub name: String,
    /// `U8` or `I64`, as the header says.
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    file: Arc<MappedFile>,
    offset: usize,
    len: usize,
}

impl ByteTensor {
    pub fn bytes(&self) -> &[u8] {
        &self.file.bytes()[self.offset..self.offset + self.len]
    }

    pub fn file(&self) -> &MappedFile {
        &self.file
    }
}

/// What a folder's safetensors hold: the tensors sluice computes on, and byte tensors.
#[derive(Default)]
pub struct Tensors {
    pub tensors: HashMap<String, TensorView>,
    pub bytes: HashMap<String, ByteTensor>,
}

/// Reads one `.safetensors` file's header and returns its tensors.
pub fn read_file(path: &Path) -> Result<Tensors> {
    let file = MappedFile::open(path)?;
    let (header_len, meta) = SafeTensors::read_metadata(file.bytes())
        .map_err(|e| Error::format(path, format!("not a valid safetensors file: {e}")))?;
    let data_start = 8 + header_len;
    let mut out = Tensors::default();
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::U8 | Dtype::I64 => {
                let t = ByteTensor {
                    name,
                    dtype: if info.dtype == Dtype::U8 { "U8" } else { "I64" },
                    shape: info.shape.clone(),
                    file: Arc::clone(&file),
                    offset: data_start + s,
                    len: e - s,
                };
                out.bytes.insert(t.name.clone(), t);
                continue;
            }
            other => {
                return Err(Error::format(
                    path,
                    format!("tensor '{name}' has type {other:?}, which sluice does not read (F32, F16, BF16, U8, I64)"),
                ));
            }
        };
        let t = TensorView::new(name, dtype, info.shape.clone(), Arc::clone(&file), data_start + s, e - s)?;
        out.tensors.insert(t.name.clone(), t);
    }
    Ok(out)
}

/// All tensors of a Hugging Face folder: `model.safetensors`, or the shards that
/// `model.safetensors.index.json` lists.
pub fn read_folder(dir: &Path) -> Result<Tensors> {
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
        // A shard is a file of this folder: an absolute name or one with a separator or
        // `..` would make the index open any file on the machine.
        if let Some(bad) = names.iter().find(|n| {
            let mut parts = Path::new(n).components();
            !matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None))
        }) {
            return Err(Error::format(&index, format!("shard name {bad:?} is not a file name in this folder")));
        }
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
    let mut all = Tensors::default();
    for f in files {
        let one = read_file(&f)?;
        let names = one.tensors.keys().chain(one.bytes.keys());
        if let Some(name) = names.into_iter().find(|n| all.tensors.contains_key(*n) || all.bytes.contains_key(*n)) {
            let prev = all.tensors.get(name).map(|t| t.path()).or_else(|| all.bytes.get(name).map(|t| t.file().path()));
            let prev = prev.expect("found above");
            return Err(Error::format(&f, format!("tensor '{name}' also appears in {}", prev.display())));
        }
        all.tensors.extend(one.tensors);
        all.bytes.extend(one.bytes);
    }
    Ok(all)
}
