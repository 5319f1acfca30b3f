//! Qwen4-Exp.
//!
//! Qwen3.5's layers (Gated DeltaNet on most, gated attention on the rest, routed
//! experts beside a gated shared expert) on hyper-connections instead of norms: the
//! residual is `streams` copies of the hidden state, and each sublayer reads a mix of
//! them and is added back to each with its own gate:
//!
//!   xn  = norm(X)                         each stream on its own, weights per stream
//!   x   = mean_s( sigmoid(up(silu(down(xn) / streams)))_s * xn_s )
//!   X_s += 2 sigmoid(inject(xn) / streams)_s * sublayer(x)
//!
//! The model starts every stream at the token's embedding and ends with one more mix
//! (without injection) before the output; there is no other norm. Attention layers
//! attend only to the key blocks a QSA indexer picks (see [`Indexer`]); some linear
//! layers first add hashed n-gram embeddings to the streams (see [`Ngram`]). Both
//! choose on the host: the scores and hashes are small, and what they pick is what the
//! backend's attention and embedding then read.

use sluice_core::{Activation, Error, HyperSpec, IndexerSpec, ModelSpec, NgramSpec, Result, RopeSpec, SharedExperts};
use sluice_formats::{Checkpoint, HcPart, NgramPart, TensorId, TensorKind};

use super::Network;
use crate::backend::{Backend, HeadCols};
use crate::blocks::{Attention, Cx, Mlp, Pending, check_tokens, load_mat, load_output, load_vector, rope_heads};
use crate::delta_net::DeltaNet;
use crate::moe::{Moe, RouterInput};
use crate::state::StateSpec;

pub struct Qwen4Exp<B: Backend> {
    spec: ModelSpec,
    hyper: HyperSpec,
    embed: B::Mat,
    output: B::Mat,
    /// The last mix, whose output is the output projection's input.
    out_mix: HyperConnection<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Backend> Qwen4Exp<B> {
    pub fn load(be: &B, ckpt: &Checkpoint) -> Result<Self> {
        let spec = ckpt.spec.clone();
        let hyper = spec.hyper.expect("Qwen4-Exp has hyper-connections");
        // Token ids of the n-gram context live in a float state: exact below 2^24.
        if spec.vocab_size > 1 << 24 {
            return Err(Error::Unsupported(format!(
                "Qwen4-Exp with a vocabulary of {} (at most 2^24)",
                spec.vocab_size
            )));
        }
        Ok(Qwen4Exp {
            embed: load_mat(be, ckpt, TensorId::model(TensorKind::TokenEmbd), spec.vocab_size, spec.hidden_size)?,
            output: load_output(be, ckpt)?,
            out_mix: HyperConnection::load(be, ckpt, &hyper, |p| TensorId::model(TensorKind::OutHc(p)), false)?,
            layers: (0..spec.n_layers()).map(|i| Layer::load(be, ckpt, &hyper, i)).collect::<Result<_>>()?,
            hyper,
            spec,
        })
    }
}

impl<B: Backend> Network<B> for Qwen4Exp<B> {
    /// A linear layer keeps its DeltaNet state, then (with n-grams) the n-gram context
    /// and the convolution's window; an attention layer its keys and values and the
    /// indexer's keys.
    fn state(&self) -> Vec<StateSpec> {
        let c = self.hyper.streams * self.spec.hidden_size;
        self.spec
            .layers
            .iter()
            .map(|l| match (l.linear, l.attention.indexer) {
                (Some(d), _) => StateSpec::Recurrent {
                    rows: 1,
                    cols: d.state_len() + l.ngram.map_or(0, |n| ngram_state_len(&n, c)),
                },
                (None, Some(ix)) => StateSpec::IndexedKv {
                    kv_dim: l.attention.kv_dim(),
                    head_dim: l.attention.head_dim,
                    index_dim: ix.head_dim,
                },
                (None, None) => {
                    StateSpec::Kv { kv_dim: l.attention.kv_dim(), head_dim: l.attention.head_dim, window: None }
                }
            })
            .collect()
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        check_tokens(tokens, self.spec.vocab_size)
    }

