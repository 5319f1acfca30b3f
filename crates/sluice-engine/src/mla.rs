//! Multi-head latent attention (DeepSeek-V2/V3), computed in its absorbed form.
//!
//! The reference expands each position's cached latent `c` (kv_lora_rank wide, after
//! its norm) into every head's key `[W_UK_h c, k_pe]` and value `W_UV_h c`. Since
//! `q_nope_h · W_UK_h c = (W_UK_hᵀ q_nope_h) · c` and `Σ p W_UV_h c = W_UV_h Σ p c`, each
//! head can instead take its query into the latent space once, attend over the cached
//! `[c, k_pe]` as one KV head shared by all, and take the weighted latent back out
//! through `W_UV_h`: the cache holds `kv_lora_rank + rope_dim` floats a position
//! instead of `heads * (nope + rope + v)`, and no step expands the past.
//!
//!   q        = q_b(norm(q_a(x)))  or  q(x)           [rows, heads * (nope + rope)]
//!   c, k_pe  = kv_a(x)                                c normed, k_pe roped (one head)
//!   q_lat_h  = W_UK_hᵀ q_nope_h   (AttnKB, [kv_lora_rank, nope] per head)
//!   o_lat_h  = attention([q_lat_h, rope(q_pe_h)] over the cached [c, k_pe]), scale
//!              (nope + rope)^-1/2 (times YaRN's mscale²)
//!   out      = o(concat_h W_UV_h o_lat_h)   (AttnVB, [v, kv_lora_rank] per head)
//!
//! The cache keeps each position's `[c, k_pe]` as its key and again as its value (the
//! attention's output then carries a RoPE part, which is dropped).

