//! What a forward pass carries through the layers ([`Cx`]), and the blocks the
//! families share: attention and the gated MLP. Each is written once against
//! [`Backend`]; the routed experts are in `moe.rs`.

use sluice_core::{Activation, AttentionSpec, Error, Glu, Result, RopeSpec};
use sluice_experts::ExpertStore;
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::{AttnOp, Backend, HeadCols, Norm};
use crate::batch::Batch;
use crate::pilot::Pilot;
use crate::state::SeqState;
use crate::stats::Timers;

/// One forward pass over a batch of rows: the backend at this step's precisions,
/// the batch, each sequence's state as it was before the step, and what the step
/// collects on the way.
pub struct Cx<'a, B: Backend> {
    pub be: &'a B,
    pub batch: &'a Batch,
    /// Each sequence's state, in batch order.
    pub(crate) states: &'a [&'a SeqState<B>],
    /// What each layer's state takes from this step, applied to each sequence once
    /// every layer has run (and nothing has failed).
    pub(crate) pending: Vec<Option<Pending<B>>>,
    pub(crate) store: &'a ExpertStore,
    pub(crate) timers: &'a mut Timers,
    pub(crate) pilot: Option<Pilot<'a, B>>,
    pub(crate) eps: f32,
    pub(crate) norm_offset: f32,
    /// Set when an expert read failed: the sequences (batch indices) it stops.
    pub(crate) affected: Option<Vec<usize>>,
}

/// A layer's contribution to the sequences' state from one step.
pub enum Pending<B: Backend> {
    /// Keys and values of every row, appended to each sequence's cache.
    Kv(B::Act, B::Act),
    /// Each sequence's new recurrent state, in batch order (taken as it is applied).
    Recurrent(Vec<Option<B::Act>>),
    /// Keys and values as `Kv`, and every row's indexer key (`[rows, index_dim]`, host).
    IndexedKv(B::Act, B::Act, Vec<f32>),
}

impl<'a, B: Backend> Cx<'a, B> {
    /// The RMS norm over groups of `width` (whole rows, or heads) with weight `w`.
    fn weighted<'w>(&self, w: &'w B::Vector, width: usize) -> Norm<'w, B> {
        Norm { group: width, weight: Some(w), offset: self.norm_offset, eps: self.eps }
    }

    /// RMS norm over groups of `width` (whole rows, or heads), with a weight.
    pub fn norm(&self, x: &mut B::Act, w: &B::Vector, width: usize) -> Result<()> {
        self.be.rms_norm(x, &self.weighted(w, width))
    }

    /// The RMS norm over groups of `width` without a weight.
    pub(crate) fn plain(&self, width: usize) -> Norm<'static, B> {
        Norm { group: width, weight: None, offset: 0.0, eps: self.eps }
    }

    /// RMS norm over groups of `width` without a weight.
    pub fn norm_plain(&self, x: &mut B::Act, width: usize) -> Result<()> {
        self.be.rms_norm(x, &self.plain(width))
    }

    /// `norm(x)` as a new activation, `x` left as it is (a pre-norm block's input).
    pub fn normed(&self, x: &B::Act, w: &B::Vector, width: usize) -> Result<B::Act> {
        self.be.normed(x, &self.weighted(w, width))
    }

    /// `x += y`, then `norm(x)` as a new activation (the residual after a block, and
    /// the next block's input).
    pub fn add_normed(&self, x: &mut B::Act, y: &B::Act, w: &B::Vector, width: usize) -> Result<B::Act> {
        self.be.add_normed(x, y, &self.weighted(w, width))
    }

    /// [`Cx::add_normed`] with the previous layer's output where there is one (a
    /// [`Stack`](crate::families::Stack) layer's first norm), else [`Cx::normed`].
    pub fn then_normed(&self, x: &mut B::Act, before: Option<B::Act>, w: &B::Vector, width: usize) -> Result<B::Act> {
        match before {
            Some(y) => self.add_normed(x, &y, w, width),
            None => self.normed(x, w, width),
        }
    }

    /// The rows of the token embedding table for this step's tokens, times `scale`.
    pub fn embed(&mut self, table: &B::Mat, tokens: &[u32], scale: f32) -> Result<B::Act> {
        let be = self.be;
        self.timers.time(|t| &mut t.embed, || be.embed(table, tokens, scale))
    }

    /// Each sequence's KV cache of layer `layer`, in batch order.
    pub(crate) fn caches(&self, layer: usize) -> Result<Vec<&'a B::Kv>> {
        let states: &'a [&'a SeqState<B>] = self.states;
        states.iter().map(|s| s.kv(layer)).collect()
    }
}

