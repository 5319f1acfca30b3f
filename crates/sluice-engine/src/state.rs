//! What a sequence keeps between steps, layer by layer, as its family declares it.
//!
//! The session does not assume a KV cache per layer: a family lists a [`StateSpec`]
//! for each of its layers (a KV cache, a ring of the last `window` positions, a
//! reference to an earlier layer's cache, a fixed-size recurrent state, a latent
//! cache), and [`SeqState`] holds one [`LayerState`] of that kind per layer.

use sluice_core::{Error, ExactRows, KvFormat, KvLayout, Result};
use sluice_formats::Checkpoint;
use sluice_formats::names::{TensorId, TensorKind};

use crate::backend::Backend;

/// One layer's state, as the family declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateSpec {
    /// Keys and values of every position (`window: None`) or of the last `window`
    /// positions (a ring, for sliding-window layers).
    Kv { kv_dim: usize, head_dim: usize, window: Option<usize> },
    /// Nothing of its own: the layer attends over the cache of layer `source` (KV sharing).
    SharedKv { source: usize },
    /// A fixed-size state rewritten every token (a linear-attention recurrence and its
    /// convolution's tail), `rows x cols` floats, zero at the start.
    Recurrent { rows: usize, cols: usize },
    /// One compressed vector of `width` per position (MLA's latent and RoPE key).
    Latent { width: usize },
    /// Keys and values, and beside them one indexer key of `index_dim` per position,
    /// kept on the host where the indexer chooses (Qwen4-Exp's QSA).
    IndexedKv { kv_dim: usize, head_dim: usize, index_dim: usize },
    /// Nothing kept.
    Stateless,
}

/// How one layer's coded caches code its keys: relative to a shift ([`key_shifts`])
/// and times a scale ([`key_scales`]).
#[derive(Clone, Debug, Default)]
pub struct KeyForm {
    pub shift: Option<Vec<f32>>,
    pub scale: Option<Vec<f32>>,
}

impl KeyForm {
    /// Every layer's.
    pub fn of(ckpt: &Checkpoint) -> Result<Vec<KeyForm>> {
        let scales = key_scales(ckpt)?;
        Ok(key_shifts(ckpt)?.into_iter().zip(scales).map(|(shift, scale)| KeyForm { shift, scale }).collect())
    }
}

/// Per layer, the vector its coded KV caches store keys relative to
/// ([`KvLayout::key_shift`]), or `None`: the key projection's bias where a layer has
/// one, on the rotary pairs that turn by at most [`SLOW_PAIR`] radians over the
/// model's context (there the bias, rotated by RoPE, stays close to itself; the
/// large entries of Qwen2.5's bias, up to 350, sit in those pairs). A shift only moves
/// rounding: attention adds it back, so any vector gives the same scores.
pub fn key_shifts(ckpt: &Checkpoint) -> Result<Vec<Option<Vec<f32>>>> {
    let context = ckpt.spec.max_context as f32;
    ckpt.spec
        .layers
        .iter()
        .enumerate()
        .map(|(layer, l)| {
            let a = &l.attention;
            if !a.qkv_bias || a.qk_norm || a.mla.is_some() || a.kv_source.is_some() {
                return Ok(None);
            }
            let bias = ckpt.tensor(TensorId::layer(layer, TensorKind::AttnKBias), &[a.kv_dim()])?.to_f32_vec()?;
            let hd = a.head_dim;
            let mut shift = vec![0f32; bias.len()];
            for (s, b) in shift.chunks_mut(hd).zip(bias.chunks(hd)) {
                for (p, &f) in a.rope.inv_freq.iter().enumerate() {
                    if f * context > SLOW_PAIR {
                        continue;
                    }
                    let (x, y) = a.rope.style.pair(p, hd);
                    // RoPE scales what it rotates by the attention factor (YaRN).
                    for c in [x, y] {
                        s[c] = b[c] * a.rope.attention_factor;
                    }
                }
            }
            Ok(shift.iter().any(|&v| v != 0.0).then_some(shift))
        })
        .collect()
}

