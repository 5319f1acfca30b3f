//! A model on disk: its [`ModelSpec`] and its tensors by canonical identity.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_core::{DType, Error, Family, ModelSpec, MoeSpec, Result};

use crate::gguf::{GgufFile, has_gguf_magic};
use crate::mapped::{TensorView, check_shape};
use crate::names::{TensorId, TensorKind, gguf_name, hf_name};
use crate::pack::{self, PackInfo};
use crate::{gguf_config, hf_config, safetensors};

pub struct Checkpoint {
    pub path: PathBuf,
    pub spec: ModelSpec,
    source: Source,
    tensors: HashMap<String, TensorView>,
    /// Set for a packed folder, whose experts come from `experts.bin`.
    packed: Option<PackInfo>,
}

/// Where the tensors come from, which decides what they are called.
enum Source {
    /// A Hugging Face folder; the prefix is the language model's module path in tensor
    /// names (`model.` and the like).
    Hf {
        prefix: String,
    },
    Gguf(GgufFile),
}

/// One routed expert's three matrices, each `[rows, cols]` as a Linear weight.
#[derive(Clone, Debug)]
pub struct ExpertMats {
    pub gate: TensorView,
    pub up: TensorView,
    pub down: TensorView,
}

impl ExpertMats {
    pub fn bytes(&self) -> usize {
        self.gate.len_bytes() + self.up.len_bytes() + self.down.len_bytes()
    }
}