/// Loads a norm weight `[n]`.
pub fn load_vector<B: Backend>(be: &B, ckpt: &Checkpoint, id: TensorId, n: usize) -> Result<B::Vector> {
    be.vector(&ckpt.tensor(id, &[n])?)
}

/// Loads a matrix `[rows, cols]`.
pub fn load_mat<B: Backend>(be: &B, ckpt: &Checkpoint, id: TensorId, rows: usize, cols: usize) -> Result<B::Mat> {
    be.mat(&ckpt.tensor(id, &[rows, cols])?)
}

/// The output projection: the tied embedding table, or `lm_head`.
pub fn load_output<B: Backend>(be: &B, ckpt: &Checkpoint) -> Result<B::Mat> {
    let spec = &ckpt.spec;
    let kind = if spec.tie_word_embeddings { TensorKind::TokenEmbd } else { TensorKind::Output };
    load_mat(be, ckpt, TensorId::model(kind), spec.vocab_size, spec.hidden_size)
}

pub struct Attention<B: Backend> {
    layer: usize,
    spec: AttentionSpec,
    q: B::Mat,
    /// `None` on layers that read another layer's cache.
    k: Option<B::Mat>,
    /// `None` on those and on k_eq_v layers.
    v: Option<B::Mat>,
    o: B::Mat,
    biases: Option<[B::Vector; 3]>,
    o_bias: Option<B::Vector>,
    sinks: Option<B::Vector>,
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
}

