//! How often each expert of each layer was routed to: recorded by the store from
//! its fetches, saved as JSON, and read back to pin a hot set.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sluice_core::{Error, Result};

const FORMAT: &str = "sluice-routing-histogram";
const VERSION: u32 = 1;

/// `layers[l][e]` counts the fetches of layer `l` that included expert `e`
/// (an empty row for a layer without routed experts).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingHistogram {
    pub layers: Vec<Vec<u64>>,
}

#[derive(Serialize, Deserialize)]
struct File {
    format: String,
    version: u32,
    layers: Vec<Vec<u64>>,
}

impl RoutingHistogram {
    /// Writes the histogram as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let f = File { format: FORMAT.into(), version: VERSION, layers: self.layers.clone() };
        let text = serde_json::to_string(&f).map_err(|e| Error::format(path, e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
    }

    /// Reads a histogram written by [`save`](Self::save).
    pub fn load(path: &Path) -> Result<RoutingHistogram> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let f: File =
            serde_json::from_str(&text).map_err(|e| Error::format(path, format!("not a routing histogram: {e}")))?;
        if f.format != FORMAT || f.version != VERSION {
            return Err(Error::format(
                path,
                format!("a '{}' version {} file; expected '{FORMAT}' version {VERSION}", f.format, f.version),
            ));
        }
        Ok(RoutingHistogram { layers: f.layers })
    }

    /// The `n` most-routed experts of a layer that were routed at all, most first
    /// (ties to the lower id).
    pub fn top(&self, layer: usize, n: usize) -> Vec<usize> {
        let Some(row) = self.layers.get(layer) else { return Vec::new() };
        let mut ids: Vec<usize> = (0..row.len()).filter(|&e| row[e] > 0).collect();
        ids.sort_by_key(|&e| (std::cmp::Reverse(row[e]), e));
        ids.truncate(n);
        ids
    }

    /// Adds another histogram of the same model (counts from several runs).
    pub fn merge(&mut self, other: &RoutingHistogram) {
        if self.layers.len() < other.layers.len() {
            self.layers.resize(other.layers.len(), Vec::new());
        }
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            if a.len() < b.len() {
                a.resize(b.len(), 0);
            }
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
    }
}