    fn forward(&self, cx: &mut Cx<'_, B>, tokens: &[u32]) -> Result<B::Act> {
        let (be, h, n) = (cx.be, self.spec.hidden_size, self.hyper.streams);
        let e = cx.embed(&self.embed, tokens, 1.0)?;
        let mut x = be.zeros(tokens.len(), n * h)?;
        for s in 0..n {
            be.copy_columns(&mut x, stream(s, h), &e, stream(0, h))?;
        }
        for l in &self.layers {
            l.forward(cx, &mut x, tokens, &self.hyper, h)?;
        }
        Ok(self.out_mix.mix(cx, &x, &self.hyper, h)?.0)
    }

    fn lm_head(&self) -> &B::Mat {
        &self.output
    }

    fn moe(&self, layer: usize) -> Option<&Moe<B>> {
        Some(&self.layers.get(layer)?.experts)
    }
}

/// Columns of stream `s` (of width `h`) in a row of streams.
fn stream(s: usize, h: usize) -> HeadCols {
    HeadCols { heads: 1, start: s * h, len: h }
}

/// Each stream RMS-normed on its own, times its own weights (plus the model's offset):
/// the weight `w` spans all the streams, which a grouped norm's weight does not.
fn stream_norm<B: Backend>(cx: &Cx<'_, B>, x: &B::Act, w: &B::Vector, h: usize) -> Result<B::Act> {
    let be = cx.be;
    let mut n = be.copy(x)?;
    cx.norm_plain(&mut n, h)?;
    let mut y = be.copy(&n)?;
    be.mul_row(&mut y, w)?;
    if cx.norm_offset != 0.0 {
        be.scale(&mut n, cx.norm_offset)?;
        be.add(&mut y, &n)?;
    }
    Ok(y)
}

/// One hyper-connection: the streams' norm, the mixer's two projections, and the
/// injection gates (none on the output's).
struct HyperConnection<B: Backend> {
    norm: B::Vector,
    down: B::Mat,
    up: B::Mat,
    inject: Option<B::Mat>,
}

impl<B: Backend> HyperConnection<B> {
    fn load(be: &B, ckpt: &Checkpoint, hs: &HyperSpec, id: impl Fn(HcPart) -> TensorId, inject: bool) -> Result<Self> {
        let c = hs.streams * ckpt.spec.hidden_size;
        Ok(HyperConnection {
            norm: load_vector(be, ckpt, id(HcPart::Norm), c)?,
            down: load_mat(be, ckpt, id(HcPart::Down), hs.rank, c)?,
            up: load_mat(be, ckpt, id(HcPart::Up), c, hs.rank)?,
            inject: inject.then(|| load_mat(be, ckpt, id(HcPart::Inject), hs.streams, c)).transpose()?,
        })
    }