impl<B: Backend> Attention<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize) -> Result<Self> {
        let spec = &ckpt.spec.layers[layer].attention;
        let hidden = ckpt.spec.hidden_size;
        let id = |k| TensorId::layer(layer, k);
        let (qd, kvd, hd) = (spec.q_dim(), spec.kv_dim(), spec.head_dim);
        let own_kv = spec.kv_source.is_none();
        let biases = if spec.qkv_bias {
            Some([
                load_vector(be, ckpt, id(TensorKind::AttnQBias), qd)?,
                load_vector(be, ckpt, id(TensorKind::AttnKBias), kvd)?,
                load_vector(be, ckpt, id(TensorKind::AttnVBias), kvd)?,
            ])
        } else {
            None
        };
        Ok(Attention {
            layer,
            spec: spec.clone(),
            // With an output gate, each head's query rows are followed by its gate's.
            q: load_mat(be, ckpt, id(TensorKind::AttnQ), if spec.output_gate { 2 * qd } else { qd }, hidden)?,
            k: own_kv.then(|| load_mat(be, ckpt, id(TensorKind::AttnK), kvd, hidden)).transpose()?,
            v: (own_kv && !spec.k_eq_v).then(|| load_mat(be, ckpt, id(TensorKind::AttnV), kvd, hidden)).transpose()?,
            o: load_mat(be, ckpt, id(TensorKind::AttnOut), hidden, qd)?,
            biases,
            o_bias: spec.o_bias.then(|| load_vector(be, ckpt, id(TensorKind::AttnOutBias), hidden)).transpose()?,
            sinks: spec.sinks.then(|| load_vector(be, ckpt, id(TensorKind::AttnSinks), spec.n_heads)).transpose()?,
            q_norm: spec.qk_norm.then(|| load_vector(be, ckpt, id(TensorKind::AttnQNorm), hd)).transpose()?,
            k_norm: (spec.qk_norm && own_kv)
                .then(|| load_vector(be, ckpt, id(TensorKind::AttnKNorm), hd))
                .transpose()?,
        })
    }

    /// `h` is the normed input `[rows, hidden]`; returns the o-projection's output.
    pub fn forward(&self, cx: &mut Cx<'_, B>, h: &B::Act) -> Result<B::Act> {
        self.forward_selecting(cx, h, None)
    }

    /// [`Attention::forward`], each row attending only to the positions `select` lists
    /// for it (Qwen4-Exp's QSA), when given.
    pub fn forward_selecting(&self, cx: &mut Cx<'_, B>, h: &B::Act, select: Option<&[Vec<u32>]>) -> Result<B::Act> {
        let s = &self.spec;
        let hd = s.head_dim;
        let src = s.kv_source.unwrap_or(self.layer);
        let be = cx.be;
        // The projections of `h` in one job: q, and k and v where this layer has them.
        let ws: Vec<&B::Mat> =
            [Some(&self.q), self.k.as_ref(), self.k.as_ref().and(self.v.as_ref())].into_iter().flatten().collect();
        let mut proj = be.matmul_many(h, &ws)?.into_iter();
        let mut q = proj.next().expect("q");
        // Split each head's [query, gate] rows apart.
        let gate = match s.output_gate {
            true => {
                let rows = be.n_rows(&q);
                let (mut query, mut gate) = (be.zeros(rows, s.q_dim())?, be.zeros(rows, s.q_dim())?);
                let part = |start| HeadCols { heads: s.n_heads, start, len: hd };
                be.copy_columns(&mut query, part(0), &q, part(0))?;
                be.copy_columns(&mut gate, part(0), &q, part(hd))?;
                q = query;
                Some(gate)
            }
            false => None,
        };
        if let Some(b) = &self.biases {
            be.add_row(&mut q, &b[0])?;
        }
        if self.k.is_none() {
            rope_heads(cx, &mut q, self.q_norm.as_ref(), s.n_heads, hd, &s.rope)?;
        } else {
            let mut k = proj.next().expect("k");
            if let Some(b) = &self.biases {
                be.add_row(&mut k, &b[1])?;
            }
            // k_eq_v: V is the k projection before k norm and RoPE.
            let mut v = match proj.next() {
                Some(mut v) => {
                    if let Some(b) = &self.biases {
                        be.add_row(&mut v, &b[2])?;
                    }
                    v
                }
                None => be.copy(&k)?,
            };
            if s.v_norm {
                cx.norm_plain(&mut v, hd)?;
            }
            match (&self.q_norm, &self.k_norm) {
                // Both normed and rotated whole: one operation (one launch on a GPU).
                (Some(qn), Some(kn)) if 2 * s.rope.inv_freq.len() >= hd => {
                    let (qn, kn) = (cx.weighted(qn, hd), cx.weighted(kn, hd));
                    be.norm_rope_qk(&mut q, &qn, &mut k, &kn, cx.batch, &s.rope)?;
                }
                _ => {
                    rope_heads(cx, &mut q, self.q_norm.as_ref(), s.n_heads, hd, &s.rope)?;
                    rope_heads(cx, &mut k, self.k_norm.as_ref(), s.n_kv_heads, hd, &s.rope)?;
                }
            }
            cx.pending[self.layer] = Some(Pending::Kv(k, v));
        }
        let (Some(Pending::Kv(k, v)) | Some(Pending::IndexedKv(k, v, _))) = cx.pending[src].as_ref() else {
            return Err(Error::Unsupported(format!(
                "layer {} reads the KV of layer {src}, which has none",
                self.layer
            )));
        };
        let caches = cx.caches(src)?;
        let op = AttnOp { spec: s, q: &q, k, v, batch: cx.batch, caches: &caches, sinks: self.sinks.as_ref(), select };
        let mut a = cx.timers.time(|t| &mut t.attention, || be.attention(&op))?;
        if let Some(mut g) = gate {
            be.activate(&mut g, Activation::Sigmoid)?;
            be.mul(&mut a, &g)?;
        }
        let mut o = be.matmul(&a, &self.o)?;
        if let Some(b) = &self.o_bias {
            be.add_row(&mut o, b)?;
        }
        Ok(o)
    }
}

