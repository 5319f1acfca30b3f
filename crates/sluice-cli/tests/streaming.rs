//! Streamed residency under faults: a cache below one token's top-k is refused with
//! the minimum, and a file truncated while the model runs ends that request with an
//! error naming the file and the expert, after which the same process carries on.

use std::path::{Path, PathBuf};
use std::process::Command;

use sluice_engine::{Cpu, LoadOptions, Logits, Model};
use sluice_experts::{CacheBudget, Residency, StoreConfig};
use sluice_formats::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

fn sluice(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().expect("sluice runs")
}

#[test]
fn cache_below_top_k_is_refused_with_the_minimum() {
    let m = fixture("qwen3-moe");
    let out = std::env::temp_dir().join("sluice-never.f32");
    for cache in ["1", "1KiB"] {
        let o = sluice(&[
            "logits",
            "--model",
            m.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--out",
            out.to_str().unwrap(),
            "--residency",
            "streamed",
            "--expert-cache",
            cache,
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{cache}: {err}");
        assert!(err.contains("at least") && err.contains("slots"), "{cache}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn truncated_expert_file_fails_the_request_not_the_process() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("streaming-fault");
    let _ = std::fs::remove_dir_all(&dir);
    let o = sluice(&["pack", "--model", fixture("qwen3-moe").to_str().unwrap(), "--out", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let experts = dir.join("experts.bin");
    let intact = std::fs::read(&experts).unwrap();

    let ckpt = Checkpoint::open(&dir).unwrap();
    let top_k = ckpt.spec.layers.iter().find_map(|l| l.moe.as_ref()).unwrap().top_k;
    let store = StoreConfig {
        residency: Residency::Streamed,
        budget: Some(CacheBudget::SlotsPerLayer(top_k)),
        ..Default::default()
    };
    let model = Model::load_with(Cpu::default(), &ckpt, &LoadOptions { store, ..Default::default() }, None).unwrap();
    let tokens: Vec<u32> = (1..40).collect();
    let want = model.session().unwrap().forward(&tokens, Logits::All).unwrap();

    // Cut the file in half under the running model: the next misses read past its end.
    std::fs::OpenOptions::new().write(true).open(&experts).unwrap().set_len(intact.len() as u64 / 2).unwrap();
    let mut s = model.session().unwrap();
    let err = tokens.iter().map(|&t| s.forward(&[t], Logits::Last)).find_map(|r| r.err()).expect("a read must fail");
    let msg = err.to_string();
    assert!(msg.contains("experts.bin") && msg.contains("expert"), "{msg}");

    // Put the bytes back: the same model and store serve the next request.
    std::fs::write(&experts, &intact).unwrap();
    let again = model.session().unwrap().forward(&tokens, Logits::All).unwrap();
    assert!(again == want, "logits after recovery differ");
}
