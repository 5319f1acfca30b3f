//! Where sluice keeps what it derives once and reuses across runs (compiled GPU
//! kernels, checkpoints' experts rearranged into the layout the kernels read), and
//! the stable hash that names those files.

use std::path::PathBuf;

/// `$SLUICE_CACHE_DIR/<sub>`, else `$XDG_CACHE_HOME/sluice/<sub>`, else
/// `~/.cache/sluice/<sub>`; `None` when none of those variables is set.
pub fn cache_dir(sub: &str) -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let base = var("SLUICE_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("sluice")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/sluice")))?;
    Some(base.join(sub))
}

/// FNV-1a over the parts in order: a hash that stays the same from build to build, to
/// name cached files.
pub fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}