/// Per layer, what its TurboQuant caches multiply keys by before coding them and
/// divide queries by ([`KvLayout::key_scale`]), or `None`: where a layer normalises
/// each head's queries and keys (`q_norm`, `k_norm`), the normalised vectors are
/// spread about evenly over a head's channels and the norms' weights set each
/// channel's size, so a channel pair's share of the scores is about `|w_q| |w_k|`.
/// The rotation spreads the codes' error evenly over the channels, so keys scaled by
/// `s = sqrt(|w_q| / |w_k|)` per rotary pair (and queries by `1 / s`) put as much of
/// it where the queries are small as where they are large: the score error's
/// variance goes from `sum w_q^2 x sum w_k^2` to `(sum |w_q w_k|)^2`, 2.1 to 3.3 times
/// less on gemma-3-270m's full-attention layers, whose key-norm weights run from 0 to
/// 30. A pair rotates as one, so both of its channels take one scale, and the scores
/// are unchanged in arithmetic.
pub fn key_scales(ckpt: &Checkpoint) -> Result<Vec<Option<Vec<f32>>>> {
    ckpt.spec
        .layers
        .iter()
        .enumerate()
        .map(|(layer, l)| {
            let a = &l.attention;
            if !a.qk_norm || a.mla.is_some() || a.kv_source.is_some() || l.linear.is_some() {
                return Ok(None);
            }
            let hd = a.head_dim;
            let offset = ckpt.spec.norm_weight_offset;
            let weight = |kind| -> Result<Vec<f32>> {
                let w = ckpt.tensor(TensorId::layer(layer, kind), &[hd])?.to_f32_vec()?;
                Ok(w.iter().map(|w| (w + offset).abs()).collect())
            };
            let (wq, wk) = (weight(TensorKind::AttnQNorm)?, weight(TensorKind::AttnKNorm)?);
            let mut scale: Vec<f32> = wq.iter().zip(&wk).map(|(q, k)| pair_scale(*q, *k)).collect();
            for p in 0..a.rope.inv_freq.len() {
                let (x, y) = a.rope.style.pair(p, hd);
                let rms = |w: &[f32]| ((w[x] * w[x] + w[y] * w[y]) / 2.0).sqrt();
                let s = pair_scale(rms(&wq), rms(&wk));
                (scale[x], scale[y]) = (s, s);
            }
            Ok(Some(scale.repeat(a.kv_dim() / hd)))
        })
        .collect()
}

/// `sqrt(q / k)`, within 1/100 and 100 (a weight of zero, which some channels of
/// gemma's norms have, would otherwise give 0 or infinity).
fn pair_scale(q: f32, k: f32) -> f32 {
    (q.max(1e-4) / k.max(1e-4)).sqrt().clamp(0.01, 100.0)
}

/// The most a rotary pair may turn over the context for [`key_shifts`] to take the
/// bias there as fixed. Below 60 degrees a rotated vector is closer to where it
/// started than to zero, so the shifted key is nearer zero than the key at every
/// position (Qwen2.5-1.5B's layer 0 keeps a bias of 70 in a pair that turns 0.54
/// radians over its 32k positions).
const SLOW_PAIR: f32 = 1.0;

/// One layer's state of one sequence.
pub enum LayerState<B: Backend> {
    Kv(B::Kv),
    SharedKv(usize),
    Recurrent(B::Act),
    /// Held in a KV cache whose keys are the latent vectors.
    Latent(B::Kv),
    /// The KV cache, and the indexer keys of every position, position-major.
    IndexedKv(B::Kv, Vec<f32>),
    Stateless,
}

/// Everything one sequence holds: its layers' state and how many positions it has seen.
pub struct SeqState<B: Backend> {
    layers: Vec<LayerState<B>>,
    len: usize,
}

impl<B: Backend> SeqState<B> {
    /// A sequence's empty state; its caches store `kv` (a sliding layer's ring at
    /// most 16 bits, see [`KvFormat::for_sliding`]), TurboQuant caches keeping `exact`
    /// positions as computed, each layer's keys coded as its [`KeyForm`] says.
    pub fn new(
        be: &B,
        specs: &[StateSpec],
        (kv, exact): (KvFormat, ExactRows),
        key_forms: &[KeyForm],
    ) -> Result<SeqState<B>> {
        let layers = specs
            .iter()
            .enumerate()
            .map(|(layer, s)| {
                let form = key_forms.get(layer);
                let shift = form.and_then(|f| f.shift.as_deref());
                let key_scale = form.and_then(|f| f.scale.as_deref());
                let cache = |kv_dim, head_dim, window: Option<usize>, key_shift| {
                    let format = if window.is_some() { kv.for_sliding() } else { kv };
                    let seed = layer as u64;
                    be.kv_new(&KvLayout { kv_dim, head_dim, window, format, seed, key_shift, key_scale, exact })
                };
                Ok(match *s {
                    StateSpec::Kv { kv_dim, head_dim, window } => {
                        LayerState::Kv(cache(kv_dim, head_dim, window, shift)?)
                    }
                    StateSpec::SharedKv { source } => LayerState::SharedKv(source),
                    StateSpec::Recurrent { rows, cols } => LayerState::Recurrent(be.zeros(rows, cols)?),
                    StateSpec::Latent { width } => LayerState::Latent(cache(width, width, None, None)?),
                    StateSpec::IndexedKv { kv_dim, head_dim, .. } => {
                        LayerState::IndexedKv(cache(kv_dim, head_dim, None, shift)?, Vec::new())
                    }
                    StateSpec::Stateless => LayerState::Stateless,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SeqState { layers, len: 0 })
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the KV and latent caches and the recurrent states.
    pub fn kv_bytes(&self, be: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kv(c) | LayerState::Latent(c) => be.kv_bytes(c),
                LayerState::IndexedKv(c, keys) => be.kv_bytes(c) + 4 * keys.len(),
                LayerState::Recurrent(s) => 4 * be.n_rows(s) * be.n_cols(s),
                _ => 0,
            })
            .sum()
    }

    /// Floats per position of an indexed layer's keys (0 before the first position).
    fn index_width(&self, keys: &[f32]) -> usize {
        keys.len() / self.len.max(1)
    }

    /// Bytes one more position adds to the caches, every layer's in its own format
    /// (a sliding layer's as long as its window is not full; recurrent states have a
    /// fixed size and add nothing; indexer keys count once a position is held).
    pub fn kv_bytes_per_position(&self, be: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kv(c) | LayerState::Latent(c) => be.kv_bytes_per_position(c),
                LayerState::IndexedKv(c, keys) => be.kv_bytes_per_position(c) + 4 * self.index_width(keys),
                _ => 0,
            })
            .sum()
    }

