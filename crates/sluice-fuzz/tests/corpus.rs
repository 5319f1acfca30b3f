//! Every fuzz target over its seeds (`fuzz/seeds/<target>`, from
//! scripts/make_fuzz_seeds.py) and over the inputs that once crashed, hung or
//! over-allocated in it (`fuzz/regressions/<target>`, each fixed since): none may panic.
//! This is what CI runs of the fuzzers; the fuzzing itself is `fuzz/README.md`'s.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use sluice_fuzz::Target;

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

/// Panics on any thread, caught or not: the server turns a panic in a step into a 500,
/// libFuzzer's hook aborts on every one, and so does this test.
static PANICS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn every_target_over_its_seeds_and_regressions() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for target in Target::ALL {
        let seeds = inputs(&fuzz.join("seeds").join(target.name()));
        assert!(!seeds.is_empty(), "no seeds for the {} target in {}", target.name(), fuzz.display());
        let regressions = inputs(&fuzz.join("regressions").join(target.name()));
        for file in seeds.iter().chain(&regressions) {
            let data = std::fs::read(file).unwrap();
            eprintln!("{}: {}", target.name(), file.display());
            target.run(&data);
            assert_eq!(PANICS.load(Ordering::SeqCst), 0, "{}: a panic (above)", file.display());
        }
    }
}
