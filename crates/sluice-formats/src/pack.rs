//! The packed layout: a model's routed experts laid out one expert after another, so
//! that each expert is one contiguous, 4 KiB-aligned read.
//!
//! A packed folder holds:
//!
//! - the model without its routed experts, in its own format: `model.gguf` (same
//!   metadata, every non-expert tensor) for a GGUF source; for a Hugging Face source
//!   `model.safetensors` (the non-expert tensors under their own names and types) beside
//!   copies of `config.json`, the tokenizer files, the chat template and the generation
//!   config;
//! - `experts.bin`: for each MoE layer in order, for each expert in order, its gate, up
//!   and down matrices (each `[rows, cols]` as a Linear weight, in the source's type and
//!   block layout). Each expert starts on a 4096-byte boundary; inside an expert each
//!   matrix starts on a 32-byte boundary (GGUF's default alignment), which in practice
//!   leaves them back to back. The file ends on a 4096-byte boundary;
//! - `sluice-pack.json`, the manifest, written last: the format and version, the source
//!   (path, bytes), the inner model file, the size of `experts.bin`, and per MoE layer per
//!   expert the offset and byte count of the expert and the offset, type and shape of each
//!   of its three matrices.
//!
//! [`Checkpoint::open`] recognises a packed folder by its manifest, opens the inner model
//! for the spec and the resident tensors, and serves the experts from `experts.bin`. The
//! manifest is checked against the size of `experts.bin` and against the model's spec
//! before any expert byte is touched.

use std::borrow::Cow;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sluice_core::{DType, Error, Result};

use crate::checkpoint::Checkpoint;
use crate::gguf::GgufValue;
use crate::gguf_write::{GgufWriter, write_zeros};
use crate::mapped::{MappedFile, TensorView};
use crate::names::{TensorId, TensorKind};

pub const MANIFEST: &str = "sluice-pack.json";
pub const EXPERTS_FILE: &str = "experts.bin";
pub const MODEL_GGUF: &str = "model.gguf";
pub const MODEL_SAFETENSORS: &str = "model.safetensors";
/// Where every expert starts in `experts.bin`: the page size O_DIRECT reads want.
pub const EXPERT_ALIGN: u64 = 4096;
/// Where each matrix starts inside an expert.
pub const MATRIX_ALIGN: u64 = 32;

const FORMAT: &str = "sluice-pack";
const VERSION: u32 = 1;

