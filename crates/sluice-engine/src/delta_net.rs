//! Gated DeltaNet (Qwen3.5's linear attention) as a block: its projections, the
//! backend's convolution and recurrence (`Backend::delta_net`), the gated norm and the
//! output projection.
//!
//!   mixed = qkv(h); z = z(h); b = b(h); a = a(h)
//!   o     = delta_net(mixed, b, a)        per value head, from each sequence's state
//!   out   = o_proj(norm(o) * silu(z))     the norm per value head, with a plain weight
//!                                         (the gate's activation is the spec's)

use sluice_core::{DeltaNetSpec, Result};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

use crate::backend::{Backend, DeltaOp, Norm};
use crate::blocks::{Cx, Pending, load_mat, load_vector};

pub struct DeltaNet<B: Backend> {
    layer: usize,
    spec: DeltaNetSpec,
    qkv: B::Mat,
    z: B::Mat,
    b: B::Mat,
    a: B::Mat,
    /// `[conv_dim, kernel]`, flat.
    conv: B::Vector,
    a_neg: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    out: B::Mat,
}

impl<B: Backend> DeltaNet<B> {
    pub fn load(be: &B, ckpt: &Checkpoint, layer: usize) -> Result<Self> {
        let spec = ckpt.spec.layers[layer].linear.expect("a Gated DeltaNet layer");
        let hidden = ckpt.spec.hidden_size;
        let (c, hv, vd) = (spec.conv_dim(), spec.v_heads, spec.v_heads * spec.v_dim);
        let id = |k| TensorId::layer(layer, k);
        let mat = |k, rows, cols| load_mat(be, ckpt, id(k), rows, cols);
        Ok(DeltaNet {
            layer,
            qkv: mat(TensorKind::SsmQkv, c, hidden)?,
            z: mat(TensorKind::SsmZ, vd, hidden)?,
            b: mat(TensorKind::SsmBeta, hv, hidden)?,
            a: mat(TensorKind::SsmAlpha, hv, hidden)?,
            conv: be.vector(&ckpt.tensor(id(TensorKind::SsmConv), &[c, spec.conv_kernel])?)?,
            a_neg: load_vector(be, ckpt, id(TensorKind::SsmA), hv)?,
            dt_bias: load_vector(be, ckpt, id(TensorKind::SsmDtBias), hv)?,
            norm: load_vector(be, ckpt, id(TensorKind::SsmNorm), spec.v_dim)?,
            out: mat(TensorKind::SsmOut, hidden, vd)?,
            spec,
        })
    }

    pub fn spec(&self) -> &DeltaNetSpec {
        &self.spec
    }

    /// `h` is the normed input `[rows, hidden]`; returns the output projection's. Each
    /// sequence's state is the layer's recurrent state.
    pub fn forward(&self, cx: &mut Cx<'_, B>, h: &B::Act) -> Result<B::Act> {
        let states = cx.states.iter().map(|s| s.recurrent(self.layer)).collect::<Result<Vec<_>>>()?;
        let (out, next) = self.forward_from(cx, h, &states)?;
        cx.pending[self.layer] = Some(Pending::Recurrent(next.into_iter().map(Some).collect()));
        Ok(out)
    }

    /// The output for `h` from each sequence's `states` (in batch order, `[1,
    /// spec.state_len()]` each), and each one's state after the step.
    pub fn forward_from(&self, cx: &mut Cx<'_, B>, h: &B::Act, states: &[&B::Act]) -> Result<(B::Act, Vec<B::Act>)> {
        let be = cx.be;
        let mut p = be.matmul_many(h, &[&self.qkv, &self.z, &self.b, &self.a])?.into_iter();
        let (mixed, mut z, b, a) =
            (p.next().expect("qkv"), p.next().expect("z"), p.next().expect("b"), p.next().expect("a"));
        let op = DeltaOp {
            spec: &self.spec,
            mixed: &mixed,
            b: &b,
            a: &a,
            conv: &self.conv,
            a_neg: &self.a_neg,
            dt_bias: &self.dt_bias,
            batch: cx.batch,
            states,
        };
        let (mut o, next) = cx.timers.time(|t| &mut t.attention, || be.delta_net(&op))?;
        // The gated norm's weight is plain (no 1 + w), whatever the model's other norms do.
        be.rms_norm(&mut o, &Norm { group: self.spec.v_dim, weight: Some(&self.norm), offset: 0.0, eps: cx.eps })?;
        be.activate(&mut z, self.spec.gate)?;
        be.mul(&mut o, &z)?;
        Ok((be.matmul(&o, &self.out)?, next))
    }
}