/// Each of `heads` heads of `x` RMS-normed with `norm` where given, then RoPE: on
/// the whole head, or where `rope` covers fewer dims (`2 * inv_freq.len()`, Qwen3.5's
/// partial rotary) on those first dims alone, as their own heads (NeoX halves of the
/// rotated dims).
pub(crate) fn rope_heads<B: Backend>(
    cx: &Cx<'_, B>,
    x: &mut B::Act,
    norm: Option<&B::Vector>,
    heads: usize,
    hd: usize,
    rope: &RopeSpec,
) -> Result<()> {
    let (be, rot) = (cx.be, 2 * rope.inv_freq.len());
    if rot >= hd {
        return match norm {
            Some(w) => be.norm_rope(x, &cx.weighted(w, hd), cx.batch, rope),
            None => be.rope(x, hd, cx.batch, rope),
        };
    }
    if let Some(w) = norm {
        cx.norm(x, w, hd)?;
    }
    let mut r = be.zeros(be.n_rows(x), heads * rot)?;
    let first = HeadCols { heads, start: 0, len: rot };
    be.copy_columns(&mut r, first, x, first)?;
    be.rope(&mut r, rot, cx.batch, rope)?;
    be.copy_columns(x, first, &r, first)
}

/// `down(glu(gate(h), up(h)))`.
pub struct Mlp<B: Backend> {
    gate: B::Mat,
    up: B::Mat,
    down: B::Mat,
    glu: Glu,
}

impl<B: Backend> Mlp<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize, inter: usize) -> Result<Self> {
        Self::load_parts(be, ckpt, layer, inter, [TensorKind::FfnGate, TensorKind::FfnUp, TensorKind::FfnDown])
    }

    /// The shared experts of a MoE layer, as one MLP.
    pub fn load_shared(be: &B, ckpt: &Checkpoint, layer: usize, inter: usize) -> Result<Self> {
        Self::load_parts(be, ckpt, layer, inter, [TensorKind::ShexpGate, TensorKind::ShexpUp, TensorKind::ShexpDown])
    }

    fn load_parts(be: &B, ckpt: &Checkpoint, layer: usize, inter: usize, kinds: [TensorKind; 3]) -> Result<Self> {
        let id = |k| TensorId::layer(layer, k);
        let hidden = ckpt.spec.hidden_size;
        Ok(Mlp {
            gate: load_mat(be, ckpt, id(kinds[0]), inter, hidden)?,
            up: load_mat(be, ckpt, id(kinds[1]), inter, hidden)?,
            down: load_mat(be, ckpt, id(kinds[2]), hidden, inter)?,
            glu: Glu::Gated(ckpt.spec.activation),
        })
    }

    pub fn forward(&self, cx: &mut Cx<'_, B>, h: &B::Act) -> Result<B::Act> {
        let be = cx.be;
        cx.timers.time(
            |t| &mut t.mlp,
            || {
                let mut gu = be.matmul_many(h, &[&self.gate, &self.up])?.into_iter();
                let (mut g, u) = (gu.next().expect("gate"), gu.next().expect("up"));
                be.glu(&mut g, &u, self.glu)?;
                be.matmul(&g, &self.down)
            },
        )
    }
}

/// Checks token ids against a vocabulary before any lookup.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&t) => Err(Error::TokenOutOfRange { id: t as u64, vocab_size: vocab }),
        None => Ok(()),
    }
}