use sluice_core::{AttentionSpec, MlaSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::{AttnOp, Backend, HeadCols, Norm};
use crate::blocks::{Cx, Pending, load_mat, load_vector};

/// How the queries are made.
enum Query<B: Backend> {
    Direct(B::Mat),
    /// Through a bottleneck of `q_lora_rank`, normed.
    LowRank {
        a: B::Mat,
        norm: B::Vector,
        b: B::Mat,
    },
}

pub struct Mla<B: Backend> {
    layer: usize,
    /// The attention over the latent: one KV head of `kv_lora_rank + rope_dim`.
    spec: AttentionSpec,
    dims: MlaSpec,
    q: Query<B>,
    /// `[kv_lora_rank + rope_dim, hidden]`: the latent, then the shared RoPE key.
    kv_a: B::Mat,
    kv_norm: B::Vector,
    /// Per head: `W_UK_hᵀ` `[kv_lora_rank, nope]` and `W_UV_h` `[v, kv_lora_rank]`.
    k_b: Vec<B::Mat>,
    v_b: Vec<B::Mat>,
    o: B::Mat,
}

impl<B: Backend> Mla<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize) -> Result<Self> {
        let spec = ckpt.spec.layers[layer].attention.clone();
        let dims = spec.mla.expect("an MLA layer");
        let (hidden, heads) = (ckpt.spec.hidden_size, spec.n_heads);
        let (c, qk) = (dims.kv_lora_rank, dims.nope_dim + dims.rope_dim);
        let id = |k| TensorId::layer(layer, k);
        let q = match dims.q_lora_rank {
            None => Query::Direct(load_mat(be, ckpt, id(TensorKind::AttnQ), heads * qk, hidden)?),
            Some(r) => Query::LowRank {
                a: load_mat(be, ckpt, id(TensorKind::AttnQA), r, hidden)?,
                norm: load_vector(be, ckpt, id(TensorKind::AttnQANorm), r)?,
                b: load_mat(be, ckpt, id(TensorKind::AttnQB), heads * qk, r)?,
            },
        };
        let per_head = |kind, rows, cols| -> Result<Vec<B::Mat>> {
            let t = ckpt.tensor(id(kind), &[heads, rows, cols])?;
            (0..heads).map(|h| be.mat(&t.index0(h))).collect()
        };
        Ok(Mla {
            layer,
            q,
            kv_a: load_mat(be, ckpt, id(TensorKind::AttnKvAMqa), c + dims.rope_dim, hidden)?,
            kv_norm: load_vector(be, ckpt, id(TensorKind::AttnKvANorm), c)?,
            k_b: per_head(TensorKind::AttnKB, c, dims.nope_dim)?,
            v_b: per_head(TensorKind::AttnVB, dims.v_dim, c)?,
            o: load_mat(be, ckpt, id(TensorKind::AttnOut), hidden, heads * dims.v_dim)?,
            spec,
            dims,
        })
    }

    /// `h` is the normed input `[rows, hidden]`; returns the o-projection's output.
    pub fn forward(&self, cx: &mut Cx<'_, B>, h: &B::Act) -> Result<B::Act> {
        let be = cx.be;
        let MlaSpec { kv_lora_rank: c, nope_dim: dn, rope_dim: dr, v_dim: dv, latent_eps, .. } = self.dims;
        let (heads, kd, rows) = (self.spec.n_heads, c + dr, be.n_rows(h));
        let norm = |x: &mut B::Act, w: &B::Vector, group: usize| {
            be.rms_norm(x, &Norm { group, weight: Some(w), offset: 0.0, eps: latent_eps })
        };
        let q = match &self.q {
            Query::Direct(w) => be.matmul(h, w)?,
            Query::LowRank { a, norm: w, b } => {
                let mut t = be.matmul(h, a)?;
                norm(&mut t, w, self.dims.q_lora_rank.expect("a low-rank query"))?;
                be.matmul(&t, b)?
            }
        };
        let kv = be.matmul(h, &self.kv_a)?;
        let mut latent = be.columns(&kv, 0, c)?;
        norm(&mut latent, &self.kv_norm, c)?;
        let mut k_pe = be.columns(&kv, c, dr)?;
        be.rope(&mut k_pe, dr, cx.batch, &self.spec.rope)?;

        // Each head's query in the latent space, beside its rotated RoPE part.
        let mut q_pe = be.zeros(rows, heads * dr)?;
        let all = |start, len| HeadCols { heads, start, len };
        be.copy_columns(&mut q_pe, all(0, dr), &q, all(dn, dr))?;
        be.rope(&mut q_pe, dr, cx.batch, &self.spec.rope)?;
        let mut q_lat = be.zeros(rows, heads * kd)?;
        let one = |start, len| HeadCols { heads: 1, start, len };
        for (i, w) in self.k_b.iter().enumerate() {
            let q_nope = be.columns(&q, i * (dn + dr), dn)?;
            be.copy_columns(&mut q_lat, one(i * kd, c), &be.matmul(&q_nope, w)?, one(0, c))?;
        }
        be.copy_columns(&mut q_lat, all(c, dr), &q_pe, all(0, dr))?;

        // The cached key `[c, k_pe]`, and the same vector as the value.
        let mut key = be.zeros(rows, kd)?;
        be.copy_columns(&mut key, one(0, c), &latent, one(0, c))?;
        be.copy_columns(&mut key, one(c, dr), &k_pe, one(0, dr))?;
        let value = be.copy(&key)?;
        let caches = cx.caches(self.layer)?;
        let op = AttnOp {
            spec: &self.spec,
            q: &q_lat,
            k: &key,
            v: &value,
            batch: cx.batch,
            caches: &caches,
            sinks: None,
            select: None,
        };
        let a = cx.timers.time(|t| &mut t.attention, || be.attention(&op))?;
        cx.pending[self.layer] = Some(Pending::Kv(key, value));

        // Each head's weighted latent back out through its value projection.
        let mut o = be.zeros(rows, heads * dv)?;
        for (i, w) in self.v_b.iter().enumerate() {
            let o_lat = be.columns(&a, i * kd, c)?;
            be.copy_columns(&mut o, one(i * dv, dv), &be.matmul(&o_lat, w)?, one(0, dv))?;
        }
        be.matmul(&o, &self.o)
    }
}