/// `sluice-pack.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub source: SourceInfo,
    /// The inner model: `model.gguf` or `model.safetensors`.
    pub model: String,
    pub experts: ExpertsFile,
    /// The source's dominant weight type, for display (the inner model alone would
    /// name a different one once the experts are gone).
    #[serde(default)]
    pub weight_dtype: Option<String>,
    pub layers: Vec<LayerEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SourceInfo {
    pub path: String,
    /// Bytes of the source file, or of the files of the source folder.
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExpertsFile {
    pub file: String,
    pub bytes: u64,
    pub alignment: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LayerEntry {
    pub layer: usize,
    pub experts: Vec<ExpertEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertEntry {
    /// Start of the expert, a multiple of the alignment.
    pub offset: u64,
    /// From `offset` to the end of its last matrix.
    pub bytes: u64,
    pub gate: MatEntry,
    pub up: MatEntry,
    pub down: MatEntry,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MatEntry {
    pub offset: u64,
    pub dtype: String,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
}

impl MatEntry {
    fn new(offset: u64, m: &MatShape) -> MatEntry {
        MatEntry { offset, dtype: m.dtype.name().to_string(), shape: m.shape }
    }
}

/// A matrix's type and `[rows, cols]`, before it has an offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatShape {
    pub dtype: DType,
    pub shape: [usize; 2],
}

impl MatShape {
    pub fn of(t: &TensorView) -> Result<MatShape> {
        match t.shape.as_slice() {
            &[r, c] => Ok(MatShape { dtype: t.dtype, shape: [r, c] }),
            other => Err(Error::format(t.path(), format!("expert tensor '{}' has shape {other:?}, not 2-D", t.name))),
        }
    }

    pub fn bytes(&self) -> Option<u64> {
        let row = self.dtype.bytes_for(self.shape[1])?;
        row.checked_mul(self.shape[0]).map(|b| b as u64)
    }
}

/// What a packed folder is, for display.
#[derive(Clone, Debug)]
pub struct PackInfo {
    pub manifest: PathBuf,
    pub experts_file: PathBuf,
    pub experts_bytes: u64,
    pub source: SourceInfo,
}

/// True when `path` is a folder holding a pack manifest.
pub fn is_packed(path: &Path) -> bool {
    path.is_dir() && path.join(MANIFEST).is_file()
}

/// The file that holds a model's metadata: a packed folder's inner `model.gguf` where it
/// has one, otherwise `path` itself (a GGUF file, or a folder with its tokenizer files).
pub fn model_path(path: &Path) -> PathBuf {
    let inner = path.join(MODEL_GGUF);
    if is_packed(path) && inner.is_file() { inner } else { path.to_path_buf() }
}

/// Lays out the experts: `layers` holds, per MoE layer, each expert's gate, up and down.
/// Returns the manifest's layer entries and the size of `experts.bin`.
pub fn layout(layers: &[(usize, Vec<[MatShape; 3]>)], path: &Path) -> Result<(Vec<LayerEntry>, u64)> {
    let mut at = 0u64;
    let mut out = Vec::with_capacity(layers.len());
    for (layer, experts) in layers {
        let mut entries = Vec::with_capacity(experts.len());
        for (e, mats) in experts.iter().enumerate() {
            let start = at.next_multiple_of(EXPERT_ALIGN);
            let mut pos = start;
            let mut offs = [0u64; 3];
            for (i, m) in mats.iter().enumerate() {
                let len = m.bytes().ok_or_else(|| {
                    Error::format(
                        path,
                        format!("layer {layer} expert {e}: a {} matrix {:?} is too large", m.dtype, m.shape),
                    )
                })?;
                offs[i] = pos.next_multiple_of(MATRIX_ALIGN);
                pos = offs[i] + len;
            }
            entries.push(ExpertEntry {
                offset: start,
                bytes: pos - start,
                gate: MatEntry::new(offs[0], &mats[0]),
                up: MatEntry::new(offs[1], &mats[1]),
                down: MatEntry::new(offs[2], &mats[2]),
            });
            at = pos;
        }
        out.push(LayerEntry { layer: *layer, experts: entries });
    }
    Ok((out, at.next_multiple_of(EXPERT_ALIGN)))
}

/// Writes `experts.bin` under a temporary name, matrix by matrix at the offsets of the
/// layout, and renames it into place when done.
pub struct ExpertsWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    pos: u64,
}

impl ExpertsWriter {
    pub fn create(path: &Path) -> Result<ExpertsWriter> {
        let tmp = partial(path);
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(ExpertsWriter { path: path.to_path_buf(), tmp, out: BufWriter::with_capacity(1 << 22, f), pos: 0 })
    }

    fn pad_to(&mut self, offset: u64) -> Result<()> {
        if offset < self.pos {
            return Err(Error::format(
                &self.path,
                format!("offset {offset} is behind the write position {}", self.pos),
            ));
        }
        write_zeros(&mut self.out, offset - self.pos).map_err(|e| Error::io(&self.tmp, e))?;
        self.pos = offset;
        Ok(())
    }

    /// Writes one matrix where the manifest puts it.
    pub fn put(&mut self, m: &MatEntry, bytes: &[u8]) -> Result<()> {
        let want = DType::from_name(&m.dtype)
            .and_then(|d| MatShape { dtype: d, shape: m.shape }.bytes())
            .ok_or_else(|| Error::format(&self.path, format!("bad matrix entry {m:?}")))?;
        if bytes.len() as u64 != want {
            return Err(Error::format(
                &self.path,
                format!("a {} matrix {:?} needs {want} bytes, got {}", m.dtype, m.shape, bytes.len()),
            ));
        }
        self.pad_to(m.offset)?;
        self.out.write_all(bytes).map_err(|e| Error::io(&self.tmp, e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Pads to `total`, syncs, and renames the file into place.
    pub fn finish(mut self, total: u64) -> Result<()> {
        self.pad_to(total)?;
        let f = self.out.into_inner().map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))
    }
}

impl Manifest {
    pub fn new(source: SourceInfo, model: &str, experts_bytes: u64, layers: Vec<LayerEntry>) -> Manifest {
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            source,
            model: model.into(),
            experts: ExpertsFile { file: EXPERTS_FILE.into(), bytes: experts_bytes, alignment: EXPERT_ALIGN },
            weight_dtype: None,
            layers,
        }
    }

    /// Writes `dir/sluice-pack.json` (under a temporary name, then renamed).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST);
        let text = serde_json::to_string(self).map_err(|e| Error::format(&path, e.to_string()))?;
        let tmp = partial(&path);
        std::fs::write(&tmp, text + "\n").map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
    }

    /// Reads `dir/sluice-pack.json` and checks what can be checked without the model.
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let m: Manifest =
            serde_json::from_str(&text).map_err(|e| Error::format(&path, format!("not a valid pack manifest: {e}")))?;
        let bad = |msg: String| Err(Error::format(&path, msg));
        if m.format != FORMAT || m.version != VERSION {
            return bad(format!("a '{}' version {} file; expected '{FORMAT}' version {VERSION}", m.format, m.version));
        }
        if m.model != MODEL_GGUF && m.model != MODEL_SAFETENSORS {
            return bad(format!("'model' is '{}'; expected '{MODEL_GGUF}' or '{MODEL_SAFETENSORS}'", m.model));
        }
        if m.experts.file != EXPERTS_FILE {
            return bad(format!("'experts.file' is '{}'; expected '{EXPERTS_FILE}'", m.experts.file));
        }
        if m.experts.alignment == 0 || !m.experts.alignment.is_power_of_two() {
            return bad(format!("'experts.alignment' is {}; expected a power of two", m.experts.alignment));
        }
        Ok(m)
    }
}