    /// The sublayer's input `[rows, h]` and, with injection, each stream's gate
    /// `[rows, streams]`.
    fn mix(&self, cx: &Cx<'_, B>, x: &B::Act, hs: &HyperSpec, h: usize) -> Result<(B::Act, Option<B::Act>)> {
        let be = cx.be;
        let inv = 1.0 / hs.streams as f32;
        let xn = stream_norm(cx, x, &self.norm, h)?;
        let mut a = be.matmul(&xn, &self.down)?;
        be.scale(&mut a, inv)?;
        be.activate(&mut a, Activation::Silu)?;
        let mut m = be.matmul(&a, &self.up)?;
        be.activate(&mut m, Activation::Sigmoid)?;
        be.mul(&mut m, &xn)?;
        let mut mixed = be.columns(&m, 0, h)?;
        for s in 1..hs.streams {
            be.add(&mut mixed, &be.columns(&m, s * h, h)?)?;
        }
        be.scale(&mut mixed, inv)?;
        let gates = match &self.inject {
            Some(w) => {
                let mut g = be.matmul(&xn, w)?;
                be.scale(&mut g, inv)?;
                be.activate(&mut g, Activation::Sigmoid)?;
                be.scale(&mut g, 2.0)?;
                Some(g)
            }
            None => None,
        };
        Ok((mixed, gates))
    }
}

/// `X_s += gate_s * y` for every stream `s`.
fn inject<B: Backend>(
    cx: &Cx<'_, B>,
    x: &mut B::Act,
    y: &B::Act,
    gates: &B::Act,
    streams: usize,
    h: usize,
) -> Result<()> {
    let be = cx.be;
    let mut all = be.zeros(be.n_rows(y), streams * h)?;
    for s in 0..streams {
        let mut ys = be.copy(y)?;
        be.scale_rows(&mut ys, &be.columns(gates, s, 1)?)?;
        be.copy_columns(&mut all, stream(s, h), &ys, stream(0, h))?;
    }
    be.add(x, &all)
}

enum Mixer<B: Backend> {
    Linear(DeltaNet<B>),
    Indexed(Box<(Attention<B>, Indexer<B>)>),
}

/// The shared expert and the `[1, hidden]` projection whose sigmoid scales it.
struct Shared<B: Backend> {
    mlp: Mlp<B>,
    gate: Option<B::Mat>,
}

struct Layer<B: Backend> {
    index: usize,
    ngram: Option<Ngram<B>>,
    attn_hc: HyperConnection<B>,
    mixer: Mixer<B>,
    mlp_hc: HyperConnection<B>,
    experts: Moe<B>,
    shared: Option<Shared<B>>,
}

impl<B: Backend> Layer<B> {
    fn load(be: &B, ckpt: &Checkpoint, hs: &HyperSpec, i: usize) -> Result<Self> {
        let h = ckpt.spec.hidden_size;
        let ls = &ckpt.spec.layers[i];
        let moe = ls.moe.as_ref().expect("every Qwen4-Exp layer has experts");
        let shared = match moe.shared {
            Some(SharedExperts { intermediate, gated }) => Some(Shared {
                mlp: Mlp::load_shared(be, ckpt, i, intermediate)?,
                gate: gated
                    .then(|| load_mat(be, ckpt, TensorId::layer(i, TensorKind::ShexpGateInp), 1, h))
                    .transpose()?,
            }),
            None => None,
        };
        let mixer = match (ls.linear, ls.attention.indexer) {
            (Some(_), _) => Mixer::Linear(DeltaNet::load(be, ckpt, i)?),
            (None, Some(ix)) => {
                Mixer::Indexed(Box::new((Attention::load(be, ckpt, i)?, Indexer::load(be, ckpt, i, ix)?)))
            }
            (None, None) => {
                return Err(Error::Unsupported(format!("Qwen4-Exp attention layer {i} without an indexer")));
            }
        };
        Ok(Layer {
            index: i,
            ngram: ls.ngram.map(|n| Ngram::load(be, ckpt, hs, i, n)).transpose()?,
            attn_hc: HyperConnection::load(be, ckpt, hs, |p| TensorId::layer(i, TensorKind::AttnHc(p)), true)?,
            mixer,
            mlp_hc: HyperConnection::load(be, ckpt, hs, |p| TensorId::layer(i, TensorKind::FfnHc(p)), true)?,
            // The router reads the mix as it is.
            experts: Moe::load(be, ckpt, i, RouterInput::Plain)?,
            shared,
        })
    }

