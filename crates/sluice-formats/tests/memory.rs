//! `Checkpoint::copy_to_memory`: every tensor but the routed experts moves onto a copy
//! in memory with the same bytes; the experts stay in their files.

use std::collections::HashMap;
use std::path::Path;

use sluice_formats::Checkpoint;

#[test]
fn all_but_the_experts_move_into_memory() {
    // Per-expert 2-D tensors, fused 3-D ones, a wrapped model, and four shards.
    for name in ["qwen3-moe", "qwen3-moe-fused", "gemma4-moe", "gemma4-dense"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name);
        let mut ckpt = Checkpoint::open(&dir).unwrap();
        let before: HashMap<String, (usize, Vec<u8>)> = ckpt
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), (t.bytes().as_ptr() as usize, t.bytes().to_vec())))
            .collect();
        let is_expert = |n: &str| n.contains(".experts.");
        let want: u64 = before.iter().filter(|(n, _)| !is_expert(n)).map(|(_, (_, b))| b.len() as u64).sum();
        let mut last = (0, 0);
        let copied = ckpt.copy_to_memory(&mut |d, t| last = (d, t)).unwrap();
        assert_eq!((copied, last), (want, (want, want)), "{name}");
        assert!(before.keys().any(|n| is_expert(n)) == name.contains("moe"), "{name}");
        for t in ckpt.tensors() {
            let (ptr, bytes) = &before[&t.name];
            assert_eq!(t.bytes(), bytes.as_slice(), "{name}: {}", t.name);
            assert_eq!(t.bytes().as_ptr() as usize == *ptr, is_expert(&t.name), "{name}: {} moved?", t.name);
            assert!(t.path().starts_with(&dir), "{name}: {} names {}", t.name, t.path().display());
        }
    }
}