/// Reads the packed experts of `ckpt` (the inner model of the folder `dir`, opened
/// already) and checks the manifest against `experts.bin` and the model's spec. Returns
/// each expert matrix under its canonical per-expert id.
pub(crate) fn attach(dir: &Path, m: &Manifest, ckpt: &Checkpoint) -> Result<(Vec<(TensorId, TensorView)>, PackInfo)> {
    let manifest = dir.join(MANIFEST);
    let experts_path = dir.join(EXPERTS_FILE);
    let file = MappedFile::open(&experts_path)?;
    if file.len() as u64 != m.experts.bytes {
        return Err(Error::format(
            &experts_path,
            format!(
                "{} bytes, but {} says {} (truncated or not this pack's file)",
                file.len(),
                manifest.display(),
                m.experts.bytes
            ),
        ));
    }
    let bad = |msg: String| Error::format(&manifest, msg);
    let spec = &ckpt.spec;
    let h = spec.hidden_size;
    let mut seen = vec![false; spec.n_layers()];
    let mut out = Vec::new();
    for entry in &m.layers {
        let l = entry.layer;
        let Some(moe) = spec.layers.get(l).and_then(|ls| ls.moe.as_ref()) else {
            return Err(bad(format!("layer {l} has experts here but the model has no routed experts there")));
        };
        if std::mem::replace(&mut seen[l], true) {
            return Err(bad(format!("layer {l} appears twice")));
        }
        if entry.experts.len() != moe.n_experts {
            return Err(bad(format!(
                "layer {l} has {} experts here but the model has {}",
                entry.experts.len(),
                moe.n_experts
            )));
        }
        for kind in [TensorKind::ExpsGateUp, TensorKind::ExpsGate, TensorKind::ExpsUp, TensorKind::ExpsDown] {
            if ckpt.contains(TensorId::layer(l, kind)) {
                return Err(Error::format(
                    &ckpt.path,
                    format!("layer {l}: the packed model holds '{}' itself", ckpt.name(TensorId::layer(l, kind))),
                ));
            }
        }
        let i = moe.intermediate;
        for (e, x) in entry.experts.iter().enumerate() {
            if x.offset % m.experts.alignment != 0 {
                return Err(bad(format!(
                    "layer {l} expert {e} starts at {}, not a multiple of {}",
                    x.offset, m.experts.alignment
                )));
            }
            let parts = [
                (&x.gate, [i, h], TensorKind::ExpGate(e), "gate"),
                (&x.up, [i, h], TensorKind::ExpUp(e), "up"),
                (&x.down, [h, i], TensorKind::ExpDown(e), "down"),
            ];
            for (mat, want, kind, what) in parts {
                let dtype = DType::from_name(&mat.dtype)
                    .ok_or_else(|| bad(format!("layer {l} expert {e} {what}: unknown type '{}'", mat.dtype)))?;
                if mat.shape != want {
                    return Err(bad(format!(
                        "layer {l} expert {e} {what}: shape {:?}, but the model's experts are {want:?}",
                        mat.shape
                    )));
                }
                let len = MatShape { dtype, shape: want }
                    .bytes()
                    .ok_or_else(|| bad(format!("layer {l} expert {e} {what}: a {dtype} matrix {want:?} cannot be")))?;
                let end = mat.offset.checked_add(len);
                if mat.offset < x.offset || end.is_none_or(|end| end > x.offset.saturating_add(x.bytes)) {
                    return Err(bad(format!(
                        "layer {l} expert {e} {what}: {len} bytes at {} lie outside the expert ({} bytes at {})",
                        mat.offset, x.bytes, x.offset
                    )));
                }
                let id = TensorId::layer(l, kind);
                let offset =
                    usize::try_from(mat.offset).map_err(|_| bad(format!("offset {} too large", mat.offset)))?;
                let view =
                    TensorView::new(ckpt.name(id), dtype, want.to_vec(), Arc::clone(&file), offset, len as usize)?;
                out.push((id, view));
            }
        }
    }
    if let Some(l) = (0..spec.n_layers()).find(|&l| spec.layers[l].moe.is_some() && !seen[l]) {
        return Err(bad(format!("the model's layer {l} has routed experts but this manifest lists none")));
    }
    let info =
        PackInfo { manifest, experts_file: experts_path, experts_bytes: m.experts.bytes, source: m.source.clone() };
    Ok((out, info))
}