    /// A new state holding this one's first `keep` positions, or `None` when some layer
    /// cannot give them back: a recurrence has folded them in, a ring has gone past
    /// them. Lets a prompt that shares only a prefix with a kept sequence start after
    /// that prefix.
    pub fn prefix(&self, be: &B, keep: usize) -> Result<Option<SeqState<B>>> {
        if keep > self.len {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                LayerState::Kv(c) => match be.kv_prefix(c, keep)? {
                    Some(c) => LayerState::Kv(c),
                    None => return Ok(None),
                },
                LayerState::Latent(c) => match be.kv_prefix(c, keep)? {
                    Some(c) => LayerState::Latent(c),
                    None => return Ok(None),
                },
                LayerState::IndexedKv(c, keys) => match be.kv_prefix(c, keep)? {
                    Some(c) => LayerState::IndexedKv(c, keys[..keep * self.index_width(keys)].to_vec()),
                    None => return Ok(None),
                },
                LayerState::SharedKv(src) => LayerState::SharedKv(*src),
                LayerState::Stateless => LayerState::Stateless,
                LayerState::Recurrent(_) => return Ok(None),
            });
        }
        Ok(Some(SeqState { layers, len: keep }))
    }

    /// The KV cache layer `layer` attends over (its own, or the one it shares).
    pub fn kv(&self, layer: usize) -> Result<&B::Kv> {
        match &self.layers[layer] {
            LayerState::Kv(c) | LayerState::Latent(c) | LayerState::IndexedKv(c, _) => Ok(c),
            LayerState::SharedKv(src) => self.kv(*src),
            _ => Err(Error::Unsupported(format!("layer {layer} keeps no KV cache"))),
        }
    }

    /// Layer `layer`'s indexer keys, `[len, index_dim]`.
    pub fn index_keys(&self, layer: usize) -> Result<&[f32]> {
        match &self.layers[layer] {
            LayerState::IndexedKv(_, keys) => Ok(keys),
            _ => Err(Error::Unsupported(format!("layer {layer} keeps no indexer keys"))),
        }
    }

    pub(crate) fn index_keys_mut(&mut self, layer: usize) -> Option<&mut Vec<f32>> {
        match &mut self.layers[layer] {
            LayerState::IndexedKv(_, keys) => Some(keys),
            _ => None,
        }
    }

    /// Layer `layer`'s recurrent state (a linear-attention layer's).
    pub fn recurrent(&self, layer: usize) -> Result<&B::Act> {
        match &self.layers[layer] {
            LayerState::Recurrent(s) => Ok(s),
            _ => Err(Error::Unsupported(format!("layer {layer} keeps no recurrent state"))),
        }
    }

    pub(crate) fn set_recurrent(&mut self, layer: usize, next: B::Act) -> Result<()> {
        match &mut self.layers[layer] {
            LayerState::Recurrent(s) => {
                *s = next;
                Ok(())
            }
            _ => Err(Error::Unsupported(format!("layer {layer} keeps no recurrent state"))),
        }
    }

    /// Each layer that holds a KV cache, with it.
    pub(crate) fn kvs_mut(&mut self) -> impl Iterator<Item = (usize, &mut B::Kv)> {
        self.layers.iter_mut().enumerate().filter_map(|(layer, s)| match s {
            LayerState::Kv(c) | LayerState::Latent(c) | LayerState::IndexedKv(c, _) => Some((layer, c)),
            _ => None,
        })
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
