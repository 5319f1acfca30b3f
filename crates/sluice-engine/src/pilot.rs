//! Next-layer router probes (`--prefetch pilot`): as a MoE layer starts, the next
//! MoE layer's router is applied to the same residual, and the experts it picks are
//! read ahead while this layer computes (from disk by the store, and into a device's
//! own tier by the backend), the ones most rows picked first (a prompt
//! chunk picks more experts than a layer's cache has slots: the read-ahead fills the
//! slots it finds, and the rest stream as that layer computes). The probes are the
//! engine's, not the families': any layer built on [`crate::moe::Moe`] gets them.

use sluice_core::Result;

use crate::backend::Backend;
use crate::blocks::Cx;
use crate::families::Network;
use crate::moe::unique;

/// Probes during one step, and the counters they add to.
pub(crate) struct Pilot<'a, B: Backend> {
    pub net: &'a dyn Network<B>,
    /// Per layer: the experts its probe predicted, until the layer routes.
    predicted: Vec<Option<Vec<usize>>>,
    pub stats: &'a mut PilotStats,
}

impl<'a, B: Backend> Pilot<'a, B> {
    pub fn new(net: &'a dyn Network<B>, n_layers: usize, stats: &'a mut PilotStats) -> Self {
        Pilot { net, predicted: vec![None; n_layers], stats }
    }
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PilotStats {
    /// Probes run (one per MoE layer per probed step).
    pub probes: u64,
    /// Experts the probes predicted, and how many experts the routers really chose.
    pub predicted: u64,
    pub chosen: u64,
    /// Chosen experts that had been predicted.
    pub recalled: u64,
}

impl PilotStats {
    /// Predicted among the chosen.
    pub fn recall(&self) -> Option<f64> {
        (self.chosen > 0).then(|| self.recalled as f64 / self.chosen as f64)
    }

    pub fn add(&mut self, o: &PilotStats) {
        self.probes += o.probes;
        self.predicted += o.predicted;
        self.chosen += o.chosen;
        self.recalled += o.recalled;
    }
}

impl<B: Backend> Cx<'_, B> {
    /// With the pilot on: routes `x` (the residual as MoE layer `layer` starts)
    /// through the next MoE layer's router. Queued before this layer's own choices are
    /// read back, so that a device computes the probe while the host waits for those.
    pub(crate) fn probe_route(&mut self, layer: usize, x: &B::Act) -> Result<Option<B::Routing>> {
        let Some(net) = self.pilot.as_ref().map(|p| p.net) else { return Ok(None) };
        let Some(next) = net.moe(layer + 1) else { return Ok(None) };
        next.route(self, x).map(Some)
    }

    /// Starts reading what the probe of [`Cx::probe_route`] picked for the layer after
    /// `layer` (`picks`, its routing's ids), most picked first (the store's read-ahead,
    /// a device's copies ahead).
    pub(crate) fn probe_read(&mut self, layer: usize, picks: Option<Vec<u32>>) -> Result<()> {
        let Some(picks) = picks else { return Ok(()) };
        let mut ids = unique(&picks);
        let count = |e: usize| picks.iter().filter(|&&p| p as usize == e).count();
        ids.sort_by_cached_key(|&e| std::cmp::Reverse(count(e)));
        sluice_experts::trace(|| format!("probe L{} n={}", layer + 1, ids.len()));
        self.store.prefetch(layer + 1, &ids);
        self.be.prefetch_experts(self.store, layer + 1, &ids)?;
        if let Some(p) = self.pilot.as_mut() {
            p.stats.probes += 1;
            p.stats.predicted += ids.len() as u64;
            p.predicted[layer + 1] = Some(ids);
        }
        Ok(())
    }

    /// Scores the probe's prediction for `layer` against the experts it chose.
    pub(crate) fn observe(&mut self, layer: usize, chosen: &[usize]) {
        if let Some(p) = self.pilot.as_mut()
            && let Some(pred) = p.predicted[layer].take()
        {
            p.stats.chosen += chosen.len() as u64;
            p.stats.recalled += chosen.iter().filter(|e| pred.contains(e)).count() as u64;
        }
    }
}