/// What `pack` wrote.
#[derive(Clone, Debug)]
pub struct PackSummary {
    pub dir: PathBuf,
    /// The inner model file and its size.
    pub model_file: PathBuf,
    pub model_bytes: u64,
    pub experts_bytes: u64,
    pub moe_layers: usize,
    pub experts: usize,
}

/// The per-expert ids and the 3-D tensor kinds of a MoE layer: every name under which a
/// checkpoint may hold routed-expert bytes.
fn expert_ids(layer: usize, n_experts: usize) -> impl Iterator<Item = TensorId> {
    [TensorKind::ExpsGateUp, TensorKind::ExpsGate, TensorKind::ExpsUp, TensorKind::ExpsDown]
        .into_iter()
        .chain((0..n_experts).flat_map(|e| [TensorKind::ExpGate(e), TensorKind::ExpUp(e), TensorKind::ExpDown(e)]))
        .map(move |k| TensorId::layer(layer, k))
}

/// Writes the packed form of `src` into `out` (a folder that must not exist, or be
/// empty). `progress` hears of bytes as they are written.
pub fn pack(src: &Checkpoint, out: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<PackSummary> {
    let spec = &src.spec;
    let moe_layers: Vec<usize> = (0..spec.n_layers()).filter(|&l| spec.layers[l].moe.is_some()).collect();
    if moe_layers.is_empty() {
        return Err(Error::config(
            &src.path,
            format!("a dense model ({}, no routed experts): there is nothing to pack", spec.arch),
        ));
    }
    let created = prepare_dir(out)?;
    let result = pack_into(src, out, &moe_layers, progress);
    if result.is_err() && created {
        let _ = std::fs::remove_dir_all(out);
    }
    result
}

/// Makes the output folder; refuses one with files in it. True when it made it.
pub fn prepare_dir(out: &Path) -> Result<bool> {
    match std::fs::read_dir(out) {
        Ok(mut it) => {
            if it.next().is_some() {
                return Err(Error::Usage(format!(
                    "{} already exists and is not empty; remove it or choose another folder",
                    out.display()
                )));
            }
            Ok(false)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
            Ok(true)
        }
        Err(e) => Err(Error::io(out, e)),
    }
}

fn pack_into(
    src: &Checkpoint,
    out: &Path,
    moe_layers: &[usize],
    progress: &(dyn Fn(u64) + Sync),
) -> Result<PackSummary> {
    let spec = &src.spec;
    let h = spec.hidden_size;
    // Every expert, and the names its bytes go under in the source.
    let mut experts = Vec::with_capacity(moe_layers.len());
    let mut expert_names = std::collections::HashSet::new();
    for &l in moe_layers {
        let moe = spec.layers[l].moe.as_ref().expect("a MoE layer");
        experts.push((l, src.experts(l, moe, h)?));
        expert_names.extend(expert_ids(l, moe.n_experts).map(|id| src.name(id)));
    }
    let resident: Vec<&TensorView> = src.tensors().into_iter().filter(|t| !expert_names.contains(&t.name)).collect();

    // The inner model first, the experts next, the manifest last.
    let model_file = match src.gguf() {
        Some(g) => {
            let path = out.join(MODEL_GGUF);
            let mut w = GgufWriter::new();
            for (k, v) in g.metadata() {
                w.add(k, v.clone());
            }
            w.set_alignment(g.alignment());
            // Without the expert tensors the width can only come from the metadata.
            if let Some(arch) = g.get_str("general.architecture")? {
                let key = format!("{arch}.expert_feed_forward_length");
                if g.get(&key).is_none() {
                    let i = spec.layers[moe_layers[0]].moe.as_ref().map_or(0, |m| m.intermediate);
                    w.add(&key, GgufValue::U32(i as u32));
                }
            }
            // In the source's order, which keeps each tensor's place relative to the others.
            let keep: std::collections::HashSet<&str> = resident.iter().map(|t| t.name.as_str()).collect();
            for t in g.tensors().iter().filter(|t| keep.contains(t.name.as_str())) {
                let bytes = t.bytes();
                w.add_tensor_fn(&t.name, t.dtype, &t.shape, move |o| {
                    for c in bytes.chunks(1 << 22) {
                        o.write_all(c)?;
                        progress(c.len() as u64);
                    }
                    Ok(())
                });
            }
            w.write(&path)?;
            path
        }
        None => {
            let path = out.join(MODEL_SAFETENSORS);
            write_safetensors(&resident, &path, progress)?;
            copy_side_files(&src.path, out)?;
            path
        }
    };

    let shapes = experts
        .iter()
        .map(|(l, xs)| {
            let mats = xs
                .iter()
                .map(|x| Ok([MatShape::of(&x.gate)?, MatShape::of(&x.up)?, MatShape::of(&x.down)?]))
                .collect::<Result<Vec<_>>>()?;
            Ok((*l, mats))
        })
        .collect::<Result<Vec<_>>>()?;
    let experts_path = out.join(EXPERTS_FILE);
    let (layers, total) = layout(&shapes, &experts_path)?;
    let mut w = ExpertsWriter::create(&experts_path)?;
    let mut n = 0;
    for ((_, xs), entry) in experts.iter().zip(&layers) {
        for (x, e) in xs.iter().zip(&entry.experts) {
            for (t, m) in [(&x.gate, &e.gate), (&x.up, &e.up), (&x.down, &e.down)] {
                w.put(m, t.bytes())?;
                progress(t.len_bytes() as u64);
            }
            n += 1;
        }
    }
    w.finish(total)?;

    let mut manifest = Manifest::new(source_info(&src.path)?, model_name(&model_file), total, layers);
    manifest.weight_dtype = spec.weight_dtype.map(|d| d.name().to_string());
    manifest.save(out)?;
    let model_bytes = std::fs::metadata(&model_file).map_err(|e| Error::io(&model_file, e))?.len();
    Ok(PackSummary {
        dir: out.to_path_buf(),
        model_file,
        model_bytes,
        experts_bytes: total,
        moe_layers: moe_layers.len(),
        experts: n,
    })
}

fn model_name(p: &Path) -> &str {
    p.file_name().and_then(|n| n.to_str()).unwrap_or(MODEL_GGUF)
}

/// The source's path and size (a folder: its files' sizes summed).
pub fn source_info(path: &Path) -> Result<SourceInfo> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let bytes = if meta.is_dir() {
        std::fs::read_dir(path)
            .map_err(|e| Error::io(path, e))?
            .filter_map(|e| e.ok()?.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum()
    } else {
        meta.len()
    };
    let shown = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(SourceInfo { path: shown.display().to_string(), bytes })
}

/// Copies a Hugging Face folder's files other than weights (config, tokenizer, chat
/// template, generation config, ...).
fn copy_side_files(src: &Path, out: &Path) -> Result<()> {
    for e in std::fs::read_dir(src).map_err(|e| Error::io(src, e))? {
        let e = e.map_err(|e| Error::io(src, e))?;
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        let weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        let ours = name == EXPERTS_FILE || name == MANIFEST || name.ends_with(".partial");
        if weights || ours || !p.is_file() {
            continue;
        }
        std::fs::copy(&p, out.join(&name)).map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}

/// A tensor view as the safetensors writer wants it.
struct StView<'a>(&'a TensorView);

impl safetensors::View for StView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.0.dtype {
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F32,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.0.bytes())
    }
    fn data_len(&self) -> usize {
        self.0.len_bytes()
    }
}

fn write_safetensors(tensors: &[&TensorView], path: &Path, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
    if let Some(t) = tensors.iter().find(|t| !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16)) {
        return Err(Error::format(
            t.path(),
            format!("tensor '{}' is {}, which safetensors cannot hold", t.name, t.dtype),
        ));
    }
    let tmp = partial(path);
    let views = tensors.iter().map(|t| (t.name.clone(), StView(t)));
    safetensors::tensor::serialize_to_file(views, None, &tmp).map_err(|e| Error::format(&tmp, e.to_string()))?;
    progress(tensors.iter().map(|t| t.len_bytes() as u64).sum());
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

fn partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    path.with_file_name(name)
}