impl Checkpoint {
    /// Opens a Hugging Face model folder (config.json + safetensors), a packed folder
    /// (recognised by its `sluice-pack.json`) or a GGUF file (recognised by its magic,
    /// whatever its name).
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            if path.join(pack::MANIFEST).exists() {
                return Self::open_packed(path);
            }
            return Self::open_hf(path);
        }
        if has_gguf_magic(path)? {
            return Self::open_gguf(path);
        }
        let gguf_name = path.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf"));
        Err(Error::format(
            path,
            if gguf_name {
                "not a GGUF file (it does not start with the magic \"GGUF\")"
            } else {
                "not a model (expected a Hugging Face folder with config.json, or a GGUF file)"
            },
        ))
    }

    /// Opens a GGUF file.
    pub fn open_gguf(path: &Path) -> Result<Checkpoint> {
        let file = GgufFile::open(path)?;
        let spec = gguf_config::read(&file)?;
        let mut tensors = file.tensors().iter().map(|t| (t.name.clone(), t.clone())).collect();
        if spec.family == Family::DeepSeek {
            crate::deepseek::split_kv_b(path, &spec, &mut tensors, gguf_name)?;
        }
        Ok(Checkpoint { path: path.to_path_buf(), spec, source: Source::Gguf(file), tensors, packed: None })
    }

    /// Opens a Hugging Face model folder.
    pub fn open_hf(path: &Path) -> Result<Checkpoint> {
        let cfg = hf_config::read(path)?;
        let mut spec = cfg.spec;
        let safetensors::Tensors { mut tensors, mut bytes } = safetensors::read_folder(path)?;
        let candidates: &[&str] = if cfg.wrapped {
            &["model.language_model.", "language_model.model.", "model."]
        } else {
            &["model.", "", "model.language_model."]
        };
        let prefix = candidates
            .iter()
            .find(|p| tensors.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::MissingTensor {
                path: path.to_path_buf(),
                name: format!("{}embed_tokens.weight", candidates[0]),
            })?
            .to_string();
        spec.weight_dtype = tensors.get(&format!("{prefix}embed_tokens.weight")).map(|t| t.dtype);
        match spec.family {
            Family::GptOss => crate::gpt_oss::rearrange(path, &prefix, &spec, &mut tensors, &mut bytes)?,
            Family::DeepSeek => {
                crate::deepseek::split_kv_b(path, &spec, &mut tensors, |id| hf_name(Family::DeepSeek, &prefix, id))?
            }
            Family::Qwen35 => {
                crate::qwen35::derive(path, &prefix, &spec, &mut tensors, |id| hf_name(Family::Qwen35, &prefix, id))?
            }
            Family::Qwen4Exp => {
                let name = |id| hf_name(Family::Qwen4Exp, &prefix, id);
                crate::qwen35::derive(path, &prefix, &spec, &mut tensors, name)?;
                crate::qwen4_exp::derive(path, &prefix, &spec, &mut tensors, &mut bytes, name)?
            }
            _ => {}
        }
        // Byte tensors are read only as the parts of a format above.
        if let Some(t) = bytes.values().min_by(|a, b| a.name.cmp(&b.name)) {
            return Err(Error::format(
                t.file().path(),
                format!("tensor '{}' has type {}, which sluice does not read here (F32, F16, BF16)", t.name, t.dtype),
            ));
        }
        // A checkpoint without lm_head ties it to the embedding whatever the config says.
        if !tensors.contains_key("lm_head.weight") {
            spec.tie_word_embeddings = true;
        }
        Ok(Checkpoint { path: path.to_path_buf(), spec, source: Source::Hf { prefix }, tensors, packed: None })
    }

    /// Opens a folder written by `sluice pack`: the inner model (`model.gguf`, or the
    /// folder's own config and `model.safetensors`) for the spec and the resident tensors,
    /// and `experts.bin` for the routed experts, which appear under their per-expert ids.
    /// The manifest is checked against `experts.bin`'s size and the spec first.
    pub fn open_packed(dir: &Path) -> Result<Checkpoint> {
        let manifest = pack::Manifest::load(dir)?;
        let mut ckpt = if manifest.model == pack::MODEL_GGUF {
            Self::open_gguf(&dir.join(pack::MODEL_GGUF))?
        } else {
            Self::open_hf(dir)?
        };
        ckpt.path = dir.to_path_buf();
        let (experts, info) = pack::attach(dir, &manifest, &ckpt)?;
        for (id, view) in experts {
            let name = ckpt.name(id);
            if ckpt.tensors.insert(name.clone(), view).is_some() {
                return Err(Error::format(
                    &ckpt.path,
                    format!("tensor '{name}' is both in the inner model and in {}", pack::EXPERTS_FILE),
                ));
            }
        }
        if let Some(d) = manifest.weight_dtype.as_deref().and_then(DType::from_name) {
            ckpt.spec.weight_dtype = Some(d);
        }
        ckpt.packed = Some(info);
        Ok(ckpt)
    }

    /// Set when this is a packed folder.
    pub fn packed(&self) -> Option<&PackInfo> {
        self.packed.as_ref()
    }

    /// The GGUF file this checkpoint was read from, if it was one (its metadata holds
    /// the vocabulary and chat template).
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf(g) => Some(g),
            Source::Hf { .. } => None,
        }
    }

    pub fn family(&self) -> Family {
        self.spec.family
    }

    /// The name this checkpoint's format gives to a tensor.
    pub fn name(&self, id: TensorId) -> String {
        match &self.source {
            Source::Hf { prefix } => hf_name(self.spec.family, prefix, id),
            Source::Gguf(_) => gguf_name(id),
        }
    }

    pub fn get(&self, id: TensorId) -> Option<&TensorView> {
        self.tensors.get(&self.name(id))
    }

    pub fn contains(&self, id: TensorId) -> bool {
        self.get(id).is_some()
    }

    /// A tensor that must exist with exactly this shape.
    pub fn tensor(&self, id: TensorId, shape: &[usize]) -> Result<TensorView> {
        self.optional(id, shape)?.ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: self.name(id) })
    }

    /// A tensor that may be absent, but if present has exactly this shape.
    pub fn optional(&self, id: TensorId, shape: &[usize]) -> Result<Option<TensorView>> {
        let Some(t) = self.get(id) else { return Ok(None) };
        check_shape(t.path(), &t.name, &t.shape, shape)?;
        Ok(Some(t.clone()))
    }

    /// The routed experts of one layer, from whichever form the file holds them in:
    /// one fused 3-D gate_up tensor, separate 3-D gate / up tensors, or 2-D tensors
    /// per expert.
    pub fn experts(&self, layer: usize, moe: &MoeSpec, hidden: usize) -> Result<Vec<ExpertMats>> {
        let (e, i, h) = (moe.n_experts, moe.intermediate, hidden);
        let id = |k| TensorId::layer(layer, k);
        if self.contains(id(TensorKind::ExpsGateUp)) || self.contains(id(TensorKind::ExpsDown)) {
            let down = self.tensor(id(TensorKind::ExpsDown), &[e, h, i])?;
            let (gate, up) = if self.contains(id(TensorKind::ExpsGateUp)) {
                let gu = self.tensor(id(TensorKind::ExpsGateUp), &[e, 2 * i, h])?;
                (0..e)
                    .map(|x| {
                        let m = gu.index0(x);
                        (m.rows(0, i), m.rows(i, i))
                    })
                    .unzip::<_, _, Vec<_>, Vec<_>>()
            } else {
                let g = self.tensor(id(TensorKind::ExpsGate), &[e, i, h])?;
                let u = self.tensor(id(TensorKind::ExpsUp), &[e, i, h])?;
                ((0..e).map(|x| g.index0(x)).collect(), (0..e).map(|x| u.index0(x)).collect())
            };
            return Ok(gate
                .into_iter()
                .zip(up)
                .enumerate()
                .map(|(x, (gate, up))| ExpertMats { gate, up, down: down.index0(x) })
                .collect());
        }
        (0..e)
            .map(|x| {
                Ok(ExpertMats {
                    gate: self.tensor(id(TensorKind::ExpGate(x)), &[i, h])?,
                    up: self.tensor(id(TensorKind::ExpUp(x)), &[i, h])?,
                    down: self.tensor(id(TensorKind::ExpDown(x)), &[h, i])?,
                })
            })
            .collect()
    }

    /// Moves every tensor that is not a routed expert (experts are the expert store's
    /// business) onto a copy in this process's memory ([`crate::MappedFile::copy_ranges`]),
    /// each file's share in one piece. `progress` gets the bytes copied so far and the
    /// total. Returns the bytes copied.
    pub fn copy_to_memory(&mut self, progress: &mut dyn FnMut(u64, u64)) -> Result<u64> {
        // Where the experts lie: (file, offset, length), sorted.
        let mut experts = Vec::new();
        for (l, ls) in self.spec.layers.iter().enumerate() {
            if let Some(moe) = &ls.moe {
                for e in self.experts(l, moe, self.spec.hidden_size)? {
                    for t in [&e.gate, &e.up, &e.down] {
                        experts.push((Arc::as_ptr(t.file()) as usize, t.offset(), t.len_bytes()));
                    }
                }
            }
        }
        experts.sort_unstable();
        // A tensor holding the first expert range at or after its start is an expert tensor.
        let is_expert = |t: &TensorView| {
            let key = (Arc::as_ptr(t.file()) as usize, t.offset(), 0);
            let i = experts.partition_point(|e| *e < key);
            experts.get(i).is_some_and(|&(f, o, n)| f == key.0 && o + n <= t.offset() + t.len_bytes())
        };
        // The tensors to copy, grouped by file, in file order.
        let mut views: Vec<&TensorView> = self.tensors.values().filter(|t| !is_expert(t)).collect();
        views.sort_by_key(|t| t.offset());
        let mut files: Vec<Vec<TensorView>> = Vec::new();
        for t in views {
            match files.iter_mut().find(|g| Arc::ptr_eq(g[0].file(), t.file())) {
                Some(g) => g.push(t.clone()),
                None => files.push(vec![t.clone()]),
            }
        }
        let total: u64 = files.iter().flatten().map(|t| t.len_bytes() as u64).sum();
        let mut done = 0;
        for group in files {
            let ranges: Vec<(usize, usize)> = group.iter().map(|t| (t.offset(), t.len_bytes())).collect();
            let (copy, offsets) = group[0].file().copy_ranges(&ranges, &mut |n| progress(done + n, total))?;
            for (t, off) in group.iter().zip(offsets) {
                self.tensors.insert(t.name.clone(), t.moved(copy.clone(), off));
                done += t.len_bytes() as u64;
            }
        }
        Ok(total)
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> Vec<&TensorView> {
        let mut v: Vec<&TensorView> = self.tensors.values().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}
