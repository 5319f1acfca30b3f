#![no_main]
//! Every target in one binary, the one named by `SLUICE_FUZZ_TARGET`: what
//! `scripts/fuzz_device.sh` carries to a machine with many cores (one instrumented binary
//! instead of seven of ~100 MB each).

use std::sync::LazyLock;

use sluice_fuzz::Target;

static TARGET: LazyLock<Target> = LazyLock::new(|| {
    let name = std::env::var("SLUICE_FUZZ_TARGET").unwrap_or_default();
    Target::named(&name).unwrap_or_else(|| panic!("SLUICE_FUZZ_TARGET={name:?} names no target"))
});

libfuzzer_sys::fuzz_target!(|data: &[u8]| TARGET.run(data));
