//! For tests: where the real models that `scripts/fetch_models.sh` (and
//! `scripts/fetch_vocabs.sh`) put lie, and the rule for one that is not there: CI
//! fetches every one, so there a missing model fails the test; elsewhere the test is
//! skipped, saying how to fetch it.

use std::path::{Path, PathBuf};

/// The repository's root (where `.cache/models` is made).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$SLUICE_MODELS`, or `<repo>/.cache/models`.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("SLUICE_MODELS") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => repo_root().join(".cache/models"),
    }
}

/// `path` when it exists. Otherwise None after saying how to make it (`how`, a command)
/// — or, under CI (the `CI` variable set), a panic: there a skipped real-model test
/// would pass without testing anything.
pub fn require(path: PathBuf, how: &str) -> Option<PathBuf> {
    if path.exists() {
        return Some(path);
    }
    assert!(std::env::var_os("CI").is_none(), "{} is missing in CI ({how} makes it)", path.display());
    eprintln!("skipping: {} is missing (run {how})", path.display());
    None
}

/// A real model file fetched by `scripts/fetch_models.sh NAME`, as [`require`] says.
pub fn real_model(file: &str, name: &str) -> Option<PathBuf> {
    require(models_dir().join(file), &format!("scripts/fetch_models.sh {name}"))
}