    fn forward(&self, cx: &mut Cx<'_, B>, x: &mut B::Act, tokens: &[u32], hs: &HyperSpec, h: usize) -> Result<()> {
        let be = cx.be;
        let c = hs.streams * h;
        // A linear layer's state: the DeltaNet's, then the n-gram part's.
        let delta_len = self.mixer_state_len();
        let states: Vec<&B::Act> = match &self.mixer {
            Mixer::Linear(_) => cx.states.iter().map(|s| s.recurrent(self.index)).collect::<Result<_>>()?,
            Mixer::Indexed(..) => Vec::new(),
        };
        let ngram_next = match &self.ngram {
            Some(ng) => {
                let held = states
                    .iter()
                    .zip(cx.states)
                    .map(|(st, seq)| {
                        let part = be.to_host(&be.columns(st, delta_len, ngram_state_len(&ng.spec, c))?)?;
                        Ok((!seq.is_empty()).then_some(part))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(ng.forward(cx, x, tokens, &held, hs, h)?)
            }
            None => None,
        };

        let (a, gates) = self.attn_hc.mix(cx, x, hs, h)?;
        let y = match &self.mixer {
            Mixer::Linear(d) => {
                let own: Vec<B::Act> = states.iter().map(|st| be.columns(st, 0, delta_len)).collect::<Result<_>>()?;
                let own: Vec<&B::Act> = own.iter().collect();
                let (y, next) = d.forward_from(cx, &a, &own)?;
                let next = match ngram_next {
                    Some(parts) => next
                        .into_iter()
                        .zip(parts)
                        .map(|(d, p)| {
                            let mut all = be.zeros(1, delta_len + p.len())?;
                            be.copy_columns(
                                &mut all,
                                HeadCols { heads: 1, start: 0, len: delta_len },
                                &d,
                                HeadCols { heads: 1, start: 0, len: delta_len },
                            )?;
                            let p = be.upload(1, p.len(), &p)?;
                            be.copy_columns(
                                &mut all,
                                HeadCols { heads: 1, start: delta_len, len: be.n_cols(&p) },
                                &p,
                                HeadCols { heads: 1, start: 0, len: be.n_cols(&p) },
                            )?;
                            Ok(all)
                        })
                        .collect::<Result<Vec<_>>>()?,
                    None => next,
                };
                cx.pending[self.index] = Some(Pending::Recurrent(next.into_iter().map(Some).collect()));
                y
            }
            Mixer::Indexed(parts) => {
                let (att, ix) = &**parts;
                let (select, keys) = ix.select(cx, &a, self.index)?;
                let y = att.forward_selecting(cx, &a, Some(&select))?;
                match cx.pending[self.index].take() {
                    Some(Pending::Kv(k, v)) => cx.pending[self.index] = Some(Pending::IndexedKv(k, v, keys)),
                    _ => unreachable!("attention leaves its keys and values"),
                }
                y
            }
        };
        inject(cx, x, &y, &gates.expect("a layer's mix injects"), hs.streams, h)?;

        let (f, gates) = self.mlp_hc.mix(cx, x, hs, h)?;
        let mut y = self.experts.forward(cx, &f, &f)?;
        if let Some(s) = &self.shared {
            let mut z = s.mlp.forward(cx, &f)?;
            if let Some(g) = &s.gate {
                let mut g = be.matmul(&f, g)?;
                be.activate(&mut g, Activation::Sigmoid)?;
                be.scale_rows(&mut z, &g)?;
            }
            be.add(&mut y, &z)?;
        }
        inject(cx, x, &y, &gates.expect("a layer's mix injects"), hs.streams, h)
    }

    /// Floats of the DeltaNet's own state (0 on attention layers).
    fn mixer_state_len(&self) -> usize {
        match &self.mixer {
            Mixer::Linear(d) => d.spec().state_len(),
            Mixer::Indexed(..) => 0,
        }
    }
}

/// The QSA indexer: one key head and `heads` query heads of `head_dim`, from the
/// attention's input. Keys are cached raw; a query at position p scores each complete
/// block of `block` positions up to p (the keys' mean, normed, rotated to the block's
/// first position) by the sum over its heads of the ReLU of the dot products over
/// sqrt(head_dim), and attends to the best `budget / block` blocks (the lower index
/// first among equal scores) and to the open block's positions. A query with no more
/// complete blocks than that sees everything.
struct Indexer<B: Backend> {
    spec: IndexerSpec,
    qk: B::Mat,
    q_norm: B::Vector,
    /// The pooled keys' norm, on the host where they are pooled.
    k_norm: Vec<f32>,
    rope: RopeSpec,
    eps: f32,
    offset: f32,
}

impl<B: Backend> Indexer<B> {
    fn load(be: &B, ckpt: &Checkpoint, i: usize, spec: IndexerSpec) -> Result<Self> {
        let id = |k| TensorId::layer(i, k);
        let (h, d) = (ckpt.spec.hidden_size, spec.head_dim);
        Ok(Indexer {
            qk: load_mat(be, ckpt, id(TensorKind::IdxQk), (spec.heads + 1) * d, h)?,
            q_norm: load_vector(be, ckpt, id(TensorKind::IdxQNorm), d)?,
            k_norm: ckpt.tensor(id(TensorKind::IdxKNorm), &[d])?.to_f32_vec()?,
            rope: ckpt.spec.layers[i].attention.rope.clone(),
            eps: ckpt.spec.rms_norm_eps,
            offset: ckpt.spec.norm_weight_offset,
            spec,
        })
    }

    /// The positions each row attends to, and every row's raw key `[rows, head_dim]`.
    fn select(&self, cx: &Cx<'_, B>, x: &B::Act, layer: usize) -> Result<(Vec<Vec<u32>>, Vec<f32>)> {
        let be = cx.be;
        let IndexerSpec { heads, head_dim: d, budget, block } = self.spec;
        let qk = be.matmul(x, &self.qk)?;
        let mut q = be.columns(&qk, 0, heads * d)?;
        rope_heads(cx, &mut q, Some(&self.q_norm), heads, d, &self.rope)?;
        let q = be.to_host(&q)?;
        let keys = be.to_host(&be.columns(&qk, heads * d, d)?)?;
        let top = budget / block;
        let rot = (2 * self.rope.inv_freq.len()).min(d);
        let mut select = Vec::with_capacity(be.n_rows(x));
        for (seq, state) in cx.batch.seqs.iter().zip(cx.states) {
            let mut all = state.index_keys(layer)?.to_vec();
            all.extend_from_slice(&keys[seq.first * d..(seq.first + seq.rows) * d]);
            // Every block complete by the step's last position, pooled once.
            let blocks: Vec<Vec<f32>> = (0..(seq.start + seq.rows) / block)
                .map(|b| {
                    let mut k = vec![0f32; d];
                    for j in 0..block {
                        k.iter_mut().zip(&all[(b * block + j) * d..][..d]).for_each(|(a, v)| *a += v);
                    }
                    k.iter_mut().for_each(|v| *v /= block as f32);
                    sluice_cpu::ops::rms_norm(&mut k, d, Some(&self.k_norm), self.offset, self.eps);
                    sluice_cpu::ops::rope(&mut k[..rot], rot, &[b * block], &self.rope);
                    k
                })
                .collect();
            for r in 0..seq.rows {
                let p = seq.start + r;
                let complete = (p + 1) / block;
                if complete <= top {
                    select.push((0..=p as u32).collect());
                    continue;
                }
                let qr = &q[(seq.first + r) * heads * d..][..heads * d];
                let score = |k: &[f32]| -> f32 {
                    qr.chunks(d).map(|qh| qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>().max(0.0)).sum::<f32>()
                        / (d as f32).sqrt()
                };
                let mut ranked: Vec<(f32, usize)> = blocks[..complete].iter().map(|k| score(k)).zip(0..).collect();
                ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut chosen: Vec<usize> = ranked[..top].iter().map(|&(_, b)| b).collect();
                chosen.sort_unstable();
                let mut positions: Vec<u32> =
                    chosen.iter().flat_map(|&b| (b * block..(b + 1) * block).map(|j| j as u32)).collect();
                positions.extend((complete * block..=p).map(|j| j as u32));
                select.push(positions);
            }
        }
        Ok((select, keys))
    }
}

/// Floats of one sequence's n-gram state: the last `n - 1` token ids, then the
/// convolution's window `[conv_rows, c]`.
fn ngram_state_len(spec: &NgramSpec, c: usize) -> usize {
    spec.n - 1 + spec.conv_rows() * c
}

/// Hashed n-gram embeddings, added to every stream before a linear layer's mix:
///
///   e   = table[hash_h(n-gram)] for each head h, concatenated      `[rows, dim]`
///   g_s = signed_sqrt(norm_key(key(e))_s . norm_query(X)_s / sqrt(hidden))
///   v_s = sigmoid(g_s) * value(e)
///   X  += v + silu(conv(norm_conv(v)))           conv: causal, depthwise, taps n apart
///
/// An n-gram is cut at the last end of text before its token (earlier positions read
/// as that token); a sequence starts after `n - 1` of them.
struct Ngram<B: Backend> {
    spec: NgramSpec,
    multipliers: Vec<u64>,
    sizes: Vec<u64>,
    offsets: Vec<u64>,
    table: B::Mat,
    key: B::Mat,
    value: B::Mat,
    norm_key: B::Vector,
    norm_query: B::Vector,
    norm_conv: B::Vector,
    /// `[c, kernel]`, channel-major, on the host where the convolution runs.
    conv: Vec<f32>,
}

impl<B: Backend> Ngram<B> {
    fn load(be: &B, ckpt: &Checkpoint, hs: &HyperSpec, i: usize, spec: NgramSpec) -> Result<Self> {
        let id = |p| TensorId::layer(i, TensorKind::Ngram(p));
        let (h, c) = (ckpt.spec.hidden_size, hs.streams * ckpt.spec.hidden_size);
        Ok(Ngram {
            multipliers: spec.multipliers(ckpt.spec.vocab_size),
            sizes: spec.head_sizes(),
            offsets: spec.head_offsets(),
            table: load_mat(be, ckpt, id(NgramPart::Table), spec.table_rows() as usize, spec.dim / spec.heads())?,
            key: load_mat(be, ckpt, id(NgramPart::Key), c, spec.dim)?,
            value: load_mat(be, ckpt, id(NgramPart::Value), h, spec.dim)?,
            norm_key: load_vector(be, ckpt, id(NgramPart::NormKey), c)?,
            norm_query: load_vector(be, ckpt, id(NgramPart::NormQuery), c)?,
            norm_conv: load_vector(be, ckpt, id(NgramPart::NormConv), c)?,
            conv: ckpt.tensor(id(NgramPart::Conv), &[c, spec.conv_kernel])?.to_f32_vec()?,
            spec,
        })
    }

    fn rows(&self, history: &[u32]) -> Vec<Vec<u32>> {
        ngram_rows(&self.spec, &self.multipliers, &self.sizes, &self.offsets, history)
    }

    /// Adds the n-gram features to the streams `x`; `held` is each sequence's state
    /// (`None` at its start). Returns each sequence's state after the step.
    fn forward(
        &self,
        cx: &mut Cx<'_, B>,
        x: &mut B::Act,
        tokens: &[u32],
        held: &[Option<Vec<f32>>],
        hs: &HyperSpec,
        h: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let be = cx.be;
        let (n, c, heads) = (self.spec.n, hs.streams * h, self.spec.heads());
        let (conv_rows, kernel) = (self.spec.conv_rows(), self.spec.conv_kernel);
        let rows = tokens.len();

        // Each row's table rows, from each sequence's context.
        let mut ids = vec![Vec::new(); heads];
        let mut contexts = Vec::with_capacity(held.len());
        for (seq, state) in cx.batch.seqs.iter().zip(held) {
            let mut history: Vec<u32> = match state {
                Some(s) => s[..n - 1].iter().map(|&v| v as u32).collect(),
                None => vec![self.spec.eos; n - 1],
            };
            history.extend_from_slice(&tokens[seq.first..seq.first + seq.rows]);
            for row in self.rows(&history) {
                for (hh, id) in row.into_iter().enumerate() {
                    ids[hh].push(id);
                }
            }
            contexts.push(history[history.len() - (n - 1)..].to_vec());
        }
        let dh = self.spec.dim / heads;
        let mut e = be.zeros(rows, self.spec.dim)?;
        for (hh, ids) in ids.iter().enumerate() {
            let part = be.embed(&self.table, ids, 1.0)?;
            be.copy_columns(
                &mut e,
                HeadCols { heads: 1, start: hh * dh, len: dh },
                &part,
                HeadCols { heads: 1, start: 0, len: dh },
            )?;
        }
        let key = be.to_host(&stream_norm(cx, &be.matmul(&e, &self.key)?, &self.norm_key, h)?)?;
        let query = be.to_host(&stream_norm(cx, x, &self.norm_query, h)?)?;
        let value = be.to_host(&be.matmul(&e, &self.value)?)?;

        // The gated values, each stream's own gate times the shared value.
        let mut gated = vec![0f32; rows * c];
        for r in 0..rows {
            for s in 0..hs.streams {
                let at = r * c + s * h;
                let dot: f32 = key[at..at + h].iter().zip(&query[at..at + h]).map(|(a, b)| a * b).sum();
                let g = dot / (h as f32).sqrt();
                // A signed square root (zero stays zero).
                let g = if g == 0.0 { 0.0 } else { g.signum() * g.abs().max(1e-6).sqrt() };
                let gate = 1.0 / (1.0 + (-g).exp());
                gated[at..at + h].iter_mut().zip(&value[r * h..(r + 1) * h]).for_each(|(o, v)| *o = gate * v);
            }
        }
        let gated_act = be.upload(rows, c, &gated)?;
        let normed = be.to_host(&stream_norm(cx, &gated_act, &self.norm_conv, h)?)?;

        // The convolution over each sequence's window and new rows, taps n apart.
        let mut out = gated;
        let mut next = Vec::with_capacity(held.len());
        for ((seq, state), context) in cx.batch.seqs.iter().zip(held).zip(contexts) {
            let mut window = match state {
                Some(s) => s[n - 1..].to_vec(),
                None => vec![0f32; conv_rows * c],
            };
            window.extend_from_slice(&normed[seq.first * c..(seq.first + seq.rows) * c]);
            for t in 0..seq.rows {
                for ch in 0..c {
                    let acc: f32 = (0..kernel)
                        .map(|j| self.conv[ch * kernel + j] * window[(t + conv_rows - (kernel - 1 - j) * n) * c + ch])
                        .sum();
                    out[(seq.first + t) * c + ch] += acc / (1.0 + (-acc).exp());
                }
            }
            let mut state: Vec<f32> = context.iter().map(|&t| t as f32).collect();
            state.extend_from_slice(&window[window.len() - conv_rows * c..]);
            next.push(state);
        }
        be.add(x, &be.upload(rows, c, &out)?)?;
        Ok(next)
    }
}

/// The table rows of each token of `history` from index `n - 1` on, `heads()` each.
fn ngram_rows(spec: &NgramSpec, multipliers: &[u64], sizes: &[u64], offsets: &[u64], history: &[u32]) -> Vec<Vec<u32>> {
    let (n, eos) = (spec.n, spec.eos);
    (n - 1..history.len())
        .map(|p| {
            // The token `s` places back, or the end of text where one lies between.
            let mut back = vec![history[p]; n];
            for s in 1..n {
                let cut = history[p - s..p].contains(&eos);
                back[s] = if cut { eos } else { history[p - s] };
            }
            let mut ids = Vec::with_capacity(spec.heads());
            for order in 2..=n {
                let mixed = (0..order).fold(0u64, |m, s| m ^ (back[s] as u64).wrapping_mul(multipliers[s]));
                for hh in (order - 2) * spec.heads_per_n..(order - 1) * spec.heads_per_n {
                    ids.push((mixed % sizes[hh] + offsets[hh]) as u32);
                }
            }
            ids
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table rows transformers read for fixtures/tiny/qwen4-exp's two n-gram layers
    /// (an end of text at 9, and at 9 and 100 in the long text).
    #[test]
    fn ngram_rows_match_transformers() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/qwen4-exp");
        let ckpt = Checkpoint::open(&dir).unwrap();
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let list = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        for (tokens, want) in [("tokens", "ngram_ids"), ("long_tokens", "long_ngram_ids")] {
            for (l, layer) in ckpt.spec.layers.iter().enumerate() {
                let Some(ng) = layer.ngram else { continue };
                let (sizes, offsets) = (ng.head_sizes(), ng.head_offsets());
                let mut history = vec![ng.eos; ng.n - 1];
                history.extend(list(&r[tokens]));
                let got = ngram_rows(&ng, &ng.multipliers(ckpt.spec.vocab_size), &sizes, &offsets, &history);
                let want: Vec<Vec<u32>> = r[want][l.to_string()].as_array().unwrap().iter().map(list).collect();
                assert_eq!(got, want, "layer {l}, {tokens}");
            }
        }
    }
}
