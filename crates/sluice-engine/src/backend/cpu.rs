//! The CPU backend: activations in host memory, weights used where the checkpoint
//! put them (the mapped files or sluice's copy), kernels from `sluice-cpu`.

use sluice_core::{Activation, Glu, KvLayout, MatRef, Precision, Result, RopeSpec};
use sluice_cpu::delta::{DeltaRows, DeltaWeights, gated_delta_net};
use sluice_cpu::router::RouteParams;
use sluice_cpu::{AttnParams, AttnSeq, KvCache, Product};
use sluice_experts::{ExpertLease, ExpertRef, ExpertStore, FetchMode};
use sluice_formats::TensorView;

use super::{AttnOp, Backend, DeltaOp, ExpertFfn, HeadCols, Norm, RouterOp, check_head_cols};
use crate::batch::{Batch, RowPrecision, SeqRows};

/// A row-major `[rows, cols]` f32 matrix in host memory.
#[derive(Clone, Debug)]
pub struct HostAct {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostAct {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        HostAct { rows, cols, data: vec![0.0; rows * cols] }
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
    fn gather(&self, rows: impl Iterator<Item = usize>) -> HostAct {
        let mut data = Vec::new();
        rows.for_each(|r| data.extend_from_slice(self.row(r)));
        HostAct { rows: data.len() / self.cols.max(1), cols: self.cols, data }
    }
}

/// Each row's top-k experts and weights, in host memory.
#[derive(Clone, Debug, Default)]
pub struct HostRouting {
    pub top_k: usize,
    /// `[rows * top_k]` expert ids, each row's in router order.
    pub ids: Vec<u32>,
    /// `[rows * top_k]` combine weights.
    pub weights: Vec<f32>,
}

/// The CPU backend.
#[derive(Clone, Debug, Default)]
pub struct Cpu {
    precision: RowPrecision,
}

impl Cpu {
    /// `outs[i] = x · ws[i]ᵀ`. Rows of different precision go in separate calls (a
    /// row's result does not depend on the other rows of a call, so this is what
    /// each row alone would give).
    fn matmul_many_host(&self, ws: &[MatRef<'_>], x: &HostAct, precision: &RowPrecision) -> Vec<HostAct> {
        let mut outs: Vec<HostAct> = ws.iter().map(|w| HostAct::zeros(x.rows, w.rows)).collect();
        let quantized = ws.iter().any(|w| w.dtype.is_quantized());
        match precision.uniform() {
            Some(p) => Self::products(ws, x, &mut outs, p),
            None if !quantized => Self::products(ws, x, &mut outs, Precision::Fast),
            None => {
                for p in [Precision::Accurate, Precision::Fast] {
                    let rows: Vec<usize> = (0..x.rows).filter(|&r| precision.of(r) == p).collect();
                    let part = x.gather(rows.iter().copied());
                    let mut part_outs: Vec<HostAct> = ws.iter().map(|w| HostAct::zeros(rows.len(), w.rows)).collect();
                    Self::products(ws, &part, &mut part_outs, p);
                    for (out, po) in outs.iter_mut().zip(&part_outs) {
                        for (i, &r) in rows.iter().enumerate() {
                            out.data[r * out.cols..(r + 1) * out.cols].copy_from_slice(po.row(i));
                        }
                    }
                }
            }
        }
        outs
    }

    fn products(ws: &[MatRef<'_>], x: &HostAct, outs: &mut [HostAct], p: Precision) {
        if x.rows == 0 {
            return;
        }
        let mut bufs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.data.as_mut_slice()).collect();
        sluice_cpu::matmul_many(ws, &x.data, x.rows, &mut bufs, p);
    }

    fn matmul_host(&self, w: MatRef<'_>, x: &HostAct, precision: &RowPrecision) -> HostAct {
        self.matmul_many_host(&[w], x, precision).pop().expect("one output")
    }
}

/// Adds `bias[e * width..]` to every row of `x` (rows of `width`).
fn add_expert_bias(x: &mut [f32], width: usize, bias: &[f32], e: usize) {
    let b = &bias[e * width..(e + 1) * width];
    x.chunks_mut(width).for_each(|r| r.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// One expert's rows at one precision: the slots routed to it (`row * top_k + j`),
/// their inputs, and what its products give.
struct ExpertRows<'t> {
    e: usize,
    mats: ExpertRef<'t>,
    slots: Vec<usize>,
    precision: Precision,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

impl<'t> ExpertRows<'t> {
    fn new(e: usize, mats: ExpertRef<'t>, slots: Vec<usize>, precision: Precision, x: &HostAct, k: usize) -> Self {
        let n = slots.len();
        let (inter, hidden) = (mats.gate.rows, mats.down.rows);
        ExpertRows {
            e,
            mats,
            precision,
            x: x.gather(slots.iter().map(|s| s / k)).data,
            gate: vec![0.0; n * inter],
            up: vec![0.0; n * inter],
            down: vec![0.0; n * hidden],
            slots,
        }
    }
}

/// The expert FFN of every part: their gate and up products as one grouped call,
/// then their down products as another (a layer's experts on a few rows each are
/// dozens of small products; one split of the threads per phase, not per product).
fn expert_products(parts: &mut [ExpertRows<'_>], ffn: &ExpertFfn<Cpu>) {
    let mut products = Vec::with_capacity(2 * parts.len());
    for ExpertRows { mats, slots, precision, x, gate, up, .. } in parts.iter_mut() {
        let (n, precision) = (slots.len(), *precision);
        products.push(Product { w: mats.gate, x, n, out: gate, precision });
        products.push(Product { w: mats.up, x, n, out: up, precision });
    }
    sluice_cpu::matmul_grouped(&mut products);
    drop(products);
    for part in parts.iter_mut() {
        let inter = part.mats.gate.rows;
        if let Some(b) = &ffn.bias {
            add_expert_bias(&mut part.gate, inter, &b.gate, part.e);
            add_expert_bias(&mut part.up, inter, &b.up, part.e);
        }
        sluice_cpu::ops::glu_any(ffn.glu, &mut part.gate, &part.up);
    }
    let mut products: Vec<Product<'_>> = parts
        .iter_mut()
        .map(|p| Product { w: p.mats.down, x: &p.gate, n: p.slots.len(), out: &mut p.down, precision: p.precision })
        .collect();
    sluice_cpu::matmul_grouped(&mut products);
    drop(products);
    if let Some(b) = &ffn.bias {
        for part in parts.iter_mut() {
            add_expert_bias(&mut part.down, part.mats.down.rows, &b.down, part.e);
        }
    }
}

impl Backend for Cpu {
    type Act = HostAct;
    type Mat = TensorView;
    type Vector = Vec<f32>;
    type Kv = KvCache;
    type Routing = HostRouting;
    type Experts<'s> = ExpertLease<'s>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn with_precision(&self, precision: RowPrecision) -> Cpu {
        Cpu { precision }
    }

    fn mat(&self, t: &TensorView) -> Result<TensorView> {
        Ok(t.clone())
    }

    fn vector(&self, t: &TensorView) -> Result<Vec<f32>> {
        t.to_f32_vec()
    }

    fn embed(&self, table: &TensorView, tokens: &[u32], scale: f32) -> Result<HostAct> {
        let m = table.mat();
        let mut out = HostAct::zeros(tokens.len(), m.cols);
        for (i, &t) in tokens.iter().enumerate() {
            let o = &mut out.data[i * m.cols..(i + 1) * m.cols];
            sluice_cpu::row_to_f32(m.dtype, m.row(t as usize), o);
            o.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(out)
    }

    fn matmul(&self, x: &HostAct, w: &TensorView) -> Result<HostAct> {
        Ok(self.matmul_host(w.mat(), x, &self.precision))
    }

    fn matmul_many(&self, x: &HostAct, ws: &[&TensorView]) -> Result<Vec<HostAct>> {
        Ok(self.matmul_many_host(&ws.iter().map(|w| w.mat()).collect::<Vec<_>>(), x, &self.precision))
    }

    fn rms_norm(&self, x: &mut HostAct, n: &Norm<'_, Self>) -> Result<()> {
        sluice_cpu::ops::rms_norm(&mut x.data, n.group, n.weight.map(|v| v.as_slice()), n.offset, n.eps);
        Ok(())
    }

    fn add(&self, x: &mut HostAct, y: &HostAct) -> Result<()> {
        debug_assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn mul(&self, x: &mut HostAct, y: &HostAct) -> Result<()> {
        debug_assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a *= b);
        Ok(())
    }

    fn scale(&self, x: &mut HostAct, s: f32) -> Result<()> {
        x.data.iter_mut().for_each(|a| *a *= s);
        Ok(())
    }

    fn mul_row(&self, x: &mut HostAct, v: &Vec<f32>) -> Result<()> {
        for r in x.data.chunks_mut(x.cols) {
            r.iter_mut().zip(v).for_each(|(a, b)| *a *= b);
        }
        Ok(())
    }

    fn add_row(&self, x: &mut HostAct, v: &Vec<f32>) -> Result<()> {
        for r in x.data.chunks_mut(x.cols) {
            r.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn copy(&self, x: &HostAct) -> Result<HostAct> {
        Ok(x.clone())
    }

    fn gather_rows(&self, x: &HostAct, rows: &[usize]) -> Result<HostAct> {
        Ok(x.gather(rows.iter().copied()))
    }

    fn columns(&self, x: &HostAct, start: usize, len: usize) -> Result<HostAct> {
        let mut out = HostAct::zeros(x.rows, len);
        for i in 0..x.rows {
            out.data[i * len..(i + 1) * len].copy_from_slice(&x.row(i)[start..start + len]);
        }
        Ok(out)
    }

    fn copy_columns(&self, dst: &mut HostAct, to: HeadCols, src: &HostAct, from: HeadCols) -> Result<()> {
        check_head_cols((dst.rows, dst.cols), to, (src.rows, src.cols), from)?;
        let (dw, sw) = (dst.cols / to.heads, src.cols / from.heads);
        for r in 0..dst.rows {
            let (d, s) = (&mut dst.data[r * dst.cols..(r + 1) * dst.cols], &src.data[r * src.cols..(r + 1) * src.cols]);
            for h in 0..to.heads {
                let (a, b) = (h * dw + to.start, h * sw + from.start);
                d[a..a + to.len].copy_from_slice(&s[b..b + from.len]);
            }
        }
        Ok(())
    }

    fn delta_net(&self, op: &DeltaOp<'_, Self>) -> Result<(HostAct, Vec<HostAct>)> {
        let spec = op.spec;
        let (c, hv, width) = (spec.conv_dim(), spec.v_heads, spec.v_heads * spec.v_dim);
        let mut out = HostAct::zeros(op.mixed.rows, width);
        let w = DeltaWeights { conv: op.conv, a_neg: op.a_neg, dt_bias: op.dt_bias };
        let mut states = Vec::with_capacity(op.states.len());
        for (s, state) in op.batch.seqs.iter().zip(op.states) {
            let (lo, hi) = (s.first, s.first + s.rows);
            let rows = DeltaRows {
                mixed: &op.mixed.data[lo * c..hi * c],
                b: &op.b.data[lo * hv..hi * hv],
                a: &op.a.data[lo * hv..hi * hv],
            };
            let mut next = (*state).clone();
            gated_delta_net(spec, &w, &rows, &mut next.data, &mut out.data[lo * width..hi * width]);
            states.push(next);
        }
        Ok((out, states))
    }

    fn scale_rows(&self, x: &mut HostAct, s: &HostAct) -> Result<()> {
        if s.rows != x.rows || s.cols != 1 {
            return Err(sluice_core::Error::Unsupported(format!(
                "scale_rows: a {}x{} scale for {} rows",
                s.rows, s.cols, x.rows
            )));
        }
        for (row, &f) in x.data.chunks_mut(x.cols.max(1)).zip(&s.data) {
            row.iter_mut().for_each(|v| *v *= f);
        }
        Ok(())
    }

    fn activate(&self, x: &mut HostAct, act: Activation) -> Result<()> {
        sluice_cpu::ops::activate_slice(act, &mut x.data);
        Ok(())
    }

    fn glu(&self, gate: &mut HostAct, up: &HostAct, glu: Glu) -> Result<()> {
        sluice_cpu::ops::glu_any(glu, &mut gate.data, &up.data);
        Ok(())
    }

    fn softcap(&self, x: &mut HostAct, cap: f32) -> Result<()> {
        sluice_cpu::ops::softcap(&mut x.data, cap);
        Ok(())
    }

    fn rope(&self, x: &mut HostAct, head_dim: usize, batch: &Batch, rope: &RopeSpec) -> Result<()> {
        sluice_cpu::ops::rope(&mut x.data, head_dim, &batch.positions, rope);
        Ok(())
    }

    fn zeros(&self, rows: usize, cols: usize) -> Result<HostAct> {
        Ok(HostAct::zeros(rows, cols))
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<HostAct> {
        if data.len() != rows * cols {
            return Err(sluice_core::Error::Usage(format!("{} values for a {rows} x {cols} activation", data.len())));
        }
        Ok(HostAct { rows, cols, data: data.to_vec() })
    }

    fn kv_new(&self, layout: &KvLayout) -> Result<KvCache> {
        KvCache::with_layout(layout)
    }

    fn kv_bytes(&self, kv: &KvCache) -> usize {
        kv.bytes()
    }

    fn kv_bytes_per_position(&self, kv: &KvCache) -> usize {
        kv.bytes_per_position()
    }

    fn kv_prefix(&self, kv: &KvCache, keep: usize) -> Result<Option<KvCache>> {
        Ok(kv.prefix(keep))
    }

    fn kv_append(&self, kv: &mut KvCache, k: &HostAct, v: &HostAct, seq: SeqRows) -> Result<()> {
        fn rows(a: &HostAct, seq: SeqRows) -> &[f32] {
            &a.data[seq.first * a.cols..(seq.first + seq.rows) * a.cols]
        }
        kv.append(rows(k, seq), rows(v, seq));
        Ok(())
    }

    fn attention(&self, op: &AttnOp<'_, Self>) -> Result<HostAct> {
        let s = op.spec;
        let p = AttnParams {
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.head_dim,
            scale: s.scale,
            window: s.window,
            softcap: None,
            sinks: op.sinks.map(|v| v.as_slice()),
            select: op.select,
        };
        let seqs: Vec<AttnSeq<'_>> = op
            .batch
            .seqs
            .iter()
            .zip(op.caches)
            .map(|(r, &cache)| AttnSeq { first: r.first, rows: r.rows, cache })
            .collect();
        let mut out = HostAct::zeros(op.q.rows, op.q.cols);
        sluice_cpu::attention(&p, &op.q.data, &op.k.data, &op.v.data, &seqs, &mut out.data);
        Ok(out)
    }

    fn route(&self, logits: &HostAct, r: &RouterOp<Self>) -> Result<HostRouting> {
        let p = RouteParams {
            kind: r.kind,
            n_experts: r.n_experts,
            top_k: r.top_k,
            logit_bias: r.logit_bias.as_deref(),
            choice_bias: r.choice_bias.as_deref(),
            expert_scale: r.expert_scale.as_deref(),
        };
        let mut out = HostRouting { top_k: r.top_k, ..Default::default() };
        sluice_cpu::router::route(&logits.data, &p, &mut out.ids, &mut out.weights);
        Ok(out)
    }

    fn routing_ids(&self, r: &HostRouting) -> Result<Vec<u32>> {
        Ok(r.ids.clone())
    }

    fn fetch_experts<'s>(&self, store: &'s ExpertStore, layer: usize, ids: &[usize]) -> Result<ExpertLease<'s>> {
        store.fetch_with(layer, ids, FetchMode::Stream)
    }

    fn experts_ready(&self, experts: &ExpertLease<'_>) -> Result<()> {
        experts.wait_all()
    }

    fn experts_queued(&self, experts: &ExpertLease<'_>) -> bool {
        experts.has_queued()
    }

    fn experts_waited(&self, experts: &ExpertLease<'_>) -> std::time::Duration {
        experts.waited()
    }

    fn moe(
        &self,
        x: &HostAct,
        routing: &HostRouting,
        experts: &ExpertLease<'_>,
        ffn: &ExpertFfn<Self>,
    ) -> Result<HostAct> {
        let k = routing.top_k;
        // Each expert's slots (`row * top_k + j`), in one pass over the routing.
        let mut slots_of: Vec<Vec<usize>> = Vec::new();
        for (s, &e) in routing.ids.iter().enumerate() {
            let e = e as usize;
            if slots_of.len() <= e {
                slots_of.resize(e + 1, Vec::new());
            }
            slots_of[e].push(s);
        }
        let mut per_slot: Vec<Option<Vec<f32>>> = vec![None; routing.ids.len()];
        let rows = |e: usize| slots_of.get(e).map_or(0, Vec::len);
        // The experts not taken yet, in the lease's order: those in memory, then the
        // reads in the order they were started.
        let mut pending = experts.order();
        while !pending.is_empty() {
            let (ready, waiting): (Vec<usize>, Vec<usize>) = pending.iter().partition(|&&e| experts.is_ready(e));
            let take: Vec<usize> = if experts.has_queued() {
                // Misses wait for the slots of the experts taken, so one at a time: the
                // lightest in memory, whose slot comes back soonest to keep the disk
                // busy; when none is in memory, the first whose read ends.
                vec![ready.into_iter().min_by_key(|&e| rows(e)).unwrap_or(waiting[0])]
            } else if ready.is_empty() {
                vec![waiting[0]]
            } else {
                // Every expert in memory as one grouped product; the store reads the
                // others meanwhile.
                ready
            };
            pending.retain(|e| !take.contains(e));
            let taken = take.into_iter().map(|e| Ok((e, experts.take(e)?))).collect::<Result<Vec<_>>>()?;
            let mut parts = Vec::new();
            for (e, t) in &taken {
                let slots = slots_of.get(*e).map_or(&[][..], Vec::as_slice);
                // Each row at its own precision.
                for p in [Precision::Accurate, Precision::Fast] {
                    let own: Vec<usize> = slots.iter().copied().filter(|s| self.precision.of(s / k) == p).collect();
                    if !own.is_empty() {
                        parts.push(ExpertRows::new(*e, t.mats(), own, p, x, k));
                    }
                }
            }
            expert_products(&mut parts, ffn);
            for part in &parts {
                for (r, &s) in part.slots.iter().enumerate() {
                    per_slot[s] = Some(part.down[r * x.cols..(r + 1) * x.cols].to_vec());
                }
            }
        }
        // Sum each row's experts in router order, so the result does not depend on
        // which experts other rows in the batch chose.
        let mut out = HostAct::zeros(x.rows, x.cols);
        let slots = per_slot.chunks(k.max(1)).zip(routing.weights.chunks(k.max(1)));
        for (o, (ys, ws)) in out.data.chunks_mut(x.cols).zip(slots) {
            for (y, &w) in ys.iter().zip(ws) {
                let y = y.as_ref().expect("every routed expert was fetched");
                o.iter_mut().zip(y).for_each(|(a, b)| *a += w * b);
            }
        }
        Ok(out)
    }

    fn to_host(&self, x: &HostAct) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn to_host_owned(&self, x: HostAct) -> Result<Vec<f32>> {
        Ok(x.data)
    }

    fn n_rows(&self, x: &HostAct) -> usize {
        x.rows
    }

    fn n_cols(&self, x: &HostAct) -> usize {
        x.cols
    }
}
